"""swiglu forward + backward on the sweep's losing shapes (H200, torch 2.11, Triton 3.6): trainops'
default plan against candidate heuristics and torch.compile, in host-inclusive and GPU kernel time.

    python benchmarks/probe_swiglu_sweep.py benchmarks/results/probe-swiglu-sweep-h200-DATE.json
        [--budget 65] [--compile static|dynamic|off]
    python benchmarks/probe_swiglu_sweep.py /tmp/probe-swiglu-cpu.json --cpu    # CPU self-check

The call is the sweep's (trainops.bench.sweep._backward_step, family "swiglu"): gate and up leaves
with requires_grad, y = swiglu(gate, up), y.backward(dy), the grads set to None first; the inputs are
the sweep's (_randn seeds 40, 41, 42, gate scaled by 2). Every implementation is first checked
against float64 (relative-norm error of y, d gate and d up, the largest; the sweep's tolerance per
dtype), then timed: ``ms`` triton.testing.do_bench median (warm-up 5 ms, repetition 20 ms: host
included), ``kernel_ms`` triton.testing.do_bench_cudagraph median (rep 6 ms, the sweep's
KERNEL_REP_MS: a CUDA graph of the whole call replayed, no L2 flush).

Implementations:
    default      ActivationHeuristics() (with the branch's fix: whole flat blocks unmasked)
    block1024    block=1024 (4 warps): 4x the programs of the default 4096 / 8 warps, half the
                 elements a thread (for the shapes whose grid is under or near one wave of 132 SMs)
    fast         precise_math=False (Triton's exp2-based exp and approximate division, as Inductor's
                 sigmoid; not bit-identical to torch's silu)
    torch.compile  F.silu(gate) * up. ``--compile static`` (default): torch.compile(dynamic=False) anew
                 for each shape, its sizes constants in Inductor's kernels (so a numel of 8 mod 16 still
                 gives 16-byte fp16 vectors; the sweep's 0.020 ms at 4097x1000 fp16 is 3.3 TB/s, a
                 vectorised rate); ``dynamic``: one dynamic=True function per dtype (sizes at run time)
4096x1000 fp16 is the control of 4097x1000: its numel is a multiple of 16, so its kernels vectorised
before the fix; 4097x1000's should now take about its time.

Prints a table (plan: BLOCK / warps / grid of the flat plan; ms; kernel_ms; ratio torch.compile /
impl in kernel time) and writes the rows as JSON to argv[1]. ``--budget`` seconds from the process's
start (default 65, so that a run ends within 90 s on the H200): no new implementation starts after
that, its rows say "skipped: budget" (the first shape, 4097x1000 fp16, and its control run first).
``--cpu``: TRITON_INTERPRET=1, three tiny shapes on CPU tensors with the Triton backend pinned, every
candidate checked against float64, no timing, no torch.compile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

_T0 = time.perf_counter()   # the budget counts from the process's start (imports included)

if "--cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import torch
import torch.nn.functional as F

import trainops
from trainops.bench.case import _randn
from trainops.bench.sweep import KERNEL_REP_MS, TOLERANCE, _backward_step, _torch_swiglu
from trainops.ops.activations import ActivationHeuristics

SHAPES = [((4097, 1000), torch.float16), ((4096, 1000), torch.float16), ((7, 128), torch.bfloat16),
          ((2, 6144), torch.float16), ((32, 11008), torch.float32), ((32, 24576), torch.float32),
          ((2048, 509), torch.float32), ((100, 14336), torch.float16), ((4097, 8192), torch.float32)]
CPU_SHAPES = [((7, 128), torch.bfloat16), ((3, 1000), torch.float16), ((5, 509), torch.float32)]
SWEEP_KERNEL_MS = {  # the sweep's kernel ms (trainops / torch.compile) on the H200, before the fix
    "4097x1000 float16": (0.0523, 0.0200), "7x128 bfloat16": (0.0053, 0.0025), "2x6144 float16": (0.0049, 0.0032),
    "32x11008 float32": (0.0062, 0.0041), "32x24576 float32": (0.0077, 0.0056), "2048x509 float32": (0.0086, 0.0066),
    "100x14336 float16": (0.0086, 0.0077), "4097x8192 float32": (0.2560, 0.2503)}
CANDIDATES = {"default": ActivationHeuristics(), "block1024": ActivationHeuristics(block=1024),
              "fast": ActivationHeuristics(precise_math=False)}


def _label(shape, dtype) -> str:
    return "x".join(map(str, shape)) + " " + str(dtype).replace("torch.", "")


def _error(outs, refs) -> float:
    return max((o.detach().double() - r).norm().item() / max(r.norm().item(), 1e-300) for o, r in zip(outs, refs))


def _plan(shape, dtype, device, h) -> dict:
    with trainops.heuristics(h):
        kernel = trainops.plan("swiglu", shape=shape, dtype=dtype, device=device).kernel
    params = dict(kernel.params)
    if params.get("plan") == "flat":
        params["grid"] = -(-math.prod(shape) // params["BLOCK"])
    return params


def _with_heuristics(h):
    def swiglu(gate, up):
        with trainops.heuristics(h):   # the backward plans with the forward's heuristics (ctx.heuristics)
            return trainops.swiglu(gate, up)
    return swiglu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON output path")
    parser.add_argument("--cpu", action="store_true", help="CPU self-check under TRITON_INTERPRET=1, no timing")
    parser.add_argument("--budget", type=float, default=65.0, help="seconds after which no implementation starts")
    parser.add_argument("--compile", choices=("static", "dynamic", "off"), default="static")
    args = parser.parse_args(argv)
    start = _T0
    cpu = args.cpu or not torch.cuda.is_available()
    device = "cpu" if cpu else "cuda"
    shapes = CPU_SHAPES if cpu else SHAPES
    if cpu and not args.cpu:
        print("no CUDA device: the CPU self-check (--cpu)")
    if not cpu:
        import triton.testing
        for name in ("recompile_limit", "accumulated_recompile_limit"):   # as the sweep's
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 4096)
    compiled = {}
    rows = []
    with trainops.backend("triton"):
        for shape, dtype in shapes:
            gate = _randn(shape, dtype, device, 40, 2.0).requires_grad_()
            up = _randn(shape, dtype, device, 41).requires_grad_()
            dy = _randn(shape, dtype, device, 42)
            g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
            y64 = F.silu(g64) * u64
            y64.backward(dy.double())
            refs = (y64.detach(), g64.grad, u64.grad)
            impls = {name: (_with_heuristics(h), h) for name, h in CANDIDATES.items()}
            if not cpu and args.compile != "off":
                if args.compile == "static":
                    fn = torch.compile(_torch_swiglu, dynamic=False)   # one per shape: sizes as constants
                else:
                    fn = compiled.setdefault(dtype, torch.compile(_torch_swiglu, dynamic=True))
                impls["torch.compile"] = (fn, None)
            label = _label(shape, dtype)
            numel = math.prod(shape)
            for name, (fn, h) in impls.items():
                row = {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "numel": numel,
                       "numel_mod_16": numel % 16, "impl": name, "mb_moved": round(8 * numel * dtype.itemsize / 1e6, 3),
                       "plan": _plan(shape, dtype, device, h) if h is not None else None,
                       "error": None, "ok": None, "ms": None, "kernel_ms": None, "note": None}
                rows.append(row)
                if time.perf_counter() - start > args.budget:
                    row["note"] = "skipped: budget"
                    continue
                call = _backward_step(fn, (gate, up), [gate, up], dy)
                try:
                    row["error"] = _error(call(), refs)
                    row["ok"] = row["error"] <= TOLERANCE[dtype]
                    if not cpu:
                        torch.cuda.synchronize()
                        row["ms"] = round(triton.testing.do_bench(call, warmup=5, rep=20, return_mode="median"), 4)
                        row["kernel_ms"] = round(triton.testing.do_bench_cudagraph(call, rep=KERNEL_REP_MS,
                                                                                   return_mode="median"), 4)
                except Exception as e:  # noqa: BLE001 - recorded, the rest still run
                    row["note"] = f"{type(e).__name__}: {str(e)[:200]}"
                    if not cpu:
                        torch.cuda.synchronize()
    # table: per shape, each impl; ratio = torch.compile kernel ms / impl kernel ms (> 1: impl faster)
    best = {(tuple(r["shape"]), r["dtype"]): r["kernel_ms"] for r in rows if r["impl"] == "torch.compile"}
    print(f"{'shape':<20} {'impl':<14} {'plan (BLOCK/warps/grid)':<24} {'err':>8} {'ms':>8} {'kernel_ms':>10} "
          f"{'tc/impl':>8}  sweep before (trainops / tc)")
    for r in rows:
        p = r["plan"]
        plan = f"{p.get('BLOCK')}/{p.get('num_warps')}/{p.get('grid')}" if p else "-"
        tc = best.get((tuple(r["shape"]), r["dtype"]))
        ratio = f"{tc / r['kernel_ms']:.2f}" if tc and r["kernel_ms"] else "-"
        r["torch_compile_over_impl_kernel"] = None if ratio == "-" else float(ratio)
        err = "-" if r["error"] is None else f"{r['error']:.1e}" + ("" if r["ok"] else "!")
        label = _label(r["shape"], getattr(torch, r["dtype"]))
        before = SWEEP_KERNEL_MS.get(label, "")
        print(f"{label:<20} {r['impl']:<14} {plan:<24} {err:>8} {str(r['ms']):>8} {str(r['kernel_ms']):>10} "
              f"{ratio:>8}  {before}{'  ' + r['note'] if r['note'] else ''}")
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if not cpu else "cpu",
           "sms": torch.cuda.get_device_properties(0).multi_processor_count if not cpu else None,
           "compile": None if cpu else args.compile, "seconds": round(time.perf_counter() - start, 1)}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    with open(args.out, "w") as f:
        json.dump({"env": env, "sweep_kernel_ms_before": SWEEP_KERNEL_MS, "rows": rows}, f, indent=1)
    failed = [r for r in rows if r["ok"] is False or (r["note"] and not r["note"].startswith("skipped"))]
    print(f"{len(rows)} rows, {len(failed)} wrong or failed, {env['seconds']} s -> {args.out}")
    return 1 if any(r["ok"] is False and r["impl"] in CANDIDATES for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
