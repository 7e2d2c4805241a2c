// All-or-nothing changes: Pager epochs (commit, abort, buckets in flight, failures inside
// an epoch, store growth, background saves) and all-or-nothing restores, on a disk store,
// a striped RAM store and a mapped RAM store (tests/cpp/store_media.h).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>

#include "allocator/pager.h"
#include "allocator/store_restore.h"
#include "allocator/store_snapshot.h"
#include "backing/errors.h"
#include "tests/cpp/child_process.h"
#include "tests/cpp/extent_patterns.h"
#include "tests/cpp/pager_options.h"
#include "tests/cpp/store_media.h"
#include "tests/cpp/store_medium_test.h"

namespace statepager {
namespace {

class EpochTest : public StoreMediumTest {};

std::vector<ExtentId> make_extents(Pager& pager) { return make_extents(pager, 6); }

// Pages the extent in and compares it with fill(seed), then out.
bool holds(Pager& pager, ExtentId id, uint32_t seed) {
  pager.wait(pager.page_in({id}));
  const std::vector<uint8_t> want = pattern(id, seed, pager.size(id));
  const bool same = std::memcmp(reinterpret_cast<void*>(pager.address(id)), want.data(),
                                want.size()) == 0;
  pager.wait(pager.page_out({id}));
  return same;
}

size_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? size_t(st.st_size) : 0;
}

// The store's bytes on disk: all physical files (a RAM store stripes over path, path.1...).
size_t store_blocks_bytes(Pager& pager) {
  size_t bytes = 0;
  for (const std::string& path : pager.store_files()) {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0) bytes += size_t(st.st_blocks) * 512;
  }
  return bytes;
}

size_t store_size(Pager& pager) {
  size_t bytes = 0;
  for (const std::string& path : pager.store_files()) bytes += file_size(path);
  return bytes;
}

TEST_P(EpochTest, CommitKeepsTheNewBytes) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, {ids[0], ids[1], ids[2]}, 1);  // the rest stay ZERO
  const uint64_t epoch = pager.begin_epoch(ids);
  write_all(pager, ids, 2);
  pager.commit_epoch(epoch);
  for (ExtentId id : ids) {
    EXPECT_EQ(pager.residency(id), Residency::kFile);
    EXPECT_TRUE(holds(pager, id, 2)) << "extent " << id;
  }
  EXPECT_THROW(pager.commit_epoch(epoch), UsageError);  // ended
  EXPECT_THROW(pager.abort_epoch(epoch), UsageError);
}

TEST_P(EpochTest, AbortReturnsEveryExtentToItsCommittedBytesAndState) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, {ids[0], ids[1], ids[2], ids[3]}, 1);  // ids[4], ids[5] stay ZERO
  const uint64_t epoch = pager.begin_epoch(ids);
  write_all(pager, {ids[0], ids[1], ids[4]}, 2);   // stepped: new bytes at rest
  pager.wait(pager.page_in({ids[2], ids[5]}));     // being stepped: resident, changed
  fill(pager, ids[2], 3);
  fill(pager, ids[5], 3);
  pager.wait(pager.discard({ids[3]}));              // dropped in the epoch
  EXPECT_EQ(pager.residency(ids[3]), Residency::kZero);
  pager.abort_epoch(epoch);
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
  for (int i = 0; i < 6; i++) {
    EXPECT_EQ(pager.residency(ids[i]), i < 4 ? Residency::kFile : Residency::kZero) << i;
  }
  for (int i = 0; i < 6; i++) EXPECT_TRUE(holds(pager, ids[i], i < 4 ? 1 : 0)) << i;

  // The retry commits once: exactly its own bytes.
  const uint64_t retry = pager.begin_epoch(ids);
  write_all(pager, ids, 4);
  pager.commit_epoch(retry);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 4));
}

