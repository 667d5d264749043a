"""Benchmark cases of the attention softmax (``trainops.attention_softmax``, ops/attention_softmax.py).

Each case times a training step of the softmax of an explicit attention, forward and backward:
scores (batch, heads, q, k) in bf16, scale = 1 / sqrt(128), causal, and a key-padding mask of shape
(batch, 1, 1, k) (the last 1/8 of the keys of every other sequence padded). The step returns
d scores, which the runner compares with a float32 reference (exact to far below bf16's tolerance;
float64 would need 4 x 4.3 GB at 2x16x4096x4096). Implementations:

    trainops        trainops.attention_softmax(scores, scale=, mask=padding, causal=True)
    torch           the usual explicit-attention code (Hugging Face's eager attention): the causal and
                    padding masks built once as an additive float mask (b, 1, q, k), then
                    torch.softmax(scores * scale + mask, -1, dtype=torch.float32).to(bf16)
    torch.compile   the same function under torch.compile (peers only)

Bytes (the fewest the step must move): forward read scores, write the output; backward read d out
and the saved output, write d scores: 5 x scores' bytes (the masks are negligible). ``forward``
cases time the forward alone (2 x scores' bytes). A dropout variant (p = 0.1, against torch's
``F.dropout`` of the weights) is timed without a reference: the masks differ by design (the tests
check ours against the CPU Philox).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import trainops

from .case import Case

SCALE = 1 / math.sqrt(128)


def _inputs(shape, dtype, device):
    b, h, q, k = shape
    gen = torch.Generator(device=device).manual_seed(sum(shape))
    scores = (torch.randn(shape, device=device, generator=gen) * 8).to(dtype).requires_grad_()
    dout = torch.randn(shape, device=device, generator=gen).to(dtype)
    lengths = torch.tensor([k if i % 2 == 0 else k - k // 8 for i in range(b)], device=device)
    padding = (torch.arange(k, device=device)[None, :] < lengths[:, None]).view(b, 1, 1, k)  # True = keep
    causal = torch.ones(q, k, dtype=torch.bool, device=device).tril()
    additive = torch.zeros(b, 1, q, k, dtype=dtype, device=device).masked_fill(~(causal & padding), float("-inf"))
    return scores, dout, padding, additive


def _reference(scores, dout, padding, additive):
    """d scores in float32: y = softmax(z), dz = y * (g - sum(g * y)), d scores = dz * scale."""
    z = scores.detach().float() * SCALE + additive.float()
    y = torch.softmax(z, -1)
    del z
    g = dout.float()
    return y.mul_(g - (g * y).sum(-1, keepdim=True)).mul_(SCALE)


def _attention_case(shape, dtype, device, backward: bool = True, dropout_p: float = 0.0) -> Case:
    def build(peers):
        scores, dout, padding, additive = _inputs(shape, dtype, device)

        def ours(s):
            return trainops.attention_softmax(s, scale=SCALE, mask=padding, causal=True, dropout_p=dropout_p)

        def eager(s):
            w = torch.softmax(s * SCALE + additive, -1, dtype=torch.float32).to(s.dtype)
            return F.dropout(w, dropout_p) if dropout_p else w

        def step(fn):
            def run():
                if not backward:
                    with torch.no_grad():
                        return fn(scores)
                scores.grad = None
                fn(scores).backward(dout)
                return scores.grad
            return run

        impls = {"trainops": lambda: step(ours), "torch": lambda: step(eager)}
        if peers:
            compiled = torch.compile(eager, dynamic=False)
            impls["torch.compile"] = lambda: step(compiled)
        if dropout_p:
            reference = None
        elif backward:
            def reference():
                return _reference(scores, dout, padding, additive)
        else:
            def reference():
                return torch.softmax(scores.detach().float() * SCALE + additive.float(), -1)
        return impls, reference

    b, h, q, k = shape
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize * (5 if backward else 2) + b * k
    what = ("fwd+bwd" if backward else "forward") + (f" dropout {dropout_p}" if dropout_p else "")
    label = "x".join(map(str, shape)) + f" {str(dtype).replace('torch.', '')} causal+padding {what}"
    return Case("attention_softmax", label, nbytes, build,
                fields=dict(shape=list(shape), dtype=str(dtype).replace("torch.", ""), backward=backward,
                            dropout_p=dropout_p),
                tolerance=None if dropout_p else 1e-2)


def attention_cases(device, quick: bool) -> list[Case]:
    """The attention-softmax cases: on a CUDA device 4x16x1024x1024 and 2x16x4096x4096 bf16 (quick:
    the first, forward and backward); on the CPU small shapes (a self-check of the cases)."""
    device = torch.device(device)
    if device.type != "cuda":
        return [_attention_case((2, 2, 32, 48), torch.float32, device),
                _attention_case((2, 2, 32, 48), torch.float32, device, backward=False)]
    if quick:
        return [_attention_case((4, 16, 1024, 1024), torch.bfloat16, device)]
    shapes = ((4, 16, 1024, 1024), (2, 16, 4096, 4096))
    out = [_attention_case(s, torch.bfloat16, device, backward) for s in shapes for backward in (True, False)]
    out.append(_attention_case((4, 16, 1024, 1024), torch.bfloat16, device, dropout_p=0.1))
    return out


__all__ = ["attention_cases"]
