"""Sweep Triton configs of the softmax family on the GPU: which plan and block sizes win, per shape.

python benchmarks/sweep_softmax.py [OUT.json]  -- prints the best config per case; the heuristic
in trainops/ops/softmax.py (_choose_config) is set from these results (see benchmarks/NOTES.md).
"""

import itertools
import json
import sys

import torch
import triton.testing

from trainops.layout import next_pow2
from trainops.ops import softmax as S

CASES = [("softmax", (32768, 1024), -1, torch.bfloat16), ("softmax", (16384, 4096), -1, torch.bfloat16),
         ("softmax", (4096, 32768), -1, torch.bfloat16), ("softmax", (1024, 131072), -1, torch.bfloat16),
         ("softmax", (128, 262144), -1, torch.bfloat16), ("softmax", (4096, 32768), -1, torch.float32),
         ("softmax", (32, 512, 4096), 1, torch.bfloat16), ("softmax", (32, 512, 4096), 1, torch.float32)]
CASES += [("softmax_backward",) + c[1:] for c in CASES]


def variants(problem, layout):
    default = S._choose_config(problem, layout)
    yield default
    n = layout.n
    column = default.block_i > 1 and layout.stride_inner[-1] < layout.stride_n[-1]
    if column:
        for bi, w in itertools.product((16, 32, 64, 128), (4, 8, 16, 32)):
            if bi * next_pow2(n) <= 65536:
                yield S.TritonConfig("fused", bi, next_pow2(n), w)
        return
    if next_pow2(n) <= 65536:
        for w in (4, 8, 16, 32):
            yield S.TritonConfig("fused", default.block_i if default.kind == "fused" else 1, next_pow2(n), w)
    if n >= 16384:
        for bn, w in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16, 32)):
            yield S.TritonConfig("looped", 1, bn, w, 1, next_pow2(n))
        for splits, bn, w in itertools.product((2, 4, 8, 16, 32), (4096, 8192), (8, 16)):
            chunk = -(-n // (splits * bn)) * bn
            if chunk >= bn:
                yield S.TritonConfig("split", 1, bn, w, next_pow2(-(-n // chunk)), chunk)


def main():
    results = []
    for op, shape, dim, dtype in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(shape, device="cuda", generator=gen) * 3).to(dtype)
        tensors = (x,) if op == "softmax" else (torch.randn(shape, device="cuda", generator=gen).to(dtype),
                                                torch.softmax(x, dim))
        ref = torch.softmax(x.double(), dim) if op == "softmax" else None
        if ref is None:
            dy, y = (t.double() for t in tensors)
            ref = y * (dy - (y * dy).sum(dim, keepdim=True))
        problem = S._describe(op, shape, dim, dtype, "cuda", strides=tuple(t.stride() for t in tensors))
        layout = S.reduction_layout(problem.shape, problem.dim, problem.strides + (problem.out_strides,))
        nbytes = x.numel() * dtype.itemsize * (2 if op == "softmax" else 3)
        best, default_cfg = None, S._choose_config(problem, layout)
        for cfg in variants(problem, layout):
            try:
                launch = S._prepare_triton(problem, cfg)
                out = problem.new_output().fill_(float("nan"))
                launch.run(tensors, out)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(lambda: launch.run(tensors, out), warmup=10, rep=60,
                                             return_mode="median")
            except Exception as e:
                print(f"  {cfg}: {type(e).__name__} {str(e)[:80]}")
                continue
            row = dict(op=op, shape=shape, dim=dim, dtype=str(dtype), config=cfg.__dict__, ms=ms,
                       gbps=nbytes / ms / 1e6, err=err, default=cfg == default_cfg)
            results.append(row)
            if best is None or ms < best["ms"]:
                best = row
        d = [r for r in results if r["op"] == op and r["shape"] == shape and r["dtype"] == str(dtype) and r["default"]]
        print(f"{op:17s} {str(shape):18s} {str(dtype):15s} default {d[0]['gbps'] if d else 0:6.0f} GB/s "
              f"{d[0]['config'] if d else ''}\n{'':52s} best    {best['gbps']:6.0f} GB/s {best['config']} err {best['err']:.1e}",
              flush=True)
    if len(sys.argv) > 1:
        json.dump(results, open(sys.argv[1], "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
