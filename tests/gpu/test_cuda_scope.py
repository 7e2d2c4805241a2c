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


_POOL_OF_A_DEAD_PAGER = r"""
import gc, sys, torch, statepager
a = statepager.Pager(sys.argv[1], device="cuda")
with a.scope():
    kept = [torch.randn(1 << 20, device="cuda").bfloat16() for _ in range(4)]  # pool blocks
a.cycle = a               # only the garbage collector can free it
del a                     # never closed: its MemPool dies with it
b = statepager.Pager(sys.argv[2], device="cuda")
with b.scope():
    mains = [torch.randn(1 << 20, device="cuda").float() for _ in range(4)]
    gc.collect()          # the dead pager's pool is collected inside b's scope
b.close()
print("ok")
"""


def test_a_pool_collected_inside_another_scope_does_not_abort(tmp_path):
    """PyTorch aborts when a MemPool is destroyed while another pool is being allocated
    into: a garbage collection inside scope() must not destroy a dead pager's pool."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _POOL_OF_A_DEAD_PAGER, str(tmp_path / "a"),
                          str(tmp_path / "b")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")
