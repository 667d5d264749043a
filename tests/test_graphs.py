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


def test_hyper_parameters_are_held_by_value_unless_cuda_tensors():
    """What a replay compares: numbers, lists (copied, so an in-place change shows) and CPU tensors
    (read at launch) by value; CUDA tensors by identity (a replay reads them)."""
    from trainops.graphs import _hyper_parameters
    lr = torch.tensor(1e-3)
    group = {"params": [], "lr": lr, "betas": [0.9, 0.99], "weight_decay": 0.0}
    before = _hyper_parameters(group)
    assert _hyper_parameters(group) == before
    group["betas"][0] = 0.8
    assert _hyper_parameters(group) != before
    group["betas"][0] = 0.9
    lr.fill_(5e-4)
    assert _hyper_parameters(group) != before


def test_capture_step_refuses_a_capture_inside_autocast_with_its_cache():
    """Entered inside torch.autocast (cache on), the capture would read weight casts made before it:
    refused by name (the capture phase itself, which a CUDA machine reaches after the warm-up)."""
    step = trainops.capture_step(_step, warmup_steps=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(trainops.UnsupportedError, match="argument 'step' is captured inside torch.autocast"):
            step._capture([], None)
