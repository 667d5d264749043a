"""``python -m trainops train --model cnn`` (issue 22's main job): the generated images, the ResNet,
the runs (trainops's batch norm and GIST against torch's modules, the same curve), the report, and
every argument refused before any work."""

import math

import pytest
import torch

import trainops
from trainops import train
from trainops.train import cnn as train_cnn
from trainops.train.cnn import CnnRunConfig, gratings, run_cnn

TINY = CnnRunConfig(**train_cnn.CNN_CONFIGS["tiny"])


def test_gratings_are_seeded_labelled_and_learnable():
    x, y = gratings(64, seed=3, noise=0.5)
    x2, y2 = gratings(64, seed=3, noise=0.5)
    assert x.shape == (64, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, gratings(64, 4, 0.5)[0])
    assert set(y.tolist()) <= set(range(10)) and len(set(y.tolist())) > 5
    # the class is in the image: noise-free gratings of one class share an orientation, so their
    # spectra agree; a nearest-class-mean classifier on power spectra beats chance by far
    clean, labels = gratings(400, seed=5, noise=0.0)
    power = torch.fft.rfft2(clean[:, 0]).abs().flatten(1)
    means = torch.stack([power[labels == c].mean(0) for c in range(10)])
    test, test_labels = gratings(200, seed=6, noise=0.0)
    guess = torch.cdist(torch.fft.rfft2(test[:, 0]).abs().flatten(1), means).argmin(1)
    assert (guess == test_labels).float().mean() > 0.5


def test_resnet_shapes():
    model = train_cnn.ResNet((8, 16, 32), blocks=2)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    strided = [b for b in model.stages if b.shortcut is not None]
    assert len(strided) == 2   # each stage after the first halves the resolution through a 1x1 shortcut


