// The host tier on the host backend: budgets, placement, epochs, failures, snapshots.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "allocator/pager.h"
#include "allocator/store_restore.h"
#include "allocator/store_snapshot.h"
#include "backing/errors.h"
#include "child_process.h"
#include "pager_options.h"
#include "temp_dir.h"
#include "wrapped_device.h"

namespace statepager {
namespace {

constexpr size_t kExtentBytes = 300001;  // not a multiple of 4 KiB
constexpr size_t kRounded = 303104;      // its host range: 4 KiB-rounded

class HostTierTest : public ::testing::Test {
 protected:
  PagerOptions options(size_t host_budget) const {
    PagerOptions o = test_options(dir_.file("store"));
    o.host_budget = host_budget;
    return o;
  }
  std::string file(const std::string& name) const { return dir_.file(name); }

 private:
  TempDir dir_;
};

std::vector<uint8_t> pattern(ExtentId id, uint32_t seed, size_t bytes) {
  std::vector<uint8_t> out((bytes + 7) / 8 * 8, 0);
  uint64_t x = (uint64_t{seed} << 32 | id) * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < out.size(); i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&out[i], &x, 8);
  }
  out.resize(bytes);
  return out;
}

std::vector<ExtentId> make_extents(Pager& pager, int n) {
  std::vector<ExtentId> ids;
  for (int i = 0; i < n; i++) ids.push_back(pager.create(kExtentBytes));
  return ids;
}

// Pages the extents in, writes pattern(seed) into each, pages them out.
void write_all(Pager& pager, const std::vector<ExtentId>& ids, uint32_t seed) {
  pager.wait(pager.page_in(ids));
  for (ExtentId id : ids) {
    const std::vector<uint8_t> bytes = pattern(id, seed, pager.size(id));
    std::memcpy(reinterpret_cast<void*>(pager.address(id)), bytes.data(), bytes.size());
  }
  pager.wait(pager.page_out(ids));
}

// Pages the extent in, compares it with pattern(seed), pages it out again.
bool holds(Pager& pager, ExtentId id, uint32_t seed) {
  pager.wait(pager.page_in({id}));
  const std::vector<uint8_t> want = pattern(id, seed, pager.size(id));
  const bool same =
      std::memcmp(reinterpret_cast<void*>(pager.address(id)), want.data(), want.size()) == 0;
  pager.wait(pager.page_out({id}));
  return same;
}

uint64_t file_bytes(const std::vector<std::string>& paths) {
  uint64_t n = 0;
  for (const std::string& p : paths) n += std::filesystem::file_size(p);
  return n;
}

size_t count(Pager& pager, const std::vector<ExtentId>& ids, Residency state) {
  size_t n = 0;
  for (ExtentId id : ids) n += pager.residency(id) == state;
  return n;
}

