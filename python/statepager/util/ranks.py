"""This process's torch.distributed rank, 0 when not initialized (store and checkpoint
directories are per rank)."""
import torch


def rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
