#include "allocator/pager.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <tuple>

#include "allocator/trace_range.h"
#include "backing/errors.h"

namespace statepager {

namespace {

constexpr size_t kFileAlign = UringFile::kAlignment;
constexpr size_t kAddressAlign = 4096;

size_t align_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// An extent's own range in its store: whole file blocks, one at least.
size_t file_range_bytes(size_t bytes) { return align_up(std::max<size_t>(bytes, 1), kFileAlign); }

// Zero fills of adjacent extents (a tensor's, of 1 MiB each) as one: a fill is a memset
// queued on the page-in stream, between its copies (~4,700 a step of the 1.34 B GPT's
// q8 step apart, on the H200).
void add_zero_fill(std::vector<std::pair<uintptr_t, size_t>>& fills, uintptr_t addr,
                   size_t bytes) {
  if (!fills.empty() && fills.back().first + fills.back().second == addr) {
    fills.back().second += bytes;
  } else {
    fills.emplace_back(addr, bytes);
  }
}

}  // namespace

IoShape io_shape_for(bool direct_io) {
  return direct_io ? IoShape{64, size_t(4) << 20} : IoShape{32, size_t(1) << 20};
}

constexpr uint64_t kNoOffset = ~uint64_t{0};
constexpr uint64_t kNoUse = ~uint64_t{0};  // Extent::next_use not known

// Bytes nowhere, in a store file or in the host tier: no bucket is moving it.
bool at_rest(Residency s) {
  return s == Residency::kZero || s == Residency::kFile || s == Residency::kHost;
}

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
  uint64_t store_offset;                // its range in its store
  size_t file_bytes;
  uint64_t next_offset = kNoOffset;    // a FILE extent's range in the store it moves to
  Residency state = Residency::kZero;
  bool segment = false;  // PyTorch's: stays mapped until PyTorch frees it, even after close
  bool dead = false;     // released while its bucket was in flight: freed when it completes
  // In an open epoch (epoch != 0): what it was at the epoch's begin, its committed state.
  uint64_t epoch = 0;
  Residency committed_state = Residency::kZero;
  uint64_t committed_offset = kNoOffset;  // store_offset then: the committed bytes when FILE
  uint64_t committed_next = kNoOffset;    // next_offset then
  uint64_t host_offset = kNoOffset;       // HOST (or paging out to it): its host range
  uint64_t committed_host = kNoOffset;    // host_offset then
  uint64_t last_use = 0;  // Pager::use_clock_ at its last page-in, page-out or read-ahead
  // Pager::paged_in_bytes_ when it is expected to be paged in again (its last page-out's
  // reuse_after hint), or kNoUse.
  uint64_t next_use = kNoUse;
  bool tier_moving = false;  // being spilled or read ahead (a Job with spills or tier_move)
  Residency restore_from = Residency::kZero;  // its state before a restore (see begin_restore)
  ExtentId next_piece = 0;  // create_pieces(): the tensor's next piece (0: none)

