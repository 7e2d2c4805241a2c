// Pager: tensors' bytes as extents of a Pool, paged between the device, a host tier and
// the store files.
//
// An extent is a range of the pool's arena that holds one tensor's bytes. Its state is
// ZERO (never written: page-in fills zeros and reads nothing), FILE (its bytes are at
// rest in the store file), HOST (at rest in the host tier: pinned host memory of
// PagerOptions::host_budget, allocator/host_tier.h) or RESIDENT (mapped and
// current). A page-out goes to the host tier while it has room; short of room, HOST
// extents are first written back to the store (spilled, as part of that bucket) and the
// bucket takes their room; what still does not fit goes to the store file. Which spill: a
// page-out may say when its extents are needed again (page_out's reuse_after; a cyclic
// streamed step knows). Then only HOST extents needed later than that spill, the latest
// first, and when none is, the bucket itself goes to the store: the extent needed farthest
// ahead leaves, the bucket included (in a cyclic order plain LRU would spill exactly the
// next one needed). A hint that has passed means "needed now": the extent stays (a
// prediction that runs late, say with other buckets' page-ins in between, must not make
// the next extent needed the first to leave). Extents without a hint spill before any,
// least recently used (paged in or out longest ago) first. A page-in takes the bytes from
// where they are and frees the host range. read_ahead() copies FILE extents into free
// host room ahead of their page-in. A bucket that needs an extent being spilled or read
// ahead waits for that move. Each extent has its own 4 KiB-aligned range in the store
// file, so no two extents ever share a disk block and I/O never needs read-modify-write;
// extents adjacent in the file are moved in one request.
//
// page_in() and page_out() take a bucket (a set of extents) and return a Ticket at once;
// a map thread maps a page-in's new pages (cuMemSetAccess can take a millisecond a page
// while a device-to-host copy runs: the caller never waits for that), and an I/O thread
// moves the bytes (allocator/store_tier.h: pinned staging slots, device copy <-> io_uring),
// many buckets and many requests in flight. page_out() first orders itself after the
// work already queued on the caller's stream. A failed page-out leaves every extent of
// its bucket resident and intact; a failed page-in leaves them as they were.
//
// Stores: the directory holds the default store (its file) and named stores, each its own
// file in a subdirectory of that name (open_store()), all on one io_uring. An extent
// lives in one store; move_to_store() changes that at once for extents without bytes at
// rest, and for those with (FILE) on their next page-in, when the old range is let go:
// a move never copies bytes.
//
// Checkpoints copy extents straight between the store and other files (hold() and
// begin_restore(); allocator/store_snapshot.h and store_restore.h copy): an extent at rest
// keeps its range of a store file until it moves.
//
// Epochs make a set of changes all-or-nothing (an optimizer step: see begin_epoch()).
// Inside one, a page-out never overwrites the bytes an extent had at the epoch's begin
// (copy-on-write into a fresh range of its store); commit_epoch() keeps the new bytes
// and frees the old ranges, abort_epoch() returns every extent to its old bytes and
// state. Freed ranges are reused first-fit, so a store written in epochs stays within
// about twice its extents' bytes; the ranges of released extents are punched (their
// blocks go back to the filesystem).
//
// Ownership: the Pager owns its Device, Pool, store directory and file. Extent addresses
// stay valid (reserved) until the Pager is destroyed, also after close().
// Processes: a Pager belongs to the process that constructed it; its I/O and map threads,
// device memory, lock and store are that process's. In a forked child (see Note [A Pager
// across fork]) every call that would change, wait for or delete anything (page_in and
// the other buckets, wait, create, stores, trim, holds, restores, epochs, close) throws
// UsageError at once, touching nothing; release() and release_at() (a tensor dying
// there) do nothing; queries read the child's copy of the table. Its destructor there
// joins no thread and frees nothing of the device or the store: it leaves them as they
// are (the child's copies vanish when it exits).
// Thread-safety: all public methods may be called from any thread. Fields shared with
// the I/O and map threads are guarded by mu_; fields marked "I/O thread" are touched only
// by the I/O thread while it runs (and by close() once it has stopped).
// Errors: typed statepager errors (backing/errors.h); wait() rethrows a bucket's error,
// a device error while mapping its pages included, and CorruptStoreError for a page-in
// that reads back other bytes than its store range was written with (changed from
// outside: see Note [Store checksums] in allocator/pager_crc.cc; the bucket's extents
// stay at rest). page_in() itself throws what it finds
// before queuing anything: a page budget or device memory too small (OutOfMemoryError).
// Construction refuses options outside their ranges (UsageError naming the option, its
// value and the range) before touching the store directory.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <sys/types.h>
#include <unordered_map>
#include <vector>

