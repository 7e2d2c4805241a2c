// statepager._C's helpers over lists of tensors: what the step's pipeline does to every
// tensor of a bucket, in one call instead of a Python loop (a few microseconds a tensor).
#pragma once

#include <torch/extension.h>

namespace statepager {

// Adds page_runs and dense_copies to `m`. Both hold the GIL (they neither block nor wait
// for the device); errors are UsageError (bad arguments) or torch's own.
void bind_tensor_lists(pybind11::module_& m);

}  // namespace statepager
