"""``python -m trainops bench``, and the one runner behind every benchmark script of ``benchmarks/``.

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

The per-family scripts (``benchmarks/bench_cross_entropy.py``, ``bench_gather.py``,
``bench_optim.py``, ``sweep_softmax.py``) are front-ends to the same runner: they choose case
lists from ``trainops.bench.cases`` and call :func:`run_cases`. What a case may ask of the runner
beyond ``Case(op, label, nbytes, build)``:

- ``Case.timing``: :class:`Timing` (``do_bench`` warm-up / repetition ms, or CUDA events around a
  fixed number of back-to-back calls for launch-bound cases);
- ``Case.fields``: extra keys of every row of the case (``stream``, ``classes``...); ``build`` may
  return a third element, a dict of fields known only once the inputs exist
  (``hottest_row_count``);
- ``Case.tolerance``: the largest relative error a trainops implementation may have (exceeding it
  stops the run; a peer that exceeds it is reported and left out);
- an implementation may be an :class:`Impl` instead of a bare factory: its own byte count, extra
  row fields (``config``, ``default``), and a context entered around its check and its timing (a
  heuristics object through ``trainops.heuristics``, torch's deterministic mode);
- :func:`rotate` and :func:`rotation_sets`: inputs that fit in L2 rotate among 4 sets.

Timing seam: :func:`run_cases` takes ``timer(call, timing) -> ms``; by default CUDA timing when a
copy ceiling is given, else :func:`time_cpu` (the CPU path, used by the CPU tests).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

import trainops

from .case import DEFAULT_TIMING, Impl, Timing, deterministic_algorithms, rotate, rotation_sets


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
    fields: dict = field(default_factory=dict)  # the case's and the implementation's extra keys

    def as_dict(self) -> dict:
        """The JSON row: the fixed keys, then ``fields`` flattened into it."""
        out = asdict(self)
        fields = out.pop("fields")
        return {**out, **fields}


class CheckFailed(AssertionError):
    """An implementation's output is further from the reference than its case's tolerance."""


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


def l2_cache_bytes(device="cuda") -> int:
    """The CUDA device's L2 cache size in bytes (50 MiB, the H100's, where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)


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
    """||out - reference|| / ||reference||; for tuples of outputs (an output and its gradients) the
    largest over the pairs."""
    if reference is None:
        return None
    if isinstance(out, (tuple, list)) and isinstance(reference, (tuple, list)) and len(out) == len(reference):
        errors = [_relative_error(o, r) for o, r in zip(out, reference)]
        return None if None in errors else max(errors)
    if not isinstance(out, torch.Tensor):
        return None
    diff = (out.detach().double() - reference).norm().item()
    return diff / max(reference.norm().item(), 1e-300)


def _time_cpu(fn, reps: int = 10) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def time_cpu(call, timing: Timing = DEFAULT_TIMING) -> float:
    """Mean host ms of 10 calls after one (the CPU path; ``timing`` is for the GPU and ignored)."""
    return _time_cpu(call)


