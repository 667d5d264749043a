"""Optimizer-step benchmark on a CUDA device: trainops against torch foreach and torch fused.

    PYTHONPATH=src python benchmarks/bench_optim.py [--sweep] [--small] [--out results/optim-....json]

Cases (../shared/ANCHORS.md): 1.485 B float32 parameters in 96 tensors. Bytes per parameter are
the fewest the step must move: AdamW reads p, g, m, v and writes p, m, v (28 B in float32); with
bf16 parameters and a float32 master copy it reads master, g and writes master, p (28 B too); SGD
with momentum 20 B; LAMB is counted at AdamW's 28 B (its two passes move 40). With a global-norm
clip or a GradScaler the gradients must be read once more (+4 B): they are counted.
Timed with triton.testing.do_bench (median) on random (never zero) data; every trainops variant is
checked against torch's result on the first step before it is timed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import trainops  # noqa: E402
from trainops.bench import copy_ceiling_gbps  # noqa: E402
from trainops.ops.multi_tensor import MultiTensorHeuristics  # noqa: E402

TOTAL = 1_485_000_000
TENSORS = 96


def make_params(dtype, count=TENSORS, total=TOTAL, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = total // count
    params = [torch.randn(n, device="cuda", generator=gen).to(dtype).requires_grad_() for _ in range(count)]
    for p in params:
        p.grad = (torch.randn(n, device="cuda", generator=gen) * 1e-2).to(dtype)
    return params


def time_step(step, rep=300) -> float:
    step()
    torch.cuda.synchronize()
    return triton.testing.do_bench(step, warmup=50, rep=rep, return_mode="median")


def check_first_step(make_ref, make_ours, dtype, master=False, tol=1e-5) -> float:
    """Relative error of our first step against torch's on a small copy of the case (10 tensors)."""
    ref_p = make_params(torch.float32 if master else dtype, count=10, total=10 * 100_003, seed=1)
    our_p = [p.detach().to(dtype).clone().requires_grad_() for p in ref_p]
    for a, b in zip(ref_p, our_p):
        b.grad = a.grad.to(dtype).clone()
        if master:
            a.data.copy_(b.detach().float())
            a.grad = b.grad.float()
    make_ref(ref_p).step()
    opt = make_ours(our_p)
    opt.step()
    ours = [opt.state[p]["master_param"] for p in our_p] if master else our_p
    num = sum(((a.detach().double() - b.detach().double()) ** 2).sum() for a, b in zip(ours, ref_p)) ** 0.5
    den = sum((b.detach().double() ** 2).sum() for b in ref_p) ** 0.5
    err = (num / den).item()
    if not err < tol:
        raise AssertionError(f"first-step relative error {err:.2e} >= {tol}")
    return err


def row(case, impl, ms, bytes_per_param, ceiling, extra=None):
    gbps = TOTAL * bytes_per_param / ms / 1e6
    out = dict(case=case, impl=impl, ms=round(ms, 3), bytes_per_param=bytes_per_param, gbps=round(gbps),
               pct_of_copy=round(100 * gbps / ceiling, 1))
    out.update(extra or {})
    print(f"{case:24s} {impl:34s} {ms:8.3f} ms {gbps:7.0f} GB/s {100 * gbps / ceiling:5.1f}%", flush=True)
    return out


def run_case(case, impls, dtype, bytes_per_param, ceiling, results, rep=300):
    params = make_params(dtype)
    for impl, (make, bytes_override) in impls.items():
        opt = make(params)
        ms = time_step(opt.step if not callable(getattr(opt, "full_step", None)) else opt.full_step, rep=rep)
        results.append(row(case, impl, ms, bytes_override or bytes_per_param, ceiling))
        del opt
        gc.collect()
        torch.cuda.empty_cache()
    del params
    gc.collect()
    torch.cuda.empty_cache()