#include "allocator/arena.h"
#include "allocator/device.h"
#include "allocator/extent_table.h"
#include "allocator/host_tier.h"
#include "allocator/job.h"
#include "allocator/pool.h"
#include "allocator/store_tier.h"
#include "backing/store_dir.h"
#include "backing/uring_file.h"

namespace statepager {

// Staging slots (= requests in flight) and bytes per request. Chosen per medium by
// measurement on the H200 machine (bench step and bench sleep): its virtio disk, behind
// O_DIRECT, moves most with 64 x 4 MiB in flight (step 1.39x the synchronous baseline,
// 1.10x with 32 x 1 MiB); RAM (tmpfs, buffered) with 32 x 1 MiB (step 30.7 GB/s, 23.2
// with 64 x 4 MiB).
struct IoShape {
  unsigned depth;
  size_t block_bytes;
};
IoShape io_shape_for(bool direct_io);

struct PagerOptions {
  std::string directory;                    // the store directory (see backing/store_dir.h)
  PoolOptions pool;                         // ranges: see pool.h
  unsigned io_depth = 0;                    // staging slots, 1..kMaxIoDepth; 0: io_shape_for
  size_t io_block = 0;                      // bytes per request: a multiple of 4 KiB up to
                                            // kMaxIoBlockBytes; 0: io_shape_for(the medium)
  bool direct_io = true;                    // O_DIRECT where the filesystem allows it
  size_t host_budget = 0;                   // the host tier's pinned memory, allocated at
                                            // construction: 0 (none) to kMaxHostBudget
  bool map_ram = true;                      // store files in RAM mapped for the device's
                                            // copies (allocator/ram_map.h), one file each
                                            // (not striped: an extent is one copy each
                                            // way); false: io_uring
};
// The user address space of x86-64: more could never be allocated.
constexpr size_t kMaxHostBudget = size_t(1) << 47;
// Far past what any medium was measured to need (see IoShape); the staging memory is
// io_depth x io_block of pinned memory.
constexpr unsigned kMaxIoDepth = 1024;
constexpr size_t kMaxIoBlockBytes = size_t(256) << 20;

struct PagerStats {
  size_t mapped_bytes = 0;        // physical bytes mapped into the arena now (or being
                                  // mapped by a page-in)
  size_t peak_mapped_bytes = 0;   // high-water mark of mapped_bytes (reset_peak)
  size_t cached_bytes = 0;        // unmapped physical pages kept for reuse
  size_t hbm_budget = 0;          // PoolOptions::hbm_budget (a huge value: no budget)
  size_t page_size = 0;
  size_t extents = 0;
  size_t resident_bytes = 0;      // bytes of RESIDENT extents
  uint64_t bytes_read = 0;        // from the store file
  uint64_t bytes_written = 0;
  uint64_t read_requests = 0;
  uint64_t write_requests = 0;
  uint64_t zero_filled_bytes = 0; // ZERO extents paged in without I/O
  uint64_t unchanged_bytes = 0;   // release_unchanged(): returned to their bytes at rest
  uint64_t buckets_in = 0;
  uint64_t buckets_out = 0;
  uint64_t buckets_held = 0;      // page-outs that waited for a held range (see hold())
  size_t host_budget = 0;         // PagerOptions::host_budget
  size_t host_used_bytes = 0;     // host-tier memory holding extents now (4 KiB-rounded)
  size_t host_bytes = 0;          // bytes of HOST extents
  uint64_t bytes_to_host = 0;     // page-outs into the host tier
  uint64_t bytes_from_host = 0;   // page-ins from the host tier
  uint64_t spills = 0;            // HOST extents written back to the store to make room
  uint64_t spilled_bytes = 0;
  uint64_t read_aheads = 0;       // FILE extents read ahead into the host tier
  uint64_t read_ahead_bytes = 0;
  bool direct_io = false;
  uint64_t mapped_read_bytes = 0;     // of bytes_read, and of bytes_written: device copies
  uint64_t mapped_written_bytes = 0;  // from or to store files mapped in RAM (map_ram)
  uint64_t store_mapped_bytes = 0;  // store file bytes mapped for the device now
  unsigned io_depth = 0;          // the I/O shape in use (PagerOptions, resolved)
  size_t io_block = 0;
};

// Where an extent at rest keeps its bytes (see Pager::hold()).
// `range` names where the bytes are in one offset space: below HostTier::kHostBase the
// logical store files' (kFile: `spans`), above it the host tier's (kHost: `host`).
struct Placement {
  Residency state = Residency::kZero;  // kZero (no bytes anywhere), kFile or kHost
  size_t bytes = 0;                    // the extent's size
  uint64_t range = 0;                  // the start of its range (not kZero): 4 KiB-aligned,
  size_t store_bytes = 0;              // this long, past `bytes` zeros
  std::vector<UringFile::Span> spans;  // kFile: that range in the physical files
  char* host = nullptr;                // kHost: its bytes (written by a restore alone)
};

class Pager {
 public:
  Pager(std::unique_ptr<Device> device, PagerOptions options);
  ~Pager();
  Pager(const Pager&) = delete;
  Pager& operator=(const Pager&) = delete;

