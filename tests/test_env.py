"""`python -m trainops env`: the versions and the kernel each op would run here."""

import re
import subprocess
import sys

import torch

import trainops
from trainops import env, registry
from trainops.__main__ import main


def test_env_command_prints_versions_and_every_op(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"torch: {torch.__version__}" in out
    import triton
    assert f"triton: {triton.__version__}" in out
    assert re.search(r"^Triton interpreter: (on|off)", out, re.M)
    table_ops = {line.split()[0] for line in out.split("\n--", 1)[1].splitlines()[1:] if line.strip()}
    assert table_ops == set(registry.ops())


def test_kernel_table_follows_the_registry():
    rows = env.kernel_table()
    by_key = {(r["op"], r["device"], r["backend"]): r for r in rows}
    assert by_key[("softmax", "cpu", "cpu")]["kernel"] == registry.lookup("softmax", "cpu", torch.float32).name
    if registry.triton_interpreting():  # conftest turns the interpreter on without a GPU
        pinned = by_key[("adam_step", "cpu, triton pinned", "triton")]
        assert pinned["kernel"] == "adam_step_triton"
        assert "float32" in pinned["dtypes"]
    for r in rows:  # each dtype appears once per (op, device): picked by one kernel, or unsupported
        same = [x for x in rows if x["op"] == r["op"] and x["device"] == r["device"]]
        dtypes = [d for x in same for d in x["dtypes"].split(",")]
        assert sorted(dtypes) == sorted(["float32", "float16", "bfloat16", "float64"]), same


def test_warnings_name_untested_versions_and_the_old_interpreter_numpy_clash():
    assert env.warnings_for("2.13.0+cpu", "3.9.0", "2.4.1", interpreting=True) == []
    assert env.warnings_for("2.11.0+cu130", "3.6.0", "2.4.1", interpreting=False) == []
    clash = env.warnings_for("2.13.0+cpu", "3.6.0", "2.4.1", interpreting=True)
    assert len(clash) == 1 and "numpy<2.4" in clash[0]
    old = env.warnings_for("2.9.1", "3.5.0", "2.3.0", interpreting=False)
    assert len(old) == 2 and "torch 2.9.1" in old[0] and "triton 3.5.0" in old[1]
    assert "outside the tested range" in env.warnings_for("2.16.0", "3.9.0", None, interpreting=False)[0]


def test_env_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "trainops", "env"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"trainops: {trainops.__version__}" in done.stdout
    driver = env.cuda_driver_version()
    assert driver is None or re.fullmatch(r"\d+\.\d+", driver)


def test_bench_refuses_unknown_ops_before_any_work(capsys):
    import pytest
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--ops", "softmax,bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m trainops bench: error: argument --ops: bogus not among the registered ops")
