"""Measure the q8 moment codecs on real AdamW states; prints the tables that chose
statepager.formats.codecs' Q8_* defaults.

A tiny causal transformer LM learns a synthetic Zipf-distributed bigram language (rare
tokens give embedding rows with sparse gradients, so exp_avg_sq spans many decades).
1. Update-direction error: at a few steps, quantize exp_avg (v exact) or exp_avg_sq (m
   exact) per tensor, and compare the Adam update u = m_hat / (sqrt(v_hat) + eps) from
   decoded vs exact moments. rel = |u' - u| / |u| over elements with u != 0.
2. Training: the same run with both moments round-tripped through a codec after every
   step (as if paged out and back in), final held-out loss vs exact moments.

Usage: PYTHONPATH=python python3 scripts/measure_codecs.py [--quick]
"""
import argparse
import math
import time

import torch

from statepager.formats import codecs as C

VOCAB, SEQ, BATCH, DIM, LAYERS = 2048, 32, 32, 64, 2
LR, BETAS, EPS, WD = 2e-3, (0.9, 0.999), 1e-8, 0.01


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.body = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tok):
        h = self.body(self.emb(tok) + self.pos, mask=self.mask, is_causal=True)
        return self.head(h)


class Bigram:
    """Zipf unigram start, and each token moves to one of 8 Zipf-chosen successors."""
    def __init__(self, seed=1234):
        g = torch.Generator().manual_seed(seed)
        self.zipf = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
        self.succ = torch.multinomial(self.zipf.expand(VOCAB, -1), 8, generator=g)
        self.succ_p = torch.softmax(torch.randn(VOCAB, 8, generator=g, dtype=torch.float64) * 2, 1)

    def batch(self, g):
        tok = [torch.multinomial(self.zipf, BATCH, replacement=True, generator=g)]
        for _ in range(SEQ):
            pick = torch.multinomial(self.succ_p[tok[-1]], 1, generator=g).squeeze(1)
            tok.append(self.succ[tok[-1], pick])
        tok = torch.stack(tok, 1)
        return tok[:, :-1], tok[:, 1:]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def roundtrip(t, kind, scheme, block):
    """Encode + decode `t` in place, the way a paged-out moment comes back."""
    if scheme == "bf16":
        t.copy_(t.to(torch.bfloat16))
        return t
    codes = torch.empty(t.numel(), dtype=torch.uint8)
    scales = torch.empty(C.q8_num_blocks(t.numel(), block))
    C.q8_encode(t, codes, scales, kind, block=block, scheme=scheme)
    C.q8_decode(codes, scales, t, kind, block=block, scheme=scheme)
    return t


