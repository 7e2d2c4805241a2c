// Pager: construction, the extent table (extents, pieces, segments, stores), queries,
// stats and close. Buckets and the I/O thread are in pager_jobs.cc, the host tier's
// placement in pager_host.cc, holds, restores and epochs in pager_epochs.cc.
#include "allocator/pager.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <limits>

#include "allocator/pager_internal.h"
#include "backing/errors.h"

namespace statepager {

IoShape io_shape_for(bool direct_io) {
  return direct_io ? IoShape{64, size_t(4) << 20} : IoShape{32, size_t(1) << 20};
}

Pager::Pager(std::unique_ptr<Device> device, PagerOptions options)
    : owner_(::getpid()),
      device_(std::move(device)),
      options_(std::move(options)),
      pool_owner_(std::make_unique<Pool>(*device_, options_.pool)),
      pool_(*pool_owner_),
      sync_(std::make_unique<Sync>()),
      mu_(sync_->mu),
      work_cv_(sync_->work),
      map_cv_(sync_->map),
      done_cv_(sync_->done) {
  if (options_.io_depth > kMaxIoDepth) {
    throw UsageError("io_depth " + std::to_string(options_.io_depth) +
                     " is not allowed: it must be 1 to " + std::to_string(kMaxIoDepth) +
                     " (0 or None: chosen for the medium)");
  }
  if (options_.io_block % kFileAlign != 0 || options_.io_block > kMaxIoBlockBytes) {
    throw UsageError("io_block " +
                     std::to_string(options_.io_block) + " is not allowed: it must be a "
                     "multiple of 4096 up to " + std::to_string(kMaxIoBlockBytes) +
                     " (256 MiB) (0 or None: chosen for the medium)");
  }
  if (options_.host_budget > kMaxHostBudget) {
    throw UsageError("host_budget " +
                     std::to_string(options_.host_budget) + " is not allowed: it must be "
                     "0 (no host tier) to " + std::to_string(kMaxHostBudget) + " (128 TiB)");
  }
  // A file-size limit must surface as EFBIG on the write, not kill the process.
  std::signal(SIGXFSZ, SIG_IGN);
  dir_ = std::make_unique<StoreDir>(options_.directory);
  try {
    open_stores();
  } catch (...) {
    // A Pager that could not be made (a full disk, too large a host budget) leaves no
    // store behind.
    store_tier_.reset();
    host_tier_.reset();
    file_.reset();
    try {
      dir_->remove();
    } catch (...) {
    }
    throw;
  }
  io_thread_ = std::thread([this] { run_io_thread(); });
  map_thread_ = std::thread([this] { run_map_thread(); });
  // Named for profilers and for the benches' count of CPU time per thread
  // (statepager/tools/bench/cpu_use.py); io_uring's own workers are named iou-wrk-<tid>.
  pthread_setname_np(io_thread_.native_handle(), "statepager-io");
  pthread_setname_np(map_thread_.native_handle(), "statepager-map");
}

// The default store's file, the tiers and the counters of a new Pager.
void Pager::open_stores() {
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
      UringFile::Options{ring_depth, options_.direct_io, true, stripe_ram});
  dir_->adopt(*file_);
  const IoShape shape = io_shape_for(file_->direct());
  if (options_.io_depth == 0) options_.io_depth = shape.depth;
  if (options_.io_block == 0) options_.io_block = shape.block_bytes;
  add_store_locked("");  // the default store: file 0 of file_
  store_tier_ = std::make_unique<StoreTier>(*device_, *file_, options_.io_depth,
                                            options_.io_block, options_.map_ram);
  if (options_.host_budget > 0) {
    try {
      host_tier_ = std::make_shared<HostTier>(*device_, options_.host_budget);
    } catch (const OutOfMemoryError& e) {
      throw OutOfMemoryError("host_budget " + std::to_string(options_.host_budget) +
                             " bytes of pinned host memory could not be allocated (" +
                             e.what() + "): pass a smaller host_budget");
    }
  }
  counters_.host_budget = options_.host_budget;
  counters_.direct_io = file_->direct();
  counters_.io_depth = options_.io_depth;
  counters_.io_block = options_.io_block;
}

Pager::~Pager() {
  if (::getpid() != owner_) {
    abandon();
    return;
  }
  try {
    close();
  } catch (...) {
  }
}

