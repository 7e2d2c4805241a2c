"""Pager.save(path) / Pager.load(path): checkpoints of the state of attached optimizers.

A checkpoint is a directory written once:
    manifest.json     format version; per optimizer (by binding name): class, formats,
                      parameter shapes, param-group hyperparameters, the small
                      per-parameter state (step counters), and every paged tensor
                      (parameter index, state name, dtype, shape, bytes, offset, and the
                      crc32 of each CHUNK bytes of it; ZERO tensors, never written, are
                      recorded as zero and take no bytes)
    <name>/state.bin  per optimizer: its tensors' bytes, each at a 4 KiB-aligned offset,
                      zeros in between

Between steps all paged state is at rest in the store, each tensor in a fixed range of
its files, so a save copies those ranges (reflink, copy_file_range or read/write:
backing/file_copy.h) and nothing passes through the device. The ranges are held at the
moment of the call (allocator/store_snapshot.h): with background=True save() returns
then, training goes on, and a page-out into a range not yet copied waits until it is.
The checksums are computed from the written files on several threads, after the copy.

Everything is written into a temporary directory beside `path`, fsynced and renamed:
a crash leaves either the complete checkpoint or none. Load checks the format, the
layout against the attached optimizers and every checksum before it changes anything,
then copies the ranges back into the store (Pager::restore); any difference is refused
with an error that names it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from statepager import _C
from statepager.pager import flat_view
from statepager.stream import _params_in_order

log = logging.getLogger("statepager")

FORMAT, VERSION = "statepager-checkpoint", 2
ALIGN = 4096
CHUNK = 32 << 20      # bytes per checksum: big tensors are checksummed on several threads
_READ = 4 << 20       # bytes per read while checksumming
_DATA = "state.bin"
_VIAS = ("store", "device")


class CheckpointMismatchError(_C.Error):
    """The checkpoint was written for another layout or format than the one loading it."""


class SaveHandle:
    """A checkpoint being written. wait() returns once it is complete and in place, and
    raises the save's error if it failed (no checkpoint is left at `path` then); an error
    not waited for is raised by the pager's next save() or load()."""

    def __init__(self, path: str, nbytes: int):
        self.path = path
        self.bytes = nbytes           # tensor bytes in the checkpoint (ZERO ones excluded)
        self.method: str | None = None  # how the bytes were copied (file_copy.h), or "device"
        self.call_seconds = 0.0       # save() itself: until training could go on
        self.copy_seconds = 0.0       # copying the bytes (the part steps may wait for)
        self.checksum_seconds = 0.0
        self.seconds: float | None = None  # from the call until the checkpoint was in place
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()


def rank_directory(base: str) -> str:
    """base/statepager/rankNNNNN: this rank's checkpoint under a training loop's
    checkpoint directory (rank from torch.distributed, 0 when not initialized)."""
    from statepager.pager import _rank

    return os.path.join(os.path.abspath(base), "statepager", f"rank{_rank():05d}")


