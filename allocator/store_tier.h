// StoreTier: the store files as a tier — moves buckets' bytes between device memory and
// the store files through pinned staging slots (device copy <-> io_uring request), or,
// with map_ram, straight between device memory and the files' pages where the files lie
// in RAM and are mapped (allocator/ram_map.h: a device copy, no request).
//
// plan() cuts a bucket's store ranges into requests of at most block_bytes; extents that
// are neighbours in the file share a request. pump() runs one round of the pipeline over
// the jobs given (oldest first): it queues the copies of chunks whose store range is
// mapped at once (no slot: the copy engines, not the staging, bound them), hands free
// slots to the other chunks, passes finished device copies on to the file and finished
// reads on to device copies, and records each chunk's outcome in its job
// (chunks_in_flight, requests, mapped_bytes, error). plan() also cuts each store range
// into parts (Job::crc_ranges), and pump() takes each part's crc32c where its bytes lie in
// host memory (a staging slot, host-tier memory) or, for chunks copied straight to or from
// mapped files, by the device from the bytes it copies (Device::checksum; the files'
// pages where it cannot): see Note [Store checksums] in allocator/pager_crc.cc.
//
// Ownership: borrows the Device and the UringFile (both must outlive it); owns the staging
// memory (depth x block_bytes from Device::alloc_staging, and the mapped batches'
// checksums') and the RamMap, freed by the destructor.
// Thread-safety: none; the Pager's I/O thread alone calls start() and pump(),
// plan() runs under the Pager's lock (it only reads the block size); punch() and
// mapped_bytes() may be called from any thread.
// Errors: failures of a chunk (device or file) become its job's error; the first one
// sticks. The constructor throws what alloc_staging throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "allocator/copy_list.h"
#include "allocator/device.h"
#include "allocator/job.h"
#include "allocator/ram_map.h"
#include "backing/uring_file.h"

namespace statepager {

// Store ranges are whole file blocks: offsets and lengths multiples of this.
constexpr size_t kFileAlign = UringFile::kAlignment;

// The store (the file of UringFile) a logical store offset lies in.
inline unsigned store_index(uint64_t store_offset) {
  return static_cast<unsigned>(store_offset / UringFile::kRegionBytes);
}

class StoreTier {
 public:
  StoreTier(Device& device, UringFile& file, unsigned depth, size_t block_bytes,
            bool map_ram = false);
  ~StoreTier();
  StoreTier(const StoreTier&) = delete;
  StoreTier& operator=(const StoreTier&) = delete;

  // An extent's bytes at `addr` (device memory, through staging) or `buf` (host-tier
  // memory of file_bytes, read or written directly), and its range of the store files
  // (4 KiB-aligned). A page-in writes the device memory from `addr` up to the next 4 KiB
  // boundary past its bytes (from the store range's zeros there), so that small
  // neighbours' copies join: `addr` must be 4 KiB-aligned and those bytes its own.
  struct Move {
    uintptr_t addr;
    size_t bytes;
    uint64_t store_offset;
    size_t file_bytes;
    char* buf = nullptr;
  };
  // Appends to job.chunks and job.file_ends and adds to job.bytes_moved.
  void plan(Job& job, std::vector<Move> moves) const;

  // First step of a started job: a page-out makes sure its stores are allocated that far;
  // with map_ram, the stores it touches are mapped that far.
  void start(Job& job);
  // One round of the pipeline (see the class comment); `progressed` says whether the
  // caller's round moved anything already. Waits for the file only when nothing moved,
  // briefly while device copies are pending. Returns whether anything moved.
  bool pump(const std::vector<Job*>& jobs, bool progressed);

  // Gives the blocks of a store range back (UringFile::punch), unless RamMap keeps them.
  void punch(uint64_t offset, uint64_t length);
  uint64_t mapped_bytes() const;  // of the store files, now (0 without map_ram)

 private:
  struct StagingSlot {
    unsigned index = 0;
    char* buf = nullptr;
    Job* job = nullptr;
    const Chunk* chunk = nullptr;
    std::optional<Fence> copy;  // set while a device copy for this slot is queued
  };
  // Chunks of one job copied straight to or from mapped store files, under one fence.
  struct MappedCopies {
    Job* job;
    size_t first;  // of job->chunks
    size_t chunks;
    std::optional<Fence> copy;
    std::optional<Fence> sums;  // Device::checksum's, into crcs
    uint32_t* crcs;  // the device's checksums of its pieces, in order; null: it took none
  };
  void start_chunk(StagingSlot& slot);
  bool start_mapped(Job& job);
  void settle_mapped(MappedCopies& batch);
  void checksum_mapped(const MappedCopies& batch);
  uint32_t* take_crc_block();
  void give_crc_block(uint32_t* block);
  static void add_mapped_copies(bool out, const Chunk& chunk,
                                const std::vector<RamMap::Piece>& mem, CopyList* copies);
  bool copied(std::optional<Fence>& copy, Job& job, bool* pending);
  bool hold_for_copies(StagingSlot& slot, CopyQueue queue);
  void finish_slot(StagingSlot& slot, int error, uint64_t offset);

  Device& device_;
  UringFile& file_;
  size_t block_bytes_;
  char* staging_ = nullptr;
  std::vector<StagingSlot> slots_;
  std::unique_ptr<RamMap> ram_;      // with map_ram
  unsigned crc_threads_ = 1;         // checksum_mapped()'s
  std::vector<uint32_t*> crc_blocks_;       // staging memory for MappedCopies::crcs
  std::vector<uint32_t*> free_crc_blocks_;  // of them, not in use
  std::vector<MappedCopies> mapped_;  // queued, oldest first
};

}  // namespace statepager
