"""Benchmark cases of the activation family (ops/activations.py): SwiGLU and GELU (tanh) at the MLP
shapes of Llama-3 8B (8192 tokens x 14336) and a wider-batch 16384 x 8192, forward and backward
timed as one call (forward, then ``backward`` of a fixed random upstream gradient; each call resets
the inputs' ``.grad``), against torch eager, torch.compile and Liger-Kernel's LigerSiLUMulFunction
when it is installed.

Bytes are the fewest the pair must move: SwiGLU reads gate and up and writes y (forward), reads dy,
gate and up and writes d gate and d up (backward): 8 tensors; GELU reads x and writes y, reads dy and
x and writes dx: 5 tensors. On a CPU device the shapes shrink to 256 rows (a self-check, not a
benchmark).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import trainops

from .case import Case, _dt, _peer, _randn


def _fwd_bwd(fn, leaves, dy):
    """The timed call: y = fn(*leaves), y.backward(dy), the leaves' .grad reset first. The first
    call returns every gradient, flattened and concatenated, for the runner's check against the
    float64 reference; later calls return None, so no concatenation is timed."""
    state = {"checked": False}

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dy)
        if state["checked"]:
            return None
        state["checked"] = True
        return torch.cat([t.grad.flatten() for t in leaves])
    return run


def _reference(torch_fn, leaves, dy):
    def reference():
        leaves64 = [t.detach().double().requires_grad_() for t in leaves]
        torch_fn(*leaves64).backward(dy.double())
        return torch.cat([t.grad.flatten() for t in leaves64])
    return reference


def _liger_step(liger, leaves, dy):
    """Liger's backward writes the gradients over its saved inputs (in MLPs those are the
    projections' outputs): it gets copies, so the case's inputs stay intact. The first (checked)
    call sees the copies' original values; timed calls run on whatever the previous call left
    there (the values do not change the time of these kernels)."""
    work = [t.detach().clone().requires_grad_() for t in leaves]
    return _fwd_bwd(liger.apply, work, dy)


def _swiglu_case(shape, dtype, device) -> Case:
    def build(peers):
        gate = _randn(shape, dtype, device, 20, 2.0).requires_grad_()
        up = _randn(shape, dtype, device, 21).requires_grad_()
        dy = _randn(shape, dtype, device, 22)
        leaves = [gate, up]

        def torch_fn(g, u):
            return F.silu(g) * u

        impls = {"trainops": lambda: _fwd_bwd(trainops.swiglu, leaves, dy),
                 "torch": lambda: _fwd_bwd(torch_fn, leaves, dy)}
        if peers:
            compiled = torch.compile(torch_fn, dynamic=False)
            impls["torch.compile"] = lambda: _fwd_bwd(compiled, leaves, dy)
            liger = _peer("liger_kernel.ops.swiglu", "LigerSiLUMulFunction")
            if liger is not None:
                impls["liger"] = lambda: _liger_step(liger, leaves, dy)
        return impls, _reference(torch_fn, leaves, dy)

    nbytes = 8 * math.prod(shape) * dtype.itemsize
    return Case("swiglu", "x".join(map(str, shape)) + f" {_dt(dtype)} fwd+bwd", nbytes, build)


def _gelu_case(shape, dtype, device, approximate: str) -> Case:
    def build(peers):
        x = _randn(shape, dtype, device, 23, 2.0).requires_grad_()
        dy = _randn(shape, dtype, device, 24)

        def torch_fn(t):
            return F.gelu(t, approximate=approximate)

        impls = {"trainops": lambda: _fwd_bwd(lambda t: trainops.gelu(t, approximate), [x], dy),
                 "torch": lambda: _fwd_bwd(torch_fn, [x], dy)}
        if peers:
            compiled = torch.compile(torch_fn, dynamic=False)
            impls["torch.compile"] = lambda: _fwd_bwd(compiled, [x], dy)
        return impls, _reference(torch_fn, [x], dy)

    nbytes = 5 * math.prod(shape) * dtype.itemsize
    return Case("gelu", "x".join(map(str, shape)) + f" {approximate} {_dt(dtype)} fwd+bwd", nbytes, build)


def activation_cases(device, quick: bool) -> list[Case]:
    """SwiGLU 8192x14336 and 16384x8192 and GELU (tanh) 8192x14336, bfloat16 (``quick``: the first
    only). On a CPU device, 256-row versions of the same cases."""
    device = torch.device(device)
    if device.type != "cuda":
        return [_swiglu_case((256, 1024), torch.float32, device),
                _gelu_case((256, 1024), torch.float32, device, "tanh")]
    cases = [_swiglu_case((8192, 14336), torch.bfloat16, device)]
    if quick:
        return cases
    return cases + [_swiglu_case((16384, 8192), torch.bfloat16, device),
                    _gelu_case((8192, 14336), torch.bfloat16, device, "tanh")]
