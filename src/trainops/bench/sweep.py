"""``python -m trainops bench --sweep``: trainops against the best of torch eager, torch.compile
and, where installed, quack-kernels, on the shapes users run, not only the tuned ones (issue 20),
and on issue 42's shape classes in every run.

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

Issue 42's shape classes (``ISSUE42_CLASSES``, ``fixed_problems``; bf16; 37 problems) run first
in every sweep, then the draws (``plan``; a draw that is one of them is not run twice): few rows of
long rows (softmax and cross_entropy, rows 1 / 8 / 64 x 16384 / 131072 / 1048576), softmax_backward
over vocabulary-sized rows (32000 / 50257 / 65536 x 4096 / 8192 rows) and over dim=0 of a
(length, inner) tensor, cross_entropy at those vocabularies with 10240 rows, and the quack table
(softmax 4096x32768, 1024x131072, 128x262144, 2048x151936, its backward at 2048x151936,
cross_entropy 8192x128256 and 4096x151936). Their cap is ``ISSUE42_MAX_ELEMENTS`` (1 << 30, all of
them), not the draws' 1 << 26, which would drop the vocabulary-sized backward and the quack table.
Their rows carry ``issue42_class`` (None on the draws).

Each problem: trainops, torch eager, torch.compile of the same eager code (one compiled
function per family, compiled as a user would: automatic dynamic shapes; Dynamo's recompile
limits are raised for the sweep, so no shape silently falls back to eager) and quack where it is
installed and has the call (``_quack_supports``: ``quack.softmax(x)`` and
``quack.softmax.softmax_bwd(dy, y)`` on a 2-D tensor's last axis with rows a multiple of 16
bytes, ``quack.cross_entropy(x, t).backward()`` as the main bench calls it; looked up through
``_peer``, so quack is imported only then), every output first
compared with a float64 reference (the output and, for the training calls, every gradient; trainops
outside the dtype's tolerance stops the run, a peer outside it or raising is left out and recorded),
then timed once (``triton.testing.do_bench``
median, shorter warm-up and repetition than the main bench: ``SWEEP_TIMING``; a few-microsecond
call is noisy). The weights are in the input's dtype for every implementation. Rows carry ms, GB/s of the fewest bytes, % of the copy ceiling and the fields
``family``, ``row_length``, ``rows``, ``dtype``, ``dim``, ``issue42_class``, ``peers_ms`` (each
peer that ran: its ms), ``peers_failed`` (each peer that failed: why) and ``peers_unavailable``
(quack installed without a backward call: softmax_backward says so). ``summarise`` adds per family
the geometric mean of best-of-torch ms / trainops ms, the worst shape, how many shapes trainops is
slower on, and the median % of the copy ceiling of odd and of even row lengths (shapes of at least
``LARGE_BYTES``, where the copy ceiling means something), those keys unchanged; then the same
against the best of every peer that ran (``best_of``: which peers; ``geomean_speedup_best_of``,
``worst_best_of``, ``slower_best_of``, ``peer_problems``, ``peer_failed``) and per issue 42 class
the worst ratio against the best peer (``issue42_classes``). ``chart`` draws the best peer's ms /
trainops ms against row length, one panel per family (host-inclusive).

Kernel time (issue 42's target is in GPU kernel time; do_bench's median includes the host's
launch cost, which dominates small problems): each implementation is also timed without the host
(``kernel_time``): ``triton.testing.do_bench_cudagraph`` (calls captured in a CUDA graph and
replayed; no L2 flush between calls), and where capture fails the CUDA kernels' device time
summed per call under torch.profiler (``trainops.bench.kernel_ms``). Rows carry ``kernel_ms``,
``kernel_method`` ("cudagraph", "profiler" or None) and ``kernel_reason`` (why not a graph: the
capture's error, "cpu", "off"; None for a graph); kernel_ms is None, never the host time, where
neither worked. ``summarise`` puts the kernel-time best-of beside the host-inclusive one
(``geomean_speedup_kernel_best_of``, ``worst_kernel_best_of``, per class ``kernel_geomean`` and
``kernel_worst``; rows without a kernel time left out and counted in ``kernel_missing``). It
about doubles each problem's timing (``--no-sweep-kernel-time`` leaves it out).

``seconds``: no new problem starts after that much time (the run says how many ran, of the
classes and of the draws). Without a GPU (``cpu=True``) the same code runs the CPU path on a few
small shapes, eager only, no peers, no kernel time (kernel_reason "cpu"): a self-check of the
harness, not a benchmark. There issue 42's
classes are scaled down (``_scaled_down``: the largest axis halved until the shape fits the CPU's
1 << 14 elements) to one problem per family and class (8, the dim=0 backward among them), which
checks their path, not their sizes.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch
import torch.nn.functional as F

import trainops

from .case import Case, Timing, _dt, _peer, _randn

FAMILIES = ("softmax", "softmax_backward", "cross_entropy", "rms_norm", "swiglu")
ROW_LENGTHS = (1, 2, 3, 5, 8, 17, 31, 64, 100, 127, 128, 255, 384, 509, 512, 768, 1000, 1023, 1024, 1536, 2047,
               2048, 3000, 3072, 4096, 4099, 5120, 6144, 8191, 8192, 11008, 12289, 14336, 16384, 24576, 32000, 32001,
               32768, 50257, 65536, 65537, 100003, 128256, 131072, 151936, 256000, 262144, 524287, 1048576)
ROW_COUNTS = (1, 2, 7, 32, 64, 100, 255, 512, 1000, 2048, 4097, 8192, 16384, 32768, 65536)
DTYPES = (torch.bfloat16, torch.bfloat16, torch.float16, torch.float32)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float64: 1e-10}
SWEEP_TIMING = Timing(warmup=10, rep=60)
# do_bench_cudagraph replays its graph (about ``rep`` ms of calls) 10 times: a tenth of the host-inclusive
# timing's ms keeps the kernel time of a row about as long as its host-inclusive time
KERNEL_REP_MS = SWEEP_TIMING.rep / 10
PROFILER_STEPS, PROFILER_WINDOWS = 10, 3   # the fallback: kernels summed over 10 calls, median of 3 profiles
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


# -- issue 42's shape classes: fixed problems, in every run ---------------------------------------

FEW_ROWS, LONG_ROWS = (1, 8, 64), (16384, 131072, 1048576)
VOCABULARIES = (32000, 50257, 65536)
ISSUE42_CLASSES = {
    "few_long_rows": "fewer rows than SMs, long rows: softmax and cross_entropy, rows 1/8/64 x 16384/131072/1048576",
    "vocab_rows": "softmax_backward over vocabulary-sized rows: 32000/50257/65536 x 4096/8192 rows",
    "non_last_axis": "softmax_backward of a (length, inner) tensor over dim=0",
    "vocab_10k_rows": "cross_entropy at vocabularies 32000/50257/65536 with 10240 rows",
    "quack_table": "issue 42's table of quack's wins: softmax, its backward and cross_entropy",
}
ISSUE42_MAX_ELEMENTS = 1 << 30   # the fixed classes' cap on the GPU (the largest, 8192x128256, is 1.05e9)


def _issue42_shapes() -> list[tuple]:
    """(family, issue42_class, shape, dim, dtype) of every fixed problem, bf16, class by class."""
    bf16 = torch.bfloat16
    out = [(family, "few_long_rows", (rows, n), -1, bf16)
           for family in ("softmax", "cross_entropy") for rows in FEW_ROWS for n in LONG_ROWS]
    out += [("softmax_backward", "vocab_rows", (rows, n), -1, bf16) for rows in (4096, 8192) for n in VOCABULARIES]
    out += [("softmax_backward", "non_last_axis", shape, 0, bf16)    # (length, inner), reduced over dim=0
            for shape in ((4096, 4096), (32000, 512), (1024, 8192))]
    out += [("cross_entropy", "vocab_10k_rows", (10240, n), -1, bf16) for n in VOCABULARIES]
    out += [("softmax", "quack_table", shape, -1, bf16)
            for shape in ((4096, 32768), (1024, 131072), (128, 262144), (2048, 151936))]
    out += [("softmax_backward", "quack_table", (2048, 151936), -1, bf16)]
    out += [("cross_entropy", "quack_table", shape, -1, bf16) for shape in ((8192, 128256), (4096, 151936))]
    return out


def _scaled_down(shape: tuple, max_elements: int) -> tuple:
    """``shape`` with its largest axis halved (rounding up) until it holds at most ``max_elements``."""
    shape = list(shape)
    while math.prod(shape) > max_elements:
        i = shape.index(max(shape))
        shape[i] = -(-shape[i] // 2)
    return tuple(shape)


def fixed_problems(family: str, max_elements: int = ISSUE42_MAX_ELEMENTS, scale: bool = False) -> list[dict]:
    """Issue 42's shape classes of ``family`` (``ISSUE42_CLASSES``), the same in every run: problem
    dicts as ``problems``'s plus ``issue42_class``. Problems over ``max_elements`` are left out, or
    with ``scale`` (the CPU self-check) scaled down to fit (``_scaled_down``; ``scaled_from``: the
    issue's shape), a problem that scales onto an earlier one dropped."""
    seen, out = set(), []
    for fam, cls, shape, dim, dtype in _issue42_shapes():
        if fam != family:
            continue
        extra = {}
        if math.prod(shape) > max_elements:
            if not scale:
                continue
            shape, extra = _scaled_down(shape, max_elements), {"scaled_from": shape}
        if (shape, dim, dtype) in seen:
            continue
        seen.add((shape, dim, dtype))
        length = shape[dim]
        out.append(dict(shape=shape, dim=dim, dtype=dtype, row_length=length, rows=math.prod(shape) // length,
                        issue42_class=cls, **extra))
    return out


def plan(families=FAMILIES, shapes: int = 200, seed: int = 0, max_elements: int = 1 << 26,
         fixed_max_elements: int = ISSUE42_MAX_ELEMENTS, scale_fixed: bool = False) -> tuple[list, list, dict]:
    """What a sweep runs, in order: (fixed, drawn, repeats). ``fixed``: (family, problem) of issue
    42's classes, round robin over the (family, class) groups, so a time limit leaves each class a
    share; ``drawn``: (family, problem) of the random draws, round robin over the families;
    ``repeats``: per family, the draws left out because a fixed problem is the same problem. With
    ``scale_fixed`` (the CPU self-check) the classes are scaled down and each (family, class) keeps
    its first problem: their path is checked, quickly."""
    groups: dict = {}
    for family in families:
        for p in fixed_problems(family, fixed_max_elements, scale_fixed):
            group = groups.setdefault((family, p["issue42_class"]), [])
            if not (scale_fixed and group):   # scaled down (the CPU self-check): one problem a class
                group.append((family, p))
    fixed = [g[i] for i in range(max(map(len, groups.values()), default=0)) for g in groups.values() if i < len(g)]
    keys = {(family, p["shape"], p["dim"], p["dtype"]) for family, p in fixed}
    draws = {family: problems(family, shapes, seed, max_elements) for family in families}
    drawn, repeats = [], {}
    for i in range(shapes):
        for family in families:
            if i >= len(draws[family]):
                continue
            p = draws[family][i]
            if (family, p["shape"], p["dim"], p["dtype"]) in keys:
                repeats[family] = repeats.get(family, 0) + 1
                continue
            drawn.append((family, p))
    return fixed, drawn, repeats


# -- one problem -------------------------------------------------------------------------------------

PEERS_TORCH = ("torch", "torch.compile")


def _quack_supports(family: str, problem: dict) -> bool:
    """Whether quack-kernels has a call for this problem: softmax and its backward on a 2-D
    tensor's last axis, rows a multiple of 16 bytes (quack loads rows in 16-byte vectors and its
    compile asserts it), cross_entropy (2-D logits, every row length: as the main bench calls it).
    fp32 / fp16 / bf16 only."""
    shape, dim, dtype = problem["shape"], problem["dim"], problem["dtype"]
    if dtype not in (torch.float32, torch.float16, torch.bfloat16) or len(shape) != 2 or dim not in (-1, 1):
        return False
    if family in ("softmax", "softmax_backward"):
        return shape[-1] * dtype.itemsize % 16 == 0
    return family == "cross_entropy"


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
    """The Case of one problem: trainops, torch, (with ``compiled``) torch.compile, and where the
    case is built with peers, quack-kernels where installed and ``_quack_supports`` the problem
    (through ``_peer``: quack is imported only then)."""
    shape, dim, dtype = problem["shape"], problem["dim"], problem["dtype"]
    quack = _quack_supports(family, problem)
    numel = math.prod(shape)
    tensors = {"softmax": 2, "softmax_backward": 3, "cross_entropy": 2, "rms_norm": 5, "swiglu": 8}[family]

    def build(peers):
        if family == "softmax":
            x = _randn(shape, dtype, device, 0, 3.0)
            impls = {"trainops": lambda: (lambda: trainops.softmax(x, dim)),
                     "torch": lambda: (lambda: _torch_softmax(x, dim))}
            if compiled:
                impls["torch.compile"] = lambda: (lambda: _compiled(family, _torch_softmax)(x, dim))
            quack_softmax = _peer("quack", "softmax") if peers and quack else None
            if quack_softmax is not None:
                impls["quack"] = lambda: (lambda: quack_softmax(x))
            return impls, lambda: torch.softmax(x.double(), dim)
        if family == "softmax_backward":
            y = torch.softmax(_randn(shape, dtype, device, 0, 3.0), dim)
            dy = _randn(shape, dtype, device, 1)
            impls = {"trainops": lambda: (lambda: trainops.softmax_backward(dy, y, dim)),
                     "torch": lambda: (lambda: _torch_softmax_backward(dy, y, dim))}
            if compiled:
                impls["torch.compile"] = lambda: (lambda: _compiled(family, _torch_softmax_backward)(dy, y, dim))
            found = {}
            if peers and quack:
                quack_backward = _peer("quack.softmax", "softmax_bwd")   # quack's own allocating call, as ours
                if quack_backward is not None:
                    impls["quack"] = lambda: (lambda: quack_backward(dy, y))
                elif _peer("quack", "softmax") is not None:   # quack is installed, its backward is not reachable
                    found["peers_unavailable"] = {"quack": "quack.softmax has no softmax_bwd(dy, y): no backward peer"}

            def reference():
                yd, dyd = y.double(), dy.double()
                return yd * (dyd - (yd * dyd).sum(dim, keepdim=True))
            return impls, reference, found
        if family == "cross_entropy":
            x = _randn(shape, dtype, device, 0, 2.0).requires_grad_()
            t = torch.randint(0, shape[-1], shape[:-1], device=device)
            impls = {"trainops": lambda: _backward_step(trainops.cross_entropy, (x, t), [x], None),
                     "torch": lambda: _backward_step(_torch_cross_entropy, (x, t), [x], None)}
            if compiled:
                impls["torch.compile"] = lambda: _backward_step(_compiled(family, _torch_cross_entropy), (x, t), [x],
                                                                None)
            quack_ce = _peer("quack", "cross_entropy") if peers and quack else None
            if quack_ce is not None:   # as cases.py's: quack_ce(x, t), a mean loss, .backward()
                impls["quack"] = lambda: _backward_step(quack_ce, (x, t), [x], None)

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
              "dim": dim, "issue42_class": problem.get("issue42_class")}
    nbytes = numel * dtype.itemsize * tensors + (8 * problem["rows"] if family == "cross_entropy" else 0)  # targets
    return Case(family, label, nbytes, build, fields, SWEEP_TIMING, TOLERANCE[dtype])


