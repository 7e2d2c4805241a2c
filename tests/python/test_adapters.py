"""Pager.attach of another framework's optimizer goes to its adapter
(statepager.core.adapters): the options the adapter sets itself are refused, and the
Megatron adapter refuses a megatron-core outside its supported range before changing
anything."""
import importlib.util
import re
import types

import pytest
import torch

import statepager
from statepager import Pager
from statepager.core import adapters
from statepager.integrations import megatron_internals, megatron_version

KiB = 1 << 10


class FakeMegatronOptimizer:
    """Looks like a Megatron optimizer to the adapter registry (by its module)."""


FakeMegatronOptimizer.__module__ = "megatron.core.optimizer.distrib_optimizer"


def test_megatron_is_registered():
    assert adapters.find(FakeMegatronOptimizer()).name == "Megatron"
    assert adapters.find(torch.optim.SGD([torch.zeros(2, requires_grad=True)])) is None
    # A torch optimizer Megatron defines (TensorParallelMuon) is a member's inner one,
    # attached as a torch optimizer.
    inner = _optimizer_named("megatron.core.optimizer.emerging_optimizers", "TensorParallelMuon")
    assert adapters.find(inner) is None


@pytest.mark.parametrize("option", ["name", "hooks"])
def test_attach_refuses_what_the_megatron_adapter_sets(store_dir, option):
    value = "x" if option == "name" else statepager.Hooks(before_bucket=lambda *_: None)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        with pytest.raises(statepager.UsageError,
                           match=f"Megatron optimizer sets {option} itself.*leave it out"):
            pager.attach(FakeMegatronOptimizer(), **{option: value})
        assert pager.bindings == ()


@pytest.mark.skipif(importlib.util.find_spec("megatron") is not None,
                    reason="megatron-core is installed: the GPU suite tests the adapter")
def test_attach_without_a_supported_megatron_core_is_refused(store_dir):
    with Pager(store_dir, page_size=64 * KiB) as pager:
        with pytest.raises(statepager.UsageError, match="supports megatron-core 0.19.x"):
            pager.attach(FakeMegatronOptimizer())
        assert pager.bindings == ()


def test_supported_range_is_one_minor_release():
    low, high = megatron_version.SUPPORTED
    assert low < high and low[0] == high[0] and high[1] == low[1] + 1


def _optimizer_named(module: str, name: str) -> torch.optim.Optimizer:
    cls = type(name, (torch.optim.Optimizer,), {"__module__": module})
    cls.__qualname__ = name
    return cls([torch.zeros(2, requires_grad=True)], {})


@pytest.mark.parametrize("module, name, match", [
    ("transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam",
     "counts its step per param group.*torch.optim.AdamW"),
    ("megatron.core.optimizer.emerging_optimizers", "TensorParallelAdaptiveMuon",
     "scale_mode is never set.*--optimizer muon"),
    ("emerging_optimizers.soap.soap", "SOAP", "replaces its state tensors"),
    ("apex.optimizers.fused_sgd", "FusedSGD", "has not been checked against it"),
])
def test_megatron_inner_optimizers_not_checked_are_refused_by_name(module, name, match):
    problem = megatron_internals.inner_problem(_optimizer_named(module, name))
    assert f"{module}.{name}" in problem and re.search(match, problem)


def _muon(tp_mode: str, **sizes) -> torch.optim.Optimizer:
    """A TensorParallelMuon by name whose pg_collection's groups have `sizes` ranks."""
    muon = _optimizer_named("megatron.core.optimizer.emerging_optimizers", "TensorParallelMuon")
    muon.tp_mode = tp_mode
    muon.pg_collection = types.SimpleNamespace(**{g: FakeGroup(n) for g, n in sizes.items()})
    return muon


class FakeGroup:
    def __init__(self, size: int):
        self.size = size


@pytest.fixture
def group_sizes(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: group.size)


def test_megatron_inner_optimizers_paged(group_sizes):
    params = [torch.zeros(2, requires_grad=True)]
    for optimizer in (torch.optim.Adam(params), torch.optim.AdamW(params),
                      torch.optim.SGD(params, lr=0.1), _muon("duplicated"),
                      _muon("blockwise", tp=4, expt_tp=2, gtp_remat=1),
                      _muon("distributed", tp=1)):
        assert megatron_internals.inner_problem(optimizer) is None


@pytest.mark.parametrize("muon, groups", [
    (dict(tp_mode="duplicated", tp=2), "tp"),
    (dict(tp_mode="distributed", tp=2, expt_tp=4), "tp, expt_tp"),
    (dict(tp_mode="blockwise", tp=2, gtp_remat=2), "gtp_remat"),
])
def test_megatron_muon_across_ranks_is_refused(group_sizes, muon, groups):
    problem = megatron_internals.inner_problem(_muon(**muon))
    assert f"span the ranks of its {groups} group" in problem
    assert "--muon-tp-mode blockwise" in problem