def test_the_trainops_model_fuses_each_batch_norm_a_relu_follows():
    """The stem's and each block's first batch norm are BatchNormReLU2d (no ReLU module after them),
    the others BatchNorm2d; the parameters are the same, in the same order, from the same seed."""
    cfg = CnnRunConfig(**{**train_cnn.CNN_CONFIGS["tiny"], "blocks": 2})
    ours = train_cnn.build_model(cfg, torch.device("cpu"), True)
    ref = train_cnn.build_model(cfg, torch.device("cpu"), False)
    fused = [n for n, m in ours.named_modules() if isinstance(m, trainops.nn.BatchNormReLU2d)]
    assert fused == ["stem.1"] + [f"stages.{i}.bn1" for i in range(4)], fused
    plain = [n for n, m in ours.named_modules() if type(m) is trainops.nn.BatchNorm2d]
    assert len(plain) == 4 + 1 and all(n.endswith(("bn2", "shortcut.1")) for n in plain), plain
    assert sum(isinstance(m, torch.nn.ReLU) for m in ours.modules()) == 4   # each block's relu2
    assert [n for n, _ in ours.named_parameters()] != [] and all(
        torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
    assert ours.state_dict().keys() == ref.state_dict().keys()


def test_trainops_run_follows_pytorchs_curve_and_uses_its_kernels():
    ours = run_cnn(TINY, torch.device("cpu"), "trainops", quiet=True)
    ref = run_cnn(TINY, torch.device("cpu"), "pytorch", quiet=True)
    assert len(ours.run.losses) == TINY.steps and all(math.isfinite(v) for v in ours.run.losses)
    # float32 on the CPU: trainops's batch norms (those a ReLU follows fused with it) and the exact
    # GIST ReLU give torch's values
    assert max(abs(a - b) / b for a, b in zip(ours.run.losses, ref.run.losses)) < 1e-5
    ops = {op for op, *_ in ours.run.kernels}
    assert ops == {"batch_norm_stats", "batch_norm", "batch_norm_backward", "gist_relu", "gist_relu_backward",
                   "sgd_step"}, ops
    assert ref.run.kernels == {}
    assert 0.0 <= ours.accuracy <= 1.0 and ours.stash is None


def test_a_lossy_stash_is_reported_and_stays_close():
    cfg = CnnRunConfig(**{**train_cnn.CNN_CONFIGS["tiny"], "gist": "e4m3", "steps": 4})
    ours = run_cnn(cfg, torch.device("cpu"), "trainops", quiet=True)
    ref = run_cnn(cfg, torch.device("cpu"), "pytorch", quiet=True)
    assert ours.stash is not None and ours.stash.packed > 0 and ours.stash.stored_bytes * 4 == ours.stash.original_bytes
    assert ours.run.losses[0] == pytest.approx(ref.run.losses[0], rel=1e-6)   # the first forward is untouched
    assert max(abs(a - b) / b for a, b in zip(ours.run.losses, ref.run.losses)) < 0.05
    assert "GIST stash: " in train_cnn.summary(ours)


def test_the_command_reports_every_run(capsys, tmp_path):
    assert train.main(["--model", "cnn", "--config", "tiny", "--steps", "5", "--compare",
                       "--plot", str(tmp_path / "cnn.png")]) == 0
    out = capsys.readouterr().out
    for label in ("trainops (BatchNorm, GIST)", "PyTorch eager", "torch.compile"):
        assert label in out, out
    assert "images/s" in out and "accuracy" in out and (tmp_path / "cnn.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["--gist", "e4m3"], "argument --gist: only with --model cnn"),
    (["--model", "cnn", "--config", "medium"], "argument --config: --model cnn has tiny, small, resnet18"),
    (["--model", "cnn", "--save", "x.pt"], "argument --save: not available with --model cnn"),
    (["--model", "cnn", "--optimizer", "lamb"], "argument --optimizer: not available with --model cnn"),
    (["--model", "cnn", "--compile"], "argument --compile: --model cnn's --compare"),
    (["--model", "cnn", "--amp", "fp16"], "argument --amp: --model cnn runs bf16 or none"),
    (["--model", "cnn", "--dropout", "0.1"], "argument --dropout: not available with --model cnn"),
    (["--model", "cnn", "--gist", "int8"], "argument --gist: invalid choice"),
    (["--model", "cnn", "--cuda-graphs"], "argument --cuda-graphs: needs --device cuda"),
    (["--cuda-graphs"], "argument --cuda-graphs: only with --model cnn"),
    (["--model", "cnn", "--runs", "trainops,eager"], "argument --runs: 'eager' is not a --model cnn run"),
    (["--model", "cnn", "--runs", "pytorch,pytorch"], "argument --runs: a run is named twice"),
    (["--model", "cnn", "--runs", "pytorch", "--compare"], "argument --runs: names the runs itself"),
    (["--model", "cnn", "--amp", "bf16", "--gist", "fp16"], "argument --gist: fp16 packs nothing under --amp bf16"),
])
def test_arguments_are_refused_before_any_work(argv, message, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the command started work before refusing its arguments")
    monkeypatch.setattr(train_cnn, "run_cnn", no_work)
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_cnn_runs_side_by_side():
    cfg = CnnRunConfig(**{**train_cnn.CNN_CONFIGS["small"], "steps": 10, "amp": "bf16", "gist": "e4m3"})
    device = torch.device("cuda")
    ours = run_cnn(cfg, device, "trainops", quiet=True)
    ref = run_cnn(cfg, device, "pytorch", quiet=True)
    assert all(math.isfinite(v) for v in ours.run.losses)
    assert max(abs(a - b) / b for a, b in zip(ours.run.losses, ref.run.losses)) < 0.05
    assert ours.run.peak_memory_mb < ref.run.peak_memory_mb


@pytest.mark.gpu
def test_gpu_cnn_runs_as_cuda_graphs_on_the_same_curve():
    """--cuda-graphs: the trainops and pytorch runs replay one graph a step after the warm-up; the
    curve is the eager run's (bf16: within a few percent), the learning rate follows the schedule."""
    base = {**train_cnn.CNN_CONFIGS["small"], "steps": 12, "amp": "bf16"}
    device = torch.device("cuda")
    for run in ("trainops", "pytorch"):
        eager = run_cnn(CnnRunConfig(**base), device, run, quiet=True)
        graphs = run_cnn(CnnRunConfig(**base, cuda_graphs=True), device, run, quiet=True)
        assert all(math.isfinite(v) for v in graphs.run.losses)
        assert max(abs(a - b) / b for a, b in zip(graphs.run.losses, eager.run.losses)) < 0.05, run
