// Job: one bucket of a Pager — its plan (which bytes go where) and its progress.
//
// The Pager plans a job under its lock, queues it, and settles its extents once done; the
// tiers that move its bytes (allocator/store_tier.h, allocator/host_tier.h) work through
// its chunks and copies on the Pager's I/O thread.
//
// Fields: set by the Pager under its lock and fixed once queued: kind .. host_bytes (maps:
// read by the map thread without the lock while the job waits for it), except what
// phase two (Pager::place_deferred_locked, on the I/O thread under the lock, with none of
// the job's work in flight) adds. The I/O thread's alone: part_crcs, part_known (sized by
// plan), host_copies_issued .. fence, requests, mapped_bytes, error and the times (error
// and the times are read by others once the phase is kDone). phase: changed under the
// Pager's lock, while the job is queued by the I/O thread alone (which so reads it without).
// done(): readable from any thread without the lock (set_done() publishes error and the
// times with it), so that polling a bucket never waits for the I/O thread's lock.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "allocator/device.h"
#include "allocator/pool.h"
#include "allocator/trace_range.h"

namespace statepager {

using ExtentId = uint64_t;

// kHost: at rest in the host tier (allocator/host_tier.h).
enum class Residency { kZero, kFile, kResident, kPagingIn, kPagingOut, kHost };

// One copy between device memory and a buffer inside a chunk (its staging slot).
struct StagingCopy {
  size_t buf_offset;  // in the chunk's buffer
  uintptr_t addr;     // device address
  size_t bytes;
};

// One I/O request: a contiguous, aligned range of the store files.
struct Chunk {
  uint64_t store_offset = 0;
  size_t file_bytes = 0;
  std::vector<StagingCopy> pieces;
  char* buf = nullptr;  // host-tier memory read or written directly (no pieces, no staging)
  // Its parts of the job's store checksums (Job::crc_ranges): pieces[i] is part
  // first_part + i; a chunk with buf is part first_part alone.
  size_t first_part = 0;
};

// The crc32c of one store range a job reads or writes (see Note [Store checksums]): the
// combination of its parts, Job::part_crcs[first, first + parts), in store order.
struct RangeCrc {
  uint64_t store_offset;
  size_t first;
  size_t parts;
};

// What a bucket does: Pager's page_in(), page_out(), release_unchanged(), discard() or
// read_ahead().
enum class JobKind {
  kPageIn,
  kPageInForRead,     // keeping where the bytes lie at rest (page_in's for_read)
  kPageOut,
  kReleaseUnchanged,  // a page-out of extents the caller did not write
  kDiscard,           // a page-out that drops the bytes instead of writing them
  kReadAhead,         // store -> host tier, no device
};

// Whether a job of this kind takes bytes off the device (to the store files, the host
// tier or nowhere): the direction of its copies and requests.
constexpr bool pages_out(JobKind kind) {
  return kind == JobKind::kPageOut || kind == JobKind::kReleaseUnchanged ||
         kind == JobKind::kDiscard;
}

// A job's progress. A page-out short of host room has a phase two (see Job::deferred):
// kHeldBack or kPlaced once planned, kPlacedStarted once its added work starts.
enum class JobPhase {
  kQueued,         // its work not started (a page-out may wait for a held range)
  kStarted,        // its work issued or in flight
  kHeldBack,       // phase two planned; its chunks wait for a held range
  kPlaced,         // phase two planned; its work still to start
  kPlacedStarted,  // phase two's work issued or in flight
  kDone,           // finished: error and the times may be read
};

struct Job {
  explicit Job(JobKind job_kind) : kind(job_kind) {}
  bool out() const { return pages_out(kind); }

  const JobKind kind;
  std::vector<ExtentId> extents;       // the extents this bucket moves
  std::vector<Residency> before;       // their states before (restored on failure)
  std::vector<Residency> after;        // page-out: their states once done (file or host)
  std::vector<std::pair<uintptr_t, size_t>> zero_fills;
  std::vector<ExtentId> unfilled;      // a page-in's ZERO extents mapped without a fill
                                       // (Pager::page_in's overwrite), sorted
  // A page-out of unchanged extents (Pager::release_unchanged): those whose bytes also
  // lie at rest go back there without a write (unmapped once the fence passes), in
  // these states; the others are in `extents`, written.
  std::vector<ExtentId> returned;
  std::vector<Residency> returned_to;
  // A page-in's pages still to map (Pool::ref_begin), mapped by the Pager's map thread
  // before the job is queued for the I/O thread; its Pool entries point here meanwhile.
  Pool::PendingMaps maps;
  std::vector<HostCopy> host_copies;   // device <-> host tier (allocator/host_tier.h)
  // A page-out short of host room: `spills` (HOST extents, Pager::choose_spills_locked)
  // are written back first, then `deferred` (extents of this bucket) take the room they leave
  // (Pager::place_deferred_locked, phase two).
  std::vector<ExtentId> spills;
  std::vector<ExtentId> deferred;
  std::vector<Chunk> chunks;           // store requests (staging or host-tier memory)
  std::vector<uint64_t> file_ends;     // page-out: per store touched, allocate this far
  uint64_t bytes_moved = 0;            // to or from the store files
  std::vector<RangeCrc> crc_ranges;    // the store ranges it moves, and their parts'
  std::vector<size_t> part_bytes;      // lengths (StoreTier::plan)
  std::vector<uint32_t> part_crcs;     // I/O thread: each part's crc32c once its bytes pass,
  std::vector<char> part_known;        // or not known (copied straight to mapped files)
  uint64_t host_bytes = 0;             // to or from the host tier
  size_t host_copies_issued = 0;       // I/O thread: host_copies[0, this) are queued
  size_t next_chunk = 0;
  size_t chunks_in_flight = 0;
  // Counted in buckets_held: apart from the phase, as a page-out may wait in either phase.
  bool counted_held = false;
  std::optional<Fence> fence;          // device work to finish before completing
  uint64_t requests = 0;               // file requests completed (added to the counters once)
  uint64_t mapped_bytes = 0;           // of bytes_moved, by device copies to or from mapped
                                       // store files (allocator/ram_map.h)
  std::exception_ptr error;
  std::chrono::steady_clock::time_point start_time, end_time;  // first I/O, completion
  TraceRange trace;                    // the same span, for profilers (allocator/trace_range.h)
  JobPhase phase = JobPhase::kQueued;

  // kDone, under the Pager's lock, once error and the times are final.
  void set_done() {
    phase = JobPhase::kDone;
    finished.store(true, std::memory_order_release);
  }
  bool done() const { return finished.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> finished{false};
};

using Ticket = std::shared_ptr<Job>;

// When a finished bucket's I/O started and when it completed, in seconds of the steady
// clock (time.monotonic() in Python). Both are 0 for a bucket that had nothing to move.
// Only once the bucket is done (after Pager::wait() or is_done()): the I/O thread sets them.
std::pair<double, double> job_times(const Job& job);

}  // namespace statepager
