// RamMap (store files in RAM mapped for the device's copies) on its own, and a Pager with
// map_ram: what goes through the mapping is in the files, punches never take a mapped
// page from a file, a file cut short is told, and where the device refuses the mapping
// the store goes through io_uring as before.
#include "allocator/ram_map.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "allocator/pager.h"
#include "backing/errors.h"
#include "tests/cpp/pager_options.h"
#include "tests/cpp/temp_dir.h"
#include "tests/cpp/wrapped_device.h"

namespace statepager {
namespace {

constexpr size_t kMiB = size_t(1) << 20;

// Logical store bytes [offset, offset + n) through the mapping (write: copy `bytes` in).
bool through_map(const RamMap& map, uint64_t offset, char* bytes, size_t n, bool write) {
  std::vector<RamMap::Piece> pieces;
  if (!map.resolve(offset, n, &pieces)) return false;
  size_t at = 0;
  for (const RamMap::Piece& p : pieces) {
    write ? std::memcpy(p.host, bytes + at, p.bytes) : std::memcpy(bytes + at, p.host, p.bytes);
    at += p.bytes;
  }
  return at == n;
}

// Logical store bytes [offset, offset + n) read from the files (pread of each span).
std::vector<char> from_files(const UringFile& file, uint64_t offset, size_t n) {
  std::vector<char> out(n);
  size_t at = 0;
  const std::vector<std::string> paths = file.physical_paths();
  for (const UringFile::Span& s : file.spans(offset, n)) {
    const int fd = ::open(paths[s.file].c_str(), O_RDONLY);
    EXPECT_EQ(::pread(fd, out.data() + at, s.length, static_cast<off_t>(s.offset)),
              static_cast<ssize_t>(s.length));
    ::close(fd);
    at += s.length;
  }
  return out;
}

class RamMapTest : public ::testing::Test {
 protected:
  RamMapTest() : file_(dir_.file("state.bin"), UringFile::Options{}) {}
  TempDir dir_{"/dev/shm"};
  UringFile file_;
  WrappedDevice device_;
};

TEST_F(RamMapTest, WhatGoesThroughTheMappingIsInTheFiles) {
  ASSERT_TRUE(file_.physical_of(0).ram);
  const size_t n = 3 * kMiB + 5000;  // across stripe units, not a page multiple
  file_.allocate(n);
  RamMap map(device_, file_);
  EXPECT_EQ(map.mapped_bytes(), 0u);
  map.grow(0);
  // Every physical file up to its end, in whole pages: 3 full units, 5000 bytes of a fourth.
  EXPECT_EQ(map.mapped_bytes(), 3 * kMiB + 4096);
  std::vector<char> bytes = random_bytes(3 * kMiB + 4096, 1);
  ASSERT_TRUE(through_map(map, 0, bytes.data(), bytes.size(), true));
  EXPECT_EQ(from_files(file_, 0, bytes.size()), bytes);
  // A range past what is mapped (the last page's rest) is not resolved, nor changed.
  std::vector<RamMap::Piece> pieces;
  EXPECT_FALSE(map.resolve(3 * kMiB, 8192, &pieces));
  EXPECT_TRUE(pieces.empty());
  // The file grows: the next grow() maps the rest.
  file_.allocate(5 * kMiB);
  map.grow(0);
  EXPECT_EQ(map.mapped_bytes(), 5 * kMiB);
  EXPECT_TRUE(map.resolve(3 * kMiB, 8192, &pieces));
}

// After grow(0) of a file holding 1 MiB: nothing mapped, nothing resolved.
void expect_nothing_mapped(Device& device, UringFile& file) {
  file.allocate(kMiB);
  RamMap map(device, file);
  map.grow(0);
  std::vector<RamMap::Piece> pieces;
  EXPECT_EQ(map.mapped_bytes(), 0u);
  EXPECT_FALSE(map.resolve(0, 4096, &pieces));
}

TEST_F(RamMapTest, AFileOnDiskIsNeverMapped) {
  TempDir disk("/tmp");
  UringFile file(disk.file("state.bin"), UringFile::Options{});
  expect_nothing_mapped(device_, file);
}

TEST_F(RamMapTest, PunchesNeverTakeAMappedPageFromItsFile) {
  file_.allocate(2 * kMiB);
  std::vector<char> bytes = random_bytes(2 * kMiB, 2);
  {
    RamMap unmapped(device_, file_);  // no grow(): punching goes through
    const int fd = ::open(file_.physical_paths()[0].c_str(), O_WRONLY);
    ASSERT_EQ(::pwrite(fd, bytes.data(), 4096, 0), 4096);
    ::close(fd);
    unmapped.punch(0, 4096);
    EXPECT_EQ(from_files(file_, 0, 4096), std::vector<char>(4096, 0));
  }
  RamMap map(device_, file_);
  map.grow(0);
  ASSERT_TRUE(through_map(map, 0, bytes.data(), bytes.size(), true));
  map.punch(0, 2 * kMiB);
  EXPECT_EQ(from_files(file_, 0, bytes.size()), bytes);
}

TEST_F(RamMapTest, AFileCutShortOutsideIsTold) {
  file_.allocate(2 * kMiB);
  RamMap map(device_, file_);
  map.grow(0);
  ASSERT_EQ(::truncate(file_.physical_paths()[1].c_str(), 4096), 0);
  EXPECT_THROW(map.grow(0), CorruptStoreError);
}

struct RefusingDevice : WrappedDevice {
  bool register_host(void*, size_t) override { return false; }
};

TEST_F(RamMapTest, WhereTheDeviceRefusesNothingIsMapped) {
  RefusingDevice refusing;
  expect_nothing_mapped(refusing, file_);
}

PagerOptions mapped_options(const TempDir& dir) {
  PagerOptions o = test_options(dir.file("store"));
  o.map_ram = true;
  return o;
}

// Extents of mixed sizes, filled, paged out, paged in: their bytes back, and how many of
// the bytes went through the mapping.
uint64_t round_trip(Pager& pager) {
  std::vector<ExtentId> ids;
  std::vector<std::vector<char>> want;
  for (int i = 0; i < 7; i++) {
    ids.push_back(pager.create(size_t(250000) * (i % 3 + 1) + 77 * i));
    pager.wait(pager.page_in({ids.back()}));
    want.push_back(random_bytes(pager.size(ids.back()), 10 + i));
    std::memcpy(reinterpret_cast<void*>(pager.address(ids.back())), want.back().data(),
                want.back().size());
  }
  pager.wait(pager.page_out(ids));
  pager.wait(pager.page_in(ids));
  for (size_t i = 0; i < ids.size(); i++) {
    EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(ids[i])), want[i].data(),
                          want[i].size()),
              0);
  }
  const PagerStats s = pager.stats();
  EXPECT_EQ(s.bytes_read, s.bytes_written);
  EXPECT_EQ(s.mapped_read_bytes, s.mapped_written_bytes);
  return s.mapped_read_bytes + s.mapped_written_bytes;
}

