// The C entry points of torch.cuda.memory.CUDAPluggableAllocator, routed into Pagers.
//
// statepager_alloc() serves the Pager set for the device by route_device() (what
// Pager.scope() does on entry); each segment becomes a resident extent, mapped at once so
// constructors can write it. statepager_free() finds the Pager whose arena holds the
// pointer. PyTorch calls free only when a MemPool is destroyed, possibly after the Pager
// was closed or dropped: the entry points stay valid for the life of the process and
// ignore what they no longer know.
//
// Thread-safety: all functions may be called from any thread. They are called under the
// caching allocator's lock, so they never call back into PyTorch.
// Errors: statepager_alloc returns nullptr on any failure (PyTorch then frees its cache
// and retries, or raises its out-of-memory error); it never throws or aborts.
#pragma once

#include <cstddef>
#include <memory>

#include "allocator/pager.h"

namespace statepager {

// Routes allocations for CUDA device `device` to `pager` (nullptr: no routing).
void route_device(int device, std::shared_ptr<Pager> pager);

}  // namespace statepager

extern "C" {
__attribute__((visibility("default"))) void* statepager_alloc(size_t size, int device,
                                                              void* stream);
__attribute__((visibility("default"))) void statepager_free(void* ptr, size_t size, int device,
                                                            void* stream);
}
