// Pager on the host backend: round trips, residency, budget, failure atomicity.
#include "allocator/pager.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "allocator/arena.h"
#include "backing/errors.h"
#include "backing/uring_file.h"
#include "pager_options.h"
#include "wrapped_device.h"

namespace statepager {
namespace {

std::string test_dir(const char* name) {
  return std::string("/tmp/statepager-pager-test-") + name + "-" + std::to_string(getpid());
}

PagerOptions small_options(const char* name) {
  return test_options(test_dir(name), 32 << 10);  // buckets of several requests
}

void fill_random(uintptr_t addr, size_t bytes, uint32_t seed) {
  std::mt19937 gen(seed);
  auto* p = reinterpret_cast<uint8_t*>(addr);
  for (size_t i = 0; i < bytes; i++) p[i] = uint8_t(gen());
}

bool equals_random(uintptr_t addr, size_t bytes, uint32_t seed) {
  std::mt19937 gen(seed);
  auto* p = reinterpret_cast<const uint8_t*>(addr);
  for (size_t i = 0; i < bytes; i++) {
    if (p[i] != uint8_t(gen())) return false;
  }
  return true;
}

TEST(Pager, RoundTripManyBucketsAndSizes) {
  Pager pager(make_host_device(), small_options("roundtrip"));
  std::mt19937 gen(7);
  std::vector<std::vector<ExtentId>> buckets(12);
  std::vector<ExtentId> all;
  for (auto& bucket : buckets) {
    const int n = 1 + int(gen() % 9);
    for (int i = 0; i < n; i++) {
      const size_t bytes = 1 + gen() % (300 << 10);  // mostly not multiples of 4 KiB
      const ExtentId id = pager.create(bytes);
      bucket.push_back(id);
      all.push_back(id);
    }
  }
  for (auto& bucket : buckets) pager.wait(pager.page_in(bucket));
  for (ExtentId id : all) fill_random(pager.address(id), pager.size(id), uint32_t(id));
  std::vector<Ticket> outs;
  for (auto& bucket : buckets) outs.push_back(pager.page_out(bucket));  // all in flight
  for (auto& t : outs) pager.wait(t);
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
  for (ExtentId id : all) EXPECT_EQ(pager.residency(id), Residency::kFile);
  std::vector<Ticket> ins;
  for (size_t b = buckets.size(); b-- > 0;) ins.push_back(pager.page_in(buckets[b]));
  for (auto& t : ins) pager.wait(t);
  for (ExtentId id : all) {
    EXPECT_EQ(pager.residency(id), Residency::kResident);
    EXPECT_TRUE(equals_random(pager.address(id), pager.size(id), uint32_t(id))) << "extent " << id;
  }
}

TEST(Pager, ZeroExtentsAreNeverRead) {
  Pager pager(make_host_device(), small_options("zero"));
  std::vector<ExtentId> bucket;
  for (int i = 0; i < 10; i++) bucket.push_back(pager.create(100000 + i));
  pager.wait(pager.page_in(bucket));
  const PagerStats s = pager.stats();
  EXPECT_EQ(s.bytes_read, 0u);
  EXPECT_EQ(s.read_requests, 0u);
  EXPECT_GT(s.zero_filled_bytes, 0u);
  for (ExtentId id : bucket) {
    auto* p = reinterpret_cast<const uint8_t*>(pager.address(id));
    const size_t bytes = pager.size(id);
    for (size_t i = 0; i < bytes; i++) ASSERT_EQ(p[i], 0);
  }
}

TEST(Pager, AddressStableAcrossPaging) {
  Pager pager(make_host_device(), small_options("address"));
  const ExtentId id = pager.create(123457);
  const uintptr_t addr = pager.address(id);
  for (int round = 0; round < 3; round++) {
    pager.wait(pager.page_in({id}));
    fill_random(addr, 123457, round);
    pager.wait(pager.page_out({id}));
    pager.wait(pager.page_in({id}));
    EXPECT_TRUE(equals_random(addr, 123457, round));
    pager.wait(pager.page_out({id}));
    EXPECT_EQ(pager.address(id), addr);
  }
}

TEST(Pager, ExtentsInAreThePiecesARangeTouches) {
  PagerOptions o = small_options("extents_in");
  Pager pager(make_host_device(), o);
  const size_t page = o.pool.page_size;
  const ExtentId single = pager.create(1000);
  const std::vector<ExtentId> ids = pager.create_pieces({2 * page, 2 * page, 12345});
  const uintptr_t a = pager.address(ids[0]), s = pager.address(single);
  using R = Pager::ByteRange;
  size_t unknown = 99;
  // A tensor of one extent is that extent, whatever part of it a view spans; one of
  // pieces, the pieces its bytes touch, in order (an empty view: the piece it points into,
  // none where it points at a piece's start).
  EXPECT_EQ(pager.extents_in({R{s, s + 10, s + 20}, R{a, a, a + 4 * page + 12345},
                              R{a, a + 2 * page, a + 2 * page + 1}, R{a, a + 2 * page - 1,
                              a + 2 * page + 1}, R{a, a + page, a + page},
                              R{a, a + 2 * page, a + 2 * page}}, &unknown),
            (std::vector<ExtentId>{single, ids[0], ids[1], ids[2], ids[1], ids[0], ids[1],
                                   ids[0]}));
  EXPECT_EQ(unknown, 99u);
  // An address that starts no extent: its index, and nothing.
  EXPECT_TRUE(pager.extents_in({R{s, s, s + 1}, R{s + 8, s + 8, s + 9}}, &unknown).empty());
  EXPECT_EQ(unknown, 1u);
  const uintptr_t segment = pager.create_segment(page);  // PyTorch's memory: never found
  EXPECT_TRUE(pager.extents_in({R{segment, segment, segment + 1}}, &unknown).empty());
  EXPECT_EQ(unknown, 0u);
  pager.release_at(segment);
}

TEST(Pager, PiecesAreAdjacentAndPagedOnTheirOwn) {
  PagerOptions o = small_options("pieces");
  Pager pager(make_host_device(), o);
  const size_t page = o.pool.page_size;
  const ExtentId before = pager.create(1000);  // a neighbour sharing the first page
  const std::vector<ExtentId> ids = pager.create_pieces({2 * page, 2 * page, 12345});
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(pager.pieces(ids[0]), ids);
  EXPECT_EQ(pager.pieces(before), std::vector<ExtentId>{before});
  EXPECT_EQ(pager.address(ids[1]), pager.address(ids[0]) + 2 * page);
  EXPECT_EQ(pager.address(ids[2]), pager.address(ids[1]) + 2 * page);
  for (ExtentId id : ids) {
    pager.wait(pager.page_in({id}));
    fill_random(pager.address(id), pager.size(id), uint32_t(id));
    pager.wait(pager.page_out({id}));
  }
  // One piece in: its pages only (two, plus one it may share with a neighbour).
  pager.reset_peak();
  pager.wait(pager.page_in({ids[1]}));
  EXPECT_LE(pager.stats().mapped_bytes, 3 * page);
  EXPECT_EQ(pager.residency(ids[0]), Residency::kFile);
  EXPECT_TRUE(equals_random(pager.address(ids[1]), 2 * page, uint32_t(ids[1])));
  pager.wait(pager.page_in({ids[0], ids[2]}));
  for (ExtentId id : ids) EXPECT_TRUE(equals_random(pager.address(id), pager.size(id), uint32_t(id)));
  for (ExtentId id : ids) pager.release(id);
  pager.release(before);
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
  EXPECT_EQ(pager.stats().extents, 0u);
  EXPECT_THROW(pager.create_pieces({4095, 10}), UsageError);
  EXPECT_THROW(pager.create_pieces({4096, 0}), UsageError);
  EXPECT_THROW(pager.create_pieces({}), UsageError);
  EXPECT_EQ(pager.stats().extents, 0u);
}

TEST(Pager, BudgetIsNeverExceeded) {
  PagerOptions o = small_options("budget");
  o.pool.hbm_budget = 8 * o.pool.page_size;
  Pager pager(make_host_device(), o);
  std::vector<ExtentId> ids;
  for (int i = 0; i < 40; i++) ids.push_back(pager.create(50000 + 1000 * i));
  for (int round = 0; round < 3; round++) {
    for (size_t i = 0; i + 4 <= ids.size(); i += 4) {
      std::vector<ExtentId> bucket(ids.begin() + i, ids.begin() + i + 4);
      pager.wait(pager.page_in(bucket));
      for (ExtentId id : bucket) fill_random(pager.address(id), pager.size(id), uint32_t(id + round));
      pager.wait(pager.page_out(bucket));
    }
  }
  EXPECT_LE(pager.stats().peak_mapped_bytes, o.pool.hbm_budget);
  EXPECT_GT(pager.stats().peak_mapped_bytes, 0u);
  // Everything at once does not fit: refused, and nothing changes.
  EXPECT_THROW(pager.wait(pager.page_in(ids)), OutOfMemoryError);
  for (ExtentId id : ids) EXPECT_EQ(pager.residency(id), Residency::kFile);
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
  pager.wait(pager.page_in({ids[5]}));
  EXPECT_TRUE(equals_random(pager.address(ids[5]), pager.size(ids[5]), uint32_t(ids[5] + 2)));
}

TEST(Pager, FailedPageOutLeavesDataResident) {
  // In a child: a file-size limit makes the page-out fail; the data must stay intact.
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 0;
    try {
      Pager pager(make_host_device(), small_options("fsize"));
      const ExtentId id = pager.create(3 << 20);
      pager.wait(pager.page_in({id}));
      fill_random(pager.address(id), 3 << 20, 42);
      rlimit limit{1 << 20, RLIM_INFINITY};
      setrlimit(RLIMIT_FSIZE, &limit);
      try {
        pager.wait(pager.page_out({id}));
        code = 10;  // should have failed
      } catch (const NoSpaceError& e) {
        if (std::strstr(e.what(), "state.bin") == nullptr) code = 11;
      }
      if (code == 0 && pager.residency(id) != Residency::kResident) code = 12;
      if (code == 0 && !equals_random(pager.address(id), 3 << 20, 42)) code = 13;
      limit.rlim_cur = RLIM_INFINITY;
      setrlimit(RLIMIT_FSIZE, &limit);
      if (code == 0) {
        pager.wait(pager.page_out({id}));  // retry succeeds once space is back
        pager.wait(pager.page_in({id}));
        if (!equals_random(pager.address(id), 3 << 20, 42)) code = 14;
      }
      pager.close();
    } catch (...) {
      code = 20;
    }
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(Pager, TruncatedStoreFileIsReported) {
  Pager pager(make_host_device(), small_options("truncated"));
  const ExtentId id = pager.create(200000);
  pager.wait(pager.page_in({id}));
  fill_random(pager.address(id), 200000, 1);
  pager.wait(pager.page_out({id}));
  ASSERT_EQ(truncate(pager.file_path().c_str(), 4096), 0);
  EXPECT_THROW(pager.wait(pager.page_in({id})), CorruptStoreError);
  EXPECT_EQ(pager.residency(id), Residency::kFile);
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
}

TEST(Pager, SecondPagerOnSameDirectoryIsRefused) {
  Pager pager(make_host_device(), small_options("busy"));
  EXPECT_THROW(Pager(make_host_device(), small_options("busy")), StoreBusyError);
}

TEST(Pager, PagingTheSameExtentTwiceAtOnceIsRefused) {
  Pager pager(make_host_device(), small_options("twice"));
  const ExtentId id = pager.create(8 << 20);
  pager.wait(pager.page_in({id}));
  Ticket out = pager.page_out({id});
  if (!pager.is_done(out)) {
    EXPECT_THROW(pager.page_in({id}), UsageError);
  }
  pager.wait(out);
}

TEST(Pager, ReleaseUnmapsAndCloseRemovesDirectory) {
  const std::string dir = test_dir("close");
  PagerOptions o = small_options("close");
  Pager pager(make_host_device(), o);
  const ExtentId a = pager.create(100000), b = pager.create(100000);
  pager.wait(pager.page_in({a, b}));
  const size_t mapped = pager.stats().mapped_bytes;
  pager.release(a);
  EXPECT_LT(pager.stats().mapped_bytes, mapped);
  pager.close();
  EXPECT_NE(access(dir.c_str(), F_OK), 0);
  EXPECT_THROW(pager.create(10), UsageError);
  pager.release(b);  // still allowed: tensors die after close
}

}  // namespace
}  // namespace statepager

namespace statepager {
namespace {

// A tensor may die while its page-out waits for a range a save holds; the save's thread
// may need the dying thread's lock (Python's GIL) to copy it. Release never waits: the
// extent is freed when its bucket completes.
TEST(Pager, ReleaseWhilePagingNeverWaits) {
  Pager pager(make_host_device(), small_options("release-paging"));
  const ExtentId a = pager.create(100000);
  pager.wait(pager.page_in({a}));
  fill_random(pager.address(a), 100000, 7);
  pager.wait(pager.page_out({a}));
  const std::vector<Placement> held = pager.hold({a});
  pager.wait(pager.page_in({a}));
  const Ticket out = pager.page_out({a});  // waits, unstarted, for the held range
  pager.release(a);
  EXPECT_EQ(pager.stats().extents, 1u);  // address and range reserved until it completes
  EXPECT_FALSE(pager.is_done(out));
  pager.unhold(held.at(0).range);
  pager.wait(out);
  EXPECT_EQ(pager.stats().extents, 0u);
  EXPECT_FALSE(pager.exists(a));
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
}

TEST(Pager, DiscardUnmapsWithoutWriting) {
  Pager pager(make_host_device(), small_options("discard"));
  const ExtentId id = pager.create(300000);
  pager.wait(pager.page_in({id}));
  fill_random(pager.address(id), 300000, 5);
  pager.wait(pager.discard({id}));
  EXPECT_EQ(pager.residency(id), Residency::kZero);
  EXPECT_EQ(pager.stats().bytes_written, 0u);
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
  pager.wait(pager.page_in({id}));  // zero again, nothing read
  EXPECT_EQ(pager.stats().bytes_read, 0u);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(pager.address(id))[12345], 0);
}

}  // namespace
}  // namespace statepager