TEST(PagerMappedRam, EveryByteGoesThroughTheMapping) {
  TempDir dir("/dev/shm");
  Pager pager(std::make_unique<WrappedDevice>(), mapped_options(dir));
  const uint64_t mapped = round_trip(pager);
  EXPECT_EQ(mapped, pager.stats().bytes_read + pager.stats().bytes_written);
  EXPECT_GT(pager.stats().store_mapped_bytes, 0u);
  EXPECT_EQ(pager.stats().read_requests + pager.stats().write_requests, 0u);
}

// A mapped store without a host tier is one file (not striped): an extent of many I/O
// blocks goes each way as one copy, not one per block or 1 MiB stripe unit (each copy
// costs the I/O thread about 9 us on the H200).
TEST(PagerMappedRam, AnExtentGoesAsOneCopyEachWay) {
  TempDir dir("/dev/shm");
  auto owned = std::make_unique<CopyCountingDevice>();
  CopyCountingDevice& device = *owned;
  Pager pager(std::move(owned), mapped_options(dir));
  EXPECT_EQ(pager.store_files().size(), 1u);
  const size_t n = 5 * kMiB + 4000;  // 41 I/O blocks of 128 KiB, across 1 MiB units
  const ExtentId id = pager.create(n);
  pager.wait(pager.page_in({id}));  // zero-filled: no copy
  const std::vector<char> want = random_bytes(n, 3);
  std::memcpy(reinterpret_cast<void*>(pager.address(id)), want.data(), n);
  pager.wait(pager.page_out({id}));
  pager.wait(pager.page_in({id}));
  EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(id)), want.data(), n), 0);
  EXPECT_EQ(pager.stats().mapped_read_bytes, n);
  EXPECT_EQ(device.to_host, 1);
  EXPECT_EQ(device.to_device, 1);
}

