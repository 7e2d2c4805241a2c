"""Checkpoints of paged optimizer state: exact resume in a fresh process, atomic save,
and refusal (with nothing loaded) of corrupt or foreign checkpoints."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager.checkpoint.manifest import stored as stored_tensors
from statepager.util.flat import flat_view

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
    assert sorted(os.listdir(ckpt)) == ["manifest.json", "opt0"]
    assert os.listdir(ckpt / "opt0") == ["state.bin"]


def test_kill_during_a_step_then_resume_continues_exactly(tmp_path):
    """A job killed (-9) in the middle of a step after its last checkpoint resumes from
    that checkpoint exactly as an uninterrupted job continues from it."""
    ckpt = str(tmp_path / "ckpt")
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "ckpt_run.py"),
                          str(tmp_path / "s0"), ckpt, str(tmp_path / "unused.pt"), "6", "0",
                          "train-on"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not os.path.exists(os.path.join(ckpt, "manifest.json")):
        time.sleep(0.05)
    time.sleep(0.5)  # well into the steps after the save
    assert p.poll() is None, p.stderr.read()
    p.send_signal(signal.SIGKILL)
    p.wait()
    run(tmp_path / "s1", ckpt, tmp_path / "resumed.pt", 6, 7, "resume")
    run(tmp_path / "s2", tmp_path / "ref", tmp_path / "ref.pt", 6, 7, "fresh")
    a, b = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "resumed.pt")
    assert a["losses"] == b["losses"]
    assert equal(a["params"], b["params"]) and equal(a["state"], b["state"])


@pytest.mark.parametrize("mode", ["kill", "kill-background"])
def test_kill_during_save_leaves_complete_checkpoints_or_none(tmp_path, mode):
    ckpt = str(tmp_path / "ckpt")
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "ckpt_run.py"),
                          str(tmp_path / "s"), ckpt, str(tmp_path / "o.pt"), "3", "0", mode],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        assert checkpoint.load(pager, str(tmp_path / name))
        pager.close()


def test_background_save_is_the_state_of_its_moment(tmp_path):
    """Steps run while the save copies; a fresh process loads exactly the state of the
    moment save() was called."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "bg.pt"
    width = 30000  # about 60 MB of state: the copy outlasts the call by far
    run(tmp_path / "s1", ckpt, out, 3, 3, "background", width)
    run(tmp_path / "s2", ckpt, tmp_path / "loaded.pt", 0, 0, "inspect", width)
    at_save, loaded = torch.load(f"{out}.at-save"), torch.load(tmp_path / "loaded.pt")
    assert torch.load(out)["running"]  # the steps did run during the save
    assert equal(at_save["state"], loaded["state"]) and at_save["lr"] == loaded["lr"]
    # ...and the steps changed the state, so the test could tell.
    run(tmp_path / "s3", tmp_path / "unused", tmp_path / "after.pt", 6, 0, "fresh", width)
    assert not equal(at_save["state"], torch.load(tmp_path / "after.pt")["state"])