  // The store ranges it refers to now, and in an epoch also those it committed.
  std::vector<uint64_t> ranges() const {
    std::vector<uint64_t> out;
    for (uint64_t r : {store_offset, next_offset, committed_offset, committed_next, host_offset,
                       committed_host}) {
      if (r != kNoOffset && std::find(out.begin(), out.end(), r) == out.end()) out.push_back(r);
    }
    return out;
  }
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
  if (options_.host_budget_bytes > kMaxHostBudget) {
    throw UsageError("host_budget (PagerOptions::host_budget_bytes) " +
                     std::to_string(options_.host_budget_bytes) + " is not allowed: it must be "
                     "0 (no host tier) to " + std::to_string(kMaxHostBudget) + " (128 TiB)");
  }
  // A file-size limit must surface as EFBIG on the write, not kill the process.
  std::signal(SIGXFSZ, SIG_IGN);
  dir_ = std::make_unique<StoreDir>(options_.directory);
  const unsigned ring_depth = options_.io_depth != 0
                                  ? options_.io_depth
                                  : std::max(io_shape_for(true).depth, io_shape_for(false).depth);
  // A store mapped for the device's copies (map_ram) is kept whole: striped, a bucket's
  // extent would go as one copy per 1 MiB unit (each costs the I/O thread about 9 us).
  // With a host tier too: what the tier cannot hold goes to the mapped store every step,
  // while its spills (io_uring writes from host memory, one inode's rate) are rare.
  const bool stripe_ram = !options_.map_ram;
  file_ = std::make_unique<UringFile>(
      dir_->store_file(""),
      UringFile::Options{ring_depth, options_.try_direct, true, stripe_ram});
  const IoShape shape = io_shape_for(file_->direct());
  if (options_.io_depth == 0) options_.io_depth = shape.depth;
  if (options_.io_block_bytes == 0) options_.io_block_bytes = shape.block_bytes;
  add_store_locked("");  // the default store: file 0 of file_
  store_tier_ = std::make_unique<StoreTier>(*device_, *file_, options_.io_depth,
                                            options_.io_block_bytes, options_.map_ram);
  if (options_.host_budget_bytes > 0) {
    try {
      host_tier_ = std::make_shared<HostTier>(*device_, options_.host_budget_bytes);
    } catch (const OutOfMemoryError& e) {
      throw OutOfMemoryError("host_budget " + std::to_string(options_.host_budget_bytes) +
                             " bytes of pinned host memory could not be allocated (" +
                             e.what() + "): pass a smaller host_budget");
    }
  }
  counters_.host_budget_bytes = options_.host_budget_bytes;
  counters_.direct_io = file_->direct();
  counters_.io_depth = options_.io_depth;
  counters_.io_block_bytes = options_.io_block_bytes;
  io_thread_ = std::thread([this] { run_io_thread(); });
  map_thread_ = std::thread([this] { run_map_thread(); });
  // Named for profilers and for the benches' count of CPU time per thread
  // (statepager/bench/cpu_use.py); io_uring's own workers are named iou-wrk-<tid>.
  pthread_setname_np(io_thread_.native_handle(), "statepager-io");
  pthread_setname_np(map_thread_.native_handle(), "statepager-map");
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

ExtentId Pager::create(size_t bytes, unsigned store) { return create_pieces({bytes}, store)[0]; }

std::vector<ExtentId> Pager::create_pieces(const std::vector<size_t>& pieces, unsigned store) {
  size_t total = 0;
  for (size_t i = 0; i < pieces.size(); i++) {
    const bool last = i + 1 == pieces.size();
    if ((!last && pieces[i] % kAddressAlign != 0) || (pieces.size() > 1 && pieces[i] == 0)) {
      throw UsageError("piece " + std::to_string(i) + " of " + std::to_string(pieces[i]) +
                       " bytes: every piece of a tensor but the last must be a multiple of " +
                       std::to_string(kAddressAlign) + " bytes, and none of several empty");
    }
    total += pieces[i];
  }
  if (pieces.empty()) throw UsageError("a tensor of no pieces");
  std::unique_lock lock(mu_);
  check_open_locked();
  check_store_locked(store);
  if (total > pool_.arena_bytes()) {
    throw UsageError("a tensor of " + std::to_string(total) + " bytes is larger than the "
                     "pager's whole address arena (arena_size " +
                     std::to_string(pool_.arena_bytes()) + " bytes): create the Pager with "
                     "a larger arena_size");
  }
  // The file ranges, then the address range: what can fail, undone if it does.
  std::vector<uint64_t> offsets;
  uintptr_t addr;
  try {
    for (size_t bytes : pieces) {
      offsets.push_back(stores_[store]->space.allocate(file_range_bytes(bytes), kFileAlign));
    }
    addr = pool_.allocate(std::max<size_t>(total, 1), kAddressAlign);
  } catch (...) {
    for (uint64_t offset : offsets) stores_[store]->space.free(offset);
    throw;
  }
  std::vector<ExtentId> ids;
  for (size_t i = 0; i < pieces.size(); i++) {
    if (i + 1 < pieces.size()) pool_.split(addr, pieces[i]);
    auto e = std::make_unique<Extent>();
    e->addr = addr;
    e->bytes = pieces[i];
    e->file_bytes = file_range_bytes(pieces[i]);
    e->store_offset = offsets[i];
    const ExtentId id = next_id_++;
    if (!ids.empty()) extents_[ids.back()]->next_piece = id;
    by_address_[addr] = id;
    extents_[id] = std::move(e);
    ids.push_back(id);
    addr += pieces[i];
  }
  return ids;
}

std::vector<ExtentId> Pager::pieces(ExtentId first) const {
  std::unique_lock lock(mu_);
  std::vector<ExtentId> ids{first};
  for (ExtentId next = extent_locked(first).next_piece; next != 0;
       next = extent_locked(next).next_piece) {
    ids.push_back(next);
  }
  return ids;
}

std::vector<ExtentId> Pager::extents_in(const std::vector<ByteRange>& ranges,
                                        size_t* unknown) const {
  std::unique_lock lock(mu_);
  std::vector<ExtentId> ids;
  ids.reserve(ranges.size());
  for (size_t i = 0; i < ranges.size(); i++) {
    const ByteRange& r = ranges[i];
    auto it = by_address_.find(r.storage);
    if (it == by_address_.end() || extent_locked(it->second).segment) {
      *unknown = i;
      return {};
    }
    if (extent_locked(it->second).next_piece == 0) {
      ids.push_back(it->second);
      continue;
    }
    for (ExtentId id = it->second; id != 0; id = extent_locked(id).next_piece) {
      const Extent& e = extent_locked(id);
      if (e.addr >= r.end) break;  // pieces lie in address order
      if (e.addr + e.bytes > r.begin) ids.push_back(id);
    }
  }
  return ids;
}

uintptr_t Pager::create_segment(size_t bytes) {
  const ExtentId id = create(bytes);
  std::unique_lock lock(mu_);
  Extent& e = extent_locked(id);
  try {
    while (!pool_.ref(e.addr, e.bytes, true)) {  // a page of it is being mapped: wait
      done_cv_.wait(lock);
      check_open_locked();
    }
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
  if (extent_locked(id).state == Residency::kResident && !closed_) {
    // As cudaFree does: work queued before the tensor died (a kernel on any stream) may
    // still read or write its pages, which the release unmaps. A broken device (its
    // error rethrown after) has no work left to wait for.
    std::exception_ptr error;
    lock.unlock();
    try {
      device_->synchronize();
    } catch (const DeviceError&) {
      error = std::current_exception();
    }
    lock.lock();
    release_locked(id);  // pause() may have begun paging it out meanwhile
    if (error) std::rethrow_exception(error);
    return;
  }
  release_locked(id);
}

void Pager::release_locked(ExtentId id) {
  Extent& e = extent_locked(id);
  // A tensor may die while its bucket is in flight (its page-out may even wait for a
  // range a save holds): never wait here, the bucket frees it when it completes.
  if (e.state == Residency::kPagingIn || e.state == Residency::kPagingOut || e.tier_moving) {
    e.dead = true;
    return;
  }
  free_extent_locked(id);
}

void Pager::free_extent_locked(ExtentId id) {
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
    const uint64_t now = e.next_offset != kNoOffset ? e.next_offset : e.store_offset;
    if (store_index(now) != store) check_not_in_epoch_locked(e, id, "change stores");
  }
  for (ExtentId id : ids) {
    Extent& e = extent_locked(id);
    const uint64_t now = e.next_offset != kNoOffset ? e.next_offset : e.store_offset;
    if (store_index(now) == store) continue;
    if (e.next_offset != kNoOffset) {  // a move not done yet goes elsewhere
      free_range_locked(e.next_offset);
      e.next_offset = kNoOffset;
      if (store_index(e.store_offset) == store) continue;
    }
    const uint64_t to = stores_[store]->space.allocate(e.file_bytes, kFileAlign);
    if (e.state == Residency::kFile) {
      e.next_offset = to;  // its bytes are read from the old range once more
    } else {
      free_range_locked(e.store_offset);
      e.store_offset = to;
    }
  }
}

unsigned Pager::store_of(ExtentId id) const {
  std::unique_lock lock(mu_);
  const Extent& e = extent_locked(id);
  return store_index(e.next_offset != kNoOffset ? e.next_offset : e.store_offset);
}

// A range a save holds is freed once it is copied (unhold()): until then nothing may be
// written into it. punch_bytes > 0: its blocks go back to the filesystem (its extent is
// gone; ranges freed by steps are not punched, the next step writes them again).
void Pager::free_range_locked(uint64_t store_offset, size_t punch_bytes) {
  if (held_.count(store_offset) != 0) {
    freed_held_[store_offset] = punch_bytes;
    return;
  }
  if (HostTier::is_host(store_offset)) {
    if (host_tier_) host_tier_->free(store_offset);  // none once closed
    return;
  }
  if (punch_bytes > 0 && store_tier_) store_tier_->punch(store_offset, punch_bytes);
  stores_[store_index(store_offset)]->space.free(store_offset);
}

// The extent's bytes are no longer needed in its old store: it now lives in the new one.
// In an epoch the old range holds the committed bytes: the epoch's end frees it.
void Pager::finish_move_locked(Extent& e) {
  if (e.next_offset == kNoOffset) return;
  if (e.store_offset != e.committed_offset) free_range_locked(e.store_offset);
  e.store_offset = e.next_offset;
  e.next_offset = kNoOffset;
}

// The extent no longer uses its host range (paged in, discarded, or a page-out failed);
// in an epoch a range holding committed bytes stays until the epoch ends.
void Pager::drop_host_locked(Extent& e) {
  if (e.host_offset == kNoOffset) return;
  if (e.host_offset != e.committed_host) free_range_locked(e.host_offset);
  e.host_offset = kNoOffset;
}

void Pager::check_not_in_epoch_locked(const Extent& e, ExtentId id, const char* what) const {
  if (e.epoch != 0) {
    throw UsageError("extent " + std::to_string(id) + " is in an open epoch (a step is "
                     "running): it cannot " + what + " until the epoch ends");
  }
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

Ticket Pager::page_out(const std::vector<ExtentId>& bucket, uintptr_t stream,
                        uint64_t reuse_after) {
  return submit(bucket, true, stream, false, reuse_after);
}

Ticket Pager::discard(const std::vector<ExtentId>& bucket, uintptr_t stream) {
  return submit(bucket, true, stream, true);
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
        const Extent& e = extent_locked(ids[taken]);
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
    check_open_locked();  // close() does not wait for a submit that waits here
  }
}

void Pager::unref_pages_locked(const std::vector<ExtentId>& ids, size_t count) {
  for (size_t i = 0; i < count; i++) {
    const Extent& e = extent_locked(ids[i]);
    pool_.unref(e.addr, e.bytes);
  }
}

// The map thread: maps each queued page-in's pages (Job::maps) without the lock, then
// queues the job for the I/O thread. The submitting thread does not wait for the mapping:
// cuMemSetAccess takes about 1 ms a page while a device-to-host copy runs
// (docs/DESIGN-NOTES.md, "Mapping costs"), and a streamed step always has one running.
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
    Extent& e = extent_locked(job.extents[i]);
    e.state = job.before[i];
    if (e.dead && !e.tier_moving) free_extent_locked(job.extents[i]);  // released meanwhile
  }
  job.error = error;
  job.done = true;
}

