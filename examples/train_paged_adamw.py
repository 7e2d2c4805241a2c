"""Train a small bf16 transformer with PagedAdamW: fp32 masters and Adam moments live in a
statepager store and stream through the device bucket by bucket every step.

    python examples/train_paged_adamw.py --dir /tmp/statepager-main [--steps 20]

Runs on the GPU when one is present, else on the host backend. Prints loss, step time and
the pager's per-step figures.
"""
import argparse
import time

import torch

import statepager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(0)
    vocab, seq, batch = 1024, 64, 8
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, args.width),
        *[torch.nn.TransformerEncoderLayer(args.width, 8, 4 * args.width, batch_first=True)
          for _ in range(args.layers)],
        torch.nn.Linear(args.width, vocab),
    ).to(device=device, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())

    with statepager.Pager(args.dir, device=device, page_size=2 << 20) as pager:
        opt = statepager.PagedAdamW(model.parameters(), pager=pager, lr=3e-4, weight_decay=0.1,
                                    bucket_size=8 << 20)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
        print(f"{n_params / 1e6:.1f} M params (bf16) on {device}; fp32 masters + moments "
              f"({12 * n_params / 2**20:.0f} MiB) in {len(opt.binding.buckets)} buckets at "
              f"{args.dir}; resident now: {pager.stats()['mapped_bytes']} bytes")
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, vocab, (64, seq + 1), generator=g)
        for step in range(1, args.steps + 1):
            rows = torch.randint(0, len(data), (batch,), generator=g)
            x, y = data[rows, :-1].to(device), data[rows, 1:].to(device)
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            s = opt.binding.last
            print(f"step {step:3d}  loss {loss.item():.4f}  step {1e3 * (time.perf_counter() - t0):6.1f} ms"
                  f"  optimizer {1e3 * s.seconds:6.1f} ms  read {s.bytes_read / 2**20:5.1f} MiB"
                  f"  wrote {s.bytes_written / 2**20:5.1f} MiB  overlap {100 * s.overlap:3.0f}%"
                  f"  peak mapped {s.peak_mapped_bytes / 2**20:5.1f} MiB")
        print("pager:", pager.stats())


if __name__ == "__main__":
    main()
