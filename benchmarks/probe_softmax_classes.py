"""Softmax backward in the two shape classes where trainops still loses to torch.compile on the H200
(issue 42): rows of 30K-65K vocabulary elements (the last axis), and a non-last axis (dim=0 of a
2-D matrix, read in place through its stride). trainops's default plan and a small grid of
``SoftmaxHeuristics`` candidates per class, beside torch eager and torch.compile.

    PYTHONPATH=src python benchmarks/probe_softmax_classes.py --out benchmarks/results/probe-softmax-classes-h200-DATE.json
        [--quick] [--only last-axis|dim0] [--compile static|dynamic|none] [--budget 210] [--warmup 10] [--rep 40]
    PYTHONPATH=src python benchmarks/probe_softmax_classes.py --plans-only [--sms 132]   # no GPU: the plans each candidate gets
    PYTHONPATH=src python benchmarks/probe_softmax_classes.py --cpu-check --out check.json  # no GPU: the harness, tiny shapes

Shapes (bf16 unless said; dy random, y = softmax of random x along dim, never zeros):
    last axis  4096x32000, 8192x32000, 4096x50257, 4096x65536, 8192x65536
    dim=0      4096x4096, 32000x512, 1024x8192, 8192x1024, 4096x4096 float32
``--quick``: 4096x32000, 4096x65536 and dim=0 of 4096x4096, 1024x8192 (two plans of each class).
The classes' shapes are interleaved (a run stopped by ``--budget`` still has both classes).

The default plans on the H200 (132 SMs; ``--plans-only`` prints every candidate's):
    32000 (both)  fused: a row a program, BLOCK_N 32768 (32000 <= register_tile 32768), 8 warps (the
                  backward's cap): 128 elements of dy and of y a thread
    50257         exchange: 7 chunks of 8192 a row, 8 warps, 2 programs an SM, aligned windows (VEC 8:
                  the row length is no multiple of 16)
    65536 (both)  exchange: 8 chunks of 8192, 8 warps, 2 programs an SM
    dim=0         column tiles of BLOCK_I = max(column_block, column_bytes_backward / itemsize)
                  contiguous columns (bf16 64, float32 32) by BLOCK_N = stream_tile / 2 / BLOCK_I rows;
                  split plan (two launches: partial sums to a workspace, then apply, re-reading dy
                  and y) for 4096x4096 (64 x 128 tiles, 32 splits), 32000x512 (256 splits),
                  8192x1024 (64 splits), float32 4096x4096 (32 x 128, 32 splits); 1024x8192 is fused
                  (32 columns x 1024 rows a program, 8 warps: 128 elements a thread a tensor)

Implementations per shape:
    torch eager      torch._softmax_backward_data(dy, y, dim, dtype)
    torch.compile    y * (dy - (dy * y).sum(dim, keepdim=True)) in float32 (opmath, as torch's own
                     decomposition of _softmax_backward_data), cast back. ``--compile static``
                     (the default): dynamic=False, one compiled function per class recompiled for
                     each shape (as the issue's comparisons); ``dynamic``: dynamic=True, one
                     compile per class; ``none``. Each shape's first call (compile included) is
                     reported as compile_s.
    trainops default trainops.softmax_backward(dy, y, dim), no heuristics override
    candidates       the same call inside ``trainops.heuristics(SoftmaxHeuristics(...))`` (the
                     mechanism every probe uses: plan.py ``heuristics``); CANDIDATES below, and
                     why each field matters for these shapes. A candidate whose plan (the
                     KernelChoice of ``trainops.plan``) equals one already timed for the shape is
                     not timed again: its row says ``same_as``.

Every result is checked first against float64 dx = y * (dy - sum(dy * y, dim)) computed from the same
dy and y (relative-norm error within 1e-2 for bf16, 1e-5 for float32); a wrong result, or one that
raises, is recorded and never timed. Times: triton.testing.do_bench median (ms; L2 cleared between
calls; warmup/rep in ms of the GPU's time). GB/s counts the fewest bytes: dy and y read, dx written
(3 x numel x element size); pct_of_copy: that against a device-to-device copy of 512 MiB measured in
the run. trainops rows also carry the plan and, best-effort from Triton's caches, ``kernels``: the
registers, spills and warps of the kernels that row's first call compiled (empty where it reused
kernels an earlier row compiled: the 8192-row vocabulary shapes reuse the 4096-row ones'), and for exchange
plans ``exchange_grids``: the programs launched (groups x splits; / SMs = programs an SM after the
occupancy cap). The JSON (versions, settings, candidates, every row, a summary per shape) is
rewritten after each row: a run cut short keeps what it measured. A table prints last: per shape
the best trainops variant, the default, eager and compile ms, and the speed against the best torch
(best torch ms / trainops ms: > 1 means trainops is faster).

Estimated GPU wall time, full run (H200, cold Triton and Inductor caches): ~20 s start-up (imports,
CUDA, the copy), ~35-60 s of Triton compiles (about 65 kernel specialisations: the split plan
compiles two phases), ~40-60 s of torch.compile (10 static compiles, the first with Inductor's
start-up; ``--compile dynamic``: 2), ~15-20 s of timing (about 75 do_bench calls), a few s of data
and float64 checks: about 2-2.7 minutes. ``--budget`` (default 210 s from the start) skips what has
not started by then and still writes the JSON and the table. ``--quick``: about 1-1.5 minutes.

``--cpu-check`` (TRITON_INTERPRET=1, no GPU: tests/test_probe_softmax_classes.py) runs the same
harness on CPU_SHAPES with every candidate's tiles divided by CPU_SCALE and CPU_SMS SMs, so that the
fused, exchange (windowed), looped and split plans all run under the interpreter; no torch.compile,
and its ms is one call's wall time: no timing claims.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time

_START = time.monotonic()   # --budget counts from here (the imports below included)

if "--cpu-check" in sys.argv or "--plans-only" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import torch
import triton

import trainops
from trainops.ops import softmax as softmax_ops
from trainops.ops.exchange import ExchangeGrid
from trainops.ops.softmax import SoftmaxHeuristics
from trainops.plan import cached_plan

BF16, FP32 = torch.bfloat16, torch.float32
LAST, DIM0 = "last-axis", "dim0"
DIMS = {LAST: -1, DIM0: 0}
SHAPES = {
    LAST: [((4096, 32000), BF16), ((8192, 32000), BF16), ((4096, 50257), BF16), ((4096, 65536), BF16),
           ((8192, 65536), BF16)],
    DIM0: [((4096, 4096), BF16), ((32000, 512), BF16), ((1024, 8192), BF16), ((8192, 1024), BF16),
           ((4096, 4096), FP32)],
}
QUICK = {LAST: [((4096, 32000), BF16), ((4096, 65536), BF16)], DIM0: [((4096, 4096), BF16), ((1024, 8192), BF16)]}
# --cpu-check: interpreter-sized shapes, tiles divided by CPU_SCALE and CPU_SMS "SMs" so that the same
# kinds of plan come up (fused, exchange with and without windows, looped, split, column fused)
CPU_SHAPES = {LAST: [((8, 500), BF16)], DIM0: [((64, 48), BF16), ((24, 40), FP32)]}
CPU_SCALE, CPU_SMS = 64, 4
TOLERANCE = {BF16: 1e-2, FP32: 1e-5}
_D = SoftmaxHeuristics()   # the class defaults, to derive the candidates' tables from


def _table(name: str, entries: dict) -> dict:
    """The default table ``name`` (e.g. register_tile, by element size) with ``entries`` replaced."""
    return {**getattr(_D, name), **entries}


# Candidates per class: name -> SoftmaxHeuristics fields. Plans the H200 gets (132 SMs; ``--plans-only``):
CANDIDATES = {
    LAST: {
        # 32000 is fused today (32768 <= register_tile: one row a program, BLOCK_N 32768, 8 warps, the backward's
        # cap: 128 elements a thread of dy and of y); a smaller register tile sends it to the exchange plan.
        # 50257 / 65536 rows are on the exchange plan already (8192-element chunks, 8 warps, 2 programs an SM).
        "exch8k": dict(register_tile=_table("register_tile", {2: 16384})),   # 32000: 4 chunks of 8192
        # 16 elements a thread: fewer registers, more warps an SM (up to 4 programs, as the occupancy allows)
        "exch8k_w16": dict(register_tile=_table("register_tile", {2: 16384}),
                           exchange_warps=_table("exchange_warps", {"softmax_backward": 16}),
                           exchange_per_sm={False: 3, True: 4}),
        # 8 / 13 / 16 chunks a row of 4096 (16 elements a thread at 8 warps), up to 4 programs an SM
        "exch4k": dict(register_tile=_table("register_tile", {2: 16384}),
                       exchange_tile=_table("exchange_tile", {2: 4096}), exchange_per_sm={False: 3, True: 4}),
        # 2 / 4 / 4 chunks a row of 16384 at 16 warps (32 elements a thread, as the default's)
        "exch16k_w16": dict(register_tile=_table("register_tile", {2: 16384}),
                            exchange_tile=_table("exchange_tile", {2: 16384}),
                            exchange_warps=_table("exchange_warps", {"softmax_backward": 16})),
        # no exchange: one program streams its row twice (the second pass from L2), as Inductor's looped reduction
        "looped16k": dict(register_tile=_table("register_tile", {2: 16384}), row_exchange=False),
        "looped8k": dict(register_tile=_table("register_tile", {2: 16384}), row_exchange=False,
                         stream_tile=_table("stream_tile", {2: 8192})),
        # 32000 fused: 16 warps by default since 2026-11-30 (fused_backward_warps; 64 elements a thread of dy
        # and of y), 8 before (128 a thread), and 32 (32 a thread)
        "fused_w8": dict(fused_backward_warps=8),
        "fused_w32": dict(fused_backward_warps=32),
    },
    DIM0: {
        # column tiles: BLOCK_I = max(column_block, column_bytes_backward / itemsize) contiguous columns (bf16 64
        # today; float32 32) by BLOCK_N = stream_tile / 2 / BLOCK_I rows; the split plan (two launches: partial
        # sums, then apply) for all but 1024x8192, which is fused (32 columns x 1024 rows, 8 warps). column_block (32)
        # is a floor: column_bytes_backward under 64 B changes nothing in bf16 (probe_split_rows.py's "col32B" ran
        # 32 columns, 64 B), and column_backward_split_per_sm above 16 nothing here (the splits are capped at
        # N / BLOCK_N).
        "col64B": dict(column_bytes_backward=64),       # bf16 32 columns (float32: 32, the default's)
        "col256B": dict(column_bytes_backward=256),     # bf16 128 columns, float32 64
        "col512B": dict(column_bytes_backward=512),     # bf16 256 columns (32 rows a step), float32 128
        # the split plan's programs an SM: 2 by default since 2026-11-30 (column_backward_split_per_sm), 16 before
        "split16": dict(column_backward_split_per_sm=16),
        "split4": dict(column_backward_split_per_sm=4),
        "stream32k": dict(stream_tile=_table("stream_tile", {2: 32768, 4: 16384})),   # 256-row steps, half the splits
        "reg16k": dict(register_tile=_table("register_tile", {2: 16384, 4: 16384})),  # 1024x8192: fused at 16 columns
        "reg8k": dict(register_tile=_table("register_tile", {2: 8192, 4: 8192})),     # 1024x8192: split, 64 columns
    },
}


def heuristics_of(fields: dict, sms: int | None, scale: int = 1) -> SoftmaxHeuristics:
    """SoftmaxHeuristics of ``fields``, planning for ``sms`` SMs, tiles divided by ``scale`` (--cpu-check)."""
    fields = dict(fields)
    if scale != 1:
        for name in ("register_tile", "stream_tile", "exchange_tile"):
            fields[name] = {k: max(16, v // scale) for k, v in fields.get(name, getattr(_D, name)).items()}
    return SoftmaxHeuristics(sms=sms, **fields)


def decomposed_last(dy, y):
    """torch.compile's input, last axis (its own function: dynamo's cache is per code object)."""
    yf, dyf = y.float(), dy.float()
    return (yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)


def decomposed_dim0(dy, y):
    """torch.compile's input, dim 0."""
    yf, dyf = y.float(), dy.float()
    return (yf * (dyf - (dyf * yf).sum(0, keepdim=True))).to(y.dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-300))


