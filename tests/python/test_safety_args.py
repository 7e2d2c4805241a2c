"""Arguments of the public API are checked at its edge, before anything changes: a value
of the wrong type is refused with a UsageError naming the argument and what it must be,
never taken for what its truthiness or str() says, and never reaching pybind or the
core as a signature dump, a TypeError or an AttributeError."""
import gc
import os
import pathlib

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import Pager, PagedAdamW

KiB, MiB = 1 << 10, 1 << 20


def tree(path) -> list:
    """Every path under `path`, relative to it (what a refused call must leave as it was)."""
    out = []
    for root, dirs, files in os.walk(path):
        out += [os.path.relpath(os.path.join(root, n), path) for n in dirs + files]
    return sorted(out)


# -- the store directory ---------------------------------------------------------------

@pytest.mark.parametrize("directory, match", [
    (None, r"directory must be a str or os.PathLike path, not NoneType None"),
    (123, r"directory must be a str or os.PathLike path, not int 123"),
    (["a"], r"directory must be a str or os.PathLike path, not list"),
    ("", r"directory must not be empty"),
    ("store\0tail", r"directory .* holds a NUL character"),
    (b"store\0tail", r"directory .* holds a NUL character"),
])
def test_a_directory_that_is_no_path_is_refused_and_nothing_is_created(tmp_path, monkeypatch,
                                                                       directory, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(statepager.UsageError, match=match):
        Pager(directory)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("device", [0, None, "tpu"])
def test_a_device_is_a_torch_device_or_its_name(tmp_path, monkeypatch, device):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(statepager.UsageError, match=r"device must be a torch.device or its name"):
        Pager("store", device=device)
    assert os.listdir(tmp_path) == []


def test_bytes_and_pathlike_directories_are_paths(tmp_path):
    with Pager(os.fsencode(tmp_path / "from-bytes")) as p:
        assert p.directory == str(tmp_path / "from-bytes")
    with Pager(pathlib.Path(tmp_path / "from-path")) as p:
        assert p.directory == str(tmp_path / "from-path")


# -- booleans -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(map_ram="false"), "map_ram"),
    (dict(direct_io="no"), "direct_io"),
    (dict(direct_io=0), "direct_io"),
    (dict(map_ram=None), "map_ram"),
])
def test_pager_flags_must_be_bools(store_dir, kwargs, name):
    with pytest.raises(statepager.UsageError, match=rf"{name} must be a bool \(True or False\)"):
        Pager(store_dir, **kwargs)
    assert not os.path.exists(store_dir)


def test_numpy_bools_are_bools(store_dir):
    np = pytest.importorskip("numpy")
    with Pager(store_dir, map_ram=np.False_, direct_io=np.True_) as p:
        assert p.stats()["extents"] == 0


def model_and_optimizer():
    model = torch.nn.Linear(8, 8)
    return model, torch.optim.AdamW(model.parameters())


@pytest.mark.parametrize("kwargs, name", [
    (dict(log_steps="yes"), "log_steps"),
])
def test_attach_flags_must_be_bools(store_dir, kwargs, name):
    with Pager(store_dir, page_size=64 * KiB) as p:
        before = tree(store_dir)
        with pytest.raises(statepager.UsageError, match=rf"{name} must be a bool"):
            p.attach(model_and_optimizer()[1], **kwargs)
        assert p.bindings == () and tree(store_dir) == before


@pytest.mark.parametrize("value", ["no", 1, None, "Step", "epoch"])
def test_attach_atomic_is_one_of_its_choices(store_dir, value):
    attach_refused(store_dir, r"atomic must be one of .*'bucket'", atomic=value)


@pytest.mark.parametrize("value, kind", [(True, "step"), ("step", "step"),
                                         ("bucket", "bucket"), (False, False)])
def test_attach_atomic_choices(store_dir, value, kind):
    with Pager(store_dir, page_size=64 * KiB) as p:
        assert p.attach(model_and_optimizer()[1], atomic=value).atomic == kind
        assert p.attach(model_and_optimizer()[1]).atomic == "bucket"  # the default


