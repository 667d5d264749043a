"""Benchmark cases of the q/k norm + rotary family: ``trainops.qk_norm_rotary`` (one pass) against
trainops unfused (``trainops.rms_norm`` of q and of k, then ``trainops.rotary_embedding``), Hugging
Face's sequence in torch eager (Qwen3RMSNorm's formula, then ``apply_rotary_pos_emb``; OLMo 2's
norm over the whole projection for the across-heads case), and torch.compile of that sequence.

Inputs as the attention block makes them: q (b, s, hq, d) and k (b, s, hk, d) projections, the
weights (d,) (across heads: (h * d,)) in bf16 as a bf16 model holds them, cos and sin (1, s, d) in
q's dtype (HF's LlamaRotaryEmbedding: float32 angles, cast). The unfused implementations return
(b, h, s, d) views; outputs are compared as (b, s, h, d). Forward: q_out is checked; forward +
backward: the gradient of q and of q's weight (the largest of the two relative errors).

Bytes are the fewest the op moves. Forward: q, k, cos, sin, weights read once, q_out, k_out
written once. Backward: dq_out, dk_out, q, k, cos, sin, weights read once, dq, dk and the weight
gradients written once.
"""

from __future__ import annotations

import torch

import trainops

from .case import Case, _dt, _randn


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_qk_norm_rotary(q, k, wq, wk, cos, sin, eps, across_heads=False):
    """Hugging Face's Qwen3 (per head: ``weight * normed.to(input dtype)``) or OLMo 2 (across heads:
    ``(weight * normed).to(input dtype)``) norm of the (b, s, h, d) projections, the transpose to
    (b, h, s, d), then ``apply_rotary_pos_emb``; returns (b, h, s, d) views."""
    def norm(x, w):
        dtype = x.dtype
        if across_heads:
            flat = x.flatten(2).float()
            y = (w * (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps))).to(dtype)
            return y.view(x.shape)
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    qn, kn = norm(q, wq).transpose(1, 2), norm(k, wk).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return qn * c + rotate_half(qn) * s, kn * c + rotate_half(kn) * s


def unfused_trainops(q, k, wq, wk, cos, sin, eps, across_heads=False):
    """trainops.rms_norm of q and of k, then trainops.rotary_embedding; (b, h, s, d) outputs."""
    if across_heads:
        qn = trainops.rms_norm(q.flatten(2), wq, eps).view(q.shape)
        kn = trainops.rms_norm(k.flatten(2), wk, eps).view(k.shape)
    else:
        qn, kn = trainops.rms_norm(q, wq, eps), trainops.rms_norm(k, wk, eps)
    return trainops.rotary_embedding(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin)


def fused_trainops(q, k, wq, wk, cos, sin, eps, across_heads=False):
    qo, ko = trainops.qk_norm_rotary(q, k, wq, wk, cos, sin, eps, across_heads=across_heads)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def _angles(s, d, dtype, device):
    inv_freq = 1.0 / (1000000 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    freqs = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def qk_case(b, s, hq, hk, d, dtype, device, backward: bool, across_heads: bool = False,
            peers_compile=True) -> Case:
    """One case (the fused op's backward kernels and their heuristics variants, timed side by side
    in interleaved rounds: benchmarks/bench_qk_norm_rotary.py)."""
    eps = 1e-6

    def build(peers):
        q_base = _randn((b, s, hq, d), dtype, device, 40, 3.0)
        k_base = _randn((b, s, hk, d), dtype, device, 41, 3.0)
        nq, nk = (hq * d, hk * d) if across_heads else (d, d)
        wq = (_randn((nq,), torch.float32, device, 42, 0.1) + 1.0).to(dtype).requires_grad_()
        wk = (_randn((nk,), torch.float32, device, 43, 0.1) + 1.0).to(dtype).requires_grad_()
        cos, sin = _angles(s, d, dtype, device)
        dq_out = _randn((b, s, hq, d), dtype, device, 44).transpose(1, 2)   # (b, h, s, d) views, as SDPA's
        dk_out = _randn((b, s, hk, d), dtype, device, 45).transpose(1, 2)

        def make(fn):
            def factory():
                q, k = q_base.detach().requires_grad_(backward), k_base.detach().requires_grad_(backward)
                if not backward:
                    return lambda: fn(q, k, wq, wk, cos, sin, eps, across_heads)[0].transpose(1, 2)

                def run():
                    q.grad = k.grad = wq.grad = wk.grad = None
                    qo, ko = fn(q, k, wq, wk, cos, sin, eps, across_heads)
                    torch.autograd.backward((qo, ko), (dq_out, dk_out))
                    return q.grad, wq.grad
                return run
            return factory

        impls = {"trainops": make(fused_trainops), "trainops unfused": make(unfused_trainops),
                 "torch (HF's sequence)": make(hf_qk_norm_rotary)}
        if peers and peers_compile:
            impls["torch.compile (HF's sequence)"] = make(torch.compile(hf_qk_norm_rotary, dynamic=False))

        def reference():
            q, k = q_base.double().requires_grad_(), k_base.double().requires_grad_()
            w = wq.detach().double().requires_grad_()
            qo, ko = hf_qk_norm_rotary(q, k, w, wk.detach().double(), cos.double(), sin.double(), eps, across_heads)
            if not backward:
                return qo.transpose(1, 2).detach()
            dq, dw = torch.autograd.grad(qo, (q, w), dq_out.double())   # k's terms do not reach q or wq
            return dq, dw
        return impls, reference

    e = dtype.itemsize
    tokens = b * s * (hq + hk) * d
    weights = (2 * d if not across_heads else (hq + hk) * d) * e
    forward_bytes = 2 * tokens * e + 2 * s * d * e + weights
    backward_bytes = 3 * tokens * e + 2 * s * d * e + 2 * weights
    nbytes = forward_bytes + (backward_bytes if backward else 0)
    label = (f"q {b}x{s}x{hq}x{d} k {b}x{s}x{hk}x{d} {_dt(dtype)}" + (" across heads" if across_heads else "")
             + (" fwd+bwd" if backward else ""))
    return Case("qk_norm_rotary", label, nbytes, build, tolerance=1e-2 if dtype == torch.bfloat16 else 1e-3)


SHAPES = {"qwen3-0.6b": (8, 2048, 16, 8, 128), "llama-3.2-1b": (4, 2048, 32, 8, 64), "olmo2-1b": (8, 2048, 16, 16, 128)}


def qk_norm_rotary_cases(device, quick: bool) -> list[Case]:
    """Qwen3-0.6B's attention (b 8, s 2048, 16 / 8 heads of 128), Llama-3.2-1B-like (4 x 2048, 32 / 8
    heads of 64) and OLMo-2-1B's norm across 16 heads of 128; bf16."""
    cases = []
    for name, shape in SHAPES.items():
        across = name.startswith("olmo")
        for backward in ((True,) if quick or across else (False, True)):
            cases.append(qk_case(*shape, torch.bfloat16, device, backward, across))
    return cases


def qk_norm_rotary_cpu_cases() -> list[Case]:
    """Tiny shapes for the CPU path (a self-check, not a benchmark): no torch.compile."""
    device = torch.device("cpu")
    return [qk_case(2, 16, 4, 2, 16, torch.float32, device, False, peers_compile=False),
            qk_case(2, 16, 4, 2, 16, torch.float32, device, True, True, peers_compile=False)]
