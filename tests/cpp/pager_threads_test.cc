// Pager used from several threads at once, and its request counts. CI runs these (with
// the whole suite) under ThreadSanitizer (build/tsan, see scripts/test.sh), where any
// data race fails the test.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstring>
#include <thread>
#include <vector>

#include "allocator/pager.h"
#include "backing/errors.h"
#include "pager_options.h"
#include "temp_dir.h"
#include "wrapped_device.h"

namespace statepager {
namespace {

constexpr size_t kBlock = 16 << 10;  // bytes per request: buckets of many requests

PagerOptions options(const TempDir& dir) { return test_options(dir.file("store"), kBlock, 4); }

void fill(Pager& pager, ExtentId id, uint8_t value) {
  std::memset(reinterpret_cast<void*>(pager.address(id)), value, pager.size(id));
}

bool holds(Pager& pager, ExtentId id, uint8_t value) {
  const auto* b = reinterpret_cast<const uint8_t*>(pager.address(id));
  const size_t bytes = pager.size(id);
  for (size_t i = 0; i < bytes; i++) {
    if (b[i] != value) return false;
  }
  return true;
}

// Two threads page their own buckets in and out in a loop, checking every byte, while
// others poll stats() and residency(), take and release holds on the store ranges, and
// create and release extents.
TEST(PagerThreads, PagingWhileOthersPollHoldAndCreate) {
  TempDir dir;
  Pager pager(make_host_device(), options(dir));
  constexpr int kPagers = 2, kBuckets = 3, kPerBucket = 3, kRounds = 8;
  // Each extent is 3 requests long and starts a request: 9 requests per bucket each way.
  constexpr size_t kExtentBytes = 3 * kBlock;
  std::vector<std::vector<std::vector<ExtentId>>> buckets(kPagers);
  std::vector<ExtentId> all;
  for (auto& mine : buckets) {
    for (int b = 0; b < kBuckets; b++) {
      std::vector<ExtentId> bucket;
      for (int i = 0; i < kPerBucket; i++) bucket.push_back(pager.create(kExtentBytes));
      all.insert(all.end(), bucket.begin(), bucket.end());
      mine.push_back(bucket);
    }
  }
  // Every extent FILE to begin with, so each round reads and writes all of it.
  pager.wait(pager.page_in(all));
  for (ExtentId id : all) fill(pager, id, 0);
  pager.wait(pager.page_out(all));
  const PagerStats before = pager.stats();

  std::atomic<bool> stop{false};
  std::atomic<int> failures{0}, holds_taken{0};
  auto page = [&](int t) {
    for (int round = 1; round <= kRounds; round++) {
      for (const auto& bucket : buckets[t]) {
        pager.wait(pager.page_in(bucket));
        for (ExtentId id : bucket) {
          if (!holds(pager, id, uint8_t(round - 1))) failures++;
          fill(pager, id, uint8_t(round));
        }
        pager.wait(pager.page_out(bucket));
      }
    }
  };
  auto poll = [&] {
    while (!stop) {
      const PagerStats s = pager.stats();
      if (s.buckets_in < before.buckets_in || s.mapped_bytes > (size_t(1) << 30)) failures++;
      for (ExtentId id : all) (void)pager.residency(id);
      (void)pager.resident_extents();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  };
  auto hold = [&] {
    size_t next = 0;
    while (!stop) {
      const auto& bucket = buckets[next % kPagers][next / kPagers % kBuckets];
      next++;
      try {
        const std::vector<Placement> held = pager.hold(bucket);
        holds_taken++;
        std::this_thread::sleep_for(std::chrono::microseconds(200));  // page-outs wait
        for (const Placement& p : held) pager.unhold(p.range);
      } catch (const UsageError&) {
        // Some extent of the bucket was resident or being paged: try the next one.
      }
    }
  };
  auto churn = [&] {
    while (!stop) {
      const ExtentId id = pager.create(5000);
      pager.wait(pager.page_in({id}));
      fill(pager, id, 7);
      pager.wait(pager.page_out({id}));
      pager.wait(pager.page_in({id}));
      if (!holds(pager, id, 7)) failures++;
      pager.release(id);
    }
  };

  std::vector<std::thread> others;
  others.emplace_back(poll);
  others.emplace_back(poll);
  others.emplace_back(hold);
  others.emplace_back(churn);
  std::vector<std::thread> pagers;
  for (int t = 0; t < kPagers; t++) pagers.emplace_back(page, t);
  for (auto& t : pagers) t.join();
  stop = true;
  for (auto& t : others) t.join();

  EXPECT_EQ(failures, 0);
  EXPECT_GT(holds_taken, 0);
  const PagerStats s = pager.stats();
  const uint64_t moves = uint64_t{kPagers} * kBuckets * kRounds;  // per direction
  // Each round of the churn thread: a ZERO page-in (no read), then one request each way.
  const uint64_t churned = s.buckets_out - before.buckets_out - moves;
  EXPECT_EQ(s.buckets_in - before.buckets_in, moves + 2 * churned);
  EXPECT_EQ(s.read_requests - before.read_requests, moves * kPerBucket * 3 + churned);
  EXPECT_EQ(s.write_requests - before.write_requests, moves * kPerBucket * 3 + churned);
  EXPECT_EQ(s.bytes_read - before.bytes_read, moves * kPerBucket * kExtentBytes + churned * 5000);
  EXPECT_EQ(s.mapped_bytes, 0u);
}

// Each file request is counted once, when its bucket completes; a failed bucket counts
// nothing (every counter stays as it was).
TEST(PagerThreads, RequestsAreCountedOnceAndOnlyForBucketsThatMoved) {
  TempDir dir;
  Pager pager(make_host_device(), options(dir));
  const ExtentId id = pager.create(5 * kBlock);
  pager.wait(pager.page_in({id}));
  EXPECT_EQ(pager.stats().read_requests, 0u);  // ZERO: filled, not read
  pager.wait(pager.page_out({id}));
  EXPECT_EQ(pager.stats().write_requests, 5u);
  pager.wait(pager.page_in({id}));
  PagerStats s = pager.stats();
  EXPECT_EQ(s.read_requests, 5u);
  EXPECT_EQ(s.bytes_read, 5 * kBlock);
  pager.wait(pager.page_out({id}));
  ASSERT_EQ(::truncate(pager.file_path().c_str(), 2 * kBlock), 0);
  s = pager.stats();
  EXPECT_THROW(pager.wait(pager.page_in({id})), CorruptStoreError);
  const PagerStats after = pager.stats();
  EXPECT_EQ(after.read_requests, s.read_requests);
  EXPECT_EQ(after.bytes_read, s.bytes_read);
  EXPECT_EQ(after.buckets_in, s.buckets_in);
}

// A point a device call stops at, once armed, until let go.
class Gate {
 public:
  void arm() {
    std::lock_guard lock(mu_);
    armed_ = true;
  }
  void pass() {
    std::unique_lock lock(mu_);
    if (!armed_) return;
    reached_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return !armed_; });
  }
  void wait_reached() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return reached_; });
  }
  void let_go() {
    std::lock_guard lock(mu_);
    armed_ = false;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, reached_ = false;
};

