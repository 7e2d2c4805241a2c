"""PyTorch's own optimizer test inputs through attach, bit for bit.

torch.testing._internal.common_optimizers.optim_db: every optimizer, every configuration
its optim_inputs_func gives on CPU, each with the implementations it supports there
(for-loop, foreach, fused, differentiable), stepped 5 times attached to a Pager (host
backend) and unattached, then compared bit for bit: parameters after every step, every
state entry (keys and their order, dtype, shape, strides, bits), param_groups and
state_dict(). Then the cases a training loop meets, for each implementation: a param group
added and one removed after attach, grads that are None, channels_last and transposed
parameters, bf16/fp64/complex parameters, StepLR created before and after attach, a
closure, sparse gradients, state_dict()/load_state_dict() round trips (also from the
unattached optimizer). A run the pager refuses must be refused at attach or at
add_param_group with a statepager.UsageError; a configuration torch itself fails on is
counted apart. Any other difference fails the test; the counts are printed at the end.
"""
from __future__ import annotations

import collections
import itertools
import warnings

import pytest
import torch

# torch's test inputs import expecttest (the '.[test]' extra; README, "The GPU machine",
# for a machine without an index): without it, this module skips and says so instead of
# stopping the whole run at collection.
pytest.importorskip("expecttest", reason="expecttest is not installed: pip install '.[test]'")
from torch.testing._internal.common_optimizers import (  # noqa: E402
    _get_optim_inputs_including_global_cliquey_kwargs,
    optim_db,
)

import statepager  # noqa: E402
from statepager import Pager  # noqa: E402

KiB = 1 << 10
STEPS = 5
IMPLS = ("foreach", "fused", "differentiable")

# optimizer -> outcome -> count; outcome "refused: <reason>", "torch fails: <error>".
COUNTS: dict = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module", autouse=True)
def print_counts(request):
    """The counts, in the terminal summary (tests/conftest.py prints config.summary_lines)."""
    yield
    if COUNTS:
        request.config.summary_lines = getattr(request.config, "summary_lines", []) + counts()


def counts() -> list[str]:
    lines = ["optim_db through attach (identical / refused / torch fails / differing):"]
    totals = collections.Counter()
    for name, c in COUNTS.items():
        kinds = collections.Counter()
        for outcome, n in c.items():
            kinds[outcome.split(":")[0]] += n
        totals.update(kinds)
        lines.append(f"  {name:10s} {kinds['identical']:4d} / {kinds['refused']:3d} / "
                     f"{kinds['torch fails']:3d} / {kinds['differing']:3d}")
    lines.append(f"  {'total':10s} {totals['identical']:4d} / {totals['refused']:3d} / "
                 f"{totals['torch fails']:3d} / {totals['differing']:3d}")
    reasons = collections.Counter()
    for c in COUNTS.values():
        for outcome, n in c.items():
            if not outcome.startswith("identical"):
                reasons[outcome] += n
    for outcome, n in sorted(reasons.items()):
        lines.append(f"    {n:4d} x {outcome}")
    return lines


# -- parameters and gradients -----------------------------------------------------------

def make_params(info, layout: str = "plain", dtype=torch.float32) -> list[list]:
    """Leaf parameters in two groups, from a fixed seed. Muon takes 2-D parameters only."""
    gen = torch.Generator().manual_seed(7)

    def param(*shape, fmt=None, transpose=False):
        t = torch.randn(*shape, generator=gen, dtype=torch.float64)
        t = t.to(dtype) if not dtype.is_complex else torch.complex(t, t.flip(-1)).to(dtype)
        if transpose:
            t = t.t()  # a transposed view: strides (1, n)
        if fmt is not None:
            t = t.contiguous(memory_format=fmt)
        return torch.nn.Parameter(t)

    two_d = info.optim_cls is torch.optim.Muon
    if layout == "plain":
        first = [param(5, 4)] + ([] if two_d else [param(5)])
        second = [param(3, 5)] + ([] if two_d else [param(3)])
    elif layout == "strided":
        first = [param(4, 5, transpose=True)]
        second = [param(3, 4)] + ([] if two_d else [param(2, 3, 2, 2, fmt=torch.channels_last)])
    elif layout == "embedding":  # one 2-D parameter per group, for sparse gradients
        first, second = [param(10, 3)], [param(6, 3)]
    else:
        raise ValueError(layout)
    return [first, second]


