"""One bucket's state made resident and given back (statepager.core.plan's Bucket, filled
by statepager.core.layout): what its page-in brings, its stored forms decoded into fp32
working tensors and encoded back, its page-out. The step (statepager.core.pipeline) and
the reads and writes between steps (statepager.core.binding) share these."""
from __future__ import annotations

from statepager.core.late_reads import ParamChecks
from statepager.core.plan import Bucket
from statepager.formats import codecs
from statepager.formats.stored import decode_residuals, encode_residuals


def incoming(b: Bucket, fused: list | None) -> list:
    """What a bucket's step needs resident: its stored forms (paged in), then the scratch
    its decode fills (mapped as it steps, unfilled: Note [Scratch is mapped as its bucket
    steps]): not that of moments the fused step reads in their stored form (`fused`:
    StateLayout.fused_forms(b))."""
    if not b.working:
        return b.stored
    fused = {id(f) for f in fused or ()}
    scratch = [f.working for f in b.forms if f.scratch and id(f) not in fused]
    return b.stored + scratch


def decode(pager, b: Bucket, check_params: bool = True, skip=(),
           checks: ParamChecks | None = None, resident=()) -> None:
    """Decodes the bucket's stored forms (but those in `skip`) into fp32 working
    tensors. Residual masters are checked against their model params (checksum and
    rounding): now (a device sync), the bucket not stepped if any changed, or, given
    `checks`, at the end of the step (an atomic step, rolled back if any changed).
    resident: tensors known to be paged in (a step's incoming(), its page-in waited for)."""
    coded, residual = _coded(b, skip)
    resident_ids = {id(t) for t in resident}
    working = [f.working for f in coded + residual if id(f.working) not in resident_ids]
    if working:
        # Scratch, written whole by the decode. Not asked again where incoming() brought
        # it: a call takes the Pager's lock, which the I/O thread holds while it settles
        # buckets.
        pager.page_in_async((), overwrite=working).wait()
    for f in coded:
        f.decode()
    # Without check_params nobody reads `changed`: the params' checksums are skipped.
    changed = decode_residuals(residual, check_params, _masters(b, residual))
    if changed is None or not check_params:
        return
    if checks is not None:
        checks.add(changed)
    elif changed.item():
        ParamChecks.refuse()


def encode(b: Bucket, skip=()) -> list:
    """Encodes the bucket's stored forms (but those in `skip`). Returns the residual
    masters' exceptions, pending, as [(forms, codecs.PendingExceptions)] (empty
    without residual masters): until they are finished, the bucket's scratch must
    stay as it is."""
    coded, residual = _coded(b, skip)
    for f in coded:
        f.encode()
    return [(residual, encode_residuals(residual, _masters(b, residual)))] if residual else []


def _coded(b: Bucket, skip) -> tuple[list, list]:
    """Of the bucket's forms but those in `skip`: (those with a codec, bf16 or q8; the
    residual ones), kept on the bucket for the `skip` last asked (a step asks with the
    same moments each time). fp32 forms are their own working tensors: nothing to code."""
    kept, skip = b.coded, list(skip)
    if kept is not None and kept[0] is b.forms and kept[1] == skip:
        return kept[2]
    skipped = {id(f) for f in skip}
    forms = [f for f in b.forms if id(f) not in skipped]
    split = ([f for f in forms if f.fmt in ("bf16", "q8")],
             [f for f in forms if f.fmt == "residual"])
    b.coded = (b.forms, skip, split)
    return split


def _masters(b: Bucket, residual: list) -> codecs.ResidualMasters | None:
    """The bucket's ResidualMasters (StateLayout.fill) where `residual` is all of its
    residual forms (a subset of them, in order), else None."""
    masters = b.masters
    return masters if masters is not None and len(masters.mains) == len(residual) else None


def encode_now(b: Bucket) -> None:
    """encode(), its exception counts read at once (one device sync for the bucket)."""
    for forms, pending in encode(b):
        for f, exceptions in zip(forms, codecs.finish_exceptions([pending])):
            f.set_exceptions(exceptions)


def release(pager, b: Bucket, wait: bool = True, keep=(), reuse_after: int = 0) -> list:
    """Pages the stored form out and drops the scratch but `keep`; returns the
    handles. reuse_after: see Pager.page_out_async."""
    handles = [pager.page_out_async(b.stored, reuse_after)]
    drop = dropped(b, keep)
    if drop:
        handles.append(pager.discard_async(drop))
    if wait:
        for h in handles:
            h.wait()
    return handles


def dropped(b: Bucket, keep=()) -> list:
    """The scratch release() drops: all but `keep`."""
    kept = {id(k) for k in keep}  # a set: a bucket of many small parameters holds many
    return [t for t in b.working if id(t) not in kept]


def to_rest(pager, buckets: list, unchanged: bool = False, staying=()) -> None:
    """The buckets' stored forms paged out and their scratch dropped, once a step that
    left some resident (its page-out failed) ends. unchanged: stored forms paged in
    for a read go back to their bytes at rest without a write
    (pager.services.release_unchanged_async); the others are written. staying: buckets
    left as they are (stationary: Note [Stationary buckets])."""
    if staying:
        buckets = [b for b in buckets if all(b is not s for s in staying)]
    stored = [t for b in buckets for t in b.stored]
    if unchanged:
        pager.services.release_unchanged_async(stored).wait()
    else:
        pager.page_out(stored)
    pager.discard_async([t for b in buckets for t in b.working]).wait()


def hand_back(pager, b: Bucket, written: bool) -> None:
    """A bucket paged in and decoded outside the step, given back: encoded and paged
    out where it was written; else its stored forms back to their bytes at rest
    without any write (pager.services.release_unchanged_async) and its scratch dropped."""
    if written:
        encode_now(b)
        release(pager, b)
        return
    handles = [pager.services.release_unchanged_async(b.stored)]
    if b.working:  # the decoded scratch
        handles.append(pager.discard_async(b.working))
    for h in handles:
        h.wait()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
