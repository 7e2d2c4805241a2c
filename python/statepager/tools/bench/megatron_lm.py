"""python -m statepager bench megatron-lm: Megatron-LM's own pretrain_gpt.py (mock data, one
GPU) side by side in one run: unpaged, Megatron's optimizer CPU offload, and statepager by
its flags (python -m statepager.megatron_lm), with the state on the store (--dir) or in the
pinned host tier, its step after backward or under the next forward.

The GPT is bench megatron's (24 layers, hidden 2048, 16 heads, vocab 32000, seq 512,
micro-batch 4, untied embeddings, fp32 grads with overlap_grad_reduce: 1.34 B params),
trained through Megatron-LM's own loop, so the figure is the one Megatron-LM users read:
its log's `elapsed time per iteration (ms)`, median of the iterations after the first
--skip (the first builds the moments), and against the unpaged run's the difference, the
paging that the iteration exposes; for paged runs also the medians of statepager's own
fields of that line (its step, its waits for page-ins and page-outs). Each configuration
is one torchrun of its own, one after another; the device memory the driver saw at the
run's peak is sampled beside it (NVML, by a child process:
statepager.tools.bench.driver_memory). A configuration that fails keeps its log's last
lines in the results; the others go on.

With --save-interval N each run also saves every N iterations with --async-save (Megatron's
torch_dist checkpoint beside statepager's part), and each counted iteration is put in one
of two sets by the log's order: those logged while a save is in flight (after Megatron's
"scheduled an async checkpoint save" and before its "successfully saved checkpoint") and
the others. Their times are wall-clock, from one iteration line's timestamp to the next:
Megatron's own elapsed time leaves out the time its save call blocks the training thread.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

from statepager import _C
from statepager.tools.bench.common import bench_directory
from statepager.tools.bench import megatron_configs
from statepager.tools.bench.megatron_configs import OFFLOAD, add_gpt_arguments
from statepager.tools.cli_args import at_least, directory, size
from statepager.tools.progress import Progress
from statepager.util.units import GiB

# Megatron-LM's flags for Megatron's own offload (bench megatron's OFFLOAD), which needs
# its precision-aware optimizer.
_OFFLOAD_FLAGS = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                  "--optimizer-offload-fraction", str(OFFLOAD["optimizer_offload_fraction"]),
                  "--overlap-cpu-optimizer-d2h-h2d"]
# paged: statepager's options (host: the host tier holds the state; overlap: steps under
# the next forward).
CONFIGS = {
    "unpaged": dict(what="unpaged (state in device memory)"),
    "offload": dict(flags=_OFFLOAD_FLAGS, what="Megatron optimizer_cpu_offload (fraction "
                                               "1.0, overlapped d2h/h2d)"),
    "fp32": dict(paged=dict(), what="statepager, fp32, store on --dir"),
    "fp32-overlap": dict(paged=dict(overlap=True),
                         what="statepager, fp32, store on --dir, steps under the forward"),
    "host-fp32": dict(paged=dict(host=True), what="statepager, fp32, host tier"),
    "host-fp32-overlap": dict(paged=dict(host=True, overlap=True),
                              what="statepager, fp32, host tier, steps under the forward"),
    "host-q8": dict(paged=dict(host=True, moments="q8", mains="residual"),
                    what="statepager, q8 moments, residual mains, host tier"),
    "host-q8-overlap": dict(paged=dict(host=True, moments="q8", mains="residual", overlap=True),
                            what="statepager, q8 moments, residual mains, host tier, steps "
                                 "under the forward"),
    "host-q8-overlap-stationary": dict(
        paged=dict(host=True, moments="q8", mains="residual", overlap=True, stationary=True),
        what="statepager, q8 moments, residual mains, host tier, steps under the forward, "
             "stationary buckets"),
    # --optimizer muon: the layer-wise chain, Muon for the matrices and Adam for the rest.
    "muon-unpaged": dict(flags=["--optimizer", "muon"],
                         what="unpaged, Muon (layer-wise, Adam for the rest)"),
    "muon-host-fp32": dict(flags=["--optimizer", "muon"], paged=dict(host=True),
                           what="statepager, Muon (layer-wise), fp32, host tier"),
}
# Steps under the forward on a thread of their own (--statepager-step-thread on).
CONFIGS.update({f"{name}-thread": dict(paged=dict(CONFIGS[name]["paged"], thread=True),
                                       what=CONFIGS[name]["what"] + ", on a thread")
                for name in ("fp32-overlap", "host-fp32-overlap", "host-q8-overlap",
                             "host-q8-overlap-stationary")})
DEFAULT_CONFIGS = ["unpaged", "offload", "fp32", "host-fp32", "host-q8", "host-q8-overlap"]
_LINE = re.compile(r"\[([0-9-]+ [0-9:.]+)\] iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per "
                   r"iteration \(ms\): ([0-9.]+) \|")
# statepager's fields of the same line (statepager.integrations.megatron_lm.IntervalStats).
_STEP = re.compile(r"statepager step \(ms\): ([0-9.]+) \| statepager page-in/out wait "
                   r"\(ms\): ([0-9.]+)/([0-9.]+) \|")
_PAGED_KEYS = ("step_ms", "page_in_wait_ms", "page_out_wait_ms")  # _STEP's groups
_SCHEDULED, _SAVED = "scheduled an async checkpoint save", "successfully saved checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"),
                   help="Megatron-LM's checkout (core_r0.19.0: pretrain_gpt.py and "
                        "megatron/training); default $MEGATRON_LM")
    p.add_argument("--dir", required=True, type=directory,
                   help="where the stores go (e.g. /dev/shm/sp): the bench makes a new "
                        "directory in it and deletes it afterwards")
    add_gpt_arguments(p, CONFIGS, DEFAULT_CONFIGS)
    p.add_argument("--iters", type=at_least(2, "iterations"), default=14)
    p.add_argument("--skip", type=at_least(1, "the first iteration builds the moments"),
                   default=3, help="iterations not counted (default 3: the median of the "
                                   "4th onward)")
    p.add_argument("--bucket-size", type=size, default=size("512M"))
    p.add_argument("--depth", type=at_least(2, "buckets in the step's pipeline"), default=None,
                   help="default per format, as bench megatron's")
    p.add_argument("--page-size", type=size, default=None,
                   help="default per format, as bench megatron's")
    p.add_argument("--stationary-bytes", type=size, default=size("1536M"),
                   help="the *-stationary configurations' --statepager-stationary-bytes "
                        "(default 1536M, as bench megatron's)")
    p.add_argument("--host-budget", type=size, default=None,
                   help="the host-* configurations' --statepager-host-budget (default: "
                        "twice their state, from the GPT's parameter count)")
    p.add_argument("--save-interval", type=at_least(1, "iterations"), default=None,
                   help="save every N iterations with --async-save, and time the iterations "
                        "a save is in flight under against the others")
    p.add_argument("--timeout", type=at_least(1, "seconds"), default=900,
                   help="seconds each configuration may take")
    p.add_argument("--megatron-args", type=shlex.split, default=[],
                   help="more pretrain_gpt.py arguments for every configuration, one string "
                        "(e.g. \"--no-check-for-nan-in-loss-and-grad\"), after the bench's")
    p.add_argument("--json", action="store_true")


def gpt_params(layers: int, hidden: int, vocab: int, seq: int) -> int:
    """Parameters of Megatron's GPT (local layers, learned positions, untied output)."""
    per_layer = 12 * hidden * hidden + 13 * hidden  # QKV, proj, 4h MLP, two LayerNorms
    return layers * per_layer + 2 * vocab * hidden + seq * hidden + 2 * hidden


