// measure_mapping: what a Device takes to map and unmap pages, per GiB, without any pager
// work in between (Note [Mapping costs per call, not per byte] in docs/design.md; `bench
// pager` reports it beside the pager's own figures).
//
// Errors: UsageError for rounds < 1, a page of 0 bytes or larger than total_bytes, or a
// page that is not a multiple of the device's granularity, before anything is reserved;
// the device's own errors (OutOfMemoryError, DeviceError) otherwise, after what was
// mapped, created and reserved is given back. Thread-safety: none needed (it owns what
// it creates; the device's calls are thread-safe).
#pragma once

#include <cstddef>

#include "allocator/device.h"

namespace statepager {

struct MapCost {
  double map_s_per_gib = 0;    // map + set access
  double unmap_s_per_gib = 0;
};

// Maps then unmaps `total_bytes` (rounded down to whole pages) of a fresh reservation in
// pages of `page_size`, `rounds` times; the pages are created once, untimed, as the
// page pool recycles them.
MapCost measure_mapping(Device& device, size_t page_size, size_t total_bytes, int rounds);

}  // namespace statepager
