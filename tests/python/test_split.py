"""Parameters larger than a bucket step in chunks over consecutive buckets (no bucket
above bucket_size): bit for bit the unpaged step, no bucket above bucket_size, and
state_dict, checkpoints and failed steps as with whole parameters."""
import copy

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import PagedAdamW, Pager
from statepager.core.slices import CHUNK_ALIGN

KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB
BUCKET = 4 * MiB
# 1.13 M elements: in 4 MiB buckets, its two fp32 moments (8 bytes per element) step in 3
# chunks of at most 524288 elements, and with amsgrad's third (12 bytes) in 5 of 262144.
SHAPE = (1100, 1024)


def params(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*SHAPE).to(dtype)),
            torch.nn.Parameter(torch.randn(300).to(dtype))]


def set_grads(ps, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


VARIANTS = {
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam-forloop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False, weight_decay=0.1),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
}


def chunked(binding):
    return [c for b in binding.buckets for c in b.chunks]


def check_window(pager, binding):
    """Every bucket within bucket_size, the step's peak within depth of them."""
    assert all(max(b.nbytes, b.planned) <= BUCKET for b in binding.buckets)
    assert binding.last.peak_mapped_bytes <= binding.depth * (BUCKET + 2 * PAGE)


@pytest.mark.parametrize("variant", VARIANTS)
def test_split_parameter_steps_as_unpaged(store_dir, variant):
    ref = params()
    ref_opt = VARIANTS[variant](ref)
    ps = params()
    opt = VARIANTS[variant](ps)
    with Pager(store_dir, page_size=PAGE) as pager:
        binding = pager.attach(opt, bucket_size=BUCKET, depth=3)
        for step in range(4):
            set_grads(ref, step)
            set_grads(ps, step)
            ref_opt.step()
            opt.step()
            check_window(pager, binding)
        amsgrad = opt.param_groups[0]["amsgrad"]
        assert len(chunked(binding)) == (5 if amsgrad else 3)
        assert binding.buckets[0].chunks[0].stop == (1 if amsgrad else 2) * CHUNK_ALIGN
        for p, r in zip(ps, ref):
            assert torch.equal(p, r)
        state = opt.state_dict()["state"]
        for i, r in enumerate(ref):
            for k, v in ref_opt.state[r].items():
                assert torch.equal(state[i][k], v), (i, k)
        assert state[0]["step"].item() == 4


@pytest.mark.parametrize("moments,mains", [("fp32", "fp32"), ("bf16", "fp32"), ("q8", "fp32"),
                                          ("fp32", "residual"), ("q8", "residual")])
def test_paged_adamw_formats_split_as_whole(store_dir, tmp_path, moments, mains):
    """Each stored format, split into chunks, against itself whole (one bucket per
    parameter): the same bits."""
    def run(directory, bucket_size):
        model = params(dtype=torch.bfloat16)
        with Pager(directory, page_size=PAGE) as pager:
            opt = PagedAdamW(model, pager=pager, lr=1e-2, bucket_size=bucket_size,
                             moments=moments, mains=mains)
            for step in range(3):
                set_grads(model, step)
                opt.step()
            split = len(chunked(opt.binding))
            state = opt.state_dict()["state"]
            return [p.detach().clone() for p in model], state, split, opt.binding
    whole, whole_state, n, _ = run(str(tmp_path / "whole"), 64 * MiB)
    assert n == 0
    split, split_state, n, binding = run(store_dir, BUCKET)
    assert n >= 4
    # Within the pipeline's window of depth buckets: with q8 moments and residual mains a
    # chunk of CHUNK_ALIGN elements takes about 4.9 MB resident (its scratch comes in with
    # its page-in), above this test's 4 MiB bucket_size: the chunks' minimum.
    assert binding.last.peak_mapped_bytes <= binding.window_bytes
    assert binding.window_bytes <= binding.depth * (max(BUCKET, 24 * CHUNK_ALIGN) + 2 * PAGE)
    for a, b in zip(split, whole):
        assert torch.equal(a, b)
    for i in whole_state:
        for k, v in whole_state[i].items():
            assert torch.equal(split_state[i][k], v), (i, k)


