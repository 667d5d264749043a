"""trainops.capture_step's argument checks (the CPU part; the replays are GPU tests in
test_cuda_graphs.py): each refusal names the argument, before anything runs."""

import pytest
import torch

import trainops


def _step(x):
    raise AssertionError("the step must not run when its arguments are refused")


def test_capture_step_refuses_bad_construction_arguments_by_name():
    with pytest.raises(trainops.InvalidProblemError, match="argument 'step'"):
        trainops.capture_step(3)
    with pytest.raises(trainops.InvalidProblemError, match="argument 'optimizers' item 0"):
        trainops.capture_step(_step, [torch.nn.Linear(2, 2)])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(trainops.InvalidProblemError, match="argument 'warmup_steps'"):
            trainops.capture_step(_step, warmup_steps=bad)


def test_capture_step_refuses_cpu_tensors_and_tensors_that_require_grad():
    step = trainops.capture_step(_step)
    with pytest.raises(trainops.InvalidProblemError, match=r"argument 'args\[0\]' is on cpu"):
        step(torch.zeros(3))
    with pytest.raises(trainops.UnsupportedError, match="argument 'x' requires grad"):
        step(x=torch.zeros(3, requires_grad=True))
    assert step.calls == 0 and not step.captured


def test_capture_step_takes_one_optimizer_or_several():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert trainops.capture_step(_step, opt).optimizers == [opt]
    assert trainops.capture_step(_step, (opt, opt)).optimizers == [opt, opt]
