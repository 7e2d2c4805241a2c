"""All-or-nothing streamed steps: a step that fails leaves the optimizer as it was.

A streamed step (statepager.core.binding) changes three kinds of things; AtomicStep keeps what
it needs to put each back:
- the paged state (moments, and the masters the pager owns): the step runs in a pager
  epoch (Pager.begin_epoch). Page-outs write fresh store ranges, so until the commit the
  bytes of before the step stay where they were, and an abort returns every tensor to
  them without any I/O;
- what the optimizer changes in ordinary memory: unpaged state (step counters, the
  resident state of parameters kept out of the pager) is copied at the start, param
  groups and grads are remembered, and so are the residual formats' exception lists;
  parameters the pager does not own, which the optimizer updates in place, are copied
  into host memory (UndoCopies) while the bucket before theirs steps, read back only when
  the step fails (on CUDA on a stream of their own: only what writes their targets waits
  for them, by then long done);
- model parameters that the after_bucket hook writes from the masters (`model_param`):
  with fp32 masters they are rewritten from the restored masters, which costs the step
  nothing; residual masters are stored relative to them, so there they get undo copies.

What it costs: the store needs room for a second copy of what a step writes (the old
bytes stay until the commit; freed ranges are reused by the next step); the undo copies
take host memory, pinned for a CUDA pager (2 bytes per element of a residual master's
bf16 parameter, the parameter's own size for unowned ones), and one device-to-host copy
of them per step. They do not go through the pager: in its store they were written every
step and never read (a third more bytes written than a q8 + residual step's state), and
they would take room in the step's window of HBM.

Residual masters' model parameters can be copied before the step, while the device runs
forward and backward and the copy engines have nothing else to do
(UndoCopies.take_before_step: see Note [Undo copies of residual masters' params are taken
before the step] in docs/design.md): within the step those 2 bytes per element would
share the device-to-host link with the page-outs. The step uses them only where they
still hold what it overwrites: the same buckets and copies, and each parameter still
matching the checksum its residual was encoded against (its fingerprint, unchanged
since), checked on the device at the step's start and read back before the step's first
write of a parameter (a LateRead: no device-wide sync). Otherwise the step takes its own
then, before writing any, as without them. A parameter written and then restored to the
same bits while its copy runs would pass that check with a torn copy; nothing in a
training loop does that between zero_grad() and step().
"""
from __future__ import annotations

from typing import Callable

import torch

from statepager import _C
from statepager.util.flat import copy_each
from statepager.core import residency
from statepager.core.late_reads import LateRead
from statepager.formats.stored import params_changed_since_encoded, residual_forms


# copy_state() keeps copies of unpaged state tensors up to this size between steps: step
# counters and other scalars, a few bytes per parameter.
KEPT_BYTES = 4096


