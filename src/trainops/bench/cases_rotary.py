"""Benchmark cases of the rotary family: ``trainops.rotary_embedding`` against Hugging Face's formula
in torch eager, torch.compile of it, and Liger-Kernel's ``LigerRopeFunction`` when installed.

Inputs as a Llama attention block makes them: q and k are transposed views (b, h, s, d) of the
projections' (b, s, h, d) outputs; cos and sin (1, s, d) in q's dtype, HF's duplicated layout
(cat(freqs, freqs)) computed in float32 and cast, as LlamaRotaryEmbedding does. Bytes are the
fewest the op moves: q and k read and written once, cos and sin read once, per pass.
"""

from __future__ import annotations

import torch

import trainops

from .case import Case, _dt, _peer, _randn


def hf_rotary(q, k, cos, sin):
    """Hugging Face's ``apply_rotary_pos_emb`` (modeling_llama, unsqueeze_dim=1), written out."""
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _angles(s, d, dtype, device):
    """HF's cos and sin for positions 0..s-1 (Llama 3's base 500000): (1, s, d) in ``dtype``."""
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    freqs = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotary_case(b, hq, hk, s, d, dtype, device, backward: bool) -> Case:
    def build(peers):
        q_base = _randn((b, s, hq, d), dtype, device, 20)
        k_base = _randn((b, s, hk, d), dtype, device, 21)
        cos, sin = _angles(s, d, dtype, device)
        dq_base = _randn((b, s, hq, d), dtype, device, 22)
        dk_base = _randn((b, s, hk, d), dtype, device, 23)

        def ours(q, k, cos, sin):
            return trainops.rotary_embedding(q, k, cos, sin)

        def forward(fn, q_base, k_base):
            q, k = q_base.transpose(1, 2), k_base.transpose(1, 2)
            return lambda: fn(q, k, cos, sin)[0]

        def step(fn, q_base, k_base, dq_base, dk_base):
            """Forward and backward from the (b, s, h, d) leaves; returns dq as (b, h, s, d)."""
            q_leaf, k_leaf = q_base.detach().requires_grad_(), k_base.detach().requires_grad_()
            dq_out, dk_out = dq_base.transpose(1, 2), dk_base.transpose(1, 2)

            def run():
                q_leaf.grad = k_leaf.grad = None
                q_out, k_out = fn(q_leaf.transpose(1, 2), k_leaf.transpose(1, 2), cos, sin)
                torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
                return q_leaf.grad.transpose(1, 2)
            return run

        def make(fn, own_copies=False):
            def factory():
                # Liger rotates its contiguous inputs (and the output gradients) in place: give it its own
                # copies, so the shared inputs stay intact (its first call is the one compared; later calls
                # rotate its copies further, which does not change the time)
                qb, kb, dqb, dkb = ((t.clone() for t in (q_base, k_base, dq_base, dk_base)) if own_copies
                                    else (q_base, k_base, dq_base, dk_base))
                return step(fn, qb, kb, dqb, dkb) if backward else forward(fn, qb, kb)
            return factory

        impls = {"trainops": make(ours), "torch (HF's formula)": make(hf_rotary)}
        if peers:
            impls["torch.compile"] = make(torch.compile(hf_rotary, dynamic=False))
            liger = _peer("liger_kernel.ops.rope", "LigerRopeFunction")
            if liger is not None:
                impls["liger"] = make(lambda q, k, cos, sin: liger.apply(q, k, cos, sin), own_copies=True)

        def reference():
            c, sn = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
            if not backward:
                return hf_rotary(q_base.double().transpose(1, 2), k_base.double().transpose(1, 2),
                                 cos.double(), sin.double())[0]
            dy = dq_base.double().transpose(1, 2)  # dq = dy * cos + rotate_half^T(dy * sin)
            z = dy * sn
            return dy * c + torch.cat((z[..., d // 2:], -z[..., :d // 2]), dim=-1)
        return impls, reference

    passes = 2 if backward else 1
    nbytes = passes * (2 * b * s * (hq + hk) * d + 2 * s * d) * dtype.itemsize
    label = f"q {b}x{hq}x{s}x{d} k {b}x{hk}x{s}x{d} {_dt(dtype)}" + (" fwd+bwd" if backward else "")
    return Case("rotary_embedding", label, nbytes, build)


def rotary_cases(device, quick: bool) -> list[Case]:
    """Llama 3 8B's attention at batch 4, seq 2048: q 4x32x2048x128, k 4x8x2048x128, bf16."""
    shape = (4, 32, 8, 2048, 128)
    if quick:
        return [_rotary_case(*shape, torch.bfloat16, device, True)]
    return [_rotary_case(*shape, torch.bfloat16, device, False), _rotary_case(*shape, torch.bfloat16, device, True)]


def rotary_cpu_cases() -> list[Case]:
    """Small shapes for the CPU path (a self-check and a rough comparison, not a benchmark)."""
    device = torch.device("cpu")
    return [_rotary_case(2, 8, 2, 128, 64, torch.float32, device, False),
            _rotary_case(2, 8, 2, 128, 64, torch.float32, device, True)]
