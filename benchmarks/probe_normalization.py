"""``trainops.rms_norm`` / ``layer_norm`` forward + backward as GPU time (kernel durations under
torch.profiler: no host time), beside torch eager, torch.compile, Liger-Kernel and quack when
installed, and each half over grids of ``NormHeuristics``.

    python benchmarks/probe_normalization.py --out norm.json [--grid quick|fp32|stages|wide|one-per-sm|small-tiles]
        [--forward-grid] [--shapes 16384x1000,4096x5120] [--no-peers]

Rows: RMSNorm and LayerNorm at 8192 x 4096, 32768 x 768 and 16384 x 2048 (Llama, GPT-2 and a
middle width), and both with the pre-norm residual at 8192 x 4096; or, with ``--shapes``, both
ops over the given ROWSxN shapes. bf16 x and dy, float32 weight (and bias), as ``python -m
trainops bench --ops rms_norm,layer_norm``. In the residual rows the returned h is used too (its
gradient reaches the backward, as in a pre-norm block); x and the residual are both leaves, so
autograd copies the shared gradient once for the second (a device-to-device copy in every
implementation's time: 31 us at 8192 x 4096 bf16 on the H200). ``--grads-only`` takes the
gradients with torch.autograd.grad instead, as a block's non-leaf x and residual receive them.

Bytes (the fewest a forward + backward moves, weight and bias left out): x read and y written,
then dy and x read and dx written: 5 tensors of x's size; with the residual, x and r read and y
and h written, then dy, h and the gradient of h read and dx written: 8.

Every result is checked against float64 torch (relative-norm error of dx, and of dweight and
dbias) before it is timed. ``--grid`` times the backward alone (the plan API, the forward's
outputs made once) under each variant of GRIDS (backward_tile, backward warps, programs per SM,
stages, pipeline_bytes; for every row block, small ones included; tiles in 2-byte units); ``--forward-grid`` the forward alone under FORWARD_GRID (forward_tile,
warps), its y compared with the default plan's. The first variant of each is the defaults. The
JSON is rewritten before every row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import math
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

import trainops
from trainops.bench.cases import _peer
from trainops.ops import normalization as norm
from trainops.plan import cached_plan

from profiled import kernel_ms, relative_error

DEVICE = "cuda"
DTYPE = torch.bfloat16
SHAPES = ((8192, 4096), (32768, 768), (16384, 2048))
ROWS = [(op, s, False) for op in ("rms_norm", "layer_norm") for s in SHAPES] + \
       [("rms_norm", SHAPES[0], True), ("layer_norm", SHAPES[0], True)]
EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5}
# backward variants: (backward_tile, warps, programs per SM, stages, pipeline_bytes)
GRIDS = {
    "quick": [(t, w, p, s, 98304) for t, w, p, s in itertools.product((4096, 8192), (8, 16), (1, 2), (3, 4))],
    "fp32": [(t, 8, p, 3, 147456) for t, p in itertools.product((2048, 4096, 8192), (1, 2))],
    "stages": [(8192, 8, 1, s, 147456) for s in (1, 2, 3, 4)],
    "wide": [(8192, w, p, s, 147456) for w, p, s in itertools.product((8, 16, 32), (1, 2), (1, 2, 3))],
    "one-per-sm": [(t, w, 1, s, 196608) for t, w, s in itertools.product((4096, 8192, 16384), (4, 8, 16), (2, 3, 4, 5))],
    "small-tiles": [(t, w, p, s, 98304) for t, w, p, s in itertools.product((1024, 2048, 4096), (2, 4, 8), (2, 3, 4),
                                                                            (2, 3, 4))],
}
# forward variants: (forward_tile, warps, forward_rows)
FORWARD_GRID = list(itertools.product((4096, 8192, 16384, 32768), (4, 8, 16, 32), (2,)))
FORWARD_GRID_ROWS = list(itertools.product((2048, 4096, 8192, 16384), (4, 8, 16), (1, 2)))


def gpu_time(fn) -> float:
    """ms of one call on the GPU (``kernel_ms``: the median of 3 profiler windows of 20 calls); wall
    time on the CPU (a smoke test of this script)."""
    if DEVICE == "cpu":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return kernel_ms(fn, steps=20, windows=3)


def make_inputs(op, shape, residual):
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    n = shape[-1]

    def randn(*s, scale=1.0):
        return torch.randn(s, device=DEVICE, generator=gen) * scale
    x = (randn(*shape, scale=2.0) + 0.5).to(DTYPE)
    r = randn(*shape).to(DTYPE) if residual else None
    w = randn(n, scale=0.1) + 1.0
    b = randn(n) if op == "layer_norm" else None
    dy = randn(*shape).to(DTYPE)
    dh = randn(*shape).to(DTYPE) if residual else None
    return x, r, w, b, dy, dh


def reference(op, x, r, w, b, dy, dh):
    """float64 dx (of x; r's is the same), dweight, dbias, y and h (None without the residual)."""
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_()
    bd = b.double().requires_grad_() if b is not None else None
    h = xd + r.double() if r is not None else xd
    if op == "rms_norm":
        y = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS[op]) * wd
    else:
        y = F.layer_norm(h, (x.shape[-1],), wd, bd, EPS[op])
    outs, grads = [y], [dy.double()]
    if dh is not None:
        outs.append(h)
        grads.append(dh.double())
    torch.autograd.backward(outs, grads)
    return xd.grad, wd.grad, (bd.grad if bd is not None else None), y.detach(), (h.detach() if r is not None else None)


