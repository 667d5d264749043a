"""Where trainops.linear_cross_entropy's time goes at padded vocabularies: one forward + backward
profiled per LinearCrossEntropyHeuristics.vocab_align, the top kernels by GPU time.

    python benchmarks/probe_lce_align.py [--tokens 16384] [--hidden 768] [--vocab 50257] [--align 8 64]

Each vocab_align twice, alternated.
"""

from __future__ import annotations

import argparse
import math

import torch

import trainops
from trainops.ops.linear_cross_entropy import LinearCrossEntropyHeuristics


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--align", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, device="cuda", generator=gen) / math.sqrt(args.hidden)
         ).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=gen)
    for align in args.align * 2:   # each twice, alternated
        config = LinearCrossEntropyHeuristics(vocab_align=align)

        def step():
            x.grad = w.grad = None
            with trainops.heuristics(config):
                trainops.linear_cross_entropy(x, w, t).backward()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1e3 / 5
        total = sum(kernels.values())
        print(f"vocab_align {align} (rows of {config.padded_classes(args.vocab)}): {total:.3f} ms of GPU time a step")
        for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {ms:8.3f} ms  {name[:110]}")


if __name__ == "__main__":
    main()
