"""Megatron-core's optimizers streamed by statepager, on the GPU (DistributedOptimizer and
ChainedOptimizer with Adam; SGD and Muon in non-distributed and layer-wise chains): a
small GPT trained with and without the pager must match bit for bit (losses, model params,
mains and optimizer state). Skips when megatron-core is not installed."""
import contextlib
import copy
import importlib.util
import os
import sys

import pytest
import torch

from statepager import Pager
from statepager import _C
from statepager.integrations import megatron_internals

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))
import megatron_run  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core is not installed (the GPU suite carries it)"),
]
MiB = 1 << 20
# Muon, AdaptiveMuon, SOAP and Lion come from emerging-optimizers (a wheel the GPU suite
# carries); the cases that build them skip without it.
needs_emerging = pytest.mark.skipif(
    importlib.util.find_spec("emerging_optimizers") is None,
    reason="emerging-optimizers is not installed (the GPU suite carries its wheel)")


@pytest.fixture(scope="module")
def gpt():
    import megatron_gpt

    megatron_gpt.init()
    return megatron_gpt


def members(optimizer):
    """The optimizer's members, one binding each (nested chains' leaves)."""
    return [m for _, m in megatron_internals.members(optimizer)]


def snapshot(optimizer, binding=None):
    """Every main and moment, and every native fp32 param and its state, on the host
    (paged state is paged in bucket by bucket)."""
    out = []
    member_bindings = binding.bindings if binding else [None] * len(members(optimizer))
    for d, member_binding in zip(members(optimizer), member_bindings):
        inner = d.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        copies = {}
        if member_binding is None:
            for p in params:
                copies[id(p)] = [p.cpu()] + [v.cpu() for k, v in sorted(inner.state[p].items())
                                             if isinstance(v, torch.Tensor) and v.dim() > 0]
        else:
            for b in member_binding.state_in_buckets():
                for p in b.params:
                    copies[id(p)] = [p.cpu()] + [
                        v.cpu() for k, v in sorted(inner.state[p].items())
                        if isinstance(v, torch.Tensor) and v.dim() > 0]
        out.append([copies[id(p)] for p in params])
    return out


def run(gpt, setup, pager=None, **attach):
    model, optimizer, scheduler, binding = gpt.build(setup, pager, **attach)
    losses = [gpt.train_step(setup, model, optimizer, scheduler, i) for i in range(setup.steps)]
    gpt.finish(model)
    params = [p.detach().cpu() for p in model.parameters()]
    return losses, params, snapshot(optimizer, binding), (model, optimizer, binding)


def assert_same(a, b, entries=(3,)):
    """Losses, model params and every member's mains and state equal; entries: per
    member, the tensors per param in snapshot() (its main and state tensors)."""
    la, pa, sa, _ = a
    lb, pb, sb, _ = b
    assert la == lb, f"losses differ:\n{la}\n{lb}"
    assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert len(sa) == len(sb) == len(entries)
    for ma, mb, n in zip(sa, sb, entries):
        assert len(ma) == len(mb)
        for ta, tb in zip(ma, mb):
            assert len(ta) == len(tb) == n
            assert all(torch.equal(x, y) for x, y in zip(ta, tb))


ALL_OR_NOTHING = dict(attach_options=dict(atomic="step"))
CASES = {
    "bf16-grads": dict(),
    "bf16-grads-overlap": dict(overlap=True),
    "fp32-grads": dict(grad_fp32=True),
    "fp32-grads-overlap": dict(grad_fp32=True, overlap=True),
    # Grad syncs in the backward (overlap_grad_reduce alone), activations past the window.
    "fp32-grads-reduce-in-backward": dict(grad_fp32=True, overlap_grad_reduce=True, batch=32,
                                          seq=256),
    "bf16-grads-residual-mains": dict(attach=dict(mains="residual")),
    "q8-residual-reduce-in-backward": dict(overlap_grad_reduce=True, batch=32, seq=256,
                                           attach=dict(moments="q8", mains="residual")),
    "bf16-grads-q8-moments": dict(attach=dict(moments="q8")),
    "q8-residual-overlap": dict(overlap=True, attach=dict(moments="q8", mains="residual")),
    "moe": dict(experts=4),
    "moe-fp32-grads-overlap": dict(experts=4, grad_fp32=True, overlap=True),
    # Megatron's DistributedOptimizer refuses SGD: a non-distributed chain, whose grad
    # buffers statepager cannot reach (its steps are all or nothing).
    "sgd": dict(optimizer="sgd", distributed=False, attach=ALL_OR_NOTHING),
    "sgd-fp32-grads": dict(optimizer="sgd", distributed=False, grad_fp32=True,
                           attach=ALL_OR_NOTHING),
    "sgd-no-momentum": dict(optimizer="sgd", sgd_momentum=0.0, distributed=False,
                            attach=ALL_OR_NOTHING),
    # Muon for the matrices, Adam for the rest: two members.
    "muon": dict(optimizer="muon", distributed=False, attach=ALL_OR_NOTHING),
    "muon-fp32-grads": dict(optimizer="muon", distributed=False, grad_fp32=True,
                            attach=ALL_OR_NOTHING),
    "muon-layer-wise": dict(optimizer="muon", layer_wise=True),
    "muon-layer-wise-fp32-grads": dict(optimizer="muon", layer_wise=True, grad_fp32=True),
    "muon-layer-wise-residual-mains": dict(optimizer="muon", layer_wise=True,
                                           attach=dict(mains="residual")),
}
# The inner optimizers each case's members step with.
INNER = {"sgd": ["SGD"], "sgd-fp32-grads": ["SGD"], "sgd-no-momentum": ["SGD"],
         **{case: ["TensorParallelMuon", "AdamW"] for case in CASES if "muon" in case}}


