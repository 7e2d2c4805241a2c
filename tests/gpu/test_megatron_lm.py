"""Megatron-LM's pretrain_gpt.py, unchanged, through `python -m statepager.megatron_lm` on
one GPU (torchrun; the DP = 2 test needs two): a tiny GPT (2 layers, hidden 256,
--transformer-impl local, mock data) trained 6 iterations with a checkpoint at 4 and at
6, resumed from 4, compared with the same run unpaged. Losses and grad norms are
compared as Megatron logs them (every iteration); the optimizer state statepager saved
at iteration 6 after the resume is compared byte for byte with the uninterrupted run's.
Also: --no-load-optim against Megatron's own, a rank's state missing, a refused flag,
--async-save, and a crash between statepager's save and Megatron's.

Skips without CUDA, megatron-core, or Megatron-LM's training scripts in .deps/megatron-lm
(git-ignored; NVIDIA/Megatron-LM core_r0.19.0). Each run's log is kept under
$STATEPAGER_TEST_LOGS when set (scripts/gpu_megatron_lm.sh sets it), else in tmp_path."""
import filecmp
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MEGATRON_LM = os.path.join(ROOT, ".deps", "megatron-lm")
PRETRAIN_GPT = os.path.join(MEGATRON_LM, "pretrain_gpt.py")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core is not installed (the GPU suite carries it)"),
    pytest.mark.skipif(not os.path.isfile(PRETRAIN_GPT),
                       reason=f"Megatron-LM's pretrain_gpt.py is not in {MEGATRON_LM} "
                              "(NVIDIA/Megatron-LM core_r0.19.0, git-ignored)"),
]

ITERS, SAVE_AT = 6, 4
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

    def run(self, name, extra, *, paged=True, gpus=1):
        store = self.path(f"store-{name}-{{rank}}")
        argv = TINY_GPT + extra + [a.replace("{store}", store) for a in PAGED if paged]
        entry = ["-m", "statepager.megatron_lm", PRETRAIN_GPT] if paged else [PRETRAIN_GPT]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(gpus)] + entry + argv
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([MEGATRON_LM] + sys.path))
        p = subprocess.run(cmd, cwd=self.folder, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=400)
        with open(os.path.join(self.logs, f"{name}.log"), "w") as f:
            f.write(" ".join(cmd) + "\n\n" + p.stdout)
        return p.returncode, p.stdout


def logged(text):
    """{iteration: (loss, grad norm)} as Megatron's log lines print them."""
    return {int(i): (loss, norm) for i, loss, norm in LINE.findall(text)}


def ok(result):
    code, text = result
    assert code == 0, text[-4000:]
    return text


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = Runs(str(tmp_path_factory.mktemp("megatron_lm")))
    a, b = r.path("ckpt-unpaged"), r.path("ckpt-paged")
    r.unpaged = logged(ok(r.run("unpaged", ["--save", a], paged=False)))
    r.paged_text = ok(r.run("paged", ["--save", b]))
    r.paged = logged(r.paged_text)
    r.resumed_text = ok(r.run("resumed", ["--load", b, "--ckpt-step", str(SAVE_AT),
                                          "--save", r.path("ckpt-resumed")]))
    r.resumed = logged(r.resumed_text)
    load_fresh = ["--ckpt-step", str(SAVE_AT), "--no-load-optim"]
    r.fresh_paged = logged(ok(r.run("fresh-paged", ["--load", b] + load_fresh)))
    r.fresh_unpaged = logged(ok(r.run("fresh-unpaged", ["--load", a] + load_fresh,
                                      paged=False)))
    return r


