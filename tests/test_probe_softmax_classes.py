"""benchmarks/probe_softmax_classes.py on the CPU: ``--cpu-check`` runs its harness (checks, plans,
candidate grid, JSON, table) on tiny shapes with the Triton kernels under the interpreter, and
``--plans-only`` prints the plan of every shape and candidate for the H200's 132 SMs. What this
cannot check: do_bench, the copy ceiling, torch.compile and the Triton cache diagnostics (GPU only).
"""

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probe_softmax_classes.py")


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("_probe_softmax_classes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_check_checks_every_candidate(probe, tmp_path, capsys):
    out = str(tmp_path / "classes.json")
    assert probe.main(["--cpu-check", "--out", out]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == f"wrote {out}"
    with open(out) as f:
        result = json.load(f)
    assert result["versions"]["torch"] and result["versions"]["triton"] and not result["skipped"]
    tolerance = result["settings"]["tolerance"]
    rows = result["rows"]
    for cls, shapes in probe.CPU_SHAPES.items():
        names = ["default", *probe.CANDIDATES[cls]]
        assert list(result["candidates"][cls]) == names
        for shape, dtype in shapes:
            label = probe.label_of(shape, dtype)
            got = {r["impl"]: r for r in rows if r["class"] == cls and r["label"] == label}
            assert list(got) == ["torch eager", *names], (cls, label)   # no torch.compile on the CPU
            for name, r in got.items():
                assert "error" not in r, r
                if "same_as" in r:   # a plan already checked and timed for this shape
                    assert r["same_as"] in got and "ms" in got[r["same_as"]], r
                    continue
                assert r["ok"] and r["rel_err"] <= tolerance[r["dtype"]] and r["ms"] > 0, r
                assert (r["family"] == "trainops") == ("plan" in r), r
    kinds = {r["plan_short"].split()[0] for r in rows if "plan_short" in r and "same_as" not in r}
    assert kinds == {"fused", "exchange", "looped", "split"}   # the cpu check reaches every plan kind
    assert [s["label"] for s in result["summary"]] == [probe.label_of(*s) for _, *s in probe._order(
        type("A", (), {"cpu_check": True, "quick": False})())]
    assert all(s["best_ms"] and not s["not_ok"] for s in result["summary"])


def test_plans_only_lists_every_shape_and_candidate(probe, capsys):
    assert probe.main(["--plans-only"]) == 0
    lines = capsys.readouterr().out.splitlines()
    n_shapes = sum(len(v) for v in probe.SHAPES.values())
    n_plans = sum(len(v) * (1 + len(probe.CANDIDATES[c])) for c, v in probe.SHAPES.items())
    assert len(lines) == n_shapes + n_plans
    assert all(line.split()[1].split()[0] in {"fused", "exchange", "looped", "split"}
               for line in lines if line.startswith("    "))
