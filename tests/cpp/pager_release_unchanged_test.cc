// Reads: Pager::page_in(for_read) and release_unchanged() hand extents back to their
// bytes at rest without a write (store range, host range, zeros), exactly in epochs,
// with pieces and after moves, and fall back to a page-out where those bytes are gone;
// on a disk store, a striped RAM store and a mapped RAM store (tests/cpp/store_media.h).
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstring>
#include <vector>

#include "allocator/pager.h"
#include "backing/errors.h"
#include "tests/cpp/child_process.h"
#include "tests/cpp/extent_patterns.h"
#include "tests/cpp/pager_options.h"
#include "tests/cpp/store_media.h"
#include "tests/cpp/store_medium_test.h"

namespace statepager {
namespace {

class ReleaseUnchangedTest : public StoreMediumTest {};

std::vector<ExtentId> make_extents(Pager& pager) { return make_extents(pager, 4); }

bool resident_holds(Pager& pager, ExtentId id, uint32_t seed) {
  const std::vector<uint8_t> want = pattern(id, seed, pager.size(id));
  return std::memcmp(reinterpret_cast<void*>(pager.address(id)), want.data(), want.size()) == 0;
}

// Reads the extent (for_read) and hands it back unchanged: whether it held fill(seed).
bool holds(Pager& pager, ExtentId id, uint32_t seed) {
  pager.wait(pager.page_in({id}, true));
  const bool same = resident_holds(pager, id, seed);
  pager.wait(pager.release_unchanged({id}));
  return same;
}

uint64_t written(Pager& pager) {
  const PagerStats s = pager.stats();
  return s.bytes_written + s.bytes_to_host;
}

// The read of a whole state: FILE extents go back to their store range, ZERO ones to
// zeros, nothing written; the bytes are the same when read again.
TEST_P(ReleaseUnchangedTest, ReadWritesNothing) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, {ids[0], ids[1], ids[2]}, 1);  // ids[3] stays ZERO
  const uint64_t before = written(pager);
  pager.wait(pager.page_in(ids, true));
  for (ExtentId id : ids) EXPECT_TRUE(resident_holds(pager, id, id == ids[3] ? 0 : 1));
  pager.wait(pager.release_unchanged(ids));
  EXPECT_EQ(written(pager), before);
  EXPECT_EQ(pager.residency(ids[0]), Residency::kFile);
  EXPECT_EQ(pager.residency(ids[3]), Residency::kZero);
  EXPECT_EQ(pager.stats().resident_bytes, 0u);
  EXPECT_EQ(pager.stats().unchanged_bytes,
            pager.size(ids[0]) + pager.size(ids[1]) + pager.size(ids[2]) + pager.size(ids[3]));
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, id == ids[3] ? 0 : 1));
  EXPECT_EQ(written(pager), before);
  // Steps go on as before: a write after the reads lands.
  write_all(pager, ids, 2);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 2));
}

// On a store that can no longer be written (a file-size limit: every write fails, as on a
// full disk), a read succeeds; handing back with a page-out fails. (The host device's
// pages are memfd ranges, under the limit too: the pool keeps those made before.)
TEST_P(ReleaseUnchangedTest, ReadWorksOnAnUnwritableStore) {
  if (GetParam().map_ram) GTEST_SKIP() << "a mapped store's writes are stores to memory";
  const PagerOptions o = options();
  EXPECT_TRUE(in_child([&] {
    Pager pager(make_host_device(), o);
    pager.set_keep(size_t(64) << 20);
    std::vector<ExtentId> ids = make_extents(pager);
    write_all(pager, ids, 1);
    rlimit limit{rlim_t(4096), RLIM_INFINITY};
    setrlimit(RLIMIT_FSIZE, &limit);
    for (ExtentId id : ids) check(holds(pager, id, 1), "the read failed or changed bytes");
    pager.wait(pager.page_in(ids, true));
    bool failed = false;
    try {
      pager.wait(pager.page_out(ids));  // what a read did before release_unchanged
    } catch (const NoSpaceError&) {
      failed = true;
    }
    check(failed, "a page-out succeeded on the unwritable store: the test proves nothing");
  }));
}

