"""``python -m trainops train``'s optimizer flags (issue 41): --optim-bits, --param-dtype,
--master-weights, --stochastic-rounding, --step-in-backward, --clip-with-previous-norm,
--max-grad-norm. A tiny CPU run per flag (3 steps) and one test per refusal (the error names the
flag, before any work)."""

import argparse
import math
from dataclasses import replace

import pytest
import torch

from test_train_cli import PROG, refused   # exit status 2, usage, then one line naming the argument
from trainops import train
from trainops.train import cli, gpt

TINY = ["--config", "tiny", "--steps", "2"]


def run_command(capsys, argv):
    assert train.main(TINY + argv) == 0
    out = capsys.readouterr().out
    loss_line = next(line for line in out.splitlines() if line.startswith("trainops: final loss"))
    final = float(loss_line.split("final loss ")[1].split()[0])
    assert math.isfinite(final) and 0 < final < 6.0, out   # bytes: ln 256 = 5.55 at the start
    return out


def test_optim_bits_8_trains_with_8bit_states(capsys):
    out = run_command(capsys, ["--optim-bits", "8"])
    assert "8-bit optimizer states" in out.splitlines()[0]
    assert "adam_step_lowbit" in out   # the 8-bit step ran (the matrices; norms keep float32 states)


def test_stochastic_rounding_trains_bf16_parameters(capsys):
    out = run_command(capsys, ["--param-dtype", "bfloat16", "--stochastic-rounding"])
    assert "bfloat16 parameters rounded stochastically" in out.splitlines()[0]
    lowbit = [line for line in out.splitlines() if line.strip().startswith("adam_step_lowbit")]
    assert lowbit and "bfloat16" in lowbit[0], out   # the rounding step ran on bf16 parameters


def test_step_in_backward_follows_the_plain_step(capsys):
    """The flag gives the handle (accumulation_steps = the config's 2 micro-batches); the run's
    curve equals the plain step's: the same sums of the same gradients, the same update."""
    args = cli_args(["--step-in-backward", "--max-grad-norm", "0"])
    cfg, _ = gpt.config_from_args(argparse.ArgumentParser(prog=PROG), args)
    assert cfg.step_in_backward and cfg.max_grad_norm == 0 and cfg.accumulate == 2
    cfg = replace(cfg, steps=2)
    data = train.stdlib_bytes(cfg.data_bytes)
    inside = train.run(cfg, torch.device("cpu"), True, data, quiet=True)
    plain = train.run(replace(cfg, step_in_backward=False), torch.device("cpu"), True, data, quiet=True)
    assert "grad_stats" not in {op for op, *_ in inside.kernels}   # no clip, no check: nothing reads all gradients
    for a, b in zip(inside.losses, plain.losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (inside.losses, plain.losses)
    assert plain.losses[-1] < plain.losses[0]


def cli_args(argv):
    """The parsed namespace of ``argv`` (cli's parser, stopped before it hands the arguments on)."""
    seen = {}

    def capture(parser, args, *rest):
        seen["args"] = args
        return 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpt, "main_gpt", capture)
        patch.setattr(gpt, "config_from_args", lambda parser, args: (args, None))
        cli.main(TINY + argv)
    return seen["args"]


@pytest.mark.parametrize("argv, argument, says", [
    (["--optim-bits", "7"], "--optim-bits", "invalid choice"),
    (["--stochastic-rounding"], "--stochastic-rounding", "the parameters are float32"),
    (["--param-dtype", "bfloat16", "--master-weights", "--stochastic-rounding"], "--stochastic-rounding",
     "--master-weights"),
    (["--master-weights"], "--master-weights", "the parameters are float32"),
    (["--step-in-backward"], "--step-in-backward", "--clip-with-previous-norm"),
    (["--step-in-backward", "--max-grad-norm", "0", "--amp", "fp16"], "--step-in-backward", "GradScaler"),
    (["--clip-with-previous-norm"], "--clip-with-previous-norm", "only with --step-in-backward"),
    (["--step-in-backward", "--clip-with-previous-norm", "--max-grad-norm", "0"], "--clip-with-previous-norm",
     "turns the clip off"),
    (["--step-in-backward", "--max-grad-norm", "0", "--fsdp"], "--step-in-backward", "--fsdp"),
    (["--param-dtype", "bfloat16", "--fsdp"], "--param-dtype", "--fsdp"),
    (["--max-grad-norm", "-1"], "--max-grad-norm", "at least 0"),
    (["--model", "cnn", "--optim-bits", "8"], "--optim-bits", "not available with --model cnn"),
    (["--model", "cnn", "--step-in-backward"], "--step-in-backward", "not available with --model cnn"),
])
def test_optimizer_flag_errors_are_refused_before_any_work(argv, argument, says, capsys, no_work):
    assert says in refused(capsys, TINY + argv, argument)


def test_llama_refuses_step_in_backward_under_fp16(capsys, no_work, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from trainops.train import llama
    monkeypatch.setattr(llama, "stdlib_tokens", no_work)
    monkeypatch.setattr(llama, "run_llama", no_work)
    line = refused(capsys, ["--model", "llama", "--config", "tiny", "--step-in-backward", "--max-grad-norm", "0",
                            "--amp", "fp16"], "--step-in-backward")
    assert "GradScaler" in line