  // A new extent of `bytes` in ZERO state in store `store`: address reserved, nothing
  // mapped, no file I/O; the address from the arena's `end` (kHigh: keeps extents paged
  // together apart from the rest, see Arena). UsageError when `bytes` exceeds the whole
  // arena (arena_size); OutOfMemoryError when the arena has no free range that large.
  ExtentId create(size_t bytes, unsigned store = 0, ArenaEnd end = ArenaEnd::kLow);
  // One tensor's bytes as adjacent extents ("pieces"), so that a part of a tensor larger
  // than a bucket can be paged on its own: pieces[i] bytes each, one after the other from
  // one address, every piece but the last a positive multiple of 4 KiB (so that each
  // starts a file block and its own pages). Each piece is an extent as create() makes
  // (paged, stored and released on its own). Returns their ids in address order. Errors
  // as create(), and UsageError for empty or misaligned pieces; nothing is created then.
  std::vector<ExtentId> create_pieces(const std::vector<size_t>& pieces, unsigned store = 0,
                                     ArenaEnd end = ArenaEnd::kLow);
  // The UsageErrors of create_pieces() that depend on the pieces alone (misaligned or no
  // pieces, more bytes than the arena), raised before any store is opened; returns their
  // total bytes. Thread-safe: reads only what construction fixed.
  size_t check_pieces(const std::vector<size_t>& pieces) const;
  // The extents of the tensor whose first extent is `first`: [first] for one create()
  // made, all its pieces, in address order, for one create_pieces() made.
  std::vector<ExtentId> pieces(ExtentId first) const;
  // Bytes [begin, end) of the tensor whose storage starts at `storage` (a view's span).
  struct ByteRange {
    uintptr_t storage;
    uintptr_t begin;
    uintptr_t end;
  };
  // The extents holding each range's bytes, in order: of a tensor create_pieces() made,
  // the pieces the range's bytes lie in (an empty range: the piece it points into, none
  // at a piece's start); of any other, its extent. One acquisition of the lock
  // for them all (a step names a few thousand tensors, a large one in hundreds of pieces).
  // A storage that is no extent of this Pager (or is a segment) sets *unknown to its
  // index and returns nothing.
  std::vector<ExtentId> extents_in(const std::vector<ByteRange>& ranges, size_t* unknown) const;

  // The store named `name` ("" is the default store, 0), opened on first use as
  // <directory>/<name>/state.bin. UsageError for a name that is not a plain file name.
  unsigned open_store(const std::string& name);
  const std::string& store_name(unsigned store) const;
  // Extents to live in `store` from now on (see Stores). UsageError for a segment or an
  // extent being paged.
  void move_to_store(const std::vector<ExtentId>& ids, unsigned store);
  // The store an extent lives in (or moves to, on its next page-in).
  unsigned store_of(ExtentId id) const;
  // Forgets an extent: unmaps its pages if resident, frees its address and file range.
  // A resident extent is let go after the device's queued work, as cudaFree does (work
  // queued before its tensor died may still use it). Waits for no bucket: an extent
  // being paged is marked dead and freed when its bucket completes (its address and
  // range stay reserved until then).
  void release(ExtentId id);

