"""``python -m trainops bench``: every registered GPU kernel family against torch and the peers.

On a CUDA device: the ../shared/ANCHORS.md shapes of softmax / log-softmax and their backward,
embedding forward and backward (GatherGrad), fused cross-entropy, the AdamW / SGD / LAMB steps
and the multi-tensor finite check, unscale, gradient norm, accumulation and zeroing (see
``trainops.bench.cases``), each against torch eager, torch.compile, and Liger-Kernel and quack
when they are installed. Timed with ``triton.testing.do_bench`` (median); each row carries ms,
GB/s (fewest bytes), % of a large (2 GiB) device-to-device copy measured in the same run, and % of
a copy that moves the case's own bytes (smaller problems do not reach the large copy's rate:
launch and tail costs weigh more); every output is first compared with a float64 reference where
the case has one. Writes JSON to benchmarks/results/ and a bar chart of % of the copy ceiling
(PNG, when matplotlib is installed).

Without a GPU it says so and runs the CPU path against torch on small shapes instead.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import platform
import time
from dataclasses import asdict, dataclass

import torch

import trainops


@dataclass
class Row:
    op: str
    case: str
    impl: str
    ms: float
    gbps: float
    pct_of_copy: float | None
    error: float | None
    pct_of_same_copy: float | None = None  # copy moving this case's bytes: its time / ours, in %


def copy_ceiling_gbps(device) -> float:
    """GB/s of a 2 GiB device-to-device copy (bytes read + bytes written)."""
    import triton.testing

    src = torch.randn(256 * 2**20, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * 256 * 2**20 * 4 / ms / 1e6


def same_bytes_copy_ms(nbytes: int, device) -> float:
    """Median ms of a device-to-device copy moving ``nbytes`` in all (half read, half written)."""
    import triton.testing

    src = torch.randint(0, 256, (max(1, nbytes // 2),), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    torch.cuda.empty_cache()
    return ms


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


def _relative_error(out, reference) -> float | None:
    if reference is None or not isinstance(out, torch.Tensor):
        return None
    diff = (out.detach().double() - reference).norm().item()
    return diff / max(reference.norm().item(), 1e-300)


def _time_cpu(fn, reps: int = 10) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def run_cases(cases, *, peers: bool, ceiling: float | None, log=print) -> list[Row]:
    """Build each case, check each implementation against the reference, time it, free it."""
    import triton.testing

    rows: list[Row] = []
    for case in cases:
        copy_ms = None if ceiling is None else same_bytes_copy_ms(case.nbytes, "cuda")
        impls, reference = case.build(peers)
        ref = reference() if reference is not None else None
        for name, factory in impls.items():
            try:
                call = factory()
                error = _relative_error(call(), ref)
                if ceiling is None:
                    ms = _time_cpu(call)
                else:
                    ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
            except Exception as e:  # a peer that fails on a shape is reported, not fatal
                log(f"  {case.op} {case.label}: {name} failed: {type(e).__name__}: {str(e)[:160]}")
                if name == "trainops":
                    raise
                continue
            finally:
                call = None
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            gbps = case.nbytes / ms / 1e6
            pct = None if ceiling is None else round(100 * gbps / ceiling, 1)
            same = None if copy_ms is None else round(100 * copy_ms / ms, 1)
            rows.append(Row(case.op, case.label, name, round(ms, 4), round(gbps, 1), pct, error, same))
            err = "-" if error is None else f"{error:.1e}"
            log(f"  {case.op:20s} {case.label:40s} {name:28s} {ms:9.4f} ms {gbps:7.0f} GB/s"
                + (f" {pct:5.1f}% ({same:5.1f}% of same-size copy)" if pct is not None else "") + f"  err {err}")
        del impls, ref
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def summary_table(rows: list[Row]) -> list[str]:
    """One line per case: trainops ms, GB/s, % of the large copy and of a same-size copy, the best
    non-trainops implementation, speed-up
    (other trainops kernels of the op, e.g. the atomic gradient, are rows of their own, not rivals)."""
    cases: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        cases.setdefault((r.op, r.case), {})[r.impl] = r
    lines = [f"{'op':20s} {'case':40s} {'trainops ms':>11s} {'GB/s':>6s} {'%copy':>6s} {'%same':>6s} "
             f"{'best other':>34s} {'speed-up':>8s}"]
    for (op, case), impls in cases.items():
        ours = impls.get("trainops")
        if ours is None:
            continue
        others = [r for k, r in impls.items() if not k.startswith("trainops")]
        best = min(others, key=lambda r: r.ms) if others else None
        best_s = f"{best.impl} {best.ms:.4f}" if best else "-"
        speed = f"{best.ms / ours.ms:.2f}x" if best else "-"
        pct = f"{ours.pct_of_copy:6.1f}" if ours.pct_of_copy is not None else "     -"
        same = f"{ours.pct_of_same_copy:6.1f}" if ours.pct_of_same_copy is not None else "     -"
        lines.append(f"{op:20s} {case:40s} {ours.ms:11.4f} {ours.gbps:6.0f} {pct} {same} {best_s:>34s} {speed:>8s}")
    return lines


def bar_chart(rows: list[Row], path: str, title: str) -> str:
    """Grouped bars: % of the copy ceiling by case and implementation."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    rows = [r for r in rows if r.pct_of_copy is not None]
    cases = list(dict.fromkeys((r.op, r.case) for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    value = {(r.op, r.case, r.impl): r.pct_of_copy for r in rows}
    height = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.42 * len(cases)))
    for j, impl in enumerate(impls):
        ys = [i + j * height for i, c in enumerate(cases) if (*c, impl) in value]
        xs = [value[(*c, impl)] for c in cases if (*c, impl) in value]
        ax.barh(ys, xs, height, label=impl, color=plt.cm.tab20(j % 20))
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))])
    ax.set_yticklabels([f"{op}  {case}" for op, case in cases], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(100, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("% of device-to-device copy bandwidth (fewest bytes / time)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return f"wrote {path}"


def environment() -> dict:
    import triton
    env = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version(), "trainops": trainops.__version__}
    env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor()})"
    from importlib.metadata import PackageNotFoundError, version
    for package in ("liger_kernel", "quack-kernels"):
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = None
    return env


