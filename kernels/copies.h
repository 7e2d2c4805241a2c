// Byte ranges copied on the device, many in one launch (kernels/batch.cuh): a bucket's
// undo copies (python/tensor_lists.cc), where a copy per tensor cost the host a few
// tensor operations each. Same contract as codecs.h: device memory of `device`, work
// enqueued on `stream`, nothing waited for, KernelError where a launch is refused.
#pragma once

#include <cstdint>
#include <vector>

namespace statepager::kernels {

// `bytes` bytes from src to dst; the ranges of one call must not overlap. Any alignment
// (16-byte loads where src, dst and bytes allow them).
struct ByteCopy {
  const void* src;
  void* dst;
  int64_t bytes;
};
void copy_bytes(const std::vector<ByteCopy>& copies, int device, void* stream);

}  // namespace statepager::kernels