def kernel_time(call, timing: Timing = SWEEP_TIMING) -> dict:
    """The GPU kernel time of one call, without the host: row fields ``kernel_ms``,
    ``kernel_method`` and ``kernel_reason``. First ``triton.testing.do_bench_cudagraph`` (the calls
    captured in a CUDA graph and replayed: GPU time only, median of its replays, ``KERNEL_REP_MS``;
    unlike do_bench it flushes no L2 between calls), method "cudagraph", reason None. Where capture
    fails (a call that synchronises, or allocates or launches through a path a graph cannot
    capture), ``trainops.bench.kernel_ms``: the CUDA kernels' device time summed per call under
    torch.profiler (``PROFILER_STEPS`` calls, median of ``PROFILER_WINDOWS``), method "profiler",
    the capture's error as the reason. Where that fails too (or sees no kernel), kernel_ms and
    method None, both errors the reason: never the host-inclusive time."""
    import triton.testing

    from . import kernel_ms

    try:
        ms = triton.testing.do_bench_cudagraph(call, rep=KERNEL_REP_MS, return_mode="median")
        return {"kernel_ms": round(ms, 4), "kernel_method": "cudagraph", "kernel_reason": None}
    except Exception as e:   # not capturable: fall back to the profiler's kernel sum
        reason = f"cudagraph: {type(e).__name__}: {str(e)[:160]}"
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()   # what the failed capture left queued
        except Exception:
            pass
    try:
        ms = kernel_ms(call, steps=PROFILER_STEPS, windows=PROFILER_WINDOWS)
        if not ms > 0:
            raise RuntimeError("the profiler saw no CUDA kernel")
        return {"kernel_ms": round(ms, 4), "kernel_method": "profiler", "kernel_reason": reason}
    except Exception as e:
        return {"kernel_ms": None, "kernel_method": None,
                "kernel_reason": f"{reason}; profiler: {type(e).__name__}: {str(e)[:160]}"}


