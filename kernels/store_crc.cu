#include "kernels/store_crc.h"

#include <algorithm>
#include <array>

#include "kernels/launch.cuh"

namespace statepager::kernels {

namespace {

constexpr uint32_t kPoly = 0x82F63B78;  // Castagnoli, reflected
constexpr uint32_t kOne = 1u << 31;     // x^0, reflected: mult_mod_p's identity
constexpr int kThreads = 256;
constexpr uint64_t kSegment = 512;               // bytes a thread sums
constexpr uint64_t kTile = kThreads * kSegment;  // bytes a block sums at a time
constexpr int kLevels = 8;                       // log2(kThreads)
constexpr int kPowers = 48;                      // shifts of up to 2^48 - 1 bytes
constexpr int kBatch = 512;                      // ranges a launch takes (in 10 KiB of
                                                 // parameters: sm_70 on, CUDA 12.1 on)
constexpr int kBlocksPerSm = 6;                  // what the table's shared memory allows

// What a launch reads: its ranges, where each one's tiles begin among the launch's, and
// x^(8 * 2^b), the factors that move a crc past 2^b bytes (shift()).
struct Batch {
  uint64_t addr[kBatch];
  uint64_t bytes[kBatch];
  uint32_t first_tile[kBatch + 1];
  uint32_t power[kPowers];
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

// x^(8 n) modulo the polynomial, by squaring (the host's, once per power).
uint32_t shift_factor(uint64_t n) {
  uint32_t factor = kOne, square = 1u << 30;
  for (uint64_t e = 8 * n; e != 0; e >>= 1) {
    if (e & 1) factor = mult_mod_p(square, factor);
    square = mult_mod_p(square, square);
  }
  return factor;
}

// crc moved past n bytes (crc(a b) = shift(crc(a), |b|) ^ crc(b)): a product per bit
// set in n.
__device__ uint32_t shift(uint32_t crc, uint64_t n, const uint32_t* power) {
  for (int b = 0; n != 0; b++, n >>= 1) {
    if (n & 1) crc = mult_mod_p(power[b], crc);
  }
  return crc;
}

// Four tables (slicing by 4: a word's four lookups do not wait for one another), entry e
// of table k being the crc of byte e followed by k zero bytes; kCopies copies of each,
// lane l reading copy l % kCopies, so that the lanes of a warp meet about two to a bank
// (with one copy, about four).
constexpr int kCopies = 8;
constexpr int kTableWords = 4 * 256 * kCopies;

__device__ void fill_tables(uint32_t* table) {
  for (int k = threadIdx.x; k < kTableWords; k += kThreads) {
    const int tab = k / (256 * kCopies);
    uint32_t c = (k / kCopies) % 256;
    for (int i = 0; i < 8 * (tab + 1); i++) c = (c >> 1) ^ (kPoly & (0u - (c & 1)));
    table[k] = c;
  }
  __syncthreads();
}

// crc32c(0, p, n) through the tables, a word at a time where p is aligned.
__device__ uint32_t segment_crc(const uint32_t* table, const unsigned char* p, uint64_t n) {
  const uint32_t* t0 = table + threadIdx.x % kCopies;
  const uint32_t* t1 = t0 + 256 * kCopies;
  const uint32_t* t2 = t1 + 256 * kCopies;
  const uint32_t* t3 = t2 + 256 * kCopies;
  uint32_t c = 0xFFFFFFFFu;
  uint64_t i = 0;
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0) {
#pragma unroll 4
    for (; i + 16 <= n; i += 16) {
      const uint4 v = *reinterpret_cast<const uint4*>(p + i);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
      for (int w = 0; w < 4; w++) {
        c ^= words[w];
        c = t3[(c & 0xFF) * kCopies] ^ t2[((c >> 8) & 0xFF) * kCopies] ^
            t1[((c >> 16) & 0xFF) * kCopies] ^ t0[(c >> 24) * kCopies];
      }
    }
  }
  for (; i < n; i++) c = t0[((c ^ p[i]) & 0xFF) * kCopies] ^ (c >> 8);
  return ~c;
}

// Joins the block's (crc, bytes) pairs in thread order into crc[0].
__device__ void join_block(uint32_t* crc, uint64_t* bytes, const uint32_t* power) {
  const int t = threadIdx.x;
  for (int level = 0; level < kLevels; level++) {
    const int s = 1 << level;
    if (t % (2 * s) == 0) {
      const uint64_t right = bytes[t + s];
      if (right > 0) crc[t] = shift(crc[t], right, power) ^ crc[t + s];
      bytes[t] += right;
    }
    __syncthreads();
  }
}

// The range holding `tile`: the last whose first tile is not past it.
__device__ int range_of(const Batch& batch, uint32_t tile) {
  int lo = 0, hi = batch.n;  // first_tile[lo] <= tile < first_tile[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (batch.first_tile[mid] <= tile) lo = mid; else hi = mid;
  }
  return lo;
}

// Each block sums tiles (a tile lies within one range) and adds each, moved past the
// bytes of its range after it, into out[its range] (zero before): a range's crc is the
// xor of its tiles' crcs so moved.
__global__ void range_crcs(Batch batch, uint32_t* out) {
  __shared__ uint32_t table[kTableWords];
  __shared__ uint32_t crc[kThreads];
  __shared__ uint64_t bytes[kThreads];
  fill_tables(table);
  const uint32_t tiles = batch.first_tile[batch.n];
  for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int r = range_of(batch, tile);
    const uint64_t size = batch.bytes[r];
    const uint64_t tile_start = uint64_t(tile - batch.first_tile[r]) * kTile;
    const uint64_t start = tile_start + threadIdx.x * kSegment;
    const uint64_t n = start < size ? least(kSegment, size - start) : 0;
    const auto* at = reinterpret_cast<const unsigned char*>(batch.addr[r] + start);
    crc[threadIdx.x] = n == 0 ? 0 : segment_crc(table, at, n);
    bytes[threadIdx.x] = n;
    __syncthreads();
    join_block(crc, bytes, batch.power);
    if (threadIdx.x == 0) {
      atomicXor(&out[r], shift(crc[0], size - least(size, tile_start + kTile), batch.power));
    }
    __syncthreads();  // crc[] and bytes[] are the next tile's
  }
}

