// The codec kernels of codecs.h. Arithmetic is spelled with the IEEE round-to-nearest
// intrinsics (__fdiv_rn, __fsqrt_rn, __fmul_rn) so that no build flag (fast math, FMA
// contraction) can move a result off the CPU reference's.
#include "kernels/codecs.h"

#include <cuda_runtime.h>

#include "kernels/launch.cuh"
#include "kernels/q8.cuh"

#include <string>

namespace statepager::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kPrime = 2147483647;  // codecs.param_checksum's modulus, 2**31 - 1

bool aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The bf16 bits torch's float->bfloat16 cast gives a non-NaN float: round to nearest even.
__device__ __forceinline__ uint32_t bf16_rne(uint32_t bits) {
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

// ------------------------------------------------------------------------------ q8
// One warp per block of 256 elements, 8 consecutive elements per lane: a lane reads two
// float4 and writes one 8-byte word of codes.

template <bool kNonneg, bool kVec>
__global__ void q8_encode_kernel(const float* __restrict__ x, uint8_t* __restrict__ codes,
                                 float* __restrict__ scales, int64_t n) {
  const int lane = threadIdx.x & 31;
  const int64_t blk = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (blk * kQ8Block >= n) return;  // uniform across the warp
  const int64_t base = blk * kQ8Block + lane * 8;
  const bool full = blk * kQ8Block + kQ8Block <= n;
  float v[8];
  if (kVec && full) {
    const float4 a = reinterpret_cast<const float4*>(x + base)[0];
    const float4 b = reinterpret_cast<const float4*>(x + base)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = base + j < n ? x[base + j] : 0.f;  // 0: no effect on absmax
  }
  q8_store<kNonneg, kVec>(codes, scales, blk, lane, base, n, full, v);
}

template <bool kNonneg, bool kVec>
__global__ void q8_decode_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                                 float* __restrict__ x, int64_t n) {
  const int lane = threadIdx.x & 31;
  const int64_t blk = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (blk * kQ8Block >= n) return;
  const int64_t base = blk * kQ8Block + lane * 8;
  const bool full = blk * kQ8Block + kQ8Block <= n;
  float v[8];
  q8_load<kNonneg, kVec>(codes, scales, blk, base, n, full, v);
  if (kVec && full) {
    reinterpret_cast<float4*>(x + base)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(x + base)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (base + j < n) x[base + j] = v[j];
  }
}

// ------------------------------------------------------------------------ residual
// Four consecutive elements per thread: one float4 of mains, 8 bytes of params and of
// residuals.

__device__ __forceinline__ bool residual_exception(uint32_t bits, uint32_t p, int32_t* r) {
  *r = static_cast<int32_t>(bits - (p << 16));  // wraps like torch's int32 subtraction
  const bool finite = (bits & 0x7f800000u) != 0x7f800000u;
  return *r > 32767 || *r < -32768 || !finite || bf16_rne(bits) != p;
}

template <bool kVec>
__global__ void residual_encode_kernel(const float* __restrict__ main, const uint16_t* __restrict__ param,
                                       int16_t* __restrict__ residual, int64_t n,
                                       int64_t* __restrict__ exc_idx, int32_t* __restrict__ exc_bits,
                                       int64_t capacity, unsigned long long* count) {
  const int lane = threadIdx.x & 31;
  const int64_t base = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  uint32_t bits[4] = {0, 0, 0, 0}, p[4] = {0, 0, 0, 0};
  const bool full = base + 4 <= n;
  if (kVec && full) {
    const uint4 m4 = *reinterpret_cast<const uint4*>(main + base);
    const uint2 p2 = *reinterpret_cast<const uint2*>(param + base);
    bits[0] = m4.x; bits[1] = m4.y; bits[2] = m4.z; bits[3] = m4.w;
    p[0] = p2.x & 0xffff; p[1] = p2.x >> 16; p[2] = p2.y & 0xffff; p[3] = p2.y >> 16;
  } else {
    for (int j = 0; j < 4; ++j) {
      if (base + j < n) {
        bits[j] = __float_as_uint(main[base + j]);
        p[j] = param[base + j];
      }
    }
  }
  uint16_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    int32_t r = 0;
    const bool exc = base + j < n && residual_exception(bits[j], p[j], &r);
    out[j] = exc ? 0 : static_cast<uint16_t>(r);
    // Exceptions are rare (ties, non-finite values): one atomic per warp that has any.
    const unsigned ballot = __ballot_sync(kFullMask, exc);
    if (ballot != 0) {
      const int leader = __ffs(ballot) - 1;
      unsigned long long first = 0;
      if (lane == leader) first = atomicAdd(count, static_cast<unsigned long long>(__popc(ballot)));
      first = __shfl_sync(kFullMask, first, leader);
      if (exc) {
        const unsigned long long slot = first + __popc(ballot & ((1u << lane) - 1));
        if (slot < static_cast<unsigned long long>(capacity)) {
          exc_idx[slot] = base + j;
          exc_bits[slot] = static_cast<int32_t>(bits[j]);
        }
      }
    }
  }
  if (kVec && full) {
    uint2 w;
    w.x = out[0] | static_cast<uint32_t>(out[1]) << 16;
    w.y = out[2] | static_cast<uint32_t>(out[3]) << 16;
    *reinterpret_cast<uint2*>(residual + base) = w;
  } else {
    for (int j = 0; j < 4; ++j)
      if (base + j < n) residual[base + j] = static_cast<int16_t>(out[j]);
  }
}