// The host device whose map() waits, once armed, until let go: a page-in mapping for as
// long as cuMemSetAccess may take while a device-to-host copy runs.
class SlowMapDevice final : public WrappedDevice {
 public:
  void map(uintptr_t a, size_t b, PhysicalPage p) override {
    gate_.pass();
    WrappedDevice::map(a, b, p);
  }
  void arm() { gate_.arm(); }
  void wait_until_mapping() { gate_.wait_reached(); }
  void let_go() { gate_.let_go(); }

 private:
  Gate gate_;
};

// A Pager on a SlowMapDevice, in a store of its own.
struct SlowMapPager {
  TempDir dir;
  std::unique_ptr<SlowMapDevice> owned = std::make_unique<SlowMapDevice>();  // to the Pager
  SlowMapDevice& device = *owned;
  Pager pager{std::move(owned), options(dir)};
  size_t page = options(dir).pool.page_size;
};

// While one thread's page-in maps its pages, the Pager's lock is free: another thread
// submits a page-out and the I/O thread completes it (both need the lock).
TEST(PagerThreads, APageInMappingHoldsUpNoOtherBucket) {
  SlowMapPager slow;
  SlowMapDevice& device = slow.device;
  Pager& pager = slow.pager;
  const ExtentId out = pager.create(5 * kBlock), in = pager.create(12 * kBlock);  // new pages
  pager.wait(pager.page_in({out}));
  fill(pager, out, 0x5a);
  device.arm();
  std::thread mapping([&] { pager.wait(pager.page_in({in})); });
  device.wait_until_mapping();
  std::atomic<bool> written{false};
  std::thread writer([&] {
    pager.wait(pager.page_out({out}));
    written = true;
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!written && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const bool done_while_mapping = written;
  device.let_go();
  mapping.join();
  writer.join();
  EXPECT_TRUE(done_while_mapping) << "the page-out waited for another bucket's mapping";
  EXPECT_EQ(pager.residency(in), Residency::kResident);
  EXPECT_EQ(pager.residency(out), Residency::kFile);
  pager.wait(pager.page_in({out}));
  EXPECT_TRUE(holds(pager, out, 0x5a));
  EXPECT_EQ(pager.stats().mapped_bytes, pager.stats().peak_mapped_bytes);
}

// page_in() returns before its pages are mapped: the map thread maps them, so the
// submitting thread (a streamed step's) never waits for cuMemSetAccess.
TEST(PagerThreads, APageInReturnsBeforeItsPagesAreMapped) {
  SlowMapPager slow;
  SlowMapDevice& device = slow.device;
  Pager& pager = slow.pager;
  const ExtentId id = pager.create(3 * slow.page);
  pager.wait(pager.page_in({id}));
  fill(pager, id, 0x3c);
  pager.wait(pager.page_out({id}));
  const PagerStats before = pager.stats();
  device.arm();
  const Ticket ticket = pager.page_in({id});  // returns while the map thread is held up
  device.wait_until_mapping();
  EXPECT_FALSE(pager.is_done(ticket));
  EXPECT_EQ(pager.residency(id), Residency::kPagingIn);
  EXPECT_EQ(pager.stats().bytes_read, before.bytes_read) << "read before it was mapped";
  device.let_go();
  pager.wait(ticket);
  EXPECT_EQ(pager.residency(id), Residency::kResident);
  EXPECT_TRUE(holds(pager, id, 0x3c));
}

// The host device whose map() fails, once armed, like a CUDA context after an error.
class FailingMapDevice final : public WrappedDevice {
 public:
  void map(uintptr_t a, size_t b, PhysicalPage p) override {
    if (fail) throw DeviceError("injected: cuMemMap failed");
    WrappedDevice::map(a, b, p);
  }
  std::atomic<bool> fail{false};
};

// A mapping that fails fails its bucket at wait(), leaving it as before: its extents in
// their state and bytes, no page held, no counter moved; the next page-in maps.
TEST(PagerThreads, AFailedMappingFailsItsBucketAndLeavesItAsBefore) {
  TempDir dir;
  auto owned = std::make_unique<FailingMapDevice>();
  FailingMapDevice& device = *owned;
  Pager pager(std::move(owned), options(dir));
  const size_t page = options(dir).pool.page_size;
  const ExtentId stored = pager.create(2 * page + page / 2), fresh = pager.create(page);
  pager.wait(pager.page_in({stored}));
  fill(pager, stored, 0x77);
  pager.wait(pager.page_out({stored}));
  const PagerStats before = pager.stats();
  device.fail = true;
  const Ticket ticket = pager.page_in({stored, fresh});
  EXPECT_THROW(pager.wait(ticket), DeviceError);
  EXPECT_EQ(pager.residency(stored), Residency::kFile);
  EXPECT_EQ(pager.residency(fresh), Residency::kZero);
  const PagerStats after = pager.stats();
  EXPECT_EQ(after.mapped_bytes, before.mapped_bytes);
  EXPECT_EQ(after.bytes_read, before.bytes_read);
  EXPECT_EQ(after.buckets_in, before.buckets_in);
  EXPECT_EQ(after.zero_filled_bytes, before.zero_filled_bytes);
  device.fail = false;
  pager.wait(pager.page_in({stored, fresh}));
  EXPECT_TRUE(holds(pager, stored, 0x77));
  EXPECT_TRUE(holds(pager, fresh, 0));
}

// A page-in that meets a page another page-in is mapping waits holding none of its own:
// two page-ins never wait for each other's pages.
TEST(PagerThreads, APageInWaitingForAnothersMappingHoldsNothing) {
  SlowMapPager slow;
  SlowMapDevice& device = slow.device;
  Pager& pager = slow.pager;
  const size_t page = slow.page;
  const ExtentId own = pager.create(2 * page);                 // pages of its own
  const ExtentId mapping = pager.create(2 * page + page / 2);  // its last page is shared
  const ExtentId shared = pager.create(page / 4);              // with this one
  device.arm();
  std::thread first([&] { pager.wait(pager.page_in({mapping})); });
  device.wait_until_mapping();
  const size_t held = pager.stats().mapped_bytes;  // the first page-in's pages
  EXPECT_EQ(held, 3 * page);
  std::thread second([&] { pager.wait(pager.page_in({own, shared})); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // it meets the shared page
  EXPECT_EQ(pager.stats().mapped_bytes, held) << "the waiting page-in held its own pages";
  EXPECT_EQ(pager.residency(own), Residency::kPagingIn);
  device.let_go();
  first.join();
  second.join();
  for (ExtentId id : {mapping, shared, own}) {
    EXPECT_EQ(pager.residency(id), Residency::kResident);
  }
  fill(pager, shared, 7);
  EXPECT_TRUE(holds(pager, shared, 7));
}

// close() while a page-in waits for another's mapping: the waiting page-in is refused
// (the Pager is closed), it does not map and queue work nobody will run.
TEST(PagerThreads, APageInWaitingWhenThePagerClosesIsRefused) {
  SlowMapPager slow;
  SlowMapDevice& device = slow.device;
  Pager& pager = slow.pager;
  const size_t page = slow.page;
  const ExtentId mapping = pager.create(page + page / 2);
  const ExtentId shared = pager.create(page / 4);  // in the first one's last page
  device.arm();
  std::thread first([&] { pager.wait(pager.page_in({mapping})); });
  device.wait_until_mapping();
  std::string refused;
  std::thread second([&] {
    try {
      pager.wait(pager.page_in({shared}));
    } catch (const UsageError& e) {
      refused = e.what();
    }
  });
  std::thread closing([&] { pager.close(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // both wait by now
  device.let_go();
  first.join();
  second.join();
  closing.join();
  EXPECT_NE(refused.find("closed"), std::string::npos) << "a page-in went on: " << refused;
}

// The host device whose synchronize() and device-to-host copies stop at gates.
class GatedDevice final : public WrappedDevice {
 public:
  void synchronize() override {
    sync_gate.pass();
    WrappedDevice::synchronize();
  }
  void copy_to_host(void* d, uintptr_t s, size_t b) override {
    copy_gate.pass();
    WrappedDevice::copy_to_host(d, s, b);
  }
  Gate sync_gate, copy_gate;
};

// A resident tensor released while another thread pages it out by its id (as pause()
// pages every resident extent): release() waits for the device without the lock, and
// the page-out that began meanwhile frees the extent when it completes, not release()
// under it.
TEST(PagerThreads, AReleaseWaitingForTheDeviceLeavesAPageOutBegunMeanwhileToFreeIt) {
  TempDir dir;
  auto owned = std::make_unique<GatedDevice>();
  GatedDevice& device = *owned;
  Pager pager(std::move(owned), options(dir));
  const ExtentId id = pager.create(3 * kBlock);
  pager.wait(pager.page_in({id}));
  fill(pager, id, 5);
  device.sync_gate.arm();
  std::thread releasing([&] { pager.release(id); });
  device.sync_gate.wait_reached();  // release() waits for the device
  device.copy_gate.arm();
  const Ticket out = pager.page_out({id});
  device.copy_gate.wait_reached();  // the page-out is under way
  device.sync_gate.let_go();
  releasing.join();
  EXPECT_TRUE(pager.exists(id)) << "freed under its page-out";
  device.copy_gate.let_go();
  pager.wait(out);
  EXPECT_FALSE(pager.exists(id));
  EXPECT_EQ(pager.stats().extents, 0u);
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
}

}  // namespace
}  // namespace statepager