const uint32_t* powers() {
  static const auto table = [] {
    std::array<uint32_t, kPowers> p{};
    for (int b = 0; b < kPowers; b++) p[b] = shift_factor(uint64_t(1) << b);
    return p;
  }();
  return table.data();
}

int sm_count(int device) {
  int count = 0;
  check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "crc32c");
  return count;
}

void launch(Batch& batch, int device, cudaStream_t stream, uint32_t* out) {
  const uint32_t tiles = batch.first_tile[batch.n];
  uint32_t* sums = nullptr;  // the ranges' crcs, on the device
  check(cudaMallocAsync(reinterpret_cast<void**>(&sums), sizeof(uint32_t) * batch.n, stream),
        "crc32c (scratch)");
  cudaError_t err = cudaMemsetAsync(sums, 0, sizeof(uint32_t) * batch.n, stream);
  if (err == cudaSuccess && tiles > 0) {
    const uint32_t blocks = std::min<uint32_t>(tiles, kBlocksPerSm * sm_count(device));
    // Room for kBlocksPerSm: a hint, without which the kernel runs fewer blocks at a time
    // (its error cleared, not left for the launch's check).
    static const bool carved = [] {
      const bool ok = cudaFuncSetAttribute(range_crcs,
                                           cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared) == cudaSuccess;
      if (!ok) (void)cudaGetLastError();
      return ok;
    }();
    (void)carved;
    range_crcs<<<blocks, kThreads, 0, stream>>>(batch, sums);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(out, sums, sizeof(uint32_t) * batch.n, cudaMemcpyDeviceToHost, stream);
  }
  const cudaError_t freed = cudaFreeAsync(sums, stream);
  check(err, "crc32c");
  check(freed, "crc32c (free)");
}

}  // namespace

void crc32c_ranges(int device, void* stream, const uint64_t* addrs, const uint64_t* lengths,
                   size_t n, uint32_t* out) {
  cudaStream_t s = prepare(device, stream, "crc32c");
  Batch batch{};
  std::copy_n(powers(), kPowers, batch.power);
  for (size_t done = 0; done < n; done += kBatch) {
    batch.n = static_cast<int>(std::min<size_t>(kBatch, n - done));
    batch.first_tile[0] = 0;
    for (int i = 0; i < batch.n; i++) {
      batch.addr[i] = addrs[done + i];
      batch.bytes[i] = lengths[done + i];
      batch.first_tile[i + 1] =
          batch.first_tile[i] + static_cast<uint32_t>((lengths[done + i] + kTile - 1) / kTile);
    }
    launch(batch, device, s, out + done);
  }
}

}  // namespace statepager::kernels
