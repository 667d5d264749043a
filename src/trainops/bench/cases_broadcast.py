"""Benchmark cases of the broadcast-gradient family: ``trainops.sum_to_shape`` against torch eager
(``Tensor.sum_to_size``, what torch's broadcasting backwards call) and torch.compile of it, on the
shapes broadcasting backwards produce: a bias gradient over a transformer's tokens, a per-channel
gradient of a CNN activation (contiguous and channels-last), an attention bias shared by the heads,
and a row sum.

Each timed call is one reduction of a fixed random gradient. Bytes are the fewest the op must move:
the gradient read once and the result written once.
"""

from __future__ import annotations

import math

import torch

import trainops

from .case import Case, _dt, _randn


def _sum_case(grad_shape, shape, dtype, device, channels_last: bool = False) -> Case:
    def build(peers):
        grad = _randn(grad_shape, dtype, device, 50)
        if channels_last:
            grad = grad.to(memory_format=torch.channels_last)

        def torch_sum(g):
            return g.sum_to_size(shape)

        impls = {"trainops": lambda: lambda: trainops.sum_to_shape(grad, shape), "torch": lambda: lambda: torch_sum(grad)}
        if peers:
            compiled = torch.compile(torch_sum, dynamic=False)
            impls["torch.compile"] = lambda: lambda: compiled(grad)
        return impls, lambda: grad.double().sum_to_size(shape)

    nbytes = (math.prod(grad_shape) + math.prod(shape)) * dtype.itemsize
    label = (f"{'x'.join(map(str, grad_shape))} -> {'x'.join(map(str, shape))} {_dt(dtype)}"
             f"{' channels_last' if channels_last else ''}")
    return Case("sum_to_shape", label, nbytes, build)


def broadcast_cases(device, quick: bool) -> list[Case]:
    """A bias gradient over 8 x 1024 tokens of 4096 features (bf16), ResNet-50's first stage's
    per-channel gradient at batch 32 (bf16, channels-last and contiguous); in full runs also an
    attention bias over 32 heads, a row sum and float32."""
    cases = [_sum_case((8, 1024, 4096), (4096,), torch.bfloat16, device),
             _sum_case((32, 256, 56, 56), (256, 1, 1), torch.bfloat16, device, channels_last=True),
             _sum_case((32, 256, 56, 56), (256, 1, 1), torch.bfloat16, device)]
    if quick:
        return cases
    return cases + [_sum_case((4, 32, 1024, 1024), (4, 1, 1024, 1024), torch.bfloat16, device),
                    _sum_case((8192, 4096), (8192, 1), torch.bfloat16, device),
                    _sum_case((8, 1024, 4096), (4096,), torch.float32, device),
                    _sum_case((32, 64, 112, 112), (64, 1, 1), torch.float32, device, channels_last=True)]


def broadcast_cpu_cases() -> list[Case]:
    """Small shapes for the CPU path (a self-check and a rough comparison, not a benchmark)."""
    cpu = torch.device("cpu")
    return [_sum_case((64, 512), (512,), torch.float32, cpu),
            _sum_case((8, 16, 16, 16), (16, 1, 1), torch.float32, cpu, channels_last=True)]
