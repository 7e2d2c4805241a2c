"""Pager.scope(): optimizer state built straight into the pager within a budget."""
import pytest
import torch

from statepager import Pager

KiB, MiB = 1 << 10, 1 << 20
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def shards(device, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).bfloat16().to(device) for n in sizes]


@pytest.mark.parametrize("device", DEVICES)
def test_megatron_style_mains_stay_within_budget(store_dir, device):
    page = 64 * KiB if device == "cpu" else 2 * MiB
    sizes = [(3 + i % 5) * 256 * 1024 + 17 * i for i in range(24)]  # 3-7 MiB of fp32 each
    model = shards(device, sizes)
    # On CUDA the bf16 temporaries of clone() take a 20 MiB segment of PyTorch's (1-10 MiB
    # requests get 20 MiB segments), which stays mapped: the budget must leave room.
    budget = 16 * MiB if device == "cpu" else 64 * MiB
    with Pager(store_dir, device=device, page_size=page, hbm_budget=budget) as pager:
        with pager.scope() as capture:
            mains = [s.clone().float() for s in model]
        assert all(pager.owns(m) for m in mains) and capture.tensors == mains
        s = pager.stats()
        largest = max(sizes) * 4
        assert s["peak_mapped_bytes"] <= budget + largest + 2 * page
        assert sum(sizes) * 4 > 1.5 * budget
        assert s["bytes_written"] > 0  # the oldest went to the store during construction
        pager.page_out(mains)
        for m, shard in zip(mains, model):
            pager.page_in(m)
            assert torch.equal(m, shard.float())
            pager.page_out(m)


@pytest.mark.parametrize("device", DEVICES)
def test_small_and_non_fp32_tensors_are_left_alone(store_dir, device):
    with Pager(store_dir, device=device, page_size=64 * KiB if device == "cpu" else 2 * MiB) as pager:
        x, ref = torch.ones(1000, device=device), torch.ones(1 << 20, device=device)
        with pager.scope():
            small = x.clone()                       # below min_bytes
            half = torch.zeros(1 << 20, dtype=torch.bfloat16, device=device)
            plain = torch.zeros(1 << 20, device=device)  # plain factory (how modules build)
            big = torch.zeros_like(ref)             # made from a tensor: captured, zero
            y = big + 1                             # not a copy/factory op: ordinary
        assert not any(pager.owns(t) for t in (small, half, plain, y))
        assert pager.owns(big) and int(torch.count_nonzero(big)) == 0
        assert bool((y == 1).all())


def test_like_factories_are_tracked_and_paged_within_budget(store_dir):
    """zeros_like() hands its caller a detached alias of what scope() made: that alias
    is what is tracked, so the moments page out under the budget like clone()s do."""
    ref = torch.ones(256 * 1024 + 3)  # just over 1 MiB of fp32
    with Pager(store_dir, page_size=64 * KiB, hbm_budget=4 * MiB) as pager:
        with pager.scope() as capture:
            moments = [torch.zeros_like(ref) for _ in range(6)] + [ref.new_zeros(ref.shape)]
            twins = [ref.clone().detach() for _ in range(2)]
        made = moments + twins
        assert len(capture.tensors) == len(made)
        assert all(t is m for t, m in zip(capture.tensors, made)) and not capture.kept
        assert sum(pager.is_resident(m) for m in made) < len(made)
        assert pager.stats()["peak_mapped_bytes"] <= 4 * MiB + 2 * 64 * KiB


def test_scope_state_streams_through_attach(store_dir):
    """Mains built in scope, then an AdamW over them attached: the mains are streamed."""
    model = shards("cpu", [300_000, 400_001, 299_999])  # each at least min_bytes (1 MiB)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        with pager.scope():
            mains = [s.clone().float() for s in model]
        ref = [s.clone().float() for s in model]
        opt, ref_opt = torch.optim.AdamW(mains, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
        binding = pager.attach(opt, bucket_size=1 * MiB)
        streamed = {id(t) for b in binding.buckets for t in b.stored}
        assert all(id(m) in streamed for m in mains)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            grads = [torch.randn(m.shape, generator=g) for m in mains]
            for m, r, gr in zip(mains, ref, grads):
                m.grad, r.grad = gr, gr.clone()
            opt.step()
            ref_opt.step()
        pager.page_in(mains)
        assert all(torch.equal(m, r) for m, r in zip(mains, ref))