// A rebuilt master, and whether it is inconsistent with its param: it does not round to
// it, or (codecs._inconsistent) it is NaN with a nonzero residual.
__device__ __forceinline__ uint32_t rebuilt(uint32_t p, uint32_t r16, bool* bad) {
  const uint32_t bits = (p << 16) + static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(r16)));
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  *bad |= nan ? (r16 & 0xffffu) != 0 : bf16_rne(bits) != p;
  return bits;
}

template <bool kVec>
__global__ void residual_rebuild_kernel(const uint16_t* __restrict__ param, const int16_t* __restrict__ residual,
                                        float* __restrict__ main, int64_t n, uint8_t* bad) {
  const int64_t base = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (base >= n) return;
  bool b = false;
  if (kVec && base + 4 <= n) {
    const uint2 p2 = *reinterpret_cast<const uint2*>(param + base);
    const uint2 r2 = *reinterpret_cast<const uint2*>(residual + base);
    uint4 m;
    m.x = rebuilt(p2.x & 0xffff, r2.x & 0xffff, &b);
    m.y = rebuilt(p2.x >> 16, r2.x >> 16, &b);
    m.z = rebuilt(p2.y & 0xffff, r2.y & 0xffff, &b);
    m.w = rebuilt(p2.y >> 16, r2.y >> 16, &b);
    *reinterpret_cast<uint4*>(main + base) = m;
  } else {
    for (int j = 0; j < 4 && base + j < n; ++j) {
      main[base + j] = __uint_as_float(rebuilt(param[base + j],
                                               static_cast<uint16_t>(residual[base + j]), &b));
    }
  }
  // An exception's residual is 0: it rebuilds to its param's value, never bad.
  if (b) *bad = 1;  // every writer writes 1: no atomic needed
}

__global__ void scatter_exceptions_kernel(float* __restrict__ main, const int64_t* __restrict__ idx,
                                          const int32_t* __restrict__ bits, int64_t n_exc) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < n_exc) main[idx[k]] = __int_as_float(bits[k]);
}

// ------------------------------------------------------------------------ checksum
// One CTA per row of 4096 elements, 16 per thread.

__device__ __forceinline__ long long warp_sum(long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ long long block_sum(long long v) {
  __shared__ long long warps[32];
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = v;
  __syncthreads();
  const int n_warps = blockDim.x >> 5;
  v = threadIdx.x < n_warps ? warps[threadIdx.x] : 0;
  return threadIdx.x < 32 ? warp_sum(v) : 0;
}

template <bool kVec>
__global__ void checksum_rows_kernel(const uint16_t* __restrict__ param, int64_t n,
                                     int64_t* __restrict__ rows) {
  const int64_t row = blockIdx.x;
  const int64_t start = row * kChecksumRow;
  const int col0 = threadIdx.x * 16;
  uint32_t p[16];
  if (kVec && start + kChecksumRow <= n) {
    const uint4 a = reinterpret_cast<const uint4*>(param + start + col0)[0];
    const uint4 b = reinterpret_cast<const uint4*>(param + start + col0)[1];
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      p[2 * j] = (w[j] & 0xffff) + 1;
      p[2 * j + 1] = (w[j] >> 16) + 1;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) p[j] = start + col0 + j < n ? param[start + col0 + j] + 1u : 0u;
  }
  long long sum = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) sum += static_cast<long long>(p[j] * static_cast<uint32_t>(col0 + j + 1));
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    const long long weight = row * 0x9E3779B1LL % (kPrime - 1) + 1;
    rows[row] = sum % kPrime * weight % kPrime;
  }
}

__global__ void checksum_total_kernel(const int64_t* __restrict__ rows, int64_t n_rows,
                                      int64_t* __restrict__ out, const int64_t* expected,
                                      uint8_t* bad) {
  long long sum = 0;
  for (int64_t i = threadIdx.x; i < n_rows; i += blockDim.x) sum += rows[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    *out = sum % kPrime;
    if (expected != nullptr && sum % kPrime != *expected) *bad = 1;
  }
}

}  // namespace

