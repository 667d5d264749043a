"""Benchmark cases of the convolution registry: depthwise convolutions (MobileNet-V2's 3x3 and 5x5,
ConvNeXt's 7x7) forward + backward in bf16, channels-last and contiguous, through
``trainops.conv2d`` as the registry chooses (``choose_backend``: Triton for the contiguous row,
cuDNN for the channels-last ones), with its Triton kernels pinned (``trainops.backend("triton")``),
and torch's own ``F.conv2d`` (and torch.compile of it). The per-direction measurements behind
``choose_backend`` come from ``benchmarks/probe_conv.py``.

Each timed call is a training step's convolution: forward, then the backward of a fixed random
upstream gradient into x's and the weight's gradients (returned, checked against float64 torch).
Bytes are the fewest a depthwise convolution's step must move: forward reads x and writes y;
backward reads dy and x and writes dx (the weight is small).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import trainops

from .case import Case, _dt, _randn


def _depthwise_case(shape, kernel: int, stride: int, dtype, device, channels_last: bool = True) -> Case:
    n, c, h, w = shape
    padding = kernel // 2
    oh, ow = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1

    def build(peers):
        layout = torch.channels_last if channels_last else torch.contiguous_format
        x = _randn(shape, dtype, device, 60).to(memory_format=layout).requires_grad_()
        weight = (_randn((c, 1, kernel, kernel), dtype, device, 61) * 0.2).requires_grad_()
        dy = _randn((n, c, oh, ow), dtype, device, 62).to(memory_format=layout)

        def conv(fn):
            def factory():
                return lambda: torch.autograd.grad(fn(x, weight), (x, weight), dy)
            return factory

        def ours(x, weight):
            return trainops.conv2d(x, weight, None, stride, padding, 1, c)

        def ours_triton(x, weight):
            with trainops.backend("triton"):
                return trainops.conv2d(x, weight, None, stride, padding, 1, c)

        def theirs(x, weight):
            return F.conv2d(x, weight, None, stride, padding, 1, c)

        impls = {"trainops": conv(ours), "torch": conv(theirs)}
        if x.device.type == "cuda":   # the pinned Triton kernels (on the CPU only under the interpreter)
            impls["trainops triton"] = conv(ours_triton)
        if peers:
            impls["torch.compile"] = conv(torch.compile(theirs, dynamic=False))

        def reference():
            xd, wd = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
            return torch.autograd.grad(theirs(xd, wd), (xd, wd), dy.double())
        return impls, reference

    size = dtype.itemsize
    nbytes = (math.prod(shape) * 3 + n * c * oh * ow * 2) * size
    label = (f"{'x'.join(map(str, shape))} {kernel}x{kernel} s{stride} depthwise {_dt(dtype)}"
             f"{' channels_last' if channels_last else ''} fwd+bwd")
    return Case("conv2d", label, nbytes, build)


def convolution_cases(device, quick: bool) -> list[Case]:
    """MobileNet-V2's depthwise layers at batch 32 (144 channels at 56 x 56, 3x3, channels-last and
    contiguous (where the registry picks Triton); 240 at 28 x 28, 5x5 stride 2) and ConvNeXt-T's
    first stage (96 channels at 56 x 56, 7x7), bf16."""
    cases = [_depthwise_case((32, 144, 56, 56), 3, 1, torch.bfloat16, device),
             _depthwise_case((32, 144, 56, 56), 3, 1, torch.bfloat16, device, channels_last=False)]
    if quick:
        return cases
    return cases + [_depthwise_case((32, 240, 28, 28), 5, 2, torch.bfloat16, device),
                    _depthwise_case((32, 96, 56, 56), 7, 1, torch.bfloat16, device)]


def convolution_cpu_cases() -> list[Case]:
    """A small shape for the CPU path (a self-check and a rough comparison, not a benchmark)."""
    return [_depthwise_case((4, 8, 16, 16), 3, 1, torch.float32, torch.device("cpu"))]
