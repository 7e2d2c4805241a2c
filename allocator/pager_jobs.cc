// Pager's buckets (allocator/pager.h): submitting a page-in, page-out or discard as a
// Job, mapping its pages on the map thread, planning its store moves, and the I/O
// thread that starts, advances and completes jobs.
#include <pthread.h>

#include <algorithm>
#include <chrono>

#include "allocator/copy_list.h"
#include "allocator/pager.h"
#include "allocator/pager_internal.h"
#include "allocator/trace_range.h"
#include "backing/errors.h"

namespace statepager {

namespace {

// Zero fills of adjacent extents (a tensor's, of 1 MiB each; small ones by their rounded
// ranges, page_in_bytes) as one: a fill is a memset queued on the page-in stream, between
// its copies (~4,700 a step of the 1.34 B GPT's q8 step apart, on the H200).
void add_zero_fill(std::vector<std::pair<uintptr_t, size_t>>& fills, uintptr_t addr,
                   size_t bytes) {
  if (!fills.empty() && fills.back().first + fills.back().second == addr) {
    fills.back().second += bytes;
  } else {
    fills.emplace_back(addr, bytes);
  }
}

// A job about to start its work, or phase two's, moves on to its started phase (under
// the lock, where waiters read it; start_job() then runs without). False: started already.
bool take_start(Job& job) {
  if (job.phase == JobPhase::kQueued) {
    job.phase = JobPhase::kStarted;
  } else if (job.phase == JobPhase::kPlaced) {
    job.phase = JobPhase::kPlacedStarted;
  } else {
    return false;
  }
  return true;
}

}  // namespace

Ticket Pager::page_in(const std::vector<ExtentId>& bucket, bool for_read,
                      const std::vector<ExtentId>& overwrite) {
  auto job = std::make_shared<Job>(for_read ? JobKind::kPageInForRead : JobKind::kPageIn);
  if (overwrite.empty()) return submit(std::move(job), bucket);
  job->unfilled = sorted_unique(overwrite);  // submit() keeps the ZERO ones
  std::vector<ExtentId> all = bucket;
  all.insert(all.end(), overwrite.begin(), overwrite.end());
  return submit(std::move(job), all);
}

Ticket Pager::page_out(const std::vector<ExtentId>& bucket, uintptr_t stream,
                        uint64_t reuse_after) {
  return submit(std::make_shared<Job>(JobKind::kPageOut), bucket, stream, reuse_after);
}

Ticket Pager::discard(const std::vector<ExtentId>& bucket, uintptr_t stream) {
  return submit(std::make_shared<Job>(JobKind::kDiscard), bucket, stream);
}

// References on the pages of every extent of `ids` (Pool::ref_begin), all or none: what
// is not mapped yet is appended to *pending. It waits for pages another submit is mapping
// (map_unlocked() notifies), and for room while page-outs that will free some are in
// flight (with none in flight the budget is simply too small: OutOfMemoryError), holding
// none meanwhile, so that two submits never wait for each other.
void Pager::ref_pages_locked(std::unique_lock<std::mutex>& lock,
                             const std::vector<ExtentId>& ids, Pool::PendingMaps* pending) {
  while (true) {
    size_t taken = 0;
    try {
      while (taken < ids.size()) {
        const Extent& e = extents_.at(ids[taken]);
        if (!pool_.ref_begin(e.addr, e.bytes, pending)) break;
        taken++;
      }
      if (taken == ids.size()) return;
    } catch (const OutOfMemoryError&) {
      if (outs_in_flight_ == 0) {
        unref_pages_locked(ids, taken);
        pending->clear();
        throw;
      }
    } catch (...) {  // a device error: nothing kept
      unref_pages_locked(ids, taken);
      pending->clear();
      throw;
    }
    unref_pages_locked(ids, taken);
    pending->clear();
    done_cv_.wait(lock);
    check_open();  // close() does not wait for a submit that waits here
  }
}

void Pager::unref_pages_locked(const std::vector<ExtentId>& ids, size_t count) {
  for (size_t i = 0; i < count; i++) {
    const Extent& e = extents_.at(ids[i]);
    pool_.unref(e.addr, e.bytes);
  }
}

// The map thread: maps each queued page-in's pages (Job::maps) without the lock, then
// queues the job for the I/O thread. The submitting thread does not wait for the mapping:
// cuMemSetAccess takes about 1 ms a page while a device-to-host copy runs
// (see Note [Mapping costs per call, not per byte] in docs/design.md), and a streamed
// step always has one running.
// Meanwhile the pages are the job's alone (Pool: others wait for them), its extents
// PAGING_IN and in no queued job.
void Pager::run_map_thread() {
  std::unique_lock lock(mu_);
  while (true) {
    if (map_queue_.empty()) {
      if (stopping_) return;
      map_cv_.wait(lock);
      continue;
    }
    Ticket job = map_queue_.front();
    map_queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      pool_.map_pending(job->maps);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    maps_in_flight_--;
    if (error) {
      mapping_failed_locked(*job, error);
    } else {
      pool_.finish_mapping(job->maps);
      job->maps.clear();
      queue_.push_back(job);
      work_cv_.notify_one();
    }
    done_cv_.notify_all();
  }
}

// A page-in whose mapping failed: its pages let go, its extents back in their states of
// before, its error for wait(). Its new pages were never mapped (released without
// unmapping); a page it shared, whose other references went meanwhile, is unmapped here,
// and a device failing that (a broken context) must not end the map thread: the bucket
// has failed already, and close() meets that device again.
void Pager::mapping_failed_locked(Job& job, std::exception_ptr error) {
  try {
    unref_pages_locked(job.extents, job.extents.size());
  } catch (...) {
  }
  job.maps.clear();
  for (size_t i = 0; i < job.extents.size(); i++) {
    Extent& e = extents_.at(job.extents[i]);
    e.state = job.before[i];
    if (e.dead && !e.tier_move) free_extent_locked(job.extents[i]);  // released meanwhile
  }
  job.error = error;
  job.set_done();
}

// `job` says what kind of bucket (Job::kind); submit plans the rest of it.
Ticket Pager::submit(Ticket job, const std::vector<ExtentId>& bucket, uintptr_t stream,
                     uint64_t reuse_after) {
  check_owner();
  std::unique_lock lock(mu_);
  check_open();
  const bool out = job->out(), discard = job->kind == JobKind::kDiscard;
  const std::vector<ExtentId> ids = sorted_unique(bucket);
  wait_tier_moves_locked(lock, ids);
  for (ExtentId id : ids) {
    const Residency s = extents_.at(id).state;
    if (s == Residency::kPagingIn || s == Residency::kPagingOut) {
      throw UsageError("extent " + std::to_string(id) +
                       " is already being paged by another bucket: wait for that bucket first");
    }
    extents_.at(id).last_use = ++use_clock_;
    if (s == Residency::kResident && job->kind == JobKind::kPageIn) {
      forget_rest_locked(extents_.at(id));  // its caller may write it now
    }
    const bool at_rest_with_bytes = s == Residency::kFile || s == Residency::kHost;
    const bool moves = !out ? s != Residency::kResident
                            : s == Residency::kResident || (discard && at_rest_with_bytes);
    if (moves) job->extents.push_back(id);
  }
  // The clock and hints of the spill choice; an extent already at rest keeps its hint.
  if (!out) {
    for (ExtentId id : ids) paged_in_bytes_ += extents_.at(id).bytes;
  } else {
    const std::optional<uint64_t> next_use =
        reuse_after > 0 ? std::optional(paged_in_bytes_ + reuse_after) : std::nullopt;
    for (ExtentId id : job->extents) extents_.at(id).next_use = next_use;
  }
  if (job->kind == JobKind::kReleaseUnchanged) return_unchanged_locked(*job);
  // What a page-out may write (or a discard drop) no longer lies at rest unchanged.
  if (out) {
    for (ExtentId id : job->extents) forget_rest_locked(extents_.at(id));
  }
  if (discard) {
    // Unmapped once the caller's kernels are done, not behind the page-outs queued on the
    // copy queue (see Note [The pipeline admits page-ins by pages] in docs/design.md).
    job->fence = device_->record_stream(stream);
  } else if (out) {
    device_->wait_for_stream(CopyQueue::kToHost, stream);
  }
  if (out && !discard) {
    try {
      redirect_writes_locked(place_outs_locked(*job));
    } catch (...) {  // the store has no room left: nothing moves
      for (ExtentId id : job->extents) drop_host_locked(extents_.at(id));
      for (ExtentId id : job->spills) {
        extents_.at(id).state = Residency::kHost;
        extents_.at(id).tier_move.reset();
      }
      throw;
    }
  }
  std::vector<ExtentId> unfilled;  // of job->unfilled, those it moves from ZERO
  for (ExtentId id : job->extents) {
    Extent& e = extents_.at(id);
    job->before.push_back(e.state);
    if (!out && e.state == Residency::kZero) {
      if (std::binary_search(job->unfilled.begin(), job->unfilled.end(), id)) {
        unfilled.push_back(id);
      } else {
        add_zero_fill(job->zero_fills, e.addr, page_in_bytes(e.bytes));
      }
    }
    if (!out && e.state == Residency::kHost) {  // one host allocation: one mapping
      append_joined(job->host_copies,
                    HostCopy{e.addr, host_tier_->host(*e.ranges.host), page_in_bytes(e.bytes)});
      job->host_bytes += e.bytes;
    }
    e.state = out ? Residency::kPagingOut : Residency::kPagingIn;
  }
  job->unfilled = std::move(unfilled);
  if (!out) {
    try {
      ref_pages_locked(lock, job->extents, &job->maps);
    } catch (...) {
      if (closed_) throw;  // closed while it waited: close() lets every extent go
      std::vector<ExtentId> released;  // by release() while it waited for room
      for (size_t i = 0; i < job->extents.size(); i++) {
        Extent& e = extents_.at(job->extents[i]);
        e.state = job->before[i];
        if (e.dead && !e.tier_move) released.push_back(job->extents[i]);
      }
      for (ExtentId id : released) free_extent_locked(id);
      done_cv_.notify_all();
      throw;
    }
  }
  for (ExtentId id : job->returned) extents_.at(id).state = Residency::kPagingOut;
  if (!discard) plan_locked(*job);
  if (job->extents.empty() && job->returned.empty()) {
    if (job->fence) device_->release_fence(*job->fence);
    job->fence.reset();
    job->set_done();
    return job;
  }
  if (!job->maps.empty()) {  // queued for the I/O thread once mapped
    maps_in_flight_++;
    map_queue_.push_back(job);
    map_cv_.notify_one();
    return job;
  }
  queue_.push_back(job);
  if (out) outs_in_flight_++;
  work_cv_.notify_one();
  return job;
}

// The bucket's moves to or from the store files.
void Pager::plan_locked(Job& job) {
  std::vector<StoreTier::Move> moves;
  auto host_move = [&](const Extent& e) {
    moves.push_back(StoreTier::Move{0, e.bytes, e.ranges.store, e.file_bytes,
                                    host_tier_->host(*e.ranges.host)});
  };
  for (ExtentId id : job.spills) host_move(extents_.at(id));
  for (size_t i = 0; i < job.extents.size(); i++) {
    const Extent& e = extents_.at(job.extents[i]);
    if (job.kind == JobKind::kReadAhead) {
      host_move(e);
      continue;
    }
    const bool to_store = job.out() ? job.after[i] == Residency::kFile
                                    : job.before[i] == Residency::kFile;
    if (to_store) {
      moves.push_back(StoreTier::Move{e.addr, e.bytes, e.ranges.store, e.file_bytes});
    }
  }
  store_tier_->plan(job, std::move(moves));
}

void Pager::wait(const Ticket& ticket) {
  check_owner();
  if (!ticket->done()) {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return ticket->done(); });
  }
  if (ticket->error) std::rethrow_exception(ticket->error);
}

