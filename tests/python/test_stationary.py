"""Stationary buckets (attach(stationary_bytes=...)): the first buckets whose stored forms
fit stay mapped between steps and move no byte, the rest stream as before. Training so
is bit-identical to training without them, in place, resumable and under the forward;
a step that fails in a stationary bucket is finished bit-identically by the next; what
reads or replaces the state whole (state_dict(), checkpoints, pause(), opt.state) finds
it at rest; all-or-nothing steps refuse them."""
import copy

import pytest
import torch

from statepager import Pager, checkpoint
from statepager import _C

from small_jobs import KiB
from test_overlap import model_and_opt, result, same, train

PAGE = 16 * KiB
STATIONARY = 160 * KiB  # of the small model's 445 KiB of moments: 2 to 4 buckets


def stored_bytes(buckets):
    return sum(t.numel() * t.element_size() for b in buckets for t in b.stored)


def run(tmp_path, name, steps=5, overlap=False, **attach):
    """Trains the small model of test_overlap: (losses, result, bytes written by the steps
    after the first, binding)."""
    with Pager(str(tmp_path / name), "cpu", page_size=PAGE) as pager:
        model, opt, binding, _ = model_and_opt(pager, overlap, **attach)
        losses = train(model, opt, 1)
        before = pager.stats()
        losses += train(model, opt, steps - 1, first=1)
        moved = pager.stats()["bytes_written"] - before["bytes_written"]
        return losses, result(model, opt), moved, binding


@pytest.mark.parametrize("atomic", ["bucket", False])
@pytest.mark.parametrize("overlap", [False, True])
def test_stationary_buckets_are_bit_identical_and_move_nothing(tmp_path, atomic, overlap):
    ref = run(tmp_path, "ref", atomic=atomic, overlap=overlap)
    got = run(tmp_path, "st", atomic=atomic, overlap=overlap, stationary_bytes=STATIONARY)
    assert ref[0] == got[0]
    assert same(ref[1], got[1])
    # Four steps after the first: none writes the stationary buckets' stored bytes.
    n = got[3]._planner.stationary
    assert 2 <= n < len(got[3].buckets)
    kept = stored_bytes(got[3].buckets[:n])
    assert ref[2] - got[2] == 4 * kept


def test_stationary_bytes_through_attach(tmp_path):
    with Pager(str(tmp_path / "a"), "cpu", page_size=PAGE) as pager:
        model, opt, binding, _ = model_and_opt(pager, False, stationary_bytes=STATIONARY)
        assert binding.stationary_bytes == STATIONARY
        train(model, opt, 2)
        n = binding._planner.stationary
        assert n >= 1
        stationary = binding.buckets[:n]
        assert all(pager.is_resident(t) for b in stationary for t in b.stored)
        assert not any(pager.is_resident(t) for b in binding.buckets[n:] for t in b.stored)
        # The window counts their pages, so attach's check holds them within hbm_budget.
        window = binding.window_bytes
        assert window >= binding._planner.stationary_pages() * PAGE > 0
    assert binding.window_bytes == window  # a closed Pager's, as last counted


def test_what_reads_the_state_whole_finds_it_at_rest(tmp_path):
    ref3, ref6 = run(tmp_path, "ref3", steps=3), run(tmp_path, "ref6", steps=6)
    with Pager(str(tmp_path / "b"), "cpu", page_size=PAGE) as pager:
        model, opt, binding, _ = model_and_opt(pager, False, stationary_bytes=STATIONARY)
        losses = train(model, opt, 3)
        n = binding._planner.stationary
        stationary = [t for b in binding.buckets[:n] for t in b.stored]
        assert all(pager.is_resident(t) for t in stationary)
        assert same(ref3[1], result(model, opt))  # state_dict() reads them at rest
        assert not any(pager.is_resident(t) for t in stationary)
        losses += train(model, opt, 1, first=3)
        assert all(pager.is_resident(t) for t in stationary)
        checkpoint.save(pager, str(tmp_path / "ckpt"))
        assert not any(pager.is_resident(t) for t in stationary)
        losses += train(model, opt, 1, first=4)
        pager.pause()
        pager.resume()
        losses += train(model, opt, 1, first=5)
        assert losses == ref6[0]
        assert same(ref6[1], result(model, opt))


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_a_read_of_a_stationary_entry_is_a_read(tmp_path, moments):
    """opt.state[p][name] of a stationary bucket: read at rest in an epoch as any other
    (a change to it is not kept), the entries read before it still resident."""
    ref = run(tmp_path, "ref", steps=4, moments=moments)
    with Pager(str(tmp_path / "r"), "cpu", page_size=PAGE) as pager:
        model, opt, binding, _ = model_and_opt(pager, False, moments=moments,
                                               stationary_bytes=STATIONARY)
        losses = train(model, opt, 3)
        n = binding._planner.stationary
        assert 1 <= n < len(binding.buckets)
        streamed = binding.buckets[-1].params[0]
        before = opt.state[streamed]["exp_avg"]
        stationary_param = binding.buckets[0].params[0]
        value = opt.state[stationary_param]["exp_avg"]
        assert pager.is_resident(before) and pager.is_resident(value)
        assert torch.isfinite(value).all() and value.abs().sum() > 0
        value.zero_()  # not kept
        losses += train(model, opt, 1, first=3)
        assert losses == ref[0]
        assert same(ref[1], result(model, opt))


