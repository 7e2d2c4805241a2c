"""statepager.megatron_lm on the CPU: its options (flags, environment), the Megatron flags
it refuses, the rank agreement (gloo, two processes), and the save / load / log hooks
(statepager.integrations.megatron_lm.Run) driving a real Pager, a real optimizer and real files, with
Megatron-LM's side (MegatronLM: its save, tracker file, async request, log line) played
by FakeMegatron. Where megatron-core and Megatron-LM's training code import (Python 3.12,
or 3.11 with typing.override supplied), the hooks are also checked against the real
megatron.training: its parser, its argument validation and its function signatures."""
import argparse
import dataclasses
import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

import statepager
from ports import free_port
from statepager.integrations import megatron_lm
from statepager.integrations.megatron_lm import IntervalStats, RanksFailedError, Run, agree
from statepager.integrations.megatron_lm_config import (Options, RefusedConfiguration, add_arguments,
                                           check, options_from, refusals)
from statepager.integrations.megatron_version import check_version

MiB = 1 << 20


# -- options -----------------------------------------------------------------------------

def parse(argv, environ=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser, environ=environ or {})
    return parser.parse_args(argv)


def test_flags_give_the_options():
    args = parse(["--statepager-dir", "/nvme/sp-{rank}", "--statepager-hbm-budget", "8G",
                  "--statepager-bucket-size", "64M", "--statepager-depth", "4",
                  "--statepager-moments", "q8", "--statepager-mains", "residual",
                  "--statepager-page-size", "2M", "--statepager-host-budget", "64G"])
    assert options_from(args) == Options("/nvme/sp-{rank}", hbm_budget=8 << 30,
                                         host_budget=64 << 30, page_size=2 * MiB, bucket_size=64 * MiB, depth=4,
                                         moments="q8", mains="residual")


def test_defaults_without_flags():
    assert options_from(parse(["--statepager-dir", "/d"])) == Options("/d")


def test_environment_gives_defaults_and_flags_win():
    env = {"STATEPAGER_DIR": "/env/sp", "STATEPAGER_HBM_BUDGET": "1G",
           "STATEPAGER_MOMENTS": "bf16", "STATEPAGER_HOST_BUDGET": "2G"}
    assert options_from(parse([], env)) == Options("/env/sp", hbm_budget=1 << 30,
                                                   host_budget=2 << 30, moments="bf16")
    o = options_from(parse(["--statepager-moments", "q8", "--statepager-dir", "/flag",
                            "--statepager-stationary-bytes", "2G"], env))
    assert (o.directory, o.moments, o.hbm_budget) == ("/flag", "q8", 1 << 30)
    assert o.stationary_bytes == 2 << 30


@pytest.mark.parametrize("var, value, words", [
    ("STATEPAGER_BUCKET_SIZE", "lots", "not a size"),
    ("STATEPAGER_HBM_BUDGET", "0", "more than 0"),
    ("STATEPAGER_HOST_BUDGET", "8X", "not a size"),
    ("STATEPAGER_DEPTH", "1", "at least 2"),
    ("STATEPAGER_STATIONARY_BYTES", "most", "not a size"),
    ("STATEPAGER_MOMENTS", "int4", "fp32, bf16, q8"),
])
def test_bad_environment_value_names_the_variable(var, value, words):
    with pytest.raises(RefusedConfiguration, match=f"{var}.*{words}"):
        parse([], {var: value})


def test_bad_flag_value_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--statepager-dir", "/d", "--statepager-mains", "bf16"])
    assert e.value.code == 2
    assert "--statepager-mains" in capsys.readouterr().err


def test_no_directory_is_refused():
    with pytest.raises(RefusedConfiguration, match="--statepager-dir.*STATEPAGER_DIR"):
        options_from(parse([]))


# -- refused Megatron flags ----------------------------------------------------------------