def no_kernel_time(reason: str):
    """A kernel timer that measures nothing: kernel_ms and kernel_method None, ``reason`` ("cpu":
    the CPU self-check; "off": ``--no-sweep-kernel-time``)."""
    def timer(call, timing=None) -> dict:
        return {"kernel_ms": None, "kernel_method": None, "kernel_reason": reason}
    return timer


def run_problem(family: str, problem: dict, device, *, compiled: bool, peers: bool, ceiling: float | None,
                log=print, timer=None, kernel_timer=None) -> list:
    """The rows of one problem (``run_cases`` on its ``sweep_case``), each carrying which peers
    ran and their ms (``peers_ms``), which failed and why (``peers_failed``: an error, or a result
    outside the tolerance; left out of every best-of) and which are installed but have no call for
    the problem (``peers_unavailable``: quack's softmax backward where quack lacks ``softmax_bwd``),
    and the implementation's GPU kernel time (``kernel_timer``, default ``kernel_time`` on a GPU,
    ``no_kernel_time("cpu")`` on the CPU: ``kernel_ms``, ``kernel_method``, ``kernel_reason``)."""
    from . import run_cases

    if kernel_timer is None:
        kernel_timer = no_kernel_time("cpu") if torch.device(device).type == "cpu" else kernel_time
    failed: list = []
    rows = run_cases([sweep_case(family, problem, device, compiled)], peers=peers, ceiling=ceiling, log=log,
                     timer=timer, same_copy=False, failed=failed, kernel_timer=kernel_timer)
    ran = {r.impl: r.ms for r in rows if r.impl != "trainops"}
    lost = {impl: why for _, _, impl, why in failed}
    for r in rows:
        r.fields.update(peers_ms=dict(ran), peers_failed=dict(lost),
                        peers_unavailable=dict(r.fields.get("peers_unavailable", {})))
    return rows


