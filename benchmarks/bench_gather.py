"""Embedding / GatherGrad benchmark on a CUDA device: trainops against torch and Liger, plus a config sweep.

    PYTHONPATH=src python benchmarks/bench_gather.py [--sweep] [--no-peers] [--out FILE] [--cpu]

A front-end of trainops.bench: the cases are ``trainops.bench.cases.gather_backward_stream_cases``,
``gather_sweep_cases`` (--sweep: GatherHeuristics variants on the first and last shapes) and
``embedding_forward_cases`` (the first shape), run by ``trainops.bench.run_cases``. Cases: the
../shared/ANCHORS.md shapes (dY of T x D scattered into V x D), each with a uniform and a Zipf-like
index stream (p(rank r) ~ 1/r^1.1 over the vocabulary, ids shuffled so hot rows are scattered as
real tokens are; the hottest row's count is in each row). Bytes: dY read once, the index read
once, dX written once. Timed with triton.testing.do_bench (median); inputs rotate among 4 sets
when they fit in 4x L2. Every implementation is checked against a float64 index_add_ first (the
forward: equal to weight[idx]); "torch deterministic" runs in torch's deterministic mode.
JSON: {"environment", "copy_ceiling_gbps", "l2_bytes", "rows", "sweep", "forward"}.
--cpu: tiny shapes on the CPU path without peers, with a nominal 2 KiB "L2" so that both the
rotated (4 sets) and the single-set cases run (a self-check of this script, run by CI).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from trainops import bench  # noqa: E402
from trainops.bench import cases  # noqa: E402

SHAPES = [(32768, 4096, 128256, torch.bfloat16), (32768, 4096, 32000, torch.float32),
          (65536, 1024, 50257, torch.float32), (8192, 4096, 128256, torch.bfloat16)]
CPU_SHAPES = [(64, 16, 100, torch.bfloat16), (256, 8, 50, torch.float32)]
CPU_L2_BYTES = 2048


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time GatherHeuristics variants")
    parser.add_argument("--no-peers", action="store_true", help="skip Liger")
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/gather-h100.json)")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU path, no peers (a self-check)")
    args = parser.parse_args(argv)
    log = lambda s: print(s, flush=True)  # noqa: E731
    env, ceiling = bench.start(args.cpu, log)
    device, shapes, l2 = ("cpu", CPU_SHAPES, CPU_L2_BYTES) if args.cpu else ("cuda", SHAPES, bench.l2_cache_bytes())
    log(f"L2 {l2 / 2**20:.3g} MiB: inputs of cases moving at most {4 * l2 / 2**20:.3g} MiB rotate among 4 sets")
    run = lambda case_list, peers=False: bench.run_cases(case_list, peers=peers, ceiling=ceiling, log=log)  # noqa
    sweep = run(cases.gather_sweep_cases(device, [shapes[0], shapes[-1]], l2)) if args.sweep else []
    rows = run(cases.gather_backward_stream_cases(device, shapes, l2), peers=not (args.no_peers or args.cpu))
    forward = run(cases.embedding_forward_cases(device, shapes[:1]))
    log("\nsummary: trainops (deterministic) vs the others, ms\n" + "\n".join(bench.summary_table(rows + forward)))
    if sweep:
        log("\nsweep (ms):\n" + "\n".join(bench.sweep_table(sweep)))
    out = args.out or os.path.join(os.environ.get("OUT", "."), "gather-h100.json")
    meta = {"l2_bytes": l2} if ceiling is None else {"copy_ceiling_gbps": round(ceiling, 1), "l2_bytes": l2}
    bench.write_results(out, env, meta, rows=rows, sweep=sweep, forward=forward)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
