"""The patterns users combine the optimizers in: LR schedulers, checkpoint resume mid-run,
add_param_group, frozen parameters, accumulation into kept gradients, a GradScaler's state,
a model moved to another dtype. Against torch.optim on the same model and batches."""

import io

import pytest
import torch

import trainops
from numerics import relative_error


def _model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches(n):
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(5, 6, generator=gen) for _ in range(n)]


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _train(make_opt, make_sched, steps, resume_at=None):
    """``steps`` steps; at ``resume_at`` everything goes through torch.save / torch.load(weights_only=True)
    into a new model, optimizer and scheduler (built in that order, then loaded: torch's recipe)."""
    model = _model()
    opt = make_opt(model.parameters())
    sched = make_sched(opt)
    for step, x in enumerate(_batches(steps)):
        if step == resume_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            model = _model()
            model.load_state_dict(saved["model"])
            opt = make_opt(model.parameters())
            sched = make_sched(opt)
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        sched.step()
    return _flat(model)


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10),
    "CosineAnnealingWarmRestarts": lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, 3),
}
OPTIMIZERS = {
    "AdamW": (lambda p: trainops.optim.AdamW(p, lr=1e-2), lambda p: torch.optim.AdamW(p, lr=1e-2)),
    "SGD": (lambda p: trainops.optim.SGD(p, lr=1e-2, momentum=0.9), lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9)),
}


@pytest.mark.parametrize("sched", SCHEDULERS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_schedulers_and_resume_mid_run(backend, name, sched):
    """An LR scheduler drives ours as torch's (OneCycleLR also cycles AdamW's betas), and a resume
    mid-run continues the same curve bit for bit."""
    ours, theirs = OPTIMIZERS[name]
    with trainops.backend("cpu"):
        reference = _train(theirs, SCHEDULERS[sched], 10)
    got = _train(ours, SCHEDULERS[sched], 10)
    assert relative_error(got, reference) <= (0 if backend == "cpu" else 2e-6)
    assert torch.equal(_train(ours, SCHEDULERS[sched], 10, resume_at=4), got)


def test_add_param_group_mid_run(backend):
    flats = []
    for cls in (trainops.optim.AdamW, torch.optim.AdamW):
        torch.manual_seed(0)
        first, second = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
        opt = cls(first.parameters(), lr=0.01)
        x = torch.randn(5, 4)
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": second.parameters(), "lr": 0.05})
            opt.zero_grad()
            second(first(x)).square().sum().backward()
            opt.step()
        flats.append(torch.cat([_flat(first), _flat(second)]))
    assert relative_error(flats[0], flats[1]) <= (0 if backend == "cpu" else 2e-6)


def test_frozen_parameter_is_skipped_and_keeps_no_state(backend):
    model = _model()
    frozen = model[0].bias.requires_grad_(False)
    before = frozen.detach().clone()
    opt = trainops.optim.AdamW(model.parameters(), lr=0.1)
    for x in _batches(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    assert torch.equal(frozen, before) and len(opt.state[frozen]) == 0


def test_accumulation_into_kept_gradients(backend):
    """zero_grad(set_to_none=False), then two backwards a step: as torch's SGD with momentum."""
    flats = []
    for cls in (trainops.optim.SGD, torch.optim.SGD):
        model = _model()
        opt = cls(model.parameters(), lr=0.1, momentum=0.9)
        for step, x in enumerate(_batches(6)):
            if step % 2 == 0:
                opt.zero_grad(set_to_none=False)
            model(x).sum().backward()
            if step % 2 == 1:
                opt.step()
        flats.append(_flat(model))
    assert relative_error(flats[0], flats[1]) <= (0 if backend == "cpu" else 2e-6)


def test_grad_scaler_state_resumes(backend):
    scaler = trainops.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    model = _model()
    opt = trainops.optim.AdamW(model.parameters())
    for x in _batches(2):
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
    buf = io.BytesIO()
    torch.save(scaler.state_dict(), buf)
    buf.seek(0)
    resumed = trainops.amp.GradScaler("cpu")
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.get_scale() == scaler.get_scale() == 4096.0
    assert resumed.state_dict() == scaler.state_dict()


def test_model_moved_to_float64_after_steps(backend):
    """torch's AdamW raises (its float32 state meets float64 parameters); ours keeps stepping with
    the float32 state on the CPU path (state_dtype's rule), and the Triton backend, which has no
    float64 multi-tensor kernels, raises UnsupportedError before writing anything."""
    model = _model()
    opt = trainops.optim.AdamW(model.parameters(), lr=0.1)
    model(_batches(1)[0]).sum().backward()
    opt.step()
    model.double()
    opt.zero_grad()
    model(_batches(1)[0].double()).sum().backward()
    before = _flat(model)
    if backend == "triton":
        with pytest.raises(trainops.UnsupportedError, match="float64"):
            opt.step()
        assert torch.equal(_flat(model), before)
    else:
        opt.step()
        assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float32
        assert torch.isfinite(_flat(model)).all() and not torch.equal(_flat(model), before)
