// Device helpers of the q8 format (codecs.q8_encode / q8_decode with the default schemes)
// shared by the codec and optimizer kernels: a warp holds one block of 256 elements, 8
// consecutive ones per lane; q8_store and q8_load move a block between registers and the
// stored codes and scale. Bits as the CPU reference: IEEE round-to-nearest
// intrinsics only, so no build flag (fast math, FMA contraction) changes a result.
#pragma once

#include <cstdint>

namespace statepager::kernels {

constexpr unsigned kFullMask = 0xffffffffu;

// The block's scale: its absmax, or the one NaN 0x7fc00000 when it holds a NaN. Every
// lane of the warp must call it (v: the lane's 8 elements; 0 where past the tensor).
__device__ __forceinline__ float q8_warp_scale(const float (&v)[8]) {
  float m = 0.f;
  bool nan = false;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float a = fabsf(v[j]);
    nan |= a != a;
    m = fmaxf(m, a);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, o));
  return __any_sync(kFullMask, nan) ? __int_as_float(0x7fc00000) : m;
}

// Code of x in a block of scale s: signed linear int8 round(x/s*127), or ("nonneg") sqrt
// uint8 round(sqrt(x/s)*255) with positive values never coded 0. 0 across a block whose
// scale is not finite, and for NaN codes (sqrt of a negative value).
template <bool kNonneg>
__device__ __forceinline__ uint8_t q8_code(float x, float s) {
  int c = 0;
  if (isfinite(s)) {
    const float u0 = __fdiv_rn(x, s > 0.f ? s : 1.f);
    const float u = kNonneg ? __fsqrt_rn(u0) : u0;
    const float t = __fmul_rn(u, kNonneg ? 255.f : 127.f);
    c = t != t ? 0 : __float2int_rn(t);  // round half to even, as torch.round
  }
  if (kNonneg && c == 0 && x > 0.f) c = 1;  // a positive v never decodes to 0
  return static_cast<uint8_t>(kNonneg ? c : static_cast<int8_t>(c));
}

template <bool kNonneg>
__device__ __forceinline__ void q8_codes(const float (&v)[8], float s, uint8_t (&q)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) q[j] = q8_code<kNonneg>(v[j], s);
}

template <bool kNonneg>
__device__ __forceinline__ float q8_value(uint8_t c, float s) {
  const float code = kNonneg ? static_cast<float>(c) : static_cast<float>(static_cast<int8_t>(c));
  const float u0 = __fdiv_rn(code, kNonneg ? 255.f : 127.f);
  const float u = kNonneg ? __fmul_rn(u0, u0) : u0;
  return __fmul_rn(u, s);
}

__device__ __forceinline__ uint2 pack8(const uint8_t (&q)[8]) {
  uint2 w;
  w.x = q[0] | q[1] << 8 | q[2] << 16 | static_cast<uint32_t>(q[3]) << 24;
  w.y = q[4] | q[5] << 8 | q[6] << 16 | static_cast<uint32_t>(q[7]) << 24;
  return w;
}

__device__ __forceinline__ void unpack8(uint2 w, uint8_t (&q)[8]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    q[j] = w.x >> (8 * j) & 0xff;
    q[4 + j] = w.y >> (8 * j) & 0xff;
  }
}

// A warp's block `blk` of a q8 tensor of n elements (codes, scales), the lane's 8
// elements starting at `base` (full: the whole block is inside the tensor; kVec: codes is
// 8-byte aligned): writes the block's scale (lane 0) and the lane's codes of v (0 past n).
// Every lane of the warp must call it.
template <bool kNonneg, bool kVec>
__device__ __forceinline__ void q8_store(uint8_t* codes, float* scales, int64_t blk, int lane,
                                         int64_t base, int64_t n, bool full,
                                         const float (&v)[8]) {
  const float s = q8_warp_scale(v);
  if (lane == 0) scales[blk] = s;
  uint8_t q[8];
  q8_codes<kNonneg>(v, s, q);
  if (kVec && full) {
    *reinterpret_cast<uint2*>(codes + base) = pack8(q);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (base + j < n) codes[base + j] = q[j];
  }
}

// The lane's 8 values of block `blk` (q8_store's layout), 0 past n.
template <bool kNonneg, bool kVec>
__device__ __forceinline__ void q8_load(const uint8_t* codes, const float* scales, int64_t blk,
                                        int64_t base, int64_t n, bool full, float (&v)[8]) {
  const float s = scales[blk];
  uint8_t q[8];
  if (kVec && full) {
    unpack8(*reinterpret_cast<const uint2*>(codes + base), q);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = base + j < n ? codes[base + j] : 0;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = base + j < n ? q8_value<kNonneg>(q[j], s) : 0.f;
}

}  // namespace statepager::kernels