// Without the lock, which the I/O thread holds while it settles buckets: a step's pipeline
// polls its page-outs from every forward pre-hook.
bool Pager::is_done(const Ticket& ticket) const { return ticket->done(); }

// ---- I/O thread ----------------------------------------------------------------------

void Pager::run_io_thread() {
  std::unique_lock lock(mu_);
  while (true) {
    // Page-outs waiting for held ranges are woken by unhold().
    if (queue_.empty() || only_held_jobs_locked()) {
      if (stopping_ && queue_.empty()) return;
      work_cv_.wait(lock);
      continue;
    }
    if (!advance(lock)) {
      // Only device copies are pending: poll them again shortly.
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      lock.lock();
    }
  }
}

// One round of the pipeline: start buckets, hand free slots to the oldest buckets,
// move finished copies on to I/O and finished I/O on to copies, complete buckets.
// Called with the lock held; drops it around device and file calls.
bool Pager::advance(std::unique_lock<std::mutex>& lock) {
  std::vector<Ticket> jobs;
  std::vector<Job*> running;   // those whose chunks may be issued
  std::vector<Job*> starting;  // of them, those whose work (or phase two's) starts now
  for (const Ticket& job : queue_) {
    if (job->phase == JobPhase::kHeldBack && !waits_for_hold_locked(*job)) {
      job->phase = JobPhase::kPlaced;
    }
    if (job->phase == JobPhase::kQueued && waits_for_hold_locked(*job)) continue;
    jobs.push_back(job);
    if (job->phase == JobPhase::kHeldBack) continue;
    running.push_back(job.get());
    if (take_start(*job)) starting.push_back(job.get());
  }
  lock.unlock();
  for (Job* job : starting) start_job(*job);
  bool progressed = store_tier_->pump(running, !starting.empty());
  lock.lock();
  for (const Ticket& job : jobs) {
    const bool issued_all = job->error || job->next_chunk == job->chunks.size();
    const bool in_flight = job->phase == JobPhase::kStarted ||
                           job->phase == JobPhase::kPlacedStarted;
    if (!in_flight || job->chunks_in_flight > 0 || !issued_all) continue;
    if (job->fence && !fence_passed_locked(*job)) continue;
    progressed = true;
    if (!job->error && !job->deferred.empty() && job->phase == JobPhase::kStarted) {
      try {
        place_deferred_locked(*job);
        continue;
      } catch (...) {
        job->error = std::current_exception();
      }
    }
    settle_crcs_locked(*job);
    complete(*job);
  }
  return progressed;
}

