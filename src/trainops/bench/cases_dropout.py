"""Benchmark cases of the dropout family: ``trainops.dropout`` and ``trainops.bias_dropout_add``
against torch eager (``F.dropout``; ``residual + F.dropout(x + bias)``) and torch.compile of the same.

Each call is a training step's forward and backward (or the forward alone) from leaves that need
gradients; it returns dx. There is no float64 reference: the masks differ (ours is Philox by
element index, torch's its own generator's), so the runner compares nothing (tests/test_dropout.py
checks the values). Bytes are the fewest the op moves with the mask regenerated: dropout forward
reads x and writes y, backward reads dy and writes dx; bias_dropout_add forward reads x, the
residual and the bias and writes y, backward reads dy and writes dx and dbias (d residual is dy
itself). The ``trainops (mask bits)`` row is credited with the packed mask too (n / 8 bytes written,
read back).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

import trainops

from ..ops.dropout import DropoutHeuristics
from .case import Case, Impl, _dt, _randn


def _dropout_case(op: str, shape, p: float, dtype, device, backward: bool = True, variants=None) -> Case:
    """``variants``: None, trainops against torch eager and torch.compile; else a list of
    DropoutHeuristics field dicts (``dropout_sweep_cases``), trainops under each."""
    n, n_last = math.prod(shape), shape[-1]
    fused = op == "bias_dropout_add"

    def build(peers):
        x = _randn(shape, dtype, device, 30).requires_grad_()
        dy = _randn(shape, dtype, device, 31)
        r = _randn(shape, dtype, device, 32).requires_grad_() if fused else None
        b = _randn((n_last,), dtype, device, 33).requires_grad_() if fused else None
        leaves = (x, b, r) if fused else (x,)

        if fused:
            def torch_fn(x, b, r):
                return r + F.dropout(x + b, p)

            def ours(x, b, r, mask_mode="regenerate"):
                return trainops.bias_dropout_add(x, b, r, p, mask_mode=mask_mode)
        else:
            def torch_fn(x):
                return F.dropout(x, p)

            def ours(x, mask_mode="regenerate"):
                return trainops.dropout(x, p, mask_mode=mask_mode)

        def make(fn, **kwargs):
            def factory():
                if not backward:
                    def forward():
                        with torch.no_grad():
                            return fn(*leaves, **kwargs)
                    return forward

                def step():
                    return torch.autograd.grad(fn(*leaves, **kwargs), leaves, dy)[0]
                return step
            return factory

        if variants is not None:
            impls = {}
            for v in variants:
                config = DropoutHeuristics(**v)
                impls["trainops " + " ".join(f"{k}={x}" for k, x in v.items())] = Impl(
                    make(ours), context=functools.partial(trainops.heuristics, config),
                    fields={"heuristics": v, "default": config == DropoutHeuristics()})
            return impls, None
        bits = 2 * ((n + 7) // 8) if backward else (n + 7) // 8
        impls = {"trainops": make(ours), "trainops (mask bits)": Impl(make(ours, mask_mode="bits"),
                                                                      nbytes=nbytes + bits),
                 "torch": make(torch_fn)}
        if peers:
            impls["torch.compile"] = make(torch.compile(torch_fn, dynamic=False))
        return impls, None

    s = dtype.itemsize
    forward_bytes = (3 * n + n_last) * s if fused else 2 * n * s
    backward_bytes = (2 * n + n_last) * s if fused else 2 * n * s
    nbytes = forward_bytes + (backward_bytes if backward else 0)
    label = f"{'x'.join(map(str, shape))} p={p} {_dt(dtype)}" + (" fwd+bwd" if backward else "")
    return Case(op, label, nbytes, build)


def dropout_cases(device, quick: bool) -> list[Case]:
    """A transformer block's activations, 8192 tokens x 4096 features in bf16, p = 0.1."""
    shape, p = (8192, 4096), 0.1
    cases = [_dropout_case("dropout", shape, p, torch.bfloat16, device),
             _dropout_case("bias_dropout_add", shape, p, torch.bfloat16, device)]
    if quick:
        return cases
    return cases + [_dropout_case("dropout", shape, p, torch.bfloat16, device, backward=False),
                    _dropout_case("bias_dropout_add", shape, p, torch.bfloat16, device, backward=False)]


# block x warps of the one-dimensional kernels; the dbias kernel's programs per SM and column block
DROPOUT_SWEEP = ([dict(block=b, warps=w) for b in (1024, 2048, 4096, 8192) for w in (2, 4, 8)]
                 + [dict(rows_programs_per_sm=k, rows_block_n=c) for k in (1, 2, 4, 8) for c in (512, 1024, 2048)])


def dropout_sweep_cases(device, shape=(8192, 4096), dtype=torch.bfloat16, variants=DROPOUT_SWEEP) -> list[Case]:
    """The heuristics' choices timed (not yet measured on the GPU): dropout and bias_dropout_add
    fwd+bwd under each DropoutHeuristics variant (rows carry the variant and whether it is the
    default)."""
    return [_dropout_case(op, shape, 0.1, dtype, device, variants=variants) for op in ("dropout", "bias_dropout_add")]


def dropout_cpu_cases() -> list[Case]:
    """Small shapes for the CPU path (a self-check and a rough comparison, not a benchmark)."""
    device = torch.device("cpu")
    return [_dropout_case("dropout", (256, 512), 0.1, torch.float32, device),
            _dropout_case("bias_dropout_add", (256, 512), 0.1, torch.float32, device)]
