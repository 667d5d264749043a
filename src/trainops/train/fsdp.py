"""``torchrun --nproc_per_node N -m trainops train --fsdp``: the GPT of ``trainops.train.gpt`` sharded by
FSDP2 over N ranks (NCCL on GPUs, one per rank; gloo on the CPU).

Each transformer block is a ``fully_shard`` unit, and the root (embedding, tied head, final norm)
another. The trainops run is the single-process one's (trainops kernels, ``trainops.patch``,
``trainops.optim.AdamW`` or LAMB with the global-norm clip inside its step, ``trainops.amp.GradScaler``
under fp16) on the FSDP2 model: the optimizers step the local shards and sum what needs whole
tensors over the mesh (trainops.dtensor). ``--compare`` then trains plain FSDP2 (torch's ops,
``torch.optim.AdamW``, ``clip_grad_norm_``, ``ShardedGradScaler`` under fp16) from the same weights
on the same batches. Every rank takes its contiguous share of each micro-batch; FSDP2 sums the
micro-batches' gradients and averages them over ranks, so the step is the global batch's.

Reported by rank 0: tokens/s of the whole job, ms per step (median), and every rank's peak memory
(CUDA: ``max_memory_allocated``; CPU: the process's peak resident set, which only grows, so
``--compare``'s second run reports at least the first's), beside plain FSDP2's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import gpt
from .common import Batches, RunResult, evaluate, learning_rate, peak_memory_mb, show_progress, stdlib_bytes


@dataclass
class ShardedResult:
    run: RunResult
    peaks_mb: list   # every rank's peak memory


def _shard(mesh):
    def shard(model):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return shard


def _rank_rows(micro_batches, rank: int, world: int):
    return [(x.tensor_split(world)[rank], y.tensor_split(world)[rank]) for x, y in micro_batches]


def run_sharded(cfg: gpt.Config, device: torch.device, use_trainops: bool, data: torch.Tensor, mesh, *,
                quiet: bool = False) -> ShardedResult:
    """``cfg.steps`` steps of the FSDP2 model on this rank, then the validation loss (every rank
    evaluates the held-out batches: FSDP2's gathers need them all)."""
    import trainops

    rank, world = dist.get_rank(), dist.get_world_size()
    name = ("trainops" if use_trainops else "pytorch") + f" fsdp x{world}"
    model, forward, opt, scaler, amp_dtype, report = gpt.build(cfg, device, use_trainops, shard=_shard(mesh))
    if report is not None and not quiet:
        print(report)
    batches = Batches(data, cfg, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens_per_step = cfg.batch * cfg.context
    losses, step_times = [], []
    with trainops.track_kernels() as used:
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg, step)
            if cfg.dropout:
                torch.manual_seed((cfg.seed * 1_000_003 + step) * world + rank)
            t0 = time.perf_counter()
            loss = gpt.train_step(model, forward, opt, scaler, _rank_rows(batches.train_batch(step), rank, world),
                                  amp_dtype, use_trainops, device, cfg.max_grad_norm, sharded=True)
            dist.all_reduce(loss)
            losses.append(float(loss) / world)  # one host read per step, as the single-process run
            elapsed = time.perf_counter() - t0
            if step >= gpt.UNTIMED_STEPS:
                step_times.append(1e3 * elapsed)
            if not quiet:
                timed = sum(step_times) / 1e3
                show_progress(name, step + 1, cfg.steps, losses[-1],
                              tokens_per_step * len(step_times) / timed if timed else 0, final=step + 1 == cfg.steps)
    val = evaluate(model, batches.val_batches(), amp_dtype, device)
    peak = peak_memory_mb(device)
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    seconds = sum(step_times) / 1e3
    result = RunResult(name, losses, val, tokens_per_step * len(step_times) / seconds if seconds else float("nan"),
                       1e3 * seconds / len(step_times) if step_times else float("nan"), peak, dict(used), step_times)
    return ShardedResult(result, peaks)


def summary(result: ShardedResult) -> str:
    peaks = ", ".join(f"{p:,.0f}" for p in result.peaks_mb)
    return gpt.summary(result.run) + f"\n  peak memory per rank (MiB): {peaks}"


def main_fsdp(parser, args, cfg: gpt.Config, plot_path: str | None) -> int:
    """Check what --fsdp needs (parser.error before any work), join the process group, train, report."""
    for option, given in (("--save", args.save is not None), ("--resume", args.resume is not None),
                          ("--compile", args.compile)):
        if given:
            parser.error(f"argument {option}: not available with --fsdp")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error("argument --fsdp: run it under torchrun (torchrun --nproc_per_node N -m trainops train "
                     "--fsdp), which sets RANK and WORLD_SIZE")
    world = int(os.environ["WORLD_SIZE"])
    rows = cfg.batch // cfg.accumulate
    if rows % world:
        parser.error(f"argument --fsdp: the {args.config} config's micro-batches of {rows} sequences do not split "
                     f"evenly over {world} ranks")
    device = args.device
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if local_rank >= torch.cuda.device_count():
            parser.error(f"argument --fsdp: rank {local_rank} of this machine has no GPU of its own "
                         f"({torch.cuda.device_count()} here)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        mesh = init_device_mesh(device.type, (world,))
        rank = dist.get_rank()
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        data = stdlib_bytes(cfg.data_bytes)
        if rank == 0:
            params = sum(p.numel() for p in gpt.GPT(cfg).parameters())
            ranks = f"{world} rank{'s' if world != 1 else ''}"
            print(f"trainops train --fsdp: {args.config} GPT ({cfg.n_layer} layers, width {cfg.d_model}, "
                  f"{params / 1e6:.2f} M parameters) sharded over {ranks} ({mesh.device_type}, "
                  f"{dist.get_backend()}), {cfg.steps} steps of {cfg.batch}x{cfg.context} tokens "
                  f"({cfg.accumulate} micro-batches of {rows // world} sequences per rank), {cfg.optimizer}, "
                  f"amp {cfg.amp}")
        ours = run_sharded(cfg, device, True, data, mesh, quiet=rank != 0)
        if rank == 0:
            print(summary(ours))
        if args.compare:
            ref = run_sharded(cfg, device, False, data, mesh, quiet=rank != 0)
            if rank == 0:
                print(summary(ref))
                print(gpt.compare_table(ours.run, ref.run, every=max(1, len(ours.run.losses) // 15)))
                worst = max(a / b for a, b in zip(ours.peaks_mb, ref.peaks_mb))
                print(f"peak memory per rank, trainops / pytorch: at most {worst:.2f}")
                print(gpt.plot(ours.run, ref.run, plot_path) if plot_path
                      else "matplotlib is not installed: no plot (pip install matplotlib)")
    finally:
        dist.destroy_process_group()
    return 0


__all__ = ["main_fsdp", "run_sharded"]
