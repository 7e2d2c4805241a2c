// CudaDevice: the Device contract on the CUDA driver's virtual memory API.
//
// libcuda is opened at run time, never linked, so that statepager loads on machines
// without a driver. All work runs in the device's primary context, the one PyTorch uses,
// so addresses, streams and events are shared with it.

#include "allocator/device.h"

#include <atomic>

#include "backing/errors.h"

namespace statepager {
namespace {
std::atomic<ChecksumKernel> checksum_kernel{nullptr};  // set_cuda_checksum_kernel's
}  // namespace

void set_cuda_checksum_kernel(ChecksumKernel kernel) { checksum_kernel.store(kernel); }

}  // namespace statepager

#if STATEPAGER_WITH_CUDA

#include <cuda.h>
#include <dlfcn.h>

#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace statepager {
namespace {

// Every driver entry point used below. A name that cuda.h #defines to a versioned symbol
// (cuMemGetInfo -> cuMemGetInfo_v2) gets that version's type; kDriverAbi requests the same.
#define STATEPAGER_CUDA_FUNCTIONS(X)                                                       \
  X(cuGetErrorName) X(cuGetErrorString) X(cuInit) X(cuDeviceGetCount) X(cuDeviceGet)      \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxGetCurrent)              \
  X(cuCtxSetCurrent) X(cuCtxSynchronize) X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize)           \
  X(cuStreamWaitEvent) X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord) X(cuEventQuery) \
  X(cuEventSynchronize) X(cuMemGetAllocationGranularity) X(cuMemAddressReserve)            \
  X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap)             \
  X(cuMemSetAccess) X(cuMemHostAlloc) X(cuMemFreeHost) X(cuMemcpyDtoHAsync)                \
  X(cuMemcpyHtoDAsync) X(cuMemsetD8Async) X(cuMemGetInfo) X(cuMemHostRegister)             \
  X(cuMemHostUnregister)

// The ABI of CUDA 12.0: every driver since accepts it (a version above the driver's is
// refused), and none of the functions above has changed signature since, so the types
// from a newer cuda.h still match.
constexpr int kDriverAbi = 12000;

struct Driver {
#define STATEPAGER_DECLARE(name) decltype(&::name) name = nullptr;
  STATEPAGER_CUDA_FUNCTIONS(STATEPAGER_DECLARE)
#undef STATEPAGER_DECLARE
  std::string error;  // why the driver is unusable; empty when every function was found
};

Driver load_driver() {
  Driver d;
  // Never closed: the driver stays loaded for the life of the process, like with cudart.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    d.error = std::string("cannot load libcuda.so.1 (") + dlerror() +
              "): install the NVIDIA driver, or use the CPU device";
    return d;
  }
  // cuda.h renames cuGetProcAddress to the five-argument _v2, which drivers export since
  // CUDA 12; the older four-argument symbol is not call-compatible with it.
  auto get_proc = reinterpret_cast<decltype(&::cuGetProcAddress)>(
      dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    d.error = "libcuda.so.1 has no cuGetProcAddress_v2: the NVIDIA driver predates CUDA 12, "
              "upgrade it";
    return d;
  }
  // Legacy-stream variants: stream 0 is the legacy default stream, as in PyTorch.
#define STATEPAGER_LOAD(name)                                                                    \
  {                                                                                              \
    void* fn = nullptr;                                                                          \
    CUresult r = get_proc(#name, &fn, kDriverAbi, CU_GET_PROC_ADDRESS_LEGACY_STREAM, nullptr);   \
    if (r != CUDA_SUCCESS || fn == nullptr) {                                                    \
      d.error = "libcuda.so.1 does not provide " #name " (CUresult " + std::to_string(r) +       \
                "): install or upgrade the NVIDIA driver";                                       \
      return d;                                                                                  \
    }                                                                                            \
    d.name = reinterpret_cast<decltype(d.name)>(fn);                                             \
  }
  STATEPAGER_CUDA_FUNCTIONS(STATEPAGER_LOAD)
#undef STATEPAGER_LOAD
  return d;
}

// Never destroyed: a device may still be torn down after static destructors have run.
const Driver& driver() {
  static const Driver* d = new Driver(load_driver());
  return *d;
}

