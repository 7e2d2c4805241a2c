"""statepager.core.state_values: an attached optimizer's state read out and loaded back
per parameter (masters included), all or nothing, in every stored format."""
import copy

import pytest
import torch

from statepager import PagedAdamW, Pager, _C
from statepager.core import state_values

KiB = 1 << 10
FORMATS = [("fp32", "fp32"), ("bf16", "fp32"), ("q8", "residual")]


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 6)).bfloat16()


def train(m, opt, steps, first=0):
    losses = []
    for i in range(first, first + steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 40, generator=g).bfloat16(), torch.randn(32, 6, generator=g)
        loss = torch.nn.functional.mse_loss(m(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def paged(m, pager, moments, mains):
    return PagedAdamW(m.parameters(), pager=pager, lr=3e-3, weight_decay=0.1,
                      bucket_size=100 * KiB, moments=moments, mains=mains)


def masters(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def as_lists(values: dict, opt) -> list:
    return [[(n, t.clone()) for n, t in values[p].items()] for p in masters(opt)]


def same(a: list, b: list) -> bool:
    return all(x[0] == y[0] and torch.equal(x[1], y[1])
               for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


@pytest.mark.parametrize("moments,mains", FORMATS)
def test_read_gives_each_master_and_moment_as_the_step_reads_it(store_dir, moments, mains):
    """Masters and moments as host tensors of the parameter's shape: the moments as
    state_dict() gives them, the masters as the model's params round them."""
    m = model()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = paged(m, pager, moments, mains)
        train(m, opt, 3)
        values = state_values.read(opt.binding)
        sd = opt.state_dict()
        assert len(opt.binding.buckets) > 3
        for i, (p, model_p) in enumerate(zip(masters(opt), m.parameters())):
            got = values[p]
            assert sorted(got) == ["exp_avg", "exp_avg_sq", "param"]
            assert all(t.device.type == "cpu" and t.shape == p.shape for t in got.values())
            assert torch.equal(got["exp_avg"], sd["state"][i]["exp_avg"])
            assert torch.equal(got["exp_avg_sq"], sd["state"][i]["exp_avg_sq"])
            assert got["param"].dtype == torch.float32
            assert torch.equal(got["param"].bfloat16(), model_p.detach())
        assert "param" not in state_values.read(opt.binding, masters=False)[masters(opt)[0]]


@pytest.mark.parametrize("moments,mains", FORMATS)
def test_values_loaded_into_another_optimizer_continue_the_run_exactly(store_dir, moments,
                                                                       mains):
    """A second optimizer over a copy of the model, its state made by a load of zeros (as
    Megatron makes it before setting the values), then given the first one's masters and
    moments: the next steps are the first run's, bit for bit; and read gives back what
    was loaded."""
    a, b = model(), model(seed=1)
    with Pager(store_dir, page_size=64 * KiB) as pa, Pager(store_dir + "-b",
                                                            page_size=64 * KiB) as pb:
        opt_a = paged(a, pa, moments, mains)
        train(a, opt_a, 4)
        with torch.no_grad():
            for x, y in zip(a.parameters(), b.parameters()):
                y.copy_(x)
        opt_b = paged(b, pb, moments, mains)
        sd = opt_a.state_dict()
        opt_b.load_state_dict({**sd, "state": {
            i: {n: torch.zeros_like(v) if v.dim() else v.clone() for n, v in st.items()}
            for i, st in sd["state"].items()}})
        values = state_values.read(opt_a.binding)
        state_values.load(opt_b.binding, dict(zip(masters(opt_b),
                                                  (values[p] for p in masters(opt_a)))))
        assert same(as_lists(state_values.read(opt_b.binding), opt_b), as_lists(values, opt_a))
        assert train(a, opt_a, 5, first=4) == train(b, opt_b, 5, first=4)
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
        assert same(as_lists(state_values.read(opt_a.binding), opt_a),
                    as_lists(state_values.read(opt_b.binding), opt_b))


def test_residual_masters_load_against_model_params_loaded_first(store_dir):
    """A checkpoint's load in Megatron's order: the model params first, then the
    optimizer's values. Residual masters, stored against the params they had, are encoded
    against the loaded ones where the load gives every master: the run continues as the
    one that saved, bit for bit. A load that leaves some masters as they were cannot
    rebuild them from the changed params: refused (their fingerprints), nothing changed."""
    a, b = model(), model(seed=1)
    with Pager(store_dir, page_size=64 * KiB) as pa, Pager(store_dir + "-b",
                                                            page_size=64 * KiB) as pb:
        opt_a, opt_b = paged(a, pa, "q8", "residual"), paged(b, pb, "q8", "residual")
        train(a, opt_a, 4)
        train(b, opt_b, 1)
        # The step counters (and moments) of the saving run, as from a file: its own.
        opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
        own = [p.detach().clone() for p in b.parameters()]
        before = as_lists(state_values.read(opt_b.binding), opt_b)
        with torch.no_grad():  # the model's checkpoint, loaded first
            for x, y in zip(a.parameters(), b.parameters()):
                y.copy_(x)
        values = state_values.read(opt_a.binding)
        first = masters(opt_b)[0]
        with pytest.raises(ValueError):
            state_values.load(opt_b.binding, {first: dict(values[masters(opt_a)[0]])})
        with torch.no_grad():
            for p, kept in zip(b.parameters(), own):
                p.copy_(kept)
        assert same(as_lists(state_values.read(opt_b.binding), opt_b), before)
        with torch.no_grad():
            for x, y in zip(a.parameters(), b.parameters()):
                y.copy_(x)
        state_values.load(opt_b.binding, dict(zip(masters(opt_b),
                                                  (values[p] for p in masters(opt_a)))))
        assert same(as_lists(state_values.read(opt_b.binding), opt_b), as_lists(values, opt_a))
        assert train(a, opt_a, 5, first=4) == train(b, opt_b, 5, first=4)
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_load_of_some_entries_keeps_the_others(store_dir):
    m = model()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = paged(m, pager, "fp32", "fp32")
        train(m, opt, 2)
        before = state_values.read(opt.binding)
        p = masters(opt)[2]
        state_values.load(opt.binding, {p: {"exp_avg": torch.full(p.shape, 0.5)}})
        after = state_values.read(opt.binding)
        assert torch.equal(after[p]["exp_avg"], torch.full(p.shape, 0.5))
        after[p]["exp_avg"] = before[p]["exp_avg"]
        assert same(as_lists(after, opt), as_lists(before, opt))


def bad_values(opt, stranger):
    p = masters(opt)[0]
    return [
        ({p: {"max_exp_avg_sq": torch.zeros(p.shape)}}, r"'max_exp_avg_sq' is not a paged "
         r"entry of the parameter of shape \(256, 40\) \(it has \['exp_avg', 'exp_avg_sq', "
         r"'param'\]\)"),
        ({p: {"exp_avg": torch.zeros(3)}}, r"'exp_avg' of the parameter of shape \(256, 40\) "
         r"must be a tensor of that shape, not \(3,\)"),
        ({p: {"param": 1.0}}, r"must be a tensor of that shape, not <class 'float'>"),
        ({stranger: {"exp_avg": torch.zeros(4)}}, r"the parameter of shape \(4,\) has no "
         r"state the pager holds"),
    ]


def test_refused_loads_change_nothing(store_dir):
    m = model()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = paged(m, pager, "q8", "residual")
        train(m, opt, 2)
        before = as_lists(state_values.read(opt.binding), opt)
        first = masters(opt)[1]
        for values, message in bad_values(opt, torch.nn.Parameter(torch.zeros(4))):
            # A good value first: it must not be kept either.
            values = {first: {"exp_avg": torch.ones(first.shape)}, **values}
            with pytest.raises(_C.UsageError, match=message + ".*nothing was loaded"):
                state_values.load(opt.binding, values)
            assert same(as_lists(state_values.read(opt.binding), opt), before)


@pytest.mark.parametrize("moments,mains", FORMATS)
def test_a_load_failing_midway_puts_every_tensor_back(store_dir, moments, mains):
    """The last parameter's value cannot be copied (a meta tensor, found only when its
    bucket is copied into): the buckets loaded before it go back too."""
    m = model()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = paged(m, pager, moments, mains)
        train(m, opt, 2)
        before = as_lists(state_values.read(opt.binding), opt)
        ps = masters(opt)
        values = {p: {"param": torch.ones(p.shape), "exp_avg": torch.ones(p.shape)}
                  for p in ps[:-1]}
        values[ps[-1]] = {"exp_avg": torch.empty(ps[-1].shape, device="meta")}
        with pytest.raises(Exception, match="meta"):
            state_values.load(opt.binding, values)
        assert same(as_lists(state_values.read(opt.binding), opt), before)
        losses = train(m, opt, 2, first=2)
    ref = model()
    with Pager(store_dir + "-ref", page_size=64 * KiB) as pager:
        ref_opt = paged(ref, pager, moments, mains)
        assert train(ref, ref_opt, 4)[2:] == losses


def test_a_paused_pager_refuses_a_load(store_dir):
    m = model()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = paged(m, pager, "fp32", "fp32")
        train(m, opt, 1)
        p = masters(opt)[0]
        pager.pause()
        with pytest.raises(_C.UsageError, match="paused"):
            state_values.load(opt.binding, {p: {"exp_avg": torch.zeros(p.shape)}})
        pager.resume()


@pytest.mark.parametrize("moments,mains", FORMATS)
def test_a_state_dict_taken_by_reference_loads_back_without_moving_a_byte(store_dir, moments,
                                                                          mains):
    """A state dict holding the live paged tensors (state_dict_by_reference(), as
    Megatron's load_state_dict reads and loads back its inner optimizer's) loads without
    a read or a write; the run goes on as if it had not been loaded."""
    runs = []
    for reload in (False, True):
        m = model()
        with Pager(f"{store_dir}-{reload}", page_size=64 * KiB) as pager:
            opt = paged(m, pager, moments, mains)
            losses = train(m, opt, 2)
            if reload:
                with opt.binding.state_dict_by_reference():
                    sd = opt.state_dict()
                before = pager.stats()
                opt.load_state_dict(sd)
                after = pager.stats()
                assert after["bytes_read"] == before["bytes_read"]
                assert after["bytes_written"] == before["bytes_written"]
            runs.append((losses + train(m, opt, 2, first=2),
                         as_lists(state_values.read(opt.binding), opt)))
    assert runs[0][0] == runs[1][0] and same(runs[0][1], runs[1][1])