// Bytes written after a page-in not for a read, or named by one since, are written.
TEST_P(ReleaseUnchangedTest, WrittenExtentsArePagedOut) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, ids, 1);
  pager.wait(pager.page_in({ids[0]}));  // its caller may write it
  fill(pager, ids[0], 2);
  pager.wait(pager.page_in({ids[1]}, true));
  pager.wait(pager.page_in({ids[1]}));  // a writer names it too
  fill(pager, ids[1], 2);
  pager.wait(pager.page_in({ids[2]}, true));
  const uint64_t before = pager.stats().bytes_written;
  pager.wait(pager.release_unchanged({ids[0], ids[1], ids[2]}));
  EXPECT_GE(pager.stats().bytes_written, before + pager.size(ids[0]) + pager.size(ids[1]));
  EXPECT_EQ(pager.stats().unchanged_bytes, pager.size(ids[2]));
  EXPECT_TRUE(holds(pager, ids[0], 2));
  EXPECT_TRUE(holds(pager, ids[1], 2));
  EXPECT_TRUE(holds(pager, ids[2], 1));
}

// A bucket of both kinds whose write fails: every extent stays resident and intact, the
// unchanged ones included, and handing them back again works once the store has room.
TEST_P(ReleaseUnchangedTest, FailedWriteLeavesTheWholeBucketResident) {
  if (GetParam().map_ram) GTEST_SKIP() << "a mapped store's writes are stores to memory";
  const PagerOptions o = options();
  EXPECT_TRUE(in_child([&] {
    Pager pager(make_host_device(), o);
    std::vector<ExtentId> ids = make_extents(pager);
    write_all(pager, ids, 1);
    pager.wait(pager.page_in({ids[0]}));
    fill(pager, ids[0], 2);
    pager.wait(pager.page_in({ids[1], ids[2]}, true));
    rlimit limit{rlim_t(4096), RLIM_INFINITY};
    setrlimit(RLIMIT_FSIZE, &limit);
    bool failed = false;
    try {
      pager.wait(pager.release_unchanged({ids[0], ids[1], ids[2]}));
    } catch (const NoSpaceError&) {
      failed = true;
    }
    check(failed, "the write did not fail");
    for (ExtentId id : {ids[0], ids[1], ids[2]}) {
      check(pager.residency(id) == Residency::kResident, "an extent left");
    }
    check(resident_holds(pager, ids[0], 2) && resident_holds(pager, ids[1], 1),
          "bytes changed");
    limit.rlim_cur = RLIM_INFINITY;
    setrlimit(RLIMIT_FSIZE, &limit);
    pager.wait(pager.release_unchanged({ids[0], ids[1], ids[2]}));
    check(holds(pager, ids[0], 2) && holds(pager, ids[1], 1) && holds(pager, ids[2], 1),
          "bytes lost");
  }));
}

// In an epoch an extent goes back to the range it was read from: the committed one before
// any page-out, the fresh one after; commit and abort each keep the right bytes.
TEST_P(ReleaseUnchangedTest, ExactInEpochs) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, ids, 1);
  uint64_t epoch = pager.begin_epoch(ids);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1));  // the committed range
  write_all(pager, {ids[0], ids[1]}, 2);                     // fresh ranges
  const uint64_t before = written(pager);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, id == ids[0] || id == ids[1] ? 2 : 1));
  EXPECT_EQ(written(pager), before);
  pager.abort_epoch(epoch);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1));
  epoch = pager.begin_epoch(ids);
  write_all(pager, {ids[0]}, 3);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, id == ids[0] ? 3 : 1));
  pager.commit_epoch(epoch);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, id == ids[0] ? 3 : 1));
}