def set_grads(groups, step: int, none=lambda i, step: False, sparse=False) -> None:
    """Gradients from (step, parameter index) alone, in each parameter's memory layout."""
    for i, p in enumerate(itertools.chain.from_iterable(groups)):
        if none(i, step):
            p.grad = None
            continue
        gen = torch.Generator().manual_seed(1000 * step + i)
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        g = g.to(p.dtype) if not p.dtype.is_complex else torch.complex(g, -g).to(p.dtype)
        if sparse:  # rows 1 and 3 (and the last) get gradients, as an embedding's would
            rows = torch.tensor([1, 3, p.shape[0] - 1])
            p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), g[rows], p.shape).coalesce()
        else:
            p.grad = torch.empty_like(p).copy_(g)


# -- a run, attached or not -------------------------------------------------------------

class Refused(Exception):
    """The pager refused the run where it may: at attach or at add_param_group."""


class TorchFails(Exception):
    """torch's own optimizer fails on this run (not a case torch supports)."""


class Run:
    """One optimizer over its parameters, attached to a Pager (pager_dir) or not."""

    def __init__(self, info, kwargs, groups, pager_dir=None, before_attach=None):
        if kwargs.get("differentiable"):
            # torch steps these in the autograd graph: non-leaf parameters only.
            groups = [[p.clone() for p in g] for g in groups]
        self.groups = groups
        specs = [{"params": groups[0]}, {"params": groups[1]}]
        if not info.supports_param_groups:  # LBFGS
            specs = [{"params": groups[0] + groups[1]}]
        self.opt = info.optim_cls(specs, **kwargs)
        if isinstance(self.opt.param_groups[-1]["lr"], float):
            self.opt.param_groups[-1]["lr"] *= 0.5  # the groups differ
        if before_attach:
            before_attach(self.opt)
        self.pager = None
        if pager_dir is not None:
            self.pager = Pager(pager_dir, page_size=64 * KiB, io_depth=4, io_block=64 * KiB)
            # 256-byte buckets: most parameters a bucket of their own, some shared
            # across the two groups.
            self.attach(lambda: self.pager.attach(self.opt, bucket_size=256, depth=3))

    def attach(self, fn):
        try:
            return fn()
        except statepager.UsageError as e:
            raise Refused(str(e).split(":")[0]) from e

    def add_param_group(self, group: dict) -> None:
        self.attach(lambda: self.opt.add_param_group(group))

    def close(self):
        if self.pager is not None:
            self.pager.close()

    def params(self):
        return [p for g in self.groups for p in g]

    def live_state(self) -> list:
        """opt.state as it is (copies), paged tensors read through the pager."""
        index = {id(p): i for i, p in enumerate(self.params())}
        out = []
        for p, st in self.opt.state.items():
            entries = []
            for name, v in st.items():
                paged = self.pager is not None and self.pager.owns(v)
                if paged:
                    self.pager.page_in(v)
                if isinstance(v, torch.Tensor):
                    v = v.detach().clone(memory_format=torch.preserve_format)
                if paged:
                    self.pager.page_out(self.opt.state[p][name])
                entries.append((name, v))
            out.append((index[id(p)], entries))
        return out


def snapshot(run: Run) -> dict:
    """What must be identical: parameters, live state, param_groups, state_dict()."""
    snap = {"params": [p.detach().clone(memory_format=torch.preserve_format)
                       for p in run.params()],
            "state": run.live_state(),
            "groups": [{k: v for k, v in g.items() if k != "params"}
                       for g in run.opt.param_groups]}
    try:
        snap["state_dict"] = detached(run.opt.state_dict())
    except KeyError as e:  # torch's own, for state of parameters no longer in a group
        snap["state_dict"] = f"KeyError {e}"
    return snap