TEST_P(EpochTest, AbortWaitsForTheBucketsInFlight) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager, 12);
  write_all(pager, ids, 1);
  const uint64_t epoch = pager.begin_epoch(ids);
  // As a step that failed in its middle: some buckets being written, some being read.
  pager.wait(pager.page_in({ids[0], ids[1], ids[2], ids[3]}));
  for (int i = 0; i < 4; i++) fill(pager, ids[i], 2);
  std::vector<Ticket> tickets = {pager.page_out({ids[0], ids[1]}), pager.page_out({ids[2], ids[3]}),
                                 pager.page_in({ids[4], ids[5], ids[6]}),
                                 pager.page_in({ids[7], ids[8]})};
  pager.abort_epoch(epoch);
  for (const Ticket& t : tickets) EXPECT_TRUE(pager.is_done(t));
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
  for (ExtentId id : ids) {
    EXPECT_EQ(pager.residency(id), Residency::kFile);
    EXPECT_TRUE(holds(pager, id, 1)) << "extent " << id;
  }
}

// A page-out that fails for want of space inside an epoch (a file-size limit, in a child):
// the abort leaves the committed bytes; with space back the retry commits.
TEST_P(EpochTest, FailedPageOutInAnEpochLosesNothing) {
  const PagerOptions o = options();
  EXPECT_TRUE(in_child([&] {
    Pager pager(make_host_device(), o);
    std::vector<ExtentId> ids = make_extents(pager);
    write_all(pager, ids, 1);
    const uint64_t epoch = pager.begin_epoch(ids);
    pager.wait(pager.page_in(ids));
    for (ExtentId id : ids) fill(pager, id, 2);
    // Copy-on-write needs room beyond the committed bytes: there is none.
    rlimit limit{rlim_t(store_size(pager) / pager.store_files().size()), RLIM_INFINITY};
    setrlimit(RLIMIT_FSIZE, &limit);
    bool failed = false;
    try {
      pager.wait(pager.page_out(ids));
    } catch (const NoSpaceError&) {
      failed = true;
    }
    check(failed, "the page-out did not fail");
    pager.abort_epoch(epoch);
    limit.rlim_cur = RLIM_INFINITY;
    setrlimit(RLIMIT_FSIZE, &limit);
    for (ExtentId id : ids) check(holds(pager, id, 1), "committed bytes lost");
    const uint64_t retry = pager.begin_epoch(ids);
    write_all(pager, ids, 2);
    pager.commit_epoch(retry);
    for (ExtentId id : ids) check(holds(pager, id, 2), "the retry did not land");
  }));
}

// Freed ranges are reused: fifty steps of copy-on-write keep the store within about twice
// its extents' bytes.
TEST_P(EpochTest, StoreStaysBoundedOverManyEpochs) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager, 20);
  size_t state = 0;
  for (ExtentId id : ids) state += (pager.size(id) + 4095) / 4096 * 4096;
  for (int step = 1; step <= 50; step++) {
    const uint64_t epoch = pager.begin_epoch(ids);
    for (size_t b = 0; b < ids.size(); b += 4) {  // buckets of 4, as a step pages them
      std::vector<ExtentId> bucket(ids.begin() + long(b),
                                   ids.begin() + long(std::min(b + 4, ids.size())));
      pager.wait(pager.page_in(bucket));
      for (ExtentId id : bucket) fill(pager, id, step);
      pager.wait(pager.page_out(bucket));
    }
    pager.commit_epoch(epoch);
  }
  EXPECT_LE(store_size(pager), 2 * state + (4 << 20)) << "state " << state;
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 50));
}

// A page-out in an epoch never writes a range a background save holds, so it never waits
// for one; the save copies the bytes of its moment, and the ranges the epoch freed are
// reused only once copied.
TEST_P(EpochTest, PageOutsInAnEpochNeverWaitForASave) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, ids, 1);
  StoreSnapshot snapshot(pager, ids);
  for (int step = 2; step <= 4; step++) {  // steps run while the save has copied nothing
    const uint64_t epoch = pager.begin_epoch(ids);
    write_all(pager, ids, step);
    pager.commit_epoch(epoch);
  }
  EXPECT_EQ(pager.stats().buckets_held, 0u);
  std::vector<StoreSnapshot::Target> targets;
  uint64_t at = 0;
  for (const Placement& p : snapshot.placements()) {
    targets.push_back({0, at});
    at += p.store_bytes;
  }
  const std::string copy = file("copy");
  snapshot.copy_to({copy}, targets);
  std::ifstream in(copy, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
  for (size_t i = 0; i < ids.size(); i++) {
    const std::vector<uint8_t> want = pattern(ids[i], 1, pager.size(ids[i]));
    ASSERT_GE(bytes.size(), targets[i].offset + want.size());
    EXPECT_TRUE(std::equal(want.begin(), want.end(), bytes.begin() + long(targets[i].offset)))
        << "the save lost the bytes of its moment, extent " << ids[i];
  }
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 4));
}