def host_budget(args, moments: str, mains: str) -> int:
    """Host tier bytes for two copies of the GPT's paged state (megatron_configs)."""
    n = gpt_params(args.layers, args.hidden, args.vocab, args.seq)
    return megatron_configs.host_budget([n], moments, mains)


def gpt_flags(args) -> list[str]:
    """pretrain_gpt.py's arguments for the GPT (see the module doc)."""
    a = args
    flags = [
        "--num-layers", a.layers, "--hidden-size", a.hidden, "--num-attention-heads", a.heads,
        "--seq-length", a.seq, "--max-position-embeddings", a.seq,
        "--micro-batch-size", a.micro_batch, "--global-batch-size", a.micro_batch,
        "--train-iters", a.iters, "--lr", "1e-4", "--min-lr", "1e-5",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", a.vocab, "--untie-embeddings-and-output-weights",
        "--bf16", "--use-distributed-optimizer",
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000"]
    if not a.bf16_grads:
        flags.append("--accumulate-allreduce-grads-in-fp32")
    if not a.no_overlap_grad_reduce:
        flags.append("--overlap-grad-reduce")
    if a.save_interval:
        flags += ["--save-interval", a.save_interval, "--async-save", "--async-strategy",
                  "mcore", "--use-persistent-ckpt-worker"]
    return [str(f) for f in flags]


def command(name: str, args, work: str) -> list[str]:
    """The torchrun of configuration `name`, its store under `work`."""
    config = CONFIGS[name]
    paged = config.get("paged")
    flags = gpt_flags(args) + config.get("flags", [])
    if args.save_interval:
        flags += ["--save", os.path.join(work, f"ckpt-{name}")]
    module = []
    if paged is not None:
        module = ["-m", "statepager.megatron_lm"]
        moments, mains = paged.get("moments", "fp32"), paged.get("mains", "fp32")
        page, depth = megatron_configs.streaming(moments, args.bucket_size, args.page_size,
                                                 args.depth, paged.get("stationary", False))
        flags += ["--statepager-dir", os.path.join(work, f"{name}-{{rank}}"),
                  "--statepager-bucket-size", str(args.bucket_size),
                  "--statepager-page-size", str(page),
                  "--statepager-depth", str(depth),
                  "--statepager-moments", moments, "--statepager-mains", mains]
        if paged.get("host"):
            budget = args.host_budget or host_budget(args, moments, mains)
            flags += ["--statepager-host-budget", str(budget)]
        if paged.get("overlap"):
            flags += ["--statepager-overlap-forward", "on"]
        if paged.get("stationary"):
            flags += ["--statepager-stationary-bytes", str(args.stationary_bytes)]
        if paged.get("thread"):
            flags += ["--statepager-step-thread", "on"]
    flags += args.megatron_args
    script = os.path.join(args.megatron_lm, "pretrain_gpt.py")
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "1"] + module + [script] + flags)


