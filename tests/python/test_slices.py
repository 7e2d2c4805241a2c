"""A parameter's Adam step on slices (statepager.core.slices) is bit for bit the
whole-tensor step: every torch variant, amsgrad, weight decay, layouts; the step count
advances once per step."""
import pytest
import torch

import statepager
from statepager.core import slices

ALIGN = slices.CHUNK_ALIGN

VARIANTS = [dict(foreach=False), dict(foreach=True), dict(fused=True),
            dict(foreach=False, amsgrad=True, weight_decay=0.1),
            dict(foreach=True, amsgrad=True, weight_decay=0.1),
            dict(fused=True, amsgrad=True, weight_decay=0.1),
            dict(foreach=True, maximize=True)]


def raw_step(opt):
    step = type(opt).step
    return getattr(step, "__wrapped__", step)(opt)


def train(cls, kwargs, sliced, *, steps=4, shape=(3 * ALIGN // 512 + 7, 512),
          channels_last=False, max_elements=ALIGN):
    torch.manual_seed(0)
    p = torch.randn(*shape)
    if channels_last:
        p = p.to(memory_format=torch.channels_last)
    p = torch.nn.Parameter(p)
    opt = cls([p], lr=1e-2, **kwargs)
    for i in range(steps):
        p.grad = torch.randn(*shape, generator=torch.Generator().manual_seed(i))
        if sliced and opt.state.get(p):  # the first step, which creates the state, is whole
            slices.step_in_slices(opt, raw_step, 0, p, slices.chunk_bounds(p.numel(), max_elements))
        else:
            opt.step()
    return p, opt


@pytest.mark.parametrize("kwargs", VARIANTS,
                         ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_sliced_step_is_the_whole_step(cls, kwargs):
    ref, ref_opt = train(cls, kwargs, sliced=False)
    p, opt = train(cls, kwargs, sliced=True)
    assert len(slices.chunk_bounds(p.numel(), ALIGN)) == 4  # the last one partial
    assert torch.equal(p, ref)
    state, ref_state = opt.state[p], ref_opt.state[ref]
    assert list(state) == list(ref_state)
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), k
    assert state["step"].item() == 4  # once per step, not once per chunk
    assert list(opt.state) == [p]  # no chunk left behind


def test_sliced_step_with_a_grad_of_another_layout():
    """A channels_last parameter with a contiguous grad: chunks are in the parameter's
    memory order, the grad's elements matched to them."""
    shape = (8, 2 * ALIGN // 64 + 3, 4, 16)
    ref, _ = train(torch.optim.AdamW, {}, sliced=False, shape=shape, channels_last=True)
    p, _ = train(torch.optim.AdamW, {}, sliced=True, shape=shape, channels_last=True)
    assert p.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(p, ref)


def test_failed_chunk_leaves_the_count_and_groups():
    p, opt = train(torch.optim.Adam, {}, sliced=False, steps=1)
    p.grad = torch.ones_like(p)
    calls = []

    def failing(o):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        raw_step(o)

    with pytest.raises(RuntimeError, match="injected"):
        slices.step_in_slices(opt, failing, 0, p, slices.chunk_bounds(p.numel(), ALIGN))
    assert opt.state[p]["step"].item() == 1
    assert opt.param_groups[0]["params"] == [p]
    assert list(opt.state) == [p]


def test_a_parameter_without_grad_does_not_step():
    p, opt = train(torch.optim.Adam, {}, sliced=False, steps=1)
    before = p.detach().clone()
    p.grad = None
    slices.step_in_slices(opt, raw_step, 0, p, slices.chunk_bounds(p.numel(), ALIGN))
    assert torch.equal(p, before) and opt.state[p]["step"].item() == 1


@pytest.mark.parametrize("numel,most,expected", [
    (1, 1, [(0, 1)]),
    (ALIGN, 10, [(0, ALIGN)]),
    (2 * ALIGN + 5, ALIGN + 7, [(0, ALIGN), (ALIGN, 2 * ALIGN), (2 * ALIGN, 2 * ALIGN + 5)]),
    (5 * ALIGN, 2 * ALIGN, [(0, 2 * ALIGN), (2 * ALIGN, 4 * ALIGN), (4 * ALIGN, 5 * ALIGN)])])
def test_chunk_bounds(numel, most, expected):
    assert slices.chunk_bounds(numel, most) == expected


def test_chunk_starts_fall_on_file_blocks_of_every_format():
    """fp32, bf16, int16 and q8 codes at whole 4 KiB; q8 scales (one per block) too."""
    for start, _ in slices.chunk_bounds(7 * ALIGN + 1, 2 * ALIGN):
        for bytes_per_element in (4, 2, 1):
            assert start * bytes_per_element % 4096 == 0
        assert start % 256 == 0 and start // 256 * 4 % 4096 == 0


def test_only_elementwise_steps_slice():
    p = torch.nn.Parameter(torch.zeros(4))
    assert slices.sliceable(torch.optim.AdamW([p]))
    with pytest.raises(statepager.UsageError, match="cannot run on slices"):
        slices.check_sliceable(torch.optim.Adagrad([p]), "parameter 0")
