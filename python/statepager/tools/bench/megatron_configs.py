"""`bench megatron`'s configurations and options: what each configuration runs (unpaged,
Megatron's own optimizer CPU offload, statepager in each on-disk format with its state on
the store or in the pinned host tier; Adam, or Muon unpaged and paged), the command line that picks them, and the page
size and timeline those options imply."""
from __future__ import annotations

import argparse

from statepager import _C
from statepager.tools.cli_args import (FIO_JOBS, at_least, directory, job_counts, output_file,
                                       plot_file, size)
from statepager.util.units import MiB

# Megatron's own offload, as users configure it: Adam on the CPU for all of the state,
# copies overlapped with it (HybridDeviceOptimizer).
OFFLOAD = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
               overlap_cpu_optimizer_d2h_h2d=True)
# Muon for the matrices and Adam for the rest, as Megatron-LM's --optimizer muon
# --use-distributed-optimizer builds them (the layer-wise chain). megatron-core 0.19 has no
# offload of Muon's state to compare with (its optimizer_cpu_offload steps Adam or SGD).
MUON = dict(optimizer="muon", layer_wise=True)
# host: the Pager's host tier (host_budget) holds the whole paged state in pinned host
# memory; the store on --dir is then only where a spill would go.
CONFIGS = {
    "unpaged": dict(pager=False, what="unpaged (state in device memory)"),
    "offload": dict(pager=False, optimizer_options=OFFLOAD,
                    what="Megatron optimizer_cpu_offload (fraction 1.0, overlapped d2h/h2d)"),
    "fp32": dict(pager=True, moments="fp32", mains="fp32", what="statepager, fp32, store on --dir"),
    "bf16": dict(pager=True, moments="bf16", mains="fp32",
                 what="statepager, bf16 moments, fp32 mains, store on --dir"),
    "q8": dict(pager=True, moments="q8", mains="residual",
               what="statepager, q8 moments, residual mains, store on --dir"),
    "host-fp32": dict(pager=True, host=True, moments="fp32", mains="fp32",
                      what="statepager, fp32, state in the pinned host tier"),
    "host-q8": dict(pager=True, host=True, moments="q8", mains="residual",
                    what="statepager, q8 moments, residual mains, state in the pinned host tier"),
    # Pager and attach left to their defaults: page, bucket size and depth chosen from the
    # device and --hbm-budget (statepager.core.defaults).
    "fp32-defaults": dict(pager=True, defaults=True, moments="fp32", mains="fp32",
                          what="statepager, fp32, store on --dir, Pager and attach defaults"),
    # The host tier at the state's size (what Megatron's offload pins), with the default
    # failure guarantee and in place.
    "host-fp32-1x": dict(pager=True, host=True, host_copies=1, moments="fp32", mains="fp32",
                         what="statepager, fp32, host tier of 1 x the state"),
    "host-fp32-1x-inplace": dict(pager=True, host=True, host_copies=1, moments="fp32",
                                 mains="fp32", atomic=False,
                                 what="statepager, fp32, host tier of 1 x the state, "
                                      "atomic=False"),
    # Steps under the next forward (binding.overlap_forward(model)).
    "fp32-overlap": dict(pager=True, overlap=True, moments="fp32", mains="fp32",
                         what="statepager, fp32, store on --dir, steps under the forward"),
    "host-fp32-overlap": dict(pager=True, host=True, overlap=True, moments="fp32",
                              mains="fp32", what="statepager, fp32, host tier, steps under "
                                                 "the forward"),
    "host-q8-overlap": dict(pager=True, host=True, overlap=True, moments="q8",
                            mains="residual", what="statepager, q8 moments, residual mains, "
                                                   "host tier, steps under the forward"),
    # The same, the first buckets up to --stationary-bytes kept mapped between steps.
    "host-fp32-overlap-stationary": dict(pager=True, host=True, overlap=True, stationary=True,
                                         moments="fp32", mains="fp32",
                                         what="statepager, fp32, host tier, steps under the "
                                              "forward, stationary buckets"),
    "host-q8-overlap-stationary": dict(pager=True, host=True, overlap=True, stationary=True,
                                       moments="q8", mains="residual",
                                       what="statepager, q8 moments, residual mains, host "
                                            "tier, steps under the forward, stationary buckets"),
    # The same, its page-ins begun after the backward (as without page_in_during_backward).
    "host-q8-overlap-late": dict(pager=True, host=True, overlap=True, early=False, moments="q8",
                                 mains="residual", what="statepager, q8 moments, residual "
                                 "mains, host tier, steps under the forward, page-ins after "
                                 "the backward"),
    "muon-unpaged": dict(pager=False, setup=MUON,
                         what="unpaged, Muon (layer-wise, Adam for the rest)"),
    "muon-host-fp32": dict(pager=True, host=True, setup=MUON, moments="fp32", mains="fp32",
                           what="statepager, Muon (layer-wise), fp32, state in the pinned "
                                "host tier"),
    "muon-fp32": dict(pager=True, setup=MUON, moments="fp32", mains="fp32",
                      what="statepager, Muon (layer-wise), fp32, store on --dir"),
}
# Steps under the forward on a thread of their own (overlap_forward(step_thread=True)).
CONFIGS.update({f"{name}-thread": dict(CONFIGS[name], thread=True,
                                       what=CONFIGS[name]["what"] + ", on a thread")
                for name in ("fp32-overlap", "host-fp32-overlap", "host-q8-overlap",
                             "host-q8-overlap-stationary")})