def test_stationary_buckets_need_the_pager_to_themselves(tmp_path):
    with Pager(str(tmp_path / "o"), "cpu", page_size=PAGE) as pager:
        model_and_opt(pager, False, stationary_bytes=STATIONARY)
        with pytest.raises(_C.UsageError, match="alone on the Pager"):
            model_and_opt(pager, False, name="second")
    with Pager(str(tmp_path / "p"), "cpu", page_size=PAGE) as pager:
        model_and_opt(pager, False)
        with pytest.raises(_C.UsageError, match="alone on the Pager"):
            model_and_opt(pager, False, stationary_bytes=STATIONARY, name="second")


def test_a_step_that_fails_in_a_stationary_bucket_is_finished_bit_identically(tmp_path):
    ref = run(tmp_path, "ref", steps=4)
    with Pager(str(tmp_path / "c"), "cpu", page_size=PAGE) as pager:
        model, opt, binding, _ = model_and_opt(pager, False, stationary_bytes=STATIONARY)
        losses = train(model, opt, 2)
        assert binding._planner.stationary >= 2
        calls = {"n": 0}

        def after_bucket(params):
            calls["n"] += 1
            if calls["n"] == 2:  # the second stationary bucket, stepped and not written
                raise RuntimeError("injected")
        binding.after_bucket = after_bucket
        x = torch.randn(8, model[0].in_features, generator=torch.Generator().manual_seed(2))
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        with pytest.raises(RuntimeError, match="injected"):
            opt.step()
        assert binding.pending
        binding.after_bucket = None
        opt.step()  # finishes it
        losses.append(loss.item())
        losses += train(model, opt, 1, first=3)
        assert losses == ref[0]
        assert same(ref[1], result(model, opt))


def test_all_or_nothing_steps_refuse_stationary_buckets(tmp_path):
    with Pager(str(tmp_path / "d"), "cpu", page_size=PAGE) as pager:
        with pytest.raises(_C.UsageError, match="stationary_bytes"):
            model_and_opt(pager, False, atomic="step", stationary_bytes=1 << 20)
        with pytest.raises(_C.UsageError, match="stationary_bytes"):
            model_and_opt(pager, False, stationary_bytes=-1)
        _, _, binding, _ = model_and_opt(pager, False, stationary_bytes=1 << 20)
        with pytest.raises(_C.UsageError, match="atomic='step'"):
            binding.atomic = "step"


def test_a_budget_counts_the_stationary_buckets(tmp_path):
    with Pager(str(tmp_path / "e"), "cpu", page_size=PAGE, hbm_budget=256 * KiB) as pager:
        with pytest.raises(_C.UsageError, match="stationary"):
            model_and_opt(pager, False, stationary_bytes=1 << 30)


