"""NCCL correctness on GPUs: GradientSync and ShardedOptimizer (float32 and bfloat16 communication)
against torch's DDP, with trainops AdamW everywhere, the same per-rank data, 4 float32 steps of a
small demo GPT. Prints each variant's relative parameter difference to DDP and whether the ranks
hold identical parameters. (CI checks the same against one process over gloo on the CPU.)

    torchrun --nproc_per_node 2 benchmarks/check_nccl.py
"""
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


def final_parameters(kind: str, data, device) -> torch.Tensor:
    torch.manual_seed(0)
    model = train.GPT(CFG).to(device)
    forward, sync = model, None
    if kind == "ddp":
        forward = torch.nn.parallel.DistributedDataParallel(model)
        opt = trainops.optim.AdamW(model.parameters(), lr=1e-3)
    elif kind == "sync":
        opt = trainops.optim.AdamW(model.parameters(), lr=1e-3)
        sync = trainops.distributed.GradientSync(model.parameters(), bucket_mb=1)
    else:
        comm = torch.bfloat16 if kind == "sharded bf16" else None
        opt = trainops.distributed.ShardedOptimizer(model.parameters(), trainops.optim.AdamW, lr=1e-3, bucket_mb=1,
                                                    comm_dtype=comm)
    for x, y in data:
        forward(x, y).backward()
        if sync is not None:
            sync.wait()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    dist.init_process_group("nccl", timeout=dt.timedelta(minutes=2))
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(rank)
    data = [tuple(torch.randint(0, 256, (CFG.batch, CFG.context), device=device, generator=gen) for _ in range(2))
            for _ in range(4)]
    reference = final_parameters("ddp", data, device)
    for kind in ("sync", "sharded", "sharded bf16"):
        got = final_parameters(kind, data, device)
        difference = ((got - reference).norm() / reference.norm()).item()
        gathered = [torch.zeros_like(got) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, got)
        identical = all(torch.equal(gathered[0], g) for g in gathered)
        if rank == 0:
            print(f"{kind:14s} rel. difference to DDP {difference:.2e}  ranks identical {identical}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
