// StoreSnapshot: extents of a Pager copied out of its store as they were at one moment,
// while the Pager goes on paging (a checkpoint taken between two training steps, finished
// during the next ones).
//
// Construction holds the extents (Pager::hold): page-outs into their store ranges wait
// until each range has been copied. copy_to() copies the FILE and HOST extents (these from
// the host tier's memory) to ranges of destination files, several at once (kCopyThreads
// threads, backing/file_copy.h, take them in the order given: more reads in flight on a
// disk, and the checksums and copies through memory on more than one core), releasing
// each hold as soon as its range is copied, so a step that pages buckets out in the same
// order waits, if at all, only for the buckets being copied. ZERO extents have no bytes
// and are not copied. The destructor (or release()) releases the holds that are left,
// after a failure or when no copy is made.
//
// Ownership: refers to the Pager, which must outlive it. Opens the store's files and keeps
// the host tier's memory at construction, so a copy still reads them after the Pager has
// closed and deleted them.
// Thread-safety: copy_to() may run on another thread than the constructor's, but not
// concurrently with itself or release().
// Errors: those of Pager::hold() and copy_range() (backing/file_copy.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "allocator/pager.h"
#include "backing/file_copy.h"

namespace statepager {

class StoreSnapshot {
 public:
  StoreSnapshot(Pager& pager, const std::vector<ExtentId>& ids);
  ~StoreSnapshot();
  StoreSnapshot(const StoreSnapshot&) = delete;
  StoreSnapshot& operator=(const StoreSnapshot&) = delete;

  // In the order of the ids given to the constructor.
  const std::vector<Placement>& placements() const { return placements_; }

  // Where extent i goes: byte `offset` of destination file `file`.
  struct Target {
    unsigned file = 0;
    uint64_t offset = 0;
  };
  struct Copied {
    // The last resort any extent's copy came to (kReadWrite where one fell back to it).
    CopyMethod method = CopyMethod::kReflink;
    // With chunk_bytes > 0: per placement, the crc32c of each chunk_bytes of its
    // store_bytes (the extent and the zeros after it), empty for ZERO ones.
    std::vector<std::vector<uint32_t>> crcs;
  };
  // Copies every FILE or HOST extent's store_bytes to its target (one per placement; ZERO ones
  // are ignored) and fsyncs the destinations. With chunk_bytes > 0 the bytes are
  // checksummed as they are copied (copy_range with ChunkCrcs: no second read). The first
  // error stops the copy (the extents being copied finish) and is thrown.
  Copied copy_to(const std::vector<std::string>& files, const std::vector<Target>& targets,
                 uint64_t chunk_bytes = 0);

  // Copies bytes [offset, offset + length) of extent i into memory `dst`, where they lie
  // at rest: zeros (ZERO), the host tier's memory (HOST) or the store's files (FILE); reads
  // only. UsageError when the range passes the extent's end. May run while holds are taken
  // (before copy_to() or release()), not concurrently with them.
  void read(size_t i, uint64_t offset, void* dst, uint64_t length) const;

  void release();  // releases every hold still taken

 private:
  // Copies placement i to its target, trying `first` first; returns the method it came to.
  CopyMethod copy_one(size_t i, const std::vector<OpenFile>& out, const Target& target,
                      uint64_t chunk_bytes, CopyMethod first, Copied& copied);
  void unhold(size_t i);

  Pager& pager_;
  std::vector<Placement> placements_;
  std::vector<OpenFile> store_;
  std::shared_ptr<const HostTier> host_;  // the memory of HOST placements
  bool copied_ = false;  // copy_to() ran (once per snapshot)
  // Per placement: still held. Written by copy_to()'s threads, each for the placements it
  // copies (distinct elements), and read by release() after they have joined.
  std::vector<char> held_;
};

}  // namespace statepager