def save(pager, path: str, *, background: bool = False, via: str = "store") -> SaveHandle:
    if via not in _VIAS:
        raise _C.UsageError(f"via must be one of {_VIAS}, not {via!r}")
    if background and via != "store":
        raise _C.UsageError("a background save copies the store: use via='store'")
    wait_for_save(pager)
    t_call = time.perf_counter()
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise _C.UsageError(f"checkpoint {path} exists: checkpoints are written once, "
                            "give each one a new path (e.g. one per step)")
    for binding in pager._bindings:
        _check_name(binding.name)
    # At rest: a save between steps finds nothing resident, so this moves no bytes.
    for h in [pager.page_out_async(b.stored) for bd in pager._bindings for b in bd.buckets]:
        h.wait()
    plan = [_Plan(binding) for binding in pager._bindings]
    tensors = [t for p in plan for t in p.tensors]
    snapshot = pager._core.snapshot(tensors) if via == "store" else None
    try:
        states = ([s for s, _, _ in snapshot.placements] if snapshot is not None
                  else [pager.residency(t) for t in tensors])
        at = 0
        for p in plan:
            p.place(states[at:at + len(p.tensors)])
            at += len(p.tensors)
        manifest = {"format": FORMAT, "version": VERSION, "checksum": "crc32",
                    "chunk_bytes": CHUNK, "optimizers": [p.entry for p in plan]}
        _make_parents(os.path.dirname(path))
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.makedirs(tmp)
    except BaseException:
        if snapshot is not None:
            snapshot.release()
        raise
    handle = SaveHandle(path, sum(p.data_bytes for p in plan))

    def finish():
        try:
            files = [os.path.join(tmp, p.binding.name, _DATA) for p in plan]
            for f in files:
                os.makedirs(os.path.dirname(f))
                open(f, "wb").close()
            t0 = time.perf_counter()
            if snapshot is not None:
                targets = [(i, e["offset"] or 0) for i, p in enumerate(plan)
                           for e in p.entries]
                handle.method = snapshot.copy_to(files, targets)
            else:
                handle.method = "device"
                for p, f in zip(plan, files):
                    p.write_through_device(f)
            t1 = time.perf_counter()
            ranges = [(f, e["offset"], e["bytes"]) for p, f in zip(plan, files)
                      for e in p.entries if not e["zero"]]
            sums = iter(checksums(ranges))
            handle.copy_seconds, handle.checksum_seconds = t1 - t0, time.perf_counter() - t1
            for p in plan:
                for e in p.entries:
                    e["crc32"] = [] if e["zero"] else next(sums)
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            for p in plan:
                _fsync_dir(os.path.join(tmp, p.binding.name))
            _fsync_dir(tmp)
            os.rename(tmp, path)
            _fsync_dir(os.path.dirname(path))
            handle.seconds = time.perf_counter() - t_call
        except BaseException as e:
            handle._error = e
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            if snapshot is not None:
                snapshot.release()

    if background:
        handle._thread = threading.Thread(target=finish, name="statepager-save")
        handle._thread.start()
        pager._saving = handle
        handle.call_seconds = time.perf_counter() - t_call
        return handle
    finish()
    handle.call_seconds = time.perf_counter() - t_call
    handle.wait()
    return handle


def wait_for_save(pager) -> None:
    """Waits for the pager's background save, if one is running (one at a time)."""
    handle, pager._saving = pager._saving, None
    if handle is not None:
        handle.wait()


class _Plan:
    """One optimizer's part of a checkpoint: its stored tensors in bucket order (the order
    the step pages them out in, so the copy frees the first bucket first), their places
    in its state.bin, and its manifest entry, all taken at the moment of the save."""

    def __init__(self, binding):
        self.binding = binding
        opt = binding.optimizer
        params = _params_in_order(opt)
        index = {id(p): i for i, p in enumerate(params)}
        # Per bucket: (manifest entry, tensor) of each stored tensor.
        self.buckets = [[({"param": index[id(p)], "name": name, "dtype": str(t.dtype),
                           "shape": list(t.shape), "strides": list(t.stride()),
                           "bytes": t.numel() * t.element_size()}, t)
                         for p in b.params for name, t in _stored(binding, p)]
                        for b in binding.buckets]
        self.entries = [e for items in self.buckets for e, _ in items]
        self.tensors = [t for items in self.buckets for _, t in items]
        small, names = {}, {}
        for p in params:
            i = str(index[id(p)])
            small[i] = {k: _encode(v) for k, v in opt.state.get(p, {}).items()
                        if not binding.pager.owns(v)}
            names[i] = list(opt.state.get(p, {}))  # torch's order of the entries
            for name, form in binding.forms(p):
                if form.fmt == "residual":
                    small[i][f"{name}:exceptions"] = [_encode(e) for e in form.exceptions]
        self.entry = {"name": binding.name, "class": type(opt).__name__, "params": len(params),
                      "formats": {"moments": binding.moments, "mains": binding.mains},
                      "shapes": [list(p.shape) for p in params],
                      "param_groups": [{k: _encode(v) for k, v in g.items() if k != "params"}
                                       for g in opt.param_groups],
                      "data": f"{binding.name}/{_DATA}", "tensors": self.entries,
                      "small_state": small, "state_names": names}
        self.data_bytes = 0

    def place(self, states: list) -> None:
        """Offsets in state.bin: each non-ZERO tensor at the next 4 KiB boundary."""
        offset = 0
        for e, state in zip(self.entries, states):
            e["zero"] = state == "zero"
            e["offset"] = None if e["zero"] else offset
            if not e["zero"]:
                offset += _align(e["bytes"])
                self.data_bytes += e["bytes"]
        self.entry["data_bytes"] = offset

    def write_through_device(self, path: str) -> None:
        """The bytes via the device, bucket by bucket (page in, write, page out): the same
        file as the store copy makes, without touching the store's files."""
        pager = self.binding.pager
        with open(path, "r+b") as f:
            for items in self.buckets:
                moved = [(e, t) for e, t in items if not e["zero"]]
                pager.page_in([t for _, t in moved])
                try:
                    for e, t in moved:
                        data = flat_view(t.detach()).view(torch.uint8).cpu().numpy()
                        f.seek(e["offset"])
                        f.write(data.data)
                        f.write(b"\0" * (_align(data.size) - data.size))
                finally:
                    pager.page_out([t for _, t in moved])
            f.flush()
            os.fsync(f.fileno())