def state_entries(optimizer) -> tuple:
    """Per member, tensors per main in snapshot(): the main and its state (Adam: two
    moments; SGD with momentum and Muon: a momentum buffer)."""
    counts = {"Adam": 3, "AdamW": 3, "TensorParallelMuon": 2}
    return tuple(counts.get(type(m.optimizer).__name__, 1 + bool(m.optimizer.defaults.get(
        "momentum"))) for m in members(optimizer))


@pytest.mark.parametrize("case", [pytest.param(c, marks=[needs_emerging] if "muon" in c else [])
                                  for c in CASES])
def test_parity_with_unpaged_megatron(gpt, case, store_dir):
    options = dict(CASES[case])
    attach = options.pop("attach", {})
    setup = gpt.Setup(**options)
    base = run(gpt, setup)
    with Pager(store_dir, "cuda", page_size=2 * MiB) as pager:
        paged = run(gpt, setup, pager, bucket_size=1 * MiB, **attach)
        if attach.get("moments") == "q8":  # lossy by design: it trains, close to fp32
            assert paged[0][-1] < paged[0][0]
            assert abs(paged[0][-1] - base[0][-1]) < 0.05 * base[0][-1]
            return
        binding = paged[3][2]
        # One GPU: experts are not expert-parallel, so one (dense) DistributedOptimizer;
        # the dense + expert ChainedOptimizer runs on two GPUs (test_expert_parallel_...).
        optimizer = paged[3][1]
        inner = [type(m.optimizer).__name__ for m in members(optimizer)]
        assert sorted(inner) == sorted(INNER.get(case, ["AdamW"]))
        entries = state_entries(optimizer)
        names = [f"{i}-dense" for i in range(len(entries))]
        assert [s.name for s in binding.bindings] == names
        assert megatron_run.stores_in_use(pager, binding) == names
        assert max(st.buckets for st in binding.last) > 1, "several buckets"
        assert_same(base, paged, entries)
        # The model's loss went down: the pager trains, it does not just copy.
        assert paged[0][-1] < paged[0][0]


ONE_PASS_CASES = {k: CASES[k] for k in ("bf16-grads", "bf16-grads-overlap", "fp32-grads",
                                          "fp32-grads-overlap", "moe")}


@pytest.mark.parametrize("case", ONE_PASS_CASES)
def test_one_step_reads_and_writes_the_state_once(gpt, case, store_dir):
    """Megatron's step_with_ready_grads copies mains to params after the inner step; the
    streamed step did that bucket by bucket already, so a step moves each stored byte
    exactly once each way (a second pass doubled the step's I/O before)."""
    setup = gpt.Setup(steps=3, **ONE_PASS_CASES[case])
    with Pager(store_dir, "cuda", page_size=2 * MiB) as pager:
        model, optimizer, scheduler, binding = gpt.build(setup, pager, bucket_size=1 * MiB)
        for i in range(2):  # the first step reads only the mains (moments are deferred)
            gpt.train_step(setup, model, optimizer, scheduler, i)
        stored = sum(t.numel() * t.element_size() for s in binding.bindings
                     for b in s.buckets for t in b.stored)
        before = pager.stats()
        gpt.train_step(setup, model, optimizer, scheduler, 2)
        after = pager.stats()
        gpt.finish(model)
        # Resumable steps keep no host undo copies (they copy a bucket's targets on the
        # device as it steps), and undo copies are never pager bytes.
        undo = sum(t.numel() * t.element_size() for s in binding.bindings
                   for b in s.buckets for t in b.undo)
        assert after["bytes_read"] - before["bytes_read"] == stored
        assert after["bytes_written"] - before["bytes_written"] == stored
        assert undo == 0
        assert sum(st.bytes_read for st in binding.last) == stored


