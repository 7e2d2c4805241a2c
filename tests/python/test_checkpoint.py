"""Checkpoints of paged optimizer state: exact resume in a fresh process, atomic save,
and refusal (with nothing loaded) of corrupt or foreign checkpoints."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import statepager

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ckpt_run  # noqa: E402


def run(*args):
    r = subprocess.run([sys.executable, os.path.join(HERE, "ckpt_run.py"), *map(str, args)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return a == b


def test_resume_in_a_fresh_process_is_exact(tmp_path):
    ckpt = tmp_path / "ckpt"
    run(tmp_path / "s1", ckpt, tmp_path / "a.pt", 6, 7, "fresh")
    run(tmp_path / "s2", ckpt, tmp_path / "b.pt", 6, 7, "resume")
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a["losses"] == b["losses"]
    assert equal(a["params"], b["params"]) and equal(a["state"], b["state"])
    assert a["lr"] == b["lr"]
    assert sorted(os.listdir(ckpt)) == ["manifest.json", "state.bin"]


def test_kill_during_save_leaves_complete_checkpoints_or_none(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "ckpt_run.py"),
                          str(tmp_path / "s"), ckpt, str(tmp_path / "o.pt"), "3", "0", "fresh",
                          "kill"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and len(os.listdir(tmp_path)) < 8:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    names = os.listdir(tmp_path)
    done = [n for n in names if n.startswith("ckpt-") and ".tmp-" not in n]
    assert done, names
    for name in done:  # every checkpoint that has its name is complete and loads
        model, pager, opt, sched = ckpt_run.model_and_opt(str(tmp_path / f"load-{name}"))
        assert pager.load(str(tmp_path / name))
        pager.close()


@pytest.fixture
def saved(tmp_path):
    model, pager, opt, sched = ckpt_run.model_and_opt(str(tmp_path / "store"))
    ckpt_run.steps(model, opt, sched, 0, 3)
    path = str(tmp_path / "ckpt")
    pager.save(path)
    pager.close()
    return path


def fresh(tmp_path):
    model, pager, opt, sched = ckpt_run.model_and_opt(str(tmp_path / "fresh"))
    return model, pager, opt


def refused(tmp_path, path, error, match):
    """Loading `path` raises `error`, and the optimizer is exactly as it was."""
    model, pager, opt = fresh(tmp_path)
    before = ckpt_run.snapshot(model, opt, pager)
    with pytest.raises(error, match=match):
        pager.load(path)
    assert equal(before, ckpt_run.snapshot(model, opt, pager))
    pager.close()


def test_flipped_byte_is_refused(tmp_path, saved):
    data = os.path.join(saved, "state.bin")
    with open(data, "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 0x10]))
    refused(tmp_path, saved, statepager.CorruptStoreError, "checksum")


def test_truncated_file_is_refused(tmp_path, saved):
    os.truncate(os.path.join(saved, "state.bin"), 10000)
    refused(tmp_path, saved, statepager.CorruptStoreError, "truncated")


def test_other_layout_is_refused(tmp_path, saved):
    torch.manual_seed(0)
    other = torch.nn.Linear(24, 7).bfloat16()
    with statepager.Pager(str(tmp_path / "other"), page_size=64 << 10) as pager:
        statepager.PagedAdamW(other.parameters(), pager=pager)
        with pytest.raises(statepager.CheckpointMismatchError, match="shapes differ"):
            pager.load(saved)


def test_other_format_is_refused(tmp_path, saved):
    manifest = os.path.join(saved, "manifest.json")
    with open(manifest) as f:
        m = json.load(f)
    m["version"] = 99
    with open(manifest, "w") as f:
        json.dump(m, f)
    refused(tmp_path, saved, statepager.CheckpointMismatchError, "version 99")


def test_missing_checkpoint_starts_fresh_with_a_notice(tmp_path, caplog):
    model, pager, opt = fresh(tmp_path)
    with caplog.at_level("WARNING", logger="statepager"):
        assert pager.load(str(tmp_path / "nothing-here")) is False
    assert "starts fresh" in caplog.text
    pager.close()


def test_existing_path_is_not_overwritten(tmp_path, saved):
    model, pager, opt = fresh(tmp_path)
    with pytest.raises(statepager.UsageError, match="written once"):
        pager.save(saved)
    pager.close()
