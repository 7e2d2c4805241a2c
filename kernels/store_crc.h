// crc32c of device memory, on a stream: the store checksums of bytes that pass through no
// host buffer of statepager's (see Note [Store checksums] in allocator/pager_crc.cc).
//
// crc32c_ranges() queues on `stream` the crc32c (Castagnoli, as backing/crc32c.h's
// crc32c(0, bytes, n)) of each of `n` ranges of device memory [addrs[i], addrs[i] +
// lengths[i]) into out[i], host memory (pinned, for the copy to it to be queued rather
// than waited for); out[i] holds it once the stream has run past this call. Two kernels:
// each block sums a 64 KiB tile, 256 bytes a thread, joined in the block (crc(a b) =
// crc(a) x^(8|b|) + crc(b)); then one block per range joins its tiles, and the ranges'
// crcs are copied to `out`. Their scratch (4 bytes a tile and a range) is stream-ordered
// memory (cudaMallocAsync), freed on the stream after them.
//
// Thread-safety: reentrant. Errors: KernelError (kernels/codecs.h) where a launch or the
// scratch allocation fails; nothing is queued past the failing call.
#pragma once

#include <cstddef>
#include <cstdint>

namespace statepager::kernels {

void crc32c_ranges(int device, void* stream, const uint64_t* addrs, const uint64_t* lengths,
                   size_t n, uint32_t* out);

}  // namespace statepager::kernels
