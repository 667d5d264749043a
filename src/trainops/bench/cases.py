"""Benchmark cases: every registered GPU kernel family at the ../shared/ANCHORS.md shapes.

A case builds its inputs once and returns ``{implementation: factory}``; a factory allocates what
that implementation needs (an optimizer's state, say) and returns the zero-argument call that is
timed. The call returns its output (or None) so the runner can compare it with the case's float64
reference. Bytes are the fewest the op must move (each input read once, each output written once).
Inputs are random normal data, never zeros; every GPU shape here is larger than the L2 cache.

Two kinds of lists: ``gpu_cases`` / ``cpu_cases`` (``python -m trainops bench``: each family's
main op against torch and the peers), and per family the variant studies that the scripts of
``benchmarks/`` run (each a front-end choosing shapes): ``cross_entropy_variant_cases`` /
``cross_entropy_sweep_cases``, ``gather_backward_stream_cases`` / ``gather_sweep_cases`` /
``embedding_forward_cases``, ``optimizer_variant_cases`` / ``optimizer_sweep_cases`` /
``optimizer_launch_bound_cases`` / ``optimizer_first_step_errors``, and
``softmax_config_cases``. Each takes a device, so the CPU tests build and run them on tiny shapes.
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import asdict
from typing import Callable

import torch
import torch.nn.functional as F

import trainops

from . import (cases_activations, cases_attention, cases_batch_norm, cases_broadcast, cases_convolution,
               cases_dropout, cases_gist, cases_normalization, cases_qk_norm_rotary, cases_rotary)
from .case import (Case, Impl, Timing, _dt, _heuristics_impls, _peer, _randn, deterministic_algorithms, rotate,
                   rotation_sets)


# -- softmax family ------------------------------------------------------------------------------

def _softmax_case(op: str, shape, dim: int, dtype, device, *, compiled: bool = True, pinned=None) -> Case:
    """One softmax-family problem: trainops (the registry's choice: its row's ``backend`` and
    ``kernel`` say which ran), torch, and with peers torch.compile (``compiled``), Liger and quack.
    ``pinned``: backends to time trainops under as well (rows ``trainops <backend>``, with
    ``trainops.backend(...)``); by default Triton where the choice is another backend on the GPU
    (quack's on long rows), so the bench keeps timing our kernel next to quack's own call."""
    backward = op.endswith("_backward")
    log = op.startswith("log_")

    def build(peers):
        x = _randn(shape, dtype, device, 0, 3.0)
        if not backward:
            inputs = (x,)
            torch_fn = (lambda t: torch.log_softmax(t, dim)) if log else (lambda t: torch.softmax(t, dim))
            reference = lambda: torch_fn(x.double())  # noqa: E731
        else:
            y = torch.log_softmax(x, dim) if log else torch.softmax(x, dim)
            dy = _randn(shape, dtype, device, 1)
            inputs = (dy, y)

            def torch_fn(dy, y):
                if log:
                    return torch._log_softmax_backward_data(dy, y, dim, y.dtype)
                return torch._softmax_backward_data(dy, y, dim, y.dtype)

            def reference():
                yd, dyd = y.double(), dy.double()
                if log:
                    return dyd - yd.exp() * dyd.sum(dim, keepdim=True)
                return yd * (dyd - (yd * dyd).sum(dim, keepdim=True))
        ours = getattr(trainops, op)
        strides = tuple(t.stride() for t in inputs)
        chosen = trainops.plan(op, shape=shape, dim=dim, dtype=dtype, device=device, strides=strides)
        impls = {"trainops": Impl(lambda: (lambda: ours(*inputs, dim)),
                                  fields={"backend": chosen.info.backend, "kernel": chosen.kernel.name})}
        others = pinned if pinned is not None else (() if chosen.info.backend in ("triton", "cpu") else ("triton",))
        for backend in others:
            with trainops.backend(backend):
                forced = trainops.plan(op, shape=shape, dim=dim, dtype=dtype, device=device, strides=strides)
            impls[f"trainops {backend}"] = Impl(lambda: (lambda: ours(*inputs, dim)),
                                                context=functools.partial(trainops.backend, backend),
                                                fields={"backend": backend, "kernel": forced.kernel.name})
        impls["torch"] = lambda: (lambda: torch_fn(*inputs))
        if peers:
            if compiled:
                compiled_fn = torch.compile(torch_fn, dynamic=False)
                impls["torch.compile"] = lambda: (lambda: compiled_fn(*inputs))
            liger = _peer("liger_kernel.ops.softmax", "LigerSoftmaxFunction")
            if liger is not None and op == "softmax" and dim in (-1, len(shape) - 1):
                impls["liger"] = lambda: (lambda: liger.apply(*inputs))
            last_of_2d = dim in (-1, len(shape) - 1) and len(shape) == 2
            quack_softmax = _peer("quack", "softmax")
            if quack_softmax is not None and op == "softmax" and last_of_2d:
                impls["quack"] = lambda: (lambda: quack_softmax(*inputs))
            quack_backward = _peer("quack.softmax", "softmax_bwd")   # quack's own allocating call, as ours
            if quack_backward is not None and op == "softmax_backward" and last_of_2d:
                impls["quack"] = lambda: (lambda: quack_backward(*inputs))
        return impls, reference

    nbytes = math.prod(shape) * dtype.itemsize * (3 if backward else 2)
    label = "x".join(map(str, shape)) + (f" dim={dim}" if dim not in (-1, len(shape) - 1) else "") + f" {_dt(dtype)}"
    return Case(op, label, nbytes, build)


def softmax_cases(device, quick: bool) -> list[Case]:
    if quick:
        return [_softmax_case("softmax", (4096, 4096), -1, torch.bfloat16, device),
                _softmax_case("log_softmax_backward", (32, 512, 1024), 1, torch.float32, device)]
    ops = ("softmax", "softmax_backward", "log_softmax", "log_softmax_backward")
    rows = [(32768, 1024), (16384, 4096), (4096, 32768), (1024, 131072), (128, 262144)]
    out = [_softmax_case(op, s, -1, torch.bfloat16, device) for op in ops for s in rows]
    out += [_softmax_case(op, (4096, 32768), -1, torch.float32, device) for op in ops]
    out += [_softmax_case(op, (32, 512, 4096), 1, torch.bfloat16, device) for op in ops]
    return out


def _config_label(config) -> str:
    return config.kind + " " + " ".join(f"{k}={v}" for k, v in asdict(config).items() if k != "kind")


def softmax_configs(problem, layout):
    """Launch configurations worth timing for one softmax-family problem: the heuristic's choice
    first, then warps per fused tile (rows of up to 65536 elements), column tiles x warps (a batch
    axis more contiguous than the reduced one), and for rows of 16384 or more the looped and split
    plans over their block sizes and warps."""
    from trainops.layout import next_pow2
    from trainops.ops import softmax as S

    default = S._choose_config(problem, layout)
    yield default
    n = layout.n
    column = default.block_i > 1 and layout.stride_inner[-1] < layout.stride_n[-1]
    if column:
        for bi in (16, 32, 64, 128):
            for w in (4, 8, 16, 32):
                if bi * next_pow2(n) <= 65536:
                    yield S.TritonConfig("fused", bi, next_pow2(n), w)
        return
    if next_pow2(n) <= 65536:
        for w in (4, 8, 16, 32):
            yield S.TritonConfig("fused", default.block_i if default.kind == "fused" else 1, next_pow2(n), w)
    if n >= 16384:
        for bn in (2048, 4096, 8192, 16384):
            for w in (4, 8, 16, 32):
                yield S.TritonConfig("looped", 1, bn, w, 1, next_pow2(n))
        for splits in (2, 4, 8, 16, 32):
            for bn in (4096, 8192):
                for w in (8, 16):
                    chunk = -(-n // (splits * bn)) * bn
                    if chunk >= bn:
                        yield S.TritonConfig("split", 1, bn, w, next_pow2(-(-n // chunk)), chunk)


def _softmax_config_case(op: str, shape, dim: int, dtype, device) -> Case:
    """Every softmax_configs launch of one problem through ``ops.softmax._prepare_triton(problem,
    config)`` (the kernel alone, no custom-op layer), into a NaN-poisoned output; rows carry the
    config and whether it is the heuristic's (``default``). A config seen twice is timed once."""
    from trainops.ops import softmax as S

    def build(peers):
        gen = torch.Generator(device=device).manual_seed(0)
        x = (torch.randn(shape, device=device, generator=gen) * 3).to(dtype)
        if op == "softmax":
            tensors = (x,)
        else:
            tensors = (torch.randn(shape, device=device, generator=gen).to(dtype), torch.softmax(x, dim))

        def reference():
            if op == "softmax":
                return torch.softmax(x.double(), dim)
            dy, y = (t.double() for t in tensors)
            return y * (dy - (y * dy).sum(dim, keepdim=True))
        problem = S._describe(op, shape, dim, dtype, device, strides=tuple(t.stride() for t in tensors))
        layout = S.reduction_layout(problem.shape, problem.dim, problem.strides + (problem.out_strides,))
        default = S._choose_config(problem, layout)

        def factory(config):
            launch = S._prepare_triton(problem, config)
            out = problem.new_output().fill_(float("nan"))

            def call():
                launch.run(tensors, out)
                return out
            return call
        impls = {}
        for config in softmax_configs(problem, layout):
            fields = {"config": asdict(config), "default": config == default}
            impls.setdefault(_config_label(config), Impl(functools.partial(factory, config), fields=fields))
        return impls, reference

    nbytes = math.prod(shape) * dtype.itemsize * (2 if op == "softmax" else 3)
    label = "x".join(map(str, shape)) + (f" dim={dim}" if dim not in (-1, len(shape) - 1) else "") + f" {_dt(dtype)}"
    return Case(op, label, nbytes, build, fields=dict(shape=list(shape), dim=dim, dtype=_dt(dtype)),
                timing=Timing(warmup=10, rep=60))


def softmax_config_cases(device, problems) -> list[Case]:
    """The softmax config sweep (benchmarks/sweep_softmax.py): ``problems`` are (op, shape, dim,
    dtype) with op "softmax" or "softmax_backward"."""
    return [_softmax_config_case(op, shape, dim, dtype, device) for op, shape, dim, dtype in problems]


# -- gather / embedding ----------------------------------------------------------------------------

def _embedding_backward_case(tokens, dim, rows, dtype, device) -> Case:
    def build(peers):
        dy = _randn((tokens, dim), dtype, device, 2)
        gen = torch.Generator(device=device).manual_seed(3)
        idx = torch.randint(0, rows, (tokens,), device=device, generator=gen)
        ours = lambda: trainops.ops.gather.gather_backward_op(dy, idx, 0, [rows, dim], True, None, False, False,  # noqa
                                                         False)
        def torch_backward(dy, idx):
            return torch.ops.aten.embedding_dense_backward(dy, idx, rows, -1, False)

        atomic = lambda: trainops.ops.gather.gather_backward_op(dy, idx, 0, [rows, dim], False, None, False, False,  # noqa
                                                           False)
        impls = {"trainops": lambda: ours, "trainops atomic (deterministic=False)": lambda: atomic,
                 "torch": lambda: (lambda: torch_backward(dy, idx)),
                 "torch index_add_": lambda: (lambda: torch.zeros(rows, dim, device=device, dtype=dtype)
                                              .index_add_(0, idx, dy))}
        if peers:
            compiled = torch.compile(torch_backward, dynamic=False)
            impls["torch.compile"] = lambda: (lambda: compiled(dy, idx))
        reference = lambda: torch.zeros(rows, dim, device=device, dtype=torch.float64).index_add_(0, idx, dy.double())  # noqa
        return impls, reference

    nbytes = tokens * dim * dtype.itemsize + tokens * 8 + rows * dim * dtype.itemsize
    return Case("gather_backward", f"{tokens}x{dim} into {rows} {_dt(dtype)}", nbytes, build)


def _embedding_forward_case(tokens, dim, rows, dtype, device) -> Case:
    def build(peers):
        weight = _randn((rows, dim), dtype, device, 4)
        gen = torch.Generator(device=device).manual_seed(5)
        idx = torch.randint(0, rows, (tokens,), device=device, generator=gen)
        impls = {"trainops": lambda: (lambda: trainops.embedding(idx, weight, check_index=False)),
                 "torch": lambda: (lambda: F.embedding(idx, weight))}
        if peers:
            compiled = torch.compile(F.embedding, dynamic=False)
            impls["torch.compile"] = lambda: (lambda: compiled(idx, weight))
        return impls, lambda: weight.double()[idx]

    return Case("gather", f"{tokens} rows of {rows}x{dim} {_dt(dtype)}", 2 * tokens * dim * dtype.itemsize + tokens * 8,
                build)


def gather_cases(device, quick: bool) -> list[Case]:
    if quick:
        return [_embedding_backward_case(4096, 1024, 32000, torch.bfloat16, device)]
    return [_embedding_forward_case(32768, 4096, 128256, torch.bfloat16, device),
            _embedding_backward_case(32768, 4096, 128256, torch.bfloat16, device),
            _embedding_backward_case(8192, 4096, 128256, torch.bfloat16, device)]


def index_stream(kind: str, tokens: int, rows: int, seed: int, device) -> torch.Tensor:
    """``tokens`` indices into [0, rows): "uniform", or "zipf" (p(rank r) ~ 1/r^1.1 over the
    vocabulary, ids shuffled so that hot rows are scattered as real tokens are)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if kind == "uniform":
        return torch.randint(0, rows, (tokens,), device=device, generator=gen)
    weights = 1.0 / torch.arange(1, rows + 1, device=device, dtype=torch.float32) ** 1.1
    ranks = torch.multinomial(weights, tokens, replacement=True, generator=gen)
    return torch.randperm(rows, device=device, generator=gen)[ranks]


def _gather_backward_runs(rows: int, peers: bool) -> dict[str, tuple[Callable, dict]]:
    """The embedding weight gradient as autograd calls it (indices in [0, rows), checked in the
    forward): {name: (fn(dy, idx), Impl keywords)}."""
    def trainops_sorted(dy, idx):
        return trainops.ops.gather.gather_backward_op(dy, idx, 0, [rows, dy.shape[1]], True, None, False, False, False)

    def trainops_atomic(dy, idx):
        return trainops.ops.gather.gather_backward_op(dy, idx, 0, [rows, dy.shape[1]], False, None, False, False, False)

    def trainops_checked(dy, idx):
        return trainops.gather_backward(dy, idx, 0, [rows, dy.shape[1]])

    def torch_default(dy, idx):
        return torch.ops.aten.embedding_dense_backward(dy, idx, rows, -1, False)

    def torch_index_add(dy, idx):
        return torch.zeros(rows, dy.shape[1], device=dy.device, dtype=dy.dtype).index_add_(0, idx, dy)

    runs = {"trainops": (trainops_sorted, {}), "trainops atomic": (trainops_atomic, {}),
            "trainops checked": (trainops_checked, {}), "torch": (torch_default, {}),
            "torch deterministic": (torch_default, {"context": deterministic_algorithms}),
            "torch index_add_": (torch_index_add, {})}
    liger = _peer("liger_kernel.ops.experimental.embedding", "LigerEmbeddingFunction") if peers else None
    if liger is not None:
        def liger_backward(dy, idx):
            ctx = types.SimpleNamespace(saved_tensors=(idx, torch.empty(rows, dy.shape[1], device=dy.device,
                                                                          dtype=dy.dtype)))
            return liger.backward(ctx, dy)[0]
        runs["liger"] = (liger_backward, {})
    return runs


def _gather_stream_case(tokens, dim, rows, dtype, stream, device, l2_bytes, runs_for) -> Case:
    """dY (tokens x dim) scattered into rows x dim along an index ``stream``; 4 input sets
    (rotation_sets) when the case fits in 4x L2; the hottest row's count and the number of input
    sets are row fields."""
    nbytes = tokens * dim * dtype.itemsize + tokens * 8 + rows * dim * dtype.itemsize

    def build(peers):
        sets = []
        for seed in range(rotation_sets(nbytes, l2_bytes)):
            idx = index_stream(stream, tokens, rows, seed, device)
            gen = torch.Generator(device=device).manual_seed(100 + seed)
            sets.append((torch.randn(tokens, dim, device=device, generator=gen).to(dtype), idx))
        dy, idx = sets[0]
        hot = int(torch.bincount(idx, minlength=rows).max())
        impls = {name: Impl(functools.partial(rotate, fn, sets), **kw) for name, (fn, kw) in runs_for(peers).items()}

        def reference():
            return torch.zeros(rows, dim, device=device, dtype=torch.float64).index_add_(0, idx, dy.double())
        return impls, reference, {"hottest_row_count": hot, "input_sets": len(sets)}

    return Case("gather_backward", f"{tokens}x{dim} into {rows} {_dt(dtype)} {stream}", nbytes, build,
                fields=dict(tokens=tokens, dim=dim, rows=rows, dtype=_dt(dtype), stream=stream))


def gather_backward_stream_cases(device, shapes, l2_bytes: int, streams=("uniform", "zipf")) -> list[Case]:
    """benchmarks/bench_gather.py's rows: per (tokens, dim, rows, dtype) and index stream, the
    sorted (deterministic), atomic and index-checked trainops kernels against torch's default,
    torch in deterministic mode (around that implementation only), index_add_ and Liger."""
    return [_gather_stream_case(tokens, dim, rows, dtype, stream, device, l2_bytes,
                                functools.partial(_gather_backward_runs, rows))
            for tokens, dim, rows, dtype in shapes for stream in streams]


GATHER_SWEEP_NAMES = ("row_block", "row_tile", "chunk")
GATHER_SWEEP = [(4096, 4096, 64), (4096, 4096, 32), (4096, 8192, 64), (4096, 4096, 128), (2048, 4096, 64)]


def gather_sweep_cases(device, shapes, l2_bytes: int, variants=GATHER_SWEEP, streams=("uniform", "zipf")) -> list[Case]:
    """The sorted kernel under GatherHeuristics variants (tile shapes and chunk), both streams."""
    from trainops.ops.gather import GatherHeuristics

    def runs_for(rows, peers):
        sorted_run = _gather_backward_runs(rows, False)["trainops"][0]
        return {name: (sorted_run, kw) for name, kw in _heuristics_impls(
            GatherHeuristics, GATHER_SWEEP_NAMES, variants,
            lambda v: "sorted " + " ".join(f"{n}={x}" for n, x in zip(GATHER_SWEEP_NAMES, v)))}
    return [_gather_stream_case(tokens, dim, rows, dtype, stream, device, l2_bytes, functools.partial(runs_for, rows))
            for tokens, dim, rows, dtype in shapes for stream in streams]


def embedding_forward_cases(device, shapes) -> list[Case]:
    """Embedding forward (rows of weight gathered by a uniform index stream): trainops unchecked
    and index-checked against torch; every output must equal weight[idx] exactly."""
    def case(tokens, dim, rows, dtype):
        def build(peers):
            weight = _randn((rows, dim), dtype, device, 4)
            idx = index_stream("uniform", tokens, rows, 0, device)
            impls = {"trainops": lambda: (lambda: trainops.embedding(idx, weight, check_index=False)),
                     "trainops checked": lambda: (lambda: trainops.embedding(idx, weight)),
                     "torch": lambda: (lambda: F.embedding(idx, weight))}
            return impls, lambda: weight.double()[idx]
        nbytes = 2 * tokens * dim * dtype.itemsize + tokens * 8
        return Case("gather", f"{tokens} rows of {rows}x{dim} {_dt(dtype)}", nbytes, build,
                    fields=dict(tokens=tokens, dim=dim, rows=rows, dtype=_dt(dtype)), tolerance=0.0)
    return [case(*shape) for shape in shapes]


# -- cross-entropy -------------------------------------------------------------------------------------

def _cross_entropy_case(rows, classes, dtype, device) -> Case:
    def build(peers):
        x = _randn((rows, classes), dtype, device, 6, 2.0).requires_grad_()
        gen = torch.Generator(device=device).manual_seed(7)
        target = torch.randint(0, classes, (rows,), device=device, generator=gen)

        def step(loss_fn, on=None):
            def run():
                x.grad = None
                inp = x if on is None else on()
                loss_fn(inp, target).backward()
                return x.grad
            return run

        impls = {"trainops": lambda: step(trainops.cross_entropy), "torch": lambda: step(F.cross_entropy)}
        if peers:
            compiled = torch.compile(F.cross_entropy, dynamic=False)
            impls["torch.compile"] = lambda: step(compiled)
            liger = _peer("liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction")
            if liger is not None:
                # Liger writes the gradient over its input: give it a copy, so x stays the logits.
                impls["liger"] = lambda: _liger_ce_step(liger, x, target)
            quack_ce = _peer("quack", "cross_entropy")
            if quack_ce is not None:
                impls["quack"] = lambda: step(quack_ce)

        def reference():
            xd = x.detach().double().requires_grad_()
            F.cross_entropy(xd, target).backward()
            return xd.grad
        return impls, reference

    return Case("cross_entropy", f"{rows}x{classes} {_dt(dtype)} fwd+bwd", 2 * rows * classes * dtype.itemsize, build)


def _liger_ce_step(liger, x, target):
    work = x.detach().clone().requires_grad_()

    def run():
        work.grad = None
        liger.apply(work, target, None)[0].backward()
        return work.grad
    return run


def cross_entropy_cases(device, quick: bool) -> list[Case]:
    if quick:
        return [_cross_entropy_case(2048, 32000, torch.bfloat16, device)]
    return [_cross_entropy_case(8192, 32000, torch.bfloat16, device),
            _cross_entropy_case(8192, 128256, torch.bfloat16, device),
            _cross_entropy_case(4096, 262144, torch.bfloat16, device)]


def _ce_step(loss_fn):
    """A training step's loss: forward, then backward into the leaf's .grad (reset each call)."""
    def run(x, t):
        x.grad = None
        loss_fn(x, t).backward()
        return x.grad
    return run


def _ce_forward_only(x, t):
    with torch.no_grad():
        trainops.cross_entropy(x, t, check_target=False)
    return None


def _ce_family_case(rows, classes, dtype, device, runs_for) -> Case:
    """benchmarks/bench_cross_entropy.py's case: logits x (normal x 2) and targets from one
    generator seeded rows + classes; the logits are restored before each implementation (Liger and
    inplace_backward write the gradient over them). runs_for(peers, nbytes) -> {name: (run(x, t),
    Impl keywords)}."""
    nbytes = 2 * rows * classes * dtype.itemsize

    def build(peers):
        gen = torch.Generator(device=device).manual_seed(rows + classes)
        x = (torch.randn(rows, classes, device=device, generator=gen) * 2).to(dtype).requires_grad_()
        t = torch.randint(0, classes, (rows,), device=device, generator=gen)
        pristine = x.detach().clone()

        def restored(run):
            with torch.no_grad():
                x.copy_(pristine)
            return lambda: run(x, t)

        def reference():
            xd = x.detach().double().requires_grad_()
            F.cross_entropy(xd, t).backward()
            return xd.grad
        impls = {name: Impl(functools.partial(restored, run), **kw)
                 for name, (run, kw) in runs_for(peers, nbytes).items()}
        return impls, reference

    return Case("cross_entropy", f"{rows}x{classes} {_dt(dtype)} fwd+bwd", nbytes, build,
                fields=dict(rows=rows, classes=classes, dtype=_dt(dtype)), timing=Timing(warmup=10, rep=100))


def _ce_variant_runs(peers: bool, nbytes: int) -> dict[str, tuple[Callable, dict]]:
    runs = {"trainops": (_ce_step(lambda x, t: trainops.cross_entropy(x, t)), {}),
            "trainops unchecked": (_ce_step(lambda x, t: trainops.cross_entropy(x, t, check_target=False)), {}),
            "trainops fp32 loss + z": (_ce_step(lambda x, t: trainops.cross_entropy(x, t, loss_dtype=torch.float32,
                                                                                    z_loss=1e-4)), {}),
            "torch": (_ce_step(lambda x, t: F.cross_entropy(x, t)), {})}
    if peers:
        runs["torch.compile"] = (_ce_step(torch.compile(lambda x, t: F.cross_entropy(x, t), dynamic=False)), {})
    runs["trainops forward only (no grad)"] = (_ce_forward_only, {"nbytes": nbytes // 2})  # no gradient written
    # the gradient over the logits: x.view_as(x) is a non-leaf whose backward is a free reshape; it clobbers x
    runs["trainops inplace_backward"] = (_ce_step(lambda x, t: trainops.cross_entropy(x.view_as(x), t,
                                                                                     inplace_backward=True)), {})
    liger = _peer("liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction") if peers else None
    if liger is not None:
        runs["liger"] = (_ce_step(lambda x, t: liger.apply(x, t, None)[0]), {})  # writes its gradient into x
    quack_ce = _peer("quack", "cross_entropy") if peers else None
    if quack_ce is not None:
        runs["quack"] = (_ce_step(quack_ce), {})
    return runs


def cross_entropy_variant_cases(device, shapes, dtype=torch.bfloat16) -> list[Case]:
    """Per (rows, classes): trainops (checked targets, unchecked, float32 loss + z-loss, forward
    only (no gradient: half the bytes), inplace_backward) against torch, and with peers
    torch.compile, Liger and quack when installed."""
    return [_ce_family_case(rows, classes, dtype, device, _ce_variant_runs) for rows, classes in shapes]


CE_SWEEP_NAMES = ("first_pass_evict", "grad_store", "stream_programs_per_sm")
CE_SWEEP = [("evict_last", ".cs", 1), ("", "", 1), ("evict_last", "", 1), ("", ".cs", 1), ("evict_last", ".cs", 2)]


def cross_entropy_sweep_cases(device, shapes, dtype=torch.bfloat16, variants=CE_SWEEP) -> list[Case]:
    """Unchecked trainops cross-entropy under CrossEntropyHeuristics variants: the cache hints of
    streamed (two-pass) rows and the persistent grid of the streaming plan."""
    from trainops.ops.cross_entropy import CrossEntropyHeuristics

    def runs_for(peers, nbytes):
        run = _ce_step(lambda x, t: trainops.cross_entropy(x, t, check_target=False))
        return {name: (run, kw) for name, kw in _heuristics_impls(
            CrossEntropyHeuristics, CE_SWEEP_NAMES, variants,
            lambda v: "trainops unchecked " + " ".join(f"{n}={x or '-'}" for n, x in zip(CE_SWEEP_NAMES, v)))}
    return [_ce_family_case(rows, classes, dtype, device, runs_for) for rows, classes in shapes]


# -- optimizers, loss scaling, gradient accumulation ------------------------------------------------------

def _param_list(total, count, dtype, device, seed=8):
    n = total // count
    params = [_randn((n,), dtype, device, seed + i).requires_grad_() for i in range(count)]
    for i, p in enumerate(params):
        p.grad = _randn((n,), dtype, device, 1000 + seed + i, 1e-2)
    return params


def _optimizer_case(name, total, count, bytes_per_param, device) -> Case:
    def build(peers):
        params = _param_list(total, count, torch.float32, device)
        kwargs = dict(lr=1e-3, momentum=0.9) if name == "SGD" else dict(lr=1e-3)
        op_cls = getattr(trainops.optim, name)
        impls = {"trainops": lambda: op_cls(params, **kwargs).step}
        if hasattr(torch.optim, name):
            torch_cls = getattr(torch.optim, name)
            impls["torch fused"] = lambda: torch_cls(params, fused=True, **kwargs).step
            impls["torch foreach"] = lambda: torch_cls(params, foreach=True, **kwargs).step
            if peers:
                impls["torch.compile (foreach step)"] = lambda: _compiled_step(torch_cls(params, foreach=True, **kwargs))
        return impls, None

    op = {"SGD": "sgd_step", "AdamW": "adam_step", "LAMB": "lamb_step"}[name]
    return Case(op, f"{name} {total / 1e9:.3f} B fp32 params in {count} tensors", total * bytes_per_param, build)


def _compiled_step(opt):
    """torch.compile of a torch optimizer's step (PyTorch's "compiled optimizer" recipe)."""
    step = torch.compile(opt.step, fullgraph=False)
    step()  # compiles
    return step


def _tensor_list_case(op, total, count, device) -> Case:
    """all_finite / unscale / grad_stats / accumulate / zero over a model-sized list of float32 tensors."""
    def build(peers):
        tensors = _param_list(total, count, torch.float32, device)
        grads = [p.grad for p in tensors]
        found = torch.zeros((), device=device)
        inv = torch.tensor(1.0, device=device)
        if op == "all_finite":
            impls = {"trainops": lambda: (lambda: trainops.ops.amp.all_finite(grads, found)),
                     "torch (check and unscale by 1)":
                         lambda: (lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv))}
        elif op == "unscale":
            impls = {"trainops": lambda: (lambda: trainops.ops.amp.unscale_(grads, inv, found)),
                     "torch": lambda: (lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv))}
        elif op == "grad_stats":
            impls = {"trainops": lambda: (lambda: trainops.ops.amp.grad_stats(grads, max_norm=1.0).norm),
                     "torch get_total_norm": lambda: (lambda: torch.linalg.vector_norm(
                         torch.stack(torch._foreach_norm(grads, 2.0)), 2.0))}
        elif op == "accumulate":
            acc = [t.detach() for t in tensors]
            impls = {"trainops": lambda: (lambda: trainops.grad.accumulate_(acc, grads, 1.0)),
                     "torch foreach": lambda: (lambda: torch._foreach_add_(acc, grads))}
        else:
            impls = {"trainops": lambda: (lambda: trainops.grad.zero_(grads)),
                     "torch foreach": lambda: (lambda: torch._foreach_zero_(grads))}
        return impls, None

    per = {"all_finite": 4, "unscale": 8, "grad_stats": 4, "accumulate": 12, "zero": 4}[op]
    return Case(op, f"{total / 1e9:.3f} B fp32 in {count} tensors", total * per, build)


def _update_scale_case(device) -> Case:
    """The loss-scale update: one program on three scalars (a launch-latency measurement)."""
    def build(peers):
        scale, tracker = torch.full((), 65536.0, device=device), torch.zeros((), dtype=torch.int32, device=device)
        found = torch.zeros((), device=device)
        impls = {"trainops": lambda: (lambda: trainops.ops.amp.update_scale_(scale, tracker, found, 2.0, 0.5, 2000)),
                 "torch": lambda: (lambda: torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2000))}
        return impls, None

    return Case("update_scale", "scale, tracker, found_inf", 12, build)


def multi_tensor_cases(device, quick: bool) -> list[Case]:
    total, count = (16_000_000, 16) if quick else (1_485_000_000, 96)
    cases = [_optimizer_case("AdamW", total, count, 28, device)]
    if quick:
        return cases
    cases += [_optimizer_case("SGD", total, count, 20, device), _optimizer_case("LAMB", total, count, 40, device)]
    cases += [_tensor_list_case(op, total // 2, count, device)
              for op in ("all_finite", "unscale", "grad_stats", "accumulate", "zero")]
    return cases + [_update_scale_case(device)]


def optimizer_params(dtype, count: int, total: int, device, seed: int = 0) -> list[torch.Tensor]:
    """``count`` leaf tensors of total // count elements with gradients (x 1e-2), all drawn from
    one generator (parameters first, then gradients)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = total // count
    params = [torch.randn(n, device=device, generator=gen).to(dtype).requires_grad_() for _ in range(count)]
    for p in params:
        p.grad = (torch.randn(n, device=device, generator=gen) * 1e-2).to(dtype)
    return params


