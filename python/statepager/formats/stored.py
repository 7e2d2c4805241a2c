"""On-disk formats of streamed optimizer state.

The optimizer always computes on fp32 "working" tensors. A StoredForm says how one working
tensor is kept at rest in the pager:
  fp32      the working tensor itself (bit-identical to no paging)
  bf16      a bf16 copy (moments: 2 bytes instead of 4)
  q8        8-bit codes with one fp32 scale per block (see codecs.py)
  residual  for fp32 masters of a bf16 model: the 16 bits the bf16 parameter does not
            already hold, plus a sparse exception list (lossless; see codecs.py)
With any format but fp32 the working tensor is scratch: zero-filled on page-in, decoded
into, stepped, encoded from, and discarded without being written.

A tensor larger than a bucket steps in chunks (statepager.core.slices): at chunk bounds
that fall on whole q8 blocks, a chunk's stored bytes are a contiguous slice of each stored
tensor, the very bytes the whole tensor's encode writes there (StoredForm.chunk), so the
stored tensors can be made of one piece per chunk (Pager.empty's pieces) and stay the
same tensors, on disk and in checkpoints, as unchunked ones.
"""
from __future__ import annotations

import copy

import torch

from statepager.formats import codecs
from statepager.util.flat import flat_view

MOMENT_FORMATS = ("fp32", "bf16", "q8")
MAIN_FORMATS = ("fp32", "residual")


