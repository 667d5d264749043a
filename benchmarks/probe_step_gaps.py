"""Where the GPU idles in a whole training step (issue 39): the wall time of 30 steps, then a
chrome trace of 3 steps under torch.profiler. Each gap between GPU activities (kernels, copies,
memsets) longer than 3 us is attributed to the CPU op stack at the launch that ended it (the CUDA
runtime or driver call of the next activity), and each phase of the step (forward, backward,
optimizer step, zero_grad) reports when the host ran it and when the GPU ran what it launched.
The profiler slows the host, so the traced steps are longer than the timed ones.

    PYTHONPATH=src python benchmarks/probe_step_gaps.py gpt2 trainops out.json [--batch B --seq S]
        [--pinned-tables] [--device cpu]

Models and runs are ``python -m trainops bench --step``'s (trainops.bench.step); ``--pinned-tables``
stages the multi-tensor address tables through pinned memory (an A/B tried in the sixth session,
benchmarks/NOTES.md); ``--device cpu`` (tiny widths) only checks that the script runs.
"""
import argparse
import bisect
import collections
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from trainops.bench import step as S

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("model", choices=list(S.MODELS))
parser.add_argument("run", choices=[r for r in S.RUNS if r != "liger" and not r.endswith("graphs")])
parser.add_argument("out", help="JSON path")
parser.add_argument("--batch", type=int, default=None)
parser.add_argument("--seq", type=int, default=None)
parser.add_argument("--pinned-tables", action="store_true")
parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
args = parser.parse_args()
model_name, run, out, DEV = args.model, args.run, args.out, args.device
spec = S.MODELS[model_name]
batch = args.batch or spec.batch
seq = args.seq or spec.seq
layers = spec.values[spec.keys["layers"]]
settings = dict(device=DEV, compile_scope="model", layers=layers, model=model_name)
config = S.build_config(model_name, None, seq, tiny=DEV == "cpu")
model = S.build_model(config, DEV)
forward, opt, _ = S._setup(run, model, settings)
batches = S.make_batches(8, batch, seq, config.vocab_size, DEV)
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)

if args.pinned_tables:
    from trainops.ops import multi_tensor as _mt
    _orig = _mt._to_device

    def _pinned(host, device, in_capture):
        if in_capture or device.type != "cuda":
            return _orig(host, device, in_capture)
        return host.pin_memory().to(device, non_blocking=True)
    _mt._to_device = _pinned
RF = torch.profiler.record_function
def train_step(ids):
    with RF("PH_FWD"):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
    with RF("PH_BWD"):
        loss.backward()
    with RF("PH_OPT"):
        opt.step()
    with RF("PH_ZERO"):
        opt.zero_grad(set_to_none=True)
    return loss

for i in range(5):
    train_step(batches[i % 8]).item()
sync()
walls = []
for i in range(30):
    t0 = time.perf_counter(); train_step(batches[i % 8]).item(); walls.append(1e3 * (time.perf_counter() - t0))
N = 3
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for i in range(N):
        with torch.profiler.record_function(f"STEP{i}"):
            train_step(batches[i % 8]).item()
    sync()
trace = out + ".trace.json"
prof.export_chrome_trace(trace)
ev = json.load(open(trace))["traceEvents"]
os.remove(trace)
gpu = sorted([e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], key=lambda e: e["ts"])
rt = {e["args"].get("correlation"): e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")}
cpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
steps = sorted([e for e in cpu if e["name"].startswith("STEP")], key=lambda e: e["ts"])
cpu.sort(key=lambda e: e["ts"])
starts = [e["ts"] for e in cpu]

def stack_at(ts, tid):
    i = bisect.bisect_right(starts, ts)
    out = []
    for e in cpu[max(0, i - 4000):i]:
        if e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e["dur"]:
            out.append(e)
    out.sort(key=lambda e: (e["ts"], -e["dur"]))
    return [e["name"] for e in out]

def label(stack):
    names = [n for n in stack if not n.startswith("STEP")]
    tro = [n for n in names if n.startswith("trainops") or "trainops" in n]
    first = names[0] if names else "?"
    inner = names[-1] if names else "?"
    return f"{tro[0] if tro else first} > {inner}"

res = dict(pin=args.pinned_tables, walls=walls, model=model_name, run=run, batch=batch, seq=seq, wall_ms=sorted(walls)[len(walls)//2], steps=[])
by_label = collections.Counter(); count_label = collections.Counter()
for s in steps:
    t0, t1 = s["ts"], s["ts"] + s["dur"]
    g = [e for e in gpu if t0 <= e["ts"] <= t1]
    busy = sum(e["dur"] for e in g)
    idle, prev_end, gaps = 0.0, t0, []
    for e in g:
        gap = e["ts"] - prev_end
        if gap > 3:
            r = rt.get(e["args"].get("correlation"))
            lab = label(stack_at(r["ts"], r["tid"])) if r else "?"
            gaps.append((gap, (prev_end - t0) / 1e3, lab, e["name"][:60]))
            by_label[lab] += gap; count_label[lab] += 1
            idle += gap
        prev_end = max(prev_end, e["ts"] + e["dur"])
    tail = t1 - prev_end
    phases = {}
    for ph in [e for e in cpu if e["name"].startswith("PH_") and t0 <= e["ts"] <= t1]:
        a, z = ph["ts"], ph["ts"] + ph["dur"]
        launched = [e for e in g if (rt.get(e["args"].get("correlation")) or {}).get("ts", -1) >= a
                    and (rt.get(e["args"].get("correlation")) or {}).get("ts", -1) <= z]
        phases[ph["name"]] = dict(host_start_ms=round((a - t0) / 1e3, 2), host_end_ms=round((z - t0) / 1e3, 2),
                                  gpu_first_ms=round((min(e["ts"] for e in launched) - t0) / 1e3, 2) if launched else None,
                                  gpu_last_end_ms=round((max(e["ts"] + e["dur"] for e in launched) - t0) / 1e3, 2) if launched else None,
                                  gpu_busy_ms=round(sum(e["dur"] for e in launched) / 1e3, 2), launches=len(launched))
    res["steps"].append(dict(step_ms=s["dur"] / 1e3, gpu_busy_ms=busy / 1e3, idle_ms=idle / 1e3, tail_ms=tail / 1e3,
                             launches=len(g), phases=phases, biggest=[dict(us=round(a, 1), at_ms=round(b, 2), host=c, kernel=d) for a, b, c, d in sorted(gaps, reverse=True)[:25]]))
res["idle_by_host_op_us_per_step"] = [(k, round(v / len(steps), 1), count_label[k] // len(steps)) for k, v in by_label.most_common(40)]
json.dump(res, open(out, "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "steps"}, indent=1)[:4000])
for s in res["steps"]:
    print({k: v for k, v in s.items() if k not in ("biggest", "phases")})
    for k, v in s["phases"].items(): print("   ", k, v)
