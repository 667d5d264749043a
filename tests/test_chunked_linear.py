"""cross_entropy's ``scale_unless_one_`` (the fused linear losses' backward scaling of the gradients
their forward computed by the upstream gradient, through the op "cross_entropy_grad_scale"):
nothing touched when the factor is 1, the float product rounded once otherwise; both backends, more
blocks than one program."""

import pytest
import torch

import trainops
from trainops.ops.cross_entropy import scale_unless_one_

from numerics import interpreter_rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scale_unless_one(backend, device, dtype):
    gen = torch.Generator().manual_seed(3)
    # 34 blocks of 4096: more than the 32 programs (8 an "SM", 4 under the interpreter) of the grid-stride loop
    t = torch.randn(33 * 4096 + 5, generator=gen).to(dtype)
    t[7], t[8] = float("nan"), float("-inf")
    t = t.to(device)
    before = t.clone()
    with trainops.track_kernels() as used:
        assert scale_unless_one_(t, torch.ones((), device=device)) is t
    assert {(op, kernel_backend) for op, kernel_backend, *_ in used} == {("cross_entropy_grad_scale", backend)}
    assert torch.equal(t[~before.isnan()], before[~before.isnan()]) and t[7].isnan()   # s == 1: untouched
    scale_unless_one_(t, torch.tensor([0.37], device=device))   # a one-element tensor of any shape
    want = before.float() * 0.37
    finite = want.isfinite()
    assert t[7].isnan() and t[8] == float("-inf")
    if backend == "cpu" or dtype == torch.float32:
        assert torch.equal(t[finite], want[finite].to(dtype))
    elif device == "cpu":   # the interpreter truncates to half dtypes where the GPU rounds
        assert torch.equal(t[finite], interpreter_rounding(want[finite], dtype))
    else:
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        assert torch.allclose(t[finite].float(), want[finite], rtol=ulp, atol=2.0 ** -24)


def test_scale_unless_one_edge_cases(backend, device):
    empty = torch.empty(0, device=device)
    scale_unless_one_(empty, torch.tensor(0.5, device=device))
    base = torch.arange(12.0, device=device).view(3, 4)
    scale_unless_one_(base.t(), torch.tensor(0.5, device=device))   # dense in another dim order
    assert torch.equal(base, torch.arange(12.0, device=device).view(3, 4) * 0.5)
    t64 = torch.arange(5.0, dtype=torch.float64, device=device)
    scale_unless_one_(t64, torch.tensor(2.0, dtype=torch.float64, device=device))
    assert torch.equal(t64, torch.arange(5.0, dtype=torch.float64, device=device) * 2)
