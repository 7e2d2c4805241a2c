"""Scripts that end with an error while a Pager is live, for the exit tests
(tests/python/test_exit.py on the host, tests/gpu/test_cuda_exit.py on CUDA):
    exit_run.py CASE STORE [--device D]
Each case raises out of the script; the process must print the traceback and exit with
status 1 (3 for `sys-exit`, 0 for `clean`), never abort. STORE is the store directory:
closed at exit, it is gone afterwards. Megatron cases (GPU) build examples/megatron_gpt.py."""
import argparse
import os
import sys

import torch

import statepager

MiB = 1 << 20


def small_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256)).to(device)


def trained(pager, device, **attach):
    """A model with an attached AdamW that has stepped once."""
    model = small_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pager.attach(opt, bucket_size=128 << 10, **attach)
    model(torch.randn(8, 256, device=device)).sum().backward()
    opt.step()
    return model, opt


def megatron(pager, **build):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import megatron_gpt

    megatron_gpt.init()
    setup = megatron_gpt.Setup(steps=2)
    return setup, megatron_gpt, megatron_gpt.build(setup, pager, **build)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("store")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    page = 2 * MiB if args.device.startswith("cuda") else 64 << 10
    case = args.case
    if case == "megatron-assert-unpaged":  # the control: Megatron alone, no Pager at all
        setup, gpt, (model, optimizer, scheduler, _) = megatron(None)
        gpt.train_step(setup, model, optimizer, scheduler, 0)
        assert False, "user code failed after a Megatron step"
    pager = statepager.Pager(args.store, args.device, page_size=page)
    if case == "attach-usage-error":
        # The pipeline cannot fit the budget: attach refuses.
        small = statepager.Pager(args.store + "-small", args.device, page_size=page,
                                 hbm_budget=page)
        trained(small, args.device)
    elif case == "raise-after-step":
        trained(pager, args.device)
        assert False, "user code failed after a step"
    elif case == "bucket-in-flight":
        trained(pager, args.device)
        ts = [pager.empty(1 << 20) for _ in range(16)]  # 64 MiB
        pager.page_in(ts)
        pending = pager.page_out_async(ts)  # noqa: F841  (in flight when the error comes)
        raise RuntimeError("user code failed with a bucket in flight")
    elif case == "save-in-flight":
        trained(pager, args.device)
        pending = pager.save(args.store + "-ckpt", background=True)  # noqa: F841
        raise RuntimeError("user code failed with a background save in flight")
    elif case == "scope-open":
        with pager.scope():
            mains = [torch.zeros(1 << 20, device=args.device) for _ in range(4)]  # noqa: F841
            raise RuntimeError("user code failed inside scope()")
    elif case == "paused":
        trained(pager, args.device)
        pager.pause()
        raise RuntimeError("user code failed while paused")
    elif case == "with-block":
        with statepager.Pager(args.store + "-with", args.device, page_size=page) as inner:
            trained(inner, args.device)
            raise RuntimeError("user code failed inside `with Pager()`")
    elif case == "sys-exit":
        trained(pager, args.device)
        sys.exit(3)
    elif case == "clean":
        trained(pager, args.device)  # never closed: closed at exit
    elif case == "megatron-attach-usage-error":
        # Mains below scope()'s 1 MiB stay out of the pager; attach finds no room for
        # the step's pipeline in one page.
        small = statepager.Pager(args.store + "-small", args.device, page_size=page,
                                 hbm_budget=page)
        megatron(small)  # built in scope(), refused at attach
    elif case == "megatron-assert":
        setup, gpt, (model, optimizer, scheduler, _) = megatron(pager, bucket_size=1 * MiB)
        gpt.train_step(setup, model, optimizer, scheduler, 0)
        assert False, "user code failed after a Megatron step"
    else:
        raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    main()