class ScaledStep:
    """scaler.step(opt) + scaler.update() on gradients that were already scaled (the timed unit)."""

    def __init__(self, scaler, opt, device):
        self.scaler, self.opt = scaler, opt
        scaler.scale(torch.ones((), device=device))  # creates the scale tensor, as scaling a loss would

    def step(self):
        self.scaler.step(self.opt)
        self.scaler.update()


class ClippedStep:
    """clip_grad_norm_ then step: torch's way to clip (the timed unit)."""

    def __init__(self, params, opt, max_norm=1.0):
        self.params, self.opt, self.max_norm = params, opt, max_norm

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.opt.step()


def _step_of(make, params):
    return make(params).step


def _optimizer_study_case(label, op, dtype, total, count, bytes_per_param, makers, device, timing) -> Case:
    """One parameter list shared by the implementations in turn (each a fresh optimizer over it);
    makers: {name: (make(params) -> object with .step(), bytes per parameter or None for the
    case's[, Impl keywords])}. No reference: optimizer_first_step_errors checks the steps."""
    def build(peers):
        params = optimizer_params(dtype, count, total, device)
        impls = {}
        for name, (make, own, *extra) in makers.items():
            kw = extra[0] if extra else {}
            per = own or bytes_per_param
            impls[name] = Impl(functools.partial(_step_of, make, params), nbytes=total * per,
                               context=kw.get("context"), fields={"bytes_per_param": per, **kw.get("fields", {})})
        return impls, None
    return Case(op, label, total * bytes_per_param, build, fields=dict(params=total, tensors=count, dtype=_dt(dtype)),
                timing=timing)


