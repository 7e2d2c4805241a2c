"""Steps under the next forward: an attached optimizer's step() returns once its first
page-ins are issued, and each bucket steps when the next forward first reaches a module
that uses its parameters (see Note [Steps under the forward] in docs/design.md).

A ForwardOverlap (StreamedOptimizer.overlap_forward) sets a forward pre-hook on every
module of `modules` that holds parameters, and a forward hook on each of `modules`:
- step() (statepager.core.steps, `defer`) starts the step's pipeline and returns; the
  grads of its parameters and the param groups' options are kept as they were then (a
  zero_grad() that sets grads to None, or an LR scheduler's step, does not reach the
  step);
- a module's pre-hook steps the buckets up to the last one holding one of its
  parameters or its children's (it may read them without calling them, as
  torch.nn.MultiheadAttention does its out_proj's), on the binding's own CUDA stream,
  and makes the forward's stream wait for them on the device (a CUDA event, no host
  sync); after its last bucket it does not wait for room for the next page-in, which
  a later pre-hook issues once page-outs have made it (Pipeline.pump);
- the forward hook steps whatever is left, so that backward never meets a bucket not
  stepped; the last page-outs are waited for by whatever the pager does next;
- what reads parameters outside their modules' forwards (Megatron's param all-gathers)
  calls before_reading() first, which steps theirs as a pre-hook does;
- with step_thread, the first hook starts a thread (statepager.core.step_thread) that
  steps every bucket in order, and each hook only waits for its buckets: on the host
  until the thread has stepped them, then on the device (Note [A thread steps the
  buckets under the forward]).
The modules' parameters are found as the optimizer's, or as forward_param(p) of one
(Megatron's bf16 model parameter of an fp32 main).
On the host backend the same happens in order, without streams.
"""
from __future__ import annotations

import contextlib
import time

import torch

from statepager import _C
from statepager.core.serial import holding, lock_of
from statepager.core.step_thread import StepThread
from statepager.util import streams


