"""Where the sharded demo's step time goes (issue 21): ``train --fsdp``'s trainops and plain FSDP2
runs alternated in one process (rounds in both orders, so a host that warms up or drifts favours
neither), then one profiled run of each (its set-up, 5 steps and evaluation, per step): the
host's time, the GPU kernels' time, the launches, and the calls that wait for the GPU.

    torchrun --nproc_per_node N benchmarks/profile_fsdp.py [--config medium] [--rounds 4] [--out f.json]

Printed by rank 0 (and written as JSON with --out).
"""
import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from trainops.train import fsdp as train_fsdp  # noqa: E402
from trainops.train import gpt  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def profiled(cfg, device, use_trainops, data, mesh) -> dict:
    """Host ms, GPU kernel ms and waiting calls per step over three steps after the untimed ones."""
    from torch.profiler import ProfilerActivity, profile

    short = replace(cfg, steps=gpt.UNTIMED_STEPS + 3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        result = train_fsdp.run_sharded(short, device, use_trainops, data, mesh, quiet=True)
    events = prof.key_averages()
    on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl = sum(e.device_time_total for e in on_gpu if "nccl" in e.key.lower())
    kernels = sum(e.device_time_total for e in on_gpu) - nccl
    waits = {e.key: e.count for e in events if e.key in WAITS}
    launches = sum(e.count for e in events if e.key in ("cuLaunchKernel", "cudaLaunchKernel", "cuLaunchKernelEx",
                                                       "cudaLaunchKernelExC"))
    return {"step ms": result.run.step_times_ms, "GPU kernel ms a step (whole run)": kernels / 1e3 / short.steps,
            "NCCL kernel ms a step (whole run)": nccl / 1e3 / short.steps,
            "launches a step (whole run)": launches / short.steps, "waits (whole run)": waits,
            "top host self ms a step (whole run)": {
                e.key: round(e.self_cpu_time_total / 1e3 / short.steps, 3)
                for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="medium")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:   # a dry run of the script over gloo
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    cfg = replace(gpt.Config(**gpt.CONFIGS[args.config]), amp="fp16" if device.type == "cuda" else "none",
                  steps=args.steps)
    data = gpt.stdlib_bytes(cfg.data_bytes)
    medians = {"trainops": [], "pytorch": []}
    for round_ in range(args.rounds):
        order = ("pytorch", "trainops") if round_ % 2 == 0 else ("trainops", "pytorch")
        for name in order:
            result = train_fsdp.run_sharded(cfg, device, name == "trainops", data, mesh, quiet=True)
            medians[name].append(statistics.median(result.run.step_times_ms))
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "world": dist.get_world_size(), "torch": torch.__version__,
           "config": args.config, "median ms a step, per round": medians,
           "profiled": {name: profiled(cfg, device, name == "trainops", data, mesh) for name in ("trainops", "pytorch")}}
    if dist.get_rank() == 0:
        print(json.dumps(out, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
