// CopyList: a copy joins the last one only where it continues it on both sides within
// the same host mapping.
#include "allocator/copy_list.h"

#include <gtest/gtest.h>

namespace statepager {
namespace {

TEST(CopyList, JoinsWhatContinuesOnBothSidesInOneMapping) {
  char host[64];
  const int a = 0;  // names a mapping
  CopyList list;
  list.add(1000, host, 16, &a);
  list.add(1016, host + 16, 8, &a);  // follows on both sides
  list.add(1030, host + 24, 8, &a);  // a gap on the device side
  list.add(1038, host + 40, 8, &a);  // a gap on the host side (padding in the file)
  ASSERT_EQ(list.copies().size(), 3u);
  EXPECT_EQ(list.copies()[0].addr, 1000u);
  EXPECT_EQ(list.copies()[0].bytes, 24u);
  EXPECT_EQ(list.copies()[1].addr, 1030u);
  EXPECT_EQ(list.copies()[2].host, host + 40);
}

TEST(CopyList, NeverJoinsTwoMappingsLyingEndToEnd) {
  char host[64];
  const int a = 0, b = 0;
  CopyList list;
  list.add(1000, host, 32, &a);
  list.add(1032, host + 32, 32, &b);  // continues on both sides, in another mapping
  ASSERT_EQ(list.copies().size(), 2u);
  EXPECT_EQ(list.copies()[0].bytes, 32u);
  EXPECT_EQ(list.copies()[1].bytes, 32u);
}

}  // namespace
}  // namespace statepager