def optimizer_variant_cases(device, total: int = 1_485_000_000, count: int = 96) -> list[Case]:
    """benchmarks/bench_optim.py's cases. Bytes per parameter are the fewest the step must move:
    AdamW reads p, g, m, v and writes p, m, v (28 B in float32); with bf16 parameters and a float32
    master copy it reads master, g and writes master, p (28 B too; a bf16 state 16 B); SGD with
    momentum 20 B; LAMB 40 B (the trust ratio needs the whole tensor's update norm before any
    parameter is written: pass 1 reads p, g, m, v and writes m, v, pass 2 reads p, m, v and writes p).
    With a global-norm clip or a GradScaler the gradients are read once more (+4 B)."""
    fp32, bf16 = torch.float32, torch.bfloat16
    adamw, sgd = torch.optim.AdamW, torch.optim.SGD
    ours = trainops.optim
    do_bench_300, do_bench_200 = Timing(warmup=50, rep=300), Timing(warmup=50, rep=200)
    return [
        _optimizer_study_case("adamw fp32", "adam_step", fp32, total, count, 28, {
            "torch foreach": (lambda p: adamw(p, lr=1e-3, foreach=True), None),
            "torch fused": (lambda p: adamw(p, lr=1e-3, fused=True), None),
            "trainops": (lambda p: ours.AdamW(p, lr=1e-3), None),
            "trainops lamb": (lambda p: ours.LAMB(p, lr=1e-3), 40)}, device, do_bench_300),
        _optimizer_study_case("adamw fp32 + clip/scaler", "adam_step", fp32, total, count, 28, {
            "torch fused + clip_grad_norm_": (lambda p: ClippedStep(p, adamw(p, lr=1e-3, fused=True)), 32),
            "trainops max_grad_norm": (lambda p: ours.AdamW(p, lr=1e-3, max_grad_norm=1.0), 32),
            "torch GradScaler + torch fused": (lambda p: ScaledStep(torch.amp.GradScaler(torch.device(device).type),
                                                                    adamw(p, lr=1e-3, fused=True), device), 32),
            "trainops GradScaler + trainops": (lambda p: ScaledStep(trainops.amp.GradScaler(torch.device(device).type),
                                                                    ours.AdamW(p, lr=1e-3), device), 32)},
            device, do_bench_200),
        _optimizer_study_case("adamw bf16 params", "adam_step", bf16, total, count, 28, {
            "torch fused (bf16 state)": (lambda p: adamw(p, lr=1e-3, fused=True), 16),
            "trainops fp32 master + state": (lambda p: ours.AdamW(p, lr=1e-3, master_weights=True), 28),
            "trainops bf16 state, no master": (lambda p: ours.AdamW(p, lr=1e-3, state_dtype=bf16), 16)},
            device, do_bench_300),
        _optimizer_study_case("sgd momentum fp32", "sgd_step", fp32, total, count, 20, {
            "torch foreach": (lambda p: sgd(p, lr=1e-3, momentum=0.9, foreach=True), None),
            "torch fused": (lambda p: sgd(p, lr=1e-3, momentum=0.9, fused=True), None),
            "trainops": (lambda p: ours.SGD(p, lr=1e-3, momentum=0.9), None)}, device, do_bench_300)]


