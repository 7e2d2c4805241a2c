"""Loss curves of a small GPT trained with PagedAdamW under each on-disk moment format
(fp32, bf16, q8), written to a PNG: how much accuracy the narrow formats cost.

    python examples/formats_loss_curves.py --dir /tmp/statepager-curves --out docs/moment_formats_loss.png

Data: sequences from a fixed random bigram language (learnable, entropy well below
log(vocab)), so the curves show real learning. Runs on the GPU when present, else CPU.
Needs matplotlib for the plot.
"""
import argparse
import math

import torch

import statepager


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab, width, layers, seq):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.randn(seq, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, x):
        h = self.embed(x) + self.pos[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def bigram_batches(vocab, seq, batch, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 3.0  # peaked transitions
    probs = logits.softmax(-1)
    entropy = float(-(probs * probs.log()).sum(-1).mean())
    for _ in range(steps):
        tok = torch.randint(0, vocab, (batch,), generator=g)
        rows = [tok]
        for _ in range(seq):
            tok = torch.multinomial(probs[tok], 1, generator=g).squeeze(1)
            rows.append(tok)
        data = torch.stack(rows, 1)
        yield data[:, :-1], data[:, 1:], entropy


def train(moments, args, device):
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.width, args.layers, args.seq).to(device)
    if device.type == "cuda":
        model = model.bfloat16()  # bf16 matmuls are slow on most CPUs: fp32 model there
    losses = []
    with statepager.Pager(f"{args.dir}/{moments}", device=device, page_size=2 << 20) as pager:
        opt = statepager.PagedAdamW(model.parameters(), pager=pager, lr=args.lr,
                                    weight_decay=0.01, moments=moments,
                                    mains="residual" if device.type == "cuda" else "fp32",
                                    bucket_size=4 << 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
        for x, y, entropy in bigram_batches(args.vocab, args.seq, args.batch, args.steps):
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    return losses, entropy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", default="docs/moment_formats_loss.png")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    curves = {}
    for moments in ("fp32", "bf16", "q8"):
        curves[moments], entropy = train(moments, args, device)
        tail = sum(curves[moments][-20:]) / 20
        print(f"moments {moments:5s}: final loss (mean of last 20 steps) {tail:.4f}")
    ref = sum(curves["fp32"][-20:]) / 20
    for moments in ("bf16", "q8"):
        gap = sum(curves[moments][-20:]) / 20 - ref
        print(f"  {moments} - fp32 final-loss gap: {gap:+.4f} ({100 * gap / ref:+.2f}%)")
    print(f"  (the language's entropy, the lowest reachable loss: {entropy:.4f})")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for moments, losses in curves.items():
        ax.plot(losses, label=f"{moments} moments", linewidth=1)
    ax.axhline(entropy, color="gray", linestyle=":", label="entropy of the data")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(f"Small GPT, PagedAdamW, {args.steps} steps on {device.type}: moment formats")
    ax.set_ylim(entropy - 0.1, min(max(max(c[5:]) for c in curves.values()), 5))
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
