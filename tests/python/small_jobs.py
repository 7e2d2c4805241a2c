"""The small model and Pager the step suites (test_fault_step, test_safety_steps) bind
optimizers to: an MLP of 37 -> 7 with a LayerNorm, a Pager whose budget fits the step
pipeline's window twice over, and reproducible gradients per step."""
import torch

from statepager import Pager

KiB, MiB = 1 << 10, 1 << 20
BUDGET = {"cpu": 8 * MiB, "cuda": 64 * MiB}  # the pipeline's window fits, twice over
PAGE = {"cpu": 64 * KiB, "cuda": 2 * MiB}


def make_model(device, dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(37, 301), torch.nn.GELU(), torch.nn.LayerNorm(301),
        torch.nn.Linear(301, 129), torch.nn.GELU(), torch.nn.Linear(129, 7))
    return model.to(device=device, dtype=dtype)


def make_pager(store, device, budget=True):
    return Pager(store, device=device, page_size=PAGE[device],
                 hbm_budget=BUDGET[device] if budget else None)


def set_grads(model, step=0):
    """Gradients of a fixed batch per `step` (the same in every run)."""
    gen = torch.Generator().manual_seed(100 + step)
    p = next(model.parameters())
    x = torch.randn(16, 37, generator=gen).to(device=p.device, dtype=p.dtype)
    model.zero_grad()
    model(x).float().square().mean().backward()


def bits(t):
    """A tensor's bytes, on the CPU."""
    return t.detach().reshape(-1).view(torch.uint8).cpu().clone()


def stored_bits(pager, binding):
    """Per bucket, each stored tensor's residency and bytes, read without changing anything:
    paged in inside an epoch that is then aborted (no writes, residency as it was)."""
    stored = []
    for b in binding.buckets:
        residency = [pager.residency(t) for t in b.stored]
        epoch = pager.begin_epoch(b.stored)
        pager.page_in(b.stored)
        stored.append([(r, bits(t)) for r, t in zip(residency, b.stored)])
        epoch.abort()
    return stored