def test_state_dict_round_trip(store_dir):
    """state_dict() of split parameters loads into a split optimizer, which then steps
    as an unpaged one that loaded the same state dict."""
    ps = params()
    opt = torch.optim.AdamW(ps, lr=1e-2)
    with Pager(store_dir, page_size=PAGE) as pager:
        pager.attach(opt, bucket_size=BUCKET)
        for step in range(2):
            set_grads(ps, step)
            opt.step()
        sd = opt.state_dict()
        ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt2 = torch.optim.AdamW(ps2, lr=1e-2)
        binding2 = pager.attach(opt2, bucket_size=BUCKET)
        opt2.load_state_dict(copy.deepcopy(sd))  # torch keeps what it loads
        assert len(chunked(binding2)) == 3
        ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        ref_opt = torch.optim.AdamW(ref, lr=1e-2)
        ref_opt.load_state_dict(copy.deepcopy(sd))
        for step in range(2, 4):
            for o, group in ((ref_opt, ref), (opt2, ps2)):
                set_grads(group, step)
                o.step()
        for p, q in zip(ref, ps2):
            assert torch.equal(p, q)
        a, b = ref_opt.state_dict()["state"], opt2.state_dict()["state"]
        for i in a:
            for k in a[i]:
                assert torch.equal(a[i][k], b[i][k])


@pytest.mark.parametrize("moments,mains", [("fp32", "fp32"), ("q8", "residual")])
def test_checkpoint_round_trip(tmp_path, moments, mains):
    """save_to / load_from of split parameters: the run goes on as if never stopped; the
    checkpoint's tensors are whole, as a run with whole buckets reads them."""
    def start(directory, bucket_size):
        model = params(dtype=torch.bfloat16)
        pager = Pager(str(tmp_path / directory), page_size=PAGE)
        return model, pager, PagedAdamW(model, pager=pager, lr=1e-2, bucket_size=bucket_size,
                                        moments=moments, mains=mains)
    model, pager, opt = start("a", BUCKET)
    for step in range(2):
        set_grads(model, step)
        opt.step()
    checkpoint.save(pager, checkpoint.rank_directory(str(tmp_path / "ckpt")))
    saved = [p.detach().clone() for p in model]
    for step in range(2, 4):
        set_grads(model, step)
        opt.step()
    for directory, bucket_size in (("b", BUCKET), ("c", 64 * MiB)):  # split, and whole
        model2, pager2, opt2 = start(directory, bucket_size)
        with torch.no_grad():
            for p, s in zip(model2, saved):
                p.copy_(s)
        assert checkpoint.load(pager2, checkpoint.rank_directory(str(tmp_path / "ckpt")))
        for step in range(2, 4):
            set_grads(model2, step)
            opt2.step()
        for p, q in zip(model, model2):
            assert torch.equal(p, q), directory
        pager2.close()
    pager.close()


@pytest.mark.parametrize("mains", ["fp32", "residual"])
def test_failed_step_in_a_later_chunk_changes_nothing(store_dir, mains):
    model = params(dtype=torch.bfloat16)
    ref = params(dtype=torch.bfloat16)
    with Pager(store_dir, page_size=PAGE) as pager:
        opt = PagedAdamW(model, pager=pager, lr=1e-2, bucket_size=BUCKET, mains=mains,
                         atomic=True)  # all or nothing: the failed step changes nothing
        with Pager(store_dir + "-ref", page_size=PAGE) as ref_pager:
            ref_opt = PagedAdamW(ref, pager=ref_pager, lr=1e-2, bucket_size=BUCKET, mains=mains)
            binding = opt.binding
            set_grads(model, 0)
            opt.step()
            saved = binding.after_chunk
            calls = []

            def failing(p, start, stop):
                calls.append(1)
                saved(p, start, stop)  # the model parameter's chunk is written
                if len(calls) == 3:
                    raise RuntimeError("injected")

            binding.after_chunk = failing
            set_grads(model, 1)
            before = [p.detach().clone() for p in model]
            with pytest.raises(RuntimeError, match="injected"):
                opt.step()
            for p, b in zip(model, before):
                assert torch.equal(p, b)
            assert opt.state[opt.param_groups[0]["params"][0]]["step"].item() == 1
            binding.after_chunk = saved
            opt.step()  # the retry steps once
            for step in range(2):
                set_grads(ref, step)
                ref_opt.step()
            for p, r in zip(model, ref):
                assert torch.equal(p, r)


