"""Narrow on-disk formats in the streamed step: bytes moved per parameter, lossless
residual mains (bit-exact), narrow moments, and checkpoints that record formats."""
import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import PagedAdamW, Pager

KiB = 1 << 10


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 6)).bfloat16()


def step(m, opt, x, y) -> float:
    loss = torch.nn.functional.mse_loss(m(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def train(m, opt, steps, first=0):
    """One fresh random batch per step (seeded by the step number)."""
    losses = []
    for i in range(first, first + steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 40, generator=g).bfloat16(), torch.randn(32, 6, generator=g)
        losses.append(step(m, opt, x, y))
    return losses


def masters_and_moments(opt, pager):
    out = []
    for m in [m for g in opt.param_groups for m in g["params"]]:
        for _, form in opt.binding.forms(m):
            pager.page_in(form.tensors)
        with torch.no_grad():
            for b in opt.binding.state_in_buckets():
                for p in b.params:
                    if p is m:
                        out.append([m.clone(), opt.state[m]["exp_avg"].clone(),
                                    opt.state[m]["exp_avg_sq"].clone()])
    return out


# Written = read: the undo copy of a residual master's bf16 model param, which a failed
# step needs (statepager.atomic), is kept in host memory, not written to the store.
@pytest.mark.parametrize("moments,mains,read,written", [
    ("fp32", "fp32", 12, 12), ("fp32", "residual", 10, 10), ("bf16", "fp32", 8, 8),
    ("bf16", "residual", 6, 6)])
def test_bytes_moved_per_parameter(store_dir, moments, mains, read, written):
    m = model()
    n = sum(p.numel() for p in m.parameters())
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = PagedAdamW(m.parameters(), pager=pager, lr=1e-3, bucket_size=128 * KiB,
                         moments=moments, mains=mains)
        train(m, opt, 3)
        s = opt.binding.last
        assert (s.bytes_read, s.bytes_written) == (read * n, written * n)


def test_q8_moments_move_about_two_bytes(store_dir):
    m = model()
    n = sum(p.numel() for p in m.parameters())
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = PagedAdamW(m.parameters(), pager=pager, lr=1e-3, bucket_size=128 * KiB,
                         moments="q8", mains="residual")
        train(m, opt, 3)
        per_param = opt.binding.last.bytes_read / n
        assert 4.0 <= per_param < 4.2  # 2 (residual) + 2 x (1 code + scales)


@pytest.mark.parametrize("depth", [2, 3, 5])
def test_residual_mains_are_lossless(store_dir, depth):
    """20 steps with residual mains are bit-identical to 20 steps with fp32 mains, at any
    depth (the exceptions of a bucket are finished two buckets later, or at the end)."""
    ref_m, m = model(), model()
    with Pager(store_dir, page_size=64 * KiB) as p1, Pager(store_dir + "-r", page_size=64 * KiB) as p2:
        ref = PagedAdamW(ref_m.parameters(), pager=p1, lr=3e-3, weight_decay=0.1,
                         bucket_size=100 * KiB)
        opt = PagedAdamW(m.parameters(), pager=p2, lr=3e-3, weight_decay=0.1,
                         bucket_size=100 * KiB, mains="residual", depth=depth)
        assert len(opt.binding.buckets) > 3
        assert train(ref_m, ref, 20) == train(m, opt, 20)
        assert all(torch.equal(a, b) for a, b in zip(ref_m.parameters(), m.parameters()))
        for a, b in zip(masters_and_moments(ref, p1), masters_and_moments(opt, p2)):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("moments,mains", [("q8", "residual"), ("bf16", "fp32")])
def test_scratch_comes_in_with_the_buckets_page_in(store_dir, moments, mains):
    """A bucket's fp32 scratch is paged in (zero-filled) with its stored forms, ahead of its
    step: the step itself pages nothing in, nor asks for the scratch again (a call takes
    the Pager's lock), and the pipeline stays within its window."""
    m = model()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = PagedAdamW(m.parameters(), pager=pager, lr=1e-3, bucket_size=128 * KiB,
                         moments=moments, mains=mains)
        train(m, opt, 2)
        assert len(opt.binding.buckets) >= 3
        asked, page_in = [], pager.page_in
        pager.page_in = lambda ts: (asked.extend(ts), page_in(ts))
        train(m, opt, 1, first=2)
        assert asked == []
        assert 0 < opt.binding.last.peak_mapped_bytes <= opt.binding.window_bytes


def test_stored_forms_pack_apart_from_their_working_tensors(store_dir):
    """Every bucket's stored forms lie one after another at the arena's top, apart from the
    fp32 working tensors made beside them at the first step (the moments) or before it
    (the mains), so that a step's page-ins touch no page for bytes it does not bring."""
    m = model()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = PagedAdamW(m.parameters(), pager=pager, lr=1e-3, bucket_size=128 * KiB,
                         moments="q8", mains="residual")
        train(m, opt, 2)
        assert len(opt.binding.buckets) >= 3

        def spans(ts):
            return sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts)
        stored = spans(t for b in opt.binding.buckets for t in b.stored)
        working = spans(t for b in opt.binding.buckets for t in b.working)
        assert stored and working
        assert max(end for _, end in working) <= stored[0][0]
        gaps = [b[0] - a[1] for a, b in zip(stored, stored[1:])]
        assert all(0 <= g < 4 * KiB for g in gaps), gaps  # what 4 KiB alignment leaves


def stored_bytes(opt) -> list:
    """Copies of every stored tensor of the optimizer's state (not decoded)."""
    return [t.clone() for b in opt.binding.stored_in_buckets() for t in b.stored]


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("where", ["first", "last"])
def test_residual_refuses_a_changed_model_param(store_dir, atomic, where):
    """A model param changed behind the optimizer's back fails the step, which changes
    nothing, whichever bucket holds it: atomic, the checks are read once, after the last
    bucket, and the step rolled back (a retry with the param put back steps as if
    nothing happened); not atomic, every bucket's params are checked before the first
    steps (they were checked per bucket: a change in the last bucket was found after the
    others had stepped in place)."""
    ref = model()
    with Pager(store_dir + "-ref", page_size=64 * KiB) as pager:
        opt = PagedAdamW(ref.parameters(), pager=pager, lr=1e-3, mains="residual",
                         bucket_size=32 * KiB)
        train(ref, opt, 3)
    m = model()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = PagedAdamW(m.parameters(), pager=pager, lr=1e-3, mains="residual",
                         bucket_size=32 * KiB)
        opt.binding.atomic = atomic
        train(m, opt, 2)
        assert len(opt.binding.buckets) >= 3
        bucket = opt.binding.buckets[0 if where == "first" else -1]
        # A model parameter (or the chunk of one) of that bucket's masters alone.
        changed = next(f for f in bucket.forms if f.fmt == "residual").flat_model_param
        kept = changed.detach().clone()
        with torch.no_grad():
            changed.add_(1.0)
        params, stored = [p.detach().clone() for p in m.parameters()], stored_bytes(opt)
        with pytest.raises(ValueError, match="no longer matches"):
            train(m, opt, 1, first=2)
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), params))
        assert all(torch.equal(a, b) for a, b in zip(stored_bytes(opt), stored))
        with torch.no_grad():
            changed.copy_(kept)
        train(m, opt, 1, first=2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))


