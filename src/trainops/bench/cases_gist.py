"""Benchmark cases of the GIST family: ``trainops.gist.relu`` forward + backward against torch eager
(``torch.relu``) and torch.compile of it, at ResNet-50 activation shapes; ``relu_max_pool2d`` against
``max_pool2d(relu(x))`` at ResNet-50's stem.

Each call is a training step's forward and backward from a leaf that needs its gradient; it
returns dx, checked against float64 torch. Bytes are the fewest the GIST op moves: forward reads x
and writes y and the bits (n / 8), backward reads dy and the bits and writes dx: 4 n s + n / 4 for
elements of s bytes. torch's ReLU moves 5 n s (its backward reads the saved output), so its row is
credited with the GIST op's bytes: its GB/s are for the same work.
"""

from __future__ import annotations

import math

import torch

import trainops

from .case import Case, _dt, _randn


def _relu_case(shape, dtype, device, channels_last: bool) -> Case:
    n = math.prod(shape)

    def build(peers):
        x = _randn(shape, dtype, device, 40)
        dy = _randn(shape, dtype, device, 41)
        if channels_last:
            x, dy = (t.to(memory_format=torch.channels_last) for t in (x, dy))
        x.requires_grad_()

        def make(fn):
            def factory():
                return lambda: torch.autograd.grad(fn(x), x, dy)[0]
            return factory

        impls = {"trainops": make(trainops.gist.relu), "torch": make(torch.relu)}
        if peers:
            impls["torch.compile"] = make(torch.compile(torch.relu, dynamic=False))
        return impls, lambda: torch.where(x.detach().double() > 0, dy.double(), 0.0)

    nbytes = 4 * n * dtype.itemsize + 2 * ((n + 7) // 8)
    label = f"{'x'.join(map(str, shape))} {_dt(dtype)}{' channels_last' if channels_last else ''} fwd+bwd"
    return Case("gist_relu", label, nbytes, build)


def _pool_case(shape, dtype, device) -> Case:
    """ResNet's stem pooling (3x3, stride 2, padding 1) after its ReLU, forward + backward, channels-last.
    Bytes, the fused op's fewest: forward reads x and writes z and a byte a window; backward reads
    dz and the bytes and writes dx."""
    n = math.prod(shape)
    out = shape[0] * shape[1] * ((shape[2] - 1) // 2 + 1) * ((shape[3] - 1) // 2 + 1)

    def build(peers):
        x = _randn(shape, dtype, device, 42).to(memory_format=torch.channels_last).requires_grad_()
        dz = _randn((shape[0], shape[1], out // (shape[0] * shape[1] * ((shape[3] - 1) // 2 + 1)),
                     (shape[3] - 1) // 2 + 1), dtype, device, 43).to(memory_format=torch.channels_last)

        def torch_fn(t):
            return torch.nn.functional.max_pool2d(torch.relu(t), 3, 2, 1)

        def make(fn):
            def factory():
                return lambda: torch.autograd.grad(fn(x), x, dz)[0]
            return factory

        impls = {"trainops": make(lambda t: trainops.gist.relu_max_pool2d(t, 3, 2, 1)), "torch": make(torch_fn)}
        if peers:
            impls["torch.compile"] = make(torch.compile(torch_fn, dynamic=False))

        def reference():
            xd = x.detach().double().requires_grad_()
            return torch.autograd.grad(torch_fn(xd), xd, dz.double())[0]
        return impls, reference

    nbytes = 2 * n * dtype.itemsize + 2 * out * dtype.itemsize + 2 * out
    label = f"{'x'.join(map(str, shape))} {_dt(dtype)} channels_last relu+max_pool2d(3, 2, 1) fwd+bwd"
    return Case("gist_relu_max_pool2d", label, nbytes, build)


def gist_cases(device, quick: bool) -> list[Case]:
    """ResNet-50's largest ReLU outputs at batch 32: the first stage's 32x256x56x56 (bf16 and float32,
    channels_last as mixed-precision CNN training runs) and the stem's 32x64x112x112."""
    cases = [_relu_case((32, 256, 56, 56), torch.bfloat16, device, True),
             _pool_case((32, 64, 112, 112), torch.bfloat16, device)]
    if quick:
        return cases
    return cases + [_relu_case((32, 256, 56, 56), torch.float32, device, True),
                    _relu_case((32, 64, 112, 112), torch.bfloat16, device, True),
                    _relu_case((32, 256, 56, 56), torch.bfloat16, device, False)]


def gist_cpu_cases() -> list[Case]:
    """Small shapes for the CPU path (a self-check and a rough comparison, not a benchmark)."""
    return [_relu_case((8, 16, 32, 32), torch.float32, torch.device("cpu"), True),
            _pool_case((8, 16, 32, 32), torch.float32, torch.device("cpu"))]
