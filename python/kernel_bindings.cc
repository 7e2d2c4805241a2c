// The bindings of kernels/codecs.h. Each function checks its tensors (UsageError naming
// the argument) and enqueues the kernel on `stream`, the cuda_stream of the caller's
// current torch stream; launch failures become DeviceError.
#include "python/kernel_bindings.h"

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "backing/errors.h"

#ifdef STATEPAGER_WITH_KERNELS
#include "allocator/device.h"
#include "kernels/adamw.h"
#include "kernels/codecs.h"
#include "kernels/store_crc.h"
#endif

namespace py = pybind11;

namespace statepager {

#ifdef STATEPAGER_WITH_KERNELS
namespace {

void need(bool ok, const std::string& what) {
  if (!ok) throw UsageError("statepager kernels: " + what);
}

// `t` is a contiguous CUDA tensor of `dtype` on `device` (-1: any; returns its index).
int check(const torch::Tensor& t, const char* name, torch::ScalarType dtype, int device = -1) {
  need(t.is_cuda(), std::string(name) + " must be a CUDA tensor");
  need(t.scalar_type() == dtype, std::string(name) + " must be " + c10::toString(dtype) +
                                     ", not " + c10::toString(t.scalar_type()));
  need(t.is_contiguous(), std::string(name) + " must be contiguous");
  need(device < 0 || t.get_device() == device, std::string(name) + " is on another device");
  return t.get_device();
}

void* as_stream(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

template <class F>
void launch(F&& f) {
  try {
    f();
  } catch (const kernels::KernelError& e) {
    throw DeviceError(e.what());
  }
}

// The device of x (float32), after checking codes (a uint8 per element of x) and scales
// (a float32 per block of kQ8Block) against it.
int check_q8(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales) {
  const int dev = check(x, "x", torch::kFloat32);
  check(codes, "codes", torch::kUInt8, dev);
  check(scales, "scales", torch::kFloat32, dev);
  const int64_t n = x.numel();
  need(codes.numel() == n, "codes must have as many elements as x");
  need(scales.numel() == (n + kernels::kQ8Block - 1) / kernels::kQ8Block,
       "scales must have one element per block of 256");
  return dev;
}

void q8_encode(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
               bool nonneg, uintptr_t stream) {
  const int dev = check_q8(x, codes, scales);
  const int64_t n = x.numel();
  launch([&] {
    kernels::q8_encode(x.data_ptr<float>(), codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                       n, nonneg, dev, as_stream(stream));
  });
}

void q8_decode(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& x,
               bool nonneg, uintptr_t stream) {
  const int dev = check_q8(x, codes, scales);
  const int64_t n = x.numel();
  launch([&] {
    kernels::q8_decode(codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), x.data_ptr<float>(),
                       n, nonneg, dev, as_stream(stream));
  });
}

const uint16_t* bf16_bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

// The tensors of a residual master (fp32 main, bf16 param, int16 residual, exceptions):
// one device, one size; returns the device.
int check_residual(const torch::Tensor& main, const torch::Tensor& param,
                   const torch::Tensor& residual, const torch::Tensor& exc_idx,
                   const torch::Tensor& exc_bits) {
  const int dev = check(main, "main", torch::kFloat32);
  check(param, "param", torch::kBFloat16, dev);
  check(residual, "residual", torch::kInt16, dev);
  check(exc_idx, "exc_idx", torch::kInt64, dev);
  check(exc_bits, "exc_bits", torch::kInt32, dev);
  const int64_t n = main.numel();
  need(param.numel() == n && residual.numel() == n, "main, param and residual differ in size");
  need(exc_idx.numel() == exc_bits.numel(), "exc_idx and exc_bits must be equally long");
  return dev;
}

// The core's CUDA devices' checksum kernel (allocator/device.h, set_cuda_checksum_kernel):
// the store checksums of mapped store copies.
void checksum_kernel(int ordinal, uintptr_t stream, const DeviceRange* ranges, size_t n,
                     uint32_t* out) {
  std::vector<uint64_t> addrs(n), lengths(n);
  for (size_t i = 0; i < n; i++) {
    addrs[i] = ranges[i].addr;
    lengths[i] = ranges[i].bytes;
  }
  kernels::crc32c_ranges(ordinal, as_stream(stream), addrs.data(), lengths.data(), n, out);
}

// crc32c of byte ranges [offset, offset + length) of `x` (a CUDA uint8 tensor) by the
// store checksums' kernel, on `stream`, waited for (the copy of the crcs to pageable
// memory returns once done): what the pager's checks compute.
std::vector<uint32_t> crc32c_of(const torch::Tensor& x,
                                const std::vector<std::pair<int64_t, int64_t>>& ranges,
                                uintptr_t stream) {
  const int dev = check(x, "x", torch::kUInt8);
  std::vector<uint64_t> addrs, lengths;
  for (const auto& [offset, length] : ranges) {
    need(offset >= 0 && length >= 0 && offset + length <= x.numel(),
         "each range (offset, length) must lie within x");
    addrs.push_back(reinterpret_cast<uint64_t>(x.data_ptr<uint8_t>()) + uint64_t(offset));
    lengths.push_back(uint64_t(length));
  }
  std::vector<uint32_t> out(ranges.size());  // pageable: the copy to it is waited for
  py::gil_scoped_release unlocked;
  launch([&] {
    kernels::crc32c_ranges(dev, as_stream(stream), addrs.data(), lengths.data(), addrs.size(),
                           out.data());
  });
  return out;
}

void param_checksum(const torch::Tensor& param, const torch::Tensor& rows, const torch::Tensor& out,
                    uintptr_t stream) {
  const int dev = check(param, "param", torch::kBFloat16);
  check(rows, "rows", torch::kInt64, dev);
  check(out, "out", torch::kInt64, dev);
  const int64_t n = param.numel();
  need(rows.numel() == (n + kernels::kChecksumRow - 1) / kernels::kChecksumRow,
       "rows must have one element per 4096 params");
  need(out.numel() == 1, "out must have one element");
  launch([&] {
    kernels::param_checksum({{bf16_bits(param), n, rows.data_ptr<int64_t>(), out.data_ptr<int64_t>(),
                              nullptr}}, nullptr, dev, as_stream(stream));
  });
}

// Scratch of a call on device `dev`, from torch's caching allocator on the device's current
// stream (the stream the caller passes): as a tensor the caller allocated would be.
torch::Tensor int64_on(int dev, int64_t n) {
  return torch::empty({n}, torch::TensorOptions().dtype(torch::kInt64).device(torch::kCUDA, dev));
}

// A zero `bad` flag (one uint8 the kernels set, never clear) on `dev`.
torch::Tensor bad_flag(int dev) {
  return torch::zeros({1}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA, dev));
}

// The flag as the callers read it: a 0-dim bool, a view (no kernel).
torch::Tensor as_bool(const torch::Tensor& bad) { return bad.view(torch::kBool).view({}); }

// The offsets of `params`' checksum rows in one scratch (each its own rows, as they run at
// once: ceil(n / 4096) each), and their total.
std::pair<std::vector<int64_t>, int64_t> rows_of(const std::vector<torch::Tensor>& params) {
  std::vector<int64_t> at;
  at.reserve(params.size());
  int64_t total = 0;
  for (const torch::Tensor& p : params) {
    at.push_back(total);
    total += (p.numel() + kernels::kChecksumRow - 1) / kernels::kChecksumRow;
  }
  return {at, total};
}

void check_fingerprint(const torch::Tensor& fingerprint, int dev) {
  check(fingerprint, "fingerprint", torch::kInt64, dev);
  need(fingerprint.numel() == 1, "a fingerprint must be one element");
}

// param_checksum of k params in one call, each compared with its fingerprint (a 1-element
// int64 of the same device). Returns a 0-dim bool on their device, True when any differs.
torch::Tensor params_changed_many(const std::vector<torch::Tensor>& params,
                                  const std::vector<torch::Tensor>& fingerprints,
                                  uintptr_t stream) {
  const size_t k = params.size();
  need(fingerprints.size() == k, "params and fingerprints differ in length");
  need(k > 0, "params must not be empty");
  const int dev = check(params[0], "param", torch::kBFloat16);
  for (size_t i = 0; i < k; i++) {
    need(check(params[i], "param", torch::kBFloat16) == dev,
         "the params of one call must be on one device");
    check_fingerprint(fingerprints[i], dev);
  }
  const auto [at, rows] = rows_of(params);
  const torch::Tensor scratch = int64_on(dev, rows + int64_t(k));  // rows, then the sums
  const torch::Tensor bad = bad_flag(dev);
  int64_t* const sums = scratch.data_ptr<int64_t>() + rows;
  std::vector<kernels::Checksum> sums_of;
  sums_of.reserve(k);
  for (size_t i = 0; i < k; i++) {
    sums_of.push_back({bf16_bits(params[i]), params[i].numel(), scratch.data_ptr<int64_t>() + at[i],
                       sums + i, fingerprints[i].data_ptr<int64_t>()});
  }
  {
    py::gil_scoped_release unlocked;  // a launch waits when the device's queue is full
    launch([&] { kernels::param_checksum(sums_of, bad.data_ptr<uint8_t>(), dev, as_stream(stream)); });
  }
  return as_bool(bad);
}

// The residual masters of one bucket, k of them (lists of equal length k): what
// residual_rebuild and a comparison of param_checksum with the fingerprint do per master,
// in one call, so that a bucket of many small parameters costs the host no Python and no
// launch per master. fingerprints[i] (a 1-element int64, or None: not checked) is the
// checksum the residual was encoded against. Returns a 0-dim bool on the masters' device,
// True when any param differs from its fingerprint or any master does not round to its
// param.
torch::Tensor residual_rebuild_many(const std::vector<torch::Tensor>& params,
                                    const std::vector<torch::Tensor>& residuals,
                                    const std::vector<torch::Tensor>& mains,
                                    const std::vector<torch::Tensor>& exc_idx,
                                    const std::vector<torch::Tensor>& exc_bits,
                                    const std::vector<std::optional<torch::Tensor>>& fingerprints,
                                    uintptr_t stream) {
  const size_t k = mains.size();
  need(params.size() == k && residuals.size() == k && exc_idx.size() == k &&
           exc_bits.size() == k && fingerprints.size() == k,
       "params, residuals, mains, exc_idx, exc_bits and fingerprints differ in length");
  need(k > 0, "mains must not be empty");
  const int dev = check(mains[0], "main", torch::kFloat32);
  std::vector<kernels::ResidualRebuild> masters;
  std::vector<torch::Tensor> checked;  // the fingerprinted params
  std::vector<size_t> checked_at;
  masters.reserve(k);
  for (size_t i = 0; i < k; i++) {
    need(check_residual(mains[i], params[i], residuals[i], exc_idx[i], exc_bits[i]) == dev,
         "the masters of one call must be on one device");
    if (fingerprints[i]) {
      check_fingerprint(*fingerprints[i], dev);
      checked.push_back(params[i]);
      checked_at.push_back(i);
    }
    masters.push_back({bf16_bits(params[i]), residuals[i].data_ptr<int16_t>(),
                       mains[i].data_ptr<float>(), mains[i].numel(),
                       exc_idx[i].data_ptr<int64_t>(), exc_bits[i].data_ptr<int32_t>(),
                       exc_idx[i].numel()});
  }
  const torch::Tensor bad = bad_flag(dev);
  std::vector<kernels::Checksum> sums_of;
  torch::Tensor scratch;  // rows, then the sums
  if (!checked.empty()) {
    const auto [at, rows] = rows_of(checked);
    scratch = int64_on(dev, rows + int64_t(checked.size()));
    int64_t* const sums = scratch.data_ptr<int64_t>() + rows;
    for (size_t j = 0; j < checked.size(); j++) {
      const size_t i = checked_at[j];
      sums_of.push_back({bf16_bits(params[i]), params[i].numel(),
                         scratch.data_ptr<int64_t>() + at[j], sums + j,
                         fingerprints[i]->data_ptr<int64_t>()});
    }
  }
  {
    py::gil_scoped_release unlocked;  // a launch waits when the device's queue is full
    launch([&] {
      if (!sums_of.empty()) {
        kernels::param_checksum(sums_of, bad.data_ptr<uint8_t>(), dev, as_stream(stream));
      }
      kernels::residual_rebuild(masters, bad.data_ptr<uint8_t>(), dev, as_stream(stream));
    });
  }
  return as_bool(bad);
}

// The residual masters of one bucket encoded in one call: per master i, residual_encode
// with room for capacities[i] exceptions, at the next offset of one exceptions' buffer for
// all, counted into counts[i]; given `fingerprints`, also its param's checksum into
// fingerprints[i]. Returns (exc_idx int64, exc_bits int32: the capacities' sum each;
// counts int64[k]; fingerprints int64[k] or None), all on the masters' device.
py::tuple residual_encode_many(const std::vector<torch::Tensor>& mains,
                               const std::vector<torch::Tensor>& params,
                               const std::vector<torch::Tensor>& residuals,
                               const std::vector<int64_t>& capacities, bool fingerprints,
                               uintptr_t stream) {
  const size_t k = mains.size();
  need(params.size() == k && residuals.size() == k && capacities.size() == k,
       "mains, params, residuals and capacities differ in length");
  need(k > 0, "mains must not be empty");
  int64_t room = 0;
  for (const int64_t c : capacities) {
    need(c >= 0, "capacities must not be negative");
    room += c;
  }
  const int dev = check(mains[0], "main", torch::kFloat32);
  const auto [at, rows] = fingerprints ? rows_of(params) : std::pair{std::vector<int64_t>{}, int64_t{0}};
  // One buffer for the exceptions' indices, their bits (int32, two to an element) and the
  // checksums' rows; one for the counts (zeroed) and fingerprints.
  const int64_t bits_room = (room + 1) / 2;
  const torch::Tensor listed = int64_on(dev, room + bits_room + rows);
  const torch::Tensor exc_idx = listed.narrow(0, 0, room);
  const torch::Tensor exc_bits = listed.narrow(0, room, bits_room).view(torch::kInt32).narrow(0, 0, room);
  const torch::Tensor counted = int64_on(dev, 2 * int64_t(k));
  const torch::Tensor counts = counted.narrow(0, 0, int64_t(k));
  counts.zero_();
  const torch::Tensor sums = counted.narrow(0, int64_t(k), int64_t(k));
  std::vector<kernels::ResidualEncode> masters;
  masters.reserve(k);
  int64_t offset = 0;
  for (size_t i = 0; i < k; i++) {
    need(check_residual(mains[i], params[i], residuals[i], exc_idx, exc_bits) == dev,
         "the masters of one call must be on one device");
    masters.push_back({mains[i].data_ptr<float>(), bf16_bits(params[i]),
                       residuals[i].data_ptr<int16_t>(), mains[i].numel(),
                       exc_idx.data_ptr<int64_t>() + offset, exc_bits.data_ptr<int32_t>() + offset,
                       capacities[i], counts.data_ptr<int64_t>() + i});
    offset += capacities[i];
  }
  std::vector<kernels::Checksum> sums_of;
  if (fingerprints) {
    int64_t* const row = listed.data_ptr<int64_t>() + room + bits_room;
    sums_of.reserve(k);
    for (size_t i = 0; i < k; i++) {
      sums_of.push_back({bf16_bits(params[i]), params[i].numel(), row + at[i],
                         sums.data_ptr<int64_t>() + i, nullptr});
    }
  }
  {
    py::gil_scoped_release unlocked;  // a launch waits when the device's queue is full
    launch([&] {
      if (!sums_of.empty()) kernels::param_checksum(sums_of, nullptr, dev, as_stream(stream));
      kernels::residual_encode(masters, dev, as_stream(stream));
    });
  }
  return py::make_tuple(exc_idx, exc_bits, counts,
                        fingerprints ? py::cast(sums) : py::none());
}

// `t` holds n elements laid out as `param` (same strides, dense): the fused step walks
// every tensor of a parameter in memory order, element i of each the same element.
void check_like(const torch::Tensor& t, const torch::Tensor& param, const std::string& name) {
  need(t.numel() == param.numel(), name + " must have as many elements as its param");
  need(t.is_non_overlapping_and_dense() &&
           (t.strides() == param.strides() || (t.is_contiguous() && param.is_contiguous())),
       name + " must be dense and laid out as its param (its strides)");
}

// One moment's stored tensors: [fp32, laid out as param] / [bf16, contiguous] / [q8 codes
// (uint8 or int8), q8 scales (fp32)], both contiguous.
kernels::Moment moment(const std::vector<torch::Tensor>& t, const std::string& format,
                       const std::string& name, int dev, const torch::Tensor& param) {
  const std::string what = name + " (" + format + ")";
  const int64_t n = param.numel();
  if (format == "fp32" || format == "bf16") {
    need(t.size() == 1, what + " must be one tensor");
    need(t[0].is_cuda() && t[0].get_device() == dev, what + " must be on its param's device");
    need(t[0].scalar_type() == (format == "fp32" ? torch::kFloat32 : torch::kBFloat16),
         what + " has dtype " + c10::toString(t[0].scalar_type()));
    if (format == "fp32") {
      check_like(t[0], param, what);
    } else {
      need(t[0].is_contiguous() && t[0].numel() == n,
           what + " must be contiguous, with as many elements as its param");
    }
    return {t[0].data_ptr(), nullptr};
  }
  need(format == "q8", "unknown moment format '" + format + "': use fp32, bf16 or q8");
  need(t.size() == 2, what + " must be two tensors, codes and scales");
  need(t[0].scalar_type() == torch::kUInt8 || t[0].scalar_type() == torch::kChar,
       what + ": codes must be uint8 or int8");
  need(t[0].is_cuda() && t[0].get_device() == dev && t[0].is_contiguous(),
       what + ": codes must be contiguous, on its param's device");
  check(t[1], (name + " scales").c_str(), torch::kFloat32, dev);
  need(t[0].numel() == n && t[1].numel() == (n + kernels::kQ8Block - 1) / kernels::kQ8Block,
       what + ": codes must have as many elements as param, scales one per 256");
  return {t[0].data_ptr(), t[1].data_ptr<float>()};
}

// The kernel's scalars for hyperparameters (lr, beta1, beta2, eps, weight_decay) at step
// count `step`: torch 2.11's _multi_tensor_adam host arithmetic, expression for
// expression, in doubles (pow: the libm function Python's ** calls), then rounded to fp32
// as torch rounds a Python number for a float tensor's op.
kernels::AdamWScalars adamw_scalars(const std::vector<double>& h, double step) {
  const double lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4];
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  need(bias_correction1 != 0, "betas[0] = " + std::to_string(beta1) + " makes 1 - beta1 ** step "
                              "zero (torch's step divides by it): use betas[0] < 1");
  const double step_size = (lr / bias_correction1) * -1;
  const double decay = 1 - lr * wd;
  return {wd != 0, static_cast<float>(wd != 0 ? decay : 1.0), static_cast<float>(1 - beta1),
          static_cast<float>(beta2), static_cast<float>(1 - beta2),
          static_cast<float>(std::pow(bias_correction2, 0.5)), static_cast<float>(eps),
          static_cast<float>(step_size)};
}