def megatron_args(**changes):
    """The Megatron arguments refusals() reads, as a supported run sets them."""
    values = dict(use_distributed_optimizer=True, use_megatron_fsdp=False,
                  use_torch_fsdp2=False, use_precision_aware_optimizer=False,
                  optimizer_cpu_offload=False, optimizer_cuda_graph=False,
                  fp8_param_gather=False, fp4_param_gather=False,
                  reuse_grad_buf_for_mxfp8_param_ag=False, fp16=False, bf16=True,
                  log_num_zeros_in_grad=False, accumulate_allreduce_grads_in_fp32=True,
                  save="/ckpt", load="/ckpt", ckpt_format="torch_dist",
                  non_persistent_save_interval=None, moe_use_upcycling=False,
                  load_main_params_from_ckpt=False, optimizer="adam",
                  statepager_directory="/sp")
    values.update(changes)
    return types.SimpleNamespace(**values)


def test_supported_flags_pass():
    assert refusals(megatron_args()) == []
    assert check(megatron_args()) == Options("/sp")
    # Muon: blockwise under tensor parallelism, or any mode on one tensor-parallel rank.
    for mode, tp in (("blockwise", 4), ("duplicated", 1)):
        assert refusals(megatron_args(optimizer="muon", muon_tp_mode=mode,
                                      tensor_model_parallel_size=tp)) == []


@pytest.mark.parametrize("changes, flag", [
    (dict(use_distributed_optimizer=False), "--use-distributed-optimizer"),
    (dict(use_megatron_fsdp=True), "--use-megatron-fsdp"),
    (dict(use_torch_fsdp2=True), "--use-torch-fsdp2"),
    (dict(use_precision_aware_optimizer=True), "--use-precision-aware-optimizer"),
    (dict(optimizer_cpu_offload=True), "--optimizer-cpu-offload"),
    (dict(optimizer_cuda_graph=True), "--optimizer-cuda-graph"),
    (dict(fp8_param_gather=True), "--fp8-param-gather"),
    (dict(fp4_param_gather=True), "--fp4-param-gather"),
    (dict(reuse_grad_buf_for_mxfp8_param_ag=True), "--reuse-grad-buf-for-mxfp8-param-ag"),
    (dict(fp16=True, bf16=False), "--fp16"),
    (dict(log_num_zeros_in_grad=True, accumulate_allreduce_grads_in_fp32=False),
     "--log-num-zeros-in-grad"),
    (dict(ckpt_format="torch"), "--ckpt-format"),
    (dict(non_persistent_save_interval=100), "--non-persistent-save-interval"),
    (dict(moe_use_upcycling=True), "--moe-use-upcycling"),
    (dict(load_main_params_from_ckpt=True), "--load-main-params-from-ckpt"),
    (dict(optimizer="muon", muon_tp_mode="duplicated", tensor_model_parallel_size=2),
     "--muon-tp-mode"),
    (dict(optimizer="muon", muon_tp_mode="distributed", tensor_model_parallel_size=1,
          expert_tensor_parallel_size=2), "--muon-tp-mode"),
])
def test_unsupported_flag_is_refused_by_name(changes, flag):
    found = refusals(megatron_args(**changes))
    assert len(found) == 1 and found[0].startswith(flag), found
    with pytest.raises(RefusedConfiguration, match=flag):
        check(megatron_args(**changes))


def test_layer_wise_runs_and_a_non_distributed_optimizer_needs_steps_all_or_nothing():
    # Megatron-LM turns --optimizer muon --use-distributed-optimizer into these.
    layer_wise = dict(use_distributed_optimizer=False, use_layer_wise_distributed_optimizer=True,
                      optimizer="muon")
    assert refusals(megatron_args(**layer_wise)) == []
    sgd = dict(use_distributed_optimizer=False, optimizer="sgd")
    assert check(megatron_args(**sgd, statepager_atomic="step")).atomic == "step"
    with pytest.raises(RefusedConfiguration, match="--statepager-atomic step"):
        check(megatron_args(**sgd))


def test_every_refused_flag_is_listed_at_once():
    found = refusals(megatron_args(fp16=True, optimizer_cpu_offload=True))
    assert [f.split(":")[0] for f in found] == ["--optimizer-cpu-offload", "--fp16"]