  // A resident extent, mapped at once even past the page budget: a segment PyTorch's
  // allocator asked for (see allocator/pluggable.h). Returns its address.
  uintptr_t create_segment(size_t bytes);
  // Releases the extent that starts at `addr` (a segment); UsageError if there is none.
  void release_at(uintptr_t addr);
  bool owns_address(uintptr_t addr) const;  // inside this pager's arena

  bool exists(ExtentId id) const;  // created and not freed (see release())
  uintptr_t address(ExtentId id) const;
  size_t size(ExtentId id) const;
  Residency residency(ExtentId id) const;
  // The pager tensor (extent, not a segment) starting at addr. Segments are PyTorch's
  // memory, shared by its small blocks: never paged, so never found here.
  std::optional<ExtentId> find(uintptr_t addr) const;

  // Buckets. Extents already in the requested state are skipped; an extent being paged
  // by another bucket is a UsageError. `stream`: see the class comment.
  // for_read: for a caller that will only read them and hand them back with
  // release_unchanged(): where their bytes lie at rest is remembered, and HOST extents
  // keep their host range (its room stays taken while they are resident), so that
  // handing them back writes nothing. A page-in not for a read that names a resident
  // extent makes it forget (its caller may write it).
  // overwrite: more extents of the bucket, which the caller writes whole before reading
  // any byte of them (scratch): one in ZERO state is mapped without its zero fill, its
  // bytes undefined until written, so that the page-in waits for no copy queue; the
  // others page in like the bucket's.
  Ticket page_in(const std::vector<ExtentId>& bucket, bool for_read = false,
                 const std::vector<ExtentId>& overwrite = {});
  // reuse_after > 0: the bucket will be paged in again once about that many more bytes
  // have been named in page-ins (of any bucket, resident extents included: the clock
  // the spill choice compares, see the class comment); 0: not known. Extents already at
  // rest keep the hint they had.
  Ticket page_out(const std::vector<ExtentId>& bucket, uintptr_t stream = 0,
                  uint64_t reuse_after = 0);
  // A page-out of extents the caller promises it did not write since their page-in for
  // a read (state_dict, a save through the device). Each that such a page-in brought in,
  // and whose bytes still lie at rest where they came from, goes back to them without a
  // write: zeros (ZERO), its store range (FILE, not moved to another store since), its
  // host range (HOST). The others (paged in otherwise, or named since by a page-in not
  // for a read, a page-out or a discard, or moved to another store) are paged out as
  // page_out() does. Exact in copy-on-write epochs: an extent goes back to the range it
  // was read from, which nothing but a page-out of it writes. Ordered after `stream`
  // like page_out(); a failure leaves every extent resident.
  Ticket release_unchanged(const std::vector<ExtentId>& bucket, uintptr_t stream = 0,
                           uint64_t reuse_after = 0);
  // Drops extents' bytes: resident ones are unmapped without writing, FILE ones forget
  // their bytes at rest; all become ZERO (scratch tensors whose bytes live elsewhere in
  // another form, or are no longer needed). Ordered after `stream` like page_out().
  Ticket discard(const std::vector<ExtentId>& bucket, uintptr_t stream = 0);
  // Reads FILE extents into free host-tier room (never making room: what does not fit
  // stays FILE), so that their page-in is a copy-engine copy. Other extents are skipped;
  // without a host tier nothing moves. A failed read leaves them FILE.
  Ticket read_ahead(const std::vector<ExtentId>& bucket);
  void wait(const Ticket& ticket);      // rethrows the bucket's error
  bool is_done(const Ticket& ticket) const;  // without the lock: never waits

  // Extents now resident (for pause/resume: page these out, later back in).
  std::vector<ExtentId> resident_extents() const;
  // Returns the page pool's cached pages to the device.
  void trim();
  // Unmapped pages kept for reuse, at most (PoolOptions::keep).
  void set_keep(size_t keep);

