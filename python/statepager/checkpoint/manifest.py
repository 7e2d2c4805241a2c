"""The manifest of a checkpoint (statepager.checkpoint): its format, its own checksum, and
the checks of it that need no optimizer (a load's and `statepager inspect --verify`'s).

manifest.json (format version 4):
    format, version       "statepager-checkpoint", 4
    manifest_sha256       sha256 of the canonical JSON (sorted keys, no whitespace) of
                          everything else in the manifest: an edited manifest is refused
    checksum, chunk_bytes "crc32c" of each chunk_bytes bytes of each tensor's range in its
                          data file: the tensor and the zeros after it up to the next
                          4 KiB boundary (the range a save copies; checksummed as it is
                          copied, backing/file_copy.h)
    optimizers            per attached optimizer (by binding name): class, formats,
                          parameter shapes, param-group hyperparameters, the small
                          per-parameter state (step counters, residual exception lists)
                          and the order of its entries (state_names), data
                          ("<name>/state.bin"), data_bytes, and every paged tensor
                          (parameter index, state name, dtype, shape, strides, bytes,
                          zero, offset, and under the checksum's name its value per
                          chunk; ZERO tensors take no bytes)
Other versions are refused (CheckpointMismatchError), naming the version found.

Errors: CorruptStoreError for a manifest or data file that is damaged, edited or
malformed; CheckpointMismatchError for one of another format or version.
"""
from __future__ import annotations

import hashlib
import json
import math
import os

import torch

from statepager import _C
from statepager.checkpoint import dirs as checkpoint_dirs
from statepager.util.names import valid_name

FORMAT, VERSION = "statepager-checkpoint", 4
CHECKSUM = "crc32c"   # the manifest's "checksum", also the key of each tensor's values
ALIGN = 4096
CHUNK = 32 << 20      # bytes per checksum: big tensors are verified on several threads
DIGEST = "manifest_sha256"


class CheckpointMismatchError(_C.Error):
    """The checkpoint was written for another layout or format than the one loading it."""