def label_of(shape, dtype) -> str:
    return f"{'x'.join(map(str, shape))} {str(dtype).replace('torch.', '')}"


def short_plan(kernel) -> str:
    """'exchange N8192 w8 s7 per_sm2 win8' from a KernelChoice."""
    p = dict(kernel.params)
    parts = [str(p.get("plan", kernel.name))]
    if p.get("BLOCK_I", 1) != 1:
        parts.append(f"I{p['BLOCK_I']}")
    parts += [f"N{p.get('BLOCK_N')}", f"w{p.get('num_warps')}"]
    if p.get("splits", 1) != 1:
        parts.append(f"s{p['splits']}")
    if p.get("chunk"):
        parts.append(f"chunk{p['chunk']}")
    if p.get("per_sm"):
        parts.append(f"per_sm{p['per_sm']}")
    if p.get("programs"):
        parts.append(f"grid{p['programs']}")
    if p.get("window"):
        parts.append(f"win{p['window']}")
    return " ".join(parts)


def plan_of(shape, dim, dtype, device, h) -> tuple[str, str]:
    """(full, short) description of the plan trainops makes for this problem under ``h`` (None: the default)."""
    kernel = trainops.plan("softmax_backward", shape=shape, dim=dim, dtype=dtype, device=device, heuristics=h).kernel
    return str(kernel), short_plan(kernel)


