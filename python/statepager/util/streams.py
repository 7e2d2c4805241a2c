"""current(device): the CUDA stream that paging and statepager's kernels order themselves
after, as the cudaStream_t the extension takes."""
from __future__ import annotations

import torch


def current(device: torch.device) -> int:
    """The current CUDA stream of `device` (torch.cuda.current_stream(device).cuda_stream);
    0 on the host backend. Through torch's raw accessor, which its compiled code calls
    per launch: a step asks it a few hundred times, and the Stream object the public call
    makes took a few microseconds each."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._C._cuda_getCurrentRawStream(index)