def checksums(ranges: list) -> list:
    """crc32 of each CHUNK bytes of each (path, offset, nbytes) range: one list per range.
    The chunks are read and summed on several threads (zlib and reads release the GIL)."""
    chunks = [(i, path, offset + k, min(CHUNK, n - k))
              for i, (path, offset, n) in enumerate(ranges) for k in range(0, n, CHUNK)]
    fds = {path: os.open(path, os.O_RDONLY) for path in {r[0] for r in ranges}}
    local = threading.local()

    def crc(chunk) -> int:
        _, path, offset, left = chunk
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(_READ))
        value = 0
        while left:
            got = os.preadv(fds[path], [local.buf[:min(left, _READ)]], offset)
            if got == 0:
                raise _C.CorruptStoreError(f"{path} ends at byte {offset}, before its data "
                                           "does: the checkpoint is truncated")
            value = zlib.crc32(local.buf[:got], value)
            offset += got
            left -= got
        return value

    try:
        # Disks need several reads in flight even where cores are few.
        threads = max(1, min(len(chunks), 16, max(4, os.cpu_count() or 1)))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            values = list(pool.map(crc, chunks))
    finally:
        for fd in fds.values():
            os.close(fd)
    out = [[] for _ in ranges]
    for (i, *_), v in zip(chunks, values):
        out[i].append(v)
    return out


