"""statepager: optimizer state in a paged virtual-memory pool, streamed to NVMe files.

Tensors created by a Pager keep their address and identity for life; their physical
memory exists only while they are resident. See README.md for usage.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from statepager import _build

_C = _build.load_extension()

from statepager._C import (  # noqa: E402, F401
    CorruptStoreError,
    DeviceError,
    Error,
    IoUringUnavailableError,
    NoSpaceError,
    OutOfMemoryError,
    StoreBusyError,
    StoreIOError,
    StorePermissionError,
    UsageError,
    cuda_available,
)
from statepager.core.handles import PageHandle  # noqa: E402, F401
from statepager.core.pager import Pager  # noqa: E402, F401
from statepager.core.hooks import Hooks  # noqa: E402, F401
from statepager.core.step_stats import StepStats  # noqa: E402, F401
from statepager.core.binding import StreamedOptimizer  # noqa: E402, F401
from statepager.core.optim import PagedAdamW  # noqa: E402, F401
from statepager import checkpoint  # noqa: E402, F401
from statepager.core import state_values  # noqa: E402, F401
from statepager.checkpoint import CheckpointMismatchError  # noqa: E402, F401
# Integrations register their adapters with Pager.attach (statepager.core.adapters).
from statepager.integrations import megatron as _megatron  # noqa: E402, F401

__all__ = [
    "Pager",
    "PageHandle",
    "Hooks",
    "PagedAdamW",
    "StepStats",
    "StreamedOptimizer",
    "checkpoint",
    "state_values",
    "cuda_available",
    "Error",
    "UsageError",
    "StoreIOError",
    "NoSpaceError",
    "StorePermissionError",
    "CorruptStoreError",
    "CheckpointMismatchError",
    "StoreBusyError",
    "OutOfMemoryError",
    "DeviceError",
    "IoUringUnavailableError",
]