def fit(m, opt, steps):
    """A fixed regression task the model can learn; returns the losses."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(64, 40, generator=g).bfloat16(), torch.randn(64, 6, generator=g)
    return [step(m, opt, x, y) for _ in range(steps)]


@pytest.mark.parametrize("moments", ["bf16", "q8"])
def test_narrow_moments_train_close_to_fp32(store_dir, moments):
    ref_m, m = model(), model()
    with Pager(store_dir, page_size=64 * KiB) as p1, Pager(store_dir + "-n", page_size=64 * KiB) as p2:
        ref = PagedAdamW(ref_m.parameters(), pager=p1, lr=3e-3)
        opt = PagedAdamW(m.parameters(), pager=p2, lr=3e-3, moments=moments)
        a, b = fit(ref_m, ref, 60), fit(m, opt, 60)
    assert b[-1] < 0.5 * b[0]  # it learns
    assert abs(b[-1] - a[-1]) < 0.1 * a[-1]


def test_checkpoint_records_formats(store_dir, tmp_path):
    ck = str(tmp_path / "ck")
    m = model()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = PagedAdamW(m.parameters(), pager=pager, lr=1e-3, moments="q8", mains="residual")
        train(m, opt, 3)
        weights = {k: v.clone() for k, v in m.state_dict().items()}
        checkpoint.save(pager, ck)
        after = train(m, opt, 4, first=3)
    resumed = model(seed=1)
    resumed.load_state_dict(weights)
    with Pager(store_dir + "-2", page_size=64 * KiB) as pager:
        opt = PagedAdamW(resumed.parameters(), pager=pager, lr=1e-3, moments="q8",
                         mains="residual")
        assert checkpoint.load(pager, ck)
        assert train(resumed, opt, 4, first=3) == after
    other = model(seed=1)
    other.load_state_dict(weights)
    with Pager(store_dir + "-3", page_size=64 * KiB) as pager:
        opt = PagedAdamW(other.parameters(), pager=pager, lr=1e-3, moments="bf16",
                         mains="residual")
        with pytest.raises(statepager.CheckpointMismatchError, match="formats"):
            checkpoint.load(pager, ck)
