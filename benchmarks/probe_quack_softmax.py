"""Check the softmax family's quack rule on the GPU: Triton against quack over row lengths, both ways.

    PYTHONPATH=src python benchmarks/probe_quack_softmax.py [OUT.json] [--dtype bfloat16] [--elements 134217728]
        [--columns 32000,151936] [--ops softmax_backward] [--cpu]

ops/softmax.py puts softmax and its backward on quack's kernels for bf16 / fp16 rows in the ranges
QUACK_COLUMNS[op] on sm_90 (softmax 16384 to 524288, softmax_backward 24576 to 28672 and 32776 to
524288: this probe's H200 runs of 2026-11-30, benchmarks/results/probe-quack-softmax-bf16-h200-20261130-s8.json
and probe-quack-bwd{,-split}-h200-20261130-s9.json), forward only where the length is a multiple of
QUACK_COLUMN_MULTIPLE["softmax"] (8192) and quack_forward_fills_every_warp (quack's forward returned
NaN at 151936 and 152064), so the forward's "agrees" column says "no" at such lengths by design.
This times, per op (softmax, softmax_backward) and row length N in COLUMNS (8192 to 524288, around
and past both ends), rows = elements // N of contiguous inputs: trainops (the rule's choice; the
row's ``backend`` says which), trainops with Triton pinned, trainops with quack pinned (our wrapper
of quack's call), quack's own call (the peer), and torch (trainops.bench: do_bench medians, each
row's relative error against float64; the softmax cases set no tolerance, so read the err column: a
nan there does not stop the run). Then per (op, N): Triton's ms against quack's (pinned), which is
faster, and whether the rule picks that one ("agrees"): a "no" outside the op's range means the
range should grow, one inside it that it should shrink.
--cpu: tiny shapes under Triton's interpreter (TRITON_INTERPRET=1; a self-check of this script, no quack).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import trainops  # noqa: E402
from trainops import bench  # noqa: E402
from trainops.bench import cases  # noqa: E402

COLUMNS = [8192, 16384, 24576, 32760, 32768, 49152, 65536, 131072, 151936, 262144, 524288]
ELEMENTS = 4096 * 32768        # the rows x columns of issue 42's 4096x32768 and 1024x131072
OPS = ("softmax", "softmax_backward")
CPU_COLUMNS, CPU_ELEMENTS = [64, 96], 256


def agreement_table(rows: list[bench.Row]) -> list[str]:
    """Per (op, N): Triton-pinned ms, quack-pinned ms, the faster, the rule's backend, agrees."""
    by_case: dict[tuple[str, str], dict[str, bench.Row]] = {}
    for r in rows:
        by_case.setdefault((r.op, r.case), {})[r.impl] = r
    lines = [f"{'op':18s} {'case':28s} {'triton ms':>10s} {'quack ms':>10s} {'faster':>7s} {'rule':>7s} agrees"]
    for (op, case), impls in by_case.items():
        triton, quack, rule = impls.get("trainops triton"), impls.get("trainops quack"), impls.get("trainops")
        if triton is None or quack is None or rule is None:
            lines.append(f"{op:18s} {case:28s} (no {'quack' if quack is None else 'triton'} row)")
            continue
        faster = "quack" if quack.ms < triton.ms else "triton"
        chosen = rule.fields.get("backend")
        lines.append(f"{op:18s} {case:28s} {triton.ms:10.4f} {quack.ms:10.4f} {faster:>7s} {chosen:>7s} "
                     f"{'yes' if chosen == faster else 'NO'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=None, help="JSON path (default: no JSON)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--elements", type=int, default=ELEMENTS, help="rows x columns of each case")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes under Triton's interpreter (a self-check)")
    parser.add_argument("--columns", default=None, help="comma-separated row lengths (default: COLUMNS)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    args = parser.parse_args(argv)
    if args.elements < 1:
        parser.error(f"argument --elements: must be positive, got {args.elements}")
    ops = tuple(args.ops.split(","))
    if not set(ops) <= set(OPS):
        parser.error(f"argument --ops: {args.ops!r}; the ops are {', '.join(OPS)}")
    try:
        chosen = [int(n) for n in args.columns.split(",")] if args.columns else None
    except ValueError:
        parser.error(f"argument --columns: {args.columns!r} is not a comma-separated list of integers")
    if chosen is not None and min(chosen) < 1:
        parser.error(f"argument --columns: row lengths must be positive, got {args.columns}")
    if args.cpu and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        parser.error("--cpu runs the Triton kernels under Triton's interpreter: set TRITON_INTERPRET=1")
    log = lambda s: print(s, flush=True)  # noqa: E731
    env, ceiling = bench.start(args.cpu, log)
    dtype = getattr(torch, args.dtype)
    device, columns, elements = ("cpu", CPU_COLUMNS, CPU_ELEMENTS) if args.cpu else ("cuda", COLUMNS, args.elements)
    columns = chosen or columns
    pinned = ("triton",) if args.cpu else ("triton", "quack")
    if not args.cpu:
        try:
            with trainops.backend("quack"):
                trainops.lookup("softmax", "cuda", dtype)
        except trainops.UnsupportedError as e:
            log(f"no quack backend here ({e}); install the quack extra first (benchmarks/notes/quack-backend.md)")
            return 1
    problems = [(op, (max(1, elements // n), n)) for op in ops for n in columns]
    case_list = [cases._softmax_case(op, shape, -1, dtype, device, compiled=False, pinned=pinned)
                 for op, shape in problems]
    rows = bench.run_cases(case_list, peers=True, ceiling=ceiling, log=log)
    log("\nTriton against quack (both through trainops, pinned), and the rule's choice:\n"
        + "\n".join(agreement_table(rows)))
    if args.out:
        meta = {} if ceiling is None else {"copy_ceiling_gbps": round(ceiling, 1)}
        bench.write_results(args.out, env, meta, rows=rows)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