def iterations(log: str) -> dict[int, dict]:
    """{iteration: {"ms": Megatron's elapsed time, "wall_ms": since the line before (None
    for the first), "saving": logged while an async save was in flight, and where
    statepager stepped, "step_ms", "page_in_wait_ms", "page_out_wait_ms": its fields of
    the line}} from `log`."""
    out, saving, before = {}, False, None
    for line in log.splitlines():
        if _SCHEDULED in line:
            saving = True
        elif _SAVED in line:
            saving = False
        m = _LINE.search(line)
        if m is None:
            continue
        at = datetime.datetime.fromisoformat(m.group(1))
        wall = None if before is None else (at - before).total_seconds() * 1e3
        it = out[int(m.group(2))] = {"ms": float(m.group(3)), "wall_ms": wall,
                                     "saving": saving}
        paged = _STEP.search(line)
        if paged:
            it.update(zip(_PAGED_KEYS, map(float, paged.groups())))
        before = at
    return out


def _stats(values: list, key: str) -> dict:
    return {f"{key}median_ms": statistics.median(values), f"{key}min_ms": min(values),
            f"{key}max_ms": max(values), f"{key}n": len(values)} if values else {}


def bench_megatron_lm(args) -> dict:
    """Runs each configuration (see the module doc), printing each as it ends unless
    --json; print_megatron_lm() prints the comparison."""
    args.megatron_lm = args.megatron_lm and os.path.abspath(args.megatron_lm)
    if not args.megatron_lm or not os.path.isfile(os.path.join(args.megatron_lm,
                                                               "pretrain_gpt.py")):
        raise _C.UsageError(
            f"bench megatron-lm runs Megatron-LM's pretrain_gpt.py, which is not in "
            f"{args.megatron_lm or '(no --megatron-lm and no $MEGATRON_LM)'}: pass "
            "--megatron-lm with Megatron-LM's checkout (core_r0.19.0)")
    r = {"model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq",
                                                  "micro_batch", "iters", "skip")},
         "configs": []}
    r["model"]["params"] = gpt_params(args.layers, args.hidden, args.vocab, args.seq)
    r["model"]["overlap_grad_reduce"] = not args.no_overlap_grad_reduce
    r["model"]["max_connections"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if not args.json:
        print(header(r["model"]), flush=True)
    with bench_directory(args.dir) as work, \
            Progress("bench megatron-lm", len(args.configs)) as bar:
        for name in args.configs:
            bar.phase(f"{name}: {CONFIGS[name]['what']}")
            c = run_config(name, command(name, args, work), args, work)
            r["configs"].append(c)
            if not args.json:
                print(config_line(c), flush=True)
    r["failed"] = [c["config"] for c in r["configs"] if "error" in c]
    return r


def run_config(name: str, cmd: list[str], args, work: str) -> dict:
    """One configuration's run: its iteration times and driver peak, or its error."""
    # CUDA_DEVICE_MAX_CONNECTIONS as the caller has it: one GPU needs no 1 (Megatron-LM
    # asks for it with tensor or context parallelism), and the header says which ran.
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([args.megatron_lm] + sys.path))
    log_path = os.path.join(work, f"{name}.log")
    sampler = _driver_sampler()
    t0 = time.perf_counter()
    with open(log_path, "w") as log, sampler:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=work, timeout=args.timeout).returncode
            error = None if rc == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {args.timeout} s"
    with open(log_path) as f:
        text = f.read()
    logged = iterations(text)
    counted = [it for i, it in sorted(logged.items()) if i > args.skip]
    c = {"config": name, "what": CONFIGS[name]["what"], "iterations": logged,
         "seconds": time.perf_counter() - t0, "driver_peak": getattr(sampler, "peak", None)}
    if error is None and not counted:
        error = f"no iteration after the first {args.skip} logged"
    if error is not None:
        return dict(c, error=error, log_tail=text.splitlines()[-60:])  # torchrun adds ~30
    c.update(_stats([it["ms"] for it in counted], ""))
    paged = [it for it in counted if "step_ms" in it]
    if paged:
        c["statepager_ms"] = {k: statistics.median(it[k] for it in paged) for k in _PAGED_KEYS}
    if args.save_interval:
        c.update(_stats([it["wall_ms"] for it in counted if it["saving"]], "saving_wall_"))
        c.update(_stats([it["wall_ms"] for it in counted if not it["saving"]], "quiet_wall_"))
    return c


