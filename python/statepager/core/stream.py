"""The bucket-streamed optimizer step: Pager.attach(optimizer).

An attached optimizer keeps its per-parameter state tensors (and its parameters, when
they are fp32 masters the pager owns) in the pager. step() walks buckets of parameters:
each bucket is paged in, stepped by the optimizer's own algorithm on just those
parameters, and paged out, while the next bucket is read and the previous one written.
A parameter whose state is larger than a bucket steps in chunks (statepager.core.slices),
consecutive buckets holding consecutive chunks: its pager tensors are made of pieces
(Pager.empty's pieces), so that a chunk pages alone. Which parameters step together is
statepager.core.plan's.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import time
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from statepager import _C
from statepager.core import interrupts, plan, slices, state_access, state_dict, support
from statepager.core.serial import lock_of, serialized
from statepager.core.atomic import AtomicStep, UndoCopies
from statepager.core.flat import flat_view
from statepager.core.late_reads import ExceptionCounts, ParamChecks
from statepager.core.step_stats import StepStats
from statepager.core.plan import Bucket
from statepager.formats.stored import (StoredForm, decode_residuals, encode_residuals,
                                       params_changed_since_encoded, residual_forms)
from statepager.formats import codecs
from statepager.formats.fused_adamw import FusedStep, applies_to

log = logging.getLogger("statepager")

MiB, GiB = 1 << 20, 1 << 30


@dataclass
class _Run:
    """One step's pipeline (StreamedOptimizer._start): its buckets as planned, what each
    one's page-in brings, and the page-ins and read-aheads in flight."""
    atomic: "AtomicStep | None"
    buckets: list
    before: dict                                  # the pager's stats() at the start
    t_start: float                                # time.monotonic() at the start
    stats: StepStats
    fused: list = field(default_factory=list)     # per bucket: _fused_forms()
    incoming: list = field(default_factory=list)  # per bucket: _incoming()
    sched: "_Schedule | None" = None
    read_ahead: int = 0                           # buckets read ahead past a page-in
    ins: dict = field(default_factory=dict)       # bucket index -> its page-in's handle
    aheads: dict = field(default_factory=dict)    # bucket index -> its read-ahead's handle
    fused_groups: tuple | None = None             # StreamedOptimizer._fused_groups()
    setup_seconds: float = 0.0                    # StepStats.setup_seconds, so far
    checked: bool = False                         # residual masters' params checked up front
    interrupts: "interrupts.Deferral | None" = None  # an atomic step's: polled per bucket


BucketHook = Callable[[Sequence[torch.Tensor]], None]
# Called with (param, start, stop) around the step of a chunk of a parameter: elements
# [start, stop) of it in memory order (statepager.core.slices).
ChunkHook = Callable[[torch.Tensor, int, int], None]