// Whether the job's fence has passed (then let go). A device that fails the query (a
// broken context, say after a kernel's illegal address) fails the job instead of ending
// the I/O thread: its waiter gets the device's error.
bool Pager::fence_passed_locked(Job& job) {
  try {
    if (!device_->is_done(*job.fence)) return false;
  } catch (...) {
    if (!job.error) job.error = std::current_exception();
  }
  device_->release_fence(*job.fence);
  job.fence.reset();
  return true;
}

// Starts a job's work (kStarted), or the work place_deferred_locked() added
// (kPlacedStarted). Without the lock: the fields it touches are the I/O thread's.
void Pager::start_job(Job& job) {
  const bool discard = job.kind == JobKind::kDiscard;
  if (job.phase == JobPhase::kStarted) {
    job.start_time = std::chrono::steady_clock::now();
    job.trace.start(io_range_name(job.out(), discard, job.bytes_moved),
                    job.out() ? TraceKind::kWrite : TraceKind::kRead);
  }
  try {
    store_tier_->start(job);
    if (host_tier_) host_tier_->start(job);
    for (auto [addr, bytes] : job.zero_fills) device_->fill_zero(addr, bytes);
    // Extents returned unchanged unmap once the work queued before it on the caller's
    // stream is done (a discard's fence was recorded on that stream by submit()).
    if (!job.zero_fills.empty() || !job.host_copies.empty() || !job.returned.empty()) {
      job.fence = device_->record(job.out() ? CopyQueue::kToHost : CopyQueue::kToDevice);
    }
  } catch (...) {
    job.error = std::current_exception();
  }
}