# -- best-effort diagnostics from Triton's caches (never fail a run) ------------------------------

_KERNEL_FNS = ("_softmax_bwd_fused", "_softmax_bwd_chunked", "_softmax_bwd_exchange")


def _compiled_kernels() -> dict:
    """id -> (function name, compiled kernel) of every softmax backward kernel Triton has compiled."""
    found = {}
    try:
        for name in _KERNEL_FNS:
            fn = getattr(softmax_ops, name, None)
            for entry in getattr(fn, "device_caches", {}).values():   # Triton 3.x: (kernel_cache, ...)
                cache = entry[0] if isinstance(entry, tuple) else entry
                for kernel in getattr(cache, "values", lambda: ())():
                    found[id(kernel)] = (name.lstrip("_"), kernel)
    except Exception:  # noqa: BLE001 - diagnostics only
        pass
    return found


def kernel_stats(before: dict) -> list:
    """Registers, spills and warps of the kernels compiled since ``before`` (a _compiled_kernels())."""
    stats = []
    try:
        for key, (name, kernel) in _compiled_kernels().items():
            if key in before:
                continue
            kernel._init_handles()
            stats.append({"kernel": name, "n_regs": getattr(kernel, "n_regs", None),
                          "n_spills": getattr(kernel, "n_spills", None),
                          "num_warps": getattr(kernel.metadata, "num_warps", None),
                          "shared": getattr(kernel.metadata, "shared", None)})
    except Exception as e:  # noqa: BLE001 - diagnostics only
        stats.append({"error": f"{type(e).__name__}: {str(e)[:200]}"})
    return stats


