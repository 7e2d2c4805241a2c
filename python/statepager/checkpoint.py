"""Pager.save(path) / Pager.load(path): checkpoints of the state of attached optimizers.

A checkpoint is a directory written once:
    manifest.json   format version; per optimizer: class, param-group hyperparameters,
                    every paged tensor (parameter index, state name, dtype, shape, offset,
                    bytes, crc32) and the small per-parameter state (step counters)
    state.bin       the tensors' bytes, each at a 4 KiB-aligned offset

Save streams the state bucket by bucket (never more than the pipeline window on the
device, nor more than one tensor in host memory), writes into a temporary directory,
fsyncs and renames: a crash leaves either the complete checkpoint or none. Load checks
the format, the layout against the attached optimizers and every checksum before it
changes anything; any difference is refused with an error that names it.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
import zlib

import torch

from statepager import _C
from statepager.stream import _params_in_order

log = logging.getLogger("statepager")

FORMAT, VERSION = "statepager-checkpoint", 1
ALIGN = 4096
_CHUNK = 64 << 20


class CheckpointMismatchError(_C.Error):
    """The checkpoint was written for another layout or format than the one loading it."""


def save(pager, path: str) -> None:
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise _C.UsageError(f"checkpoint {path} exists: checkpoints are written once, "
                            "give each one a new path (e.g. one per step)")
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    manifest = {"format": FORMAT, "version": VERSION, "optimizers": []}
    offset = 0
    with open(os.path.join(tmp, "state.bin"), "wb") as f:
        for binding in pager._bindings:
            entry, offset = _save_optimizer(binding, f, offset)
            manifest["optimizers"].append(entry)
        f.flush()
        os.fsync(f.fileno())
    manifest["state_bytes"] = offset
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _save_optimizer(binding, f, offset: int):
    opt = binding.optimizer
    index = {id(p): i for i, p in enumerate(_params_in_order(opt))}
    tensors, small = [], {}
    for bucket in binding.stored_in_buckets():
        for p in bucket.params:
            for name, t in _stored(binding, p):
                data = t.detach().view(-1).view(torch.uint8).cpu().numpy()
                f.write(data.data)
                pad = -data.size % ALIGN
                f.write(b"\0" * pad)
                tensors.append({"param": index[id(p)], "name": name, "dtype": str(t.dtype),
                                "shape": list(t.shape), "offset": offset, "bytes": data.size,
                                "crc32": zlib.crc32(data)})
                offset += data.size + pad
    for p, i in ((p, index[id(p)]) for p in _params_in_order(opt)):
        small[str(i)] = {k: _encode(v) for k, v in opt.state[p].items()
                         if not binding.pager.owns(v)}
        for name, form in binding.forms(p):
            if form.fmt == "residual":
                small[str(i)][f"{name}:exceptions"] = [_encode(e) for e in form.exceptions]
    groups = [{k: _encode(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"class": type(opt).__name__, "params": len(index),
            "formats": {"moments": binding.moments, "mains": binding.mains},
            "shapes": [list(p.shape) for p in _params_in_order(opt)],
            "param_groups": groups, "tensors": tensors, "small_state": small}, offset


def load(pager, path: str) -> bool:
    """Loads `path` into the attached optimizers. False (with a logged notice) when `path`
    holds no statepager checkpoint, so runs from older checkpoints start fresh."""
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.exists(manifest_path):
        log.warning("statepager: no checkpoint at %s; the optimizer state starts fresh", path)
        return False
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise _C.CorruptStoreError(f"{manifest_path} is not a readable manifest: {e}") from e
    _check_layout(pager, manifest, path)
    data_path = os.path.join(path, "state.bin")
    _verify(manifest, data_path)
    with open(data_path, "rb") as f:
        for binding, entry in zip(pager._bindings, manifest["optimizers"]):
            _load_optimizer(binding, entry, f)
    return True


def _check_layout(pager, manifest: dict, path: str) -> None:
    def refuse(what: str):
        raise CheckpointMismatchError(f"checkpoint {path} does not fit: {what}. Load it into "
                                      "the same model, optimizers and sharding it was saved "
                                      "from.")

    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        refuse(f"format {manifest.get('format')!r} version {manifest.get('version')!r}, "
               f"this statepager reads {FORMAT!r} version {VERSION}")
    if len(manifest["optimizers"]) != len(pager._bindings):
        refuse(f"{len(manifest['optimizers'])} optimizers saved, {len(pager._bindings)} attached")
    for i, (binding, entry) in enumerate(zip(pager._bindings, manifest["optimizers"])):
        opt = binding.optimizer
        params = _params_in_order(opt)
        if entry["class"] != type(opt).__name__:
            refuse(f"optimizer {i} was a {entry['class']}, is a {type(opt).__name__}")
        formats = {"moments": binding.moments, "mains": binding.mains}
        if entry.get("formats") != formats:
            refuse(f"optimizer {i} was saved with formats {entry.get('formats')}, is attached "
                   f"with {formats}")
        if entry["shapes"] != [list(p.shape) for p in params]:
            refuse(f"optimizer {i}'s parameter shapes differ")
        if len(entry["param_groups"]) != len(opt.param_groups):
            refuse(f"optimizer {i} had {len(entry['param_groups'])} param groups, has "
                   f"{len(opt.param_groups)}")
        expected = {(j, name): list(t.shape) for j, p in enumerate(params)
                    for name, t in _stored(binding, p)}
        saved = {(t["param"], t["name"]): t["shape"] for t in entry["tensors"]}
        for key in expected.keys() ^ saved.keys():
            refuse(f"optimizer {i} parameter {key[0]} {key[1]} is only in "
                   f"{'the checkpoint' if key in saved else 'the attached optimizer'}")
        for key, shape in saved.items():
            if shape != expected[key]:
                refuse(f"optimizer {i} parameter {key[0]} {key[1]} has shape {shape}, "
                       f"expected {expected[key]}")


def _verify(manifest: dict, data_path: str) -> None:
    """Every tensor's bytes against its checksum, before anything is changed."""
    try:
        size = os.path.getsize(data_path)
    except OSError as e:
        raise _C.CorruptStoreError(f"{data_path} cannot be read: {e}") from e
    if size < manifest["state_bytes"]:
        raise _C.CorruptStoreError(f"{data_path} is truncated: {size} bytes, the manifest "
                                   f"records {manifest['state_bytes']}")
    with open(data_path, "rb") as f:
        for i, entry in enumerate(manifest["optimizers"]):
            for t in entry["tensors"]:
                crc = 0
                f.seek(t["offset"])
                left = t["bytes"]
                while left:
                    chunk = f.read(min(left, _CHUNK))
                    crc = zlib.crc32(chunk, crc)
                    left -= len(chunk)
                if crc != t["crc32"]:
                    raise _C.CorruptStoreError(
                        f"{data_path}: optimizer {i} parameter {t['param']} {t['name']} "
                        f"(bytes {t['offset']}..{t['offset'] + t['bytes']}) fails its checksum: "
                        "the checkpoint is corrupt; nothing was loaded")