def detached(v):
    """A copy of a state dict (deepcopy refuses tensors in an autograd graph)."""
    if isinstance(v, torch.Tensor):
        return v.detach().clone(memory_format=torch.preserve_format)
    if isinstance(v, dict):
        return {k: detached(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(detached(x) for x in v)
    return v


def differences(a, b, where="") -> list[str]:
    """Bit-level differences between two snapshots (nested dicts, lists, tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        meta = [(x.dtype, x.shape, x.stride(), x.device, x.layout) for x in (a, b)]
        if meta[0] != meta[1]:
            return [f"{where}: {meta[0]} vs {meta[1]}"]
        if a.layout != torch.strided:
            a, b = a.coalesce(), b.coalesce()
            return (differences(a.indices(), b.indices(), where + ".indices")
                    + differences(a.values(), b.values(), where + ".values"))
        if not torch.equal(_bits(a), _bits(b)):
            n = int((_bits(a) != _bits(b)).sum())
            return [f"{where}: {n} bytes of {a.numel() * a.element_size()} differ"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} vs {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{where}: {a!r:.80} vs {b!r:.80}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r:.80} vs {b!r:.80}"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def compare(info, name, kwargs, scenario, tmp_path) -> str:
    """Runs `scenario` unattached, then attached; records and returns the outcome. The
    scenario gets make(groups, **Run kwargs) -> Run, info, and a dict shared by the runs."""
    shared = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ref = scenario(lambda groups, **kw: Run(info, kwargs, groups, **kw), info, shared)
        except Exception as e:  # noqa: BLE001  (torch's own failure: not a supported case)
            outcome = f"torch fails: {type(e).__name__}: {str(e)[:70]}"
            COUNTS[info.name][outcome] += 1
            return outcome
        runs = []

        def attached(groups, **kw):
            runs.append(Run(info, kwargs, groups, pager_dir=str(tmp_path / f"p{len(runs)}"),
                            **kw))
            return runs[-1]

        try:
            got = scenario(attached, info, shared)
        except Refused as e:
            outcome = f"refused: {e}"
        except Exception as e:  # noqa: BLE001  (counted, printed, and fails the test)
            outcome = f"differing: {name} raised {type(e).__name__}: {str(e)[:200]}"
            print(f"{info.name} {name} {kwargs}: {outcome}")
        else:
            diffs = differences(ref, got)
            outcome = "identical" if not diffs else f"differing: {name}"
            if diffs:
                print(f"{info.name} {name} {kwargs}: {diffs[:5]}")
        finally:
            for r in runs:
                r.close()
    COUNTS[info.name][outcome] += 1
    return outcome


# -- scenarios: each takes make(groups, **Run kwargs) -> Run and returns snapshots -------

def plain(make, info, shared=None, *, layout="plain", dtype=torch.float32, none=None,
          closure=False):
    closure = closure or info.step_requires_closure  # LBFGS
    run = make(make_params(info, layout, dtype))
    snaps = []
    for k in range(STEPS):
        if closure:
            def loss_fn(k=k):
                run.opt.zero_grad()
                loss = sum((p.abs() ** 2).sum() * (i + 1) for i, p in enumerate(run.params()))
                loss.backward()
                return loss.detach()
            snaps.append(run.opt.step(loss_fn))
        else:
            set_grads(run.groups, k, none or (lambda i, step: False))
            run.opt.step()
        snaps.append([p.detach().clone() for p in run.params()])
    return snaps + [snapshot(run)]


def grads_none(make, info, shared):
    """Some parameters without a gradient some steps; the last one never has one."""
    n = sum(len(g) for g in make_params(info))
    return plain(make, info, none=lambda i, step: i == n - 1 or (i + step) % 3 == 0)


def added_group(make, info, shared):
    """Two steps, then a param group added after attach, then three more steps."""
    run = make(make_params(info))
    snaps = []
    extra = [torch.nn.Parameter(torch.linspace(-1, 1, 12).view(3, 4))]
    if info.optim_cls is not torch.optim.Muon:
        extra.append(torch.nn.Parameter(torch.linspace(2, 3, 7)))
    for k in range(STEPS):
        if k == 2:
            run.add_param_group({"params": extra})
            run.groups.append(extra)
        set_grads(run.groups, k)
        run.opt.step()
        snaps.append([p.detach().clone() for p in run.params()])
    return snaps + [snapshot(run)]


def removed_group(make, info, shared):
    """Two steps, then param group 1 removed, three more steps, then group 1 added back."""
    run = make(make_params(info))
    snaps = []
    removed = None
    for k in range(STEPS + 1):
        if k == 2:
            removed = run.opt.param_groups.pop(1)
        if k == STEPS:
            run.opt.param_groups.append(removed)
        set_grads(run.groups, k)
        run.opt.step()
        snaps.append([p.detach().clone() for p in run.params()])
    return snaps + [snapshot(run)]


def with_scheduler(make, info, shared, *, before: bool):
    """StepLR created before attach (it wraps opt.step, which attach replaces) or after."""
    box = {}

    def schedule(opt):
        box["sched"] = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    run = make(make_params(info), before_attach=schedule if before else None)
    if not before:
        schedule(run.opt)
    snaps = []
    for k in range(STEPS):
        set_grads(run.groups, k)
        run.opt.step()
        box["sched"].step()
        snaps.append([p.detach().clone() for p in run.params()] + [box["sched"].get_last_lr()])
    return snaps + [snapshot(run)]


def sparse_grads(make, info, shared):
    run = make(make_params(info, "embedding"))
    snaps = []
    for k in range(STEPS):
        set_grads(run.groups, k, sparse=True)
        run.opt.step()
        snaps.append([p.detach().clone() for p in run.params()])
    return snaps + [snapshot(run)]


def state_dict_round_trips(make, info, shared):
    """Three steps; load_state_dict(state_dict()) (a no-op); a fresh optimizer over
    copies of the parameters loads the state dict the unattached run had then; two more
    steps on both."""
    run = make(make_params(info))
    for k in range(3):
        set_grads(run.groups, k)
        run.opt.step()
    sd = run.opt.state_dict()
    shared.setdefault("sd", detached(sd))  # the unattached run's, which runs first
    run.opt.load_state_dict(sd)
    copies = [[torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format))
               for p in g] for g in run.groups]
    fresh = make(copies)
    fresh.opt.load_state_dict(detached(shared["sd"]))
    snaps = []
    for r in (run, fresh):
        for k in range(3, STEPS):
            set_grads(r.groups, k)
            r.opt.step()
        snaps.append([p.detach().clone() for p in r.params()])
        snaps.append(snapshot(r))
    return snaps


SCENARIOS = {
    "grads None": grads_none,
    "group added": added_group,
    "group removed": removed_group,
    "strided": lambda make, info, shared: plain(make, info, layout="strided"),
    "bf16": lambda make, info, shared: plain(make, info, dtype=torch.bfloat16),
    "fp64": lambda make, info, shared: plain(make, info, dtype=torch.float64),
    "complex64": lambda make, info, shared: plain(make, info, dtype=torch.complex64),
    "StepLR before": lambda make, info, shared: with_scheduler(make, info, shared, before=True),
    "StepLR after": lambda make, info, shared: with_scheduler(make, info, shared, before=False),
    "closure": lambda make, info, shared: plain(make, info, closure=True),
    "state_dict": state_dict_round_trips,
}


# -- what optim_db gives ----------------------------------------------------------------

def impls(info) -> list[str]:
    """The implementations info supports on CPU: for-loop first."""
    out = ["forloop"]
    for impl in IMPLS:
        if impl in info.supported_impls and (impl != "fused" or "cpu" in info.supports_fused_on):
            out.append(impl)
    return out


def configs(info) -> list[tuple[str, dict]]:
    """(description, kwargs) of every CPU configuration with each implementation.
    torch's helper leaves foreach out on CPU (no foreach kernels there); torch runs it
    with its per-tensor fallback, so it is added here."""
    out = [(o.desc, o.kwargs) for o in
           _get_optim_inputs_including_global_cliquey_kwargs("cpu", torch.float32, info)]
    if "foreach" in info.supported_impls:
        for o in info.optim_inputs_func(device="cpu"):
            flags = {impl: False for impl in impls(info)[1:]}
            out.append((f"{o.desc} & foreach", {**o.kwargs, **flags, "foreach": True}))
    return out


def impl_kwargs(info, impl: str) -> dict:
    flags = {f: False for f in impls(info)[1:]}
    if impl != "forloop":
        flags[impl] = True
    return flags


DENSE = [i for i in optim_db if not i.only_supports_sparse_grads]
SPARSE = [i for i in optim_db if i.supports_sparse or i.only_supports_sparse_grads]


@pytest.mark.parametrize("info", DENSE, ids=lambda i: i.name)
def test_optim_db_configs(info, tmp_path):
    outcomes = [compare(info, desc, kwargs, plain, tmp_path / f"c{i}")
                for i, (desc, kwargs) in enumerate(configs(info))]
    assert outcomes and not [o for o in outcomes if o.startswith("differing")], outcomes


@pytest.mark.parametrize("info", [i for i in DENSE if not i.step_requires_closure],
                         ids=lambda i: i.name)  # LBFGS: refused at attach (counted above)
def test_optim_db_training_loop_cases(info, tmp_path):
    base = info.optim_inputs_func(device="cpu")[0].kwargs  # the "default" configuration
    outcomes = []
    for impl in impls(info):
        if impl == "differentiable":
            continue  # refused at attach (test_optim_db_configs counts it)
        for name, scenario in SCENARIOS.items():
            if name == "complex64" and not info.supports_complex:
                continue
            d = tmp_path / f"{impl}-{name.replace(' ', '_')}"
            outcomes.append(compare(info, f"{impl} {name}", {**base, **impl_kwargs(info, impl)},
                                    scenario, d))
    assert outcomes and not [o for o in outcomes if o.startswith("differing")], outcomes


@pytest.mark.parametrize("info", SPARSE, ids=lambda i: i.name)
def test_optim_db_sparse_gradients(info, tmp_path):
    kwargs, _ = info.metadata_for_sparse
    runs = [kwargs] + ([{**kwargs, "momentum": 0.9}] if info.optim_cls is torch.optim.SGD else [])
    outcomes = [compare(info, f"sparse {kw}", kw, sparse_grads, tmp_path / f"s{i}")
                for i, kw in enumerate(runs)]
    assert outcomes and not [o for o in outcomes if o.startswith("differing")], outcomes