class UndoCopies:
    """Per binding: one host tensor for each tensor an all-or-nothing step overwrites
    outside the pager (a resumable step copies one bucket's on the device instead:
    statepager.core.resumable.undo_copies),
    created on first use and kept between steps (pager.services.host_like: pinned for a CUDA pager,
    so that the copy before a bucket steps is queued on the device, not waited for).

    targets(params): the parameters the pager does not own, and for owned masters their
    model parameter when `mirror` is given (residual masters)."""

    def __init__(self, pager, mirror: Callable | None = None):
        self.pager, self.mirror = pager, mirror
        self._copies: dict[int, torch.Tensor] = {}  # id(param) -> the copy of its target
        self._stream = None  # CUDA: the stream the copies run on, made at first use
        # take_before_step()'s: ({id(bucket): (its copies, their event)}, [(residual
        # form, its fingerprint then)]), until the step takes them (taken_before_step).
        self._before = None
        # copy_state()'s copies of small unpaged state tensors (step counters), by
        # (id(param), name): kept between steps, so that a step's snapshot allocates
        # nothing for them (a clone each cost the 1.34 B GPT's step 2-4 ms).
        self._state_copies: dict[tuple, torch.Tensor] = {}

    def let_go(self) -> None:
        """Lets the host copies go, those taken before a step too: the binding's steps are
        no longer all or nothing."""
        self._copies, self._before = {}, None

    def copy_state(self, state, part: bool = False) -> dict:
        """param -> {name: (value, copy of it or None)} of an optimizer's state: unpaged
        tensors (step counters, the state of resident parameters, sparse state) are
        copied, as the step may update them in place; paged ones and other values are
        kept as they are. A count on the host (a float32 or float64 scalar holding a whole
        number: a step counter) is copied as its number, which restore_state fills back
        bit for bit: a tensor copy and its multi-tensor copy cost the step's host ~3 us a
        counter (other scalars stay tensors: a number may not keep their bits, under
        torch.set_flush_denormal say). The copies of other tensors of at most KEPT_BYTES
        are kept for the next step; larger ones (a resident parameter's moments) are
        made per step and let go with it, so that between steps their memory serves
        other tensors. part: `state` is some parameters' (a bucket's): the others' kept
        copies stay."""
        entries = [(p, name, v) for p, values in state.items() for name, v in values.items()]
        owned = self.pager.services.owns_each(v for _, _, v in entries)
        unpaged = [isinstance(v, torch.Tensor) and not mine
                   for (_, _, v), mine in zip(entries, owned)]
        # The counts among them, read in one call (not an item() each).
        counts = iter(_C.whole_counts([v for (_, _, v), u in zip(entries, unpaged) if u]))
        saved = {p: {} for p in state}
        kept, targets, sources = {}, [], []
        with torch.no_grad():
            for (p, name, v), is_unpaged in zip(entries, unpaged):
                copy = None
                if is_unpaged:
                    number = next(counts)
                    if v.layout != torch.strided:  # sparse: no multi-tensor copy
                        copy = v.clone()
                    elif number is not None:
                        copy = number  # a count: its number holds every bit
                    elif v.numel() * v.element_size() > KEPT_BYTES:
                        copy = torch.empty_like(v)
                    else:
                        copy = kept[(id(p), name)] = self._state_copy((id(p), name), v)
                    if isinstance(copy, torch.Tensor) and copy.layout == torch.strided:
                        targets.append(copy)
                        sources.append(v)
                saved[p][name] = (v, copy)
            copy_each(targets, sources)
        if part:
            self._state_copies.update(kept)
        else:
            self._state_copies = kept  # those of parameters gone since are let go
        return saved

    def _state_copy(self, key: tuple, v: torch.Tensor) -> torch.Tensor:
        """The copy kept for `key` when it still fits v (its shape, dtype and device: a
        copy_ back then restores v's bits exactly, within one device), else a new one."""
        copy = self._state_copies.get(key)
        if copy is None or (copy.shape, copy.dtype, copy.device) != (v.shape, v.dtype, v.device):
            copy = torch.empty_like(v)
        return copy

    def take(self, copies: list, targets: list):
        """Copies targets into copies: on CUDA queued on a stream of their own after the
        work queued so far on the current one, and returns the event that marks their
        end: join() it before anything writes a target. On the CPU done now (None)."""
        if not targets or not targets[0].is_cuda:
            for copy, target in zip(copies, targets):
                copy.copy_(target)
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(targets[0].device)
        self._stream.wait_stream(torch.cuda.current_stream(targets[0].device))
        with torch.cuda.stream(self._stream):
            for copy, target in zip(copies, targets):
                copy.copy_(target, non_blocking=True)
            return torch.cuda.current_stream().record_event()

    def take_before_step(self, buckets: list) -> None:
        """Takes the next step's copies of every bucket now, where all its targets are
        residual masters' model parameters whose fingerprints are known (see the module
        doc); nothing else, and nothing again until a step takes them."""
        forms = residual_forms(buckets)
        if self.mirror is None or self._before is not None or not forms or any(
                f.fingerprint is None for f in forms) or self.written_by_the_step(
                [p for b in buckets for p in b.params], [c for b in buckets for c in b.chunks]):
            return
        with torch.no_grad():
            taken = {id(b): (b.undo, self.take(b.undo, self.targets(b.params, b.chunks)))
                     for b in buckets}
        self._before = (taken, [(f, f.fingerprint) for f in forms])

    def taken_before_step(self, buckets: list) -> tuple[dict, LateRead | None]:
        """The copies take_before_step() took for this step, as ({id(bucket): event},
        changed), where they were taken of these buckets' targets and the forms'
        fingerprints have not changed since; `changed` (a LateRead of a bool, queued on
        the device now) tells whether a target no longer matches its fingerprint: then
        they do not hold what the step overwrites. ({}, None) otherwise. Either way they
        are the step's from now on."""
        before, self._before = self._before, None
        if before is None:
            return {}, None
        taken, fingerprinted = before
        forms = residual_forms(buckets)
        if [id(b) for b in buckets] != list(taken) or any(
                taken[id(b)][0] is not b.undo for b in buckets) or len(forms) != len(
                fingerprinted) or any(f is not g or f.fingerprint is not fp
                                      for f, (g, fp) in zip(forms, fingerprinted)):
            return {}, None
        events = {key: event for key, (_, event) in taken.items()}
        changed = params_changed_since_encoded(forms)  # each fingerprint is as taken
        return events, LateRead(changed)

    def take_bucket(self, bucket):
        """take() of what the bucket's step overwrites into its undo copies."""
        with torch.no_grad():
            return self.take(bucket.undo, self.targets(bucket.params, bucket.chunks))

    def put_back(self, buckets) -> None:
        """The buckets' targets as their undo copies hold them (once settle()d)."""
        with torch.no_grad():
            for b in buckets:
                for target, copy in zip(self.targets(b.params, b.chunks), b.undo):
                    target.copy_(copy)

    def join(self, taken) -> None:
        """The current stream's later work waits for the copies take() returned `taken` for."""
        if taken is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(taken)

    def settle(self) -> None:
        """Waits for the copies taken so far (before the host reads them)."""
        if self._stream is not None:
            self._stream.synchronize()

    def written_by_the_step(self, params, chunks=()) -> bool:
        """True when a target is a parameter the pager does not own: the optimizer's step
        writes it (a mirror is written after the step, by after_bucket)."""
        return not all(self.pager.services.owns_each([*params, *(c.param for c in chunks)]))

    def _target(self, p):
        """What the step overwrites outside the pager for p, or None."""
        if not self.pager.owns(p):
            return p
        return self.mirror(p) if self.mirror is not None else None

    def targets(self, params, chunks=()) -> list:
        """Those of the whole params, then the chunks' parts of those of theirs
        (slices.Chunk)."""
        whole = [self._target(p) for p in params]
        parts = [(c, self._target(c.param)) for c in chunks]
        return [t for t in whole if t is not None] + [c.of(t) for c, t in parts if t is not None]

    def copies(self, params, chunks=()) -> list:
        """The host tensors for targets(params, chunks), in the same order: a chunk's is
        the part of its parameter's copy."""
        out = [self._copy(p, t) for p in params if (t := self._target(p)) is not None]
        out += [c.of(self._copy(c.param, t)) for c in chunks
                if (t := self._target(c.param)) is not None]
        return out

    def _copy(self, p, t: torch.Tensor) -> torch.Tensor:
        copy = self._copies.get(id(p))
        like = torch.empty_like(t, device="meta")  # the layout host_like gives
        if copy is None or (copy.shape, copy.dtype, copy.stride()) != \
                (like.shape, like.dtype, like.stride()):
            copy = self._copies[id(p)] = self.pager.services.host_like(t)  # chunks are views of it
        return copy


