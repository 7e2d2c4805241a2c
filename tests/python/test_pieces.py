"""Tensors made of pieces (Pager.empty(pieces=...)): each piece pages on its own through a
view of its bytes; and stored forms in chunks (StoredForm.chunk) write the bytes of the
whole form's encode, so a tensor larger than a bucket keeps its on-disk format."""
import pytest
import torch

import statepager
from statepager import Pager
from statepager.util.flat import copy_each, flat_view, zero_each
from statepager.core.slices import CHUNK_ALIGN, chunk_bounds
from statepager.formats import codecs
from statepager.formats.stored import StoredForm

KiB = 1 << 10
PAGE = 64 * KiB


def test_a_piece_pages_on_its_own(store_dir):
    with Pager(store_dir, page_size=PAGE) as pager:
        piece = 4 * PAGE
        t = pager.empty((2 * piece + 400) // 4, pieces=[piece, piece, 400])  # fp32
        assert pager.stats()["extents"] == 3
        pager.page_in(t)
        t.copy_(torch.arange(t.numel(), dtype=torch.float32))
        pager.page_out(t)
        assert pager.residency(t) == "file"
        pager.reset_peak()
        middle = t[piece // 4:piece // 2]
        pager.page_in(middle)
        assert pager.residency(middle) == "resident" and pager.residency(t) == "mixed"
        assert pager.stats()["peak_mapped_bytes"] <= piece + PAGE  # + a page shared at an end
        assert torch.equal(middle, torch.arange(piece // 4, piece // 2, dtype=torch.float32))
        middle.neg_()
        pager.page_out(middle)
        pager.page_in(t)
        expected = torch.arange(t.numel(), dtype=torch.float32)
        expected[piece // 4:piece // 2].neg_()
        assert torch.equal(t, expected)
        pager.page_out(t)
        del t, middle
        assert pager.stats()["extents"] == 0


def test_owns_each_is_owns_of_each_value(store_dir):
    with Pager(store_dir, page_size=PAGE) as pager:
        t = pager.empty(1000)
        pieces = pager.empty((2 * 4 * PAGE) // 4, pieces=[4 * PAGE, 4 * PAGE])
        values = [t, t[10:20], pieces[5:], torch.zeros(3), torch.zeros(3).to_sparse(), 1.5,
                  None, "t"]
        assert pager.services.owns_each(values) == [pager.owns(v) for v in values] == \
            [True, True, True, False, False, False, False, False]


def test_a_list_naming_a_tensor_of_no_pager_s_fails_whole(store_dir):
    """The tensor is named by its shape, and nothing of the list moves."""
    with Pager(store_dir, page_size=PAGE) as pager:
        t = pager.empty(1000)
        with pytest.raises(statepager.UsageError, match=r"a tensor of shape \[7, 2\] was not "
                                                        "created by this Pager"):
            pager.page_in([t, torch.zeros(7, 2)])
        assert pager.residency(t) == "zero"


def test_pieces_that_do_not_fit_are_refused(store_dir):
    with Pager(store_dir, page_size=PAGE) as pager:
        with pytest.raises(statepager.UsageError, match="add up"):
            pager.empty(1024, pieces=[4096, 4095])
        with pytest.raises(statepager.UsageError, match="multiple of 4096"):
            pager.empty(1024, pieces=[100, 4096 - 100])
        with pytest.raises(statepager.UsageError, match="pieces\\[1\\]"):
            pager.empty(1024, pieces=[4096, -1])
        assert pager.stats()["extents"] == 0


def bounds_of(n):
    return chunk_bounds(n, CHUNK_ALIGN)


def encode(form) -> None:
    """form.encode(), its residual exceptions (if any) finished."""
    pending = form.encode()
    if pending is not None:
        form.set_exceptions(codecs.finish_exceptions([pending])[0])


def resident(form):
    """The tensors a form needs resident (its working tensor once)."""
    return form.tensors + ([form.working] if form.scratch else [])


@pytest.mark.parametrize("fmt,kind", [("fp32", "signed"), ("bf16", "signed"), ("q8", "signed"),
                                      ("q8", "nonneg"), ("residual", "signed")])
def test_stored_form_in_chunks_writes_the_whole_forms_bytes(store_dir, fmt, kind):
    """Encoded chunk by chunk, each chunk paged in alone: the bytes and exceptions of the
    whole tensor's encode; decoded chunk by chunk: the whole decode."""
    n = 2 * CHUNK_ALIGN + 3 * codecs.Q8_BLOCK + 5  # a last chunk with a partial q8 block
    g = torch.Generator().manual_seed(1)
    values = torch.randn(n, generator=g)
    if kind == "nonneg":
        values = values.abs()
    values[::9973] = float("inf")  # residual exceptions in several chunks
    values[CHUNK_ALIGN - 1] = float("nan")
    bounds = bounds_of(n)
    assert len(bounds) == 3
    with Pager(store_dir, page_size=PAGE) as pager:
        pieces = [4 * (b - a) for a, b in bounds]
        param = values.bfloat16() if fmt == "residual" else None
        whole = StoredForm(pager, pager.empty(n), fmt, kind, param)
        chunked = StoredForm(pager, pager.empty(n, pieces=pieces), fmt, kind, param, bounds)
        pager.page_in(resident(whole))
        whole.working.copy_(values)
        encode(whole)
        for start, stop in bounds:
            part = chunked.chunk(start, stop)
            pager.page_in(resident(part))
            part.working.copy_(values[start:stop])
            encode(part)
            pager.page_out(resident(part))
            if fmt == "residual":  # the whole form's exceptions, in this chunk
                idx, bits = whole.exceptions
                inside = (idx >= start) & (idx < stop)
                assert torch.equal(part.exceptions[0], idx[inside] - start)
                assert torch.equal(part.exceptions[1], bits[inside])
        for a, b in zip(chunked.exceptions, whole.exceptions):  # set through the chunks
            assert torch.equal(a, b)
        pager.page_in(chunked.tensors)
        for a, b in zip(chunked.tensors, whole.tensors):  
            assert torch.equal(flat_view(a).view(torch.uint8), flat_view(b).view(torch.uint8))
        whole.decode()
        expected = whole.working.clone()
        pager.page_out(chunked.tensors)
        for start, stop in bounds:  # decoded by chunk, from the chunks' own exceptions
            part = chunked.chunk(start, stop)
            pager.page_in(resident(part))
            if chunked.scratch:
                part.working.zero_()
            part.decode()
            assert torch.equal(part.working.view(torch.int32),
                               expected[start:stop].view(torch.int32))
            pager.page_out(resident(part))


def test_a_chunk_starts_on_a_q8_block():
    form = StoredForm(None, torch.zeros(1000), "fp32")
    with pytest.raises(ValueError, match="multiple of 256"):
        form.chunk(100, 600)
    assert form.chunk(256, 1000).working.numel() == 744


def test_chunks_of_two_plans_keep_one_exception_list(store_dir):
    """A residual form's chunks read and set their ranges of its exception list (each
    chunk its own, without a device sync in a step), and chunks of another plan, whose
    ranges overlap theirs, and the whole form still see one list: the one a whole-list
    reference holds, read sorted by index however it was set (the encode kernel lists
    them in any order)."""
    block, n = codecs.Q8_BLOCK, 16 * codecs.Q8_BLOCK + 7
    g = torch.Generator().manual_seed(3)
    truth = {}  # index -> main bits

    def some(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New exceptions of [start, stop) (indices from start), in no order, recorded in
        truth."""
        for k in [k for k in truth if start <= k < stop]:
            del truth[k]
        index = torch.randperm(stop - start, generator=g)[:5]
        bits = torch.randint(-2**31, 2**31 - 1, (5,), generator=g, dtype=torch.int32)
        truth.update({start + int(i): int(b) for i, b in zip(index, bits)})
        return index, bits

    def expected(start: int, stop: int) -> list:
        return [(k - start, v) for k, v in sorted(truth.items()) if start <= k < stop]

    def listed(exceptions) -> list:
        return list(zip(exceptions[0].tolist(), exceptions[1].tolist()))

    with Pager(store_dir, page_size=PAGE) as pager:
        form = StoredForm(pager, pager.empty(n), "residual", "signed",
                          torch.zeros(n, dtype=torch.bfloat16))
        form.exceptions = some(0, n)
        plan_a = [(0, 4 * block), (4 * block, 10 * block), (10 * block, n)]
        plan_b = [(0, 7 * block), (7 * block, n)]
        for start, stop in plan_a[1:]:
            form.chunk(start, stop).exceptions = some(start, stop)
        for start, stop in plan_a:
            assert listed(form.chunk(start, stop).exceptions) == expected(start, stop)
        start, stop = plan_b[1]
        form.chunk(start, stop).exceptions = some(start, stop)  # overlaps two of plan a
        for start, stop in plan_b:
            assert listed(form.chunk(start, stop).exceptions) == expected(start, stop)
        assert listed(form.exceptions) == expected(0, n)
        form.chunk(*plan_a[0]).exceptions = some(*plan_a[0])
        assert sorted(listed(form.exceptions_as_set)) == expected(0, n)
        assert listed(form.exceptions) == expected(0, n)
        form.exceptions = some(0, n)  # a whole encode or load: the chunks' go
        for start, stop in plan_a:
            assert listed(form.chunk(start, stop).exceptions) == expected(start, stop)


def test_copy_each_and_zero_each_over_mixed_dtypes_and_views():
    """Each pair copied (dtypes converted as copy_ converts them), each tensor zeroed,
    views into one buffer included, whatever the mix of dtypes."""
    buffer = torch.arange(12, dtype=torch.float32) + 1
    targets = [buffer[0:4], buffer[6:9], torch.ones(3, dtype=torch.bfloat16)]
    sources = [torch.full((4,), 7.0, dtype=torch.bfloat16), torch.full((3,), 8.0),
               torch.full((3,), 9.0)]
    copy_each(targets, sources)
    assert buffer.tolist() == [7.0] * 4 + [5.0, 6.0] + [8.0] * 3 + [10.0, 11.0, 12.0]
    assert targets[2].tolist() == [9.0] * 3
    zero_each([buffer[0:2], buffer[8:10], targets[2]])
    assert buffer.tolist() == [0.0, 0.0, 7.0, 7.0, 5.0, 6.0, 8.0, 8.0, 0.0, 0.0, 11.0, 12.0]
    assert targets[2].tolist() == [0.0] * 3


def test_zero_each_fills_runs_end_to_end_and_nothing_between():
    """Views end to end in one buffer (a grad buffer's, in any order) are zeroed as runs,
    without the elements between runs; a view with gaps, a view of another dtype that
    follows a run, another storage whose bytes follow a run's, and a tensor autograd
    tracks are each zeroed alone, as torch's multi-tensor zero would."""
    buffer = torch.arange(16, dtype=torch.float32) + 1
    buffer[6] = 7.1  # 0x40e33333
    strided = buffer[12:16:2]
    zero_each([buffer[4:6], buffer[0:2], buffer[2:4], buffer[8:10], strided,
               buffer[6:7].view(torch.bfloat16)[:1], torch.empty(0)])
    # buffer[6]'s low two bytes alone (0x40e30000): the run 0..6 did not grow by a float32.
    assert buffer[:6].tolist() == [0.0] * 6 and buffer[6].item() == 7.09375
    assert buffer[7:].tolist() == [8.0] + [0.0] * 2 + [11.0, 12.0, 0.0, 14.0, 0.0, 16.0]
    # Two storages from one host buffer's start, of 4 and 8 floats: a view of the second
    # right after the first's bytes.
    raw = bytearray(torch.ones(8).numpy().tobytes())
    first, second = (torch.frombuffer(raw, dtype=torch.float32, count=n) for n in (4, 8))
    zero_each([first, second[4:6]])
    assert torch.frombuffer(raw, dtype=torch.float32).tolist() == [0.0] * 6 + [1.0] * 2
    # A tracked view beside an untracked one: each as torch records it.
    x = torch.arange(1.0, 9.0).requires_grad_()
    base = x * 1
    zero_each([base[0:2], base[2:4].detach()])
    (base * torch.arange(1.0, 9.0)).sum().backward()
    assert x.grad.tolist() == [0.0, 0.0] + [float(i) for i in range(3, 9)]
