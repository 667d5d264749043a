"""The one benchmark harness: trainops.bench's runner and the benchmarks/ scripts, its front-ends.

Each script runs in-process on the CPU path with tiny shapes (``--cpu``: CPU timing, no copy
ceiling; the softmax config sweep under Triton's interpreter), so a broken front-end or case list
fails here. What this cannot check: the CUDA timers (do_bench, CUDA events), the copy ceilings,
the device's L2 size and the peers (torch.compile, Liger, quack): those run on the GPU only.
"""

import importlib.util
import json
import os
import sys
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
    fixed = {family: len({p["issue42_class"] for p in sweep.fixed_problems(family, 1 << 14, scale=True)})
             for family in sweep.FAMILIES}   # scaled down, one problem a class
    assert saved["issue42_problems"] == fixed and saved["issue42_scaled_down"] is True
    assert saved["issue42_problems_run"] == {family: n for family, n in fixed.items() if n}
    assert {c for s in saved["summary"].values() for c in s["issue42_classes"]} == set(sweep.ISSUE42_CLASSES)
    assert "issue 42's shape classes against the best peer" in printed
    assert "kernel time: rows by method: none" in printed   # no GPU: no kernel time, and the summary says so
    for family, s in saved["summary"].items():
        assert s["kernel_problems"] == 0 and s["geomean_speedup_kernel_best_of"] is None
        assert s["worst_kernel_best_of"] is None and s["kernel_methods"] == {"none": len(
            [r for r in saved["rows"] if r["family"] == family])}
        assert all(c["kernel_geomean"] is None and c["kernel_worst"] is None for c in s["issue42_classes"].values())
    for row in saved["rows"]:   # every implementation checked against float64 before it was timed
        assert row["error"] is not None and row["error"] < sweep.TOLERANCE[getattr(torch, row["dtype"])]
        assert row["family"] == row["op"] and row["impl"] in ("trainops", "torch")
        assert row["kernel_ms"] is None and row["kernel_method"] is None and row["kernel_reason"] == "cpu"
    rows = sweep.load_rows(out)
    assert json.loads(json.dumps(sweep.summarise(rows))) == saved["summary"]
    assert os.path.getsize(out[:-5] + ".png") > 1000


def test_sweep_plan_has_issue42_classes_first():
    """Issue 42's shape classes are in every plan, before the draws, each problem with its class; on
    the GPU at the issue's sizes (37 problems, the draws' cap would drop most), on the CPU scaled
    down under the CPU's cap with every class kept."""
    from trainops.bench import sweep

    fixed, drawn, repeats = sweep.plan(sweep.FAMILIES, shapes=5, seed=0)
    assert len(fixed) == 37 and drawn and all("issue42_class" not in p for _, p in drawn)
    got = {(family, p["issue42_class"], p["shape"], p["dim"]) for family, p in fixed}
    bf16 = {p["dtype"] for _, p in fixed}
    assert bf16 == {torch.bfloat16}
    for rows in (1, 8, 64):
        for n in (16384, 131072, 1048576):
            assert {(f, "few_long_rows", (rows, n), -1) for f in ("softmax", "cross_entropy")} <= got
    for rows in (4096, 8192):
        for n in (32000, 50257, 65536):
            assert ("softmax_backward", "vocab_rows", (rows, n), -1) in got
    for shape in ((4096, 4096), (32000, 512), (1024, 8192)):
        assert ("softmax_backward", "non_last_axis", shape, 0) in got     # dim=0 of a 2-D tensor
    for n in (32000, 50257, 65536):
        assert ("cross_entropy", "vocab_10k_rows", (10240, n), -1) in got
    quack_table = {("softmax", s) for s in ((4096, 32768), (1024, 131072), (128, 262144), (2048, 151936))}
    quack_table |= {("softmax_backward", (2048, 151936)), ("cross_entropy", (8192, 128256)),
                    ("cross_entropy", (4096, 151936))}
    assert {(f, s) for f, c, s, _ in got if c == "quack_table"} == quack_table
    assert {c for _, c, _, _ in got} == set(sweep.ISSUE42_CLASSES)
    assert not {f for f, _ in fixed} & {"rms_norm", "swiglu"}
    # the first problems of the run cover every class (a time limit leaves each a share)
    assert {(f, p["issue42_class"]) for f, p in fixed[:8]} == {(f, c) for f, c, _, _ in got}
    assert sweep.plan(sweep.FAMILIES, shapes=5, seed=0)[0] == fixed   # the same every run

    cpu_fixed, _, _ = sweep.plan(sweep.FAMILIES, 2, 0, 1 << 14, 1 << 14, scale_fixed=True)
    assert sorted((f, p["issue42_class"]) for f, p in cpu_fixed) == sorted({(f, c) for f, c, _, _ in got})
    for family, p in cpu_fixed:
        assert p["rows"] * p["row_length"] <= 1 << 14 and p["shape"][p["dim"]] == p["row_length"]
    assert any(p["dim"] == 0 and len(p["shape"]) == 2 for _, p in cpu_fixed)
    # the row says its class
    impls_case = sweep.sweep_case("softmax_backward", cpu_fixed[3][1], "cpu", compiled=False)
    assert cpu_fixed[3][0] == "softmax_backward" and impls_case.fields["issue42_class"] == "non_last_axis"


