"""What an attached optimizer pages (statepager.core.binding): each parameter's paged
state entries and their stored forms (statepager.formats.stored), the buckets filled
with them, the bytes they take, and state moved into the pager or created there."""
from __future__ import annotations

import functools
from typing import Callable

import torch

from statepager import _C
from statepager.core import residency, slices, support
from statepager.core.atomic import UndoCopies
from statepager.core.hooks import Hooks
from statepager.core.plan import Bucket
from statepager.core.state_access import held
from statepager.formats import codecs
from statepager.formats.stored import StoredForm, residual_masters


class StateLayout:
    """The paged state of one optimizer in one pager. Its forms are found again only
    where a state entry changed (forms())."""

    def __init__(self, pager, optimizer: torch.optim.Optimizer, *, store: str, moments: str,
                 mains: str, hooks: Hooks, atomic: str | bool, undo: UndoCopies, fused):
        self.pager, self.optimizer = pager, optimizer
        self.store = store      # the binding's own store (directory/<name>/)
        self.moments, self.mains = moments, mains
        self.hooks = hooks      # model_param and keep_resident
        self.atomic = atomic    # "step": buckets carry host undo copies (UndoCopies.copies)
        self.undo = undo
        self.fused = fused      # statepager.core.fused_adamw.FusedStep, or None
        self.deferred = support.DeferredState.for_optimizer(optimizer)
        # Parameters that step in chunks (by id): their chunks' (start, stop), as planned.
        self.split: dict[int, list[tuple[int, int]]] = {}
        # Per parameter (by id): its paged state entries' StoredForms, by name, and what
        # they were found from (_C.state_key: each entry's tensor and where its bytes are):
        # forms() asks the pager again only when that changed.
        self._forms: dict[int, dict[str, StoredForm]] = {}
        self._forms_from: dict[int, tuple] = {}

    def mirror(self):
        """What a failed step rewrites from restored fp32 masters: their model parameters
        (the model_param hook; None with residual mains)."""
        return self.hooks.model_param if self.mains == "fp32" else None

    def fused_groups(self) -> tuple | None:
        """What decides, per param group, whether the fused step may run it (None without
        it): a step begun under other options starts again."""
        return self.fused.groups_key() if self.fused else None

    def resident(self, p) -> bool:
        """True for parameters whose state stays in ordinary memory (keep_resident)."""
        keep = self.hooks.keep_resident
        return keep(p) if keep is not None else False

    def check_group(self, group: dict, index: int) -> None:
        """Refuses (UsageError) a param group whose state the pager cannot hold."""
        support.check_group(group, index, self.pager.device, self.resident)

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

    def forms(self, p) -> list[tuple[str, StoredForm]]:
        """(name, form) of parameter p's paged tensors, in a stable order; 'param' is the
        parameter itself when the pager owns it (an fp32 master)."""
        state = held(self.optimizer, p, {})
        found_from = (id(p) in self.split, _C.state_key(p, state))
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
        split = id(p) in self.split
        if form is None or form.working is not working or (form.bounds is not None) != split:
            kind = "nonneg" if "sq" in name else "signed"
            model_param = self.hooks.model_param
            model = model_param(p) if fmt == "residual" and model_param else None
            bounds = slices.chunk_bounds(working.numel(), slices.CHUNK_ALIGN) if split else None
            form = StoredForm(self.pager, working, fmt, kind, model, bounds)
        return form

    def stored_whole(self, p) -> bool:
        """True when some scratch form of p's is stored whole (made before p stepped in
        chunks): p cannot step in chunks."""
        return any(f.bounds is None and f.scratch for f in self._forms.get(id(p), {}).values())

    def known_form(self, p, name: str, value: torch.Tensor) -> StoredForm | None:
        """The StoredForm of p's state entry `name`, whose working tensor is `value`, where
        p's state is paged here; None otherwise."""
        if id(p) not in self._forms:
            return None
        form = dict(self.forms(p)).get(name)
        return form if form is not None and form.working is value else None

    def forms_kept(self) -> Callable[[], None]:
        """The returned callable puts back the stored forms of now (which form holds each
        state entry, and the residual ones' exception lists and fingerprints)."""
        forms, found_from = dict(self._forms), dict(self._forms_from)
        residual = [(f, f.exceptions_as_set, f.fingerprint) for named in forms.values()
                    for f in named.values() if f.fmt == "residual"]

        def put_back() -> None:
            self._forms, self._forms_from = forms, found_from
            for f, exceptions, fingerprint in residual:
                f.exceptions, f.fingerprint = exceptions, fingerprint
        return put_back

    def empty_state_like(self, p, t: torch.Tensor, dtype: torch.dtype | None = None):
        """A pager tensor for state of parameter p shaped and laid out as t (Pager.
        empty_like), in pieces when p steps in chunks."""
        pieces = None
        if id(p) in self.split:
            size = torch.empty((), dtype=dtype or t.dtype).element_size()
            pieces = slices.pieces(t.numel(), size)
        return self.pager.empty_like(t, dtype=dtype, pieces=pieces)

    def fill(self, b: Bucket, to_store: bool = True) -> None:
        """The bucket's forms, stored tensors, scratch and sizes as its parameters' state
        is now; the stored tensors moved to this binding's store unless to_store=False."""
        b.chunk_forms = [{name: f.chunk(c.start, c.stop) for name, f in self.forms(c.param)}
                         for c in b.chunks]
        b.forms = [f for p in b.params for _, f in self.forms(p)]
        b.forms += [f for named in b.chunk_forms for f in named.values()]
        b.stored = [t for f in b.forms for t in f.tensors]
        if to_store:
            self.to_store(b)
        b.working = [f.working for f in b.forms if f.scratch]
        b.masters = residual_masters([f for f in b.forms if f.fmt == "residual"])
        # Host undo copies for all-or-nothing steps; resumable ones copy on the device.
        b.undo = self.undo.copies(b.params, b.chunks) if self.atomic == "step" else []
        b.undo_targets = self.undo.targets(b.params, b.chunks)
        b.fused = self.fused_forms(b)
        b.incoming = residency.incoming(b, b.fused)
        b.nbytes, b.stored_bytes = residency.nbytes(b.incoming), residency.nbytes(b.stored)

    def to_store(self, b: Bucket) -> None:
        if b.stored:  # the binding's own store, opened on first use
            self.pager.services.move_to_store(b.stored, self.store)

    def fused_forms(self, b: Bucket):
        """The moment forms the fused step reads in their stored form, or None where it
        does not step the bucket."""
        return self.fused.moment_forms(b) if self.fused else None

    def planned_bytes(self, p, group: dict, at_rest: bool = False) -> int:
        """Bytes p's paged tensors map while its bucket steps (moments the fused step
        reads in their stored form without their fp32 scratch), or with at_rest the bytes
        their stored forms take at rest: its state in the pager or to be adopted into it;
        for state yet to be created, an estimate (the optimizer's count of param-shaped
        tensors, else 2)."""
        if self.resident(p):
            return 0
        scratch = not (self.fused and self.fused.may_step(group, p))

        def size(t, fmt, scratch=scratch):
            return _stored_bytes(t, fmt) if at_rest else _form_bytes(t, fmt, scratch)

        state = held(self.optimizer, p, {})
        nbytes = sum(size(v, self.moments) for v in state.values()
                     if self.pager.owns(v) or support.pageable(v, p))
        if self.pager.owns(p):
            nbytes += size(p, self.mains, True)
        if not state:
            count = self.deferred.moments(group) if self.deferred else 2
            nbytes += count * size(p, self.moments)
        return nbytes

    def stored_bytes(self) -> int:
        """The bytes the state takes at rest (its stored forms; state yet to be created
        estimated as the plan estimates it)."""
        return sum(self.planned_bytes(p, g, at_rest=True)
                   for g in self.optimizer.param_groups for p in g["params"])

    def has_state_to_adopt(self) -> bool:
        """True when state exists in ordinary memory that the pager would hold."""
        return any(support.pageable(v, p) and not self.pager.owns(v)
                   for p in self.params_in_order() if not self.resident(p)
                   for v in held(self.optimizer, p, {}).values())

    @torch.no_grad()
    def adopt(self, bucket: Bucket) -> bool:
        """Moves the bucket's state tensors that are not in the pager into it (resident),
        each in the memory layout it had."""
        moved = False
        known = {id(f.working) for f in bucket.forms}  # already paged: skip the lookups
        for p in bucket.params:
            state = held(self.optimizer, p)
            if not state or self.resident(p):
                continue
            for name, v in list(state.items()):
                if id(v) not in known and support.pageable(v, p) and not self.pager.owns(v):
                    paged = self.empty_state_like(p, v)
                    self.pager.page_in(paged)
                    paged.copy_(v)
                    state[name] = paged
                    moved = True
        return moved

    def create_deferred_state(self, bucket: Bucket) -> bool:
        """The state the optimizer's step would create now for the bucket's parameters
        that got their first gradient, created in the pager (support.DeferredState)."""
        if self.deferred is None:
            return False
        created = False
        groups = self.optimizer.param_groups
        for group, params in zip(groups, bucket.groups):
            for p in params:
                # Those with state first: create() makes none for them, and the check of
                # residency (a hook) costs more.
                if not held(self.optimizer, p) and not self.resident(p):
                    created |= self.deferred.create(group, p, self.pager.empty_like)
        for c in bucket.chunks:
            created |= self.deferred.create(groups[c.group], c.param,
                                            functools.partial(self.empty_state_like, c.param))
        return created

    def chunks_got_state(self, bucket: Bucket) -> bool:
        """True when a parameter of which the bucket holds a chunk got paged state that
        the bucket does not hold yet (created at the bucket of its first chunk)."""
        for c, named in zip(bucket.chunks, bucket.chunk_forms):
            state = held(self.optimizer, c.param, {})
            if any(k not in named and self.pager.owns(v) for k, v in state.items()):
                return True
        return False


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
