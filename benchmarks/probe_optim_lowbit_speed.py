"""The 8-bit optimizer step's speed on a 1.5 B-parameter Llama-shaped list (issue 41; the tiled
kernel of benchmarks/notes/optimflags.md).

    PYTHONPATH=src python benchmarks/probe_optim_lowbit_speed.py \
        --out benchmarks/results/probe-optim-lowbit-speed-h200.json

One process, about a minute on an H200. The tensors: bench_optim_lowbit.py's model_shapes (vocab
32000, hidden 2048, MLP 5632, 26 layers: 1.47 B parameters in 237 tensors), parameters and
gradients random (gradients 1e-2 * N(0, 1), never zero), one configuration at a time (freed before
the next):

    torch fused AdamW          float32 parameters and states (the reference: "x torch")
    trainops AdamW fp32        float32 states
    trainops AdamW8bit fp32    8-bit states, float32 parameters and gradients
    trainops AdamW8bit bf16+SR 8-bit states, bf16 parameters and gradients, stochastic rounding

and, unless --no-variants, the 8-bit float32 step under other settings of the kernel, to choose
its defaults from: "one tile a program" (16 elements a thread at 4 warps: the layout of the step
before the tiles), "maxnreg 80" (lowbit_optimizers.MAX_REGISTERS), "block 4096" (16 chunks a
program). Per row: ms (CUDA events around each of --steps steps after 3 warm-up steps, median),
x torch fused AdamW's ms, the bytes the step must move (every parameter and state tensor read and
written once, every gradient read once: bench_optim_lowbit.py's count), GB/s at that count, the
floor (those bytes at the device-to-device copy rate measured in the run) and time / floor. The
issue's targets: 8-bit fp32 <= 0.65x torch and <= 1.1x its floor; 8-bit bf16+SR <= 0.45x torch.
JSON to --out: {"environment", "copy_ceiling_gbps", "params", "tensors", "rows", "targets"}; the
table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
import trainops  # noqa: E402
from trainops import bench  # noqa: E402
from trainops.ops import lowbit_optimizers as lowbit  # noqa: E402
from trainops.ops.multi_tensor import MultiTensorHeuristics  # noqa: E402
from bench_optim_lowbit import _bytes_moved, model_shapes  # noqa: E402

REFERENCE = "torch fused AdamW fp32"


@contextlib.contextmanager
def setting(module, name, value):
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def configurations(variants: bool):
    """(name, parameter dtype, optimizer factory, context) in run order."""
    eight = lambda ps: trainops.optim.AdamW8bit(ps, lr=1e-4)  # noqa: E731
    none = contextlib.nullcontext
    rows = [
        (REFERENCE, torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), none),
        ("trainops AdamW fp32", torch.float32, lambda ps: trainops.optim.AdamW(ps, lr=1e-4), none),
        ("trainops AdamW8bit fp32", torch.float32, eight, none),
        ("trainops AdamW8bit bf16+SR", torch.bfloat16,
         lambda ps: trainops.optim.AdamW8bit(ps, lr=1e-4, stochastic_rounding=True), none),
    ]
    if variants:
        rows += [
            ("trainops AdamW8bit fp32 [one tile a program]", torch.float32, eight,
             lambda: setting(lowbit, "TILE_ELEMENTS_PER_THREAD", 16)),
            ("trainops AdamW8bit fp32 [maxnreg 80]", torch.float32, eight,
             lambda: setting(lowbit, "MAX_REGISTERS", 80)),
            ("trainops AdamW8bit bf16+SR [maxnreg 80]", torch.bfloat16,
             lambda ps: trainops.optim.AdamW8bit(ps, lr=1e-4, stochastic_rounding=True),
             lambda: setting(lowbit, "MAX_REGISTERS", 80)),
            ("trainops AdamW8bit fp32 [maxnreg 64]", torch.float32, eight,
             lambda: setting(lowbit, "MAX_REGISTERS", 64)),
            ("trainops AdamW8bit bf16+SR [maxnreg 64]", torch.bfloat16,
             lambda ps: trainops.optim.AdamW8bit(ps, lr=1e-4, stochastic_rounding=True),
             lambda: setting(lowbit, "MAX_REGISTERS", 64)),
            ("trainops AdamW8bit fp32 [maxnreg 48]", torch.float32, eight,
             lambda: setting(lowbit, "MAX_REGISTERS", 48)),
            ("trainops AdamW8bit fp32 [block 4096]", torch.float32, eight,
             lambda: trainops.heuristics(MultiTensorHeuristics(block=4096))),
        ]
    return rows


def run_one(name, dtype, factory, context, shapes, steps, ceiling, reference_ms, log):
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, device="cuda", generator=gen) * 1e-2).to(dtype)
    with context():
        opt = factory(params)
        for _ in range(3):   # the first compiles the kernels and makes the states
            opt.step()
        torch.cuda.synchronize()
        moved = _bytes_moved(params, opt)
        times = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    finite = all(bool(torch.isfinite(p).all()) for p in params[:3] + params[-3:])
    ms = statistics.median(times)
    floor_ms = moved / (ceiling * 1e9) * 1e3
    row = dict(name=name, param_dtype=str(dtype).replace("torch.", ""), ms=round(ms, 4),
               x_torch=round(ms / reference_ms, 3) if reference_ms else 1.0, bytes_moved=int(moved),
               gbps=round(moved / ms / 1e6, 1), floor_ms=round(floor_ms, 4), time_over_floor=round(ms / floor_ms, 3),
               finite=finite, times_ms=[round(t, 4) for t in times])
    log(f"{name:45s} {ms:8.3f} ms" + ("" if finite else "  NON-FINITE"))
    del opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON path")
    parser.add_argument("--steps", type=int, default=10, help="timed steps a configuration (median; default 10)")
    parser.add_argument("--no-variants", action="store_true", help="only the four main configurations")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("argument --steps: must be at least 1")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the step's speed on a GPU)")
    log = lambda s: print(s, flush=True)  # noqa: E731
    env, ceiling = bench.start(False, log)
    shapes = model_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)
    log(f"{n / 1e9:.3f} B parameters in {len(shapes)} tensors")
    rows, reference_ms = [], None
    for name, dtype, factory, context in configurations(not args.no_variants):
        try:
            row = run_one(name, dtype, factory, context, shapes, args.steps, ceiling, reference_ms, log)
        except Exception as error:   # reported as a row; the others still run
            log(f"{name:45s} failed: {type(error).__name__}: {error}")
            row = dict(name=name, error=f"{type(error).__name__}: {error}")
        if name == REFERENCE and "ms" in row:
            reference_ms = row["ms"]
        rows.append(row)
    by = {r["name"]: r for r in rows if "ms" in r}
    targets = {
        "8bit fp32 x torch fused (<= 0.65)": by.get("trainops AdamW8bit fp32", {}).get("x_torch"),
        "8bit fp32 time / own floor (<= 1.1)": by.get("trainops AdamW8bit fp32", {}).get("time_over_floor"),
        "8bit bf16+SR x torch fused (<= 0.45)": by.get("trainops AdamW8bit bf16+SR", {}).get("x_torch"),
        "8bit bf16+SR time / own floor": by.get("trainops AdamW8bit bf16+SR", {}).get("time_over_floor"),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"environment": env, "copy_ceiling_gbps": round(ceiling, 1), "params": n, "tensors": len(shapes),
                   "rows": rows, "targets": targets}, f, indent=1)
    log(f"\ncopy ceiling {ceiling:.0f} GB/s; {n / 1e9:.3f} B parameters")
    log(f"{'configuration':45s} {'ms':>8s} {'x torch':>8s} {'GB moved':>9s} {'GB/s':>7s} {'floor ms':>9s} "
        f"{'x floor':>8s}")
    for r in rows:
        if "ms" not in r:
            log(f"{r['name']:45s} failed: {r['error']}")
            continue
        log(f"{r['name']:45s} {r['ms']:8.3f} {r['x_torch']:8.3f} {r['bytes_moved'] / 1e9:9.2f} {r['gbps']:7.0f} "
            f"{r['floor_ms']:9.3f} {r['time_over_floor']:8.2f}" + ("" if r["finite"] else "  NON-FINITE"))
    log("targets: " + "; ".join(f"{k}: {v}" for k, v in targets.items()))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
