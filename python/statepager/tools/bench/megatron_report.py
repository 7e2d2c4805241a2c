"""`bench megatron`'s report: the header, a row and notes per configuration (printed as
each ends), and the summary that compares them, from the workers' results (see
statepager.tools.bench.megatron_worker)."""
from __future__ import annotations

import statistics

from statepager.tools.bench import floor as bench_floor
from statepager.tools.bench import megatron_checkpoint
from statepager.tools.bench.megatron_configs import CONFIGS, MUON
from statepager.tools.bench.report import faster, multiple
from statepager.util.units import GiB, MiB


def median_bytes(values: list) -> int:
    """The median of per-step byte counts, in whole bytes."""
    return int(statistics.median(values))


def print_lines(lines: list[str]) -> None:
    print("\n".join(lines), flush=True)


def breakdown(r: dict) -> dict | None:
    """What the driver's peak holds beyond torch's peak allocation, in pieces (bytes):
    the CUDA context, torch's cache (reserved - allocated at their peaks), the page pool
    (mapped or kept, less what torch counted as scope() reservations), and the rest
    (NCCL, library workspaces outside torch, timing skew). None without a baseline."""
    d, t, p = r["driver"], r["torch"], r.get("pager")
    if d["baseline"] is None:
        return None
    above = d["peak"] - d["baseline"] - t["max_allocated"]
    context = d["with_context"] - d["baseline"]
    cache = t["max_reserved"] - t["max_allocated"]
    pool = (p["held"] - t["scope_pool"]) if p else 0
    return {"above_torch_peak": above, "context": context, "torch_cache": cache, "pool": pool,
            "other": above - context - cache - pool}


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _gb(values: list | None) -> str:
    return "-" if values is None else f"{median_bytes(values) / 1e9:.2f}"


def _range(s: dict) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}, n={s['n']})"


def _used(c: dict) -> int:
    """The driver's peak over the timed steps, less the device's use before the process."""
    d = c["driver"]
    return d["peak"] - (d["baseline"] or 0)


def _step(c: dict, key: str = "step_s") -> float:
    return c[key]["median"]


_COLUMNS = (("config", 9, "<"), ("step, s (median, min-max)", 26, "<"),
            ("opt.step, s", 26, "<"), ("store rd GB", 11, ">"), ("store wr GB", 11, ">"),
            ("host in GB", 10, ">"), ("host out GB", 11, ">"), ("driver peak GiB", 15, ">"),
            ("torch max alloc", 15, ">"), ("torch max resv", 14, ">"), ("pool held", 9, ">"))


def _row(cells) -> str:
    return "  " + " ".join(f"{c:{align}{width}}"
                           for c, (_, width, align) in zip(cells, _COLUMNS)).rstrip()


def header_lines(r: dict) -> list[str]:
    """What runs, and the table's header."""
    m = r["model"]
    return [f"megatron bench: GPT, {m['layers']} layers, hidden {m['hidden']}, {m['heads']} "
            f"heads, vocab {m['vocab']}, seq {m['seq']}, micro-batch {m['micro_batch']}, "
            f"{m['grads']} grads"
            + (", overlap_grad_reduce" if m["overlap_grad_reduce"] else "")
            + f"; {m['warmup']} warm-up + {m['steps']} timed steps; stores in "
            f"{r['dir']}, buckets of {m['bucket'] // MiB} MiB"
            + (f" x depth {m['depth']}" if m["depth"] else "")
            + (f", pages of {m['page_size'] // MiB} MiB" if m["page_size"] else "")
            + ("" if m["depth"] and m["page_size"] else ", pages and depth per format")
            + ("; map_ram off (a store in RAM goes through io_uring)"
               if m.get("no_map_ram") else "")
            + "; each configuration in its own process, printed as it ends (per step: "
            "medians; GB = 1e9 bytes, GiB = 2^30)",
            _row(name for name, _, _ in _COLUMNS)]


