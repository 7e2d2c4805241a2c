#include "allocator/host_tier.h"

#include "backing/align.h"
#include "backing/errors.h"

namespace statepager {

HostTier::HostTier(Device& device, size_t host_budget)
    : device_(device),
      host_budget_(host_budget),
      memory_(static_cast<char*>(device.alloc_staging(host_budget))),
      ranges_(kHostBase, host_budget) {}

HostTier::~HostTier() {
  try {
    device_.free_staging(memory_, host_budget_);
  } catch (...) {
  }
}

std::optional<uint64_t> HostTier::allocate(size_t bytes) {
  try {
    return ranges_.allocate(align_up(bytes, UringFile::kAlignment), UringFile::kAlignment);
  } catch (const OutOfMemoryError&) {
    return std::nullopt;
  }
}

void HostTier::free(uint64_t offset) { ranges_.free(offset); }

void HostTier::start(Job& job) {
  for (; job.host_copies_issued < job.host_copies.size(); job.host_copies_issued++) {
    const HostCopy& c = job.host_copies[job.host_copies_issued];
    if (job.out()) {
      device_.copy_to_host(c.host, c.addr, c.bytes);
    } else {
      device_.copy_to_device(c.addr, c.host, c.bytes);
    }
  }
}

}  // namespace statepager