  // -- the store seen from outside: checkpoints copy file ranges, not bytes via the device
  // The physical files of all stores; UringFile::Span::file indexes them.
  std::vector<std::string> store_files() const;
  // Placements of at-rest (ZERO, FILE or HOST) extents, and a hold on the store or host
  // range of each FILE or HOST one: from now on a page-out that would write into a held range waits, unstarted,
  // until unhold() of that range, while other buckets go on. A copy of the held ranges is
  // then the state of this moment even while training pages on. One set of holds at a
  // time: UsageError while any range is held, or when an extent is not at rest (page it
  // out first).
  std::vector<Placement> hold(const std::vector<ExtentId>& ids);
  void unhold(uint64_t range);  // the held range starting there (Placement::range); no-op if none
  // Keeps the memory of HOST placements valid for its holder's life, also after close()
  // (null without a host tier).
  std::shared_ptr<const HostTier> host_memory() const;
  // Restores (allocator/store_restore.h copies a checkpoint's bytes in between): extents
  // at rest, not held and in no epoch (else UsageError) become 'paging_in', and each gets
  // a placement for its new bytes: a fresh host range while the host tier has room (state
  // kHost), else a fresh range of its store (kFile), or none when zero[i] (kZero).
  // end_restore(ok) switches them to those bytes (a HOST extent keeps its store range for
  // spills); end_restore(!ok) frees the fresh ranges and returns every extent to what it
  // was. Exactly one end_restore() per begin_restore(), with the same ids and the
  // placements returned.
  std::vector<Placement> begin_restore(const std::vector<ExtentId>& ids,
                                       const std::vector<bool>& zero);
  void end_restore(const std::vector<ExtentId>& ids, const std::vector<Placement>& places,
                   bool ok);

  // -- epochs: all-or-nothing changes of a set of extents (an optimizer step)
  // Opens an epoch over `ids`, which must be at rest and in no other epoch (UsageError),
  // and returns its id. Until the epoch ends, each of them keeps the bytes it has now
  // (its committed bytes): a page-out of an extent whose range holds them writes a fresh
  // range of its store instead, so that range is never written in the epoch (nor waited
  // for when a save holds it). Its extents cannot change stores, be held or be restored
  // in the meantime (UsageError). Epochs on disjoint sets may be open at once.
  uint64_t begin_epoch(const std::vector<ExtentId>& ids);
  // Ends the epoch keeping what its extents hold now; the ranges of committed bytes they
  // no longer use are freed. Waits for the epoch's buckets in flight first.
  void commit_epoch(uint64_t epoch);
  // Ends the epoch returning each extent to its committed state and bytes: waits for
  // the epoch's buckets in flight (whatever their outcome), waits for the device's queued
  // work, unmaps resident extents without writing, and frees the ranges written in the
  // epoch. Extents that were ZERO are ZERO again.
  void abort_epoch(uint64_t epoch);

  PagerStats stats() const;
  void reset_peak();
  Device& device() { return *device_; }
  const std::string& file_path() const;  // the default store's file
  const std::string& directory() const;  // the store directory, absolute and resolved
  // The process that made it (see Processes).
  pid_t owner() const { return owner_; }
  // UsageError in any process but the one that made it (a forked child).
  void check_owner() const;
  // UsageError unless this Pager can be used here: made by this process and not closed.
  void check_usable() const;

  // Waits for all buckets and the device, unmaps everything but PyTorch's segments
  // (those stay mapped until PyTorch frees them), stops the I/O thread and deletes what
  // it created in the store directory (StoreDir::remove()). Idempotent; later calls other
  // than release() and queries throw UsageError. When the device fails meanwhile, every
  // step is still taken and the first error thrown at the end. The destructor closes and
  // never throws. In a forked child: UsageError, nothing touched (see Processes).
  void close();

