"""``python -m trainops train --model llama``: the BPE tokenizer learned from the standard library,
the runs (trainops, PyTorch eager, torch.compile) training the same model on the same batches to
the same curve on the CPU, the report, and every argument error refused before any work."""

import os
from dataclasses import replace

import pytest
import torch
import transformers  # noqa: F401  (the hf extra; the test extra installs it)

from test_train_cli import refused   # exit status 2, usage, then one line naming the argument
from trainops import train
from trainops.train import common
from trainops.train import llama as L

LLAMA = ["--model", "llama", "--config", "tiny"]
CPU = torch.device("cpu")


def tiny(**changes):
    return replace(L.LlamaRunConfig(**L.LLAMA_CONFIGS["tiny"]), **changes)


@pytest.fixture(scope="module")
def tokens():
    return L.stdlib_tokens(tiny())


# -- data -------------------------------------------------------------------------------------------

def test_tokenizer_is_learned_from_the_training_text_and_gives_it_back(tokens):
    cfg = tiny()
    source = train.stdlib_source(cfg.data_bytes).decode("utf-8", errors="replace")
    cut = int(len(source) * 0.95)
    assert 256 < tokens.vocab_learned <= cfg.vocab
    assert tokens.ids.dtype == torch.long and 0 <= int(tokens.ids.min()) and int(tokens.ids.max()) < tokens.vocab_learned
    assert tokens.train_text_bytes == len(source[:cut].encode())
    # byte-level BPE loses nothing: the training tokens decode to the training text, the held-out ones to the rest
    assert tokens.tokenizer.decode(tokens.ids[:tokens.split].tolist()) == source[:cut]
    assert tokens.tokenizer.decode(tokens.ids[tokens.split:].tolist()) == source[cut:]
    assert 2.0 < tokens.text_bytes / len(tokens.ids) < 6.0   # merges happened (measured 3.5 at 4 MiB)


def test_tokens_are_the_same_every_time(tokens):
    again = L.stdlib_tokens(tiny())
    assert torch.equal(again.ids, tokens.ids) and again.split == tokens.split


# -- runs ---------------------------------------------------------------------------------------------

def test_trainops_run_learns_and_follows_pytorchs_curve(tokens):
    cfg = tiny(steps=12)
    ours = L.run_llama(cfg, CPU, "trainops", tokens, quiet=True)
    ref = L.run_llama(cfg, CPU, "pytorch", tokens, quiet=True)
    assert ours.name == "trainops" and ref.name == "pytorch" and len(ours.losses) == len(ref.losses) == 12
    assert all(torch.isfinite(torch.tensor(ours.losses)))
    assert sum(ours.losses[-3:]) < sum(ours.losses[:3]) - 1.0, ours.losses
    # float32 on the CPU: the same model and batches, trainops's kernels against torch's
    assert common.largest_relative_difference(ours.losses, ref.losses) < 1e-4, (ours.losses, ref.losses)
    assert abs(ours.val_loss - ref.val_loss) < 1e-3 * ref.val_loss
    assert ours.kernels and not ref.kernels   # trainops kernels ran in the trainops run only
    assert any(op == "cross_entropy" for op, *_ in ours.kernels)   # the loss through linear_cross_entropy


def test_compiled_trainops_run_follows_the_eager_one(tokens):
    cfg = tiny(steps=4)
    eager = L.run_llama(cfg, CPU, "trainops", tokens, quiet=True)
    compiled = L.run_llama(cfg, CPU, "trainops-compile", tokens, quiet=True)
    assert common.largest_relative_difference(compiled.losses, eager.losses) < 1e-4, (compiled.losses, eager.losses)
    assert len(compiled.step_times_ms) == 4 - L.UNTIMED_STEPS


def test_lamb_trainops_run_learns(tokens):
    result = L.run_llama(tiny(steps=12, optimizer="lamb"), CPU, "trainops", tokens, quiet=True)
    assert sum(result.losses[-3:]) < sum(result.losses[:3]) - 0.5, result.losses


def test_results_table_without_a_pytorch_run():
    def result(name, losses):
        return train.RunResult(name, losses, 2.0, 1000.0, 10.0, 512.0, {}, [10.0, 10.0])

    table = common.results_table([result("trainops", [3.0, 2.0]), result("trainops-compile", [3.0, 2.2])], CPU,
                                 L.RUNS, L.UNTIMED_STEPS)
    lines = table.splitlines()
    assert lines[0].endswith("curve vs -: max, mean") and len(lines) == 3
    assert lines[2].startswith("trainops.patch + torch.compile") and lines[2].split()[-1] == "-"
    table = common.results_table([result("trainops", [3.0, 2.0]), result("pytorch", [3.0, 2.5])], CPU, L.RUNS,
                                 L.UNTIMED_STEPS)
    assert table.splitlines()[1].split()[-2:] == ["20.00%,", "10.00%"] and " 1.00x" in table


