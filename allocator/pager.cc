#include "allocator/pager.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>

#include "allocator/trace_range.h"
#include "backing/errors.h"

namespace statepager {

namespace {

constexpr size_t kFileAlign = UringFile::kAlignment;
constexpr size_t kAddressAlign = 4096;

size_t align_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// One device<->staging copy inside a chunk.
struct Piece {
  size_t staging_offset;
  uintptr_t addr;
  size_t bytes;
};

// One I/O request: a contiguous, aligned range of the store file.
struct Chunk {
  uint64_t file_offset = 0;
  size_t file_bytes = 0;
  std::vector<Piece> pieces;
};

}  // namespace

// A bucket. Set by submit() under mu_ and fixed once queued: out .. file_ends and
// bytes_moved. The I/O thread's alone: next_chunk .. fence, requests, error and
// start_time (error and the times are read by others once done is set). Under mu_: done.
struct Job {
  bool out = false;
  bool discard = false;                // page-out that drops the bytes instead of writing
  std::vector<ExtentId> extents;       // the extents this bucket moves
  std::vector<Residency> before;       // their states before (restored on failure)
  std::vector<std::pair<uintptr_t, size_t>> zero_fills;
  std::vector<Chunk> chunks;
  std::vector<uint64_t> file_ends;     // page-out: per store touched, allocate this far
  size_t next_chunk = 0;
  size_t chunks_in_flight = 0;
  bool started = false;
  bool held = false;                   // a page-out found waiting for a held range
  std::optional<Fence> fence;          // device work to finish before completing
  uint64_t bytes_moved = 0;
  uint64_t requests = 0;               // file requests completed (added to the counters once)
  bool done = false;
  std::exception_ptr error;
  std::chrono::steady_clock::time_point start_time, end_time;  // first I/O, completion
  TraceRange trace;                    // the same span, for profilers (allocator/trace_range.h)
};

IoShape io_shape_for(bool direct_io) {
  return direct_io ? IoShape{64, size_t(4) << 20} : IoShape{32, size_t(1) << 20};
}

std::pair<double, double> job_times(const Job& job) {
  auto seconds = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(t.time_since_epoch()).count();
  };
  return {seconds(job.start_time), seconds(job.end_time)};
}

constexpr uint64_t kNoOffset = ~uint64_t{0};

unsigned store_index(uint64_t store_offset) {
  return static_cast<unsigned>(store_offset / UringFile::kRegionBytes);
}

// Guarded by mu_.
struct Pager::Store {
  std::string name;
  Arena space;       // its ranges, as logical offsets of file_ (see UringFile)
};

// Guarded by mu_ (a Job carries copies of what the I/O thread needs: addresses, ranges).
struct Pager::Extent {
  uintptr_t addr;
  size_t bytes;
  uint64_t file_offset;                // its range in its store
  size_t file_bytes;
  uint64_t next_offset = kNoOffset;    // a FILE extent's range in the store it moves to
  Residency state = Residency::kZero;
  bool segment = false;  // PyTorch's: stays mapped until PyTorch frees it, even after close
  // In an open epoch (epoch != 0): what it was at the epoch's begin, its committed state.
  uint64_t epoch = 0;
  Residency committed_state = Residency::kZero;
  uint64_t committed_offset = kNoOffset;  // file_offset then: the committed bytes when FILE
  uint64_t committed_next = kNoOffset;    // next_offset then