class StoredForm:
    def __init__(self, pager, working: torch.Tensor, fmt: str, kind: str = "signed",
                 model_param: torch.Tensor | None = None,
                 bounds: list[tuple[int, int]] | None = None):
        """bounds: the chunks (statepager.core.slices.chunk_bounds) the stored tensors are
        made of, one piece each (Pager.empty's pieces); None: one piece."""
        self.working, self.fmt, self.kind, self.model_param = working, fmt, kind, model_param
        # Their flat views, made once: a step's decode and encode take them every time.
        self.flat_working = flat_view(working)
        self.flat_model_param = None if model_param is None else flat_view(model_param)
        self.bounds = bounds
        self._whole, self._range = None, None  # a chunk's: the whole form, (start, stop)
        self._exceptions = (torch.empty(0, dtype=torch.int64, device=working.device),
                            torch.empty(0, dtype=torch.int32, device=working.device))
        # residual: (start, stop) -> a chunk's exceptions (indices from start), set by its
        # encode or read once from _exceptions: they, not _exceptions, hold that range.
        # Disjoint ranges. A chunk reads and sets its own without a device sync (a range
        # of the whole list is a boolean mask), once per step in the step's loop.
        self._chunk_exceptions = {}
        self._in_order = True  # _exceptions sorted by index (what `exceptions` returns)
        self._fingerprint = None  # residual: the model parameter's, when last encoded
        self._chunk_fingerprints = {}  # residual: (start, stop) -> a chunk's, when encoded
        n = working.numel()

        def pieces(size_of) -> list[int] | None:
            return None if bounds is None else [size_of(stop - start) for start, stop in bounds]

        def empty(numel, dtype, size_of):  # Note [Stored forms pack at the arena's top]
            return pager.empty(numel, dtype=dtype, pieces=pieces(size_of), arena_end="high")

        if fmt == "fp32":
            self.tensors = [working]
        elif fmt == "bf16":
            self.tensors = [empty(n, torch.bfloat16, lambda k: 2 * k)]
        elif fmt == "q8":
            self.tensors = [empty(n, torch.uint8, lambda k: k),
                            empty(codecs.q8_num_blocks(n), torch.float32,
                                  lambda k: 4 * codecs.q8_num_blocks(k))]
        elif fmt == "residual":
            if model_param is None or model_param.dtype != torch.bfloat16:
                raise ValueError("the 'residual' mains format needs a bf16 model parameter "
                                 "for every master: use mains='fp32' for this model")
            self.tensors = [empty(n, torch.int16, lambda k: 2 * k)]
        else:
            raise ValueError(f"unknown format {fmt!r}: use one of {MOMENT_FORMATS + MAIN_FORMATS}")

    def chunk(self, start: int, stop: int) -> "StoredForm":
        """The form of elements [start, stop) of the working tensor, in memory order (start
        a multiple of Q8_BLOCK; stop too, or the end): views of the working and stored
        tensors and of the model parameter, whose encode writes the bytes the whole form's
        encode writes there. A residual chunk's exceptions are the whole form's in it
        (indices from start): setting them (its encode) sets those of the whole form
        there; its fingerprint is the chunk's model parameter's, kept by the whole form."""
        if start % codecs.Q8_BLOCK or not 0 <= start < stop <= self.working.numel() or (
                stop % codecs.Q8_BLOCK and stop != self.working.numel()):
            raise ValueError(f"chunk [{start}, {stop}) of a tensor of {self.working.numel()} "
                             f"elements: it must start on a multiple of {codecs.Q8_BLOCK}")
        part = copy.copy(self)
        part.working = part.flat_working = self.flat_working[start:stop]
        if self.model_param is not None:
            part.model_param = part.flat_model_param = self.flat_model_param[start:stop]
        if self.fmt == "fp32":
            part.tensors = [part.working]
        elif self.fmt == "q8":
            first = start // codecs.Q8_BLOCK
            part.tensors = [self.tensors[0][start:stop],
                            self.tensors[1][first:first + codecs.q8_num_blocks(stop - start)]]
        else:
            part.tensors = [self.tensors[0][start:stop]]
        part._whole, part._range = self, (start, stop)
        return part

    @property
    def exceptions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual format: (flat int64 indices, int32 main bits) of the elements the
        residual does not hold (codecs.residual_encode), sorted by index (as checkpoints
        keep them). Set in any order."""
        if self._whole is not None:
            return codecs.in_index_order(self._whole._range_exceptions(*self._range))
        listed = self.exceptions_as_set  # folds the chunks' in
        if not self._in_order:
            self._exceptions, self._in_order = codecs.in_index_order(listed), True
        return self._exceptions

    @exceptions.setter
    def exceptions(self, exceptions: tuple[torch.Tensor, torch.Tensor]) -> None:
        if self._whole is not None:
            self._whole._set_range_exceptions(*self._range, exceptions)
        else:
            self._exceptions, self._chunk_exceptions = exceptions, {}
            self._in_order = False

    @property
    def exceptions_as_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exceptions in the order they were set: what a decode reads (it places each
        at its index). The step sets them in the encode kernel's order and never sorts."""
        if self._whole is not None:
            return self._whole._range_exceptions(*self._range)
        if self._chunk_exceptions:
            self._fold()
        return self._exceptions

    def _range_exceptions(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole form's exceptions in [start, stop), indices from start."""
        known = self._chunk_exceptions.get((start, stop))
        if known is None:
            self._fold_overlapping(start, stop)
            index, bits = self._exceptions
            inside = (index >= start) & (index < stop)
            known = self._chunk_exceptions[(start, stop)] = (index[inside] - start, bits[inside])
        return known

    def _set_range_exceptions(self, start: int, stop: int, exceptions) -> None:
        if (start, stop) not in self._chunk_exceptions:
            self._fold_overlapping(start, stop)
        self._chunk_exceptions[(start, stop)] = exceptions

    def _fold_overlapping(self, start: int, stop: int) -> None:
        """Keeps the ranges disjoint: folds them all when one overlaps [start, stop)
        (chunks of another plan; rare)."""
        if any(a < stop and start < b for a, b in self._chunk_exceptions):
            self._fold()

    def _fold(self) -> None:
        """The ranges' exceptions into the whole list."""
        index, bits = self._exceptions
        outside = torch.ones_like(index, dtype=torch.bool)
        indices, values = [], []
        for (start, stop), (i, b) in self._chunk_exceptions.items():
            outside &= (index < start) | (index >= stop)
            indices.append(i + start)
            values.append(b)
        index, bits = torch.cat([index[outside], *indices]), torch.cat([bits[outside], *values])
        self._exceptions, self._chunk_exceptions = (index, bits), {}
        self._in_order = False

    @property
    def fingerprint(self):
        """Residual format: the model parameter's checksum (codecs.param_checksum) when
        last encoded; None when unknown."""
        if self._whole is None:
            return self._fingerprint
        return self._whole._chunk_fingerprints.get(self._range)

    @fingerprint.setter
    def fingerprint(self, value) -> None:
        # A whole encode or load makes the chunks' unknown, a chunk's encode the whole's.
        if self._whole is None:
            self._fingerprint, self._chunk_fingerprints = value, {}
        else:
            self._whole._fingerprint = None
            self._whole._chunk_fingerprints[self._range] = value

    @property
    def scratch(self) -> bool:
        """True when the working tensor is not itself the stored form."""
        return self.fmt != "fp32"

    def names(self, name: str) -> list[str]:
        """Names of the stored tensors of state entry `name` (for checkpoints)."""
        suffix = {"fp32": [""], "bf16": [":bf16"], "q8": [":q8codes", ":q8scales"],
                  "residual": [":residual"]}[self.fmt]
        return [name + s for s in suffix]

    def decode(self) -> torch.Tensor | None:
        """Decodes into the working tensor. Residual format: returns a device bool, True
        when the model parameter changed (see decode_residuals; the caller reads it, at
        once or after more work is queued); otherwise None."""
        w = self.flat_working
        if self.fmt == "bf16":
            w.copy_(self.tensors[0])
        elif self.fmt == "q8":
            codecs.q8_decode(self.tensors[0], self.tensors[1], w, self.kind)
        elif self.fmt == "residual":
            return decode_residuals([self])
        return None

    def encode(self) -> codecs.PendingExceptions | None:
        """Encodes the working tensor into the stored form. Residual format: returns its
        exceptions, pending (see encode_residuals); the caller passes them, finished
        (codecs.finish_exceptions), to set_exceptions(). None for the other formats."""
        w = self.flat_working
        if self.fmt == "bf16":
            self.tensors[0].copy_(w)
        elif self.fmt == "q8":
            codecs.q8_encode(w, self.tensors[0], self.tensors[1], self.kind)
        elif self.fmt == "residual":
            return encode_residuals([self])
        return None

    def set_exceptions(self, exceptions: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The exceptions of the residual encode() returned pending."""
        self.exceptions = exceptions


def residual_forms(buckets) -> list:
    """The residual masters' StoredForms of `buckets` (anything with `.forms`), in order."""
    return [f for b in buckets for f in b.forms if f.fmt == "residual"]


def params_changed_since_encoded(forms: list) -> torch.Tensor | None:
    """A 0-dim device bool: True when some residual form's model parameter differs from
    its fingerprint (its checksum when the residual was last encoded). None when there
    are no forms or some fingerprint is not known yet (state new or loaded). One kernel
    call for all of them on CUDA."""
    if not forms or any(f.fingerprint is None for f in forms):
        return None
    return codecs.params_changed([f.flat_model_param for f in forms],
                                 [f.fingerprint for f in forms])


def residual_masters(forms: list) -> codecs.ResidualMasters:
    """The residual forms' masters (working tensors, model parameters, residuals)."""
    return codecs.ResidualMasters([f.flat_working for f in forms],
                                  [f.flat_model_param for f in forms],
                                  [f.tensors[0] for f in forms])


def decode_residuals(forms: list, checksums: bool = True,
                     masters: codecs.ResidualMasters | None = None) -> torch.Tensor | None:
    """Decodes residual forms (a bucket's) into their working tensors: a device bool, True
    when some model parameter changed: it differs from the one its residual was encoded
    against (its checksum, where known and `checksums`: False where the caller checked
    them already), or is not the bf16 rounding of the rebuilt master. Changed behind the
    optimizer's back, the residual would rebuild wrong masters. None when there are no
    forms. One kernel call for all of them on CUDA. masters: residual_masters(forms),
    where the caller keeps it."""
    if not forms:
        return None
    masters = residual_masters(forms) if masters is None else masters
    return masters.rebuild(
        [f.exceptions_as_set for f in forms],
        [f.fingerprint if checksums else None for f in forms])


def encode_residuals(forms: list,
                     masters: codecs.ResidualMasters | None = None) -> codecs.PendingExceptions | None:
    """Encodes residual forms (a bucket's) from their working tensors: their exceptions,
    pending, one count per form in order; each form's fingerprint is its model
    parameter's checksum now. Until the exceptions are finished, the working tensors and
    model parameters must stay as they are. None when there are no forms. masters: as
    decode_residuals'."""
    if not forms:
        return None
    masters = residual_masters(forms) if masters is None else masters
    pending = codecs.PendingExceptions(masters, fingerprints=True)
    for f, fingerprint in zip(forms, pending.fingerprints):
        f.fingerprint = fingerprint
    return pending
