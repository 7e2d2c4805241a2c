// Byte ranges copied on the device, many in one launch (kernels/batch.cuh): a bucket's
// undo copies (python/tensor_lists.cc), where a copy per tensor cost the host a few
// tensor operations each. Same contract as codecs.h: device memory of `device`, work
// enqueued on `stream`, nothing waited for, KernelError where a launch is refused.
#pragma once

#include <cstdint>
#include <vector>

namespace statepager::kernels {

// `bytes` bytes from src to dst. The destinations of one call overlap neither each other
// nor any source (sources may overlap). Any alignment: 16-byte words where src, dst and
// bytes are multiples of 16, else 4-byte or single-byte ones for the whole range.
struct ByteCopy {
  const void* src;
  void* dst;
  int64_t bytes;
};
void copy_bytes(const std::vector<ByteCopy>& copies, int device, void* stream);

}  // namespace statepager::kernels
