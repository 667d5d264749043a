"""Data-parallel step time with NCCL: trainops GradientSync / ShardedOptimizer against torch DDP and ZeRO.

    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py [--batch 8] [--repeat 2] [--out results/distributed-....json]

Model: the training demo's GPT (plain torch.nn modules, the same for every variant) at 12 layers,
width 1024, context 256, ``--batch`` sequences per rank (default 8), bf16 autocast. A step is forward, backward,
gradient synchronisation and the optimizer step; median of 20 steps after 5 warm-up steps, on
random tokens. Bytes: what each rank sends per step for its gradient and parameter collectives
(ring algorithms send (w-1)/w of a buffer per reduce-scatter or all-gather, twice that per
all-reduce).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import trainops  # noqa: E402
from trainops import train  # noqa: E402


def make_model(cfg, device):
    torch.manual_seed(0)
    return train.GPT(cfg).to(device)


def variants(world):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    def ddp_fused(model):
        wrapped = DDP(model, bucket_cap_mb=25)
        return wrapped, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), None

    def ddp_zero(model):
        wrapped = DDP(model, bucket_cap_mb=25)
        return wrapped, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True), None

    def trainops_sync(model):
        return model, trainops.optim.AdamW(model.parameters(), lr=1e-4), \
            trainops.distributed.GradientSync(model.parameters(), bucket_mb=25)

    def trainops_sharded(model, comm=None):
        return model, trainops.distributed.ShardedOptimizer(model.parameters(), trainops.optim.AdamW, lr=1e-4,
                                                            bucket_mb=25, comm_dtype=comm), None

    return {"torch DDP + fused AdamW": ddp_fused,
            "torch DDP + ZeroRedundancyOptimizer": ddp_zero,
            "trainops GradientSync + AdamW": trainops_sync,
            "trainops ShardedOptimizer (ZeRO-1)": trainops_sharded,
            "trainops ShardedOptimizer, bf16 comm": lambda m: trainops_sharded(m, torch.bfloat16)}


# Bytes per parameter each rank sends per step, times (w-1)/w (ring estimates): an all-reduce of
# float32 gradients sends 2 x 4, a reduce-scatter or an all-gather 4 (2 in bfloat16); torch's
# ZeroRedundancyOptimizer all-reduces the gradients and broadcasts the updated partitions.
SENT_PER_PARAM = {"torch DDP + fused AdamW": 2 * 4, "torch DDP + ZeroRedundancyOptimizer": 2 * 4 + 4,
                  "trainops GradientSync + AdamW": 2 * 4, "trainops ShardedOptimizer (ZeRO-1)": 4 + 4,
                  "trainops ShardedOptimizer, bf16 comm": 2 + 4}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences of 256 tokens per rank")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over the variants (interleaved)")
    parser.add_argument("--only", default=None, help="run only the variants whose name contains this")
    args = parser.parse_args()
    dist.init_process_group("nccl", timeout=dt.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    cfg = train.Config(n_layer=12, d_model=1024, n_head=16, context=256, batch=args.batch, accumulate=1, steps=0,
                       lr=1e-4, data_bytes=0)
    gen = torch.Generator(device=device).manual_seed(rank)
    x = torch.randint(0, 256, (cfg.batch, cfg.context), device=device, generator=gen)
    y = torch.randint(0, 256, (cfg.batch, cfg.context), device=device, generator=gen)
    rows = []
    chosen = [item for item in variants(world).items() if args.only is None or args.only in item[0]]
    for name, build in [item for _ in range(args.repeat) for item in chosen]:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)  # what earlier variants left (torch's DDP leaves some)
        model = make_model(cfg, device)
        n_params = sum(p.numel() for p in model.parameters())
        forward, opt, sync = build(model)
        times = []
        for step in range(5 + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(x, y)
            loss.backward()
            if sync is not None:
                sync.wait()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if step >= 5:
                times.append(1e3 * (time.perf_counter() - t0))
        sent = SENT_PER_PARAM[name] * n_params * (world - 1) / world
        row = dict(impl=name, params=n_params, world=world, batch_per_rank=cfg.batch,
                   median_ms=round(statistics.median(times), 2), bytes_sent_per_rank=int(sent),
                   peak_memory_mib=round((torch.cuda.max_memory_allocated(device) - base) / 2**20),
                   left_over_mib=round(base / 2**20))
        rows.append(row)
        if rank == 0:
            print(f"{name:40s} {row['median_ms']:8.2f} ms/step  {sent / 2**20:8.1f} MiB sent/rank  "
                  f"peak {row['peak_memory_mib']} MiB (left over before: {row['left_over_mib']})", flush=True)
        del model, opt, sync, forward, loss
        gc.collect()
        torch.cuda.empty_cache()
    if rank == 0:
        out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                       f"distributed-{dt.date.today():%Y%m%d}.json")
        with open(out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), world=world, torch=torch.__version__,
                           date=str(dt.date.today()), rows=rows), f, indent=1)
        print("wrote", out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