def begin_epoch_at_rest(pager, buckets: list):
    """A pager epoch over the buckets' paged tensors (stored forms and scratch), opened
    once they are at rest, so that it covers their bytes: a tensor left resident since the
    last step is written now, as the step would have written it; scratch is dropped."""
    residency.to_rest(pager, buckets)
    return pager.begin_epoch([t for b in buckets for t in b.stored + b.working])


class AtomicStep:
    """One step's way back. Construction opens the pager epoch, before the step's first
    page-in (StreamedOptimizer.begin_step may start them before step() is called);
    snapshot(), at the step's start, takes what the step will change in ordinary memory;
    save() and writing() are called per bucket by the step; commit() or roll_back() ends
    it, or abandon() one that never started. `rebuild_mirror(master)` returns the model
    parameter that after_bucket writes from an fp32 master (rewritten from it on
    roll_back)."""

    def __init__(self, binding, undo: UndoCopies, rebuild_mirror: Callable | None = None):
        self.pager, self.optimizer, self.buckets = binding.pager, binding.optimizer, binding.buckets
        self.undo, self.rebuild_mirror = undo, rebuild_mirror
        self._saved = []    # buckets that stepped, their undo copies taken
        self._written = []  # buckets whose model parameters after_bucket may have written
        # Last: nothing after it can fail.
        self.epoch = begin_epoch_at_rest(self.pager, self.buckets)

    def snapshot(self) -> None:
        """At the step's start: copies what it changes outside the pager (unpaged state,
        param group options, grads, the residual forms' exceptions) as they are now, and
        takes up the undo copies taken before it, checked against the params now."""
        # id(bucket) -> the event of its undo copies (UndoCopies.take), taken before the
        # step where they may be (UndoCopies.take_before_step), then checked (_recheck)
        self._taken, self._recheck = self.undo.taken_before_step(self.buckets)
        self._state = self.undo.copy_state(self.optimizer.state)
        self._groups = copy_groups(self.optimizer.param_groups)
        self._grads = [(p, p.grad) for g in self.optimizer.param_groups for p in g["params"]]
        self._forms = [(f, f.exceptions_as_set, f.fingerprint) for b in self.buckets for f in b.forms]

    def abandon(self) -> None:
        """Ends a step that changed nothing yet (its page-ins waited for, or the abort
        waits for them): the epoch's tensors return to rest, their pages dropped
        unwritten. Undo copies taken before the step, if not taken up, stay for it."""
        self.epoch.abort()

    def take_ahead(self, bucket) -> None:
        """Takes a later bucket's undo copies now, before the buckets stepping ahead of it
        are queued: nothing writes what it overwrites before its own step (each bucket
        writes its own parameters and chunks only), and by then the copies are done
        instead of holding up its after_bucket (a step of q8 moments and residual mains
        copies 2 bytes per parameter, sharing device-to-host bandwidth with page-outs)."""
        if id(bucket) not in self._taken:
            self._taken[id(bucket)] = self.undo.take_bucket(bucket)

    def save(self, bucket) -> None:
        """Before the bucket steps: copies what it will overwrite (UndoCopies.take), unless
        take_ahead() did; the step waits for them only where it writes a target itself."""
        if id(bucket) not in self._taken:
            self.take_ahead(bucket)
        if self.undo.written_by_the_step(bucket.params, bucket.chunks):
            self.undo.join(self._taken[id(bucket)])
        self._saved.append(bucket)

    def writing(self, bucket) -> None:
        """Before after_bucket: it may write model parameters from this bucket's masters,
        once their copies are taken."""
        recheck, self._recheck = self._recheck, None
        if recheck is not None and bool(recheck.get()):
            # A parameter changed after take_before_step() copied it: nothing is written
            # yet, so every bucket's copies are taken again now, as the step would have.
            self._taken = {}
            for b in self.buckets:
                self.take_ahead(b)
        self.undo.join(self._taken[id(bucket)])
        self._written.append(bucket)

    def commit(self) -> None:
        self.epoch.commit()

    def roll_back(self) -> None:
        """After a failure, once no bucket is in flight: everything as before the step."""
        self.epoch.abort()
        self.undo.settle()
        # Copies taken before the step and not checked yet may not hold the targets,
        # and none was written (writing() checks them first).
        self.undo.put_back(self._saved if self._recheck is None else [])
        if self.rebuild_mirror is not None:
            for b in self._written:
                rebuild_mirrors(self.pager, b, self.rebuild_mirror)
        restore_state(self.optimizer.state, self._state)
        restore_groups(self.optimizer.param_groups, self._groups)
        for p, grad in self._grads:
            p.grad = grad
        for f, exceptions, fingerprint in self._forms:
            f.exceptions, f.fingerprint = exceptions, fingerprint