Ticket Pager::submit(const std::vector<ExtentId>& bucket, bool out, uintptr_t stream,
                     bool discard, uint64_t reuse_after) {
  std::unique_lock lock(mu_);
  check_open_locked();
  auto job = std::make_shared<Job>();
  job->out = out;
  job->discard = discard;
  std::vector<ExtentId> ids = bucket;
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  wait_tier_moves_locked(lock, ids);
  for (ExtentId id : ids) {
    const Residency s = extent_locked(id).state;
    if (s == Residency::kPagingIn || s == Residency::kPagingOut) {
      throw UsageError("extent " + std::to_string(id) +
                       " is already being paged by another bucket: wait for that bucket first");
    }
    extent_locked(id).last_use = ++use_clock_;
    const bool at_rest_with_bytes = s == Residency::kFile || s == Residency::kHost;
    const bool moves = !out ? s != Residency::kResident
                            : s == Residency::kResident || (discard && at_rest_with_bytes);
    if (moves) job->extents.push_back(id);
  }
  // The clock and hints of the spill choice; an extent already at rest keeps its hint.
  if (!out) {
    for (ExtentId id : ids) paged_in_bytes_ += extent_locked(id).bytes;
  } else {
    for (ExtentId id : job->extents) {
      extent_locked(id).next_use = reuse_after > 0 ? paged_in_bytes_ + reuse_after : kNoUse;
    }
  }
  if (out) device_->wait_for_stream(CopyQueue::kToHost, stream);
  if (out && !discard) {
    try {
      redirect_writes_locked(place_outs_locked(*job));
    } catch (...) {  // the store has no room left: nothing moves
      for (ExtentId id : job->extents) drop_host_locked(extent_locked(id));
      for (ExtentId id : job->spills) {
        extent_locked(id).state = Residency::kHost;
        extent_locked(id).tier_moving = false;
      }
      throw;
    }
  }
  for (ExtentId id : job->extents) {
    Extent& e = extent_locked(id);
    job->before.push_back(e.state);
    if (!out && e.state == Residency::kZero) add_zero_fill(job->zero_fills, e.addr, e.bytes);
    if (!out && e.state == Residency::kHost) {
      job->host_copies.push_back(HostCopy{e.addr, host_tier_->host(e.host_offset), e.bytes});
      job->host_bytes += e.bytes;
    }
    e.state = out ? Residency::kPagingOut : Residency::kPagingIn;
  }
  if (!out) {
    try {
      ref_pages_locked(lock, job->extents, &job->maps);
    } catch (...) {
      if (closed_) throw;  // closed while it waited: close() lets every extent go
      std::vector<ExtentId> released;  // by release() while it waited for room
      for (size_t i = 0; i < job->extents.size(); i++) {
        Extent& e = extent_locked(job->extents[i]);
        e.state = job->before[i];
        if (e.dead && !e.tier_moving) released.push_back(job->extents[i]);
      }
      for (ExtentId id : released) free_extent_locked(id);
      done_cv_.notify_all();
      throw;
    }
  }
  if (!discard) plan_locked(*job);
  if (job->extents.empty()) {
    job->done = true;
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

// Where each extent of a page-out goes: into a fresh host range while the host tier has
// room (a page-out never writes a host range in use, so committed host bytes stay as they
// are); short of room, after spills of the least recently used HOST extents (deferred,
// after[i] kResident until place_deferred_locked() decides); else to its store range.
// Returns those going to the store now.
std::vector<ExtentId> Pager::place_outs_locked(Job& job) {
  std::vector<ExtentId> to_store;
  size_t short_bytes = 0;
  for (ExtentId id : job.extents) {
    Extent& e = extent_locked(id);
    std::optional<uint64_t> range;
    if (host_tier_) range = host_tier_->allocate(e.file_bytes);
    if (!range && host_tier_ && e.file_bytes <= host_tier_->budget_bytes()) {
      job.after.push_back(Residency::kResident);
      job.deferred.push_back(id);
      short_bytes += e.file_bytes;
      continue;
    }
    if (!range) {
      job.after.push_back(Residency::kFile);
      to_store.push_back(id);
      continue;
    }
    e.host_offset = *range;
    // Past its bytes a range holds zeros, as a store range does (checkpoints copy them).
    std::memset(host_tier_->host(*range) + e.bytes, 0, e.file_bytes - e.bytes);
    job.after.push_back(Residency::kHost);
    job.host_copies.push_back(HostCopy{e.addr, host_tier_->host(*range), e.bytes});
    job.host_bytes += e.bytes;
  }
  if (!job.deferred.empty()) choose_spills_locked(job, short_bytes);
  if (job.spills.empty()) {  // no room to make: the store takes them now
    for (size_t i = 0; i < job.extents.size(); i++) {
      if (job.after[i] != Residency::kResident) continue;
      job.after[i] = Residency::kFile;
      to_store.push_back(job.extents[i]);
    }
    job.deferred.clear();
  }
  return to_store;
}

// HOST extents whose host range no save holds, until their ranges add up to short_bytes
// (see the class comment for the order): the job writes them back before placing its
// deferred extents. They are 'paging_out' (tier_moving) meanwhile.
void Pager::choose_spills_locked(Job& job, size_t short_bytes) {
  uint64_t needed = kNoUse;  // when the job's own extents are needed next, if known
  for (ExtentId id : job.deferred) needed = std::min(needed, extent_locked(id).next_use);
  // Ordered by (hinted, hinted: farthest next use first, else least recently used).
  std::vector<std::tuple<bool, uint64_t, ExtentId>> order;
  for (const auto& [id, e] : extents_) {
    if (e->state != Residency::kHost || held_.count(e->host_offset) != 0) continue;
    if (e->next_use == kNoUse) {
      order.emplace_back(false, e->last_use, id);
    } else if (needed == kNoUse || e->next_use > needed) {
      order.emplace_back(true, kNoUse - e->next_use, id);
    }
  }
  std::sort(order.begin(), order.end());
  size_t freed = 0;
  for (auto [known, rank, id] : order) {
    if (freed >= short_bytes) break;
    job.spills.push_back(id);
    freed += extent_locked(id).file_bytes;
  }
  redirect_writes_locked(job.spills);  // committed store bytes are never overwritten
  for (ExtentId id : job.spills) {
    extent_locked(id).state = Residency::kPagingOut;
    extent_locked(id).tier_moving = true;
  }
}

// Phase two of a page-out short of host room, once its spills are written: they let
// their host ranges go and the deferred extents take what room there is; the rest goes
// to the store. start_job() starts the work added (job.restart).
void Pager::place_deferred_locked(Job& job) {
  job.placed = true;
  for (ExtentId id : job.spills) {
    Extent& e = extent_locked(id);
    counters_.spills++;
    counters_.spilled_bytes += e.bytes;
    spilled_locked(e);
  }
  std::vector<ExtentId> to_store;
  for (size_t i = 0; i < job.extents.size(); i++) {
    if (job.after[i] != Residency::kResident) continue;  // placed at submit
    Extent& e = extent_locked(job.extents[i]);
    const std::optional<uint64_t> range = host_tier_->allocate(e.file_bytes);
    if (!range) {
      job.after[i] = Residency::kFile;
      to_store.push_back(job.extents[i]);
      continue;
    }
    e.host_offset = *range;
    std::memset(host_tier_->host(*range) + e.bytes, 0, e.file_bytes - e.bytes);
    job.after[i] = Residency::kHost;
    job.host_copies.push_back(HostCopy{e.addr, host_tier_->host(*range), e.bytes});
    job.host_bytes += e.bytes;
  }
  redirect_writes_locked(to_store);
  std::vector<StoreTier::Move> moves;
  for (ExtentId id : to_store) {
    const Extent& e = extent_locked(id);
    moves.push_back(StoreTier::Move{e.addr, e.bytes, e.store_offset, e.file_bytes});
  }
  store_tier_->plan(job, std::move(moves));
  job.held_back = waits_for_hold_locked(job);
  job.restart = true;
}

// A spill landed: the extent's bytes are in its store range, its host range goes. In an
// epoch whose committed bytes were that host range, the store range holds them now.
void Pager::spilled_locked(Extent& e) {
  if (e.epoch != 0 && e.host_offset == e.committed_host) {
    e.committed_state = Residency::kFile;
    e.committed_offset = e.store_offset;
    e.committed_host = kNoOffset;
  }
  drop_host_locked(e);
  e.state = Residency::kFile;
  e.tier_moving = false;
}

// Waits until none of `ids` is being spilled or read ahead.
void Pager::wait_tier_moves_locked(std::unique_lock<std::mutex>& lock,
                                   const std::vector<ExtentId>& ids) {
  done_cv_.wait(lock, [&] {
    for (ExtentId id : ids) {
      auto it = extents_.find(id);
      if (it != extents_.end() && it->second->tier_moving) return false;
    }
    return true;
  });
}

Ticket Pager::read_ahead(const std::vector<ExtentId>& bucket) {
  std::unique_lock lock(mu_);
  check_open_locked();
  auto job = std::make_shared<Job>();
  job->tier_move = true;
  std::vector<ExtentId> ids = bucket;
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  wait_tier_moves_locked(lock, ids);
  for (ExtentId id : ids) {
    Extent& e = extent_locked(id);
    if (!host_tier_ || e.state != Residency::kFile) continue;
    const std::optional<uint64_t> range = host_tier_->allocate(e.file_bytes);
    if (!range) break;  // no room: the rest stays FILE
    e.host_offset = *range;
    e.state = Residency::kPagingIn;
    e.tier_moving = true;
    e.last_use = ++use_clock_;
    job->extents.push_back(id);
    job->before.push_back(Residency::kFile);
  }
  plan_locked(*job);
  if (job->extents.empty()) {
    job->done = true;
    return job;
  }
  queue_.push_back(job);
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
          e.store_offset != e.committed_offset) {
        continue;
      }
      Arena& space = stores_[store_index(e.store_offset)]->space;
      fresh.emplace_back(&e, space.allocate(e.file_bytes, kFileAlign));
    }
  } catch (...) {
    for (auto [e, range] : fresh) free_range_locked(range);
    throw;
  }
  for (auto [e, range] : fresh) e->store_offset = range;
}

