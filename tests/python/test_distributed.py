"""Data parallel on CPU (gloo, world size 2): each rank streams its optimizer state
through its own store, with no shared files and no cross-rank coordination for paging.

Each rank's process takes one AdamW step on a tensor of its own before the job
(first_adamw_step): on this machine under load, the first AdamW step of a process now
and then gave another result for the same inputs (a plain torch.optim.AdamW, the first
layer's weight: in 4 of 63 two-rank runs, none in 247 with the step thrown away first;
see Note [The first AdamW step of a process] in docs/design.md). These tests compare
bits, so the reference must reproduce."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ports import free_port
from statepager import checkpoint
from statepager import PagedAdamW, Pager

KiB = 1 << 10
STEPS = 20


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 8))


def first_adamw_step():
    """Takes the process's first AdamW step, on a tensor of its own (see the module doc)."""
    w = torch.nn.Parameter(torch.randn(256, 32))
    w.grad = torch.randn(256, 32)
    torch.optim.AdamW([w], lr=1e-3).step()


def train(rank, world, port, root, paged, out):
    first_adamw_step()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    pager = None
    if paged:
        pager = Pager(os.path.join(root, f"rank{dist.get_rank()}"), page_size=64 * KiB)
        opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-3, bucket_size=64 * KiB)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = run_steps(model, opt, rank, 0, STEPS)
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


def resume_job(rank, world, port, root, mode, out):
    """fresh: 6 steps, save (model per rank + pager.save_to on every rank), 6 more.
    resume: a new process group loads both and runs the same 6 steps."""
    first_adamw_step()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    ckpt = os.path.join(root, "ckpt")
    with Pager(os.path.join(root, "store-{rank}"), page_size=64 * KiB) as pager:
        opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-3, bucket_size=64 * KiB)
        model_file = os.path.join(ckpt, f"model{rank}.pt")
        if mode == "fresh":
            run_steps(model, opt, rank, 0, 6)
            os.makedirs(ckpt, exist_ok=True)
            torch.save(model.state_dict(), model_file)
            checkpoint.save(pager, checkpoint.rank_directory(ckpt))
        else:
            model.load_state_dict(torch.load(model_file))
            assert checkpoint.load(pager, checkpoint.rank_directory(ckpt))
        losses = run_steps(model, opt, rank, 6, 6)
        masters = [m for g in opt.param_groups for m in g["params"]]
        state = []
        for m in masters:
            ts = [m, opt.state[m]["exp_avg"], opt.state[m]["exp_avg_sq"]]
            pager.page_in(ts)
            state.append([t.clone() for t in ts])
            pager.page_out(ts)
    torch.save({"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
                "state": state}, os.path.join(out, f"{mode}{rank}.pt"))
    dist.destroy_process_group()


def run_steps(model, opt, rank, first, count):
    losses = []
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * i + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_two_ranks_save_and_resume_exactly(tmp_path):
    root, out = str(tmp_path), str(tmp_path)
    for mode in ("fresh", "resume"):
        mp.spawn(resume_job, args=(2, free_port(), root, mode, out), nprocs=2, join=True)
    assert sorted(os.listdir(os.path.join(root, "ckpt", "statepager"))) == ["rank00000",
                                                                           "rank00001"]
    for rank in range(2):
        fresh = torch.load(os.path.join(out, f"fresh{rank}.pt"))
        resumed = torch.load(os.path.join(out, f"resume{rank}.pt"))
        assert fresh["losses"] == resumed["losses"]
        assert all(torch.equal(a, b) for a, b in zip(fresh["params"], resumed["params"]))
        for a, b in zip(fresh["state"], resumed["state"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
