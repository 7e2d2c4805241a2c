#include "allocator/store_snapshot.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "backing/errors.h"
#include "backing/parallel.h"

namespace statepager {

StoreSnapshot::StoreSnapshot(Pager& pager, const std::vector<ExtentId>& ids) : pager_(pager) {
  for (const std::string& path : pager.store_files()) store_.emplace_back(path, OpenFile::kRead);
  host_ = pager.host_memory();
  placements_ = pager_.hold(ids);
  held_.assign(placements_.size(), 1);
}

StoreSnapshot::~StoreSnapshot() { release(); }

void StoreSnapshot::release() {
  for (size_t i = 0; i < placements_.size(); i++) unhold(i);
}

void StoreSnapshot::unhold(size_t i) {
  if (!held_[i]) return;
  held_[i] = 0;
  if (placements_[i].state != Residency::kZero) pager_.unhold(placements_[i].range);
}

StoreSnapshot::Copied StoreSnapshot::copy_to(const std::vector<std::string>& files,
                                             const std::vector<Target>& targets,
                                             uint64_t chunk_bytes) {
  if (targets.size() != placements_.size()) {
    throw UsageError("StoreSnapshot::copy_to: one target per extent is needed, " +
                     std::to_string(targets.size()) + " given for " +
                     std::to_string(placements_.size()));
  }
  if (copied_) throw UsageError("StoreSnapshot::copy_to: the snapshot was already copied");
  copied_ = true;
  std::vector<size_t> todo;
  for (size_t i = 0; i < placements_.size(); i++) {
    if (placements_[i].state == Residency::kZero) continue;
    if (targets[i].file >= files.size()) {
      throw UsageError("StoreSnapshot::copy_to: target file " + std::to_string(targets[i].file) +
                       " of " + std::to_string(files.size()));
    }
    todo.push_back(i);
  }
  std::vector<OpenFile> out;
  for (const std::string& path : files) out.emplace_back(path, OpenFile::kWrite);
  Copied copied;
  copied.crcs.resize(chunk_bytes > 0 ? placements_.size() : 0);

  SharedCopyMethod method;
  parallel_for(todo.size(), kCopyThreads, [&](size_t k) {
    method.came_to(copy_one(todo[k], out, targets[todo[k]], chunk_bytes, method.first(), copied));
  });
  copied.method = method.first();
  for (const OpenFile& f : out) f.sync();
  return copied;
}

CopyMethod StoreSnapshot::copy_one(size_t i, const std::vector<OpenFile>& out,
                                   const Target& target, uint64_t chunk_bytes, CopyMethod first,
                                   Copied& copied) {
  const Placement& p = placements_[i];
  std::optional<ChunkCrcs> crcs;
  if (chunk_bytes > 0) crcs.emplace(chunk_bytes);
  uint64_t at = target.offset;
  CopyMethod method = first;
  if (p.host != nullptr) {  // HOST: from memory, checksummed on the way out
    if (crcs) crcs->update(static_cast<const char*>(p.host), p.store_bytes);
    write_range(out[target.file], at, p.host, p.store_bytes);
  }
  for (const UringFile::Span& s : p.spans) {
    method = copy_range(store_[s.file], s.offset, out[target.file], at, s.length, method,
                        crcs ? &*crcs : nullptr);
    at += s.length;
  }
  if (crcs) copied.crcs[i] = crcs->take();  // its own element: no other thread writes it
  unhold(i);
  return method;
}

void StoreSnapshot::read(size_t i, uint64_t offset, void* dst, uint64_t length) const {
  const Placement& p = placements_.at(i);
  if (offset > p.bytes || length > p.bytes - offset) {
    throw UsageError("StoreSnapshot::read: bytes " + std::to_string(offset) + " to " +
                     std::to_string(offset + length) + " pass the end of an extent of " +
                     std::to_string(p.bytes));
  }
  char* to = static_cast<char*>(dst);
  if (p.state == Residency::kZero) {
    std::memset(to, 0, length);
    return;
  }
  if (p.host != nullptr) {
    std::memcpy(to, p.host + offset, length);
    return;
  }
  for (const UringFile::Span& s : p.spans) {  // the store range, span after span
    if (length == 0) break;
    if (offset >= s.length) {
      offset -= s.length;
      continue;
    }
    const uint64_t n = std::min<uint64_t>(length, s.length - offset);
    read_into(store_[s.file], s.offset + offset, to, n);
    to += n;
    length -= n;
    offset = 0;
  }
}

}  // namespace statepager