def test_reload_model_params_goes_through_the_pager(gpt, store_dir):
    setup = gpt.Setup(steps=3)
    with Pager(store_dir, "cuda", page_size=2 * MiB) as pager:
        model, optimizer, scheduler, binding = gpt.build(setup, pager, bucket_size=1 * MiB)
        # No state before the first step, as in torch; the first step creates the
        # moments in the pager (ZERO): it reads only the mains.
        mains = [(d, m) for d in members(optimizer) for g in d.shard_fp32_from_float16_groups
                 for m in g]
        assert not any(d.optimizer.state.get(main) for d, main in mains)
        mains_bytes = sum(m.numel() * 4 for _, m in mains)
        for i in range(setup.steps):
            gpt.train_step(setup, model, optimizer, scheduler, i)
            if i == 0:
                assert sum(s.bytes_read for s in binding.last) <= mains_bytes + 4096 * len(mains)
                assert all(pager.owns(d.optimizer.state[main][k]) for d, main in mains
                           for k in ("exp_avg", "exp_avg_sq"))
        gpt.finish(model)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        optimizer.reload_model_params()
        for d, member_binding in zip(members(optimizer), binding.bindings):
            for b in member_binding.state_in_buckets():
                for main in b.params:
                    member = next(m for m in binding.members if m.optimizer is d)
                    model_param = member.model_of.get(id(main))
                    if model_param is not None:
                        r = d._get_model_param_range_map(model_param)["param"]
                        assert torch.equal(main, model_param.view(-1)[r.start:r.end].float())


@contextlib.contextmanager
def three_steps(gpt, case, store_dir, atomic):
    """(setup, the unpaged run of 6 steps, (model, optimizer, scheduler, binding) attached
    with `atomic`, the losses of its first 3 steps, the model params after them), the
    Pager open until the block ends."""
    options = dict(CASES[case])
    attach = dict(options.pop("attach", {}), attach_options={"atomic": atomic})
    setup = gpt.Setup(steps=6, **options)
    base = run(gpt, setup)
    with Pager(store_dir, "cuda", page_size=2 * MiB) as pager:
        built = gpt.build(setup, pager, bucket_size=1 * MiB, **attach)
        model, optimizer, scheduler, _ = built
        losses = [gpt.train_step(setup, model, optimizer, scheduler, i) for i in range(3)]
        gpt.finish(model)
        yield setup, base, built, losses, [p.detach().clone() for p in model.parameters()]


def fail_in_second_bucket(member_binding, train_step) -> None:
    """Runs train_step() with the second bucket's after_bucket raising (after it wrote
    that bucket's stepped mains into the param buffer); checks that it raised."""
    hook, calls = member_binding.after_bucket, []

    def failing(bucket_params):
        hook(bucket_params)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")

    member_binding.after_bucket = failing
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            train_step()
    finally:
        member_binding.after_bucket = hook
    torch.cuda.synchronize()


@pytest.mark.parametrize("case", ["bf16-grads", "fp32-grads", "bf16-grads-residual-mains",
                                  "moe-fp32-grads-overlap"])
def test_failed_step_changes_nothing_and_the_retry_is_exact(gpt, case, store_dir):
    """An all-or-nothing step (atomic="step") that fails after some buckets' mains went
    into the DDP param buffer: the model params, mains and moments are as before it (the
    param buffer rewritten from the restored mains, or from undo copies with residual
    mains), and training on from there matches unpaged Megatron bit for bit."""
    with three_steps(gpt, case, store_dir, "step") as (setup, base, built, losses, params):
        model, optimizer, scheduler, binding = built
        state = snapshot(optimizer, binding)
        assert len(binding.bindings[0].buckets) >= 3
        fail_in_second_bucket(binding.bindings[0],
                              lambda: gpt.train_step(setup, model, optimizer, scheduler, 3))
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
        for ma, mb in zip(state, snapshot(optimizer, binding)):
            assert all(torch.equal(x, y) for ta, tb in zip(ma, mb) for x, y in zip(ta, tb))
        losses += [gpt.train_step(setup, model, optimizer, scheduler, i)
                   for i in range(3, setup.steps)]  # the retry of step 3, and on
        gpt.finish(model)
        paged = (losses, [p.detach().cpu() for p in model.parameters()],
                 snapshot(optimizer, binding), None)
    assert_same(base, paged)