def test_budget_that_only_chunks_fit(store_dir):
    """Whole, the big parameter's bucket (state and undo copy, 13 MiB) would not fit."""
    ps = params()
    opt = torch.optim.Adam(ps, lr=1e-2)
    with Pager(store_dir, page_size=PAGE, hbm_budget=3 * BUCKET + 8 * PAGE) as pager:
        binding = pager.attach(opt, bucket_size=BUCKET, depth=3)
        set_grads(ps, 0)
        opt.step()
        assert pager.stats()["peak_mapped_bytes"] <= 3 * BUCKET + 8 * PAGE
        assert binding.window_bytes <= 3 * (BUCKET + 2 * PAGE)


def test_bucket_hooks_without_chunk_hooks_keep_parameters_whole(store_dir):
    ps = params()
    opt = torch.optim.Adam(ps, lr=1e-2)
    with Pager(store_dir, page_size=PAGE) as pager:
        binding = pager.attach(opt, bucket_size=BUCKET,
                               hooks=statepager.Hooks(before_bucket=lambda params: None))
        assert not chunked(binding)
        assert max(b.planned for b in binding.buckets) > BUCKET


def test_pause_resume_and_a_save_of_split_parameters(store_dir, tmp_path):
    """pause()/resume() between steps of split parameters, and a save of them (pieces
    copied back to back) loaded into a split optimizer: the run as if uninterrupted."""
    def start(directory):
        model = params(dtype=torch.bfloat16)
        pager = Pager(directory, page_size=PAGE)
        return model, pager, PagedAdamW(model, pager=pager, lr=1e-2, bucket_size=BUCKET,
                                        moments="bf16")
    model, pager, opt = start(store_dir)
    ref, ref_pager, ref_opt = start(str(tmp_path / "ref"))
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            set_grads(m, step)
            o.step()
        if step == 0:
            pager.pause()
            assert pager.stats()["mapped_bytes"] == 0
            pager.resume()
        if step == 1:
            checkpoint.save(pager, str(tmp_path / "ckpt"))
            saved = [p.detach().clone() for p in model]
    for p, r in zip(model, ref):
        assert torch.equal(p, r)
    again, pager2, opt2 = start(str(tmp_path / "again"))
    assert chunked(opt2.binding)
    with torch.no_grad():
        for p, s in zip(again, saved):
            p.copy_(s)
    assert checkpoint.load(pager2, str(tmp_path / "ckpt"))
    set_grads(again, 2)
    opt2.step()
    for p, r in zip(again, ref):
        assert torch.equal(p, r)
    for pg in (pager, ref_pager, pager2):
        pg.close()


def test_chunks_also_once_dynamo_wrapped_the_optimizers_init_group(store_dir, monkeypatch):
    """torch._dynamo wraps each optimizer class's _init_group in disable() once anything
    compiles (Megatron's model does): AdamW's state is still created by the pager, and a
    parameter larger than a bucket still steps in chunks."""
    monkeypatch.setattr(torch.optim.AdamW, "_init_group",
                        torch._dynamo.disable(torch.optim.Adam._init_group), raising=False)
    ps = params()
    with Pager(store_dir, page_size=PAGE) as pager:
        opt = torch.optim.AdamW(ps, lr=1e-2)
        binding = pager.attach(opt, bucket_size=BUCKET)
        assert len(chunked(binding)) == 3
