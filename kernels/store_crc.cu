#include "kernels/store_crc.h"

#include <algorithm>

#include "kernels/launch.cuh"

namespace statepager::kernels {

namespace {

constexpr uint32_t kPoly = 0x82F63B78;  // Castagnoli, reflected
constexpr int kThreads = 256;
constexpr uint64_t kSegment = 256;                  // bytes a thread sums
constexpr uint64_t kTile = kThreads * kSegment;     // bytes a block sums
constexpr int kLevels = 8;                          // log2(kThreads)
constexpr int kBatch = 64;                          // ranges a launch takes

// What a launch reads: its ranges, where each one's tiles begin among the launch's, and
// the factors that move a crc past a full subtree of the block's (kSegment << level
// bytes) and past a full tile.
struct Batch {
  uint64_t addr[kBatch];
  uint64_t bytes[kBatch];
  uint32_t first_tile[kBatch + 1];
  uint32_t past_segments[kLevels];
  uint32_t past_tile;
  int n;
};

template <class T>
__device__ T least(T a, T b) {
  return a < b ? a : b;
}

// a * b modulo the polynomial, both reflected (backing/crc32c.cc's mult_mod_p).
__host__ __device__ uint32_t mult_mod_p(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(8 n) modulo the polynomial: the factor that moves a crc past n bytes.
__host__ __device__ uint32_t shift_factor(uint64_t n) {
  uint32_t factor = 1u << 31, square = 1u << 30;
  for (uint64_t e = 8 * n; e != 0; e >>= 1) {
    if (e & 1) factor = mult_mod_p(square, factor);
    square = mult_mod_p(square, square);
  }
  return factor;
}

__device__ void fill_table(uint32_t* table) {
  uint32_t c = threadIdx.x;
  for (int i = 0; i < 8; i++) c = (c >> 1) ^ (kPoly & (0u - (c & 1)));
  table[threadIdx.x] = c;
  __syncthreads();
}

// crc32c(0, p, n), a byte at a time through the table (8 at a load where aligned).
__device__ uint32_t segment_crc(const uint32_t* table, const unsigned char* p, uint64_t n) {
  uint32_t c = 0xFFFFFFFFu;
  uint64_t i = 0;
  if (reinterpret_cast<uintptr_t>(p) % 8 == 0) {
    for (; i + 8 <= n; i += 8) {
      uint64_t w = *reinterpret_cast<const uint64_t*>(p + i);
      for (int b = 0; b < 8; b++, w >>= 8) c = table[(c ^ w) & 0xFF] ^ (c >> 8);
    }
  }
  for (; i < n; i++) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return ~c;
}

// Joins the block's (crc, bytes) pairs in thread order into crc[0], bytes[0]; `full[l]`
// (or 0: compute it) moves a crc past a right-hand side of kSegment << l bytes.
__device__ void join_block(uint32_t* crc, uint64_t* bytes, const uint32_t* full) {
  const int t = threadIdx.x;
  for (int level = 0; level < kLevels; level++) {
    const int s = 1 << level;
    if (t % (2 * s) == 0) {
      const uint64_t right = bytes[t + s];
      const uint32_t factor =
          full != nullptr && right == (kSegment << level) ? full[level] : shift_factor(right);
      crc[t] = mult_mod_p(factor, crc[t]) ^ crc[t + s];
      bytes[t] += right;
    }
    __syncthreads();
  }
}

__global__ void tile_crcs(Batch batch, uint32_t* tiles) {
  __shared__ uint32_t table[256];
  __shared__ uint32_t crc[kThreads];
  __shared__ uint64_t bytes[kThreads];
  fill_table(table);
  const uint32_t tile = blockIdx.x;
  int r = 0;
  while (batch.first_tile[r + 1] <= tile) r++;
  const uint64_t start = uint64_t(tile - batch.first_tile[r]) * kTile + threadIdx.x * kSegment;
  const uint64_t n = start < batch.bytes[r] ? least(kSegment, batch.bytes[r] - start) : 0;
  crc[threadIdx.x] =
      n == 0 ? 0 : segment_crc(table, reinterpret_cast<const unsigned char*>(batch.addr[r] + start), n);
  bytes[threadIdx.x] = n;
  __syncthreads();
  join_block(crc, bytes, batch.past_segments);
  if (threadIdx.x == 0) tiles[tile] = crc[0];
}

__global__ void range_crcs(Batch batch, const uint32_t* tiles, uint32_t* out) {
  __shared__ uint32_t crc[kThreads];
  __shared__ uint64_t bytes[kThreads];
  const int r = blockIdx.x;
  const uint32_t first = batch.first_tile[r], count = batch.first_tile[r + 1] - first;
  const uint32_t per = (count + kThreads - 1) / kThreads;
  uint32_t c = 0;
  uint64_t b = 0;
  for (uint32_t k = threadIdx.x * per; k < least(count, (threadIdx.x + 1) * per); k++) {
    const uint64_t n = least(kTile, batch.bytes[r] - uint64_t(k) * kTile);
    c = mult_mod_p(n == kTile ? batch.past_tile : shift_factor(n), c) ^ tiles[first + k];
    b += n;
  }
  crc[threadIdx.x] = c;
  bytes[threadIdx.x] = b;
  __syncthreads();
  join_block(crc, bytes, nullptr);
  if (threadIdx.x == 0) out[r] = crc[0];
}

void launch(Batch& batch, cudaStream_t stream, uint32_t* out) {
  const uint32_t tiles = batch.first_tile[batch.n];
  uint32_t* scratch = nullptr;  // the tiles' crcs, then the ranges'
  check(cudaMallocAsync(reinterpret_cast<void**>(&scratch),
                        sizeof(uint32_t) * (tiles + batch.n), stream),
        "crc32c (scratch)");
  cudaError_t err = cudaSuccess;
  if (tiles > 0) {
    tile_crcs<<<tiles, kThreads, 0, stream>>>(batch, scratch);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    range_crcs<<<batch.n, kThreads, 0, stream>>>(batch, scratch, scratch + tiles);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(out, scratch + tiles, sizeof(uint32_t) * batch.n,
                          cudaMemcpyDeviceToHost, stream);
  }
  const cudaError_t freed = cudaFreeAsync(scratch, stream);
  check(err, "crc32c");
  check(freed, "crc32c (free)");
}

}  // namespace

void crc32c_ranges(int device, void* stream, const uint64_t* addrs, const uint64_t* lengths,
                   size_t n, uint32_t* out) {
  cudaStream_t s = prepare(device, stream, "crc32c");
  Batch batch{};
  for (int l = 0; l < kLevels; l++) batch.past_segments[l] = shift_factor(kSegment << l);
  batch.past_tile = shift_factor(kTile);
  for (size_t done = 0; done < n; done += kBatch) {
    batch.n = static_cast<int>(std::min<size_t>(kBatch, n - done));
    batch.first_tile[0] = 0;
    for (int i = 0; i < batch.n; i++) {
      batch.addr[i] = addrs[done + i];
      batch.bytes[i] = lengths[done + i];
      batch.first_tile[i + 1] =
          batch.first_tile[i] + static_cast<uint32_t>((lengths[done + i] + kTile - 1) / kTile);
    }
    launch(batch, s, out + done);
  }
}

}  // namespace statepager::kernels
