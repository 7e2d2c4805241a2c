// One AdamW step of one parameter in one pass over its bytes: the moments are read in
// their stored format, stepped, and written back in it, with no fp32 copy of them. The
// arithmetic is torch.optim.AdamW's multi-tensor ("foreach") implementation's, operation
// for operation (torch 2.11: _multi_tensor_adam with decoupled weight decay, and the
// foreach CUDA functors: lerp, std::fma in addcmul/addcdiv), so the result is the bits
// torch computes from the same decoded moments. Same contract as codecs.h (device
// pointers, contiguous, `stream`, KernelError).
#pragma once

#include <cstdint>
#include <vector>

namespace statepager::kernels {

enum class MomentFormat { kFp32, kBf16, kQ8 };

// Where a moment lives: fp32 -> data (float), bf16 -> data (bf16 bits), q8 -> data (codes)
// plus scales (one fp32 per 256 elements).
struct Moment {
  void* data;
  float* scales;
};

// The step's scalars as torch passes them to its foreach ops (Python doubles rounded to
// fp32): decay = 1 - lr * weight_decay (has_decay: weight_decay != 0), lerp weight
// 1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2 ** step), eps, -lr / (1 - beta1 ** step).
struct AdamWScalars {
  bool has_decay;
  float decay, lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps, step_size;
};

// One parameter's step: param (fp32, updated in place), grad (fp32), exp_avg and
// exp_avg_sq in `format`, n elements.
struct AdamWParam {
  float* param;
  const float* grad;
  Moment exp_avg, exp_avg_sq;
  MomentFormat format;
  int64_t n;
  AdamWScalars scalars;
};

// The steps of many parameters (a bucket's), in as few launches as fit (batch.cuh): they
// run at once, so no two may share a tensor.
void adamw_step(const std::vector<AdamWParam>& params, int device, void* stream);

}  // namespace statepager::kernels