class ForwardOverlap:
    """The forward hooks of one binding (`binding`, a StreamedOptimizer, planned by
    `planner`) over `modules`.
    Thread-safety: its hooks take the Pager's lock, as the binding's entry points do
    (with step_thread, only where no thread steps the buckets). remove() finishes a step
    in flight and takes the hooks off."""

    def __init__(self, binding, modules: tuple, planner, forward_param=None,
                 step_thread: bool = False):
        if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
            raise _C.UsageError("overlap_forward(*modules) takes the torch.nn.Module(s) "
                                "whose forward uses the optimizer's parameters, e.g. "
                                "overlap_forward(model)")
        if binding.atomic == "step":
            raise _C.UsageError(
                "overlap_forward() steps buckets while the forward runs, which an "
                "all-or-nothing step (atomic='step') cannot: attach with "
                "atomic='bucket' (the default) or atomic=False")
        self.binding, self._planner = binding, planner
        self.step_thread = bool(step_thread)
        self._thread: StepThread | None = None  # the step in flight's, once started
        # Whether the step's stream waits for the forward's work since step() already.
        self._released = False
        # The calling thread's time in the hooks, in all (bench megatron reports it).
        self.hook_seconds = 0.0
        # What the forward uses for an optimizer parameter: forward_param(p), else the
        # model parameter model_param writes from it, else p itself.
        self._forward_param = forward_param or binding.hooks.model_param
        # Buckets in the order the forward meets their parameters: the modules'.
        used = {id(p): i for i, p in enumerate(q for m in modules for q in m.parameters())}
        unused = len(used)

        def order(p) -> int:
            seen = self._forward_param(p) if self._forward_param else None
            return used.get(id(p if seen is None else seen), unused)
        planner.set_order(order)
        device = binding.pager.device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._events: dict[int, torch.cuda.Event] = {}  # bucket index -> its step's end
        # Per stream (streams.current), the last bucket it was made to wait for: the
        # events are recorded in bucket order on one stream, so it waits for those
        # before it already (each module's pre-hook would wait again).
        self._waited: dict[int, int] = {}
        # Per optimizer param, the tensors whose grads its step reads: the param and the
        # model param the forward uses for it (PagedAdamW reads the model param's grad).
        self._holders: dict[int, list] = {}
        self._grads: dict[int, torch.Tensor | None] = {}  # id(holder) -> its grad kept
        self._options: list[dict] = []  # per param group, its options at step()
        self._last: dict[int, int] = {}   # id(param) -> its last bucket (chunks: several)
        self._bucket_holders: list = []  # per bucket: (holder, its param's last bucket)
        self._index: dict[int, int] = {}  # ... and id(its model param) -> that bucket
        # id(module or key) -> how many buckets it waits for, kept while _index stays
        self._needs: dict[int, int] = {}
        self._handles = []
        for m in modules:
            for sub in m.modules():
                if next(sub.parameters(recurse=False), None) is not None:
                    self._handles.append(
                        sub.register_forward_pre_hook(self._before_module, prepend=True))
            self._handles.append(m.register_forward_hook(self._after_forward))

    def remove(self) -> None:
        """Finishes a step in flight, then takes the hooks off (idempotent). A bucket
        that failed on the step's thread raises here, the hooks left on."""
        if self._thread is not None and not holding(self.binding.pager):
            self._thread.join()  # one holding the lock completes the step itself
        with lock_of(self.binding):
            self.binding.end_begun_step()
            for h in self._handles:
                h.remove()
            self._handles = []
            if self.binding.overlap is self:
                self.binding.overlap = None
                self._planner.set_order(None)

    # -- called by the binding's steps (statepager.core.steps) ------------------------

    def started(self, run) -> None:
        """A step deferred: its grads and options kept, its buckets indexed, its stream
        after the work that made the grads."""
        index = self._index
        self._holders, self._grads, self._last, self._events = {}, {}, {}, {}
        self._waited = {}
        self._thread, self._released = None, False
        self._options = [_options(g) for g in self.binding.optimizer.param_groups]
        for i, b in enumerate(run.buckets):
            for p in _params(b):
                used = self._forward_param(p) if self._forward_param else None
                holders = [p] if used is None or used is p else [p, used]
                self._holders[id(p)] = holders
                self._grads.update((id(h), h.grad) for h in holders)
                self._last[id(p)] = i
        self._bucket_holders = [[(h, self._last[id(p)]) for p in _params(b)
                                 for h in self._holders[id(p)]] for b in run.buckets]
        self._index = dict(self._last)
        for holders in self._holders.values():
            for used in holders[1:]:
                self._index[id(used)] = self._last[id(holders[0])]
        if self._index != index:  # a module's need holds while the buckets stay the same
            self._needs = {}
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
            for g in self._grads.values():
                if g is not None:
                    g.record_stream(self._stream)  # freed by a zero_grad meanwhile

    @contextlib.contextmanager
    def stepping(self, run, n: int):
        """Around stepping run's buckets until n have stepped: their kept grads in place
        (the grads now put back after), the param groups' options of step() (the ones
        now put back after), on the binding's stream, an event after them."""
        first = run.stepped
        held = [x for i in range(first, min(n, len(run.buckets)))
                for x in self._bucket_holders[i]]
        holders = [h for h, _ in held]
        now = [h.grad for h in holders]
        grads = self._grads
        for h in holders:
            h.grad = grads.get(id(h))
        groups = self.binding.optimizer.param_groups
        options_now = [_options(g, copy=False) for g in groups]
        for g, kept in zip(groups, self._options):
            g.update(kept)
        if not self._released:
            self._release()
        try:
            with (torch.cuda.stream(self._stream) if self._stream is not None
                  else contextlib.nullcontext()):
                yield
        except BaseException:
            self._give_back_grads(run, first)
            raise
        else:
            for h, last in held:
                if last < run.stepped:  # its last chunk stepped too
                    grads.pop(id(h), None)
                else:  # later chunks step with the grad its hooks put in place
                    grads[id(h)] = h.grad
            for h, g in zip(holders, now):
                h.grad = g
        finally:
            for g, options, kept in zip(groups, options_now, self._options):
                for k, v in options.items():
                    if g.get(k) is kept.get(k):  # not set meanwhile (by another thread)
                        g[k] = v
            if self._stream is not None and run.stepped > first:
                event = torch.cuda.Event()
                event.record(self._stream)
                for i in range(first, run.stepped):
                    self._events[i] = event

    @contextlib.contextmanager
    def pumping(self, run):
        """Around issuing page-ins between buckets (Pipeline.pump): on the binding's stream,
        where a failure's clean-up queues its work, and the grads handed back where it
        fails, as stepping() does."""
        try:
            with (torch.cuda.stream(self._stream) if self._stream is not None
                  else contextlib.nullcontext()):
                yield
        except BaseException:
            self._give_back_grads(run, run.stepped)
            raise

    def _give_back_grads(self, run, first: int) -> None:
        """The step failed with buckets from `first` on not stepped: they keep their grads,
        for the step that finishes it (a resumable step pending), whatever zero_grad()
        did meanwhile."""
        for b in run.buckets[first:]:
            for p in _params(b):
                for h in self._holders[id(p)]:
                    h.grad = self._grads.get(id(h))

    def _release(self) -> None:
        """Before the step's first bucket: its stream after what ran on the current one
        since step() returned (an integration's param sync, say)."""
        self._released = True
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))

    def joined(self) -> None:
        """The current stream after everything queued on the binding's: a step completed
        outside the forward's hooks (the forward that follows waits for none)."""
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    # -- the forward's hooks -----------------------------------------------------------

    def before_reading(self, params, key=None) -> None:
        """Steps the buckets that `params` (optimizer params, or the model params the
        forward uses for them) come from, and makes the current stream wait for them on
        the device: what runs next on it (a module's forward, an integration's param
        all-gather) reads them stepped. key: an object that names `params` while they
        stay the same (the count of buckets they need is kept per key)."""
        t0 = time.perf_counter()
        try:
            # Under an entry point holding the lock, the thread could never take it.
            if self.step_thread and not holding(self.binding.pager):
                self._wait_for_thread(lambda: self._need(params, key))
            else:
                self._step_for(params, key)
        finally:
            self.hook_seconds += time.perf_counter() - t0

    def _step_for(self, params, key) -> None:
        """before_reading() without step_thread: steps them here."""
        with lock_of(self.binding):
            if self.binding.step_in_flight is None:
                return
            need = self._need(params, key)
            # Back to the forward's launches once its buckets have stepped: page-ins that
            # wait for room are issued by a later hook (Pipeline.pump).
            self.binding.step_in_flight_to(need, lazy=True)
            if need:
                self._wait(need - 1)

    def _need(self, params, key) -> int:
        """How many buckets `params` (named by key, where given) need stepped."""
        need = self._needs.get(id(key)) if key is not None else None
        if need is None:
            need = 1 + max((self._index.get(id(p), -1) for p in params), default=-1)
            if key is not None:
                self._needs[id(key)] = need
        return need

    def _wait_for_thread(self, need_of) -> None:
        """before_reading() with step_thread: the thread started at the step's first
        hook; then, waiting for no lock, until it has stepped need_of() buckets (or, where
        it returned short of them, a step completed elsewhere, stepped here), then on the
        device for the last of them."""
        thread = self._thread
        if thread is None:
            if self.binding.step_in_flight is None:
                return  # without the lock, which another member's thread may hold
            with lock_of(self.binding):
                run, thread = self.binding.step_in_flight, self._thread
                if run is None:
                    return
                if thread is None and run.stepped < len(run.buckets):
                    if not self._released:
                        self._release()
                    thread = StepThread(self.binding, run, self.binding.step_in_flight_to)
                    thread.start()
                    self._thread = thread  # once started: no hook waits for one that is not
        need = need_of()
        if thread is None or not self._joined_where_failed(thread.wait_for, need):
            with lock_of(self.binding):
                if self.binding.step_in_flight is not None:
                    self.binding.step_in_flight_to(need)
        if need:
            self._wait(need - 1)

    def _joined_where_failed(self, wait, *args):
        """wait(*args) on the step's thread; where a bucket failed on it, the current
        stream then waits for what the failure queued (its buckets put back) and the
        error raises here, on the training thread."""
        try:
            return wait(*args)
        except BaseException:
            self.joined()
            raise

    def _before_module(self, module, inputs) -> None:
        # Its children's parameters too: it may read them without calling them.
        self.before_reading(module.parameters(), key=module)

    def _after_forward(self, module, inputs, output) -> None:
        t0 = time.perf_counter()
        try:
            if self._thread is not None and not holding(self.binding.pager):
                self._joined_where_failed(self._thread.join)
            with lock_of(self.binding):
                run = self.binding.step_in_flight
                if run is None:
                    return
                n = len(run.buckets)
                self.binding.step_in_flight_to(n)
                if n:
                    self._wait(n - 1)
        finally:
            self.hook_seconds += time.perf_counter() - t0

    def _wait(self, i: int) -> None:
        """The current stream waits, on the device, for bucket i's step."""
        event = self._events.get(i)
        if event is None:
            return
        device = self._stream.device
        stream = streams.current(device)
        if self._waited.get(stream, -1) < i:
            torch.cuda.current_stream(device).wait_event(event)
            self._waited[stream] = i


def _options(group: dict, copy: bool = True) -> dict:
    """A param group's options (lr, betas, ...): not its params, nor the step counter
    that the bucket steps keep (statepager.core.bucket_step). copy: tensor options
    cloned (an LR scheduler fills a tensor lr in place)."""
    return {k: v.clone() if copy and isinstance(v, torch.Tensor) else v
            for k, v in group.items() if k not in ("params", "step")}


def _params(b) -> list:
    """A bucket's parameters, those that step in chunks in it included."""
    return list(b.params) + [c.param for c in b.chunks]
