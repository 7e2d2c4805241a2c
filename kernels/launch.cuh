// Launch helpers shared by the kernels' host functions (codecs.cu, adamw.cu, copies.cu).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kernels/codecs.h"  // KernelError

namespace statepager::kernels {

// KernelError naming `what` and the CUDA error, unless err is cudaSuccess.
inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw KernelError(std::string("statepager kernel ") + what + " failed: " +
                      cudaGetErrorString(err));
  }
}

// Selects the device for this runtime (statically linked: its current device is not
// torch's), returns the stream.
inline cudaStream_t prepare(int device, void* stream, const char* what) {
  check(cudaSetDevice(device), what);
  return static_cast<cudaStream_t>(stream);
}

}  // namespace statepager::kernels
