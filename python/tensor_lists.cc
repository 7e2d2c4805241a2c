// Helpers over lists of tensors (python/tensor_lists.h).
#include "python/tensor_lists.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "backing/errors.h"

namespace py = pybind11;

namespace statepager {
namespace {

using Runs = std::vector<std::pair<uint64_t, uint64_t>>;

// The pages of `page` bytes the tensors' elements touch, by address, as sorted disjoint
// runs (adjacent ones merged).
Runs page_runs(const std::vector<torch::Tensor>& tensors, uint64_t page) {
  if (page == 0) throw UsageError("page_runs: page must be positive");
  Runs runs;
  runs.reserve(tensors.size());
  for (const torch::Tensor& t : tensors) {
    const uint64_t bytes = t.numel() * t.element_size();
    if (bytes == 0) continue;
    const auto at = reinterpret_cast<uintptr_t>(t.data_ptr());
    runs.emplace_back(at / page, (at + bytes - 1) / page);
  }
  std::sort(runs.begin(), runs.end());
  Runs merged;
  for (const auto& [first, last] : runs) {
    if (!merged.empty() && first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, last);
    } else {
      merged.emplace_back(first, last);
    }
  }
  return merged;
}

// t's elements as a 1-D view in memory order (t dense: contiguous or a permutation).
torch::Tensor flat(const torch::Tensor& t) {
  return t.is_contiguous() ? t.view(-1) : t.as_strided({t.numel()}, {1}, t.storage_offset());
}

// (what, its copy) per target with elements, copied now on the current stream: a dense
// target as its flat view, its copy a slice of one buffer on its device, each slice
// starting on a multiple of `align` bytes; a target with gaps or overlaps as itself, its
// copy a tensor of its own. The copies go as one multi-tensor copy per dtype.
std::vector<std::pair<torch::Tensor, torch::Tensor>> dense_copies(
    const std::vector<torch::Tensor>& targets, int64_t align) {
  if (align <= 0) throw UsageError("dense_copies: align must be positive");
  torch::NoGradGuard no_grad;  // the views and copies record nothing for autograd
  std::vector<torch::Tensor> kept;
  std::vector<int64_t> sizes;  // 0: not dense
  int64_t total = 0;
  for (const torch::Tensor& t : targets) {
    if (t.numel() == 0) continue;
    if (!kept.empty() && t.device() != kept.front().device()) {
      throw UsageError("dense_copies: the targets lie on more than one device");
    }
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    sizes.push_back(t.is_non_overlapping_and_dense() ? (bytes + align - 1) / align * align : 0);
    total += sizes.back();
    kept.push_back(t);
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> pairs;
  if (kept.empty()) return pairs;
  torch::Tensor buffer;
  if (total > 0) {
    buffer = torch::empty({total}, torch::TensorOptions().dtype(torch::kUInt8).device(
                                       kept.front().device()));
  }
  int64_t at = 0;
  for (size_t i = 0; i < kept.size(); i++) {
    const torch::Tensor& t = kept[i];
    if (sizes[i] > 0) {
      const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
      pairs.emplace_back(flat(t), buffer.slice(0, at, at + bytes).view(t.scalar_type()));
    } else {
      pairs.emplace_back(t, torch::empty_like(t));
    }
    at += sizes[i];
  }
  // One multi-tensor copy per dtype: torch copies a list that mixes them pair by pair.
  std::vector<std::vector<torch::Tensor>> copies, sources;
  std::vector<torch::ScalarType> dtypes;
  for (const auto& [what, copy] : pairs) {
    const auto k = std::find(dtypes.begin(), dtypes.end(), what.scalar_type()) - dtypes.begin();
    if (k == static_cast<long>(dtypes.size())) {
      dtypes.push_back(what.scalar_type());
      copies.emplace_back();
      sources.emplace_back();
    }
    copies[k].push_back(copy);
    sources[k].push_back(what);
  }
  for (size_t k = 0; k < dtypes.size(); k++) torch::_foreach_copy_(copies[k], sources[k]);
  return pairs;
}

}  // namespace

void bind_tensor_lists(py::module_& m) {
  m.def("page_runs", &page_runs, py::arg("tensors"), py::arg("page"),
        "The pages of `page` bytes the tensors' elements touch, by address (data_ptr() to "
        "data_ptr() + numel * element_size), as sorted disjoint (first, last) runs");
  m.def("dense_copies", &dense_copies, py::arg("targets"), py::arg("align"),
        "[(target, its copy)] for each target with elements, copied now on the current "
        "stream: a dense target as its flat view in memory order, its copy a slice of one "
        "buffer starting on a multiple of `align` bytes; others as themselves, each copy a "
        "tensor of its own");
}

}  // namespace statepager