@pytest.mark.parametrize("changes, flag", [
    (dict(data_parallel_size=2), "data-parallel size > 1 without --overlap-param-gather"),
    (dict(use_distributed_optimizer=False, optimizer="sgd", statepager_atomic="step"),
     "no --use-distributed-optimizer"),
    (dict(use_distributed_optimizer=False, use_layer_wise_distributed_optimizer=True,
          optimizer="muon", use_layer_wise_param_layout=False),
     "--no-use-layer-wise-param-layout"),
])
def test_steps_under_the_forward_refuse_what_reads_params_early(changes, flag):
    on = dict(statepager_overlap_forward="on")
    assert check(megatron_args(**on)) == Options("/sp", overlap_forward="on")
    args = megatron_args(**changes)
    assert refusals(args, options_from(args)) == []  # without it, these run
    with pytest.raises(RefusedConfiguration,
                       match=f"{flag} with --statepager-overlap-forward on"):
        check(megatron_args(**changes, **on))
    args = parse(["--statepager-dir", "/d", "--statepager-overlap-forward", "on"])
    assert options_from(args).overlap_forward == "on"
    assert options_from(parse([], {"STATEPAGER_DIR": "/d", "STATEPAGER_OVERLAP_FORWARD": "on"})
                        ).overlap_forward == "on"


@pytest.mark.parametrize("changes", [dict(overlap_param_gather=True),
                                     dict(overlap_param_gather=True, data_parallel_size=2)])
def test_steps_under_the_forward_run_with_the_param_gather_in_the_forward(changes):
    """With --overlap-param-gather each bucket group's all-gather waits for its mains'
    step (MegatronBinding.overlap_forward), at any data-parallel size."""
    on = dict(statepager_overlap_forward="on")
    assert check(megatron_args(**changes, **on)).overlap_forward == "on"


def test_log_num_zeros_with_fp32_grads_and_other_formats_without_checkpoints_pass():
    assert refusals(megatron_args(log_num_zeros_in_grad=True)) == []
    assert refusals(megatron_args(ckpt_format="torch", save=None, load=None)) == []


def test_version_range():
    check_version("0.19.2")
    check_version("0.19.0rc1")
    for version in ("0.18.9", "0.20.0", "1.0.0"):
        with pytest.raises(statepager.UsageError, match=f"{version} is installed.*>= 0.19"):
            check_version(version)
    with pytest.raises(statepager.UsageError, match="cannot read"):
        check_version("dev")


# -- rank agreement --------------------------------------------------------------------------

def test_agree_alone():
    agree(True, "", "saving")
    with pytest.raises(RanksFailedError, match="saving failed on 1 of 1 ranks.*rank 0: full"):
        agree(False, "full", "saving")


_AGREE_CHILD = r"""
import os, sys, torch
from statepager.integrations.megatron_lm import RanksFailedError, agree
rank = int(sys.argv[1])
torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2],
                                     rank=rank, world_size=2)
agree(True, "", "step one")
try:
    agree(rank == 0, "" if rank == 0 else "NoSpaceError: disk full", "loading x")
    print("no error")
except RanksFailedError as e:
    print("raised:", e)
torch.distributed.destroy_process_group()
"""


