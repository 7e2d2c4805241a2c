// Helpers over lists of tensors (python/tensor_lists.h).
#include "python/tensor_lists.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "backing/errors.h"

#ifdef STATEPAGER_WITH_KERNELS
#include "kernels/codecs.h"  // KernelError
#include "kernels/copies.h"
#endif

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

// A copy of each target with elements, taken by dense_copies: a dense target's bytes (in
// memory order) in one buffer on the targets' device, each at a multiple of `align`
// bytes; a target with gaps or overlaps, or a lazily conjugated or negated view (whose
// bytes are not its values), copied as a tensor of its own. pairs() makes the (target,
// its copy) views only when asked (a put-back, a test): making them as the copies are
// taken cost the step's host a few tensor operations per target.
class DenseCopies {
 public:
  struct Entry {
    torch::Tensor target;
    int64_t offset;     // in the buffer; -1: `own` holds the copy
    int64_t bytes;      // the target's, when copied into the buffer
    torch::Tensor own;  // a target copied as a tensor of its own
  };

  DenseCopies(torch::Tensor buffer, std::vector<Entry> entries)
      : buffer_(std::move(buffer)), entries_(std::move(entries)) {}

  size_t size() const { return entries_.size(); }

  std::vector<std::pair<torch::Tensor, torch::Tensor>> pairs() const {
    torch::NoGradGuard no_grad;  // the views record nothing for autograd
    std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
    out.reserve(entries_.size());
    for (const Entry& e : entries_) {
      if (e.offset < 0) {
        out.emplace_back(e.target, e.own);
        continue;
      }
      if (!in_buffer(e.target) || byte_size(e.target) != e.bytes) {
        throw UsageError("DenseCopies.pairs: a target was resized or re-laid out since its "
                         "copy was taken: its copy no longer matches it");
      }
      out.emplace_back(flat(e.target), buffer_.slice(0, e.offset, e.offset + e.bytes)
                                           .view(e.target.scalar_type()));
    }
    return out;
  }

  // Whether t's bytes are its values, dense in memory order: copied into the buffer.
  static bool in_buffer(const torch::Tensor& t) {
    return t.is_non_overlapping_and_dense() && !t.is_conj() && !t.is_neg();
  }

  static int64_t byte_size(const torch::Tensor& t) {
    return t.numel() * static_cast<int64_t>(t.element_size());
  }

 private:
  torch::Tensor buffer_;  // undefined where no target is in it
  std::vector<Entry> entries_;
};

// The dense targets' bytes into their places in `buffer`, now: on the host backend by
// memcpy; on CUDA on `stream`, in one batched copy where the kernels are built; else (or
// on another device) by torch's copies, on the current stream.
void copy_into(const torch::Tensor& buffer, const std::vector<DenseCopies::Entry>& entries,
               uintptr_t stream) {
  auto* base = static_cast<char*>(buffer.data_ptr());
  if (buffer.is_cpu()) {
    for (const auto& e : entries) {
      if (e.offset >= 0) std::memcpy(base + e.offset, e.target.data_ptr(), e.bytes);
    }
    return;
  }
#ifdef STATEPAGER_WITH_KERNELS
  if (buffer.is_cuda()) {
    std::vector<kernels::ByteCopy> copies;
    for (const auto& e : entries) {
      if (e.offset >= 0) copies.push_back({e.target.data_ptr(), base + e.offset, e.bytes});
    }
    try {
      kernels::copy_bytes(copies, buffer.get_device(), reinterpret_cast<void*>(stream));
    } catch (const kernels::KernelError& err) {
      throw DeviceError(err.what());
    }
    return;
  }
#endif
  for (const auto& e : entries) {
    if (e.offset >= 0) {
      buffer.slice(0, e.offset, e.offset + e.bytes).view(e.target.scalar_type()).copy_(
          flat(e.target));
    }
  }
}

// dense_copies(targets, align, stream): a DenseCopies of the targets, their bytes copied
// now; `stream` must be the cuda_stream of the targets' device's current torch stream (0
// on the host backend), where the buffer is allocated and the other copies run.
DenseCopies dense_copies(const std::vector<torch::Tensor>& targets, int64_t align,
                         uintptr_t stream) {
  if (align <= 0) throw UsageError("dense_copies: align must be positive");
  torch::NoGradGuard no_grad;  // the copies record nothing for autograd
  std::vector<DenseCopies::Entry> entries;
  int64_t total = 0;
  for (const torch::Tensor& t : targets) {
    if (t.numel() == 0) continue;
    if (!entries.empty() && t.device() != entries.front().target.device()) {
      throw UsageError("dense_copies: the targets lie on more than one device");
    }
    if (DenseCopies::in_buffer(t)) {
      const int64_t bytes = DenseCopies::byte_size(t);
      entries.push_back({t, total, bytes, {}});
      total += (bytes + align - 1) / align * align;
    } else {
      torch::Tensor own = torch::empty_like(t);
      own.copy_(t);
      entries.push_back({t, -1, 0, own});
    }
  }
  torch::Tensor buffer;
  if (total > 0) {
    buffer = torch::empty({total}, torch::TensorOptions().dtype(torch::kUInt8).device(
                                       entries.front().target.device()));
    copy_into(buffer, entries, stream);
  }
  return DenseCopies(std::move(buffer), std::move(entries));
}