  // The store ranges it refers to now, and in an epoch also those it committed.
  std::vector<uint64_t> ranges() const {
    std::vector<uint64_t> out;
    for (uint64_t r : {file_offset, next_offset, committed_offset, committed_next}) {
      if (r != kNoOffset && std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
    }
    return out;
  }
};

// A staging slot: the I/O thread's alone.
struct Pager::Slot {
  unsigned index = 0;
  char* buf = nullptr;
  Job* job = nullptr;
  const Chunk* chunk = nullptr;
  std::optional<Fence> copy;  // set while a device copy for this slot is queued
};

Pager::Pager(std::unique_ptr<Device> device, PagerOptions options)
    : device_(std::move(device)),
      options_(std::move(options)),
      pool_(*device_, options_.pool) {
  if (options_.io_depth > kMaxIoDepth) {
    throw UsageError("io_depth (PagerOptions::io_depth) " + std::to_string(options_.io_depth) +
                     " is not allowed: it must be 1 to " + std::to_string(kMaxIoDepth) +
                     " (0 or None: chosen for the medium)");
  }
  if (options_.io_block_bytes % kFileAlign != 0 || options_.io_block_bytes > kMaxIoBlockBytes) {
    throw UsageError("io_block (PagerOptions::io_block_bytes) " +
                     std::to_string(options_.io_block_bytes) + " is not allowed: it must be a "
                     "multiple of 4096 up to " + std::to_string(kMaxIoBlockBytes) +
                     " (256 MiB) (0 or None: chosen for the medium)");
  }
  // A file-size limit must surface as EFBIG on the write, not kill the process.
  std::signal(SIGXFSZ, SIG_IGN);
  dir_ = std::make_unique<StoreDir>(options_.directory);
  const unsigned ring_depth = options_.io_depth != 0
                                  ? options_.io_depth
                                  : std::max(io_shape_for(true).depth, io_shape_for(false).depth);
  file_ = std::make_unique<UringFile>(
      dir_->store_file(""), UringFile::Options{ring_depth, options_.try_direct, true});
  const IoShape shape = io_shape_for(file_->direct());
  if (options_.io_depth == 0) options_.io_depth = shape.depth;
  if (options_.io_block_bytes == 0) options_.io_block_bytes = shape.block_bytes;
  add_store_locked("");  // the default store: file 0 of file_
  char* staging = static_cast<char*>(
      device_->alloc_staging(size_t(options_.io_depth) * options_.io_block_bytes));
  for (unsigned i = 0; i < options_.io_depth; i++) {
    Slot slot;
    slot.index = i;
    slot.buf = staging + size_t(i) * options_.io_block_bytes;
    slots_.push_back(slot);
  }
  try {
    file_->register_buffers({iovec{staging, slots_.size() * options_.io_block_bytes}});
  } catch (const Error&) {
    // Registration needs RLIMIT_MEMLOCK headroom; unregistered I/O is correct, just slower.
  }
  counters_.direct_io = file_->direct();
  counters_.io_depth = options_.io_depth;
  counters_.io_block_bytes = options_.io_block_bytes;
  io_thread_ = std::thread([this] { run_io_thread(); });
}

Pager::~Pager() {
  try {
    close();
  } catch (...) {
  }
}

const std::string& Pager::file_path() const { return file_->path(); }
const std::string& Pager::directory() const { return dir_->path(); }

void Pager::check_open_locked() const {
  if (closed_) throw UsageError("this Pager is closed: create a new one");
}

Pager::Extent& Pager::extent_locked(ExtentId id) {
  auto it = extents_.find(id);
  if (it == extents_.end()) throw UsageError("unknown extent " + std::to_string(id));
  return *it->second;
}

const Pager::Extent& Pager::extent_locked(ExtentId id) const {
  return const_cast<Pager*>(this)->extent_locked(id);
}

ExtentId Pager::create(size_t bytes, unsigned store) {
  std::unique_lock lock(mu_);
  check_open_locked();
  check_store_locked(store);
  if (bytes > pool_.arena_bytes()) {
    throw UsageError("a tensor of " + std::to_string(bytes) + " bytes is larger than the "
                     "pager's whole address arena (arena_size " +
                     std::to_string(pool_.arena_bytes()) + " bytes): create the Pager with "
                     "a larger arena_size");
  }
  auto extent = std::make_unique<Extent>();
  extent->bytes = bytes;
  extent->file_bytes = align_up(std::max<size_t>(bytes, 1), kFileAlign);
  extent->addr = pool_.allocate(std::max<size_t>(bytes, 1), kAddressAlign);
  try {
    extent->file_offset = stores_[store]->space.allocate(extent->file_bytes, kFileAlign);
  } catch (...) {
    pool_.free(extent->addr);
    throw;
  }
  const ExtentId id = next_id_++;
  by_address_[extent->addr] = id;
  extents_[id] = std::move(extent);
  return id;
}

uintptr_t Pager::create_segment(size_t bytes) {
  const ExtentId id = create(bytes);
  std::unique_lock lock(mu_);
  Extent& e = extent_locked(id);
  try {
    pool_.ref(e.addr, e.bytes, true);
  } catch (...) {
    lock.unlock();
    release(id);
    throw;
  }
  e.state = Residency::kResident;
  e.segment = true;
  return e.addr;
}

void Pager::release_at(uintptr_t addr) {
  ExtentId id;
  {
    std::unique_lock lock(mu_);
    auto it = by_address_.find(addr);
    if (it == by_address_.end() || !extent_locked(it->second).segment) {
      throw UsageError("no segment of this pager starts at the freed address");
    }
    id = it->second;
  }
  release(id);
}

bool Pager::owns_address(uintptr_t addr) const {
  std::unique_lock lock(mu_);
  return pool_.contains(addr, 1);
}

void Pager::release(ExtentId id) {
  std::unique_lock lock(mu_);
  // A tensor may die while its bucket is in flight: let the bucket finish first.
  done_cv_.wait(lock, [&] {
    const Residency s = extent_locked(id).state;
    return s != Residency::kPagingIn && s != Residency::kPagingOut;
  });
  Extent& e = extent_locked(id);
  if (e.state == Residency::kResident && (!closed_ || e.segment)) pool_.unref(e.addr, e.bytes);
  pool_.free(e.addr);
  for (uint64_t range : e.ranges()) free_range_locked(range, e.file_bytes);
  by_address_.erase(e.addr);
  extents_.erase(id);
}

unsigned Pager::open_store(const std::string& name) {
  std::unique_lock lock(mu_);
  check_open_locked();
  for (unsigned i = 0; i < stores_.size(); i++) {
    if (stores_[i]->name == name) return i;
  }
  file_->add_file(dir_->store_file(name));
  return add_store_locked(name);
}

// The store of file_'s newest file (stores_[i] is file i). Offset 0 of every store stays
// unused, so an extent's range never starts at 0.
unsigned Pager::add_store_locked(const std::string& name) {
  const auto index = static_cast<unsigned>(stores_.size());
  const uint64_t base = uint64_t{index} * UringFile::kRegionBytes;
  stores_.push_back(std::make_unique<Store>(
      Store{name, Arena(base + kFileAlign, UringFile::kRegionBytes - kFileAlign)}));
  return index;
}

void Pager::check_store_locked(unsigned store) const {
  if (store >= stores_.size()) throw UsageError("no store " + std::to_string(store));
}

const std::string& Pager::store_name(unsigned store) const {
  std::unique_lock lock(mu_);
  check_store_locked(store);
  return stores_[store]->name;
}

void Pager::move_to_store(const std::vector<ExtentId>& ids, unsigned store) {
  std::unique_lock lock(mu_);
  check_open_locked();
  check_store_locked(store);
  for (ExtentId id : ids) {  // all checked before any moves
    const Extent& e = extent_locked(id);
    if (e.segment) throw UsageError("a segment of PyTorch's allocator cannot change stores");
    if (e.state == Residency::kPagingIn || e.state == Residency::kPagingOut) {
      throw UsageError("extent " + std::to_string(id) + " is being paged: wait for its bucket "
                       "before moving it to another store");
    }
    const uint64_t now = e.next_offset != kNoOffset ? e.next_offset : e.file_offset;
    if (store_index(now) != store) check_not_in_epoch_locked(e, id, "change stores");
  }
  for (ExtentId id : ids) {
    Extent& e = extent_locked(id);
    const uint64_t now = e.next_offset != kNoOffset ? e.next_offset : e.file_offset;
    if (store_index(now) == store) continue;
    if (e.next_offset != kNoOffset) {  // a move not done yet goes elsewhere
      free_range_locked(e.next_offset);
      e.next_offset = kNoOffset;
      if (store_index(e.file_offset) == store) continue;
    }
    const uint64_t to = stores_[store]->space.allocate(e.file_bytes, kFileAlign);
    if (e.state == Residency::kFile) {
      e.next_offset = to;  // its bytes are read from the old range once more
    } else {
      free_range_locked(e.file_offset);
      e.file_offset = to;
    }
  }
}

unsigned Pager::store_of(ExtentId id) const {
  std::unique_lock lock(mu_);
  const Extent& e = extent_locked(id);
  return store_index(e.next_offset != kNoOffset ? e.next_offset : e.file_offset);
}

// A range a save holds is freed once it is copied (unhold()): until then nothing may be
// written into it. punch_bytes > 0: its blocks go back to the filesystem (its extent is
// gone; ranges freed by steps are not punched, the next step writes them again).
void Pager::free_range_locked(uint64_t store_offset, size_t punch_bytes) {
  if (held_.count(store_offset) != 0) {
    freed_held_[store_offset] = punch_bytes;
    return;
  }
  if (punch_bytes > 0 && file_) file_->punch(store_offset, punch_bytes);
  stores_[store_index(store_offset)]->space.free(store_offset);
}

// The extent's bytes are no longer needed in its old store: it now lives in the new one.
// In an epoch the old range holds the committed bytes: the epoch's end frees it.
void Pager::finish_move_locked(Extent& e) {
  if (e.next_offset == kNoOffset) return;
  if (e.file_offset != e.committed_offset) free_range_locked(e.file_offset);
  e.file_offset = e.next_offset;
  e.next_offset = kNoOffset;
}

void Pager::check_not_in_epoch_locked(const Extent& e, ExtentId id, const char* what) const {
  if (e.epoch != 0) {
    throw UsageError("extent " + std::to_string(id) + " is in an open epoch (a step is "
                     "running): it cannot " + what + " until the epoch ends");
  }
}

// Safe without the lock: UringFile's files never move (the I/O thread calls this).
const std::string& Pager::path_of(uint64_t store_offset) const {
  return file_->file_path(store_index(store_offset));
}

bool Pager::exists(ExtentId id) const {
  std::unique_lock lock(mu_);
  return extents_.count(id) != 0;
}

uintptr_t Pager::address(ExtentId id) const {
  std::unique_lock lock(mu_);
  return extent_locked(id).addr;
}

size_t Pager::size(ExtentId id) const {
  std::unique_lock lock(mu_);
  return extent_locked(id).bytes;
}

Residency Pager::residency(ExtentId id) const {
  std::unique_lock lock(mu_);
  return extent_locked(id).state;
}

std::optional<ExtentId> Pager::find(uintptr_t addr) const {
  std::unique_lock lock(mu_);
  auto it = by_address_.find(addr);
  if (it == by_address_.end() || extent_locked(it->second).segment) return std::nullopt;
  return it->second;
}

Ticket Pager::page_in(const std::vector<ExtentId>& bucket) {
  return submit(bucket, false, 0, false);
}

Ticket Pager::page_out(const std::vector<ExtentId>& bucket, uintptr_t stream) {
  return submit(bucket, true, stream, false);
}

Ticket Pager::discard(const std::vector<ExtentId>& bucket, uintptr_t stream) {
  return submit(bucket, true, stream, true);
}

// Maps the pages under [addr, addr + bytes). At the budget, waits for page-outs in flight
// to return pages; with none in flight the budget is simply too small.
void Pager::ref_pages_locked(std::unique_lock<std::mutex>& lock, uintptr_t addr, size_t bytes) {
  while (true) {
    try {
      pool_.ref(addr, bytes);
      return;
    } catch (const OutOfMemoryError&) {
      if (outs_in_flight_ == 0) throw;
      done_cv_.wait(lock);
    }
  }
}

Ticket Pager::submit(const std::vector<ExtentId>& bucket, bool out, uintptr_t stream,
                     bool discard) {
  std::unique_lock lock(mu_);
  check_open_locked();
  auto job = std::make_shared<Job>();
  job->out = out;
  job->discard = discard;
  std::vector<ExtentId> ids = bucket;
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  for (ExtentId id : ids) {
    const Residency s = extent_locked(id).state;
    if (s == Residency::kPagingIn || s == Residency::kPagingOut) {
      throw UsageError("extent " + std::to_string(id) +
                       " is already being paged by another bucket: wait for that bucket first");
    }
    const bool moves = !out ? s != Residency::kResident
                            : s == Residency::kResident || (discard && s == Residency::kFile);
    if (moves) job->extents.push_back(id);
  }
  if (out && !discard) redirect_writes_locked(job->extents);
  if (out) device_->wait_for_stream(CopyQueue::kToHost, stream);
  for (ExtentId id : job->extents) {
    Extent& e = extent_locked(id);
    job->before.push_back(e.state);
    if (!out && e.state == Residency::kZero) job->zero_fills.emplace_back(e.addr, e.bytes);
    e.state = out ? Residency::kPagingOut : Residency::kPagingIn;
  }
  if (!out) {
    size_t mapped = 0;
    try {
      for (; mapped < job->extents.size(); mapped++) {
        const Extent& e = extent_locked(job->extents[mapped]);
        ref_pages_locked(lock, e.addr, e.bytes);
      }
    } catch (...) {
      for (size_t i = 0; i < job->extents.size(); i++) {
        Extent& e = extent_locked(job->extents[i]);
        if (i < mapped) pool_.unref(e.addr, e.bytes);
        e.state = job->before[i];
      }
      done_cv_.notify_all();
      throw;
    }
  }
  if (!discard) plan_chunks(*job);
  if (job->extents.empty()) {
    job->done = true;
    return job;
  }
  queue_.push_back(job);
  if (out) outs_in_flight_++;
  work_cv_.notify_one();
  return job;
}

// In an epoch a page-out never overwrites committed bytes: an extent whose range holds
// them is written to a fresh range of its store (copy-on-write).
void Pager::redirect_writes_locked(const std::vector<ExtentId>& ids) {
  std::vector<std::pair<Extent*, uint64_t>> fresh;
  try {
    for (ExtentId id : ids) {
      Extent& e = extent_locked(id);
      if (e.epoch == 0 || e.committed_state != Residency::kFile ||
          e.file_offset != e.committed_offset) {
        continue;
      }
      Arena& space = stores_[store_index(e.file_offset)]->space;
      fresh.emplace_back(&e, space.allocate(e.file_bytes, kFileAlign));
    }
  } catch (...) {
    for (auto [e, range] : fresh) free_range_locked(range);
    throw;
  }
  for (auto [e, range] : fresh) e->file_offset = range;
}

// Cuts the bucket's file ranges into requests of at most io_block_bytes. Extents that are
// neighbours in the file share a request.
void Pager::plan_chunks(Job& job) {
  std::vector<const Extent*> moved;
  for (size_t i = 0; i < job.extents.size(); i++) {
    const Extent& e = extent_locked(job.extents[i]);
    if (job.out || job.before[i] == Residency::kFile) moved.push_back(&e);
  }
  std::sort(moved.begin(), moved.end(),
            [](const Extent* a, const Extent* b) { return a->file_offset < b->file_offset; });
  const size_t block = options_.io_block_bytes;
  Chunk chunk;
  auto flush = [&] {
    if (chunk.file_bytes > 0) job.chunks.push_back(std::move(chunk));
    chunk = Chunk{};
  };
  for (const Extent* e : moved) {
    size_t pos = 0;
    while (pos < e->bytes) {
      const uint64_t at = e->file_offset + pos;
      if (chunk.file_bytes == block || (chunk.file_bytes > 0 && chunk.file_offset + chunk.file_bytes != at)) {
        flush();
      }
      if (chunk.file_bytes == 0) chunk.file_offset = at;
      const size_t n = std::min(block - chunk.file_bytes, e->bytes - pos);
      chunk.pieces.push_back(Piece{chunk.file_bytes, e->addr + pos, n});
      chunk.file_bytes += align_up(n, kFileAlign);
      pos += n;
    }
    const uint64_t end = e->file_offset + e->file_bytes;
    if (job.file_ends.empty() || store_index(job.file_ends.back()) != store_index(end - 1)) {
      job.file_ends.push_back(end);  // sorted by offset: stores come one after another
    } else {
      job.file_ends.back() = std::max(job.file_ends.back(), end);
    }
    job.bytes_moved += e->bytes;
  }
  flush();
}

void Pager::wait(const Ticket& ticket) {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return ticket->done; });
  if (ticket->error) std::rethrow_exception(ticket->error);
}