def _fake_quack(monkeypatch, scale=1.0, backward=True):
    """A quack-kernels stand-in in sys.modules: quack.softmax(x), quack.softmax.softmax_bwd(dy, y)
    (without it with ``backward=False``) and quack.cross_entropy(x, t) (a mean loss), their results
    times ``scale`` (not 1: wrong). Returns the list of calls made."""
    calls = []
    quack, module = types.ModuleType("quack"), types.ModuleType("quack.softmax")

    def softmax(x):
        calls.append("softmax")
        return (torch.softmax(x.float(), -1) * scale).to(x.dtype)

    def softmax_bwd(dy, y):
        calls.append("softmax_bwd")
        return (torch._softmax_backward_data(dy.float(), y.float(), -1, torch.float32) * scale).to(y.dtype)

    def cross_entropy(x, t):
        calls.append("cross_entropy")
        return torch.nn.functional.cross_entropy(x.float(), t) * scale

    quack.softmax, quack.cross_entropy = softmax, cross_entropy
    if backward:
        module.softmax_bwd = softmax_bwd
    monkeypatch.setitem(sys.modules, "quack", quack)
    monkeypatch.setitem(sys.modules, "quack.softmax", module)
    return calls


def _no_quack(monkeypatch):
    """quack not installed (an import of it raises), whether or not this machine has it."""
    monkeypatch.setitem(sys.modules, "quack", None)
    monkeypatch.setitem(sys.modules, "quack.softmax", None)


def _sweep_rows(family, shape, dim=-1, dtype=torch.bfloat16, issue42_class=None, kernel_timer=None):
    from trainops.bench import sweep

    length = shape[dim]
    problem = dict(shape=shape, dim=dim, dtype=dtype, row_length=length, rows=shape[0] * shape[-1] // length,
                   issue42_class=issue42_class)
    return sweep.run_problem(family, problem, "cpu", compiled=False, peers=True, ceiling=None, log=lambda *a: None,
                             kernel_timer=kernel_timer)


SWEEP_QUACK_FAMILIES = [("softmax", "softmax"), ("softmax_backward", "softmax_bwd"),
                        ("cross_entropy", "cross_entropy")]


@pytest.mark.parametrize("family, call", SWEEP_QUACK_FAMILIES)
def test_sweep_quack_is_a_peer_where_installed(monkeypatch, family, call):
    """With quack importable, its call runs as a third peer on the problems it has a call for, checked
    against float64 first; every row says which peers ran and their ms; without quack, none."""
    calls = _fake_quack(monkeypatch)
    rows = _sweep_rows(family, (4, 64), issue42_class="quack_table")
    by_impl = {r.impl: r for r in rows}
    assert set(by_impl) == {"trainops", "torch", "quack"} and call in calls
    assert by_impl["quack"].error < 1e-2
    for r in rows:
        assert r.fields["peers_ms"] == {"torch": by_impl["torch"].ms, "quack": by_impl["quack"].ms}
        assert r.fields["peers_failed"] == {} and r.fields["issue42_class"] == "quack_table"
    if family != "cross_entropy":   # no quack call: a middle axis, dim=0, rows not a multiple of 16 bytes
        calls.clear()
        for shape, dim in (((2, 16, 8), 1), ((16, 8), 0), ((4, 63), -1)):
            rows = _sweep_rows(family, shape, dim)
            assert {r.impl for r in rows} == {"trainops", "torch"} and not calls
            assert "quack" not in rows[0].fields["peers_ms"] and "quack" not in rows[0].fields["peers_failed"]
    _no_quack(monkeypatch)
    rows = _sweep_rows(family, (4, 64))
    assert {r.impl for r in rows} == {"trainops", "torch"} and rows[0].fields["peers_ms"].keys() == {"torch"}


