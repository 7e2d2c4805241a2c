#include "allocator/store_restore.h"

#include <algorithm>

#include "backing/errors.h"
#include "backing/parallel.h"

namespace statepager {

CopyMethod restore_extents(Pager& pager, const std::vector<ExtentId>& ids,
                           const std::vector<bool>& zero, const std::string& src,
                           const std::vector<uint64_t>& src_offsets) {
  if (zero.size() != ids.size() || src_offsets.size() != ids.size()) {
    throw UsageError("restore: ids, zero and src_offsets must have the same length");
  }
  std::vector<ExtentId> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw UsageError("restore: an extent is given twice");
  }
  const std::vector<Placement> places = pager.begin_restore(ids, zero);
  SharedCopyMethod method;
  try {
    // After begin_restore: stores are only ever added, so these cover every span.
    const std::vector<std::string> paths = pager.store_files();
    const OpenFile from(src, OpenFile::kRead);
    std::vector<OpenFile> store;
    for (const std::string& path : paths) store.emplace_back(path, OpenFile::kWrite);
    parallel_for(ids.size(), kCopyThreads, [&](size_t i) {
      if (places[i].host != nullptr) {  // into the host tier: memory, no method to choose
        read_into(from, src_offsets[i], places[i].host, places[i].store_bytes);
        return;
      }
      CopyMethod used = method.first();
      uint64_t at = src_offsets[i];
      for (const UringFile::Span& s : places[i].spans) {
        used = copy_range(from, at, store[s.file], s.offset, s.length, used);
        at += s.length;
      }
      method.came_to(used);
    });
  } catch (...) {
    pager.end_restore(ids, places, false);
    throw;
  }
  pager.end_restore(ids, places, true);
  return method.first();
}

}  // namespace statepager