bool Pager::is_done(const Ticket& ticket) const {
  std::unique_lock lock(mu_);
  return ticket->done;
}

PagerStats Pager::stats() const {
  std::unique_lock lock(mu_);
  PagerStats s = counters_;
  s.mapped_bytes = pool_.mapped_bytes();
  s.peak_mapped_bytes = pool_.pages().peak_in_use_bytes();
  s.cached_bytes = pool_.pages().cached_bytes();
  s.budget_bytes = pool_.pages().budget_bytes();
  s.page_bytes = pool_.page_bytes();
  s.extents = extents_.size();
  for (const auto& [id, e] : extents_) {
    if (e->state == Residency::kResident) s.resident_bytes += e->bytes;
  }
  return s;
}

std::vector<ExtentId> Pager::resident_extents() const {
  std::unique_lock lock(mu_);
  std::vector<ExtentId> ids;
  for (const auto& [id, e] : extents_) {
    if (e->state == Residency::kResident) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

void Pager::trim() {
  std::unique_lock lock(mu_);
  pool_.trim();
}

void Pager::set_keep_bytes(size_t keep_bytes) {
  std::unique_lock lock(mu_);
  pool_.pages().set_keep_bytes(keep_bytes);
}

void Pager::reset_peak() {
  std::unique_lock lock(mu_);
  pool_.pages().reset_peak();
}

std::vector<std::string> Pager::store_files() const {
  std::unique_lock lock(mu_);
  check_open_locked();
  return file_->physical_paths();
}

Placement Pager::placement_locked(const Extent& e, uint64_t store_offset) const {
  Placement p;
  p.state = e.state;
  p.bytes = e.bytes;
  p.store_offset = store_offset;
  p.store_bytes = align_up(e.bytes, kFileAlign);
  p.spans = file_->spans(p.store_offset, p.store_bytes);
  return p;
}

std::vector<Placement> Pager::hold(const std::vector<ExtentId>& ids) {
  std::unique_lock lock(mu_);
  check_open_locked();
  if (!held_.empty()) {
    throw UsageError("a checkpoint copy still holds ranges of this Pager's store: wait for it "
                     "to finish before taking another");
  }
  std::vector<Placement> out;
  for (ExtentId id : ids) {
    const Extent& e = extent_locked(id);
    if (e.state != Residency::kZero && e.state != Residency::kFile) {
      throw UsageError("extent " + std::to_string(id) + " is resident or being paged: page it "
                       "out (and wait) before copying the store");
    }
    check_not_in_epoch_locked(e, id, "be copied");
    out.push_back(placement_locked(e, e.file_offset));
  }
  for (const Placement& p : out) {
    if (p.state == Residency::kFile && p.store_bytes > 0) {
      held_[p.store_offset] = p.store_offset + p.store_bytes;
    }
  }
  return out;
}

void Pager::unhold(uint64_t store_offset) {
  std::unique_lock lock(mu_);
  if (held_.erase(store_offset) == 0) return;
  auto freed = freed_held_.find(store_offset);
  if (freed != freed_held_.end()) {
    const size_t punch_bytes = freed->second;
    freed_held_.erase(freed);
    free_range_locked(store_offset, punch_bytes);
  }
  work_cv_.notify_one();  // a page-out may be waiting for this range
}

// True when the (unstarted) job is a page-out into a held range; counts it once.
bool Pager::waits_for_hold_locked(Job& job) {
  if (!job.out || job.discard || held_.empty()) return false;
  for (const Chunk& c : job.chunks) {
    auto next = held_.upper_bound(c.file_offset);  // ranges are disjoint: check two
    const bool before = next != held_.begin() && std::prev(next)->second > c.file_offset;
    const bool after = next != held_.end() && next->first < c.file_offset + c.file_bytes;
    if (before || after) {
      if (!job.held) counters_.buckets_held++;
      job.held = true;
      return true;
    }
  }
  return false;
}

bool Pager::only_held_jobs_locked() {
  for (const Ticket& job : queue_) {
    if (job->started || !waits_for_hold_locked(*job)) return false;
  }
  return true;
}

CopyMethod Pager::restore(const std::vector<ExtentId>& ids, const std::vector<bool>& zero,
                          const std::string& src, const std::vector<uint64_t>& src_offsets) {
  if (zero.size() != ids.size() || src_offsets.size() != ids.size()) {
    throw UsageError("restore: ids, zero and src_offsets must have the same length");
  }
  std::vector<ExtentId> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw UsageError("restore: an extent is given twice");
  }
  std::vector<uint64_t> fresh(ids.size(), kNoOffset);  // where the new bytes go
  std::vector<Placement> places(ids.size());
  std::vector<Residency> before;
  std::vector<std::string> paths;
  {
    std::unique_lock lock(mu_);
    check_open_locked();
    for (ExtentId id : ids) {
      const Extent& e = extent_locked(id);
      if (e.state != Residency::kZero && e.state != Residency::kFile) {
        throw UsageError("extent " + std::to_string(id) + " is resident or being paged: page "
                         "it out or discard it (and wait) before restoring it");
      }
      if (held_.count(e.file_offset) != 0) {
        throw UsageError("a checkpoint copy still holds the store range of extent " +
                         std::to_string(id) + ": wait for the save to finish first");
      }
      check_not_in_epoch_locked(e, id, "be restored");
    }
    try {
      for (size_t i = 0; i < ids.size(); i++) {
        if (zero[i]) continue;
        const Extent& e = extent_locked(ids[i]);
        // In the store it moves to, if it moves: the move is done once the bytes are there.
        const uint64_t now = e.next_offset != kNoOffset ? e.next_offset : e.file_offset;
        fresh[i] = stores_[store_index(now)]->space.allocate(e.file_bytes, kFileAlign);
      }
    } catch (...) {
      for (uint64_t range : fresh) {
        if (range != kNoOffset) free_range_locked(range);
      }
      throw;
    }
    for (size_t i = 0; i < ids.size(); i++) {
      Extent& e = extent_locked(ids[i]);
      if (!zero[i]) places[i] = placement_locked(e, fresh[i]);
      before.push_back(e.state);
      e.state = Residency::kPagingIn;
    }
    paths = file_->physical_paths();
  }
  CopyMethod method = CopyMethod::kReflink;
  try {
    const OpenFile from(src, OpenFile::kRead);
    std::vector<OpenFile> store;
    for (const std::string& path : paths) store.emplace_back(path, OpenFile::kWrite);
    for (size_t i = 0; i < ids.size(); i++) {
      uint64_t at = src_offsets[i];
      for (const UringFile::Span& s : places[i].spans) {
        method = copy_range(from, at, store[s.file], s.offset, s.length, method);
        at += s.length;
      }
    }
  } catch (...) {
    std::unique_lock lock(mu_);
    for (size_t i = 0; i < ids.size(); i++) {
      if (fresh[i] != kNoOffset) free_range_locked(fresh[i]);
      extent_locked(ids[i]).state = before[i];
    }
    done_cv_.notify_all();
    throw;
  }
  std::unique_lock lock(mu_);
  for (size_t i = 0; i < ids.size(); i++) {
    Extent& e = extent_locked(ids[i]);
    if (zero[i]) {
      e.state = Residency::kZero;
      finish_move_locked(e);
      continue;
    }
    for (uint64_t range : e.ranges()) free_range_locked(range);
    e.file_offset = fresh[i];
    e.next_offset = kNoOffset;
    e.state = Residency::kFile;
  }
  done_cv_.notify_all();
  return method;
}

// ---- epochs ----------------------------------------------------------------------------

uint64_t Pager::begin_epoch(const std::vector<ExtentId>& ids) {
  std::unique_lock lock(mu_);
  check_open_locked();
  std::vector<ExtentId> members = ids;
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  for (ExtentId id : members) {
    const Extent& e = extent_locked(id);
    if (e.segment) throw UsageError("a segment of PyTorch's allocator cannot be in an epoch");
    if (e.state != Residency::kZero && e.state != Residency::kFile) {
      throw UsageError("extent " + std::to_string(id) + " is resident or being paged: page it "
                       "out (and wait) before an epoch begins");
    }
    check_not_in_epoch_locked(e, id, "join another one");
  }
  const uint64_t epoch = next_epoch_++;
  for (ExtentId id : members) {
    Extent& e = extent_locked(id);
    e.epoch = epoch;
    e.committed_state = e.state;
    e.committed_offset = e.file_offset;
    e.committed_next = e.next_offset;
  }
  epochs_[epoch] = std::move(members);
  return epoch;
}

// The epoch's extents (those not released meanwhile), once none is being paged.
std::vector<Pager::Extent*> Pager::settled_epoch_locked(std::unique_lock<std::mutex>& lock,
                                                        uint64_t epoch) {
  check_open_locked();
  auto it = epochs_.find(epoch);
  if (it == epochs_.end()) throw UsageError("no open epoch " + std::to_string(epoch));
  std::vector<Extent*> members;
  done_cv_.wait(lock, [&] {
    members.clear();
    for (ExtentId id : it->second) {
      auto e = extents_.find(id);
      if (e == extents_.end() || e->second->epoch != epoch) continue;
      const Residency s = e->second->state;
      if (s == Residency::kPagingIn || s == Residency::kPagingOut) return false;
      members.push_back(e->second.get());
    }
    return true;
  });
  return members;
}

// Ends e's epoch. keep: what it holds now becomes committed; else it returns to what it
// committed. The ranges it no longer refers to are freed.
void Pager::end_epoch_locked(Extent& e, bool keep) {
  const std::vector<uint64_t> before = e.ranges();
  if (!keep) {
    if (e.state == Residency::kResident) pool_.unref(e.addr, e.bytes);
    e.state = e.committed_state;
    e.file_offset = e.committed_offset;
    e.next_offset = e.committed_next;
  }
  e.epoch = 0;
  e.committed_offset = e.committed_next = kNoOffset;
  const std::vector<uint64_t> now = e.ranges();
  for (uint64_t range : before) {
    if (std::find(now.begin(), now.end(), range) == now.end()) free_range_locked(range);
  }
}

void Pager::commit_epoch(uint64_t epoch) {
  std::unique_lock lock(mu_);
  for (Extent* e : settled_epoch_locked(lock, epoch)) end_epoch_locked(*e, true);
  epochs_.erase(epoch);
}

void Pager::abort_epoch(uint64_t epoch) {
  std::unique_lock lock(mu_);
  std::vector<Extent*> members = settled_epoch_locked(lock, epoch);
  if (std::any_of(members.begin(), members.end(),
                  [](const Extent* e) { return e->state == Residency::kResident; })) {
    lock.unlock();
    device_->synchronize();  // kernels may still use what is about to be unmapped
    lock.lock();
    members = settled_epoch_locked(lock, epoch);
  }
  for (Extent* e : members) end_epoch_locked(*e, false);
  epochs_.erase(epoch);
}

void Pager::close() {
  std::unique_lock lock(mu_);
  if (closed_) return;
  closed_ = true;
  done_cv_.wait(lock, [&] { return queue_.empty(); });
  stopping_ = true;
  work_cv_.notify_all();
  lock.unlock();
  if (io_thread_.joinable()) io_thread_.join();  // nothing before can throw: always joined
  // Every step is taken even when the device fails (a CUDA context with a sticky error),
  // so the store is deleted all the same; the first error is rethrown at the end.
  std::exception_ptr error;
  auto attempt = [&](auto&& step) {
    try {
      step();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  };
  attempt([&] { device_->synchronize(); });  // kernels may still be using resident tensors
  lock.lock();
  for (auto& [id, e] : extents_) {
    if (e->segment) continue;  // PyTorch's MemPool may still hand out its blocks
    if (e->state == Residency::kResident) attempt([&] { pool_.unref(e->addr, e->bytes); });
    e->state = Residency::kZero;
  }
  attempt([&] { pool_.trim(); });
  if (!slots_.empty()) {
    attempt([&] { device_->free_staging(slots_[0].buf, slots_.size() * options_.io_block_bytes); });
    slots_.clear();
  }
  file_.reset();
  attempt([&] { dir_->remove(); });
  if (error) std::rethrow_exception(error);
}

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
  for (const Ticket& job : queue_) {
    if (job->started || !waits_for_hold_locked(*job)) jobs.push_back(job);
  }
  lock.unlock();
  bool progressed = false;
  bool copies_pending = false;
  for (const Ticket& job : jobs) {
    if (job->started) continue;
    job->started = true;
    job->start_time = std::chrono::steady_clock::now();
    job->trace.start(io_range_name(job->out, job->discard, job->bytes_moved),
                     job->out ? TraceKind::kWrite : TraceKind::kRead);
    progressed = true;
    try {
      if (job->out) {
        for (uint64_t end : job->file_ends) file_->allocate(end);
      }
      for (auto [addr, bytes] : job->zero_fills) device_->fill_zero(addr, bytes);
      if (!job->zero_fills.empty()) job->fence = device_->record(CopyQueue::kToDevice);
      // A discard unmaps once the work queued before it on the caller's stream is done.
      if (job->discard) job->fence = device_->record(CopyQueue::kToHost);
    } catch (...) {
      job->error = std::current_exception();
    }
  }
  for (Slot& slot : slots_) {
    if (slot.job) continue;
    for (const Ticket& job : jobs) {
      if (job->error || job->next_chunk == job->chunks.size()) continue;
      slot.job = job.get();
      slot.chunk = &job->chunks[job->next_chunk++];
      job->chunks_in_flight++;
      start_chunk(slot);
      progressed = true;
      break;
    }
  }
  for (Slot& slot : slots_) {
    if (!slot.copy) continue;
    try {
      if (!device_->is_done(*slot.copy)) {
        copies_pending = true;
        continue;
      }
    } catch (...) {
      slot.job->error = std::current_exception();
    }
    device_->release_fence(*slot.copy);
    slot.copy.reset();
    progressed = true;
    if (slot.job->out && !slot.job->error) {
      file_->submit(UringFile::Request{slot.index, true, slot.buf, slot.chunk->file_bytes,
                                       slot.chunk->file_offset, 0});
    } else {
      finish_slot(slot, 0, 0);
    }
  }
  std::vector<UringFile::Completion> done;
  if (file_->in_flight() > 0) {
    const int64_t timeout_us = progressed ? 0 : copies_pending ? 20 : 500;
    file_->reap(&done, timeout_us);
  }
  for (const auto& c : done) {
    progressed = true;
    Slot& slot = slots_[c.tag];
    slot.job->requests++;
    if (c.error == 0 && !slot.job->out && !slot.job->error) {
      try {
        for (const Piece& p : slot.chunk->pieces) {
          device_->copy_to_device(p.addr, slot.buf + p.staging_offset, p.bytes);
        }
        slot.copy = device_->record(CopyQueue::kToDevice);
        continue;
      } catch (...) {
        slot.job->error = std::current_exception();
      }
    }
    finish_slot(slot, c.error, c.offset);
  }
  lock.lock();
  for (const Ticket& job : jobs) {
    const bool issued_all = job->error || job->next_chunk == job->chunks.size();
    if (!job->started || job->chunks_in_flight > 0 || !issued_all) continue;
    if (job->fence) {
      if (!device_->is_done(*job->fence)) continue;
      device_->release_fence(*job->fence);
      job->fence.reset();
    }
    complete(*job);
    progressed = true;
  }
  return progressed;
}

void Pager::start_chunk(Slot& slot) {
  const Chunk& chunk = *slot.chunk;
  try {
    if (slot.job->out) {
      size_t at = 0;
      for (const Piece& p : chunk.pieces) {
        std::memset(slot.buf + at, 0, p.staging_offset - at);  // padding between extents
        device_->copy_to_host(slot.buf + p.staging_offset, p.addr, p.bytes);
        at = p.staging_offset + p.bytes;
      }
      std::memset(slot.buf + at, 0, chunk.file_bytes - at);
      slot.copy = device_->record(CopyQueue::kToHost);
    } else {
      file_->submit(UringFile::Request{slot.index, false, slot.buf, chunk.file_bytes,
                                       chunk.file_offset, 0});
    }
  } catch (...) {
    slot.job->error = std::current_exception();
    finish_slot(slot, 0, 0);
  }
}

void Pager::finish_slot(Slot& slot, int error, uint64_t offset) {
  Job& job = *slot.job;
  if (error != 0 && !job.error) {
    try {
      if (error == ENODATA) {
        throw CorruptStoreError("store file " + path_of(offset) + " is truncated at offset " +
                                std::to_string(offset % UringFile::kRegionBytes) +
                                ": it holds fewer bytes than were paged out there. The store "
                                "was changed outside statepager; its state is lost.");
      }
      throw_io_error(error, job.out ? "page-out write" : "page-in read", path_of(offset),
                     offset % UringFile::kRegionBytes);
    } catch (...) {
      job.error = std::current_exception();
    }
  }
  job.chunks_in_flight--;
  slot.job = nullptr;
  slot.chunk = nullptr;
}

// Under the lock: the bucket's extents take their new state (or get their old one back).
void Pager::complete(Job& job) {
  const bool ok = !job.error;
  for (size_t i = 0; i < job.extents.size(); i++) {
    Extent& e = extent_locked(job.extents[i]);
    if (job.out) {
      e.state = !ok ? job.before[i] : job.discard ? Residency::kZero : Residency::kFile;
      if (ok && job.before[i] == Residency::kResident) pool_.unref(e.addr, e.bytes);
    } else {
      e.state = ok ? Residency::kResident : job.before[i];
      if (ok) finish_move_locked(e);
      if (!ok) pool_.unref(e.addr, e.bytes);
    }
  }
  if (ok) {
    const uint64_t file_bytes = job.bytes_moved;
    if (job.out) {
      counters_.bytes_written += file_bytes;
      counters_.write_requests += job.requests;
      counters_.buckets_out++;
    } else {
      counters_.bytes_read += file_bytes;
      counters_.read_requests += job.requests;
      counters_.buckets_in++;
      for (auto [addr, bytes] : job.zero_fills) counters_.zero_filled_bytes += bytes;
    }
  }
  if (job.out) outs_in_flight_--;
  job.end_time = std::chrono::steady_clock::now();
  job.trace.end();
  job.done = true;
  queue_.erase(std::find_if(queue_.begin(), queue_.end(),
                            [&](const Ticket& t) { return t.get() == &job; }));
  done_cv_.notify_all();
}

}  // namespace statepager
