"""Host time per eager call of issue 39's seven small calls, trainops against torch (item 5, "the
host floor").

    python benchmarks/probe_host_time.py --out host.json [--device cuda] [--calls 1000] [--rounds 3]

Each call runs on a problem small enough that the device idles, so the time per call is host time
(Python, dispatch, allocation, launch). Per call and implementation: warm-up calls, then
``--calls`` calls with no synchronisation between them, then one synchronisation; the figure is
us a call, the median of ``--rounds`` rounds, trainops and torch alternated within each round.

Calls (bf16 tensors unless said; the same arguments for both):
- softmax 64x64: forward, no grad (``trainops.softmax`` / ``torch.softmax``);
- cross_entropy, no grad: 64 x 512 logits, int64 targets, mean (``trainops.cross_entropy`` /
  ``F.cross_entropy``), in ``torch.no_grad()``;
- embedding forward: 64 int64 ids into a 1000 x 512 table that does not require grad;
- AdamW, 8 small tensors: one ``step()`` over 8 float32 parameters of 256 x 256 with gradients
  set (``trainops.optim.AdamW`` / ``torch.optim.AdamW``, fused on CUDA, foreach on the CPU);
- rms_norm 64x4096, forward + backward: x (requires grad) and a float32 weight (requires grad),
  ``y.backward(dy)`` (``F.rms_norm(x, (4096,), weight, eps)`` for torch);
- cross_entropy, forward + backward: 64 x 512 logits that require grad, ``loss.backward()``;
- softmax 64x4096, forward + backward: ``y.backward(dy)``;
- the floor (CUDA, or --python-only): a minimal autograd.Function whose forward and backward each
  allocate one output and launch one Triton copy kernel through trainops.launch.launcher, on
  64x4096, beside torch's softmax 64x4096 forward + backward (the issue's ~1.4x reference).

A call that fails is recorded with its error and the others still run; the JSON is rewritten
after every row.

Before timing, each pair's outputs are compared (relative-norm error, NaN fails), so the probe
never times a broken call. The JSON (``--out``) holds the settings, versions and every round;
a table (us a call, trainops / torch, ratio, the issue's target) prints last.

``--python-only`` (CPU tensors, no GPU needed): the Triton path's Python layers alone, as a GPU
call runs them (functional, the eager shortcut, plan cache, descriptors, outputs, autograd) with
every Triton launch replaced by a no-op: TRITON_INTERPRET=1, the triton backend pinned, each op
module's ``launcher`` stubbed (the outputs are garbage: no comparison; AdamW, which launches
through Triton's JIT, is left out). CUDA-only work (the launches themselves, the deferred checks'
report launches into the error word) is not in it; the CPU-only immediate checks are (use --no-check for the
cross-entropy and embedding calls without them). Timed in thread CPU time (time.thread_time_ns),
which a busy host perturbs less than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

if __name__ == "__main__" and "--python-only" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before trainops is imported: Triton plans for CPU tensors

import torch
import torch.nn.functional as F

import trainops

_CLOCK = [time.perf_counter_ns]

TARGETS = {"forward": 2.0, "forward + backward": 1.5, "optimizer": 2.0, "floor": 1.5, "floor forward": 2.0}
_STUB = [False]   # --python-only: launches are no-ops (the floor's too)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    error = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    return float("inf") if error != error else error


def stub_op_launchers() -> None:
    """Every op module's ``launcher`` made a no-op factory: the ops' Python layers run, their Triton
    launches do not (also benchmarks/probe_cnn_host.py's)."""
    import importlib
    import pkgutil

    import trainops.ops as ops

    def launcher(kernel, grid, trailing=(), **meta):
        return lambda *args: None

    for info in pkgutil.iter_modules(ops.__path__):
        module = importlib.import_module(f"trainops.ops.{info.name}")
        if hasattr(module, "launcher"):
            module.launcher = launcher


def _stub_launches() -> None:
    """--python-only: the ops' launches stubbed (stub_op_launchers), and the floors told so."""
    stub_op_launchers()
    _STUB[0] = True


_COPY: list = []   # the floors' Triton copy kernel, made on first use (Triton is imported only then)


def _copy_launcher(grid: int, block: int):
    """trainops.launch.launcher of a plain Triton copy y[i] = x[i] over ``grid`` programs of ``block``
    elements (the floors' one kernel)."""
    from trainops.launch import launcher

    if not _COPY:
        import triton
        import triton.language as tl

        @triton.jit
        def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)
        _COPY.append(_copy)
    return launcher(_COPY[0], (grid,), BLOCK=block, num_warps=4)