// Step counters (torch's Adam keeps one per parameter: a 0-dim CPU tensor) read and
// written as numbers: what a multi-tensor add and copy and an item() per counter cost the
// fused step's host ~50 microseconds a bucket. Float32 and float64 counters only, not
// inference tensors (which torch refuses to write in place outside inference mode); the
// caller takes torch's way for others (nullopt).
bool plain_counter(const torch::Tensor& t) {
  return t.is_cpu() && t.numel() == 1 && t.layout() == torch::kStrided && !t.is_inference() &&
         (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kFloat64);
}

// Per value, its number where it is a count: a 0-dim float32 or float64 CPU tensor (strided)
// holding a whole number, whose number then holds every bit (UndoCopies.copy_state keeps a
// step counter so); nullopt for any other. One call for a bucket's counters instead of an
// item() each, which lets go of the GIL (a handover to the training thread, on the step's
// own thread).
std::vector<std::optional<double>> whole_counts(const std::vector<torch::Tensor>& values) {
  std::vector<std::optional<double>> out;
  out.reserve(values.size());
  for (const torch::Tensor& t : values) {
    std::optional<double> count;
    // Not a negated view: its bytes are not its value (item() resolves the bit).
    if (t.is_cpu() && t.dim() == 0 && t.layout() == torch::kStrided && !t.is_neg() &&
        (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kFloat64)) {
      const double v = t.scalar_type() == torch::kFloat32
                           ? static_cast<double>(*t.data_ptr<float>())
                           : *t.data_ptr<double>();
      if (std::isfinite(v) && std::floor(v) == v) count = v;
    }
    out.push_back(count);
  }
  return out;
}

// Each counter's value plus one, added in its own dtype as torch's add of a float32 one
// (0-dim: the counter's float dtype wins) rounds it.
std::optional<std::vector<double>> counts_after(const std::vector<torch::Tensor>& counts) {
  std::vector<double> after;
  after.reserve(counts.size());
  for (const torch::Tensor& t : counts) {
    if (!plain_counter(t)) return std::nullopt;
    after.push_back(t.scalar_type() == torch::kFloat32
                        ? static_cast<double>(*t.data_ptr<float>() + 1.0f)
                        : *t.data_ptr<double>() + 1.0);
  }
  return after;
}

void set_counts(const std::vector<torch::Tensor>& counts, const std::vector<double>& values) {
  if (counts.size() != values.size()) {
    throw UsageError("set_counts: counts and values differ in length");
  }
  for (const torch::Tensor& t : counts) {
    if (!plain_counter(t)) {
      throw UsageError("set_counts: each counter must be a one-element float32 or float64 "
                       "CPU tensor, not an inference tensor");
    }
  }
  for (size_t i = 0; i < counts.size(); i++) {
    if (counts[i].scalar_type() == torch::kFloat32) {
      *counts[i].data_ptr<float>() = static_cast<float>(values[i]);
    } else {
      *counts[i].data_ptr<double>() = values[i];
    }
    counts[i].unsafeGetTensorImpl()->bump_version();  // an in-place write, as torch's
  }
}

