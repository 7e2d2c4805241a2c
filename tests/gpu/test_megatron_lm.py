"""Megatron-LM's pretrain_gpt.py, unchanged, through `python -m statepager.megatron_lm` on
one GPU (torchrun; the DP = 2 test needs two): a tiny GPT (2 layers, hidden 256,
--transformer-impl local, mock data) trained 20 iterations with checkpoints at 10 and
20, compared with the same run unpaged; then the paged run killed (SIGKILL, the whole
process group) once it has logged iteration 15 and restarted with --load: iterations
11-20 as in the uninterrupted run, and the optimizer state statepager saved at 20 byte
for byte the uninterrupted run's. Losses and grad norms are compared as Megatron logs
them (every iteration). Also: --no-load-optim against Megatron's own, a rank's state
missing, a refused flag, --async-save, a crash between statepager's save and Megatron's,
statepager turned on by environment variables alone (no -m statepager.megatron_lm:
the package's start-up hook, its .pth in a site directory), --optimizer muon paged,
unpaged, killed and restarted, and Megatron's own optimizer checkpoints (through the
pager) loaded at the same and, with two GPUs, at the other data-parallel size, and
resumed by Megatron-LM without statepager.

Megatron's own logging: the first iteration a run logs does not reset its loss sum
(training_log's is_first_iteration), so the second iteration after a resume prints the
mean of both losses (every resume shows it); resumed_as() checks that iteration against
that mean. Megatron-LM alone resuming a checkpoint (a paged run's in Megatron's format,
and the unpaged run's own as the control) runs through plain_megatron_lm.py: megatron-core
0.19.2 with torch's AdamW (no TransformerEngine, no apex) fails any resume while building
the optimizer's sharded state dict before the first step (DistributedOptimizer.state_dict:
`assert len(steps) == 1`, the state being empty), and its load leaves every state one
shared step tensor holding the loader's own step from before the load (dp_reshardable's
parameter state copies it in), so AdamW restarts its bias correction; that script works
around these two and nothing else. The uninterrupted unpaged run is the reference of
every resume.

The runs are independent processes, started in two waves (each run's inputs come from
the first) that run at once on the GPU(s), so the whole module takes about two runs'
time; the tests then check what they logged and wrote.

Skips without CUDA, megatron-core, or Megatron-LM's training scripts in .deps/megatron-lm
(git-ignored; NVIDIA/Megatron-LM core_r0.19.0). Each run's log is kept under
$STATEPAGER_TEST_LOGS when set (scripts/gpu.sh megatron-lm sets it), else in tmp_path."""
import argparse
import concurrent.futures
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MEGATRON_LM = os.path.join(ROOT, ".deps", "megatron-lm")
PRETRAIN_GPT = os.path.join(MEGATRON_LM, "pretrain_gpt.py")
PLAIN_MEGATRON_LM = os.path.join(os.path.dirname(__file__), "plain_megatron_lm.py")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.alone,  # several torchruns at once of its own
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core is not installed (the GPU suite carries it)"),
    pytest.mark.skipif(not os.path.isfile(PRETRAIN_GPT),
                       reason=f"Megatron-LM's pretrain_gpt.py is not in {MEGATRON_LM} "
                              "(NVIDIA/Megatron-LM core_r0.19.0, git-ignored)"),
]

ITERS, SAVE_AT, KILL_AT = 20, 10, 15
TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
    "--bf16", "--use-distributed-optimizer", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",  # no apex, no TE
    "--no-persist-layer-norm", "--no-rope-fusion",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--save-interval", str(SAVE_AT),
]
MUON = ["--optimizer", "muon"]
HAVE_EMERGING = importlib.util.find_spec("emerging_optimizers") is not None
# Megatron's param all-gathers in the forward's pre-hooks (it needs the grad reduce
# overlapped too).
PARAM_GATHER_IN_THE_FORWARD = ["--overlap-grad-reduce", "--overlap-param-gather"]
MEGATRON_FORMAT = ["--statepager-optimizer-checkpoint", "megatron"]
PAGED = ["--statepager-dir", "{store}", "--statepager-bucket-size", "4M",
         "--statepager-page-size", "2M", "--statepager-hbm-budget", "256M"]
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: "
                  r"([0-9.]+) \|")


