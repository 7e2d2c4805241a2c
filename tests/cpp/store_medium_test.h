// A Pager suite's fixture, run on each medium of tests/cpp/store_media.h: a fresh
// directory on that medium per test, and the options of a small Pager with its store there.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <string>

#include "allocator/pager.h"
#include "tests/cpp/pager_options.h"
#include "tests/cpp/store_media.h"
#include "tests/cpp/temp_dir.h"

namespace statepager {

class StoreMediumTest : public ::testing::TestWithParam<StoreMedium> {
 protected:
  StoreMediumTest() : dir_(GetParam().root) {}
  PagerOptions options(size_t host_budget = 0) const {
    PagerOptions o = test_options(dir_.file("store"));
    o.map_ram = GetParam().map_ram;
    o.host_budget = host_budget;
    return o;
  }
  std::string file(const std::string& name) const { return dir_.file(name); }

 private:
  TempDir dir_;
};

}  // namespace statepager
