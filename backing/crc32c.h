// crc32c (Castagnoli; the checksum of iSCSI, ext4 and btrfs metadata): checkpoint
// checksums computed while the bytes pass through memory anyway.
//
// crc32c() uses the CPU's CRC instruction where there is one (x86-64 SSE4.2 crc32q,
// AArch64 crc32cx; chosen once at run time) and a slicing-by-8 table everywhere else; both
// give the same values. Chaining follows zlib.crc32: crc32c(crc32c(0, a), b) is the crc32c
// of a followed by b, and crc32c(0, "123456789", 9) == 0xE3069283.
//
// ChunkCrcs splits a stream of bytes into chunks of a fixed size and keeps one crc32c per
// chunk (the last one may be shorter), so a range can be checked chunk by chunk.
// Thread-safety: crc32c() and crc32c_combine() are reentrant; a ChunkCrcs belongs to one
// thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace statepager {

uint32_t crc32c(uint32_t crc, const void* data, size_t n);

// The crc32c of a followed by b from crc32c(0, a), crc32c(0, b) and b's length (zlib's
// crc32_combine): checksums of pieces computed apart, in any order, joined in file order.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t b_bytes);

// "sse4.2", "armv8-crc" or "table": what crc32c() runs on this machine.
const char* crc32c_engine();

// crc32c() by the table alone, whatever the CPU has (the tests compare the two).
uint32_t crc32c_table(uint32_t crc, const void* data, size_t n);

class ChunkCrcs {
 public:
  explicit ChunkCrcs(uint64_t chunk_bytes);  // UsageError when 0
  void update(const void* data, size_t n);
  // One crc32c per chunk of the bytes given so far (none for no bytes); starts over.
  std::vector<uint32_t> take();

 private:
  uint64_t chunk_bytes_;
  uint64_t in_chunk_ = 0;  // bytes of the current chunk seen so far
  uint32_t crc_ = 0;       // of those bytes
  std::vector<uint32_t> done_;
};

}  // namespace statepager