// The bucket's moves to or from the store files.
void Pager::plan_locked(Job& job) {
  std::vector<StoreTier::Move> moves;
  auto host_move = [&](const Extent& e) {
    moves.push_back(StoreTier::Move{0, e.bytes, e.store_offset, e.file_bytes,
                                    host_tier_->host(e.host_offset)});
  };
  for (ExtentId id : job.spills) host_move(extent_locked(id));
  for (size_t i = 0; i < job.extents.size(); i++) {
    const Extent& e = extent_locked(job.extents[i]);
    if (job.tier_move) {
      host_move(e);
      continue;
    }
    const bool to_store = job.out ? job.after[i] == Residency::kFile
                                  : job.before[i] == Residency::kFile;
    if (to_store) {
      moves.push_back(StoreTier::Move{e.addr, e.bytes, e.store_offset, e.file_bytes});
    }
  }
  store_tier_->plan(job, std::move(moves));
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
    if (e->state == Residency::kHost) s.host_bytes += e->bytes;
  }
  s.host_used_bytes = host_tier_ ? host_tier_->used_bytes() : 0;
  s.store_mapped_bytes = store_tier_ ? store_tier_->mapped_bytes() : 0;
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

// kNoOffset: a placement without bytes at rest (no spans).
Placement Pager::placement_locked(const Extent& e, uint64_t store_offset) const {
  Placement p;
  p.state = e.state;
  p.bytes = e.bytes;
  p.store_offset = store_offset;
  p.store_bytes = align_up(e.bytes, kFileAlign);
  if (HostTier::is_host(store_offset) && store_offset != kNoOffset) {
    p.host = host_tier_->host(store_offset);
  } else if (store_offset != kNoOffset) {
    p.spans = file_->spans(p.store_offset, p.store_bytes);
  }
  return p;
}

