// The codec kernels of codecs.h. Arithmetic is spelled with the IEEE round-to-nearest
// intrinsics (__fdiv_rn, __fsqrt_rn, __fmul_rn) so that no build flag (fast math, FMA
// contraction) can move a result off the CPU reference's.
#include "kernels/codecs.h"

#include <cuda_runtime.h>

#include "kernels/batch.cuh"
#include "kernels/launch.cuh"
#include "kernels/q8.cuh"

#include <string>

namespace statepager::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kPrime = 2147483647;  // codecs.param_checksum's modulus, 2**31 - 1

bool aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

__host__ __device__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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
// residuals. The entries of a batch: a master, and whether its pointers allow vector loads.

constexpr int64_t kResidualPerCta = 4 * kThreads;

struct EncodeEntry {
  ResidualEncode m;
  bool vec;
};

struct RebuildEntry {
  ResidualRebuild m;
  bool vec;
};

struct ScatterEntry {
  float* main;
  const int64_t* idx;
  const int32_t* bits;
  int64_t n_exc;
};

__device__ __forceinline__ bool residual_exception(uint32_t bits, uint32_t p, int32_t* r) {
  *r = static_cast<int32_t>(bits - (p << 16));  // wraps like torch's int32 subtraction
  const bool finite = (bits & 0x7f800000u) != 0x7f800000u;
  return *r > 32767 || *r < -32768 || !finite || bf16_rne(bits) != p;
}

template <bool kVec>
__device__ __forceinline__ void residual_encode_cta(const ResidualEncode& m, uint32_t cta) {
  const int lane = threadIdx.x & 31;
  const int64_t n = m.n;
  const int64_t base = (static_cast<int64_t>(cta) * blockDim.x + threadIdx.x) * 4;
  uint32_t bits[4] = {0, 0, 0, 0}, p[4] = {0, 0, 0, 0};
  const bool full = base + 4 <= n;
  if (kVec && full) {
    const uint4 m4 = *reinterpret_cast<const uint4*>(m.main + base);
    const uint2 p2 = *reinterpret_cast<const uint2*>(m.param + base);
    bits[0] = m4.x; bits[1] = m4.y; bits[2] = m4.z; bits[3] = m4.w;
    p[0] = p2.x & 0xffff; p[1] = p2.x >> 16; p[2] = p2.y & 0xffff; p[3] = p2.y >> 16;
  } else {
    for (int j = 0; j < 4; ++j) {
      if (base + j < n) {
        bits[j] = __float_as_uint(m.main[base + j]);
        p[j] = m.param[base + j];
      }
    }
  }
  auto* count = reinterpret_cast<unsigned long long*>(m.count);
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
        if (slot < static_cast<unsigned long long>(m.capacity)) {
          m.exc_idx[slot] = base + j;
          m.exc_bits[slot] = static_cast<int32_t>(bits[j]);
        }
      }
    }
  }
  if (kVec && full) {
    uint2 w;
    w.x = out[0] | static_cast<uint32_t>(out[1]) << 16;
    w.y = out[2] | static_cast<uint32_t>(out[3]) << 16;
    *reinterpret_cast<uint2*>(m.residual + base) = w;
  } else {
    for (int j = 0; j < 4; ++j)
      if (base + j < n) m.residual[base + j] = static_cast<int16_t>(out[j]);
  }
}

__global__ void residual_encode_kernel(const __grid_constant__ Batch<EncodeEntry> b) {
  uint32_t cta;
  const EncodeEntry& e = entry_of(b, blockIdx.x, &cta);
  e.vec ? residual_encode_cta<true>(e.m, cta) : residual_encode_cta<false>(e.m, cta);
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
__device__ __forceinline__ void residual_rebuild_cta(const ResidualRebuild& m, uint32_t cta,
                                                     uint8_t* bad) {
  const int64_t n = m.n;
  const int64_t base = (static_cast<int64_t>(cta) * blockDim.x + threadIdx.x) * 4;
  if (base >= n) return;
  bool b = false;
  if (kVec && base + 4 <= n) {
    const uint2 p2 = *reinterpret_cast<const uint2*>(m.param + base);
    const uint2 r2 = *reinterpret_cast<const uint2*>(m.residual + base);
    uint4 out;
    out.x = rebuilt(p2.x & 0xffff, r2.x & 0xffff, &b);
    out.y = rebuilt(p2.x >> 16, r2.x >> 16, &b);
    out.z = rebuilt(p2.y & 0xffff, r2.y & 0xffff, &b);
    out.w = rebuilt(p2.y >> 16, r2.y >> 16, &b);
    *reinterpret_cast<uint4*>(m.main + base) = out;
  } else {
    for (int j = 0; j < 4 && base + j < n; ++j) {
      m.main[base + j] = __uint_as_float(rebuilt(m.param[base + j],
                                                 static_cast<uint16_t>(m.residual[base + j]), &b));
    }
  }
  // An exception's residual is 0: it rebuilds to its param's value, never bad.
  if (b) *bad = 1;  // every writer writes 1: no atomic needed
}

__global__ void residual_rebuild_kernel(const __grid_constant__ Batch<RebuildEntry> b,
                                        uint8_t* bad) {
  uint32_t cta;
  const RebuildEntry& e = entry_of(b, blockIdx.x, &cta);
  e.vec ? residual_rebuild_cta<true>(e.m, cta, bad) : residual_rebuild_cta<false>(e.m, cta, bad);
}

__global__ void scatter_exceptions_kernel(const __grid_constant__ Batch<ScatterEntry> b) {
  uint32_t cta;
  const ScatterEntry& e = entry_of(b, blockIdx.x, &cta);
  const int64_t k = static_cast<int64_t>(cta) * blockDim.x + threadIdx.x;
  if (k < e.n_exc) e.main[e.idx[k]] = __int_as_float(e.bits[k]);
}

// ------------------------------------------------------------------------ checksum
// One CTA per row of 4096 elements, 16 per thread; then one CTA per param for the total.

struct RowsEntry {
  const uint16_t* param;
  int64_t n;
  int64_t* rows;
  bool vec;
};

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

__global__ void checksum_rows_kernel(const __grid_constant__ Batch<RowsEntry> b) {
  uint32_t cta;
  const RowsEntry& e = entry_of(b, blockIdx.x, &cta);
  const int64_t row = cta;
  const int64_t start = row * kChecksumRow;
  const int col0 = threadIdx.x * 16;
  uint32_t p[16];
  if (e.vec && start + kChecksumRow <= e.n) {
    const uint4 a = reinterpret_cast<const uint4*>(e.param + start + col0)[0];
    const uint4 c = reinterpret_cast<const uint4*>(e.param + start + col0)[1];
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      p[2 * j] = (w[j] & 0xffff) + 1;
      p[2 * j + 1] = (w[j] >> 16) + 1;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) p[j] = start + col0 + j < e.n ? e.param[start + col0 + j] + 1u : 0u;
  }
  long long sum = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) sum += static_cast<long long>(p[j] * static_cast<uint32_t>(col0 + j + 1));
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    const long long weight = row * 0x9E3779B1LL % (kPrime - 1) + 1;
    e.rows[row] = sum % kPrime * weight % kPrime;
  }
}

