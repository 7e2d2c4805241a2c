// page_all (pause and resume's paging of a whole state) and measure_mapping (bench pager's
// mapping cost): what they page or measure, their refusals before anything changes, and
// a device error that leaves nothing mapped, created or reserved.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "allocator/map_cost.h"
#include "allocator/page_all.h"
#include "backing/errors.h"
#include "tests/cpp/pager_options.h"
#include "tests/cpp/temp_dir.h"
#include "tests/cpp/wrapped_device.h"

namespace statepager {
namespace {

constexpr size_t kBytes = 100 << 10;

TEST(PageAll, PagesEveryExtentOutAndBackInBuckets) {
  TempDir dir;
  Pager pager(make_host_device(), test_options(dir.file("store")));
  std::vector<ExtentId> ids;
  std::vector<std::vector<char>> want;
  for (int i = 0; i < 10; i++) {
    ids.push_back(pager.create(kBytes));
    want.push_back(random_bytes(kBytes, i));
  }
  pager.wait(pager.page_in(ids));
  for (int i = 0; i < 10; i++) {
    std::memcpy(reinterpret_cast<void*>(pager.address(ids[i])), want[i].data(), kBytes);
  }
  const ExtentId freed = ids[3];
  pager.release(freed);  // skipped, not an error
  page_all(pager, ids, 3 * kBytes, /*out=*/true);
  for (ExtentId id : ids) {
    if (id != freed) EXPECT_EQ(pager.residency(id), Residency::kFile);
  }
  EXPECT_EQ(pager.stats().mapped_bytes, 0u);
  page_all(pager, ids, 3 * kBytes, /*out=*/false);
  for (int i = 0; i < 10; i++) {
    if (ids[i] == freed) continue;
    EXPECT_EQ(pager.residency(ids[i]), Residency::kResident);
    EXPECT_EQ(std::memcmp(reinterpret_cast<void*>(pager.address(ids[i])), want[i].data(), kBytes),
              0);
  }
}

TEST(PageAll, ABucketOfNoBytesIsRefusedBeforeAnythingIsPaged) {
  TempDir dir;
  Pager pager(make_host_device(), test_options(dir.file("store")));
  const ExtentId id = pager.create(kBytes);
  pager.wait(pager.page_in({id}));
  EXPECT_THROW(page_all(pager, {id}, 0, /*out=*/true), UsageError);
  EXPECT_EQ(pager.residency(id), Residency::kResident);
}

TEST(MeasureMapping, GivesTheCostOfEachWay) {
  MapCheckingDevice device;
  const size_t page = 64 << 10;
  const MapCost c = measure_mapping(device, page, 16 * page + 1, 2);
  EXPECT_GT(c.map_s_per_gib, 0);
  EXPECT_GT(c.unmap_s_per_gib, 0);
  EXPECT_EQ(device.maps, 2 * 16);  // whole pages only, each round
  EXPECT_TRUE(device.mapped.empty());
  EXPECT_EQ(device.pages + device.reservations, 0);
}

TEST(MeasureMapping, RefusesWhatItCannotMeasureBeforeReservingAnything) {
  MapCheckingDevice device;
  const size_t page = 64 << 10;
  EXPECT_THROW(measure_mapping(device, 0, page, 1), UsageError);
  EXPECT_THROW(measure_mapping(device, 2 * page, page, 1), UsageError);
  EXPECT_THROW(measure_mapping(device, page, page, 0), UsageError);
  EXPECT_THROW(measure_mapping(device, page + 1, 4 * page, 1), UsageError);  // granularity
  EXPECT_EQ(device.reservations, 0);
}

TEST(MeasureMapping, ADeviceErrorGivesBackWhatWasMappedCreatedAndReserved) {
  MapCheckingDevice device;
  device.fail_at = 5;
  EXPECT_THROW(measure_mapping(device, 64 << 10, 8 << 16, 1), DeviceError);
  EXPECT_TRUE(device.mapped.empty());
  EXPECT_EQ(device.pages + device.reservations, 0);
}

}  // namespace
}  // namespace statepager