def train(steps, seed, codec=None, snapshots=()):
    """codec: None (exact) or (signed_scheme, nonneg_scheme, block). Returns the held-out
    loss and {step: [(exp_avg, exp_avg_sq), ...]} copies at the snapshot steps."""
    torch.manual_seed(seed)
    model, data = TinyLM(), Bigram()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    g, snaps = torch.Generator().manual_seed(seed + 1), {}
    for step in range(1, steps + 1):
        loss = loss_of(model, *data.batch(g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if codec:
            for st in opt.state.values():
                roundtrip(st["exp_avg"], "signed", codec[0], codec[2])
                roundtrip(st["exp_avg_sq"], "nonneg", codec[1], codec[2])
        if step in snapshots:
            snaps[step] = [(st["exp_avg"].clone(), st["exp_avg_sq"].clone())
                           for st in opt.state.values()]
    g_eval = torch.Generator().manual_seed(999)
    with torch.no_grad():
        held_out = sum(loss_of(model, *data.batch(g_eval)).item() for _ in range(16)) / 16
    return held_out, snaps


def update(m, v, step):
    return (m / (1 - BETAS[0] ** step)) / ((v / (1 - BETAS[1] ** step)).sqrt() + EPS)


def direction_errors(snaps, which, scheme, block):
    """Pooled over snapshots and tensors: median/p99 of per-element relative error, the
    global relative L2 error, the largest absolute error of u (|u| is O(1)), and the
    fraction of nonzero moment elements that decode to 0."""
    rels, sq_err, sq_ref, worst, zeroed, nonzero = [], 0.0, 0.0, 0.0, 0, 0
    for step, states in snaps.items():
        for m, v in states:
            u = update(m, v, step)
            x = m if which == "m" else v
            x2 = roundtrip(x.clone(), "signed" if which == "m" else "nonneg", scheme, block)
            u2 = update(x2, v, step) if which == "m" else update(m, x2, step)
            zeroed += ((x != 0) & (x2 == 0)).sum().item()
            nonzero += (x != 0).sum().item()
            d, nz = (u2 - u).abs(), u != 0
            rels.append((d[nz] / u.abs()[nz]).double())
            sq_err += d.double().square().sum().item()
            sq_ref += u.double().square().sum().item()
            worst = max(worst, d.max().item())
    rel = torch.cat(rels).sort().values
    q = lambda f: rel[min(len(rel) - 1, int(f * len(rel)))].item()  # noqa: E731
    return q(0.5), q(0.99), math.sqrt(sq_err / sq_ref), worst, zeroed / nonzero


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="train with block 256 only")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    blocks = (256, 1024, 4096)
    t0 = time.time()

    base, snaps = train(200, 0, snapshots=(20, 100, 200))
    n = sum(m.numel() for m, _ in snaps[200])
    print(f"# update-direction error: TinyLM ({n} params), AdamW, snapshots at steps "
          f"{list(snaps)}; rel = |u'-u|/|u|, L2 = ||u'-u||/||u||, max = max|u'-u|, zeroed = "
          f"share of nonzero moments decoded as 0")
    print(f"{'moment':<6} {'scheme':<10} {'block':>5} {'B/elem':>7} {'med rel':>9} "
          f"{'p99 rel':>9} {'L2 rel':>9} {'max abs':>9} {'zeroed':>9}")
    for which, kind in (("m", "signed"), ("v", "nonneg")):
        print(f"{which:<6} {'bf16':<10} {'-':>5} {2.0:7.4f} "
              + "{:9.2e} {:9.2e} {:9.2e} {:9.2e} {:9.2e}".format(*direction_errors(snaps, which, "bf16", 0)))
        for scheme in C.Q8_SCHEMES[kind]:
            for block in blocks:
                bpe = C.encoded_bytes(n, "q8", block=block) / n
                print(f"{which:<6} {scheme:<10} {block:>5} {bpe:7.4f} "
                      + "{:9.2e} {:9.2e} {:9.2e} {:9.2e} {:9.2e}".format(
                          *direction_errors(snaps, which, scheme, block)))

    print(f"\n# training: {args.steps} steps, moments round-tripped after every step; "
          f"held-out loss, mean over {args.seeds} seeds; delta vs exact moments, per seed")
    exact = [train(args.steps, s)[0] for s in range(args.seeds)]
    print(f"{'m scheme':<8} {'v scheme':<10} {'block':>5} {'loss':>8} {'delta':>24}")
    print(f"{'exact':<8} {'exact':<10} {'-':>5} {sum(exact) / len(exact):8.4f}"
          f"   (per seed: {', '.join(f'{e:.4f}' for e in exact)})")
    # Every v scheme with linear m; e4m3 m with the two best v schemes.
    codecs = [("bf16", "bf16", 0)]
    for b in (256,) if args.quick else blocks:
        codecs += [("linear", vs, b) for vs in C.Q8_SCHEMES["nonneg"]]
        codecs += [("e4m3", "sqrt", b), ("e4m3", "e4m3_sqrt", b)]
    for ms, vs, b in codecs:
        losses = [train(args.steps, s, (ms, vs, b))[0] for s in range(args.seeds)]
        deltas = ", ".join(f"{l - e:+.4f}" for l, e in zip(losses, exact))
        print(f"{ms:<8} {vs:<10} {b if b else '-':>5} {sum(losses) / len(losses):8.4f} "
              f"{deltas:>24}", flush=True)
    print(f"# {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