@pytest.mark.parametrize("family, call", SWEEP_QUACK_FAMILIES)
def test_sweep_wrong_quack_is_a_failed_peer_never_the_best(monkeypatch, family, call):
    """A quack whose result is outside the tolerance: recorded as failed on the row, the run goes on,
    and the best-of leaves it out however fast it was."""
    from trainops.bench import sweep

    calls = _fake_quack(monkeypatch, scale=1.5)
    rows = _sweep_rows(family, (4, 64), issue42_class="quack_table")
    assert {r.impl for r in rows} == {"trainops", "torch"} and call in calls
    assert rows[0].fields["peers_failed"]["quack"].startswith("CheckFailed: relative error")
    assert rows[0].fields["peers_ms"].keys() == {"torch"}
    s = sweep.summarise(rows)[family]
    assert s["best_of"] == ["torch"] and s["peer_failed"] == {"quack": 1}
    assert s["worst_best_of"][2] == "torch" and s["issue42_classes"]["quack_table"]["worst_best_of"][2] == "torch"
    assert "quack 0 (1 failed)" in "\n".join(sweep.summary_lines(sweep.summarise(rows)))


def test_sweep_softmax_backward_says_when_quack_has_no_backward(monkeypatch):
    calls = _fake_quack(monkeypatch, backward=False)
    rows = _sweep_rows("softmax_backward", (4, 64))
    assert {r.impl for r in rows} == {"trainops", "torch"} and not calls
    assert "softmax_bwd" in rows[0].fields["peers_unavailable"]["quack"]
    _no_quack(monkeypatch)
    assert _sweep_rows("softmax_backward", (4, 64))[0].fields["peers_unavailable"] == {}


def test_sweep_summary_best_of_peers_and_issue42_classes():
    """summarise: the old keys against the better of torch eager and torch.compile, the new ones
    against the best of every peer that ran (quack included), which peers those were, and per
    issue 42 class the worst ratio against the best peer."""
    from trainops.bench import sweep

    def rows(case, ms, cls=None, failed=None):
        fields = {"family": "softmax", "row_length": 64, "rows": 4, "dtype": "bfloat16", "dim": -1,
                  "issue42_class": cls, "peers_failed": failed or {}}
        return [Row("softmax", case, impl, t, 1.0, None, 0.0, None, dict(fields)) for impl, t in ms.items()]

    summary = sweep.summarise(
        rows("a", {"trainops": 1.0, "torch": 2.0, "torch.compile": 1.5, "quack": 0.5}, "quack_table")
        + rows("b", {"trainops": 1.0, "torch": 4.0, "torch.compile": 3.0, "quack": 2.0}, "quack_table")
        + rows("c", {"trainops": 1.0, "torch": 0.8, "torch.compile": 1.2}, "few_long_rows", {"quack": "CheckFailed"})
        + rows("d", {"trainops": 1.0, "torch": 2.0, "torch.compile": 2.0}))["softmax"]
    assert summary["problems"] == 4 and summary["worst"] == (0.8, "c", "torch") and summary["slower"] == 1
    assert summary["geomean_speedup"] == round((1.5 * 3.0 * 0.8 * 2.0) ** 0.25, 3)
    assert summary["best_of"] == ["quack", "torch", "torch.compile"]
    assert summary["peer_problems"] == {"torch": 4, "torch.compile": 4, "quack": 2}
    assert summary["peer_failed"] == {"quack": 1}
    assert summary["geomean_speedup_best_of"] == round((0.5 * 2.0 * 0.8 * 2.0) ** 0.25, 3)
    assert summary["worst_best_of"] == (0.5, "a", "quack") and summary["slower_best_of"] == 2
    host_keys = ("problems", "geomean_speedup_best_of", "worst_best_of")
    assert {cls: {k: c[k] for k in host_keys} for cls, c in summary["issue42_classes"].items()} == {
        "quack_table": {"problems": 2, "geomean_speedup_best_of": 1.0, "worst_best_of": (0.5, "a", "quack")},
        "few_long_rows": {"problems": 1, "geomean_speedup_best_of": 0.8, "worst_best_of": (0.8, "c", "torch")}}
    text = "\n".join(sweep.summary_lines({"softmax": summary}))
    assert "against the best of torch eager, quack and torch.compile" in text
    assert "quack 2 (1 failed)" in text and "quack_table" in text and "(0.5, 'a', 'quack')" in text