def exchange_grids(dy, y, dim, h) -> list:
    """The grids an exchange plan launched (after its first call): programs = groups x splits."""
    try:
        with trainops.heuristics(h) if h is not None else contextlib.nullcontext():
            launch = cached_plan(softmax_ops.descriptor_of("softmax_backward", (dy, y), dim)).launch
        grids = []
        for cell in launch.run.__closure__ or ():
            value = cell.cell_contents
            if isinstance(value, list) and value and all(isinstance(g, ExchangeGrid) for g in value):
                grids += [list(grid) for g in value for grid in g._grids.values()]
        return grids
    except Exception:  # noqa: BLE001 - diagnostics only
        return []


# -- the run -----------------------------------------------------------------------------------

class Probe:
    """The run's arguments, device and JSON result."""

    def __init__(self, args, device: str):
        self.args, self.device = args, device
        self.cpu = device == "cpu"
        self.result = {}

    def write(self):
        with open(self.args.out, "w") as f:
            json.dump(self.result, f, indent=1)

    def past_budget(self) -> bool:
        return not self.cpu and time.monotonic() - _START > self.args.budget

    def time_ms(self, fn) -> float:
        import triton.testing
        return triton.testing.do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, return_mode="median")


def _versions(device: str) -> dict:
    out = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "trainops": getattr(trainops, "__version__", None), "cuda": torch.version.cuda}
    try:
        import subprocess
        here = os.path.dirname(os.path.abspath(__file__))
        out["trainops_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                                cwd=here, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(), sms=props.multi_processor_count,
                   l2_bytes=getattr(props, "L2_cache_size", None))
    else:
        out.update(device="cpu (TRITON_INTERPRET=1)", sms=CPU_SMS)
    return out


