// CopyList: device <-> host copies gathered to be queued together (StoreTier's mapped
// chunks and staging slots), each as large as it can be.
//
// add() joins a copy to the last one where it continues it on both sides (the device
// address and the host address follow on) within the same host mapping; otherwise it
// starts a new copy. A copy never spans two mappings, even where the host placed them
// end to end: each is its own registration with the device (cuMemHostRegister), and
// one copy across two registrations is not something the driver promises to take.
// append_joined() is the same rule for copies the caller knows lie in one mapping.
//
// Thread-safety: none (one caller). No errors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator/device.h"

namespace statepager {

// Appends `c`, joined to the last copy where it continues it on both sides. Every copy
// in `copies` must lie in one host mapping, and none be queued yet.
inline void append_joined(std::vector<HostCopy>& copies, const HostCopy& c) {
  if (!copies.empty()) {
    HostCopy& last = copies.back();
    if (last.addr + last.bytes == c.addr && last.host + last.bytes == c.host) {
      last.bytes += c.bytes;
      return;
    }
  }
  copies.push_back(c);
}

class CopyList {
 public:
  // `mapping` names the host mapping holding [host, host + bytes) (its start, say).
  void add(uintptr_t addr, char* host, size_t bytes, const void* mapping) {
    if (copies_.empty() || mapping != last_mapping_) {
      copies_.push_back(HostCopy{addr, host, bytes});
      last_mapping_ = mapping;
      return;
    }
    append_joined(copies_, HostCopy{addr, host, bytes});
  }
  const std::vector<HostCopy>& copies() const { return copies_; }

 private:
  std::vector<HostCopy> copies_;
  const void* last_mapping_ = nullptr;  // the mapping copies_.back() is in
};

}  // namespace statepager
