// Store checksums (see Note [Store checksums] in allocator/pager_crc.cc): bytes of a store
// file changed from outside between a page-out and the next page-in fail that page-in with
// CorruptStoreError naming the file and offset, and leave the pager as it was; clean round
// trips through epochs, spills and release_unchanged() pass. On every medium: a disk
// store, a striped RAM store and a RAM store mapped for the device's copies.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "allocator/pager.h"
#include "backing/crc32c.h"
#include "backing/errors.h"
#include "tests/cpp/pager_options.h"
#include "tests/cpp/store_media.h"
#include "tests/cpp/store_medium_test.h"
#include "tests/cpp/temp_dir.h"
#include "tests/cpp/wrapped_device.h"

namespace statepager {
namespace {

class StoreCrcTest : public StoreMediumTest {};

// Sizes that share requests (128 KiB) and span several of them.
std::vector<ExtentId> make_extents(Pager& pager) {
  std::vector<ExtentId> ids;
  for (size_t bytes : {size_t(5000), size_t(300000), size_t(77), size_t(400001)}) {
    ids.push_back(pager.create(bytes));
  }
  return ids;
}

void fill(Pager& pager, ExtentId id, uint32_t seed) {
  const std::vector<char> bytes = random_bytes(pager.size(id), seed + uint32_t(id));
  std::memcpy(reinterpret_cast<void*>(pager.address(id)), bytes.data(), bytes.size());
}

bool resident_holds(Pager& pager, ExtentId id, uint32_t seed) {
  const std::vector<char> want = random_bytes(pager.size(id), seed + uint32_t(id));
  return std::memcmp(reinterpret_cast<void*>(pager.address(id)), want.data(), want.size()) == 0;
}

void write_all(Pager& pager, const std::vector<ExtentId>& ids, uint32_t seed) {
  pager.wait(pager.page_in(ids));
  for (ExtentId id : ids) fill(pager, id, seed);
  pager.wait(pager.page_out(ids));
}

bool holds(Pager& pager, ExtentId id, uint32_t seed) {
  pager.wait(pager.page_in({id}, true));
  const bool same = resident_holds(pager, id, seed);
  pager.wait(pager.release_unchanged({id}));
  return same;
}

// Where byte `at` of a FILE extent's store range lies: a physical file and its offset.
struct Where {
  std::string path;
  uint64_t offset;
};
Where locate(Pager& pager, ExtentId id, uint64_t at) {
  const Placement p = pager.hold({id}).front();
  pager.unhold(p.range);
  for (const UringFile::Span& s : p.spans) {
    if (at < s.length) return Where{pager.store_files()[s.file], s.offset + at};
    at -= s.length;
  }
  ADD_FAILURE() << "byte past the range";
  return {};
}

// Flips byte `at` of the extent's store range from outside, as another process would.
Where corrupt(Pager& pager, ExtentId id, uint64_t at) {
  const Where w = locate(pager, id, at);
  const int fd = ::open(w.path.c_str(), O_RDWR);
  EXPECT_GE(fd, 0);
  char c = 0;
  EXPECT_EQ(::pread(fd, &c, 1, off_t(w.offset)), 1);
  c = char(c ^ 0x5A);
  EXPECT_EQ(::pwrite(fd, &c, 1, off_t(w.offset)), 1);
  ::close(fd);
  return w;
}

uint64_t moved(const PagerStats& s) {
  return s.bytes_read + s.bytes_written + s.buckets_in + s.buckets_out + s.read_requests;
}

// A changed byte of the extent or of its range's zeros fails the page-in, names the file
// and where the range lies, and changes nothing: put back, the same page-in works.
TEST_P(StoreCrcTest, ChangedStoreBytesFailThePageIn) {
  Pager pager(make_host_device(), options());
  const std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, ids, 1);
  for (uint64_t at : {uint64_t(150000), uint64_t(300000 + 10)}) {  // a byte, a zero after
    const Where w = corrupt(pager, ids[1], at);
    const Where range = locate(pager, ids[1], 0);
    const PagerStats before = pager.stats();
    try {
      pager.wait(pager.page_in(ids));
      ADD_FAILURE() << "the page-in read changed bytes";
    } catch (const CorruptStoreError& e) {
      EXPECT_NE(std::string(e.what()).find(w.path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("offset " + std::to_string(range.offset)),
                std::string::npos)
          << e.what();
    }
    for (ExtentId id : ids) EXPECT_EQ(pager.residency(id), Residency::kFile);
    EXPECT_EQ(moved(pager.stats()), moved(before));
    EXPECT_EQ(pager.stats().resident_bytes, 0u);
    corrupt(pager, ids[1], at);  // back as it was
    pager.wait(pager.page_in(ids, true));
    for (ExtentId id : ids) EXPECT_TRUE(resident_holds(pager, id, 1));
    pager.wait(pager.release_unchanged(ids));
  }
}

// A spill writes an extent's host range into its store range: that write is checked too.
TEST_P(StoreCrcTest, SpilledBytesAreChecked) {
  Pager pager(make_host_device(), options(size_t(1) << 20));
  const std::vector<ExtentId> ids = make_extents(pager);
  const std::vector<ExtentId> more = make_extents(pager);
  write_all(pager, ids, 1);
  write_all(pager, more, 2);  // spills the first ones
  ASSERT_GT(pager.stats().spills, 0u);
  ExtentId spilled = 0;
  for (ExtentId id : ids) {
    if (pager.residency(id) == Residency::kFile) spilled = id;
  }
  ASSERT_NE(spilled, 0u);
  corrupt(pager, spilled, 7);
  EXPECT_THROW(pager.wait(pager.page_in({spilled})), CorruptStoreError);
  EXPECT_EQ(pager.residency(spilled), Residency::kFile);
  corrupt(pager, spilled, 7);
  EXPECT_TRUE(holds(pager, spilled, 1));
}

// Clean round trips: epochs (committed and fresh ranges, abort and commit), moves between
// stores, spills and unchanged hand-backs never fail the check.
TEST_P(StoreCrcTest, CleanRoundTripsPass) {
  Pager pager(make_host_device(), options(size_t(1) << 20));
  const std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, ids, 1);
  uint64_t epoch = pager.begin_epoch(ids);
  write_all(pager, {ids[0], ids[1]}, 2);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, id == ids[0] || id == ids[1] ? 2 : 1));
  pager.abort_epoch(epoch);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1));
  epoch = pager.begin_epoch(ids);
  write_all(pager, {ids[3]}, 3);
  pager.commit_epoch(epoch);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, id == ids[3] ? 3 : 1));
  const unsigned other = pager.open_store("other");
  pager.move_to_store(ids, other);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, id == ids[3] ? 3 : 1));
  write_all(pager, ids, 4);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 4));
}

