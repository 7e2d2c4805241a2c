"""Megatron-LM with its optimizer state paged by statepager, turned on by flags:

    torchrun ... -m statepager.megatron_lm pretrain_gpt.py <Megatron args> \\
        --statepager-dir /nvme/sp-{rank} [--statepager-hbm-budget 8G ...]

runs the training script unchanged (runpy) after install() has hooked megatron.training
(statepager.megatron_lm_hooks): the options are Megatron arguments (in its --help) or
environment variables (statepager.megatron_lm_config); the optimizer is built inside
Pager.scope() and attached; checkpoints carry the optimizer state through the pager, in
<iteration directory>/statepager/rank<NNNNN>/, written before Megatron's tracker file
names the iteration and loaded by every rank or by none; each step's StepStats join
Megatron's log line, timers and TensorBoard / W&B writers. With only STATEPAGER_DIR (and
the other STATEPAGER_* variables) set, the start-up hook python/_statepager_autoload.py
calls install_once() when megatron.training is imported, so `torchrun pretrain_gpt.py`
is paged too.

Ordering of a save (Run.save): synchronous, statepager's part is written and every
rank has agreed it succeeded before Megatron's save starts, so the tracker, written at
the end of Megatron's, never names an iteration without it. With --async-save ours is a
background save, started first; a finalize function put first on Megatron's async
request waits for it and for every rank's, and Megatron writes the tracker in a later
finalize function of the same request.

Thread-safety: Run is used from the training thread only (Megatron's async finalize
functions run there too).
"""
from __future__ import annotations

import os
import runpy
import shutil
import sys

import torch

from statepager import checkpoint
from statepager._C import UsageError
from statepager.core.pager import Pager
from statepager.integrations.megatron_lm_config import (Options, RefusedConfiguration,
                                                        add_arguments, check)
from statepager.integrations.megatron_lm_hooks import MegatronLM
from statepager.util import ranks
from statepager.util.names import MANIFEST
from statepager.util.units import GB, MiB



class RanksFailedError(RuntimeError):
    """Raised on every rank when a checkpoint step failed on at least one rank; the
    message names each failing rank and its reason."""


def agree(ok: bool, reason: str, what: str) -> None:
    """Every rank passes whether `what` succeeded on it (and why not); when any failed,
    every rank raises RanksFailedError naming each failed rank and its reason. A
    collective: every rank must call it at the same point."""
    results = [(ok, reason)]
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, (ok, reason))
    failed = [(rank, why) for rank, (good, why) in enumerate(results) if not good]
    if failed:
        raise RanksFailedError(
            f"statepager: {what} failed on {len(failed)} of {len(results)} ranks, so it "
            "fails on every rank: " + "; ".join(f"rank {r}: {why}" for r, why in failed))


def _attempt(action) -> tuple[object, bool, str]:
    """(result, ok, reason) of action(); an exception becomes its type and message."""
    try:
        return action(), True, ""
    except Exception as e:  # reported to every rank by agree(), then raised there
        return None, False, f"{type(e).__name__}: {e}"