class ScaledStep:
    """scaler.step(opt) + scaler.update() on gradients that were already scaled (the timed unit)."""

    def __init__(self, scaler, opt, clip=None, params=None):
        self.scaler, self.opt, self.clip, self.params = scaler, opt, clip, params
        scaler.scale(torch.ones((), device="cuda"))  # creates the scale tensor, as scaling a loss would

    def full_step(self):
        if self.clip is not None:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.scaler.step(self.opt)
        self.scaler.update()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time block/warp variants of the AdamW kernel")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceiling = copy_ceiling_gbps("cuda")
    print(f"copy ceiling {ceiling:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    results = []
    checks = {}

    fp32, bf16 = torch.float32, torch.bfloat16
    checks["adamw"] = check_first_step(lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
                                       lambda p: trainops.optim.AdamW(p, lr=1e-3), fp32)
    checks["adamw_clip"] = check_first_step(lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
                                            lambda p: trainops.optim.AdamW(p, lr=1e-3, max_grad_norm=1e6), fp32)
    checks["adamw_bf16_master"] = check_first_step(lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
                                                   lambda p: trainops.optim.AdamW(p, lr=1e-3, master_weights=True),
                                                   bf16, master=True)
    checks["sgd"] = check_first_step(lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, fused=True),
                                     lambda p: trainops.optim.SGD(p, lr=1e-3, momentum=0.9), fp32)
    print("first-step checks (relative error vs torch fused):", checks, flush=True)

    run_case("adamw fp32", {
        "torch foreach": (lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True), None),
        "torch fused": (lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), None),
        "trainops": (lambda p: trainops.optim.AdamW(p, lr=1e-3), None),
        "trainops lamb": (lambda p: trainops.optim.LAMB(p, lr=1e-3), None),
    }, fp32, 28, ceiling, results)

    run_case("adamw fp32 + clip/scaler", {
        "torch fused + clip_grad_norm_": (lambda p: ScaledStepless(p, torch.optim.AdamW(p, lr=1e-3, fused=True)), 32),
        "trainops max_grad_norm": (lambda p: trainops.optim.AdamW(p, lr=1e-3, max_grad_norm=1.0), 32),
        "torch GradScaler + torch fused": (lambda p: ScaledStep(torch.amp.GradScaler("cuda"),
                                                                torch.optim.AdamW(p, lr=1e-3, fused=True)), 32),
        "trainops GradScaler + trainops": (lambda p: ScaledStep(trainops.amp.GradScaler("cuda"),
                                                                trainops.optim.AdamW(p, lr=1e-3)), 32),
    }, fp32, 28, ceiling, results, rep=200)

    run_case("adamw bf16 params", {
        "torch fused (bf16 state)": (lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), 16),
        "trainops fp32 master + state": (lambda p: trainops.optim.AdamW(p, lr=1e-3, master_weights=True), 28),
        "trainops bf16 state, no master": (lambda p: trainops.optim.AdamW(p, lr=1e-3, state_dtype=bf16), 16),
    }, bf16, 28, ceiling, results)

    run_case("sgd momentum fp32", {
        "torch foreach": (lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=True), None),
        "torch fused": (lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, fused=True), None),
        "trainops": (lambda p: trainops.optim.SGD(p, lr=1e-3, momentum=0.9), None),
    }, fp32, 20, ceiling, results)

    if args.sweep:
        params = make_params(fp32)
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                with trainops.heuristics(MultiTensorHeuristics(block=block, warps=warps)):
                    opt = trainops.optim.AdamW(params, lr=1e-3)
                    ms = time_step(opt.step, rep=200)
                results.append(row("sweep adamw fp32", f"BLOCK={block} warps={warps}", ms, 28, ceiling))
                del opt
                gc.collect()
                torch.cuda.empty_cache()
        del params

    small = make_params(fp32, count=200, total=200 * 4096)
    for impl, make in {"torch foreach": lambda p: torch.optim.AdamW(p, foreach=True),
                       "torch fused": lambda p: torch.optim.AdamW(p, fused=True),
                       "trainops": lambda p: trainops.optim.AdamW(p)}.items():
        opt = make(small)
        for _ in range(20):
            opt.step()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            opt.step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 200
        print(f"{'small: 200 x 4096 fp32':24s} {impl:34s} {ms:8.3f} ms per step (launch-bound)", flush=True)
        results.append(dict(case="small 200x4096 fp32", impl=impl, ms=round(ms, 4)))

    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"optim-h100-{dt.date.today():%Y%m%d}.json")
    with open(out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       date=str(dt.date.today()), copy_ceiling_gbps=round(ceiling), checks=checks,
                       results=results), f, indent=1)
    print("wrote", out)
    return 0


class ScaledStepless:
    """clip_grad_norm_ then step: torch's way to clip (the timed unit)."""

    def __init__(self, params, opt):
        self.params, self.opt = params, opt

    def full_step(self):
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()


if __name__ == "__main__":
    sys.exit(main())
