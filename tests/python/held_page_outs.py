"""Page-outs held back: while a gate is held, the buckets a step releases
(statepager.core.residency.release) are not paged out, so that their pages stay mapped
and their handles say they have not landed, as page-outs slower than the step would."""
import time


class _Release:
    """One bucket's release (residency.release), not issued while the gate is held: its
    pages stay mapped. Issued once a handle is asked after the gate opened, or waited for
    (a wait() while the gate is held is counted in gate["waited"])."""

    def __init__(self, call, gate):
        self._call, self.gate, self._handles = call, gate, None

    @property
    def issued(self) -> bool:
        return self._handles is not None

    def handles(self) -> list:
        if self._handles is None:
            self._handles = self._call()
        return self._handles


class _Landing:
    """Handle k of a _Release (0: the page-out)."""

    def __init__(self, release: _Release, k: int):
        self._release, self._k = release, k
        self.page_out = k == 0

    @property
    def issued(self) -> bool:
        return self._release.issued

    def done(self):
        release = self._release
        return ((release.issued or not release.gate["held"])
                and release.handles()[self._k].done())

    def wait(self):
        gate = self._release.gate
        gate["waited"] += gate["held"] and not self.done()
        return self._release.handles()[self._k].wait()

    def __getattr__(self, name):
        return getattr(self._release.handles()[self._k], name)


def hold_page_outs(monkeypatch) -> dict:
    """The gate of every bucket's release a step makes from now on (_Release): while it is
    held, a stepped bucket's page-out and scratch discard are not issued."""
    from statepager.core import pipeline

    gate = {"held": False, "waited": 0, "made": []}
    release, dropped = pipeline.residency.release, pipeline.residency.dropped

    def held_release(pager, b, wait=True, keep=(), reuse_after=0):
        deferred = _Release(lambda: release(pager, b, wait=False, keep=keep,
                                            reuse_after=reuse_after), gate)
        if not gate["held"]:
            deferred.handles()
        handles = [_Landing(deferred, k) for k in range(1 + bool(dropped(b, keep)))]
        gate["made"] += handles
        return handles
    monkeypatch.setattr(pipeline.residency, "release", held_release)
    return gate


def let_land(gate, seconds: float = 30) -> bool:
    """Opens the gate; whether every page-out made so far landed within `seconds` (the
    I/O thread's)."""
    gate["held"] = False
    deadline = time.monotonic() + seconds
    while not all(h.done() for h in gate["made"]) and time.monotonic() < deadline:
        time.sleep(0.001)
    return all(h.done() for h in gate["made"])