def _holds_checkpoint(path: str) -> bool:
    """Whether `path` is a checkpoint statepager.checkpoint.save wrote (it has its manifest)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


class IntervalStats:
    """StepStats of the steps since the last report, summed over the optimizer's members
    (which step one after another)."""

    def __init__(self):
        self.steps = 0
        self.bytes_read = self.bytes_written = 0
        self.seconds = self.wait_in = self.wait_out = 0.0
        self.shorter_io = self.both_io = 0.0
        self.peak_mapped = 0
        self._last = None  # the step counters last added, so a step counts once

    def add(self, members: list) -> bool:
        """members: the binding's .last (one StepStats per member) after a step. False,
        adding nothing, when they are the step added last (or no step yet)."""
        key = tuple(s.step for s in members)
        if not members or key == self._last or all(s.buckets == 0 for s in members):
            return False
        self._last = key
        self.steps += 1
        for s in members:
            self.bytes_read += s.bytes_read
            self.bytes_written += s.bytes_written
            self.seconds += s.seconds
            self.wait_in += s.wait_in_seconds
            self.wait_out += s.wait_out_seconds
            self.shorter_io += min(s.read_busy_seconds, s.write_busy_seconds)
            self.both_io += s.both_busy_seconds
            self.peak_mapped = max(self.peak_mapped, s.peak_mapped_bytes)
        return True

    def scalars(self) -> dict:
        """Per step, averaged over the interval: what TensorBoard / W&B get."""
        n = max(self.steps, 1)
        return {"statepager/read-GB": self.bytes_read / n / GB,
                "statepager/written-GB": self.bytes_written / n / GB,
                "statepager/step-ms": self.seconds / n * 1e3,
                "statepager/page-in-wait-ms": self.wait_in / n * 1e3,
                "statepager/page-out-wait-ms": self.wait_out / n * 1e3,
                "statepager/io-overlap": self.both_io / self.shorter_io if self.shorter_io
                else 0.0,
                "statepager/peak-mapped-MiB": self.peak_mapped / MiB}

    def log_text(self) -> str:
        """The fields appended to Megatron's iteration line, in its style."""
        v = self.scalars()
        return (f" statepager read/written per iter (GB): {v['statepager/read-GB']:.3f}/"
                f"{v['statepager/written-GB']:.3f} |"
                f" statepager step (ms): {v['statepager/step-ms']:.1f} |"
                f" statepager page-in/out wait (ms): {v['statepager/page-in-wait-ms']:.1f}/"
                f"{v['statepager/page-out-wait-ms']:.1f} |"
                f" statepager io overlap: {100 * v['statepager/io-overlap']:.0f}% |"
                f" statepager peak mapped (MiB): {v['statepager/peak-mapped-MiB']:.0f} |")

    def timer_seconds(self) -> dict:
        return {"statepager-step": self.seconds, "statepager-page-in-wait": self.wait_in,
                "statepager-page-out-wait": self.wait_out}


