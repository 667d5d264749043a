"""Fused linear cross-entropy (issue 19): time and memory of an LM head's loss, forward + backward.

    python benchmarks/bench_linear_cross_entropy.py [--tokens 8192 32768] [--hidden 4096] [--vocab 128256 50257]
        [--align 1 64] [--chunks 2048] [--out results.json]

Side by side in one process, bf16 hidden (N x H), weight (V x H) in bf16 (and float32 master
weights for trainops), class-index targets with some ignored: torch eager (F.linear +
F.cross_entropy), torch.compile of the same, Liger's fused linear cross-entropy (when installed),
trainops.linear_cross_entropy at several chunk sizes, and the three matmuls alone (logits, dX, dW
in bf16 with float32 accumulation: the time floor). Time: triton.testing.do_bench median of a
forward + backward with the gradients set to None before each run. Memory: the peak allocated
during one forward + backward, minus what is allocated after it (inputs and gradients: the
steady state of a training step), in MiB. Loss and gradients of each are compared with torch
float32 reference's from the same bf16 inputs (relative-norm error), so a fast wrong variant
shows.

The floor (issue 39): the three matmuls timed alone, at the vocabulary itself and padded to a
multiple of 64 (the faster of the two), plus one read and one write of the logits at the
device-to-device copy bandwidth measured in the same process; each row reports its ratio to it.
``--align`` runs trainops's default chunk at several LinearCrossEntropyHeuristics.vocab_align.

Not a trainops.bench case: that runner times but does not measure memory.
"""

from __future__ import annotations

import argparse
import json
import math
import platform

import torch
import torch.nn.functional as F

import trainops
from trainops.ops.linear_cross_entropy import LinearCrossEntropyHeuristics

H, V = 4096, 128256   # set per run by main()


def inputs(n: int, weight_dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=gen) / math.sqrt(H)).to(weight_dtype).requires_grad_()
    t = torch.randint(0, V, (n,), device="cuda", generator=gen)
    t[::11] = -100
    return x, w, t


def torch_loss(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t)


def liger_loss():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    fn = LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, t: fn(w, x, t)


def measure(loss_fn, x, w, t, reps=10):
    from triton.testing import do_bench

    def step():
        x.grad = w.grad = None
        loss_fn(x, w, t).backward()

    step()   # warm-up (compiles)
    torch.cuda.synchronize()
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()) / 2**20
    loss = loss_fn(x, w, t)
    grads = torch.autograd.grad(loss, (x, w))
    ms = do_bench(step, warmup=3, rep=reps * 60, return_mode="median")
    return ms, extra, loss.detach().float(), [g.detach().float() for g in grads]