// Note [A Pager across fork]: fork() copies the Pager's memory into the child, but not
// its I/O and map threads, and the child shares the parent's store files, lock (one open
// file description: flock(LOCK_UN) or a punch there is the parent's), host memory (the
// host backend's pages are shared memfds) and CUDA context (unusable there). So in the
// child nothing may wait for the threads (they never answer: a hang), join them (they do
// not exist), destroy what they waited on (destroying a condition variable with waiters
// counted blocks forever), free device memory or touch a file. Every entry point that
// could do one of these checks the process first (check_owner()), before taking mu_,
// which a parent's thread may have held at the fork; release() does nothing. The
// destructor leaves the threads' handles, the condition variables, the device, the pool,
// the tiers and the ring undestroyed (abandon()): the child's copies vanish with it.
void Pager::abandon() noexcept {
  for (std::thread* t : {&io_thread_, &map_thread_}) new std::thread(std::move(*t));
  new std::shared_ptr<HostTier>(std::move(host_tier_));
  (void)store_tier_.release();
  (void)file_.release();
  (void)pool_owner_.release();
  (void)sync_.release();
  (void)device_.release();
}

void Pager::check_owner() const {
  if (::getpid() == owner_) return;
  throw UsageError("this Pager belongs to process " + std::to_string(owner_) +
                   ": a forked child (process " + std::to_string(::getpid()) + ") cannot use "
                   "it (its I/O threads, device memory and store are the parent's) and "
                   "nothing was touched; create a Pager of the child's own, on another "
                   "directory");
}

void Pager::check_usable() const {
  check_owner();
  check_open();
}

const std::string& Pager::file_path() const { return file_->path(); }
const std::string& Pager::directory() const { return dir_->path(); }

void Pager::check_open() const {
  if (closed_) throw UsageError("this Pager is closed: create a new one");
}

ExtentId Pager::create(size_t bytes, unsigned store, ArenaEnd end) {
  return create_pieces({bytes}, store, end)[0];
}

size_t Pager::check_pieces(const std::vector<size_t>& pieces) const {
  if (pieces.empty()) throw UsageError("a tensor of no pieces");
  constexpr size_t kMax = std::numeric_limits<size_t>::max();
  size_t total = 0;  // saturating: a sum that would wrap stays above the arena
  for (size_t i = 0; i < pieces.size(); i++) {
    const bool last = i + 1 == pieces.size();
    if ((!last && pieces[i] % kAddressAlign != 0) || (pieces.size() > 1 && pieces[i] == 0)) {
      throw UsageError("piece " + std::to_string(i) + " of " + std::to_string(pieces[i]) +
                       " bytes: every piece of a tensor but the last must be a multiple of " +
                       std::to_string(kAddressAlign) + " bytes, and none of several empty");
    }
    total = pieces[i] > kMax - total ? kMax : total + pieces[i];
  }
  if (total > pool_.arena_size()) {  // fixed at construction: no lock needed
    throw UsageError("a tensor of " + std::to_string(total) + " bytes is larger than the "
                     "pager's whole address arena (arena_size " +
                     std::to_string(pool_.arena_size()) + " bytes): create the Pager with "
                     "a larger arena_size");
  }
  return total;
}

std::vector<ExtentId> Pager::create_pieces(const std::vector<size_t>& pieces, unsigned store,
                                           ArenaEnd end) {
  const size_t total = check_pieces(pieces);
  check_owner();
  std::unique_lock lock(mu_);
  check_open();
  check_store_locked(store);
  // The file ranges, then the address range: what can fail, undone if it does.
  std::vector<uint64_t> offsets;
  uintptr_t addr;
  try {
    for (size_t bytes : pieces) {
      offsets.push_back(stores_[store]->space.allocate(file_range_bytes(bytes), kFileAlign));
    }
    addr = pool_.allocate(std::max<size_t>(total, 1), kAddressAlign, end);
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
    e->ranges.store = offsets[i];
    const ExtentId id = extents_.add(std::move(e));
    if (!ids.empty()) extents_.at(ids.back()).next_piece = id;
    ids.push_back(id);
    addr += pieces[i];
  }
  return ids;
}