namespace statepager {
namespace {

// Segments are PyTorch's memory (its small blocks share them): never found as pager
// tensors, so never paged; release_at() frees segments only.
TEST(Pager, SegmentsAreNotPagerTensors) {
  Pager pager(make_host_device(), small_options("segments"));
  const uintptr_t seg = pager.create_segment(3 << 16);
  const ExtentId t = pager.create(1000);
  EXPECT_TRUE(pager.owns_address(seg));
  EXPECT_FALSE(pager.find(seg).has_value());
  EXPECT_EQ(pager.find(pager.address(t)), t);
  EXPECT_THROW(pager.release_at(pager.address(t)), UsageError);
  pager.release_at(seg);
  EXPECT_THROW(pager.release_at(seg), UsageError);
  pager.release(t);
}

// Named stores: each its own file in a subdirectory of the store directory. Extents move
// between stores without copies: at once without bytes at rest, else on their next
// page-in, which still reads the old range.
TEST(Pager, NamedStoresHoldTheirExtents) {
  const PagerOptions o = small_options("stores");
  Pager pager(make_host_device(), o);
  EXPECT_EQ(pager.open_store(""), 0u);
  const unsigned dense = pager.open_store("0-dense");
  EXPECT_EQ(pager.open_store("0-dense"), dense);
  EXPECT_EQ(pager.store_name(dense), "0-dense");
  EXPECT_THROW(pager.open_store("../x"), UsageError);
  EXPECT_THROW(pager.open_store(".hidden"), UsageError);
  const std::string dense_file = o.directory + "/0-dense/state.bin";
  auto file_size = [](const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 ? static_cast<size_t>(st.st_size) : size_t(0);
  };

  const ExtentId a = pager.create(300000, dense);
  const ExtentId b = pager.create(200000);
  const ExtentId c = pager.create(100000);
  pager.wait(pager.page_in({a, b}));
  fill_random(pager.address(a), 300000, 1);
  fill_random(pager.address(b), 200000, 2);
  pager.wait(pager.page_out({a, b}));
  EXPECT_GE(file_size(pager.file_path()), 200000u);
  EXPECT_LT(file_size(pager.file_path()), 300000u);
  EXPECT_GE(file_size(dense_file), 300000u);

  pager.move_to_store({b, c}, dense);
  EXPECT_EQ(pager.store_of(b), dense);
  EXPECT_EQ(pager.store_of(c), dense);
  EXPECT_EQ(pager.residency(b), Residency::kFile);
  pager.wait(pager.page_in({b}));  // from the default store
  EXPECT_TRUE(equals_random(pager.address(b), 200000, 2));
  pager.wait(pager.page_out({b}));  // into the dense store
  EXPECT_GE(file_size(dense_file), 500000u);
  const std::vector<std::string> files = pager.store_files();
  for (const Placement& p : pager.hold({a, b})) {
    EXPECT_EQ(p.range / UringFile::kRegionBytes, dense);
    for (const UringFile::Span& s : p.spans) EXPECT_EQ(files.at(s.file), dense_file);
    pager.unhold(p.range);
  }

  pager.move_to_store({a}, 0);      // pending: a's bytes stay in the dense store
  pager.move_to_store({a}, dense);  // and the move is called off
  EXPECT_EQ(pager.store_of(a), dense);
  pager.wait(pager.page_in({a, b}));
  EXPECT_TRUE(equals_random(pager.address(a), 300000, 1));
  EXPECT_TRUE(equals_random(pager.address(b), 200000, 2));
  EXPECT_THROW(pager.move_to_store({a}, 7), UsageError);
  pager.close();
  EXPECT_NE(::access(o.directory.c_str(), F_OK), 0) << "named stores are removed on close";
}

// Unset, the I/O shape follows the medium the store's file turned out to be on.
TEST(Pager, IoShapeFollowsTheMedium) {
  for (const char* root : {"/tmp", "/dev/shm"}) {
    PagerOptions o;
    o.directory = std::string(root) + "/statepager-pager-test-io-" + std::to_string(getpid());
    o.pool.arena_size = size_t(1) << 30;
    Pager pager(make_host_device(), o);
    const PagerStats s = pager.stats();
    const IoShape want = io_shape_for(s.direct_io);
    EXPECT_EQ(s.io_depth, want.depth) << root;
    EXPECT_EQ(s.io_block, want.block_bytes) << root;
  }
  EXPECT_NE(io_shape_for(true).block_bytes, io_shape_for(false).block_bytes);
  PagerOptions o = small_options("io-shape");
  Pager pager(make_host_device(), o);  // set: kept as given
  EXPECT_EQ(pager.stats().io_depth, 8u);
  EXPECT_EQ(pager.stats().io_block, size_t(32) << 10);
}

// Options outside their ranges are refused before the store directory is touched (no
// SIGFPE for a zero page, no OOM kill for a 1 TiB one).
TEST(Pager, OptionsOutOfRangeAreRefused) {
  auto refused = [](void (*change)(PagerOptions&), const char* what) {
    PagerOptions o = small_options("options");
    change(o);
    try {
      Pager pager(make_host_device(), o);
      ADD_FAILURE() << what << " was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::strstr(e.what(), what), nullptr) << e.what();
    }
    EXPECT_NE(::access(o.directory.c_str(), F_OK), 0) << what;
  };
  refused([](PagerOptions& o) { o.pool.page_size = 0; }, "page_size");
  refused([](PagerOptions& o) { o.pool.page_size = 4097; }, "page_size");
  refused([](PagerOptions& o) { o.pool.page_size = size_t(1) << 40; }, "page_size");
  refused([](PagerOptions& o) { o.pool.arena_size = 0; }, "arena_size");
  refused([](PagerOptions& o) { o.pool.arena_size = size_t(1) << 50; }, "arena_size");
  refused([](PagerOptions& o) { o.pool.arena_size = o.pool.page_size - 4096; }, "one page");
  refused([](PagerOptions& o) { o.pool.hbm_budget = 4096; }, "hbm_budget");
  refused([](PagerOptions& o) { o.io_depth = kMaxIoDepth + 1; }, "io_depth");
  refused([](PagerOptions& o) { o.io_block = 1000; }, "io_block");
  refused([](PagerOptions& o) { o.io_block = kMaxIoBlockBytes + 4096; }, "io_block");
  EXPECT_THROW(UringFile("/tmp/statepager-uring-depth", UringFile::Options{5000, true}),
               UsageError);
}

// An extent larger than the arena is refused; the arena never hands out a range that
// wraps around the address space.
TEST(Pager, ExtentLargerThanTheArenaIsRefused) {
  Pager pager(make_host_device(), small_options("huge"));
  EXPECT_THROW(pager.create(size_t(1) << 33), UsageError);
  EXPECT_THROW(pager.create(~size_t(0) - 100), UsageError);
  EXPECT_EQ(pager.stats().extents, 0u);
  Arena arena(uintptr_t(1) << 40, size_t(1) << 20);
  EXPECT_THROW(arena.allocate(~size_t(0) - 4096, 4096), OutOfMemoryError);
}

// The host device, failing on demand like a CUDA context after an illegal address.
class FailingDevice final : public WrappedDevice {
 public:
  explicit FailingDevice(const bool& fail) : fail_(fail) {}
  void unreserve(uintptr_t a, size_t b) override {
    check();
    WrappedDevice::unreserve(a, b);
  }
  void release_page(PhysicalPage p, size_t b) override {
    check();
    WrappedDevice::release_page(p, b);
  }
  void unmap(uintptr_t a, size_t b) override {
    check();
    WrappedDevice::unmap(a, b);
  }
  void free_staging(void* p, size_t b) override {
    check();
    WrappedDevice::free_staging(p, b);
  }
  void synchronize() override { check(); }
  bool is_done(Fence f) override {
    check();
    return WrappedDevice::is_done(f);
  }

