"""``python -m trainops train``: every user error is refused before any work (exit status 2, one line
naming the argument), checkpoints are read as untrusted files and written atomically, and the
combinations that are allowed work."""

import io
import os
import pickle
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from trainops import train

PROG = "python -m trainops train"
TINY = ["--config", "tiny"]


def tiny(steps, **kw):
    return replace(train.Config(**train.CONFIGS["tiny"]), steps=steps, **kw)


@pytest.fixture(scope="module")
def data():
    return train.stdlib_bytes(train.CONFIGS["tiny"]["data_bytes"])


@pytest.fixture(scope="module")
def checkpoint(data, tmp_path_factory):
    """A tiny trainops checkpoint at step 2 (adamw, amp none, the config's lr)."""
    path = str(tmp_path_factory.mktemp("checkpoint") / "tiny-2.pt")
    train.run(tiny(2), torch.device("cpu"), True, data, quiet=True, save=path)
    return path


def refused(capsys, argv, argument):
    """Run the command, expecting argparse's user error: exit status 2, nothing on stdout, and stderr
    the usage then one error line naming ``argument``. Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2, err
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith(f"usage: {PROG}") and all(line.startswith(" ") for line in lines[1:-1]), err
    assert lines[-1].startswith(f"{PROG}: error: argument {argument}: "), err
    return lines[-1]


# -- arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-1", "ten"])
def test_steps_below_one_is_refused(value, capsys, no_work):
    line = refused(capsys, TINY + ["--steps", value], "--steps")
    assert "at least 1" in line


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "fast"])
def test_lr_not_a_positive_finite_number_is_refused(value, capsys, no_work):
    line = refused(capsys, TINY + ["--steps", "1", "--lr", value], "--lr")
    assert "finite number above 0" in line


@pytest.mark.parametrize("value", ["1", "-0.1", "1.5", "nan", "half"])
def test_dropout_outside_zero_to_one_is_refused(value, capsys, no_work):
    line = refused(capsys, TINY + ["--steps", "1", "--dropout", value], "--dropout")
    assert "[0, 1)" in line


@pytest.mark.parametrize("value", ["0", "-1"])
def test_threads_below_one_is_refused(value, capsys, no_work):
    before = torch.get_num_threads()
    refused(capsys, TINY + ["--steps", "1", "--threads", value], "--threads")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("value", ["bogus", "mps", "meta", "cpu:1", "cuda:x"])
def test_device_other_than_cpu_or_cuda_is_refused(value, capsys, no_work):
    line = refused(capsys, TINY + ["--steps", "1", "--device", value], "--device")
    assert "use cpu, cuda or cuda:N" in line


@pytest.mark.parametrize("value", ["cuda", "cuda:0"])
def test_cuda_device_without_cuda_is_refused(value, capsys, no_work, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = refused(capsys, TINY + ["--steps", "1", "--device", value], "--device")
    assert f"{value} asked for" in line and "use cpu" in line


def test_cuda_device_past_the_devices_present_is_refused(capsys, no_work, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    line = refused(capsys, TINY + ["--steps", "1", "--device", "cuda:7"], "--device")
    assert "2 CUDA devices (cuda:0 to cuda:1)" in line


def test_config_outside_the_choices_is_refused(capsys, no_work):
    refused(capsys, ["--config", "huge", "--steps", "1"], "--config")


def test_compare_with_lamb_is_refused_before_the_first_run(capsys, no_work):
    line = refused(capsys, TINY + ["--steps", "1", "--compare", "--optimizer", "lamb"], "--compare")
    assert "--optimizer adamw" in line


def test_plot_without_compare_is_refused(tmp_path, capsys, no_work):
    line = refused(capsys, TINY + ["--steps", "1", "--plot", str(tmp_path / "curves.png")], "--plot")
    assert "only used with --compare" in line


def test_plot_into_a_missing_directory_is_refused(tmp_path, capsys, no_work):
    line = refused(capsys, TINY + ["--steps", "1", "--compare", "--plot", str(tmp_path / "missing" / "curves.png")],
                   "--plot")
    assert "No such file or directory" in line


@pytest.mark.parametrize("name", ["curves.xyz", "curves"])
def test_plot_in_a_format_matplotlib_cannot_write_is_refused(name, tmp_path, capsys, no_work):
    line = refused(capsys, TINY + ["--steps", "1", "--compare", "--plot", str(tmp_path / name)], "--plot")
    assert ".png" in line


def test_plot_onto_the_checkpoint_is_refused(tmp_path, capsys, no_work):
    path = str(tmp_path / "run.png")
    line = refused(capsys, TINY + ["--steps", "1", "--compare", "--plot", path, "--save", path], "--plot")
    assert "--save" in line


def test_save_into_a_missing_directory_is_refused_before_training(tmp_path, capsys, no_work):
    path = tmp_path / "missing" / "ckpt.pt"
    line = refused(capsys, TINY + ["--steps", "1", "--save", str(path)], "--save")
    assert "No such file or directory" in line and not path.parent.exists()


def test_save_onto_a_directory_is_refused(tmp_path, capsys, no_work):
    line = refused(capsys, TINY + ["--steps", "1", "--save", str(tmp_path)], "--save")
    assert "directory" in line


# -- --resume: files that are not checkpoints ---------------------------------------------------

def test_resume_of_a_missing_file_is_refused(tmp_path, capsys, no_work):
    before = torch.get_num_threads()
    line = refused(capsys, TINY + ["--steps", "3", "--threads", "1", "--resume", str(tmp_path / "nothing.pt")],
                   "--resume")
    assert "No such file or directory" in line
    assert torch.get_num_threads() == before  # nothing applied before the refusal


def test_resume_of_a_directory_is_refused(tmp_path, capsys, no_work):
    refused(capsys, TINY + ["--steps", "3", "--resume", str(tmp_path)], "--resume")


class _CreatesFile:
    """A pickle payload: unpickling it calls open(path, "w"), creating ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("writer", ["torch.save", "pickle protocol 2", "pickle protocol 5"])