std::vector<ExtentId> Pager::pieces(ExtentId first) const {
  std::unique_lock lock(mu_);
  std::vector<ExtentId> ids{first};
  for (ExtentId next = extents_.at(first).next_piece; next != 0;
       next = extents_.at(next).next_piece) {
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
    const std::optional<ExtentId> first = extents_.starting_at(r.storage);
    if (!first || extents_.at(*first).segment) {
      *unknown = i;
      return {};
    }
    if (extents_.at(*first).next_piece == 0) {
      ids.push_back(*first);
      continue;
    }
    for (ExtentId id = *first; id != 0; id = extents_.at(id).next_piece) {
      const Extent& e = extents_.at(id);
      if (e.addr >= r.end) break;  // pieces lie in address order
      if (e.addr + e.bytes > r.begin) ids.push_back(id);
    }
  }
  return ids;
}

uintptr_t Pager::create_segment(size_t bytes) {
  const ExtentId id = create(bytes);
  std::unique_lock lock(mu_);
  Extent& e = extents_.at(id);
  try {
    while (!pool_.ref(e.addr, e.bytes, true)) {  // a page of it is being mapped: wait
      done_cv_.wait(lock);
      check_open();
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
  if (::getpid() != owner_) return;  // the parent's (see Note [A Pager across fork])
  ExtentId id;
  {
    std::unique_lock lock(mu_);
    const std::optional<ExtentId> at = extents_.starting_at(addr);
    if (!at || !extents_.at(*at).segment) {
      throw UsageError("no segment of this pager starts at the freed address");
    }
    id = *at;
  }
  release(id);
}

bool Pager::owns_address(uintptr_t addr) const {
  std::unique_lock lock(mu_);
  return pool_.contains(addr, 1);
}

void Pager::release(ExtentId id) {
  if (::getpid() != owner_) return;  // the parent's (see Note [A Pager across fork])
  std::unique_lock lock(mu_);
  if (extents_.at(id).state == Residency::kResident && !closed_) {
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
  Extent& e = extents_.at(id);
  // A tensor may die while its bucket is in flight (its page-out may even wait for a
  // range a save holds): never wait here, the bucket frees it when it completes.
  if (e.state == Residency::kPagingIn || e.state == Residency::kPagingOut || e.tier_move) {
    e.dead = true;
    return;
  }
  free_extent_locked(id);
}

void Pager::free_extent_locked(ExtentId id) {
  Extent& e = extents_.at(id);
  if (e.state == Residency::kResident && (!closed_ || e.segment)) pool_.unref(e.addr, e.bytes);
  pool_.free(e.addr);
  for (uint64_t range : e.referenced()) free_range_locked(range, e.file_bytes);
  extents_.erase(id);
}

unsigned Pager::open_store(const std::string& name) {
  check_owner();
  std::unique_lock lock(mu_);
  check_open();
  for (unsigned i = 0; i < stores_.size(); i++) {
    if (stores_[i]->name == name) return i;
  }
  file_->add_file(dir_->store_file(name));
  dir_->adopt(*file_);
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
  check_owner();
  std::unique_lock lock(mu_);
  check_open();
  check_store_locked(store);
  for (ExtentId id : ids) {  // all checked before any moves
    const Extent& e = extents_.at(id);
    if (e.segment) throw UsageError("a segment of PyTorch's allocator cannot change stores");
    if (e.state == Residency::kPagingIn || e.state == Residency::kPagingOut) {
      throw UsageError("extent " + std::to_string(id) + " is being paged: wait for its bucket "
                       "before moving it to another store");
    }
    if (store_index(e.ranges.next_store.value_or(e.ranges.store)) != store) {
      check_not_in_epoch_locked(e, id, "change stores");
    }
  }
  for (ExtentId id : ids) {
    Extent& e = extents_.at(id);
    if (store_index(e.ranges.next_store.value_or(e.ranges.store)) == store) continue;
    if (e.ranges.next_store) {  // a move not done yet goes elsewhere
      free_range_locked(*e.ranges.next_store);
      e.ranges.next_store.reset();
      if (store_index(e.ranges.store) == store) continue;
    }
    const uint64_t to = stores_[store]->space.allocate(e.file_bytes, kFileAlign);
    if (e.state == Residency::kFile) {
      e.ranges.next_store = to;  // its bytes are read from the old range once more
    } else {
      free_range_locked(e.ranges.store);
      e.ranges.store = to;
      if (e.rest == Residency::kFile) e.rest.reset();  // the new range is empty
    }
  }
}

unsigned Pager::store_of(ExtentId id) const {
  std::unique_lock lock(mu_);
  const Extent& e = extents_.at(id);
  return store_index(e.ranges.next_store.value_or(e.ranges.store));
}

// A range a save holds is freed once it is copied (unhold()): until then nothing may be
// written into it. punch_bytes > 0: its blocks go back to the filesystem (its extent is
// gone; ranges freed by steps are not punched, the next step writes them again).
void Pager::free_range_locked(uint64_t range, size_t punch_bytes) {
  if (held_.count(range) != 0) {
    freed_held_[range] = punch_bytes;
    return;
  }
  if (HostTier::is_host(range)) {
    if (host_tier_) host_tier_->free(range);  // none once closed
    return;
  }
  if (punch_bytes > 0 && store_tier_) store_tier_->punch(range, punch_bytes);
  stores_[store_index(range)]->crcs.erase(range);
  stores_[store_index(range)]->space.free(range);
}

// The extent's bytes are no longer needed in its old store: it now lives in the new one.
// In an epoch the old range holds the committed bytes: the epoch's end frees it.
void Pager::finish_move_locked(Extent& e) {
  if (!e.ranges.next_store) return;
  if (!e.committed || e.ranges.store != e.committed->ranges.store) {
    free_range_locked(e.ranges.store);
  }
  e.ranges.store = *e.ranges.next_store;
  e.ranges.next_store.reset();
}

// The extent no longer uses its host range (paged in, discarded, or a page-out failed);
// in an epoch a range holding committed bytes stays until the epoch ends.
void Pager::drop_host_locked(Extent& e) {
  if (!e.ranges.host) return;
  if (!e.committed || e.ranges.host != e.committed->ranges.host) {
    free_range_locked(*e.ranges.host);
  }
  e.ranges.host.reset();
}

void Pager::check_not_in_epoch_locked(const Extent& e, ExtentId id, const char* what) const {
  if (e.committed) {
    throw UsageError("extent " + std::to_string(id) + " is in an open epoch (a step is "
                     "running): it cannot " + what + " until the epoch ends");
  }
}

bool Pager::exists(ExtentId id) const {
  std::unique_lock lock(mu_);
  return extents_.find(id) != nullptr;
}

uintptr_t Pager::address(ExtentId id) const {
  std::unique_lock lock(mu_);
  return extents_.at(id).addr;
}

size_t Pager::size(ExtentId id) const {
  std::unique_lock lock(mu_);
  return extents_.at(id).bytes;
}

Residency Pager::residency(ExtentId id) const {
  std::unique_lock lock(mu_);
  return extents_.at(id).state;
}

std::optional<ExtentId> Pager::find(uintptr_t addr) const {
  std::unique_lock lock(mu_);
  const std::optional<ExtentId> id = extents_.starting_at(addr);
  if (!id || extents_.at(*id).segment) return std::nullopt;
  return id;
}

PagerStats Pager::stats() const {
  std::unique_lock lock(mu_);
  PagerStats s = counters_;
  s.mapped_bytes = pool_.mapped_bytes();
  s.peak_mapped_bytes = pool_.pages().peak_in_use_bytes();
  s.cached_bytes = pool_.pages().cached_bytes();
  s.hbm_budget = pool_.pages().hbm_budget();
  s.page_size = pool_.page_size();
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
  check_owner();
  std::unique_lock lock(mu_);
  pool_.trim();
}

void Pager::set_keep(size_t keep) {
  check_owner();
  std::unique_lock lock(mu_);
  pool_.pages().set_keep(keep);
}

void Pager::reset_peak() {
  check_owner();
  std::unique_lock lock(mu_);
  pool_.pages().reset_peak();
}

std::vector<std::string> Pager::store_files() const {
  check_owner();
  std::unique_lock lock(mu_);
  check_open();
  return file_->physical_paths();
}

void Pager::close() {
  check_owner();
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
    // The host tier goes below.
    e->ranges.host.reset();
    if (e->committed) e->committed->ranges.host.reset();
  }
  attempt([&] { pool_.trim(); });
  store_tier_.reset();  // frees the staging memory
  host_tier_.reset();   // its memory lives on while a StoreSnapshot still holds it
  file_.reset();
  attempt([&] { dir_->remove(); });
  if (error) std::rethrow_exception(error);
}

}  // namespace statepager
