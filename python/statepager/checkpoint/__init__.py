"""Checkpoints of the optimizers attached to a Pager, in the shape of
torch.distributed.checkpoint: functions over a Pager.

    statepager.checkpoint.save(pager, path, background=False)   # -> SaveHandle
    statepager.checkpoint.load(pager, path, missing_ok=False)   # -> bool
    statepager.checkpoint.rank_directory(base)  # base/statepager/rankNNNNN, per rank

The format, its checks and their order: statepager.checkpoint.save_load; the layout
rules: staging and manifest; the directory's atomic creation: dirs. This layer sits on
the core's interface (pager.services: between_steps, snapshot, restore) and nothing
above.
"""
from __future__ import annotations

import logging
import weakref

from statepager import _C
from statepager.checkpoint import save_load
from statepager.checkpoint.manifest import CheckpointMismatchError
from statepager.checkpoint.save_load import SaveHandle, rank_directory
from statepager.core import args

__all__ = ["save", "load", "rank_directory", "SaveHandle", "CheckpointMismatchError"]

log = logging.getLogger("statepager")

# Pager -> its background save in flight: one at a time, the next save or load of that
# Pager waits for it (and raises its error if no wait() has).
_saving: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def save(pager, path: str, *, background: bool = False) -> SaveHandle:
    """Writes the state of every optimizer attached to `pager` to the new directory
    `path`, atomically. Call it between steps. The bytes are copied from the store's
    files and the host tier, never through the device, with their crc32c computed while
    copying. background=True returns as soon as the state of this moment is secured:
    steps may run while the copy finishes, and a bucket's page-out waits until that
    bucket has been copied. Returns a SaveHandle: wait(), done(), and .method, .bytes,
    .seconds of the save."""
    background = args.flag("background", background)  # before anything changes
    with pager.services.between_steps("save()"):
        _settle(pager)
        handle = save_load.save(pager, path, background=background)
        if background:
            _saving[pager] = handle
        return handle


def load(pager, path: str, *, missing_ok: bool = False) -> bool:
    """Loads a checkpoint written by save() into the optimizers attached to `pager`,
    after verifying format, layout, entries and checksums; nothing changes if any check
    fails. Returns True. A path that holds no checkpoint (nothing there, a file, a
    directory without the manifest) is a UsageError naming what is missing, so that a
    mistyped path never trains from scratch; missing_ok=True ("load if present")
    returns False instead where nothing exists at `path`. With a host tier, the loaded
    state goes into its free room, and what did not fit beside the old state is read
    into it afterwards, first buckets first (the next step's page-ins are host copies)."""
    missing_ok = args.flag("missing_ok", missing_ok)
    with pager.services.between_steps("load()", replaces_state=True):
        _settle(pager)
        loaded = save_load.load(pager, path, missing_ok)
        if loaded:
            _fill_host_tier(pager)
        return loaded


def _settle(pager) -> None:
    """Waits for the pager's background save, if any, and raises its error if no wait()
    has (a failed save is reported once); forgotten either way."""
    handle = _saving.pop(pager, None)
    if handle is not None:
        handle.settle()


def _fill_host_tier(pager) -> None:
    """Reads the loaded state from the store into the host tier's free room, in the order
    the steps need it, until the room is used. A read that fails leaves its tensors in
    the store, where their page-in reads them: the load stands."""
    if not pager.stats()["host_budget"]:
        return
    handles = [pager.read_ahead_async(b.stored) for binding in pager.bindings
               for b in binding.buckets]
    for h in handles:
        try:
            h.wait()
        except _C.Error as e:
            log.warning("statepager: reading the loaded state into the host tier failed "
                        "(%s); it is read from the store instead", e)