@pytest.mark.parametrize("kwargs, name", [
    (dict(log_steps="no"), "log_steps"),
    (dict(amsgrad="no"), "amsgrad"),
    (dict(foreach="no"), "foreach"),
    (dict(fused=0), "fused"),
])
def test_paged_adamw_flags_must_be_bools(store_dir, kwargs, name):
    model = torch.nn.Linear(8, 8)
    with Pager(store_dir, page_size=64 * KiB) as p:
        with pytest.raises(statepager.UsageError, match=rf"{name} must be a bool"):
            PagedAdamW(model.parameters(), pager=p, **kwargs)
        assert p.stats()["extents"] == 0


def test_save_background_must_be_a_bool(store_dir, tmp_path):
    with Pager(store_dir, page_size=64 * KiB) as p:
        p.attach(model_and_optimizer()[1])
        with pytest.raises(statepager.UsageError, match=r"background must be a bool"):
            checkpoint.save(p, str(tmp_path / "ckpt"), background="no")
        assert not os.path.exists(tmp_path / "ckpt")


# -- sizes --------------------------------------------------------------------------------

def test_a_tensor_larger_than_the_arena_is_refused_before_anything_is_made(store_dir):
    with Pager(store_dir, page_size=64 * KiB, arena_size=1 * MiB) as p:
        before = tree(store_dir)
        with pytest.raises(statepager.UsageError,
                           match=r"tensor of 4194304 bytes is larger than .*arena_size 1048576"):
            p.empty(MiB, store="named")
        assert tree(store_dir) == before and p.stats()["extents"] == 0


def test_empty_strides_must_be_integers(store_dir):
    with Pager(store_dir, page_size=64 * KiB) as p:
        for strides in (5, "ab", [1.5]):
            with pytest.raises(statepager.UsageError, match=r"the strides must be integers"):
                p.empty(4, strides=strides)
        assert p.stats()["extents"] == 0


# -- tensors, optimizers, hooks ---------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda p: p.page_in(None), r"page_in: tensors must be a tensor or a sequence of tensors"),
    (lambda p: p.page_out(5), r"page_out: tensors must be a tensor or a sequence of tensors"),
    (lambda p: p.page_in("ab"), r"page_in: tensors must be a tensor or a sequence of tensors"),
    (lambda p: p.page_in([None]),
     r"page_in: tensors\[0\] must be a dense torch.Tensor of this Pager, not NoneType"),
    (lambda p: p.page_out([torch.zeros(3)]),
     r"tensor of shape \[3\] was not created by this Pager"),
    (lambda p: p.page_in([torch.zeros(3).to_sparse()]),
     r"page_in: tensors\[0\] must be a dense torch.Tensor of this Pager, not Tensor"),
])
def test_paging_takes_tensors_of_this_pager(store_dir, call, match):
    with Pager(store_dir, page_size=64 * KiB) as p:
        with pytest.raises(statepager.UsageError, match=match):
            call(p)


@pytest.mark.parametrize("optimizer, match", [
    (None, r"optimizer must be a torch.optim.Optimizer, not NoneType None"),
    (torch.nn.Linear(2, 2), r"optimizer must be a torch.optim.Optimizer, not Linear .*"
                            r"torch.optim.AdamW\(model.parameters\(\)\)"),
    ([torch.zeros(2)], r"optimizer must be a torch.optim.Optimizer, not list"),
])
def test_attach_takes_an_optimizer(store_dir, optimizer, match):
    with Pager(store_dir, page_size=64 * KiB) as p:
        before = tree(store_dir)
        with pytest.raises(statepager.UsageError, match=match):
            p.attach(optimizer)
        assert tree(store_dir) == before


