// CopyList: device <-> host copies gathered to be queued together (StoreTier's mapped
// chunks), each as large as it can be.
//
// add() joins a copy to the last one where it continues it on both sides (the device
// address and the host address follow on) within the same host mapping; otherwise it
// starts a new copy. A copy never spans two mappings, even where the host placed them
// end to end: each is its own registration with the device (cuMemHostRegister), and
// one copy across two registrations is not something the driver promises to take.
//
// Thread-safety: none (one caller). No errors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator/device.h"

namespace statepager {

class CopyList {
 public:
  // `mapping` names the host mapping holding [host, host + bytes) (its start, say).
  void add(uintptr_t addr, char* host, size_t bytes, const void* mapping) {
    if (!copies_.empty() && mapping == last_mapping_) {
      HostCopy& last = copies_.back();
      if (last.addr + last.bytes == addr && last.host + last.bytes == host) {
        last.bytes += bytes;
        return;
      }
    }
    copies_.push_back(HostCopy{addr, host, bytes});
    last_mapping_ = mapping;
  }
  const std::vector<HostCopy>& copies() const { return copies_; }

 private:
  std::vector<HostCopy> copies_;
  const void* last_mapping_ = nullptr;  // the mapping copies_.back() is in
};

}  // namespace statepager