DEFAULT_CONFIGS = ["unpaged", "offload", "fp32", "q8", "host-fp32", "host-q8"]


def names_of(table: dict):
    """The --configs type of a table of configurations: a comma-separated subset of it, in
    the order given, each once."""
    def configs(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in table]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"{text!r}: configurations are {', '.join(table)} (comma-separated)")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{text!r} names a configuration twice")
        return names
    return configs


def paged_config(text: str) -> str:
    """One configuration that runs statepager (whose step has a timeline)."""
    paged = [n for n, c in CONFIGS.items() if c["pager"]]
    if text not in paged:
        raise argparse.ArgumentTypeError(f"{text!r}: the timeline is a paged configuration's: "
                                         f"one of {', '.join(paged)}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `bench megatron`; the defaults are a 1.34 B GPT."""
    p.add_argument("--dir", required=True, type=directory,
                   help="where the pager's stores and the fio floor's files go (e.g. "
                        "/dev/shm/sp): the bench makes a new directory in it and deletes it "
                        "afterwards")
    add_gpt_arguments(p, CONFIGS, DEFAULT_CONFIGS)
    p.add_argument("--warmup", type=at_least(1, "the first step creates the moments, so "
                                                "it is not timed"), default=3)
    p.add_argument("--steps", type=at_least(1, "timed steps"), default=5)
    p.add_argument("--bucket-size", type=size, default=size("512M"),
                   help="the pager's bucket_size (default 512M: half the buckets of 256M, so "
                        "half the stepping thread's per-bucket work per byte moved: "
                        "docs/design.md, Note [Buckets and the window])")
    p.add_argument("--depth", type=at_least(2, "buckets in the step's pipeline"), default=None,
                   help="the pager's depth (attach(depth=...)); default per format "
                        "(streaming()): 4 keeps two page-ins in flight, so that a bucket's page "
                        "mapping overlaps another's copies (attach's own default is 3: one "
                        "bucket less of HBM); 6 with q8 moments")
    p.add_argument("--stationary-bytes", type=size, default=size("1536M"),
                   help="attach(stationary_bytes=...) of the *-stationary configurations: "
                        "the first buckets' stored forms up to it stay mapped between steps "
                        "(default 1536M: the 1.34 B GPT's driver peak then stays below "
                        "Megatron's offload's, which 2G reached: docs/benchmarks.md)")
    p.add_argument("--page-size", type=size, default=None,
                   help="the pager's page_size (default per format, streaming(): the bucket "
                        "size, at most 256M, 128M with q8 moments; smaller pages map less "
                        "memory but cost the step about 1 ms per page mapped while a page-out "
                        "copies: docs/design.md, Note [Mapping costs per call, not per byte])")
    p.add_argument("--hbm-budget", type=size, default=None, help="the pager's hbm_budget")
    p.add_argument("--host-budget", type=size, default=None,
                   help="the host-* configurations' host_budget (default: what holds their "
                        "state through atomic steps, from the model's parameters)")
    p.add_argument("--no-map-ram", action="store_true",
                   help="Pager(map_ram=False): a store in RAM read and written through "
                        "io_uring (the kernel copies on the CPU) instead of mapped")
    p.add_argument("--fio-jobs", type=job_counts, default=FIO_JOBS,
                   help="fio jobs each way for the floor, comma-separated: the fastest count "
                        "sets it (default 4,8,16)")
    p.add_argument("--timeout", type=at_least(1, "seconds"), default=900,
                   help="seconds each configuration may take (its floor included)")
    p.add_argument("--device-time", action="store_true",
                   help="after the timed steps, one more whose optimizer.step() runs under "
                        "torch.profiler: the device's time in statepager's kernels (the "
                        "codecs' and the optimizer's compute of a step) and the copy engines' "
                        "busy time")
    p.add_argument("--checkpoint", action="store_true",
                   help="after the timed steps, the model and optimizer saved in "
                        "Megatron's own format (dist_checkpointing, dp_reshardable) into "
                        "--dir and loaded back: seconds, and the device and host memory "
                        "peaks of each against the state's size")
    p.add_argument("--timeline", type=paged_config, default=None,
                   help="the paged configuration whose last timed step --trace and --plot "
                        "draw, and whose iteration --iteration-trace and --iteration-plot "
                        "(default: the first paged one of --configs)")
    p.add_argument("--trace", type=output_file, metavar="FILE.json",
                   help="write that step's buckets (page-in, step, page-out) as a Chrome "
                        "trace (chrome://tracing, ui.perfetto.dev)")
    p.add_argument("--plot", type=plot_file, metavar="FILE.png",
                   help="draw that step's timeline (needs matplotlib: statepager[plot])")
    p.add_argument("--iteration-trace", type=output_file, metavar="FILE.json",
                   help="one more iteration of that configuration under torch.profiler: "
                        "its host phases, the model's kernels, statepager's and the copies "
                        "each way, as lanes of intervals (statepager.tools.bench.iteration)")
    p.add_argument("--iteration-plot", type=plot_file, metavar="FILE.png",
                   help="draw those lanes (needs matplotlib: statepager[plot])")
    p.add_argument("--json", action="store_true")


def add_gpt_arguments(p: argparse.ArgumentParser, table: dict, default: list) -> None:
    """--configs (of `table`) and the GPT's shape, shared with bench megatron-lm; the
    defaults are a 1.34 B GPT."""
    p.add_argument("--configs", type=names_of(table), default=list(default),
                   help=f"which to run, comma-separated, of {','.join(table)} (default "
                        f"{','.join(default)})")
    p.add_argument("--layers", type=at_least(1, "transformer layers"), default=24)
    p.add_argument("--hidden", type=at_least(1, "hidden size"), default=2048)
    p.add_argument("--heads", type=at_least(1, "attention heads"), default=16)
    p.add_argument("--vocab", type=at_least(2, "vocabulary size"), default=32000)
    p.add_argument("--seq", type=at_least(1, "sequence length"), default=512)
    p.add_argument("--micro-batch", type=at_least(1, "sequences per step"), default=4)
    p.add_argument("--bf16-grads", action="store_true",
                   help="reduce grads in bf16 (default: fp32 grads, grad_reduce_in_fp32)")
    p.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="grad syncs after the backward (default: Megatron's "
                        "overlap_grad_reduce, as each bucket's grads are ready in it)")


