// The store seen from outside: Pager::hold/unhold, StoreSnapshot and Pager::restore, on a
// disk store, a striped RAM store and a mapped RAM store (tests/cpp/store_media.h).
#include "allocator/store_restore.h"
#include "allocator/store_snapshot.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "backing/align.h"
#include "backing/crc32c.h"
#include "backing/errors.h"
#include "tests/cpp/pager_options.h"
#include "tests/cpp/store_media.h"

namespace statepager {
namespace {

constexpr size_t kPage = 4096;


class StoreSnapshotTest : public ::testing::TestWithParam<StoreMedium> {
 protected:
  PagerOptions options() const {
    PagerOptions o = test_options(std::string(GetParam().root) + "/statepager-snapshot-test-" +
                                      test_name() + "-" + std::to_string(getpid()),
                                  256 << 10);
    o.map_ram = GetParam().map_ram;
    return o;
  }
  std::string out_path() const { return options().directory + ".out"; }
  void TearDown() override { ::unlink(out_path().c_str()); }
  static std::string test_name() {  // "Name/Param": no slash in a file name
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '-');
    return name;
  }
};

// Extents of mixed sizes, most spanning several 1 MiB stripe units, none 4 KiB multiples.
std::vector<ExtentId> make_extents(Pager& pager) {
  std::vector<ExtentId> ids;
  for (size_t bytes : {size_t(3 << 20) + 5, size_t(100), size_t(1 << 20) + 4097,
                       size_t(2500000), size_t(7)}) {
    ids.push_back(pager.create(bytes));
  }
  return ids;
}

void fill(Pager& pager, ExtentId id, uint32_t seed) {
  std::mt19937 gen(seed + uint32_t(id));
  auto* p = reinterpret_cast<uint8_t*>(pager.address(id));
  const size_t bytes = pager.size(id);  // once: a call per byte takes the lock per byte
  for (size_t i = 0; i < bytes; i++) p[i] = uint8_t(gen());
}

std::vector<uint8_t> expected(Pager& pager, ExtentId id, uint32_t seed) {
  std::mt19937 gen(seed + uint32_t(id));
  std::vector<uint8_t> out(pager.size(id));
  for (uint8_t& b : out) b = uint8_t(gen());
  return out;
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

TEST_P(StoreSnapshotTest, CopyIsTheStateOfItsMomentWhilePagingGoesOn) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager);
  const ExtentId never_written = pager.create(5000);
  std::vector<ExtentId> others = {pager.create(300000), pager.create(12345)};
  pager.wait(pager.page_in(ids));
  for (ExtentId id : ids) fill(pager, id, 1);
  pager.wait(pager.page_out(ids));

  std::vector<ExtentId> saved = ids;
  saved.push_back(never_written);
  StoreSnapshot snapshot(pager, saved);
  ASSERT_EQ(snapshot.placements().size(), saved.size());
  std::vector<StoreSnapshot::Target> targets;
  uint64_t at = 0;
  for (size_t i = 0; i < saved.size(); i++) {
    const Placement& p = snapshot.placements()[i];
    EXPECT_EQ(p.bytes, pager.size(saved[i]));
    EXPECT_EQ(p.store_bytes, align_up(p.bytes, kPage));
    EXPECT_EQ(p.state, saved[i] == never_written ? Residency::kZero : Residency::kFile);
    targets.push_back({0, at});
    at += p.store_bytes;
  }

  // Training goes on: reads are free, a write into a held range waits, others do not.
  pager.wait(pager.page_in(ids));
  for (ExtentId id : ids) fill(pager, id, 2);
  const Ticket out = pager.page_out(ids);
  pager.wait(pager.page_in(others));
  pager.wait(pager.page_out(others));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(pager.is_done(out));
  EXPECT_EQ(pager.stats().buckets_held, 1u);
  EXPECT_THROW(pager.hold(others), UsageError);  // one set of holds at a time

  const std::string dst = out_path();
  const uint64_t chunk = 3 * 4096;
  const StoreSnapshot::Copied copied = snapshot.copy_to({dst}, targets, chunk);
  pager.wait(out);
  const std::vector<uint8_t> file = read_file(dst);
  ASSERT_EQ(copied.crcs.size(), saved.size());
  EXPECT_TRUE(copied.crcs.back().empty());  // never_written: ZERO, nothing copied
  for (size_t i = 0; i < ids.size(); i++) {
    // The crc32c of each chunk of what was copied (the extent and its zero padding).
    std::vector<uint32_t> crcs;
    const uint64_t end = targets[i].offset + snapshot.placements()[i].store_bytes;
    for (uint64_t c = targets[i].offset; c < end; c += chunk) {
      crcs.push_back(crc32c(0, file.data() + c, std::min(chunk, end - c)));
    }
    EXPECT_EQ(copied.crcs[i], crcs) << "extent " << ids[i];
    const std::vector<uint8_t> want = expected(pager, ids[i], 1);
    ASSERT_GE(file.size(), targets[i].offset + align_up(want.size(), kPage));
    EXPECT_TRUE(std::equal(want.begin(), want.end(), file.begin() + long(targets[i].offset)))
        << "extent " << ids[i];
    const auto pad = file.begin() + long(targets[i].offset + want.size());
    EXPECT_TRUE(std::all_of(pad, pad + long(align_up(want.size(), kPage) - want.size()),
                            [](uint8_t b) { return b == 0; }));
  }
  pager.wait(pager.page_in(ids));
  for (ExtentId id : ids) {
    const std::vector<uint8_t> want = expected(pager, id, 2);
    EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(id)), want.data(), want.size()),
              0);
  }
  EXPECT_NO_THROW(StoreSnapshot(pager, others));  // all released
}