@pytest.mark.parametrize("case", ["bf16-grads", "fp32-grads-overlap",
                                  "bf16-grads-residual-mains"])
def test_failed_resumable_step_finishes_before_the_grads_are_zeroed(gpt, case, store_dir):
    """A resumable step (atomic="bucket", the default) that fails after some buckets
    stepped leaves those stepped and the rest not; the loop's next zero_grad_buffer(),
    which zeroes the grads the rest need before the optimizer's zero_grad(), finishes it
    first. Training on from there matches unpaged Megatron with that step whole."""
    with three_steps(gpt, case, store_dir, "bucket") as (setup, base, built, losses, params):
        model, optimizer, scheduler, binding = built
        member_binding = binding.bindings[0]
        assert len(member_binding.buckets) >= 3 and member_binding.atomic == "bucket"
        fail_in_second_bucket(member_binding,
                              lambda: gpt.train_step(setup, model, optimizer, scheduler, 3))
        changed = [not torch.equal(a, b) for a, b in zip(params, model.parameters())]
        assert any(changed) and not all(changed), "some buckets stepped, not all"
        model.zero_grad_buffer()  # finishes step 3 with its grads, then zeroes them
        scheduler.step(increment=1)  # step 3 is whole: the loop's record of it
        losses += [None] + [gpt.train_step(setup, model, optimizer, scheduler, i)
                            for i in range(4, setup.steps)]
        gpt.finish(model)
        paged = (losses, [p.detach().cpu() for p in model.parameters()],
                 snapshot(optimizer, binding), None)
    base[0][3] = None  # the failed step's loss was never returned
    assert_same(base, paged)


UNDER_THE_FORWARD = ["bf16-grads", "fp32-grads", "bf16-grads-residual-mains",
                     "bf16-grads-q8-moments", "fp32-grads-reduce-in-backward",
                     "q8-residual-reduce-in-backward", "bf16-grads-overlap",
                     "fp32-grads-overlap", "q8-residual-overlap", "moe-fp32-grads-overlap",
                     "muon-layer-wise"]
# With the buckets stepped on a thread of their own (Note [A thread steps the buckets
# under the forward]).
ON_A_THREAD = ["bf16-grads", "fp32-grads", "q8-residual-reduce-in-backward",
               "bf16-grads-overlap", "fp32-grads-overlap", "q8-residual-overlap",
               "moe-fp32-grads-overlap"]
# With the state in the Pager's host tier, with and without the thread.
IN_THE_HOST_TIER = [("bf16-grads", False), ("fp32-grads-overlap", False),
                    ("bf16-grads", True), ("fp32-grads-overlap", True),
                    ("q8-residual-overlap", True)]


@pytest.mark.parametrize("case, step_thread, host_tier", [
    pytest.param(c, thread, host, marks=[needs_emerging] if "muon" in c else [])
    for c, thread, host in [(c, False, False) for c in UNDER_THE_FORWARD]
    + [(c, True, False) for c in ON_A_THREAD] + [(c, t, True) for c, t in IN_THE_HOST_TIER]])