def _candidates(args, sms) -> dict:
    """class -> [(name, heuristics or None for the plain default call)]."""
    scale = CPU_SCALE if args.cpu_check else 1
    out = {}
    for cls, fields in CANDIDATES.items():
        default = heuristics_of({}, sms, scale) if (args.cpu_check or args.plans_only) else None
        out[cls] = [("default", default)] + [(name, heuristics_of(f, sms, scale)) for name, f in fields.items()]
    return out


def _order(args) -> list:
    shapes = CPU_SHAPES if args.cpu_check else QUICK if args.quick else SHAPES
    classes = [c for c in (LAST, DIM0) if getattr(args, "only", None) in (None, c)]
    order = []
    for k in range(max(len(v) for v in shapes.values())):
        for cls in classes:
            if k < len(shapes[cls]):
                order.append((cls, *shapes[cls][k]))
    return order


def plans_only(args) -> int:
    """Print the plan of every shape and candidate (CPU, no kernel runs: plans for ``--sms`` SMs)."""
    cands = _candidates(args, args.sms)
    with trainops.backend("triton"):
        for cls, shape, dtype in _order(args):
            print(f"{cls:9s} {label_of(shape, dtype)}")
            for name, h in cands[cls]:
                print(f"    {name:12s} {plan_of(shape, DIMS[cls], dtype, 'cpu', h)[1]}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON to write (rewritten after each row)")
    parser.add_argument("--quick", action="store_true", help="2 shapes a class")
    parser.add_argument("--only", choices=(LAST, DIM0), help="one class of shapes")
    parser.add_argument("--compile", choices=("static", "dynamic", "none"), default="static",
                        help="torch.compile with dynamic=False per shape (default), dynamic=True once a class, or not")
    parser.add_argument("--budget", type=float, default=210.0,
                        help="seconds from start: what is not started by then is skipped (the JSON says what)")
    parser.add_argument("--warmup", type=int, default=10, help="do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=40, help="do_bench rep (ms)")
    parser.add_argument("--cpu-check", action="store_true",
                        help="the harness on tiny CPU shapes under TRITON_INTERPRET=1 (no timing claims)")
    parser.add_argument("--plans-only", action="store_true", help="print the plans (no GPU needed) and exit")
    parser.add_argument("--sms", type=int, default=132, help="--plans-only: SMs to plan for (H200: 132)")
    args = parser.parse_args(argv)
    if args.plans_only:
        return plans_only(args)
    if not args.out:
        parser.error("--out is required")
    device = "cpu" if args.cpu_check else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --cpu-check or --plans-only")
    probe = Probe(args, device)
    sms = CPU_SMS if args.cpu_check else None
    cands = _candidates(args, sms)
    ceiling = None
    if device == "cuda":
        import triton.testing
        src = torch.empty(2 ** 28, dtype=BF16, device="cuda")
        dst = torch.empty_like(src)
        ceiling = 2 * src.numel() * 2 / triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6
        del src, dst
        for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, limit):   # one compile a shape, never a silent fallback to eager
                setattr(torch._dynamo.config, limit, 1024)
    compiled = {}
    if device == "cuda" and args.compile != "none":
        dynamic = args.compile == "dynamic"
        compiled = {LAST: torch.compile(decomposed_last, dynamic=dynamic),
                    DIM0: torch.compile(decomposed_dim0, dynamic=dynamic)}
    probe.result = {
        "probe": "softmax_classes", "versions": _versions(device), "copy_gbs": ceiling,
        "settings": {"quick": args.quick, "compile": args.compile if device == "cuda" else "none (cpu-check)",
                     "budget_s": args.budget, "warmup_ms": args.warmup, "rep_ms": args.rep,
                     "cpu_check": args.cpu_check, "timing": "cpu wall, one call: no claim" if args.cpu_check
                     else "triton.testing.do_bench median", "tolerance": {"bfloat16": TOLERANCE[BF16],
                                                                          "float32": TOLERANCE[FP32]}},
        "candidates": {cls: {name: _fields_json(CANDIDATES[cls].get(name, {})) for name, _ in cands[cls]}
                       for cls in cands},
        "rows": [], "summary": [], "skipped": [],
    }
    v = probe.result["versions"]
    print(f"{v['device']}, torch {v['torch']}, triton {v['triton']}"
          + (f", copy {ceiling:.0f} GB/s" if ceiling else ""), flush=True)
    with trainops.backend("triton") if args.cpu_check else contextlib.nullcontext():
        gen = torch.Generator(device=device).manual_seed(0)
        for cls, shape, dtype in _order(args):
            _run_shape(probe, cls, shape, dtype, cands[cls], compiled.get(cls), ceiling, gen)
            if device == "cuda":
                torch.cuda.empty_cache()   # the shape's tensors are gone with _run_shape's frame
    probe.result["elapsed_s"] = time.monotonic() - _START
    probe.write()
    _print_table(probe.result["summary"])
    print(f"elapsed {probe.result['elapsed_s']:.0f} s")
    print(f"wrote {args.out}")
    return 0