// Lets an extent's pages go where a bucket completes. A device failing the unmap (a
// broken context) must not end the I/O thread: the pages stay mapped (a later page-in
// finds them so), and the next device call or close() meets that device again.
void Pager::unref_quietly_locked(const Extent& e) {
  try {
    pool_.unref(e.addr, e.bytes);
  } catch (const DeviceError&) {
  }
}

// Under the lock: the bucket's extents take their new state (or get their old one back).
void Pager::complete(Job& job) {
  const bool ok = !job.error;
  const bool discard = job.kind == JobKind::kDiscard;
  if (!ok && job.phase == JobPhase::kStarted) {  // phase one failed: spills not landed
    for (ExtentId id : job.spills) {
      extents_.at(id).state = Residency::kHost;
      extents_.at(id).tier_move.reset();
    }
  }
  for (size_t i = 0; i < job.extents.size(); i++) {
    Extent& e = extents_.at(job.extents[i]);
    if (job.kind == JobKind::kReadAhead) {
      e.tier_move.reset();
      e.state = ok ? Residency::kHost : Residency::kFile;
      if (ok) finish_move_locked(e);
      if (!ok) drop_host_locked(e);
    } else if (job.out()) {
      e.state = !ok ? job.before[i] : discard ? Residency::kZero : job.after[i];
      if (ok && job.before[i] == Residency::kResident) unref_quietly_locked(e);
      // A failed page-out lets its fresh host range go; a discard, the host bytes.
      if (ok ? discard : !discard && job.after[i] == Residency::kHost) {
        drop_host_locked(e);
      }
    } else {
      e.state = ok ? Residency::kResident : job.before[i];
      if (ok) paged_in_locked(e, job.before[i], job.kind == JobKind::kPageInForRead);
      if (!ok) unref_quietly_locked(e);
    }
  }
  for (size_t i = 0; i < job.returned.size(); i++) {
    Extent& e = extents_.at(job.returned[i]);
    e.state = ok ? job.returned_to[i] : Residency::kResident;
    if (ok) unref_quietly_locked(e);
    if (ok) counters_.unchanged_bytes += e.bytes;
  }
  if (ok) {
    const uint64_t file_bytes = job.bytes_moved;
    if (job.out()) {
      counters_.bytes_to_host += job.host_bytes;
      counters_.bytes_written += file_bytes;
      counters_.write_requests += job.requests;
      counters_.mapped_written_bytes += job.mapped_bytes;
      counters_.buckets_out++;
    } else if (job.kind == JobKind::kReadAhead) {
      counters_.read_aheads += job.extents.size();
      counters_.read_ahead_bytes += file_bytes;
      counters_.bytes_read += file_bytes;
      counters_.read_requests += job.requests;
    } else {
      counters_.bytes_from_host += job.host_bytes;
      counters_.bytes_read += file_bytes;
      counters_.read_requests += job.requests;
      counters_.mapped_read_bytes += job.mapped_bytes;
      counters_.buckets_in++;
      for (size_t i = 0; i < job.extents.size(); i++) {  // their bytes, not the fills' rounding
        if (job.before[i] == Residency::kZero &&
            !std::binary_search(job.unfilled.begin(), job.unfilled.end(), job.extents[i])) {
          counters_.zero_filled_bytes += extents_.at(job.extents[i]).bytes;
        }
      }
    }
  }
  for (const auto* ids : {&job.extents, &job.spills, &job.returned}) {
    for (ExtentId id : *ids) {
      const Extent& e = extents_.at(id);
      if (e.dead && !e.tier_move && e.state != Residency::kPagingIn &&
          e.state != Residency::kPagingOut) {
        free_extent_locked(id);
      }
    }
  }
  if (job.out()) outs_in_flight_--;
  job.end_time = std::chrono::steady_clock::now();
  job.trace.end();
  job.set_done();
  queue_.erase(std::find_if(queue_.begin(), queue_.end(),
                            [&](const Ticket& t) { return t.get() == &job; }));
  done_cv_.notify_all();
}

}  // namespace statepager
