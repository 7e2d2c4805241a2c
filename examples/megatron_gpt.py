"""Trains a small GPT with megatron-core, its optimizer streamed by statepager.

    python examples/megatron_gpt.py --steps 20 --store /tmp/sp-store            # one GPU
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --store /tmp/sp-{rank}  # DP=2
    python examples/megatron_gpt.py --no-pager                                   # baseline

Prints loss, step time and the pager's stats for every step. Megatron is unmodified:
the optimizer is built inside pager.scope() and handed to pager.attach(). The functions
here (init, build, train_step) are also what tests/gpu/test_megatron.py drives.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

import statepager

MiB = 1 << 20


@dataclass
class Setup:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    vocab: int = 512
    seq: int = 64
    batch: int = 8
    experts: int = 0            # > 0: MoE layers, a ChainedOptimizer (dense + expert)
    grad_fp32: bool = False     # DDP grad_reduce_in_fp32
    overlap: bool = False       # overlap_grad_reduce and overlap_param_gather
    overlap_grad_reduce: bool = False  # overlap_grad_reduce alone (grad syncs in backward)
    lr: float = 3e-3
    optimizer: str = "adam"     # OptimizerConfig.optimizer: "adam", "sgd" or "muon"
    sgd_momentum: float = 0.9
    # use_distributed_optimizer (Megatron's DistributedOptimizer refuses SGD; without it,
    # a non-distributed chain of Float16OptimizerWithFloat16Params)
    distributed: bool = True
    # use_layer_wise_distributed_optimizer (Muon): a LayerWiseDistributedOptimizer for the
    # matrices beside a DistributedOptimizer for the rest, over Megatron-LM's buffer layout
    layer_wise: bool = False
    steps: int = 20
    clip_grad: float = 1.0
    ddp_bucket: int = 40_000    # elements per DDP bucket: several buckets even when small
    seed: int = 1234
    # A native fp32 parameter beside the bf16 ones (like Mamba's A_log; it scales the loss,
    # starting at 1). Megatron's optimizer_cpu_offload cannot step one (see build()).
    fp32_param: bool = True


def init(expert_parallel: int = 1) -> None:
    """One process group (NCCL) and Megatron's parallel state; torchrun or single GPU.
    Experts are only a separate (expert) optimizer when expert_parallel > 1."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                 expert_model_parallel_size=expert_parallel)


def build_model(setup: Setup):
    """A bf16 GPT wrapped in Megatron's DDP (init() first)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(setup.seed)
    model_parallel_cuda_manual_seed(setup.seed)
    # The config's expert_model_parallel_size must repeat init()'s: Megatron's expert linear
    # layers mark their params expert-parallel (allreduce=False: the expert DDP buffers and
    # the expert DistributedOptimizer) from the config, not from parallel_state.
    moe = dict(num_moe_experts=setup.experts, moe_router_topk=2, moe_grouped_gemm=False,
               moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
               add_bias_linear=False,
               expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
               ) if setup.experts else {}
    config = TransformerConfig(num_layers=setup.layers, hidden_size=setup.hidden,
                               num_attention_heads=setup.heads, bf16=True,
                               params_dtype=torch.bfloat16, hidden_dropout=0.0,
                               attention_dropout=0.0, **moe)
    spec = get_gpt_layer_local_spec(num_experts=setup.experts or None, moe_grouped_gemm=False)
    gpt = GPTModel(config, spec, vocab_size=setup.vocab,
                   max_sequence_length=setup.seq).cuda().bfloat16()
    if setup.fp32_param:  # Megatron steps it in place, unpaged
        gpt.loss_log_scale = torch.nn.Parameter(torch.zeros(1, device="cuda"))
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=setup.grad_fp32,
        overlap_grad_reduce=setup.overlap or setup.overlap_grad_reduce,
        overlap_param_gather=setup.overlap,
        use_distributed_optimizer=setup.distributed or setup.layer_wise,
        bucket_size=setup.ddp_bucket)
    layout = {}
    if setup.layer_wise:  # as Megatron-LM's training wraps the model for it
        from megatron.core.optimizer.layer_wise_optimizer import (
            LayerWiseDistributedOptimizer, tag_params_for_buffer_routing)

        tag_params_for_buffer_routing([gpt])
        size = torch.distributed.get_world_size()
        layout = dict(full_param_layout=LayerWiseDistributedOptimizer.compute_full_param_layout(
            [p for p in gpt.parameters() if p.requires_grad], setup.ddp_bucket, size,
            ddp_config))
    return DistributedDataParallel(config, ddp_config, gpt, **layout)


def build(setup: Setup, pager: statepager.Pager | None = None, *, bucket_size=8 * MiB,
          moments: str = "fp32", mains: str = "fp32", attach: bool = True,
          optimizer_options: dict | None = None, model=None, depth: int | None = 3,
          attach_options: dict | None = None):
    """(model, optimizer, scheduler, binding): build_model()'s GPT (or `model`, one it
    built), its Megatron optimizer (built in pager.scope() and, unless attach=False,
    attached when a pager is given). optimizer_options: more OptimizerConfig fields (e.g.
    Megatron's own optimizer_cpu_offload, for comparison; statepager refuses it);
    attach_options: more attach() keywords (e.g. atomic); bucket_size or depth None: the
    pager's defaults."""
    if setup.fp32_param and (optimizer_options or {}).get("optimizer_cpu_offload"):
        # megatron-core 0.19.2: DistributedOptimizer rebuilds its HybridDeviceOptimizer from
        # the main param shards, and an fp32 param's shard is model_param.view(-1)[range]
        # (not detached, unlike the bf16 params' fp32 copies): torch's add_param_group
        # refuses it ("can't optimize a non-leaf Tensor").
        raise ValueError("Megatron's optimizer_cpu_offload (HybridDeviceOptimizer) cannot "
                         "step a native fp32 parameter: its shard is a non-leaf view "
                         "(megatron-core 0.19.2). Build with Setup(fp32_param=False)")
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model = build_model(setup) if model is None else model
    opt_config = OptimizerConfig(**{
        **dict(optimizer=setup.optimizer, sgd_momentum=setup.sgd_momentum, lr=setup.lr,
               min_lr=setup.lr / 10, weight_decay=0.1, bf16=True,
               use_distributed_optimizer=setup.distributed and not setup.layer_wise,
               use_layer_wise_distributed_optimizer=setup.layer_wise,
               clip_grad=setup.clip_grad,
               overlap_param_gather=setup.overlap),
        **(optimizer_options or {})})
    binding = None
    if pager is None:
        optimizer = get_megatron_optimizer(opt_config, [model])
    else:
        with pager.scope():
            optimizer = get_megatron_optimizer(opt_config, [model])
        if attach:
            binding = pager.attach(optimizer, bucket_size=bucket_size, depth=depth,
                                   moments=moments, mains=mains, **(attach_options or {}))
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=setup.lr, min_lr=setup.lr / 10, lr_warmup_steps=3,
        lr_decay_steps=max(setup.steps, 10), lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
        wd_incr_steps=setup.steps, wd_incr_style="constant")
    return model, optimizer, scheduler, binding