def _ratios() -> dict:
    return {"problems": 0, "log_ratio_sum": 0.0, "worst": None, "slower": 0}


def _add_ratio(s: dict, ratio: float, case: str, impl: str) -> None:
    s["problems"] += 1
    s["log_ratio_sum"] += math.log(ratio)
    if s["worst"] is None or ratio < s["worst"][0]:
        s["worst"] = (round(ratio, 3), case, impl)
    s["slower"] += ratio < 1.0


def _geomean(s: dict) -> float | None:
    total = s.pop("log_ratio_sum")
    return round(math.exp(total / s["problems"]), 3) if s["problems"] else None


def summarise(rows) -> dict:
    """Per family: problems, geometric mean and minimum of best-of-torch ms / trainops ms (and the
    worst shape), shapes where trainops is slower, and the median % of the copy ceiling of odd and
    even row lengths among shapes of at least LARGE_BYTES (bytes / GB/s gives the bytes back);
    these keys keep their meaning (the better of torch eager and torch.compile).

    Against the best of every peer that ran on a problem (torch eager, torch.compile, quack where
    it ran; a failed peer has no row and is never the best): ``best_of`` (the peers that entered
    it), ``peer_problems`` / ``peer_failed`` (problems each peer ran / failed on),
    ``geomean_speedup_best_of``, ``worst_best_of``, ``slower_best_of``, and per issue 42 class
    (``issue42_classes``): problems, geomean and the worst (ratio, shape, fastest peer).

    The same best-of in GPU kernel time (the rows' ``kernel_ms``, the same peers): a peer without
    a kernel time is left out of the problem's kernel best-of, a problem where trainops or every
    peer has none is left out of the kernel figures, and each is counted (``kernel_missing``:
    implementation -> problems). ``kernel_problems``, ``geomean_speedup_kernel_best_of``,
    ``worst_kernel_best_of``, ``slower_kernel_best_of``, ``kernel_methods`` (method -> rows, "none"
    for rows without a kernel time), and per class ``kernel_problems``, ``kernel_geomean``,
    ``kernel_worst``; None where no problem had kernel times (the CPU self-check)."""
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r.op, r.case), {})[r.impl] = r
    out = {}
    for (family, case), impls in by_case.items():
        ours = impls.get("trainops")
        others = [r for k, r in impls.items() if k != "trainops"]
        if ours is None or not others:
            continue
        s = out.setdefault(family, {**_ratios(), "odd_pct": [], "even_pct": [], "best_of": set(), "peer_problems": {},
                                    "peer_failed": {}, "best_of_ratios": _ratios(), "classes": {},
                                    "kernel_ratios": _ratios(), "kernel_classes": {}, "kernel_missing": {},
                                    "kernel_methods": {}})
        torch_peers = [r for r in others if r.impl in PEERS_TORCH]
        if torch_peers:
            best = min(torch_peers, key=lambda r: r.ms)
            _add_ratio(s, best.ms / ours.ms, case, best.impl)
        best = min(others, key=lambda r: r.ms)
        _add_ratio(s["best_of_ratios"], best.ms / ours.ms, case, best.impl)
        cls = ours.fields.get("issue42_class")
        if cls is not None:
            _add_ratio(s["classes"].setdefault(cls, _ratios()), best.ms / ours.ms, case, best.impl)
        for r in others:
            s["best_of"].add(r.impl)
            s["peer_problems"][r.impl] = s["peer_problems"].get(r.impl, 0) + 1
        for impl in ours.fields.get("peers_failed") or {}:
            s["peer_failed"][impl] = s["peer_failed"].get(impl, 0) + 1
        for r in (ours, *others):
            method = r.fields.get("kernel_method") if r.fields.get("kernel_ms") is not None else None
            s["kernel_methods"][method or "none"] = s["kernel_methods"].get(method or "none", 0) + 1
            if r.fields.get("kernel_ms") is None:
                s["kernel_missing"][r.impl] = s["kernel_missing"].get(r.impl, 0) + 1
        timed = [r for r in others if r.fields.get("kernel_ms") is not None]
        if ours.fields.get("kernel_ms") is not None and timed:
            best = min(timed, key=lambda r: r.fields["kernel_ms"])
            ratio = best.fields["kernel_ms"] / ours.fields["kernel_ms"]
            _add_ratio(s["kernel_ratios"], ratio, case, best.impl)
            if cls is not None:
                _add_ratio(s["kernel_classes"].setdefault(cls, _ratios()), ratio, case, best.impl)
        nbytes = ours.gbps * 1e6 * ours.ms
        if ours.pct_of_copy is not None and nbytes >= LARGE_BYTES:
            s["odd_pct" if ours.fields["row_length"] % 2 else "even_pct"].append(ours.pct_of_copy)
    for s in out.values():
        s["geomean_speedup"] = _geomean(s)
        for key in ("odd_pct", "even_pct"):
            values = s.pop(key)
            s[f"median_pct_of_copy_{key[:-4]}_rows"] = round(statistics.median(values), 1) if values else None
        s["best_of"] = sorted(s["best_of"])
        b = s.pop("best_of_ratios")
        s["geomean_speedup_best_of"], s["worst_best_of"], s["slower_best_of"] = _geomean(b), b["worst"], b["slower"]
        k = s.pop("kernel_ratios")
        s["kernel_problems"] = k["problems"]
        s["geomean_speedup_kernel_best_of"], s["worst_kernel_best_of"] = _geomean(k), k["worst"]
        s["slower_kernel_best_of"] = k["slower"]
        classes, kernel_classes = s.pop("classes"), s.pop("kernel_classes")
        s["issue42_classes"] = {cls: {"problems": c["problems"], "geomean_speedup_best_of": _geomean(c),
                                      "worst_best_of": c["worst"]} for cls, c in classes.items()}
        for cls, c in s["issue42_classes"].items():
            kc = kernel_classes.get(cls, _ratios())
            c.update(kernel_problems=kc["problems"], kernel_geomean=_geomean(kc), kernel_worst=kc["worst"])
    return out