@pytest.mark.parametrize("kwargs, match", [
    (dict(hooks=dict(before_bucket=print)), r"hooks must be a statepager.Hooks or None, "
                                            r"not dict.*Hooks\(before_bucket=...\)"),
    (dict(name=5), r"name must be a str or None, not int 5"),
    (dict(moments="fp16"), r"moments must be one of \('fp32', 'bf16', 'q8'\), not 'fp16'"),
    (dict(mains=None), r"mains must be one of \('fp32', 'residual'\), not None"),
])
def test_attach_options_are_checked_at_the_call(store_dir, kwargs, match):
    with Pager(store_dir, page_size=64 * KiB) as p:
        before = tree(store_dir)
        with pytest.raises(statepager.UsageError, match=match):
            p.attach(model_and_optimizer()[1], **kwargs)
        assert p.bindings == () and tree(store_dir) == before


@pytest.mark.parametrize("kwargs, match", [
    (dict(keep_resident=5), r"keep_resident must be callable or None, not int 5"),
    (dict(before_bucket=5), r"before_bucket must be callable or None, not int 5"),
    (dict(after_bucket="f"), r"after_bucket must be callable or None, not str 'f'"),
    (dict(model_param=5), r"model_param must be callable or None, not int 5"),
    (dict(before_chunk=5), r"before_chunk must be callable or None"),
    (dict(after_chunk=5), r"after_chunk must be callable or None"),
])
def test_hooks_are_checked_at_construction(kwargs, match):
    with pytest.raises(statepager.UsageError, match=match):
        statepager.Hooks(**kwargs)


# -- optimizer names -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["manifest.json", "-run1", ".hidden", "a/b", "a+b", "",
                                  "x" * 129, "caf\u00e9"])
def test_attach_refuses_the_names_save_would_refuse(store_dir, name):
    attach_refused(store_dir, r"optimizer name .* names its ", name=name)


def attach_refused(store_dir, match: str, **attach) -> None:
    """attach(**attach) refused with UsageError matching `match`, before anything
    changed: no binding, the store directory as it was."""
    with Pager(store_dir, page_size=64 * KiB) as p:
        before = tree(store_dir)
        with pytest.raises(statepager.UsageError, match=match):
            p.attach(model_and_optimizer()[1], **attach)
        assert p.bindings == () and tree(store_dir) == before


def test_attach_without_binding_plans_and_changes_nothing_until_bind(store_dir):
    """attach(bind=False), as an integration plans several optimizers before attaching
    any: the checks and the plan, and no binding, state or method of the optimizer's
    changed until bind()."""
    model, opt = model_and_optimizer()
    with Pager(store_dir, page_size=64 * KiB) as p:
        before = tree(store_dir)
        binding = p.attach(opt, bind=False)
        assert p.bindings == () and tree(store_dir) == before
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # torch's own step: nothing paged
        assert p.stats()["bytes_written"] == 0 and not any(p.owns(v) for s in opt.state.values()
                                                          for v in s.values())
        binding.bind()
        assert p.bindings == (binding,)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        assert binding.last.buckets >= 1 and all(p.owns(s["exp_avg"]) for s in opt.state.values())
        with pytest.raises(statepager.UsageError, match="already attached"):
            p.attach(opt)


def test_a_name_attach_takes_is_one_save_writes(store_dir, tmp_path):
    model, opt = model_and_optimizer()
    with Pager(store_dir, page_size=64 * KiB) as p:
        p.attach(opt, name="run_1.a-b")
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        checkpoint.save(p, str(tmp_path / "ckpt")).wait()
        assert os.path.isdir(tmp_path / "ckpt" / "run_1.a-b")


