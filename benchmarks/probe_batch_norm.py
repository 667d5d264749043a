"""``trainops.batch_norm`` (training, forward + backward) against torch's at ResNet-50's shapes, as GPU
time (the kernels' durations under torch.profiler, ``profiled.kernel_ms``: no host time; not a
CUDA-graph replay, as capturing ten of these steps in one graph failed in this probe's process,
NOTES.md) and eager wall time, over a grid of ``BatchNormHeuristics``.

    python benchmarks/probe_batch_norm.py --out bn.json [--quick]

The cases are ``python -m trainops bench --ops batch_norm``'s (bf16 x, float32 weight, bias and
running statistics; contiguous and channels-last). Every configuration's y, dx, dweight and dbias
are checked against float64 torch (relative-norm error) before it is timed. GB/s counts the eight
tensor passes of a two-pass batch norm (the bench's bytes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

import trainops
from trainops.bench.cases_batch_norm import RESNET50_SHAPES
from trainops.ops.batch_norm import BatchNormHeuristics
from trainops.plan import clear_plan_cache

from profiled import kernel_ms, relative_error

# (tile, channel_block, spatial_block, programs_per_sm, warps); None: the defaults
GRID = [None] + [(t, cb, sb, p, w) for t, (cb, sb), p, w in itertools.product(
    (2048, 4096, 8192), ((32, 512), (64, 1024), (128, 2048)), (2, 4, 8), (4,))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="the defaults and five other configurations")
    parser.add_argument("--shapes", default=None, help="comma-separated indices into RESNET50_SHAPES")
    args = parser.parse_args(argv)
    grid = GRID[:1] + GRID[1::6] if args.quick else GRID
    shapes = [RESNET50_SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else RESNET50_SHAPES
    copy_src = torch.empty(2 ** 28, dtype=torch.bfloat16, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_ms = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), return_mode="median")
    ceiling = 2 * copy_src.numel() * 2 / copy_ms / 1e6
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "copy_gbs": ceiling, "rows": []}
    print(f"{result['device']}, torch {torch.__version__}, triton {triton.__version__}, copy {ceiling:.0f} GB/s")
    for shape, channels_last in itertools.product(shapes, (False, True)):
        c = shape[1]
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = (torch.randn(shape, device="cuda", generator=gen) * 2 + 0.5).bfloat16()
        dy = torch.randn(shape, device="cuda", generator=gen).bfloat16()
        if channels_last:
            x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
        x.requires_grad_()
        w = (torch.randn(c, device="cuda", generator=gen) * 0.1 + 1).requires_grad_()
        b = torch.randn(c, device="cuda", generator=gen).requires_grad_()
        rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
        xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
        yd = F.batch_norm(xd, None, None, wd, bd, True, 0.1, 1e-5)
        yd.backward(dy.double())
        refs = (yd.detach(), xd.grad, wd.grad, bd.grad)

        def step(fn):
            def run():
                x.grad = w.grad = b.grad = None
                y = fn(x, rm, rv, w, b, True, 0.1, 1e-5)
                y.backward(dy)
                return y
            return run
        label = "x".join(map(str, shape)) + (" channels_last" if channels_last else "")
        nbytes = math.prod(shape) * 2 * 8
        row = {"label": label, "torch": {}, "trainops": {}}
        torch_step = step(F.batch_norm)
        row["torch"] = {"gpu_ms": kernel_ms(torch_step),
                        "eager_ms": triton.testing.do_bench(torch_step, return_mode="median")}
        for config in grid:
            heuristics = BatchNormHeuristics() if config is None else BatchNormHeuristics(*config)
            name = "default" if config is None else "/".join(map(str, config))
            clear_plan_cache()
            with trainops.heuristics(heuristics):
                ours = step(trainops.batch_norm)
                y = ours()
                errors = [relative_error(got, want) for got, want in zip((y, x.grad, w.grad, b.grad), refs)]
                entry = {"errors": errors}
                if max(errors) > 1e-2 or not all(map(math.isfinite, errors)):
                    entry["failed"] = True
                else:
                    entry["gpu_ms"] = kernel_ms(ours)
                    if config is None:
                        entry["eager_ms"] = triton.testing.do_bench(ours, return_mode="median")
            row["trainops"][name] = entry
        ok = {k: v for k, v in row["trainops"].items() if "gpu_ms" in v}
        best = min(ok, key=lambda k: ok[k]["gpu_ms"])
        d, t = row["trainops"]["default"], row["torch"]
        print(f"{label:28s} GPU: torch {t['gpu_ms'] * 1e3:7.1f} us, default {d.get('gpu_ms', float('nan')) * 1e3:7.1f} "
              f"({t['gpu_ms'] / d.get('gpu_ms', float('nan')):.2f}x, {nbytes / d.get('gpu_ms', 1) / 1e6 / ceiling:.0%} "
              f"of copy), best {ok[best]['gpu_ms'] * 1e3:7.1f} [{best}] ({t['gpu_ms'] / ok[best]['gpu_ms']:.2f}x) | "
              f"eager: torch {t['eager_ms'] * 1e3:6.1f}, trainops {d.get('eager_ms', float('nan')) * 1e3:6.1f} | "
              f"worst error {max(max(v['errors']) for v in row['trainops'].values()):.1e}", flush=True)
        result["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