MULTI_TENSOR_SWEEP = [(block, warps) for block in (1024, 2048, 4096, 8192) for warps in (4, 8, 16)]


def optimizer_sweep_cases(device, total: int = 1_485_000_000, count: int = 96,
                          variants=MULTI_TENSOR_SWEEP) -> list[Case]:
    """trainops AdamW (float32) under MultiTensorHeuristics(block, warps) variants, each in force
    while its optimizer is made and stepped."""
    from trainops.ops.multi_tensor import MultiTensorHeuristics

    makers = {name: (lambda p: trainops.optim.AdamW(p, lr=1e-3), None, kw) for name, kw in _heuristics_impls(
        MultiTensorHeuristics, ("block", "warps"), variants, lambda v: f"BLOCK={v[0]} warps={v[1]}")}
    return [_optimizer_study_case("sweep adamw fp32", "adam_step", torch.float32, total, count, 28, makers, device,
                                  Timing(warmup=50, rep=200))]


def optimizer_launch_bound_cases(device, count: int = 200, numel: int = 4096) -> list[Case]:
    """AdamW over ``count`` small float32 tensors (default hyper-parameters), where the host's
    launch path is the cost: 20 steps, then CUDA events around 200 back-to-back steps."""
    adamw = torch.optim.AdamW
    return [_optimizer_study_case(f"small {count}x{numel} fp32", "adam_step", torch.float32, count * numel, count, 28, {
        "torch foreach": (lambda p: adamw(p, foreach=True), None),
        "torch fused": (lambda p: adamw(p, fused=True), None),
        "trainops": (lambda p: trainops.optim.AdamW(p), None)}, device, Timing("events", warmup=20, rep=200))]