def test_refused_attach_calls_leave_the_directory_as_it_was(store_dir):
    model = torch.nn.Linear(64, 64)
    with Pager(store_dir, page_size=64 * KiB) as p:
        p.attach(torch.optim.SGD(model.parameters(), lr=0.1), name="dup")
        before = tree(store_dir)
        attached = torch.optim.AdamW(model.parameters())
        p.attach(attached, name="first")
        before = tree(store_dir)
        for optimizer, kwargs, match in [
            (torch.optim.AdamW(model.parameters()), dict(name="dup"), "already attached"),
            (attached, dict(name="again"), "already attached to a Pager"),
            (torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True),
             dict(name="diff"), "differentiable"),
            (torch.optim.LBFGS(model.parameters()), dict(name="lbfgs"), "LBFGS"),
            (torch.optim.AdamW(model.parameters()), dict(name="bad", moments="x"), "moments"),
        ]:
            with pytest.raises(statepager.UsageError, match=match):
                p.attach(optimizer, **kwargs)
            assert tree(store_dir) == before, kwargs
        assert [b.name for b in p.bindings] == ["dup", "first"]


@pytest.mark.parametrize("stepped", [False, True], ids=["no-state", "state"])
def test_attach_refused_for_its_window_opens_no_store(store_dir, stepped):
    model = torch.nn.Linear(1024, 1024)  # 8 MiB of moments
    opt = torch.optim.AdamW(model.parameters())
    if stepped:  # state made before attach, which moves it to the pager when accepted
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    with Pager(store_dir, page_size=64 * KiB, hbm_budget=7 << 20) as p:
        before = tree(store_dir)
        with pytest.raises(statepager.UsageError, match="cannot hold the step's pipeline"):
            p.attach(opt, bucket_size=8 << 20)
        assert tree(store_dir) == before
        assert p.bindings == ()
        assert all(torch.equal(opt.state[model.weight][k], v) for k, v in state.items())
        p.attach(opt, bucket_size=1 << 20)  # what fits is accepted afterwards: in chunks,
        if stepped:                          # the state made before it moved in chunks too
            assert all(torch.equal(opt.state[model.weight][k], v) for k, v in state.items())
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()


# -- PagedAdamW -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1.0), r"PagedAdamW: Invalid learning rate: -1.0"),
    (dict(betas=(0.9, 1.5)), r"PagedAdamW: Invalid beta parameter at index 1"),
    (dict(eps=-1.0), r"PagedAdamW: Invalid epsilon value"),
    (dict(moments="fp16"), r"moments must be one of"),
    (dict(mains="bf16"), r"mains must be one of"),
    (dict(pager=None), r"pager must be a statepager.Pager, not NoneType None"),
    (dict(bucket_size="1M"), r"bucket_size must be an integer"),
])
def test_paged_adamw_checks_every_argument_before_making_a_tensor(store_dir, kwargs, match):
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    with Pager(store_dir, page_size=64 * KiB) as p:
        before = tree(store_dir)
        with pytest.raises(statepager.UsageError, match=match):
            PagedAdamW(model.parameters(), **{"pager": p, **kwargs})
        s = p.stats()
        assert s["extents"] == 0 and s["bytes_written"] == 0 and tree(store_dir) == before


def test_paged_adamw_refuses_params_that_are_no_tensors(store_dir):
    with Pager(store_dir, page_size=64 * KiB) as p:
        for params, match in [(torch.zeros(3), r"params must be an iterable of parameters"),
                              ([1.0], r"params\[0\] must be a torch.Tensor, not float"),
                              (None, r"params must be an iterable of parameters")]:
            with pytest.raises(statepager.UsageError, match=match):
                PagedAdamW(params, pager=p)
        assert p.stats()["extents"] == 0


@pytest.mark.parametrize("budget", [
    64 * KiB,   # filling the masters cannot page in a bucket: OutOfMemoryError
    512 * KiB,  # the masters are filled, attach finds the step's pipeline too large
])
def test_a_paged_adamw_that_fails_later_frees_what_it_made(store_dir, budget):
    model = torch.nn.Linear(256, 256).to(torch.bfloat16)
    with Pager(store_dir, page_size=64 * KiB, hbm_budget=budget) as p:
        try:
            PagedAdamW(model.parameters(), pager=p, bucket_size=1 * MiB)
        except statepager.Error:
            pass  # its traceback, which holds the failed frames, goes with it
        else:
            pytest.fail("PagedAdamW was not refused")
        gc.collect()
        assert p.stats()["extents"] == 0
