"""Benchmark cases of the normalization family: ``trainops.rms_norm`` / ``trainops.layer_norm``,
forward + backward, against torch eager (``F.rms_norm`` / ``F.layer_norm``, ATen's fused kernels),
torch.compile of the same, Liger-Kernel's RMSNorm / LayerNorm and quack's RMSNorm when installed.

Each timed call is a training step's norm: forward, then backward of a fixed random upstream
gradient into x's and the weight's (and bias's) ``.grad`` (reset each call). With ``residual``
the pre-norm block's add is part of the op: trainops fuses it (``rms_norm(x, w, residual=r)``
returns (y, x + r)); the others compute ``h = x + r`` first. Bytes are the fewest a
forward + backward must move: x read, y written, then dy and x read again and dx written (five
tensors of x's size; with a residual, r read and h written too, and h read instead of x by the
backward: seven); the weight and bias are negligible.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import trainops

from .case import Case, _dt, _peer, _randn


def _norm_case(op: str, shape, dtype, device, residual: bool = False) -> Case:
    n = shape[-1]

    def build(peers):
        x = _randn(shape, dtype, device, 30, 2.0).requires_grad_()
        r = _randn(shape, dtype, device, 31).requires_grad_() if residual else None
        w = (_randn((n,), torch.float32, device, 32, 0.1) + 1.0).requires_grad_()
        b = _randn((n,), torch.float32, device, 33).requires_grad_() if op == "layer_norm" else None
        dy = _randn(shape, dtype, device, 34)
        leaves = [t for t in (x, r, w, b) if t is not None]

        def ours(x, r, w, b):
            if op == "rms_norm":
                return trainops.rms_norm(x, w, 1e-6, residual=r) if residual else trainops.rms_norm(x, w, 1e-6)
            if residual:
                return trainops.layer_norm(x, n, w, b, 1e-5, residual=r)
            return trainops.layer_norm(x, n, w, b, 1e-5)

        def torch_norm(x, r, w, b):
            h = x + r if residual else x
            y = F.rms_norm(h, (n,), w.to(h.dtype), 1e-6) if op == "rms_norm" else \
                F.layer_norm(h, (n,), w.to(h.dtype), b.to(h.dtype), 1e-5)
            return (y, h) if residual else y

        def step(fn):
            def run():
                for t in leaves:
                    t.grad = None
                out = fn(x, r, w, b)
                y = out[0] if residual else out
                y.backward(dy)
                return x.grad
            return run

        impls = {"trainops": lambda: step(ours), "torch": lambda: step(torch_norm)}
        if peers:
            compiled = torch.compile(torch_norm, dynamic=False)
            impls["torch.compile"] = lambda: step(compiled)
            if not residual:
                liger_rms = _peer("liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
                liger_ln = _peer("liger_kernel.ops.layer_norm", "LigerLayerNormFunction")
                if op == "rms_norm" and liger_rms is not None:
                    impls["liger"] = lambda: step(
                        lambda x, r, w, b: liger_rms.apply(x, w, 1e-6, 0.0, "llama", False))
                if op == "layer_norm" and liger_ln is not None:
                    impls["liger"] = lambda: step(lambda x, r, w, b: liger_ln.apply(x, w, b, 1e-5))
            quack_rms = _peer("quack", "rmsnorm")
            if op == "rms_norm" and quack_rms is not None:  # prenorm=True: returns (y, x + residual)
                impls["quack"] = lambda: step(lambda x, r, w, b: quack_rms(x, w, residual=r, eps=1e-6, prenorm=True)
                                              if residual else quack_rms(x, w, eps=1e-6))

        def reference():
            xd = x.detach().double().requires_grad_()
            h = xd + r.detach().double() if residual else xd
            wd = w.detach().double()
            if op == "rms_norm":
                y = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6) * wd
            else:
                y = F.layer_norm(h, (n,), wd, b.detach().double(), 1e-5)
            y.backward(dy.double())
            return xd.grad
        return impls, reference

    tensors = 7 if residual else 5
    nbytes = math.prod(shape) * dtype.itemsize * tensors
    label = "x".join(map(str, shape)) + f" {_dt(dtype)} fwd+bwd" + (" +residual" if residual else "")
    return Case(op, label, nbytes, build)


def normalization_cases(device, quick: bool) -> list[Case]:
    if quick:
        return [_norm_case("rms_norm", (4096, 4096), torch.bfloat16, device)]
    bf16 = torch.bfloat16
    cases = [_norm_case("rms_norm", s, bf16, device) for s in ((8192, 4096), (32768, 768), (16384, 2048))]
    cases += [_norm_case("layer_norm", s, bf16, device) for s in ((8192, 4096), (32768, 768))]
    cases += [_norm_case("rms_norm", (8192, 4096), bf16, device, residual=True),
              _norm_case("layer_norm", (8192, 4096), bf16, device, residual=True)]
    return cases


def normalization_cpu_cases() -> list[Case]:
    device = torch.device("cpu")
    return [_norm_case("rms_norm", (64, 256), torch.float32, device, residual=True),
            _norm_case("layer_norm", (64, 256), torch.float32, device)]