class Run:
    """One Megatron-LM run with statepager: the hooks' callbacks and what they share.
    Pagers and bindings are statepager's public ones (Pager.scope / attach, statepager.checkpoint's
    save / load)."""

    def __init__(self, megatron: MegatronLM, *, device: str = "cuda"):
        self.megatron = megatron
        self.device = device
        self.options: Options | None = None  # set once Megatron has parsed its arguments
        self.pager: Pager | None = None
        self.binding = None
        self.optimizer = None
        self._pending = None      # (handle, iteration, directory) of an async save not yet
                                  # handed to Megatron's async request
        self._interval = IntervalStats()

    def install(self) -> None:
        m = self.megatron
        m.wrap_argument_parser(add_arguments)
        m.wrap_parsed_arguments(self.check_arguments)
        m.wrap_optimizer_builder(self.build_optimizer)
        m.wrap_save(self.save)
        m.wrap_async_schedule(self.scheduled)
        m.wrap_load(self.load)
        m.wrap_training_log(self.training_log)

    # -- start ---------------------------------------------------------------------------

    def check_arguments(self, args) -> None:
        self.options = check(args)

    def build_optimizer(self, megatron_build, model_chunks=()):
        """Megatron's optimizer, built inside Pager.scope() (its fp32 mains go straight
        into the store) and attached; its steps end under the next forward of
        `model_chunks` with --statepager-overlap-forward on."""
        if self.optimizer is not None:
            raise UsageError("statepager.megatron_lm pages one Megatron optimizer per run; "
                             "the script built a second one")
        o = self.options
        if o is None:
            raise UsageError("Megatron built its optimizer before parsing its arguments: "
                             "statepager.megatron_lm cannot serve this script")
        self.pager = Pager(o.directory, self.device, hbm_budget=o.hbm_budget,
                           host_budget=o.host_budget, page_size=o.page_size)
        with self.pager.scope():
            optimizer = megatron_build()
        def attach():
            binding = self.pager.attach(optimizer, bucket_size=o.bucket_size, depth=o.depth,
                                        moments=o.moments, mains=o.mains,
                                        atomic=o.attach_atomic(),
                                        stationary_bytes=o.stationary_bytes)
            if o.overlap_forward == "on":
                binding.overlap_forward(*model_chunks, step_thread=o.step_thread == "on")
            return binding

        # Ranks may differ (a layer-wise chain gives each its own matrices): one refused
        # fails every rank, none is left waiting in a collective.
        self.binding, ok, reason = _attempt(attach)
        agree(ok, reason, "attaching the optimizer")
        self.optimizer = optimizer
        if ranks.rank() == 0:
            print(f"statepager: optimizer state paged through {self.pager.directory} "
                  f"(rank 0; hbm budget {o.hbm_budget or 'unbounded'}, host budget "
                  f"{o.host_budget or 'none'}, pages of {self.pager.page_size / MiB:g} MiB, "
                  f"buckets of {self.pager.bindings[0].bucket_size / MiB:g} MiB x "
                  f"{self.pager.bindings[0].depth}, moments {o.moments}, mains "
                  f"{o.mains}, stationary {o.stationary_bytes / MiB:g} MiB)",
                  flush=True)
        return optimizer

    # -- checkpoints ---------------------------------------------------------------------

    def save(self, iteration: int, optimizer, release: bool, megatron_save):
        args = self.megatron.args()
        if self.binding is not None:
            self.binding.complete_step_in_flight()  # the model params Megatron saves
        if optimizer is None or optimizer is not self.optimizer or args.no_save_optim \
                or self.options.optimizer_checkpoint == "megatron":
            # --no-save-optim: Megatron saves no optimizer; "megatron": Megatron saves it,
            # through the pager (statepager.integrations.megatron_states).
            return megatron_save(optimizer)
        directory = self.megatron.iteration_directory(args.save, iteration, release)
        handle, ok, reason = _attempt(lambda: self._save_to(directory, args.async_save))
        agree(ok, reason, f"saving the optimizer state of iteration {iteration} "
                          f"into {directory}")
        if args.async_save:
            self._pending = (handle, iteration, directory)
        try:
            return megatron_save(None)  # the model, RNG and LR scheduler: Megatron's
        finally:
            self._pending = None

    def _save_to(self, directory: str, background: bool):
        """statepager.checkpoint.save into this rank's part of `directory`, after removing
        its part of an earlier, unfinished save of the same iteration (a save that crashed
        before the tracker named it)."""
        stale = checkpoint.rank_directory(directory)
        if os.path.lexists(stale):
            if not _holds_checkpoint(stale):
                raise UsageError(f"{stale} exists and is no statepager checkpoint: remove it "
                                 "or save elsewhere")
            shutil.rmtree(stale)
        return checkpoint.save(self.pager, stale, background=background)

    def scheduled(self, request) -> None:
        """Megatron is queueing its async save: ours finishes, on every rank, first."""
        if self._pending is None:
            return
        handle, iteration, directory = self._pending
        self._pending = None

        def finish():
            _, ok, reason = _attempt(handle.wait)
            agree(ok, reason, f"saving the optimizer state of iteration {iteration} "
                              f"into {directory} (in the background)")
        request.finalize_fns.insert(0, finish)

    def load(self, optimizer, load_arg: str, megatron_load):
        if optimizer is None or optimizer is not self.optimizer \
                or self.options.optimizer_checkpoint == "megatron":
            return megatron_load(optimizer)
        result = megatron_load(None)  # the model, RNG and, where due, the LR scheduler
        args, m = self.megatron.args(), self.megatron
        iteration = m.loaded_iteration()
        if iteration is None or iteration < 0:
            return result  # no checkpoint: everything starts fresh, as in Megatron
        base = getattr(args, load_arg)
        if args.finetune or args.no_load_optim or m.tracker_names_release(base):
            # Megatron's rule: the optimizer starts fresh from the loaded model params.
            if args.bf16 or args.fp16:
                optimizer.reload_model_params()
            return result
        directory = m.iteration_directory(base, iteration)
        # A missing part is not taken for a fresh start anywhere: it fails every rank.
        part = checkpoint.rank_directory(directory)
        loaded, ok, reason = _attempt(lambda: checkpoint.load(self.pager, part, missing_ok=True))
        if ok and not loaded:
            ok, reason = False, (f"{part} holds no statepager checkpoint "
                                 "(saved without statepager, or with --no-save-optim); pass "
                                 "--no-load-optim to start the optimizer fresh")
        agree(ok, reason, f"loading the optimizer state of iteration {iteration} from "
                          f"{directory}")
        return result

    # -- logging -------------------------------------------------------------------------

    def training_log(self, iteration: int, megatron_log):
        if self.binding is None:
            return megatron_log()
        last = self.binding.last  # one StepStats per member (MegatronBinding)
        members = last if isinstance(last, list) else [last]
        if self._interval.add(members):
            step = IntervalStats()
            step.add(members)
            self.megatron.write_scalars(step.scalars(), iteration)
        printed = []

        def suffix() -> str:
            printed.append(True)
            return self._interval.log_text()

        with self.megatron.appending_to_log_line(suffix):
            result = megatron_log()
        if printed:
            args = self.megatron.args()
            if args.timing_log_level >= 1:
                self.megatron.log_timers(self._interval.timer_seconds(), iteration,
                                         max(self._interval.steps, 1))
            self._interval = IntervalStats()
        return result

    def close(self) -> None:
        """Closes the pager (its background save, if any, finishes first)."""
        if self.pager is not None:
            self.pager.close()
            self.pager = None


