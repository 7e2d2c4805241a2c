// statepager._C.kernels: the CUDA codec kernels (kernels/codecs.h) over torch tensors.
#pragma once

#include <torch/extension.h>

namespace statepager {

// Adds the submodule `kernels` to `m` when the extension was built with the kernels
// (nvcc found at build time); `m.KERNELS_BUILT` says which.
void bind_kernels(pybind11::module_& m);

}  // namespace statepager
