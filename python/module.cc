// statepager._C: the C++ core as seen from Python. Tensors are built over pool extents
// with torch::from_blob; their deleter releases the extents (one, or a tensor's pieces) and
// holds the Pager alive.
#include <torch/extension.h>

#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "allocator/device.h"
#include "allocator/map_cost.h"
#include "allocator/page_all.h"
#include "allocator/pager.h"
#include "allocator/pluggable.h"
#include "allocator/store_restore.h"
#include "allocator/store_snapshot.h"
#include "allocator/trace_range.h"
#include "backing/crc32c.h"
#include "backing/errors.h"
#include "backing/file_copy.h"
#include "backing/raw_io.h"
#include "python/kernel_bindings.h"
#include "python/tensor_lists.h"

namespace py = pybind11;
using namespace statepager;

namespace {

// The storages of the tensors a Pager made (Pager.empty), so that its close() can take
// their memory away from them: a storage marked so makes torch raise (kClosedMessage) on
// any access to its data, where reading the unmapped arena would fault. A null data
// pointer alone does not do: torch 2.11's CPU kernels (sum, add_, clone) read through it.
// Weak: a storage that died is skipped. Deleters run on any thread, hence the mutex.
class PagerStorages {
 public:
  void add(const c10::Storage& s) {
    std::lock_guard lock(mu_);
    if (all_.size() >= 2 * pruned_size_ + 64) {  // amortized: the dead ones go
      std::erase_if(all_, [](const auto& w) { return w.expired(); });
      pruned_size_ = all_.size();
    }
    all_.emplace_back(s.getWeakStorageImpl());
  }
  static constexpr const char* kClosedMessage =
      "statepager: this tensor's Pager is closed, and its memory with it: read what you "
      "need before Pager.close()";

  // Gives each live one a null DataPtr of its device (its bytes' count kept; the old
  // DataPtr's deleter releases the extents) and makes every access to its data raise.
  void cut_off() {
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> all;
    {
      std::lock_guard lock(mu_);
      all.swap(all_);
      pruned_size_ = 0;
    }
    for (auto& w : all) {
      if (auto impl = w.lock()) {
        impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
        impl->release_data_and_set_meta_custom_data_ptr_error_msg_(kClosedMessage);
      }
    }
  }

 private:
  std::mutex mu_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> all_;  // mu_
  size_t pruned_size_ = 0;                                       // mu_
};

struct PyPager {
  std::shared_ptr<Pager> pager;
  torch::Device device{torch::kCPU};
  std::shared_ptr<PagerStorages> storages = std::make_shared<PagerStorages>();

  ExtentId extent_of(const torch::Tensor& t) const {
    pager->check_usable();  // a closed Pager's tensors have no data to look up
    auto id = pager->find(reinterpret_cast<uintptr_t>(t.storage().data()));
    if (!id) throw not_created(t);
    return *id;
  }

