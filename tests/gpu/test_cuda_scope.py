"""Construction inside Pager.scope() on the GPU, shaped like Megatron's
DistributedOptimizer: shard.clone().float() over many shards of mixed sizes."""
import pytest
import torch

from statepager import Pager

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30


def test_eight_gib_of_mains_built_under_a_one_gib_budget(store_dir, cuda_free):
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes, total = [], 0
    while total < 8 * GiB:
        n = (8 + len(sizes) % 9 * 4) * MiB + 4 * len(sizes) + 1  # 32-160 MiB of fp32
        sizes.append(n)
        total += 4 * n
    model = [torch.randn(n, device="cuda", generator=g).bfloat16() for n in sizes]
    budget = 1 * GiB
    with Pager(store_dir, device="cuda", hbm_budget=budget) as pager:
        before = cuda_free()
        lowest = before
        mains = []
        with pager.scope():
            for shard in model:
                mains.append(shard.clone().float())
                lowest = min(lowest, cuda_free())
        largest = 4 * max(sizes)
        used_driver = before - lowest
        s = pager.stats()
        print(f"\n8 GiB of mains in {len(mains)} shards, budget {budget / GiB:.0f} GiB: driver saw "
              f"{used_driver / GiB:.2f} GiB at most, pool peak {s['peak_mapped_bytes'] / GiB:.2f} "
              f"GiB, largest segment {largest / MiB:.0f} MiB")
        assert all(pager.owns(m) for m in mains)
        assert s["peak_mapped_bytes"] <= budget + largest + 2 * 32 * MiB
        assert used_driver <= budget + 2 * largest + 128 * MiB
        pager.page_out(mains)
        for m, shard in zip(mains, model):
            pager.page_in(m)
            assert torch.equal(m, shard.float())
            pager.page_out(m)
