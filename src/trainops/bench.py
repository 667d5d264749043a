"""Benchmarks: every softmax-family op against torch eager, torch.compile and Liger-Kernel.

On a CUDA device: the ../shared/ANCHORS.md shapes, timed with ``triton.testing.do_bench``
(median), each row with ms, GB/s (fewest bytes: inputs read once, output written once) and
% of a device-to-device copy measured in the same run; inputs rotate among several sets when
they would fit in L2; never zeros. Without a GPU: a small CPU comparison and self-check.
JSON goes to benchmarks/results/ (device, versions, date).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

import trainops

# (op, shape, dim, dtype): the ANCHORS shapes, forward and backward, both families.
_ROWS = [(32768, 1024), (16384, 4096), (4096, 32768), (1024, 131072), (128, 262144)]
CASES = (
    [(op, s, -1, torch.bfloat16) for op in ("softmax", "softmax_backward", "log_softmax", "log_softmax_backward")
     for s in _ROWS]
    + [(op, (4096, 32768), -1, torch.float32) for op in ("softmax", "softmax_backward", "log_softmax",
                                                          "log_softmax_backward")]
    + [(op, (32, 512, 4096), 1, dt) for dt in (torch.bfloat16, torch.float32)
       for op in ("softmax", "softmax_backward", "log_softmax", "log_softmax_backward")]
)
QUICK_CASES = [("softmax", (4096, 4096), -1, torch.bfloat16), ("softmax_backward", (4096, 4096), -1, torch.bfloat16),
               ("log_softmax", (32, 512, 1024), 1, torch.float32)]


@dataclass
class Row:
    op: str
    shape: str
    dim: int
    dtype: str
    impl: str
    ms: float
    gbps: float
    pct_of_copy: float
    error: float | None = None


def _inputs(op: str, shape, dim: int, dtype, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, device=device, dtype=torch.float32, generator=gen).mul_(3).to(dtype)
    if not op.endswith("_backward"):
        return (x,)
    y = torch.softmax(x, dim) if op == "softmax_backward" else torch.log_softmax(x, dim)
    dy = torch.randn(shape, device=device, dtype=torch.float32, generator=gen).to(dtype)
    return (dy, y)


def _min_bytes(op: str, shape, dtype) -> int:
    """The fewest bytes the op moves: x read, y written (forward); dy and y read, dx written (backward)."""
    return math.prod(shape) * dtype.itemsize * (3 if op.endswith("_backward") else 2)


def _torch_impl(op: str, dim: int) -> Callable:
    if op == "softmax":
        return lambda x: torch.softmax(x, dim)
    if op == "log_softmax":
        return lambda x: torch.log_softmax(x, dim)
    if op == "softmax_backward":
        return lambda dy, y: torch._softmax_backward_data(dy, y, dim, y.dtype)
    return lambda dy, y: torch._log_softmax_backward_data(dy, y, dim, y.dtype)


def _formula_impl(op: str, dim: int) -> Callable:
    """The op written in plain torch ops (what torch.compile fuses)."""
    if op in ("softmax", "log_softmax"):
        return _torch_impl(op, dim)
    if op == "softmax_backward":
        def f(dy, y):
            yf, dyf = y.float(), dy.float()
            return (yf * (dyf - (yf * dyf).sum(dim, keepdim=True))).to(y.dtype)
        return f

    def g(dy, y):
        dyf = dy.float()
        return (dyf - y.float().exp() * dyf.sum(dim, keepdim=True)).to(y.dtype)
    return g


def _liger_impl(op: str, dim: int, ndim: int) -> Callable | None:
    if op != "softmax" or dim not in (-1, ndim - 1):
        return None
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except Exception:
        return None
    return lambda x: LigerSoftmaxFunction.apply(x)


def implementations(op: str, dim: int, ndim: int, peers: bool) -> dict[str, Callable]:
    impls = {"trainops": lambda *t: getattr(trainops, op)(*t, dim), "torch": _torch_impl(op, dim)}
    if peers:
        impls["torch.compile"] = torch.compile(_formula_impl(op, dim), dynamic=False)
        liger = _liger_impl(op, dim, ndim)
        if liger is not None:
            impls["liger"] = liger
    return impls


def copy_ceiling_gbps(device) -> float:
    """GB/s of a 2 GiB device-to-device copy (bytes read + bytes written)."""
    import triton.testing

    src = torch.randn(256 * 2**20, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 4 / ms / 1e6


def launch_overhead_us(device, calls: int = 2000) -> dict[str, float]:
    """Host time per call for a 64x64 softmax (the launch path, not the kernel)."""
    x = torch.randn(64, 64, device=device)
    out = {}
    for name, fn in {"trainops": lambda: trainops.softmax(x, -1), "torch": lambda: torch.softmax(x, -1)}.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
    return out


def run_gpu(cases, peers: bool, log=print) -> tuple[list[Row], dict]:
    import triton.testing

    device = torch.device("cuda")
    ceiling = copy_ceiling_gbps(device)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    log(f"copy ceiling {ceiling:.0f} GB/s; L2 {l2 / 2**20:.0f} MiB")
    rows: list[Row] = []
    for op, shape, dim, dtype in cases:
        nbytes = _min_bytes(op, shape, dtype)
        sets = [_inputs(op, shape, dim, dtype, device, seed) for seed in range(1 if nbytes > 4 * l2 else 4)]
        ref = _formula_impl(op, dim)(*[t.double() for t in sets[0]])
        for name, fn in implementations(op, dim, len(shape), peers).items():
            try:
                out = fn(*sets[0])
                err = ((out.double() - ref).norm() / ref.norm()).item()
                counter = iter(range(10**9))
                ms = triton.testing.do_bench(lambda: fn(*sets[next(counter) % len(sets)]), warmup=25, rep=200,
                                             return_mode="median")
            except Exception as e:  # a peer that fails on a shape is reported, not fatal
                log(f"  {name} failed on {op} {shape}: {type(e).__name__}: {str(e)[:120]}")
                continue
            gbps = nbytes / ms / 1e6
            rows.append(Row(op, "x".join(map(str, shape)), dim, str(dtype).replace("torch.", ""), name,
                            round(ms, 4), round(gbps, 1), round(100 * gbps / ceiling, 1), err))
            log(f"  {op:22s} {rows[-1].shape:>12s} dim={dim} {rows[-1].dtype:8s} {name:14s} "
                f"{ms:8.4f} ms {gbps:7.0f} GB/s {100 * gbps / ceiling:5.1f}%  err {err:.1e}")
    meta = {"copy_ceiling_gbps": round(ceiling, 1), "launch_overhead_us_64x64": launch_overhead_us(device)}
    return rows, meta


def run_cpu(log=print) -> tuple[list[Row], dict]:
    """Without a GPU: the CPU path against torch on small shapes, with a correctness check."""
    rows = []
    for op, shape, dim, dtype in [("softmax", (256, 1024), -1, torch.float32),
                                  ("log_softmax", (64, 256, 64), 1, torch.float32),
                                  ("softmax_backward", (256, 1024), -1, torch.float32)]:
        inputs = _inputs(op, shape, dim, dtype, "cpu", 0)
        ref = _formula_impl(op, dim)(*[t.double() for t in inputs])
        for name, fn in implementations(op, dim, len(shape), peers=False).items():
            out = fn(*inputs)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            if err > 1e-5:
                raise AssertionError(f"{name} {op}: relative error {err:.2e}")
            t0, reps = time.perf_counter(), 20
            for _ in range(reps):
                fn(*inputs)
            ms = (time.perf_counter() - t0) / reps * 1e3
            rows.append(Row(op, "x".join(map(str, shape)), dim, "float32", name, round(ms, 4),
                            round(_min_bytes(op, shape, dtype) / ms / 1e6, 1), float("nan"), err))
            log(f"  {op:22s} {rows[-1].shape:>12s} {name:9s} {ms:8.3f} ms  err {err:.1e}")
    return rows, {}


def environment() -> dict:
    import triton
    env = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version(), "trainops": trainops.__version__}
    env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor()})"
    from importlib.metadata import PackageNotFoundError, version
    try:
        env["liger_kernel"] = version("liger_kernel")
    except PackageNotFoundError:
        env["liger_kernel"] = None
    return env


def main(quick: bool = False, ops: str = "all", out: str | None = None, peers: bool = True) -> int:
    env = environment()
    print(f"trainops bench on {env['device']} (torch {env['torch']}, triton {env['triton']})")
    if torch.cuda.is_available():
        cases = QUICK_CASES if quick else CASES
        if ops != "all":
            cases = [c for c in cases if c[0] in ops.split(",")]
        rows, meta = run_gpu(cases, peers=peers and not quick)
    else:
        print("no CUDA device: CPU path against torch on small shapes (timings are CPU timings)")
        rows, meta = run_cpu()
    _print_summary(rows)
    if out is None:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        tag = "cuda" if torch.cuda.is_available() else "cpu"
        out = os.path.join("benchmarks", "results", f"softmax-{tag}-{stamp}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"environment": env, **meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"wrote {out}")
    return 0


def _print_summary(rows: list[Row]) -> None:
    """One line per case: trainops ms, GB/s, % of copy, and its speed-up over the best other."""
    cases: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        cases.setdefault((r.op, r.shape, r.dim, r.dtype), {})[r.impl] = r
    print(f"\n{'op':22s} {'shape':>12s} {'dim':>3s} {'dtype':8s} {'trainops ms':>11s} {'GB/s':>6s} {'%copy':>6s} "
          f"{'best other':>20s} {'speed-up':>8s}")
    for (op, shape, dim, dtype), impls in cases.items():
        ours = impls.get("trainops")
        others = [r for k, r in impls.items() if k != "trainops"]
        if ours is None:
            continue
        best = min(others, key=lambda r: r.ms) if others else None
        best_s = f"{best.impl} {best.ms:.4f}" if best else "-"
        speed = f"{best.ms / ours.ms:.2f}x" if best else "-"
        print(f"{op:22s} {shape:>12s} {dim:3d} {dtype:8s} {ours.ms:11.4f} {ours.gbps:6.0f} {ours.pct_of_copy:6.1f} "
              f"{best_s:>20s} {speed:>8s}")
