#include "allocator/pluggable.h"

#include <map>
#include <mutex>
#include <vector>

namespace statepager {

namespace {

struct Routes {
  std::mutex mu;
  std::map<int, std::shared_ptr<Pager>> by_device;
  // Every pager that ever served a segment, kept alive for the life of the process: its
  // arena must stay reserved while PyTorch may still hold (and free) its segments.
  std::vector<std::shared_ptr<Pager>> all;
};

// Never destroyed: PyTorch may free segments during interpreter shutdown.
Routes& routes() {
  static Routes* r = new Routes;
  return *r;
}

}  // namespace

void route_device(int device, std::shared_ptr<Pager> pager) {
  Routes& r = routes();
  std::lock_guard lock(r.mu);
  if (!pager) {
    r.by_device.erase(device);
    return;
  }
  r.by_device[device] = pager;
  for (auto& known : r.all) {
    if (known == pager) return;
  }
  r.all.push_back(pager);
}

}  // namespace statepager

using statepager::Pager;

extern "C" void* statepager_alloc(size_t size, int device, void*) {
  std::shared_ptr<Pager> pager;
  {
    auto& r = statepager::routes();
    std::lock_guard lock(r.mu);
    auto it = r.by_device.find(device);
    if (it == r.by_device.end()) return nullptr;
    pager = it->second;
  }
  try {
    return reinterpret_cast<void*>(pager->create_segment(size));
  } catch (...) {
    return nullptr;
  }
}

extern "C" void statepager_free(void* ptr, size_t, int, void*) {
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  std::vector<std::shared_ptr<Pager>> pagers;
  {
    auto& r = statepager::routes();
    std::lock_guard lock(r.mu);
    pagers = r.all;
  }
  for (auto& pager : pagers) {
    if (!pager->owns_address(addr)) continue;
    try {
      pager->release_at(addr);
    } catch (...) {
    }
    return;
  }
}
