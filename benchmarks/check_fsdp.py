"""FSDP2 on GPUs over NCCL (issue 21): trainops.optim on ``fully_shard``ed models against torch's
fused AdamW and against one process, the GradScaler's decision on every rank, and the optimizer
step's time on sharded parameters. (CI checks the same over gloo on the CPU: tests/test_fsdp.py.)

    torchrun --nproc_per_node N benchmarks/check_fsdp.py [--out results.json]

Printed by rank 0 (and written as JSON with --out):
  vs torch fused       relative parameter difference (Frobenius) after each of 6 steps: trainops
                       AdamW (max_grad_norm) against torch.optim.AdamW(fused=True) + clip_grad_norm_,
                       the same FSDP2 model, float32 and MixedPrecisionPolicy(bf16 params, fp32 reduce)
  vs one process       trainops LAMB and AdamW with the clip on the FSDP2 model against the same
                       optimizer on an unsharded replica fed the global batch (whole-tensor norms)
  scaler               trainops.amp.GradScaler scales over 3 steps with an inf on the last rank at
                       step 2, from every rank (they must agree: back-off, then growth)
  step ms              one optimizer step over 96 Linear(1024, 1024) FSDP2 units, and over the same
                       parameters unsharded: trainops AdamW / LAMB against torch fused and foreach
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import trainops  # noqa: E402


def full(tensors):
    return [t.full_tensor().detach().float() if isinstance(t, DTensor) else t.detach().float() for t in tensors]


def rel(a, b) -> float:
    return max(((p - q).norm() / max(q.norm(), 1e-30)).item() for p, q in zip(a, b))


def blocks(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                                                     torch.nn.Linear(1024, 512)) for _ in range(4)]).to(device)


def sharded(model, mesh, mp=None):
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    return fully_shard(model, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())


def batch(step, device, rank, world, whole=False):
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(step)).to(device)
    return x if whole else x.tensor_split(world)[rank]


def loss_of(model, x):
    return model(x).float().square().mean()


def vs_torch_fused(device, mesh, rank, world) -> dict:
    out = {}
    for label, mp in (("float32", None),
                      ("bf16 params, fp32 reduce", MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                         reduce_dtype=torch.float32))):
        ours, theirs = sharded(blocks(device), mesh, mp), sharded(blocks(device), mesh, mp)
        opt = trainops.optim.AdamW(ours.parameters(), lr=1e-3, max_grad_norm=0.5)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3, fused=True)
        diffs = []
        for step in range(6):
            x = batch(step, device, rank, world)
            for model, o in ((ours, opt), (theirs, ref)):
                o.zero_grad()
                loss_of(model, x).backward()
                if o is ref:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                o.step()
            diffs.append(rel(full(ours.parameters()), full(theirs.parameters())))
        out[label] = diffs
        out[f"{label}: moved"] = rel(full(sharded(blocks(device), mesh, mp).parameters()), full(theirs.parameters()))
    return out


def vs_one_process(device, mesh, rank, world) -> dict:
    out = {}
    for name, make in (("LAMB", lambda ps: trainops.optim.LAMB(ps, lr=1e-3, max_grad_norm=0.5)),
                       ("AdamW", lambda ps: trainops.optim.AdamW(ps, lr=1e-3, max_grad_norm=0.5))):
        ours, whole = sharded(blocks(device), mesh), blocks(device)
        opt, ref = make(ours.parameters()), make(whole.parameters())
        for step in range(4):
            for model, o, x in ((ours, opt, batch(step, device, rank, world)),
                                (whole, ref, batch(step, device, rank, world, whole=True))):
                o.zero_grad()
                loss_of(model, x).backward()
                o.step()
        out[name] = rel(full(ours.parameters()), full(whole.parameters()))
    return out


def scaler_agreement(device, mesh, rank, world) -> list:
    model = sharded(blocks(device), mesh)
    opt = trainops.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = trainops.amp.GradScaler(device.type, init_scale=256.0, growth_interval=1)
    scales = []
    for step in range(3):
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = loss_of(model, batch(step, device, rank, world))
        scaler.scale(loss).backward()
        if step == 1 and rank == world - 1:
            model[0][0].weight.grad._local_tensor.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    every = [None] * world
    dist.all_gather_object(every, scales)
    return every


def step_times(device, mesh) -> dict:
    out = {}
    for layout in ("plain", "fsdp"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(96)]).to(device)
        if layout == "fsdp":
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        for name, make in (("trainops AdamW", lambda ps: trainops.optim.AdamW(ps, lr=1e-4)),
                           ("trainops AdamW + clip", lambda ps: trainops.optim.AdamW(ps, lr=1e-4, max_grad_norm=1.0)),
                           ("trainops LAMB", lambda ps: trainops.optim.LAMB(ps, lr=1e-4)),
                           ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
                           ("torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True))):
            opt = make(model.parameters())
            for _ in range(3):
                opt.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                opt.step()
            torch.cuda.synchronize()
            out[f"{name}, {layout}"] = 1e3 * (time.perf_counter() - t0) / 20
            del opt
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file for the results (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda", (world,))
    results = {"world": world, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "vs torch fused": vs_torch_fused(device, mesh, rank, world),
               "vs one process": vs_one_process(device, mesh, rank, world),
               "scaler": scaler_agreement(device, mesh, rank, world),
               "step ms": step_times(device, mesh)}
    if rank == 0:
        print(json.dumps(results, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
