"""Scripts that end with an error while a Pager is live, for the exit tests
(tests/python/test_exit.py on the host, tests/gpu/test_cuda_exit.py on CUDA):
    exit_run.py CASE STORE [--device D]
Each case raises out of the script; the process must print the traceback and exit with
status 1 (3 for `sys-exit`, 0 for `clean`; for a KeyboardInterrupt, the status of the
same interrupt after a torch optimizer's step, `interrupt-unpaged`), never abort. The `*-in-step` cases fail inside opt.step() (the pager's
page budget used up, a store file cut short, a hook's exception, a KeyboardInterrupt) and
check, before the error leaves the script, that the failed step changed no parameter and
no state. STORE is the store directory: closed at exit, it is gone afterwards. Megatron
cases (GPU) build examples/megatron_gpt.py."""
import argparse
import os
import sys

import torch

import statepager
from statepager import checkpoint

from compare import same

MiB = 1 << 20


def small_model(device, width=256):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width)).to(device)


def trained(pager, device, width=256, **attach):
    """A model with an attached AdamW that has stepped once."""
    model = small_model(device, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pager.attach(opt, bucket_size=128 << 10, **attach)
    model(torch.randn(8, width, device=device)).sum().backward()
    opt.step()
    return model, opt


def step_fails(pager, device, arrange, width=256, **attach):
    """trained(), then a step that arrange(model, opt) makes fail from inside; arrange
    returns what ends the cause. Checks that the failed step (all or nothing) changed no
    parameter and no state, then lets its error out."""
    model, opt = trained(pager, device, width, atomic=True, **attach)
    model(torch.randn(8, width, device=device)).sum().backward()
    params = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    end_cause = arrange(model, opt)
    try:
        opt.step()
    finally:
        end_cause()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        assert same(opt.state_dict(), state), "the failed step changed the state"


def budget_used_up(pager):
    """Pages in tensors of the user's until the page budget refuses one."""
    def arrange(model, opt):
        held = []
        try:
            while True:
                held.append(pager.empty(64 << 10))
                pager.page_in(held[-1:])
        except statepager.OutOfMemoryError:
            held.pop()
        return lambda: pager.page_out(held)
    return arrange


def store_cut_short(pager):
    """Cuts the optimizer's store file short under the pager (its page-ins fail, as on an
    I/O error); what ends it writes the bytes back."""
    def arrange(model, opt):
        path = os.path.join(pager.directory, "opt0", "state.bin")
        with open(path, "rb") as f:
            data = f.read()
        os.truncate(path, 4096)

        def write_back():
            with open(path, "r+b") as f:
                f.write(data)
        return write_back
    return arrange


class FailingHook:
    """A before_bucket hook that raises `error` at the second bucket once armed."""

    def __init__(self, error):
        self.error, self.calls = error, None

    def __call__(self, params):
        if self.calls is not None:
            self.calls += 1
            if self.calls == 2:
                raise self.error

    def arm(self, model, opt):
        self.calls = 0
        return self.disarm

    def disarm(self):
        self.calls = None


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
    if case == "interrupt-unpaged":  # the control: a torch optimizer's step, no Pager
        model = small_model(args.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(8, 256, device=args.device)).sum().backward()
        opt.step()
        raise KeyboardInterrupt
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
        pending = checkpoint.save(pager, args.store + "-ckpt", background=True)  # noqa: F841
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
    elif case == "oom-in-step":
        budgeted = statepager.Pager(args.store + "-budget", args.device, page_size=page,
                                    hbm_budget=64 * page)
        # State over many pages: the user's tensors that fill the budget may share a page
        # with it (CUDA's are 2 MiB), never all of the step's.
        step_fails(budgeted, args.device, budget_used_up(budgeted),
                   width=1024 if args.device.startswith("cuda") else 256)
    elif case == "io-error-in-step":
        step_fails(pager, args.device, store_cut_short(pager))
    elif case in ("hook-in-step", "interrupt-in-step"):
        hook = FailingHook(RuntimeError("user hook failed inside a step")
                           if case == "hook-in-step" else KeyboardInterrupt())
        step_fails(pager, args.device, hook.arm, hooks=statepager.Hooks(before_bucket=hook))
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
