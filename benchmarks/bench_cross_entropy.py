"""Cross-entropy forward + backward on a CUDA device: trainops against torch, torch.compile and Liger.

    PYTHONPATH=src python benchmarks/bench_cross_entropy.py [--sweep] [--out FILE]

Cases: the ../shared/ANCHORS.md shapes (bf16 logits, int64 targets, mean reduction). Bytes: the
logits read once and their gradient written once (the floor of a fused loss + gradient).
Each call is a full training-step loss: forward, then backward into a leaf's .grad (reset to
None each call). Timed with triton.testing.do_bench (median); every implementation is checked
against a float64 torch reference first (loss and gradient).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import trainops  # noqa: E402
from trainops.bench import copy_ceiling_gbps  # noqa: E402
from trainops.ops import cross_entropy as ce_ops  # noqa: E402

CASES = [(8192, 32000), (8192, 128256), (4096, 262144)]


def implementations(liger):
    def step(loss_fn):
        def run(x, t):
            x.grad = None
            loss_fn(x, t).backward()
            return x.grad
        return run

    impls = {"trainops": step(lambda x, t: trainops.cross_entropy(x, t)),
             "trainops unchecked": step(lambda x, t: trainops.cross_entropy(x, t, check_target=False)),
             "trainops fp32 loss + z": step(lambda x, t: trainops.cross_entropy(x, t, loss_dtype=torch.float32,
                                                                                 z_loss=1e-4)),
             "torch": step(lambda x, t: F.cross_entropy(x, t)),
             "torch.compile": step(torch.compile(lambda x, t: F.cross_entropy(x, t), dynamic=False))}
    def forward_only(x, t):
        with torch.no_grad():
            trainops.cross_entropy(x, t, check_target=False)
        return None

    impls["trainops forward only (no grad)"] = forward_only
    # the gradient over the logits: x.view_as(x) is a non-leaf whose backward is a free reshape; it clobbers x
    impls["trainops inplace_backward"] = step(lambda x, t: trainops.cross_entropy(x.view_as(x), t,
                                                                                 inplace_backward=True))
    if liger is not None:
        impls["liger"] = step(lambda x, t: liger.apply(x, t, None)[0])  # writes its gradient into x
    return impls


def bench_case(rows, classes, impls, ceiling, log, forward_only=False):
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(rows + classes)
    x = (torch.randn(rows, classes, device="cuda", generator=gen) * 2).to(dtype).requires_grad_()
    t = torch.randint(0, classes, (rows,), device="cuda", generator=gen)
    nbytes = 2 * rows * classes * dtype.itemsize
    xd = x.detach().double().requires_grad_()
    F.cross_entropy(xd, t).backward()
    ref_grad = xd.grad
    del xd
    pristine = x.detach().clone()  # Liger and inplace_backward overwrite the logits with the gradient
    out = []
    for name, fn in impls.items():
        try:
            with torch.no_grad():
                x.copy_(pristine)
            grad = fn(x, t)
            err = float("nan") if grad is None else ((grad.double() - ref_grad).norm() / ref_grad.norm()).item()
            ms = triton.testing.do_bench(lambda: fn(x, t), warmup=10, rep=100, return_mode="median")
        except Exception as e:  # a peer that fails is reported, not fatal
            log(f"  {name} failed on {rows}x{classes}: {type(e).__name__}: {str(e)[:160]}")
            continue
        moved = nbytes // 2 if "forward only" in name else nbytes  # no gradient written
        gbps = moved / ms / 1e6
        out.append(dict(rows=rows, classes=classes, dtype="bfloat16", impl=name, ms=round(ms, 4),
                        gbps=round(gbps, 1), pct_of_copy=round(100 * gbps / ceiling, 1), grad_error=err))
        log(f"  {rows}x{classes} {name:24s} {ms:8.4f} ms {gbps:6.0f} GB/s {100 * gbps / ceiling:5.1f}%  "
            f"grad err {err:.1e}")
    x.grad = None
    return out


def sweep(ceiling, log):
    """Cache hints of the streamed (two-pass) rows and the fused rows' grid (CrossEntropyHeuristics)."""
    rows_out = []
    names = ("first_pass_evict", "grad_store", "stream_programs_per_sm")
    variants = [("evict_last", ".cs", 1), ("", "", 1), ("evict_last", "", 1), ("", ".cs", 1), ("evict_last", ".cs", 2)]
    for values in variants:
        heuristics = ce_ops.CrossEntropyHeuristics(**dict(zip(names, values)))
        name = "trainops unchecked " + " ".join(f"{n}={v or '-'}" for n, v in zip(names, values))
        plain = implementations(None)["trainops unchecked"]

        def run(x, t, plain=plain, heuristics=heuristics):
            with trainops.heuristics(heuristics):
                return plain(x, t)
        for rows, classes in CASES:
            rows_out += bench_case(rows, classes, {name: run}, ceiling, log)
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    log = lambda s: print(s, flush=True)  # noqa: E731
    ceiling = copy_ceiling_gbps("cuda")
    log(f"{torch.cuda.get_device_name()}: copy ceiling {ceiling:.0f} GB/s")
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction as liger
    except Exception as e:  # noqa: BLE001
        log(f"liger not available: {e}")
        liger = None
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "copy_ceiling_gbps": round(ceiling, 1), "rows": [], "sweep": []}
    if args.sweep:
        results["sweep"] = sweep(ceiling, log)
    for rows, classes in CASES:
        results["rows"] += bench_case(rows, classes, implementations(liger), ceiling, log)
    log("\nsummary (ms, fwd+bwd):")
    for rows, classes in CASES:
        impls = {r["impl"]: r["ms"] for r in results["rows"] if (r["rows"], r["classes"]) == (rows, classes)}
        ours = impls.get("trainops", float("nan"))
        others = {k: v for k, v in impls.items() if not k.startswith("trainops")}
        best = min(others, key=others.get) if others else None
        log(f"  {rows}x{classes}: trainops {ours:.4f}  " + "  ".join(f"{k} {v:.4f}" for k, v in others.items())
            + (f"  -> {others[best] / ours:.2f}x the best other ({best})" if best else ""))
    out = args.out or os.path.join(os.environ.get("OUT", "."), "cross-entropy-h100.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