class StreamedOptimizer:
    """The binding between one optimizer and one pager (returned by Pager.attach)."""

    def __init__(self, pager, optimizer: torch.optim.Optimizer, *, bucket_size: int,
                 depth: int, log_steps: bool, before_bucket: BucketHook | None,
                 after_bucket: BucketHook | None, moments: str = "fp32", mains: str = "fp32",
                 model_param: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 name: str = "opt0",
                 keep_resident: Callable[[torch.Tensor], bool] | None = None,
                 atomic: bool = True, before_chunk: ChunkHook | None = None,
                 after_chunk: ChunkHook | None = None):
        # Pager.attach checked the arguments.
        if optimizer in _attached:
            raise _C.UsageError("this optimizer is already attached to a Pager")
        support.check_optimizer(optimizer)
        self.pager = pager
        self.optimizer = optimizer
        self.name = name
        self._resident = keep_resident or (lambda p: False)
        self.bucket_size = bucket_size
        self.depth = depth
        self.log_steps = log_steps
        self.before_bucket = before_bucket
        self.after_bucket = after_bucket
        self.before_chunk, self.after_chunk = before_chunk, after_chunk
        # Called with no arguments around each step's buckets (the Megatron adapter reads
        # its clip coefficient before, and knows the mains are copied after).
        self.before_step: Callable[[], None] | None = None
        self.after_step: Callable[[], None] | None = None
        # False within state_dict_by_reference().
        self.copies_state_dict = True
        self.moments, self.mains = moments, mains
        self._model_param = model_param
        self.last = StepStats()
        self._steps = 0
        self._begun: _Run | None = None  # begin_step()'s, until step() takes it up
        # Per parameter (by id): its paged state entries' StoredForms, by name, and what
        # they were found from (_tensor_key): forms() asks the pager again only when that
        # changed.
        self._forms: dict[int, dict[str, StoredForm]] = {}
        self._forms_from: dict[int, tuple] = {}
        # Parameters that step in chunks (by id): their chunks' (start, stop).
        self._split: dict[int, list[tuple[int, int]]] = {}
        self._counts: dict[int, dict] = {}  # in a step: counters of split params before it
        self._raw_step = _raw_step_function(optimizer)
        self._fused = FusedStep(self) if applies_to(optimizer) else None
        self._deferred = support.DeferredState.for_optimizer(optimizer)
        for i, group in enumerate(optimizer.param_groups):
            self.check_group(group, i)
        self.atomic = atomic
        self._undo = UndoCopies(pager, model_param if mains == "residual" else None)
        self._buckets = self._plan(to_store=False)  # a refused attach opens no store
        # Steady state creates and releases no physical pages: the pool keeps what the
        # pipeline's window of buckets needs.
        (bucket, held), window = self._window_parts(), self._window()
        budget = pager.stats()["budget_bytes"]  # None: no budget
        if budget is not None and window > budget:
            residual = (f" + the residual masters' scratch of {ExceptionCounts.LAG} buckets, "
                        f"held until their exceptions are counted ({held / MiB:.0f} MiB)"
                        if held else "")
            raise _C.UsageError(
                f"hbm_budget {budget / MiB:.0f} MiB cannot hold the step's pipeline: depth "
                f"{depth} x the largest bucket ({bucket / MiB:.0f} MiB with its page "
                f"rounding){residual} = {window / MiB:.0f} MiB. Raise hbm_budget, or lower "
                "depth or bucket_size (a parameter whose state is larger than bucket_size "
                "steps in chunks of at most bucket_size, of 262144 elements at least; it is a "
                "bucket of its own when its optimizer is not Adam's, when bucket hooks come "
                "without chunk hooks, or when its pager tensor was made without "
                "Pager.empty(pieces=...)).")
        pager.keep_at_least(window)
        self._warn_if_the_host_tier_spills()
        for b in self._buckets:
            self._to_store(b)
        self._adopt_existing_state()
        _attached.add(optimizer)
        # The optimizer's methods below refer to this binding (a reference cycle, which the
        # garbage collector frees with the optimizer).
        step = torch.optim.Optimizer.profile_hook_step(functools.partial(_paged_step, self))
        # LR schedulers wrap step() to notice it ran; ours sets the same flag
        # (_opt_called), so mark it the way theirs is marked.
        step._wrapped_by_lr_sched = True
        optimizer.step = types.MethodType(step, optimizer)
        optimizer.state_dict = types.MethodType(_paged_state_dict, self)
        optimizer.load_state_dict = types.MethodType(_paged_load_state_dict, self)
        optimizer.add_param_group = functools.partial(_paged_add_param_group, self)
        optimizer.zero_grad = functools.partial(_paged_zero_grad, self, optimizer.zero_grad)
        state_access.wrap(self)  # its state readable between steps

    # -- setup ---------------------------------------------------------------------

    def check_group(self, group: dict, index: int) -> None:
        """Refuses (UsageError) a param group whose state the pager cannot hold."""
        support.check_group(group, index, self.pager.device, self._resident)

    def params_in_order(self) -> list:
        """The optimizer's parameters in the order torch's state_dict numbers them (and
        checkpoints do)."""
        seen, out = set(), []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def resident(self, p) -> bool:
        """True for parameters whose state stays in ordinary memory (keep_resident)."""
        return self._resident(p)

    def forms(self, p) -> list[tuple[str, StoredForm]]:
        """(name, form) of parameter p's paged tensors, in a stable order; 'param' is the
        parameter itself when the pager owns it (an fp32 master)."""
        state = _held(self.optimizer, p, {})
        found_from = (id(p) in self._split, _tensor_key(p),
                      tuple((name, _tensor_key(v)) for name, v in state.items()))
        if self._forms_from.get(id(p)) == found_from:
            return list(self._forms[id(p)].items())
        known = self._forms.get(id(p), {})
        forms = {}
        for name, v in state.items():
            if isinstance(v, torch.Tensor) and self.pager.owns(v):
                forms[name] = self._form(p, name, v, self.moments, known.get(name))
        if self.pager.owns(p):
            forms["param"] = self._form(p, "param", p, self.mains, known.get("param"))
        self._forms[id(p)] = forms  # entries no longer in the state are let go
        self._forms_from[id(p)] = found_from
        return list(forms.items())

    def _form(self, p, name: str, working: torch.Tensor, fmt: str,
              form: StoredForm | None) -> StoredForm:
        split = id(p) in self._split
        if form is None or form.working is not working or (form.bounds is not None) != split:
            kind = "nonneg" if "sq" in name else "signed"
            model = self._model_param(p) if fmt == "residual" and self._model_param else None
            bounds = slices.chunk_bounds(working.numel(), slices.CHUNK_ALIGN) if split else None
            form = StoredForm(self.pager, working, fmt, kind, model, bounds)
        return form

    def empty_state_like(self, p, t: torch.Tensor, dtype: torch.dtype | None = None):
        """A pager tensor for state of parameter p shaped and laid out as t (Pager.
        empty_like), in pieces when p steps in chunks."""
        pieces = None
        if id(p) in self._split:
            size = torch.empty((), dtype=dtype or t.dtype).element_size()
            pieces = slices.pieces(t.numel(), size)
        return self.pager.empty_like(t, dtype=dtype, pieces=pieces)

    def _fill(self, b: Bucket, to_store: bool = True) -> None:
        b.chunk_forms = [{name: f.chunk(c.start, c.stop) for name, f in self.forms(c.param)}
                         for c in b.chunks]
        b.forms = [f for p in b.params for _, f in self.forms(p)]
        b.forms += [f for named in b.chunk_forms for f in named.values()]
        b.stored = [t for f in b.forms for t in f.tensors]
        if to_store:
            self._to_store(b)
        b.working = [f.working for f in b.forms if f.scratch]
        b.undo = self._undo.copies(b.params, b.chunks) if self.atomic else []
        b.fused = self._fused_forms(b)
        b.incoming = self._incoming(b, b.fused)
        b.nbytes, b.stored_bytes = _bytes(b.incoming), _bytes(b.stored)

    def _to_store(self, b: Bucket) -> None:
        if b.stored:  # this binding's own store (directory/<name>/), opened on first use
            self.pager.move_to_store(b.stored, self.name)

    def _layout(self) -> list:
        """What a plan is made for: the parameters of each param group, by identity."""
        return [[id(p) for p in g["params"]] for g in self.optimizer.param_groups]

    def _planned_bytes(self, p, group: dict, at_rest: bool = False) -> int:
        """Bytes p's paged tensors map while its bucket steps (moments the fused step
        reads in their stored form without their fp32 scratch), or with at_rest the bytes
        their stored forms take at rest: its state in the pager or to be adopted into it;
        for state yet to be created, an estimate (the optimizer's count of param-shaped
        tensors, else 2)."""
        if self._resident(p):
            return 0
        scratch = not (self._fused and self._fused.may_step(group, p))

        def size(t, fmt, scratch=scratch):
            return _stored_bytes(t, fmt) if at_rest else _form_bytes(t, fmt, scratch)

        state = _held(self.optimizer, p, {})
        nbytes = sum(size(v, self.moments) for v in state.values()
                     if self.pager.owns(v) or support.pageable(v, p))
        if self.pager.owns(p):
            nbytes += size(p, self.mains, True)
        if not state:
            count = self._deferred.moments(group) if self._deferred else 2
            nbytes += count * size(p, self.moments)
        return nbytes

    def stored_bytes(self) -> int:
        """The bytes the state takes at rest (its stored forms; state yet to be created
        estimated as the plan estimates it)."""
        return sum(self._planned_bytes(p, g, at_rest=True)
                   for g in self.optimizer.param_groups for p in g["params"])

    def _warn_if_the_host_tier_spills(self) -> None:
        """An atomic step writes fresh ranges and frees the committed ones at commit (Note
        [Atomic steps need twice the state in the host tier] in docs/design.md): a host
        tier smaller than twice the state spills to the store at every step. Said at
        attach, with the fix, rather than found in the step's time."""
        host = self.pager.stats()["host_budget_bytes"]
        stored = self.stored_bytes()
        if not self.atomic or not host or 2 * stored <= host:
            return
        warnings.warn(
            f"statepager: optimizer {self.name!r} keeps about {stored / GiB:.2f} GiB at rest; "
            f"an atomic step needs twice that in the host tier ({2 * stored / GiB:.2f} GiB), "
            f"which has {host / GiB:.2f} GiB: about {(2 * stored - host) / GiB:.2f} GiB spill "
            "to the store at every step. Raise host_budget, or attach(atomic=False) (a step "
            "that fails then leaves the state partly stepped).", stacklevel=4)

    def _plan(self, to_store: bool = True) -> list[Bucket]:
        """The buckets for the param groups as they are now (statepager.core.plan), filled
        (their stored tensors moved to this binding's store unless to_store=False).
        Small parameters are dealt unless resident; where the fused step runs some, only
        those it runs (another would turn off the fused step of each bucket it joined)."""
        groups = self.optimizer.param_groups
        fused = self._fused and {id(p) for g in groups for p in g["params"]
                                 if self._fused.may_step(g, p)}

        def dealable(p, group: dict) -> bool:
            return not self._resident(p) and (not fused or id(p) in fused)

        buckets, self._split = plan.plan(groups, self.bucket_size, self._planned_bytes,
                                         self._chunking, dealable)
        for b in buckets:
            self._fill(b, to_store)
        self._planned_layout = self._layout()
        return buckets

    def _chunking(self, p, nbytes: int) -> list[tuple[int, int]] | None:
        """The chunks p steps in when its `nbytes` are more than a bucket and it can: the
        optimizer's step is Adam's, bucket hooks have chunk hooks beside them, and p's
        pager tensors (the parameter when the pager owns it, and its state) are made of
        pieces (slices.pieces) or not made yet. None: p is a bucket of its own."""
        if nbytes <= self.bucket_size or p.numel() <= slices.CHUNK_ALIGN or self._resident(p):
            return None
        if not slices.sliceable(self.optimizer) or self._deferred is None:
            return None
        if (self.before_bucket and not self.before_chunk) or \
                (self.after_bucket and not self.after_chunk):
            return None
        if any(f.bounds is None and f.scratch for f in self._forms.get(id(p), {}).values()):
            return None  # stored whole already
        made = [p] if self.pager.owns(p) else []
        made += [v for v in _held(self.optimizer, p, {}).values() if self.pager.owns(v)]
        if not all(self.pager.pieces(t) == slices.pieces(t.numel(), t.element_size())
                   for t in made):
            return None
        bounds = slices.chunk_bounds(p.numel(), self.bucket_size * p.numel() // nbytes)
        return bounds if len(bounds) > 1 else None

    def params_by_bucket(self) -> list[list]:
        """Per bucket, the parameters it steps, one that steps in chunks in the bucket of
        its first chunk (the order checkpoints list their tensors in)."""
        return [b.params + [c.param for c in b.chunks if c.start == 0] for b in self.buckets]

    def _whole_buckets(self):
        """The buckets, each parameter that steps in chunks as a bucket of its own, whole
        (for state_dict(), load_state_dict() and checkpoints through the device, which
        read and write whole state entries: one such parameter's state is resident at
        once, beyond the step's window)."""
        self.end_begun_step()
        groups = self.optimizer.param_groups
        for b in self.buckets:
            if not b.chunks:
                yield b
                continue
            if b.params:
                whole = Bucket(params=b.params, groups=b.groups)
                self._fill(whole)
                yield whole
            for c in b.chunks:
                if c.start == 0:
                    whole = Bucket(params=[c.param], groups=[[] for _ in groups])
                    whole.groups[c.group].append(c.param)
                    self._fill(whole)
                    yield whole

    @property
    def window_bytes(self) -> int:
        """Physical bytes the step maps at most; the pool keeps them between steps."""
        return self._window()

    def _window(self) -> int:
        """Physical bytes the step's pipeline maps at most (_window_parts)."""
        bucket, held = self._window_parts()
        return self.depth * bucket + held

    def _window_parts(self) -> tuple[int, int]:
        """The largest bucket with its page rounding, of which `depth` are in the pipeline,
        and the residual masters' scratch of the last ExceptionCounts.LAG buckets stepped."""
        page = self.pager.page_size
        largest = max((max(b.nbytes, b.planned) for b in self._buckets), default=0)
        held = max((_bytes(f.working for f in b.forms if f.fmt == "residual")
                    for b in self._buckets), default=0)
        return largest + 2 * page, ExceptionCounts.LAG * (held + 2 * page) if held else 0

    @property
    @serialized
    def buckets(self) -> list[Bucket]:
        """The plan for the param groups as they are now: groups added, removed or changed
        since the last plan (add_param_group, direct edits) are planned anew, so they are
        streamed from the next step on."""
        self._plan_anew_if_changed()
        return self._buckets

    def _plan_anew_if_changed(self) -> None:
        """Plans the buckets anew when the param groups changed since the last plan (a step
        begun on that plan ends first)."""
        if self._layout() != self._planned_layout:
            self.end_begun_step()
            for i, group in enumerate(self.optimizer.param_groups):
                self.check_group(group, i)
            self._buckets = self._plan()
            self.pager.keep_at_least(self._window())

    @serialized
    def state_changed(self) -> None:
        """Paged state entries were added or replaced outside a step (a checkpoint load):
        the buckets take them in."""
        self.end_begun_step()
        for b in self.buckets:
            self._fill(b)
        self.pager.keep_at_least(self._window())

    def forms_kept(self) -> Callable[[], None]:
        """For a change of the state that may fail midway (load_state_dict): the returned
        callable puts back the stored forms of now (which form holds each state entry,
        and the residual ones' exception lists and fingerprints; their bytes are the
        caller's to put back, by a pager epoch) once the state entries are as now again,
        and fills the buckets with them."""
        forms, found_from = dict(self._forms), dict(self._forms_from)
        residual = [(f, f.exceptions_as_set, f.fingerprint) for named in forms.values()
                    for f in named.values() if f.fmt == "residual"]

        def put_back() -> None:
            self._forms, self._forms_from = forms, found_from
            for f, exceptions, fingerprint in residual:
                f.exceptions, f.fingerprint = exceptions, fingerprint
            self.state_changed()
        return put_back

    def _adopt_existing_state(self) -> None:
        """State that already exists in ordinary memory moves into the pager as a load of
        it would (state_dict.adopt_state): in the step's pieces, all or nothing."""
        if any(support.pageable(v, p) and not self.pager.owns(v)
               for p in self.params_in_order() if not self._resident(p)
               for v in _held(self.optimizer, p, {}).values()):
            state_dict.adopt_state(self)

    def _fill_chunked(self) -> None:
        """Fills the buckets holding chunks anew, after their whole buckets
        (_whole_buckets) took in new state."""
        for b in self.buckets:
            if b.chunks:
                self._fill(b)

    @torch.no_grad()
    def _adopt(self, bucket: Bucket) -> bool:
        """Moves the bucket's state tensors that are not in the pager into it (resident),
        each in the memory layout it had."""
        moved = False
        known = {id(f.working) for f in bucket.forms}  # already paged: skip the lookups
        for p in bucket.params:
            state = _held(self.optimizer, p)
            if not state or self._resident(p):
                continue
            for name, v in list(state.items()):
                if id(v) not in known and support.pageable(v, p) and not self.pager.owns(v):
                    paged = self.empty_state_like(p, v)
                    self.pager.page_in(paged)
                    paged.copy_(v)
                    state[name] = paged
                    moved = True
        return moved

    def _create_deferred_state(self, bucket: Bucket) -> bool:
        """The state the optimizer's step would create now for the bucket's parameters
        that got their first gradient, created in the pager (support.DeferredState)."""
        if self._deferred is None:
            return False
        created = False
        groups = self.optimizer.param_groups
        for group, params in zip(groups, bucket.groups):
            for p in params:
                if not self._resident(p):
                    created |= self._deferred.create(group, p, self.pager.empty_like)
        for c in bucket.chunks:
            created |= self._deferred.create(groups[c.group], c.param,
                                             functools.partial(self.empty_state_like, c.param))
        return created

    # -- residency of one bucket ---------------------------------------------------

    def _incoming(self, b: Bucket, fused: list | None) -> list:
        """What a bucket's page-in brings in the step: its stored forms and the scratch
        its decode fills (zero-filled, nothing read): not that of moments the fused step
        reads in their stored form (`fused`: _fused_forms(b)). Paged in with
        the rest, the scratch costs the step no wait of its own (a page-in is a round trip
        through the I/O thread, its zero fill queued behind the next bucket's copies)."""
        if not b.working:
            return b.stored
        fused = {id(f) for f in fused or ()}
        scratch = [f.working for f in b.forms if f.scratch and id(f) not in fused]
        return b.stored + scratch

    def _fused_forms(self, b: Bucket):
        """The moment forms the fused step reads in their stored form, or None where it
        does not step the bucket."""
        return self._fused.moment_forms(b) if self._fused else None

    def _decode(self, b: Bucket, check_params: bool = True, skip=(),
                checks: ParamChecks | None = None) -> None:
        """Decodes the bucket's stored forms (but those in `skip`) into fp32 working
        tensors. Residual masters are checked against their model params (checksum and
        rounding): now (a device sync), the bucket not stepped if any changed, or, given
        `checks`, at the end of the step (an atomic step, rolled back if any changed)."""
        skip = {id(s) for s in skip}
        forms = [f for f in b.forms if id(f) not in skip]
        working = [f.working for f in forms if f.scratch]
        if working:
            self.pager.page_in(working)  # zero-filled scratch; in already when _incoming
        for f in forms:
            if f.fmt != "residual":
                f.decode()
        # Without check_params nobody reads `changed`: the params' checksums are skipped.
        changed = decode_residuals([f for f in forms if f.fmt == "residual"], check_params)
        if changed is None or not check_params:
            return
        if checks is not None:
            checks.add(changed)
        elif changed.item():
            ParamChecks.refuse()

    def _encode(self, b: Bucket, skip=()) -> list:
        """Encodes the bucket's stored forms (but those in `skip`). Returns the residual
        masters' exceptions, pending, as [(forms, codecs.PendingExceptions)] (empty
        without residual masters): until they are finished, the bucket's scratch must
        stay as it is."""
        skip = {id(s) for s in skip}
        forms = [f for f in b.forms if id(f) not in skip]
        for f in forms:
            if f.fmt != "residual":
                f.encode()
        residual = [f for f in forms if f.fmt == "residual"]
        return [(residual, encode_residuals(residual))] if residual else []

    def _encode_now(self, b: Bucket) -> None:
        """_encode, its exception counts read at once (one device sync for the bucket)."""
        for forms, pending in self._encode(b):
            for f, exceptions in zip(forms, codecs.finish_exceptions([pending])):
                f.set_exceptions(exceptions)

    def _release(self, b: Bucket, wait: bool = True, keep=(), reuse_after: int = 0) -> list:
        """Pages the stored form out and drops the scratch but `keep`; returns the
        handles. reuse_after: see Pager.page_out_async."""
        handles = [self.pager.page_out_async(b.stored, reuse_after)]
        kept = {id(k) for k in keep}  # a set: a bucket of many small parameters holds many
        drop = [t for t in b.working if id(t) not in kept]
        if drop:
            handles.append(self.pager.discard_async(drop))
        if wait:
            for h in handles:
                h.wait()
        return handles

    def state_in_buckets(self, rebuild_mains: bool = False, write: bool = True):
        """Yields each bucket with its state resident and decoded to fp32; encodes and
        pages it out again afterwards. The caller may replace the bucket's parameters'
        state entries by resident pager tensors of its own: they are stored from then on.
        rebuild_mains: the caller overwrites the masters from changed model params, so
        their stored form is not checked against them. write=False: the caller only
        reads; nothing is encoded, and the stored forms go back to their bytes at rest
        without any write (Pager.release_unchanged_async). A parameter that steps in
        chunks comes whole, in a bucket of its own."""
        for b in self._whole_buckets():
            self.pager.page_in_async(b.stored, for_read=not write).wait()
            self._decode(b, check_params=not rebuild_mains)
            try:
                yield b
            finally:
                if write:
                    self._fill(b)  # the caller's new tensors and their stored forms
                    self.pager.page_in(b.stored + b.working)
                self._hand_back(b, write)
        if write:
            self._fill_chunked()

    def state_in_pieces(self, write: bool = False):
        """Yields (param, start, stop, entries) bucket by bucket as the step pages them, a
        parameter that steps in chunks chunk by chunk: entries maps each of the
        parameter's paged state entries ("param" for an fp32 master the pager owns) to a
        resident flat view of its fp32 values of elements [start, stop) in memory order
        (0 and its numel where it steps whole). Within the step's window, so within any
        budget attach accepted. write=False: the caller only reads; nothing is encoded or
        written, the stored forms go back to their bytes at rest
        (Pager.release_unchanged_async). write=True: the caller may write the views; each
        bucket's forms are made from the state entries as they are (pager tensors the
        caller put there are stored from then on), and it is encoded and paged out after.
        See Note [Reads and loads in the step's pieces] in docs/design.md."""
        self.end_begun_step()
        for b in self.buckets:
            if write:
                self._fill(b)
            self.pager.page_in_async(b.stored, for_read=not write).wait()
            try:
                self._decode(b)
                for p in b.params:
                    entries = {name: flat_view(f.working) for name, f in self.forms(p)}
                    if entries:
                        yield p, 0, p.numel(), entries
                for c, named in zip(b.chunks, b.chunk_forms):
                    yield c.param, c.start, c.stop, {n: f.working for n, f in named.items()}
            finally:
                self._hand_back(b, write)

    def _hand_back(self, b: Bucket, written: bool) -> None:
        """A bucket paged in and decoded outside the step, given back: encoded and paged
        out where it was written; else its stored forms back to their bytes at rest
        without any write (Pager.release_unchanged_async) and its scratch dropped."""
        if written:
            self._encode_now(b)
            self._release(b)
            return
        handles = [self.pager.release_unchanged_async(b.stored)]
        if b.working:  # the decoded scratch
            handles.append(self.pager.discard_async(b.working))
        for h in handles:
            h.wait()

    @contextlib.contextmanager
    def state_dict_by_reference(self):
        """Within it, the optimizer's state_dict() is torch's own: its state entries are
        the live paged tensors, not read (for callers that keep only the rest, such as
        Megatron's DistributedOptimizer.state_dict)."""
        self.copies_state_dict = False
        try:
            yield
        finally:
            self.copies_state_dict = True

    def stored_in_buckets(self):
        """Yields each bucket with its stored form resident (no decoding), for a caller
        that only reads it: it goes back to its bytes at rest without any write
        (Pager.release_unchanged_async). A parameter that steps in chunks comes whole, in a
        bucket of its own."""
        for b in self._whole_buckets():  # which ends a begun step first
            self.pager.page_in_async(b.stored, for_read=True).wait()
            try:
                yield b
            finally:
                self.pager.release_unchanged_async(b.stored).wait()

    # -- the step ------------------------------------------------------------------

    @serialized
    def prepare_step(self) -> None:
        """Called where the next step's grads are being made (the optimizer's zero_grad(),
        and Megatron's): an atomic step's undo copies of residual masters' model
        parameters are taken now, while the device runs forward and backward, instead of
        within the step (statepager.core.atomic). A step begun and not taken up (a
        skipped step) ends first."""
        self.end_begun_step()
        if self.atomic and self.mains == "residual":
            self._undo.take_before_step(self.buckets)

    @serialized
    def step_buckets(self) -> None:
        """One step, all or nothing when atomic: a step that raises has changed nothing
        (statepager.core.atomic), and a retry steps once. before_step and after_step, when
        set, run before the first bucket and after the last (not after a failed step)."""
        if self.before_step:
            self.before_step()
        self._step_all()
        if self.after_step:
            self.after_step()

    @serialized
    def begin_step(self) -> None:
        """Starts the next step's first page-ins now, so that they overlap what runs
        before the step (Megatron's grad norm and clipping: the adapter calls it once
        the grads are ready); step() takes them up. Atomic steps only: their pager epoch
        opens now, so a begun step that no step() takes up ends (end_begun_step) without
        writing a byte. Until then, whatever else reads or changes the state ends it
        first (state_dict(), checkpoints, pause(), another binding's step on the same
        Pager: one step is begun per Pager at a time). Nothing changes when the page-ins
        cannot start (a budget too small, a device error): step() meets the problem
        again and reports it, rolled back."""
        if self._begun is not None or not self.atomic or self.pager.paused:
            return
        self._end_others_begun()
        self.pager.reads.release()  # their room is the step's
        t0, run = time.monotonic(), None
        held = interrupts.Deferral()  # a Ctrl-C comes at poll(), or once this has ended
        try:
            try:
                step = AtomicStep(self, self._undo, self._mirror())
            except Exception as error:
                log.debug("statepager %s: begin_step() left to step() (%r)", self.name, error)
                return
            try:
                run = self._start(step)
                run.setup_seconds = time.monotonic() - t0
                held.poll()
                self._begun = run  # last: from here on the begun step is ended as such
            except BaseException as error:
                _end(step, run)
                if not isinstance(error, Exception):  # an interrupt: after the epoch is closed
                    raise
                log.debug("statepager %s: begin_step() left to step() (%r)", self.name, error)
        finally:
            held.release()

    @property
    def begun(self) -> bool:
        """True from begin_step() until step() takes the begun step up or it is ended."""
        return self._begun is not None

    @serialized
    def end_begun_step(self) -> None:
        """Ends a step that begin_step() began and no step() took up: its page-ins are
        waited for and their pages dropped, nothing written. Lets go of the state read
        since the last step (statepager.core.state_access)."""
        self.pager.reads.release()
        if self._begun is None:
            return
        with interrupts.deferred():
            run, self._begun = self._begun, None
            _end_run(run)

    def _end_others_begun(self) -> None:
        """Ends the other bindings' begun steps on this Pager: their page-ins would take
        this step's room and count in its stats."""
        for binding in self.pager.bindings:
            if binding is not self:
                binding.end_begun_step()

    def _mirror(self):
        """What AtomicStep rewrites from restored fp32 masters: their model parameters."""
        return self._model_param if self.mains == "fp32" else None

    def _step_all(self) -> None:
        t0 = time.monotonic()
        self._plan_anew_if_changed()
        self._end_others_begun()
        self.pager.reads.release()  # their room is the step's
        run = self._begun
        if run is not None and (not self.atomic or run.fused_groups != self._fused_groups()):
            self.end_begun_step()  # begun as atomic, or with param groups the fused step differs on
        if not self.atomic:
            checked = self._params_checked_up_front()
            run = self._start(None)
            run.checked, run.setup_seconds = checked, time.monotonic() - t0
            self._finish(self._stream(run))
            return
        self._step_atomic(t0)

    def _step_atomic(self, t0: float) -> None:
        """All or nothing (statepager.core.atomic), a KeyboardInterrupt included: SIGINT is
        held (statepager.core.interrupts) for the whole step and delivered where a failure
        is undone (after the epoch opens, between buckets, before the commit) or once the
        step is whole, so that a Ctrl-C never splits opening the epoch from the try that
        ends it, the commit from its bookkeeping, or an undo."""
        held = interrupts.Deferral()
        try:
            run, self._begun = self._begun, None
            step = run.atomic if run is not None else AtomicStep(self, self._undo, self._mirror())
            snapshot = False
            try:
                held.poll()
                step.snapshot()
                snapshot = True
                if run is None:
                    run = self._start(step)
                run.setup_seconds += time.monotonic() - t0
                run.interrupts = held
                stats = self._stream(run)
                held.poll()
                t1 = time.monotonic()
                step.commit()
            except BaseException as error:
                self._undo_step(step, run, snapshot, error)
                raise
            stats.commit_seconds = time.monotonic() - t1
            self._finish(stats)
        finally:
            held.release()

    def _undo_step(self, step: AtomicStep, run: "_Run | None", snapshot: bool,
                   error: BaseException) -> None:
        """After `error`: everything as before the step (its epoch aborted; once its
        snapshot is taken, what it changed in ordinary memory put back)."""
        if not snapshot:
            _end(step, run)
            return
        try:
            step.roll_back()
            for b in self.buckets:  # without the state the failed step created
                self._fill(b)
        except BaseException as failed:
            error.add_note(f"statepager: undoing the failed step failed too ({failed!r}): "
                           "the optimizer state may be partly stepped")

    def _finish(self, stats: StepStats) -> None:
        """A step done: its stats are the last, and logged."""
        self._steps += 1
        self.last = stats
        if self.log_steps:
            log.info("statepager %s", stats.summary())

    @serialized
    def known_form(self, p, name: str, value: torch.Tensor) -> StoredForm | None:
        """The StoredForm of p's state entry `name`, whose working tensor is `value`, where
        p's state is paged by this binding; None otherwise."""
        if id(p) not in self._forms:
            return None
        form = dict(self.forms(p)).get(name)
        return form if form is not None and form.working is value else None

    def _params_checked_up_front(self) -> bool:
        """An in-place step's residual checks, every bucket's at once before any bucket
        steps: a model parameter changed since its master was encoded (its fingerprint)
        is refused here, with nothing written, and the host waits for the device once
        per step instead of once per bucket. True when done; False where some master's
        fingerprint is not known yet (its state new, or loaded), whose bucket's decode
        then checks it before the bucket steps, as before."""
        changed = params_changed_since_encoded(residual_forms(self.buckets))
        if changed is None:
            return False
        if bool(changed):
            ParamChecks.refuse()
        return True

    def _start(self, atomic: AtomicStep | None) -> "_Run":
        """A step's pipeline, its first page-ins issued (the rest as buckets step)."""
        pager, buckets = self.pager, self.buckets
        before = pager.stats()
        pager.reset_peak()
        run = _Run(atomic=atomic, buckets=buckets, before=before, t_start=time.monotonic(),
                   stats=StepStats(step=self._steps + 1, buckets=len(buckets)),
                   fused_groups=self._fused_groups())
        # Which moments the fused step reads as stored, per bucket: what its page-in
        # brings and how it steps (a bucket that creates state finds out again).
        run.fused = [self._fused_forms(b) for b in buckets]
        incoming = [(b.incoming, b.nbytes) if f == b.fused else
                    (x := self._incoming(b, f), _bytes(x)) for b, f in zip(buckets, run.fused)]
        run.incoming = [x for x, _ in incoming]
        named_in = [n for _, n in incoming]
        scratch = [m - b.stored_bytes for m, b in zip(named_in, buckets)]
        run.sched = _Schedule(named_in, scratch, self._ahead())
        # With a host tier, the `depth` buckets past the page-ins in flight are read from
        # the store into free host room (bounded by it: the pager never makes room for a
        # read-ahead), so that their page-in is a copy from host memory that never waits
        # for a file read it could have started earlier. Only that far: the room a
        # read-ahead holds until its page-in is room the buckets stepped meanwhile
        # cannot keep. None where the store's files lie in RAM, mapped for the device
        # (map_ram): a page-in from them is a copy from host memory already, and a
        # read-ahead only adds the kernel's copy into host room, which that page-in then
        # waits for (at half the host budget on the H200, 0.88 GB of the atomic step's
        # 2.22 GB read went that way).
        mapped = before["store_mapped_bytes"] > 0
        run.read_ahead = self.depth if before["host_budget_bytes"] and not mapped else 0
        try:
            for j in range(min(self._ahead() + 1, len(buckets))):
                self._page_in(run, j)
        except BaseException:
            _settle(list(run.ins.values()) + list(run.aheads.values()))
            raise
        return run

    def _fused_groups(self) -> tuple | None:
        """What decides, per param group, whether the fused step may run it (None without
        it): a step begun under other options starts again."""
        return self._fused.groups_key() if self._fused else None

    def _ahead(self) -> int:
        """Page-ins in flight beyond the bucket stepping (the rest of the window: the
        bucket stepping and the page-outs)."""
        return max(1, self.depth - 2)

    def _page_in(self, run: "_Run", j: int) -> None:
        """Issues bucket j's page-in, and the read-aheads past it."""
        pager, buckets, aheads = self.pager, run.buckets, run.aheads
        run.ins[j] = pager.page_in_async(run.incoming[j])
        for k in range(max(j + 1, max(aheads, default=0) + 1),
                       min(j + run.read_ahead + 1, len(buckets))):
            aheads[k] = pager.read_ahead_async(buckets[k].stored)

    def _stream(self, run: "_Run") -> StepStats:
        """Runs the step's pipeline; returns its stats (the caller's once the step is
        whole)."""
        pager, buckets, n = self.pager, run.buckets, len(run.buckets)
        atomic, fused, stats, sched, ins = run.atomic, run.fused, run.stats, run.sched, run.ins
        # Optimizers that count steps per param group (TE's and apex's FusedAdam) must
        # advance the count once per step, not once per bucket.
        self._group_steps = [g.get("step", _ABSENT) for g in self.optimizer.param_groups]
        self._group_steps_after = list(self._group_steps)
        self._counts = {}
        ahead = self._ahead()
        outs = collections.deque()  # per bucket stepped, its page-out handles
        done_in, done_out, stepping = [], [], []
        counting = ExceptionCounts(pager)  # the exceptions of the buckets stepped last
        checks = ParamChecks() if atomic else None
        trace = _C.TraceRange()  # each bucket's step on profilers' timelines (NVTX)
        t_loop = time.monotonic()
        try:
            for i, b in enumerate(buckets):
                if run.interrupts is not None:
                    run.interrupts.poll()  # a Ctrl-C fails the step here
                t0 = time.monotonic()
                h = ins.pop(i)
                h.wait()
                done_in.append(h)
                t1 = time.monotonic()
                counting.read()  # bucket i - LAG's, before bucket i's work is queued
                if atomic and i == 0:  # undo copies a bucket ahead, the first's own first
                    atomic.take_ahead(b)
                if atomic and i + 1 < n:
                    atomic.take_ahead(buckets[i + 1])
                trace.start(f"step bucket {i}", "step")
                pending = self._step_bucket(b, atomic, checks, fused[i], run.checked)
                trace.end()
                t2 = time.monotonic()
                stepping.append((t1, t2))
                stats.wait_in_seconds += t1 - t0
                stats.compute_seconds += t2 - t1
                held = counting.hold(pending)  # before anything else can fail
                handles = self._release(b, wait=False, keep=held,
                                        reuse_after=sched.reuse_after(i))
                outs.append(handles)
                done_out.append(handles[0])
                j = i + ahead + 1
                if j < n:
                    t0 = time.monotonic()
                    while len(outs) + len(ins) >= self.depth:
                        for h in outs.popleft():
                            h.wait()
                    # Queued behind bucket i - 1's work, whose page-out was just waited for.
                    counting.wait_let_go()
                    stats.wait_out_seconds += time.monotonic() - t0
                    self._page_in(run, j)
            t0 = time.monotonic()
            counting.read(keep=0)
            if checks:
                checks.verify()
            for h in [h for handles in outs for h in handles]:
                h.wait()
            counting.wait_let_go()
            # Done by now (their page-ins waited for them). One that failed left its tensors
            # in the store, whose page-in then read them (or failed the step itself).
            _settle(run.aheads.values())
        except BaseException as error:
            with interrupts.deferred():  # nothing left in flight, an interrupt notwithstanding
                try:  # a stepped bucket's exceptions are its stored form's: never left unread
                    counting.read(keep=0)
                except BaseException as failed:
                    error.add_note(f"statepager: reading a stepped bucket's residual "
                                   f"exceptions failed too ({failed!r}): its masters may "
                                   "not decode")
                _settle(list(ins.values()) + [h for handles in outs for h in handles]
                        + counting.handles + list(run.aheads.values()))
            raise
        for g, counter in zip(self.optimizer.param_groups, self._group_steps_after):
            _set_counter(g, counter)
        pager.keep_at_least(self._window())  # state created in this step
        t_end = time.monotonic()
        stats.wait_out_seconds += t_end - t0
        stats.seconds = t_end - run.t_start
        stats.setup_seconds, stats.loop_seconds = run.setup_seconds, t_end - t_loop
        after = pager.stats()
        stats.bytes_read = after["bytes_read"] - run.before["bytes_read"]
        stats.bytes_written = after["bytes_written"] - run.before["bytes_written"]
        stats.peak_mapped_bytes = after["peak_mapped_bytes"]
        stats.set_io_times([h.times for h in done_in], [h.times for h in done_out])
        stats.timeline = [(b.nbytes, i.times, s, o.times)
                          for b, i, s, o in zip(buckets, done_in, stepping, done_out)]
        return stats

    def _step_bucket(self, bucket: Bucket, atomic: AtomicStep | None,
                     checks: ParamChecks | None, fused: list | None,
                     checked: bool = False) -> list:
        """Steps one bucket, its residual masters' checks left to `checks` where given,
        skipped where `checked` (up front); `fused` is _fused_forms(bucket). Returns the
        bucket's pending exceptions (StreamedOptimizer._encode)."""
        # The fused step (statepager.formats.fused_adamw) reads and writes the moments in their
        # stored form: they are not decoded unless it turns out not to apply.
        self._decode(bucket, not checked, skip=fused or (), checks=checks)
        if atomic:
            atomic.save(bucket)
        if self.before_bucket:
            self.before_bucket(bucket.params)
        for c in bucket.chunks if self.before_chunk else ():
            self.before_chunk(c.param, c.start, c.stop)
        if self._create_deferred_state(bucket) or self._chunks_got_state(bucket):
            self._fill(bucket)
            fused = self._fused_forms(bucket)
            # Their new state is zero: paged in zero-filled, nothing read (decoded, where
            # the fused step does not read the moments as stored, by the same zero fill).
            self.pager.page_in(bucket.stored + (bucket.working if fused is None else []))
        if fused is not None and self._fused.ready(bucket):
            self._fused.step(bucket, fused)
        else:
            if fused:
                moments = {id(f) for f in fused}
                self._decode(bucket, skip=[f for f in bucket.forms if id(f) not in moments],
                             checks=checks)
            fused = None
            self._raw_step_bucket(bucket)
        if atomic:
            atomic.writing(bucket)
        if self.after_bucket:
            self.after_bucket(bucket.params)
        for c in bucket.chunks if self.after_chunk else ():
            self.after_chunk(c.param, c.start, c.stop)
        return self._encode(bucket, skip=fused or ())

    def counters_before(self, p) -> dict:
        """p's scalar state (Adam's step count) as it was before this step, for a parameter
        that steps in chunks: taken at its first chunk, so that each chunk steps from it
        and the count advances once per step (slices.step_in_slices)."""
        return self._counts.setdefault(id(p), slices.counters(_held(self.optimizer, p) or {}))

    def _chunks_got_state(self, bucket: Bucket) -> bool:
        """True when a parameter of which the bucket holds a chunk got paged state that
        the bucket does not hold yet (created at the bucket of its first chunk)."""
        for c, named in zip(bucket.chunks, bucket.chunk_forms):
            state = _held(self.optimizer, c.param, {})
            if any(k not in named and self.pager.owns(v) for k, v in state.items()):
                return True
        return False

    def _raw_step_bucket(self, bucket: Bucket) -> None:
        """The optimizer's own step on the bucket's parameters (their state decoded)."""
        groups = self.optimizer.param_groups
        if bucket.params:
            saved = [g["params"] for g in groups]
            try:
                for g, params, counter in zip(groups, bucket.groups, self._group_steps):
                    g["params"] = params
                    _set_counter(g, counter)
                self._raw_step(self.optimizer)
                for i, g in enumerate(groups):
                    if g["params"]:
                        self._group_steps_after[i] = g.get("step", _ABSENT)
            finally:
                for g, params in zip(groups, saved):
                    g["params"] = params
        for c in bucket.chunks:
            state = _held(self.optimizer, c.param)
            if c.param.grad is not None and not state:
                raise _C.UsageError(
                    f"{type(self.optimizer).__name__} created no state for a parameter that "
                    "steps in chunks before its step: attach an optimizer whose state "
                    "torch.optim.Adam creates (not overriding _init_group), or raise bucket_size")
            slices.step_in_slices(self.optimizer, self._raw_step, c.group, c.param,
                                  [(c.start, c.stop)], self.counters_before(c.param))
        if self._adopt(bucket):  # state the optimizer created lazily in this step
            self._fill(bucket)
            self.pager.page_in(bucket.stored)  # the new stored forms (zero), to encode into


_ABSENT = object()


def _held(optimizer, p, default=None):
    """p's state dict as the optimizer holds it, or `default` where it has none (.get: no
    entry is made, as a defaultdict's [] would); never paged in on access
    (statepager.core.state_access), also where state_in_buckets() runs outside the
    Pager's lock."""
    return dict.get(optimizer.state, p, default)


def _tensor_key(v):
    """What forms() finds a state entry's form from: the tensor object and where its
    bytes are (a tensor whose data was set anew is another); None for other values."""
    if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
        return None
    try:
        return id(v), v.data_ptr()
    except RuntimeError:  # no storage (a meta or fake tensor): never the pager's
        return id(v), None


def _stored_bytes(t: torch.Tensor, fmt: str) -> int:
    """Bytes the StoredForm of working tensor t takes at rest."""
    n = t.numel()
    return {"fp32": n * t.element_size(), "bf16": 2 * n, "q8": n + 4 * codecs.q8_num_blocks(n),
            "residual": 2 * n}[fmt]


def _form_bytes(t: torch.Tensor, fmt: str, scratch: bool = True) -> int:
    """Bytes the StoredForm of working tensor t maps while it steps: its stored tensors,
    and t itself when it is stored (fp32) or decoded into (scratch)."""
    if fmt == "fp32":  # stored as the working tensor itself
        return _stored_bytes(t, fmt)
    return _stored_bytes(t, fmt) + (t.numel() * t.element_size() if scratch else 0)


class _Schedule:
    """When each bucket of a step is needed again, in bytes named in page-ins (the clock
    of Pager.page_out_async's reuse_after). The step names bucket k's incoming tensors
    (named_in[k]: stored forms and scratch) when it issues its page-in (the
    first ahead + 1 at once, then one after each bucket stepped) and its scratch again
    when it steps (named_at_step[k]: the decode's page-in); steps repeat the same order,
    so bucket i, paged out after its step, is needed again one step's bytes after its
    page-in was issued."""

    def __init__(self, named_in: list, named_at_step: list, ahead: int):
        n = len(named_in)
        incoming = [0, *itertools.accumulate(named_in)]
        scratch = [0, *itertools.accumulate(named_at_step)]
        self._step = incoming[n] + scratch[n]
        # The clock (from the step's start) when bucket k's page-in is issued: the first
        # ahead + 1 at once, then each after bucket k - ahead - 1 stepped.
        self._issued = [incoming[k] + scratch[max(0, k - ahead)] for k in range(n)]
        # ... and once bucket i is paged out: page-ins issued through i + ahead, scratch
        # named through i.
        self._now = [incoming[min(i + ahead, n - 1) + 1] + scratch[i + 1] for i in range(n)]

    def reuse_after(self, i: int) -> int:
        return max(1, self._step + self._issued[i] - self._now[i])


def _set_counter(group: dict, counter) -> None:
    """Sets a param group's own step counter ('step'), or removes it (_ABSENT)."""
    if counter is _ABSENT:
        group.pop("step", None)
    else:
        group["step"] = counter


def _end_run(run: _Run) -> None:
    """Ends a begun step that changed nothing: its page-ins waited for (the epoch's abort
    waits for any left, an interrupt here notwithstanding), their pages dropped unwritten."""
    try:
        _settle(list(run.ins.values()) + list(run.aheads.values()))
    finally:
        run.atomic.abandon()


def _end(step: AtomicStep, run: "_Run | None") -> None:
    """Ends a step that changed nothing: its run's page-ins waited for, where it has one."""
    if run is not None:
        _end_run(run)
    else:
        step.abandon()


def _settle(handles) -> None:
    """Waits for every handle, whatever its outcome (a failed step must not leave buckets
    in flight; the error that stopped it is the one raised)."""
    for h in handles:
        try:
            h.wait()
        except Exception:
            pass


def _raw_step_function(optimizer) -> Callable:
    """The optimizer's algorithm without the hook wrapper (hooks run once, around buckets)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step)


# Optimizers attached to a Pager (an optimizer is attached once). Weak: a binding lives
# as long as its optimizer, through the methods it set on it.
_attached: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


# The optimizer's methods below hold the Pager's lock (statepager.core.serial): a step, a
# state_dict() or a save on another thread waits for the one running.

def _paged_step(binding: StreamedOptimizer, optimizer, closure=None):
    """optimizer.step() of an attached optimizer (the closure runs outside the lock)."""
    binding.pager.check_not_paused("step()")
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with lock_of(binding):
        binding.pager.check_not_paused("step()")
        optimizer._opt_called = True  # what LR schedulers check; their step wrapper is replaced
        binding.step_buckets()
    return loss


def _paged_zero_grad(binding: StreamedOptimizer, zero_grad, *args, **kwargs):
    """optimizer.zero_grad() of an attached optimizer: its own, then prepare_step()."""
    with lock_of(binding):
        result = zero_grad(*args, **kwargs)
        binding.prepare_step()
    return result


def _paged_state_dict(binding: StreamedOptimizer) -> dict:
    with lock_of(binding):
        return state_dict.paged_state_dict(binding)


def _paged_load_state_dict(binding: StreamedOptimizer, loaded: dict) -> None:
    with lock_of(binding):
        try:
            state_dict.paged_load_state_dict(binding, loaded)
        finally:
            state_access.wrap(binding)  # torch's load sets optimizer.state anew


@serialized
def _paged_add_param_group(binding: StreamedOptimizer, param_group: dict) -> None:
    """torch's add_param_group, refused (and undone) when the pager cannot hold the new
    group's state; the group is streamed from the next step on."""
    optimizer = binding.optimizer
    type(optimizer).add_param_group(optimizer, param_group)
    try:
        binding.check_group(optimizer.param_groups[-1], len(optimizer.param_groups) - 1)
    except _C.UsageError:
        optimizer.param_groups.pop()
        raise


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
