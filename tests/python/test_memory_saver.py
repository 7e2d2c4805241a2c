"""statepager.memory_saver on the host backend: tags, backups, nesting, argument errors
and the sys.modules opt-in. Regions there hold what Pager.scope() captures on the host
backend (fp32 copies), which is enough to page them by tag."""
import os
import subprocess
import sys

import pytest
import torch

import statepager
from statepager import memory_saver
from statepager.memory_saver import TorchMemorySaver

N = 1 << 18  # fp32 elements: 1 MiB


@pytest.fixture
def saver():
    s = TorchMemorySaver(device="cpu")
    yield s
    s.close()


def _made(saver, value, **region):
    with saver.region(**region):
        return torch.full((N,), value, dtype=torch.float32).clone()


def test_backed_up_tag_comes_back_bit_exact_others_zero(saver):
    src = torch.randn(N)
    with saver.region(tag="weights", enable_cpu_backup=True):
        weights = src.clone()
    kv = _made(saver, 7.0, tag="kv")
    assert saver.pager("weights", "cpu").owns(weights) and saver.pager("kv").owns(kv)
    address = (weights.data_ptr(), kv.data_ptr())
    saver.pause()
    assert saver.tags() == {"weights": True, "kv": True}
    assert saver.pager("weights", "cpu").residency(weights) in ("file", "host")
    assert saver.pager("kv").residency(kv) == "zero"
    saver.resume()
    assert (weights.data_ptr(), kv.data_ptr()) == address
    assert torch.equal(weights, src)
    assert torch.count_nonzero(kv) == 0


def test_pause_one_tag_leaves_the_others(saver):
    a = _made(saver, 1.0, tag="a", enable_cpu_backup=True)
    b = _made(saver, 2.0, tag="b", enable_cpu_backup=True)
    saver.pause("a")
    assert saver.tags() == {"a": True, "b": False}
    assert torch.all(b == 2.0)
    with pytest.raises(statepager.UsageError, match=r"pause\('a'\).*already paused"):
        saver.pause("a")
    with pytest.raises(statepager.UsageError, match=r"resume\('b'\).*not paused"):
        saver.resume("b")
    saver.pause()  # every tag not paused: b
    saver.resume("b")
    assert saver.tags() == {"a": True, "b": False}
    saver.resume()
    assert torch.all(a == 1.0) and torch.all(b == 2.0)
    saver.pause("no such tag")  # nothing allocated under it: nothing to do, as TMS
    assert saver.tags() == {"a": False, "b": False}


def test_nested_region_uses_the_inner_tag_then_the_outer(saver):
    with saver.region(tag="outer", enable_cpu_backup=True):
        before = torch.full((N,), 3.0).clone()
        with saver.region(tag="inner"):
            inner = torch.full((N,), 4.0).clone()
        after = torch.full((N,), 5.0).clone()
    outer = saver.pager("outer", "cpu")
    assert outer.owns(before) and outer.owns(after) and not outer.owns(inner)
    assert saver.pager("inner").owns(inner)
    assert [saver.tag_of(t) for t in (before, inner, after)] == ["outer", "inner", "outer"]
    assert saver.tag_of(torch.ones(4)) is None
    with pytest.raises(statepager.UsageError, match="must be a tensor"):
        saver.tag_of([before])
    saver.pause()
    saver.resume()
    assert torch.all(before == 3.0) and torch.all(after == 5.0)
    assert torch.count_nonzero(inner) == 0


def test_disable_inside_a_region_allocates_outside_it(saver):
    with saver.region(tag="t"):
        with saver.disable():
            plain = torch.full((N,), 1.0).clone()
        mine = torch.full((N,), 1.0).clone()
    assert not saver.pager("t").owns(plain) and saver.pager("t").owns(mine)
    assert saver.tag_of(plain) is None and saver.tag_of(mine) == "t"


def test_backed_up_store_is_sized_when_the_region_ends(saver):
    t = _made(saver, 1.0, tag="w", enable_cpu_backup=True)
    pager = saver.pager("w", "cpu")
    assert os.path.getsize(pager.file_path) >= t.numel() * 4
    kv = _made(saver, 1.0, tag="kv")  # dropped at pause: no store
    assert os.path.getsize(saver.pager("kv").file_path) == 0 < kv.numel()


