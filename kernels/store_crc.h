// crc32c of device memory, on a stream: the store checksums of bytes that pass through no
// host buffer of statepager's (see Note [Store checksums] in allocator/pager_crc.cc).
//
// crc32c_ranges() queues on `stream` the crc32c (Castagnoli, as backing/crc32c.h's
// crc32c(0, bytes, n)) of each of `n` ranges of device memory [addrs[i], addrs[i] +
// lengths[i]) into out[i], host memory (pinned, for the copy to it to be queued rather
// than waited for); out[i] holds it once the stream has run past this call. One kernel per
// 512 ranges: a block sums 128 KiB tiles, 512 bytes a thread (slicing by 4, through
// tables in shared memory copied 8 times over the banks), joined in the block
// (crc(a b) = crc(a) x^(8|b|) + crc(b)); each tile's crc, moved past the bytes of its range
// after it, is xor-ed into its range's, and the ranges' crcs are copied to `out`. Their
// scratch (4 bytes a range) is stream-ordered memory (cudaMallocAsync), freed on the
// stream after them.
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