__global__ void checksum_total_kernel(const __grid_constant__ Batch<Checksum> b, uint8_t* bad) {
  uint32_t cta;
  const Checksum& e = entry_of(b, blockIdx.x, &cta);
  const int64_t n_rows = ceil_div(e.n, kChecksumRow);
  long long sum = 0;
  for (int64_t i = threadIdx.x; i < n_rows; i += blockDim.x) sum += e.rows[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    *e.out = sum % kPrime;
    if (e.expected != nullptr && sum % kPrime != *e.expected) *bad = 1;
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

void residual_encode(const std::vector<ResidualEncode>& masters, int device, void* stream) {
  cudaStream_t s = prepare(device, stream, "residual_encode");
  std::vector<EncodeEntry> entries;
  entries.reserve(masters.size());
  for (const ResidualEncode& m : masters) {
    entries.push_back({m, aligned(m.main, 16) && aligned(m.param, 8) && aligned(m.residual, 8)});
  }
  launch_batches(entries, [](const EncodeEntry& e) { return ceil_div(e.m.n, kResidualPerCta); },
                 [&](const Batch<EncodeEntry>& b, uint32_t grid) {
                   residual_encode_kernel<<<grid, kThreads, 0, s>>>(b);
                 }, "residual_encode");
}

void residual_rebuild(const std::vector<ResidualRebuild>& masters, uint8_t* bad, int device,
                      void* stream) {
  cudaStream_t s = prepare(device, stream, "residual_rebuild");
  std::vector<RebuildEntry> entries;
  std::vector<ScatterEntry> exceptions;
  entries.reserve(masters.size());
  for (const ResidualRebuild& m : masters) {
    entries.push_back({m, aligned(m.main, 16) && aligned(m.param, 8) && aligned(m.residual, 8)});
    if (m.n > 0 && m.n_exc > 0) exceptions.push_back({m.main, m.exc_idx, m.exc_bits, m.n_exc});
  }
  launch_batches(entries, [](const RebuildEntry& e) { return ceil_div(e.m.n, kResidualPerCta); },
                 [&](const Batch<RebuildEntry>& b, uint32_t grid) {
                   residual_rebuild_kernel<<<grid, kThreads, 0, s>>>(b, bad);
                 }, "residual_rebuild");
  // After every rebuild (one stream): an exception overwrites its element's rebuilt bits.
  launch_batches(exceptions, [](const ScatterEntry& e) { return ceil_div(e.n_exc, kThreads); },
                 [&](const Batch<ScatterEntry>& b, uint32_t grid) {
                   scatter_exceptions_kernel<<<grid, kThreads, 0, s>>>(b);
                 }, "residual_rebuild (exceptions)");
}

void param_checksum(const std::vector<Checksum>& params, uint8_t* bad, int device, void* stream) {
  cudaStream_t s = prepare(device, stream, "param_checksum");
  static_assert(kChecksumRow == kThreads * 16, "one CTA per checksum row, 16 per thread");
  std::vector<RowsEntry> rows;
  rows.reserve(params.size());
  for (const Checksum& c : params) rows.push_back({c.param, c.n, c.rows, aligned(c.param, 16)});
  launch_batches(rows, [](const RowsEntry& e) { return ceil_div(e.n, kChecksumRow); },
                 [&](const Batch<RowsEntry>& b, uint32_t grid) {
                   checksum_rows_kernel<<<grid, kThreads, 0, s>>>(b);
                 }, "param_checksum");
  launch_batches(params, [](const Checksum&) { return int64_t{1}; },  // 0 when n == 0
                 [&](const Batch<Checksum>& b, uint32_t grid) {
                   checksum_total_kernel<<<grid, 1024, 0, s>>>(b, bad);
                 }, "param_checksum (total)");
}

}  // namespace statepager::kernels