def best_of_words(summary: dict) -> str:
    """'torch eager, torch.compile and quack': the peers any family's best-of took in."""
    names = {"torch": "torch eager"}
    peers = sorted({p for s in summary.values() for p in s.get("best_of", ())}, key=lambda p: (p != "torch", p))
    words = [names.get(p, p) for p in peers] or ["torch eager", "torch.compile"]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _x(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def summary_lines(summary: dict) -> list[str]:
    lines = [f"{'family':18s} {'shapes':>6s} {'geomean':>8s} {'slower':>6s} {'odd %copy':>9s} {'even %copy':>10s}  "
             "worst (ratio, shape, fastest torch)"]
    for family, s in summary.items():
        odd, even = s["median_pct_of_copy_odd_rows"], s["median_pct_of_copy_even_rows"]
        geomean = "-" if s["geomean_speedup"] is None else f"{s['geomean_speedup']:.2f}x"
        lines.append(f"{family:18s} {s['problems']:6d} {geomean:>8s} {s['slower']:6d} "
                     f"{'-' if odd is None else f'{odd:.1f}':>9s} {'-' if even is None else f'{even:.1f}':>10s}  "
                     f"{s['worst']}")
    lines += ["", f"against the best of {best_of_words(summary)} (per problem, the peers that ran and passed; "
              "kernel: GPU kernel time, host left out):",
              f"{'family':18s} {'geomean':>8s} {'slower':>6s} {'kernel':>8s} {'slower':>6s}  "
              f"{'best of (problems run, failed)':44s}  worst (ratio, shape, fastest peer); kernel worst"]
    for family, s in summary.items():
        peers = ", ".join(f"{p} {s['peer_problems'][p]}" + (f" ({s['peer_failed'][p]} failed)" if p in s["peer_failed"]
                                                            else "") for p in s["best_of"])
        failed_only = [p for p in s["peer_failed"] if p not in s["best_of"]]
        peers += "".join(f", {p} 0 ({s['peer_failed'][p]} failed)" for p in failed_only)
        kernel = _x(s.get("geomean_speedup_kernel_best_of"))
        kernel_slower = "-" if not s.get("kernel_problems") else str(s["slower_kernel_best_of"])
        lines.append(f"{family:18s} {s['geomean_speedup_best_of']:7.2f}x {s['slower_best_of']:6d} {kernel:>8s} "
                     f"{kernel_slower:>6s}  {peers:44s}  {s['worst_best_of']}; {s.get('worst_kernel_best_of')}")
    for family, s in summary.items():
        if s.get("kernel_missing"):
            methods = ", ".join(f"{m} {n}" for m, n in s["kernel_methods"].items())
            missing = ", ".join(f"{impl} {n}" for impl, n in s["kernel_missing"].items())
            lines.append(f"{family:18s} kernel time: rows by method: {methods}; without one (problems): {missing}")
    classes = [(family, cls, c) for family, s in summary.items() for cls, c in s["issue42_classes"].items()]
    if classes:
        lines += ["", "issue 42's shape classes against the best peer:",
                  f"{'family':18s} {'class':16s} {'shapes':>6s} {'geomean':>8s} {'kernel':>8s}  "
                  "worst (ratio, shape, fastest peer); kernel worst"]
        lines += [f"{family:18s} {cls:16s} {c['problems']:6d} {c['geomean_speedup_best_of']:7.2f}x "
                  f"{_x(c.get('kernel_geomean')):>8s}  {c['worst_best_of']}; {c.get('kernel_worst')}"
                  for family, cls, c in classes]
    return lines


def chart(rows, path: str, title: str) -> str:
    """Best peer's ms / trainops ms against row length (the peers that ran on each problem: torch
    eager, torch.compile, quack), one panel per family, colour by dtype."""
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
        ax.set_ylabel("best peer / trainops")
        ax.set_title(family, fontsize=9)
    axes[-1, 0].set_xlabel("row length (reduced axis; hidden size for rms_norm and swiglu)")
    handles = [plt.Line2D([], [], ls="", marker="o", color=c, label=d) for d, c in colours.items()]
    handles.append(plt.Line2D([], [], ls="", marker="^", color="black", label="not the last axis"))
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
        log=print, kernel: bool = True) -> tuple[list, dict, dict]:
    """(rows, summary, meta) of a sweep; see the module docstring. ``kernel``: also time each
    implementation's GPU kernels (``kernel_time``); off, or on the CPU, rows say why not."""
    from . import _free_device_memory, start

    env, ceiling = start(cpu, log=log)
    device = torch.device("cpu" if cpu else "cuda")
    max_elements = 1 << 14 if cpu else 1 << 26
    limits = {name: getattr(torch._dynamo.config, name) for name in ("recompile_limit", "accumulated_recompile_limit")
              if hasattr(torch._dynamo.config, name)}
    for name in limits:
        setattr(torch._dynamo.config, name, 4096)
    kernel_timer = no_kernel_time("cpu") if cpu else kernel_time if kernel else no_kernel_time("off")
    started, rows = time.perf_counter(), []
    ran: dict = {}
    skipped: dict = {}
    fixed_ran: dict = {}
    fixed_skipped: dict = {}
    fixed, drawn, repeats = plan(families, shapes, seed, max_elements,
                                 max_elements if cpu else ISSUE42_MAX_ELEMENTS, scale_fixed=cpu)
    counts = {family: sum(f == family for f, _ in drawn) + repeats.get(family, 0) for family in families}
    for family, n in counts.items():
        if n < shapes:
            log(f"{family}: {n} distinct problems within the bounds, fewer than the {shapes} asked")
    try:
        # issue 42's classes first, then the draws; each list round robin, so a time limit leaves a share to all
        for is_fixed, queue in ((True, fixed), (False, drawn)):
            done, not_started = (fixed_ran, fixed_skipped) if is_fixed else (ran, skipped)
            for family, problem in queue:
                if seconds is not None and time.perf_counter() - started > seconds:
                    not_started[family] = not_started.get(family, 0) + 1
                    continue
                rows += run_problem(family, problem, device, compiled=not cpu, peers=not cpu, ceiling=ceiling,
                                    log=log, kernel_timer=kernel_timer)
                done[family] = done.get(family, 0) + 1
        _free_device_memory()
    finally:
        for name, value in limits.items():
            setattr(torch._dynamo.config, name, value)
        _COMPILED.clear()
    meta = {"environment": env, "copy_ceiling_gbps": None if ceiling is None else round(ceiling, 1),
            "shapes_asked": shapes, "problems_drawn": counts,
            "problems_run": ran, "problems_not_started": skipped, "seed": seed,
            "problems_drawn_as_issue42": repeats,
            "issue42_problems": {family: sum(f == family for f, _ in fixed) for family in families},
            "issue42_problems_run": fixed_ran, "issue42_problems_not_started": fixed_skipped,
            "issue42_scaled_down": cpu, "kernel_time": None if cpu else kernel,
            "seconds": round(time.perf_counter() - started, 1)}
    return rows, summarise(rows), meta


