"""``python -m trainops bench --sweep``: trainops against the better of torch eager and
torch.compile on the shapes users run, not only the tuned ones (issue 20).

Families: ``softmax`` (forward), ``softmax_backward``, ``cross_entropy`` (forward + backward of a
training loss), ``rms_norm`` (forward + backward, float32 weight) and ``swiglu`` (forward +
backward). Each gets ``shapes`` problems drawn by a generator seeded by (seed, family), so a run
is repeatable: a row length from ``ROW_LENGTHS`` (1 to 1M, odd and prime lengths, real vocabulary
sizes; at most 65536 for the hidden sizes of rms_norm and swiglu, at least 2 classes for
cross_entropy, at least 2 elements for rms_norm: over one element its dx is the eps term alone, a
cancellation no float32 backward resolves to a relative tolerance, torch's F.rms_norm 9 % off
float64 there, trainops 6 %, the unit tests bounding it absolutely), a row count from
``ROW_COUNTS`` (1 to 65536), at most ``max_elements`` elements,
a dtype (bfloat16 twice as often as float16 or float32), and for the softmax families a quarter
of the problems reduce a middle axis ((outer, length, inner), dim=1). Duplicates are drawn again.

Each problem: trainops, torch eager and torch.compile of the same eager code (one compiled
function per family, compiled as a user would: automatic dynamic shapes; Dynamo's recompile
limits are raised for the sweep, so no shape silently falls back to eager), every output first
compared with a float64 reference (the output and, for the training calls, every gradient; trainops
outside the dtype's tolerance stops the run), then timed once (``triton.testing.do_bench``
median, shorter warm-up and repetition than the main bench: ``SWEEP_TIMING``; a few-microsecond
call is noisy). The weights are in the input's dtype for every implementation. Rows carry ms, GB/s of the fewest bytes, % of the copy ceiling and the fields
``family``, ``row_length``, ``rows``, ``dtype``, ``dim``; ``summarise`` adds per family the
geometric mean of best-of-torch ms / trainops ms, the worst shape, how many shapes trainops is
slower on, and the median % of the copy ceiling of odd and of even row lengths (shapes of at least
``LARGE_BYTES``, where the copy ceiling means something). ``chart`` draws that speed ratio
against row length, one panel per family.

``seconds``: no new problem starts after that much time (the run says how many ran). Without a
GPU (``cpu=True``) the same code runs the CPU path on a few small shapes, eager only: a
self-check of the harness, not a benchmark.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch
import torch.nn.functional as F

import trainops

from .case import Case, Timing, _dt, _randn

FAMILIES = ("softmax", "softmax_backward", "cross_entropy", "rms_norm", "swiglu")
ROW_LENGTHS = (1, 2, 3, 5, 8, 17, 31, 64, 100, 127, 128, 255, 384, 509, 512, 768, 1000, 1023, 1024, 1536, 2047,
               2048, 3000, 3072, 4096, 4099, 5120, 6144, 8191, 8192, 11008, 12289, 14336, 16384, 24576, 32000, 32001,
               32768, 50257, 65536, 65537, 100003, 128256, 131072, 151936, 256000, 262144, 524287, 1048576)
ROW_COUNTS = (1, 2, 7, 32, 64, 100, 255, 512, 1000, 2048, 4097, 8192, 16384, 32768, 65536)
DTYPES = (torch.bfloat16, torch.bfloat16, torch.float16, torch.float32)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float64: 1e-10}
SWEEP_TIMING = Timing(warmup=10, rep=60)
LARGE_BYTES = 64 << 20   # shapes moving at least this much are judged against the copy ceiling


def problems(family: str, count: int, seed: int = 0, max_elements: int = 1 << 26) -> list[dict]:
    """``count`` problems of ``family`` (see the module docstring): dicts of shape, dim, dtype,
    row_length, rows."""
    rng = random.Random(f"{seed}:{family}")
    lengths = [n for n in ROW_LENGTHS if (n <= 65536 if family in ("rms_norm", "swiglu") else True)
               and (n >= 2 if family in ("cross_entropy", "rms_norm") else True)]
    seen, out = set(), []
    for _ in range(100 * count):
        if len(out) == count:
            break
        length = rng.choice(lengths)
        rows = rng.choice([r for r in ROW_COUNTS if r * length <= max_elements] or [1])
        dtype = rng.choice(DTYPES)
        dim = -1
        shape = (rows, length)
        if family.startswith("softmax") and rng.random() < 0.25 and length <= 8192:
            inner = rng.choice((8, 64, 512))
            shape, dim = (max(1, rows // inner), length, inner), 1
        if math.prod(shape) > max_elements or (shape, dim, dtype) in seen:
            continue
        seen.add((shape, dim, dtype))
        out.append(dict(shape=shape, dim=dim, dtype=dtype, row_length=length, rows=math.prod(shape) // length))
    return out


_COMPILED: dict = {}


def _compiled(family: str, fn):
    """One torch.compile of ``fn`` per family, shared by the family's problems."""
    if family not in _COMPILED:
        _COMPILED[family] = torch.compile(fn)
    return _COMPILED[family]


