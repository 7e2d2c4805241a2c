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
