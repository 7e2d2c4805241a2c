"""load_state_dict() of an attached optimizer: all or nothing, refused at once on a paused
Pager, and refused for a parameter whose state is not whole.

A load that fails, before or after torch's part replaced the optimizer's state, leaves
it as it was: the same state and param_groups objects, the same tensors with the same
bytes, the same step counters; the optimizer then steps exactly as one that never saw
the load."""
import contextlib
import copy
import os

import pytest
import torch

import statepager
from statepager import Pager

from filler import fill

KiB = 1 << 10


# -- jobs and what a load may change ---------------------------------------------------

def make_model(seed=0, width=64):
    """Two Linear layers of the same shape: biases (and weights) that share a shape."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, width), torch.nn.GELU(),
                               torch.nn.Linear(width, width), torch.nn.GELU(),
                               torch.nn.Linear(width, width), torch.nn.Linear(width, 5))


def groups(model):
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def job(store, seed=0, moments="fp32", width=64, atomic=True, bucket=16 * KiB):
    model = make_model(seed, width)
    opt = torch.optim.AdamW(groups(model), lr=1e-3)
    pager = Pager(store, page_size=64 * KiB)
    pager.attach(opt, bucket_size=bucket, moments=moments, atomic=atomic)
    return model, opt, pager


def train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 24, generator=gen)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def loadable(steps=3, seed=7, transposed=False) -> dict:
    """A torch state dict of an unattached AdamW over another model of the same shapes;
    transposed: the 2-D moments laid out transposed (the load makes new pager tensors
    for them, the others are loaded in place)."""
    model = make_model(seed)
    opt = torch.optim.AdamW(groups(model), lr=5e-4)
    train(model, opt, steps, seed=seed)
    sd = copy.deepcopy(opt.state_dict())
    if transposed:
        for st in sd["state"].values():
            for k, v in st.items():
                if k != "step" and v.dim() == 2:
                    st[k] = v.t().contiguous().t()
    return sd


def raw(v):
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.shape, v.detach().reshape(-1).view(torch.uint8).clone())
    if isinstance(v, dict):
        return {k: raw(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(raw(x) for x in v)
    return v


def same(a, b) -> bool:
    if isinstance(a, tuple) and len(a) == 3 and isinstance(a[2], torch.Tensor):
        return isinstance(b, tuple) and a[:2] == b[:2] and torch.equal(a[2], b[2])
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def live_objects(opt) -> dict:
    """The objects a load may replace: state, param_groups, each state entry (as held:
    dict.items reads no entry, which would page it in)."""
    return {"state": id(opt.state), "groups": id(opt.param_groups),
            "group_objects": [id(g) for g in opt.param_groups],
            "entries": {id(p): {k: id(v) for k, v in dict.items(st)}
                        for p, st in dict.items(opt.state)}}


def live(opt) -> dict:
    """Everything a load may change: live_objects, and every value, read through the
    binding (state_dict(): the paged state decoded)."""
    return {**live_objects(opt), "values": raw(opt.state_dict())}


def unchanged(before, after) -> bool:
    return {k: v for k, v in before.items() if k != "values"} == \
        {k: v for k, v in after.items() if k != "values"} and same(before["values"],
                                                                   after["values"])


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def steps_as_reference(model, opt, store, stepped, moments="fp32", **kw):
    """The optimizer steps exactly as one of the same job that never saw the load."""
    ref_model, ref_opt, ref_pager = job(store, moments=moments, **kw)
    try:
        train(ref_model, ref_opt, stepped)
        train(model, opt, 2, seed=5)
        train(ref_model, ref_opt, 2, seed=5)
        return all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(ref_model)))
    finally:
        ref_pager.close()


# -- a load that fails midway ------------------------------------------------------------

class Failure:
    """Makes one call of the load raise NoSpaceError (where: see FAILURES)."""

    def __init__(self, monkeypatch, opt, pager, where):
        self.calls = 0
        if where == "making a pager tensor":
            self._wrap(monkeypatch, pager.bindings[0], "empty_state_like", fail_at=2)
        elif where == "a page-out midway":
            # 1: the epoch's page-out of what is resident; 2, 3, ...: each bucket's.
            self._wrap(monkeypatch, pager, "page_out_async", fail_at=3)
        else:  # after torch's own load replaced the optimizer's state and param_groups
            original = torch.optim.Optimizer.load_state_dict

            def replaced_then_failed(optimizer, sd):
                original(optimizer, sd)
                raise statepager.NoSpaceError("injected after torch's load")
            monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", replaced_then_failed)

    def _wrap(self, monkeypatch, obj, name, fail_at):
        original = getattr(obj, name)

        def failing(*args, **kwargs):
            self.calls += 1
            if self.calls == fail_at:
                raise statepager.NoSpaceError(f"injected into {name}")
            return original(*args, **kwargs)
        monkeypatch.setattr(obj, name, failing)


FAILURES = ["making a pager tensor", "torch's part", "a page-out midway"]


@pytest.mark.parametrize("moments", ["fp32", "q8"])
@pytest.mark.parametrize("where", FAILURES)
def test_a_load_state_dict_failing_midway_leaves_the_optimizer(tmp_path, monkeypatch,
                                                                where, moments):
    """Into an optimizer with state: the 2-D moments get new pager tensors (their layout
    differs), the others are copied into in place, bucket by bucket."""
    model, opt, pager = job(str(tmp_path / "s"), moments=moments)
    try:
        train(model, opt, 2)
        sd = loadable(transposed=True)
        before = live(opt)
        with monkeypatch.context() as m:
            Failure(m, opt, pager, where)
            with pytest.raises(statepager.NoSpaceError, match="injected"):
                opt.load_state_dict(sd)
        assert unchanged(before, live(opt))
        assert steps_as_reference(model, opt, str(tmp_path / "ref"), 2, moments)
        opt.load_state_dict(sd)  # and the same load, retried, succeeds
        assert opt.param_groups[0]["lr"] == 5e-4
    finally:
        pager.close()


@pytest.mark.parametrize("where", FAILURES)
def test_a_failed_load_state_dict_into_a_fresh_optimizer_leaves_it_without_state(
        tmp_path, monkeypatch, where):
    model, opt, pager = job(str(tmp_path / "s"))
    try:
        before = live(opt)
        with monkeypatch.context() as m:
            Failure(m, opt, pager, where)
            with pytest.raises(statepager.NoSpaceError, match="injected"):
                opt.load_state_dict(loadable())
        assert unchanged(before, live(opt)) and len(opt.state) == 0
        assert steps_as_reference(model, opt, str(tmp_path / "ref"), 0)
    finally:
        pager.close()


@pytest.mark.parametrize("target", ["fresh", "stepped"])
def test_load_state_dict_on_a_full_filesystem_leaves_the_optimizer(tmp_path, sized_tmpfs,
                                                                    target):
    """ENOSPC while the load writes the new state into the store: the store is on a small
    tmpfs, filled until half of it fits. Into a fresh optimizer (new pager tensors) and
    into one with state (not atomic: its steps write in place, so the load's own
    copy-on-write needs the room)."""
    mnt = sized_tmpfs(24, "load_state_dict on a full filesystem")
    width = 384  # about 2.4 MB of moments
    kw = {"width": width, "atomic": target == "fresh", "bucket": 256 * KiB}
    model, opt, pager = job(os.path.join(mnt, "store"), **kw)
    try:
        stepped = 2 if target == "stepped" else 0
        train(model, opt, stepped)
        other_model, other, other_pager = job(str(tmp_path / "src2"), seed=3, **kw)
        train(other_model, other, 3, seed=4)
        sd = copy.deepcopy(other.state_dict())
        other_pager.close()
        nbytes = sum(v.numel() * 4 for st in sd["state"].values() for k, v in st.items()
                     if k != "step")
        before = live(opt)
        filler = fill(mnt, nbytes // 2)
        with pytest.raises(statepager.NoSpaceError):
            opt.load_state_dict(sd)
        os.remove(filler)
        assert unchanged(before, live(opt))
        assert steps_as_reference(model, opt, str(tmp_path / "ref"), stepped, **kw)
    finally:
        pager.close()


# -- refused before anything changes ------------------------------------------------------

def test_load_state_dict_on_a_paused_pager_is_refused_before_anything_changes(tmp_path):
    model, opt, pager = job(str(tmp_path / "s"))
    try:
        train(model, opt, 2)
        sd = loadable()
        objects, values = live_objects(opt), live(opt)["values"]
        pager.pause()
        with pytest.raises(statepager.UsageError, match="this Pager is paused: call resume"):
            opt.load_state_dict(sd)
        assert live_objects(opt) == objects
        assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-3]
        pager.resume()
        assert same(live(opt)["values"], values)
        assert steps_as_reference(model, opt, str(tmp_path / "ref"), 2)
    finally:
        pager.close()


# -- a parameter's state must be whole -------------------------------------------------

def drop(sd, key, name):
    sd = copy.deepcopy(sd)
    del sd["state"][key][name]
    return sd


@pytest.mark.parametrize("key,name,why", [
    (1, "exp_avg_sq", "the other parameters of shape \\[64, 64\\] in its param group hold"),
    (0, "exp_avg_sq", "AdamW keeps for every parameter"),   # the only one of its shape
    (0, "step", "parameter 1 of its param group holds"),
    (5, "exp_avg", "the other parameters of shape \\[64\\] in its param group hold"),
])
def test_load_state_dict_of_a_parameter_with_part_of_its_state_is_refused(
        tmp_path, key, name, why):
    """torch's own load takes a state dict without a moment (its next step fails) and
    refuses one without a step counter only after it replaced the optimizer's state (a
    KeyError of Adam.__setstate__): refused here, naming the parameter, changing nothing."""
    sd = drop(loadable(), key, name)
    plain = torch.optim.AdamW(groups(make_model()), lr=1e-3)
    with pytest.raises(KeyError) if name == "step" else contextlib.nullcontext():
        plain.load_state_dict(copy.deepcopy(sd))
    model, opt, pager = job(str(tmp_path / "s"))
    try:
        train(model, opt, 2)
        before = live(opt)
        with pytest.raises(statepager.UsageError, match=f"parameter {key} of param group "
                           f"[01] has the state entries .*without \\['{name}'\\], which {why}"):
            opt.load_state_dict(sd)
        assert unchanged(before, live(opt))
    finally:
        pager.close()


def test_load_state_dict_refuses_part_of_a_state_under_other_optimizers(tmp_path):
    """The rule of statepager.core.whole_state, not Adam's names: RMSprop (centered, with
    momentum) keeps square_avg, momentum_buffer and grad_avg for every parameter."""
    def make(model):
        return torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9, centered=True)
    src = make_model(seed=7)
    src_opt = make(src)
    train(src, src_opt, 2)
    sd = drop(src_opt.state_dict(), 2, "grad_avg")  # parameter 2: [64, 64], as 4
    model = make_model()
    opt = make(model)
    with Pager(str(tmp_path / "s"), page_size=64 * KiB) as pager:
        pager.attach(opt, bucket_size=16 * KiB)
        with pytest.raises(statepager.UsageError, match="parameter 2 of param group 0 .*"
                           "without \\['grad_avg'\\]"):
            opt.load_state_dict(sd)
        assert len(opt.state) == 0


def test_load_state_dict_takes_what_torch_takes_a_parameter_without_state(tmp_path):
    """A parameter with no state in the state dict starts fresh, as under torch: the
    attached optimizer then steps exactly as an unattached one that loaded the same."""
    sd = loadable()
    sd["state"][3] = {}
    del sd["state"][4]
    ref_model = make_model()
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-3)
    ref.load_state_dict(copy.deepcopy(sd))
    model, opt, pager = job(str(tmp_path / "s"))
    try:
        train(model, opt, 1)  # state of its own for every parameter, to be replaced
        with torch.no_grad():
            for a, b in zip(ref_model.parameters(), model.parameters()):
                b.copy_(a)
        opt.load_state_dict(sd)
        params = [p for g in opt.param_groups for p in g["params"]]  # the state dict's order
        assert not dict.get(opt.state, params[3]) and not dict.get(opt.state, params[4])
        train(model, opt, 2, seed=5)
        train(ref_model, ref, 2, seed=5)
        assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(ref_model)))
    finally:
        pager.close()
