"""Data parallel on CPU (gloo, world size 2): each rank streams its optimizer state
through its own store, with no shared files and no cross-rank coordination for paging."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from statepager import PagedAdamW, Pager

KiB = 1 << 10
STEPS = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 8))


def train(rank, world, port, root, paged, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    pager = None
    if paged:
        pager = Pager(os.path.join(root, f"rank{dist.get_rank()}"), page_size=64 * KiB)
        opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-3, bucket_size=64 * KiB)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    result = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}
    if pager is not None:
        dist.barrier()  # both stores exist now
        result["dirs"] = sorted(os.listdir(root))
        result["own_files"] = sorted(os.listdir(pager.directory))
        dist.barrier()  # both ranks have looked before either removes its store
        pager.close()
    torch.save(result, os.path.join(out, f"{'paged' if paged else 'plain'}{rank}.pt"))
    dist.destroy_process_group()


def test_two_ranks_each_with_its_own_store(tmp_path):
    root, out = str(tmp_path / "stores"), str(tmp_path)
    os.makedirs(root)
    for paged in (False, True):
        mp.spawn(train, args=(2, free_port(), root, paged, out), nprocs=2, join=True)
    for rank in range(2):
        plain = torch.load(os.path.join(out, f"plain{rank}.pt"))
        paged = torch.load(os.path.join(out, f"paged{rank}.pt"))
        assert paged["losses"] == plain["losses"]
        assert all(torch.equal(a, b) for a, b in zip(plain["params"], paged["params"]))
        assert paged["dirs"] == ["rank0", "rank1"]
        assert "state.bin" in paged["own_files"]
    assert not os.listdir(root)  # each rank removed its own store on close