def test_steps_under_the_forward_match_unpaged(gpt, case, step_thread, host_tier, store_dir):
    """binding.overlap_forward(model): Megatron's step() returns with the buckets left to
    the next forward, each stepped (and its mains in the param buffer, its grads zeroed)
    before the first module using it runs, and before a param all-gather reads them
    (overlap_param_gather: DDP's forward pre-hooks dispatch each bucket group's, the next
    one's ahead); bit-identical to unpaged Megatron. In a chain (Muon's layer-wise one,
    dense + expert) only the last member's steps are left to the forward: each earlier
    one completes when the next begins. With grad syncs in the backward
    (overlap_grad_reduce) and activations larger than the window, each step's page-ins
    begin in the backward before it (Note [Page-ins during backward]). step_thread: the
    same, the buckets stepped on a thread of their own while the forward runs; host_tier:
    the state kept in the Pager's host tier. 20 steps."""
    options = dict(CASES[case])
    attach = options.pop("attach", {})
    setup = gpt.Setup(steps=20, **options)
    base = run(gpt, setup)
    with Pager(store_dir, "cuda", page_size=2 * MiB,
               host_budget=64 * MiB if host_tier else 0) as pager:
        model, optimizer, scheduler, binding = gpt.build(setup, pager, bucket_size=1 * MiB,
                                                         **attach)
        binding.overlap_forward(model, step_thread=step_thread)
        member_binding = binding.bindings[-1]  # a chain's earlier members complete as it starts
        losses = []
        for i in range(setup.steps):
            losses.append(gpt.train_step(setup, model, optimizer, scheduler, i))
            run_ = member_binding.step_in_flight
            assert run_ is not None and run_.stepped == 0, "left to the next forward"
            assert all(s.step_in_flight is None for s in binding.bindings[:-1])
        for s in binding.bindings:
            s.complete_step_in_flight()  # what the next forward would step
        gpt.finish(model)
        paged = (losses, [p.detach().cpu() for p in model.parameters()],
                 snapshot(optimizer, binding), None)
        if setup.overlap_grad_reduce:  # the first step's at least: none in flight before it
            assert binding.early.steps_begun >= 1, "a step's page-ins began in the backward"
        if host_tier:
            assert pager.stats()["bytes_to_host"] > 0 and pager.stats()["spilled_bytes"] == 0
    if attach.get("moments") == "q8":  # lossy by design: the same as q8 without overlap
        with Pager(store_dir + "-q8", "cuda", page_size=2 * MiB) as pager:
            base = run(gpt, setup, pager, bucket_size=1 * MiB, **attach)
    assert_same(base, paged, state_entries(optimizer))


@pytest.mark.parametrize("case, step_thread", [
    ("bf16-grads", False), ("fp32-grads-overlap", False), ("q8-residual-overlap", False),
    ("q8-residual-reduce-in-backward", False), ("q8-residual-overlap", True)])
def test_stationary_buckets_match_unpaged(gpt, case, step_thread, store_dir):
    """attach(stationary_bytes=...) (Note [Stationary buckets]): the first buckets stay
    mapped between steps and the steps after the first write none of their bytes; the
    training is bit-identical to unpaged Megatron (q8 moments: to the same pager without
    them), under the forward and with page-ins begun in the backward."""
    options = dict(CASES[case])
    attach = options.pop("attach", {})
    overlap = options.pop("overlap", False)
    setup = gpt.Setup(steps=6, **options)
    base = run(gpt, setup)
    if attach.get("moments") == "q8":
        with Pager(store_dir + "-q8", "cuda", page_size=2 * MiB) as pager:
            base = run(gpt, setup, pager, bucket_size=1 * MiB, **attach)
    # About half the first member's state: 12 bytes a parameter in fp32, 4 with q8 moments.
    stationary = (1 if attach.get("moments") == "q8" else 3) * MiB
    with Pager(store_dir, "cuda", page_size=2 * MiB) as pager:
        model, optimizer, scheduler, binding = gpt.build(
            setup, pager, bucket_size=1 * MiB, attach_options=dict(stationary_bytes=stationary),
            **attach)
        if overlap:
            binding.overlap_forward(model, step_thread=step_thread)
        first = binding.bindings[0]
        losses = [gpt.train_step(setup, model, optimizer, scheduler, 0)]
        stationary = first.buckets[:first._planner.stationary]
        assert stationary and len(stationary) < len(first.buckets)
        written = pager.stats()["bytes_written"]
        losses += [gpt.train_step(setup, model, optimizer, scheduler, i)
                   for i in range(1, setup.steps)]
        for s in binding.bindings:
            s.complete_step_in_flight()
        assert all(pager.is_resident(t) for b in stationary for t in b.stored)
        stored = sum(t.numel() * t.element_size() for s in binding.bindings
                     for b in s.buckets for t in b.stored)
        kept = sum(t.numel() * t.element_size() for b in stationary for t in b.stored)
        # Under the forward the first step's page-outs land after it returned.
        steps = setup.steps if overlap else setup.steps - 1
        assert pager.stats()["bytes_written"] - written == steps * (stored - kept)
        gpt.finish(model)
        paged = (losses, [p.detach().cpu() for p in model.parameters()],
                 snapshot(optimizer, binding), None)
    assert_same(base, paged, state_entries(optimizer))


@needs_emerging
def test_stationary_buckets_refuse_a_chain(gpt, store_dir):
    """A chain's members (Muon's layer-wise chain: Muon and Adam; at one rank, the MoE
    optimizer is a chain of one) step one after another, each beside the others'
    stationary buckets, which no window counts: refused at attach, before anything
    changes."""
    setup = gpt.Setup(steps=1, **CASES["muon-layer-wise"])
    with Pager(store_dir, "cuda", page_size=2 * MiB) as pager:
        with pytest.raises(_C.UsageError, match="single member"):
            gpt.build(setup, pager, bucket_size=1 * MiB,
                      attach_options=dict(stationary_bytes=1 * MiB))
        assert pager.bindings == ()


