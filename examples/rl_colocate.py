"""RL colocation: a trainer and an inference engine take turns on one device.

The trainer's parameters, gradients and AdamW state are allocated inside
memory_saver.region(tag="train", enable_cpu_backup=True), as verl, slime and SGLang do
with torch_memory_saver (statepager.memory_saver.install_as_torch_memory_saver() gives
their `import torch_memory_saver` this API). Between two training steps,
pause("train") gives the trainer's memory back; an "inference" phase then allocates a
KV-cache-like buffer in it, uses it and frees it; resume("train") brings the trainer
back at the same addresses. The same run without the pause must give bit-exact losses,
parameters and optimizer state: both runs happen here, in one process.

On CUDA the buffer is sized from torch.cuda.mem_get_info() to need the memory the pause
gives back; without a GPU the host backend runs it (for CI), with a buffer of --kv-mib.
    python examples/rl_colocate.py [--hidden 256] [--layers 2] [--steps 2] [--kv-mib 64]
"""
import argparse
import time

import torch

from statepager.memory_saver import TorchMemorySaver

MiB, GiB = 1 << 20, 1 << 30


def batches(args, device: torch.device) -> list:
    """The same (input, target) pairs for every run."""
    g = torch.Generator().manual_seed(args.seed + 1)
    shape = (args.batch, args.hidden)
    return [(torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device))
            for _ in range(2 * args.steps)]


def build(args, device: torch.device):
    """The model, its gradients and AdamW, made inside the "train" region (call it there).
    On the host backend a region holds the tensors made by copies and *_like factories
    (Pager.scope()), so parameters are copied and gradients made with zeros_like; on
    CUDA every allocation inside is the region's anyway."""
    torch.manual_seed(args.seed)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, 4 * args.hidden), torch.nn.GELU(),
                   torch.nn.Linear(4 * args.hidden, args.hidden)]
    model = torch.nn.Sequential(*layers).to(device)
    for p in model.parameters():
        p.data = p.data.clone()
        p.grad = torch.zeros_like(p)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, opt, batch) -> torch.Tensor:
    x, y = batch
    opt.zero_grad(set_to_none=False)  # the gradients stay in the region
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def inference(args, device: torch.device, free_before: int) -> dict:
    """Allocates a KV-cache-like buffer, writes and reads it, frees it. On CUDA it takes
    all the free memory but some headroom, which without the pause was not free."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        headroom = min((free - free_before) // 2, GiB)
        nbytes = free - headroom
    else:
        nbytes = args.kv_mib * MiB
    kv = torch.empty(nbytes, dtype=torch.uint8, device=device)
    kv.fill_(1)
    total = int(kv[:: 4096].sum())
    del kv
    if device.type == "cuda":
        torch.cuda.empty_cache()
    assert total == (nbytes + 4095) // 4096
    return {"kv_bytes": nbytes,
            "needs_the_pause": nbytes > free_before if device.type == "cuda" else "n/a (host)"}


def run(args, device: torch.device, pause: bool) -> dict:
    """2 x --steps training steps, with pause / inference / resume in the middle when
    `pause`. Returns the losses, the final parameters and optimizer state (on the CPU)
    and the timings."""
    saver = TorchMemorySaver(device=device)
    out = {"losses": []}
    try:
        data = batches(args, device)
        with saver.region(tag="train", enable_cpu_backup=True):
            model, opt = build(args, device)
            for batch in data[:args.steps]:
                out["losses"].append(train_step(model, opt, batch))
        if pause:
            out.update(pause_resume(args, device, saver))
        with saver.region(tag="train", enable_cpu_backup=True):
            for batch in data[args.steps:]:
                out["losses"].append(train_step(model, opt, batch))
        # Copies: on the host backend .cpu() would be the region's memory, gone at close().
        out["params"] = [p.detach().to("cpu", copy=True) for p in model.parameters()]
        out["state"] = [v.detach().to("cpu", copy=True) for s in opt.state.values()
                        for v in s.values()]
    finally:
        synchronize(device)
        saver.close()
    return out


def pause_resume(args, device: torch.device, saver) -> dict:
    pager = saver.pager("train", "cpu")
    nbytes = pager.stats()["mapped_bytes"]
    synchronize(device)
    free_before = pager.free_device_memory()
    t0 = time.perf_counter()
    saver.pause("train")
    synchronize(device)
    pause_s = time.perf_counter() - t0
    infer = inference(args, device, free_before)
    t0 = time.perf_counter()
    saver.resume("train")
    synchronize(device)
    return {"train_bytes": nbytes, "pause_s": pause_s, "resume_s": time.perf_counter() - t0,
            **infer}


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="MLP blocks")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2,
                        help="training steps before the pause, and as many after")
    parser.add_argument("--kv-mib", type=int, default=64,
                        help="the inference buffer on the host backend (CUDA sizes its own)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    plain = run(args, device, pause=False)
    paused = run(args, device, pause=True)
    gb = paused["train_bytes"] / 1e9
    print(f"device {device}; trainer state in the region: {paused['train_bytes'] / MiB:.1f} MiB")
    print(f"pause:  {paused['pause_s'] * 1e3:.1f} ms ({gb / paused['pause_s']:.2f} GB/s)")
    print(f"inference buffer: {paused['kv_bytes'] / MiB:.1f} MiB; would not fit without the "
          f"pause: {paused['needs_the_pause']}")
    print(f"resume: {paused['resume_s'] * 1e3:.1f} ms ({gb / paused['resume_s']:.2f} GB/s)")
    print("losses:", [f"{x:.6f}" for x in paused["losses"]])
    exact = all(same(plain[k], paused[k]) for k in ("losses", "params", "state"))
    print(f"bit-exact: {exact}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
