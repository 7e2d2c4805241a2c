"""What an attached optimizer's binding calls back (statepager.core.binding): the hooks
Pager.attach takes, and the step hooks an integration adds, as one object fixed at
construction."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from statepager import _C
from statepager.core import args

BucketHook = Callable[[Sequence[torch.Tensor]], None]
# Called with (param, start, stop) around the step of a chunk of a parameter: elements
# [start, stop) of it in memory order (statepager.core.slices).
ChunkHook = Callable[[torch.Tensor, int, int], None]


@dataclass(frozen=True)
class Hooks:
    """Every callable a binding calls, None where not given (statepager.core.attach
    documents each). before_step and after_step are called with no arguments around each
    step's buckets (the Megatron integration reads its clip coefficient before, and
    knows the mains are copied after); not after a failed step. Each is checked callable
    at construction (UsageError)."""

    before_bucket: BucketHook | None = None
    after_bucket: BucketHook | None = None
    model_param: Callable[[torch.Tensor], torch.Tensor] | None = None
    keep_resident: Callable[[torch.Tensor], bool] | None = None
    before_chunk: ChunkHook | None = None
    after_chunk: ChunkHook | None = None
    before_step: Callable[[], None] | None = None
    after_step: Callable[[], None] | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            args.hook(f.name, getattr(self, f.name))

    def given(self) -> dict:
        """The hooks given, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    @staticmethod
    def of(hooks: "Hooks | None") -> "Hooks":
        """Pager.attach's hooks: `hooks`, or none (UsageError for anything else)."""
        if hooks is None:
            return Hooks()
        if not isinstance(hooks, Hooks):
            raise _C.UsageError(f"hooks must be a statepager.Hooks or None, not "
                                f"{type(hooks).__name__}: attach(opt, hooks=statepager."
                                f"Hooks(before_bucket=...))")
        return hooks