// Fills an extent with random_bytes(seed) and pages it out; returns its bytes.
std::vector<char> fill_out(Pager& pager, ExtentId id, uint32_t seed) {
  pager.wait(pager.page_in({id}));
  std::vector<char> bytes = random_bytes(pager.size(id), seed);
  std::memcpy(reinterpret_cast<void*>(pager.address(id)), bytes.data(), bytes.size());
  pager.wait(pager.page_out({id}));
  return bytes;
}

bool holds(Pager& pager, ExtentId id, const std::vector<char>& want) {
  pager.wait(pager.page_in({id}));
  return std::memcmp(reinterpret_cast<void*>(pager.address(id)), want.data(), want.size()) == 0;
}

// With a host tier the mapped store is one file too: what the tier cannot hold goes to
// the store each step, one copy each way; the tier's spills (io_uring writes from host
// memory) land in that file and come back through the mapping.
TEST(PagerMappedRam, WithAHostTierTheStoreIsOneFileToo) {
  TempDir dir("/dev/shm");
  auto owned = std::make_unique<CopyCountingDevice>();
  CopyCountingDevice& device = *owned;
  PagerOptions o = mapped_options(dir);
  o.host_budget = kMiB;
  Pager pager(std::move(owned), o);
  EXPECT_EQ(pager.store_files().size(), 1u);
  const ExtentId large = pager.create(5 * kMiB + 4000);  // more than the tier holds
  const std::vector<char> large_bytes = fill_out(pager, large, 3);
  EXPECT_EQ(pager.residency(large), Residency::kFile);
  EXPECT_TRUE(holds(pager, large, large_bytes));
  EXPECT_EQ(device.to_host, 1);
  EXPECT_EQ(device.to_device, 1);
  EXPECT_EQ(pager.stats().mapped_read_bytes, 5 * kMiB + 4000);

  const ExtentId first = pager.create(600 * 1024), second = pager.create(600 * 1024);
  const std::vector<char> first_bytes = fill_out(pager, first, 4);
  EXPECT_EQ(pager.residency(first), Residency::kHost);
  const std::vector<char> second_bytes = fill_out(pager, second, 5);  // spills `first`
  EXPECT_EQ(pager.residency(first), Residency::kFile);
  EXPECT_EQ(pager.residency(second), Residency::kHost);
  EXPECT_EQ(pager.stats().spills, 1u);
  const uint64_t mapped_before = pager.stats().mapped_read_bytes;
  EXPECT_TRUE(holds(pager, first, first_bytes));
  EXPECT_EQ(pager.stats().mapped_read_bytes, mapped_before + 600 * 1024);
  EXPECT_TRUE(holds(pager, second, second_bytes));
  EXPECT_EQ(pager.store_files().size(), 1u);
}