__all__ = ["FAMILIES", "ISSUE42_CLASSES", "ROW_COUNTS", "ROW_LENGTHS", "best_of_words", "chart", "fixed_problems",
           "kernel_time", "load_rows", "no_kernel_time", "plan", "problems", "run", "run_problem", "summarise", "summary_lines", "sweep_case"]


def main(shapes: int = 200, seconds: float | None = None, families=FAMILIES, out: str | None = None,
         seed: int = 0, kernel: bool = True) -> int:
    """``python -m trainops bench --sweep``: run, print the per-family summary, write JSON and the chart."""
    import datetime as _dt_module
    import os

    from . import write_results

    cpu = not torch.cuda.is_available()
    rows, summary, meta = run(families, shapes, seconds, seed, cpu, kernel=kernel)
    print()
    print("\n".join(summary_lines(summary)))
    if meta["problems_not_started"] or meta["issue42_problems_not_started"]:
        print(f"not started (past --sweep-seconds {seconds:g}): issue 42's classes "
              f"{meta['issue42_problems_not_started']}, draws {meta['problems_not_started']}")
    if out is None:
        stamp = _dt_module.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = os.path.join("benchmarks", "results", f"sweep-{'cpu' if cpu else 'cuda'}-{stamp}.json")
    env = meta.pop("environment")
    write_results(out, env, {**meta, "summary": summary}, rows=rows)
    print(f"wrote {out}")
    print(chart(rows, os.path.splitext(out)[0] + ".png",
                f"best of {best_of_words(summary)} over trainops, {env['device']}, {env['date'][:10]}"
                + (" (CPU self-check)" if cpu else "")))
    return 0