// A device that cannot checksum (CUDA without the kernel): a mapped store's pages are
// checksummed on the CPU once the copies are done, with the same outcome.
class NoChecksumDevice : public WrappedDevice {
 public:
  std::optional<Fence> checksum(CopyQueue, const DeviceRange*, size_t, uint32_t*) override {
    calls++;
    return std::nullopt;
  }
  int calls = 0;
};

TEST(StoreCrcMappedTest, PagesAreCheckedWhereTheDeviceCannot) {
  TempDir dir("/dev/shm");
  PagerOptions o = test_options(dir.file("store"));
  o.map_ram = true;
  auto owned = std::make_unique<NoChecksumDevice>();
  NoChecksumDevice* device = owned.get();
  Pager pager(std::move(owned), o);
  const std::vector<ExtentId> ids = make_extents(pager);
  write_all(pager, ids, 1);
  ASSERT_GT(pager.stats().mapped_written_bytes, 0u);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1));
  corrupt(pager, ids[3], 400000);
  EXPECT_THROW(pager.wait(pager.page_in(ids)), CorruptStoreError);
  for (ExtentId id : ids) EXPECT_EQ(pager.residency(id), Residency::kFile);
  corrupt(pager, ids[3], 400000);
  for (ExtentId id : ids) EXPECT_TRUE(holds(pager, id, 1));
  EXPECT_GT(device->calls, 0);
}

// Pieces' crcs joined in order equal the whole's, at any cut, the empty piece included.
TEST(Crc32cCombineTest, JoinsPieces) {
  const std::vector<char> bytes = random_bytes(100000, 9);
  const uint32_t whole = crc32c(0, bytes.data(), bytes.size());
  for (size_t cut : {size_t(0), size_t(1), size_t(4096), size_t(65537), bytes.size()}) {
    const uint32_t a = crc32c(0, bytes.data(), cut);
    const uint32_t b = crc32c(0, bytes.data() + cut, bytes.size() - cut);
    EXPECT_EQ(crc32c_combine(a, b, bytes.size() - cut), whole) << cut;
  }
}

INSTANTIATE_TEST_SUITE_P(Media, StoreCrcTest, ::testing::ValuesIn(kStoreMedia), medium_name);

}  // namespace
}  // namespace statepager
