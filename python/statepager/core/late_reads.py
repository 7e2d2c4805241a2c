"""What a streamed step (statepager.core.binding) reads back from the device late, so
that the host never waits for the device as a whole within a step: the residual masters'
exception counts (ExceptionCounts, each bucket's a LateRead) and their model parameters'
checks (ParamChecks). All work on the host backend too (the values known at once), so CI runs the
same way. Used by the stepping thread alone."""
from __future__ import annotations

import collections

import torch

from statepager.formats.stored import params_changed_since_encoded, residual_forms


class LateRead:
    """A device tensor's values, copied to host memory once the work queued so far on
    the current stream has made them, and read later, waiting for that copy alone (an
    event), not for the device as a whole. On the host, the tensor itself. `spare`: a
    pinned buffer and event of a LateRead read before (its `spare` once get() returned),
    taken where the values fit: a pinned allocation and an event each cost the step's
    host tens of microseconds a bucket."""

    def __init__(self, values: torch.Tensor, spare: tuple | None = None):
        self._ready = None
        self.spare: tuple | None = None
        if values.is_cuda:
            n = values.numel()
            if spare is None or spare[0].numel() < n or spare[0].dtype != values.dtype:
                # Rounded up, so that the other buckets' values fit it too.
                spare = (torch.empty(max(64, 1 << (n - 1).bit_length()), dtype=values.dtype,
                                     pin_memory=True), torch.cuda.Event())
            host = spare[0][:n].view(values.shape)
            host.copy_(values, non_blocking=True)
            self._ready = spare[1]
            self._ready.record(torch.cuda.current_stream(values.device))
            self.spare, values = spare, host
        self._values = values

    def ready(self) -> bool:
        """Whether get() would not wait."""
        return self._ready is None or self._ready.query()

    def get(self) -> torch.Tensor:
        """The values (a host tensor), once copied: valid until `spare` is given to
        another LateRead."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._values


class ExceptionCounts:
    """The residual exceptions of the buckets stepped last, their counts still on the
    device. Each bucket's counts are copied to host memory once its encode is queued, and
    read LAG buckets later, waiting for that copy alone: the host queues bucket i while
    the device still runs bucket i - 1, and never waits for the device as a whole (as a
    read of the counts after bucket i's work was queued would: the device idle while the
    host queues the next). Until its counts are read, a bucket's master scratch stays
    mapped: a count past the kernel's room lists the exceptions again from it
    (codecs.PendingExceptions.finish). The step's window has room for LAG buckets' of it
    (StreamedOptimizer.window_bytes); the rest of a bucket's scratch goes with its release."""

    LAG = 2

    def __init__(self, pager):
        self.pager = pager
        # Per bucket stepped, oldest first: its key, its (StoredForms, PendingExceptions)
        # pairs (residency.encode), their counts (a LateRead), the scratch held for them.
        self._queue: collections.deque = collections.deque()
        self.handles: list = []  # the discards of the scratch let go, not yet waited for
        self.let_go: dict = {}  # a bucket's key -> the discard of its scratch held here
        self._spare: list = []  # LateRead.spare of the counts read

    def hold(self, pending: list, key) -> list:
        """The bucket just stepped (named `key`), before its release: returns the
        scratch to keep."""
        if not pending:
            return []
        values = [p.count for _, p in pending]
        counts = LateRead(values[0] if len(values) == 1 else torch.cat(values),
                          self._spare.pop() if self._spare else None)
        held = [f.working for forms, _ in pending for f in forms]
        self._queue.append((key, pending, counts, held))
        return held

    def holds(self, key) -> bool:
        """Whether the scratch of the bucket named `key` is still held (its counts unread)."""
        return any(k == key for k, _, _, _ in self._queue)

    def read(self, keep: int = LAG - 1) -> None:
        """Finishes all buckets but the last `keep` (each form gets its exceptions) and
        lets their scratch go (discarded after the work queued on it)."""
        while len(self._queue) > keep:
            key, pending, counts, held = self._queue[0]
            values, at = counts.get().tolist(), 0
            for forms, p in pending:
                for form, exceptions in zip(forms, p.finish(values[at:at + len(forms)])):
                    form.set_exceptions(exceptions)
                at += len(forms)
            self._queue.popleft()
            if counts.spare is not None:  # read: its buffer is free for another bucket's
                self._spare.append(counts.spare)
            handle = self.pager.discard_async(held)
            self.handles.append(handle)
            self.let_go[key] = handle

    def ready(self) -> bool:
        """Whether read() would wait for no copy."""
        return all(counts.ready() for _, _, counts, _ in self._queue)

    def wait_let_go(self) -> None:
        """Waits for the scratch let go so far to be unmapped (before a page-in that the
        window counts on it for: the scratch of the last LAG buckets stepped is all it
        holds)."""
        while self.handles:
            self.handles.pop(0).wait()


class ParamChecks:
    """An atomic step's residual checks (stored.decode_residuals: a model param changed),
    gathered on the device and read once, after the last bucket: a changed model
    param then fails the whole step, which is rolled back. The host never waits for the
    device to check a bucket. A step that is not atomic cannot roll back: it checks every
    bucket's params against their fingerprints before the first bucket steps (one
    sync), or, where a fingerprint is not known yet, each bucket's before it steps."""

    def __init__(self):
        self._flags: list = []  # 0-dim bool tensors: True where a bucket's param changed

    def add(self, flag: torch.Tensor) -> None:
        self._flags.append(flag)

    def verify(self) -> None:
        """Raises (refuse()) when any flag added is True: one device sync."""
        if self._flags and bool(torch.stack(self._flags).any()):
            ParamChecks.refuse()

    @staticmethod
    def up_front(buckets: list) -> bool:
        """A step's residual checks that cannot roll back, every bucket's at once before
        any bucket steps: a model parameter changed since its master was encoded (its
        fingerprint) is refused here, with nothing written, and the host waits for the
        device once per step instead of once per bucket. True when done; False where
        some master's fingerprint is not known yet (its state new, or loaded), whose
        bucket's decode then checks it before the bucket steps."""
        changed = ParamChecks.queued(buckets)
        if changed is None:
            return False
        ParamChecks.verify_queued(changed)
        return True

    @staticmethod
    def queued(buckets: list) -> torch.Tensor | None:
        """up_front()'s checks queued, not read: a 0-dim device bool, True where a param
        changed, for verify_queued() before the first bucket steps (a step under the
        forward reads it there, so that step() returns without a device sync); None
        where some fingerprint is not known yet (as up_front())."""
        return params_changed_since_encoded(residual_forms(buckets))

    @staticmethod
    def verify_queued(changed: torch.Tensor) -> None:
        """Raises (refuse()) where queued()'s flag is True: a device sync."""
        if bool(changed):
            ParamChecks.refuse()

    @staticmethod
    def refuse() -> None:
        raise ValueError("a model parameter no longer matches the one its master weights "
                         "were stored against (changed outside the optimizer?): with "
                         "mains='residual' the masters cannot be rebuilt. Change model "
                         "weights through the optimizer, or use mains='fp32'.")