std::vector<Placement> Pager::hold(const std::vector<ExtentId>& ids) {
  std::unique_lock lock(mu_);
  check_open_locked();
  if (!held_.empty()) {
    throw UsageError("a checkpoint copy still holds ranges of this Pager's store: wait for it "
                     "to finish before taking another");
  }
  wait_tier_moves_locked(lock, ids);
  std::vector<Placement> out;
  for (ExtentId id : ids) {
    const Extent& e = extent_locked(id);
    if (!at_rest(e.state)) {
      throw UsageError("extent " + std::to_string(id) + " is resident or being paged: page it "
                       "out (and wait) before copying the store");
    }
    check_not_in_epoch_locked(e, id, "be copied");
    out.push_back(placement_locked(e, e.state == Residency::kHost ? e.host_offset : e.store_offset));
  }
  for (const Placement& p : out) {
    if (p.state != Residency::kZero && p.store_bytes > 0) {
      held_[p.store_offset] = p.store_offset + p.store_bytes;
    }
  }
  return out;
}

std::shared_ptr<const HostTier> Pager::host_memory() const {
  std::unique_lock lock(mu_);
  return host_tier_;
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
    auto next = held_.upper_bound(c.store_offset);  // ranges are disjoint: check two
    const bool before = next != held_.begin() && std::prev(next)->second > c.store_offset;
    const bool after = next != held_.end() && next->first < c.store_offset + c.file_bytes;
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

std::vector<Placement> Pager::begin_restore(const std::vector<ExtentId>& ids,
                                            const std::vector<bool>& zero) {
  std::unique_lock lock(mu_);
  check_open_locked();
  wait_tier_moves_locked(lock, ids);
  for (ExtentId id : ids) {
    const Extent& e = extent_locked(id);
    if (!at_rest(e.state)) {
      throw UsageError("extent " + std::to_string(id) + " is resident or being paged: page "
                       "it out or discard it (and wait) before restoring it");
    }
    if (held_.count(e.store_offset) != 0 || held_.count(e.host_offset) != 0) {
      throw UsageError("a checkpoint copy still holds the store range of extent " +
                       std::to_string(id) + ": wait for the save to finish first");
    }
    check_not_in_epoch_locked(e, id, "be restored");
  }
  std::vector<uint64_t> fresh(ids.size(), kNoOffset);  // where the new bytes go
  try {
    for (size_t i = 0; i < ids.size(); i++) {
      if (zero[i]) continue;
      const Extent& e = extent_locked(ids[i]);
      // In the store it moves to, if it moves: the move is done once the bytes are there.
      const uint64_t now = e.next_offset != kNoOffset ? e.next_offset : e.store_offset;
      fresh[i] = stores_[store_index(now)]->space.allocate(e.file_bytes, kFileAlign);
    }
  } catch (...) {
    for (uint64_t range : fresh) {
      if (range != kNoOffset) free_range_locked(range);
    }
    throw;
  }
  std::vector<Placement> places(ids.size());
  for (size_t i = 0; i < ids.size(); i++) {
    Extent& e = extent_locked(ids[i]);
    places[i] = zero[i] ? placement_locked(e, kNoOffset) : placement_locked(e, fresh[i]);
    places[i].state = zero[i] ? Residency::kZero : Residency::kFile;
    e.restore_from = e.state;
    e.state = Residency::kPagingIn;
  }
  return places;
}

void Pager::end_restore(const std::vector<ExtentId>& ids, const std::vector<Placement>& places,
                        bool ok) {
  std::unique_lock lock(mu_);
  for (size_t i = 0; i < ids.size(); i++) {
    Extent& e = extent_locked(ids[i]);
    const bool zero = places[i].state == Residency::kZero;
    if (!ok) {
      if (!zero) free_range_locked(places[i].store_offset);
      e.state = e.restore_from;
    } else if (zero) {
      drop_host_locked(e);
      e.state = Residency::kZero;
      finish_move_locked(e);
    } else {
      drop_host_locked(e);
      for (uint64_t range : e.ranges()) free_range_locked(range);
      e.store_offset = places[i].store_offset;
      e.next_offset = kNoOffset;
      e.state = Residency::kFile;
    }
  }
  done_cv_.notify_all();
}

// ---- epochs ----------------------------------------------------------------------------

uint64_t Pager::begin_epoch(const std::vector<ExtentId>& ids) {
  std::unique_lock lock(mu_);
  check_open_locked();
  std::vector<ExtentId> members = ids;
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  wait_tier_moves_locked(lock, members);
  for (ExtentId id : members) {
    const Extent& e = extent_locked(id);
    if (e.segment) throw UsageError("a segment of PyTorch's allocator cannot be in an epoch");
    if (!at_rest(e.state)) {
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
    e.committed_offset = e.store_offset;
    e.committed_next = e.next_offset;
    e.committed_host = e.host_offset;
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
    e.store_offset = e.committed_offset;
    e.next_offset = e.committed_next;
    e.host_offset = e.committed_host;
  }
  e.epoch = 0;
  e.committed_offset = e.committed_next = e.committed_host = kNoOffset;
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
  done_cv_.wait(lock, [&] { return queue_.empty() && maps_in_flight_ == 0; });
  stopping_ = true;
  work_cv_.notify_all();
  map_cv_.notify_all();
  lock.unlock();
  // Nothing before can throw: always joined.
  if (io_thread_.joinable()) io_thread_.join();
  if (map_thread_.joinable()) map_thread_.join();
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
    e->host_offset = e->committed_host = kNoOffset;  // the host tier goes below
  }
  attempt([&] { pool_.trim(); });
  store_tier_.reset();  // frees the staging memory
  host_tier_.reset();   // its memory lives on while a StoreSnapshot still holds it
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
  std::vector<Job*> running;  // those whose chunks may be issued
  for (const Ticket& job : queue_) {
    if (job->held_back && !waits_for_hold_locked(*job)) job->held_back = false;
    if (job->started || !waits_for_hold_locked(*job)) {
      jobs.push_back(job);
      if (!job->held_back) running.push_back(job.get());
    }
  }
  lock.unlock();
  bool progressed = false;
  for (Job* job : running) {
    if (job->started && !job->restart) continue;
    start_job(*job);
    progressed = true;
  }
  progressed = store_tier_->pump(running, progressed);
  lock.lock();
  for (const Ticket& job : jobs) {
    const bool issued_all = job->error || job->next_chunk == job->chunks.size();
    if (!job->started || job->restart || job->chunks_in_flight > 0 || !issued_all) continue;
    if (job->fence && !fence_passed_locked(*job)) continue;
    progressed = true;
    if (!job->error && !job->deferred.empty() && !job->placed) {
      try {
        place_deferred_locked(*job);
        continue;
      } catch (...) {
        job->error = std::current_exception();
      }
    }
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

// Starts a job's work, or the work place_deferred_locked() added (job.restart). Without
// the lock: the fields it touches are the I/O thread's.
void Pager::start_job(Job& job) {
  if (!job.started) {
    job.started = true;
    job.start_time = std::chrono::steady_clock::now();
    job.trace.start(io_range_name(job.out, job.discard, job.bytes_moved),
                    job.out ? TraceKind::kWrite : TraceKind::kRead);
  }
  job.restart = false;
  try {
    store_tier_->start(job);
    if (host_tier_) host_tier_->start(job);
    for (auto [addr, bytes] : job.zero_fills) device_->fill_zero(addr, bytes);
    // A discard unmaps once the work queued before it on the caller's stream is done.
    if (!job.zero_fills.empty() || !job.host_copies.empty() || job.discard) {
      job.fence = device_->record(job.out ? CopyQueue::kToHost : CopyQueue::kToDevice);
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
  if (!ok && !job.placed) {  // spills not landed: their host bytes stay
    for (ExtentId id : job.spills) {
      extent_locked(id).state = Residency::kHost;
      extent_locked(id).tier_moving = false;
    }
  }
  for (size_t i = 0; i < job.extents.size(); i++) {
    Extent& e = extent_locked(job.extents[i]);
    if (job.tier_move) {  // a read-ahead
      e.tier_moving = false;
      e.state = ok ? Residency::kHost : Residency::kFile;
      if (ok) finish_move_locked(e);
      if (!ok) drop_host_locked(e);
    } else if (job.out) {
      e.state = !ok ? job.before[i] : job.discard ? Residency::kZero : job.after[i];
      if (ok && job.before[i] == Residency::kResident) unref_quietly_locked(e);
      // A failed page-out lets its fresh host range go; a discard, the host bytes.
      if (ok ? job.discard : !job.discard && job.after[i] == Residency::kHost) {
        drop_host_locked(e);
      }
    } else {
      e.state = ok ? Residency::kResident : job.before[i];
      if (ok) finish_move_locked(e);
      if (ok) drop_host_locked(e);
      if (!ok) unref_quietly_locked(e);
    }
  }
  if (ok) {
    const uint64_t file_bytes = job.bytes_moved;
    if (job.out) {
      counters_.bytes_to_host += job.host_bytes;
      counters_.bytes_written += file_bytes;
      counters_.write_requests += job.requests;
      counters_.mapped_written_bytes += job.mapped_bytes;
      counters_.buckets_out++;
    } else if (job.tier_move) {
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
      for (auto [addr, bytes] : job.zero_fills) counters_.zero_filled_bytes += bytes;
    }
  }
  for (const auto* ids : {&job.extents, &job.spills}) {
    for (ExtentId id : *ids) {
      const Extent& e = extent_locked(id);
      if (e.dead && !e.tier_moving && e.state != Residency::kPagingIn &&
          e.state != Residency::kPagingOut) {
        free_extent_locked(id);
      }
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