def config_lines(c: dict) -> list[str]:
    """One configuration's row of the table and its notes (with its floor, if paged)."""
    name = c["config"]
    if "error" in c:
        return [f"  {name:9s} failed ({c['error']}):"] + [f"      {line}" for line in c["log_tail"]]
    p, t = c["pager"], c["torch"]
    lines = [_row([name, _range(c["step_s"]), _range(c["opt_step_s"]),
                   *(_gb(p and p[k]) for k in ("bytes_read", "bytes_written", "bytes_from_host",
                                               "bytes_to_host")),
                   _gib(_used(c)), _gib(t["max_allocated"]), _gib(t["max_reserved"]),
                   _gib(p and p["held"])])]
    notes = [f"{CONFIGS[name]['what']}: {c['params'] / 1e9:.3f} B params; {c['seconds']:.0f} s "
             "in all (build, steps, floor)"]
    if p:
        reads = [a + b for a, b in zip(p["bytes_read"], p["bytes_from_host"])]
        one_pass = all(x == p["stored_bytes"] for x in reads)
        writes = [a + b for a, b in zip(p["bytes_written"], p["bytes_to_host"])]
        written = all(x == p["stored_bytes"] for x in writes)
        notes.append(f"stored state {p['stored_bytes'] / 1e9:.2f} GB; per step read = stored: "
                     f"{one_pass}, written = stored: {written}")
        if p.get("skipped_steps"):
            notes.append(f"{p['skipped_steps']} timed steps skipped by Megatron (inf or nan in "
                         "the grads): left out, the figures are of the others")
        if any(p["mapped_read_bytes"]) or any(p["mapped_written_bytes"]):
            notes.append(f"through the mapped store files (map_ram): "
                         f"{median_bytes(p['mapped_read_bytes']) / 1e9:.2f} GB of the read and "
                         f"{median_bytes(p['mapped_written_bytes']) / 1e9:.2f} GB of the "
                         "written per step")
        if p["undo_bytes"]:  # statepager.core.atomic
            notes.append(f"undo copies: {p['undo_bytes'] / 1e9:.2f} GB of pinned "
                         "host memory (all-or-nothing steps: the bf16 params residual mains "
                         "are stored against, copied from the device before each step, while "
                         "forward and backward run; only a failed step reads them)")
        if p["host_budget"]:
            notes.append(f"host tier {p['host_budget'] / 1e9:.2f} GB pinned, "
                         f"{p['host_used'] / 1e9:.2f} GB in use after the steps; spilled to "
                         f"the store over the timed steps: {sum(p['spilled_bytes']) / 1e9:.2f} GB")
        if "bucket_size" in p:
            notes.append(f"pages of {p['page_size'] // MiB} MiB, buckets of "
                         f"{p['bucket_size'] // MiB} MiB x depth {p['depth']}, atomic="
                         f"{p['atomic']!r}"
                         + (f", stationary {p['stationary_bytes'] / GiB:g} GiB"
                            if p.get("stationary_bytes") else ""))
        notes.append(f"{p['buckets']} buckets, largest {p['largest_bucket'] / MiB:.0f} MiB; pool "
                     f"peak mapped {p['peak_mapped'] / GiB:.2f} GiB of a window of "
                     f"{p['window'] / GiB:.2f} GiB")
        if p.get("parts_s"):
            ms = {k: 1e3 * v["median"] for k, v in p["parts_s"].items()}
            loop = (f"its bucket loop {ms['loop']:.1f} ms (in the next forward's hooks, "
                    "not in opt.step)" if p.get("under_forward") else
                    f"its bucket loop {ms['loop']:.1f} ms")
            notes.append(f"opt.step's host time (medians): the pager's set-up {ms['setup']:.1f} "
                         f"ms (the epoch, the first page-ins, the snapshot), {loop}, commit "
                         f"{ms['commit']:.1f} ms; the rest, Megatron's own (grad copies, norm, "
                         f"clip, the params' sync) and the pager's bookkeeping after the loop, "
                         f"{ms['rest']:.1f} ms")
        if p.get("loop_host_s"):
            ms = {k: 1e3 * v["median"] for k, v in p["loop_host_s"].items()}
            notes.append(f"in the bucket loop, the host's time (medians): stepping "
                         f"{ms['stepping']:.1f} ms (each bucket's kernels queued, its hooks), "
                         f"waiting for page-ins {ms['page_ins']:.1f} ms, for the device "
                         f"{ms['device']:.1f} ms (the residual exception counts of the bucket "
                         f"stepped two before), for page-outs to land {ms['page_outs']:.1f} ms "
                         "(room in the window, the last ones)")
        if p.get("under_forward"):
            if p.get("in_hooks_s"):
                where = ("waiting for the step's thread, which steps the buckets" if
                         p.get("step_thread") else "stepping buckets and waiting for copies")
                notes.append(f"the training thread's time in the forward's hooks (median): "
                             f"{1e3 * p['in_hooks_s']['median']:.1f} ms an iteration, {where}")
            thread = {k: 1e3 * v["median"] for k, v in (p.get("loop_host_s") or {}).items()}
            if p.get("step_thread") and thread.get("thread_cpu"):
                notes.append(f"the step's thread (medians): started "
                             f"{thread['thread_start']:.1f} ms after step() left the buckets "
                             f"to the forward, its own CPU time {thread['thread_cpu']:.1f} ms")
            held = p.get("held_back") or {}
            why = (f"; grad-sync starts that began none: {held['the step in flight']} with "
                   f"the step in flight still paging, {held['room']} without room for its "
                   "page-ins" if held else "")
            notes.append(f"steps whose first page-ins began in the backward before them: "
                         f"{p.get('begun_in_backward', 0)} (warm-up and timed){why}")
    if c.get("cpu_cores"):
        notes.append("CPU over the timed steps, in cores busy: " + ", ".join(
            f"{kind} {cores:.1f}" for kind, cores in c["cpu_cores"].items())
            + f" (of {c['cpus']})")
    b = breakdown(c)
    if b:
        notes.append(f"driver peak - torch max allocated = {_gib(b['above_torch_peak'])} GiB: "
                     f"CUDA context {_gib(b['context'])} + torch cache {_gib(b['torch_cache'])}"
                     f" + page pool {_gib(b['pool'])} + other {_gib(b['other'])} (driver: "
                     f"{c['driver']['source']}, sampled every ms)")
    first = (f"; pool mapped before the first step {_gib(p['mapped_before_first_step'])} GiB"
             if p else "")
    d = c["driver"]
    notes.append(f"warm-up steps: driver peak {_gib(d['warmup_peak'] - (d['baseline'] or 0))} "
                 f"GiB{first}; loss {c['losses'][0]:.4f} -> {c['losses'][-1]:.4f}")
    f = c.get("floor")
    if f:
        notes.append((f"step {multiple(c['step_s']['median'], f['seconds'], 'the floor')}, "
                      f"opt.step {multiple(c['opt_step_s']['median'], f['seconds'], 'the floor')}"
                      f", of which the pager's pipeline {_pipeline_share(p, f)}"
                      if f["seconds"] else "no floor") +
                     "; the floor of its median step's bytes, measured after its steps:")
        notes += ["  " + line for line in bench_floor.describe(f)]
    if c.get("iteration"):
        notes.append(_iteration_line(c["iteration"]))
    if c.get("device_time"):
        notes.append(_device_time_line(c["device_time"]))
    if c.get("checkpoint"):
        notes.append(megatron_checkpoint.line(c, p["stored_bytes"] if p else None))
    if c["timeline_files"]:
        notes.append(f"timelines written: {', '.join(c['timeline_files'])}")
    return lines + [f"  {'':9s} {note}" for note in notes]


