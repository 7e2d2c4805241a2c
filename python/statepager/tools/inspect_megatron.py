"""statepager inspect's reading of a Megatron-LM checkpoint: the iteration its tracker
names (PATH its --save directory, holding latest_checkpointed_iteration.txt) and, in an
iteration's torch_dist checkpoint (metadata.json and torch.distributed.checkpoint's
.metadata, read with its FileSystemReader: no Megatron and no process group needed), the
optimizer state Megatron's own format holds beside the model:
  none               saved with --no-save-optim, as statepager.megatron_lm saves (the
                     optimizer state is statepager's part, statepager/rank*/);
  dp_reshardable     the DistributedOptimizer's buckets (keys optimizer.distributed.*);
  model space        one tensor per model parameter and state entry (keys
                     optimizer.state.*: fully_reshardable, fully_sharded_model_space, or
                     an optimizer that is not distributed).
Keys and shapes only; the tensors' bytes are not read.
"""
from __future__ import annotations

import glob
import json
import os

_TRACKER = "latest_checkpointed_iteration.txt"
_CONFIG = "metadata.json"  # Megatron's dist-checkpointing config (its backends)
_LAYOUTS = (("optimizer.distributed.", "dp_reshardable"), ("optimizer.state.", "model space"))


def tracker(path: str) -> str | None:
    """The iteration Megatron's tracker file in `path` names, or None without one."""
    try:
        with open(os.path.join(path, _TRACKER)) as f:
            return f.read().strip()
    except OSError:
        return None


def iterations(path: str) -> list[str]:
    """The iteration directories (iter_NNNNNNN) of a --save directory, in order."""
    return sorted(d for d in glob.glob(os.path.join(path, "iter_*")) if os.path.isdir(d))


def checkpoint(path: str) -> dict | None:
    """What Megatron's torch_dist checkpoint in `path` holds: its backend, tensor count
    and bytes, and the optimizer state by layout; None when `path` holds none."""
    config = os.path.join(path, _CONFIG)
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        backend = json.load(f).get("sharded_backend")
    out = {"path": path, "backend": backend}
    try:
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # a partial or foreign checkpoint: say so, read the rest
        return {**out, "error": f"{type(e).__name__}: {e}"}
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    out.update(tensors=len(tensors), tensor_bytes=sum(map(_bytes, tensors.values())))
    optimizer = {}
    for key, v in tensors.items():
        layout = next((name for prefix, name in _LAYOUTS if key.startswith(prefix)), None)
        if layout is None:
            continue
        o = optimizer.setdefault(layout, {"tensors": 0, "bytes": 0, "states": []})
        o["tensors"] += 1
        o["bytes"] += _bytes(v)
        state = key.rsplit(".", 1)[-1] if layout == "dp_reshardable" else key.split(".")[2]
        if state not in o["states"]:
            o["states"].append(state)
    out["optimizer"] = optimizer
    return out


def _bytes(v) -> int:
    n = v.properties.dtype.itemsize
    for d in v.size:
        n *= d
    return n


def lines(r: dict, size) -> list[str]:
    """The report's lines of a checkpoint() result; size(n) formats a byte count."""
    head = f"Megatron checkpoint {r['path']} ({r['backend']})"
    if "error" in r:
        return [f"{head}: unreadable: {r['error']}"]
    out = [f"{head}: {r['tensors']} tensors, {size(r['tensor_bytes'])}"]
    if not r["optimizer"]:
        out.append("  optimizer state in Megatron's format: none (--no-save-optim; "
                   "statepager.megatron_lm saves its own part, statepager/rank*/)")
    for layout, o in r["optimizer"].items():
        out.append(f"  optimizer state in Megatron's format, {layout}: {o['tensors']} "
                   f"tensors, {size(o['bytes'])} ({', '.join(o['states'])}); a paged run "
                   "resumes from it with --statepager-optimizer-checkpoint megatron")
    return out
