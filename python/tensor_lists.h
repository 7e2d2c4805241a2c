// statepager._C's helpers over lists of tensors: what the step's pipeline does to every
// tensor of a bucket, in one call instead of a Python loop (a few microseconds a tensor).
#pragma once

#include <torch/extension.h>

namespace statepager {

// Adds page_runs, dense_copies (with its DenseCopies), whole_counts, counts_after,
// set_counts, listed_exceptions and state_key to `m`. All hold the GIL: page_runs and
// state_key read addresses, the counters' calls read and write CPU scalars in place,
// listed_exceptions queues two copies on the current stream (torch's cat), dense_copies
// queues its copies on the stream it is given (the current torch stream's) and waits for
// none (its buffer comes from torch's caching allocator, as a Python torch.empty's would,
// on the current stream).
// A DenseCopies owns its buffer and keeps its targets alive; its targets must keep their
// size and layout until pairs() (which refuses one that did not). Errors are UsageError
// (bad arguments), DeviceError (a refused launch) or torch's own (a closed Pager's tensor
// has no data).
void bind_tensor_lists(pybind11::module_& m);

}  // namespace statepager
