"""Command line: ``python -m trainops kernels | env | bench | train``."""

from __future__ import annotations

import argparse
import sys


def _print_table(rows: list[dict]) -> None:
    if not rows:
        print("(nothing)")
        return
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        from .train import main as train_main
        return train_main(argv[1:])
    if argv[:1] == ["bench"] and "--memory" in argv[1:]:   # its own options: trainops.bench.memory
        from .bench import memory
        return memory.main([a for a in argv[1:] if a != "--memory"])
    parser = argparse.ArgumentParser(prog="python -m trainops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("kernels", help="print the kernel registry")
    sub.add_parser("env", help="versions, devices and the kernel each op would run here (for bug reports)")
    sub.add_parser("train", help="train a byte-level GPT on the standard library's sources (--help for options)")
    bench = sub.add_parser("bench", help="time every op against torch (and peers when installed)")
    bench.add_argument("--quick", action="store_true", help="small shapes, few repeats (a self-check)")
    bench.add_argument("--ops", default="all", help="comma-separated op names (default: all)")
    bench.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/<device>-<date>.json; "
                       "with --step: ./bench-step-<model>-<device>-<date>.json, or that name in a directory)")
    bench.add_argument("--no-peers", action="store_true", help="skip torch.compile and peer libraries")
    bench.add_argument("--sweep", action="store_true",
                       help="time trainops against the best of torch eager, torch.compile and quack (where installed) "
                            "on issue 42's shape classes and shapes drawn from what users run (trainops.bench.sweep); "
                            "--ops picks families")
    bench.add_argument("--sweep-shapes", type=int, default=200, help="with --sweep: problems per family (default 200)")
    bench.add_argument("--sweep-seconds", type=float, default=None,
                       help="with --sweep: start no new problem after this many seconds")
    bench.add_argument("--sweep-kernel-time", action=argparse.BooleanOptionalAction, default=None,
                       help="with --sweep: also time each implementation's GPU kernels without the host (a CUDA "
                            "graph's replay, or torch.profiler's kernel sum where capture fails), reported beside "
                            "the host-inclusive time (default on; about doubles each problem's timing)")
    bench.add_argument("--compiled-choice", action="store_true",
                       help="measure our kernels against Inductor's fusion of their decompositions under "
                            "torch.compile (trainops.compiled); --write-table PATH writes the table trainops ships; "
                            "--ops picks ops (the table written keeps the other ops' shipped entries)")
    bench.add_argument("--write-table", default=None, help="with --compiled-choice: where to write compiled_table.py")
    bench.add_argument("--memory", action="store_true",
                       help="training-step memory (weights, gradients, optimizer states, activations, peak) by "
                            "optimizer configuration: its own options, see --memory --help (trainops.bench.memory)")
    from .bench import step
    step.add_arguments(bench)
    args = parser.parse_args(argv)

    if args.command == "kernels":
        import trainops
        from .compiled import CompiledChoices
        from .plan import heuristics_for
        from .registry import backend_notes, op_spec, ops
        _print_table([k.row() for k in trainops.kernels()])
        chooses = [(op, op_spec(op).choose_backend) for op in ops() if op_spec(op).choose_backend is not None]
        print("\nwith no backend pinned, the backend chosen per problem (register_op's choose_backend; every "
              "other op: triton on CUDA, cpu on the CPU):")
        for op, choose in chooses:
            print(f"  {op}: {' '.join((choose.__doc__ or choose.__qualname__).split())}")
        for name, note in backend_notes().items():
            print(f"  the {name} backend: {note}")
        print("\nunder torch.compile, Inductor's fusion of the op's decomposition instead of our kernel "
              "(trainops.compiled; every other problem runs our kernel):")
        _print_table(heuristics_for(CompiledChoices).rows())
        return 0
    if args.command == "env":
        from . import env
        print(env.format_report(env.collect()))
        return 0
    if args.write_table is not None and not args.compiled_choice:
        bench.error("argument --write-table: only with --compiled-choice")
    if args.compiled_choice:
        if args.sweep or args.quick or step.given(args):
            bench.error("argument --compiled-choice: runs alone (no --sweep, --step or --quick)")
        from .bench import compiled_choice
        chosen = compiled_choice.OPS if args.ops == "all" else tuple(args.ops.split(","))
        unknown = sorted(set(chosen) - set(compiled_choice.OPS))
        if unknown or len(set(chosen)) != len(chosen):
            bench.error(f"argument --ops: with --compiled-choice, distinct ops among those with a decomposition "
                        f"({', '.join(compiled_choice.OPS)}), or 'all'; got {args.ops!r}")
        return compiled_choice.main(args.out, args.write_table, chosen)
    if step.given(args):
        return step.main(args, bench.error)
    if not args.sweep and (args.sweep_shapes != 200 or args.sweep_seconds is not None
                           or args.sweep_kernel_time is not None):
        bench.error("argument --sweep-shapes/--sweep-seconds/--sweep-kernel-time: only with --sweep")
    if args.sweep:
        from .bench import sweep
        if args.quick or args.no_peers:
            bench.error("argument --sweep: times torch.compile on every shape; leave out --quick and --no-peers")
        if args.sweep_shapes < 1:
            bench.error(f"argument --sweep-shapes: must be at least 1, got {args.sweep_shapes}")
        if args.sweep_seconds is not None and not args.sweep_seconds > 0:
            bench.error(f"argument --sweep-seconds: must be above 0, got {args.sweep_seconds}")
        families = sweep.FAMILIES if args.ops == "all" else tuple(args.ops.split(","))
        if len(set(families)) != len(families):
            bench.error(f"argument --ops: a family is named twice in {args.ops!r}")
        unknown = sorted(set(families) - set(sweep.FAMILIES))
        if unknown:
            bench.error(f"argument --ops: {', '.join(unknown)} not among the sweep's families "
                        f"({', '.join(sweep.FAMILIES)}), or 'all'")
        return sweep.main(args.sweep_shapes, args.sweep_seconds, families, args.out,
                          kernel=args.sweep_kernel_time is not False)
    if args.ops != "all":
        from .registry import ops as registered_ops
        unknown = sorted(set(args.ops.split(",")) - set(registered_ops()))
        if unknown:
            bench.error(f"argument --ops: {', '.join(unknown)} not among the registered ops "
                         f"({', '.join(registered_ops())}), or 'all'")
    from . import bench as bench_module
    return bench_module.main(quick=args.quick, ops=args.ops, out=args.out, peers=not args.no_peers)


if __name__ == "__main__":
    sys.exit(main())
