// kernels/copies.h: each CTA copies one chunk of one range.
#include "kernels/copies.h"

#include <cuda_runtime.h>

#include "kernels/batch.cuh"
#include "kernels/launch.cuh"

namespace statepager::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 64 * 1024;  // bytes a CTA copies (16 words of 16 bytes a thread)

template <class Word>
__device__ __forceinline__ void copy_words(const char* src, char* dst, int64_t begin,
                                           int64_t end) {
  constexpr int64_t w = sizeof(Word);
  for (int64_t i = begin + threadIdx.x * w; i < end; i += kThreads * w) {
    *reinterpret_cast<Word*>(dst + i) = *reinterpret_cast<const Word*>(src + i);
  }
}

__global__ void copy_bytes_kernel(const __grid_constant__ Batch<ByteCopy> b) {
  uint32_t cta;
  const ByteCopy& c = entry_of(b, blockIdx.x, &cta);
  const int64_t begin = static_cast<int64_t>(cta) * kChunk;  // a multiple of every word
  const int64_t end = min(c.bytes, begin + kChunk);
  const auto* src = static_cast<const char*>(c.src);
  auto* dst = static_cast<char*>(c.dst);
  const uintptr_t bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                         static_cast<uintptr_t>(c.bytes);
  if (bits % 16 == 0) {
    copy_words<uint4>(src, dst, begin, end);
  } else if (bits % 4 == 0) {
    copy_words<uint32_t>(src, dst, begin, end);
  } else {
    copy_words<char>(src, dst, begin, end);
  }
}

}  // namespace

void copy_bytes(const std::vector<ByteCopy>& copies, int device, void* stream) {
  if (copies.empty()) return;
  cudaStream_t s = prepare(device, stream, "copy_bytes");
  launch_batches(copies, [](const ByteCopy& c) { return (c.bytes + kChunk - 1) / kChunk; },
                 [&](const Batch<ByteCopy>& b, uint32_t grid) {
                   copy_bytes_kernel<<<grid, kThreads, 0, s>>>(b);
                 }, "copy_bytes");
}

}  // namespace statepager::kernels