def _torch_softmax(x, dim):
    return torch.softmax(x, dim)


def _torch_softmax_backward(dy, y, dim):
    return torch._softmax_backward_data(dy, y, dim, y.dtype)


def _torch_cross_entropy(x, t):
    return F.cross_entropy(x, t)


def _torch_rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def _torch_swiglu(gate, up):
    return F.silu(gate) * up


def _backward_step(fn, inputs, leaves, dy):
    """A call that runs ``fn(*inputs)`` and its backward (of ``dy``, or of the scalar loss) and
    returns (the output, every leaf's gradient): all of them are checked."""
    def run():
        for t in leaves:
            t.grad = None
        out = fn(*inputs)
        out.backward() if dy is None else out.backward(dy)
        return (out.detach(), *(t.grad for t in leaves))
    return run


def sweep_case(family: str, problem: dict, device, compiled: bool) -> Case:
    """The Case of one problem: trainops, torch and (with ``compiled``) torch.compile."""
    shape, dim, dtype = problem["shape"], problem["dim"], problem["dtype"]
    numel = math.prod(shape)
    tensors = {"softmax": 2, "softmax_backward": 3, "cross_entropy": 2, "rms_norm": 5, "swiglu": 8}[family]

    def build(peers):
        if family == "softmax":
            x = _randn(shape, dtype, device, 0, 3.0)
            impls = {"trainops": lambda: (lambda: trainops.softmax(x, dim)),
                     "torch": lambda: (lambda: _torch_softmax(x, dim))}
            if compiled:
                impls["torch.compile"] = lambda: (lambda: _compiled(family, _torch_softmax)(x, dim))
            return impls, lambda: torch.softmax(x.double(), dim)
        if family == "softmax_backward":
            y = torch.softmax(_randn(shape, dtype, device, 0, 3.0), dim)
            dy = _randn(shape, dtype, device, 1)
            impls = {"trainops": lambda: (lambda: trainops.softmax_backward(dy, y, dim)),
                     "torch": lambda: (lambda: _torch_softmax_backward(dy, y, dim))}
            if compiled:
                impls["torch.compile"] = lambda: (lambda: _compiled(family, _torch_softmax_backward)(dy, y, dim))

            def reference():
                yd, dyd = y.double(), dy.double()
                return yd * (dyd - (yd * dyd).sum(dim, keepdim=True))
            return impls, reference
        if family == "cross_entropy":
            x = _randn(shape, dtype, device, 0, 2.0).requires_grad_()
            t = torch.randint(0, shape[-1], shape[:-1], device=device)
            impls = {"trainops": lambda: _backward_step(trainops.cross_entropy, (x, t), [x], None),
                     "torch": lambda: _backward_step(_torch_cross_entropy, (x, t), [x], None)}
            if compiled:
                impls["torch.compile"] = lambda: _backward_step(_compiled(family, _torch_cross_entropy), (x, t), [x],
                                                                None)

            def reference():
                xd = x.detach().double().requires_grad_()
                loss = F.cross_entropy(xd, t)
                loss.backward()
                return loss.detach(), xd.grad
            return impls, reference
        if family == "rms_norm":
            x = _randn(shape, dtype, device, 30, 2.0).requires_grad_()
            w = (_randn(shape[-1:], torch.float32, device, 32, 0.1) + 1.0).to(dtype).requires_grad_()
            dy = _randn(shape, dtype, device, 34)
            impls = {"trainops": lambda: _backward_step(lambda x, w: trainops.rms_norm(x, w, 1e-6), (x, w), [x, w], dy),
                     "torch": lambda: _backward_step(_torch_rms_norm, (x, w), [x, w], dy)}
            if compiled:
                impls["torch.compile"] = lambda: _backward_step(_compiled(family, _torch_rms_norm), (x, w), [x, w], dy)

            def reference():
                xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
                y = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6) * wd
                y.backward(dy.double())
                return y.detach(), xd.grad, wd.grad
            return impls, reference
        gate = _randn(shape, dtype, device, 40, 2.0).requires_grad_()
        up = _randn(shape, dtype, device, 41).requires_grad_()
        dy = _randn(shape, dtype, device, 42)
        impls = {"trainops": lambda: _backward_step(trainops.swiglu, (gate, up), [gate, up], dy),
                 "torch": lambda: _backward_step(_torch_swiglu, (gate, up), [gate, up], dy)}
        if compiled:
            impls["torch.compile"] = lambda: _backward_step(_compiled(family, _torch_swiglu), (gate, up), [gate, up],
                                                            dy)

        def reference():
            g, u = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
            y = F.silu(g) * u
            y.backward(dy.double())
            return y.detach(), g.grad, u.grad
        return impls, reference

    label = "x".join(map(str, shape)) + (f" dim={dim}" if dim != -1 else "") + f" {_dt(dtype)}"
    fields = {"family": family, "row_length": problem["row_length"], "rows": problem["rows"], "dtype": _dt(dtype),
              "dim": dim}
    nbytes = numel * dtype.itemsize * tensors + (8 * problem["rows"] if family == "cross_entropy" else 0)  # targets
    return Case(family, label, nbytes, build, fields, SWEEP_TIMING, TOLERANCE[dtype])


