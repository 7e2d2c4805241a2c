// Many tensors in one launch (codecs.cu, adamw.cu, copies.cu). A bucket of the 1.34 B GPT
// holds up to ~200 small parameters, and a launch per tensor per kernel cost the host
// ~2,600 launches a step, on the step's critical path. A Batch holds up to kMax entries
// and the first of the grid's CTAs that works on each; it is passed by value as the
// kernel's parameter (__grid_constant__: read in place, never copied), so a launch needs
// no device memory and no copy. A CTA finds its entry by binary search.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/codecs.h"  // KernelError
#include "kernels/launch.cuh"  // check

namespace statepager::kernels {

// What a batch may take of the kernel's parameter space: CUDA's portable limit is 4 KiB,
// and a kernel's other parameters (a flag's pointer) take a few bytes.
inline constexpr size_t kBatchBytes = 4000;
inline constexpr uint32_t kMaxGrid = 0x7fffffffu;  // gridDim.x's limit

template <class Entry>
struct Batch {
  static constexpr int kMax = static_cast<int>((kBatchBytes - 16) / (sizeof(Entry) + 4));
  Entry entry[kMax];
  uint32_t first[kMax + 1];  // entry i's first CTA; first[count] is the grid's size
  int count;
};

// The entry CTA `block` works on, and (out) its index among the entry's CTAs.
template <class Entry>
__device__ __forceinline__ const Entry& entry_of(const Batch<Entry>& b, uint32_t block,
                                                 uint32_t* local) {
  int lo = 0, hi = b.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (b.first[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  *local = block - b.first[lo];
  return b.entry[lo];
}

// Calls launch(batch, grid) for batches of `entries` in order, entry e taking
// blocks_of(e) CTAs (entries of none are left out). Entries of one batch run at once;
// a later batch's kernels run after an earlier one's only as the stream orders them.
template <class Entry, class BlocksOf, class Launch>
void launch_batches(const std::vector<Entry>& entries, BlocksOf blocks_of, Launch launch,
                    const char* what) {
  static_assert(sizeof(Batch<Entry>) <= kBatchBytes, "a batch must fit a kernel's parameters");
  Batch<Entry> b;
  b.count = 0;
  uint32_t grid = 0;
  auto flush = [&] {
    if (b.count == 0) return;
    b.first[b.count] = grid;
    launch(b, grid);
    check(cudaGetLastError(), what);
    b.count = 0;
    grid = 0;
  };
  for (const Entry& e : entries) {
    const int64_t blocks = blocks_of(e);
    if (blocks == 0) continue;
    if (blocks > kMaxGrid) {
      throw KernelError(std::string("statepager kernel ") + what + ": a tensor of " +
                        std::to_string(blocks) + " CTAs exceeds one launch's grid");
    }
    if (b.count == Batch<Entry>::kMax || grid + blocks > kMaxGrid) flush();
    b.entry[b.count] = e;
    b.first[b.count++] = grid;
    grid += static_cast<uint32_t>(blocks);
  }
  flush();
}

}  // namespace statepager::kernels
