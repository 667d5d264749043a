"""The cnn demo's ResNet-18 eager training step on the GPU (issue 42, item 4): wall time a step,
host time a step (the queue drained first), GPU kernel time and launches a step (torch.profiler), the
top kernels, torch.profiler's CPU self time by op (Python autograd Functions appear under their
names, e.g. _EagerTraining) and cProfile's tottime / cumtime of 20 steps, per run.

    PYTHONPATH=src python benchmarks/profile_cnn_step.py OUT.json trainops,pytorch

CUDA only (bf16 autocast, channels-last, batch 256, the demo's step function and runs).
The profilers inflate Python-heavy code: read their figures as proportions, the walls as the result.
"""
import cProfile, io, json, pstats, sys, time, collections
import torch
from trainops.train import cnn as C

out = sys.argv[1]
dev = torch.device("cuda")
base = dict(C.CNN_CONFIGS["resnet18"]); base["steps"] = 100
fields = {f for f in C.CnnRunConfig.__dataclass_fields__}
cfg = C.CnnRunConfig(**{k: v for k, v in base.items() if k in fields}, **({"amp": "bf16"} if "amp" in fields else {}))
print(cfg)
res = {}
for run in sys.argv[2].split(","):
    model, forward, opt, handle = C.build_run(cfg, dev, run)
    step, _ = C._step_function(cfg, run, dev, forward, opt)
    batches = [C._images(cfg, s, dev) for s in range(8)]
    for i in range(10):
        step(*batches[i % 8])
    torch.cuda.synchronize()
    walls = []
    for r in range(3):
        t0 = time.perf_counter()
        for i in range(30):
            step(*batches[i % 8])
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) / 30 * 1e3)
    # host time of a step: time until step() returns, queue drained first
    host = []
    for i in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); step(*batches[i % 8]); host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            step(*batches[i % 8])
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kern) / 1e3 / 5
    by_name = collections.Counter(); by_cnt = collections.Counter()
    for e in kern:
        by_name[e.name[:70]] += e.device_time / 5; by_cnt[e.name[:70]] += 1 / 5
    cpu_self = collections.Counter(); cpu_cnt = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            cpu_self[e.name[:70]] += e.self_cpu_time_total / 5; cpu_cnt[e.name[:70]] += 1 / 5
    pr = cProfile.Profile(); pr.enable()
    for i in range(20):
        step(*batches[i % 8])
    torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
    s2 = io.StringIO(); pstats.Stats(pr, stream=s2).sort_stats("cumtime").print_stats(40)
    res[run] = dict(wall_ms=walls, host_ms_median=sorted(host)[10], gpu_ms=gpu_ms, launches=len(kern) / 5,
                    top_kernels=by_name.most_common(25), kernel_counts=by_cnt.most_common(25),
                    cpu_self_us=cpu_self.most_common(40), cpu_counts={k: cpu_cnt[k] for k, _ in cpu_self.most_common(40)},
                    cprofile_tottime=s.getvalue()[:12000], cprofile_cumtime=s2.getvalue()[:12000])
    print(run, "wall", walls, "host", sorted(host)[10], "gpu", gpu_ms, "launches", len(kern) / 5, flush=True)
    del model, forward, opt, step
    torch.cuda.empty_cache()
json.dump(res, open(out, "w"), indent=1, default=str)