def test_resume_of_a_file_that_would_run_code_is_refused_and_runs_nothing(writer, tmp_path, capsys, no_work):
    marker, path = tmp_path / "marker", tmp_path / "evil.pt"
    payload = {"variant": "trainops", "model": _CreatesFile(str(marker))}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=int(writer[-1]))
    line = refused(capsys, TINY + ["--steps", "3", "--resume", str(path)], "--resume")
    assert not marker.exists()
    assert "weights_only=True" in line
    if writer != "pickle protocol 5":  # whose framing the weights-only loader rejects before it meets the import
        assert "would import" in line and "open" in line
    with open(path, "rb") as f:  # the payload is live: an unrestricted load runs it
        loaded = torch.load(f, weights_only=False) if writer == "torch.save" else pickle.load(f)
    loaded["model"].close()
    assert marker.exists()


def test_run_resuming_reads_the_file_without_running_its_code(data, tmp_path):
    marker, path = tmp_path / "marker", tmp_path / "evil.pt"
    torch.save({"variant": "trainops", "model": _CreatesFile(str(marker))}, path)
    with pytest.raises(Exception) as info:
        train.run(tiny(3), torch.device("cpu"), True, data, quiet=True, resume=str(path))
    assert not marker.exists()
    assert info.type is train.CheckpointError and "would import" in str(info.value)


UNREADABLE = "torch.load(weights_only=True) cannot read it"


def _resume(path):
    return TINY + ["--steps", "3", "--resume", str(path)]


def test_resume_of_garbage_is_refused(tmp_path, capsys, no_work):
    path = tmp_path / "garbage.pt"
    path.write_bytes(b"not a checkpoint\n" * 20)
    assert UNREADABLE in refused(capsys, _resume(path), "--resume")


def test_resume_of_an_empty_file_is_refused(tmp_path, capsys, no_work):
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    assert UNREADABLE in refused(capsys, _resume(path), "--resume")


