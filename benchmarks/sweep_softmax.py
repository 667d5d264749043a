"""Sweep Triton configs of the softmax family on the GPU: which plan and block sizes win, per shape.

    PYTHONPATH=src python benchmarks/sweep_softmax.py [OUT.json] [--cpu]

A front-end of trainops.bench: ``trainops.bench.cases.softmax_config_cases`` times every config
of ``softmax_configs`` (the heuristic's choice, marked ``default``, then warps, column tiles,
looped and split plans) through ``ops.softmax._prepare_triton(problem, config)`` into a poisoned
output, checked against float64 first (triton.testing.do_bench median, 10 ms warm-up, 60 ms).
Prints a row per config, then per case the default's ms against the best config's; the heuristic
in trainops/ops/softmax.py (_choose_config) is set from these results (see benchmarks/NOTES.md).
JSON (when OUT.json is given): {"environment", "copy_ceiling_gbps", "rows"}, rows as
trainops.bench.Row plus shape / dim / dtype / config / default.
--cpu: tiny shapes under Triton's interpreter (TRITON_INTERPRET=1; a self-check of this script).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from trainops import bench  # noqa: E402
from trainops.bench import cases  # noqa: E402

PROBLEMS = [("softmax", (32768, 1024), -1, torch.bfloat16), ("softmax", (16384, 4096), -1, torch.bfloat16),
            ("softmax", (4096, 32768), -1, torch.bfloat16), ("softmax", (1024, 131072), -1, torch.bfloat16),
            ("softmax", (128, 262144), -1, torch.bfloat16), ("softmax", (4096, 32768), -1, torch.float32),
            ("softmax", (32, 512, 4096), 1, torch.bfloat16), ("softmax", (32, 512, 4096), 1, torch.float32)]
PROBLEMS += [("softmax_backward",) + p[1:] for p in PROBLEMS]
CPU_PROBLEMS = [("softmax", (8, 64), -1, torch.float32), ("softmax_backward", (4, 32), -1, torch.float32)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=None, help="JSON path (default: no JSON)")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes under Triton's interpreter (a self-check)")
    args = parser.parse_args(argv)
    if args.cpu and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        parser.error("--cpu runs the Triton configs under Triton's interpreter: set TRITON_INTERPRET=1")
    log = lambda s: print(s, flush=True)  # noqa: E731
    env, ceiling = bench.start(args.cpu, log)
    device, problems = ("cpu", CPU_PROBLEMS) if args.cpu else ("cuda", PROBLEMS)
    rows = bench.run_cases(cases.softmax_config_cases(device, problems), peers=False, ceiling=ceiling, log=log)
    log("\nper case, the heuristic's config against the best (ms):\n" + "\n".join(bench.sweep_table(rows)))
    if args.out:
        meta = {} if ceiling is None else {"copy_ceiling_gbps": round(ceiling, 1)}
        bench.write_results(args.out, env, meta, rows=rows)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