def time_events(call, warmup: int, calls: int) -> float:
    """ms per call: ``warmup`` calls, then CUDA events around ``calls`` back-to-back calls."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def time_gpu(call, timing: Timing = DEFAULT_TIMING) -> float:
    """ms of one call on the GPU, as ``timing`` says."""
    if timing.method == "events":
        return time_events(call, timing.warmup, timing.rep)
    import triton.testing
    return triton.testing.do_bench(call, warmup=timing.warmup, rep=timing.rep, return_mode="median")


def kernel_ms(fn, steps: int = 20, windows: int = 1, warmup: int = 1) -> float:
    """ms of one call on the GPU: the durations of the kernels and copies it launched, summed, per
    call, over ``steps`` calls under torch.profiler (launch gaps and ``record_function`` ranges left
    out); the median of ``windows`` such profiles, after ``warmup`` unprofiled calls (compiles,
    caches). GPU time alone: what a call costs where the host keeps ahead of the GPU."""
    import statistics

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
        total_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                       and not getattr(e, "is_user_annotation", False))
        times.append(total_us / 1e3 / steps)
    return statistics.median(times)


def _free_device_memory() -> None:
    """Collect what an implementation left (cycles included) and return it to the device, so the
    next one starts from the same memory. Only with CUDA: on the CPU path refcounting frees the
    small cases' tensors, and a full collection (~0.1 s) would take most of a CPU run's time."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def run_cases(cases, *, peers: bool, ceiling: float | None, log=print,
              timer: Callable[[Callable, Timing], float] | None = None, same_copy: bool = True,
              failed: list | None = None, kernel_timer: Callable[[Callable, Timing], dict] | None = None
              ) -> list[Row]:
    """Build each case, check each implementation against the reference, time it, free it.

    ``ceiling``: the large copy's GB/s (None: the CPU path, no % of copy, CPU timing). ``timer``:
    ``timer(call, timing) -> ms`` (default time_gpu with a ceiling, else time_cpu). ``same_copy``:
    also time a copy of each case's bytes (GPU only; rows whose implementation has bytes of its
    own get None there). A failing implementation is reported and left out, but "trainops"
    itself, and a trainops implementation outside its case's tolerance, stop the run. ``failed``:
    a list that receives ``(op, label, impl, "ExceptionType: message")`` for each implementation
    left out (the sweep records its failed peers from it). ``kernel_timer``: ``kernel_timer(call,
    timing) -> dict`` of extra row fields, called after ``timer`` in the implementation's context
    (the sweep's GPU kernel time: ``kernel_ms``, ``kernel_method``, ``kernel_reason``); it reports
    its own failures in those fields rather than raising.
    """
    timer = timer or (time_cpu if ceiling is None else time_gpu)
    rows: list[Row] = []
    for case in cases:
        copy_ms = None if ceiling is None or not same_copy else same_bytes_copy_ms(case.nbytes, "cuda")
        built = case.build(peers)
        impls, reference = built[0], built[1]
        case_fields = {**getattr(case, "fields", {}), **(built[2] if len(built) > 2 else {})}
        tolerance = getattr(case, "tolerance", None)
        timing = getattr(case, "timing", DEFAULT_TIMING)
        ref = reference() if reference is not None else None
        for name, impl in impls.items():
            impl = impl if isinstance(impl, Impl) else Impl(impl)
            fields = {**case_fields, **impl.fields}
            clash = set(fields) & set(Row.__dataclass_fields__)
            if clash:
                raise ValueError(f"case {case.op} {case.label}: row fields {sorted(clash)} clash with Row's keys")
            call = None
            try:
                with impl.context() if impl.context is not None else contextlib.nullcontext():
                    call = impl.factory()
                    error = _relative_error(call(), ref)
                    if tolerance is not None and error is not None and not error <= tolerance:
                        raise CheckFailed(f"relative error {error:.2e} > tolerance {tolerance:.1e}")
                    ms = timer(call, timing)
                    if kernel_timer is not None:
                        fields = {**fields, **kernel_timer(call, timing)}
            except Exception as e:  # a peer that fails on a shape is reported, not fatal
                log(f"  {case.op} {case.label}: {name} failed: {type(e).__name__}: {str(e)[:160]}")
                if failed is not None:
                    failed.append((case.op, case.label, name, f"{type(e).__name__}: {str(e)[:160]}"))
                if name == "trainops" or (isinstance(e, CheckFailed) and name.startswith("trainops")):
                    raise
                continue
            finally:
                call = None
                _free_device_memory()
            nbytes = case.nbytes if impl.nbytes is None else impl.nbytes
            gbps = nbytes / ms / 1e6
            pct = None if ceiling is None else round(100 * gbps / ceiling, 1)
            same = None if copy_ms is None or nbytes != case.nbytes else round(100 * copy_ms / ms, 1)
            rows.append(Row(case.op, case.label, name, round(ms, 4), round(gbps, 1), pct, error, same, fields))
            err = "-" if error is None else f"{error:.1e}"
            log(f"  {case.op:20s} {case.label:40s} {name:28s} {ms:9.4f} ms {gbps:7.0f} GB/s"
                + (f" {pct:5.1f}%" if pct is not None else "")
                + (f" ({same:5.1f}% of same-size copy)" if same is not None else "") + f"  err {err}"
                + (f"  kernel {fields['kernel_ms']:.4f} ms ({fields.get('kernel_method')})"
                   if fields.get("kernel_ms") is not None else ""))
        del impls, ref, built
        _free_device_memory()
    return rows