def _floor_case(device: torch.device, dtype: torch.dtype, rand):
    """The issue's floor: a minimal autograd.Function launching one Triton kernel (a copy) each way
    through trainops.launch.launcher, one output allocated each way; torch's softmax 64x4096 forward
    + backward beside it. None where no Triton kernel can run (CPU without --python-only)."""
    if not _STUB[0] and device.type != "cuda":
        return None
    x = rand(64, 4096, grad=True)
    dy = rand(64, 4096)
    n, block = x.numel(), 4096
    launch = (lambda *a: None) if _STUB[0] else _copy_launcher(-(-n // block), block)

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            y = torch.empty_like(t)
            launch(t, y, n)
            return y

        @staticmethod
        def backward(ctx, g):
            dx = torch.empty_like(g)
            launch(g, dx, n)
            return dx

    def ours():
        y = Floor.apply(x)
        y.backward(dy)
        return y

    def theirs():
        y = torch.softmax(x, -1)
        y.backward(dy)
        return y
    def check():   # the copy's output against its input (stubbed launches write nothing)
        return 0.0 if _STUB[0] else _relative(Floor.apply(x).detach().float(), x.detach().float())
    return ours, theirs, check


def _floor_forward_case(device: torch.device, dtype: torch.dtype, rand, custom_op: bool):
    """The forward-only floor: one output allocated and one Triton copy launched through
    trainops.launch.launcher, called directly or (custom_op) as a minimal torch.library custom op
    (the dispatcher's cost, which every trainops op pays); torch's softmax 64x64 beside it. None where
    no Triton kernel can run (CPU without --python-only)."""
    if not _STUB[0] and device.type != "cuda":
        return None
    x = rand(64, 64)
    n = x.numel()
    launch = (lambda *a: None) if _STUB[0] else _copy_launcher(1, 4096)

    def copy(t: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(t)
        launch(t, y, n)
        return y

    if custom_op:
        name = f"probe_host_time::floor_copy_{device.type}"
        op = torch.library.custom_op(name, mutates_args=())(copy)
        op.register_fake(lambda t: torch.empty_like(t))
        ours = lambda: op(x)  # noqa: E731
    else:
        ours = lambda: copy(x)  # noqa: E731

    def check():
        return 0.0 if _STUB[0] else _relative(ours().float(), x.float())
    return ours, (lambda: torch.softmax(x, -1)), check


def _cases(device: torch.device, dtype: torch.dtype, check: bool = True):
    """(name, kind, make) -> make() returns (trainops call, torch call, check) on fresh inputs."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dt=dtype, grad=False):
        t = torch.randn(*shape, generator=g).to(device=device, dtype=dt)
        return t.requires_grad_(grad)

    def softmax_small():
        x = rand(64, 64)
        return (lambda: trainops.softmax(x, -1)), (lambda: torch.softmax(x, -1)), None

    def ce_no_grad():
        logits = rand(64, 512)
        target = torch.randint(0, 512, (64,), generator=g).to(device)

        def ours():
            with torch.no_grad():
                return trainops.cross_entropy(logits, target, check_target=check)

        def theirs():
            with torch.no_grad():
                return F.cross_entropy(logits, target)
        return ours, theirs, None

    def embedding_forward():
        table = rand(1000, 512)
        ids = torch.randint(0, 1000, (64,), generator=g).to(device)
        return (lambda: trainops.embedding(ids, table, check_index=check)), (lambda: F.embedding(ids, table)), None

    def adamw():
        def params():
            gen = torch.Generator(device="cpu").manual_seed(1)
            ps = [torch.randn(256, 256, generator=gen).to(device).requires_grad_() for _ in range(8)]
            for p in ps:
                p.grad = torch.randn(256, 256, generator=gen).to(device) * 1e-2
            return ps
        ours_p, theirs_p = params(), params()
        ours_opt = trainops.optim.AdamW(ours_p, lr=1e-3)
        kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
        theirs_opt = torch.optim.AdamW(theirs_p, lr=1e-3, **kwargs)

        def check():   # one step each from the same start: the same parameters
            a, b = params(), params()
            trainops.optim.AdamW(a, lr=1e-3).step()
            torch.optim.AdamW(b, lr=1e-3, **kwargs).step()
            return max(_relative(x.detach(), y.detach()) for x, y in zip(a, b))
        return ours_opt.step, theirs_opt.step, check

    def rms_norm_fwd_bwd():
        x = rand(64, 4096, grad=True)
        w = rand(4096, dt=torch.float32, grad=True)
        dy = rand(64, 4096)

        def ours():
            y = trainops.rms_norm(x, w, 1e-6)
            y.backward(dy)
            return y

        def theirs():
            y = F.rms_norm(x, (4096,), w, 1e-6)
            y.backward(dy)
            return y
        return ours, theirs, None

    def ce_fwd_bwd():
        logits = rand(64, 512, grad=True)
        target = torch.randint(0, 512, (64,), generator=g).to(device)

        def ours():
            loss = trainops.cross_entropy(logits, target, check_target=check)
            loss.backward()
            return loss

        def theirs():
            loss = F.cross_entropy(logits, target)
            loss.backward()
            return loss
        return ours, theirs, None

    def softmax_fwd_bwd():
        x = rand(64, 4096, grad=True)
        dy = rand(64, 4096)

        def ours():
            y = trainops.softmax(x, -1)
            y.backward(dy)
            return y

        def theirs():
            y = torch.softmax(x, -1)
            y.backward(dy)
            return y
        return ours, theirs, None

    return [("softmax 64x64", "forward", softmax_small),
            ("cross_entropy, no grad", "forward", ce_no_grad),
            ("embedding forward", "forward", embedding_forward),
            ("AdamW, 8 small tensors", "optimizer", adamw),
            ("rms_norm 64x4096, forward + backward", "forward + backward", rms_norm_fwd_bwd),
            ("cross_entropy, forward + backward", "forward + backward", ce_fwd_bwd),
            ("softmax 64x4096, forward + backward", "forward + backward", softmax_fwd_bwd),
            ("floor: Function + 1 copy launch each way (vs torch softmax 64x4096 fwd+bwd)", "floor",
             lambda: _floor_case(device, dtype, rand)),
            ("floor, forward only: 1 output + 1 copy launch (vs torch softmax 64x64)", "floor forward",
             lambda: _floor_forward_case(device, dtype, rand, custom_op=False)),
            ("floor, forward only: the same as a minimal custom op (vs torch softmax 64x64)", "floor forward",
             lambda: _floor_forward_case(device, dtype, rand, custom_op=True))]


def _time_us(fn, calls: int, device: torch.device) -> float:
    clock = _CLOCK[0]
    _sync(device)
    start = clock()
    for _ in range(calls):
        fn()
    _sync(device)
    return (clock() - start) / calls / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--calls", type=int, default=1000, help="timed calls per round")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated substrings of the call names to run")
    parser.add_argument("--python-only", action="store_true",
                        help="CPU: the Triton path's Python layers, launches stubbed (see the module docstring)")
    parser.add_argument("--no-check", action="store_true",
                        help="cross_entropy with check_target=False, embedding with check_index=False")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(1)   # tiny problems: one thread, no intra-op pool waking (stable on a shared host)
    pinned = None
    if args.python_only:
        if device.type != "cpu":
            raise SystemExit("--python-only runs on CPU tensors (--device cpu)")
        _stub_launches()
        _CLOCK[0] = time.thread_time_ns
        pinned = trainops.backend("triton")
        pinned.__enter__()

    rows = []
    for name, kind, make in _cases(device, dtype, not args.no_check):
        if args.only and not any(s.strip() in name for s in args.only.split(",")):
            continue
        if args.python_only and kind == "optimizer":
            continue
        try:
            row = _measure(name, kind, make, args, device, dtype)
        except Exception as e:   # one broken call must not lose the others' figures
            row = {"call": name, "kind": kind, "error": f"{type(e).__name__}: {e}"}
            print(f"{name}: FAILED {row['error']}", flush=True)
        if row is not None:
            rows.append(row)
        _write(args, device, rows)

    if pinned is not None:
        pinned.__exit__(None, None, None)
    mode = ", Python layers only (launches stubbed), thread time" if args.python_only else ""
    print(f"\nhost time per call, us (median of {args.rounds} rounds of {args.calls} calls; {device}, {args.dtype}{mode})")
    print(f"{'call':40s} {'trainops':>9s} {'torch':>8s} {'ratio':>6s} {'target':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['call'][:40]:40s} failed: {r['error'][:80]}")
            continue
        print(f"{r['call'][:40]:40s} {r['trainops_us']:9.1f} {r['torch_us']:8.1f} {r['ratio']:5.2f}x "
              f"{'<=' + format(r['target_ratio'], '.1f') + 'x':>7s}")


def _measure(name, kind, make, args, device, dtype) -> dict | None:
    """One call's row: compared, warmed up, then timed (None when it cannot run here)."""
    made = make()
    if made is None:
        return None
    ours, theirs, check = made
    if args.python_only:
        error = float("nan")   # the stubbed launches write nothing: not compared
    elif check is not None:
        error = check()
    else:
        a, b = ours(), theirs()
        error = _relative(a.detach().float(), b.detach().float())
    tolerance = 2e-2 if dtype != torch.float32 else 1e-4
    if not args.python_only and not error <= tolerance:
        raise RuntimeError(f"trainops and torch disagree (relative error {error:.3g}); not timed")
    for fn in (ours, theirs):
        for _ in range(args.warmup):
            fn()
    _sync(device)
    rounds = {"trainops": [], "torch": []}
    for _ in range(args.rounds):
        rounds["trainops"].append(_time_us(ours, args.calls, device))
        rounds["torch"].append(_time_us(theirs, args.calls, device))
    us = {k: statistics.median(v) for k, v in rounds.items()}
    print(f"{name}: trainops {us['trainops']:.1f} us, torch {us['torch']:.1f} us", flush=True)
    return {"call": name, "kind": kind, "trainops_us": us["trainops"], "torch_us": us["torch"],
            "ratio": us["trainops"] / us["torch"], "target_ratio": TARGETS[kind], "rounds_us": rounds,
            "relative_error": None if error != error else error}


def _write(args, device, rows) -> None:
    """The JSON, rewritten after every row (a run cut short keeps what it measured)."""
    result = {"probe": "host_time", "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "python_only": args.python_only, "checks": not args.no_check,
              "dtype": args.dtype, "calls": args.calls, "warmup": args.warmup, "rounds": args.rounds,
              "torch": torch.__version__, "trainops": getattr(trainops, "__version__", None),
              "triton": _version("triton"), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


def _version(package: str) -> str | None:
    try:
        import importlib.metadata
        return importlib.metadata.version(package)
    except Exception:
        return None


if __name__ == "__main__":
    main()