@pytest.mark.parametrize("case", ["bf16-grads", "fp32-grads-overlap"])
def test_a_step_stopped_before_the_inner_step_writes_nothing(gpt, case, store_dir):
    """The streamed step begins once the grads are ready (its page-ins overlap the grad
    norm); Megatron's step stopped between then and the inner step (here the grad norm
    raises; a skipped step returns there) ends it, its pages dropped unwritten, and
    training on matches unpaged Megatron bit for bit."""
    setup = gpt.Setup(steps=5, **CASES[case])
    base = run(gpt, setup)
    with Pager(store_dir, "cuda", page_size=2 * MiB) as pager:
        model, optimizer, scheduler, binding = gpt.build(setup, pager, bucket_size=1 * MiB)
        losses = [gpt.train_step(setup, model, optimizer, scheduler, i) for i in range(3)]

        def failing():
            raise RuntimeError("injected grad norm failure")

        optimizer.get_grad_norm = failing
        before = pager.stats()
        with pytest.raises(RuntimeError, match="injected grad norm failure"):
            gpt.train_step(setup, model, optimizer, scheduler, 3)
        del optimizer.get_grad_norm
        after = pager.stats()
        assert after["bytes_read"] > before["bytes_read"]  # it had begun
        assert after["bytes_written"] == before["bytes_written"]
        assert all(pager.residency(t) == "file" for s in binding.bindings for b in s.buckets
                   for t in b.stored)
        losses += [gpt.train_step(setup, model, optimizer, scheduler, i)
                   for i in range(3, setup.steps)]
        gpt.finish(model)
        paged = (losses, [p.detach().cpu() for p in model.parameters()],
                 snapshot(optimizer, binding), None)
    assert_same(base, paged)


def test_refusals_name_what_to_use_instead(gpt, store_dir):
    setup = gpt.Setup(steps=1)
    with Pager(store_dir, "cuda") as pager:
        model, optimizer, scheduler, _ = gpt.build(setup, pager)
        gpt.train_step(setup, model, optimizer, scheduler, 0)
        with pytest.raises(_C.UsageError, match="pause"):
            optimizer.offload_to_cpu()
        assert "optimizer" in members(optimizer)[0].state_dict()  # served, no state read
        with pytest.raises(_C.UsageError, match="sets the mains directly, behind the pager"):
            members(optimizer)[0].load_parameter_state_from_dp_zero_legacy({})


@needs_emerging
@pytest.mark.parametrize("case", ["muon-layer-wise", "muon"])
def test_muon_steps_whole_matrices_larger_than_a_bucket(gpt, store_dir, case):
    """Newton-Schulz needs each matrix whole: with buckets smaller than the matrices, each
    of Muon's matrices larger than a bucket is a bucket of its own, never chunks, while
    Adam's large params (the embedding) step in chunks (of its flat shards, or of whole
    shaped mains in the non-distributed chain); the run matches unpaged Megatron bit for
    bit."""
    options = dict(CASES[case])
    attach = options.pop("attach", {})
    # An embedding of 4096 x 128: more than a chunk's least (slices.CHUNK_ALIGN elements).
    setup = gpt.Setup(steps=4, vocab=4096, **options)
    base = run(gpt, setup)
    with Pager(store_dir, "cuda", page_size=2 * MiB) as pager:
        paged = run(gpt, setup, pager, bucket_size=128 * 1024, **attach)
        member_bindings = {type(s.optimizer).__name__: s for s in paged[3][2].bindings}
        muon, adam = member_bindings["TensorParallelMuon"], member_bindings["AdamW"]
        assert all(not b.chunks for b in muon.buckets)
        big = [b for b in muon.buckets
               if any(p.numel() * 8 > 128 * 1024 for p in b.params)]
        assert big and all(len(b.params) == 1 for b in big)
        assert any(b.chunks for b in adam.buckets)
    assert_same(base, paged, state_entries(paged[3][1]))