def summary_table(rows: list[Row]) -> list[str]:
    """One line per case: trainops ms, GB/s, % of the large copy and of a same-size copy, the best
    non-trainops implementation, speed-up
    (other trainops kernels of the op, e.g. the atomic gradient, are rows of their own, not rivals;
    a case without a row named "trainops" is shown by its first trainops implementation)."""
    cases: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        cases.setdefault((r.op, r.case), {})[r.impl] = r
    lines = [f"{'op':20s} {'case':40s} {'trainops ms':>11s} {'GB/s':>6s} {'%copy':>6s} {'%same':>6s} "
             f"{'best other':>34s} {'speed-up':>8s}"]
    for (op, case), impls in cases.items():
        ours = impls.get("trainops") or next((r for k, r in impls.items() if k.startswith("trainops")), None)
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


def sweep_table(rows: list[Row]) -> list[str]:
    """One line per case of a sweep: the default variant (the row whose ``default`` field is
    true), the fastest variant, and default ms / fastest ms."""
    cases: dict[tuple, list[Row]] = {}
    for r in rows:
        cases.setdefault((r.op, r.case), []).append(r)
    lines = [f"{'op':20s} {'case':40s} {'default ms':>10s} {'best ms':>9s} {'gain':>6s}  best variant"]
    for (op, case), variants in cases.items():
        best = min(variants, key=lambda r: r.ms)
        default = next((r for r in variants if r.fields.get("default")), None)
        d_ms = f"{default.ms:10.4f}" if default else f"{'-':>10s}"
        gain = f"{default.ms / best.ms:5.2f}x" if default else f"{'-':>6s}"
        lines.append(f"{op:20s} {case:40s} {d_ms} {best.ms:9.4f} {gain}  {best.impl}")
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
    for package in ("liger_kernel", "quack-kernels", "transformers"):
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = None
    return env


def start(cpu: bool, log=print) -> tuple[dict, float | None]:
    """A front-end's first step: the environment, and the copy ceiling in GB/s (measured on the
    GPU; None with ``cpu``, the CPU path). Logs one line saying which."""
    env = environment()
    if cpu:
        log(f"{env['device']}: the CPU path on tiny shapes (CPU timings, no % of copy: a self-check, "
            "not a benchmark)")
        return env, None
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device (--cpu runs the CPU path on tiny shapes)")
    ceiling = copy_ceiling_gbps("cuda")
    log(f"{env['device']}: copy ceiling {ceiling:.0f} GB/s (torch {env['torch']}, triton {env['triton']}, "
        f"liger {env['liger_kernel'] or 'not installed'}, quack {env['quack-kernels'] or 'not installed'})")
    return env, ceiling


def write_results(path: str, env: dict, meta: dict | None = None, **sections: list[Row]) -> str:
    """JSON: {"environment": env, **meta, section: [row dicts], ...}; returns the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": env, **(meta or {}),
                   **{name: [r.as_dict() for r in rows] for name, rows in sections.items()}}, f, indent=1)
    return path


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
    write_results(out, env, meta, rows=rows)
    print(f"wrote {out}")
    if ceiling is not None:
        print(bar_chart(rows, os.path.splitext(out)[0] + ".png",
                        f"trainops bench, {env['device']}, {env['date'][:10]} (copy ceiling {ceiling:.0f} GB/s)"))
    return 0


__all__ = ["CheckFailed", "DEFAULT_TIMING", "Impl", "Row", "Timing", "bar_chart", "copy_ceiling_gbps", "kernel_ms",
           "deterministic_algorithms", "environment", "l2_cache_bytes", "launch_overhead_us", "main", "rotate",
           "rotation_sets", "run_cases", "same_bytes_copy_ms", "start", "summary_table", "sweep_table", "time_cpu",
           "time_events", "time_gpu", "write_results"]
