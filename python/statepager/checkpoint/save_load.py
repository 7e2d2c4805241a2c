"""statepager.checkpoint.save(pager, path) / load(pager, path): checkpoints of the state
of attached optimizers.

A checkpoint is a directory written once:
    manifest.json     what it holds, with a checksum of its own (statepager.checkpoint.manifest)
    <name>/state.bin  per optimizer: its tensors' bytes, each at a 4 KiB-aligned offset,
                      zeros in between

Between steps all paged state is at rest in the store, each tensor in a fixed range of
its files, so a save copies those ranges (reflink, copy_file_range or read/write:
backing/file_copy.h) and nothing passes through the device. The ranges are held at the
moment of the call (allocator/store_snapshot.h): with background=True save() returns
then, training goes on, and a page-out into a range not yet copied waits until it is.
The checksums (crc32c, the CPU's instruction) are computed in the same pass as the copy:
bytes that move are checksummed between read and write, and the ranges a reflink shares
are read once (backing/file_copy.h); those of a tensor made of pieces are read back from
the written file on several threads.
Everything is written into a temporary directory beside `path`, fsynced and renamed: a
crash leaves either the complete checkpoint or none, and the next save or load beside it
removes the temporary of a killed save (statepager.checkpoint.dirs). A path inside a
store directory is refused before anything is written.

A load is all or nothing. First it checks that `path` holds a checkpoint (a UsageError
naming what is missing otherwise; load(..., missing_ok=True) returns False where nothing
exists), that each file it reads is a regular file inside the checkpoint, not a link
(statepager.checkpoint.dirs), the manifest's format, version and own checksum
(statepager.checkpoint.manifest), each data file's place inside the checkpoint and each tensor's
range in it, the layout against the attached optimizers, each parameter's state entries
(whole, and the same as the optimizer's where it has state: staging.check_entries), and
every tensor's crc32s. Then
it creates, ZERO, the state entries the checkpoint holds for parameters that have none
yet, checks each stored tensor against the live one (dtype, shape, strides, size) and
decodes the small state and hyperparameters into staging (statepager.checkpoint.staging);
a failure there drops what it created. Only then is each optimizer's state copied into
the store (Pager::restore, which keeps the old bytes if it fails) and its staged values
assigned, which cannot fail. Any difference is refused with an error that names it. With
several optimizers, a copy failing in one leaves those before it loaded; the error's note
says which.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

import torch

from statepager import _C
from statepager.checkpoint import dirs as checkpoint_dirs
from statepager.checkpoint.checksums import sums_of, verify_data
from statepager.checkpoint.dirs import DATA, MANIFEST
from statepager.checkpoint.staging import Staged, check_entries, check_layout, missing_state
from statepager.checkpoint.manifest import (CHECKSUM, CHUNK, DIGEST, FORMAT, VERSION,
                                            CheckpointMismatchError, DataFile, align, digest,
                                            encode, read_manifest, stored)
from statepager.core import args
from statepager.formats.codecs import in_index_order
from statepager.util import ranks
from statepager.util.names import check_name

log = logging.getLogger("statepager")


class SaveHandle:
    """A checkpoint being written. wait() returns once it is complete and in place, and
    raises the save's error, each time it is called, if it failed (nothing is left at
    `path` then). A background save's error that no wait() has raised is raised once by
    the pager's next save() or load(), which then does nothing else; the pager forgets it
    either way, so the save after that proceeds."""

    def __init__(self, path: str, nbytes: int):
        self.path = path
        self.bytes = nbytes           # tensor bytes in the checkpoint (ZERO ones excluded)
        self.method: str | None = None  # how the bytes were copied (file_copy.h)
        self.call_seconds = 0.0       # save() itself: until training could go on
        self.copy_seconds = 0.0       # copying the bytes (the part steps may wait for), and
                                      # checksumming them (crc32c: in the same pass)
        self.checksum_seconds = 0.0   # a second read to checksum them (tensors in pieces)
        self.seconds: float | None = None  # from the call until the checkpoint was in place
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # set by the saving thread before it ends
        self._raised = False          # whether wait() has raised _error

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._raised = True
            raise self._error

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def settle(self) -> None:
        """Waits for the save and raises its error if no wait() has: the pager's next
        save or load reports a failed background save once."""
        if self._thread is not None:
            self._thread.join()
        if not self._raised:
            self.wait()


def rank_directory(base: str) -> str:
    """base/statepager/rankNNNNN: this rank's checkpoint under a training loop's
    checkpoint directory (rank from torch.distributed, 0 when not initialized)."""
    return os.path.join(os.path.abspath(base), "statepager", f"rank{ranks.rank():05d}")


def save(pager, path: str, *, background: bool = False) -> SaveHandle:
    """statepager.checkpoint.save, between steps (pager.services.between_steps). The caller has
    settled the previous background save and keeps the handle of a background one (the
    next save or load settles it)."""
    args.flag("background", background)
    t_call = time.perf_counter()
    path = os.path.abspath(path)
    checkpoint_dirs.refuse_store_target(path, pager.directory)
    if os.path.exists(path):
        raise _C.UsageError(f"checkpoint {path} exists: checkpoints are written once, "
                            "give each one a new path (e.g. one per step)")
    for binding in pager.bindings:
        check_name(binding.name)
    checkpoint_dirs.remove_dead_temporaries(path)
    # At rest: a save between steps finds nothing resident, so this moves no bytes.
    for h in [pager.page_out_async(b.stored) for bd in pager.bindings for b in bd.buckets]:
        h.wait()
    plan = [_Plan(binding) for binding in pager.bindings]
    # A tensor made of pieces (a parameter that steps in chunks) is copied piece by piece,
    # back to back: its bytes in the checkpoint are those of a tensor of one piece.
    pieces = [pager.services.piece_views(t) for p in plan for t in p.tensors]
    snapshot = pager.services.snapshot([v for views in pieces for v in views])
    try:
        placed = iter(snapshot.placements)
        states = iter(["zero" if all(next(placed)[0] == "zero" for _ in views) else "file"
                       for views in pieces])
        for p in plan:
            p.place([next(states) for _ in p.tensors])
        manifest = {"format": FORMAT, "version": VERSION, "checksum": CHECKSUM,
                    "chunk_bytes": CHUNK, "optimizers": [p.entry for p in plan]}
        checkpoint_dirs.make_parents(os.path.dirname(path))
        tmp = checkpoint_dirs.Temporary(path)
    except BaseException:
        snapshot.release()
        raise
    handle = SaveHandle(path, sum(p.data_bytes for p in plan))

    def finish():
        try:
            _write(plan, pieces, snapshot, tmp.path, manifest, handle)
            tmp.commit()
            handle.seconds = time.perf_counter() - t_call
        except BaseException as e:
            handle._error = e
            tmp.discard()
        finally:
            snapshot.release()

    if background:
        handle._thread = threading.Thread(target=finish, name="statepager-save")
        handle._thread.start()
        handle.call_seconds = time.perf_counter() - t_call
        return handle
    finish()
    handle.call_seconds = time.perf_counter() - t_call
    handle.wait()
    return handle


def _write(plan: list, pieces: list, snapshot, directory: str, manifest: dict,
           handle: SaveHandle) -> None:
    """The checkpoint's files in `directory`: each optimizer's data copied from the
    snapshot with its checksums, then the manifest, all fsynced."""
    files = [os.path.join(directory, p.binding.name, DATA) for p in plan]
    for f in files:
        os.makedirs(os.path.dirname(f))
        open(f, "wb").close()
    t0 = time.perf_counter()
    # Checksums per CHUNK of a tensor made of pieces are read back from the file.
    inline = all(len(views) == 1 for views in pieces)
    if not inline:  # a ZERO piece of a tensor that is not ZERO leaves a hole
        for p, f in zip(plan, files):
            os.truncate(f, p.entry["data_bytes"])
    entries = [(i, e) for i, p in enumerate(plan) for e in p.entries]
    targets = [(i, (e["offset"] or 0) + at) for (i, e), views in zip(entries, pieces)
               for at in _starts(views)]
    handle.method, sums = snapshot.copy_to(files, targets, CHUNK if inline else 0)
    t1 = time.perf_counter()
    handle.copy_seconds = t1 - t0
    if not inline:
        read = iter(sums_of([(f, e["offset"], align(e["bytes"]))
                             for p, f in zip(plan, files) for e in p.entries if not e["zero"]]))
        sums = [[] if e["zero"] else next(read) for p in plan for e in p.entries]
        handle.checksum_seconds = time.perf_counter() - t1
    sums = iter(sums)
    for p in plan:
        for e in p.entries:
            e[CHECKSUM] = next(sums)
    manifest[DIGEST] = digest(manifest)
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    for p in plan:
        checkpoint_dirs.fsync_dir(os.path.join(directory, p.binding.name))


class _Plan:
    """One optimizer's part of a checkpoint: its stored tensors in bucket order (the order
    the step pages them out in, so the copy frees the first bucket first), their places
    in its state.bin, and its manifest entry, all taken at the moment of the save."""

    def __init__(self, binding):
        self.binding = binding
        opt = binding.optimizer
        params = binding.params_in_order()
        index = {id(p): i for i, p in enumerate(params)}
        # Per bucket: (manifest entry, tensor) of each stored tensor.
        self.buckets = [[({"param": index[id(p)], "name": name, "dtype": str(t.dtype),
                           "shape": list(t.shape), "strides": list(t.stride()),
                           "bytes": t.numel() * t.element_size()}, t)
                         for p in bucket for name, t in stored(binding, p)]
                        for bucket in binding.params_by_bucket()]
        self.entries = [e for items in self.buckets for e, _ in items]
        self.tensors = [t for items in self.buckets for _, t in items]
        small, names = {}, {}
        for p in params:
            i = str(index[id(p)])
            small[i] = {k: encode(v) for k, v in opt.state.get(p, {}).items()
                        if not binding.pager.owns(v)}
            names[i] = list(opt.state.get(p, {}))  # torch's order of the entries
            for name, form in binding.forms(p):
                if form.fmt == "residual":  # sorted on the host: a save allocates no device memory
                    listed = tuple(e.cpu() for e in form.exceptions_as_set)
                    small[i][f"{name}:exceptions"] = [encode(e) for e in in_index_order(listed)]
        self.entry = {"name": binding.name, "class": type(opt).__name__, "params": len(params),
                      "formats": {"moments": binding.moments, "mains": binding.mains},
                      "shapes": [list(p.shape) for p in params],
                      "param_groups": [{k: encode(v) for k, v in g.items() if k != "params"}
                                       for g in opt.param_groups],
                      "data": f"{binding.name}/{DATA}", "tensors": self.entries,
                      "small_state": small, "state_names": names}
        self.data_bytes = 0

    def place(self, states: list) -> None:
        """Offsets in state.bin: each non-ZERO tensor at the next 4 KiB boundary."""
        offset = 0
        for e, state in zip(self.entries, states):
            e["zero"] = state == "zero"
            e["offset"] = None if e["zero"] else offset
            if not e["zero"]:
                offset += align(e["bytes"])
                self.data_bytes += e["bytes"]
        self.entry["data_bytes"] = offset


def _starts(views: list) -> list:
    """The byte offset of each of consecutive views from the first one's start."""
    out, at = [], 0
    for v in views:
        out.append(at)
        at += v.numel() * v.element_size()
    return out