def _first_step_error(make_ref, make_ours, dtype, device, count, numel, master=False, tol=1e-5) -> float:
    """Relative error of our first step against torch's on ``count`` tensors of ``numel``."""
    ref_p = optimizer_params(torch.float32 if master else dtype, count, count * numel, device, seed=1)
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


def optimizer_first_step_errors(device, count: int = 10, numel: int = 100_003) -> dict[str, float]:
    """Our first step against torch fused's (AdamW, AdamW with a clip that does not bind, AdamW on
    bf16 parameters with a float32 master copy, SGD with momentum): relative errors, each < 1e-5
    or AssertionError."""
    fp32, bf16 = torch.float32, torch.bfloat16
    adamw_fused = lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)  # noqa: E731
    checks = {"adamw": (adamw_fused, lambda p: trainops.optim.AdamW(p, lr=1e-3), fp32, False),
              "adamw_clip": (adamw_fused, lambda p: trainops.optim.AdamW(p, lr=1e-3, max_grad_norm=1e6), fp32, False),
              "adamw_bf16_master": (adamw_fused, lambda p: trainops.optim.AdamW(p, lr=1e-3, master_weights=True),
                                    bf16, True),
              "sgd": (lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, fused=True),
                      lambda p: trainops.optim.SGD(p, lr=1e-3, momentum=0.9), fp32, False)}
    return {name: _first_step_error(ref, ours, dtype, device, count, numel, master)
            for name, (ref, ours, dtype, master) in checks.items()}