// One AdamW step (kernels/adamw.h) per entry i: params[i] (fp32, dense), grads[i] (laid
// out as it), its moments in formats[i], hypers[i] = (lr, beta1, beta2, eps,
// weight_decay), steps[i] = its step count after this step. Every entry is checked before
// the first launch.
void adamw_step_many(const std::vector<torch::Tensor>& params,
                     const std::vector<torch::Tensor>& grads,
                     const std::vector<std::vector<torch::Tensor>>& exp_avgs,
                     const std::vector<std::vector<torch::Tensor>>& exp_avg_sqs,
                     const std::vector<std::string>& formats,
                     const std::vector<std::vector<double>>& hypers,
                     const std::vector<double>& steps, uintptr_t stream) {
  const size_t k = params.size();
  need(grads.size() == k && exp_avgs.size() == k && exp_avg_sqs.size() == k &&
           formats.size() == k && hypers.size() == k && steps.size() == k,
       "params, grads, exp_avgs, exp_avg_sqs, formats, hypers and steps differ in length");
  std::vector<kernels::AdamWParam> steps_of;
  steps_of.reserve(k);
  int dev = -1;
  for (size_t i = 0; i < k; i++) {
    const torch::Tensor& p = params[i];
    need(p.is_cuda() && p.scalar_type() == torch::kFloat32 && p.is_non_overlapping_and_dense(),
         "params must be dense fp32 CUDA tensors");
    dev = p.get_device();
    need(dev == params[0].get_device(), "params of one call must be on one device (its stream's)");
    need(grads[i].is_cuda() && grads[i].get_device() == dev &&
             grads[i].scalar_type() == torch::kFloat32,
         "grads must be fp32, on their param's device");
    check_like(grads[i], p, "grad");
    need(hypers[i].size() == 5, "hypers must be (lr, beta1, beta2, eps, weight_decay)");
    const std::string& f = formats[i];
    const kernels::MomentFormat format = f == "fp32"   ? kernels::MomentFormat::kFp32
                                         : f == "bf16" ? kernels::MomentFormat::kBf16
                                                       : kernels::MomentFormat::kQ8;
    steps_of.push_back({p.data_ptr<float>(), grads[i].data_ptr<float>(),
                        moment(exp_avgs[i], f, "exp_avg", dev, p),
                        moment(exp_avg_sqs[i], f, "exp_avg_sq", dev, p), format, p.numel(),
                        adamw_scalars(hypers[i], steps[i])});
  }
  if (k == 0) return;
  py::gil_scoped_release unlocked;  // a launch waits when the device's queue is full
  launch([&] { kernels::adamw_step(steps_of, dev, as_stream(stream)); });
}

}  // namespace
#endif

