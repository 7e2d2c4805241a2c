// parallel_for: fn(i) for every i in [0, n), on up to `threads` threads (the caller's
// among them), each taking the next index in order, so the items finish roughly in order.
//
// Errors: the first exception fn throws stops the taking of new indices; the calls under
// way finish, and it is rethrown on the calling thread once every thread has joined.
// Thread-safety: fn runs concurrently with itself; it guards what its calls share.
#pragma once

#include <cstddef>
#include <functional>

namespace statepager {

void parallel_for(size_t n, unsigned threads, const std::function<void(size_t)>& fn);

}  // namespace statepager
