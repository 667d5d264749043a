"""NCCL correctness on GPUs: GradientSync and ShardedOptimizer (float32 and bfloat16 communication)
against torch's DDP, with trainops AdamW everywhere, the same per-rank data, 4 float32 steps of a
small demo GPT, each step one backward or, with --accumulate K, K micro-batches of which all but
the last run inside no_sync() (DDP's and ours). Prints each variant's relative parameter
difference to DDP and whether the ranks hold identical parameters. (CI checks the same against
one process over gloo on the CPU.)

    torchrun --nproc_per_node 2 benchmarks/check_nccl.py [--accumulate 2]
"""
import argparse
import contextlib
import datetime as dt
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import trainops  # noqa: E402
from trainops import train  # noqa: E402

CFG = train.Config(n_layer=2, d_model=256, n_head=4, context=128, batch=4, accumulate=1, steps=0, lr=1e-3,
                   data_bytes=0)


def final_parameters(kind: str, data, device, accumulate: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = train.GPT(CFG).to(device)
    forward, sync, no_sync = model, None, contextlib.nullcontext
    if kind == "ddp":
        forward = torch.nn.parallel.DistributedDataParallel(model)
        opt = trainops.optim.AdamW(model.parameters(), lr=1e-3)
        no_sync = forward.no_sync
    elif kind == "sync":
        opt = trainops.optim.AdamW(model.parameters(), lr=1e-3)
        sync = trainops.distributed.GradientSync(model.parameters(), bucket_mb=1)
        no_sync = sync.no_sync
    else:
        comm = torch.bfloat16 if kind == "sharded bf16" else None
        opt = trainops.distributed.ShardedOptimizer(model.parameters(), trainops.optim.AdamW, lr=1e-3, bucket_mb=1,
                                                    comm_dtype=comm)
        no_sync = opt.no_sync
    for step in range(0, len(data), accumulate):
        for x, y in data[step:step + accumulate - 1]:
            with no_sync():
                forward(x, y).backward()
        forward(*data[step + accumulate - 1]).backward()
        if sync is not None:
            sync.wait()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    accumulate = parser.parse_args().accumulate
    dist.init_process_group("nccl", timeout=dt.timedelta(minutes=2))
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(rank)
    data = [tuple(torch.randint(0, 256, (CFG.batch, CFG.context), device=device, generator=gen) for _ in range(2))
            for _ in range(4 * accumulate)]
    reference = final_parameters("ddp", data, device, accumulate)
    for kind in ("sync", "sharded", "sharded bf16"):
        got = final_parameters(kind, data, device, accumulate)
        difference = ((got - reference).norm() / reference.norm()).item()
        gathered = [torch.zeros_like(got) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, got)
        identical = all(torch.equal(gathered[0], g) for g in gathered)
        if rank == 0:
            print(f"{kind:14s} accumulate {accumulate}: rel. difference to DDP {difference:.2e}  "
                  f"ranks identical {identical}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