def test_agree_fails_every_rank_naming_the_failed_one(tmp_path):
    port = str(free_port())
    script = tmp_path / "child.py"
    script.write_text(_AGREE_CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    children = [subprocess.Popen([sys.executable, str(script), str(r), port], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in range(2)]
    outs = [c.communicate(timeout=300) for c in children]
    for c, (out, err) in zip(children, outs):
        assert c.returncode == 0, err
        assert out.strip() == ("raised: statepager: loading x failed on 1 of 2 ranks, so it "
                               "fails on every rank: rank 1: NoSpaceError: disk full"), out


# -- the hooks, with Megatron's side played by FakeMegatron -----------------------------------

class FakeMegatron:
    """What Run uses of statepager.megatron_lm_hooks.MegatronLM, over a directory: the
    iteration directories and tracker file as Megatron lays them out, its log line, and
    its writers and timers as lists."""

    def __init__(self, **args):
        self._args = types.SimpleNamespace(**{
            **dict(save=None, load=None, no_save_optim=None, no_load_optim=None,
                   finetune=False, async_save=False, bf16=True, fp16=False,
                   timing_log_level=0), **args})
        self.loaded = None       # the iteration the last load found
        self.lines, self.scalars, self.timer_reports = [], [], []

    def args(self):
        return self._args

    def iteration_directory(self, base, iteration, release=False):
        return os.path.join(base, "release" if release else f"iter_{iteration:07d}")

    def loaded_iteration(self):
        return self.loaded

    def tracker_names_release(self, base):
        return tracker(base) == "release"

    def appending_to_log_line(self, suffix):
        import contextlib

        @contextlib.contextmanager
        def context():
            self._suffix = suffix
            yield
            self._suffix = None
        return context()

    def print_line(self, text):  # what training_log's print_rank_last does
        self.lines.append(text + self._suffix())

    def write_scalars(self, values, iteration):
        self.scalars.append((iteration, values))

    def log_timers(self, seconds, iteration, normalizer):
        self.timer_reports.append((iteration, seconds, normalizer))


def tracker(base):
    try:
        with open(os.path.join(base, "latest_checkpointed_iteration.txt")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


class AdamWithReload(torch.optim.Adam):
    """A torch optimizer with the reload_model_params() Megatron's optimizers have."""

    reloads = 0

    def reload_model_params(self):
        self.reloads += 1


def make_run(tmp_path, name, host_budget=0, **args):
    fake = FakeMegatron(**args)
    run = Run(fake, device="cpu")
    run.options = Options(str(tmp_path / f"store-{name}"), bucket_size=4096,
                          host_budget=host_budget)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(3)]
    run.build_optimizer(lambda: AdamWithReload(params, lr=0.1))
    return run, fake, params


def train(run, params, steps):
    for _ in range(steps):
        for p in params:
            p.grad = torch.full_like(p, 0.5) + p.detach() * 0.01
        run.optimizer.step()


def state(run, params):
    """Params and moments, read through state_dict() (bucket by bucket)."""
    sd = run.optimizer.state_dict()  # small state (step) is the live tensor: cloned
    return ([p.detach().clone() for p in params],
            {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()})


def same_moments(sa, sb):
    return sa.keys() == sb.keys() and all(
        sa[k].keys() == sb[k].keys() and all(torch.equal(sa[k][n], sb[k][n]) for n in sa[k])
        for k in sa)


def same_state(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and same_moments(a[1], b[1])


def megatron_save(fake, base, iteration, seen):
    """Megatron's save as Run sees it: its part, then the tracker (sync)."""
    def save(optimizer):
        directory = fake.iteration_directory(base, iteration)
        seen.append((optimizer, os.path.isfile(os.path.join(
            statepager.checkpoint.rank_directory(directory), "manifest.json"))))
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(base, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    return save


def test_build_attaches_inside_scope(tmp_path):
    run, _, params = make_run(tmp_path, "a")
    assert run.binding.optimizer is run.optimizer
    train(run, params, 1)
    assert run.binding.last.buckets >= 1
    with pytest.raises(statepager.UsageError, match="one Megatron optimizer per run"):
        run.build_optimizer(lambda: None)
    run.close()


def test_a_refused_attach_fails_every_rank_naming_it(tmp_path):
    fake = FakeMegatron()
    run = Run(fake, device="cpu")
    run.options = Options(str(tmp_path / "store"), bucket_size=4096)
    params = [torch.nn.Parameter(torch.randn(10))]
    with pytest.raises(RanksFailedError, match="attaching the optimizer failed.*rank 0: "
                                               "UsageError: LBFGS cannot be attached"):
        run.build_optimizer(lambda: torch.optim.LBFGS(params))
    assert run.optimizer is None
    run.close()


def test_save_is_complete_before_megatron_writes_the_tracker(tmp_path):
    base = str(tmp_path / "ckpt")
    run, fake, params = make_run(tmp_path, "a", save=base)
    train(run, params, 3)
    seen = []
    run.save(3, run.optimizer, False, megatron_save(fake, base, 3, seen))
    # Megatron was asked to save everything but the optimizer, after ours was in place.
    assert seen == [(None, True)] and tracker(base) == "3"
    manifest = os.path.join(base, "iter_0000003", "statepager", "rank00000", "manifest.json")
    assert os.path.isfile(manifest)
    run.close()


def test_failed_save_leaves_the_tracker_and_megatron_untouched(tmp_path):
    base = str(tmp_path / "ckpt")
    run, fake, params = make_run(tmp_path, "a", save=base)
    train(run, params, 1)
    run.save(1, run.optimizer, False, megatron_save(fake, base, 1, []))
    train(run, params, 1)
    # Something that is no statepager checkpoint where rank 0's part of iteration 2 goes.
    blocker = os.path.join(base, "iter_0000002", "statepager", "rank00000")
    os.makedirs(blocker)
    open(os.path.join(blocker, "notes.txt"), "w").close()
    seen = []
    with pytest.raises(RanksFailedError, match="iteration 2.*rank 0: UsageError.*no "
                                               "statepager checkpoint"):
        run.save(2, run.optimizer, False, megatron_save(fake, base, 2, seen))
    assert seen == [] and tracker(base) == "1"
    assert os.listdir(blocker) == ["notes.txt"]
    run.close()


def test_unfinished_save_of_the_same_iteration_is_replaced(tmp_path):
    base = str(tmp_path / "ckpt")
    run, fake, params = make_run(tmp_path, "a", save=base)
    train(run, params, 2)
    # A crash between the two saves: ours written, Megatron's and the tracker not.
    run.save(2, run.optimizer, False, lambda optimizer: None)
    assert tracker(base) is None
    train(run, params, 1)
    at_save = state(run, params)
    seen = []
    run.save(2, run.optimizer, False, megatron_save(fake, base, 2, seen))
    assert seen == [(None, True)] and tracker(base) == "2"
    run.close()
    # What iteration 2 holds now is the second save's.
    other, fake2, params2 = make_run(tmp_path, "b", load=base)
    train(other, params2, 1)  # creates the state the checkpoint fills
    fake2.loaded = 2
    other.load(other.optimizer, "load", lambda optimizer: (2, 0))
    assert same_moments(state(other, params2)[1], at_save[1])
    other.close()


def test_no_save_optim_skips_ours(tmp_path):
    base = str(tmp_path / "ckpt")
    run, fake, params = make_run(tmp_path, "a", save=base)
    fake.args().no_save_optim = True
    train(run, params, 1)
    seen = []
    run.save(1, run.optimizer, False, megatron_save(fake, base, 1, seen))
    assert seen == [(run.optimizer, False)]
    assert not os.path.exists(os.path.join(base, "iter_0000001", "statepager"))
    run.close()


def test_async_save_finishes_before_the_tracker(tmp_path):
    base = str(tmp_path / "ckpt")
    run, fake, params = make_run(tmp_path, "a", save=base)
    fake.args().async_save = True
    train(run, params, 2)
    request = types.SimpleNamespace(finalize_fns=[])
    order = []

    def save(optimizer):
        assert optimizer is None
        # Megatron's tracker write is a finalize function of its async request.
        request.finalize_fns.append(lambda: order.append(
            ("tracker", os.path.isfile(os.path.join(base, "iter_0000002", "statepager",
                                                    "rank00000", "manifest.json")))))
        run.scheduled(request)  # Megatron hands the request to its queue
    run.save(2, run.optimizer, False, save)
    assert len(request.finalize_fns) == 2 and order == []
    train(run, params, 1)       # training goes on while ours is written
    for fn in request.finalize_fns:  # Megatron's finalize, once the writes are done
        fn()
    assert order == [("tracker", True)]
    run.close()


@pytest.mark.parametrize("host_budget", [0, 64 * MiB], ids=["store", "host-tier"])
def test_load_restores_exactly_and_no_load_optim_starts_fresh(tmp_path, host_budget):
    base = str(tmp_path / "ckpt")
    run, fake, params = make_run(tmp_path, "a", save=base, host_budget=host_budget)
    train(run, params, 3)
    saved = state(run, params)
    run.save(3, run.optimizer, False, megatron_save(fake, base, 3, []))
    train(run, params, 2)
    after = state(run, params)
    run.close()

    resumed, fake2, params2 = make_run(tmp_path, "b", load=base, host_budget=host_budget)
    with torch.no_grad():  # Megatron's load puts the model params back
        for p, q in zip(params2, saved[0]):
            p.copy_(q)
    train(resumed, params2, 1)
    fake2.loaded = 3
    calls = []
    assert resumed.load(resumed.optimizer, "load",
                        lambda optimizer: calls.append(optimizer) or (3, 0)) == (3, 0)
    assert calls == [None] and resumed.optimizer.reloads == 0
    assert same_moments(state(resumed, params2)[1], saved[1])
    with torch.no_grad():
        for p, q in zip(params2, saved[0]):
            p.copy_(q)
    train(resumed, params2, 2)
    assert same_state(state(resumed, params2), after)
    resumed.close()

    for flag in ("no_load_optim", "finetune"):
        fresh, fake3, params3 = make_run(tmp_path, f"c-{flag}", load=base, **{flag: True})
        fake3.loaded = 3
        fresh.load(fresh.optimizer, "load", lambda optimizer: (3, 0))
        assert fresh.optimizer.reloads == 1 and fresh.optimizer.state_dict()["state"] == {}
        fresh.close()


def test_load_without_a_checkpoint_changes_nothing(tmp_path):
    run, fake, params = make_run(tmp_path, "a", load=str(tmp_path / "none"))
    fake.loaded = -1
    assert run.load(run.optimizer, "load", lambda optimizer: (0, 0)) == (0, 0)
    assert run.optimizer.reloads == 0
    run.close()


def test_load_of_a_checkpoint_without_our_state_fails_naming_the_rank(tmp_path):
    base = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(base, "iter_0000004"))
    run, fake, params = make_run(tmp_path, "a", load=base)
    fake.loaded = 4
    with pytest.raises(RanksFailedError, match="iteration 4.*rank 0: .*rank00000 holds no "
                                               "statepager checkpoint.*--no-load-optim"):
        run.load(run.optimizer, "load", lambda optimizer: (4, 0))
    run.close()


def test_other_optimizers_pass_through(tmp_path):
    run, fake, params = make_run(tmp_path, "a", save=str(tmp_path / "c"))
    other = object()
    assert run.save(1, other, False, lambda optimizer: optimizer) is other
    assert run.load(other, "load", lambda optimizer: optimizer) is other
    run.close()


def test_megatron_s_optimizer_checkpoint_is_left_to_megatron(tmp_path):
    """--statepager-optimizer-checkpoint megatron: Megatron saves and loads the optimizer
    itself (its state read and set through the pager); statepager writes nothing."""
    base = str(tmp_path / "ckpt")
    run, fake, params = make_run(tmp_path, "a", save=base, load=base)
    run.options = dataclasses.replace(run.options, optimizer_checkpoint="megatron")
    train(run, params, 2)
    seen, loaded = [], []
    run.save(2, run.optimizer, False, megatron_save(fake, base, 2, seen))
    assert seen == [(run.optimizer, False)] and tracker(base) == "2"
    assert not os.path.exists(os.path.join(base, "iter_0000002", "statepager"))
    fake.loaded = 2
    run.load(run.optimizer, "load", loaded.append)
    assert loaded == [run.optimizer]
    run.close()


def test_the_optimizer_checkpoint_flag_and_its_variable():
    assert options_from(parse(["--statepager-dir", "/d", "--statepager-optimizer-checkpoint",
                               "megatron"])).optimizer_checkpoint == "megatron"
    assert options_from(parse(["--statepager-dir", "/d"], {
        "STATEPAGER_OPTIMIZER_CHECKPOINT": "megatron"})).optimizer_checkpoint == "megatron"
    with pytest.raises(SystemExit):
        parse(["--statepager-dir", "/d", "--statepager-optimizer-checkpoint", "torch"])


def test_step_stats_join_the_log_line_scalars_and_timers(tmp_path):
    run, fake, params = make_run(tmp_path, "a", timing_log_level=1)
    for iteration in (1, 2):
        train(run, params, 1)
        run.training_log(iteration, lambda: None)  # Megatron prints nothing here
    train(run, params, 1)
    run.training_log(3, lambda: fake.print_line(" iteration 3/ 3 | lm loss: 1.0 |"))
    assert [i for i, _ in fake.scalars] == [1, 2, 3]
    assert fake.scalars[0][1]["statepager/read-GB"] >= 0
    assert fake.scalars[0][1]["statepager/written-GB"] > 0
    (line,) = fake.lines
    assert line.startswith(" iteration 3/ 3 | lm loss: 1.0 | statepager read/written per "
                           "iter (GB): ")
    assert "statepager step (ms):" in line and line.endswith("|")
    ((iteration, seconds, normalizer),) = fake.timer_reports
    assert iteration == 3 and normalizer == 3 and seconds["statepager-step"] > 0
    run.close()


def test_interval_stats_count_each_step_once():
    s = statepager.StepStats(step=1, buckets=2, bytes_read=10 ** 9, bytes_written=2 * 10 ** 9,
                             seconds=0.5, read_busy_seconds=0.2, write_busy_seconds=0.4,
                             both_busy_seconds=0.1, peak_mapped_bytes=64 * MiB)
    t = IntervalStats()
    assert t.add([s]) and not t.add([s])
    assert t.steps == 1 and t.scalars()["statepager/io-overlap"] == 0.5
    assert t.log_text() == (" statepager read/written per iter (GB): 1.000/2.000 |"
                            " statepager step (ms): 500.0 |"
                            " statepager page-in/out wait (ms): 0.0/0.0 |"
                            " statepager io overlap: 50% | statepager peak mapped (MiB): 64 |")


# -- the entry point ---------------------------------------------------------------------------

def test_main_help_lists_the_flags(capsys):
    assert megatron_lm.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--statepager-dir", "--statepager-hbm-budget", "--statepager-bucket-size",
                 "--statepager-moments", "--statepager-mains", "STATEPAGER_DIR"):
        assert flag in out


def test_main_without_a_script(capsys, tmp_path):
    assert megatron_lm.main([]) == 2
    assert megatron_lm.main([str(tmp_path / "missing.py")]) == 2
    assert "no training script" in capsys.readouterr().err


# -- against the real megatron.training ----------------------------------------------------

def _megatron_training():
    """megatron.training, importable (skip otherwise). Its 0.19 release imports
    typing.override (Python 3.12); on 3.11 typing_extensions' is supplied."""
    if importlib.util.find_spec("megatron") is None \
            or importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron-core / Megatron-LM's training code is not importable here")
    import typing

    if not hasattr(typing, "override"):
        typing_extensions = pytest.importorskip("typing_extensions")
        typing.override = typing_extensions.override
    import megatron.training.training  # noqa: F401
    from megatron.training import global_vars

    global_vars.unset_global_variables()  # Megatron's arguments are set once per process

    from statepager.integrations.megatron_lm_hooks import MegatronLM

    return MegatronLM()


TINY_GPT = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data",
            "--bf16", "--use-distributed-optimizer", "--transformer-impl", "local",
            "--vocab-size", "128", "--tokenizer-type", "NullTokenizer"]


def test_real_megatron_parser_validation_and_signatures(tmp_path, monkeypatch):
    mlm = _megatron_training()
    from megatron.training import arguments, checkpointing, training

    calls = []

    class Recording(Run):
        def save(self, *a):
            calls.append(("save",) + a[:3])

        def load(self, *a):
            calls.append(("load",) + a[:2])

        def training_log(self, *a):
            calls.append(("log", a[0]))

    run = Recording(mlm, device="cpu")
    run.install()
    try:
        ckpt = str(tmp_path / "ckpt")
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + TINY_GPT + [
            "--save", ckpt, "--load", ckpt, "--save-interval", "2",
            "--statepager-dir", str(tmp_path / "sp-{rank}"), "--statepager-moments", "q8"])
        arguments.parse_and_validate_args()
        assert run.options == Options(str(tmp_path / "sp-{rank}"), moments="q8")
        # Megatron's validation ran first: it turns on fp32 grad accumulation for bf16.
        assert mlm.args().accumulate_allreduce_grads_in_fp32

        monkeypatch.setattr(sys, "argv", sys.argv + ["--optimizer-cpu-offload",
                                                     "--use-precision-aware-optimizer"])
        with pytest.raises(RefusedConfiguration, match="--optimizer-cpu-offload"):
            arguments.parse_and_validate_args()

        # Every parser Megatron builds knows the flags (its 0.19 --help itself fails on a
        # '%' in one of its own help texts, so that is not what is checked).
        parser = arguments.add_megatron_arguments(argparse.ArgumentParser())
        assert parser.parse_known_args(["--statepager-bucket-size", "1M"])[0] \
            .statepager_bucket_size == MiB

        # The wrappers bind Megatron's own signatures.
        opt = object()
        training.save_checkpoint(7, [], opt, None, 0, None, non_persistent_ckpt=False)
        checkpointing.save_checkpoint(8, [], opt, None, 0, release=True)
        training.load_checkpoint([], opt, None)
        training.training_log({}, {}, 0.1, 9, 1.0, False, 0, 1.0, 1.0, None, None)
        assert calls == [("save", 7, opt, False), ("save", 8, opt, True),
                         ("load", opt, "load"), ("log", 9)]
        assert mlm.iteration_directory(ckpt, 12) == os.path.join(ckpt, "iter_0000012")
    finally:
        mlm.uninstall()
    assert training.save_checkpoint is checkpointing.save_checkpoint
    assert "statepager" not in training.get_megatron_optimizer.__module__