// A copy that fails (here: half the extents go to /dev/full, ENOSPC) throws its error, and
// once the snapshot is released no range is held: page-outs in place go on without
// waiting, and the extents keep their bytes.
TEST_P(EpochTest, FailedSaveCopyThrowsAndHoldsNothingAfterRelease) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager, 8);
  write_all(pager, ids, 1);
  const std::string good = file("good");
  {
    StoreSnapshot snapshot(pager, ids);
    std::vector<StoreSnapshot::Target> targets;
    uint64_t at = 0;
    for (const Placement& p : snapshot.placements()) {
      targets.push_back({unsigned(targets.size() % 2), at});
      at += p.store_bytes;
    }
    EXPECT_THROW(snapshot.copy_to({good, "/dev/full"}, targets, 1 << 20), NoSpaceError);
    EXPECT_THROW(snapshot.copy_to({good, "/dev/full"}, targets), UsageError);  // once only
    snapshot.release();
  }
  write_all(pager, ids, 2);  // in place, over the ranges the snapshot held
  EXPECT_EQ(pager.stats().buckets_held, 0u);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 2));
}

TEST_P(EpochTest, WhatAnEpochRefuses) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager, 3);
  const unsigned other = pager.open_store("other");
  pager.wait(pager.page_in({ids[0]}));
  EXPECT_THROW(pager.begin_epoch(ids), UsageError);  // resident
  pager.wait(pager.page_out({ids[0]}));
  const uint64_t epoch = pager.begin_epoch(ids);
  EXPECT_THROW(pager.begin_epoch({ids[1]}), UsageError);  // in an epoch already
  EXPECT_THROW(pager.hold({ids[0]}), UsageError);
  EXPECT_THROW(pager.move_to_store({ids[0]}, other), UsageError);
  pager.move_to_store({ids[0]}, 0);  // its own store: nothing moves
  EXPECT_THROW(restore_extents(pager, {ids[0]}, {true}, file("none"), {0}), UsageError);
  const ExtentId outside = pager.create(1000);
  EXPECT_NO_THROW(pager.abort_epoch(pager.begin_epoch({outside})));  // disjoint: fine
  pager.commit_epoch(epoch);
  EXPECT_NO_THROW(pager.move_to_store({ids[0]}, other));
}

// A tensor may die in the middle of a step: its ranges, committed or new, are freed.
TEST_P(EpochTest, ReleaseInAnEpoch) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager, 3);
  write_all(pager, ids, 1);
  const uint64_t epoch = pager.begin_epoch(ids);
  write_all(pager, ids, 2);
  pager.release(ids[1]);
  pager.abort_epoch(epoch);
  EXPECT_TRUE(holds(pager, ids[0], 1));
  EXPECT_TRUE(holds(pager, ids[2], 1));
}

// Discard forgets bytes at rest too, without I/O.
TEST_P(EpochTest, DiscardForgetsBytesAtRest) {
  Pager pager(make_host_device(), options());
  const ExtentId id = pager.create(200000);
  write_all(pager, {id}, 1);
  const PagerStats before = pager.stats();
  pager.wait(pager.discard({id}));
  EXPECT_EQ(pager.residency(id), Residency::kZero);
  EXPECT_TRUE(holds(pager, id, 0));
  EXPECT_EQ(pager.stats().bytes_read, before.bytes_read);
}