def install(megatron: MegatronLM | None = None, *, device: str = "cuda") -> Run:
    """Hooks megatron.training for statepager in this process (what the entry point
    does before running the script): for launchers that run Megatron in-process. The
    options come from Megatron's arguments or STATEPAGER_* variables."""
    run = Run(megatron or MegatronLM(), device=device)
    run.install()
    return run


_installed: Run | None = None  # install_once's; the training thread's only
_installing = False


def install_once() -> Run | None:
    """install(), at most once per process: the entry point and the start-up hook
    (_statepager_autoload, STATEPAGER_DIR set) both call it, and the hook fires inside
    the entry point's own install (it imports megatron.training). The Run installed, or
    None when called during that install."""
    global _installed, _installing
    if _installed is None and not _installing:
        _installing = True
        try:
            _installed = install()
        finally:
            _installing = False
    return _installed


_USAGE = """usage: python -m statepager.megatron_lm SCRIPT [SCRIPT ARGS ...]
       torchrun [torchrun args] -m statepager.megatron_lm SCRIPT [SCRIPT ARGS ...]

Runs a Megatron-LM training script (pretrain_gpt.py, or any script on
megatron.training) unchanged, its optimizer state paged by statepager. Give the
statepager options with the script's arguments (SCRIPT --help lists them):
"""


def _usage() -> str:
    import argparse

    parser = argparse.ArgumentParser(prog="SCRIPT", add_help=False, usage=argparse.SUPPRESS)
    add_arguments(parser, environ={})
    return _USAGE + parser.format_help()


def main(argv: list[str] | None = None, megatron: MegatronLM | None = None) -> int:
    """The entry point: runs argv[0] as __main__ with argv[1:] as its arguments, hooked
    by install(megatron). 0 when the script returns, 2 for a refused configuration."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"statepager.megatron_lm: no training script {script!r}", file=sys.stderr)
        return 2
    try:
        run = install(megatron) if megatron is not None else install_once()
    except UsageError as e:
        print(f"statepager.megatron_lm: {e}", file=sys.stderr)
        return 2
    sys.argv = [script] + argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except RefusedConfiguration as e:
        print(f"statepager.megatron_lm: {e}", file=sys.stderr)
        return 2
    run.close()
    return 0