def load(pager, path: str, missing_ok: bool = False) -> bool:
    """Loads `path` into the attached optimizers, all or nothing (see the module
    docstring; pager.services.restore copies the bytes in) and
    returns True. A path that holds no checkpoint is a UsageError naming what is missing
    (checkpoint_dirs.require_checkpoint), except that with missing_ok=True a path where
    nothing exists returns False (with a logged notice), changing nothing. The caller has
    settled a background save."""
    path = os.path.abspath(path)
    checkpoint_dirs.remove_dead_temporaries(path)
    if missing_ok and not os.path.lexists(path):
        log.info("statepager: no checkpoint at %s; the optimizer state is left as it is", path)
        return False
    manifest = read_manifest(path)
    saved = {e["name"]: e for e in manifest["optimizers"]}
    bindings = pager.bindings
    attached = [b.name for b in bindings]
    if sorted(saved) != sorted(attached):
        raise CheckpointMismatchError(
            f"checkpoint {path} does not fit: optimizers {sorted(saved)} saved, "
            f"{sorted(attached)} attached. Load it into the same model, optimizers and "
            "sharding it was saved from.")
    entries = [saved[b.name] for b in bindings]
    data = [DataFile(entry, path) for entry in entries]
    for binding, entry, d in zip(bindings, entries, data):
        check_layout(binding, entry, d)
        check_entries(binding, entry, d)
    missing = [missing_state(binding, d) for binding, d in zip(bindings, data)]
    verify_data(data)
    # The live state changes from here on; until an optimizer is loaded, what changed in
    # it is undone on failure.
    created, loaded = {}, []
    try:
        for binding, m in zip(bindings, missing):
            created[binding.name] = _create_state(binding, m)
        staged = [Staged(b, e, d) for b, e, d in zip(bindings, entries, data)]
        _restore(pager, staged, loaded)
    except BaseException as e:
        for binding in bindings:
            if binding.name not in loaded:
                _drop_state(binding, created.get(binding.name, {}))
        if loaded:
            e.add_note(f"statepager: optimizers {loaded} were loaded from {path} before "
                       "this error; the others are as they were")
        raise
    return True


