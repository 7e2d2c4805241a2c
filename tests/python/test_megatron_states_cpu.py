"""integrations.megatron_states on the CPU host backend, under Megatron's own parameter-
state format code: a DistributedOptimizer whose ranges Megatron's layout code computes
(its buffers and process groups need CUDA, so the instance is assembled from those
ranges, a paged torch AdamW over fp32 mains and the fields its format methods read)
saves with get_parameter_state_dp_reshardable and loads with load_state_dict, as
Megatron's dist-checkpoint load runs them, through ParamStates (wired as
MegatronMember.bind wires it); the loaded optimizer continues exactly. The GPU suite runs
the real one (tests/gpu/test_megatron_formats.py)."""
import types

import pytest
import torch

from statepager import Pager, _C
from statepager.core import state_values
from statepager.integrations import megatron_internals as internals
from statepager.integrations.megatron_states import ParamStates

pytestmark = pytest.mark.megatron
distrib = pytest.importorskip(
    "megatron.core.optimizer.distrib_optimizer",
    reason="megatron-core is not installed: its format code is what is tested")
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402

KiB = 1 << 10


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.GELU(),
                               torch.nn.Linear(96, 6)).bfloat16()


class Member:
    """A DistributedOptimizer at DP = 1 over `m`'s params, its mains and moments paged,
    with ParamStates set as MegatronMember.bind sets it."""

    def __init__(self, m, directory: str):
        D = distrib.DistributedOptimizer
        params = list(m.parameters())
        lay = D._compute_per_buffer_param_layout(
            params, 500, 1, DistributedDataParallelConfig(use_distributed_optimizer=True))
        buckets = [D._build_model_gbuf_param_range_map(
            {p: i for p, i in lay.param_index_map.items() if i[2] == b},
            distrib.Range(start, end), start) for b, (start, end) in enumerate(lay.bucket_indices)]
        self.m, self.pager = m, Pager(directory, page_size=64 * KiB)
        with self.pager.scope(min_bytes=1):
            self.mains = [p.detach().view(-1).float() for p in params]
        self.inner = torch.optim.AdamW(self.mains, lr=3e-3, weight_decay=0.1)
        self.binding = self.pager.attach(self.inner, bucket_size=16 * KiB)
        d = self.d = object.__new__(D)
        d.gbuf_ranges = [{(torch.bfloat16, torch.float32): [{"param_map": b} for b in buckets]}]
        d.per_bucket_numel = [lay.bucket_indices[-1][1]]
        d.per_bucket_numel_unpadded = lay.per_bucket_numel_unpadded
        d.model_param_group_index_map = {p: (0, i) for i, p in enumerate(params)}
        d.optimizer = self.inner
        d.config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False,
                                         optimizer="adam", fp16=False)
        d.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
        d.grad_scaler = None
        main_of = {p: main for p, main in zip(params, self.mains)}
        self.states = ParamStates(types.SimpleNamespace(
            megatron=types.SimpleNamespace(main_of=main_of.__getitem__,
                                           state_keys=lambda: tuple(d.optimizer_state_keys)),
            pager=self.pager, binding=self.binding))
        internals.answer_param_states(d, self.states)  # as MegatronMember.bind does

    def common_state(self) -> dict:
        """Megatron's state_dict (the param groups, their step counter), as the member's
        own state_dict gives it."""
        with self.binding.state_dict_by_reference():
            return distrib.DistributedOptimizer.state_dict(self.d)

    def load(self, common: dict, saved) -> dict:
        """What Megatron's dist-checkpoint load does with a dp_reshardable checkpoint
        (`saved`, holding no step counters: the format keeps them non-persistent):
        sharded_state_dict(is_loading) builds the state's tensors from the loader's own
        read (make_state first), dist_checkpointing fills them in place, and
        load_state_dict loads the common state and then them. Returns the bytes the
        pager read and wrote in load_state_dict."""
        self.states.make_state()
        buffers = self.d.get_parameter_state_dp_reshardable()
        for mine, theirs in zip(entries(buffers), entries(saved)):
            for name in ("param", "exp_avg", "exp_avg_sq"):
                mine[name].copy_(theirs[name])
            mine["padding"] = False
        before = self.pager.stats()
        self.d.load_state_dict({**common, "param_state": buffers,
                                "param_state_sharding_type": "dp_reshardable"})
        after = self.pager.stats()
        return {k: after[k] - before[k] for k in ("bytes_read", "bytes_written")}

    def step(self, i: int) -> float:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 40, generator=g).bfloat16(), torch.randn(16, 6, generator=g)
        self.m.zero_grad()
        loss = torch.nn.functional.mse_loss(self.m(x).float(), y)
        loss.backward()
        for p, main in zip(self.m.parameters(), self.mains):
            main.grad = p.grad.view(-1).float()
        self.states.forget()  # as MegatronMember's before-step hook does
        self.inner.step()
        with torch.no_grad():
            for p, values in zip(self.m.parameters(), self.state(("param",))):
                p.view(-1).copy_(values[0])
        return loss.item()

    def state(self, names=("param", "exp_avg", "exp_avg_sq")) -> list:
        values = state_values.read(self.binding)
        return [[values[main][n] for n in names] for main in self.mains]


def entries(state) -> list:
    """The per-param entries of a dp_reshardable param state, bucket after bucket."""
    return [e for bucket in state[0][(torch.bfloat16, torch.float32)] for e in bucket]