def q8_run(tmp_path, name, device, steps, overlap, fail_in=None, **attach):
    """PagedAdamW with q8 moments and residual mains over a bf16 model (the fused step,
    the masters' scratch and its late exception counts): (losses, model bits, state bits,
    binding's stationary count). fail_in: the stationary bucket (1-based) whose after_bucket
    call in step 3 raises once its model params are written; the next step() finishes
    the step."""
    from statepager.core.optim import PagedAdamW
    page = 2 << 20 if device == "cuda" else 16 * KiB
    with Pager(str(tmp_path / name), device, page_size=page) as pager:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(6)]).to(
            device, torch.bfloat16)
        opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-2, bucket_size=16 * KiB,
                         depth=3, mains="residual", moments="q8", **attach)
        binding = opt.binding
        if overlap:
            binding.overlap_forward(model)
        losses, failed = [], []
        for i in range(steps):
            if i == 3 and fail_in:
                written, calls = binding.after_bucket, []

                def failing(params):
                    written(params)
                    calls.append(1)
                    if len(calls) == fail_in:
                        bucket = binding._planner.stationary_buckets()[fail_in - 1]
                        failed.append(params is bucket.params)
                        raise RuntimeError("injected")
                binding.after_bucket = failing
            x = torch.randn(8, 96, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            loss = model(x.to(device, torch.bfloat16)).float().square().mean()
            loss.backward()
            try:
                opt.step()
            except RuntimeError:
                binding.after_bucket = written
                opt.step()
            losses.append(loss.item())
        binding.complete_step_in_flight()
        assert failed == ([True] if fail_in else []), "failed once, in a stationary bucket"
        n = binding._planner.stationary
        return losses, result(model, opt), n


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_q8_residual_stationary_buckets_are_bit_identical(tmp_path, device, overlap):
    ref = q8_run(tmp_path, "ref", device, 5, overlap)
    got = q8_run(tmp_path, "st", device, 5, overlap, stationary_bytes=48 * KiB)
    assert got[2] >= 2
    assert ref[0] == got[0]
    assert same(ref[1], got[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_q8_step_failing_in_a_stationary_bucket_is_finished_bit_identically(tmp_path,
                                                                              device):
    ref = q8_run(tmp_path, "ref", device, 5, False)
    got = q8_run(tmp_path, "st", device, 5, False, fail_in=2, stationary_bytes=48 * KiB)
    assert got[2] >= 2
    assert ref[0] == got[0]
    assert same(ref[1], got[1])


@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_a_load_replaces_stationary_state(tmp_path, how):
    """Saved after 3 steps, trained 2 more, loaded back and trained the same 2: the same
    losses and state as the first time (the stationary buckets, mapped when the load
    came, take the loaded bytes)."""
    with Pager(str(tmp_path / "l"), "cpu", page_size=PAGE) as pager:
        model, opt, binding, _ = model_and_opt(pager, False, stationary_bytes=STATIONARY)
        train(model, opt, 3)
        assert binding._planner.stationary >= 2
        params = [p.detach().clone() for p in model.parameters()]
        if how == "checkpoint":
            checkpoint.save(pager, str(tmp_path / "ckpt"))
        else:
            saved = copy.deepcopy(opt.state_dict())  # torch's holds the step counts
        losses = train(model, opt, 2, first=3)
        assert pager.is_resident(binding.buckets[0].stored[0])  # stationary again
        first = losses, result(model, opt)
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.copy_(v)
        if how == "checkpoint":
            checkpoint.load(pager, str(tmp_path / "ckpt"))
        else:
            opt.load_state_dict(saved)
        losses = train(model, opt, 2, first=3)
        assert pager.is_resident(binding.buckets[0].stored[0])
        again = losses, result(model, opt)
        assert first[0] == again[0]
        assert same(first[1], again[1])


@pytest.mark.parametrize("write", [False, True])
def test_reads_inside_state_in_buckets_keep_the_bucket_it_paged_in(tmp_path, write):
    """binding.state_in_buckets() puts the stationary buckets at rest, then pages each
    bucket in for its caller: a read of opt.state there is served from that bucket (it
    is not put at rest under the caller), and holds the values of a run without them."""
    def entries(binding, opt):
        out = []
        for b in binding.state_in_buckets(write=write):
            first = opt.state[b.params[0]]["exp_avg"].clone()
            assert all(binding.pager.is_resident(t) for t in b.stored), \
                "the bucket it paged in stays resident"
            for p in b.params:
                out.append([opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")])
            assert torch.equal(first, out[-len(b.params)][0])
        return out
    seen = []
    for stationary in (0, STATIONARY):
        with Pager(str(tmp_path / f"r{stationary}"), "cpu", page_size=PAGE) as pager:
            model, opt, binding, _ = model_and_opt(pager, False, stationary_bytes=stationary)
            train(model, opt, 3)
            seen.append(entries(binding, opt))
            seen.append(entries(binding, opt))  # once more: at rest now, and read so again
    assert len(seen[0]) > 2
    assert all(torch.equal(a, b) for x in seen[1:] for xs, ys in zip(seen[0], x)
               for a, b in zip(xs, ys))
