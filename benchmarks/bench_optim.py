"""Optimizer-step benchmark on a CUDA device: trainops against torch foreach and torch fused.

    PYTHONPATH=src python benchmarks/bench_optim.py [--sweep] [--out FILE] [--cpu]

A front-end of trainops.bench: ``trainops.bench.cases.optimizer_first_step_errors`` (our first
step against torch fused's on 10 tensors, each < 1e-5 or the run stops), then
``optimizer_variant_cases``, ``optimizer_sweep_cases`` (--sweep: MultiTensorHeuristics block x
warps of the AdamW kernel) and ``optimizer_launch_bound_cases``, run by ``trainops.bench.run_cases``.
Cases (../shared/ANCHORS.md): 1.485 B float32 parameters in 96 tensors. Bytes per parameter are
the fewest the step must move: AdamW reads p, g, m, v and writes p, m, v (28 B in float32); with
bf16 parameters and a float32 master copy it reads master, g and writes master, p (28 B too); SGD
with momentum 20 B; LAMB 40 B (two passes: the trust ratio needs the whole update's norm). With a global-norm
clip or a GradScaler the gradients must be read once more (+4 B): they are counted.
Timed with triton.testing.do_bench (median) on random (never zero) data; the launch-bound case
(200 x 4096 float32) with CUDA events around 200 steps after 20. JSON: {"environment",
"copy_ceiling_gbps", "checks", "rows", "sweep"} (rows as trainops.bench.Row plus bytes_per_param,
params, tensors, dtype). --cpu: tiny sizes on the CPU path (a self-check of this script, run by CI).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from trainops import bench  # noqa: E402
from trainops.bench import cases  # noqa: E402

TOTAL, TENSORS = 1_485_000_000, 96
SMALL = (200, 4096)      # tensors x elements of the launch-bound case
CHECK = (10, 100_003)    # tensors x elements of the first-step checks
CPU_TOTAL, CPU_TENSORS, CPU_SMALL, CPU_CHECK = 6 * 1000, 6, (4, 64), (2, 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time block/warp variants of the AdamW kernel")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/optim-h100-<date>.json)")
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU path (a self-check)")
    args = parser.parse_args(argv)
    log = lambda s: print(s, flush=True)  # noqa: E731
    env, ceiling = bench.start(args.cpu, log)
    if args.cpu:
        device, total, count, small, check = "cpu", CPU_TOTAL, CPU_TENSORS, CPU_SMALL, CPU_CHECK
    else:
        device, total, count, small, check = "cuda", TOTAL, TENSORS, SMALL, CHECK
    checks = cases.optimizer_first_step_errors(device, *check)
    log(f"first-step checks (relative error vs torch fused): {checks}")
    run = lambda case_list: bench.run_cases(case_list, peers=False, ceiling=ceiling, log=log)  # noqa: E731
    rows = run(cases.optimizer_variant_cases(device, total, count))
    sweep = run(cases.optimizer_sweep_cases(device, total, count)) if args.sweep else []
    rows += run(cases.optimizer_launch_bound_cases(device, *small))
    log("\nsummary (ms per step):\n" + "\n".join(bench.summary_table(rows)))
    if sweep:
        log("\nsweep (ms):\n" + "\n".join(bench.sweep_table(sweep)))
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"optim-h100-{dt.date.today():%Y%m%d}.json")
    meta = {"checks": checks} if ceiling is None else {"copy_ceiling_gbps": round(ceiling, 1), "checks": checks}
    bench.write_results(out, env, meta, rows=rows, sweep=sweep)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