def main(quick: bool = False, ops: str = "all", out: str | None = None, peers: bool = True) -> int:
    from .cases import cpu_cases, gpu_cases

    env = environment()
    print(f"trainops bench on {env['device']} (torch {env['torch']}, triton {env['triton']}, "
          f"liger {env['liger_kernel'] or 'not installed'})")
    meta: dict = {}
    if torch.cuda.is_available():
        cases = gpu_cases(quick)
        ceiling = copy_ceiling_gbps("cuda")
        meta = {"copy_ceiling_gbps": round(ceiling, 1)}
        print(f"copy ceiling {ceiling:.0f} GB/s")
    else:
        print("no CUDA device: the CPU path against torch on small shapes (CPU timings, no % of copy)")
        cases, ceiling = cpu_cases(), None
    if ops != "all":
        cases = [c for c in cases if c.op in ops.split(",")]
    rows = run_cases(cases, peers=peers and not quick and ceiling is not None, ceiling=ceiling)
    if torch.cuda.is_available():
        meta["launch_overhead_us_64x64_softmax"] = launch_overhead_us("cuda")
    print()
    print("\n".join(summary_table(rows)))
    tag = "cuda" if torch.cuda.is_available() else "cpu"
    if out is None:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = os.path.join("benchmarks", "results", f"bench-{tag}-{stamp}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"environment": env, **meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"wrote {out}")
    if ceiling is not None:
        print(bar_chart(rows, os.path.splitext(out)[0] + ".png",
                        f"trainops bench, {env['device']}, {env['date'][:10]} (copy ceiling {ceiling:.0f} GB/s)"))
    return 0


__all__ = ["Row", "bar_chart", "copy_ceiling_gbps", "launch_overhead_us", "main", "run_cases", "same_bytes_copy_ms",
           "summary_table"]