TEST_P(StoreSnapshotTest, HoldNeedsExtentsAtRestAndReleasesOnDestruction) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager);
  pager.wait(pager.page_in(ids));
  EXPECT_THROW(StoreSnapshot(pager, ids), UsageError);
  pager.wait(pager.page_out(ids));
  { StoreSnapshot snapshot(pager, ids); }  // released without a copy
  pager.wait(pager.page_in(ids));
  pager.wait(pager.page_out(ids));  // would wait forever if a range were still held
  EXPECT_EQ(pager.stats().buckets_held, 0u);
}

TEST_P(StoreSnapshotTest, RestoreReplacesExtentsAtRest) {
  Pager pager(make_host_device(), options());
  std::vector<ExtentId> ids = make_extents(pager);
  const ExtentId fresh = pager.create(70000);  // ZERO, its file range never written
  ids.push_back(fresh);
  pager.wait(pager.page_in(ids));
  for (ExtentId id : ids) fill(pager, id, 3);
  pager.wait(pager.page_out(ids));

  // A checkpoint-like file: each extent's new bytes at a 4 KiB-aligned offset.
  const std::string src = out_path();
  std::vector<uint64_t> offsets;
  std::vector<bool> zero;
  {
    std::ofstream f(src, std::ios::binary);
    uint64_t at = 0;
    for (ExtentId id : ids) {
      std::vector<uint8_t> bytes = expected(pager, id, 4);
      bytes.resize(align_up(bytes.size(), kPage));
      f.write(reinterpret_cast<const char*>(bytes.data()), long(bytes.size()));
      offsets.push_back(at);
      zero.push_back(id == ids[1]);  // restored as never written
      at += bytes.size();
    }
  }
  restore_extents(pager, ids, zero, src, offsets);
  for (size_t i = 0; i < ids.size(); i++) {
    EXPECT_EQ(pager.residency(ids[i]), zero[i] ? Residency::kZero : Residency::kFile);
  }
  pager.wait(pager.page_in(ids));
  for (size_t i = 0; i < ids.size(); i++) {
    std::vector<uint8_t> want = expected(pager, ids[i], 4);
    if (zero[i]) want.assign(want.size(), 0);
    EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(ids[i])), want.data(),
                          want.size()),
              0)
        << "extent " << ids[i];
  }
  EXPECT_THROW(restore_extents(pager, ids, zero, src, offsets), UsageError);  // resident
  pager.wait(pager.page_out(ids));
  StoreSnapshot snapshot(pager, ids);
  EXPECT_THROW(restore_extents(pager, ids, zero, src, offsets), UsageError);  // held
}

TEST_P(StoreSnapshotTest, RestoreFromAShortFileIsCorrupt) {
  Pager pager(make_host_device(), options());
  const ExtentId id = pager.create(100000);
  const std::string src = out_path();
  std::ofstream(src, std::ios::binary).write("abc", 3);
  EXPECT_THROW(restore_extents(pager, {id}, {false}, src, {0}), CorruptStoreError);
  EXPECT_EQ(pager.residency(id), Residency::kZero);  // as it was
}

// An extent moving to another store (bytes still in the old one) is restored into the new
// store; a failed restore leaves its old bytes where they were.
TEST_P(StoreSnapshotTest, RestoreIntoAMovingExtent) {
  Pager pager(make_host_device(), options());
  const ExtentId a = pager.create(100000), b = pager.create(90000);
  pager.wait(pager.page_in({a, b}));
  fill(pager, a, 3);
  fill(pager, b, 3);
  pager.wait(pager.page_out({a, b}));
  const unsigned moved = pager.open_store("moved");
  pager.move_to_store({a, b}, moved);

  const std::string src = out_path();
  {
    std::vector<uint8_t> bytes = expected(pager, a, 4);
    bytes.resize(align_up(bytes.size(), kPage));
    std::ofstream(src, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                               long(bytes.size()));
  }
  restore_extents(pager, {a}, {false}, src, {0});
  EXPECT_THROW(restore_extents(pager, {b}, {false}, src, {1 << 20}), CorruptStoreError);  // past the end
  EXPECT_EQ(pager.store_of(a), moved);
  EXPECT_EQ(pager.store_of(b), moved);
  EXPECT_EQ(pager.residency(b), Residency::kFile);
  pager.wait(pager.page_in({a, b}));
  const std::vector<uint8_t> want_a = expected(pager, a, 4), want_b = expected(pager, b, 3);
  EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(a)), want_a.data(), want_a.size()), 0);
  EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(b)), want_b.data(), want_b.size()), 0)
      << "a failed restore lost the bytes of an extent that was moving";
}

INSTANTIATE_TEST_SUITE_P(Media, StoreSnapshotTest, ::testing::ValuesIn(kStoreMedia),
                         medium_name);

}  // namespace
}  // namespace statepager