def matmuls(x, w, reps=10, classes=None):
    """The three matmuls of a linear + cross-entropy forward and backward, alone (bf16 in and out),
    over ``classes`` rows of the weight (default: V)."""
    from triton.testing import do_bench

    classes = classes or V
    g = torch.randn(x.shape[0], classes, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(classes, x.shape[1], device="cuda", dtype=torch.bfloat16)
    xd = x.detach()
    return do_bench(lambda: (torch.mm(xd, wb.t()), torch.mm(g, wb), torch.mm(g.t(), xd)), warmup=3,
                    rep=reps * 60, return_mode="median")


def copy_gbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second, GB/s) of a 1 GiB buffer."""
    from triton.testing import do_bench

    a = torch.randn(2**28, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=5, rep=200, return_mode="median")
    return 2 * a.numel() * 4 / ms / 1e6


def chunked(rows: int, vocab_align: int | None = None):
    """trainops.linear_cross_entropy with chunks of ``rows`` tokens (0: the default chunk)."""
    default = LinearCrossEntropyHeuristics()
    config = LinearCrossEntropyHeuristics(chunk_bytes=rows * V * 2 if rows else default.chunk_bytes,
                                          vocab_align=vocab_align or default.vocab_align)

    def loss(x, w, t):
        with trainops.heuristics(config):
            return trainops.linear_cross_entropy(x, w, t)

    return loss


def record(results, name, fn, x, w, t, n, floor, reference):
    """Time and measure one implementation, compare it with the float32 reference, print and keep the row."""
    try:
        ms, extra, loss, grads = measure(fn, x, w, t)
    except Exception as error:   # a peer that fails is reported, not fatal
        print(f"  {name}: failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
        return
    errors = [rel(loss, reference[0])] + [rel(g, r) for g, r in zip(grads, reference[1])]
    results["rows"].append(dict(tokens=n, hidden=H, vocab=V, impl=name, ms=ms, extra_mib=extra, vs_floor=ms / floor,
                                err_loss=errors[0], err_dx=errors[1], err_dw=errors[2]))
    print(f"  {name:32s} {ms:8.2f} ms ({ms / floor:.2f}x floor)  extra {extra:9.0f} MiB  "
          f"err loss {errors[0]:.1e} dx {errors[1]:.1e} dw {errors[2]:.1e}", flush=True)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                        help="trainops chunk sizes (tokens) to run")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, nargs="+", default=[128256])
    parser.add_argument("--align", type=int, nargs="+", default=[],
                        help="also run trainops's default chunk at these vocab_align values")
    parser.add_argument("--no-fp32-weight", action="store_true", help="skip the float32 master-weight rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, host=platform.node(), rows=[])
    import triton
    results["triton"] = triton.__version__
    results["copy_gbps"] = bandwidth = copy_gbps()
    global H, V
    H = args.hidden
    for V in args.vocab:
        for n in args.tokens:
            run_shape(results, args, n, bandwidth)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def run_shape(results, args, n, bandwidth):
    x, w, t = inputs(n)
    padded = -(-V // 64) * 64   # the floor: the faster of V and this
    at_v, at_padded = matmuls(x, w), matmuls(x, w, classes=padded)
    logits_ms = 2 * n * V * 2 / bandwidth / 1e6
    floor = min(at_v, at_padded) + logits_ms
    results.setdefault("floors", []).append(dict(tokens=n, hidden=H, vocab=V, matmuls_ms=at_v,
                                                 matmuls_padded_ms=at_padded, logits_pass_ms=logits_ms,
                                                 floor_ms=floor))
    print(f"== {n} tokens, H {H}, V {V}: three matmuls alone {at_v:.2f} ms (at {padded} classes "
          f"{at_padded:.2f}), logits read + write {logits_ms:.2f} ms, floor {floor:.2f} ms", flush=True)
    runs = {"torch eager": torch_loss, "torch.compile": torch.compile(torch_loss)}
    liger = liger_loss()
    if liger is not None:
        runs["liger"] = liger
    runs["trainops (default chunk)"] = trainops.linear_cross_entropy
    runs["trainops under torch.compile"] = torch.compile(lambda x, w, t: trainops.linear_cross_entropy(x, w, t))
    runs.update({f"trainops vocab_align {a}": chunked(0, a) for a in args.align})
    runs.update({f"trainops chunk {rows}": chunked(rows) for rows in args.chunks if rows <= n})
    # float32 reference from the same bf16 values: each row's error says how close it is to exact
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref_loss = F.cross_entropy(F.linear(xr, wr), t)
    reference = (ref_loss.detach(), [g.detach() for g in torch.autograd.grad(ref_loss, (xr, wr))])
    del xr, wr, ref_loss
    torch.cuda.empty_cache()
    for name, fn in runs.items():
        record(results, name, fn, x, w, t, n, floor, reference)
    if not args.no_fp32_weight:
        # float32 master weights (autocast-style training): the chunks accumulate dW into its float32 gradient
        x, w32, t = inputs(n, torch.float32)
        for rows in args.chunks:
            if rows <= n:
                record(results, f"trainops fp32 weight chunk {rows}", chunked(rows), x, w32, t, n, floor,
                       reference)
        del w32
    del x, w, t
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