def test_resume_of_a_truncated_checkpoint_is_refused(checkpoint, tmp_path, capsys, no_work):
    path = tmp_path / "truncated.pt"
    whole = open(checkpoint, "rb").read()
    path.write_bytes(whole[: len(whole) // 2])
    assert UNREADABLE in refused(capsys, _resume(path), "--resume")


def test_resume_of_a_foreign_torch_file_is_refused(tmp_path, capsys, no_work):
    path = tmp_path / "foreign.pt"
    torch.save({"a": 1}, path)
    line = refused(capsys, TINY + ["--steps", "3", "--resume", str(path)], "--resume")
    assert "not a checkpoint of python -m trainops train" in line


def _edited(checkpoint, tmp_path, edit):
    state = torch.load(checkpoint, weights_only=True)
    edit(state)
    path = tmp_path / "edited.pt"
    torch.save(state, path)
    return str(path)


def test_resume_of_a_checkpoint_holding_other_types_is_refused(checkpoint, tmp_path, capsys, no_work):
    path = _edited(checkpoint, tmp_path, lambda state: state["scaler"].update(extra={1, 2}))
    assert "builtins.set" in refused(capsys, TINY + ["--steps", "3", "--resume", path], "--resume")


def test_resume_of_a_checkpoint_whose_tensors_do_not_fit_is_refused(checkpoint, tmp_path, capsys, no_work):
    path = _edited(checkpoint, tmp_path, lambda state: state["model"].update({"ln.weight": torch.ones(3)}))
    line = refused(capsys, TINY + ["--steps", "3", "--resume", path], "--resume")
    assert "does not fit" in line and "ln.weight" in line


def test_resume_of_the_pytorch_runs_checkpoint_is_refused(checkpoint, tmp_path, capsys, no_work):
    path = _edited(checkpoint, tmp_path, lambda state: state.update(variant="pytorch"))
    assert "pytorch run" in refused(capsys, TINY + ["--steps", "3", "--resume", path], "--resume")


# -- --resume: a checkpoint of another run -------------------------------------------------------

def test_resume_under_another_config_is_refused(checkpoint, capsys, no_work):
    line = refused(capsys, ["--config", "small", "--steps", "3", "--resume", checkpoint], "--resume")
    assert "--config tiny" in line and "--config small" in line


@pytest.mark.parametrize("option, value", [("--optimizer", "lamb"), ("--amp", "bf16"), ("--lr", "0.01"),
                                           ("--dropout", "0.1")])
def test_resume_with_another_optimizer_amp_or_lr_is_refused(option, value, checkpoint, capsys, no_work):
    line = refused(capsys, TINY + ["--steps", "3", "--resume", checkpoint, option, value], "--resume")
    assert f"this run has {option} {value}" in line


@pytest.mark.parametrize("steps", ["2", "1"])
def test_resume_of_a_checkpoint_not_before_steps_is_refused(steps, checkpoint, capsys, no_work):
    line = refused(capsys, TINY + ["--steps", steps, "--resume", checkpoint], "--resume")
    assert "is at step 2" in line and "--steps greater than 2" in line


# -- what works -----------------------------------------------------------------------------------

def test_cli_save_then_resume_continues_the_same_run(tmp_path, capsys):
    first, resumed, whole = (str(tmp_path / name) for name in ("first.pt", "resumed.pt", "whole.pt"))
    assert train.main(TINY + ["--steps", "2", "--save", first]) == 0
    assert train.main(TINY + ["--steps", "3", "--resume", first, "--save", resumed]) == 0
    assert "resuming at step 2" in capsys.readouterr().out
    assert train.main(TINY + ["--steps", "3", "--save", whole]) == 0
    a, b = torch.load(resumed, weights_only=True), torch.load(whole, weights_only=True)
    assert a["step"] == b["step"] == 3 and a["losses"] == b["losses"]
    for key, tensor in b["model"].items():
        assert torch.equal(a["model"][key], tensor), key
    for saved_id, state in b["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(a["optimizer"]["state"][saved_id][key], tensor), (saved_id, key)


def test_resume_with_compare_compares_the_whole_curve(checkpoint, tmp_path, capsys):
    png = str(tmp_path / "curves.png")
    assert train.main(TINY + ["--steps", "3", "--resume", checkpoint, "--compare", "--plot", png]) == 0
    out = capsys.readouterr().out
    assert "largest difference over 3 steps" in out and os.path.getsize(png) > 1000


def test_compare_of_runs_too_short_to_time(tmp_path, capsys):
    png = str(tmp_path / "curves.png")
    assert train.main(TINY + ["--steps", "2", "--compare", "--plot", png]) == 0
    out = capsys.readouterr().out
    assert "step time trainops / pytorch: not measured" in out and "speed not measured" in out


def test_checkpoint_save_is_atomic(data, tmp_path, monkeypatch):
    """A save that dies midway leaves the previous checkpoint in place, and no scratch file."""
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"the previous checkpoint")
    real_save = torch.save

    def dies_midway(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        with (open(f, "wb") if isinstance(f, (str, os.PathLike)) else open(f.fileno(), "wb", closefd=False)) as out:
            out.write(buffer.getvalue()[:1000])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        train.run(tiny(1), torch.device("cpu"), True, data, quiet=True, save=str(path))
    assert path.read_bytes() == b"the previous checkpoint"
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_command_line_exit_status_is_2_with_one_error_line():
    done = subprocess.run([sys.executable, "-m", "trainops", "train", "--config", "tiny", "--steps", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines()[-1] == (f"{PROG}: error: argument --steps: "
                                            "must be a whole number of at least 1, got 0")