def _load_optimizer(binding, entry: dict, f) -> None:
    opt = binding.optimizer
    params = _params_in_order(opt)
    saved = {(t["param"], t["name"]): t for t in entry["tensors"]}
    index = {id(p): i for i, p in enumerate(params)}
    for bucket in binding.stored_in_buckets():
        for p in bucket.params:
            for name, t in _stored(binding, p):
                s = saved[(index[id(p)], name)]
                f.seek(s["offset"])
                raw = torch.frombuffer(bytearray(f.read(s["bytes"])), dtype=torch.uint8)
                t.view(-1).view(torch.uint8).copy_(raw)
    for i, small in entry["small_state"].items():
        p = params[int(i)]
        forms = dict(binding.forms(p))
        for k, v in small.items():
            if k.endswith(":exceptions"):
                form = forms[k.removesuffix(":exceptions")]
                form.exceptions = tuple(_decode(e, form.working) for e in v)
            else:
                opt.state[p][k] = _decode(v, opt.state[p].get(k))
    for group, g in zip(opt.param_groups, entry["param_groups"]):
        for k, v in g.items():
            group[k] = _decode(v, group.get(k))


def _stored(binding, p):
    """(name, tensor) of parameter p's stored tensors, in a stable order."""
    return [(n, t) for name, form in binding.forms(p)
            for n, t in zip(form.names(name), form.tensors)]


def _encode(v):
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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