void bind_kernels(py::module_& m) {
#ifdef STATEPAGER_WITH_KERNELS
  m.attr("KERNELS_BUILT") = true;
  auto k = m.def_submodule("kernels", "CUDA codec kernels (see statepager/codecs.py)");
  k.def("q8_encode", &q8_encode, py::arg("x"), py::arg("codes"), py::arg("scales"),
        py::arg("nonneg"), py::arg("stream"));
  k.def("q8_decode", &q8_decode, py::arg("codes"), py::arg("scales"), py::arg("x"),
        py::arg("nonneg"), py::arg("stream"));
  k.def("param_checksum", &param_checksum, py::arg("param"), py::arg("rows"), py::arg("out"),
        py::arg("stream"));
  k.def("params_changed_many", &params_changed_many, py::arg("params"),
        py::arg("fingerprints"), py::arg("stream"));
  k.def("residual_rebuild_many", &residual_rebuild_many, py::arg("params"),
        py::arg("residuals"), py::arg("mains"), py::arg("exc_idx"), py::arg("exc_bits"),
        py::arg("fingerprints"), py::arg("stream"));
  k.def("residual_encode_many", &residual_encode_many, py::arg("mains"), py::arg("params"),
        py::arg("residuals"), py::arg("capacities"), py::arg("fingerprints"), py::arg("stream"));
  k.def("adamw_step_many", &adamw_step_many, py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("formats"), py::arg("hypers"),
        py::arg("steps"), py::arg("stream"));
  k.def("crc32c", &crc32c_of, py::arg("x"), py::arg("ranges"), py::arg("stream"));
  set_cuda_checksum_kernel(&checksum_kernel);
#else
  m.attr("KERNELS_BUILT") = false;
#endif
}

}  // namespace statepager
