// A page-in writes each extent's bytes up to the next 4 KiB boundary (page_in_bytes in
// allocator/pager_internal.h), so that neighbouring small extents fill or copy as one, on
// every path: zero fills, the store through staging slots, a mapped store in RAM and the
// host tier. Their bytes come back, and neighbours' bytes are untouched.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "allocator/pager.h"
#include "tests/cpp/pager_options.h"
#include "tests/cpp/temp_dir.h"
#include "tests/cpp/wrapped_device.h"

namespace statepager {
namespace {

constexpr int kCount = 20;
constexpr size_t kBytes = 1000;  // each a quarter of its 4 KiB block

struct Setup {
  const char* root;
  bool map_ram;
  size_t host_budget;
  const char* name;
};

class PageInJoins : public ::testing::TestWithParam<Setup> {
 protected:
  PageInJoins() : dir_(GetParam().root) {
    auto owned = std::make_unique<CopyCountingDevice>();
    device_ = owned.get();
    PagerOptions o = test_options(dir_.file("store"));
    o.map_ram = GetParam().map_ram;
    o.host_budget = GetParam().host_budget;
    pager_ = std::make_unique<Pager>(std::move(owned), o);
  }

  TempDir dir_;
  CopyCountingDevice* device_;
  std::unique_ptr<Pager> pager_;
};

TEST_P(PageInJoins, SmallNeighboursFillAndCopyAsOne) {
  Pager& pager = *pager_;
  std::vector<ExtentId> ids;
  for (int i = 0; i < kCount; i++) ids.push_back(pager.create(kBytes));
  pager.wait(pager.page_in(ids));  // zero: one fill for all
  EXPECT_EQ(device_->fills, 1);
  EXPECT_EQ(pager.stats().zero_filled_bytes, kCount * kBytes);  // their bytes, not blocks
  std::vector<std::vector<char>> want;
  for (int i = 0; i < kCount; i++) {
    want.push_back(random_bytes(kBytes, i));
    std::memcpy(reinterpret_cast<void*>(pager.address(ids[i])), want[i].data(), kBytes);
  }
  pager.wait(pager.page_out(ids));
  const int in_before = device_->to_device;
  pager.wait(pager.page_in(ids));
  EXPECT_EQ(device_->to_device - in_before, 1);
  for (int i = 0; i < kCount; i++) {
    EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(ids[i])), want[i].data(), kBytes),
              0)
        << "extent " << i;
  }
  // Every other one out and in again: its rounding bytes are written, its neighbours'
  // bytes (resident, changed meanwhile) are not.
  std::vector<ExtentId> odd;
  for (int i = 1; i < kCount; i += 2) odd.push_back(ids[i]);
  pager.wait(pager.page_out(odd));
  for (int i = 0; i < kCount; i += 2) {
    std::memset(reinterpret_cast<void*>(pager.address(ids[i])), i + 1, kBytes);
  }
  pager.wait(pager.page_in(odd));
  for (int i = 0; i < kCount; i++) {
    const std::vector<char> expect = i % 2 ? want[i] : std::vector<char>(kBytes, char(i + 1));
    EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(ids[i])), expect.data(), kBytes),
              0)
        << "extent " << i;
  }
  const PagerStats s = pager.stats();
  EXPECT_EQ(s.bytes_read + s.bytes_from_host, (kCount + kCount / 2) * kBytes);  // bytes, not blocks
}

// overwrite: ZERO extents are mapped without a fill (no device call, no zero-filled bytes
// counted); one with bytes at rest among them still reads them; the bucket's own extents
// are filled as before. The pages come back to be written and paged like any other.
TEST_P(PageInJoins, OverwriteMapsZeroExtentsWithoutAFill) {
  Pager& pager = *pager_;
  const ExtentId stored = pager.create(kBytes), scratch = pager.create(kBytes);
  const ExtentId kept = pager.create(kBytes), zero = pager.create(kBytes);
  const std::vector<char> bytes = random_bytes(kBytes, 7);
  pager.wait(pager.page_in({kept}));
  std::memcpy(reinterpret_cast<void*>(pager.address(kept)), bytes.data(), kBytes);
  pager.wait(pager.page_out({kept}));
  const int fills = device_->fills;
  const uint64_t filled = pager.stats().zero_filled_bytes;
  pager.wait(pager.page_in({stored}, false, {scratch, kept}));
  EXPECT_EQ(device_->fills - fills, 1);  // `stored` alone
  EXPECT_EQ(pager.stats().zero_filled_bytes - filled, kBytes);
  for (ExtentId id : {stored, scratch, kept}) {
    EXPECT_EQ(pager.residency(id), Residency::kResident) << "extent " << id;
  }
  EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(kept)), bytes.data(), kBytes), 0);
  EXPECT_EQ(pager.residency(zero), Residency::kZero);
  // Only ZERO extents: nothing to copy or fill, done once mapped.
  pager.wait(pager.page_in({}, false, {zero}));
  EXPECT_EQ(device_->fills - fills, 1);
  std::memset(reinterpret_cast<void*>(pager.address(zero)), 5, kBytes);
  pager.wait(pager.page_out({zero, scratch}));
  pager.wait(pager.page_in({zero}));
  EXPECT_EQ(reinterpret_cast<const char*>(pager.address(zero))[kBytes - 1], 5);
}

// In an epoch a page-out takes fresh store ranges (copy-on-write) in address order, not in
// the order the extents were created (a bucket's order): the next page-in joins them.
// Here the second half of the extents, created last, reuses the addresses of a released
// one below the first half's.
class StorePageInJoins : public PageInJoins {};  // the store's paths: no host tier

TEST_P(StorePageInJoins, FreshRangesInAnEpochFollowTheAddresses) {
  constexpr int kHalf = 12;  // both halves in one staging chunk (128 KiB)
  Pager& pager = *pager_;
  const ExtentId placeholder = pager.create(kHalf * 4096);
  std::vector<ExtentId> ids;
  for (int i = 0; i < kHalf; i++) ids.push_back(pager.create(kBytes));
  pager.release(placeholder);
  for (int i = 0; i < kHalf; i++) ids.push_back(pager.create(kBytes));
  ASSERT_LT(pager.address(ids[kHalf]), pager.address(ids[0]));
  pager.wait(pager.page_in(ids));
  for (size_t i = 0; i < ids.size(); i++) {
    std::memset(reinterpret_cast<void*>(pager.address(ids[i])), int(i + 1), kBytes);
  }
  pager.wait(pager.page_out(ids));
  const uint64_t epoch = pager.begin_epoch(ids);
  pager.wait(pager.page_in(ids));
  pager.wait(pager.page_out(ids));
  const int in_before = device_->to_device;
  pager.wait(pager.page_in(ids));
  EXPECT_EQ(device_->to_device - in_before, 1);
  pager.commit_epoch(epoch);
  for (size_t i = 0; i < ids.size(); i++) {
    EXPECT_EQ(reinterpret_cast<const char*>(pager.address(ids[i]))[kBytes - 1], char(i + 1));
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, PageInJoins,
                         ::testing::Values(Setup{"/tmp", false, 0, "Staging"},
                                           Setup{"/dev/shm", true, 0, "MappedRam"},
                                           Setup{"/tmp", false, 1 << 20, "HostTier"}),
                         [](const auto& info) { return std::string(info.param.name); });
INSTANTIATE_TEST_SUITE_P(Paths, StorePageInJoins,
                         ::testing::Values(Setup{"/tmp", false, 0, "Staging"},
                                           Setup{"/dev/shm", true, 0, "MappedRam"}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace statepager
