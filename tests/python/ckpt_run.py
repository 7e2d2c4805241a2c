"""Training job for the checkpoint tests, run in its own process:
    python ckpt_run.py STORE CKPT_DIR OUT N_BEFORE M_AFTER MODE [WIDTH]
fresh: train N steps, save model + pager checkpoint, train M more, write losses/state.
resume: load the checkpoint, train the same M steps, write losses/state.
kill, kill-background: train N steps, then save checkpoints CKPT_DIR-k over and over
    (background: a step while each save is in flight) until killed from outside.
background: train N steps, write the state to OUT.at-save, save in the background, train
    M steps while it runs, wait; OUT records whether the save was still running then.
inspect: load the checkpoint and write the state to OUT.
WIDTH: of the hidden layer (200); larger makes a save long enough to overlap steps."""
import sys

import torch

import statepager
from statepager import checkpoint

KiB = 1 << 10


def model_and_opt(store, width=200):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, width), torch.nn.GELU(),
                                torch.nn.Linear(width, 150), torch.nn.GELU(),
                                torch.nn.Linear(150, 5)).bfloat16()
    pager = statepager.Pager(store, page_size=64 * KiB)
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    # Buckets: several per step at any width.
    bucket = max(60 * KiB, width * 174 * 12 // 8)
    opt = statepager.PagedAdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": rest, "weight_decay": 0.0}],
                                pager=pager, lr=2e-3, bucket_size=bucket)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    return model, pager, opt, sched


def steps(model, opt, sched, first, count):
    losses = []
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, 24, generator=g).bfloat16()
        y = torch.randn(32, 5, generator=g).bfloat16()
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def snapshot(model, opt, pager):
    masters = [m for g in opt.param_groups for m in g["params"]]
    state = []
    for m in masters:
        st = opt.state.get(m, {})  # none before the first step, as in torch
        ts = [m] + [st[k] for k in ("exp_avg", "exp_avg_sq") if k in st]
        pager.page_in(ts)
        state.append([t.clone() for t in ts] + ([st["step"].clone()] if st else []))
        pager.page_out(ts)
    return {"params": [p.detach().clone() for p in model.parameters()], "state": state,
            "lr": [g["lr"] for g in opt.param_groups]}


def saved(tmp_path) -> str:
    """A checkpoint after 3 steps (PagedAdamW, two param groups, a scheduler), saved
    into tmp_path/ckpt from a store in tmp_path/store; its path."""
    model, pager, opt, sched = model_and_opt(str(tmp_path / "store"))
    steps(model, opt, sched, 0, 3)
    path = str(tmp_path / "ckpt")
    checkpoint.save(pager, path)
    pager.close()
    return path


def main():
    store, ckpt, out, n, m, mode = sys.argv[1:7]
    n, m = int(n), int(m)
    model, pager, opt, sched = model_and_opt(store, *map(int, sys.argv[7:8]))
    if mode in ("kill", "kill-background"):
        steps(model, opt, sched, 0, n)
        for k in range(100000):
            h = checkpoint.save(pager, f"{ckpt}-{k}", background=mode == "kill-background")
            if mode == "kill-background":
                steps(model, opt, sched, n + k, 1)
                h.wait()
    if mode == "background":
        steps(model, opt, sched, 0, n)
        torch.save(snapshot(model, opt, pager), out + ".at-save")
        h = checkpoint.save(pager, ckpt, background=True)
        running = not h.done()
        held = pager.stats()["buckets_held"]
        steps(model, opt, sched, n, m)
        h.wait()
        torch.save({"running": running, "held": pager.stats()["buckets_held"] - held}, out)
        pager.close()
        return
    if mode == "inspect":
        assert checkpoint.load(pager, ckpt)
        torch.save(snapshot(model, opt, pager), out)
        pager.close()
        return
    if mode in ("fresh", "train-on"):
        steps(model, opt, sched, 0, n)
        torch.save({"model": model.state_dict(), "sched": sched.state_dict()}, ckpt + ".pt")
        checkpoint.save(pager, ckpt)
        if mode == "train-on":  # until killed (the test kills it in the middle of a step)
            steps(model, opt, sched, n, 10**9)
    else:
        extra = torch.load(ckpt + ".pt")
        model.load_state_dict(extra["model"])
        sched.load_state_dict(extra["sched"])
        assert checkpoint.load(pager, ckpt)
    losses = steps(model, opt, sched, n, m)
    torch.save({"losses": losses, **snapshot(model, opt, pager)}, out)
    pager.close()


if __name__ == "__main__":
    main()