def host_budget(numels: list[int], moments: str, mains: str, copies: int = 2) -> int:
    """Host tier bytes that hold `copies` of the paged state of parameters of `numels`
    elements: 2 for atomic="step" (a step's old bytes stay until it commits), 1 for the
    state alone; and 3% + 256 MiB for the tier's 4 KiB rounding."""
    from statepager.formats import codecs

    def moment(n: int) -> int:
        return {"fp32": 4 * n, "bf16": 2 * n, "q8": n + 4 * codecs.q8_num_blocks(n)}[moments]

    state = sum((4 if mains == "fp32" else 2) * n + 2 * moment(n) for n in numels)
    return int(copies * state * 1.03) + 256 * MiB


def streaming(moments: str | None, bucket: int, page: int | None,
              depth: int | None, stationary: bool = False) -> tuple[int, int]:
    """The page size and depth a configuration streams with (Note [Pages for compact
    formats] in docs/design.md): those given, else the bucket size in whole CUDA pages
    (2 MiB) at most 256 MiB (the largest measured: a 512 MiB bucket maps two) at depth 4;
    with q8 moments, whose tensors are a quarter of fp32's, pages of at most 128 MiB at
    depth 6; stationary (buckets kept mapped beside the window), at depth 3."""
    compact = moments == "q8"
    granularity = 2 * MiB
    largest = (128 if compact else 256) * MiB
    return (page or min(largest, -(-bucket // granularity) * granularity),
            depth or (3 if stationary else 6 if compact else 4))


def timeline_config(args) -> str | None:
    """The configuration whose step --trace / --plot draw and whose iteration
    --iteration-trace / --iteration-plot profile (None when none is asked for);
    UsageError when it is not a paged one of --configs."""
    if not (args.trace or args.plot or args.iteration_trace or args.iteration_plot):
        return None
    paged = [n for n in args.configs if CONFIGS[n]["pager"]]
    name = args.timeline or (paged[0] if paged else None)
    if name is None:
        raise _C.UsageError(f"--trace, --plot and --iteration-* draw a paged configuration's "
                            f"step, and --configs {','.join(args.configs)} has none: add one "
                            "(e.g. fp32)")
    if name not in paged:
        raise _C.UsageError(f"--trace, --plot and --iteration-* draw a paged configuration's "
                            f"step: --timeline {name!r} is not in --configs "
                            f"{','.join(args.configs)}: add it there or choose another")
    return name