def _driver_sampler():
    """The driver's device memory peak over a `with` block (its .peak), on CUDA; else a
    block that measures nothing."""
    import torch

    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    from statepager.tools.bench.driver_memory import DriverMemory

    return DriverMemory().sampler()


def config_line(c: dict) -> str:
    if "error" in c:
        tail = "\n".join("      " + line for line in c["log_tail"])
        return f"  {c['config']:18s} failed: {c['error']}\n{tail}"
    peak = c["driver_peak"]
    memory = f"; driver peak {peak / GiB:.2f} GiB" if peak else ""
    line = (f"  {c['config']:18s} {c['median_ms']:7.1f} ms per iteration ({c['min_ms']:.1f}-"
            f"{c['max_ms']:.1f}, n={c['n']}){memory}: {c['what']}")
    if "statepager_ms" in c:
        v = c["statepager_ms"]
        line += (f"\n{'':21s}statepager's step {v['step_ms']:.1f} ms, waiting for page-ins "
                 f"{v['page_in_wait_ms']:.1f} ms and page-outs {v['page_out_wait_ms']:.1f} ms "
                 "(medians of its log's fields)")
    if "quiet_wall_n" in c and "saving_wall_n" in c:
        line += (f"\n{'':21s}wall clock: {c['saving_wall_median_ms']:.1f} ms with a save in "
                 f"flight (n={c['saving_wall_n']}), {c['quiet_wall_median_ms']:.1f} ms without "
                 f"(n={c['quiet_wall_n']}): "
                 f"{c['saving_wall_median_ms'] / c['quiet_wall_median_ms']:.2f} x")
    elif "quiet_wall_n" in c:
        line += f"\n{'':21s}no counted iteration was logged with a save in flight"
    return line


def header(m: dict) -> str:
    return (f"megatron-lm bench: pretrain_gpt.py, {m['params'] / 1e9:.3f} B params "
            f"({m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, vocab "
            f"{m['vocab']}, seq {m['seq']}, micro-batch {m['micro_batch']}"
            + ("" if m["overlap_grad_reduce"] else ", without --overlap-grad-reduce")
            + f"); elapsed time per iteration, median of iterations {m['skip'] + 1}-{m['iters']}"
            + f"; CUDA_DEVICE_MAX_CONNECTIONS {m.get('max_connections') or 'unset'}")


def print_megatron_lm(r: dict) -> None:
    """The comparison, after bench_megatron_lm printed each configuration."""
    ok = {c["config"]: c for c in r["configs"] if "error" not in c}
    for base in ("unpaged", "offload", "muon-unpaged"):  # each against its own optimizer's
        if base not in ok:
            continue
        others = [c for c in ok.values() if c["config"] not in (base, "unpaged")
                  and ("muon" in c["config"]) == ("muon" in base)]
        if others:
            ms = ok[base]["median_ms"]
            print(f"  against {base}'s ({ms:.1f} ms): " + "; ".join(
                f"{c['config']} {c['median_ms'] / ms:.2f} x"
                + ("" if base == "offload" else f" ({c['median_ms'] - ms:+.1f} ms)")
                for c in others))
    for name in r["failed"]:
        print(f"  {name} failed (its log's last lines are above)")