def load(pager, path: str) -> bool:
    """Loads `path` into the attached optimizers. False (with a logged notice) when `path`
    holds no statepager checkpoint, so runs from older checkpoints start fresh."""
    wait_for_save(pager)
    path = os.path.abspath(path)
    if not os.path.exists(os.path.join(path, "manifest.json")):
        log.warning("statepager: no checkpoint at %s; the optimizer state starts fresh", path)
        return False
    entries = _check_layout(pager, read_manifest(path), path)
    _verify(entries, path)
    for binding, entry in zip(pager._bindings, entries):
        created = _create_state(binding, _missing_state(binding, entry))
        try:
            _load_optimizer(binding, entry, os.path.join(path, entry["data"]))
        except BaseException:
            _drop_state(binding, created)
            raise
    return True


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`, once it is readable and of this statepager's
    format, version and checksums (CorruptStoreError, CheckpointMismatchError)."""
    manifest_path = os.path.join(path, "manifest.json")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise _C.CorruptStoreError(f"{manifest_path} is not a readable manifest: {e}") from e

    def refuse(what: str):
        raise CheckpointMismatchError(f"checkpoint {path} does not fit: {what}. Load it with "
                                      "the statepager that wrote it.")

    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        refuse(f"format {manifest.get('format')!r} version {manifest.get('version')!r}, "
               f"this statepager reads {FORMAT!r} version {VERSION}")
    if manifest.get("checksum") != "crc32" or manifest.get("chunk_bytes") != CHUNK:
        refuse(f"checksums {manifest.get('checksum')!r} per {manifest.get('chunk_bytes')} "
               f"bytes, this statepager reads crc32 per {CHUNK}")
    return manifest


def verify(path: str, manifest: dict) -> None:
    """Every tensor's bytes in checkpoint `path` against the checksums in its manifest
    (read_manifest): CorruptStoreError naming the first that fails."""
    _verify(manifest["optimizers"], path)


def _missing_state(binding, entry: dict) -> dict:
    """Parameter index -> {state name: (shape, dtype, strides)} of the paged state the
    checkpoint holds for parameters that have no state in the attached optimizer. With
    a narrow format the state entry is the fp32 working tensor, shaped like its param."""
    params = _params_in_order(binding.optimizer)
    out = {}
    for t in entry["tensors"]:
        p = params[t["param"]]
        name, _, suffix = t["name"].partition(":")
        if name == "param" or binding.optimizer.state.get(p):
            continue
        spec = ((t["shape"], t["dtype"], t.get("strides")) if not suffix
                else (list(p.shape), str(p.dtype), list(p.stride())))
        out.setdefault(t["param"], {})[name] = spec
    return out


def _create_state(binding, missing: dict) -> dict:
    """Creates the state entries of _missing_state (ZERO pager tensors, to be restored)."""
    opt, pager = binding.optimizer, binding.pager
    params = _params_in_order(opt)
    created = {}
    for j, specs in missing.items():
        p = params[j]
        for name, (shape, dtype, strides) in specs.items():
            dtype = getattr(torch, dtype.removeprefix("torch."))
            opt.state[p][name] = pager.empty(shape, dtype=dtype, strides=strides)
        created[p] = list(specs)
    binding.state_changed()
    return created


def _drop_state(binding, created: dict) -> None:
    """Undoes _create_state: those parameters have no state again."""
    for p in created:
        binding.optimizer.state.pop(p, None)
    binding.state_changed()


def _check_layout(pager, manifest: dict, path: str) -> list:
    """The manifest's optimizer entries, in attach order, once they fit what is attached."""
    def refuse(what: str):
        raise CheckpointMismatchError(f"checkpoint {path} does not fit: {what}. Load it into "
                                      "the same model, optimizers and sharding it was saved "
                                      "from.")

    saved = {e["name"]: e for e in manifest["optimizers"]}
    attached = [b.name for b in pager._bindings]
    if sorted(saved) != sorted(attached):
        refuse(f"optimizers {sorted(saved)} saved, {sorted(attached)} attached")
    for binding in pager._bindings:
        entry, name = saved[binding.name], binding.name
        opt = binding.optimizer
        params = _params_in_order(opt)
        if entry["class"] != type(opt).__name__:
            refuse(f"optimizer {name!r} was a {entry['class']}, is a {type(opt).__name__}")
        formats = {"moments": binding.moments, "mains": binding.mains}
        if entry.get("formats") != formats:
            refuse(f"optimizer {name!r} was saved with formats {entry.get('formats')}, is "
                   f"attached with {formats}")
        if entry["shapes"] != [list(p.shape) for p in params]:
            refuse(f"optimizer {name!r}'s parameter shapes differ")
        if len(entry["param_groups"]) != len(opt.param_groups):
            refuse(f"optimizer {name!r} had {len(entry['param_groups'])} param groups, has "
                   f"{len(opt.param_groups)}")
        expected = {(j, n): (list(t.shape), str(t.dtype)) for j, p in enumerate(params)
                    for n, t in _stored(binding, p)}
        stored = {(t["param"], t["name"]): (t["shape"], t["dtype"]) for t in entry["tensors"]}
        # Parameters without state yet (a fresh optimizer: torch creates state in the
        # first step) get the checkpoint's, which must be shaped like them.
        for j, specs in _missing_state(binding, entry).items():
            for n, (shape, _, _) in specs.items():
                if shape != list(params[j].shape):
                    refuse(f"optimizer {name!r} parameter {j} {n} is {shape}, the "
                           f"parameter {list(params[j].shape)}")
            expected.update({k: v for k, v in stored.items() if k[0] == j})
        for key in expected.keys() ^ stored.keys():
            refuse(f"optimizer {name!r} parameter {key[0]} {key[1]} is only in "
                   f"{'the checkpoint' if key in stored else 'the attached optimizer'}")
        for key, (shape, dtype) in stored.items():
            if (shape, dtype) != expected[key]:
                refuse(f"optimizer {name!r} parameter {key[0]} {key[1]} is {dtype} {shape}, "
                       f"expected {expected[key][1]} {expected[key][0]}")
    return [saved[b.name] for b in pager._bindings]


def _verify(entries: list, path: str) -> None:
    """Every tensor's bytes against its checksums, before anything is changed."""
    ranges, owners = [], []
    for entry in entries:
        data = os.path.join(path, entry["data"])
        try:
            size = os.path.getsize(data)
        except OSError as e:
            raise _C.CorruptStoreError(f"{data} cannot be read: {e}") from e
        if size < entry["data_bytes"]:
            raise _C.CorruptStoreError(f"{data} is truncated: {size} bytes, the manifest "
                                       f"records {entry['data_bytes']}")
        for t in entry["tensors"]:
            if not t["zero"]:
                ranges.append((data, t["offset"], t["bytes"]))
                owners.append((entry["name"], t))
    for (data, *_), (name, t), found in zip(ranges, owners, checksums(ranges)):
        if found == t["crc32"]:
            continue
        k = next((k for k, (a, b) in enumerate(zip(found, t["crc32"])) if a != b),
                 min(len(found), len(t["crc32"])))
        at = t["offset"] + k * CHUNK
        raise _C.CorruptStoreError(
            f"{data}: optimizer {name!r} parameter {t['param']} {t['name']} fails its checksum "
            f"in bytes {at}..{min(at + CHUNK, t['offset'] + t['bytes'])} (chunk {k}: crc32 "
            f"{found[k:k + 1]}, the manifest records {t['crc32'][k:k + 1]}): the checkpoint "
            "is corrupt; nothing was loaded")


def _load_optimizer(binding, entry: dict, data: str) -> None:
    pager = binding.pager
    opt = binding.optimizer
    params = _params_in_order(opt)
    saved = {(t["param"], t["name"]): t for t in entry["tensors"]}
    index = {id(p): i for i, p in enumerate(params)}
    pairs = [(saved[(index[id(p)], name)], t) for b in binding.buckets for p in b.params
             for name, t in _stored(binding, p)]
    tensors = [t for _, t in pairs]
    # Resident bytes are about to be replaced: unmap them without writing.
    pager.discard_async([t for t in tensors if pager.is_resident(t)]).wait()
    pager._core.restore(tensors, [s["zero"] for s, _ in pairs], data,
                        [s["offset"] or 0 for s, _ in pairs])
    for i, small in entry["small_state"].items():
        p = params[int(i)]
        forms = dict(binding.forms(p))
        for k, v in small.items():
            if k.endswith(":exceptions"):
                form = forms[k.removesuffix(":exceptions")]
                form.exceptions = tuple(_decode(e, form.working) for e in v)
            else:
                opt.state[p][k] = _decode(v, opt.state[p].get(k))
    for i, names in entry.get("state_names", {}).items():
        p = params[int(i)]
        state = opt.state.get(p)
        if state:  # torch's order of the entries, as saved
            opt.state[p] = {**{n: state[n] for n in names if n in state}, **state}
    for group, g in zip(opt.param_groups, entry["param_groups"]):
        for k, v in g.items():
            group[k] = _decode(v, group.get(k))


def _check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", name) or name == "manifest.json":
        raise _C.UsageError(f"optimizer name {name!r} names its checkpoint directory: use "
                            "letters, digits and _ . + - (attach(..., name=...))")


def _stored(binding, p):
    """(name, tensor) of parameter p's stored tensors, in a stable order."""
    return [(n, t) for name, form in binding.forms(p)
            for n, t in zip(form.names(name), form.tensors)]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _encode(v):
    if isinstance(v, torch.Tensor) and v.layout != torch.strided:
        raise _C.UsageError(f"a {v.layout} tensor in the optimizer's state (e.g. SGD momentum "
                            "of sparse gradients) cannot go into a pager checkpoint: save "
                            "that optimizer with torch.save(opt.state_dict()) instead")
    if isinstance(v, torch.Tensor):
        return {"tensor": v.tolist(), "dtype": str(v.dtype), "device": str(v.device)}
    if isinstance(v, tuple):
        return {"tuple": [_encode(x) for x in v]}
    return v


def _decode(v, current):
    if isinstance(v, dict) and "tensor" in v:
        dtype = getattr(torch, v["dtype"].removeprefix("torch."))
        device = current.device if isinstance(current, torch.Tensor) else v["device"]
        return torch.tensor(v["tensor"], dtype=dtype, device=device)
    if isinstance(v, dict) and "tuple" in v:
        return tuple(_decode(x, None) for x in v["tuple"])
    return v


def _make_parents(path: str) -> None:
    """mkdir -p, with each new directory's entry made durable in its parent."""
    if os.path.isdir(path):
        return
    _make_parents(os.path.dirname(path))
    try:
        os.mkdir(path)
    except FileExistsError:
        return
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