def summarise(rows) -> dict:
    """Per family: problems, geometric mean and minimum of best-of-torch ms / trainops ms (and the
    worst shape), shapes where trainops is slower, and the median % of the copy ceiling of odd and
    even row lengths among shapes of at least LARGE_BYTES (bytes / GB/s gives the bytes back)."""
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r.op, r.case), {})[r.impl] = r
    out = {}
    for (family, case), impls in by_case.items():
        ours = impls.get("trainops")
        others = [r for k, r in impls.items() if k != "trainops"]
        if ours is None or not others:
            continue
        best = min(others, key=lambda r: r.ms)
        s = out.setdefault(family, {"problems": 0, "log_ratio_sum": 0.0, "worst": None, "slower": 0,
                                    "odd_pct": [], "even_pct": []})
        ratio = best.ms / ours.ms
        s["problems"] += 1
        s["log_ratio_sum"] += math.log(ratio)
        if s["worst"] is None or ratio < s["worst"][0]:
            s["worst"] = (round(ratio, 3), case, best.impl)
        s["slower"] += ratio < 1.0
        nbytes = ours.gbps * 1e6 * ours.ms
        if ours.pct_of_copy is not None and nbytes >= LARGE_BYTES:
            s["odd_pct" if ours.fields["row_length"] % 2 else "even_pct"].append(ours.pct_of_copy)
    for s in out.values():
        s["geomean_speedup"] = round(math.exp(s.pop("log_ratio_sum") / s["problems"]), 3)
        for key in ("odd_pct", "even_pct"):
            values = s.pop(key)
            s[f"median_pct_of_copy_{key[:-4]}_rows"] = round(statistics.median(values), 1) if values else None
    return out


def summary_lines(summary: dict) -> list[str]:
    lines = [f"{'family':18s} {'shapes':>6s} {'geomean':>8s} {'slower':>6s} {'odd %copy':>9s} {'even %copy':>10s}  "
             "worst (ratio, shape, fastest torch)"]
    for family, s in summary.items():
        odd, even = s["median_pct_of_copy_odd_rows"], s["median_pct_of_copy_even_rows"]
        lines.append(f"{family:18s} {s['problems']:6d} {s['geomean_speedup']:7.2f}x {s['slower']:6d} "
                     f"{'-' if odd is None else f'{odd:.1f}':>9s} {'-' if even is None else f'{even:.1f}':>10s}  "
                     f"{s['worst']}")
    return lines