@torch.no_grad()
def rebuild_mirrors(pager, bucket, rebuild_mirror: Callable) -> None:
    """The model parameters of the bucket's fp32 masters (at rest, as restored), written
    from them; the masters are read and let go without being written (an epoch, aborted)."""
    pairs = [(m, rebuild_mirror(m)) for m in bucket.params if pager.owns(m)]
    pairs += [(c.of(c.param), c.of(rebuild_mirror(c.param))) for c in bucket.chunks
              if pager.owns(c.param)]
    if not pairs:
        return
    masters = [m for m, _ in pairs]
    epoch = pager.begin_epoch(masters)
    try:
        pager.page_in(masters)
        for m, mirror in pairs:  # rounded as after_bucket rounds them (copy_)
            mirror.copy_(m)
    finally:
        epoch.abort()


def copy_groups(groups: list) -> list:
    """The param groups' options (their own step counters among them), for restore_groups."""
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def restore_groups(groups: list, saved: list) -> None:
    for g, options in zip(groups, saved):
        for k in [k for k in g if k != "params" and k not in options]:
            del g[k]
        g.update(options)


def restore_state(state, saved: dict, params=None) -> None:
    """The optimizer's state as copied (copy_state): entries the step created are
    dropped, unpaged tensors get their bytes back in place (the same tensor objects).
    params: only these parameters' (a bucket's, copied with part=True)."""
    for p in [p for p in (state if params is None else params) if p in state and p not in saved]:
        del state[p]
    with torch.no_grad():
        for p, entries in saved.items():
            current = state[p]
            for name in [n for n in current if n not in entries]:
                del current[name]
            for name, (value, copy) in entries.items():
                if isinstance(copy, torch.Tensor):
                    value.copy_(copy)
                elif copy is not None:  # a scalar's number
                    value.fill_(copy)
                current[name] = value
