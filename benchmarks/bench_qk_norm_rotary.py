"""q/k RMSNorm + rotary embedding on one GPU: trainops.qk_norm_rotary's backward kernels (the "tiles"
kernel, the default since this bench timed it, and the first, "tokens" kernel) side by side with Hugging Face's unfused
sequence in torch eager and under torch.compile, in one process, timed in interleaved rounds.

    PYTHONPATH=src python benchmarks/bench_qk_norm_rotary.py --out FILE [--shapes a,b] [--rounds 5]
        [--rep 100] [--quick] [--sweep] [--no-compile] [--grad-layout bshd|bhsd] [--cpu]

Shapes (8 x 2048 tokens; inputs as a Hugging Face model makes them under bf16 autocast with float32
parameters: q, k bf16 (b, s, h, d) views of the projections, norm weights float32, cos and sin
float32 (b, s, d) from the rotary module; trainops writes bf16 outputs, as ``patch`` wires it):
qwen3-0.6b (16 / 8 heads of 128), qwen3-8b (32 / 8 of 128), olmo2-1b (16 / 16 of 128, the norm across
the token's heads: ``across_heads=True``), gemma3-1b (4 / 1 of 256, weights (1 + w)).
Hugging Face's sequence: the family's RMSNorm formula (Qwen3 ``w * x_n.to(dtype)``, Gemma 3
``(x_n * (1 + w)).type_as(x)``, OLMo 2 ``(w * x_n).to(dtype)`` over the whole projection), then
``apply_rotary_pos_emb``; under autocast Qwen3's float32 weight makes its outputs float32, as in the
model (its rows' upstream gradients are then float32 too).

Configurations per shape, each timed in every round, rounds interleaved (A B C ... A B C ...):
- ``bwd``: the backward alone. trainops: ``torch.ops.trainops.qk_norm_rotary_backward`` called on
  saved inputs (no autograd), tiles and tokens kernels; torch: ``autograd.grad(..., retain_graph=True)``
  of the eager and the compiled forward (the backward graph alone).
- ``fwd``: the forward alone (trainops one kernel; eager; compiled).
- ``fwd+bwd``: forward and backward through autograd (what a training step runs).
Each timing: ``triton.testing.do_bench(..., return_mode="median")`` (L2 flushed between calls); a
configuration's figure is the median over the rounds, with the rounds' min and max. Beside it,
``kernel_ms``: the GPU time of its kernels summed under torch.profiler (3 windows of 10 calls,
median): where wall ms is well above kernel ms, the host is what was timed, not the kernels. GB/s
and % of copy (a 2 GiB device-to-device copy timed in the same process) from both, against the
fewest bytes (bwd: dq_out, dk_out, q, k, cos, sin read once, dq, dk written once; fwd: q, k, cos, sin
read once, q_out, k_out written once; the weights and their gradients; nothing else).
Every implementation's outputs (and gradients of q, k and both weights) are compared with a float64
evaluation of the same formulas first; ``max_error`` is the largest relative-norm error.
--sweep: also the tiles kernel's backward under variants of (backward_tile, warps) x
tile_programs_per_sm x tile_stages, and the tiles at 4 / 8 warps at the defaults (bwd only, in the
same rounds). --cpu: tiny shapes on the CPU (a self-check of this script,
no compile, wall time only; --shapes then names CPU_SHAPES).
JSON: {"environment", "copy_ceiling_gbps", "settings", "rows"}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import torch  # noqa: E402

import trainops  # noqa: E402
from trainops.ops.qk_norm_rotary import QKNormRotaryHeuristics  # noqa: E402
from trainops.plan import heuristics_for  # noqa: E402

SHAPES = {   # name: (batch, seq, q heads, k heads, head dim, family)
    "qwen3-0.6b": (8, 2048, 16, 8, 128, "qwen3"),
    "qwen3-8b": (8, 2048, 32, 8, 128, "qwen3"),
    "olmo2-1b": (8, 2048, 16, 16, 128, "olmo2"),
    "gemma3-1b": (8, 2048, 4, 1, 256, "gemma3"),
}
CPU_SHAPES = {"qwen3-tiny": (2, 8, 4, 2, 16, "qwen3"), "olmo2-tiny": (1, 8, 2, 2, 8, "olmo2"),
              "gemma3-tiny": (1, 4, 2, 1, 16, "gemma3")}
EPS = 1e-6
SWEEP = ([dict(backward_kernel="tiles", backward_tile=t, tile_programs_per_sm=p, tile_stages=st,
               backward_warps=((1 << 62, w),))
          for t, w in ((2048, 8), (4096, 8), (8192, 16)) for p in (2, 4, 8) for st in (1, 2, 3)]
         + [dict(backward_kernel="tiles", backward_tile=t, backward_warps=((1 << 62, w),))
            for t, w in ((2048, 4), (4096, 4), (8192, 8))])


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_sequence(family: str):
    """Hugging Face's norm (per family) of the (b, s, h, d) projections, the transpose, then
    apply_rotary_pos_emb; returns (b, h, s, d)."""
    def norm(x, w):
        dtype = x.dtype
        if family == "olmo2":
            flat = x.flatten(2).float()
            return (w * (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS))).to(dtype).view(x.shape)
        xf = x.float()
        xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        if family == "gemma3":
            return (xn * (1.0 + w.float())).type_as(x)
        return w * xn.to(dtype)

    def f(q, k, wq, wk, cos, sin):
        qn, kn = norm(q, wq).transpose(1, 2), norm(k, wk).transpose(1, 2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return qn * c + rotate_half(qn) * s, kn * c + rotate_half(kn) * s
    return f


def trainops_forward(family: str):
    def f(q, k, wq, wk, cos, sin):
        qo, ko = trainops.qk_norm_rotary(q, k, wq, wk, cos, sin, EPS, weight_offset=1.0 if family == "gemma3" else 0.0,
                                         across_heads=family == "olmo2", out_dtype=q.dtype)
        return qo.transpose(1, 2), ko.transpose(1, 2)
    return f


@dataclasses.dataclass
class Config:
    shape: str
    direction: str           # bwd | fwd | fwd+bwd
    impl: str
    fn: object               # the timed call
    nbytes: int
    heuristics: object = None
    max_error: float | None = None
    rounds: list = dataclasses.field(default_factory=list)
    kernel_ms: float | None = None

    def call(self):
        if self.heuristics is None:
            return self.fn()
        with trainops.heuristics(self.heuristics):
            return self.fn()


def _rel(a, b) -> float:
    a, b = a.double(), b.double().to(a.device)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def build(name, shape, device, compile_peers: bool, grad_layout: str, sweep: bool) -> list[Config]:
    b, s, hq, hk, d, family = shape
    gen = torch.Generator(device=device).manual_seed(1)
    dtype = torch.bfloat16

    def randn(*size, dt=torch.float32, scale=1.0):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dt)
    q, k = randn(b, s, hq, d, dt=dtype, scale=2.0), randn(b, s, hk, d, dt=dtype, scale=2.0)
    nq, nk = (hq * d, hk * d) if family == "olmo2" else (d, d)
    offset = 1.0 if family == "gemma3" else 0.0
    wq, wk = randn(nq, scale=0.1) + (1.0 - offset), randn(nk, scale=0.1) + (1.0 - offset)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    angles = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv
    angles = torch.cat((angles, angles), -1)[None].expand(b, s, d)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()   # (b, s, d) float32, as the model's

    def upstream(shape_bhsd, dt):   # SDPA's gradients of (b, h, s, d) views
        if grad_layout == "bshd":   # the storage in (b, s, h, d) order
            return randn(shape_bhsd[0], shape_bhsd[2], shape_bhsd[1], shape_bhsd[3], dt=dt).transpose(1, 2)
        return randn(*shape_bhsd, dt=dt)

    e = dtype.itemsize
    elements = b * s * (hq + hk) * d
    tables = 2 * cos.numel() * cos.element_size()
    weights = (nq + nk) * 4
    fwd_bytes = 2 * elements * e + tables + weights
    bwd_bytes = 3 * elements * e + tables + 2 * weights
    leaves = [t.detach().requires_grad_() for t in (q, k, wq, wk)]

    # float64 reference of every output and gradient
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, wq, wk)]
    fused = trainops_forward(family)
    hf = hf_sequence(family)
    g_q, g_k = upstream((b, hq, s, d), dtype), upstream((b, hk, s, d), dtype)
    ref_out = _reference(family, *ref_leaves, cos.double(), sin.double(), offset)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, (g_q.double(), g_k.double()), retain_graph=True)

    configs = []
    impls = {"trainops": fused, "torch eager (HF)": hf}
    if compile_peers:
        impls["torch.compile (HF)"] = torch.compile(hf, dynamic=False)
    for impl, f in impls.items():
        variants = [("tiles", QKNormRotaryHeuristics(backward_kernel="tiles")),
                    ("tokens", QKNormRotaryHeuristics(backward_kernel="tokens"))] \
            if impl == "trainops" else [("", None)]
        errors = {}
        for label, h in variants:   # forward and backward through autograd against float64
            with trainops.heuristics(h) if h is not None else _null():
                out = f(*leaves, cos, sin)
                # the reference's upstream gradients, cast to the output dtype
                grads = torch.autograd.grad(out, leaves, tuple(u.to(o.dtype) for u, o in zip((g_q, g_k), out)))
            errors[label] = max([_rel(o.transpose(1, 2), r.transpose(1, 2)) for o, r in zip(out, ref_out)]
                                + [_rel(g, r) for g, r in zip(grads, ref_grads)])
        ups = tuple(upstream(o.shape, o.dtype) for o in out)

        def fwd(f=f):
            with torch.no_grad():
                return f(q, k, wq, wk, cos, sin)

        def fwd_bwd(f=f, ups=ups):
            o = f(*leaves, cos, sin)
            return torch.autograd.grad(o, leaves, ups)
        configs.append(Config(name, "fwd", impl, fwd, fwd_bytes, max_error=errors[variants[0][0]]))
        for label, h in variants:
            configs.append(Config(name, "fwd+bwd", f"{impl} {label}".strip(), fwd_bwd, fwd_bytes + bwd_bytes, h,
                                  max_error=errors[label]))
        if impl == "trainops":
            op = torch.ops.trainops.qk_norm_rotary_backward
            dq_out, dk_out = (u.transpose(1, 2) for u in ups)   # (b, s, h, d) views, as the op sees them
            want = ref_grads_for(ref_leaves, ref_out, ups)

            def bwd_op(kernel):   # the variant's kernel, as its forward would pass it
                return op(dq_out, dk_out, q, k, wq, wk, cos, sin, EPS, offset, family == "olmo2", True, kernel)
            backward_variants = [(f"trainops {label}", h) for label, h in variants]
            if sweep:
                for fields in SWEEP:
                    h = QKNormRotaryHeuristics(**fields)
                    backward_variants.append((f"trainops tiles tile={h.backward_tile} pps={h.tile_programs_per_sm} "
                                              f"stages={h.tile_stages} warps={h.backward_warps[0][1]}", h))
            for label, h in backward_variants:   # each checked against float64 (its first call compiles)
                run = functools.partial(bwd_op, (h or heuristics_for(QKNormRotaryHeuristics)).backward_kernel)
                with trainops.heuristics(h) if h is not None else _null():
                    got = run()
                berr = max(_rel(g, r) for g, r in zip(got, want))
                configs.append(Config(name, "bwd", label, run, bwd_bytes, h, max_error=berr))
        else:
            o = f(*leaves, cos, sin)

            def bwd_graph(o=o, ups=ups):
                return torch.autograd.grad(o, leaves, ups, retain_graph=True)
            configs.append(Config(name, "bwd", impl, bwd_graph, bwd_bytes, max_error=errors[""]))
    return configs


def ref_grads_for(ref_leaves, ref_out, ups):
    return torch.autograd.grad(ref_out, ref_leaves, tuple(u.double() for u in ups), retain_graph=True)


def _reference(family, q, k, wq, wk, cos, sin, offset):
    """float64: the op's formulas (the norm over the head, or across heads for OLMo 2)."""
    def one(x, w):
        b, s, h, d = x.shape
        xf = x.reshape(b, s, h * d) if family == "olmo2" else x
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * (w + offset)
        y = y.reshape(b, s, h, d).transpose(1, 2)
        c, sn = cos[:, None], sin[:, None]
        return y * c + rotate_half(y) * sn
    return one(q, wq), one(k, wk)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def time_config(c: Config, rep: int, cpu: bool) -> float:
    if cpu:
        t0 = time.perf_counter()
        for _ in range(3):
            c.call()
        return (time.perf_counter() - t0) / 3 * 1e3
    import triton.testing
    return triton.testing.do_bench(c.call, warmup=max(5, rep // 10), rep=rep, return_mode="median")


def _line(row, ceiling) -> str:
    """One row of the printed table (the header without a row)."""
    if row is None:
        return (f"{'shape':11s} {'dir':7s} {'impl':42s} {'ms':>8s} {'rounds min-max':>15s} {'kern ms':>8s} "
                f"{'floor':>7s} {'%copy':>6s} {'k%copy':>6s} {'error':>8s}")
    def num(v, fmt, width):
        return format(v, fmt) if v is not None else "-".rjust(width)
    return (f"{row['shape']:11s} {row['direction']:7s} {row['impl'][:42]:42s} {row['ms']:8.4f} "
            f"{row['ms_min']:7.4f}-{row['ms_max']:7.4f} {num(row['kernel_ms'], '8.4f', 8)} "
            f"{num(row.get('floor_ms'), '7.4f', 7)} {num(row.get('pct_copy'), '6.1f', 6)} "
            f"{num(row.get('kernel_pct_copy'), '6.1f', 6)} {num(row['max_error'], '8.1e', 8)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/qk-norm-rotary.json or ./)")
    parser.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rep", type=int, default=100, help="do_bench's rep (ms) per timing")
    parser.add_argument("--sweep", action="store_true", help="also the tiles kernel's heuristics variants (bwd)")
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile of HF's sequence")
    parser.add_argument("--grad-layout", choices=("bshd", "bhsd"), default="bshd",
                        help="storage order of the upstream gradients of the (b, h, s, d) outputs")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (a self-check)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of rep 50 ms (sets --rounds and --rep)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.rep = 2, 50
    log = lambda s: print(s, flush=True)  # noqa: E731
    from trainops.bench import copy_ceiling_gbps, environment, kernel_ms
    env = environment()
    table = CPU_SHAPES if args.cpu else SHAPES
    names = list(table) if args.shapes is None else args.shapes.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; known: {list(table)}")
    if args.cpu:
        device, ceiling = torch.device("cpu"), None
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device (--cpu runs tiny shapes on the CPU)")
        device, ceiling = torch.device("cuda"), copy_ceiling_gbps("cuda")
    log(f"{env['device']}: torch {env['torch']}, triton {env['triton']}"
        + (f", copy ceiling {ceiling:.0f} GB/s" if ceiling else " (CPU self-check, no % of copy)"))
    configs = []
    for name in names:
        t0 = time.perf_counter()
        built = build(name, table[name], device, not (args.cpu or args.no_compile), args.grad_layout, args.sweep)
        kept = []
        for c in built:   # warm-up: Triton and Inductor compile here, not in a timed round
            try:
                c.call()
                kept.append(c)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported and left out
                if c.impl.startswith("trainops"):
                    raise
                log(f"  {name} {c.direction} {c.impl}: left out ({type(e).__name__}: {str(e)[:200]})")
        built = kept
        log(f"{name}: {len(built)} configurations built and checked in {time.perf_counter() - t0:.1f} s; "
            f"largest error {max(c.max_error or 0 for c in built):.2e}")
        configs += built
    if device.type == "cuda":
        torch.cuda.synchronize()
    for r in range(args.rounds):   # interleaved: every configuration once a round
        for c in configs:
            c.rounds.append(time_config(c, args.rep, args.cpu))
        log(f"round {r + 1}/{args.rounds} done")
    if not args.cpu:
        for c in configs:
            c.kernel_ms = kernel_ms(c.call, steps=10, windows=3, warmup=2)
    rows = []
    for c in configs:
        ms = statistics.median(c.rounds)
        row = dict(shape=c.shape, direction=c.direction, impl=c.impl, ms=ms, ms_min=min(c.rounds),
                   ms_max=max(c.rounds), rounds=c.rounds, kernel_ms=c.kernel_ms, bytes=c.nbytes,
                   gbps=c.nbytes / ms / 1e6, max_error=c.max_error,
                   heuristics=None if c.heuristics is None else repr(c.heuristics))
        if c.kernel_ms:
            row["kernel_gbps"] = c.nbytes / c.kernel_ms / 1e6
        if ceiling:
            row["pct_copy"] = 100 * row["gbps"] / ceiling
            if c.kernel_ms:
                row["kernel_pct_copy"] = 100 * row["kernel_gbps"] / ceiling
            row["floor_ms"] = c.nbytes / ceiling / 1e6
        rows.append(row)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "qk-norm-rotary.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"environment": env, "copy_ceiling_gbps": ceiling,
                   "settings": dict(rounds=args.rounds, rep=args.rep, grad_layout=args.grad_layout,
                                    compile=not (args.cpu or args.no_compile), sweep=args.sweep),
                   "rows": rows}, f, indent=1)
    order = {"bwd": 0, "fwd+bwd": 1, "fwd": 2}
    rows.sort(key=lambda r: (names.index(r["shape"]), order[r["direction"]]))
    main_rows = [r for r in rows if " tile=" not in r["impl"]]
    sweep_rows = sorted((r for r in rows if " tile=" in r["impl"]),
                        key=lambda r: (names.index(r["shape"]), r["kernel_ms"] or r["ms"]))
    for title, part in (("", main_rows), ("sweep of the tiles backward (fastest first, by kernel ms)", sweep_rows)):
        if not part:
            continue
        log(("\n" + title if title else "") + "\n" + _line(None, ceiling))
        for row in part:
            log(_line(row, ceiling))
    log("\nsummary (kernel ms where measured, else wall ms):")
    for name in names:
        def pick(direction, impl):
            r = next((r for r in main_rows if r["shape"] == name and r["direction"] == direction
                      and r["impl"] == impl), None)
            return None if r is None else (r["kernel_ms"] or r["ms"])
        tiles, tokens = pick("bwd", "trainops tiles"), pick("bwd", "trainops tokens")
        compiled = pick("bwd", "torch.compile (HF)")
        both, both_c = pick("fwd+bwd", "trainops tiles"), pick("fwd+bwd", "torch.compile (HF)")
        line = f"  {name}: backward tiles {tiles:.4f} ms, tokens {tokens:.4f} ({tokens / tiles:.2f}x)"
        if compiled:
            line += f", torch.compile {compiled:.4f} ({compiled / tiles:.2f}x)"
        if both and both_c:
            line += f"; fwd+bwd tiles {both:.4f} vs torch.compile {both_c:.4f} ({both_c / both:.2f}x)"
        log(line)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