def errors(got, want) -> dict:
    """Relative-norm errors of (dx, dw, db[, y, h]) against the reference's, where both exist."""
    return {name: relative_error(g, w) for name, g, w in zip(("dx", "dw", "db", "y", "h"), got, want)
            if w is not None and g is not None}


def step_fn(fn, leaves, dy, dh, grads_only=False):
    """forward + backward through autograd; fn returns y, or (y, h) with the residual. The gradients
    go to the leaves' .grad, or with ``grads_only`` are returned by torch.autograd.grad (no
    accumulation into .grad: what a block's non-leaf x and residual see)."""
    def run():
        for t in leaves:
            t.grad = None
        out = fn()
        outs, grads = ([out], [dy]) if dh is None else (list(out), [dy, dh])
        if grads_only:
            for t, g in zip(leaves, torch.autograd.grad(outs, leaves, grads)):
                t.grad = g  # for the checks (host work only: the GPU time does not count it)
        else:
            torch.autograd.backward(outs, grads)
    return run


def implementations(op, x, r, w, b, peers: bool):
    """name -> a callable returning y, or (y, h) with the residual (leaves: x, r, w, b)."""
    n = x.shape[-1]
    eps = EPS[op]

    def ours():
        if op == "rms_norm":
            return trainops.rms_norm(x, w, eps, residual=r)
        return trainops.layer_norm(x, n, w, b, eps, residual=r)

    def composite(x, r, w, b):
        h = x + r if r is not None else x
        y = F.rms_norm(h, (n,), w.to(h.dtype), eps) if op == "rms_norm" else \
            F.layer_norm(h, (n,), w.to(h.dtype), b.to(h.dtype), eps)
        return (y, h) if r is not None else y

    impls = {"trainops": ours, "torch": lambda: composite(x, r, w, b)}
    if not peers:
        return impls
    torch._dynamo.reset()  # a fresh compile each row: past 8 shapes Dynamo would fall back to eager
    compiled = torch.compile(composite, dynamic=False)  # the composite traced: Inductor's own kernels
    impls["torch.compile"] = lambda: compiled(x, r, w, b)
    if r is None:
        liger_rms = _peer("liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
        liger_ln = _peer("liger_kernel.ops.layer_norm", "LigerLayerNormFunction")
        if op == "rms_norm" and liger_rms is not None:
            impls["liger"] = lambda: liger_rms.apply(x, w, eps, 0.0, "llama", False)
        if op == "layer_norm" and liger_ln is not None:
            impls["liger"] = lambda: liger_ln.apply(x, w, b, eps)
    quack_rms = _peer("quack", "rmsnorm")
    if op == "rms_norm" and quack_rms is not None:
        if r is None:
            impls["quack"] = lambda: quack_rms(x, w, eps=eps)
        else:
            impls["quack"] = lambda: quack_rms(x, w, residual=r, eps=eps, prenorm=True)
    return impls


def backward_plan_run(op, x, r, w, b, dy, dh, heuristics):
    """The backward alone through the plan API under ``heuristics``; the forward's h and stats
    made once with the defaults. Returns run() -> (dx, dweight, dbias)."""
    shape, dtype = tuple(x.shape), x.dtype
    fwd = cached_plan(norm.DESCRIPTORS[op](shape, dtype, x.device, weight_dtype=w.dtype,
                                           bias_dtype=None if b is None else b.dtype, has_residual=r is not None,
                                           eps=EPS[op]))
    y, h, stats = fwd.run_unchecked((x, w, b, r))
    h = h if r is not None else x
    bwd = cached_plan(norm.DESCRIPTORS[op + "_backward"](
        shape, dtype, x.device, weight_dtype=w.dtype, bias_dtype=None if b is None else b.dtype,
        has_residual=dh is not None, heuristics=heuristics))
    return lambda: bwd.run_unchecked((dy, h, w, stats, dh)), bwd


def forward_plan_run(op, x, r, w, b, heuristics):
    """The forward alone through the plan API under ``heuristics``. Returns run() -> (y, h, stats)."""
    fwd = cached_plan(norm.DESCRIPTORS[op](tuple(x.shape), x.dtype, x.device, weight_dtype=w.dtype,
                                           bias_dtype=None if b is None else b.dtype, has_residual=r is not None,
                                           eps=EPS[op], heuristics=heuristics))
    return lambda: fwd.run_unchecked((x, w, b, r)), fwd


def timed(result, section, label, variant, ceiling, nbytes, want, make):
    """Time one plan variant (``make() -> (run, plan)``); a backward's dx, dweight and dbias are
    checked against ``want`` (float64), a forward's y against the default plan's (the first
    variant's) y; relative-norm errors, flagged WRONG from 2e-2."""
    try:
        run, plan = make()
        out = run()
        if want is not None:
            err = errors((out[0], out[1], out[2] if want[2] is not None else None), want[:3])
        else:
            if variant is None:
                timed.first_y = out[0].clone()
            err = {"y_vs_default": relative_error(out[0], timed.first_y)}
        ms = gpu_time(run)
    except Exception as e:  # noqa: BLE001 - a failing variant is reported, the rest still run
        print(f"  {section} {label} {variant} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        result[section].append({"row": label, "variant": variant, "error": str(e)[:300]})
        return
    gbs = nbytes / ms / 1e6
    params = dict(plan.kernel.params)
    bad = any(not (v < 2e-2) for v in err.values())
    print(f"  {section} {label:30s} {str(variant or 'default'):32s} {ms * 1e3:7.1f} us {100 * gbs / ceiling:5.1f}% "
          f"{params}{'  WRONG' if bad else ''}", flush=True)
    result[section].append({"row": label, "variant": variant, "ms": ms, "pct_of_copy": 100 * gbs / ceiling,
                            "errors": err, "wrong": bad, "params": {k: str(v) for k, v in params.items()}})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--grid", choices=("none", *GRIDS), default="none")
    parser.add_argument("--forward-grid", nargs="?", const="tiles", choices=("tiles", "rows"),
                        help="also time the forward over FORWARD_GRID (tiles) or FORWARD_GRID_ROWS (rows)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "float64"),
                        help="x's (and dy's, the residual's) dtype")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--grads-only", action="store_true",
                        help="take the gradients with torch.autograd.grad instead of accumulating them into the "
                             "leaves' .grad (the residual rows: no copy of the gradient x and the residual share)")
    parser.add_argument("--rows", default=None, help="comma-separated indices into ROWS")
    parser.add_argument("--shapes", default=None,
                        help="instead of ROWS: RMSNorm and LayerNorm over these comma-separated ROWSxN shapes")
    parser.add_argument("--cpu-smoke", action="store_true", help="run the script's logic on the CPU, tiny rows")
    args = parser.parse_args(argv)
    global DEVICE, DTYPE, ROWS
    DTYPE = getattr(torch, args.dtype)
    if args.cpu_smoke:
        DEVICE = "cpu"
        ROWS = [(op, (64, 96), res) for op, _, res in ROWS[::3]] + [("rms_norm", (64, 96), True)]
    rows = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        rows = [(op, s, False) for s in shapes for op in ("rms_norm", "layer_norm")]
    if DEVICE == "cuda":
        src = torch.empty(2 ** 28, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
        ceiling = 2 * src.numel() * 2 / copy_ms / 1e6
        del src, dst
    else:
        ceiling = float("nan")

    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None
    peers = {p: version(p) for p in ("liger_kernel", "quack-kernels", "nvidia-cutlass-dsl")}
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "dtype": args.dtype, "torch": torch.__version__, "triton": triton.__version__,
              "copy_gbs": ceiling, "peers": peers, "rows": [],
              "grid": [], "forward_grid": []}
    print(f"{result['device']}, torch {torch.__version__}, triton {triton.__version__}, copy {ceiling:.0f} GB/s, "
          f"peers {peers}", flush=True)
    for op, shape, residual in rows:
        with open(args.out, "w") as f:  # before every row: a run cut short keeps what it measured
            json.dump(result, f, indent=1)
        x, r, w, b, dy, dh = make_inputs(op, shape, residual)
        want = reference(op, x, r, w, b, dy, dh)
        tensors = 8 if residual else 5
        nbytes = math.prod(shape) * DTYPE.itemsize * tensors
        label = f"{op} {'x'.join(map(str, shape))}{' +residual' if residual else ''}"
        leaves = [t.requires_grad_() for t in (x, r, w, b) if t is not None]
        for name, fn in implementations(op, x, r, w, b, not args.no_peers).items():
            run = step_fn(fn, leaves, dy, dh, args.grads_only)
            try:
                run()
                out = fn()  # the forward's outputs, checked too
                y, h = (out[0], out[1]) if residual else (out, None)
                got = (x.grad, w.grad, b.grad if b is not None else None, y, h)
                err = errors(got, want)
                if residual:
                    err["dr"] = relative_error(r.grad, want[0])  # d residual = dx
                ms = gpu_time(run)
            except Exception as e:  # noqa: BLE001 - a failing peer is reported, the rest still run
                print(f"  {label:30s} {name:14s} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                result["rows"].append({"row": label, "impl": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            gbs = nbytes / ms / 1e6
            bad = any(not (v < 2e-2) for v in err.values())
            print(f"  {label:30s} {name:14s} {ms:8.4f} ms {gbs:6.0f} GB/s {100 * gbs / ceiling:5.1f}% "
                  f"err {', '.join(f'{k} {v:.1e}' for k, v in err.items())}{'  WRONG' if bad else ''}", flush=True)
            result["rows"].append({"row": label, "impl": name, "ms": ms, "gbs": gbs, "pct_of_copy": 100 * gbs / ceiling,
                                   "errors": err, "wrong": bad})
        for t in leaves:
            t.requires_grad_(False)
            t.grad = None
        if args.grid == "none":
            continue
        bwd_bytes = math.prod(shape) * DTYPE.itemsize * (4 if residual else 3)
        for variant in [None, *GRIDS[args.grid]]:
            if variant is None:
                h = norm.NormHeuristics()
            else:
                tile, warps, pps, stages, pipeline_bytes = variant
                h = norm.NormHeuristics(backward_tile=tile, backward_warps=((1 << 62, warps),), backward_programs_per_sm=pps,
                                        backward_stages=((1 << 62, stages),), pipeline_bytes=pipeline_bytes,
                                        small_rows=1)  # the variant's values for every row block
            timed(result, "grid", label, variant, ceiling, bwd_bytes, want,
                  lambda: backward_plan_run(op, x, r, w, b, dy, dh, h))
        if args.forward_grid:
            fwd_bytes = math.prod(shape) * DTYPE.itemsize * (4 if residual else 2)
            for variant in [None, *(FORWARD_GRID_ROWS if args.forward_grid == "rows" else FORWARD_GRID)]:
                h = norm.NormHeuristics() if variant is None else \
                    norm.NormHeuristics(forward_tile=variant[0], warps=((1 << 62, variant[1]),), forward_rows=variant[2])
                timed(result, "forward_grid", label, variant, ceiling, fwd_bytes, None,
                      lambda: forward_plan_run(op, x, r, w, b, h))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
