"""Numerical checks shared by the op tests: float64 references compared by relative norm."""

import torch

# ||out - ref|| / ||ref|| bounds, by the dtype the result is computed in.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double().to(out.device)
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Same shape, NaN exactly where the reference has NaN, relative-norm error within tolerance."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out, ref = out.detach().double(), ref.detach().double().to(out.device)
    nan_out, nan_ref = out.isnan(), ref.isnan()
    assert torch.equal(nan_out, nan_ref), f"{what}: NaN at {nan_out.sum()} places, reference at {nan_ref.sum()}"
    inf_ref = ref.isinf()
    assert torch.equal(out[inf_ref], ref[inf_ref]), f"{what}: infinities differ"
    finite = ~(nan_ref | inf_ref)
    err = relative_error(out[finite], ref[finite])
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.3e} > {TOLERANCE[dtype]:.0e} ({dtype})"


def interpreter_rounding(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` as a Triton kernel computes it on this machine.

    Triton's interpreter (Triton 3.6 to 3.9) casts float32 to bfloat16 by truncation, not
    round-to-nearest as the GPU does (float16 it rounds to nearest); a reference that casts an
    input the kernel casts must model that.
    """
    import os

    if dtype == torch.bfloat16 and x.dtype == torch.float32 and os.environ.get("TRITON_INTERPRET") == "1":
        return (x.contiguous().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return x.to(dtype)
