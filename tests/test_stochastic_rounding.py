"""Stochastic rounding of bfloat16 parameters (issue 41): unbiased at every kind of value, fresh
random bits at every step, tensor and seed, the optimizer's drift unbiased over many steps, and the
Triton kernel (the interpreter here) rounding as the CPU path does. References in float64."""

import math

import pytest
import torch

import trainops
from trainops.ops import lowbit_optimizers as lowbit

# Values of each kind: between two bfloat16 numbers (just above / below powers of two, where the
# step changes), negative, float32 subnormals (bfloat16's subnormal step 2^-133), near bfloat16's
# largest finite value, and values bfloat16 holds exactly (never moved).
BETWEEN = [1.0 + 0.3 * 2.0 ** -7, 2.0 - 0.2 * 2.0 ** -7, 2.0 + 0.9 * 2.0 ** -6, 0.5 - 0.5 * 2.0 ** -9,
           -1.0 - 0.7 * 2.0 ** -7, -3.3e-3, 0.1234567, 1.0e-40, -1.7e-39, 1.3 * 2.0 ** -126, 3.0e38]
EXACT = [0.0, 1.0, -0.75, 2.0 ** -133, -(2.0 ** -126), 3.0 * 2.0 ** 100]


def bf16_neighbours(x: torch.Tensor):
    """(below, above, step) of each float64 value: the bfloat16 numbers around |x| signed as x, found
    from the exponent (8 significant bits; step 2^-133 below 2^-126), without any bit trick."""
    magnitude = x.abs()
    exponent = torch.floor(torch.log2(magnitude.clamp(min=2.0 ** -126)))
    step = torch.pow(2.0, exponent - 7)
    below = torch.floor(magnitude / step) * step
    above = torch.where(below == magnitude, below, below + step)
    return below * x.sign(), above * x.sign(), step


def test_stochastic_round_is_unbiased_at_every_kind_of_value():
    """Over 128 steps x 256 copies of each value: every result is one of the two bfloat16 neighbours,
    exact values never move, and the mean is x within 4.5 standard deviations of the mean."""
    values = torch.tensor(BETWEEN + EXACT, dtype=torch.float32).double()   # float32 values, in float64
    x = values.repeat(256)                      # copies interleaved: neighbours' bits differ
    below, above, step = bf16_neighbours(x)
    total = torch.zeros_like(x)
    samples = 128
    for t in range(1, samples + 1):
        rounded = lowbit.stochastic_round_bf16(x.float(), seed=11, key=3, step=t).double()
        assert bool(((rounded == below) | (rounded == above)).all())
        total += rounded
    mean = (total / samples).view(256, -1).mean(0)
    p = ((values.abs() - below[:values.numel()].abs()) / step[:values.numel()]).clamp(0, 1)
    sigma = step[:values.numel()] * torch.sqrt(p * (1 - p) / (samples * 256))
    exact = torch.arange(values.numel()) >= len(BETWEEN)
    assert torch.equal(mean[exact], values[exact])
    assert bool((p[~exact] > 0).all())
    assert bool(((mean - values).abs()[~exact] <= 4.5 * sigma[~exact]).all()), (mean - values) / sigma


def decisions(x, seed, key, steps):
    """Whether each element rounded up, [steps, n] (bool)."""
    return torch.stack([lowbit.stochastic_round_bf16(x, seed=seed, key=key, step=t).float() > x
                        for t in range(1, steps + 1)])


def test_random_bits_are_fresh_at_every_step_tensor_and_seed():
    """Half a step above 1 (up with probability 1/2), n elements over T steps: each element's own
    sequence of decisions is a fair coin (the spread of its up-fraction is the binomial one, not 0
    or 1/2 as with bits reused every step), consecutive steps agree half the time, and so do two
    tensors (keys) and two seeds at the same step."""
    n, steps = 2048, 64
    x = torch.full((n,), 1.0 + 0.5 * 2.0 ** -7)
    up = decisions(x, seed=5, key=0, steps=steps).double()
    fraction = up.mean(0)                                    # per element, over the steps
    assert abs(up.mean().item() - 0.5) < 4 * math.sqrt(0.25 / (n * steps))
    spread = fraction.var().item()                           # binomial: 0.25 / steps
    assert 0.7 * 0.25 / steps < spread < 1.3 * 0.25 / steps
    agree_next = (up[1:] == up[:-1]).double().mean().item()
    assert abs(agree_next - 0.5) < 4 * math.sqrt(0.25 / (n * (steps - 1)))
    for other in (decisions(x, seed=5, key=1, steps=4), decisions(x, seed=6, key=0, steps=4)):
        agree = (other.double() == up[:4]).double().mean().item()
        assert abs(agree - 0.5) < 4 * math.sqrt(0.25 / (4 * n))


@pytest.mark.parametrize("grad_sign", [1.0, -1.0], ids=["down", "up"])
def test_adamw_drift_is_unbiased_over_many_steps(grad_sign, backend, device):
    """A constant gradient and eps 0: each step moves every element by lr exactly (float64
    reference: 1 - sign * lr * t), 0.3 of a bfloat16 step. After 40 steps the mean over 4096
    elements is the reference within 4 standard deviations (each step's rounding a variance of at
    most step^2 / 4), where rounding to nearest never moves at all."""
    n, steps, lr = 4096, 40, 0.3 * 2.0 ** -8
    p = torch.ones(16, n // 16, dtype=torch.bfloat16, device=device, requires_grad=True)
    opt = trainops.optim.AdamW([p], lr=lr, weight_decay=0.0, eps=0.0, stochastic_rounding=True, rounding_seed=2)
    for _ in range(steps):
        p.grad = torch.full_like(p, grad_sign)
        opt.step()
    reference = 1.0 - grad_sign * lr * steps
    ulp = 2.0 ** -8 if grad_sign > 0 else 2.0 ** -7
    sigma = math.sqrt(steps) * ulp / 2 / math.sqrt(n)
    mean = p.detach().double().mean().item()
    assert abs(mean - reference) < 4 * sigma, (mean, reference, sigma)
    assert p.detach().double().std().item() > 0


def test_triton_step_rounds_as_the_cpu_path():
    """The Triton kernel (the interpreter here) against the CPU path, AdamW with stochastic rounding,
    3 steps: the same bfloat16 parameters but where a float32 rounding apart in the update moves an
    element across its rounding threshold (then one bfloat16 step apart)."""
    if not trainops.registry.triton_available():
        pytest.skip("needs Triton")
    gen = torch.Generator().manual_seed(4)
    shapes = [(6, 700), (3, 256), (300,)]
    start = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes] for _ in range(3)]
    out = {}
    for backend in ("cpu", "triton"):
        device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
        with trainops.backend(backend):
            params = [p.clone().to(device).requires_grad_() for p in start]
            opt = trainops.optim.AdamW(params, lr=1e-2, stochastic_rounding=True, rounding_seed=7)
            for step_grads in grads:
                for p, g in zip(params, step_grads):
                    p.grad = g.to(device)
                opt.step()
            out[backend] = torch.cat([p.detach().cpu().float().flatten() for p in params])
    a, b = out["cpu"], out["triton"]
    different = a != b
    assert different.double().mean().item() < 1e-3
    _, _, step = bf16_neighbours(a.double())
    assert bool(((a - b).abs().double()[different] <= step[different] * 1.0001).all())
    assert not torch.equal(a, torch.cat([p.float().flatten() for p in start]))
