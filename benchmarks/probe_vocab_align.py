"""Which padded vocabulary cuBLAS runs fastest: the three matmuls of an LM head's loss (logits =
x W^T, dx = dlogits W, dW = dlogits^T x; bf16, float32 accumulation) timed alone at the vocabulary
itself and rounded up to multiples of 8 .. 256 (LinearCrossEntropyHeuristics.vocab_align).

    python benchmarks/probe_vocab_align.py [--out results.json]

triton.testing.do_bench medians on random normal data; the dW matmul accumulates into a float32
buffer as trainops's chunks do (addmm out_dtype=float32), at the chunk sizes trainops would use.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

SHAPES = [  # (chunk rows, hidden, vocabulary): GPT-2, an odd Llama-2-style, Llama-3, Qwen3, Gemma, odd primes
    (4096, 768, 50257), (2048, 2048, 32001), (2048, 4096, 32001), (2048, 4096, 50257), (2048, 2048, 128256),
    (2048, 1024, 151936), (1024, 2304, 256000), (4096, 1024, 49999), (2048, 3072, 100003),
]
ALIGNS = [1, 8, 16, 32, 64, 128, 256]


def three_matmuls(rows: int, hidden: int, classes: int) -> float:
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(classes, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(rows, classes, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(rows, hidden, device="cuda", dtype=torch.float32)
    dw = torch.zeros(classes, hidden, device="cuda", dtype=torch.float32)

    def run():
        torch.mm(x, w.t())
        torch.mm(g, w, out_dtype=torch.float32, out=dx)
        torch.addmm(dw, g.t(), x, out_dtype=torch.float32, out=dw)

    return do_bench(run, warmup=5, rep=150, return_mode="median")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for n, h, v in SHAPES:
        times, seen = {}, set()
        for align in ALIGNS:
            padded = -(-v // align) * align
            if padded in seen:   # an aligned vocabulary: the same matmuls again
                continue
            seen.add(padded)
            times[align] = three_matmuls(n, h, padded)
        best = min(times, key=times.get)
        rows.append(dict(rows=n, hidden=h, vocab=v, ms=times, best=best))
        print(f"{n:5d} x {h:5d} x {v:6d}: " + "  ".join(f"{a}:{t:.3f}" for a, t in times.items())
              + f"  best {best}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