@needs_emerging
def test_muon_window_is_checked_against_the_budget_at_attach(gpt, store_dir):
    """A matrix larger than bucket_size is a bucket of its own: attach names the window it
    needs when hbm_budget cannot hold it, before any step."""
    setup = gpt.Setup(steps=1, layers=1, hidden=1024, heads=8, ddp_bucket=4_000_000,
                      **CASES["muon-layer-wise"])
    model, optimizer, _, _ = gpt.build(setup)  # its mains move into the pager at attach
    mains = [p.main_param for p in model.parameters() if hasattr(p, "main_param")]
    groups = [list(g["params"]) for g in optimizer.param_groups]
    with Pager(store_dir, "cuda", page_size=2 * MiB, hbm_budget=24 * MiB) as pager:
        with pytest.raises(_C.UsageError, match="hbm_budget 24 MiB cannot hold the step"):
            pager.attach(optimizer, bucket_size=4 * MiB)
        assert pager.bindings == ()
        # Every member's mains are Megatron's own again, none in the pager.
        assert all(p.main_param is m for p, m in zip(
            [p for p in model.parameters() if hasattr(p, "main_param")], mains))
        assert all(a is b for g, before in zip(optimizer.param_groups, groups)
                   for a, b in zip(g["params"], before))
        assert not any(pager.owns(m) for m in mains)


@needs_emerging
@pytest.mark.parametrize("optimizer, match", [
    ("adaptive_muon", "TensorParallelAdaptiveMuon: its step fails"),
    ("soap", "SOAP: SOAP replaces its state tensors"),
    ("lion", "Lion: statepager has not been checked against it"),
])
def test_optimizers_not_checked_are_refused_by_name(gpt, store_dir, optimizer, match):
    setup = gpt.Setup(steps=1, optimizer=optimizer, distributed=False)
    with Pager(store_dir, "cuda") as pager:
        with pytest.raises(_C.UsageError, match=match):
            gpt.build(setup, pager, attach_options=dict(atomic="step"))
        assert pager.bindings == ()


@needs_emerging
def test_a_non_distributed_chain_refuses_resumable_steps_and_steps_under_the_forward(
        gpt, store_dir):
    """Its grad buffers are out of statepager's reach (a resumable step must finish before
    they are zeroed, and steps under the forward keep each member's unstepped grads in
    them); its state_dict() would read the state: each is refused with what to do
    instead."""
    setup = gpt.Setup(steps=1, **{k: v for k, v in CASES["muon"].items() if k != "attach"})
    with Pager(store_dir, "cuda") as pager:
        with pytest.raises(_C.UsageError, match="atomic='step'.*use_distributed_optimizer"):
            gpt.build(setup, pager)
        assert pager.bindings == ()
    with Pager(store_dir + "-step", "cuda") as pager:
        model, optimizer, scheduler, binding = gpt.build(
            setup, pager, attach_options=dict(atomic="step"))
        with pytest.raises(_C.UsageError, match="do not know theirs"):
            binding.overlap_forward(model)
        gpt.train_step(setup, model, optimizer, scheduler, 0)
        with pytest.raises(_C.UsageError, match=r"statepager\.checkpoint\.save\(pager"):
            members(optimizer)[0].state_dict()


def test_precision_aware_optimizer_is_refused(gpt, store_dir):
    from megatron.core.optimizer import OptimizerConfig

    setup = gpt.Setup(steps=1)
    model, optimizer, _, _ = gpt.build(setup)
    d = members(optimizer)[0]
    assert isinstance(d.config, OptimizerConfig)
    d.config = copy.copy(d.config)  # (replace() would run Megatron's own TE check)
    d.config.use_precision_aware_optimizer = True
    with Pager(store_dir, "cuda") as pager:
        with pytest.raises(_C.UsageError, match="precision-aware"):
            pager.attach(optimizer)


def test_construction_in_scope_stays_within_budget(gpt, store_dir, cuda_free, capsys):
    """Mains of a GPT larger than the budget, built in scope(): the pool never holds more
    than the budget plus the largest segment."""
    setup = gpt.Setup(layers=4, hidden=1024, heads=8, vocab=4096, ddp_bucket=4_000_000)
    budget = 48 * MiB
    with Pager(store_dir, "cuda", page_size=2 * MiB, hbm_budget=budget) as pager:
        before = cuda_free()
        model, optimizer, _, _ = gpt.build(setup, pager, attach=False)
        s = pager.stats()
        mains = [m for d in members(optimizer) for g in d.shard_fp32_from_float16_groups
                 for m in g]
        total = sum(m.numel() * 4 for m in mains)
        largest = max(m.numel() * 4 for m in mains)
        with capsys.disabled():
            print(f"\nMegatron GPT construction in scope(): {total / MiB:.0f} MiB of fp32 "
                  f"mains, budget {budget / MiB:.0f} MiB, pool peak "
                  f"{s['peak_mapped_bytes'] / MiB:.0f} MiB, largest segment "
                  f"{largest / MiB:.0f} MiB; driver free memory fell by "
                  f"{(before - cuda_free()) / MiB:.0f} MiB (model, grads, buffers included)")
        assert total > 4 * budget
        assert sum(pager.owns(m) for m in mains) == sum(m.numel() * 4 >= MiB for m in mains)
        assert s["peak_mapped_bytes"] <= budget + largest + 2 * pager.page_size


