// CudaDevice against the Device contract. Skipped where there is no GPU.

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "allocator/device.h"
#include "backing/align.h"
#include "backing/errors.h"

namespace statepager {
namespace {


void fill_random(void* dst, size_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  auto* p = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < bytes; i++) p[i] = static_cast<uint8_t>(rng());
}

void drain(Device& dev, CopyQueue queue) {
  Fence f = dev.record(queue);
  dev.wait(f);
  dev.release_fence(f);
}

// Writes `bytes` from `staging` to `addr`, waits, then reads them back into `out`.
void round_trip(Device& dev, uintptr_t addr, const void* staging, void* out, size_t bytes) {
  dev.copy_to_device(addr, staging, bytes);
  drain(dev, CopyQueue::kToDevice);
  std::memset(out, 0xAB, bytes);
  dev.copy_to_host(out, addr, bytes);
  drain(dev, CopyQueue::kToHost);
}

// One page of device memory mapped at a reservation of its own, for a test's life.
struct MappedPage {
  explicit MappedPage(Device& d) : dev(d), bytes(d.granularity()) {
    base = dev.reserve(bytes);
    page = dev.create_page(bytes);
    dev.map(base, bytes, page);
  }
  ~MappedPage() {
    dev.unmap(base, bytes);
    dev.release_page(page, bytes);
    dev.unreserve(base, bytes);
  }
  Device& dev;
  size_t bytes;
  uintptr_t base = 0;
  PhysicalPage page = 0;
};

// Each test gets device 0, or is skipped where there is none. GTEST_SKIP() here skips the
// body, so anything that needs `dev` (a MappedPage) is made in the test itself.
class CudaDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!statepager::cuda_available()) GTEST_SKIP() << "no CUDA device";
    dev = make_cuda_device(0);
  }
  std::unique_ptr<Device> dev;
};

TEST_F(CudaDevice, CopiesAreBitExact) {
  EXPECT_EQ(dev->name(), "cuda:0");
  const size_t g = dev->granularity();
  ASSERT_GT(g, 0u);

  uintptr_t base = dev->reserve(2 * g);
  ASSERT_EQ(base % g, 0u);
  PhysicalPage page = dev->create_page(g);
  dev->map(base, g, page);
  auto* in = static_cast<uint8_t*>(dev->alloc_staging(g));
  auto* out = static_cast<uint8_t*>(dev->alloc_staging(g));
  ASSERT_EQ(reinterpret_cast<uintptr_t>(in) % 4096, 0u);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(out) % 4096, 0u);

  fill_random(in, g, 1);
  dev->wait_for_stream(CopyQueue::kToDevice, 0);
  dev->wait_for_stream(CopyQueue::kToHost, 0);
  round_trip(*dev, base, in, out, g);
  EXPECT_EQ(std::memcmp(in, out, g), 0);

  dev->free_staging(out, g);
  dev->free_staging(in, g);
  dev->unmap(base, g);
  dev->release_page(page, g);
  dev->unreserve(base, 2 * g);
}

// A fence on a caller's stream passes once that stream's work has run, while the copy
// queue still holds a gigabyte of copies queued before it (a discard's unmap waits for
// the kernels that used its pages, not for page-outs).
TEST_F(CudaDevice, AStreamFencePassesWhileTheCopyQueueIsBusy) {
  MappedPage mapped(*dev);
  const size_t g = mapped.bytes;
  void* staging = dev->alloc_staging(g);
  for (size_t copied = 0; copied < (size_t{1} << 30); copied += g) {
    dev->copy_to_host(staging, mapped.base, g);
  }
  const Fence copies = dev->record(CopyQueue::kToHost);
  const Fence stream_fence = dev->record_stream(0);  // the legacy default stream: nothing queued
  while (!dev->is_done(stream_fence)) {
  }
  EXPECT_FALSE(dev->is_done(copies)) << "1 GiB of copies done before a spin on a fence";
  dev->wait(copies);
  dev->release_fence(stream_fence);
  dev->release_fence(copies);
  dev->free_staging(staging, g);
}

// A batch of scattered pieces of odd sizes, both ways, between a page and registered
// memory (a file's shared mapping is registered the same way): every byte lands where its
// piece says, and bytes no piece covers are untouched.
TEST_F(CudaDevice, CopyBatchMovesEveryPieceBothWays) {
  MappedPage mapped(*dev);
  const size_t g = mapped.bytes;
  const uintptr_t base = mapped.base;
  // Page-aligned, as register_host() asks.
  std::unique_ptr<uint8_t, decltype(&std::free)> src_mem(
      static_cast<uint8_t*>(std::aligned_alloc(4096, g)), &std::free);
  std::unique_ptr<uint8_t, decltype(&std::free)> dst_mem(
      static_cast<uint8_t*>(std::aligned_alloc(4096, g)), &std::free);
  uint8_t* src = src_mem.get();
  uint8_t* dst = dst_mem.get();
  std::memset(dst, 0xCD, g);
  ASSERT_TRUE(dev->register_host(src, g));
  ASSERT_TRUE(dev->register_host(dst, g));
  fill_random(src, g, 5);
  dev->fill_zero(base, g);
  // Pieces in reverse order, of 1 byte to 780 KiB, with gaps between them.
  std::vector<HostCopy> in, out;
  for (size_t at = 0, k = 1; at + k <= g; at += k + 4096 + k % 4093, k = k * 3 + 7) {
    in.insert(in.begin(), HostCopy{base + at, reinterpret_cast<char*>(src) + at, k});
    out.insert(out.begin(), HostCopy{base + at, reinterpret_cast<char*>(dst) + at, k});
  }
  ASSERT_GE(in.size(), 8u);
  dev->copy_batch(CopyQueue::kToDevice, in.data(), in.size());
  drain(*dev, CopyQueue::kToDevice);
  dev->copy_batch(CopyQueue::kToHost, out.data(), out.size());
  drain(*dev, CopyQueue::kToHost);
  size_t covered = 0;
  for (const HostCopy& c : out) {
    const size_t at = c.addr - base;
    EXPECT_EQ(std::memcmp(dst + at, src + at, c.bytes), 0) << "piece at " << at;
    covered += c.bytes;
  }
  std::vector<uint8_t> expect(g, 0xCD);
  for (const HostCopy& c : out) {
    std::memcpy(expect.data() + (c.addr - base), src + (c.addr - base), c.bytes);
  }
  EXPECT_EQ(std::memcmp(dst, expect.data(), g), 0) << covered << " bytes in pieces";
  dev->copy_batch(CopyQueue::kToHost, nullptr, 0);  // an empty batch is nothing
  dev->unregister_host(dst);
  dev->unregister_host(src);
}

