"""``python -m trainops bench --memory`` (trainops.bench.memory): arguments, the dry run, one tiny
configuration measured on the CPU, and the benchmarks/ front-end."""

import json
import os
import runpy
import sys

import pytest

from trainops import __main__ as cli
from trainops.bench import memory


def test_dry_run_lists_the_model_and_configurations_and_builds_nothing(capsys, monkeypatch):
    monkeypatch.setattr(memory, "measure", lambda *a, **k: pytest.fail("the dry run measured"))
    assert cli.main(["bench", "--memory", "--dry-run", "--width", "4096", "--layers", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    n = memory.parameter_count(4096, 4, 32000, 1024)
    assert out[0].startswith(f"decoder: width 4096, 4 layers, vocabulary 32000, {n / 1e9:.3f} B parameters")
    names = [line.strip().split(" (")[0] for line in out[2:]]
    assert names == [c[0] for c in memory.configurations(cpu=True)]
    assert "trainops AdamW8bit bf16+SR in backward" in names


def test_parameter_count_is_the_models():
    model = memory.Decoder(vocab=50, width=16, layers=2, length=8)
    assert sum(p.numel() for p in model.parameters()) == memory.parameter_count(16, 2, 50, 8)


@pytest.mark.parametrize("argv, argument", [
    (["--width", "0"], "--width"),
    (["--batch", "x"], "--batch"),
    (["--cpu", "--length", "-2"], "--length"),
    (["--only", "nothing-has-this", "--dry-run"], "--only"),
])
def test_bad_arguments_are_refused_by_name(argv, argument, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--memory", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"{memory.PROG}: error: argument {argument}"), err


def test_cpu_step_in_backward_row_has_no_gradients_and_8bit_states(tmp_path, capsys):
    out = tmp_path / "m.json"
    micro = ["--width", "32", "--layers", "1", "--vocab", "64", "--batch", "1", "--length", "8"]   # 2-D: >= 4096
    assert memory.main(["--cpu", *micro, "--only", "8bit bf16+SR in backward", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["name"] == "trainops AdamW8bit bf16+SR in backward" and row["param_dtype"] == "bfloat16"
    assert row["gradients"] == 0
    # bf16 weights (2 B a parameter). 8-bit moments for the two MLP matrices (4096 elements each, the
    # 8-bit threshold): one byte each per element plus a float32 scale per row chunk (rows of 32 and 128
    # elements: one chunk a row, 128 + 32 rows); float32 moments (8 B) for the rest (in_proj 3072 and
    # out_proj 1024 are below 4096; embeddings, biases, norms); a float32 step counter per tensor (17)
    n = memory.parameter_count(32, 1, 64, 8)
    assert row["weights"] == 2 * n
    assert row["states"] == 2 * 8192 + 2 * 4 * (128 + 32) + 8 * (n - 8192) + 4 * 17, row
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == f"wrote {out}"


def test_benchmarks_front_end_calls_the_module(capsys, monkeypatch):
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_optim_memory.py")
    monkeypatch.setattr(sys, "argv", [script, "--dry-run", "--no-peers"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(script, run_name="__main__")
    assert exit_info.value.code == 0
    assert "trainops AdamW8bit fp32" in capsys.readouterr().out
