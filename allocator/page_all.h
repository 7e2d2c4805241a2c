// page_all: a whole set of extents paged out or in at once, in buckets, as pause() and
// resume() page a Pager's state (statepager.core.sleep).
//
// Errors: UsageError for a bucket of 0 bytes, before anything is submitted. Otherwise
// the first error a submission or a bucket raised, rethrown once every bucket submitted
// has been waited for: nothing is left in flight, and each bucket is paged or not as
// Pager::page_in / page_out leave it. Thread-safety: as those calls (any thread); it
// blocks until the last bucket completes.
#pragma once

#include <cstddef>
#include <vector>

#include "allocator/pager.h"

namespace statepager {

// Pages `ids` out (`out`) or in, in buckets of about `bucket_size` (a bucket closes at
// the first extent that takes it to bucket_size or more), all submitted before the first
// is waited for, so that the pager overlaps them. Extents freed meanwhile are skipped.
void page_all(Pager& pager, const std::vector<ExtentId>& ids, size_t bucket_size, bool out);

}  // namespace statepager
