"""Embedding / GatherGrad benchmark on a CUDA device: trainops against torch and Liger, plus a config sweep.

    PYTHONPATH=src python benchmarks/bench_gather.py [--sweep] [--out results/gather-....json]

Cases: the ../shared/ANCHORS.md shapes (dY of T x D scattered into V x D), each with a uniform
and a Zipf-like index stream (p(rank r) ~ 1/r^1.1 over the vocabulary, ids shuffled so hot rows
are scattered as real tokens are). Bytes: dY read once, the index read once, dX written once.
Timed with triton.testing.do_bench (median); inputs rotate among sets when they fit in L2.
Every implementation is checked against a float64 index_add_ first.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import types

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import trainops  # noqa: E402
from trainops.bench import copy_ceiling_gbps  # noqa: E402
from trainops.ops import gather as gather_ops  # noqa: E402

CASES = [(32768, 4096, 128256, torch.bfloat16), (32768, 4096, 32000, torch.float32),
         (65536, 1024, 50257, torch.float32), (8192, 4096, 128256, torch.bfloat16)]


def index_stream(kind: str, tokens: int, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "uniform":
        return torch.randint(0, rows, (tokens,), device="cuda", generator=gen)
    weights = 1.0 / torch.arange(1, rows + 1, device="cuda", dtype=torch.float32) ** 1.1
    ranks = torch.multinomial(weights, tokens, replacement=True, generator=gen)
    return torch.randperm(rows, device="cuda", generator=gen)[ranks]


def implementations(rows: int, liger) -> dict:
    # the embedding weight gradient as autograd calls it: indices in [0, rows), checked in the forward
    def trainops_sorted(dy, idx):
        return trainops.ops.gather.gather_backward_op(dy, idx, 0, [rows, dy.shape[1]], True, None, False, False, False)

    def trainops_atomic(dy, idx):
        return trainops.ops.gather.gather_backward_op(dy, idx, 0, [rows, dy.shape[1]], False, None, False, False, False)

    def trainops_checked(dy, idx):
        return trainops.gather_backward(dy, idx, 0, [rows, dy.shape[1]])

    def torch_default(dy, idx):
        return torch.ops.aten.embedding_dense_backward(dy, idx, rows, -1, False)

    def torch_index_add(dy, idx):
        return torch.zeros(rows, dy.shape[1], device=dy.device, dtype=dy.dtype).index_add_(0, idx, dy)

    impls = {"trainops": trainops_sorted, "trainops atomic": trainops_atomic, "trainops checked": trainops_checked,
             "torch": torch_default, "torch deterministic": torch_default, "torch index_add_": torch_index_add}
    if liger is not None:
        def liger_backward(dy, idx):
            ctx = types.SimpleNamespace(saved_tensors=(idx, torch.empty(rows, dy.shape[1], device=dy.device,
                                                                          dtype=dy.dtype)))
            return liger.backward(ctx, dy)[0]
        impls["liger"] = liger_backward
    return impls


def bench_case(tokens, dim, rows, dtype, stream, impls, ceiling, l2, log):
    nbytes = tokens * dim * dtype.itemsize + tokens * 8 + rows * dim * dtype.itemsize
    sets = []
    for seed in range(1 if nbytes > 4 * l2 else 4):
        idx = index_stream(stream, tokens, rows, seed)
        gen = torch.Generator(device="cuda").manual_seed(100 + seed)
        sets.append((torch.randn(tokens, dim, device="cuda", generator=gen).to(dtype), idx))
    dy, idx = sets[0]
    ref = torch.zeros(rows, dim, device="cuda", dtype=torch.float64).index_add_(0, idx, dy.double())
    hot = torch.bincount(idx, minlength=rows).max().item()
    out = []
    for name, fn in impls.items():
        deterministic_mode = name == "torch deterministic"
        torch.use_deterministic_algorithms(deterministic_mode, warn_only=True)
        try:
            got = fn(dy, idx)
            err = ((got.double() - ref).norm() / ref.norm()).item()
            counter = iter(range(10**9))
            ms = triton.testing.do_bench(lambda: fn(*sets[next(counter) % len(sets)]), warmup=25, rep=200,
                                         return_mode="median")
        except Exception as e:  # a peer that fails is reported, not fatal
            log(f"  {name} failed: {type(e).__name__}: {str(e)[:160]}")
            continue
        finally:
            torch.use_deterministic_algorithms(False)
        gbps = nbytes / ms / 1e6
        row = dict(tokens=tokens, dim=dim, rows=rows, dtype=str(dtype).replace("torch.", ""), stream=stream,
                   hottest_row_count=hot, impl=name, ms=round(ms, 4), gbps=round(gbps, 1),
                   pct_of_copy=round(100 * gbps / ceiling, 1), error=err)
        out.append(row)
        log(f"  {tokens}x{dim}->{rows} {row['dtype']:8s} {stream:7s} {name:20s} {ms:8.4f} ms {gbps:6.0f} GB/s "
            f"{row['pct_of_copy']:5.1f}%  err {err:.1e}")
    return out


def sweep(ceiling, l2, log):
    """Tile shapes and chunk of the sorted kernel (GatherHeuristics) on two cases, both streams."""
    rows_out = []
    names = ("row_block", "row_tile", "chunk")
    variants = [(4096, 4096, 64), (4096, 4096, 32), (4096, 8192, 64), (4096, 4096, 128), (2048, 4096, 64)]
    for variant in variants:
        heuristics = gather_ops.GatherHeuristics(**dict(zip(names, variant)))
        label = "sorted " + " ".join(f"{n}={v}" for n, v in zip(names, variant))
        for tokens, dim, rows, dtype in (CASES[0], CASES[3]):
            plain = implementations(rows, None)["trainops"]

            def run(dy, idx, plain=plain, heuristics=heuristics):
                with trainops.heuristics(heuristics):
                    return plain(dy, idx)
            for stream in ("uniform", "zipf"):
                rows_out += bench_case(tokens, dim, rows, dtype, stream, {label: run}, ceiling, l2, log)
    return rows_out


def forward_rows(ceiling, log):
    """Embedding forward (gather of rows) against torch."""
    out = []
    for tokens, dim, rows, dtype in CASES[:1]:
        weight = torch.randn(rows, dim, device="cuda").to(dtype)
        idx = index_stream("uniform", tokens, rows, 0)
        nbytes = 2 * tokens * dim * dtype.itemsize + tokens * 8
        for name, fn in {"trainops": lambda: trainops.embedding(idx, weight, check_index=False),
                         "trainops checked": lambda: trainops.embedding(idx, weight),
                         "torch": lambda: torch.nn.functional.embedding(idx, weight)}.items():
            assert torch.equal(fn(), weight[idx])
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            gbps = nbytes / ms / 1e6
            out.append(dict(op="embedding forward", tokens=tokens, dim=dim, rows=rows, impl=name, ms=round(ms, 4),
                            gbps=round(gbps, 1), pct_of_copy=round(100 * gbps / ceiling, 1)))
            log(f"  forward {tokens}x{dim} from {rows} {name:16s} {ms:8.4f} ms {gbps:6.0f} GB/s "
                f"{100 * gbps / ceiling:5.1f}%")
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    log = lambda s: print(s, flush=True)  # noqa: E731
    ceiling = copy_ceiling_gbps("cuda")
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    log(f"{torch.cuda.get_device_name()}: copy ceiling {ceiling:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB")
    try:
        from liger_kernel.ops.experimental.embedding import LigerEmbeddingFunction as liger
    except Exception as e:  # noqa: BLE001
        log(f"liger not available: {e}")
        liger = None
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "copy_ceiling_gbps": round(ceiling, 1), "rows": [], "sweep": [], "forward": []}
    if args.sweep:
        results["sweep"] = sweep(ceiling, l2, log)
    for tokens, dim, rows, dtype in CASES:
        for stream in ("uniform", "zipf"):
            results["rows"] += bench_case(tokens, dim, rows, dtype, stream, implementations(rows, liger),
                                          ceiling, l2, log)
    results["forward"] = forward_rows(ceiling, log)
    log("\nsummary: trainops (deterministic) vs the others, ms")
    cases = {}
    for r in results["rows"]:
        cases.setdefault((r["tokens"], r["dim"], r["rows"], r["dtype"], r["stream"]), {})[r["impl"]] = r["ms"]
    for key, impls in cases.items():
        ours = impls.get("trainops", math.nan)
        others = {k: v for k, v in impls.items() if not k.startswith("trainops")}
        best = min(others, key=others.get) if others else None
        log(f"  {key}: trainops {ours:.4f}  atomic {impls.get('trainops atomic', math.nan):.4f}  "
            f"torch {impls.get('torch', math.nan):.4f} ({impls.get('torch', math.nan) / ours:.2f}x)  best other "
            f"{best} {others.get(best, math.nan):.4f} ({others.get(best, math.nan) / ours:.2f}x)")
    out = args.out or os.path.join(os.environ.get("OUT", "."), "gather-h100.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
