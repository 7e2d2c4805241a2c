// TraceRange: a named time range on the timeline of NVIDIA's profilers (NVTX, in the
// "statepager" domain; Nsight Systems shows it beside the CUDA work), e.g. one bucket's
// page-in from its first I/O to its completion.
//
// NVTX is header-only (nvtx3 in the CUDA toolkit): without a profiler attached each call
// is a no-op behind one function pointer; in a build without CUDA headers it compiles to
// nothing. A range may end on another thread than the one that started it (start/end
// ranges, not push/pop).
// Ownership: a TraceRange owns its open range and ends it when destroyed.
// Thread-safety: one TraceRange is used by one thread at a time.
#pragma once

#include <cstdint>
#include <string>

namespace statepager {

// Colours of the ranges statepager draws (ARGB): page-ins, steps, page-outs.
enum class TraceKind : uint32_t { kRead = 0xFF2E86DE, kStep = 0xFF27AE60, kWrite = 0xFFE67E22 };

class TraceRange {
 public:
  TraceRange() = default;
  ~TraceRange() { end(); }
  TraceRange(const TraceRange&) = delete;
  TraceRange& operator=(const TraceRange&) = delete;

  void start(const std::string& name, TraceKind kind);  // ends an open range first
  void end();                                            // no-op when none is open

  // Whether ranges reach a profiler in this build (the CUDA toolkit's NVTX headers).
  static bool compiled_in();

 private:
  uint64_t id_ = 0;
  bool open_ = false;
};

// "page-in 12 MiB", "page-out 12 MiB" or "discard": a bucket's range name.
std::string io_range_name(bool out, bool discard, uint64_t bytes);

}  // namespace statepager
