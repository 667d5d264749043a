"""SDPA forward + backward alone, eager and torch.compile, at Llama-3.2-1B's and Qwen3-0.6B's attention
shapes (4 x 2048 and 8 x 2048 tokens, bf16): is_causal with GQA, is_causal with k / v repeated, and a
materialised boolean causal mask (what transformers passes while torch.compile traces; benchmarks/
NOTES.md, fifth session). Per variant: ms (10 calls after 3) and the top kernels' ms (torch.profiler).

    PYTHONPATH=src python benchmarks/probe_sdpa_mask.py OUT.json
"""
import collections
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
out = {}
def bench(fn, args, label):
    for _ in range(3): fn(*args)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10): fn(*args)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / 10 * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn(*args); torch.cuda.synchronize()
    k = collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k[e.name[:90]] += e.device_time_total / 1e3
    out[label] = dict(ms=ms, kernels=dict(k.most_common(4)))
    print(label, round(ms, 3), dict(k.most_common(3)), flush=True)
for name, (B, H, KV, S, D) in {"llama": (4, 32, 8, 2048, 64), "qwen3": (8, 16, 8, 2048, 128)}.items():
    g = torch.Generator(device="cuda").manual_seed(0)
    def mk(h, grad=True):  # BSHD projections viewed as BHSD, as HF does
        x = torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
        return x.transpose(1, 2).requires_grad_(grad)
    q, k, v = mk(H), mk(KV), mk(KV)
    do = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = torch.ones(S, S, device="cuda", dtype=torch.bool).tril()[None, None].expand(B, 1, S, S)
    def gqa(q, k, v, do):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.transpose(1, 2).reshape(B, S, H * D).backward(do)
    def rep(q, k, v, do):
        kk = k[:, :, None].expand(B, KV, H // KV, S, D).reshape(B, H, S, D)
        vv = v[:, :, None].expand(B, KV, H // KV, S, D).reshape(B, H, S, D)
        o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        o.transpose(1, 2).reshape(B, S, H * D).backward(do)
    def masked(q, k, v, do):
        kk = k[:, :, None].expand(B, KV, H // KV, S, D).reshape(B, H, S, D)
        vv = v[:, :, None].expand(B, KV, H // KV, S, D).reshape(B, H, S, D)
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        o.transpose(1, 2).reshape(B, S, H * D).backward(do)
    for fname, fn in (("gqa", gqa), ("repeat", rep), ("mask", masked)):
        bench(fn, (q, k, v, do), f"{name} eager {fname}")
        bench(torch.compile(fn), (q, k, v, do), f"{name} compile {fname}")
json.dump(out, open(sys.argv[1], "w"), indent=1)