// The blocks of a released extent go back to the filesystem.
TEST_P(EpochTest, ReleasedRangesArePunched) {
  Pager pager(make_host_device(), options());
  const ExtentId keep = pager.create(1 << 20), gone = pager.create(8 << 20);
  write_all(pager, {keep, gone}, 1);
  const size_t blocks = store_blocks_bytes(pager);
  pager.release(gone);
  if (GetParam().map_ram) {  // a mapped page is never punched (allocator/ram_map.h)
    EXPECT_EQ(store_blocks_bytes(pager), blocks);
  } else {
    EXPECT_LE(store_blocks_bytes(pager) + (7 << 20), blocks);
  }
  EXPECT_TRUE(holds(pager, keep, 1));
}

// A checkpoint-like file holding fill(seed) of each extent, at 4 KiB-aligned offsets.
std::vector<uint64_t> write_source(Pager& pager, const std::vector<ExtentId>& ids,
                                   uint32_t seed, const std::string& path) {
  std::ofstream f(path, std::ios::binary);
  std::vector<uint64_t> offsets;
  uint64_t at = 0;
  for (ExtentId id : ids) {
    std::vector<uint8_t> bytes = pattern(id, seed, pager.size(id));
    bytes.resize((bytes.size() + 4095) / 4096 * 4096);
    f.write(reinterpret_cast<const char*>(bytes.data()), long(bytes.size()));
    offsets.push_back(at);
    at += bytes.size();
  }
  return offsets;
}

// A restore that fails midway changes nothing: here the source ends after the third
// extent's bytes.
TEST_P(EpochTest, RestoreFailingMidwayChangesNothing) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, {ids[0], ids[1], ids[2], ids[3]}, 1);  // ids[4], ids[5] stay ZERO
  const std::string src = file("src");
  std::vector<uint64_t> offsets = write_source(pager, {ids[0], ids[1], ids[2]}, 2, src);
  offsets.insert(offsets.end(), {offsets.back() + (1 << 20), 0, offsets.back() + (2 << 20)});
  const std::vector<bool> zero = {false, false, false, false, true, false};
  EXPECT_THROW(restore_extents(pager, ids, zero, src, offsets), CorruptStoreError);
  for (int i = 0; i < 6; i++) {
    EXPECT_EQ(pager.residency(ids[i]), i < 4 ? Residency::kFile : Residency::kZero) << i;
    EXPECT_TRUE(holds(pager, ids[i], i < 4 ? 1 : 0)) << i;
  }
  // With the whole source it lands, all of it.
  offsets = write_source(pager, ids, 3, src);
  restore_extents(pager, ids, zero, src, offsets);
  for (int i = 0; i < 6; i++) EXPECT_TRUE(holds(pager, ids[i], i == 4 ? 0 : 3)) << i;
}

// Out of space midway (a file-size limit, in a child): nothing changed.
TEST_P(EpochTest, RestoreOutOfSpaceChangesNothing) {
  const PagerOptions o = options();
  const std::string src = file("src");
  EXPECT_TRUE(in_child([&] {
    Pager pager(make_host_device(), o);
    std::vector<ExtentId> ids = make_extents(pager);
    write_all(pager, ids, 1);
    const std::vector<uint64_t> offsets = write_source(pager, ids, 2, src);
    // Room for a few of the fresh ranges, not all.
    rlimit limit{rlim_t(store_size(pager) / pager.store_files().size() * 3 / 2), RLIM_INFINITY};
    setrlimit(RLIMIT_FSIZE, &limit);
    bool failed = false;
    try {
      restore_extents(pager, ids, std::vector<bool>(ids.size(), false), src, offsets);
    } catch (const NoSpaceError&) {
      failed = true;
    }
    check(failed, "the restore did not run out of space");
    limit.rlim_cur = RLIM_INFINITY;
    setrlimit(RLIMIT_FSIZE, &limit);
    for (ExtentId id : ids) {
      check(pager.residency(id) == Residency::kFile, "state changed");
      check(holds(pager, id, 1), "bytes changed");
    }
  }));
}

INSTANTIATE_TEST_SUITE_P(Media, EpochTest, ::testing::ValuesIn(kStoreMedia), medium_name);

}  // namespace
}  // namespace statepager
