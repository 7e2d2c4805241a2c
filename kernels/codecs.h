// CUDA kernels for the stored formats of statepager/codecs.py: each decodes or encodes a
// whole tensor in one pass over its bytes (one read, one write, vectorized), bit for bit
// what the CPU reference in codecs.py computes. Pure functions on device memory: this
// layer knows nothing of the pager, torch or Python (python/kernel_bindings.cc checks the
// tensors and calls these).
//
// Contract for every function:
// - Pointers are device memory of `device`, contiguous, non-overlapping; n is the element
//   count (n == 0 launches nothing; param_checksum then writes 0). Vector loads are used
//   when the pointers are 16-byte aligned, scalar ones otherwise: any alignment of the
//   element type is accepted.
// - Work is enqueued on `stream` (a cudaStream_t, as torch's stream.cuda_stream); nothing
//   waits for it. Thread-safe: no state beyond the CUDA runtime's.
// - A launch the runtime refuses throws KernelError naming the kernel and the CUDA error.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace statepager::kernels {

struct KernelError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline constexpr int64_t kQ8Block = 256;          // codecs.Q8_BLOCK
inline constexpr int64_t kChecksumRow = 4096;     // codecs._CHECKSUM_ROW

// q8 with the default schemes: kind "signed" (exp_avg) is linear int8 (round(u*127)),
// "nonneg" (exp_avg_sq) is sqrt uint8 (round(sqrt(u)*255)), u = x / the block's absmax.
// scales has ceil(n / 256) elements.
void q8_encode(const float* x, uint8_t* codes, float* scales, int64_t n, bool nonneg,
               int device, void* stream);
void q8_decode(const uint8_t* codes, const float* scales, float* x, int64_t n, bool nonneg,
               int device, void* stream);

// The residual kernels and the checksum take many tensors (a bucket's) in one call, in
// as few launches as fit (kernels/batch.cuh); the tensors of one call run at once, so
// none may be another's output.

// One master of residual_encode: residual[i] = main_bits[i] - (param_bits[i] << 16), or 0
// where element i is an exception (residual out of int16, non-finite main, or RNE(main) !=
// param). The exceptions' (index, main bits) are appended at exc_idx/exc_bits[*count]
// (unordered; *count must be 0 on entry) while they fit `capacity`; *count ends as their
// total, which may exceed capacity (then the list is incomplete and the caller must
// recompute it).
struct ResidualEncode {
  const float* main;
  const uint16_t* param;
  int16_t* residual;
  int64_t n;
  int64_t* exc_idx;
  int32_t* exc_bits;
  int64_t capacity;
  int64_t* count;
};
void residual_encode(const std::vector<ResidualEncode>& masters, int device, void* stream);

// One master of residual_rebuild: main_bits[i] = (param_bits[i] << 16) + residual[i], then
// main_bits at exc_idx[k] = exc_bits[k] for k < n_exc. Sets *bad = 1 (never clears it)
// when an element outside the exceptions does not round to its param, or rebuilds to NaN
// with a nonzero residual.
struct ResidualRebuild {
  const uint16_t* param;
  const int16_t* residual;
  float* main;
  int64_t n;
  const int64_t* exc_idx;
  const int32_t* exc_bits;
  int64_t n_exc;
};
void residual_rebuild(const std::vector<ResidualRebuild>& masters, uint8_t* bad, int device,
                      void* stream);

// One param_checksum of bf16 bits: *out = the value codecs.param_checksum returns. `rows`
// is its own scratch of ceil(n / 4096) int64 (not shared: the checksums of a call run at
// once). Given `expected` (device memory; else nullptr), also sets *bad = 1 (never clears
// it) when the checksum differs from *expected: a parameter changed since its checksum
// was taken, told without the host reading either.
struct Checksum {
  const uint16_t* param;
  int64_t n;
  int64_t* rows;
  int64_t* out;
  const int64_t* expected;
};
void param_checksum(const std::vector<Checksum>& params, uint8_t* bad, int device,
                    void* stream);

}  // namespace statepager::kernels