_SCRIPT = """
from megatron.training.arguments import parse_and_validate_args
args = parse_and_validate_args()
print("script ran:", args.statepager_directory, __name__)
"""


def test_main_runs_an_unchanged_script_and_refuses_at_start(tmp_path, monkeypatch, capsys):
    mlm = _megatron_training()
    from megatron.training import global_vars

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    flags = TINY_GPT + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    try:
        assert megatron_lm.main([str(script)] + flags + ["--statepager-dir", "/sp"],
                                megatron=mlm) == 0
        assert "script ran: /sp __main__" in capsys.readouterr().out
    finally:
        mlm.uninstall()
        global_vars.unset_global_variables()
    try:
        assert megatron_lm.main([str(script)] + flags,
                                megatron=mlm) == 2
        err = capsys.readouterr().err
        assert "statepager.megatron_lm: statepager.megatron_lm needs a store directory" in err
    finally:
        mlm.uninstall()
    monkeypatch.setenv("STATEPAGER_DIR", "/env-sp")
    try:
        assert megatron_lm.main([str(script)] + flags + ["--ckpt-format", "torch"],
                                megatron=mlm) == 2
        err = capsys.readouterr().err
        assert "cannot run with these Megatron flags:\n  --ckpt-format: " in err
    finally:
        mlm.uninstall()


def test_megatron_s_optimizer_checkpoint_takes_residual_mains():
    """Megatron loads the model params before the optimizer's state: residual mains are
    encoded against them (state_values.load), so both options go together."""
    options = check(megatron_args(statepager_optimizer_checkpoint="megatron",
                                  statepager_mains="residual"))
    assert (options.optimizer_checkpoint, options.mains) == ("megatron", "residual")


def test_the_step_thread_needs_steps_under_the_forward():
    """--statepager-step-thread on steps the buckets of a step under the forward: refused
    without --statepager-overlap-forward on, by flag or environment; passed on with it."""
    args = parse(["--statepager-dir", "/d", "--statepager-step-thread", "on"])
    with pytest.raises(RefusedConfiguration, match="add --statepager-overlap-forward on"):
        check(megatron_args(statepager_step_thread="on"))
    assert options_from(args).step_thread == "on"
    both = dict(statepager_overlap_forward="on", statepager_step_thread="on")
    assert check(megatron_args(**both)) == Options("/sp", overlap_forward="on",
                                                   step_thread="on")
    env = {"STATEPAGER_DIR": "/d", "STATEPAGER_STEP_THREAD": "on"}
    assert options_from(parse([], env)).step_thread == "on"
