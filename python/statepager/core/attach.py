"""Pager.attach(optimizer, ...): an optimizer's state streamed through a Pager.

The optimizer's state tensors (and its parameters, when the pager owns them) live in the
pager, and step() pages each bucket of about `bucket_size` bytes in, steps it, and pages
it out, within a window of the pages `depth` consecutive buckets touch. `moments` ("fp32", "bf16",
"q8") and `mains` ("fp32", "residual": needs the hook `model_param(master)` -> its bf16
parameter) choose the on-disk formats (statepager.formats). `name` identifies the
binding in checkpoints and names its own store, directory/<name>/ (default "opt<i>", i
its attach order). atomic: "bucket" (the default) makes a step resumable: one that
raises leaves each bucket stepped or not, and the next step() finishes it
(statepager.core.resumable); True or "step" makes it all or nothing: one that raises
changes nothing (statepager.core.atomic; the store and the host tier need room for a
second copy of the state); False steps in place, and a failed step may leave a bucket
partly stepped. Either atomic kind's retry steps once. stationary_bytes: the first
buckets whose stored forms take at most this many bytes stay mapped between steps, within
hbm_budget, and move no byte (Note [Stationary buckets]; not with atomic="step"). A parameter
whose state is larger than bucket_size steps in chunks of consecutive elements over
consecutive buckets when the optimizer's step is torch's Adam step and its pager tensors
are made of pieces (statepager.core.slices; the binding makes the state so; an fp32
master the pager owns must be made with
empty(pieces=statepager.core.slices.pieces(numel, 4)), as PagedAdamW makes them), else
it is a bucket of its own.

hooks: a statepager.Hooks (statepager.core.hooks), the callables the binding calls:
before_bucket(params) and after_bucket(params) around each bucket's step (e.g. copy
grads in, write model params out); before_chunk(p, start, stop) and after_chunk(p,
start, stop) around the step of elements [start, stop) of p (memory order) where a
parameter steps in chunks (with bucket hooks but no chunk hooks, none does);
model_param(master) -> the model parameter after_bucket writes from a master (a failed
step restores it; residual mains decode against it); keep_resident(p) -> True: p's
state stays in ordinary memory and steps unpaged; before_step() and after_step()
around each step's buckets (the integrations' way in). A Megatron DistributedOptimizer
or ChainedOptimizer is attached through statepager.integrations.megatron (one binding
per member; returns a MegatronBinding); it sets name and the hooks itself, and passing
either is refused (UsageError). bind=False: every check and the plan, and nothing
attached yet; the binding's bind() attaches it (an integration attaching several
optimizers checks them all first). Returns the StreamedOptimizer binding; its `.last` holds the last
step's StepStats.
"""
from __future__ import annotations

from statepager import _C
from statepager.core import adapters, args, guard
from statepager.core.hooks import Hooks
from statepager.core.binding import StreamedOptimizer


def attach(pager, optimizer, *, bucket_size, depth, log_steps, moments, mains, name, atomic,
           stationary_bytes=0, hooks=None, bind=True):
    """Pager.attach, under the Pager's lock: the binding (a StreamedOptimizer, or an
    adapter's own for an optimizer of another framework), which Pager.attach records.
    Every argument is checked before anything is made: the binding's store
    (directory/<name>/) opens when its plan first moves state there."""
    bucket_size, depth = args.bucketing(bucket_size, depth)
    log_steps, atomic = args.flag("log_steps", log_steps), args.atomicity(atomic)
    moments, mains = args.formats(moments, mains)
    stationary_bytes = args.stationary(stationary_bytes, atomic)
    hooks = Hooks.of(hooks)
    name = args.optimizer_name(name)
    pager.services.check_not_paused("attach()")
    adapter = adapters.find(optimizer)
    if adapter is not None:
        if not bind:
            raise _C.UsageError(f"attach(bind=False) is for torch optimizers, not a "
                                f"{adapter.name} optimizer")
        adapters.refuse_set_options(adapter, {"name": name,
                                              "hooks": hooks.given() or None})
        return adapter.attach(pager, optimizer, bucket_size=bucket_size, depth=depth,
                              log_steps=log_steps, moments=moments, mains=mains,
                              atomic=atomic, stationary_bytes=stationary_bytes)
    args.optimizer(optimizer)
    _refuse_stationary_beside_others(pager, stationary_bytes)
    guard.refuse_model_params(pager, optimizer)
    name = f"opt{len(pager.bindings)}" if name is None else name
    if any(b.name == name for b in pager.bindings):
        raise _C.UsageError(f"an optimizer named {name!r} is already attached to this "
                            "Pager: give each attach() its own name")
    return StreamedOptimizer(pager, optimizer, hooks, bucket_size=bucket_size, depth=depth,
                             log_steps=log_steps, moments=moments, mains=mains,
                             name=name, atomic=atomic, stationary_bytes=stationary_bytes,
                             bind=bind)


def _refuse_stationary_beside_others(pager, stationary_bytes: int) -> None:
    """Stationary buckets stay mapped while another optimizer on the Pager steps, beside
    its window, which attach checked against hbm_budget alone (Note [Stationary
    buckets]): they need the Pager to themselves."""
    others = [b.name for b in pager.bindings]
    if (stationary_bytes and others) or any(b.stationary_bytes for b in pager.bindings):
        raise _C.UsageError(
            f"stationary_bytes needs its optimizer alone on the Pager, which has "
            f"{', '.join(repr(n) for n in others)} attached: give each optimizer a Pager of "
            "its own, or stationary_bytes=0")
