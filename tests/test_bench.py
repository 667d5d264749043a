"""The one benchmark harness: trainops.bench's runner and the benchmarks/ scripts, its front-ends.

Each script runs in-process on the CPU path with tiny shapes (``--cpu``: CPU timing, no copy
ceiling; the softmax config sweep under Triton's interpreter), so a broken front-end or case list
fails here. What this cannot check: the CUDA timers (do_bench, CUDA events), the copy ceilings,
the device's L2 size and the peers (torch.compile, Liger, quack): those run on the GPU only.
"""

import importlib.util
import json
import os
import types

import pytest
import torch

from trainops import bench
from trainops.bench import Impl, Row, Timing, cases

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def _script(name):
    spec = importlib.util.spec_from_file_location(f"_bench_script_{name}", os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(name, argv, tmp_path, capsys):
    out = str(tmp_path / f"{name}.json")
    argv = [a.replace("OUT", out) for a in argv]
    assert _script(name).main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == f"wrote {out}", printed[-5:]
    with open(out) as f:
        return json.load(f)


def _by_case(rows):
    grouped = {}
    for r in rows:
        grouped.setdefault(r["case"], []).append(r)
    return grouped


# -- the runner ----------------------------------------------------------------------------------

def test_bench_json_rows_keep_their_keys():
    """`python -m trainops bench` rows: the same keys as before the runner took extra fields."""
    assert list(Row("softmax", "8x8", "trainops", 1.0, 2.0, 3.0, 0.0, 4.0).as_dict()) == [
        "op", "case", "impl", "ms", "gbps", "pct_of_copy", "error", "pct_of_same_copy"]
    row = Row("gather_backward", "c", "torch", 1.0, 2.0, None, None, None, {"stream": "zipf"}).as_dict()
    assert row["stream"] == "zipf" and "fields" not in row


def test_runner_impl_bytes_context_fields_and_timing():
    """Per-implementation bytes, a context around factory + check + timing, case / build /
    implementation fields, and the case's Timing handed to the timer."""
    x = torch.randn(64, dtype=torch.float64)
    active, seen = [], []

    class Flag:
        def __enter__(self):
            active.append(True)

        def __exit__(self, *exc):
            active.pop()

    def timer(call, timing):
        seen.append((timing, bool(active)))
        call()
        return 2.0  # a fixed time, so that GB/s can be checked

    def factory():
        assert active, "the factory runs inside the implementation's context"
        return lambda: x * 2 if active else None

    def build(peers):
        return ({"trainops": lambda: (lambda: x * 2),
                 "trainops half": Impl(factory, nbytes=500, context=Flag, fields={"variant": "half"})},
                lambda: x * 2, {"built": 7})

    case = cases.Case("softmax", "64", 1000, build, fields={"shape": [64]}, timing=Timing("events", 3, 5))
    rows = bench.run_cases([case], peers=False, ceiling=None, log=lambda s: None, timer=timer)
    assert [r.impl for r in rows] == ["trainops", "trainops half"]
    assert [s[0] for s in seen] == [Timing("events", 3, 5)] * 2 and [s[1] for s in seen] == [False, True]
    assert rows[0].gbps == round(1000 / 2.0 / 1e6, 1) and rows[1].gbps == round(500 / 2.0 / 1e6, 1)
    assert rows[0].error == 0.0 and rows[1].error == 0.0
    assert rows[0].fields == {"shape": [64], "built": 7}
    assert rows[1].fields == {"shape": [64], "built": 7, "variant": "half"}


def test_runner_tolerance_failures_and_field_clashes():
    x = torch.randn(32, dtype=torch.float64)

    def broken():
        raise RuntimeError("boom")

    def build(peers):
        return {"torch": lambda: (lambda: x), "peer off": lambda: (lambda: x + 1), "peer broken": broken,
                "trainops": lambda: (lambda: x)}, lambda: x
    case = cases.Case("softmax", "32", 256, build, tolerance=1e-6)
    logged = []
    rows = bench.run_cases([case], peers=False, ceiling=None, log=logged.append)
    assert [r.impl for r in rows] == ["torch", "trainops"]  # peers outside tolerance or failing: left out
    assert any("peer off failed: CheckFailed" in s for s in logged) and any("boom" in s for s in logged)

    def ours_off(peers):
        return {"trainops variant": lambda: (lambda: x * 1.01)}, lambda: x
    with pytest.raises(bench.CheckFailed, match="tolerance"):
        bench.run_cases([cases.Case("softmax", "32", 256, ours_off, tolerance=1e-6)], peers=False, ceiling=None,
                        log=lambda s: None)
    clash = cases.Case("softmax", "32", 256, lambda peers: ({"torch": lambda: (lambda: x)}, None), fields={"ms": 1})
    with pytest.raises(ValueError, match="clash"):
        bench.run_cases([clash], peers=False, ceiling=None, log=lambda s: None)


def test_rotation_and_deterministic_mode():
    sets = [(i,) for i in range(4)]
    call = bench.rotate(lambda i: i, sets)
    assert [call() for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    assert bench.rotation_sets(4 * 1024, 1024) == 4 and bench.rotation_sets(4 * 1024 + 1, 1024) == 1
    assert not torch.are_deterministic_algorithms_enabled()
    with bench.deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled()
    assert not torch.are_deterministic_algorithms_enabled()


def test_sweep_table_marks_default_and_best():
    rows = [Row("op", "c", "a", 2.0, 1.0, None, None, None, {"default": True}),
            Row("op", "c", "b", 1.0, 1.0, None, None, None, {"default": False})]
    line = bench.sweep_table(rows)[1]
    assert "2.0000" in line and "1.0000" in line and "2.00x" in line and line.endswith("b")


# -- the front-ends ------------------------------------------------------------------------------

def test_bench_cross_entropy_front_end(tmp_path, capsys):
    result = _run_script("bench_cross_entropy", ["--cpu", "--sweep", "--out", "OUT"], tmp_path, capsys)
    shapes = _script("bench_cross_entropy").CPU_SHAPES
    expected = ["trainops", "trainops unchecked", "trainops fp32 loss + z", "torch", "trainops forward only (no grad)",
                "trainops inplace_backward"]
    grouped = _by_case(result["rows"])
    assert list(grouped) == [f"{r}x{c} bfloat16 fwd+bwd" for r, c in shapes]
    for (rows, classes), impls in zip(shapes, grouped.values()):
        assert [r["impl"] for r in impls] == expected
        assert all((r["rows"], r["classes"], r["dtype"]) == (rows, classes, "bfloat16") for r in impls)
        for r in impls:
            if r["impl"] == "trainops forward only (no grad)":
                assert r["error"] is None  # no gradient to compare
            elif r["impl"] != "trainops fp32 loss + z":  # z-loss changes the gradient
                assert r["error"] < 1e-2, r
    sweep = _by_case(result["sweep"])
    assert len(sweep) == len(shapes)
    for variants in sweep.values():
        assert len(variants) == len(cases.CE_SWEEP) and sum(r["default"] for r in variants) == 1
        assert all(r["error"] < 1e-2 and set(r["heuristics"]) == set(cases.CE_SWEEP_NAMES) for r in variants)


def test_bench_cross_entropy_shapes(tmp_path, capsys):
    result = _run_script("bench_cross_entropy", ["--cpu", "--shapes", "5x37,3x16", "--out", "OUT"], tmp_path, capsys)
    assert list(_by_case(result["rows"])) == ["5x37 bfloat16 fwd+bwd", "3x16 bfloat16 fwd+bwd"]


def test_bench_cross_entropy_refuses_bad_shapes_before_timing(monkeypatch, capsys):
    def timing_started(*args, **kwargs):
        raise AssertionError("bench.start ran before --shapes was checked")
    monkeypatch.setattr(bench, "start", timing_started)
    for bad in ("5x37x2", "5x", "0x37", "-1x5", "5x37,"):
        with pytest.raises(SystemExit):
            _script("bench_cross_entropy").main([f"--shapes={bad}"])
        assert "--shapes: expected ROWSxCLASSES" in capsys.readouterr().err, bad


def test_cross_entropy_peers_are_built_when_asked():
    impls, _ = cases.cross_entropy_variant_cases("cpu", [(4, 10)])[0].build(True)
    assert "torch.compile" in impls and "trainops inplace_backward" in impls
    assert impls["trainops forward only (no grad)"].nbytes == 4 * 10 * 2  # half of 2 x logits


def test_bench_gather_front_end(tmp_path, capsys):
    result = _run_script("bench_gather", ["--cpu", "--sweep", "--out", "OUT"], tmp_path, capsys)
    script = _script("bench_gather")
    expected = ["trainops", "trainops atomic", "trainops checked", "torch", "torch deterministic", "torch index_add_"]
    grouped = _by_case(result["rows"])
    assert len(grouped) == 2 * len(script.CPU_SHAPES)
    for impls in grouped.values():
        assert [r["impl"] for r in impls] == expected
        assert all(r["error"] < (1e-2 if r["dtype"] == "bfloat16" else 1e-5) for r in impls)
        assert len({(r["stream"], r["hottest_row_count"], r["input_sets"]) for r in impls}) == 1
    sets = {(r["tokens"], r["stream"]): r["input_sets"] for r in result["rows"]}
    assert sets[(64, "uniform")] == 4 and sets[(256, "uniform")] == 1  # fits / does not fit in 4x the 2 KiB "L2"
    zipf = max(r["hottest_row_count"] for r in result["rows"] if r["stream"] == "zipf" and r["tokens"] == 256)
    assert zipf > max(r["hottest_row_count"] for r in result["rows"] if r["stream"] == "uniform" and r["tokens"] == 256)
    assert not torch.are_deterministic_algorithms_enabled()
    assert [r["impl"] for r in result["forward"]] == ["trainops", "trainops checked", "torch"]
    assert all(r["error"] == 0.0 for r in result["forward"])
    for variants in _by_case(result["sweep"]).values():
        assert len(variants) == len(cases.GATHER_SWEEP) and sum(r["default"] for r in variants) == 1
    assert result["l2_bytes"] == script.CPU_L2_BYTES


def test_bench_optim_front_end(tmp_path, capsys):
    result = _run_script("bench_optim", ["--cpu", "--sweep", "--out", "OUT"], tmp_path, capsys)
    assert set(result["checks"]) == {"adamw", "adamw_clip", "adamw_bf16_master", "sgd"}
    assert all(0 <= e < 1e-5 for e in result["checks"].values())
    expected = {"adamw fp32": {"torch foreach": 28, "torch fused": 28, "trainops": 28, "trainops lamb": 40},
                "adamw fp32 + clip/scaler": {"torch fused + clip_grad_norm_": 32, "trainops max_grad_norm": 32,
                                             "torch GradScaler + torch fused": 32,
                                             "trainops GradScaler + trainops": 32},
                "adamw bf16 params": {"torch fused (bf16 state)": 16, "trainops fp32 master + state": 28,
                                      "trainops bf16 state, no master": 16},
                "sgd momentum fp32": {"torch foreach": 20, "torch fused": 20, "trainops": 20},
                "small 4x64 fp32": {"torch foreach": 28, "torch fused": 28, "trainops": 28}}
    got = {case: {r["impl"]: r["bytes_per_param"] for r in impls} for case, impls in _by_case(result["rows"]).items()}
    assert got == expected
    assert {r["op"] for r in result["rows"] if r["case"] == "sgd momentum fp32"} == {"sgd_step"}
    sweep = result["sweep"]
    assert len(sweep) == len(cases.MULTI_TENSOR_SWEEP) and [r["heuristics"] for r in sweep if r["default"]] == [
        {"block": 2048, "warps": 4}]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs Triton's interpreter")
def test_probe_quack_softmax_front_end(tmp_path, capsys):
    """The quack rule's probe on the CPU: trainops (its row says the backend it ran), Triton pinned and
    torch per case; without quack, no quack rows, and the agreement table says so."""
    script = _script("probe_quack_softmax")
    result = _run_script("probe_quack_softmax", ["OUT", "--cpu"], tmp_path, capsys)
    grouped = {}
    for r in result["rows"]:
        grouped.setdefault((r["op"], r["case"]), []).append(r)
    assert len(grouped) == len(script.OPS) * len(script.CPU_COLUMNS)
    for impls in grouped.values():
        assert [r["impl"] for r in impls] == ["trainops", "trainops triton", "torch"]
        assert (impls[0]["backend"], impls[1]["backend"]) == ("cpu", "triton") and impls[1]["kernel"]


def test_probe_quack_softmax_agreement():
    """The agreement table: the faster of Triton and quack (both pinned) against the rule's choice."""
    script = _script("probe_quack_softmax")

    def row(impl, ms, backend=None):
        return Row("softmax", "4x32768 bfloat16", impl, ms, 1.0, None, 0.0, fields={"backend": backend or impl[9:]})
    agree = script.agreement_table([row("trainops", 1.0, "quack"), row("trainops triton", 2.0), row("trainops quack", 1.0)])
    disagree = script.agreement_table([row("trainops", 2.0, "triton"), row("trainops triton", 2.0),
                                       row("trainops quack", 1.0)])
    assert agree[1].split()[-3:] == ["quack", "quack", "yes"] and disagree[1].split()[-3:] == ["quack", "triton", "NO"]
    assert "no quack row" in script.agreement_table([row("trainops", 1.0, "triton"), row("trainops triton", 1.0)])[1]


def test_softmax_case_rows_say_which_backend_ran(monkeypatch):
    """Where the registry's choice is not Triton (quack on long rows), the case also times trainops
    with Triton pinned; each trainops row carries its backend and kernel."""
    import trainops

    case = cases._softmax_case("softmax", (2, 64), -1, torch.float32, "cpu")
    impls, _ = case.build(False)
    assert list(impls) == ["trainops", "torch"] and impls["trainops"].fields["backend"] == "cpu"
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    real_plan = trainops.plan

    def chosen_elsewhere(op, **descriptor):   # as if the rule had put the problem on another backend
        p = real_plan(op, **descriptor)
        if trainops.registry.pinned_backend() is None:
            return types.SimpleNamespace(info=types.SimpleNamespace(backend="quack"), kernel=p.kernel)
        return p
    monkeypatch.setattr(trainops, "plan", chosen_elsewhere)
    impls, _ = cases._softmax_case("softmax", (2, 64), -1, torch.float32, "cpu").build(False)
    assert list(impls) == ["trainops", "trainops triton", "torch"]
    assert impls["trainops"].fields["backend"] == "quack" and impls["trainops triton"].fields["backend"] == "triton"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs Triton's interpreter")
def test_sweep_softmax_front_end(tmp_path, capsys):
    result = _run_script("sweep_softmax", ["OUT", "--cpu"], tmp_path, capsys)
    grouped = _by_case(result["rows"])
    assert len(grouped) == len(_script("sweep_softmax").CPU_PROBLEMS)
    for configs in grouped.values():
        assert len(configs) >= 4 and sum(r["default"] for r in configs) == 1 and configs[0]["default"]
        assert all(r["error"] < 1e-5 and r["config"]["kind"] == "fused" for r in configs)


def test_softmax_configs_column_tiles():
    """softmax over dim=1 of [B, C, HW]: the heuristic's column tile first, then tiles x warps."""
    from trainops.ops import softmax as S

    problem = S._describe("softmax", (2, 16, 8), 1, torch.float32, "cpu")
    layout = S.reduction_layout(problem.shape, problem.dim, problem.strides + (problem.out_strides,))
    configs = list(cases.softmax_configs(problem, layout))
    assert configs[0] == S._choose_config(problem, layout) and configs[0].block_i > 1
    assert [(c.block_i, c.num_warps) for c in configs[1:]] == [(b, w) for b in (16, 32, 64, 128) for w in (4, 8, 16, 32)]


# ---- python -m trainops bench --sweep ------------------------------------------------------------

def test_sweep_problems_are_repeatable_and_within_bounds():
    from trainops.bench import sweep

    for family in sweep.FAMILIES:
        drawn = sweep.problems(family, 60, seed=3, max_elements=1 << 20)
        assert drawn == sweep.problems(family, 60, seed=3, max_elements=1 << 20)   # a run repeats
        assert drawn != sweep.problems(family, 60, seed=4, max_elements=1 << 20)
        keys = [(p["shape"], p["dim"], p["dtype"]) for p in drawn]
        assert len(drawn) == 60 and len(set(keys)) == 60
        for p in drawn:
            numel = 1
            for s in p["shape"]:
                numel *= s
            assert numel <= 1 << 20 and p["row_length"] * p["rows"] == numel
            assert p["row_length"] in sweep.ROW_LENGTHS and p["shape"][p["dim"]] == p["row_length"]
            assert p["dtype"] in (torch.bfloat16, torch.float16, torch.float32)
            if family == "cross_entropy":
                assert p["row_length"] >= 2 and p["dim"] == -1
            if family in ("rms_norm", "swiglu"):
                assert p["row_length"] <= 65536 and p["dim"] == -1
        if family.startswith("softmax"):
            assert any(p["dim"] == 1 and len(p["shape"]) == 3 for p in drawn)   # middle axes drawn too
        assert len({p["row_length"] % 2 for p in drawn}) == 2   # odd and even lengths


def test_sweep_command_on_the_cpu_writes_rows_summary_and_chart(tmp_path, capsys):
    from trainops.__main__ import main
    from trainops.bench import sweep

    out = str(tmp_path / "sweep.json")
    assert main(["bench", "--sweep", "--sweep-shapes", "2", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "geomean" in printed and f"wrote {out}" in printed
    with open(out) as f:
        saved = json.load(f)
    assert saved["problems_run"] == saved["problems_drawn"] == {family: 2 for family in sweep.FAMILIES}
    assert set(saved["summary"]) == set(sweep.FAMILIES)
    for row in saved["rows"]:   # every implementation checked against float64 before it was timed
        assert row["error"] is not None and row["error"] < sweep.TOLERANCE[getattr(torch, row["dtype"])]
        assert row["family"] == row["op"] and row["impl"] in ("trainops", "torch")
    rows = sweep.load_rows(out)
    assert json.loads(json.dumps(sweep.summarise(rows))) == saved["summary"]
    assert os.path.getsize(out[:-5] + ".png") > 1000


@pytest.mark.parametrize("argv, says", [
    (["--sweep", "--sweep-shapes", "0"], "argument --sweep-shapes: must be at least 1"),
    (["--sweep", "--sweep-seconds", "-1"], "argument --sweep-seconds: must be above 0"),
    (["--sweep", "--ops", "softmax,layer_norm"], "argument --ops: layer_norm not among the sweep's families"),
    (["--sweep-shapes", "5"], "only with --sweep"),
    (["--sweep", "--ops", "softmax,softmax"], "argument --ops: a family is named twice"),
    (["--sweep", "--quick"], "argument --sweep: times torch.compile on every shape"),
])
def test_sweep_arguments_are_refused(argv, says, capsys):
    from trainops.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench"] + argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_relative_error_of_tuples_is_the_largest_pair():
    from trainops.bench import _relative_error

    ref = (torch.ones(3, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    assert _relative_error((torch.ones(3), torch.ones(2)), ref) == 0.0
    assert _relative_error((torch.ones(3), torch.tensor([1.0, 1.5])), ref) > 0.3   # a gradient off is caught
