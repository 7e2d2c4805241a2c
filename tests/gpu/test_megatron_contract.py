"""The contract between statepager and megatron-core: every Megatron class, function,
method and attribute that statepager.integrations.megatron_internals uses exists, with the
parameters it calls it with, in the installed megatron-core, and that release is in the
supported range. The signatures are checked wherever megatron-core imports; the instance
attributes on a built DistributedOptimizer (GPU). Skips when megatron-core is not
installed. When Megatron changes, this test names what moved."""
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys

import pytest
import torch

from statepager.integrations import megatron_internals as internals
from statepager.integrations import megatron_version

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed (the GPU suite "
                                       "carries it)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))


def test_installed_release_is_supported():
    megatron_version.check_version()  # raises UsageError naming the release otherwise


@pytest.mark.parametrize("module,owner,name,params", internals.CONTRACT,
                         ids=[f"{o or m}.{n}" for m, o, n, _ in internals.CONTRACT])
def test_attribute_and_signature(module, owner, name, params):
    where = importlib.import_module(module)
    if owner is not None:
        where = getattr(where, owner)
    assert hasattr(where, name), f"{module}.{owner or ''} has no {name}"
    if params is not None:
        found = list(inspect.signature(getattr(where, name)).parameters)
        assert found[:len(params)] == params, f"{name}{found}: statepager calls it as {params}"


@pytest.mark.gpu
def test_instance_attributes_of_a_built_optimizer():
    import megatron_gpt

    megatron_gpt.init()
    setup = megatron_gpt.Setup(steps=1)
    model, optimizer, _, _ = megatron_gpt.build(setup, None)
    for _, d in internals.members(optimizer):
        for name in internals.INSTANCE_ATTRIBUTES:
            assert hasattr(d, name), f"DistributedOptimizer has no attribute {name}"
        for buffer in d.buffers:
            for name in internals.BUFFER_ATTRIBUTES:
                assert hasattr(buffer, name), f"_ParamAndGradBuffer has no attribute {name}"
        m = internals.Internals(d)
        assert m.unsupported() is None
        pairs = m.float16_params()
        assert pairs, "no bf16 parameters in the test model"
        model_param, main = pairs[0]
        assert main.dtype == torch.float32 and model_param.main_param is main
        ranges = d._get_model_param_range_map(model_param)
        assert {"param", "gbuf_world_in_bucket"} <= set(ranges)
        shard = m.shard(model_param)
        assert shard.numel() == main.numel()
        assert m.param_buffer_slice(model_param).numel() == main.numel()
        assert m.grad_shard(model_param).numel() == main.numel()
        hash(internals.grad_norm_group(main))
    megatron_gpt.finish(model)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    dict(optimizer="sgd", distributed=False),
    pytest.param(dict(optimizer="muon", layer_wise=True), marks=pytest.mark.skipif(
        importlib.util.find_spec("emerging_optimizers") is None,
        reason="emerging-optimizers is not installed (the GPU suite carries its wheel)"))])
def test_instance_attributes_of_a_built_mixed_precision_member(options):
    import megatron_gpt
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    megatron_gpt.init()
    setup = megatron_gpt.Setup(steps=1, **options)
    model, optimizer, _, _ = megatron_gpt.build(setup, None)
    chunks = internals.model_chunks(optimizer)
    for chunk in chunks:
        for name in internals.MODEL_CHUNK_ATTRIBUTES:
            assert hasattr(chunk, name), f"the DDP model chunk has no attribute {name}"
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            for name in internals.BUCKET_GROUP_ATTRIBUTES:
                assert hasattr(group, name), f"_ParamAndGradBucketGroup has no {name}"
    mixed = [d for _, d in internals.members(optimizer)
             if isinstance(d, Float16OptimizerWithFloat16Params)]
    assert mixed, "no Float16OptimizerWithFloat16Params member"
    for d in mixed:
        for name in internals.MIXED_PRECISION_ATTRIBUTES:
            assert hasattr(d, name), f"Float16OptimizerWithFloat16Params has no {name}"
        m = internals.view(d, chunks)
        assert m.unsupported() is None
        model_param, main = m.float16_params()[0]
        assert main.shape == model_param.shape and model_param.main_param is main
        assert m.grad_shard(model_param).shape == main.shape
        # The layer-wise chain knows its model's grad buffers; a non-distributed one not.
        assert bool(m.buffers()) == bool(options.get("layer_wise"))
        if type(d.optimizer).__name__ == "TensorParallelMuon":
            for name in internals.MUON_ATTRIBUTES:
                assert hasattr(d.optimizer, name), f"TensorParallelMuon has no {name}"
            groups = d.optimizer.pg_collection  # a dataclass whose groups may be unset
            fields = {f.name for f in dataclasses.fields(groups)} if groups else set()
            for name in internals.MUON_GROUPS:
                assert groups is None or name in fields, \
                    f"TensorParallelMuon's pg_collection has no field {name}"
    megatron_gpt.finish(model)