def _iteration_line(t: dict) -> str:
    """One more iteration under torch.profiler (--iteration-trace, --iteration-plot)."""
    if "error" in t:
        return f"one more iteration under torch.profiler failed: {t['error']}"
    b = t["busy_ms"]
    return (f"one more iteration under torch.profiler: {t['span_ms']:.1f} ms; on the host "
            f"forward {b['forward']:.1f}, backward {b['backward']:.1f}, optimizer.step "
            f"{b['optimizer.step']:.1f} ms; on the device the model's kernels "
            f"{b['compute']:.1f} ms, statepager's {b['statepager']:.1f} ms, copies "
            f"{t['copies_ms']:.1f} ms (host to device {b['h2d']:.1f}, device to host "
            f"{b['d2h']:.1f}), {t['copies_under_compute_ms']:.1f} ms of them under the "
            f"model's kernels" + "".join(
                f"; while the host ran {phase} h2d {ways['h2d']:.1f}, d2h {ways['d2h']:.1f}"
                for phase, ways in t["copies_in_phase_ms"].items())
            + "; the forward's longest stretch without a copy of the state {1:.1f} ms, from "
              "{0:.1f} ms".format(*t["forward_without_copies_ms"]))


def _device_time_line(t: dict) -> str:
    """One more step's optimizer.step() under torch.profiler (--device-time)."""
    if "error" in t:
        return f"one more step's optimizer.step() under torch.profiler failed: {t['error']}"
    if not t["kernels_s"]:
        return ("one more step's optimizer.step() under torch.profiler: the profiler saw no "
                "kernel (no CUDA activity from CUPTI)")

    def ms(seconds: float) -> str:
        return f"{1e3 * seconds:.1f} ms"

    kernels = ", ".join(f"{name} {ms(s)}" for name, s in list(t["by_kernel"].items())[:4])
    return (f"one more step's optimizer.step() under torch.profiler, on the device: "
            f"statepager's kernels {ms(t['statepager_kernels_s'])}"
            f"{f' ({kernels})' if kernels else ''} of all kernels' {ms(t['kernels_s'])}, "
            f"{t['statepager_launches']} of {t['launches']} launches; "
            f"copies busy host to device {ms(t['h2d_busy_s'])}, device to host "
            f"{ms(t['d2h_busy_s'])}, both at once {ms(t['both_busy_s'])}")