// Makes `ctx` current on this thread and restores the caller's context afterwards, so
// that a Pager on cuda:1 never changes which device PyTorch sees as current. Errors are
// ignored: a context that could not be made current fails the call that follows.
class ScopedContext {
 public:
  ScopedContext(const Driver& d, CUcontext ctx) : d_(d), ctx_(ctx) {
    d_.cuCtxGetCurrent(&prev_);
    if (prev_ != ctx_) d_.cuCtxSetCurrent(ctx_);
  }
  ~ScopedContext() {
    if (prev_ != ctx_) d_.cuCtxSetCurrent(prev_);
  }
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const Driver& d_;
  CUcontext ctx_;
  CUcontext prev_ = nullptr;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int ordinal) : d_(driver()), ordinal_(ordinal) {
    if (!d_.error.empty()) throw DeviceError(name() + ": " + d_.error);
    check(d_.cuInit(0), "cuInit");
    int count = 0;
    check(d_.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (ordinal < 0 || ordinal >= count) {
      throw DeviceError(name() + " does not exist: the driver sees " + std::to_string(count) +
                        " device(s)");
    }
    check(d_.cuDeviceGet(&dev_, ordinal), "cuDeviceGet");
    check(d_.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    try {
      ScopedContext scope(d_, ctx_);
      for (CUstream* group : {streams_, checksum_streams_}) {
        for (int q = 0; q < 2; q++) {
          check(d_.cuStreamCreate(&group[q], CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        }
      }
      prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop_.location = {CU_MEM_LOCATION_TYPE_DEVICE, ordinal};
      check(d_.cuMemGetAllocationGranularity(&granularity_, &prop_,
                                             CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity");
    } catch (...) {
      destroy();
      throw;
    }
  }

  ~CudaDevice() override { destroy(); }

  std::string name() const override { return "cuda:" + std::to_string(ordinal_); }
  size_t granularity() const override { return granularity_; }

  uintptr_t reserve(size_t bytes) override {
    ScopedContext scope(d_, ctx_);
    CUdeviceptr ptr = 0;
    check(d_.cuMemAddressReserve(&ptr, bytes, granularity_, 0, 0), "cuMemAddressReserve");
    return ptr;
  }

  void unreserve(uintptr_t base, size_t bytes) override {
    ScopedContext scope(d_, ctx_);
    check(d_.cuMemAddressFree(base, bytes), "cuMemAddressFree");
  }

  PhysicalPage create_page(size_t bytes) override {
    ScopedContext scope(d_, ctx_);
    CUmemGenericAllocationHandle handle = 0;
    CUresult r = d_.cuMemCreate(&handle, bytes, &prop_, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      throw OutOfMemoryError(name() + " has no free memory for a page of " +
                             std::to_string(bytes >> 20) +
                             " MiB: lower the Pager's hbm_budget or page size, or free memory");
    }
    check(r, "cuMemCreate");
    return handle;
  }

  void release_page(PhysicalPage page, size_t /*bytes*/) override {
    ScopedContext scope(d_, ctx_);
    check(d_.cuMemRelease(page), "cuMemRelease");
  }

  void map(uintptr_t addr, size_t bytes, PhysicalPage page) override {
    ScopedContext scope(d_, ctx_);
    check(d_.cuMemMap(addr, bytes, 0, page, 0), "cuMemMap");
    CUmemAccessDesc access = {};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult r = d_.cuMemSetAccess(addr, bytes, &access, 1);
    if (r != CUDA_SUCCESS) {
      d_.cuMemUnmap(addr, bytes);  // leave the range as it was: reserved, nothing mapped
      check(r, "cuMemSetAccess");
    }
  }

  void unmap(uintptr_t addr, size_t bytes) override {
    ScopedContext scope(d_, ctx_);
    check(d_.cuMemUnmap(addr, bytes), "cuMemUnmap");
  }

  // O_DIRECT reads land in staging, so it is 4 KiB-aligned. The driver hands out whole
  // pages for large allocations but sub-allocates small ones: those are made 4 KiB
  // larger and handed out from their first aligned address (unaligned_ maps it back).
  void* alloc_staging(size_t bytes) override {
    ScopedContext scope(d_, ctx_);
    void* p = nullptr;
    check(d_.cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
    if (reinterpret_cast<uintptr_t>(p) % 4096 == 0) return p;
    check(d_.cuMemFreeHost(p), "cuMemFreeHost");
    check(d_.cuMemHostAlloc(&p, bytes + 4096, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
    const uintptr_t aligned = (reinterpret_cast<uintptr_t>(p) + 4095) / 4096 * 4096;
    std::lock_guard<std::mutex> lock(mu_);
    unaligned_[aligned] = p;
    return reinterpret_cast<void*>(aligned);
  }

  void free_staging(void* ptr, size_t /*bytes*/) override {
    ScopedContext scope(d_, ctx_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = unaligned_.find(reinterpret_cast<uintptr_t>(ptr));
      if (it != unaligned_.end()) {
        ptr = it->second;
        unaligned_.erase(it);
      }
    }
    check(d_.cuMemFreeHost(ptr), "cuMemFreeHost");
  }

  bool register_host(void* ptr, size_t bytes) override {
    ScopedContext scope(d_, ctx_);
    return d_.cuMemHostRegister(ptr, bytes, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS;
  }

  void unregister_host(void* ptr) override {
    ScopedContext scope(d_, ctx_);
    check(d_.cuMemHostUnregister(ptr), "cuMemHostUnregister");
  }

  void copy_to_host(void* dst, uintptr_t src, size_t bytes) override {
    ScopedContext scope(d_, ctx_);
    check(d_.cuMemcpyDtoHAsync(dst, src, bytes, stream(CopyQueue::kToHost)),
          "cuMemcpyDtoHAsync");
  }

  void copy_to_device(uintptr_t dst, const void* src, size_t bytes) override {
    ScopedContext scope(d_, ctx_);
    check(d_.cuMemcpyHtoDAsync(dst, src, bytes, stream(CopyQueue::kToDevice)),
          "cuMemcpyHtoDAsync");
  }

  void fill_zero(uintptr_t dst, size_t bytes) override {
    ScopedContext scope(d_, ctx_);
    check(d_.cuMemsetD8Async(dst, 0, bytes, stream(CopyQueue::kToDevice)), "cuMemsetD8Async");
  }

  // The kernel runs on a stream of its own beside the queue's, after what is queued there
  // so far: the copies queued next do not wait for it (see Note [Store checksums]).
  std::optional<Fence> checksum(CopyQueue queue, const DeviceRange* ranges, size_t n,
                                uint32_t* out) override {
    const ChecksumKernel kernel = checksum_kernel.load();
    if (kernel == nullptr) return std::nullopt;
    ScopedContext scope(d_, ctx_);
    const CUstream beside = checksum_streams_[static_cast<int>(queue)];
    Fence after = take_event();
    CUresult r = d_.cuEventRecord(event(after), stream(queue));
    if (r == CUDA_SUCCESS) r = d_.cuStreamWaitEvent(beside, event(after), 0);
    release_fence(after);
    check(r, "cuEventRecord/cuStreamWaitEvent");
    try {
      kernel(ordinal_, reinterpret_cast<uintptr_t>(beside), ranges, n, out);
    } catch (const std::exception& e) {
      throw DeviceError(name() + ": " + e.what());
    }
    Fence done = take_event();
    r = d_.cuEventRecord(event(done), beside);
    if (r != CUDA_SUCCESS) {
      release_fence(done);
      check(r, "cuEventRecord");
    }
    return done;
  }

  void wait_for_stream(CopyQueue queue, uintptr_t user_stream) override {
    ScopedContext scope(d_, ctx_);
    // A wait captures the event's state when it is queued, so the event can go straight
    // back to the pool and be recorded again.
    Fence f = take_event();
    CUresult r = d_.cuEventRecord(event(f), reinterpret_cast<CUstream>(user_stream));
    if (r == CUDA_SUCCESS) r = d_.cuStreamWaitEvent(stream(queue), event(f), 0);
    release_fence(f);
    check(r, "cuEventRecord/cuStreamWaitEvent");
  }

  Fence record(CopyQueue queue) override { return record_on(stream(queue)); }

  Fence record_stream(uintptr_t user_stream) override {
    return record_on(reinterpret_cast<CUstream>(user_stream));
  }

  bool is_done(Fence fence) override {
    ScopedContext scope(d_, ctx_);
    CUresult r = d_.cuEventQuery(event(fence));
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(r, "cuEventQuery");
    return true;
  }

  void wait(Fence fence) override {
    ScopedContext scope(d_, ctx_);
    check(d_.cuEventSynchronize(event(fence)), "cuEventSynchronize");
  }

  void release_fence(Fence fence) override {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(fence);
  }

  void synchronize() override {
    ScopedContext scope(d_, ctx_);
    check(d_.cuCtxSynchronize(), "cuCtxSynchronize");
  }

  size_t free_memory() override {
    ScopedContext scope(d_, ctx_);
    size_t avail = 0, total = 0;
    check(d_.cuMemGetInfo(&avail, &total), "cuMemGetInfo");
    return avail;
  }

 private:
  void check(CUresult r, const char* call) const {
    if (r == CUDA_SUCCESS) return;
    const char* err_name = nullptr;
    const char* err_text = nullptr;
    d_.cuGetErrorName(r, &err_name);
    d_.cuGetErrorString(r, &err_text);
    throw DeviceError(name() + ": " + call + " failed: " +
                      (err_name ? err_name : "CUresult " + std::to_string(r)) + ": " +
                      (err_text ? err_text : "unknown error"));
  }

  CUstream stream(CopyQueue queue) const { return streams_[static_cast<int>(queue)]; }

  Fence record_on(CUstream s) {
    ScopedContext scope(d_, ctx_);
    Fence f = take_event();
    CUresult r = d_.cuEventRecord(event(f), s);
    if (r != CUDA_SUCCESS) {
      release_fence(f);
      check(r, "cuEventRecord");
    }
    return f;
  }

  // A Fence is an index into events_. Events are reused, never destroyed before the
  // device, so the pool stays as large as the most fences ever held at once.
  Fence take_event() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      Fence f = free_.back();
      free_.pop_back();
      return f;
    }
    CUevent ev = nullptr;
    check(d_.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    events_.push_back(ev);
    return events_.size() - 1;
  }

  CUevent event(Fence fence) {
    std::lock_guard<std::mutex> lock(mu_);
    return events_.at(fence);
  }

  // Also undoes a constructor that failed part way. Errors are ignored: nothing can be
  // done about them here, and the driver may already be shutting down at process exit.
  void destroy() noexcept {
    if (ctx_ == nullptr) return;
    ScopedContext scope(d_, ctx_);
    for (CUstream* group : {streams_, checksum_streams_}) {
      for (int q = 0; q < 2; q++) {
        if (group[q] == nullptr) continue;
        d_.cuStreamSynchronize(group[q]);
        d_.cuStreamDestroy(group[q]);
      }
    }
    for (CUevent ev : events_) d_.cuEventDestroy(ev);
    d_.cuDevicePrimaryCtxRelease(dev_);
  }

  const Driver& d_;
  const int ordinal_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUstream streams_[2] = {nullptr, nullptr};  // indexed by CopyQueue
  CUstream checksum_streams_[2] = {nullptr, nullptr};  // checksum()'s, beside streams_
  CUmemAllocationProp prop_ = {};
  size_t granularity_ = 0;

  std::mutex mu_;
  std::vector<CUevent> events_;  // guarded by mu_
  std::vector<Fence> free_;      // guarded by mu_
  std::unordered_map<uintptr_t, void*> unaligned_;  // staging handed out -> allocated; mu_
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int ordinal) {
  return std::make_unique<CudaDevice>(ordinal);
}

bool cuda_available() {
  try {
    const Driver& d = driver();
    int count = 0;
    return d.error.empty() && d.cuInit(0) == CUDA_SUCCESS &&
           d.cuDeviceGetCount(&count) == CUDA_SUCCESS && count > 0;
  } catch (...) {
    return false;
  }
}

}  // namespace statepager

#else  // !STATEPAGER_WITH_CUDA

namespace statepager {

std::unique_ptr<Device> make_cuda_device(int /*ordinal*/) {
  throw DeviceError(
      "statepager was built without the CUDA toolkit: rebuild on a machine with nvcc/cuda.h");
}

bool cuda_available() { return false; }

}  // namespace statepager

#endif  // STATEPAGER_WITH_CUDA