def test_disk_backup_goes_under_the_directory_set(saver, tmp_path):
    with pytest.raises(statepager.UsageError, match="set_disk_backup_dir"):
        with saver.region(enable_disk_backup=True):
            pass
    saver.set_disk_backup_dir(str(tmp_path / "disk"))
    t = _made(saver, 6.0, tag="d", enable_disk_backup=True)
    assert saver.pager("d", "disk").directory.startswith(str(tmp_path / "disk"))
    saver.pause("d")
    saver.resume("d")
    assert torch.all(t == 6.0)


def test_region_refused_while_its_tag_is_paused(saver):
    _made(saver, 1.0, tag="p")
    saver.pause("p")
    with pytest.raises(statepager.UsageError, match=r"tag 'p' is paused: resume\('p'\)"):
        with saver.region(tag="p"):
            pass
    with pytest.raises(statepager.UsageError, match="inside region"):
        with saver.region(tag="q"):
            saver.resume("p")
    saver.resume("p")


@pytest.mark.parametrize("kwargs, match", [
    (dict(tag=3), "tag must be a str"),
    (dict(enable_cpu_backup=1), "enable_cpu_backup must be a bool"),
    (dict(cpu_backup_backend="mmap"), "requires enable_cpu_backup=True"),
    (dict(enable_cpu_backup=True, cpu_backup_backend="cuda"), "must be None, 'pinned'"),
    (dict(enable_cpu_backup=True, enable_disk_backup=True), "exclusive"),
])
def test_region_arguments_refused_before_anything_is_made(saver, kwargs, match):
    with pytest.raises(statepager.UsageError, match=match):
        with saver.region(**kwargs):
            pass
    assert saver.tags() == {}


def test_settings(saver):
    assert saver.enabled
    saver.hook_mode = "preload"
    assert saver.hook_mode == "preload"
    with pytest.raises(statepager.UsageError, match="hook_mode must be one of"):
        saver.hook_mode = "ld_preload"
    saver.memory_margin_bytes = 1 << 20
    assert saver.memory_margin_bytes == 1 << 20
    with pytest.raises(statepager.UsageError, match="memory_margin_bytes"):
        saver.memory_margin_bytes = -1
    assert saver.retain_cpu_backup is False
    saver.retain_cpu_backup = True
    assert saver.retain_cpu_backup is True
    with pytest.raises(statepager.UsageError, match="retain_cpu_backup must be a bool"):
        saver.retain_cpu_backup = "yes"


def test_memory_margin_refuses_a_resume_that_would_not_leave_it(saver):
    t = _made(saver, 2.0, tag="m", enable_cpu_backup=True)
    saver.pause("m")
    saver.memory_margin_bytes = (1 << 63)
    with pytest.raises(statepager.OutOfMemoryError, match="memory_margin_bytes"):
        saver.resume("m")
    assert saver.tags() == {"m": True}
    saver.memory_margin_bytes = 0
    saver.resume("m")
    assert torch.all(t == 2.0)


def _store_files(pager) -> dict:
    out = {}
    for root, _, names in os.walk(pager.directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.join(root, name)] = f.read()
    return out