def digest(manifest: dict) -> str:
    """The manifest's own checksum: sha256 of the canonical JSON of all but DIGEST."""
    body = {k: v for k, v in manifest.items() if k != DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`, once its format, version and checksum are right
    and its optimizer entries have distinct plain names. UsageError when `path` holds no
    checkpoint (checkpoint_dirs.require_checkpoint); CorruptStoreError for a manifest that
    is a symlink or not a regular file (checkpoint_dirs.open_file)."""
    checkpoint_dirs.require_checkpoint(path)
    manifest_path = os.path.join(path, checkpoint_dirs.MANIFEST)
    try:
        with open(checkpoint_dirs.open_file(manifest_path), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise _C.CorruptStoreError(f"{manifest_path} is not a readable manifest: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointMismatchError(f"{manifest_path} is not a statepager checkpoint "
                                      f"manifest (format {FORMAT!r} expected)")
    version = manifest.get("version")
    if version != VERSION:
        by = "an older" if is_int(version) and version < VERSION else "another"
        raise CheckpointMismatchError(f"{manifest_path} has checkpoint format version "
                                      f"{version!r}, written by {by} statepager; this one "
                                      f"reads version {VERSION}: load it with the statepager "
                                      "that wrote it")
    if manifest.get(DIGEST) != digest(manifest):
        raise _C.CorruptStoreError(
            f"{manifest_path} does not match its own checksum ({DIGEST}): it was edited or "
            "damaged after it was written. Nothing was loaded")
    if manifest.get("checksum") != CHECKSUM or manifest.get("chunk_bytes") != CHUNK:
        raise CheckpointMismatchError(
            f"{manifest_path}: checksums {manifest.get('checksum')!r} per "
            f"{manifest.get('chunk_bytes')} bytes, this statepager reads "
            f"{CHECKSUM} per {CHUNK}")
    entries = manifest.get("optimizers")
    names = ([e.get("name") for e in entries] if isinstance(entries, list)
             and all(isinstance(e, dict) for e in entries) else [None])
    if (not all(isinstance(n, str) and valid_name(n) for n in names)
            or len(set(names)) != len(names)):
        raise _C.CorruptStoreError(f"{manifest_path} is malformed: its optimizers are not "
                                   "entries with distinct plain names. Nothing was loaded")
    return manifest


class DataFile:
    """One optimizer's data file and the tensors the manifest records in it, checked
    against the file: its place (checkpoint_dirs.data_file), its size, and each tensor's
    entry (well-formed; as many bytes as its dtype and shape make, a 4 KiB-aligned range
    inside data_bytes; one CHECKSUM value per CHUNK). Fields:
        name, path    the optimizer's name and its data file
        tensors       {(parameter index, state name): tensor entry}
        ranges        (offset, bytes checksummed, checksums, parameter index, state name)
                      of each non-ZERO tensor, in manifest order: a tensor's checksums
                      cover its range up to the next 4 KiB boundary (align)
    """

    def __init__(self, entry: dict, root: str):
        self.name = entry["name"]
        manifest_path = os.path.join(root, checkpoint_dirs.MANIFEST)
        self.where = f"{manifest_path}: optimizer {self.name!r}"  # for error messages
        self.path = checkpoint_dirs.data_file(root, entry.get("data"), self.name, manifest_path)
        data_bytes = entry.get("data_bytes")
        if not is_int(data_bytes) or data_bytes < 0:
            self._corrupt(f"data_bytes {data_bytes!r} is not a byte count")
        size = os.lstat(self.path).st_size  # data_file: a regular file, not a link
        if size < data_bytes:
            raise _C.CorruptStoreError(f"{self.path} is truncated: {size} bytes, the manifest "
                                       f"records {data_bytes}. Nothing was loaded")
        tensors = entry.get("tensors")
        if not isinstance(tensors, list):
            self._corrupt("'tensors' is not a list")
        self.tensors = {}
        for t in tensors:
            key = self._check_tensor(t, data_bytes)
            if key in self.tensors:
                self._corrupt(f"parameter {key[0]} {key[1]} is recorded twice")
            self.tensors[key] = t
        self.ranges = [(t["offset"], align(t["bytes"]), t[CHECKSUM], *key)
                       for key, t in self.tensors.items() if not t["zero"]]

    def _corrupt(self, what: str):
        raise _C.CorruptStoreError(f"{self.where}: {what}. Nothing was loaded")

    def _check_tensor(self, t, data_bytes: int) -> tuple:
        if not (isinstance(t, dict) and is_int(t.get("param")) and t["param"] >= 0
                and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
                and _is_ints(t.get("shape")) and _is_ints(t.get("strides"))
                and is_int(t.get("bytes")) and t["bytes"] >= 0):
            self._corrupt(f"tensor entry {t!r} is malformed")
        what = f"parameter {t['param']} {t['name']}"
        offset, nbytes, crcs = t.get("offset"), t["bytes"], t.get(CHECKSUM)
        dtype = getattr(torch, t["dtype"].removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            self._corrupt(f"{what} has the unknown dtype {t['dtype']!r}")
        if nbytes != math.prod(t["shape"]) * dtype.itemsize:
            self._corrupt(f"{what} records {nbytes} bytes, its dtype and shape make "
                          f"{math.prod(t['shape']) * dtype.itemsize}")
        if t.get("zero") is True:
            if offset is not None or crcs != []:
                self._corrupt(f"{what} is recorded as zero but has data (offset {offset!r})")
            return t["param"], t["name"]
        if t.get("zero") is not False:
            self._corrupt(f"{what} has no zero flag")
        checked = align(nbytes)
        if not is_int(offset) or offset < 0 or offset % ALIGN or offset + checked > data_bytes:
            self._corrupt(f"{what} at offset {offset!r} ({checked} bytes) is not a "
                          f"{ALIGN}-aligned range inside the first {data_bytes} bytes of its "
                          "data file")
        if (not isinstance(crcs, list) or len(crcs) != math.ceil(nbytes / CHUNK)
                or not all(is_int(c) and 0 <= c < 1 << 32 for c in crcs)):
            self._corrupt(f"{what} does not record one {CHECKSUM} per {CHUNK} bytes")
        return t["param"], t["name"]


def encode(v):
    """A small-state or hyperparameter value as JSON (checkpoint_staging decodes it)."""
    if isinstance(v, torch.Tensor) and v.layout != torch.strided:
        raise _C.UsageError(f"a {v.layout} tensor in the optimizer's state (e.g. SGD momentum "
                            "of sparse gradients) cannot go into a pager checkpoint: save "
                            "that optimizer with torch.save(opt.state_dict()) instead")
    if isinstance(v, torch.Tensor):
        return {"tensor": v.tolist(), "dtype": str(v.dtype), "device": str(v.device)}
    if isinstance(v, tuple):
        return {"tuple": [encode(x) for x in v]}
    return v


def stored(binding, p) -> list:
    """(name, tensor) of parameter p's stored tensors, in a stable order."""
    return [(n, t) for name, form in binding.forms(p)
            for n, t in zip(form.names(name), form.tensors)]


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ints(v) -> bool:
    return isinstance(v, list) and all(is_int(x) for x in v)
