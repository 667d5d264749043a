"""Benchmark cases of the batch-norm family: ``trainops.batch_norm`` in training, forward +
backward, against torch eager (``F.batch_norm``: cuDNN on CUDA for contiguous inputs, ATen's own
kernels for channels-last) and torch.compile of the same, at ResNet-50's shapes (batch 32 / 64,
224 x 224 images: the stem's 64 x 112 x 112 and the stages' 56 x 56 to 7 x 7), contiguous and
channels-last.

Each timed call is a training step's batch norm: forward (batch statistics, running statistics
updated), then backward of a fixed random upstream gradient into x's, the weight's and the
bias's ``.grad`` (reset each call). Bytes are the fewest a two-pass implementation must move for
tensors larger than the L2 cache: forward x read twice (statistics, then normalization) and y
written; backward dy and x read twice (sums, then dx) and dx written: eight tensors of x's size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import trainops

from .case import Case, _dt, _randn


def _bn_case(shape, dtype, device, channels_last: bool) -> Case:
    c = shape[1]

    def build(peers):
        x = _randn(shape, dtype, device, 40, 2.0)
        dy = _randn(shape, dtype, device, 44)
        if channels_last:
            x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
        x.requires_grad_()
        # float32 parameters and statistics, as mixed-precision training keeps them (torch's CUDA
        # batch norm refused bf16 weights beside float32 running statistics at some shapes)
        w = (_randn((c,), torch.float32, device, 41, 0.1) + 1.0).requires_grad_()
        b = _randn((c,), torch.float32, device, 42).requires_grad_()
        rm, rv = torch.zeros(c, device=device), torch.ones(c, device=device)
        leaves = (x, w, b)

        def step(fn):
            def run():
                for t in leaves:
                    t.grad = None
                fn(x, rm, rv, w, b).backward(dy)
                return x.grad
            return run

        def ours(x, rm, rv, w, b):
            return trainops.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)

        def torch_bn(x, rm, rv, w, b):
            return F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)

        impls = {"trainops": lambda: step(ours), "torch": lambda: step(torch_bn)}
        if peers:
            compiled = torch.compile(torch_bn, dynamic=False)
            impls["torch.compile"] = lambda: step(compiled)

        def reference():
            xd = x.detach().double().requires_grad_()
            y = F.batch_norm(xd, None, None, w.detach().double(), b.detach().double(), True, 0.1, 1e-5)
            y.backward(dy.double())
            return xd.grad
        return impls, reference

    nbytes = math.prod(shape) * dtype.itemsize * 8
    label = "x".join(map(str, shape)) + f" {_dt(dtype)}" + (" channels_last" if channels_last else "") + " fwd+bwd"
    return Case("batch_norm", label, nbytes, build)


# ResNet-50 at batch 32 (and the last stage at 64): (N, C, H, W) of its batch norms
RESNET50_SHAPES = [(32, 64, 112, 112), (32, 256, 56, 56), (32, 128, 28, 28), (32, 512, 28, 28),
                   (32, 1024, 14, 14), (32, 2048, 7, 7), (64, 512, 7, 7)]


def batch_norm_cases(device, quick: bool) -> list[Case]:
    bf16 = torch.bfloat16
    if quick:
        return [_bn_case((32, 256, 56, 56), bf16, device, True)]
    cases = []
    for shape in RESNET50_SHAPES:
        for channels_last in (False, True):
            cases.append(_bn_case(shape, bf16, device, channels_last))
    cases += [_bn_case((32, 256, 56, 56), torch.float32, device, cl) for cl in (False, True)]
    return cases


def batch_norm_cpu_cases() -> list[Case]:
    return [_bn_case((8, 16, 12, 12), torch.float32, torch.device("cpu"), cl) for cl in (False, True)]