TEST_F(CudaDevice, FillZero) {
  MappedPage mapped(*dev);
  const size_t g = mapped.bytes;
  const uintptr_t base = mapped.base;
  auto* buf = static_cast<uint8_t*>(dev->alloc_staging(g));

  fill_random(buf, g, 2);
  dev->copy_to_device(base, buf, g);
  dev->fill_zero(base, g);  // same queue: runs after the copy
  drain(*dev, CopyQueue::kToDevice);
  std::memset(buf, 0xAB, g);
  dev->copy_to_host(buf, base, g);
  drain(*dev, CopyQueue::kToHost);
  std::vector<uint8_t> zeros(g, 0);
  EXPECT_EQ(std::memcmp(buf, zeros.data(), g), 0);

  dev->free_staging(buf, g);
}

TEST_F(CudaDevice, FenceIsDoneAfterWait) {
  for (CopyQueue queue : {CopyQueue::kToHost, CopyQueue::kToDevice}) {
    Fence a = dev->record(queue);
    Fence b = dev->record(queue);
    EXPECT_NE(a, b);
    dev->wait(b);
    EXPECT_TRUE(dev->is_done(b));
    EXPECT_TRUE(dev->is_done(a));  // recorded earlier on the same queue
    dev->release_fence(a);
    dev->release_fence(b);
  }
}

TEST_F(CudaDevice, RemapKeepsAddressAndPageContents) {
  const size_t g = dev->granularity();
  uintptr_t base = dev->reserve(g);
  PhysicalPage a = dev->create_page(g);
  PhysicalPage b = dev->create_page(g);
  auto* data_a = static_cast<uint8_t*>(dev->alloc_staging(g));
  auto* data_b = static_cast<uint8_t*>(dev->alloc_staging(g));
  auto* out = static_cast<uint8_t*>(dev->alloc_staging(g));
  fill_random(data_a, g, 3);
  fill_random(data_b, g, 4);

  dev->map(base, g, a);
  round_trip(*dev, base, data_a, out, g);
  EXPECT_EQ(std::memcmp(out, data_a, g), 0);
  dev->unmap(base, g);

  dev->map(base, g, b);  // same address, different memory
  round_trip(*dev, base, data_b, out, g);
  EXPECT_EQ(std::memcmp(out, data_b, g), 0);
  dev->unmap(base, g);

  dev->map(base, g, a);  // page a kept its bytes while unmapped
  dev->copy_to_host(out, base, g);
  drain(*dev, CopyQueue::kToHost);
  EXPECT_EQ(std::memcmp(out, data_a, g), 0);
  dev->unmap(base, g);

  dev->free_staging(out, g);
  dev->free_staging(data_b, g);
  dev->free_staging(data_a, g);
  dev->release_page(b, g);
  dev->release_page(a, g);
  dev->unreserve(base, g);
}

TEST_F(CudaDevice, AbsurdPageThrows) {
  const size_t bytes = align_up(size_t{1} << 40, dev->granularity());  // 1 TiB
  try {
    PhysicalPage page = dev->create_page(bytes);
    dev->release_page(page, bytes);
    FAIL() << "create_page(1 TiB) succeeded";
  } catch (const OutOfMemoryError& e) {
    EXPECT_STRNE(e.what(), "");
  } catch (const Error& e) {  // a DeviceError is acceptable too
    EXPECT_STRNE(e.what(), "");
  }
}

TEST_F(CudaDevice, FreeMemoryTracksPages) {
  const size_t page_size = align_up(size_t{64} << 20, dev->granularity());
  const size_t count = (size_t{1} << 30) / page_size;
  const size_t total = count * page_size;
  const size_t slack = total / 4;  // other processes may allocate or free meanwhile

  const size_t before = dev->free_memory();
  std::vector<PhysicalPage> pages;
  for (size_t i = 0; i < count; i++) pages.push_back(dev->create_page(page_size));
  const size_t held = dev->free_memory();
  EXPECT_LT(held + total - slack, before);

  for (PhysicalPage p : pages) dev->release_page(p, page_size);
  const size_t after = dev->free_memory();
  EXPECT_GT(after, held + total - slack);
}

}  // namespace
}  // namespace statepager
