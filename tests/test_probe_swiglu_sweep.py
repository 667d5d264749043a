"""benchmarks/probe_swiglu_sweep.py on the CPU: ``--cpu`` runs its harness (float64 checks of every
candidate, plans, table, JSON) on tiny shapes with the Triton kernels under the interpreter. What
this cannot check: do_bench, do_bench_cudagraph and torch.compile (GPU only)."""

import importlib.util
import json
import os

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probe_swiglu_sweep.py")


def test_cpu_self_check_checks_every_candidate(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("_probe_swiglu_sweep", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    out = str(tmp_path / "swiglu.json")
    assert probe.main([out, "--cpu"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(f"-> {out}")
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert len(rows) == len(probe.CPU_SHAPES) * len(probe.CANDIDATES)
    assert all(r["ok"] and r["plan"]["plan"] == "flat" and r["note"] is None for r in rows), rows
    # 3x1000 fp16 at block 1024: two whole blocks and a partial one (3000 is 8 mod 16)
    assert {(r["numel"], r["plan"]["grid"]) for r in rows if r["impl"] == "block1024"} >= {(3000, 3)}
