// Extents of a Pager filled with reproducible bytes: make_extents() (mixed sizes, none a
// multiple of 4 KiB, some spanning 1 MiB stripe units), pattern() / fill() (the bytes of a
// seed) and write_all() (every extent filled and paged out).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "allocator/pager.h"

namespace statepager {

inline std::vector<ExtentId> make_extents(Pager& pager, int n) {
  std::vector<ExtentId> ids;
  for (int i = 0; i < n; i++) ids.push_back(pager.create(size_t(300000) * (i % 3 + 1) + 77 * i));
  return ids;
}

// The bytes fill(seed) writes into an extent (seed 0: zeros): a cheap generator, 8 bytes
// at a time, different per extent and seed.
inline std::vector<uint8_t> pattern(ExtentId id, uint32_t seed, size_t bytes) {
  std::vector<uint8_t> out((bytes + 7) / 8 * 8, 0);
  uint64_t x = (uint64_t{seed} << 32 | id) * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; seed != 0 && i < out.size(); i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&out[i], &x, 8);
  }
  out.resize(bytes);
  return out;
}

inline void fill(Pager& pager, ExtentId id, uint32_t seed) {
  const std::vector<uint8_t> bytes = pattern(id, seed, pager.size(id));
  std::memcpy(reinterpret_cast<void*>(pager.address(id)), bytes.data(), bytes.size());
}

inline void write_all(Pager& pager, const std::vector<ExtentId>& ids, uint32_t seed) {
  pager.wait(pager.page_in(ids));
  for (ExtentId id : ids) fill(pager, id, seed);
  pager.wait(pager.page_out(ids));
}

}  // namespace statepager