void q8_encode(const float* x, uint8_t* codes, float* scales, int64_t n, bool nonneg,
               int device, void* stream) {
  if (n == 0) return;
  cudaStream_t s = prepare(device, stream, "q8_encode");
  const int64_t grid = ceil_div(ceil_div(n, kQ8Block), kThreads / 32);
  const bool vec = aligned(x, 16) && aligned(codes, 16);
  if (nonneg) {
    vec ? q8_encode_kernel<true, true><<<grid, kThreads, 0, s>>>(x, codes, scales, n)
        : q8_encode_kernel<true, false><<<grid, kThreads, 0, s>>>(x, codes, scales, n);
  } else {
    vec ? q8_encode_kernel<false, true><<<grid, kThreads, 0, s>>>(x, codes, scales, n)
        : q8_encode_kernel<false, false><<<grid, kThreads, 0, s>>>(x, codes, scales, n);
  }
  check(cudaGetLastError(), "q8_encode");
}

void q8_decode(const uint8_t* codes, const float* scales, float* x, int64_t n, bool nonneg,
               int device, void* stream) {
  if (n == 0) return;
  cudaStream_t s = prepare(device, stream, "q8_decode");
  const int64_t grid = ceil_div(ceil_div(n, kQ8Block), kThreads / 32);
  const bool vec = aligned(x, 16) && aligned(codes, 16);
  if (nonneg) {
    vec ? q8_decode_kernel<true, true><<<grid, kThreads, 0, s>>>(codes, scales, x, n)
        : q8_decode_kernel<true, false><<<grid, kThreads, 0, s>>>(codes, scales, x, n);
  } else {
    vec ? q8_decode_kernel<false, true><<<grid, kThreads, 0, s>>>(codes, scales, x, n)
        : q8_decode_kernel<false, false><<<grid, kThreads, 0, s>>>(codes, scales, x, n);
  }
  check(cudaGetLastError(), "q8_decode");
}

void residual_encode(const float* main, const uint16_t* param, int16_t* residual, int64_t n,
                     int64_t* exc_idx, int32_t* exc_bits, int64_t capacity, int64_t* count,
                     int device, void* stream) {
  if (n == 0) return;
  cudaStream_t s = prepare(device, stream, "residual_encode");
  const int64_t grid = ceil_div(ceil_div(n, 4), kThreads);
  auto* counter = reinterpret_cast<unsigned long long*>(count);
  if (aligned(main, 16) && aligned(param, 8) && aligned(residual, 8)) {
    residual_encode_kernel<true><<<grid, kThreads, 0, s>>>(main, param, residual, n, exc_idx,
                                                           exc_bits, capacity, counter);
  } else {
    residual_encode_kernel<false><<<grid, kThreads, 0, s>>>(main, param, residual, n, exc_idx,
                                                            exc_bits, capacity, counter);
  }
  check(cudaGetLastError(), "residual_encode");
}

void residual_rebuild(const uint16_t* param, const int16_t* residual, float* main, int64_t n,
                      const int64_t* exc_idx, const int32_t* exc_bits, int64_t n_exc,
                      uint8_t* bad, int device, void* stream) {
  if (n == 0) return;
  cudaStream_t s = prepare(device, stream, "residual_rebuild");
  const int64_t grid = ceil_div(ceil_div(n, 4), kThreads);
  if (aligned(main, 16) && aligned(param, 8) && aligned(residual, 8)) {
    residual_rebuild_kernel<true><<<grid, kThreads, 0, s>>>(param, residual, main, n, bad);
  } else {
    residual_rebuild_kernel<false><<<grid, kThreads, 0, s>>>(param, residual, main, n, bad);
  }
  check(cudaGetLastError(), "residual_rebuild");
  if (n_exc > 0) {
    scatter_exceptions_kernel<<<ceil_div(n_exc, kThreads), kThreads, 0, s>>>(main, exc_idx,
                                                                             exc_bits, n_exc);
    check(cudaGetLastError(), "residual_rebuild (exceptions)");
  }
}

void param_checksum(const uint16_t* param, int64_t n, int64_t* rows, int64_t* out,
                    int device, void* stream, const int64_t* expected, uint8_t* bad) {
  cudaStream_t s = prepare(device, stream, "param_checksum");
  const int64_t n_rows = ceil_div(n, kChecksumRow);
  static_assert(kChecksumRow == kThreads * 16, "one CTA per checksum row, 16 per thread");
  if (n_rows > 0) {
    if (aligned(param, 16)) {
      checksum_rows_kernel<true><<<n_rows, kThreads, 0, s>>>(param, n, rows);
    } else {
      checksum_rows_kernel<false><<<n_rows, kThreads, 0, s>>>(param, n, rows);
    }
    check(cudaGetLastError(), "param_checksum");
  }
  checksum_total_kernel<<<1, 1024, 0, s>>>(rows, n_rows, out, expected, bad);  // 0 when n == 0
  check(cudaGetLastError(), "param_checksum (total)");
}

}  // namespace statepager::kernels
