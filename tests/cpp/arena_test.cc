#include "allocator/arena.h"

#include <gtest/gtest.h>

#include "backing/errors.h"

namespace statepager {
namespace {

TEST(Arena, AllocatesAlignedNeighboursAndCoalesces) {
  Arena arena(1 << 20, 1 << 20);
  const uintptr_t a = arena.allocate(100, 4096);
  const uintptr_t b = arena.allocate(5000, 4096);
  EXPECT_EQ(a % 4096, 0u);
  EXPECT_EQ(b, a + 4096);  // neighbours stay neighbours
  arena.free(a);
  arena.free(b);
  EXPECT_EQ(arena.allocated_bytes(), 0u);
  EXPECT_EQ(arena.allocate(1 << 20, 4096), uintptr_t(1) << 20);  // coalesced back to one range
}

TEST(Arena, HighEndAllocationsPackDownFromTheTopApartFromLowOnes) {
  const uintptr_t base = 1 << 20;
  const size_t size = 1 << 20;
  Arena arena(base, size);
  const uintptr_t low = arena.allocate(100, 4096);
  const uintptr_t a = arena.allocate(5000, 4096, ArenaEnd::kHigh);
  const uintptr_t b = arena.allocate(100, 4096, ArenaEnd::kHigh);
  EXPECT_EQ(low, base);
  EXPECT_EQ(a, (base + size - 5000) & ~uintptr_t(4095));  // aligned down from the top
  EXPECT_EQ(b, a - 4096);  // the next one right below: neighbours again
  EXPECT_EQ(arena.allocate(100, 4096), low + 4096);  // the low end goes on where it was
  arena.free(a);
  // The highest free range that fits, even when a lower one would.
  EXPECT_EQ(arena.allocate(4096, 4096, ArenaEnd::kHigh), base + size - 4096);
  // A range too small at the top is passed over for the next one down.
  EXPECT_EQ(arena.allocate(3 * 4096, 4096, ArenaEnd::kHigh), b - 3 * 4096);
  // Both ends meet: the range left between them (from the low end's third page to the
  // high end's eighth from the top) is allocated whole, then no 8 KiB range is left.
  EXPECT_EQ(arena.allocate(size - 8 * 4096, 4096, ArenaEnd::kHigh), low + 2 * 4096);
  EXPECT_THROW(arena.allocate(8192, 4096, ArenaEnd::kHigh), OutOfMemoryError);
}

TEST(Arena, ExhaustionAndBadFreeAreTypedErrors) {
  Arena arena(4096, 8192);
  arena.allocate(8192, 4096);
  EXPECT_THROW(arena.allocate(1, 1), OutOfMemoryError);
  EXPECT_THROW(arena.free(12345), UsageError);
}

TEST(Arena, SplitRangesAreFreedOnTheirOwn) {
  Arena arena(4096, 1 << 20);
  const uintptr_t a = arena.allocate(3 * 4096, 4096);
  arena.split(a, 4096);
  arena.split(a + 4096, 4096);
  EXPECT_EQ(arena.allocated_bytes(), 3u * 4096);
  arena.free(a + 4096);  // the middle one: a hole of its size
  EXPECT_EQ(arena.allocate(4096, 4096), a + 4096);
  arena.free(a);
  arena.free(a + 4096);
  arena.free(a + 2 * 4096);
  EXPECT_EQ(arena.allocated_bytes(), 0u);
  EXPECT_EQ(arena.allocate(1 << 20, 4096), 4096u);  // coalesced whole again
  EXPECT_THROW(arena.split(4096, 0), UsageError);
  EXPECT_THROW(arena.split(4096, 1 << 20), UsageError);
  EXPECT_THROW(arena.split(8192, 4096), UsageError);  // not an allocation's start
}

}  // namespace
}  // namespace statepager