def adamw_pair(store, fmt="fp32", mains="fp32", map_ram=False):
    """A PagedAdamW ("opt0") and a plain AdamW over fp32 params ("expert"), one pager."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(40, 300).bfloat16()
    expert = torch.nn.Linear(300, 30)
    pager = statepager.Pager(store, page_size=64 * 1024, map_ram=map_ram)
    opt = statepager.PagedAdamW(dense.parameters(), pager=pager, lr=1e-3, moments=fmt,
                                mains=mains, bucket_size=16 * 1024)
    opt2 = torch.optim.AdamW(expert.parameters(), lr=2e-3)
    pager.attach(opt2, bucket_size=16 * 1024, name="expert")
    return dense, expert, pager, opt, opt2


def pair_steps(dense, expert, opt, opt2, first, count):
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, 40, generator=g).bfloat16()
        loss = expert(dense(x).float()).square().mean()
        opt.zero_grad()
        opt2.zero_grad()
        loss.backward()
        opt.step()
        opt2.step()


def pair_state(pager, *opts):
    out = []
    for opt in opts:
        for p in (p for g in opt.param_groups for p in g["params"]):
            ts = [p] + [v for v in opt.state[p].values() if pager.owns(v)]
            pager.page_in([t for t in ts if pager.owns(t)])
            out.append([t.clone() for t in ts] + [opt.state[p]["step"].clone()])
            pager.page_out([t for t in ts if pager.owns(t)])
    return out


def saved_bytes(path: str, entry: dict) -> bytes:
    with open(os.path.join(path, entry["data"]), "rb") as f:
        data = f.read()
    return data


@pytest.mark.parametrize("where", ["disk", "ram", "mapped-ram"])
@pytest.mark.parametrize("fmt", ["fp32", "q8"])
def test_each_tensors_bytes_are_copied_from_the_store(tmp_path, where, fmt):
    """Checkpoints copied from the store (striped over files on a RAM filesystem, and
    one file mapped for the device's copies) hold each stored tensor's bytes, as the
    pager pages them in, at its offset, zeros to its 4 KiB boundary; before any step (no
    moments yet, as in torch; residual masters ZERO, recorded and not copied) and after
    some."""
    base = str(tmp_path) if where == "disk" else f"/dev/shm/statepager-test-{os.getpid()}"
    dense, expert, pager, opt, opt2 = adamw_pair(f"{base}/store", fmt, mains="residual",
                                                 map_ram=where == "mapped-ram")
    try:
        for k, n_steps in enumerate((0, 3)):
            pair_steps(dense, expert, opt, opt2, 0, n_steps)
            path = str(tmp_path / f"copied{k}")
            a = checkpoint.save(pager, path)
            assert a.method in ("reflink", "copy_file_range", "read_write")
            with open(os.path.join(path, "manifest.json")) as f:
                optimizers = {o["name"]: o for o in json.load(f)["optimizers"]}
            zero = []
            for binding in pager.bindings:
                entry = optimizers[binding.name]
                data = saved_bytes(path, entry)
                params = binding.params_in_order()
                live = {id(t): flat_view(t.detach()).cpu().view(torch.uint8).numpy().tobytes()
                        for b in binding.stored_in_buckets() for t in b.stored}
                for e in entry["tensors"]:
                    t = dict(stored_tensors(binding, params[e["param"]]))[e["name"]]
                    zero.append(e["zero"])
                    if e["zero"]:
                        assert not live[id(t)].strip(b"\0")
                        continue
                    at, end = e["offset"], e["offset"] + e["bytes"]
                    assert data[at:end] == live[id(t)], (n_steps, binding.name, e["name"])
                    assert not data[end:-(-end // 4096) * 4096].strip(b"\0")
            assert any(zero) if n_steps == 0 else not any(zero)
        assert not [fd for fd in os.listdir("/proc/self/fd")  # nothing left open
                    if "/copied" in os.path.realpath(f"/proc/self/fd/{fd}")]
    finally:
        pager.close()
        if where != "disk":
            shutil.rmtree(base, ignore_errors=True)


def test_save_to_load_from_round_trips_two_named_optimizers(tmp_path, caplog):
    base = str(tmp_path / "iter_0000003")
    dense, expert, pager, opt, opt2 = adamw_pair(str(tmp_path / "s1"))
    pair_steps(dense, expert, opt, opt2, 0, 3)
    # The model's own checkpoint (Megatron's, in a Megatron run).
    weights = [{k: v.clone() for k, v in m.state_dict().items()} for m in (dense, expert)]
    handle = checkpoint.save(pager, checkpoint.rank_directory(base), background=True)
    pair_steps(dense, expert, opt, opt2, 3, 1)
    handle.wait()
    rank = os.path.join(base, "statepager", "rank00000")
    assert sorted(os.listdir(rank)) == ["expert", "manifest.json", "opt0"]
    assert os.listdir(os.path.dirname(rank)) == ["rank00000"]  # no temporary left

    dense2, expert2, pager2, opt_b, opt2_b = adamw_pair(str(tmp_path / "s2"))
    dense2.load_state_dict(weights[0])
    expert2.load_state_dict(weights[1])
    assert checkpoint.load(pager2, checkpoint.rank_directory(base))
    dense3, expert3, pager3, opt_c, opt2_c = adamw_pair(str(tmp_path / "s3"))
    pair_steps(dense3, expert3, opt_c, opt2_c, 0, 3)
    assert equal(pair_state(pager2, opt_b, opt2_b), pair_state(pager3, opt_c, opt2_c))
    pair_steps(dense2, expert2, opt_b, opt2_b, 3, 2)
    pair_steps(dense3, expert3, opt_c, opt2_c, 3, 2)
    assert equal(pair_state(pager2, opt_b, opt2_b), pair_state(pager3, opt_c, opt2_c))
    assert equal(list(dense2.parameters()), list(dense3.parameters()))

    with caplog.at_level("INFO", logger="statepager"):
        assert checkpoint.load(pager3, checkpoint.rank_directory(str(tmp_path / "iter_without_statepager")),
                                missing_ok=True) is False
    assert "no checkpoint at" in caplog.text
    for p in (pager, pager2, pager3):
        p.close()


def test_other_optimizer_names_are_refused(tmp_path):
    dense, expert, pager, opt, opt2 = adamw_pair(str(tmp_path / "s1"))
    checkpoint.save(pager, checkpoint.rank_directory(str(tmp_path / "ck")))
    pager.close()
    torch.manual_seed(0)
    with statepager.Pager(str(tmp_path / "s2"), page_size=64 * 1024) as other:
        statepager.PagedAdamW(torch.nn.Linear(40, 300).bfloat16().parameters(), pager=other,
                              bucket_size=16 * 1024)
        opt2 = torch.optim.AdamW(torch.nn.Linear(300, 30).parameters())
        other.attach(opt2, bucket_size=16 * 1024, name="moe")
        with pytest.raises(statepager.CheckpointMismatchError, match="'moe'"):
            checkpoint.load(other, checkpoint.rank_directory(str(tmp_path / "ck")))


def test_fresh_optimizer_gets_the_state_of_the_checkpoint(tmp_path):
    """A fresh attached optimizer has no state (torch creates it in the first step):
    load() creates what the checkpoint holds, in torch's order and the saved layout."""
    def build(store):
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        pager = statepager.Pager(store, page_size=64 * 1024)
        opt = torch.optim.RMSprop(conv.parameters(), lr=1e-2, momentum=0.9, centered=True)
        pager.attach(opt, bucket_size=4 * 1024)
        return conv, pager, opt

    def train(conv, opt, first, count):
        for i in range(first, first + count):
            x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            conv(x.contiguous(memory_format=torch.channels_last)).square().mean().backward()
            opt.step()

    conv, pager, opt = build(str(tmp_path / "s1"))
    train(conv, opt, 0, 3)
    checkpoint.save(pager, str(tmp_path / "ckpt"))
    conv2, pager2, opt2 = build(str(tmp_path / "s2"))
    with torch.no_grad():
        for a, b in zip(conv.parameters(), conv2.parameters()):
            b.copy_(a)
    assert not opt2.state
    assert checkpoint.load(pager2, str(tmp_path / "ckpt"))
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    assert [list(st) for st in sd["state"].values()] == \
        [list(st) for st in sd2["state"].values()]
    for i, st in sd["state"].items():
        for k, v in st.items():
            got = sd2["state"][i][k]
            assert v.stride() == got.stride() and torch.equal(v, got), (i, k)
    square_avg = opt2.state[conv2.weight]["square_avg"]
    assert pager2.owns(square_avg) and square_avg.stride() == conv2.weight.stride()
    train(conv, opt, 3, 2)
    train(conv2, opt2, 3, 2)
    assert all(torch.equal(a, b) for a, b in zip(conv.parameters(), conv2.parameters()))
    pager.close()
    pager2.close()


@pytest.fixture
def saved(tmp_path):
    return ckpt_run.saved(tmp_path)


def fresh(tmp_path):
    model, pager, opt, sched = ckpt_run.model_and_opt(str(tmp_path / "fresh"))
    return model, pager, opt


def refused(tmp_path, path, error, match):
    """Loading `path` raises `error`, and the optimizer is exactly as it was."""
    model, pager, opt = fresh(tmp_path)
    before = ckpt_run.snapshot(model, opt, pager)
    with pytest.raises(error, match=match):
        checkpoint.load(pager, path)
    assert equal(before, ckpt_run.snapshot(model, opt, pager))
    pager.close()


def test_flipped_byte_is_refused(tmp_path, saved):
    data = os.path.join(saved, "opt0", "state.bin")
    with open(data, "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 0x10]))
    refused(tmp_path, saved, statepager.CorruptStoreError, "checksum")


def test_truncated_file_is_refused(tmp_path, saved):
    os.truncate(os.path.join(saved, "opt0", "state.bin"), 10000)
    refused(tmp_path, saved, statepager.CorruptStoreError, "truncated")


def test_other_layout_is_refused(tmp_path, saved):
    torch.manual_seed(0)
    other = torch.nn.Linear(24, 7).bfloat16()
    with statepager.Pager(str(tmp_path / "other"), page_size=64 << 10) as pager:
        statepager.PagedAdamW(other.parameters(), pager=pager)
        with pytest.raises(statepager.CheckpointMismatchError, match="shapes differ"):
            checkpoint.load(pager, saved)


@pytest.mark.parametrize("version, by", [(99, "another"), (3, "an older"), ("4", "another")])
def test_other_format_version_is_refused(tmp_path, saved, version, by):
    """Only format 4 loads: another version is refused naming it, nothing changed."""
    manifest = os.path.join(saved, "manifest.json")
    with open(manifest) as f:
        m = json.load(f)
    m["version"] = version
    with open(manifest, "w") as f:
        json.dump(m, f)
    refused(tmp_path, saved, statepager.CheckpointMismatchError,
            f"version {version!r}, written by {by} statepager")


def test_crc32c_known_answers():
    """The published check values (RFC 3720 B.4), chaining as zlib.crc32 does."""
    crc = statepager._C.crc32c
    assert crc(b"123456789") == 0xE3069283
    assert crc(bytes(32)) == 0x8A9136AA and crc(b"\xff" * 32) == 0x62A8AB43
    assert crc(bytes(range(32))) == 0x46DD794E and crc(b"") == 0
    assert crc(b"56789", crc(b"1234")) == 0xE3069283
    assert crc(memoryview(torch.arange(10, dtype=torch.uint8).numpy())) == crc(bytes(range(10)))
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        crc(torch.arange(10, dtype=torch.uint8).numpy()[::2])
    assert statepager._C.CRC32C_ENGINE in ("sse4.2", "armv8-crc", "table")


def test_a_save_checksums_in_the_copy_s_pass(tmp_path):
    """Tensors of one piece: their crc32c computed while copied, no second read."""
    model, pager, opt, sched = ckpt_run.model_and_opt(str(tmp_path / "store"))
    ckpt_run.steps(model, opt, sched, 0, 3)
    h = checkpoint.save(pager, str(tmp_path / "ckpt"))
    assert h.checksum_seconds == 0 and h.copy_seconds > 0
    pager.close()


def test_missing_checkpoint_is_an_error_unless_missing_ok(tmp_path, caplog):
    model, pager, opt = fresh(tmp_path)
    with pytest.raises(statepager.UsageError, match="no checkpoint at .*nothing-here"):
        checkpoint.load(pager, str(tmp_path / "nothing-here"))
    with caplog.at_level("INFO", logger="statepager"):
        assert checkpoint.load(pager, str(tmp_path / "nothing-here"), missing_ok=True) is False
    assert "no checkpoint at" in caplog.text
    pager.close()


def test_existing_path_is_not_overwritten(tmp_path, saved):
    model, pager, opt = fresh(tmp_path)
    with pytest.raises(statepager.UsageError, match="written once"):
        checkpoint.save(pager, saved)
    pager.close()
