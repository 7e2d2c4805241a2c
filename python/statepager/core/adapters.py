"""Adapters: how Pager.attach hands an optimizer of another framework (Megatron's) to
its integration without the core importing it.

An integration registers an Adapter when it is imported (statepager/__init__.py imports
them); Pager.attach asks find() first and falls back to the torch binding
(statepager.core.binding). Registration happens at import, under the import lock; find()
only reads. Not thread-safe against registering while attaching (nothing does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from statepager import _C


@dataclass(frozen=True)
class Adapter:
    name: str                          # e.g. "Megatron", for error messages
    matches: Callable[[object], bool]  # whether the optimizer is one of its framework's
    # attach(pager, optimizer, *, bucket_size, depth, log_steps, moments, mains, atomic,
    #        stationary_bytes)
    attach: Callable
    # Pager.attach options it sets itself per parameter: passing them is refused.
    sets: tuple = ()


_registered: list[Adapter] = []


def register(adapter: Adapter) -> None:
    if all(a.name != adapter.name for a in _registered):
        _registered.append(adapter)


def find(optimizer) -> Adapter | None:
    return next((a for a in _registered if a.matches(optimizer)), None)


def refuse_set_options(adapter: Adapter, given: dict) -> None:
    """UsageError when `given` (Pager.attach options by name, None: not passed) passes
    one that the adapter sets itself."""
    refused = [k for k in adapter.sets if given.get(k) is not None]
    if refused:
        raise _C.UsageError(
            f"attach() of a {adapter.name} optimizer sets {', '.join(refused)} itself (one "
            f"binding per member, named by its place): leave "
            f"{'it' if len(refused) == 1 else 'them'} out")