def batch(setup: Setup, step: int):
    """A learnable task (rows of an arithmetic sequence mod vocab, 10% noise tokens),
    the same on every run; each data-parallel rank gets its own rows."""
    rank = torch.distributed.get_rank()
    g = torch.Generator(device="cuda").manual_seed(setup.seed + 1000 * step + rank)
    first = torch.randint(setup.vocab, (setup.batch, 1), device="cuda", generator=g)
    stride = torch.randint(1, 8, (setup.batch, 1), device="cuda", generator=g)
    tokens = (first + stride * torch.arange(setup.seq + 1, device="cuda")) % setup.vocab
    noise = torch.rand(tokens.shape, device="cuda", generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(setup.vocab, tokens.shape, device="cuda",
                                              generator=g), tokens)
    position_ids = torch.arange(setup.seq, device="cuda").expand(setup.batch, -1)
    mask = torch.ones(1, 1, setup.seq, setup.seq, device="cuda").tril() < 0.5
    return tokens[:, :-1], position_ids, mask, tokens[:, 1:]


def train_step(setup: Setup, model, optimizer, scheduler, step: int) -> float:
    """One Megatron training iteration; returns the loss."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    tokens, position_ids, mask, labels = batch(setup, step)
    # The phases, named for profilers (bench megatron --iteration-trace).
    with torch.profiler.record_function("forward"):
        per_token = model(tokens, position_ids, mask, labels=labels)
        loss = per_token.float().mean()
        if setup.fp32_param:
            loss = loss * model.module.loss_log_scale.exp()
    with torch.profiler.record_function("backward"):
        loss.backward()
        model.finish_grad_sync()
    with torch.profiler.record_function("optimizer.step"):
        ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError(f"step {step} was skipped (inf/nan grads)")
    scheduler.step(increment=1)
    return loss.item()


def finish(model) -> None:
    """Brings the model params up to date (the overlapped all-gather runs in the next
    forward otherwise; without the distributed optimizer the step wrote them)."""
    if model.ddp_config.use_distributed_optimizer:
        model.start_param_sync(force_sync=True)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--store", default="/tmp/statepager-megatron-{rank}")
    ap.add_argument("--budget-mib", type=int, default=256, help="HBM budget of the pool")
    ap.add_argument("--bucket-mib", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--expert-parallel", type=int, default=1)
    ap.add_argument("--grad-fp32", action="store_true")
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--moments", default="fp32")
    ap.add_argument("--mains", default="fp32")
    ap.add_argument("--no-pager", action="store_true")
    args = ap.parse_args()
    init(args.expert_parallel)
    setup = Setup(layers=args.layers, hidden=args.hidden, heads=8, experts=args.experts,
                  grad_fp32=args.grad_fp32, overlap=args.overlap, steps=args.steps,
                  ddp_bucket=4_000_000)
    pager = None if args.no_pager else statepager.Pager(
        args.store, "cuda", hbm_budget=args.budget_mib * MiB)
    model, optimizer, scheduler, binding = build(setup, pager, bucket_size=args.bucket_mib * MiB,
                                                 moments=args.moments, mains=args.mains)
    rank0 = torch.distributed.get_rank() == 0
    params = sum(p.numel() for p in model.parameters())
    if rank0:
        print(f"GPT: {params / 1e6:.1f} M params, {args.layers} layers, hidden {args.hidden}"
              f"{', pager at ' + pager.directory if pager else ', no pager'}")
    for step in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train_step(setup, model, optimizer, scheduler, step)
        seconds = time.perf_counter() - t0
        if not rank0:
            continue
        line = f"step {step:3d}  loss {loss:.4f}  {seconds * 1e3:7.1f} ms"
        if binding is not None:
            for s, member in zip(binding.last, binding.bindings):
                line += (f"  [{member.name}: {s.buckets} buckets, read {s.bytes_read / MiB:.1f}"
                         f" MiB, wrote {s.bytes_written / MiB:.1f} MiB, {s.seconds * 1e3:.1f} ms,"
                         f" overlap {100 * s.overlap:.0f}%, peak {s.peak_mapped_bytes / MiB:.0f}"
                         " MiB mapped]")
        print(line, flush=True)
    finish(model)
    if pager is not None:
        pager.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
