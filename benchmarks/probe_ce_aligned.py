"""Cross-entropy's exchange plan through aligned windows (CrossEntropyHeuristics.aligned_windows) against
the plain chunks it had before, on odd vocabularies (GPT-2's 50257) and aligned ones (unchanged paths).

    python benchmarks/probe_ce_aligned.py OUT.json [--no-compile] [--budget SECONDS]
    python benchmarks/probe_ce_aligned.py OUT.json --cpu     # self-check: tiny shapes, Triton's interpreter

Per shape (bf16 10240 x {32000, 50257, 65536}, 8192 x 128256, 4096 x 151936; float32 8192 x 50257),
class-index targets at random, "mean": forward + backward (``cross_entropy(x, t).backward()``, x.grad
reset before each call so that no accumulation is timed), triton.testing.do_bench median ms (warmup
25, rep 100) of
    default     trainops as it plans by default (aligned windows where rows are off 16 elements)
    unaligned   trainops with aligned_windows=False: the plain chunks (the path before the windows)
    window-half, unaligned-half   the two at half the exchange block (bf16 16384, float32 8192
                classes a chunk), only on shapes whose default plan takes the windows
    compile     torch.compile of F.cross_entropy(x.float(), t), forward + backward
Each implementation is first checked against float64 (torch's cross_entropy on x.double()): loss and
gradient relative errors (bf16 within 1e-2, float32 within 1e-5; WRONG otherwise). GB/s counts the
fewest bytes (logits read once, gradient written once: 2 x rows x classes x element size); % of the
device-to-device copy measured in the same run. The plan each trainops variant took (plan, BLOCK_C,
splits, window) is in the table and the JSON; the exit status is 1 if any result is WRONG.
Finished in 31 s on an H200 (2026-11-30, benchmarks/results/probe-ce-aligned-h200-20261130-s9.log):
torch.compile's compiles take most of it, and ``--budget`` (80 s) runs the shapes not started by then without their
compile variant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported

import torch
import torch.nn.functional as F

import trainops
from trainops.ops.cross_entropy import CrossEntropyHeuristics

SHAPES = [((10240, 32000), torch.bfloat16), ((10240, 50257), torch.bfloat16), ((10240, 65536), torch.bfloat16),
          ((8192, 128256), torch.bfloat16), ((4096, 151936), torch.bfloat16), ((8192, 50257), torch.float32)]
# interpreter-sized: the exchange plan forced at 16-class chunks on 16 "SMs" (37: 3 chunks, windows;
# 48: aligned rows; 33: 8k + 1), and a pipelined one at 64-class chunks
CPU_SHAPES = [((19, 37), torch.bfloat16), ((19, 48), torch.bfloat16), ((19, 33), torch.float32),
              ((13, 45), torch.bfloat16)]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}


def variants(cpu: bool, classes: int) -> dict:
    """name -> CrossEntropyHeuristics of the trainops variants."""
    if cpu:
        block = 64 if classes == 45 else 16
        small = dict(sms=16, exchange_block={2: block, 4: block})
        half = dict(sms=16, exchange_block={2: block // 2, 4: block // 2})
    else:
        small, half = {}, dict(exchange_block={2: 16384, 4: 8192})
    return {"default": CrossEntropyHeuristics(**small),
            "unaligned": CrossEntropyHeuristics(aligned_windows=False, **small),
            "window-half": CrossEntropyHeuristics(**half),
            "unaligned-half": CrossEntropyHeuristics(aligned_windows=False, **half)}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def bench(fn, cpu: bool) -> float:
    """do_bench median ms (warmup 25, rep 100); on the CPU the wall time of one call."""
    if cpu:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_gbs(cpu: bool) -> float:
    """The device-to-device copy's GB/s (bytes read + written), the ceiling the % column divides by."""
    if cpu:
        return float("nan")
    src = torch.empty(2 ** 28, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    gbs = 2 * src.numel() * src.element_size() / bench(lambda: dst.copy_(src), False) / 1e6
    del src, dst
    return gbs


def plan_of(shape, dtype, device) -> dict:
    kernel = trainops.plan("cross_entropy", shape=shape, dtype=dtype, target_dtype=torch.int64, device=device).kernel
    params = dict(kernel.params)
    return {k: params[k] for k in ("plan", "BLOCK_C", "splits", "num_warps", "window") if k in params} or {
        "kernel": kernel.name}


def run_shape(shape, dtype, device, cpu, use_compile, ceiling) -> list[dict]:
    rows, classes = shape
    gen = torch.Generator(device=device).manual_seed(rows * 1_000_003 + classes)
    x = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 3).to(dtype).requires_grad_()
    t = torch.randint(0, classes, (rows,), generator=gen, device=device)
    x64 = x.detach().double().requires_grad_()
    ref_loss = F.cross_entropy(x64, t)
    ref_grad, = torch.autograd.grad(ref_loss, x64)
    del x64
    nbytes = 2 * rows * classes * x.element_size()

    def measured(name, step, plan=None) -> dict:
        x.grad = None
        loss = step()
        loss.backward()
        loss_err, grad_err = relative_error(loss, ref_loss), relative_error(x.grad, ref_grad)
        ok = max(loss_err, grad_err) <= TOLERANCE[dtype]

        def timed():
            x.grad = None
            step().backward()
        ms = bench(timed, cpu)
        row = {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "variant": name, "ms": ms,
               "gbs": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / ceiling, "loss_err": loss_err,
               "grad_err": grad_err, "ok": ok, "plan": plan}
        print(f"{rows:>6} x {classes:<7} {row['dtype']:<9} {name:<15} {ms:8.3f} ms {row['gbs']:7.0f} GB/s "
              f"{row['pct_copy']:5.1f}%  loss {loss_err:.1e} grad {grad_err:.1e} {'ok' if ok else 'WRONG'}  "
              f"{plan or ''}", flush=True)
        return row

    out = []
    windowed = False
    for name, heuristics in variants(cpu, classes).items():
        if name.endswith("-half") and not windowed:
            continue   # the half-block variants: only where the windows apply
        with trainops.heuristics(heuristics):
            plan = plan_of(shape, dtype, device)
            if name == "default":
                windowed = bool(plan.get("window"))
            out.append(measured(name, lambda: trainops.cross_entropy(x, t), plan))
    if use_compile:
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, t: F.cross_entropy(x.float(), t))
        out.append(measured("compile", lambda: compiled(x, t)))
    else:
        out.append({"shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "variant": "compile",
                    "skipped": True})
    del ref_grad
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--cpu", action="store_true", help="self-check: tiny shapes under Triton's interpreter")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--budget", type=float, default=80.0,
                        help="seconds after which shapes still to start run without their torch.compile variant")
    args = parser.parse_args(argv)
    cpu = args.cpu
    device = "cpu" if cpu else "cuda"
    start = time.perf_counter()
    ceiling = copy_gbs(cpu)
    result = {"device": "cpu (Triton interpreter)" if cpu else torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": __import__("triton").__version__, "copy_gbs": ceiling,
              "rows": []}
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}, copy {ceiling:.0f} GB/s",
          flush=True)
    if not cpu:
        for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, limit):   # one compile a shape
                setattr(torch._dynamo.config, limit, 1024)
    with trainops.backend("triton"):   # on the CPU: the Triton kernels under the interpreter
        for shape, dtype in CPU_SHAPES if cpu else SHAPES:
            use_compile = not args.no_compile and time.perf_counter() - start < args.budget
            result["rows"].extend(run_shape(shape, dtype, device, cpu, use_compile, ceiling))
            if not cpu:
                torch.cuda.empty_cache()
    result["seconds"] = time.perf_counter() - start
    wrong = [r for r in result["rows"] if r.get("ok") is False]
    print(f"{len(result['rows'])} rows in {result['seconds']:.0f} s; "
          f"{'WRONG: ' + str(len(wrong)) if wrong else 'every result within tolerance'}", flush=True)
    print(summary(result["rows"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 1 if wrong else 0


def summary(rows: list[dict]) -> str:
    """One line a shape: ms of each variant, and unaligned / default."""
    by_shape: dict = {}
    for r in rows:
        if "ms" in r:
            by_shape.setdefault((tuple(r["shape"]), r["dtype"]), {})[r["variant"]] = r["ms"]
    names = ["default", "unaligned", "window-half", "unaligned-half", "compile"]
    lines = ["shape                 dtype     " + " ".join(f"{n:>14}" for n in names) + "  unaligned/default"]
    for (shape, dtype), ms in by_shape.items():
        cells = " ".join(f"{ms[n]:14.3f}" if n in ms else f"{'-':>14}" for n in names)
        speedup = ms["unaligned"] / ms["default"] if "unaligned" in ms and "default" in ms else float("nan")
        lines.append(f"{shape[0]:>6} x {shape[1]:<12} {dtype:<9} {cells}  {speedup:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
