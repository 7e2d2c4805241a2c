#include "allocator/map_cost.h"

#include <chrono>
#include <string>
#include <vector>

#include "backing/errors.h"

namespace statepager {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// A reservation, its pages and what is mapped of it: given back when it goes out of
// scope, on success or on a device error alike.
struct Mapping {
  Mapping(Device& d, size_t page) : device(d), page_size(page) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  Device& device;
  const size_t page_size;
  uintptr_t base = 0;
  size_t reserved = 0;
  std::vector<PhysicalPage> pages;
  size_t mapped = 0;  // pages[0, mapped) are mapped at base (or being unmapped)

  // Each call on its own: one that fails (the device's error is already on its way, or
  // the range was half unmapped) does not keep the others from giving back theirs.
  ~Mapping() {
    for (; mapped > 0; mapped--) quietly([&] { device.unmap(address(mapped - 1), page_size); });
    for (PhysicalPage p : pages) quietly([&] { device.release_page(p, page_size); });
    if (reserved) quietly([&] { device.unreserve(base, reserved); });
  }
  template <typename F>
  static void quietly(F&& f) {
    try {
      f();
    } catch (...) {
    }
  }
  uintptr_t address(size_t i) const { return base + i * page_size; }
};

}  // namespace

MapCost measure_mapping(Device& device, size_t page_size, size_t total_bytes, int rounds) {
  if (rounds < 1 || page_size == 0 || total_bytes < page_size) {
    throw UsageError("measure_mapping: need rounds >= 1 and 0 < page_size <= total_bytes");
  }
  if (page_size % device.granularity() != 0) {
    throw UsageError("page size " + std::to_string(page_size) + " is not a multiple of " +
                     device.name() + "'s granularity (" + std::to_string(device.granularity()) +
                     " bytes)");
  }
  const size_t n = total_bytes / page_size;
  Mapping m(device, page_size);
  m.base = device.reserve(n * page_size);
  m.reserved = n * page_size;
  for (size_t i = 0; i < n; i++) m.pages.push_back(device.create_page(page_size));
  double map_s = 0, unmap_s = 0;
  for (int r = 0; r < rounds; r++) {
    const auto t0 = Clock::now();
    for (; m.mapped < n; m.mapped++) device.map(m.address(m.mapped), page_size, m.pages[m.mapped]);
    const auto t1 = Clock::now();
    for (size_t i = 0; i < n; i++) device.unmap(m.address(i), page_size);
    m.mapped = 0;
    map_s += seconds(t0, t1);
    unmap_s += seconds(t1, Clock::now());
  }
  const double gib = double(n * page_size) / double(size_t(1) << 30) * rounds;
  return MapCost{map_s / gib, unmap_s / gib};
}

}  // namespace statepager
