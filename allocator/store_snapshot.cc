#include "allocator/store_snapshot.h"

#include <optional>

#include "backing/errors.h"

namespace statepager {

StoreSnapshot::StoreSnapshot(Pager& pager, const std::vector<ExtentId>& ids) : pager_(pager) {
  for (const std::string& path : pager.store_files()) store_.emplace_back(path, OpenFile::kRead);
  host_ = pager.host_memory();
  placements_ = pager_.hold(ids);
}

StoreSnapshot::~StoreSnapshot() { release(); }

void StoreSnapshot::release() {
  for (; released_ < placements_.size(); released_++) {
    const Placement& p = placements_[released_];
    if (p.state != Residency::kZero) pager_.unhold(p.store_offset);
  }
}

StoreSnapshot::Copied StoreSnapshot::copy_to(const std::vector<std::string>& files,
                                             const std::vector<Target>& targets,
                                             uint64_t chunk_bytes) {
  if (targets.size() != placements_.size()) {
    throw UsageError("StoreSnapshot::copy_to: one target per extent is needed, " +
                     std::to_string(targets.size()) + " given for " +
                     std::to_string(placements_.size()));
  }
  if (released_ > 0) throw UsageError("StoreSnapshot::copy_to: the snapshot was already copied");
  std::vector<OpenFile> out;
  for (const std::string& path : files) out.emplace_back(path, OpenFile::kWrite);
  Copied copied;
  copied.crcs.resize(chunk_bytes > 0 ? placements_.size() : 0);
  for (; released_ < placements_.size(); released_++) {
    const Placement& p = placements_[released_];
    if (p.state == Residency::kZero) continue;
    const Target& t = targets[released_];
    if (t.file >= out.size()) {
      throw UsageError("StoreSnapshot::copy_to: target file " + std::to_string(t.file) +
                       " of " + std::to_string(out.size()));
    }
    std::optional<ChunkCrcs> crcs;
    if (chunk_bytes > 0) crcs.emplace(chunk_bytes);
    uint64_t at = t.offset;
    if (p.host != nullptr) {  // HOST: from memory, checksummed on the way out
      if (crcs) crcs->update(static_cast<const char*>(p.host), p.store_bytes);
      write_range(out[t.file], at, p.host, p.store_bytes);
    }
    for (const UringFile::Span& s : p.spans) {
      copied.method = copy_range(store_[s.file], s.offset, out[t.file], at, s.length,
                                 copied.method, crcs ? &*crcs : nullptr);
      at += s.length;
    }
    if (crcs) copied.crcs[released_] = crcs->take();
    pager_.unhold(p.store_offset);
  }
  for (const OpenFile& f : out) f.sync();
  return copied;
}

}  // namespace statepager