// The exceptions the residual encode listed for each of its masters (codecs.
// PendingExceptions.finish): master i's are counts[i] of its room of capacities[i] in `idx`
// and `bits`, one after another. Those with 0 < count <= room are copied out together, two
// copies for all (the room's buffers then go); the others are nullopt: none, or more than
// the room held (the caller lists them again).
using Exceptions = std::pair<torch::Tensor, torch::Tensor>;
std::vector<std::optional<Exceptions>> listed_exceptions(const torch::Tensor& idx,
                                                         const torch::Tensor& bits,
                                                         const std::vector<int64_t>& capacities,
                                                         const std::vector<int64_t>& counts) {
  if (capacities.size() != counts.size()) {
    throw UsageError("listed_exceptions: capacities and counts differ in length");
  }
  int64_t room = 0;
  bool negative = false;
  for (const int64_t c : capacities) {
    negative |= c < 0;
    room += c;
  }
  if (negative || idx.numel() != bits.numel() || room > idx.numel()) {
    throw UsageError("listed_exceptions: idx and bits must be equally long and hold the "
                     "capacities' sum");
  }
  std::vector<torch::Tensor> idx_parts, bits_parts;
  std::vector<int64_t> sizes;
  int64_t offset = 0;
  for (size_t i = 0; i < counts.size(); i++) {
    if (counts[i] > 0 && counts[i] <= capacities[i]) {
      idx_parts.push_back(idx.narrow(0, offset, counts[i]));
      bits_parts.push_back(bits.narrow(0, offset, counts[i]));
      sizes.push_back(counts[i]);
    }
    offset += capacities[i];
  }
  std::vector<std::optional<Exceptions>> out(counts.size());
  if (sizes.empty()) return out;
  const std::vector<torch::Tensor> idx_out = torch::cat(idx_parts).split_with_sizes(sizes);
  const std::vector<torch::Tensor> bits_out = torch::cat(bits_parts).split_with_sizes(sizes);
  for (size_t i = 0, j = 0; i < counts.size(); i++) {
    if (counts[i] > 0 && counts[i] <= capacities[i]) {
      out[i] = Exceptions{idx_out[j], bits_out[j]};
      j++;
    }
  }
  return out;
}

// A tensor's identity and where its bytes are, (id, data_ptr or None where it has none: a
// meta or fake tensor), or None for anything but a strided tensor: a tensor whose data was
// set anew gets another key.
py::object tensor_key(py::handle v) {
  if (!THPVariable_Check(v.ptr())) return py::none();
  const at::Tensor& t = THPVariable_Unpack(v.ptr());
  if (t.layout() != torch::kStrided) return py::none();
  py::object bytes = py::none();
  try {
    bytes = py::int_(reinterpret_cast<uintptr_t>(t.data_ptr()));
  } catch (const c10::Error&) {  // no storage: never the pager's
  }
  return py::make_tuple(reinterpret_cast<uintptr_t>(v.ptr()), bytes);
}

// What StateLayout.forms() finds a parameter's stored forms from: p's key and, in order,
// each state entry's (name, key). Five Python calls an entry cost the step's set-up
// about 8 microseconds a parameter.
py::tuple state_key(py::handle p, const py::dict& state) {
  py::tuple entries(state.size());
  size_t i = 0;
  for (const auto& [name, v] : state) {
    entries[i++] = py::make_tuple(name, tensor_key(v));
  }
  return py::make_tuple(tensor_key(p), entries);
}

}  // namespace

void bind_tensor_lists(py::module_& m) {
  m.def("page_runs", &page_runs, py::arg("tensors"), py::arg("page"),
        "The pages of `page` bytes the tensors' elements touch, by address (data_ptr() to "
        "data_ptr() + numel * element_size), as sorted disjoint (first, last) runs");
  py::class_<DenseCopies>(m, "DenseCopies")
      .def("__len__", &DenseCopies::size)
      .def("pairs", &DenseCopies::pairs,
           "[(target, its copy)]: a dense target as its flat view in memory order, its "
           "copy a slice of the buffer; others as themselves, each copy a tensor of its own. "
           "UsageError where a target was resized or re-laid out since");
  m.def("dense_copies", &dense_copies, py::arg("targets"), py::arg("align"), py::arg("stream"),
        "A DenseCopies of each target with elements, copied now on `stream` (the current "
        "torch stream's cuda_stream; 0 on the host backend): the dense ones into one buffer, "
        "each starting on a multiple of `align` bytes");
  m.def("counts_after", &counts_after, py::arg("counts"),
        "Each step counter's value plus one, as torch adds it in the counter's dtype; None "
        "unless every counter is a one-element float32 or float64 CPU tensor");
  m.def("whole_counts", &whole_counts, py::arg("values"),
        "Per tensor, its number where it is a 0-dim float32 or float64 CPU tensor holding a "
        "whole number; None for any other");
  m.def("set_counts", &set_counts, py::arg("counts"), py::arg("values"),
        "Sets each step counter (a one-element float32 or float64 CPU tensor) to its value");
  m.def("state_key", &state_key, py::arg("p"), py::arg("state"),
        "(p's key, ((name, key) of each entry of its state dict, in order)): a key is "
        "(id, data_ptr or None where it has no storage) of a strided tensor, None for "
        "anything else");
  m.def("listed_exceptions", &listed_exceptions, py::arg("idx"), py::arg("bits"),
        py::arg("capacities"), py::arg("counts"),
        "Per master, its listed residual exceptions (idx, bits), copied out of its room in "
        "the encode's buffers (capacities[i] each, in order) where 0 < counts[i] <= its "
        "room; None for the others");
}

}  // namespace statepager
