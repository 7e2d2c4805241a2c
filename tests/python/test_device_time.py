"""statepager.tools.bench.device_time on a trace in torch.profiler's Chrome format (the events
of a q8 step's kernels and copies as the H200 recorded them, shortened): statepager's
kernels told from torch's by name, summed and by kernel, and the copies' busy time each
way as unions of intervals."""
from statepager.tools.bench import device_time

ADAMW = ("void statepager::kernels::(anonymous namespace)::adamw_kernel<(statepager::kernels::"
         "MomentFormat)2, true>(float*, float const*, statepager::kernels::Moment, "
         "statepager::kernels::Moment, long, statepager::kernels::AdamWScalars)")
CHECKSUM = ("statepager::kernels::(anonymous namespace)::checksum_total_kernel(long const*, "
            "long, long*, long const*, unsigned char*)")
TORCH = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
         "at::native::NormTwoOps<float, float, float>, unsigned int, float, 4, 4> >(...)")


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def copy(way, ts, dur):
    name = {"h2d": "Memcpy HtoD (Pinned -> Device)", "d2h": "Memcpy DtoH (Device -> Pinned)",
            "d2d": "Memcpy DtoD (Device -> Device)"}[way]
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur}


def test_kernel_names_are_statepagers_own():
    assert device_time.kernel_name(ADAMW) == "adamw_kernel"
    assert device_time.kernel_name(CHECKSUM) == "checksum_total_kernel"
    assert device_time.kernel_name(TORCH) is None
    assert device_time.kernel_name("Memset (Device)") is None


def test_a_step_is_summed_by_kernel_and_by_copy_engine():
    events = [kernel(ADAMW, 100, 40), kernel(ADAMW, 300, 60), kernel(CHECKSUM, 150, 5),
              kernel(TORCH, 0, 20),
              copy("h2d", 0, 100), copy("h2d", 50, 100), copy("h2d", 400, 50),  # 0-150, 400-450
              copy("d2h", 120, 60), copy("d2h", 430, 100),                      # 120-180, 430-530
              copy("d2d", 0, 1000),  # neither way over PCIe
              {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 999},
              {"ph": "M", "name": "process_name", "args": {}}]
    got = device_time.summarize(events)
    assert got["by_kernel"] == {"adamw_kernel": 100e-6, "checksum_total_kernel": 5e-6}
    assert list(got["by_kernel"]) == ["adamw_kernel", "checksum_total_kernel"]  # largest first
    assert got["statepager_kernels_s"] == 105e-6 and got["kernels_s"] == 125e-6
    assert got["h2d_busy_s"] == 200e-6 and got["d2h_busy_s"] == 160e-6
    assert got["both_busy_s"] == 50e-6  # 120-150 and 430-450
    assert got["statepager_launches"] == 3 and got["launches"] == 4


def test_a_step_without_kernels_or_copies():
    assert device_time.summarize([]) == {
        "statepager_kernels_s": 0.0, "kernels_s": 0.0, "by_kernel": {}, "h2d_busy_s": 0.0,
        "d2h_busy_s": 0.0, "both_busy_s": 0.0, "statepager_launches": 0, "launches": 0}