def test_paged_losses_equal_unpaged(runs):
    assert sorted(runs.unpaged) == list(range(1, ITERS + 1))
    assert runs.paged == runs.unpaged


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
    with open(runs.path("ckpt-paged", "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(ITERS)


def test_resume_continues_exactly(runs):
    assert sorted(runs.resumed) == list(range(SAVE_AT + 1, ITERS + 1))
    assert runs.resumed == {i: runs.paged[i] for i in range(SAVE_AT + 1, ITERS + 1)}
    # The optimizer state after the resumed iterations, byte for byte.
    ours = sorted(glob.glob(runs.path("ckpt-paged", f"iter_{ITERS:07d}", "statepager",
                                      "rank00000", "*", "state.bin")))
    theirs = sorted(glob.glob(runs.path("ckpt-resumed", f"iter_{ITERS:07d}", "statepager",
                                        "rank00000", "*", "state.bin")))
    assert ours and [os.path.relpath(p, runs.path("ckpt-paged")) for p in ours] == \
        [os.path.relpath(p, runs.path("ckpt-resumed")) for p in theirs]
    for x, y in zip(ours, theirs):
        assert filecmp.cmp(x, y, shallow=False), f"{x} and {y} differ"


def test_no_load_optim_starts_fresh_as_megatron_does(runs):
    expected = list(range(SAVE_AT + 1, ITERS + 1))
    assert sorted(runs.fresh_paged) == expected
    assert runs.fresh_paged == runs.fresh_unpaged
    assert runs.fresh_paged[ITERS] != runs.resumed[ITERS]


def test_missing_rank_state_fails_the_load_naming_the_rank(runs):
    ckpt = runs.path("ckpt-broken")
    shutil.copytree(runs.path("ckpt-paged"), ckpt, symlinks=True)
    shutil.rmtree(os.path.join(ckpt, f"iter_{SAVE_AT:07d}", "statepager", "rank00000"))
    code, text = runs.run("broken", ["--load", ckpt, "--ckpt-step", str(SAVE_AT)])
    assert code != 0
    assert "fails on every rank: rank 0:" in text and "--no-load-optim" in text


def test_unsupported_flag_is_refused_at_start(runs):
    code, text = runs.run("refused", ["--save", runs.path("ckpt-refused"),
                                      "--ckpt-format", "torch"])
    assert code != 0
    assert "statepager cannot run with these Megatron flags" in text
    assert "--ckpt-format" in text
    assert not os.path.exists(runs.path("ckpt-refused"))


def test_async_save_matches_the_sync_one_and_timers_report(runs):
    ckpt = runs.path("ckpt-async")
    text = ok(runs.run("async", ["--save", ckpt, "--async-save", "--async-strategy", "mcore",
                                 "--use-persistent-ckpt-worker", "--timing-log-level", "1"]))
    assert logged(text) == runs.paged
    # --timing-log-level 1: Megatron's timer report lists statepager's timers (those
    # above zero: the waits may be).
    assert "statepager-step" in text
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(ITERS)
    for it in (SAVE_AT, ITERS):
        for x in glob.glob(runs.path("ckpt-paged", f"iter_{it:07d}", "statepager", "rank00000",
                                     "*", "state.bin")):
            y = os.path.join(ckpt, os.path.relpath(x, runs.path("ckpt-paged")))
            assert filecmp.cmp(x, y, shallow=False), f"{x} and {y} differ"


def test_crash_between_the_saves_leaves_the_tracker_on_the_previous_iteration(runs):
    ckpt = runs.path("ckpt-crash")
    # Megatron's part of iteration 4 cannot be written (its metadata.json is taken by a
    # directory): the run dies after statepager's part, before the tracker names 4.
    blocker = os.path.join(ckpt, "iter_0000004", "metadata.json")
    os.makedirs(blocker)
    code, text = runs.run("crash", ["--save", ckpt, "--save-interval", "2"])
    assert code != 0
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "2"
    assert os.path.isfile(os.path.join(ckpt, "iter_0000004", "statepager", "rank00000",
                                       "manifest.json"))
    # Restarted: resumes from 2, saves 4 again (replacing the unfinished part) and 6.
    os.rmdir(blocker)
    text = ok(runs.run("crash-resumed", ["--load", ckpt, "--save", ckpt,
                                         "--save-interval", "2"]))
    assert logged(text) == {i: runs.paged[i] for i in range(3, ITERS + 1)}
    for x in glob.glob(runs.path("ckpt-paged", f"iter_{ITERS:07d}", "statepager", "rank00000",
                                 "*", "state.bin")):
        y = os.path.join(ckpt, os.path.relpath(x, runs.path("ckpt-paged")))
        assert filecmp.cmp(x, y, shallow=False), f"{x} and {y} differ"


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (DP = 2)")


@two_gpus
def test_dp2_paged_equals_unpaged_resumes_exactly_and_a_missing_rank_fails_both(runs):
    a, b = runs.path("dp2-unpaged"), runs.path("dp2-paged")
    unpaged = logged(ok(runs.run("dp2-unpaged", ["--save", a], paged=False, gpus=2)))
    paged = logged(ok(runs.run("dp2-paged", ["--save", b], gpus=2)))
    assert sorted(paged) == list(range(1, ITERS + 1)) and paged == unpaged
    resumed = logged(ok(runs.run("dp2-resumed", ["--load", b, "--ckpt-step", str(SAVE_AT),
                                                 "--save", runs.path("dp2-resumed")],
                                 gpus=2)))
    assert resumed == {i: paged[i] for i in range(SAVE_AT + 1, ITERS + 1)}
    for rank in (0, 1):
        for x in glob.glob(os.path.join(b, f"iter_{ITERS:07d}", "statepager",
                                        f"rank{rank:05d}", "*", "state.bin")):
            y = os.path.join(runs.path("dp2-resumed"), os.path.relpath(x, b))
            assert filecmp.cmp(x, y, shallow=False), f"{x} and {y} differ"
    shutil.rmtree(os.path.join(b, f"iter_{SAVE_AT:07d}", "statepager", "rank00001"))
    code, text = runs.run("dp2-broken", ["--load", b, "--ckpt-step", str(SAVE_AT)], gpus=2)
    assert code != 0
    # Both ranks fail, each naming rank 1 (rank 0 had its state).
    assert text.count("failed on 1 of 2 ranks, so it fails on every rank: rank 1:") >= 2, \
        text[-4000:]
