"""A data-parallel size changed between save and load, on the CPU host backend: each DP
rank pages the shard of the model that Megatron's own layout code gives it
(DistributedOptimizer._compute_per_buffer_param_layout and
_build_model_gbuf_param_range_map, at DP = 2 and DP = 1); its masters and moments are
read out (statepager.core.state_values.read) into Megatron's dp_reshardable layout (per
grad bucket, one tensor per entry, each param at its place in the bucket), and loaded
at the other DP size (state_values.load). The resumed run continues exactly as the
uninterrupted one. Needs megatron-core (marked `megatron`: the GPU suite runs it; elsewhere
put its wheel's contents on PYTHONPATH)."""
import pytest
import torch

from statepager import PagedAdamW, Pager
from statepager.core import state_values

pytestmark = pytest.mark.megatron
distrib = pytest.importorskip(
    "megatron.core.optimizer.distrib_optimizer",
    reason="megatron-core is not installed: its layout code computes the shard ranges")
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402

KiB = 1 << 10
BUCKET_NUMEL = 500  # elements: several grad buckets, params split between ranks
ENTRIES = ("param", "exp_avg", "exp_avg_sq")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.GELU(),
                               torch.nn.Linear(96, 96), torch.nn.GELU(),
                               torch.nn.Linear(96, 6)).bfloat16()


def layout(params: list, dp: int):
    """Megatron's layout of `params` in one grad buffer at data-parallel size dp: each
    param's (start, end, bucket) and each bucket's (start, end)."""
    return distrib.DistributedOptimizer._compute_per_buffer_param_layout(
        params, BUCKET_NUMEL, dp, DistributedDataParallelConfig(use_distributed_optimizer=True))


def shard_ranges(params: list, dp: int, rank: int) -> list:
    """(param, bucket, range of its flat elements) this rank steps, as Megatron's
    _build_model_gbuf_range splits each bucket into dp equal shards."""
    lay = layout(params, dp)
    out = []
    for b, (start, end) in enumerate(lay.bucket_indices):
        size = (end - start) // dp
        world = distrib.Range(start + rank * size, start + (rank + 1) * size)
        in_bucket = {p: idx for p, idx in lay.param_index_map.items() if idx[2] == b}
        ranges = distrib.DistributedOptimizer._build_model_gbuf_param_range_map(
            in_bucket, world, start)
        out += [(p, b, r["param"]) for p, r in ranges.items()]
    return out


class Rank:
    """One DP rank: PagedAdamW over bf16 copies of its shards."""

    def __init__(self, m, dp: int, rank: int, directory: str):
        self.m = m
        self.ranges = shard_ranges(list(m.parameters()), dp, rank)
        self.shards = [torch.nn.Parameter(p.detach().view(-1)[r.start:r.end].clone())
                       for p, _, r in self.ranges]
        self.pager = Pager(directory, page_size=64 * KiB)
        self.opt = PagedAdamW(self.shards, pager=self.pager, lr=3e-3, weight_decay=0.1,
                              bucket_size=16 * KiB)

    def step(self) -> None:
        for shard, (p, _, r) in zip(self.shards, self.ranges):
            shard.grad = p.grad.view(-1)[r.start:r.end].clone()
        self.opt.step()

    def gather(self) -> None:  # the params' all-gather
        with torch.no_grad():
            for shard, (p, _, r) in zip(self.shards, self.ranges):
                p.view(-1)[r.start:r.end].copy_(shard)

    def masters(self) -> list:
        return [q for g in self.opt.param_groups for q in g["params"]]


def train(m, ranks: list, steps: range) -> list:
    losses = []
    for i in steps:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 40, generator=g).bfloat16(), torch.randn(16, 6, generator=g)
        m.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x).float(), y)
        loss.backward()
        for rank in ranks:
            rank.step()
        for rank in ranks:
            rank.gather()
        losses.append(loss.item())
    return losses


def save(m, ranks: list, dp: int) -> dict:
    """Megatron's dp_reshardable tensors: {(bucket, entry): flat fp32 tensor over the
    bucket's elements}, each rank's values at its params' places."""
    lay = layout(list(m.parameters()), dp)
    out = {(b, e): torch.zeros(end - start) for b, (start, end) in
           enumerate(lay.bucket_indices) for e in ENTRIES}
    for rank in ranks:
        values = state_values.read(rank.opt.binding)
        for q, (p, b, r) in zip(rank.masters(), rank.ranges):
            at = lay.param_index_map[p][0] - lay.bucket_indices[b][0] + r.start
            for e in ENTRIES:
                out[b, e][at:at + r.size].copy_(values[q][e])
    return out, lay


def load(saved, ranks: list, step: int) -> None:
    """Each rank's state made as Megatron makes it before setting the values (a load of
    zeros at the saved step), then its shards' values from the saved buckets."""
    tensors, lay = saved
    for rank in ranks:
        sd = rank.opt.state_dict()
        rank.opt.load_state_dict({**sd, "state": {
            i: {"step": torch.tensor(float(step)), "exp_avg": torch.zeros(s.shape),
                "exp_avg_sq": torch.zeros(s.shape)} for i, s in enumerate(rank.shards)}})
        values = {}
        for q, (p, b, r) in zip(rank.masters(), rank.ranges):
            at = lay.param_index_map[p][0] - lay.bucket_indices[b][0] + r.start
            values[q] = {e: tensors[b, e][at:at + r.size] for e in ENTRIES}
        state_values.load(rank.opt.binding, values)


@pytest.mark.parametrize("saved_dp,loaded_dp", [(2, 1), (1, 2)])
def test_a_run_resumed_at_another_dp_size_continues_exactly(store_dir, saved_dp, loaded_dp):
    ref_m, m = model(), model()
    ref = [Rank(ref_m, saved_dp, r, f"{store_dir}/ref{r}") for r in range(saved_dp)]
    first = [Rank(m, saved_dp, r, f"{store_dir}/a{r}") for r in range(saved_dp)]
    resumed = []
    try:
        buckets = layout(list(m.parameters()), 2).bucket_indices
        assert len(buckets) > 2, buckets
        assert any(r.start > 0 for rank in first for _, _, r in rank.ranges) or saved_dp == 1
        ref_losses = train(ref_m, ref, range(8))
        assert train(m, first, range(4)) == ref_losses[:4]
        saved = save(m, first, saved_dp)
        resumed = [Rank(m, loaded_dp, r, f"{store_dir}/b{r}") for r in range(loaded_dp)]
        load(saved, resumed, step=4)
        assert train(m, resumed, range(4, 8)) == ref_losses[4:]
        assert all(torch.equal(a, b) for a, b in zip(ref_m.parameters(), m.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(save(ref_m, ref, 1)[0].values(),
                                                     save(m, resumed, 1)[0].values()))
    finally:
        for rank in ref + first + resumed:
            rank.pager.close()