  static UsageError not_created(const torch::Tensor& t) {
    std::string shape;
    for (int64_t d : t.sizes()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
    return UsageError("a tensor of shape [" + shape + "] was not created by this Pager: "
                      "create it with Pager.empty()/empty_like() or inside Pager.scope()");
  }

  // The extents holding the tensors' elements: each one's storage's extent, or of a
  // tensor made of pieces (Pager.empty(pieces=...)) the pieces its elements lie in, so
  // that a view of one piece pages that piece alone.
  std::vector<ExtentId> extents_of(const std::vector<torch::Tensor>& tensors) const {
    pager->check_usable();  // a closed Pager's tensors have no data to look up
    std::vector<Pager::ByteRange> ranges;
    ranges.reserve(tensors.size());
    for (const auto& t : tensors) {
      const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
      size_t span = t.numel() == 0 ? 0 : 1;  // elements from the first to the last, inclusive
      for (int64_t d = 0; d < t.dim(); d++) {
        if (t.numel() != 0) span += static_cast<size_t>((t.size(d) - 1) * t.stride(d));
      }
      ranges.push_back({reinterpret_cast<uintptr_t>(t.storage().data()), start,
                        start + span * t.element_size()});
    }
    size_t unknown = tensors.size();
    std::vector<ExtentId> ids = pager->extents_in(ranges, &unknown);
    if (unknown < tensors.size()) throw not_created(tensors[unknown]);
    return ids;
  }

  std::vector<ExtentId> extents_of(const torch::Tensor& t) const {
    return extents_of(std::vector<torch::Tensor>{t});
  }
};

std::unique_ptr<Device> make_device(const std::string& name) {
  const torch::Device d(name);
  if (d.is_cpu()) return make_host_device();
  if (d.is_cuda()) return make_cuda_device(d.has_index() ? d.index() : 0);
  throw UsageError("device '" + name + "' is not supported: use 'cpu' or 'cuda[:N]'");
}

// The torch this extension was compiled against (set by python/CMakeLists.txt), also as a
// marker in the binary: statepager/__init__.py compares _C.TORCH_VERSION with the torch
// imported, and when another torch leaves the extension unloadable, finds it here.
[[gnu::used]] const char kTorchVersionMarker[] =
    "statepager-built-against-torch=" STATEPAGER_TORCH_VERSION;

// Job is opaque outside the core; Python holds it through this box.
struct PyTicket {
  Ticket ticket;
};

// A StoreSnapshot and the Pager it holds ranges of (declared first: destroyed last).
struct PySnapshot {
  std::shared_ptr<Pager> pager;
  std::unique_ptr<StoreSnapshot> snapshot;
};

const char* residency_name(Residency r) {
  switch (r) {
    case Residency::kZero: return "zero";
    case Residency::kFile: return "file";
    case Residency::kResident: return "resident";
    case Residency::kPagingIn: return "paging_in";
    case Residency::kPagingOut: return "paging_out";
    case Residency::kHost: return "host";
  }
  return "?";
}

// Every Pager made here, for residency_of(). Weak: a Pager lives while its Python object
// or any of its tensors (their deleters hold it) does, so a live tensor's Pager is found.
std::mutex live_pagers_mu;
std::vector<std::weak_ptr<Pager>> live_pagers;  // guarded by live_pagers_mu

void register_pager(const std::shared_ptr<Pager>& pager) {
  std::lock_guard lock(live_pagers_mu);
  std::erase_if(live_pagers, [](const std::weak_ptr<Pager>& w) { return w.expired(); });
  live_pagers.push_back(pager);
}

// The residency of the pager extent that is t's storage, in whichever live Pager made it;
// nullopt for any other tensor (also one without storage or data pointer). Never throws.
std::optional<std::string> residency_of(const torch::Tensor& t) {
  uintptr_t addr = 0;
  try {
    if (!t.defined() || !t.has_storage()) return std::nullopt;
    addr = reinterpret_cast<uintptr_t>(t.storage().data());
  } catch (const c10::Error&) {  // e.g. fake or functional tensors: no data pointer
    return std::nullopt;
  }
  if (addr == 0) return std::nullopt;
  std::lock_guard lock(live_pagers_mu);
  for (const auto& w : live_pagers) {
    const std::shared_ptr<Pager> pager = w.lock();
    if (!pager) continue;
    if (auto id = pager->find(addr)) return std::string(residency_name(pager->residency(*id)));
  }
  return std::nullopt;
}

// Bytes a tensor of `shape` (laid out by `strides`, or contiguous) spans: its numel when
// contiguous, else 1 + the offset of its last element, so no element lies past its extent.
// UsageError for negative sizes or strides, a stride per dimension missing, or overflow.
size_t tensor_bytes(const std::vector<int64_t>& shape,
                    const std::optional<std::vector<int64_t>>& strides, at::ScalarType scalar) {
  auto describe = [&] {
    std::string dims;
    for (int64_t s : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(s);
    return "Pager.empty: shape [" + dims + "] of " + std::string(c10::toString(scalar));
  };
  if (strides && strides->size() != shape.size()) {
    throw UsageError(describe() + ": " + std::to_string(strides->size()) +
                     " strides for " + std::to_string(shape.size()) +
                     " dimensions: give one stride per dimension");
  }
  bool empty = false;
  for (size_t i = 0; i < shape.size(); i++) {
    if (shape[i] < 0) throw UsageError(describe() + " has a negative size: sizes must be >= 0");
    if (strides && (*strides)[i] < 0) {
      throw UsageError(describe() + " has a negative stride: strides must be >= 0");
    }
    empty = empty || shape[i] == 0;
  }
  if (empty) return 0;
  // span = 1 + sum((size - 1) * stride), or the product of the sizes when contiguous.
  uint64_t span = 1;
  bool overflow = false;
  for (size_t i = 0; i < shape.size(); i++) {
    const auto size = static_cast<uint64_t>(shape[i]);
    if (strides) {
      uint64_t step = 0;
      const auto stride = static_cast<uint64_t>((*strides)[i]);
      overflow = overflow || __builtin_mul_overflow(size - 1, stride, &step) ||
                 __builtin_add_overflow(span, step, &span);
    } else {
      overflow = overflow || __builtin_mul_overflow(span, size, &span);
    }
  }
  uint64_t bytes = 0;
  overflow = overflow || __builtin_mul_overflow(span, uint64_t(c10::elementSize(scalar)), &bytes);
  if (overflow || bytes > static_cast<uint64_t>(INT64_MAX)) {
    throw UsageError(describe() + " needs 2^63 bytes or more: no tensor can be that large");
  }
  return bytes;
}

// Bytes of a tensor of `shape` and `scalar`, refused (UsageError) when a size is negative
// or the bytes do not fit in an int64 (torch's limit), so no size can wrap around.
size_t tensor_bytes(const std::vector<int64_t>& shape, at::ScalarType scalar) {
  auto describe = [&] {
    std::string dims;
    for (int64_t s : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(s);
    return "Pager.empty: shape [" + dims + "] of " + c10::toString(scalar);
  };
  size_t bytes = c10::elementSize(scalar);
  bool overflow = false, empty = false;
  for (int64_t s : shape) {
    if (s < 0) throw UsageError(describe() + " has a negative size: sizes must be >= 0");
    empty = empty || s == 0;
    overflow = overflow || __builtin_mul_overflow(bytes, static_cast<size_t>(s), &bytes);
  }
  if (empty) return 0;
  if (overflow || bytes > static_cast<size_t>(INT64_MAX)) {
    throw UsageError(describe() + " needs 2^63 bytes or more: no tensor can be that large");
  }
  return bytes;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "statepager core (C++): Pager over a virtual-memory pool and an io_uring store";

  auto base = py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<UsageError>(m, "UsageError", base.ptr());
  auto io = py::register_exception<IoError>(m, "StoreIOError", base.ptr());
  py::register_exception<NoSpaceError>(m, "NoSpaceError", io.ptr());
  py::register_exception<StorePermissionError>(m, "StorePermissionError", io.ptr());
  py::register_exception<CorruptStoreError>(m, "CorruptStoreError", base.ptr());
  py::register_exception<StoreBusyError>(m, "StoreBusyError", base.ptr());
  // Also a torch.OutOfMemoryError (= torch.cuda.OutOfMemoryError), so handlers written
  // for torch's own out-of-memory catch the pool's.
  const py::object torch_oom = py::module_::import("torch").attr("OutOfMemoryError");
  py::register_exception<OutOfMemoryError>(m, "OutOfMemoryError", py::make_tuple(base, torch_oom));
  py::register_exception<DeviceError>(m, "DeviceError", base.ptr());
  py::register_exception<IoUringUnavailableError>(m, "IoUringUnavailableError", base.ptr());

  m.attr("TORCH_VERSION") = STATEPAGER_TORCH_VERSION;
  bind_kernels(m);
  bind_tensor_lists(m);

  m.def("cuda_available", &cuda_available, "True when a CUDA driver and device are present");
  m.def("residency_of", &residency_of, py::arg("tensor"),
        "Residency ('zero', 'file', 'host', 'resident', 'paging_in', 'paging_out') of the pager "
        "tensor whose storage `tensor` uses, whichever live Pager made it; None for any "
        "other tensor");
  m.def(
      "storage_use_count", [](const torch::Tensor& t) { return t.storage().use_count(); },
      py::arg("tensor"),
      "Tensors (and storage handles) sharing t's storage: 1 when nothing else refers to it");
  m.def(
      "route_device",
      [](int device, PyPager* pager) { route_device(device, pager ? pager->pager : nullptr); },
      py::arg("device"), py::arg("pager").none(true),
      "Routes statepager_alloc for `device` to `pager` (None: stop routing)");

  m.def(
      "crc32c",
      [](const py::object& data, uint32_t value) {
        Py_buffer view;  // its bytes, contiguous (else the object's BufferError)
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
          throw py::error_already_set();
        }
        uint32_t crc;
        {
          py::gil_scoped_release release;
          crc = crc32c(value, view.buf, static_cast<size_t>(view.len));
        }
        PyBuffer_Release(&view);
        return crc;
      },
      py::arg("data"), py::arg("value") = 0,
      "crc32c of the buffer's bytes, continuing `value` (as zlib.crc32 chains)");
  m.attr("CRC32C_ENGINE") = crc32c_engine();

  m.def(
      "copy_file",
      [](const std::string& src, const std::string& dst) {
        py::gil_scoped_release release;
        return std::string(copy_method_name(copy_file(src, dst)));
      },
      py::arg("src"), py::arg("dst"),
      "Copies file src to dst (reflink, else copy_file_range, else read/write) and fsyncs "
      "it; returns the method used");

  py::class_<PySnapshot>(m, "StoreSnapshot")
      .def_property_readonly("placements",
                             [](const PySnapshot& s) {
                               py::list out;
                               for (const Placement& p : s.snapshot->placements()) {
                                 out.append(py::make_tuple(residency_name(p.state), p.bytes,
                                                           p.store_bytes));
                               }
                               return out;
                             },
                             "(residency, bytes, store_bytes) per tensor, in order")
      .def("copy_to",
           [](PySnapshot& s, const std::vector<std::string>& files,
              const std::vector<std::pair<unsigned, uint64_t>>& targets, uint64_t chunk_bytes) {
             std::vector<StoreSnapshot::Target> t;
             for (auto [file, offset] : targets) t.push_back({file, offset});
             StoreSnapshot::Copied copied;
             {
               py::gil_scoped_release release;
               copied = s.snapshot->copy_to(files, t, chunk_bytes);
             }
             return py::make_tuple(copy_method_name(copied.method), copied.crcs);
           },
           py::arg("files"), py::arg("targets"), py::arg("chunk_bytes") = 0,
           "(method, crcs): crcs[i] the crc32c per chunk_bytes of tensor i's store range "
           "(none when chunk_bytes is 0), computed while copying")
      .def("release", [](PySnapshot& s) { s.snapshot->release(); },
           py::call_guard<py::gil_scoped_release>());

  py::class_<TraceRange>(m, "TraceRange",
                         "A named range on NVIDIA profilers' timelines (allocator/trace_range.h)")
      .def(py::init<>())
      .def(
          "start",
          [](TraceRange& r, const std::string& name, const std::string& kind) {
            static const std::map<std::string, TraceKind> kinds = {
                {"read", TraceKind::kRead}, {"step", TraceKind::kStep}, {"write", TraceKind::kWrite}};
            const auto it = kinds.find(kind);
            if (it == kinds.end()) {
              throw UsageError("TraceRange.start: kind must be 'read', 'step' or 'write', not '" +
                               kind + "'");
            }
            r.start(name, it->second);
          },
          py::arg("name"), py::arg("kind"))
      .def("end", &TraceRange::end);
  m.attr("NVTX") = TraceRange::compiled_in();

  py::class_<PyTicket>(m, "Ticket")
      .def_property_readonly("times", [](const PyTicket& t) { return job_times(*t.ticket); });

  m.def(
      "measure_mapping",
      [](const std::string& device, size_t page_size, size_t total_bytes, int rounds) {
        MapCost c;
        {
          py::gil_scoped_release release;
          c = measure_mapping(*make_device(device), page_size, total_bytes, rounds);
        }
        return py::dict(py::arg("map_s_per_gib") = c.map_s_per_gib,
                        py::arg("unmap_s_per_gib") = c.unmap_s_per_gib);
      },
      py::arg("device"), py::arg("page_size"), py::arg("total_bytes"), py::arg("rounds") = 3);

  m.def(
      "measure_raw_io",
      [](const std::string& dir, uint64_t bytes, size_t block, unsigned depth, bool read,
         bool write) {
        RawIoResult r;
        {
          py::gil_scoped_release release;
          r = measure_raw_io(dir, bytes, block, depth, read, write);
        }
        return py::dict(py::arg("read_gbps") = r.read_gbps, py::arg("write_gbps") = r.write_gbps,
                        py::arg("seconds") = r.seconds);
      },
      py::arg("dir"), py::arg("bytes"), py::arg("block"), py::arg("depth"), py::arg("read"),
      py::arg("write"),
      "Raw sequential bandwidth of the store's io_uring engine, read and/or write at once");

  // The GIL is released (kvcached's torch_bindings.cpp does the same) around every call
  // that can wait: for buckets in flight (wait, close, epochs), for page-outs to return
  // pages at the budget (page_in), for the device's stream (page_out, discard), for
  // copies (restore, snapshots, pause/resume's page_all) or for the device (trim). Held,
  // it would deadlock: a page-out into a range that a background save holds completes
  // only when the save's Python thread copies that range, and that thread needs the GIL.
  // py::call_guard releases it after the arguments are converted and takes it back before
  // the result is; the bodies touch no Python object (at::Tensor is C++). Calls that only
  // read or set the core's state under its mutex (never held across a wait) keep it.
  using release_gil = py::call_guard<py::gil_scoped_release>;

  py::class_<PyPager>(m, "Pager")
      .def(py::init([](const std::string& directory, const std::string& device,
                       size_t page_size, size_t hbm_budget, size_t keep,
                       size_t arena_size, unsigned io_depth, size_t io_block,
                       bool direct_io, size_t host_budget, bool map_ram) {
             PagerOptions o;
             o.directory = directory;
             o.pool.page_size = page_size;
             o.pool.hbm_budget = hbm_budget;
             o.pool.keep = keep;
             o.pool.arena_size = arena_size;
             o.io_depth = io_depth;
             o.io_block = io_block;
             o.direct_io = direct_io;
             o.host_budget = host_budget;
             o.map_ram = map_ram;
             auto pager = std::make_shared<Pager>(make_device(device), std::move(o));
             register_pager(pager);
             return PyPager{std::move(pager), torch::Device(device)};
           }),
           py::arg("directory"), py::arg("device"), py::arg("page_size"),
           py::arg("hbm_budget"), py::arg("keep"), py::arg("arena_size"),
           py::arg("io_depth"), py::arg("io_block"), py::arg("direct_io"),
           py::arg("host_budget") = 0, py::arg("map_ram") = true)
      .def("empty",
           [](PyPager& self, std::vector<int64_t> shape, at::ScalarType scalar,
              const std::string& store, std::optional<std::vector<int64_t>> strides,
              std::optional<std::vector<size_t>> pieces, const std::string& arena_end) {
             const size_t bytes = tensor_bytes(shape, strides, scalar);
             if (arena_end != "low" && arena_end != "high") {
               throw UsageError("Pager.empty: arena_end " + arena_end +
                                ": use 'low' (the default) or 'high'");
             }
             std::vector<size_t> sizes = pieces.value_or(std::vector<size_t>{bytes});
             const size_t total = self.pager->check_pieces(sizes);  // before the store opens
             if (total != bytes) {
               throw UsageError("Pager.empty: pieces of " + std::to_string(total) +
                                " bytes in all for a tensor of " + std::to_string(bytes) +
                                ": the pieces must add up to the tensor's bytes");
             }
             const std::vector<ExtentId> ids =
                 self.pager->create_pieces(sizes, self.pager->open_store(store),
                                           arena_end == "high" ? ArenaEnd::kHigh : ArenaEnd::kLow);
             std::shared_ptr<Pager> keep = self.pager;
             // Pager::release waits for no bucket (a tensor still paging is freed when its
             // bucket completes), only for the device's queued work where the tensor was
             // resident (as cudaFree does), which never waits for a Python thread: the
             // deleter needs no GIL release, and torch may run it with or without the
             // GIL, on any thread.
             auto deleter = [keep, ids](void*) {
               for (ExtentId id : ids) {
                 try {
                   keep->release(id);
                 } catch (const std::exception& e) {
                   // PyTorch calls deleters noexcept: report, and leave the range reserved.
                   std::fprintf(stderr, "statepager: releasing a pager tensor failed: %s\n",
                                e.what());
                 }
               }
             };
             // target_device: an unmapped address is unknown to cudaPointerGetAttributes,
             // so torch must not try to infer the device from it.
             auto blob = at::for_blob(reinterpret_cast<void*>(self.pager->address(ids[0])), shape);
             if (strides) blob.strides(*strides);
             torch::Tensor t = blob.deleter(deleter)
                                   .options(torch::TensorOptions().dtype(scalar).device(self.device))
                                   .target_device(self.device)
                                   .make_tensor();
             self.storages->add(t.storage());
             return t;
           },
           py::arg("shape"), py::arg("dtype"), py::arg("store") = "",
           py::arg("strides") = py::none(), py::arg("pieces") = py::none(),
           py::arg("arena_end") = "low")
      // Host memory the device's copies reach directly (Device::alloc_staging: pinned on
      // CUDA), exactly `nbytes` rounded to 4 KiB: torch's pinned allocator would round each
      // allocation up to a power of two. Freed with the tensor; the pager outlives it.
      // Without the GIL: pinning pages takes time in proportion to their number.
      .def("host_empty",
           [](PyPager& self, size_t nbytes) {
             if (nbytes == 0) throw UsageError("Pager.host_empty: nbytes must be positive");
             std::shared_ptr<Pager> keep = self.pager;
             void* p = keep->device().alloc_staging(nbytes);
             auto deleter = [keep, nbytes](void* ptr) {
               try {
                 keep->device().free_staging(ptr, nbytes);
               } catch (const std::exception& e) {  // deleters are noexcept: report it
                 std::fprintf(stderr, "statepager: freeing host memory failed: %s\n", e.what());
               }
             };
             return torch::from_blob(p, {static_cast<int64_t>(nbytes)}, deleter,
                                     torch::TensorOptions().dtype(torch::kUInt8));
           },
           py::arg("nbytes"), release_gil())
      .def("move_to_store",
           [](PyPager& self, const std::vector<torch::Tensor>& tensors, const std::string& store) {
             self.pager->move_to_store(self.extents_of(tensors), self.pager->open_store(store));
           })
      .def("open_store",
           [](PyPager& self, const std::string& name) { self.pager->open_store(name); })
      .def("store_of",
           [](PyPager& self, const torch::Tensor& t) {
             return self.pager->store_name(self.pager->store_of(self.extent_of(t)));
           })
      .def("page_in",
           [](PyPager& self, const std::vector<torch::Tensor>& tensors, bool for_read,
              const std::vector<torch::Tensor>& overwrite) {
             return PyTicket{self.pager->page_in(self.extents_of(tensors), for_read,
                                                 self.extents_of(overwrite))};
           },
           py::arg("tensors"), py::arg("for_read") = false,
           py::arg("overwrite") = std::vector<torch::Tensor>{}, release_gil())
      .def("release_unchanged",
           [](PyPager& self, const std::vector<torch::Tensor>& tensors, uintptr_t stream,
              uint64_t reuse_after) {
             return PyTicket{
                 self.pager->release_unchanged(self.extents_of(tensors), stream, reuse_after)};
           },
           py::arg("tensors"), py::arg("stream") = 0, py::arg("reuse_after") = 0, release_gil())
      .def("page_out",
           [](PyPager& self, const std::vector<torch::Tensor>& tensors, uintptr_t stream,
              uint64_t reuse_after) {
             return PyTicket{self.pager->page_out(self.extents_of(tensors), stream, reuse_after)};
           },
           py::arg("tensors"), py::arg("stream") = 0, py::arg("reuse_after") = 0, release_gil())
      .def("discard",
           [](PyPager& self, const std::vector<torch::Tensor>& tensors, uintptr_t stream) {
             return PyTicket{self.pager->discard(self.extents_of(tensors), stream)};
           },
           py::arg("tensors"), py::arg("stream") = 0, release_gil())
      .def("discard_extents",
           [](PyPager& self, const std::vector<ExtentId>& ids, uintptr_t stream) {
             std::vector<ExtentId> live;  // those released since the ids were taken: gone
             for (ExtentId id : ids) {
               if (self.pager->exists(id)) live.push_back(id);
             }
             return PyTicket{self.pager->discard(live, stream)};
           },
           py::arg("ids"), py::arg("stream") = 0, release_gil(),
           "discard() of extents by id, PyTorch's segments included (pause(discard=True))")
      .def("read_ahead",
           [](PyPager& self, const std::vector<torch::Tensor>& tensors) {
             return PyTicket{self.pager->read_ahead(self.extents_of(tensors))};
           },
           release_gil())
      .def("wait", [](PyPager& self, const PyTicket& t) { self.pager->wait(t.ticket); },
           release_gil())
      .def("is_done", [](PyPager& self, const PyTicket& t) { return self.pager->is_done(t.ticket); })
      .def("residency",
           [](PyPager& self, const torch::Tensor& t) {
             // Of a tensor made of pieces: theirs when they agree, else "mixed".
             std::optional<Residency> common;
             for (ExtentId id : self.extents_of(t)) {
               const Residency r = self.pager->residency(id);
               if (common && *common != r) return std::string("mixed");
               common = r;
             }
             return std::string(residency_name(common.value_or(
                 self.pager->residency(self.extent_of(t)))));
           })
      .def("piece_bytes",
           [](PyPager& self, const torch::Tensor& t) {
             // The byte sizes of the pieces of t's storage (one for a tensor without).
             std::vector<size_t> sizes;
             for (ExtentId id : self.pager->pieces(self.extent_of(t))) {
               sizes.push_back(self.pager->size(id));
             }
             return sizes;
           })
      .def("owns", [](PyPager& self, const torch::Tensor& t) {
             return self.pager->find(reinterpret_cast<uintptr_t>(t.storage().data())).has_value();
           })
      .def("owns_each",
           [](PyPager& self, const py::list& values) {
             // Pager.owns() of each value, in one call: a step's snapshot asks it of an
             // optimizer's every state entry (a few per parameter).
             std::vector<bool> owned;
             owned.reserve(values.size());
             for (py::handle v : values) {
               bool mine = false;
               if (THPVariable_Check(v.ptr())) {
                 const torch::Tensor& t = THPVariable_Unpack(v.ptr());
                 mine = t.layout() == torch::kStrided &&
                        self.pager->find(reinterpret_cast<uintptr_t>(t.storage().data()))
                            .has_value();
               }
               owned.push_back(mine);
             }
             return owned;
           })
      .def("stats",
           [](PyPager& self) {
             const PagerStats s = self.pager->stats();
             py::dict d;
             d["mapped_bytes"] = s.mapped_bytes;
             d["peak_mapped_bytes"] = s.peak_mapped_bytes;
             d["cached_bytes"] = s.cached_bytes;
             d["hbm_budget"] = s.hbm_budget;
             d["page_size"] = s.page_size;
             d["extents"] = s.extents;
             d["resident_bytes"] = s.resident_bytes;
             d["bytes_read"] = s.bytes_read;
             d["bytes_written"] = s.bytes_written;
             d["read_requests"] = s.read_requests;
             d["write_requests"] = s.write_requests;
             d["zero_filled_bytes"] = s.zero_filled_bytes;
             d["unchanged_bytes"] = s.unchanged_bytes;
             d["buckets_in"] = s.buckets_in;
             d["buckets_out"] = s.buckets_out;
             d["buckets_held"] = s.buckets_held;
             d["host_budget"] = s.host_budget;
             d["host_used_bytes"] = s.host_used_bytes;
             d["host_bytes"] = s.host_bytes;
             d["bytes_to_host"] = s.bytes_to_host;
             d["bytes_from_host"] = s.bytes_from_host;
             d["spills"] = s.spills;
             d["spilled_bytes"] = s.spilled_bytes;
             d["read_aheads"] = s.read_aheads;
             d["read_ahead_bytes"] = s.read_ahead_bytes;
             d["direct_io"] = s.direct_io;
             d["mapped_read_bytes"] = s.mapped_read_bytes;
             d["mapped_written_bytes"] = s.mapped_written_bytes;
             d["store_mapped_bytes"] = s.store_mapped_bytes;
             d["io_depth"] = s.io_depth;
             d["io_block"] = s.io_block;
             return d;
           })
      .def("resident_extents", [](PyPager& self) { return self.pager->resident_extents(); },
           "Ids of the extents resident now (for pause/resume)")
      .def("page_all",
           [](PyPager& self, const std::vector<ExtentId>& ids, size_t bucket_size, bool out) {
             page_all(*self.pager, ids, bucket_size, out);
           },
           py::arg("ids"), py::arg("bucket_size"), py::arg("out"), release_gil(),
           "Pages extents out (or in) in buckets, all in flight; waits for all of them")
      .def("trim", [](PyPager& self) { self.pager->trim(); }, release_gil(),
           "Returns the cached pages to the device")
      .def("snapshot",
           [](PyPager& self, const std::vector<torch::Tensor>& tensors) {
             return PySnapshot{self.pager,
                               std::make_unique<StoreSnapshot>(*self.pager, self.extents_of(tensors))};
           },
           release_gil(), "Holds the tensors' store ranges (they must be at rest) for a copy of this moment")
      .def("read_at_rest",
           [](PyPager& self, const std::vector<ExtentId>& ids, uintptr_t address,
              torch::Tensor& out) {
             if (!out.device().is_cpu() || !out.is_contiguous()) {
               throw UsageError("read_at_rest: out must be a contiguous CPU tensor");
             }
             const uint64_t nbytes = out.nbytes();
             for (ExtentId id : ids) {
               if (!self.pager->exists(id)) continue;
               const uintptr_t start = self.pager->address(id);
               if (address < start || address + nbytes > start + self.pager->size(id)) continue;
               const StoreSnapshot held(*self.pager, {id});  // its range stays put meanwhile
               held.read(0, address - start, out.data_ptr(), nbytes);
               return true;
             }
             return false;
           },
           py::arg("ids"), py::arg("address"), py::arg("out"), release_gil(),
           "Copies the out.nbytes bytes at `address`, inside one of the extents `ids` (at "
           "rest; segments too), into `out` from where they lie, paging nothing; False when "
           "none of them holds that range")
      .def("restore",
           [](PyPager& self, const std::vector<torch::Tensor>& tensors,
              const std::vector<bool>& zero, const std::string& src,
              const std::vector<uint64_t>& offsets) {
             const std::vector<ExtentId> ids = self.extents_of(tensors);
             return std::string(
                 copy_method_name(restore_extents(*self.pager, ids, zero, src, offsets)));
           },
           py::arg("tensors"), py::arg("zero"), py::arg("src"), py::arg("offsets"), release_gil())
      .def("begin_epoch",
           [](PyPager& self, const std::vector<torch::Tensor>& tensors) {
             return self.pager->begin_epoch(self.extents_of(tensors));
           },
           "Opens an all-or-nothing epoch over the tensors (at rest); returns its id")
      .def("commit_epoch", [](PyPager& self, uint64_t epoch) { self.pager->commit_epoch(epoch); },
           release_gil())
      .def("abort_epoch", [](PyPager& self, uint64_t epoch) { self.pager->abort_epoch(epoch); },
           release_gil())
      .def("set_keep", [](PyPager& self, size_t n) { self.pager->set_keep(n); })
      .def("reset_peak", [](PyPager& self) { self.pager->reset_peak(); })
      .def("free_device_memory", [](PyPager& self) { return self.pager->device().free_memory(); })
      .def_property_readonly("file_path", [](PyPager& self) { return self.pager->file_path(); })
      .def_property_readonly("directory", [](PyPager& self) { return self.pager->directory(); })
      .def_property_readonly("owner_pid", [](PyPager& self) { return self.pager->owner(); })
      .def("check_owner", [](PyPager& self) { self.pager->check_owner(); })
      .def("check_usable", [](PyPager& self) { self.pager->check_usable(); })
      // After close() the arena is unmapped: its tensors' storages lose their memory, so
      // that reading one raises in torch instead of faulting (the tensors stay valid
      // objects; their views too, sharing the storage).
      .def("close",
           [](PyPager& self) {
             self.pager->check_owner();  // a forked child's close touches nothing
             try {
               self.pager->close();
             } catch (...) {  // closed all the same (see Pager::close)
               self.storages->cut_off();
               throw;
             }
             self.storages->cut_off();
           },
           release_gil());
}
