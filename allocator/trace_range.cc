#include "allocator/trace_range.h"

#include <cstdio>

#if STATEPAGER_WITH_CUDA && __has_include(<nvtx3/nvToolsExt.h>)
#define STATEPAGER_NVTX 1
#include <nvtx3/nvToolsExt.h>
#endif

namespace statepager {

std::string io_range_name(bool out, bool discard, uint64_t bytes) {
  if (discard) return "discard";
  const double mib = static_cast<double>(bytes) / double(1 << 20);
  char text[48];
  std::snprintf(text, sizeof text, "%s %.1f MiB", out ? "page-out" : "page-in", mib);
  return text;
}

#if STATEPAGER_NVTX
namespace {
nvtxDomainHandle_t domain() {
  static const nvtxDomainHandle_t d = nvtxDomainCreateA("statepager");
  return d;
}
}  // namespace

void TraceRange::start(const std::string& name, TraceKind kind) {
  end();
  nvtxEventAttributes_t attr{};
  attr.version = NVTX_VERSION;
  attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  attr.colorType = NVTX_COLOR_ARGB;
  attr.color = static_cast<uint32_t>(kind);
  attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
  attr.message.ascii = name.c_str();
  id_ = nvtxDomainRangeStartEx(domain(), &attr);
  open_ = true;
}

void TraceRange::end() {
  if (!open_) return;
  nvtxDomainRangeEnd(domain(), id_);
  open_ = false;
}

bool TraceRange::compiled_in() { return true; }
#else
void TraceRange::start(const std::string&, TraceKind) { open_ = true; }
void TraceRange::end() { open_ = false; }
bool TraceRange::compiled_in() { return false; }
#endif

}  // namespace statepager
