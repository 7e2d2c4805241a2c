// Pool's references and its mapping outside the caller's lock (ref_begin, map_pending,
// finish_mapping): pages being mapped are the caller's alone, a failure undoes itself
// without unmapping what was never mapped, and the budget holds.
#include "allocator/pool.h"

#include <gtest/gtest.h>

#include "backing/errors.h"
#include "wrapped_device.h"

namespace statepager {
namespace {

constexpr size_t kPage = 64 << 10;

PoolOptions options(size_t budget_pages) {
  PoolOptions o;
  o.arena_size = 64 * kPage;
  o.page_size = kPage;
  o.hbm_budget = budget_pages * kPage;
  return o;
}

TEST(Pool, PagesBeingMappedAreTheCallersAloneUntilFinished) {
  MapCheckingDevice device;
  Pool pool(device, options(16));
  const uintptr_t a = pool.allocate(3 * kPage, kPage);  // pages 0-2
  Pool::PendingMaps mine;
  ASSERT_TRUE(pool.ref_begin(a, 2 * kPage, &mine));      // pages 0, 1
  ASSERT_TRUE(pool.ref_begin(a + kPage, 2 * kPage, &mine));  // 1 again (its own), and 2
  EXPECT_EQ(mine.size(), 3u);
  EXPECT_FALSE(pool.is_mapped(a, kPage));
  EXPECT_TRUE(device.mapped.empty());
  // Another caller touching one of them takes nothing.
  Pool::PendingMaps other;
  EXPECT_FALSE(pool.ref_begin(a + 2 * kPage, kPage, &other));
  EXPECT_FALSE(pool.ref(a, kPage));
  EXPECT_TRUE(other.empty());
  pool.map_pending(mine);  // what the Pager does without its lock
  EXPECT_EQ(device.mapped.size(), 3u);
  pool.finish_mapping(mine);
  EXPECT_TRUE(pool.is_mapped(a, 3 * kPage));
  EXPECT_TRUE(pool.ref(a + 2 * kPage, kPage));  // now anyone's
  pool.unref(a, 2 * kPage);
  pool.unref(a + kPage, 2 * kPage);
  EXPECT_TRUE(pool.is_mapped(a + 2 * kPage, kPage));  // the last reference
  EXPECT_FALSE(pool.is_mapped(a, 2 * kPage));
  pool.unref(a + 2 * kPage, kPage);
  EXPECT_TRUE(device.mapped.empty());
  EXPECT_EQ(pool.mapped_bytes(), 0u);
  EXPECT_EQ(pool.pages().in_use_bytes(), 0u);
}

TEST(Pool, AFailedMappingIsUndoneByUnrefWithoutUnmappingWhatWasNeverMapped) {
  MapCheckingDevice device;
  Pool pool(device, options(16));
  const uintptr_t a = pool.allocate(4 * kPage, kPage);
  ASSERT_TRUE(pool.ref(a, kPage));  // page 0 mapped before: it stays
  Pool::PendingMaps mine;
  ASSERT_TRUE(pool.ref_begin(a, 4 * kPage, &mine));
  EXPECT_EQ(mine.size(), 3u);
  device.fail_at = 3;  // the second of the three pending pages
  EXPECT_THROW(pool.map_pending(mine), DeviceError);
  EXPECT_EQ(device.mapped.size(), 1u);  // the one it mapped is unmapped again
  pool.unref(a, 4 * kPage);
  EXPECT_EQ(device.mapped.size(), 1u);
  EXPECT_TRUE(pool.is_mapped(a, kPage));
  EXPECT_EQ(pool.pages().in_use_bytes(), kPage);
  // ref() undoes itself the same way, its first page mapped and unmapped again.
  device.fail_at = 5;
  EXPECT_THROW((void)pool.ref(a + kPage, 2 * kPage), DeviceError);
  EXPECT_EQ(pool.mapped_bytes(), kPage);
  EXPECT_EQ(pool.pages().in_use_bytes(), kPage);
  pool.unref(a, kPage);
  EXPECT_TRUE(device.mapped.empty());
}

// The device out of memory while a page is created: nothing taken, nothing left marked
// as being mapped, and the next reference maps as usual.
TEST(Pool, ADeviceOutOfMemoryTakesNothing) {
  MapCheckingDevice device;
  Pool pool(device, options(16));
  const uintptr_t a = pool.allocate(3 * kPage, kPage);
  ASSERT_TRUE(pool.ref(a, kPage));
  Pool::PendingMaps mine;
  device.fail_create = true;
  EXPECT_THROW((void)pool.ref_begin(a, 3 * kPage, &mine), OutOfMemoryError);
  EXPECT_THROW((void)pool.ref(a + kPage, kPage), OutOfMemoryError);
  EXPECT_TRUE(mine.empty());
  EXPECT_EQ(pool.mapped_bytes(), kPage);
  device.fail_create = false;
  Pool::PendingMaps other;  // another caller: no page is left as if being mapped
  ASSERT_TRUE(pool.ref_begin(a, 3 * kPage, &other));
  pool.map_pending(other);
  pool.finish_mapping(other);
  EXPECT_TRUE(pool.is_mapped(a, 3 * kPage));
  pool.unref(a, 3 * kPage);
  pool.unref(a, kPage);
  EXPECT_TRUE(device.mapped.empty());
  EXPECT_EQ(pool.pages().in_use_bytes(), 0u);
}

TEST(Pool, OutOfBudgetTakesNothing) {
  MapCheckingDevice device;
  Pool pool(device, options(3));
  const uintptr_t a = pool.allocate(5 * kPage, kPage);
  Pool::PendingMaps mine;
  ASSERT_TRUE(pool.ref_begin(a, kPage, &mine));
  EXPECT_THROW((void)pool.ref_begin(a, 5 * kPage, &mine), OutOfMemoryError);
  EXPECT_EQ(mine.size(), 1u);  // as before the call
  EXPECT_EQ(pool.pages().in_use_bytes(), kPage);
  pool.map_pending(mine);
  pool.finish_mapping(mine);
  pool.unref(a, kPage);
  EXPECT_TRUE(device.mapped.empty());
  EXPECT_EQ(pool.mapped_bytes(), 0u);
}

}  // namespace
}  // namespace statepager
