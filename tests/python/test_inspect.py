"""statepager inspect: what a checkpoint, a rank_directory() base or a store directory holds."""
import json
import os
import subprocess
import sys

import pytest
import torch

import statepager

KiB = 1 << 10
INSPECT = [sys.executable, "-m", "statepager", "inspect"]


def inspect(*args):
    r = subprocess.run([*INSPECT, *map(str, args)], capture_output=True, text=True)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, r.stdout


def train_and_save(store, path, *, save_to=False, moments="q8", mains="residual"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 10)).bfloat16()
    pager = statepager.Pager(store, page_size=64 * KiB)
    opt = statepager.PagedAdamW(model.parameters(), pager=pager, lr=1e-3, moments=moments,
                                mains=mains, bucket_size=64 * KiB)
    for _ in range(2):
        model(torch.randn(8, 64).bfloat16()).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    sp = statepager.checkpoint
    sp.save(pager, sp.rank_directory(path) if save_to else path)
    pager.close()


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    train_and_save(str(tmp_path / "store"), str(path))
    return path


def test_checkpoint_readable_and_json(checkpoint):
    code, text = inspect(checkpoint)
    assert code == 0, text
    assert f"checkpoint {checkpoint}: statepager-checkpoint" in text
    assert "PagedAdamW" in text and "moments q8" in text and "mains residual" in text
    assert "checksums: not verified" in text
    code, out = inspect(checkpoint, "--json")
    report = json.loads(out)
    (c,) = report["checkpoints"]
    (o,) = c["optimizers"]
    assert o["class"] == "PagedAdamW" and o["params"] == 4
    assert o["formats"] == {"moments": "q8", "mains": "residual"}
    assert o["tensors"] == sum(s["tensors"] for s in o["states"].values())
    assert o["file_bytes"] >= o["data_bytes"] > 0
    assert all(s["bytes"] > 0 and s["dtypes"] for s in o["states"].values())
    assert o["param_groups"][0]["lr"] == 1e-3


def test_verify_passes_then_finds_a_flipped_byte(checkpoint):
    code, text = inspect(checkpoint, "--verify")
    assert code == 0 and "checksums: verified" in text, text
    report = json.loads(inspect(checkpoint, "--json")[1])
    data = os.path.join(checkpoint, report["checkpoints"][0]["optimizers"][0]["data"])
    with open(data, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    code, text = inspect(checkpoint, "--verify")
    assert code == 1 and "checksums: FAILED" in text and "fails its checksum" in text, text
    assert inspect(checkpoint)[0] == 0  # without --verify the data is not read


def test_every_rank_under_a_save_to_base(tmp_path):
    train_and_save(str(tmp_path / "store"), str(tmp_path / "iter_0000010"), save_to=True)
    code, text = inspect(tmp_path / "iter_0000010", "--verify")
    assert code == 0, text
    assert "statepager/rank00000" in text and "checksums: verified" in text


def test_a_live_store_says_what_it_is(tmp_path):
    with statepager.Pager(str(tmp_path / "store"), page_size=64 * KiB) as pager:
        t = pager.empty(100_000)
        pager.page_in(t)
        pager.page_out(t)
        code, out = inspect(tmp_path / "store", "--json")
        assert code == 0
        report = json.loads(out)
        assert report["kind"] == "store" and report["in_use_by_pid"] == os.getpid()
        assert any(f["file"] == "state.bin" and f["bytes"] >= 400_000 for f in report["files"])
        code, text = inspect(tmp_path / "store")
        assert f"in use by process {os.getpid()}" in text and "not a checkpoint" in text


def test_anything_else_is_refused(tmp_path):
    code, text = inspect(tmp_path)
    assert code == 1 and "holds neither a statepager checkpoint" in text
    code, text = inspect(tmp_path / "missing")
    assert code == 1 and "does not exist" in text


def megatron_iteration(path, tensors: dict):
    """An iteration directory as Megatron-LM's torch_dist save writes it: its
    dist-checkpointing config and a torch.distributed.checkpoint of `tensors`."""
    import torch.distributed.checkpoint as dcp

    os.makedirs(path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    dcp.save(tensors, checkpoint_id=str(path), no_dist=True)


def test_a_megatron_save_directory_shows_whose_optimizer_state_each_iteration_holds(tmp_path):
    """Iteration 10 as a plain Megatron-LM run saves it (the optimizer's buckets in the
    dp_reshardable layout), 20 as statepager.megatron_lm does (Megatron's part without the
    optimizer, statepager's beside it); the tracker names 20."""
    save = tmp_path / "save"
    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_torch.bfloat16.bucket_idx_0"
    megatron_iteration(save / "iter_0000010", {
        "decoder.weight": torch.zeros(8, 8, dtype=torch.bfloat16),
        f"{bucket}.param": torch.zeros(64), f"{bucket}.exp_avg": torch.zeros(64),
        f"{bucket}.exp_avg_sq": torch.zeros(64)})
    megatron_iteration(save / "iter_0000020",
                       {"decoder.weight": torch.zeros(8, 8, dtype=torch.bfloat16)})
    train_and_save(str(tmp_path / "store"), str(save / "iter_0000020"), save_to=True)
    (save / "latest_checkpointed_iteration.txt").write_text("20")
    code, out = inspect(save)
    assert code == 0, out
    assert f"Megatron-LM --save directory {save}: its tracker names iteration 20" in out
    assert (f"Megatron checkpoint {save / 'iter_0000010'} (torch_dist): 4 tensors, 896 B\n"
            "  optimizer state in Megatron's format, dp_reshardable: 3 tensors, 768 B "
            "(param, exp_avg, exp_avg_sq); a paged run resumes from it with "
            "--statepager-optimizer-checkpoint megatron") in out
    assert (f"Megatron checkpoint {save / 'iter_0000020'} (torch_dist): 1 tensors, 128 B\n"
            "  optimizer state in Megatron's format: none") in out
    assert f"checkpoint {save / 'iter_0000020' / 'statepager' / 'rank00000'}:" in out
    code, out = inspect("--json", save / "iter_0000010")
    assert code == 0
    r = json.loads(out)
    (c,) = r["megatron"]["checkpoints"]
    assert c["optimizer"] == {"dp_reshardable": {"tensors": 3, "bytes": 768,
                                                 "states": ["param", "exp_avg", "exp_avg_sq"]}}
    assert r["megatron"]["tracker"] is None and r["checkpoints"] == []


def test_model_space_optimizer_state_is_named_by_its_entries(tmp_path):
    megatron_iteration(tmp_path / "it", {
        "optimizer.state.fp32_param.decoder.weight": torch.zeros(4, 4),
        "optimizer.state.exp_avg.decoder.weight": torch.zeros(4, 4),
        "optimizer.state.exp_avg_sq.decoder.weight": torch.zeros(4, 4)})
    code, out = inspect(tmp_path / "it")
    assert code == 0, out
    assert ("optimizer state in Megatron's format, model space: 3 tensors, 192 B "
            "(fp32_param, exp_avg, exp_avg_sq)") in out