def _pipeline_share(p: dict, f: dict) -> str:
    """The pager's pipeline (its buckets' page-ins, steps and page-outs: the part of opt.step
    the floor's bytes bound; the rest is the optimizer's own work around it, but for the
    grad norm its first page-ins overlap, from Megatron's prepare_grads) against the
    floor."""
    s = p["pipeline_s"]["median"]
    beaten = (" (below the floor: that floor was none, its PCIe copies slower than the "
              "pipeline's own)" if s < f["seconds"] else "")
    return f"{s:.3f} s = {multiple(s, f['seconds'], 'the floor')}{beaten}"


def _done(configs: list) -> dict:
    return {c["config"]: c for c in configs if "error" not in c}


def summary_lines(r: dict) -> list[str]:
    """The comparisons between configurations: with Megatron's offload, with each one's
    floor, the narrow formats with fp32, and the kernels' device time."""
    done = _done(r["configs"])
    lines = ["summary (medians of the timed steps):"]
    lines += _offload_lines(done)
    lines += _unpaged_lines(done)
    floored = [(n, c, c["floor"]) for n, c in done.items()
               if c.get("floor") and c["floor"]["seconds"]]
    if floored:
        lines.append("  against each one's floor (the larger of PCIe and fio, for its bytes):")
        lines += [f"    {n:9s} {_floor_comparison(c, f)}" for n, c, f in floored]
    for narrow, wide in (("q8", "fp32"), ("host-q8", "host-fp32")):
        if narrow in done and wide in done:
            a, b = done[narrow], done[wide]
            lines.append(f"  {narrow} / {wide}: step {_step(a) / _step(b):.2f}, opt.step "
                         f"{_step(a, 'opt_step_s') / _step(b, 'opt_step_s'):.2f} ({narrow}'s "
                         f"step is {faster(_step(a), _step(b), higher_is_better=False)})")
    kernels = [f"{n} {1e3 * t['statepager_kernels_s']:.1f} ms = "
               f"{t['statepager_kernels_s'] / _step(c, 'opt_step_s'):.2f} x its opt.step"
               for n, c in done.items() if c["pager"]
               for t in [c.get("device_time") or {}] if t.get("kernels_s")]
    if kernels:
        lines.append("  statepager's kernels on the device in one more optimizer.step() "
                     f"(--device-time): {', '.join(kernels)}")
    if r["failed"]:
        lines.append(f"  failed: {', '.join(r['failed'])} (their logs above)")
    return lines


