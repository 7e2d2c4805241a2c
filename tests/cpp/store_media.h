// The media the Pager suites run on: a store on disk, a striped store in RAM, and a RAM
// store mapped for the device's copies (PagerOptions::map_ram, allocator/ram_map.h; one
// file, not striped).
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace statepager {

struct StoreMedium {
  const char* root;  // the directory the store goes in
  bool map_ram;
  const char* name;  // of the test instance
};

inline const StoreMedium kStoreMedia[] = {
    {"/tmp", false, "Disk"}, {"/dev/shm", false, "Ram"}, {"/dev/shm", true, "MappedRam"}};

inline std::string medium_name(const ::testing::TestParamInfo<StoreMedium>& info) {
  return info.param.name;
}

}  // namespace statepager
