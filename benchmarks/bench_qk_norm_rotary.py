"""q/k RMSNorm + rotary embedding benchmark on a CUDA device: trainops.qk_norm_rotary (one pass)
against trainops unfused (rms_norm, then rotary_embedding), HF's sequence in torch eager, and
torch.compile of that sequence.

    PYTHONPATH=src python benchmarks/bench_qk_norm_rotary.py [--out FILE] [--quick] [--sweep] [--cpu]

A front-end of trainops.bench: the cases are ``trainops.bench.cases_qk_norm_rotary``'s (Qwen3-0.6B's
attention, b 8 x s 2048, 16 / 8 heads of 128; Llama-3.2-1B-like, 4 x 2048, 32 / 8 heads of 64;
OLMo-2-1B's norm across 16 heads of 128; bf16; forward, and forward + backward), run by
``trainops.bench.run_cases``: each implementation is checked against a float64 reference first
(q_out; with the backward, dq and q's weight gradient), then timed with triton.testing.do_bench
(median). Rows: ms, GB/s against the fewest bytes (q, k, cos, sin, weights read, outputs written;
the backward likewise), % of a 2 GiB device-to-device copy and of a copy of the case's own bytes.
JSON: {"environment", "copy_ceiling_gbps", "rows", "sweep"}. --quick: forward + backward only.
--sweep: also the fused op's QKNormRotaryHeuristics variants (programs a SM, warps, straight-line
code, tile), forward + backward, each shape (the row whose "default" is true: the defaults).
--cpu: tiny shapes on the CPU path without torch.compile (a self-check of this script).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from trainops import bench  # noqa: E402
from trainops.bench import cases_qk_norm_rotary as cases  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/qk-norm-rotary.json)")
    parser.add_argument("--quick", action="store_true", help="forward + backward cases only")
    parser.add_argument("--sweep", action="store_true", help="also time the fused op's heuristics variants")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU path (a self-check)")
    args = parser.parse_args(argv)
    log = lambda s: print(s, flush=True)  # noqa: E731
    env, ceiling = bench.start(args.cpu, log)
    import torch
    case_list = cases.qk_norm_rotary_cpu_cases() if args.cpu else cases.qk_norm_rotary_cases(torch.device("cuda"),
                                                                                               args.quick)
    rows = bench.run_cases(case_list, peers=not args.cpu, ceiling=ceiling, log=log)
    sweep = []
    if args.sweep:
        sweep_cases = ([cases.qk_case(2, 16, 4, 2, 16, torch.float32, torch.device("cpu"), True,
                                      variants=cases.SWEEP)] if args.cpu
                       else cases.qk_norm_rotary_sweep_cases(torch.device("cuda")))
        sweep = bench.run_cases(sweep_cases, peers=False, ceiling=ceiling, log=log, same_copy=False)
    log("\nsummary: trainops (fused) vs the others, ms\n" + "\n".join(bench.summary_table(rows)))
    if sweep:
        log("\nsweep (ms):\n" + "\n".join(bench.sweep_table(sweep)))
    out = args.out or os.path.join(os.environ.get("OUT", "."), "qk-norm-rotary.json")
    bench.write_results(out, env, None if ceiling is None else {"copy_ceiling_gbps": round(ceiling, 1)}, rows=rows,
                        sweep=sweep)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
