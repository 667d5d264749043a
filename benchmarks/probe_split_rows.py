"""Few long rows split across programs (issue 42, item 2): the softmax family and cross-entropy with
fewer rows than SMs, one program a row (before) against rows cut into chunks (now), torch and
torch.compile.

    python benchmarks/probe_split_rows.py --out benchmarks/results/probe-split-rows-h200-DATE.json
        [--no-compile] [--cpu-smoke]

Variants (trainops, forced through the families' heuristics objects):
    old      fill_per_sm=0: one program a row (or a row in exchange_tile / exchange_block chunks), as before
    new      fill_per_sm=4 (cross-entropy's default since this probe ran; softmax's stays 0): rows cut into chunks for about 4
             programs an SM, exchange plan
    fill2    the same at 2 programs an SM
    split2   softmax only, row_exchange=False: the two-launch split plan (partials, then apply) at the same chunks
    torch, torch.compile
Issue 42, item 3 (softmax backward over a non-last axis, dim=0 of a matrix; read in place through its
stride, never transposed): softmax_backward(dy, y, 0) alone, the default plan against column tiles of
32 and 256 bytes (column_bytes_backward) and split plans aiming at 4 and 32 programs per SM, torch and
torch.compile (``--no-dim0`` leaves them out).
Cases: softmax forward; softmax forward + backward (the two ops called directly: trainops.softmax then
trainops.softmax_backward, torch.softmax then torch._softmax_backward_data; compiled as one function);
cross-entropy forward + backward (autograd.grad of the mean loss; class targets at random), without
and with label smoothing 0.1.

Bytes counted: softmax forward x read + y written; + backward dy, y read + dx written (5 tensors);
cross-entropy the logits read + their gradient written (2 tensors). ms: triton.testing.do_bench
median (host time included where the host is slower than the GPU: small rows are launch-bound),
and gpu_ms: the kernels' own durations under torch.profiler (median of 2 windows of 10 calls).
Every implementation is checked against float64 first (relative-norm error; WRONG when > 2e-2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import torch
import torch.nn.functional as F

import trainops
from trainops.ops.cross_entropy import CrossEntropyHeuristics
from trainops.ops.softmax import SoftmaxHeuristics

SHAPES = [((1, 262144), torch.bfloat16), ((4, 131072), torch.bfloat16), ((8, 1048576), torch.bfloat16),
          ((8, 1048576), torch.float32), ((16, 65536), torch.bfloat16), ((64, 32768), torch.bfloat16),
          ((32, 151936), torch.bfloat16)]
SMOKE_SHAPES = [((2, 3000), torch.float32), ((3, 5000), torch.bfloat16)]
DIM0_SHAPES = [((4096, 4096), torch.bfloat16), ((32768, 1024), torch.bfloat16), ((1024, 32768), torch.bfloat16)]
SMOKE_DIM0_SHAPES = [((300, 40), torch.float32)]


def dim0_variants(smoke: bool) -> dict:
    """name -> SoftmaxHeuristics of the dim=0 backward variants."""
    small = dict(sms=4) if smoke else {}
    variants = {"default": SoftmaxHeuristics(**small)}
    for width in (32, 256):
        variants[f"col{width}B"] = SoftmaxHeuristics(column_bytes_backward=width, **small)
    for per_sm in (4, 32):
        variants[f"split{per_sm}"] = SoftmaxHeuristics(split_programs_per_sm=per_sm, **small)
    return variants
COPY_CEILING_GBS = 4200.0  # the H200's device-to-device copy (issue 42: 4,247 GB/s); also measured in the run


def variants(smoke: bool) -> dict:
    """name -> the heuristics objects a trainops variant runs under."""
    small = dict(sms=4, fill_min_bytes=256, fill_min_row_bytes=0) if smoke else {}   # interpreter-sized chunks
    return {
        "old": (SoftmaxHeuristics(fill_per_sm=0, **small), CrossEntropyHeuristics(fill_per_sm=0, **small)),
        "new": (SoftmaxHeuristics(fill_per_sm=4, **small), CrossEntropyHeuristics(fill_per_sm=4, **small)),
        "fill2": (SoftmaxHeuristics(fill_per_sm=2, **small), CrossEntropyHeuristics(fill_per_sm=2, **small)),
        "split2": (SoftmaxHeuristics(fill_per_sm=4, row_exchange=False, **small),),
    }


def relative_error(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def timings(fn, device: str) -> tuple[float, float]:
    """(do_bench median ms, GPU kernel ms); wall time of one call twice on the CPU."""
    if device == "cpu":
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return ms, ms
    import triton.testing

    from trainops.bench import kernel_ms
    return (triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"),
            kernel_ms(fn, steps=10, windows=2))


def softmax_cases(x, dy):
    """(name -> fn(x, dy) returning the outputs to check) for the forward and forward + backward."""
    def fwd_bwd_torch(x, dy):
        y = torch.softmax(x, -1)
        return y, torch._softmax_backward_data(dy, y, -1, x.dtype)

    def fwd_bwd_ours(x, dy):
        y = trainops.softmax(x, -1)
        return y, trainops.softmax_backward(dy, y, -1)
    return {"softmax fwd": (lambda x, dy: (trainops.softmax(x, -1),), lambda x, dy: (torch.softmax(x, -1),)),
            "softmax fwd+bwd": (fwd_bwd_ours, fwd_bwd_torch)}


def reference_softmax(x, dy):
    y = torch.softmax(x.double(), -1)
    return y, y * (dy.double() - (y * dy.double()).sum(-1, keepdim=True))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-compile", action="store_true",
                        help="leave torch.compile out (its compiles take a third of the run)")
    parser.add_argument("--no-dim0", action="store_true", help="leave out the dim=0 backward (item 3)")
    parser.add_argument("--budget", type=float, default=270.0,
                        help="seconds: cases not started by then are skipped (the JSON says which)")
    parser.add_argument("--cpu-smoke", action="store_true", help="the script's logic on the CPU, tiny rows")
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu_smoke else "cuda"
    shapes = SMOKE_SHAPES if args.cpu_smoke else SHAPES
    ceiling = COPY_CEILING_GBS
    if device == "cuda":
        import triton.testing
        src = torch.empty(2 ** 28, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        ceiling = 2 * src.numel() * 2 / triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6
        del src, dst
        for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, limit):   # one compile a shape
                setattr(torch._dynamo.config, limit, 1024)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "sms": torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4,
              "copy_gbs": ceiling, "rows": []}
    print(f"{result['device']}, torch {torch.__version__}, copy {ceiling:.0f} GB/s", flush=True)
    table = []
    # the smoke test runs the Triton kernels under the interpreter (the CPU path otherwise)
    with trainops.backend("triton") if args.cpu_smoke else contextlib.nullcontext():
        _run_shapes(args, device, shapes, ceiling, result, table)
        if not args.no_dim0:
            _run_dim0(args, device, SMOKE_DIM0_SHAPES if args.cpu_smoke else DIM0_SHAPES, ceiling, result, table)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    dim0 = [r for r in table if r["case"].endswith("dim=0")]
    _print_table([r for r in table if r not in dim0], "old", "new")
    _print_table(dim0, "default", "torch.compile")
    print(f"\nwritten {args.out}")


def _print_table(table, before, after):
    """GPU ms per (shape, case) and implementation, then before / after."""
    if not table:
        return
    names = _impl_names(table)
    print(f"\n{'shape':18s} {'case':28s} " + " ".join(f"{n[:9]:>9s}" for n in names) + f"   gpu ms; {before}/{after}")
    for (label, case), rows in _grouped(table).items():
        by = {r["impl"]: r for r in rows}
        ratio = by[before]["gpu_ms"] / by[after]["gpu_ms"] if before in by and after in by else float("nan")
        print(f"{label:18s} {case:28s} " + " ".join(
            f"{by[n]['gpu_ms']:9.4f}" if n in by else f"{'-':>9s}" for n in names) + f"   {ratio:5.2f}x")


def _run_shapes(args, device, shapes, ceiling, result, table):
    gen = torch.Generator(device=device).manual_seed(0)
    for shape, dtype in shapes:
        x = (torch.randn(shape, device=device, generator=gen) * 2).to(dtype)
        dy = torch.randn(shape, device=device, generator=gen).to(dtype)
        t = torch.randint(0, shape[1], (shape[0],), device=device, generator=gen)
        numel, size = math.prod(shape), dtype.itemsize
        label = f"{'x'.join(map(str, shape))} {str(dtype).replace('torch.', '')}"
        sm_want = reference_softmax(x, dy)
        cases = {}
        for case, (ours, theirs) in softmax_cases(x, dy).items():
            want = sm_want[:1] if case == "softmax fwd" else sm_want
            ops = ["softmax"] if case == "softmax fwd" else ["softmax", "softmax_backward"]
            impls = {name: _planned(lambda h=h, ours=ours: _under(h, ours, x, dy), h,
                                    *((op, dict(shape=shape, dim=-1, dtype=dtype, device=device)) for op in ops))
                     for name, h in variants(args.cpu_smoke).items()}
            impls["torch"] = lambda theirs=theirs: theirs(x, dy)
            if not args.no_compile and device == "cuda":
                compiled = torch.compile(theirs, dynamic=False)
                impls["torch.compile"] = lambda compiled=compiled: compiled(x, dy)
            cases[case] = (impls, want, numel * size * (2 if case == "softmax fwd" else 5))

        def ce_ours(h, smoothing):
            def run():
                with trainops.heuristics(*h):
                    xg = x.detach().requires_grad_()
                    loss = trainops.cross_entropy(xg, t, label_smoothing=smoothing, check_target=False)
                    return loss.detach(), torch.autograd.grad(loss, xg)[0]
            return run

        def ce_torch(fn):
            def run():
                xg = x.detach().requires_grad_()
                loss = fn(xg, t)
                return loss.detach(), torch.autograd.grad(loss, xg)[0]
            return run
        for smoothing in (0.0, 0.1):
            xd = x.double().requires_grad_()
            ce_loss = F.cross_entropy(xd, t, label_smoothing=smoothing)
            ce_want = (ce_loss.detach(), torch.autograd.grad(ce_loss, xd)[0])
            described = dict(shape=shape, dtype=dtype, target_dtype=t.dtype, device=device, label_smoothing=smoothing)
            impls = {name: _planned(ce_ours(h, smoothing), h, ("cross_entropy", described))
                     for name, h in variants(args.cpu_smoke).items() if name != "split2"}
            impls["torch"] = ce_torch(lambda x, t, smoothing=smoothing: F.cross_entropy(x, t, label_smoothing=smoothing))
            if not args.no_compile and device == "cuda":
                impls["torch.compile"] = ce_torch(torch.compile(
                    lambda x, t, smoothing=smoothing: F.cross_entropy(x, t, label_smoothing=smoothing), dynamic=False))
            cases["cross_entropy fwd+bwd" + (f" ls={smoothing}" if smoothing else "")] = (impls, ce_want,
                                                                                         numel * size * 2)
        _measure(args, device, label, cases, ceiling, result, table)


def _run_dim0(args, device, shapes, ceiling, result, table):
    """softmax_backward over dim 0 of a matrix (issue 42, item 3)."""
    gen = torch.Generator(device=device).manual_seed(1)
    for shape, dtype in shapes:
        y = torch.softmax(torch.randn(shape, device=device, generator=gen) * 2, 0).to(dtype)
        dy = torch.randn(shape, device=device, generator=gen).to(dtype)
        yd, dyd = y.double(), dy.double()
        want = (yd * (dyd - (yd * dyd).sum(0, keepdim=True)),)
        label = f"{'x'.join(map(str, shape))} {str(dtype).replace('torch.', '')}"
        impls = {}
        for name, h in dim0_variants(args.cpu_smoke).items():
            def run(h=h):
                with trainops.heuristics(h):
                    return (trainops.softmax_backward(dy, y, 0),)
            impls[name] = _planned(run, (h,), ("softmax_backward", dict(shape=shape, dim=0, dtype=dtype, device=device)))

        def theirs(dy, y):
            return (torch._softmax_backward_data(dy, y, 0, y.dtype),)
        impls["torch"] = lambda: theirs(dy, y)
        if not args.no_compile and device == "cuda":
            compiled = torch.compile(theirs, dynamic=False)
            impls["torch.compile"] = lambda: compiled(dy, y)
        nbytes = math.prod(shape) * dtype.itemsize * 3
        _measure(args, device, label, {"softmax bwd dim=0": (impls, want, nbytes)}, ceiling, result, table)


def _planned(fn, heuristics, *plans):
    """``fn`` with ``fn.plan``: what trainops plans for each (op, descriptor) under ``heuristics``."""
    with trainops.heuristics(*heuristics):
        fn.plan = "; ".join(str(trainops.plan(op, **descriptor).kernel) for op, descriptor in plans)
    return fn


_START = time.monotonic()


def _measure(args, device, label, cases, ceiling, result, table):
    """Check, then time, every implementation of every case; rows to ``result`` and ``table``."""
    for case, (impls, want, nbytes) in cases.items():
        if time.monotonic() - _START > args.budget:
            print(f"  {label:22s} {case:28s} skipped: past --budget {args.budget:.0f} s", flush=True)
            result.setdefault("skipped", []).append(f"{label} {case}")
            continue
        with open(args.out, "w") as f:  # before every case: a run cut short keeps what it measured
            json.dump(result, f, indent=1)
        for name, fn in impls.items():
            try:
                got = fn()
                err = max(relative_error(g, w) for g, w in zip(got, want))
                ms, gpu_ms = timings(fn, device)
            except Exception as e:  # noqa: BLE001 - a failing implementation is reported, the rest still run
                print(f"  {label:22s} {case:28s} {name:14s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                result["rows"].append({"shape": label, "case": case, "impl": name,
                                       "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            gbs, gpu_gbs = nbytes / ms / 1e6, nbytes / gpu_ms / 1e6
            wrong = not err < 2e-2
            row = {"shape": label, "case": case, "impl": name, "ms": ms, "gbs": gbs, "pct_of_copy": 100 * gbs / ceiling,
                   "gpu_ms": gpu_ms, "gpu_gbs": gpu_gbs, "gpu_pct_of_copy": 100 * gpu_gbs / ceiling,
                   "rel_err": err, "wrong": wrong, "plan": getattr(fn, "plan", None)}
            result["rows"].append(row)
            table.append(row)
            print(f"  {label:22s} {case:28s} {name:14s} {ms:8.4f} ms {gbs:6.0f} GB/s {row['pct_of_copy']:5.1f}% | gpu "
                  f"{gpu_ms:8.4f} ms {row['gpu_pct_of_copy']:5.1f}%  err {err:.1e}{'  WRONG' if wrong else ''}",
                  flush=True)


def _under(h, fn, x, dy):
    with trainops.heuristics(*h):
        return fn(x, dy)


def _impl_names(table) -> list:
    names = []
    for r in table:
        if r["impl"] not in names:
            names.append(r["impl"])
    return names


def _grouped(table) -> dict:
    groups = {}
    for r in table:
        groups.setdefault((r["shape"], r["case"]), []).append(r)
    return groups


if __name__ == "__main__":
    main()