def _fields_json(fields: dict) -> dict:
    return {k: ({str(a): b for a, b in v.items()} if isinstance(v, dict) else v) for k, v in fields.items()}


def _run_shape(probe, cls, shape, dtype, cands, compiled, ceiling, gen):
    device, dim = probe.device, DIMS[cls]
    label = label_of(shape, dtype)
    if probe.past_budget():
        print(f"  {cls:9s} {label:18s} skipped: past --budget {probe.args.budget:.0f} s", flush=True)
        probe.result["skipped"].append(f"{cls} {label}")
        probe.write()
        return
    x = torch.randn(shape, device=device, generator=gen) * 2
    y = torch.softmax(x, dim).to(dtype)
    del x
    dy = torch.randn(shape, device=device, generator=gen).to(dtype)
    yd, dyd = y.double(), dy.double()
    want = yd * (dyd - (yd * dyd).sum(dim, keepdim=True))
    del yd, dyd
    numel = math.prod(shape)
    nbytes = 3 * numel * dtype.itemsize
    tol = TOLERANCE[dtype]
    base = {"class": cls, "shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "dim": dim, "label": label}

    impls = [("torch eager", "torch", lambda: torch._softmax_backward_data(dy, y, dim, dtype), None)]
    ours = []
    for name, h in cands:
        if h is None:
            fn = lambda: trainops.softmax_backward(dy, y, dim)   # noqa: E731 - the plain default call
        else:
            def fn(h=h):
                with trainops.heuristics(h):
                    return trainops.softmax_backward(dy, y, dim)
        ours.append((name, "trainops", fn, h))
    impls.append(ours[0])
    if compiled is not None:
        impls.append(("torch.compile", "torch", lambda: compiled(dy, y), None))
    impls += ours[1:]

    seen_plans = {}
    rows = []
    for name, family, fn, h in impls:
        row = dict(base, impl=name, family=family)
        rows.append(row)
        if probe.past_budget():
            row["skipped"] = "past --budget"
            probe.result["skipped"].append(f"{cls} {label} {name}")
            probe.result["rows"].append(row)
            probe.write()
            continue
        if family == "trainops":
            try:
                row["plan"], row["plan_short"] = plan_of(shape, dim, dtype, device, h)
            except Exception as e:  # noqa: BLE001
                row["plan_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if row.get("plan") in seen_plans:
                row["same_as"] = seen_plans[row["plan"]]
                probe.result["rows"].append(row)
                probe.write()
                print(f"  {cls:9s} {label:18s} {name:14s} same plan as {row['same_as']}: not timed", flush=True)
                continue
            if "plan" in row:
                seen_plans[row["plan"]] = name
        before = _compiled_kernels() if family == "trainops" and not probe.cpu else {}
        try:
            start = time.monotonic()
            got = fn()
            if not probe.cpu:
                torch.cuda.synchronize()
            first_s = time.monotonic() - start
            err = relative_error(got, want)
            del got
        except Exception as e:  # noqa: BLE001 - reported; the rest still run
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            probe.result["rows"].append(row)
            probe.write()
            print(f"  {cls:9s} {label:18s} {name:14s} FAILED {row['error'][:160]}", flush=True)
            continue
        row.update(rel_err=err, ok=err <= tol, first_call_s=first_s)
        if name == "torch.compile":
            row["compile_s"] = first_s
        if family == "trainops" and not probe.cpu:
            row["kernels"] = kernel_stats(before)
            if "exchange" in row.get("plan", ""):
                row["exchange_grids"] = exchange_grids(dy, y, dim, h)
        if not row["ok"]:
            probe.result["rows"].append(row)
            probe.write()
            print(f"  {cls:9s} {label:18s} {name:14s} WRONG rel err {err:.2e} > {tol:g}: not timed", flush=True)
            continue
        ms = first_s * 1e3 if probe.cpu else probe.time_ms(fn)   # --cpu-check: the checked call's wall time
        gbs = nbytes / ms / 1e6
        row.update(ms=ms, gbs=gbs, pct_of_copy=100 * gbs / ceiling if ceiling else None)
        probe.result["rows"].append(row)
        probe.write()
        pct = f" {row['pct_of_copy']:5.1f}% of copy" if ceiling else ""
        print(f"  {cls:9s} {label:18s} {name:14s} {ms:9.4f} ms {gbs:7.0f} GB/s{pct}  err {err:.1e}  "
              f"{row.get('plan_short', '')}", flush=True)
    probe.result["summary"].append(_summary(base, rows))
    probe.write()


def _summary(base, rows) -> dict:
    timed = [r for r in rows if "ms" in r]
    ours = [r for r in timed if r["family"] == "trainops"]
    theirs = [r for r in timed if r["family"] == "torch"]
    by = {r["impl"]: r for r in rows}
    best = min(ours, key=lambda r: r["ms"], default=None)
    best_torch = min(theirs, key=lambda r: r["ms"], default=None)
    default = by.get("default", {})

    def ms(r):
        return r.get("ms") if r else None
    out = dict(base, best=best and best["impl"], best_ms=ms(best), best_plan=best and best.get("plan_short"),
               best_pct_of_copy=best and best.get("pct_of_copy"),
               default_ms=ms(default), default_plan=default.get("plan_short"),
               eager_ms=ms(by.get("torch eager")), compile_ms=ms(by.get("torch.compile")),
               compile_s=by.get("torch.compile", {}).get("compile_s"),
               best_torch=best_torch and best_torch["impl"], best_torch_ms=ms(best_torch))
    # speed against the best torch: > 1 means trainops is faster
    out["best_speed_vs_torch"] = best_torch["ms"] / best["ms"] if best and best_torch else None
    out["default_speed_vs_torch"] = best_torch["ms"] / default["ms"] if "ms" in default and best_torch else None
    out["not_ok"] = [r["impl"] for r in rows if r.get("ok") is False or "error" in r]
    return out


def _print_table(summary):
    def f(v, fmt="9.4f"):
        return f"{v:{fmt}}" if isinstance(v, (int, float)) else f"{'-':>9s}"
    print(f"\n{'class':9s} {'shape':18s} {'best':12s} {'best ms':>9s} {'default':>9s} {'eager':>9s} {'compile':>9s} "
          f"{'best/torch':>10s} {'dflt/torch':>10s}  (speed against the best torch: >1 = trainops faster)")
    for s in summary:
        print(f"{s['class']:9s} {s['label']:18s} {str(s['best']):12s} {f(s['best_ms'])} {f(s['default_ms'])} "
              f"{f(s['eager_ms'])} {f(s['compile_ms'])} {f(s['best_speed_vs_torch'], '10.2f')} "
              f"{f(s['default_speed_vs_torch'], '10.2f')}")
        print(f"{'':28s} best plan: {s['best_plan']}   default plan: {s['default_plan']}"
              + (f"   compile {s['compile_s']:.1f} s" if s.get("compile_s") else "")
              + (f"   NOT OK: {', '.join(s['not_ok'])}" if s["not_ok"] else ""))


if __name__ == "__main__":
    sys.exit(main())
