// Pager's store checksums: what a finished bucket's store ranges held, recorded where it
// wrote them and compared where it read them (see Note [Store checksums]).
//
// Note [Store checksums]
// ~~~~~~~~~~~~~~~~~~~~~~
// A store file is statepager's alone, but nothing stops another process from writing into
// it between a page-out and the next page-in; the bytes read back would then be handed to
// the optimizer as its state. So every store range a bucket writes gets the crc32c of the
// bytes written (the extent's bytes and the zeros up to its last 4 KiB block), kept with
// the range (Pager::Store::crcs) until it is written again or freed, and a bucket that
// reads the range back compares: a difference fails the bucket with CorruptStoreError
// naming the file and offset, and the bucket's extents stay as they were (still FILE).
// The key is the range, not the extent: an epoch's committed and next ranges, a move to
// another store, an unchanged extent handed back to its range, and a spill each keep or
// get the crc of their own range.
//
// The crc is taken where the bytes pass anyway. Through host memory, on the I/O thread: a
// staging slot (after the device copy of a page-out, after the read of a page-in) or the
// host tier's memory (spills, read-aheads). Copied straight between device memory and
// store files mapped in RAM (map_ram, allocator/ram_map.h), by the device, from the
// bytes it copies (Device::checksum: a kernel on a stream beside the copies' queue, after
// them, so that the next copies do not wait for it; a page-out's crc then gets the zeros
// after each piece joined on). Checksumming the files' pages on the CPU instead, at about
// 20 GB/s a core, halved the 1.34 B GPT's fp32 step on a RAM store, and the kernel on the
// copies' own queue cost it a third. A device without the kernel falls back to the CPU
// (StoreTier::checksum_mapped, on several threads). A request may hold several extents
// and an extent may span several requests that complete in any order, so StoreTier::plan
// cuts each range into parts (Job::crc_ranges), one per piece of a request, and the
// parts' crcs are joined here (crc32c_combine).
#include <cstdio>
#include <string>

#include "allocator/pager.h"
#include "allocator/pager_internal.h"
#include "backing/crc32c.h"
#include "backing/errors.h"

namespace statepager {

namespace {

// The crc32c of a range from its parts', or false where a part's is not known.
bool joined(const Job& job, const RangeCrc& r, uint32_t* crc, uint64_t* bytes) {
  *crc = 0;
  *bytes = 0;
  for (size_t k = r.first; k < r.first + r.parts; k++) {
    if (!job.part_known[k]) return false;
    *crc = k == r.first ? job.part_crcs[k]  // most ranges are one part
                        : crc32c_combine(*crc, job.part_crcs[k], job.part_bytes[k]);
    *bytes += job.part_bytes[k];
  }
  return true;
}

std::string hex(uint32_t v) {
  char out[11];
  std::snprintf(out, sizeof out, "0x%08x", v);
  return out;
}

}  // namespace

// Under the lock, on the I/O thread, before complete(): a write records its ranges' crcs
// (or forgets them, failed or not known); a read compares, failing the job on a difference.
void Pager::settle_crcs_locked(Job& job) {
  for (const RangeCrc& r : job.crc_ranges) {
    auto& crcs = stores_[store_index(r.store_offset)]->crcs;
    uint32_t crc;
    uint64_t bytes;
    const bool known = joined(job, r, &crc, &bytes);
    if (job.out()) {
      if (known && !job.error) {
        crcs[r.store_offset] = crc;
      } else {
        crcs.erase(r.store_offset);
      }
      continue;
    }
    auto it = crcs.find(r.store_offset);
    if (job.error || !known || it == crcs.end() || it->second == crc) continue;
    const UringFile::Span at = file_->spans(r.store_offset, bytes).front();
    job.error = std::make_exception_ptr(CorruptStoreError(
        "store file " + file_->physical_paths()[at.file] + " does not hold at offset " +
        std::to_string(at.offset) + " the " + std::to_string(bytes) +
        " bytes statepager paged out there (crc32c " + hex(crc) + ", written " +
        hex(it->second) + "): another process wrote into the store. Nothing was paged "
        "in; the state there is lost: load it again from a checkpoint."));
    return;
  }
}

}  // namespace statepager
