#include "allocator/extent_table.h"

#include <string>

#include "backing/errors.h"

namespace statepager {

ExtentId ExtentTable::add(std::unique_ptr<Extent> e) {
  const ExtentId id = next_id_++;
  by_address_[e->addr] = id;
  extents_[id] = std::move(e);
  return id;
}

void ExtentTable::erase(ExtentId id) {
  by_address_.erase(at(id).addr);
  extents_.erase(id);
}

Extent& ExtentTable::at(ExtentId id) {
  Extent* e = find(id);
  if (e == nullptr) throw UsageError("unknown extent " + std::to_string(id));
  return *e;
}

const Extent& ExtentTable::at(ExtentId id) const { return const_cast<ExtentTable*>(this)->at(id); }

Extent* ExtentTable::find(ExtentId id) {
  auto it = extents_.find(id);
  return it == extents_.end() ? nullptr : it->second.get();
}

const Extent* ExtentTable::find(ExtentId id) const {
  return const_cast<ExtentTable*>(this)->find(id);
}

std::optional<ExtentId> ExtentTable::starting_at(uintptr_t addr) const {
  auto it = by_address_.find(addr);
  if (it == by_address_.end()) return std::nullopt;
  return it->second;
}

}  // namespace statepager