def chart(rows, path: str, title: str) -> str:
    """Best-of-torch ms / trainops ms against row length, one panel per family, colour by dtype."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r.op, r.case), {})[r.impl] = r
    families = list(dict.fromkeys(op for op, _ in by_case))
    fig, axes = plt.subplots(len(families), 1, figsize=(8, 2.6 * len(families)), squeeze=False)
    colours = {_dt(torch.bfloat16): "tab:blue", _dt(torch.float16): "tab:orange", _dt(torch.float32): "tab:green"}
    for ax, family in zip(axes[:, 0], families):
        for (op, _), impls in by_case.items():
            ours = impls.get("trainops")
            others = [r for k, r in impls.items() if k != "trainops"]
            if op != family or ours is None or not others:
                continue
            best = min(r.ms for r in others)
            ax.scatter(ours.fields["row_length"], best / ours.ms, s=10, c=colours.get(ours.fields["dtype"], "grey"),
                       marker="o" if ours.fields["dim"] == -1 else "^")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log", base=2)
        ax.set_ylabel("best torch / trainops")
        ax.set_title(family, fontsize=9)
    axes[-1, 0].set_xlabel("row length (reduced axis; hidden size for rms_norm and swiglu)")
    handles = [plt.Line2D([], [], ls="", marker="o", color=c, label=d) for d, c in colours.items()]
    handles.append(plt.Line2D([], [], ls="", marker="^", color="black", label="middle axis"))
    axes[0, 0].legend(handles=handles, fontsize=7, loc="best")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def load_rows(path: str) -> list:
    """The rows of a sweep's JSON file (write_results's), as the runner's Row objects (for chart)."""
    import json

    from . import Row

    with open(path) as f:
        saved = json.load(f)
    fixed = set(Row.__dataclass_fields__) - {"fields"}
    return [Row(**{k: v for k, v in r.items() if k in fixed}, fields={k: v for k, v in r.items() if k not in fixed})
            for r in saved["rows"]]


def run(families=FAMILIES, shapes: int = 200, seconds: float | None = None, seed: int = 0, cpu: bool = False,
        log=print) -> tuple[list, dict, dict]:
    """(rows, summary, meta) of a sweep; see the module docstring."""
    from . import _free_device_memory, run_cases, start

    env, ceiling = start(cpu, log=log)
    device = torch.device("cpu" if cpu else "cuda")
    max_elements = 1 << 14 if cpu else 1 << 26
    limits = {name: getattr(torch._dynamo.config, name) for name in ("recompile_limit", "accumulated_recompile_limit")
              if hasattr(torch._dynamo.config, name)}
    for name in limits:
        setattr(torch._dynamo.config, name, 4096)
    started, rows, ran, skipped = time.perf_counter(), [], {}, {}
    drawn = {family: problems(family, shapes, seed, max_elements) for family in families}
    for family, found in drawn.items():
        if len(found) < shapes:
            log(f"{family}: {len(found)} distinct problems within the bounds, fewer than the {shapes} asked")
    try:
        # round robin over the families: a time limit leaves every family the same share
        for i in range(shapes):
            for family in families:
                if i >= len(drawn[family]):
                    continue
                if seconds is not None and time.perf_counter() - started > seconds:
                    skipped[family] = skipped.get(family, 0) + 1
                    continue
                rows += run_cases([sweep_case(family, drawn[family][i], device, compiled=not cpu)], peers=not cpu,
                                  ceiling=ceiling, log=log, same_copy=False)
                ran[family] = ran.get(family, 0) + 1
        _free_device_memory()
    finally:
        for name, value in limits.items():
            setattr(torch._dynamo.config, name, value)
        _COMPILED.clear()
    meta = {"environment": env, "copy_ceiling_gbps": None if ceiling is None else round(ceiling, 1),
            "shapes_asked": shapes, "problems_drawn": {family: len(found) for family, found in drawn.items()},
            "problems_run": ran, "problems_not_started": skipped, "seed": seed,
            "seconds": round(time.perf_counter() - started, 1)}
    return rows, summarise(rows), meta


__all__ = ["FAMILIES", "ROW_COUNTS", "ROW_LENGTHS", "chart", "load_rows", "problems", "run", "summarise",
           "summary_lines", "sweep_case"]


def main(shapes: int = 200, seconds: float | None = None, families=FAMILIES, out: str | None = None,
         seed: int = 0) -> int:
    """``python -m trainops bench --sweep``: run, print the per-family summary, write JSON and the chart."""
    import datetime as _dt_module
    import os

    from . import write_results

    cpu = not torch.cuda.is_available()
    rows, summary, meta = run(families, shapes, seconds, seed, cpu)
    print()
    print("\n".join(summary_lines(summary)))
    if meta["problems_not_started"]:
        print(f"not started (past --sweep-seconds {seconds:g}): {meta['problems_not_started']}")
    if out is None:
        stamp = _dt_module.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = os.path.join("benchmarks", "results", f"sweep-{'cpu' if cpu else 'cuda'}-{stamp}.json")
    env = meta.pop("environment")
    write_results(out, env, {**meta, "summary": summary}, rows=rows)
    print(f"wrote {out}")
    print(chart(rows, os.path.splitext(out)[0] + ".png",
                f"best of torch eager / torch.compile over trainops, {env['device']}, {env['date'][:10]}"
                + (" (CPU self-check)" if cpu else "")))
    return 0