def copied(saved):
    """The saved state's tensors copied (a checkpoint's, not the live reads), each param's
    entry marked as no padding (as sharded_param_state_dp_reshardable marks it)."""
    if isinstance(saved, torch.Tensor):
        return saved.clone()
    if isinstance(saved, dict):
        entry = {"padding": False} if "gbuf_local_start" in saved else {}
        return {**{k: copied(v) for k, v in saved.items()}, **entry}
    if isinstance(saved, list):
        return [copied(v) for v in saved]
    return saved


def test_megatron_s_dp_reshardable_save_and_load_continue_exactly(store_dir, monkeypatch):
    """The step counter comes from the common state (the format's own is the loader's,
    from before the load); the load's sets are loaded once, at the end of the outermost
    load (load_state_dict calls load_parameter_state_from_dp_reshardable); what a save
    read is forgotten once it returns."""
    loads, load = [], state_values.load
    monkeypatch.setattr(state_values, "load", lambda *a: (loads.append(1), load(*a))[1])
    a, b = model(), model()
    first, second = Member(a, store_dir + "-a"), Member(b, store_dir + "-b")
    try:
        losses = [first.step(i) for i in range(3)]
        common, saved = first.common_state(), copied(first.d.get_parameter_state_dp_reshardable())
        assert first.states._read is None
        # Megatron's layout: one entry per param of each bucket, the values read.
        flat = entries(saved)
        assert sorted(flat[0]) == ["exp_avg", "exp_avg_sq", "gbuf_local_end",
                                   "gbuf_local_start", "padding", "param", "step"]
        assert all(e["param"].device.type == "cpu" for e in flat)
        with torch.no_grad():  # the model's own checkpoint, loaded first
            for x, y in zip(a.parameters(), b.parameters()):
                y.copy_(x)
        moved = second.load(common, saved)  # into no state yet
        assert len(loads) == 1
        # The state written once, read at most once: Megatron's round trip of the inner
        # optimizer's state dict goes by reference.
        stored = sum(t.numel() * t.element_size() for b in second.binding.buckets
                     for t in b.stored)
        assert moved["bytes_written"] == stored and moved["bytes_read"] <= stored, moved
        assert all(torch.equal(x, y) for px, py in zip(first.state(), second.state())
                   for x, y in zip(px, py))
        steps = [{float(s["step"]) for s in m.inner.state.values()} for m in (first, second)]
        assert steps == [{3.0}, {3.0}]
        assert [first.step(i) for i in range(3, 6)] == [second.step(i) for i in range(3, 6)]
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
        assert len(losses) == 3
    finally:
        first.pager.close()
        second.pager.close()


@pytest.mark.parametrize("broken,message", [
    ("a-shape", "must be a tensor of that shape, not \\(3,\\); nothing was loaded"),
    ("an-entry", "holds no 'exp_avg_sq' for a parameter")])
def test_a_load_that_does_not_fit_changes_nothing(store_dir, broken, message):
    first = Member(model(), store_dir)
    try:
        first.step(0)
        before = first.state()
        saved = copied(first.d.get_parameter_state_dp_reshardable())
        for entry in saved[0][(torch.bfloat16, torch.float32)][0]:
            entry["exp_avg"] = torch.full_like(entry["exp_avg"], 7.0)
        if broken == "a-shape":
            entries(saved)[-1]["exp_avg_sq"] = torch.zeros(3)
        else:
            del entries(saved)[-1]["exp_avg_sq"]
        with pytest.raises(_C.UsageError, match=message):
            first.d.load_parameter_state_from_dp_reshardable(saved)
        assert all(torch.equal(x, y) for px, py in zip(before, first.state())
                   for x, y in zip(px, py))
    finally:
        first.pager.close()


def test_a_state_made_before_the_first_step_steps_as_a_fresh_one(store_dir):
    """make_state (what a load into an optimizer that has not stepped makes first): step
    0 and zero moments, paged without memory; the steps after it are a fresh run's."""
    a, b = model(), model()
    made, fresh = Member(a, store_dir + "-a"), Member(b, store_dir + "-b")
    try:
        mapped = made.pager.stats()["mapped_bytes"]
        made.states.make_state()
        assert made.pager.stats()["mapped_bytes"] == mapped
        held = made.inner.state.as_held()
        assert all(made.pager.residency(held[m]["exp_avg"]) == "zero" for m in made.mains)
        assert [made.step(i) for i in range(3)] == [fresh.step(i) for i in range(3)]
        assert all(torch.equal(x, y) for px, py in zip(made.state(), fresh.state())
                   for x, y in zip(px, py))
    finally:
        made.pager.close()
        fresh.pager.close()


def test_a_load_that_fails_in_its_sets_keeps_the_step_counters(store_dir, monkeypatch):
    """Megatron's load_state_dict writes the checkpoint's step counter into the state it
    reads (by reference) before the sets; a load that fails in them puts every param's
    own counter back, and the paged state is as it was."""
    first, second = Member(model(), store_dir + "-a"), Member(model(), store_dir + "-b")
    try:
        for i in range(3):
            first.step(i)
        second.step(0)
        common, saved = first.common_state(), copied(first.d.get_parameter_state_dp_reshardable())
        before, counters = second.state(), list(second.inner.state.values())
        ids = {id(s["step"]) for s in counters}

        def failing(*_):
            raise RuntimeError("injected in the load's sets")
        monkeypatch.setattr(state_values, "load", failing)
        with pytest.raises(RuntimeError, match="injected"):
            second.load(common, saved)
        monkeypatch.undo()
        steps = [s["step"] for s in second.inner.state.values()]
        assert [float(s) for s in steps] == [1.0] * len(steps)
        assert {id(s) for s in steps} == ids
        assert all(torch.equal(x, y) for px, py in zip(before, second.state())
                   for x, y in zip(px, py))
    finally:
        first.pager.close()
        second.pager.close()