def test_cli_compare_trains_and_reports_every_run(tmp_path, capsys):
    png = str(tmp_path / "curves.png")
    assert train.main(LLAMA + ["--steps", "5", "--compare", "--plot", png]) == 0
    out = capsys.readouterr().out
    assert "runs: trainops, pytorch, pytorch-compile" in out
    assert "liger not run: Liger-Kernel runs on CUDA only" in out
    assert "tokenizer: byte-level BPE" in out
    table = out[out.index("run "):].splitlines()
    assert [line.split("  ")[0] for line in table[1:4]] == ["trainops.patch", "PyTorch eager", "torch.compile"]
    assert os.path.getsize(png) > 1000


# -- arguments --------------------------------------------------------------------------------------

@pytest.fixture
def no_work(no_work, monkeypatch):
    """conftest's no_work, and the command neither learns the tokenizer nor trains a llama run."""
    monkeypatch.setattr(L, "stdlib_tokens", no_work)
    monkeypatch.setattr(L, "run_llama", no_work)
    return no_work


@pytest.mark.parametrize("argv, argument, says", [
    (["--model", "llama", "--config", "medium"], "--config", "--model llama has tiny, small, 1b"),
    (["--config", "1b"], "--config", "--model gpt has tiny, small, medium"),
    (["--config", "tiny", "--runs", "trainops"], "--runs", "only with --model llama"),
    (LLAMA + ["--save", "x.pt"], "--save", "not available with --model llama"),
    (LLAMA + ["--resume", "x.pt"], "--resume", "not available with --model llama"),
    (LLAMA + ["--dropout", "0.1"], "--dropout", "not available with --model llama"),
    (LLAMA + ["--runs", "trainops,eager"], "--runs", "'eager' is not a run"),
    (LLAMA + ["--runs", "trainops,pytorch,trainops"], "--runs", "named twice"),
    (LLAMA + ["--runs", "trainops", "--compare"], "--runs", "leave out --compare"),
    (LLAMA + ["--runs", "trainops", "--compile"], "--compile", "name trainops-compile or pytorch-compile"),
    (LLAMA + ["--runs", "trainops,liger"], "--runs", "Liger-Kernel runs on CUDA only"),
    (LLAMA + ["--optimizer", "lamb", "--compare"], "--compare", "no LAMB"),
    (LLAMA + ["--optimizer", "lamb", "--runs", "trainops,pytorch"], "--runs", "no LAMB"),
    (LLAMA + ["--plot", "x.png"], "--plot", "only used with --compare or --runs"),
    (LLAMA + ["--compare", "--plot", "x.unknown"], "--plot", "image format"),
])
def test_llama_argument_errors_are_refused_before_any_work(argv, argument, says, capsys, no_work):
    assert says in refused(capsys, argv, argument)


def test_llama_without_its_packages_is_refused(capsys, no_work, monkeypatch):
    monkeypatch.setattr(L, "missing_packages", lambda: ["tokenizers"])
    line = refused(capsys, LLAMA, "--model")
    assert "needs tokenizers" in line and "pip install 'trainops[hf]'" in line


@pytest.mark.gpu
def test_gpu_runs_follow_pytorchs_curve_under_bf16_autocast(tokens):
    cfg = tiny(steps=10, amp="bf16")
    cuda = torch.device("cuda")
    results = {run: L.run_llama(cfg, cuda, run, tokens, quiet=True) for run in ("trainops", "trainops-compile", "pytorch")}
    for run in ("trainops", "trainops-compile"):
        difference = common.largest_relative_difference(results[run].losses, results["pytorch"].losses)
        assert difference < 2e-2, (run, results[run].losses, results["pytorch"].losses)
    assert sum(results["trainops"].losses[-3:]) < sum(results["trainops"].losses[:3]) - 0.5
    assert all(r.peak_memory_mb > 0 for r in results.values())


def test_bf16_on_a_gpu_without_it_is_refused(capsys, no_work, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "an older GPU")
    line = refused(capsys, LLAMA + ["--device", "cuda"], "--amp")
    assert "bf16 (the default on cuda) is not supported by an older GPU" in line


def test_a_liger_that_does_not_import_is_reported_before_any_run(monkeypatch):
    import importlib.util
    import sys

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: object() if name == "liger_kernel" else real_find_spec(name, *args))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)   # importing it raises ImportError
    reason = L.liger_unavailable_reason(torch.device("cuda"))
    assert reason.startswith("Liger-Kernel does not import here (ModuleNotFoundError: import of liger_kernel")
