"""Cross-entropy forward + backward on a CUDA device: trainops against torch, torch.compile and Liger.

    PYTHONPATH=src python benchmarks/bench_cross_entropy.py [--sweep] [--no-peers] [--out FILE] [--cpu]
        [--shapes 16384x50257,8192x32001]

A front-end of trainops.bench: the cases are ``trainops.bench.cases.cross_entropy_variant_cases``
(and ``cross_entropy_sweep_cases`` with --sweep: CrossEntropyHeuristics variants), run by
``trainops.bench.run_cases``. Cases: the ../shared/ANCHORS.md shapes, or --shapes (bf16 logits, int64 targets,
mean reduction). Bytes: the logits read once and their gradient written once (the floor of a fused
loss + gradient; "forward only" is credited half). Each call is a full training-step loss:
forward, then backward into a leaf's .grad (reset to None each call). Timed with
triton.testing.do_bench (median, 10 ms warm-up, 100 ms); every implementation's gradient is
compared with a float64 torch reference first. JSON: {"environment", "copy_ceiling_gbps", "rows",
"sweep"} (rows as trainops.bench.Row plus rows / classes / dtype; sweep rows also heuristics /
default). --cpu: tiny shapes on the CPU path without peers (a self-check of this script, run by CI).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from trainops import bench  # noqa: E402
from trainops.bench import cases  # noqa: E402

SHAPES = [(8192, 32000), (8192, 128256), (4096, 262144)]
CPU_SHAPES = [(16, 100), (8, 300)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time CrossEntropyHeuristics variants")
    parser.add_argument("--no-peers", action="store_true", help="skip torch.compile, Liger and quack")
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/cross-entropy-h100.json)")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU path, no peers (a self-check)")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated ROWSxCLASSES shapes instead of the ANCHORS.md ones (e.g. 16384x50257)")
    args = parser.parse_args(argv)
    requested = None
    if args.shapes:
        try:
            requested = [(int(rows), int(classes)) for rows, classes in (shape.split("x") for shape in args.shapes.split(","))]
        except ValueError:
            requested = []
        if not requested or any(rows < 1 or classes < 1 for rows, classes in requested):
            parser.error(f"--shapes: expected ROWSxCLASSES[,ROWSxCLASSES...] of positive ints, got {args.shapes!r}")
    log = lambda s: print(s, flush=True)  # noqa: E731
    env, ceiling = bench.start(args.cpu, log)
    device, shapes = ("cpu", CPU_SHAPES) if args.cpu else ("cuda", SHAPES)
    shapes = requested or shapes
    sweep = []
    if args.sweep:
        sweep = bench.run_cases(cases.cross_entropy_sweep_cases(device, shapes), peers=False, ceiling=ceiling, log=log)
    rows = bench.run_cases(cases.cross_entropy_variant_cases(device, shapes), peers=not (args.no_peers or args.cpu),
                           ceiling=ceiling, log=log)
    log("\nsummary (ms, fwd+bwd):\n" + "\n".join(bench.summary_table(rows)))
    if sweep:
        log("\nsweep (ms):\n" + "\n".join(bench.sweep_table(sweep)))
    out = args.out or os.path.join(os.environ.get("OUT", "."), "cross-entropy-h100.json")
    meta = {} if ceiling is None else {"copy_ceiling_gbps": round(ceiling, 1)}
    bench.write_results(out, env, meta, rows=rows, sweep=sweep)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