 private:
  struct Store;
  Ticket submit(Ticket job, const std::vector<ExtentId>& bucket, uintptr_t stream = 0,
                uint64_t reuse_after = 0);
  void return_unchanged_locked(Job& job);
  void forget_rest_locked(Extent& e);
  void paged_in_locked(Extent& e, Residency before, bool for_read);
  void plan_locked(Job& job);
  std::vector<ExtentId> place_outs_locked(Job& job);
  void choose_spills_locked(Job& job, size_t short_bytes);
  void place_deferred_locked(Job& job);
  void spilled_locked(Extent& e);
  void wait_tier_moves_locked(std::unique_lock<std::mutex>& lock,
                              const std::vector<ExtentId>& ids);
  void start_job(Job& job);
  void drop_host_locked(Extent& e);
  void run_io_thread();
  void run_map_thread();
  void mapping_failed_locked(Job& job, std::exception_ptr error);
  bool advance(std::unique_lock<std::mutex>& lock);
  bool waits_for_hold_locked(Job& job);
  void release_locked(ExtentId id);      // release() once the device's work is done
  void free_extent_locked(ExtentId id);  // release() of an extent not being paged
  bool only_held_jobs_locked();
  Placement placement_locked(const Extent& e, std::optional<uint64_t> range) const;
  bool fence_passed_locked(Job& job);
  void unref_quietly_locked(const Extent& e);
  void complete(Job& job);
  void settle_crcs_locked(Job& job);  // allocator/pager_crc.cc
  void ref_pages_locked(std::unique_lock<std::mutex>& lock, const std::vector<ExtentId>& ids,
                        Pool::PendingMaps* pending);
  void unref_pages_locked(const std::vector<ExtentId>& ids, size_t count);
  unsigned add_store_locked(const std::string& name);
  void check_store_locked(unsigned store) const;
  void free_range_locked(uint64_t range, size_t punch_bytes = 0);
  void finish_move_locked(Extent& e);
  void redirect_writes_locked(const std::vector<ExtentId>& ids);
  std::vector<Extent*> settled_epoch_locked(std::unique_lock<std::mutex>& lock, uint64_t epoch);
  void end_epoch_locked(Extent& e, bool keep);
  void check_not_in_epoch_locked(const Extent& e, ExtentId id, const char* what) const;
  void check_open() const;
  void abandon() noexcept;
  void open_stores();

  // The mutex and condition variables live apart from the Pager: a forked child leaves
  // them undestroyed (see abandon()).
  struct Sync {
    std::mutex mu;
    std::condition_variable work, map, done;
  };

  // Fields shared with the I/O thread are guarded by mu_, except those marked otherwise.
  const pid_t owner_;                  // the process that made it
  std::unique_ptr<Device> device_;     // set at construction; Device is thread-safe
  PagerOptions options_;               // set at construction (io shape resolved), then read
  std::unique_ptr<Pool> pool_owner_;   // pool_'s memory (abandon() keeps it)
  Pool& pool_;                         // mu_
  std::unique_ptr<StoreDir> dir_;      // mu_ (close() removes it)
  // All stores' files, one ring: submit/reap/allocate on the I/O thread only; add_file(),
  // punch() and the path and span queries under mu_ (UringFile allows them alongside).
  std::unique_ptr<UringFile> file_;
  std::vector<std::unique_ptr<Store>> stores_;  // mu_; stores_[i] is file i of file_
  std::unique_ptr<StoreTier> store_tier_;  // I/O thread, plan() under mu_ (freed by close())
  std::shared_ptr<HostTier> host_tier_;    // null without a host budget; allocate/free
                                           // under mu_, start() on the I/O thread

  std::unique_ptr<Sync> sync_;
  std::mutex& mu_;                     // sync_->mu
  std::condition_variable& work_cv_;   // wakes the I/O thread
  std::condition_variable& map_cv_;    // wakes the map thread
  std::condition_variable& done_cv_;   // wakes waiters
  ExtentTable extents_;                // mu_
  std::deque<Ticket> queue_;           // mu_: buckets not finished, in submission order
  size_t outs_in_flight_ = 0;          // mu_: page-out buckets queued or running
  std::deque<Ticket> map_queue_;       // mu_: page-ins waiting for the map thread, in order
  size_t maps_in_flight_ = 0;          // mu_: page-ins queued or being mapped there
  std::map<uint64_t, uint64_t> held_;  // mu_: held store ranges, start -> end, disjoint
  std::map<uint64_t, size_t> freed_held_;  // mu_: held ranges freed meanwhile -> bytes to punch
  std::unordered_map<uint64_t, std::vector<ExtentId>> epochs_;  // mu_: open epochs' extents
  uint64_t next_epoch_ = 1;            // mu_
  uint64_t use_clock_ = 0;             // mu_: ticks of page-ins and page-outs (LRU)
  uint64_t paged_in_bytes_ = 0;        // mu_: bytes named in page-ins (reuse hints' clock)
  PagerStats counters_;                // mu_: counts of finished buckets (complete())
  // Written under mu_; check_usable() reads it without (the stepping thread checks before
  // each page-in, page-out and discard, and the I/O thread holds mu_ while it settles).
  std::atomic<bool> closed_ = false;
  bool stopping_ = false;              // mu_: tells the threads to return once idle
  std::thread io_thread_;              // started last by the constructor, joined by close()
  std::thread map_thread_;             // likewise
};

}  // namespace statepager