 private:
  void check() const {
    if (fail_) throw DeviceError("injected: the device failed");
  }
  const bool& fail_;
};

// A device that fails while buckets wait for their copies (CUDA after a kernel's illegal
// address: every later query fails) fails those buckets with its error; the I/O thread
// goes on (before, the failed query ended the process in std::terminate), their extents
// keep their states of before, and once the device works the same buckets page again.
TEST(Pager, ADeviceFailingUnderBucketsInFlightFailsThemAndNothingElse) {
  bool fail = false;
  Pager pager(std::make_unique<FailingDevice>(fail), small_options("failing-fence"));
  const ExtentId kept = pager.create(100000), fresh = pager.create(300000);
  pager.wait(pager.page_in({kept}));
  std::memset(reinterpret_cast<void*>(pager.address(kept)), 7, pager.size(kept));
  fail = true;
  // A page-in's zero fill and a discard each wait for a fence; the unmap after the
  // failed page-in fails as well.
  const Ticket in = pager.page_in({fresh});
  EXPECT_THROW(pager.wait(in), DeviceError);
  EXPECT_THROW(pager.wait(pager.discard({kept})), DeviceError);
  EXPECT_EQ(pager.residency(fresh), Residency::kZero);
  EXPECT_EQ(pager.residency(kept), Residency::kResident);
  fail = false;
  pager.wait(pager.page_in({fresh}));
  const auto* zeros = reinterpret_cast<const uint8_t*>(pager.address(fresh));
  EXPECT_EQ(zeros[0], 0);
  EXPECT_EQ(zeros[pager.size(fresh) - 1], 0);
  pager.wait(pager.page_out({kept, fresh}));
  pager.wait(pager.page_in({kept}));
  const auto* bytes = reinterpret_cast<const uint8_t*>(pager.address(kept));
  EXPECT_EQ(bytes[0], 7);
  EXPECT_EQ(bytes[pager.size(kept) - 1], 7);
  pager.close();
}

// The host device counting its synchronize() calls.
class SyncCountingDevice final : public WrappedDevice {
 public:
  void synchronize() override {
    syncs++;
    WrappedDevice::synchronize();
  }
  int syncs = 0;
};

// A resident tensor (or segment) is let go as cudaFree lets memory go: after the
// device's queued work, which may still use its pages; one at rest needs no wait.
TEST(Pager, ReleasingAResidentExtentWaitsForTheDeviceFirst) {
  auto owned = std::make_unique<SyncCountingDevice>();
  SyncCountingDevice& device = *owned;
  Pager pager(std::move(owned), small_options("release-sync"));
  const ExtentId resident = pager.create(100000), at_rest = pager.create(100000);
  pager.wait(pager.page_in({resident, at_rest}));
  pager.wait(pager.page_out({at_rest}));
  device.syncs = 0;
  pager.release(at_rest);
  EXPECT_EQ(device.syncs, 0);
  pager.release(resident);
  EXPECT_EQ(device.syncs, 1);
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
  pager.release_at(pager.create_segment(300000));
  EXPECT_EQ(device.syncs, 2);
  EXPECT_FALSE(pager.exists(resident));
}

// The host device out of memory (cuMemCreate failing) once `room` more pages are made.
class NoMemoryDevice final : public WrappedDevice {
 public:
  PhysicalPage create_page(size_t b) override {
    if (room == 0) throw OutOfMemoryError("injected: the device is out of memory");
    room--;
    return WrappedDevice::create_page(b);
  }
  size_t room = ~size_t(0);
};

// A page-in or segment the device has no memory for leaves everything as before: the
// next one maps its pages and holds its bytes.
TEST(Pager, DeviceOutOfMemoryLeavesNothingHalfMapped) {
  auto owned = std::make_unique<NoMemoryDevice>();
  NoMemoryDevice& device = *owned;
  Pager pager(std::move(owned), small_options("no-memory"));
  const ExtentId id = pager.create(300000);  // several pages: the second one fails
  device.room = 1;
  EXPECT_THROW(pager.page_in({id}), OutOfMemoryError);
  device.room = 1;
  EXPECT_THROW(pager.create_segment(300000), OutOfMemoryError);
  EXPECT_EQ(pager.residency(id), Residency::kZero);
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
  device.room = ~size_t(0);
  pager.wait(pager.page_in({id}));
  std::memset(reinterpret_cast<void*>(pager.address(id)), 9, pager.size(id));
  pager.wait(pager.page_out({id}));
  pager.wait(pager.page_in({id}));
  const auto* bytes = reinterpret_cast<const uint8_t*>(pager.address(id));
  EXPECT_EQ(bytes[0], 9);
  EXPECT_EQ(bytes[pager.size(id) - 1], 9);
  const uintptr_t segment = pager.create_segment(300000);
  std::memset(reinterpret_cast<void*>(segment), 1, 300000);  // mapped
  pager.release_at(segment);
}

// close() on a failing device still deletes the store and rethrows the device's error;
// destroying the Pager (and its Pool, still holding a segment) then throws nothing.
TEST(Pager, CloseOnAFailingDeviceDeletesTheStoreAndDestructionNeverThrows) {
  bool fail = false;
  const PagerOptions o = small_options("failing");
  {
    Pager pager(std::make_unique<FailingDevice>(fail), o);
    const ExtentId id = pager.create(100000);
    pager.wait(pager.page_in({id}));
    pager.create_segment(300000);  // stays mapped after close, until the Pool goes
    fail = true;
    EXPECT_THROW(pager.close(), DeviceError);
    EXPECT_NE(::access(o.directory.c_str(), F_OK), 0) << "the store was not deleted";
    EXPECT_EQ(pager.residency(id), Residency::kZero);
  }  // ~Pager, ~Pool and ~PagePool meet the failing device: no std::terminate
  {
    Pager pager(std::make_unique<FailingDevice>(fail), small_options("failing-dtor"));
    fail = false;
    pager.wait(pager.page_in({pager.create(100000)}));
    fail = true;
  }  // ~Pager closes on a failing device and swallows the error
}

}  // namespace
}  // namespace statepager