def test_get_cpu_backup_reads_a_paused_tensor_changing_nothing(saver):
    with saver.region(tag="w", enable_cpu_backup=True):
        w = torch.randn(64, N // 64).clone()
    before = w.clone()
    assert saver.get_cpu_backup(w) is None  # not paused
    saver.pause("w")
    pager = saver.pager("w", "cpu")
    stats, files = pager.stats(), _store_files(pager)
    got = saver.get_cpu_backup(w)
    assert got.device.type == "cpu" and got.shape == w.shape and got.dtype == w.dtype
    assert torch.equal(got, before)
    assert torch.equal(saver.get_cpu_backup(w[3:7], zero_copy=True), before[3:7])
    assert got.data_ptr() != saver.get_cpu_backup(w).data_ptr()  # a copy each time
    assert pager.stats() == stats and _store_files(pager) == files
    assert pager.paused and pager.residency(w) in ("file", "host")
    saver.resume("w")
    assert torch.equal(w, before) and saver.get_cpu_backup(w) is None


def test_get_cpu_backup_of_other_tags_and_bad_input(saver, tmp_path):
    kv = _made(saver, 1.0, tag="kv")
    saver.set_disk_backup_dir(str(tmp_path))
    d = _made(saver, 2.0, tag="d", enable_disk_backup=True)
    w = torch.full((64, N // 64), 3.0).clone()
    with saver.region(tag="w", enable_cpu_backup=True):
        w = w.clone()
    saver.pause()
    assert saver.get_cpu_backup(d) is None  # as torch_memory_saver: no host copy
    with pytest.raises(statepager.UsageError, match="tag 'kv' has no backup"):
        saver.get_cpu_backup(kv)
    with pytest.raises(statepager.UsageError, match="must be a tensor"):
        saver.get_cpu_backup("w")
    with pytest.raises(statepager.UsageError, match="not in any tag's memory"):
        saver.get_cpu_backup(torch.ones(4))
    with pytest.raises(statepager.UsageError, match="must be contiguous"):
        saver.get_cpu_backup(w.t())
    with pytest.raises(statepager.UsageError, match="zero_copy must be a bool"):
        saver.get_cpu_backup(w, zero_copy="yes")
    saver.resume()
    assert torch.all(w == 3.0) and torch.all(d == 2.0)


def test_read_paused_from_the_host_tier_and_after_a_discard(tmp_path):
    with statepager.Pager(str(tmp_path / "p"), host_budget=4 * N * 4) as pager:
        t, never = pager.empty(N), pager.empty(N)
        pager.page_in(t)
        t.copy_(torch.randn(N))
        want = t.clone()
        with pytest.raises(statepager.UsageError, match="not paused"):
            pager.read_paused(t)
        pager.pause()
        assert pager.residency(t) == "host"
        stats = pager.stats()
        assert torch.equal(pager.read_paused(t), want)
        assert torch.equal(pager.read_paused(t[N // 2:]), want[N // 2:])
        assert pager.stats() == stats
        with pytest.raises(statepager.UsageError, match="not in the memory"):
            pager.read_paused(never)  # not paged out by pause(): at rest as zeros
        pager.resume()
        pager.pause(discard=True)
        assert torch.count_nonzero(pager.read_paused(t)) == 0
        pager.resume()


def test_cuda_graph_refused_on_the_host_backend(saver):
    with pytest.raises(statepager.UsageError, match="cuda_graph"):
        with saver.cuda_graph(object()):
            pass
    assert saver.tags() == {}


def test_routed_pool_refused_on_the_host_backend(saver):
    kv = _made(saver, 1.0, tag="kv")
    with pytest.raises(statepager.UsageError, match="MemPools are CUDA's"):
        with saver.pager("kv").services.routed_pool():
            pass
    assert saver.tag_of(kv) == "kv"


def test_close_deletes_the_directories_it_made():
    s = TorchMemorySaver(device="cpu")
    _made(s, 1.0, tag="x", enable_cpu_backup=True)
    root = os.path.dirname(s.pager("x", "cpu").directory)
    assert os.path.isdir(root)
    s.close()
    assert not os.path.exists(root)


_OPT_IN = """
import sys
import statepager.memory_saver as ms
assert "torch_memory_saver" not in sys.modules
module = ms.install_as_torch_memory_saver()
import torch_memory_saver
from torch_memory_saver import torch_memory_saver as tms, configure_subprocess
assert torch_memory_saver is module and tms is ms.torch_memory_saver
assert ms.install_as_torch_memory_saver() is module
with configure_subprocess():
    pass
print("ok")
"""


def test_install_as_torch_memory_saver_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-c", _OPT_IN], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_install_refused_over_the_real_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_memory_saver", type(sys)("torch_memory_saver"))
    with pytest.raises(statepager.UsageError, match="before anything imports it"):
        memory_saver.install_as_torch_memory_saver()
