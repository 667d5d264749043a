"""trainops.optim.step_in_backward: the same training as the plain optimizer, gradients freed in the backward."""

import warnings

import pytest
import torch

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 3)).to(dtype)


def batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen)) for _ in range(n)]


def train(model, opt, data, scheduler=None, micro=1, check=None):
    for i, (x, y) in enumerate(data):
        dtype = next(model.parameters()).dtype
        ((model(x.to(dtype)).float() - y).square().mean() / micro).backward()
        if check is not None:
            check()
        if (i + 1) % micro == 0:
            opt.step()
            opt.zero_grad()
            if scheduler is not None:
                scheduler.step()


OPTIONS = {
    "adamw": ("AdamW", torch.float32, dict(lr=1e-2, weight_decay=0.1)),
    "adamw-8bit": ("AdamW", torch.float32, dict(lr=1e-2, optim_bits=8, min_8bit_size=0)),
    "adam-bf16-sr": ("Adam", torch.bfloat16, dict(lr=1e-2, stochastic_rounding=True)),
    "lamb": ("LAMB", torch.float32, dict(lr=1e-2)),
    "sgd": ("SGD", torch.float32, dict(lr=1e-2, momentum=0.9)),
}


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 30], ids=["a-step-per-gradient", "one-step-at-the-end"])
@pytest.mark.parametrize("case", list(OPTIONS))
def test_same_parameters_as_the_plain_optimizer(case, bucket_bytes):
    """Bit for bit, with an LR schedule that changes the rate every step (it reaches the steps in
    the backward through param_groups); every gradient freed by the end of each backward."""
    name, dtype, options = OPTIONS[case]
    ref, ours = make_model(dtype=dtype), make_model(dtype=dtype)
    ref_opt = getattr(trainops.optim, name)(ref.parameters(), **options)
    opt = getattr(trainops.optim, name)(ours.parameters(), **options)
    schedule = lambda step: 1.0 / (1 + step)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)   # made before the handle: still reaches it
    handle = trainops.optim.step_in_backward(ours, opt, bucket_bytes=bucket_bytes)
    data = batches(5)
    train(ref, ref_opt, data, torch.optim.lr_scheduler.LambdaLR(ref_opt, schedule))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "optimizer.step() overridden" warning from the scheduler
        train(ours, opt, data, scheduler,
              check=lambda: all(p.grad is None for p in ours.parameters()) or pytest.fail("a gradient was kept"))
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != options["lr"]
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert handle.steps == 5
    handle.remove()


def test_accumulation_steps_on_the_last_micro_batch():
    ref, ours = make_model(), make_model()
    ref_opt = trainops.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = trainops.optim.AdamW(ours.parameters(), lr=1e-2)
    handle = trainops.optim.step_in_backward(ours, opt, accumulation_steps=3)
    data = batches(6)
    train(ref, ref_opt, data, micro=3)
    seen = []
    train(ours, opt, data, micro=3, check=lambda: seen.append(all(p.grad is not None for p in ours.parameters())))
    assert seen == [True, True, False] * 2   # kept while accumulating, freed by the stepping backward
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)
    assert handle.steps == 2


def test_clip_with_previous_norm():
    """Each step is clipped with the coefficient of the previous backward's global norm."""
    ref, ours = make_model(), make_model()
    ref_opt = trainops.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = trainops.optim.AdamW(ours.parameters(), lr=1e-2, max_grad_norm=0.05)
    handle = trainops.optim.step_in_backward(ours, opt, clip_with_previous_norm=True)
    coefficient = None
    for x, y in batches(4):
        ref_opt.zero_grad()
        (ref(x) - y).square().mean().backward()
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.parameters()]))
        if coefficient is not None:
            for p in ref.parameters():
                p.grad.mul_(coefficient)
        ref_opt.step()
        coefficient = torch.clamp(0.05 / (norm + 1e-6), max=1.0)
        (ours(x) - y).square().mean().backward()
        assert torch.allclose(handle.grad_norm, norm, rtol=1e-5)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    handle.remove()
    assert opt.max_grad_norm == 0.05


def test_remove_restores_the_plain_optimizer():
    model = make_model()
    opt = trainops.optim.AdamW(model.parameters(), lr=1e-2)
    handle = trainops.optim.step_in_backward(model, opt)
    train(model, opt, batches(1))
    handle.remove()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1, seed=3)[0]
    (model(x) - y).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.step()
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_refusals_by_name():
    model = make_model()
    with pytest.raises(UnsupportedError, match="max_grad_norm"):
        trainops.optim.step_in_backward(model, trainops.optim.AdamW(model.parameters(), max_grad_norm=1.0))
    with pytest.raises(UnsupportedError, match="skip_nonfinite"):
        trainops.optim.step_in_backward(model, trainops.optim.AdamW(model.parameters(), skip_nonfinite=True))
    with pytest.raises(InvalidProblemError, match="accumulation_steps"):
        trainops.optim.step_in_backward(model, trainops.optim.AdamW(model.parameters()), accumulation_steps=0)
    with pytest.raises(InvalidProblemError, match="clip_with_previous_norm"):
        trainops.optim.step_in_backward(model, trainops.optim.AdamW(model.parameters()), clip_with_previous_norm=True)
    with pytest.raises(UnsupportedError, match="optimizer"):
        trainops.optim.step_in_backward(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(InvalidProblemError, match="not in the optimizer"):
        trainops.optim.step_in_backward(model, trainops.optim.AdamW(model[0].parameters()))
    opt = trainops.optim.AdamW(model.parameters())
    x, y = batches(1)[0]
    (model(x) - y).square().mean().backward()   # a micro-batch accumulated before the handle
    with pytest.raises(InvalidProblemError, match="already has a gradient"):
        trainops.optim.step_in_backward(model, opt)
    assert opt.step.__func__ is type(opt).step   # nothing installed
    opt.zero_grad()
    handle = trainops.optim.step_in_backward(model, opt)
    with pytest.raises(InvalidProblemError, match="already"):
        trainops.optim.step_in_backward(model, opt)
    with pytest.raises(UnsupportedError, match="GradScaler"):
        opt.step(grad_scale=torch.ones(()))
    handle.remove()


def test_bucket_caches_are_bounded(monkeypatch):
    """Past the cap, the cached per-flush buckets are dropped (and rebuilt): same parameters."""
    monkeypatch.setattr(trainops.optim, "_IN_BACKWARD_CACHE", 2)
    ref, ours = make_model(), make_model()
    ref_opt = trainops.optim.AdamW(ref.parameters(), lr=1e-2, optim_bits=8, min_8bit_size=0)
    opt = trainops.optim.AdamW(ours.parameters(), lr=1e-2, optim_bits=8, min_8bit_size=0)
    trainops.optim.step_in_backward(ours, opt, bucket_bytes=0)
    data = batches(3)
    train(ref, ref_opt, data)
    train(ours, opt, data)
    assert len(opt._buckets) <= 3   # without the cap: 6 (one per parameter)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)
