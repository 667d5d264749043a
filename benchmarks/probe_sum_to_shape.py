"""``trainops.sum_to_shape`` against ``grad.sum(dims, keepdim=True)`` (what ``sum_to_size`` runs) on
the reductions broadcasting backwards produce, over a grid of ``BroadcastSumHeuristics``.

    python benchmarks/probe_sum_to_shape.py --out sum.json

Every result is checked against float64 torch before it is timed. Times: ``do_bench`` medians (ms)
on random data; GB/s counts grad read once and the output written once.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import triton
import triton.testing

import trainops
from trainops.ops.broadcast import BroadcastSumHeuristics
from trainops.plan import clear_plan_cache

# (grad shape, output shape, dtype, channels_last)
CASES = [
    ((8, 1024, 4096), (4096,), torch.bfloat16, False),           # a Llama-7B bias gradient over 8K tokens
    ((16384, 768), (768,), torch.bfloat16, False),                # GPT-2's
    ((4, 1023, 11008), (11008,), torch.bfloat16, False),          # odd token count, MLP width
    ((8, 1024, 4096), (8, 1, 4096), torch.bfloat16, False),       # a per-sample bias
    ((32, 256, 56, 56), (256, 1, 1), torch.bfloat16, True),       # ResNet-50 per-channel, channels-last
    ((32, 256, 56, 56), (256, 1, 1), torch.bfloat16, False),      # and contiguous
    ((32, 64, 112, 112), (64, 1, 1), torch.float32, True),
    ((32, 64, 112, 112), (64, 1, 1), torch.float32, False),
    ((32, 2048, 7, 7), (2048, 1, 1), torch.bfloat16, False),      # a late stage, short rows
    ((32, 2048, 7, 7), (2048, 1, 1), torch.bfloat16, True),
    ((4, 32, 1024, 1024), (4, 1, 1024, 1024), torch.bfloat16, False),  # attention bias shared by the heads
    ((8192, 4096), (8192, 1), torch.bfloat16, False),             # row sums
    ((8, 1024, 4096), (4096,), torch.float32, False),
    ((64, 1000), (1000,), torch.float32, False),                  # small
    ((4, 2047, 32001), (32001,), torch.bfloat16, False),          # vocabulary bias, odd sizes
]
TILES = [None, (8192, 32, 2, 8), (2048, 1024, 2, 8), (2048, 1024, 8, 4, False), (2048, 1024, 8, 4, True),
         (2048, 32, 8, 4), (8192, 64, 2, 4)]
# (tile, kept_block, programs_per_sm, warps[, kept_run_walk]); None: the measured rule (ops/broadcast.py, ``rule``)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def gpu_time(fn) -> float:
    """The GPU's time alone: ``fn`` captured in a CUDA graph and replayed (no host overhead)."""
    return triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    copy_src = torch.randn(256 * 2 ** 20, device="cuda", dtype=torch.bfloat16)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = bench(lambda: copy_dst.copy_(copy_src))
    copy_gbs = 2 * copy_src.numel() * 2 / copy_ms / 1e6
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_gbs": copy_gbs, "rows": []}
    print(f"copy {copy_gbs:.0f} GB/s", flush=True)
    for grad_shape, shape, dtype, channels_last in CASES:
        grad = torch.randn(grad_shape, device="cuda", dtype=dtype)
        if channels_last:
            grad = grad.to(memory_format=torch.channels_last)
        lead = len(grad_shape) - len(shape)
        dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and grad_shape[lead + i] != 1)
        ref = grad.double().sum(dims, keepdim=True).reshape(shape)
        scale = grad.double().abs().sum(dims, keepdim=True).reshape(shape)
        nbytes = (grad.numel() + math.prod(shape)) * dtype.itemsize
        torch_ms = bench(lambda: grad.sum(dims, keepdim=True))
        torch_gpu = gpu_time(lambda: grad.sum(dims, keepdim=True))
        row = {"label": f"{'x'.join(map(str, grad_shape))} -> {'x'.join(map(str, shape))} {str(dtype)[6:]}"
                        f"{' cl' if channels_last else ''}", "bytes": nbytes, "torch_ms": torch_ms,
               "torch_gpu_ms": torch_gpu, "trainops": {}}
        for tiling in TILES:
            h = BroadcastSumHeuristics(**dict(zip(("tile", "kept_block", "programs_per_sm", "warps", "kept_run_walk"),
                                                  tiling or ())))
            key = "/".join(map(str, tiling)) if tiling else "rule"
            try:
                with trainops.heuristics(h):
                    clear_plan_cache()
                    out = trainops.sum_to_shape(grad, shape)
                    error = float(((out.double() - ref).abs() / scale.clamp_min(1e-30)).max())
                    ms = bench(lambda: trainops.sum_to_shape(grad, shape))
                    gpu = gpu_time(lambda: trainops.sum_to_shape(grad, shape))
                    clear_plan_cache()
                row["trainops"][key] = {"ms": ms, "gpu_ms": gpu, "error": error}
            except Exception as e:  # noqa: BLE001 - a probe: record and go on
                row["trainops"][key] = {"failed": f"{type(e).__name__}: {e}"[:300]}
        ok = {k: v for k, v in row["trainops"].items() if "failed" not in v}
        best = min(ok, key=lambda k: ok[k]["ms"]) if ok else None
        rule = ok.get("rule", {"ms": float("nan"), "gpu_ms": float("nan")})
        line = (f"{row['label']}: torch {torch_ms * 1e3:.1f} us, GPU {torch_gpu * 1e3:.1f} "
                f"({nbytes / torch_gpu / 1e6 / copy_gbs:.0%} of copy); trainops rule {rule['ms'] * 1e3:.1f} us, "
                f"GPU {rule['gpu_ms'] * 1e3:.1f} ({torch_gpu / rule['gpu_ms']:.2f}x, "
                f"{nbytes / rule['gpu_ms'] / 1e6 / copy_gbs:.0%} of copy)")
        if best:
            best_gpu = min(ok, key=lambda k: ok[k]["gpu_ms"])
            line += (f", best {ok[best]['ms'] * 1e3:.1f} us [{best}] -> {torch_ms / ok[best]['ms']:.2f}x; GPU: "
                     + ", ".join(f"{k} {v['gpu_ms'] * 1e3:.1f}" for k, v in ok.items())
                     + f"; best GPU {torch_gpu / ok[best_gpu]['gpu_ms']:.2f}x "
                       f"({nbytes / ok[best_gpu]['gpu_ms'] / 1e6 / copy_gbs:.0%} of copy); "
                       f"worst error {max(v['error'] for v in ok.values()):.1e}")
        failed = [k for k, v in row["trainops"].items() if "failed" in v]
        if failed:
            line += f"; failed {failed}: {row['trainops'][failed[0]]['failed']}"
        print(line, flush=True)
        result["rows"].append(row)
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
