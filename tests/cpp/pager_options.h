// What the Pager suites share: the options of a small Pager (64 KiB pages, so that many
// extents share pages, in a 4 GiB arena) and reproducible random bytes to fill it with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "allocator/pager.h"

namespace statepager {

inline PagerOptions test_options(const std::string& directory,
                                 size_t io_block = size_t(128) << 10,
                                 unsigned io_depth = 8) {
  PagerOptions o;
  o.directory = directory;
  o.pool.page_size = 64 << 10;
  o.pool.arena_size = size_t(1) << 32;
  o.io_depth = io_depth;
  o.io_block = io_block;
  return o;
}

inline std::vector<char> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<char> out(n);
  for (char& c : out) c = char(gen());
  return out;
}

}  // namespace statepager