// HOST extents read for_read keep their host range (its room stays taken) and go back to
// it; read without for_read, handing them back is a page-out (into the host tier).
TEST_P(ReleaseUnchangedTest, HostTierRangesAreKeptForReads) {
  Pager pager(make_host_device(), options(size_t(16) << 20));
  std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, ids, 1);
  for (ExtentId id : ids) ASSERT_EQ(pager.residency(id), Residency::kHost);
  const size_t used = pager.stats().host_used_bytes;
  const uint64_t before = written(pager);
  pager.wait(pager.page_in(ids, true));
  EXPECT_EQ(pager.stats().host_used_bytes, used);
  for (ExtentId id : ids) EXPECT_TRUE(resident_holds(pager, id, 1));
  pager.wait(pager.release_unchanged(ids));
  EXPECT_EQ(written(pager), before);
  EXPECT_EQ(pager.stats().host_used_bytes, used);
  for (ExtentId id : ids) EXPECT_EQ(pager.residency(id), Residency::kHost);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1));
  // Not for a read: the host range goes at the page-in, and comes back by a page-out.
  pager.wait(pager.page_in(ids));
  EXPECT_EQ(pager.stats().host_used_bytes, 0u);
  pager.wait(pager.release_unchanged(ids));
  EXPECT_GT(written(pager), before);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1));
  // A kept host range goes when a writer pages the extent out.
  pager.wait(pager.page_in(ids, true));
  for (ExtentId id : ids) fill(pager, id, 2);
  pager.wait(pager.page_out(ids));
  EXPECT_EQ(pager.stats().host_used_bytes, used);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 2));
  // ... and in an epoch the committed host range is the one read from.
  const uint64_t epoch = pager.begin_epoch(ids);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 2));
  write_all(pager, {ids[0]}, 3);
  pager.abort_epoch(epoch);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 2));
  EXPECT_EQ(pager.stats().host_used_bytes, used);
}

// Pieces are extents of their own: each goes back to its own range.
TEST_P(ReleaseUnchangedTest, Pieces) {
  Pager pager(make_host_device(), options());
  const std::vector<ExtentId> pieces = pager.create_pieces({1 << 20, 1 << 20, 4097});
  write_all(pager, pieces, 1);
  const uint64_t before = written(pager);
  for (ExtentId id : pieces) EXPECT_TRUE(holds(pager, id, 1));
  pager.wait(pager.page_in(pieces, true));
  pager.wait(pager.release_unchanged({pieces[1]}));  // one piece alone
  EXPECT_EQ(pager.residency(pieces[1]), Residency::kFile);
  EXPECT_EQ(pager.residency(pieces[0]), Residency::kResident);
  pager.wait(pager.release_unchanged(pieces));
  EXPECT_EQ(written(pager), before);
  for (ExtentId id : pieces) EXPECT_TRUE(holds(pager, id, 1));
}

// An extent moved to another store has no bytes there until it is written: handing it
// back writes them, whether it moved at rest (on the page-in) or while resident.
TEST_P(ReleaseUnchangedTest, MovedExtentsAreWritten) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager, 2);
  write_all(pager, ids, 1);
  const unsigned other = pager.open_store("other");
  pager.move_to_store({ids[0]}, other);  // at rest: moves on its page-in
  pager.wait(pager.page_in(ids, true));
  pager.move_to_store({ids[1]}, other);  // resident
  const uint64_t before = pager.stats().bytes_written;
  pager.wait(pager.release_unchanged(ids));
  EXPECT_GE(pager.stats().bytes_written, before + pager.size(ids[0]) + pager.size(ids[1]));
  for (ExtentId id : ids) {
    EXPECT_EQ(pager.store_of(id), other);
    EXPECT_TRUE(holds(pager, id, 1));
  }
}

INSTANTIATE_TEST_SUITE_P(Media, ReleaseUnchangedTest, ::testing::ValuesIn(kStoreMedia),
                         medium_name);

}  // namespace
}  // namespace statepager