def _restore(pager, staged: list, loaded: list) -> None:
    """Each optimizer's bytes into the store (all or nothing: Pager::restore), then its
    staged values. Appends the name of each optimizer loaded to `loaded`."""
    # Resident tensors go out first (between steps there are none), so their bytes are
    # at rest in the store, where Pager::restore keeps them if it fails.
    resident = [t for s in staged for t in s.restore[0]
                if pager.residency(t) in ("resident", "mixed")]
    if resident:
        pager.page_out(resident)
    for s in staged:
        tensors, zero, offsets = s.restore
        pieces = [pager.services.piece_views(t) for t in tensors]  # each piece from its place
        pager.services.restore([v for views in pieces for v in views],
                      [z for z, views in zip(zero, pieces) for _ in views],
                      s.data.path,
                      [offset + at for offset, views in zip(offsets, pieces)
                       for at in _starts(views)])
        s.apply()
        s.binding.drop_pending_step()  # its state replaced
        loaded.append(s.binding.name)


def _create_state(binding, missing: dict) -> dict:
    """Creates the state entries of missing_state (ZERO pager tensors, to be restored).
    Returns {param: [names]} of what it created."""
    opt = binding.optimizer
    params = binding.params_in_order()
    created = {}
    for j, specs in missing.items():
        p = params[j]
        created[p] = list(specs)
        for name, (shape, dtype, strides) in specs.items():
            like = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
            opt.state[p][name] = binding.empty_state_like(p, like)
    if created:
        binding.state_changed()
    return created


def _drop_state(binding, created: dict) -> None:
    """Undoes _create_state: those parameters have no state again."""
    for p in created:
        binding.optimizer.state.pop(p, None)
    if created:
        binding.state_changed()
