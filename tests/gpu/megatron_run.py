"""Megatron GPT jobs for the GPU tests, one process per rank (plain python, or torchrun):
    megatron_run.py parity OUT [--experts E] [--overlap] [--overlap-forward]
                                               train with and without the pager, compare
    megatron_run.py fresh OUT                  train N, save (model + pager), train M more
    megatron_run.py resume OUT                 load what `fresh` saved, train the same M
Each rank writes OUT/<mode>-rank<r>.pt; `parity` also asserts. Exit status 0 on success."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import megatron_gpt  # noqa: E402

from statepager import checkpoint
from statepager import Pager  # noqa: E402

MiB = 1 << 20
N_BEFORE, M_AFTER = 6, 6


def snapshot(optimizer, binding):
    """Mains and moments (and native fp32 params with their state), host copies."""
    out = []
    member_bindings = binding.bindings if binding else None
    for i, d in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = d.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        copies = {}

        def take(p):
            copies[id(p)] = [p.cpu()] + [v.cpu() for _, v in sorted(inner.state[p].items())
                                         if isinstance(v, torch.Tensor) and v.dim() > 0]
        if member_bindings is None:
            for p in params:
                take(p)
        else:
            for b in member_bindings[i].state_in_buckets():
                for p in b.params:
                    take(p)
        out.append([copies[id(p)] for p in params])
    return out


def stores_in_use(pager, binding) -> list:
    """Per member, the store its mains and moments are paged to (one name, or a set)."""
    out = []
    for member_binding in binding.bindings:
        names = {pager.services.store_of(t) for b in member_binding.buckets for t in b.stored}
        out.append(names.pop() if len(names) == 1 else names)
    return out


def train(setup, model, optimizer, scheduler, first, count):
    return [megatron_gpt.train_step(setup, model, optimizer, scheduler, i)
            for i in range(first, first + count)]


def result(model, optimizer, binding, losses):
    megatron_gpt.finish(model)
    return {"losses": losses, "params": [p.detach().cpu() for p in model.parameters()],
            "state": snapshot(optimizer, binding)}


def same(a, b) -> str:
    """'' when identical, else what differs."""
    if a["losses"] != b["losses"]:
        return f"losses differ: {a['losses']} vs {b['losses']}"
    if not all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])):
        return "model params differ"
    for ma, mb in zip(a["state"], b["state"]):
        for ta, tb in zip(ma, mb):
            if len(ta) != len(tb) or not all(torch.equal(x, y) for x, y in zip(ta, tb)):
                return "mains or moments differ"
    return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["parity", "fresh", "resume"])
    ap.add_argument("out")
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--expert-parallel", type=int, default=1)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--overlap-forward", action="store_true",
                    help="the paged run's steps end under the next forward")
    args = ap.parse_args()
    megatron_gpt.init(args.expert_parallel)
    rank = torch.distributed.get_rank()
    setup = megatron_gpt.Setup(experts=args.experts, overlap=args.overlap, steps=20)
    store = os.path.join(args.out, "store-{rank}")
    out_file = os.path.join(args.out, f"{args.mode}-rank{rank}.pt")
    if args.mode == "parity":
        model, optimizer, scheduler, _ = megatron_gpt.build(setup)
        base = result(model, optimizer, None,
                      train(setup, model, optimizer, scheduler, 0, setup.steps))
        del model, optimizer, scheduler
        with Pager(store, "cuda", page_size=2 * MiB) as pager:
            model, optimizer, scheduler, binding = megatron_gpt.build(setup, pager,
                                                                      bucket_size=1 * MiB)
            if args.overlap_forward:
                binding.overlap_forward(model)
            paged = result(model, optimizer, binding,
                           train(setup, model, optimizer, scheduler, 0, setup.steps))
            names = [s.name for s in binding.bindings]
            stores = stores_in_use(pager, binding)
            assert stores == names, f"members' state in stores {stores}, not {names}"
            assert all(os.path.isfile(os.path.join(pager.directory, n, "state.bin"))
                       for n in names)
        torch.save({"base": base, "paged": paged}, out_file)
        diff = same(base, paged)
        print(f"rank {rank}: optimizers {names}, each in its own store, {setup.steps} steps, "
              f"final loss "
              f"{paged['losses'][-1]:.4f}, {'identical' if not diff else diff}", flush=True)
        if diff:
            sys.exit(1)
    else:
        ckpt = os.path.join(args.out, "ckpt")
        with Pager(store, "cuda", page_size=2 * MiB) as pager:
            model, optimizer, scheduler, binding = megatron_gpt.build(setup, pager,
                                                                      bucket_size=1 * MiB)
            model_file = os.path.join(ckpt, f"model-rank{rank}.pt")
            if args.mode == "fresh":
                train(setup, model, optimizer, scheduler, 0, N_BEFORE)
                megatron_gpt.finish(model)
                torch.distributed.barrier()
                os.makedirs(ckpt, exist_ok=True)
                torch.save({"model": model.module.state_dict(),
                            "scheduler": scheduler.state_dict()}, model_file)
                checkpoint.save(pager, checkpoint.rank_directory(ckpt))
                at_checkpoint = result(model, optimizer, binding, [])
            else:
                saved = torch.load(model_file, weights_only=False)
                model.module.load_state_dict(saved["model"])
                scheduler.load_state_dict(saved["scheduler"])
                assert checkpoint.load(pager, checkpoint.rank_directory(ckpt)), "no statepager state in the checkpoint"
                at_checkpoint = result(model, optimizer, binding, [])
            losses = train(setup, model, optimizer, scheduler, N_BEFORE, M_AFTER)
            torch.save({**result(model, optimizer, binding, losses),
                        "at_checkpoint": at_checkpoint}, out_file)
        print(f"rank {rank}: {args.mode} done, losses {losses}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
