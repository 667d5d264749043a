"""Benchmark cases of the GIST family: ``trainops.gist.relu`` forward + backward against torch eager
(``torch.relu``) and torch.compile of it, at ResNet-50 activation shapes.

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

from .cases import Case, _dt, _randn


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


def gist_cases(device, quick: bool) -> list[Case]:
    """ResNet-50's largest ReLU outputs at batch 32: the first stage's 32x256x56x56 (bf16 and float32,
    channels_last as mixed-precision CNN training runs) and the stem's 32x64x112x112."""
    cases = [_relu_case((32, 256, 56, 56), torch.bfloat16, device, True)]
    if quick:
        return cases
    return cases + [_relu_case((32, 256, 56, 56), torch.float32, device, True),
                    _relu_case((32, 64, 112, 112), torch.bfloat16, device, True),
                    _relu_case((32, 256, 56, 56), torch.bfloat16, device, False)]


def gist_cpu_cases() -> list[Case]:
    """Small shapes for the CPU path (a self-check and a rough comparison, not a benchmark)."""
    return [_relu_case((8, 16, 32, 32), torch.float32, torch.device("cpu"), True)]