def _family_cases():
    """The case modules of the families whose cases live beside this one (``cases_<family>.py``, which
    import what they share from ``trainops.bench.case``, never this module): (gpu_cases, cpu_cases) pairs."""
    return [(cases_normalization.normalization_cases, cases_normalization.normalization_cpu_cases),
            (cases_batch_norm.batch_norm_cases, cases_batch_norm.batch_norm_cpu_cases),
            (cases_activations.activation_cases, lambda: cases_activations.activation_cases(torch.device("cpu"), True)),
            (cases_rotary.rotary_cases, cases_rotary.rotary_cpu_cases),
            (cases_dropout.dropout_cases, cases_dropout.dropout_cpu_cases),
            (cases_attention.attention_cases, lambda: cases_attention.attention_cases(torch.device("cpu"), True)),
            (cases_gist.gist_cases, cases_gist.gist_cpu_cases),
            (cases_broadcast.broadcast_cases, cases_broadcast.broadcast_cpu_cases),
            (cases_convolution.convolution_cases, cases_convolution.convolution_cpu_cases),
            (cases_qk_norm_rotary.qk_norm_rotary_cases, cases_qk_norm_rotary.qk_norm_rotary_cpu_cases)]


def gpu_cases(quick: bool) -> list[Case]:
    device = torch.device("cuda")
    cases = (softmax_cases(device, quick) + gather_cases(device, quick) + cross_entropy_cases(device, quick)
             + multi_tensor_cases(device, quick))
    for family_gpu_cases, _ in _family_cases():
        cases += family_gpu_cases(device, quick)
    return cases


def cpu_cases() -> list[Case]:
    """Small shapes for the CPU path (a self-check and a rough comparison, not a benchmark)."""
    device = torch.device("cpu")
    cases = [_softmax_case("softmax", (256, 1024), -1, torch.float32, device),
             _softmax_case("log_softmax_backward", (64, 256, 64), 1, torch.float32, device),
             _embedding_backward_case(2048, 64, 1000, torch.float32, device),
             _cross_entropy_case(256, 1000, torch.float32, device),
             _optimizer_case("AdamW", 1_000_000, 8, 28, device)]
    for _, family_cpu_cases in _family_cases():
        cases += family_cpu_cases()
    return cases
