// The fused AdamW step of adamw.h. One warp per block of 256 elements (a q8 block), 8
// consecutive elements per lane, all in registers: each stored byte is read once and
// written once. A launch steps a batch of parameters (batch.cuh).
#include "kernels/adamw.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "kernels/batch.cuh"
#include "kernels/codecs.h"
#include "kernels/launch.cuh"
#include "kernels/q8.cuh"

namespace statepager::kernels {
namespace {

constexpr int kThreads = 256;

// torch's at::native::lerp as nvcc compiles it (FMA contraction on, as in torch's build).
__device__ __forceinline__ float lerp(float self, float end, float weight) {
  const float diff = __fsub_rn(end, self);
  return fabsf(weight) < 0.5f ? __fmaf_rn(weight, diff, self)
                              : __fmaf_rn(-diff, __fsub_rn(1.f, weight), end);
}

template <bool kVec>
__device__ __forceinline__ void load8(const float* p, int64_t base, int64_t n, bool full,
                                      float (&v)[8]) {
  if (kVec && full) {
    const float4 a = reinterpret_cast<const float4*>(p + base)[0];
    const float4 b = reinterpret_cast<const float4*>(p + base)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = base + j < n ? p[base + j] : 0.f;
  }
}

template <bool kVec>
__device__ __forceinline__ void store8(float* p, int64_t base, int64_t n, bool full,
                                       const float (&v)[8]) {
  if (kVec && full) {
    reinterpret_cast<float4*>(p + base)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p + base)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (base + j < n) p[base + j] = v[j];
  }
}

template <MomentFormat F, bool kNonneg, bool kVec>
__device__ __forceinline__ void load_moment(Moment m, int64_t blk, int64_t base, int64_t n,
                                            bool full, float (&v)[8]) {
  if constexpr (F == MomentFormat::kFp32) {
    load8<kVec>(static_cast<const float*>(m.data), base, n, full, v);
  } else if constexpr (F == MomentFormat::kBf16) {
    const auto* h = static_cast<const uint16_t*>(m.data);
    if (kVec && full) {
      const uint4 w = *reinterpret_cast<const uint4*>(h + base);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[2 * j] = __uint_as_float(words[j] << 16);
        v[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = base + j < n ? __uint_as_float(uint32_t{h[base + j]} << 16) : 0.f;
    }
  } else {
    q8_load<kNonneg, kVec>(static_cast<const uint8_t*>(m.data), m.scales, blk, base, n, full, v);
  }
}

// Every lane of the warp must call it (q8: the block's scale is a warp reduction).
template <MomentFormat F, bool kNonneg, bool kVec>
__device__ __forceinline__ void store_moment(Moment m, int64_t blk, int lane, int64_t base,
                                             int64_t n, bool full, const float (&v)[8]) {
  if constexpr (F == MomentFormat::kFp32) {
    store8<kVec>(static_cast<float*>(m.data), base, n, full, v);
  } else if constexpr (F == MomentFormat::kBf16) {
    auto* h = static_cast<uint16_t*>(m.data);
    uint16_t b[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = __bfloat16_as_ushort(__float2bfloat16(v[j]));  // torch's cast
    if (kVec && full) {
      uint4 w;
      w.x = b[0] | uint32_t{b[1]} << 16;
      w.y = b[2] | uint32_t{b[3]} << 16;
      w.z = b[4] | uint32_t{b[5]} << 16;
      w.w = b[6] | uint32_t{b[7]} << 16;
      *reinterpret_cast<uint4*>(h + base) = w;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (base + j < n) h[base + j] = b[j];
    }
  } else {
    q8_store<kNonneg, kVec>(static_cast<uint8_t*>(m.data), m.scales, blk, lane, base, n, full, v);
  }
}

struct Entry {
  AdamWParam p;
  bool vec;
};

template <MomentFormat F, bool kVec>
__device__ __forceinline__ void adamw_cta(const AdamWParam& a, uint32_t cta) {
  const int lane = threadIdx.x & 31;
  const int64_t n = a.n;
  const int64_t blk = (static_cast<int64_t>(cta) * blockDim.x + threadIdx.x) >> 5;
  if (blk * kQ8Block >= n) return;  // uniform across the warp
  const int64_t base = blk * kQ8Block + lane * 8;
  const bool full = blk * kQ8Block + kQ8Block <= n;
  const AdamWScalars& s = a.scalars;
  float p[8], g[8], m[8], v[8];
  load8<kVec>(a.param, base, n, full, p);
  load8<kVec>(a.grad, base, n, full, g);
  load_moment<F, false, kVec>(a.exp_avg, blk, base, n, full, m);
  load_moment<F, true, kVec>(a.exp_avg_sq, blk, base, n, full, v);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    // _multi_tensor_adam, one foreach op per line (each rounds to fp32).
    if (s.has_decay) p[j] = __fmul_rn(p[j], s.decay);                   // _foreach_mul_
    m[j] = lerp(m[j], g[j], s.lerp_weight);                             // _foreach_lerp_
    v[j] = __fmul_rn(v[j], s.beta2);                                    // _foreach_mul_
    v[j] = s.one_minus_beta2 == 1.f ? __fmaf_rn(g[j], g[j], v[j])       // _foreach_addcmul_
                                    : __fmaf_rn(s.one_minus_beta2, __fmul_rn(g[j], g[j]), v[j]);
    float d = __fsqrt_rn(v[j]);                                         // _foreach_sqrt
    d = __fdiv_rn(d, s.bias_correction2_sqrt);                          // _foreach_div_
    d = __fadd_rn(d, s.eps);                                            // _foreach_add_
    const float q = __fdiv_rn(m[j], d);                                 // _foreach_addcdiv_
    p[j] = s.step_size == 1.f ? __fadd_rn(p[j], q) : __fmaf_rn(s.step_size, q, p[j]);
  }
  store8<kVec>(a.param, base, n, full, p);
  store_moment<F, false, kVec>(a.exp_avg, blk, lane, base, n, full, m);
  store_moment<F, true, kVec>(a.exp_avg_sq, blk, lane, base, n, full, v);
}

template <MomentFormat F>
__global__ void adamw_kernel(const __grid_constant__ Batch<Entry> b) {
  uint32_t cta;
  const Entry& e = entry_of(b, blockIdx.x, &cta);
  e.vec ? adamw_cta<F, true>(e.p, cta) : adamw_cta<F, false>(e.p, cta);
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

constexpr int64_t kPerCta = kQ8Block * (kThreads / 32);  // a warp per q8 block

template <MomentFormat F>
void launch(const std::vector<Entry>& entries, cudaStream_t stream) {
  launch_batches(entries, [](const Entry& e) { return (e.p.n + kPerCta - 1) / kPerCta; },
                 [&](const Batch<Entry>& b, uint32_t grid) {
                   adamw_kernel<F><<<grid, kThreads, 0, stream>>>(b);
                 }, "adamw_step");
}

}  // namespace

void adamw_step(const std::vector<AdamWParam>& params, int device, void* stream) {
  cudaStream_t s = prepare(device, stream, "adamw_step");
  std::vector<Entry> by_format[3];
  for (const AdamWParam& p : params) {
    const bool vec = aligned(p.param) && aligned(p.grad) && aligned(p.exp_avg.data) &&
                     aligned(p.exp_avg_sq.data);
    by_format[static_cast<int>(p.format)].push_back({p, vec});
  }
  launch<MomentFormat::kFp32>(by_format[static_cast<int>(MomentFormat::kFp32)], s);
  launch<MomentFormat::kBf16>(by_format[static_cast<int>(MomentFormat::kBf16)], s);
  launch<MomentFormat::kQ8>(by_format[static_cast<int>(MomentFormat::kQ8)], s);
}

}  // namespace statepager::kernels