class Runs:
    """Megatron runs in one folder; each run(name, ...) returns (exit status, log)."""

    def __init__(self, folder):
        self.folder = folder
        self.logs = os.environ.get("STATEPAGER_TEST_LOGS") or folder
        os.makedirs(self.logs, exist_ok=True)

    def path(self, *parts):
        return os.path.join(self.folder, *parts)

    def run(self, name, extra, *, paged=True, gpus=1, kill_after=None, env=None,
            entry=True, first_path=None, plain=False):
        """kill_after=N: SIGKILL to the whole run (torchrun and its workers) once it has
        logged iteration N. entry=False: plain pretrain_gpt.py, statepager's options
        only in `env` (the startup hook's way). plain=True (unpaged): through
        plain_megatron_lm.py (able to resume, statepager not importable; see there)."""
        store = self.path(f"store-{name}-{{rank}}")
        argv = TINY_GPT + extra + [a.replace("{store}", store)
                                   for a in PAGED if paged and entry]
        module = ["-m", "statepager.megatron_lm"] if paged and entry else []
        script = [PLAIN_MEGATRON_LM, PRETRAIN_GPT] if plain else [PRETRAIN_GPT]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(gpus)] + module + script + argv
        path = ([first_path] if first_path else []) + [MEGATRON_LM] + sys.path
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(path), **(env or {}))
        p = subprocess.Popen(cmd, cwd=self.folder, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines = []
        try:
            for line in p.stdout:
                lines.append(line)
                m = LINE.search(line)
                if kill_after is not None and m and int(m.group(1)) >= kill_after:
                    os.killpg(p.pid, signal.SIGKILL)
                    lines.append(f"[test] SIGKILL to the run after iteration {m.group(1)}\n")
                    break
            code = p.wait(timeout=400)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        text = "".join(lines)
        with open(os.path.join(self.logs, f"{name}.log"), "w") as f:
            f.write(" ".join(cmd) + "\n\n" + text)
        return code, text


def logged(text):
    """{iteration: (loss, grad norm)} as Megatron's log lines print them."""
    return {int(i): (loss, norm) for i, loss, norm in LINE.findall(text)}


def ok(result):
    code, text = result
    assert code == 0, text[-4000:]
    return text


def resumed_as(resumed, uninterrupted, first):
    """`resumed` (a run resumed at iteration `first`) logs iterations first..ITERS as
    `uninterrupted` did: the same losses and grad norms, but for Megatron's print of the
    second iteration after a resume (the mean of that iteration's loss and the one
    before: see the module's docstring), checked against that mean to the printed
    precision."""
    assert sorted(resumed) == list(range(first, ITERS + 1))
    for i in range(first, ITERS + 1):
        loss, norm = resumed[i]
        assert norm == uninterrupted[i][1], f"iteration {i}: grad norm {norm} vs {uninterrupted[i]}"
        if i != first + 1:
            assert loss == uninterrupted[i][0], f"iteration {i}: loss {loss} vs {uninterrupted[i]}"
        else:
            mean = (float(uninterrupted[i - 1][0]) + float(uninterrupted[i][0])) / 2
            assert abs(float(loss) - mean) <= 2e-6 * mean, (i, loss, mean)


def same_state(a, b, iteration=ITERS, rank=0):
    """statepager's saved state of `iteration` in checkpoint folders a and b: the same
    manifest but for where each tensor lies in its data file (a run stepping buckets in
    the forward's order stores them in that order), and each tensor's bytes the same."""
    part = os.path.join(f"iter_{iteration:07d}", "statepager", f"rank{rank:05d}")
    x, y = read_state(os.path.join(a, part)), read_state(os.path.join(b, part))
    assert x[0] == y[0], f"{a} and {b}: the manifests differ"
    assert x[1].keys() == y[1].keys()
    for key in x[1]:
        assert x[1][key] == y[1][key], f"{a} and {b}: {key} differs"


def megatron_tensors(base, iteration=ITERS) -> dict:
    """{key: value} of the torch_dist checkpoint Megatron saved at `iteration` in `base`:
    its model and optimizer tensors (and the objects saved beside them), read with torch's
    own reader of distributed checkpoints."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    directory = os.path.join(base, f"iter_{iteration:07d}")
    out = directory + ".pt"
    dcp_to_torch_save(directory, out)
    try:
        return torch.load(out, weights_only=False)
    finally:
        os.remove(out)


def assert_same_tensors(expected: dict, got: dict, name: str) -> None:
    """Every key of two megatron_tensors() the same, each tensor bit for bit (the RNG
    states and the run's own arguments, its paths and flags, which say nothing of the
    training state, aside). Every difference is named at once."""
    assert expected.keys() == got.keys(), (name, expected.keys() ^ got.keys())
    keys = [k for k in expected if "rng_state" not in k]
    assert any(k.startswith("optimizer.") for k in keys), (name, sorted(expected))
    differences = []
    for key in keys:
        differences += differing(expected[key], got[key], key)
    assert not differences, (name, differences)


def differing(x, y, where: str) -> list:
    """Where x and y differ (a tensor's dtype or bits, a key, a length, a value)."""
    if isinstance(x, torch.Tensor):
        same = isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        return [] if same else [where]
    if isinstance(x, argparse.Namespace):
        return []  # the run's arguments (Megatron's common state keeps them)
    if isinstance(x, dict):
        if not isinstance(y, dict) or x.keys() != y.keys():
            return [where]
        return [d for k in x for d in differing(x[k], y[k], f"{where}.{k}")]
    if isinstance(x, (list, tuple)):
        if type(x) is not type(y) or len(x) != len(y):
            return [where]
        return [d for i, (a, b) in enumerate(zip(x, y)) for d in differing(a, b, f"{where}[{i}]")]
    return [] if x == y else [where]


def read_state(directory):
    """(the manifest but for the tensors' places: their offsets, their order, the data
    file's size; {(optimizer, parameter, state name): the tensor's bytes}) of the
    statepager checkpoint in `directory`."""
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    tensors = {}
    for entry in manifest["optimizers"]:
        with open(os.path.join(directory, entry["data"]), "rb") as data:
            for t in entry["tensors"]:
                if not t["zero"]:
                    data.seek(t["offset"])
                    tensors[entry["name"], t["param"], t["name"]] = data.read(t["bytes"])
                t.pop("offset")
        entry["tensors"].sort(key=lambda t: (t["param"], t["name"]))  # saved in bucket order
        entry.pop("data_bytes")
    manifest.pop("manifest_sha256")
    assert tensors
    return manifest, tensors


two_gpus = torch.cuda.device_count() >= 2


def wave(runs, jobs):
    """Runs `jobs` ({key: (name, extra, options)}) at once; {key: (status, log)}."""
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {key: pool.submit(runs.run, name, extra, **options)
                   for key, (name, extra, options) in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def env_only_options(r):
    """Plain `torchrun pretrain_gpt.py`, statepager's options in STATEPAGER_* only: the
    start-up hook (the .pth that `statepager autoload on` writes beside the hook module
    in site-packages; here in a site directory that a sitecustomize on PYTHONPATH adds,
    as Python adds site-packages) hooks Megatron-LM when it is imported."""
    site_dir, startup = r.path("env-site"), r.path("env-startup")
    os.makedirs(site_dir)
    os.makedirs(startup)
    shutil.copy(os.path.join(ROOT, "python", "_statepager_autoload.py"), site_dir)
    subprocess.run([sys.executable, "-m", "statepager", "autoload", "on", "--site-dir",
                    site_dir], check=True, timeout=120)
    with open(os.path.join(startup, "sitecustomize.py"), "w") as f:
        f.write(f"import site\nsite.addsitedir({site_dir!r})\n")
    env = {"STATEPAGER_DIR": r.path("store-env-{rank}"), "STATEPAGER_BUCKET_SIZE": "4M",
           "STATEPAGER_PAGE_SIZE": "2M", "STATEPAGER_HBM_BUDGET": "256M"}
    return dict(env=env, entry=False, first_path=startup)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = Runs(str(tmp_path_factory.mktemp("megatron_lm")))
    a, b, k = r.path("ckpt-unpaged"), r.path("ckpt-paged"), r.path("ckpt-killed")
    crash = r.path("ckpt-crash")
    # Megatron's part of iteration 10 cannot be written (its metadata.json is taken by a
    # directory): the crash run dies after statepager's part, before the tracker names 10.
    blocker = os.path.join(crash, f"iter_{SAVE_AT:07d}", "metadata.json")
    os.makedirs(blocker)
    first = {
        "unpaged": ("unpaged", ["--save", a], dict(paged=False)),
        "paged": ("paged", ["--save", b], {}),
        "killed": ("killed", ["--save", k], dict(kill_after=KILL_AT)),
        "refused": ("refused", ["--save", r.path("ckpt-refused"), "--ckpt-format", "torch"], {}),
        "async": ("async", ["--save", r.path("ckpt-async"), "--async-save", "--async-strategy",
                            "mcore", "--use-persistent-ckpt-worker", "--timing-log-level", "1",
                            "--logging-level", "20"],
                  {}),
        "crash": ("crash", ["--save", crash, "--save-interval", "5"], {}),
        "env": ("env", ["--save", r.path("ckpt-env")], env_only_options(r)),
        "overlap": ("overlap", ["--save", r.path("ckpt-overlap"),
                                "--statepager-overlap-forward", "on"], {}),
        "overlap-gather": ("overlap-gather", ["--save", r.path("ckpt-overlap-gather"),
                                              "--statepager-overlap-forward", "on"]
                           + PARAM_GATHER_IN_THE_FORWARD, {}),
        "megatron-format": ("megatron-format", ["--save", r.path("ckpt-megatron-format")]
                            + MEGATRON_FORMAT, {}),
        "megatron-format-residual": ("megatron-format-residual", [
            "--save", r.path("ckpt-megatron-format-residual"), "--statepager-mains",
            "residual"] + MEGATRON_FORMAT, {}),
    }
    if HAVE_EMERGING:  # --optimizer muon with --use-distributed-optimizer: layer-wise
        first.update({
            "muon-unpaged": ("muon-unpaged", MUON, dict(paged=False)),
            "muon-paged": ("muon-paged", MUON + ["--save", r.path("ckpt-muon-paged")], {}),
            "muon-killed": ("muon-killed", MUON + ["--save", r.path("ckpt-muon-killed")],
                            dict(kill_after=KILL_AT)),
        })
    if two_gpus:
        first.update({
            "dp2-unpaged": ("dp2-unpaged", ["--save", r.path("dp2-unpaged")],
                            dict(paged=False, gpus=2)),
            "dp2-paged": ("dp2-paged", ["--save", r.path("dp2-paged")], dict(gpus=2)),
            "dp2-killed": ("dp2-killed", ["--save", r.path("dp2-killed")],
                           dict(gpus=2, kill_after=KILL_AT)),
            "dp2-megatron-format": ("dp2-megatron-format", ["--save", r.path(
                "ckpt-dp2-megatron-format")] + MEGATRON_FORMAT, dict(gpus=2)),
            "dp2-overlap-gather": ("dp2-overlap-gather", [
                "--save", r.path("dp2-overlap-gather"), "--statepager-overlap-forward", "on"]
                + PARAM_GATHER_IN_THE_FORWARD, dict(gpus=2)),
        })
    r.result = wave(r, first)
    # What the crash left, before its restart changes it.
    r.crash_tracker = tracker(crash)
    r.crash_part = os.path.isfile(os.path.join(crash, f"iter_{SAVE_AT:07d}", "statepager",
                                               "rank00000", "manifest.json"))
    os.rmdir(blocker)
    broken = r.path("ckpt-broken")
    shutil.copytree(b, broken, symlinks=True)
    shutil.rmtree(os.path.join(broken, f"iter_{SAVE_AT:07d}", "statepager", "rank00000"))
    load_fresh = ["--ckpt-step", str(SAVE_AT), "--no-load-optim"]
    second = {
        "restarted": ("restarted", ["--load", k, "--save", k], {}),
        "fresh-paged": ("fresh-paged", ["--load", b] + load_fresh, {}),
        "fresh-unpaged": ("fresh-unpaged", ["--load", a] + load_fresh, dict(paged=False)),
        "broken": ("broken", ["--load", broken, "--ckpt-step", str(SAVE_AT)], {}),
        # Restarted: resumes from 5, saves 10 again (replacing the unfinished part), 15, 20.
        "crash-resumed": ("crash-resumed", ["--load", crash, "--save", crash,
                                            "--save-interval", "5"], {}),
    }
    # Megatron's own optimizer checkpoints, loaded paged: the unpaged run's, and the paged
    # run's that Megatron wrote through the pager.
    second.update({
        name: (name, ["--load", ckpt, "--ckpt-step", str(SAVE_AT), "--save", r.path(
            f"ckpt-{name}")] + MEGATRON_FORMAT + more, {})
        for name, ckpt, more in (
            ("unpaged-to-paged", a, []),
            ("unpaged-to-paged-residual", a, ["--statepager-mains", "residual"]),
            ("megatron-format-resumed", r.path("ckpt-megatron-format"), []))})
    # The same checkpoints (the unpaged one as the control) resumed by Megatron-LM alone.
    second.update({
        name: (name, ["--load", r.path(ckpt), "--ckpt-step", str(SAVE_AT), "--save", r.path(
            f"ckpt-{name}")], dict(paged=False, plain=True))
        for name, ckpt in (("unpaged-resumed", "ckpt-unpaged"),
                           ("paged-to-unpaged", "ckpt-megatron-format"),
                           ("residual-to-unpaged", "ckpt-megatron-format-residual"))})
    if HAVE_EMERGING:
        second["muon-restarted"] = ("muon-restarted", MUON + [
            "--load", r.path("ckpt-muon-killed"), "--save", r.path("ckpt-muon-killed")], {})
    if two_gpus and r.result["dp2-paged"][0] == 0:
        dp2_broken = r.path("dp2-broken")
        shutil.copytree(r.path("dp2-paged"), dp2_broken, symlinks=True)
        shutil.rmtree(os.path.join(dp2_broken, f"iter_{SAVE_AT:07d}", "statepager",
                                   "rank00001"))
        second.update({
            "dp2-restarted": ("dp2-restarted", ["--load", r.path("dp2-killed"), "--save",
                                                r.path("dp2-killed")], dict(gpus=2)),
            "dp2-broken": ("dp2-broken", ["--load", dp2_broken, "--ckpt-step", str(SAVE_AT)],
                           dict(gpus=2)),
        })
    if two_gpus:  # Megatron's optimizer checkpoints loaded at the other data-parallel size
        at_10 = ["--ckpt-step", str(SAVE_AT)] + MEGATRON_FORMAT
        dp2_ckpt = r.path("ckpt-dp2-megatron-format")
        second.update({
            "dp2-to-dp1": ("dp2-to-dp1", ["--load", dp2_ckpt] + at_10, {}),
            "dp2-to-dp1-fresh": ("dp2-to-dp1-fresh", ["--load", dp2_ckpt, "--no-load-optim"]
                                 + at_10, {}),
            "dp1-to-dp2": ("dp1-to-dp2", ["--load", r.path("ckpt-megatron-format")] + at_10,
                           dict(gpus=2)),
            "dp1-to-dp2-fresh": ("dp1-to-dp2-fresh", ["--load", r.path(
                "ckpt-megatron-format"), "--no-load-optim"] + at_10, dict(gpus=2)),
        })
    r.result.update(wave(r, second))
    r.unpaged = logged(ok(r.result["unpaged"]))
    r.paged_text = ok(r.result["paged"])
    r.paged = logged(r.paged_text)
    return r


def tracker(base):
    """What Megatron's tracker file in `base` names, or None."""
    path = os.path.join(base, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def test_paged_losses_equal_unpaged(runs):
    assert sorted(runs.unpaged) == list(range(1, ITERS + 1))
    assert runs.paged == runs.unpaged


def test_steps_under_the_forward_equal_unpaged(runs):
    """--statepager-overlap-forward on: each step ends under the next forward; the losses
    are unpaged Megatron's, and the checkpoints (saved after a step in flight completes)
    are the paged run's, byte for byte. With --overlap-param-gather each bucket group's
    all-gather, dispatched in the forward's hooks, reads its mains stepped."""
    for name in ("overlap", "overlap-gather"):
        assert logged(ok(runs.result[name])) == runs.unpaged, name
        same_state(runs.path("ckpt-paged"), runs.path(f"ckpt-{name}"))


@pytest.mark.skipif(not HAVE_EMERGING, reason="emerging-optimizers is not installed (the "
                                              "GPU suite carries its wheel)")
def test_muon_paged_equals_unpaged_and_resumes_exactly(runs):
    """--optimizer muon (Megatron-LM builds the layer-wise chain: Muon for the matrices,
    a DistributedOptimizer's Adam for the rest): the paged run logs unpaged Megatron's
    losses and grad norms, and killed at 15 and restarted it continues exactly."""
    unpaged = logged(ok(runs.result["muon-unpaged"]))
    assert sorted(unpaged) == list(range(1, ITERS + 1)) and unpaged != runs.unpaged
    paged = logged(ok(runs.result["muon-paged"]))
    assert paged == unpaged
    code, text = runs.result["muon-killed"]
    assert code != 0 and max(logged(text)) == KILL_AT
    resumed_as(logged(ok(runs.result["muon-restarted"])), paged, SAVE_AT + 1)
    same_state(runs.path("ckpt-muon-paged"), runs.path("ckpt-muon-killed"))


def test_megatron_s_own_optimizer_checkpoints_resume_paged_runs_exactly(runs):
    """--statepager-optimizer-checkpoint megatron: Megatron saves and loads the optimizer
    (torch_dist, through the pager). The paged run logs the unpaged one's iterations; its
    checkpoint at 10, and the unpaged run's, each resume a fresh paged run that logs
    iterations 11-20 as the uninterrupted run; the unpaged run's also into residual
    mains (encoded against the model params Megatron loads first). The checkpoints at 20
    (the paged run's, each resumed run's) hold the uninterrupted unpaged run's tensors."""
    assert logged(ok(runs.result["megatron-format"])) == runs.unpaged
    assert not os.path.exists(runs.path("ckpt-megatron-format", f"iter_{SAVE_AT:07d}",
                                        "statepager"))
    for name in ("unpaged-to-paged", "unpaged-to-paged-residual", "megatron-format-resumed"):
        resumed_as(logged(ok(runs.result[name])), runs.unpaged, SAVE_AT + 1)
    # What they saved at 20 (model and optimizer, Megatron's format), and what the paged
    # run saved, is what the uninterrupted unpaged run saved, tensor for tensor.
    unpaged = megatron_tensors(runs.path("ckpt-unpaged"))
    for name in ("megatron-format", "unpaged-to-paged", "unpaged-to-paged-residual",
                 "megatron-format-resumed"):
        assert_same_tensors(unpaged, megatron_tensors(runs.path(f"ckpt-{name}")), name)


def test_megatron_lm_alone_resumes_paged_runs_checkpoints_exactly(runs):
    """A paged run's checkpoint at 10 in Megatron's format (fp32 mains, or residual mains
    decoded into Megatron's fp32), resumed by Megatron-LM without statepager (importing it
    fails there; plain_megatron_lm.py works around the two megatron-core bugs that keep it
    from resuming any checkpoint exactly here), logs iterations 11-20 as the uninterrupted
    unpaged run and saves at 20 its tensors. The control: Megatron-LM alone resuming the
    unpaged run's own checkpoint."""
    assert logged(ok(runs.result["megatron-format-residual"])) == runs.unpaged
    unpaged = megatron_tensors(runs.path("ckpt-unpaged"))
    for name in ("unpaged-resumed", "paged-to-unpaged", "residual-to-unpaged"):
        resumed_as(logged(ok(runs.result[name])), runs.unpaged, SAVE_AT + 1)
        assert_same_tensors(unpaged, megatron_tensors(runs.path(f"ckpt-{name}")), name)


@pytest.mark.skipif(not two_gpus, reason="needs two GPUs (DP = 2)")
@pytest.mark.parametrize("saved,resumed", [("dp2-megatron-format", "dp2-to-dp1"),
                                           ("megatron-format", "dp1-to-dp2")])
def test_megatron_s_optimizer_checkpoints_load_at_another_data_parallel_size(runs, saved,
                                                                            resumed):
    """--statepager-optimizer-checkpoint megatron, saved at one data-parallel size (its
    dp_reshardable layout) and loaded paged at the other. Iteration 11 logs the saving
    run's loss (the same params and batch). From then on the other size sums the same
    grads in another order, so the runs part in the last bits only: iteration 12 (the
    first after a step from the loaded state) within 2e-6 of the saving run, where a
    resume with fresh optimizer state (--no-load-optim) lands farther; all within 1e-3."""
    source = logged(ok(runs.result[saved]))
    got, fresh = logged(ok(runs.result[resumed])), logged(ok(runs.result[resumed + "-fresh"]))
    assert sorted(got) == list(range(SAVE_AT + 1, ITERS + 1))

    def off(run, i):
        return abs(float(run[i][0]) - float(source[i][0])) / float(source[i][0])
    assert got[SAVE_AT + 1][0] == source[SAVE_AT + 1][0]
    # Iteration 12's print is the mean of 11's and 12's losses (see resumed_as): the
    # same in all three runs but for 12's.
    assert off(got, SAVE_AT + 2) <= 2e-6 < off(fresh, SAVE_AT + 2), (got, fresh, source)
    assert all(off(got, i) <= 1e-3 for i in got), (got, source)


def test_log_line_carries_step_stats(runs):
    lines = [line for line in runs.paged_text.splitlines() if "lm loss:" in line]
    assert len(lines) == ITERS
    assert all("statepager read/written per iter (GB):" in line for line in lines)
    assert "statepager: optimizer state paged through" in runs.paged_text


def test_checkpoint_holds_statepager_state_beside_megatrons(runs):
    for it in (SAVE_AT, ITERS):
        d = runs.path("ckpt-paged", f"iter_{it:07d}")
        assert os.path.isfile(os.path.join(d, "statepager", "rank00000", "manifest.json"))
        assert os.path.isfile(os.path.join(d, "metadata.json"))  # Megatron's torch_dist
    assert tracker(runs.path("ckpt-paged")) == str(ITERS)


def test_killed_at_15_and_restarted_continues_exactly(runs):
    code, text = runs.result["killed"]
    assert code != 0 and "SIGKILL to the run after iteration" in text
    assert max(logged(text)) == KILL_AT
    restarted = logged(ok(runs.result["restarted"]))
    resumed_as(restarted, runs.paged, SAVE_AT + 1)
    assert tracker(runs.path("ckpt-killed")) == str(ITERS)
    same_state(runs.path("ckpt-paged"), runs.path("ckpt-killed"))


def test_inspect_shows_whose_optimizer_state_each_save_holds(runs):
    """statepager inspect on the --save directories: unpaged Megatron's checkpoints, and
    a paged run's with --statepager-optimizer-checkpoint megatron, hold the optimizer state
    in Megatron's dp_reshardable layout; the paged run's Megatron part none (statepager's
    part beside it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for name, held in (("ckpt-unpaged", "optimizer state in Megatron's format, dp_reshardable"),
                       ("ckpt-megatron-format",
                        "optimizer state in Megatron's format, dp_reshardable"),
                       ("ckpt-paged", "optimizer state in Megatron's format: none")):
        out = subprocess.run([sys.executable, "-m", "statepager", "inspect", runs.path(name)],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"its tracker names iteration {ITERS}" in out.stdout, out.stdout
        assert out.stdout.count(held) == 2, out.stdout  # iterations 10 and 20
    assert "statepager/rank00000: statepager-checkpoint" in out.stdout


def test_no_load_optim_starts_fresh_as_megatron_does(runs):
    fresh_paged = logged(ok(runs.result["fresh-paged"]))
    assert sorted(fresh_paged) == list(range(SAVE_AT + 1, ITERS + 1))
    assert fresh_paged == logged(ok(runs.result["fresh-unpaged"]))
    assert fresh_paged[ITERS] != runs.paged[ITERS]


def test_missing_rank_state_fails_the_load_naming_the_rank(runs):
    code, text = runs.result["broken"]
    assert code != 0
    assert "fails on every rank: rank 0:" in text and "--no-load-optim" in text


def test_unsupported_flag_is_refused_at_start(runs):
    code, text = runs.result["refused"]
    assert code != 0
    assert "statepager cannot run with these Megatron flags" in text
    assert "--ckpt-format" in text
    assert not os.path.exists(runs.path("ckpt-refused"))


def test_async_save_matches_the_sync_one_and_timers_report(runs):
    text = ok(runs.result["async"])
    assert logged(text) == runs.paged
    # --timing-log-level 1: Megatron's timer report lists statepager's timers (those
    # above zero: the waits may be). megatron-core 0.19 logs that report at INFO, which
    # its root logger drops unless --logging-level 20.
    assert "statepager-step" in text
    assert tracker(runs.path("ckpt-async")) == str(ITERS)
    for it in (SAVE_AT, ITERS):
        same_state(runs.path("ckpt-paged"), runs.path("ckpt-async"), it)


def test_crash_between_the_saves_leaves_the_tracker_on_the_previous_iteration(runs):
    assert runs.result["crash"][0] != 0
    assert runs.crash_tracker == "5" and runs.crash_part
    resumed_as(logged(ok(runs.result["crash-resumed"])), runs.paged, 6)
    same_state(runs.path("ckpt-paged"), runs.path("ckpt-crash"))


def test_environment_alone_turns_statepager_on(runs):
    text = ok(runs.result["env"])
    assert "statepager: optimizer state paged through" in text
    assert logged(text) == runs.paged
    same_state(runs.path("ckpt-paged"), runs.path("ckpt-env"))


@pytest.mark.skipif(not two_gpus, reason="needs two GPUs (DP = 2)")
def test_dp2_paged_equals_unpaged_resumes_exactly_and_a_missing_rank_fails_both(runs):
    paged = logged(ok(runs.result["dp2-paged"]))
    assert sorted(paged) == list(range(1, ITERS + 1))
    assert paged == logged(ok(runs.result["dp2-unpaged"]))
    # Steps under the forward at DP = 2, each bucket group's all-gather after its step.
    assert logged(ok(runs.result["dp2-overlap-gather"])) == paged
    for rank in (0, 1):
        same_state(runs.path("dp2-paged"), runs.path("dp2-overlap-gather"), rank=rank)
    assert runs.result["dp2-killed"][0] != 0
    resumed_as(logged(ok(runs.result["dp2-restarted"])), paged, SAVE_AT + 1)
    for rank in (0, 1):
        same_state(runs.path("dp2-paged"), runs.path("dp2-killed"), rank=rank)
    code, text = runs.result["dp2-broken"]
    assert code != 0
    # Both ranks fail, each naming rank 1 (rank 0 had its state).
    assert text.count("failed on 1 of 2 ranks, so it fails on every rank: rank 1:") >= 2, \
        text[-4000:]