TEST_F(HostTierTest, BudgetThatHoldsTheStateMovesNoFileBytes) {
  Pager pager(make_host_device(), options(8 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 8);
  write_all(pager, ids, 1);
  EXPECT_EQ(count(pager, ids, Residency::kHost), ids.size());
  for (int round = 0; round < 3; round++) {
    pager.wait(pager.page_in(ids));
    pager.wait(pager.page_out(ids));
  }
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
  const PagerStats s = pager.stats();
  EXPECT_EQ(s.bytes_written, 0u);
  EXPECT_EQ(s.bytes_read, 0u);
  EXPECT_EQ(s.host_bytes, ids.size() * kExtentBytes);
  EXPECT_EQ(s.host_used_bytes, ids.size() * kRounded);
  EXPECT_EQ(s.host_budget, 8 * kRounded);
  // write_all, the rounds, holds()
  EXPECT_EQ(s.bytes_to_host, (1 + 3 + 1) * ids.size() * kExtentBytes);
  EXPECT_EQ(s.mapped_bytes, 0u);
}

// The host device whose device-to-host queue is held: its fences do not pass until
// held is cleared, as copies still running on a GPU; fences of callers' streams pass.
class HeldCopiesDevice final : public WrappedDevice {
 public:
  static constexpr Fence kHeldFence = 1;
  Fence record(CopyQueue q) override {
    return q == CopyQueue::kToHost ? kHeldFence : WrappedDevice::record(q);
  }
  bool is_done(Fence f) override { return f != kHeldFence || !held; }
  void wait(Fence f) override {
    while (!is_done(f)) std::this_thread::yield();
  }
  std::atomic<bool> held{true};
};

// A discard unmaps once its stream's work is done, not behind the page-out copies queued
// on the device-to-host queue before it.
TEST_F(HostTierTest, ADiscardDoesNotWaitForPageOutsQueuedBeforeIt) {
  auto owned = std::make_unique<HeldCopiesDevice>();
  HeldCopiesDevice& device = *owned;
  Pager pager(std::move(owned), options(4 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 2);
  pager.wait(pager.page_in(ids));
  const Ticket out = pager.page_out({ids[0]});
  const Ticket dropped = pager.discard({ids[1]});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!pager.is_done(dropped) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  EXPECT_TRUE(pager.is_done(dropped));
  EXPECT_FALSE(pager.is_done(out));
  EXPECT_EQ(pager.residency(ids[1]), Residency::kZero);
  device.held = false;
  pager.wait(out);
  pager.wait(dropped);
  EXPECT_EQ(pager.residency(ids[0]), Residency::kHost);
}

TEST_F(HostTierTest, PageInFreesTheHostRange) {
  Pager pager(make_host_device(), options(4 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 4);
  write_all(pager, ids, 1);
  pager.wait(pager.page_in({ids[0], ids[1]}));
  EXPECT_EQ(pager.stats().host_used_bytes, 2 * kRounded);
  EXPECT_EQ(pager.residency(ids[0]), Residency::kResident);
  EXPECT_EQ(pager.residency(ids[2]), Residency::kHost);
}

TEST_F(HostTierTest, AboveTheBudgetPageOutsGoToTheStore) {
  Pager pager(make_host_device(), options(3 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 8);
  write_all(pager, ids, 1);
  EXPECT_EQ(count(pager, ids, Residency::kHost), 3u);
  EXPECT_EQ(count(pager, ids, Residency::kFile), 5u);
  EXPECT_EQ(pager.stats().bytes_written, 5 * kExtentBytes);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
  write_all(pager, ids, 2);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 2)) << "extent " << id;
}

TEST_F(HostTierTest, ZeroBudgetIsTheStoreAlone) {
  Pager pager(make_host_device(), options(0));
  const std::vector<ExtentId> ids = make_extents(pager, 3);
  write_all(pager, ids, 1);
  EXPECT_EQ(count(pager, ids, Residency::kFile), ids.size());
  const PagerStats s = pager.stats();
  EXPECT_EQ(s.host_budget, 0u);
  EXPECT_EQ(s.bytes_to_host, 0u);
  EXPECT_EQ(s.bytes_written, ids.size() * kExtentBytes);
}

TEST_F(HostTierTest, BudgetOutOfRangeIsRefused) {
  PagerOptions o = options(kMaxHostBudget + 1);
  EXPECT_THROW(Pager(make_host_device(), o), UsageError);
}

TEST_F(HostTierTest, EpochsKeepCommittedHostBytes) {
  Pager pager(make_host_device(), options(16 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 6);
  write_all(pager, ids, 1);
  uint64_t epoch = pager.begin_epoch(ids);
  write_all(pager, ids, 2);  // fresh host ranges: the committed ones stay
  EXPECT_EQ(pager.stats().host_used_bytes, 2 * ids.size() * kRounded);
  pager.abort_epoch(epoch);
  EXPECT_EQ(pager.stats().host_used_bytes, ids.size() * kRounded);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "abort lost extent " << id;
  epoch = pager.begin_epoch(ids);
  write_all(pager, ids, 3);
  pager.commit_epoch(epoch);
  EXPECT_EQ(pager.stats().host_used_bytes, ids.size() * kRounded);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 3)) << "commit lost extent " << id;
}

// The committed state fills the host tier, so a step writes into the store; an abort
// returns every extent to its committed bytes and tier.
TEST_F(HostTierTest, AbortAcrossTiers) {
  Pager pager(make_host_device(), options(6 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 6);
  write_all(pager, {ids[0], ids[1], ids[2]}, 1);
  write_all(pager, {ids[3], ids[4], ids[5]}, 1);
  const uint64_t epoch = pager.begin_epoch(ids);
  write_all(pager, ids, 2);
  EXPECT_EQ(count(pager, ids, Residency::kFile), 6u);  // the host is full of committed bytes
  pager.abort_epoch(epoch);
  EXPECT_EQ(count(pager, ids, Residency::kHost), 6u);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
}

// A page-out whose store write fails (no space, a file-size limit in a child) leaves its
// extents resident and intact and gives their fresh host ranges back.
TEST_F(HostTierTest, FailedPageOutGivesTheHostRangesBack) {
  const PagerOptions o = options(2 * kRounded);
  EXPECT_TRUE(in_child([&] {
    Pager pager(make_host_device(), o);
    const std::vector<ExtentId> ids = make_extents(pager, 4);
    const uint64_t epoch = pager.begin_epoch(ids);
    pager.wait(pager.page_in(ids));
    for (ExtentId id : ids) {
      const std::vector<uint8_t> bytes = pattern(id, 1, pager.size(id));
      std::memcpy(reinterpret_cast<void*>(pager.address(id)), bytes.data(), bytes.size());
    }
    rlimit limit{0, RLIM_INFINITY};
    setrlimit(RLIMIT_FSIZE, &limit);
    bool failed = false;
    try {
      pager.wait(pager.page_out(ids));
    } catch (const NoSpaceError&) {
      failed = true;
    }
    check(failed, "the page-out did not fail");
    check(pager.stats().host_used_bytes == 0, "the host ranges were not given back");
    for (ExtentId id : ids) check(pager.residency(id) == Residency::kResident, "not resident");
    limit.rlim_cur = RLIM_INFINITY;
    setrlimit(RLIMIT_FSIZE, &limit);
    pager.wait(pager.page_out(ids));  // with space back the step completes
    pager.commit_epoch(epoch);
    for (ExtentId id : ids) check(holds(pager, id, 1), "bytes lost");
  }));
}

TEST_F(HostTierTest, SnapshotCopiesHostExtentsAndRestoreFillsThem) {
  Pager pager(make_host_device(), options(2 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 3);
  write_all(pager, ids, 1);  // two in the host, one in the store
  ASSERT_EQ(count(pager, ids, Residency::kHost), 2u);
  const std::string out = file("ckpt.bin");
  {
    StoreSnapshot snapshot(pager, ids);
    std::vector<StoreSnapshot::Target> targets;
    for (size_t i = 0; i < ids.size(); i++) targets.push_back({0, i * kRounded});
    pager.wait(pager.page_in(ids));  // training goes on: the held host ranges stay intact
    pager.wait(pager.discard(ids));
    EXPECT_GT(pager.stats().host_used_bytes, 0u) << "held host ranges were reused";
    snapshot.copy_to({out}, targets);
  }
  EXPECT_EQ(pager.stats().host_used_bytes, 0u);
  std::vector<uint64_t> offsets;
  for (size_t i = 0; i < ids.size(); i++) offsets.push_back(i * kRounded);
  // Into the host tier while it has room (two of three), the rest into the store.
  restore_extents(pager, ids, std::vector<bool>(ids.size(), false), out, offsets);
  EXPECT_EQ(count(pager, ids, Residency::kHost), 2u);
  EXPECT_EQ(count(pager, ids, Residency::kFile), 1u);
  EXPECT_EQ(pager.stats().host_used_bytes, 2 * kRounded);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
}

TEST_F(HostTierTest, RestoreOfHostExtentsLetsTheirOldRangesGo) {
  Pager pager(make_host_device(), options(4 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 2);
  write_all(pager, ids, 1);
  const std::string src = file("src.bin");
  {
    StoreSnapshot snapshot(pager, ids);
    snapshot.copy_to({src}, {{0, 0}, {0, kRounded}});
  }
  write_all(pager, ids, 2);
  const uint64_t store_bytes = file_bytes(pager.store_files());
  restore_extents(pager, ids, {false, true}, src, {0, kRounded});
  EXPECT_EQ(pager.stats().host_used_bytes, kRounded);  // the new range alone
  EXPECT_EQ(file_bytes(pager.store_files()), store_bytes) << "a restore into host room grew the store";
  EXPECT_EQ(pager.residency(ids[0]), Residency::kHost);
  EXPECT_EQ(pager.residency(ids[1]), Residency::kZero);
  EXPECT_TRUE(holds(pager, ids[0], 1));
}

// A restore that fails midway gives its fresh host ranges back and changes nothing: the
// source ends inside the second extent's bytes.
TEST_F(HostTierTest, FailedRestoreGivesTheHostRangesBack) {
  Pager pager(make_host_device(), options(4 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 2);
  write_all(pager, ids, 1);
  const std::string src = file("src.bin");
  {
    StoreSnapshot snapshot(pager, {ids[0]});
    snapshot.copy_to({src}, {{0, 0}});
  }
  EXPECT_THROW(restore_extents(pager, ids, {false, false}, src, {0, kRounded / 2}),
               CorruptStoreError);
  EXPECT_EQ(pager.stats().host_used_bytes, 2 * kRounded);
  EXPECT_EQ(count(pager, ids, Residency::kHost), 2u);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
}

// Above the budget the least recently used HOST extents are written back to make room.
TEST_F(HostTierTest, SpillsTheLeastRecentlyUsed) {
  Pager pager(make_host_device(), options(4 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 5);
  write_all(pager, {ids[0], ids[1], ids[2], ids[3]}, 1);
  write_all(pager, {ids[0]}, 1);  // now ids[1] is the least recently used
  write_all(pager, {ids[4]}, 1);
  EXPECT_EQ(pager.residency(ids[4]), Residency::kHost);
  EXPECT_EQ(pager.residency(ids[1]), Residency::kFile);
  EXPECT_EQ(count(pager, ids, Residency::kHost), 4u);
  PagerStats s = pager.stats();
  EXPECT_EQ(s.spills, 1u);
  EXPECT_EQ(s.spilled_bytes, kExtentBytes);
  EXPECT_EQ(s.bytes_written, kExtentBytes);
  EXPECT_EQ(s.host_used_bytes, 4 * kRounded);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
}

// Writes pattern(seed) into the extent and pages it out saying it is needed again after
// `reuse_after` bytes of page-ins.
void write_hinted(Pager& pager, ExtentId id, uint32_t seed, uint64_t reuse_after) {
  pager.wait(pager.page_in({id}));
  const std::vector<uint8_t> bytes = pattern(id, seed, pager.size(id));
  std::memcpy(reinterpret_cast<void*>(pager.address(id)), bytes.data(), bytes.size());
  pager.wait(pager.page_out({id}, 0, reuse_after));
}

// With reuse hints the extent needed farthest ahead leaves the host tier, not the least
// recently used one.
TEST_F(HostTierTest, HintedPageOutsSpillTheExtentNeededFarthestAhead) {
  Pager pager(make_host_device(), options(4 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 5);
  const uint64_t x = 10 * kExtentBytes;  // far more than the test's own page-ins
  for (auto [i, after] : {std::pair{0, 9 * x}, {1, 1 * x}, {2, 3 * x}, {3, 5 * x}}) {
    write_hinted(pager, ids[i], 1, after);
  }
  write_hinted(pager, ids[4], 1, 2 * x);
  EXPECT_EQ(pager.residency(ids[0]), Residency::kFile);  // the oldest too, but farthest
  EXPECT_EQ(count(pager, ids, Residency::kHost), 4u);
  EXPECT_EQ(pager.stats().spills, 1u);
  write_hinted(pager, ids[0], 1, 2 * x);  // now ids[3] is needed latest
  EXPECT_EQ(pager.residency(ids[3]), Residency::kFile);
  EXPECT_EQ(pager.residency(ids[0]), Residency::kHost);
  EXPECT_EQ(pager.stats().spills, 2u);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
}

// A bucket needed later than everything in the host tier goes to the store itself: in a
// cyclic order the bucket just stepped is the one needed farthest ahead.
TEST_F(HostTierTest, ABucketNeededLastGoesToTheStoreWithoutSpilling) {
  Pager pager(make_host_device(), options(2 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 3);
  const uint64_t x = 10 * kExtentBytes;
  write_hinted(pager, ids[0], 1, 1 * x);
  write_hinted(pager, ids[1], 1, 2 * x);
  write_hinted(pager, ids[2], 1, 3 * x);
  EXPECT_EQ(pager.residency(ids[2]), Residency::kFile);
  EXPECT_EQ(count(pager, ids, Residency::kHost), 2u);
  EXPECT_EQ(pager.stats().spills, 0u);
  EXPECT_EQ(pager.stats().bytes_written, kExtentBytes);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
}

// Extents without a hint leave before hinted ones (least recently used first); one whose
// hint has passed is needed now and stays; a page-out without a hint spills hinted ones
// after the unhinted, the farthest first.
TEST_F(HostTierTest, UnhintedSpillFirstAndPassedHintsStay) {
  Pager pager(make_host_device(), options(3 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 5);
  const uint64_t x = 10 * kExtentBytes;
  write_hinted(pager, ids[0], 1, 9 * x);
  write_hinted(pager, ids[1], 1, kExtentBytes);  // passes at the next page-in
  write_hinted(pager, ids[2], 1, 0);             // no hint
  write_hinted(pager, ids[3], 1, 1 * x);
  EXPECT_EQ(pager.residency(ids[2]), Residency::kFile);
  EXPECT_EQ(pager.residency(ids[1]), Residency::kHost);
  write_hinted(pager, ids[4], 1, 1 * x);  // only ids[0] is needed later
  EXPECT_EQ(pager.residency(ids[0]), Residency::kFile);
  EXPECT_EQ(pager.residency(ids[1]), Residency::kHost);
  write_all(pager, {ids[2]}, 1);  // no hint: the farthest hinted one goes
  EXPECT_EQ(pager.residency(ids[4]), Residency::kFile);
  EXPECT_EQ(pager.stats().spills, 3u);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
}

// The extents of the bucket itself are never spilled for it: what does not fit goes to
// the store.
TEST_F(HostTierTest, ABucketLargerThanTheBudgetSpillsNothingOfItself) {
  Pager pager(make_host_device(), options(4 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 6);
  write_all(pager, ids, 1);
  EXPECT_EQ(count(pager, ids, Residency::kHost), 4u);
  EXPECT_EQ(count(pager, ids, Residency::kFile), 2u);
  EXPECT_EQ(pager.stats().spills, 0u);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
}

TEST_F(HostTierTest, ReadAheadFillsFreeRoomOnly) {
  Pager pager(make_host_device(), options(4 * kRounded));
  const std::vector<ExtentId> ids = make_extents(pager, 6);
  write_all(pager, ids, 1);  // 4 in the host, 2 in the store
  std::vector<ExtentId> in_file, in_host;
  for (ExtentId id : ids) {
    (pager.residency(id) == Residency::kFile ? in_file : in_host).push_back(id);
  }
  pager.wait(pager.read_ahead(in_file));  // no room: nothing moves
  EXPECT_EQ(count(pager, in_file, Residency::kFile), 2u);
  pager.wait(pager.page_in({in_host[0], in_host[1]}));
  pager.wait(pager.read_ahead(in_file));
  EXPECT_EQ(count(pager, in_file, Residency::kHost), 2u);
  const PagerStats s = pager.stats();
  EXPECT_EQ(s.read_aheads, 2u);
  EXPECT_EQ(s.read_ahead_bytes, 2 * kExtentBytes);
  pager.wait(pager.page_in(in_file));  // from the host: no more file reads
  EXPECT_EQ(pager.stats().bytes_read, s.bytes_read);
  EXPECT_EQ(pager.stats().bytes_from_host, s.bytes_from_host + 2 * kExtentBytes);
  pager.wait(pager.page_out(in_file));
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
}

TEST_F(HostTierTest, ReadAheadWithoutAHostTierMovesNothing) {
  Pager pager(make_host_device(), options(0));
  const std::vector<ExtentId> ids = make_extents(pager, 2);
  write_all(pager, ids, 1);
  pager.wait(pager.read_ahead(ids));
  EXPECT_EQ(count(pager, ids, Residency::kFile), 2u);
  EXPECT_EQ(pager.stats().read_aheads, 0u);
}

// A spill that fails for want of space (a file-size limit, in a child) keeps the host
// copy; the page-out that needed the room fails with its extents resident and intact.
TEST_F(HostTierTest, FailedSpillKeepsTheHostCopy) {
  const PagerOptions o = options(2 * kRounded);
  EXPECT_TRUE(in_child([&] {
    Pager pager(make_host_device(), o);
    const std::vector<ExtentId> ids = make_extents(pager, 3);
    write_all(pager, {ids[0], ids[1]}, 1);
    pager.wait(pager.page_in({ids[2]}));
    const std::vector<uint8_t> bytes = pattern(ids[2], 1, kExtentBytes);
    std::memcpy(reinterpret_cast<void*>(pager.address(ids[2])), bytes.data(), bytes.size());
    rlimit limit{0, RLIM_INFINITY};
    setrlimit(RLIMIT_FSIZE, &limit);
    bool failed = false;
    try {
      pager.wait(pager.page_out({ids[2]}));
    } catch (const NoSpaceError&) {
      failed = true;
    }
    check(failed, "the page-out did not fail");
    check(pager.residency(ids[0]) == Residency::kHost, "the spilled extent left the host");
    check(pager.residency(ids[2]) == Residency::kResident, "the bucket is not resident");
    check(pager.stats().host_used_bytes == 2 * kRounded, "host ranges changed");
    check(pager.stats().spills == 0, "a failed spill was counted");
    limit.rlim_cur = RLIM_INFINITY;
    setrlimit(RLIMIT_FSIZE, &limit);
    pager.wait(pager.page_out({ids[2]}));
    check(pager.stats().spills == 1, "the retry did not spill");
    for (ExtentId id : ids) check(holds(pager, id, 1), "bytes lost");
  }));
}

// A step bucket by bucket over a host tier full of committed bytes: each page-out spills
// the least recently used extent (committed bytes of buckets not stepped yet, or new
// bytes of stepped ones). Abort returns everything to the step's begin, commit keeps it.
TEST_F(HostTierTest, SpillsInsideAnEpochKeepItAllOrNothing) {
  for (bool commit : {false, true}) {
    Pager pager(make_host_device(), options(3 * kRounded));
    const std::vector<ExtentId> ids = make_extents(pager, 4);
    write_all(pager, {ids[0], ids[1], ids[2]}, 1);  // ids[3] stays ZERO
    const uint64_t epoch = pager.begin_epoch(ids);
    for (ExtentId id : {ids[3], ids[0], ids[1], ids[2]}) write_all(pager, {id}, 2);
    EXPECT_GE(pager.stats().spills, 4u);
    if (commit) {
      pager.commit_epoch(epoch);
      for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 2)) << "commit lost " << id;
    } else {
      pager.abort_epoch(epoch);
      for (ExtentId id : {ids[0], ids[1], ids[2]}) {
        EXPECT_TRUE(holds(pager, id, 1)) << "abort lost " << id;
      }
      EXPECT_EQ(pager.residency(ids[3]), Residency::kZero);
    }
    EXPECT_LE(pager.stats().host_used_bytes, 3 * kRounded);
  }
}

}  // namespace
}  // namespace statepager