def test_peak_memory_of_a_step_with_and_without_the_pager(gpt, store_dir, capsys):
    setup = gpt.Setup(layers=4, hidden=1024, heads=8, vocab=4096, ddp_bucket=4_000_000,
                      steps=3)
    import gc

    peaks = {}
    for paged in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()  # what earlier tests left behind
        pager = Pager(store_dir, "cuda", page_size=2 * MiB, hbm_budget=512 * MiB) \
            if paged else None
        model, optimizer, scheduler, binding = gpt.build(setup, pager, bucket_size=16 * MiB)
        gpt.train_step(setup, model, optimizer, scheduler, 0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if pager:
            pager.reset_peak()
        base = torch.cuda.memory_allocated() - before
        gpt.train_step(setup, model, optimizer, scheduler, 1)
        torch.cuda.synchronize()
        pool = pager.stats()["peak_mapped_bytes"] if pager else 0
        peaks[paged] = (base, torch.cuda.max_memory_allocated() - before, pool)
        del model, optimizer, scheduler, binding
        if pager:
            pager.close()
    with capsys.disabled():
        for paged, (base, peak, pool) in peaks.items():
            print(f"\nstep peak HBM {'with' if paged else 'without'} the pager: torch allocator "
                  f"{peak / MiB:.0f} MiB (of which {base / MiB:.0f} MiB held between steps) + "
                  f"pool {pool / MiB:.0f} MiB = {(peak + pool) / MiB:.0f} MiB")
    assert sum(peaks[True][1:]) < peaks[False][1]


RUNNER = os.path.join(os.path.dirname(__file__), "megatron_run.py")


def run_job(mode, out, nproc=1, *extra):
    """megatron_run.py in its own process (torchrun for several GPUs); its output on
    failure."""
    import subprocess

    cmd = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--master-port=29533"] if nproc > 1 else [sys.executable]) + [RUNNER, mode, out, *extra]
    env = {**os.environ, "MASTER_PORT": "29534"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def check_resume(out, nproc):
    """fresh: N steps, save, M more; resume (a new process): load, the same M steps."""
    run_job("fresh", out, nproc)
    run_job("resume", out, nproc)
    from megatron_run import same  # noqa: E402  (tests/gpu is on sys.path under pytest)

    for rank in range(nproc):
        fresh = torch.load(os.path.join(out, f"fresh-rank{rank}.pt"), weights_only=False)
        resumed = torch.load(os.path.join(out, f"resume-rank{rank}.pt"), weights_only=False)
        at_save, at_load = fresh["at_checkpoint"], resumed["at_checkpoint"]
        assert same(at_save, at_load) == "", f"rank {rank} right after loading: " \
                                             f"{same(at_save, at_load)}"
        assert same(fresh, resumed) == "", f"rank {rank}: {same(fresh, resumed)}"


def test_resume_in_a_fresh_process_is_exact(tmp_path):
    check_resume(str(tmp_path), 1)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="needs 2 GPUs (the nvidia-h200-x2 machine)")


@two_gpus
@pytest.mark.parametrize("extra", [[], ["--overlap"], ["--overlap", "--overlap-forward"]],
                         ids=["dp2", "dp2-overlap", "dp2-overlap-forward"])
def test_data_parallel_parity_on_two_gpus(tmp_path, extra, capsys):
    stdout = run_job("parity", str(tmp_path), 2, *extra)
    with capsys.disabled():
        print("\n" + stdout.strip())
    assert stdout.count("identical") == 2


@two_gpus
def test_expert_parallel_chained_optimizer_parity_on_two_gpus(tmp_path, capsys):
    """EP=2: a ChainedOptimizer of a dense and an expert DistributedOptimizer."""
    stdout = run_job("parity", str(tmp_path), 2, "--experts", "4", "--expert-parallel", "2")
    with capsys.disabled():
        print("\n" + stdout.strip())
    assert stdout.count("['0-dense', '1-expert']") == 2 and stdout.count("identical") == 2


@two_gpus
def test_data_parallel_resume_on_two_gpus(tmp_path):
    check_resume(str(tmp_path), 2)