def _offload_lines(done: dict) -> list[str]:
    """Each configuration's step, opt.step and driver peak against Megatron's offload."""
    offload = done.get("offload")
    if not offload:
        return ["  Megatron's offload: not measured (not in --configs, or failed)"]
    step, opt_step, peak = _step(offload), _step(offload, "opt_step_s"), _used(offload)
    offloads = "the offload's"
    lines = [f"  step against Megatron's offload ({step:.3f} s; opt.step {opt_step:.3f} s; "
             f"driver peak {_gib(peak)} GiB):"]
    for n, c in done.items():
        if n == "offload" or _unpaged_of(n) != "unpaged":  # the offload steps Adam
            continue
        ours, used = _step(c, "opt_step_s"), _used(c)
        lines.append(f"    {n:9s} {_step(c):.3f} s: "
                     f"{faster(_step(c), step, higher_is_better=False)}; opt.step {ours:.3f} s: "
                     f"{faster(ours, opt_step, higher_is_better=False)}; driver peak "
                     f"{_gib(used)} GiB = {multiple(used, peak, offloads)}")
    return lines


def _unpaged_of(name: str) -> str:
    """The unpaged configuration a configuration compares with: the same optimizer's."""
    return "muon-unpaged" if CONFIGS[name].get("setup") == MUON else "unpaged"


def _unpaged_lines(done: dict) -> list[str]:
    """Each paged configuration's whole iteration (forward + backward + step) against its
    optimizer's unpaged one: the paging it leaves exposed, and the multiple of the larger
    of unpaged's iteration and the floor of its bytes (what steps under the forward can
    reach)."""
    lines = []
    for base_name in ("unpaged", "muon-unpaged"):
        unpaged = done.get(base_name)
        paged = [(n, c) for n, c in done.items() if c["pager"] and _unpaged_of(n) == base_name]
        if not unpaged or not paged:
            continue
        base = _step(unpaged)
        lines.append(f"  the whole iteration against {base_name}'s ({base:.3f} s):")
        for n, c in paged:
            floor = (c.get("floor") or {}).get("seconds") or 0.0
            lines.append(f"    {n:9s} {_step(c):.3f} s = {_step(c) / base:.2f} x, paging "
                         f"exposed {_step(c) - base:.3f} s; {_step(c) / max(base, floor):.2f} x "
                         f"the larger of {base_name}'s and its floor ({floor:.3f} s)")
    return lines


def _floor_comparison(c: dict, f: dict) -> str:
    """A configuration's step, opt.step and pipeline as multiples of its floor; a pipeline
    below the floor shows that the floor was none (see Note [The floor of a step])."""
    pipeline = c["pager"]["pipeline_s"]["median"]
    if pipeline < f["seconds"]:
        return (f"not shown: the pager's pipeline ({pipeline:.3f} s) beat its floor "
                f"({f['seconds']:.3f} s, set by {f['bound_by']}), so that floor was none (its "
                "PCIe copies ran slower than the pipeline's own); run again")
    return (f"step {multiple(_step(c), f['seconds'], 'its floor')}, opt.step "
            f"{multiple(_step(c, 'opt_step_s'), f['seconds'], 'its floor')}, the pager's "
            f"pipeline {multiple(pipeline, f['seconds'], 'its floor')} ({f['seconds']:.3f} s, set "
            f"by {f['bound_by']})")


def print_megatron(r: dict) -> None:
    """The whole report of a finished run (e.g. from --json)."""
    print_lines(header_lines(r))
    for c in r["configs"]:
        print_lines(config_lines(c))
    print_summary(r)


def print_summary(r: dict) -> None:
    """What follows the lines bench_megatron printed as it ran."""
    print_lines(summary_lines(r))

