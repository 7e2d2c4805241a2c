// Raw device bandwidth through the same io_uring engine the store uses, without any
// pager work in between: the denominator of every benchmark ratio.
//
// Errors: IoError subclasses, as UringFile. Thread-safety: none needed (self-contained).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace statepager {

struct RawIoResult {
  double read_gbps = 0;   // 1e9 bytes per second
  double write_gbps = 0;
  double seconds = 0;     // wall time of the timed part
};

// Reads `bytes` sequentially from <dir>/raw-read.bin and/or writes `bytes` sequentially to
// <dir>/raw-write.bin, both at once when both are asked for, in requests of `block` bytes
// with `depth` requests in flight per direction, O_DIRECT where the filesystem allows
// it. Both files are written once first, untimed (the store overwrites existing blocks
// from its second step on). Both are created new (an existing file of that name is an
// IoError, EEXIST, and left alone) and deleted afterwards.
RawIoResult measure_raw_io(const std::string& dir, uint64_t bytes, size_t block, unsigned depth,
                           bool read, bool write);

}  // namespace statepager
