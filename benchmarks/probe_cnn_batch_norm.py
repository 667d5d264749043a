"""Batch norm + ReLU at the cnn demo's shapes (ResNet-18 widths on 32 x 32 images, batch 256, bf16,
channels-last), training forward + backward: torch's (batch_norm then relu), trainops's batch norm
then torch's relu, and trainops's fused batch_norm_relu. For each: GPU time (the kernels'
durations under torch.profiler, no host time), kernels launched a step, eager wall time
(``do_bench``, host included), and host time a call (``time.perf_counter`` around 200 calls
without waiting for the GPU). Every output is checked against float64 first.

    python benchmarks/probe_cnn_batch_norm.py --out cnn_bn.json

Prints one line a shape and implementation, then a table; writes the rows as JSON to ``--out``.
About a minute on an H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

import trainops

from profiled import kernel_ms, relative_error

SHAPES = [(256, 64, 32, 32), (256, 128, 16, 16), (256, 256, 8, 8), (256, 512, 4, 4)]


def _kernels_a_step(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False))


def _host_us(fn, calls: int = 200) -> float:
    """Host time a call: ``calls`` calls timed without waiting for the GPU (the queue absorbs
    them while the host is slower than the kernels), the median of three such windows."""
    fn()
    torch.cuda.synchronize()
    windows = []
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        windows.append((time.perf_counter() - started) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(windows)[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "rows": []}
    print(f"{result['device']}, torch {torch.__version__}, triton {triton.__version__}")
    impls = {
        "torch": lambda x, rm, rv, w, b: torch.relu(F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)),
        "trainops bn + torch relu": lambda x, rm, rv, w, b: torch.relu(trainops.batch_norm(x, rm, rv, w, b, True)),
        "trainops batch_norm_relu": lambda x, rm, rv, w, b: trainops.batch_norm_relu(x, rm, rv, w, b, True),
    }
    for shape in SHAPES:
        c = shape[1]
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = (torch.randn(shape, device="cuda", generator=gen) * 2 + 0.5).bfloat16()
        x = x.to(memory_format=torch.channels_last).requires_grad_()
        dy = torch.randn(shape, device="cuda", generator=gen).bfloat16().to(memory_format=torch.channels_last)
        w = (torch.randn(c, device="cuda", generator=gen) * 0.1 + 1).requires_grad_()
        b = torch.randn(c, device="cuda", generator=gen).requires_grad_()
        rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
        xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
        yd = torch.relu(F.batch_norm(xd, None, None, wd, bd, True, 0.1, 1e-5))
        yd.backward(dy.double())
        refs = (yd.detach(), xd.grad, wd.grad, bd.grad)
        label = "x".join(map(str, shape))
        for name, fn in impls.items():
            def step():
                x.grad = w.grad = b.grad = None
                y = fn(x, rm, rv, w, b)
                y.backward(dy)
                return y
            y = step()
            errors = [relative_error(got, want) for got, want in zip((y, x.grad, w.grad, b.grad), refs)]
            row = {"shape": label, "impl": name, "errors": errors, "gpu_ms": kernel_ms(step),
                   "kernels": _kernels_a_step(step), "eager_ms": triton.testing.do_bench(step, return_mode="median"),
                   "host_us": _host_us(step)}
            row["failed"] = max(errors) > 1e-2
            result["rows"].append(row)
            print(f"{label:18s} {name:26s} GPU {row['gpu_ms'] * 1e3:7.1f} us, {row['kernels']:2d} kernels, eager "
                  f"{row['eager_ms'] * 1e3:7.1f} us, host {row['host_us']:6.1f} us a step, worst error "
                  f"{max(errors):.1e}{'  FAILED' if row['failed'] else ''}", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{'shape':18s} {'impl':26s} {'GPU us':>8s} {'kernels':>8s} {'eager us':>9s} {'host us':>8s}")
    for row in result["rows"]:
        print(f"{row['shape']:18s} {row['impl']:26s} {row['gpu_ms'] * 1e3:8.1f} {row['kernels']:8d} "
              f"{row['eager_ms'] * 1e3:9.1f} {row['host_us']:8.1f}")
    return 1 if any(row["failed"] for row in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