@pytest.mark.parametrize("argv, says", [
    (["--sweep", "--sweep-shapes", "0"], "argument --sweep-shapes: must be at least 1"),
    (["--sweep", "--sweep-seconds", "-1"], "argument --sweep-seconds: must be above 0"),
    (["--sweep", "--ops", "softmax,layer_norm"], "argument --ops: layer_norm not among the sweep's families"),
    (["--sweep-shapes", "5"], "only with --sweep"),
    (["--no-sweep-kernel-time"], "only with --sweep"),
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


# ---- the sweep's GPU kernel time (host left out) -------------------------------------------------

def _fake_cudagraph(monkeypatch, result):
    """triton.testing.do_bench_cudagraph replaced: calls fn once, then returns ``result(fn)`` or raises it."""
    import triton.testing

    seen = []

    def fake(fn, rep=20, grad_to_none=None, quantiles=None, return_mode="mean"):
        seen.append((rep, return_mode))
        fn()
        if isinstance(result, Exception):
            raise result
        return result
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", fake)
    return seen


def test_sweep_row_records_kernel_time_and_method(monkeypatch):
    """Each implementation's row: the host-inclusive ms from the timer, and beside it the CUDA
    graph's kernel time (kernel_ms, kernel_method "cudagraph", no reason); on the CPU, None and why."""
    from trainops.bench import sweep

    seen = _fake_cudagraph(monkeypatch, 0.0123)
    monkeypatch.setattr(bench, "kernel_ms", lambda *a, **k: pytest.fail("the profiler ran though capture worked"))
    rows = _sweep_rows("softmax", (4, 64), kernel_timer=sweep.kernel_time)
    assert {r.impl for r in rows} == {"trainops", "torch"} and len(seen) == 2
    assert seen[0] == (sweep.KERNEL_REP_MS, "median")
    for r in rows:
        assert r.fields["kernel_ms"] == 0.0123 and r.fields["kernel_method"] == "cudagraph"
        assert r.fields["kernel_reason"] is None and r.ms != 0.0123   # the host-inclusive ms is the timer's
    for r in _sweep_rows("softmax", (4, 64)):   # the CPU: no kernel time, never the host's
        assert (r.fields["kernel_ms"], r.fields["kernel_method"], r.fields["kernel_reason"]) == (None, None, "cpu")


def test_sweep_kernel_time_falls_back_to_the_profiler_when_capture_fails(monkeypatch):
    """A call a CUDA graph cannot capture: the profiler's kernel sum, method "profiler", the capture's
    error as the reason; where the profiler fails or sees no kernel, None with both reasons."""
    from trainops.bench import sweep

    _fake_cudagraph(monkeypatch, RuntimeError("operation not permitted when stream is capturing"))
    profiled = []

    def fake_kernel_ms(fn, steps=20, windows=1, warmup=1):
        profiled.append((steps, windows))
        fn()
        return 0.0042
    monkeypatch.setattr(bench, "kernel_ms", fake_kernel_ms)
    rows = _sweep_rows("cross_entropy", (4, 64), kernel_timer=sweep.kernel_time)
    assert len(rows) == 2 and profiled == [(sweep.PROFILER_STEPS, sweep.PROFILER_WINDOWS)] * 2
    for r in rows:
        assert r.fields["kernel_ms"] == 0.0042 and r.fields["kernel_method"] == "profiler"
        assert r.fields["kernel_reason"] == "cudagraph: RuntimeError: operation not permitted when stream is capturing"
    monkeypatch.setattr(bench, "kernel_ms", lambda *a, **k: 0.0)   # no CUDA kernel seen
    got = sweep.kernel_time(lambda: None)
    assert got["kernel_ms"] is None and got["kernel_method"] is None
    assert got["kernel_reason"].startswith("cudagraph: RuntimeError") and "the profiler saw no CUDA kernel" in got[
        "kernel_reason"]

    def broken(*a, **k):
        raise RuntimeError("CUPTI unavailable")
    monkeypatch.setattr(bench, "kernel_ms", broken)
    got = sweep.kernel_time(lambda: None)
    assert got["kernel_ms"] is None and "profiler: RuntimeError: CUPTI unavailable" in got["kernel_reason"]


def _kernel_rows(case, ms, kernel, cls=None):
    fields = {"family": "softmax", "row_length": 64, "rows": 4, "dtype": "bfloat16", "dim": -1,
              "issue42_class": cls, "peers_failed": {}}
    return [Row("softmax", case, impl, t, 1.0, None, 0.0, None,
                {**fields, "kernel_ms": kernel.get(impl), "kernel_method": "cudagraph" if kernel.get(impl) else None})
            for impl, t in ms.items()]


def test_sweep_summary_kernel_time_best_of_beside_host_inclusive():
    """summarise's kernel-time figures come from kernel_ms against the same peers, beside the
    host-inclusive ones (unchanged); a peer without a kernel time is left out of that problem's
    kernel best-of, a problem where trainops has none is left out, and both are counted."""
    from trainops.bench import sweep

    rows = (_kernel_rows("a", {"trainops": 1.0, "torch": 2.0, "torch.compile": 1.5, "quack": 0.5},
                         {"trainops": 0.4, "torch": 0.5, "torch.compile": 0.6, "quack": 0.45}, "quack_table")
            + _kernel_rows("b", {"trainops": 1.0, "torch": 4.0, "torch.compile": 3.0, "quack": 2.0},
                           {"trainops": 0.5, "torch": 0.45, "torch.compile": 0.9, "quack": None}, "quack_table")
            + _kernel_rows("c", {"trainops": 1.0, "torch": 0.8, "torch.compile": 1.2},
                           {"torch": 0.1, "torch.compile": 0.2}, "few_long_rows")
            + _kernel_rows("d", {"trainops": 1.0, "torch": 2.0, "torch.compile": 2.0},
                           {"trainops": 0.2, "torch": 0.3, "torch.compile": 0.25}))
    s = sweep.summarise(rows)["softmax"]
    # host-inclusive: as before
    assert s["worst_best_of"] == (0.5, "a", "quack") and s["slower_best_of"] == 2
    assert s["geomean_speedup_best_of"] == round((0.5 * 2.0 * 0.8 * 2.0) ** 0.25, 3)
    # kernel time: a 0.45/0.4 (quack), b 0.45/0.5 (torch; quack has none), d 0.25/0.2 (torch.compile); c left out
    assert s["kernel_problems"] == 3 and s["slower_kernel_best_of"] == 1
    assert s["geomean_speedup_kernel_best_of"] == round((1.125 * 0.9 * 1.25) ** (1 / 3), 3)
    assert s["worst_kernel_best_of"] == (0.9, "b", "torch") != s["worst_best_of"]
    assert s["kernel_missing"] == {"quack": 1, "trainops": 1}
    assert s["kernel_methods"] == {"cudagraph": 12, "none": 2}
    qt, flr = s["issue42_classes"]["quack_table"], s["issue42_classes"]["few_long_rows"]
    assert qt["worst_best_of"] == (0.5, "a", "quack") and qt["kernel_worst"] == (0.9, "b", "torch")
    assert qt["kernel_problems"] == 2 and qt["kernel_geomean"] == round((1.125 * 0.9) ** 0.5, 3)
    assert flr["worst_best_of"] == (0.8, "c", "torch") and flr["problems"] == 1
    assert flr["kernel_problems"] == 0 and flr["kernel_geomean"] is None and flr["kernel_worst"] is None
    text = "\n".join(sweep.summary_lines({"softmax": s}))
    assert "(0.5, 'a', 'quack'); (0.9, 'b', 'torch')" in text and f"{s['geomean_speedup_kernel_best_of']:.2f}x" in text
    assert "without one (problems): quack 1, trainops 1" in text


def test_sweep_summary_leaves_out_problems_whose_peers_have_no_kernel_time():
    from trainops.bench import sweep

    s = sweep.summarise(_kernel_rows("a", {"trainops": 1.0, "torch": 2.0}, {"trainops": 0.3}, "vocab_rows"))["softmax"]
    assert s["problems"] == 1 and s["worst_best_of"] == (2.0, "a", "torch")
    assert s["kernel_problems"] == 0 and s["geomean_speedup_kernel_best_of"] is None
    assert s["worst_kernel_best_of"] is None and s["kernel_missing"] == {"torch": 1}
    assert s["issue42_classes"]["vocab_rows"]["kernel_worst"] is None
    assert sweep.summary_lines({"softmax": s})[-1].split()[3:5] == ["2.00x", "-"]   # host geomean; kernel: none


def test_sweep_kernel_time_flag_reaches_the_sweep(monkeypatch):
    from trainops.__main__ import main
    from trainops.bench import sweep

    got = []
    monkeypatch.setattr(sweep, "main", lambda *a, **k: got.append(k["kernel"]) or 0)
    for argv, kernel in (([], True), (["--sweep-kernel-time"], True), (["--no-sweep-kernel-time"], False)):
        assert main(["bench", "--sweep"] + argv) == 0 and got.pop() is kernel