TEST(PagerMappedRam, WhereTheDeviceRefusesIoUringCarriesOn) {
  TempDir dir("/dev/shm");
  Pager pager(std::make_unique<RefusingDevice>(), mapped_options(dir));
  EXPECT_EQ(round_trip(pager), 0u);
  EXPECT_EQ(pager.stats().store_mapped_bytes, 0u);
  EXPECT_GT(pager.stats().read_requests, 0u);
}

TEST(PagerMappedRam, AStoreCutShortFailsThePageInAndChangesNothing) {
  TempDir dir("/dev/shm");
  Pager pager(make_host_device(), mapped_options(dir));
  const ExtentId id = pager.create(3 * kMiB);
  pager.wait(pager.page_in({id}));
  std::memset(reinterpret_cast<void*>(pager.address(id)), 7, 3 * kMiB);
  pager.wait(pager.page_out({id}));
  ASSERT_EQ(::truncate(pager.file_path().c_str(), kMiB), 0);  // one file: not striped
  EXPECT_THROW(pager.wait(pager.page_in({id})), CorruptStoreError);
  EXPECT_EQ(pager.residency(id), Residency::kFile);
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
}

// The third device-to-host copy fails (then none): a page-out of a chunk of several
// extents fails partway through its copies. Counts the fences recorded after it.
struct FailingCopyDevice : WrappedDevice {
  int copies = 0;
  bool failed = false;
  int fences_after = 0;
  void copy_to_host(void* d, uintptr_t s, size_t b) override {
    if (++copies == 3) {
      failed = true;
      throw DeviceError("copy refused");
    }
    WrappedDevice::copy_to_host(d, s, b);
  }
  Fence record(CopyQueue q) override {
    fences_after += failed;
    return WrappedDevice::record(q);
  }
};

// On the mapped store and through staging: the bucket fails, its extents keep their bytes
// and state, and the failed chunk's slot waits for a fence (copies queued before the
// failure may still be running on a GPU) before the next bucket may use it.
TEST(PagerMappedRam, ACopyFailingPartwayFailsTheBucketAndChangesNothing) {
  for (bool map_ram : {true, false}) {
    TempDir dir("/dev/shm");
    PagerOptions o = mapped_options(dir);
    o.map_ram = map_ram;
    o.io_block = 1 << 20;  // the small extents share a chunk
    auto owned = std::make_unique<FailingCopyDevice>();
    FailingCopyDevice& device = *owned;
    Pager pager(std::move(owned), o);
    std::vector<ExtentId> ids;
    std::vector<std::vector<char>> want;
    for (int i = 0; i < 4; i++) {
      ids.push_back(pager.create(50000 + 4096 * i));
      pager.wait(pager.page_in({ids.back()}));
      want.push_back(random_bytes(pager.size(ids.back()), 30 + i));
      std::memcpy(reinterpret_cast<void*>(pager.address(ids.back())), want.back().data(),
                  want.back().size());
    }
    const PagerStats before = pager.stats();
    EXPECT_THROW(pager.wait(pager.page_out(ids)), DeviceError);
    EXPECT_GE(device.fences_after, 1) << "map_ram " << map_ram;
    const PagerStats after = pager.stats();
    EXPECT_EQ(after.bytes_written, before.bytes_written);
    EXPECT_EQ(after.mapped_written_bytes, before.mapped_written_bytes);
    EXPECT_EQ(after.buckets_out, before.buckets_out);
    for (size_t i = 0; i < ids.size(); i++) {
      EXPECT_EQ(pager.residency(ids[i]), Residency::kResident);
      EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(ids[i])), want[i].data(),
                            want[i].size()),
                0);
    }
    pager.wait(pager.page_out(ids));  // the device copies again: the retry succeeds
    pager.wait(pager.page_in(ids));
    for (size_t i = 0; i < ids.size(); i++) {
      EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(ids[i])), want[i].data(),
                            want[i].size()),
                0);
    }
  }
}

}  // namespace
}  // namespace statepager
