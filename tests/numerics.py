"""Numerical checks shared by the op tests: float64 references compared by relative norm."""

import torch

# ||out - ref|| / ||ref|| bounds, by the dtype the result is computed in.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double().to(out.device)
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def poison_new_output(monkeypatch, problem_cls) -> None:
    """Make every output ``problem_cls.new_output`` allocates (a tensor or a tuple of them) start
    as NaN, so that an element a kernel leaves unwritten fails the test."""
    original = problem_cls.new_output

    def new_output(self):
        out = original(self)
        return out.fill_(float("nan")) if isinstance(out, torch.Tensor) else tuple(t.fill_(float("nan")) for t in out)
    monkeypatch.setattr(problem_cls, "new_output", new_output)


def stable_seed(*parts) -> int:
    """A generator seed from a test's parameters, the same in every process (``hash`` of a string is
    salted per process, so a seed taken from it changes from run to run)."""
    import zlib

    return zlib.crc32(repr(parts).encode())


def assert_sum_close(out: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor, dtype: torch.dtype,
                     what: str = "") -> None:
    """Sums over many terms (per-channel gradient reductions): ``||out - ref|| / ||abs_sum||`` within
    the dtype's tolerance, ``abs_sum`` being the float64 sums of the terms' absolute values.

    A sum accumulated in float32 carries an error of order eps * sum(|term|), whatever the sum itself;
    where the terms cancel (one channel, a sum near 0) its error relative to the sum is unbounded, so
    the plain relative norm would fail a correct kernel by chance of the data. A missed or doubled
    term still shows: it moves the sum by about sum(|term|) / count, far above the tolerance."""
    assert out.shape == ref.shape == abs_sum.shape, f"{what}: shapes {tuple(out.shape)}, {tuple(ref.shape)}"
    out, ref, abs_sum = (t.detach().double().cpu() for t in (out, ref, abs_sum))
    assert not out.isnan().any() and not ref.isnan().any(), f"{what}: NaN"
    scale = abs_sum.norm().item()
    err = (out - ref).norm().item() / (scale if scale > 0 else 1.0)
    assert err <= TOLERANCE[dtype], f"{what}: error {err:.3e} of the absolute sums > {TOLERANCE[dtype]:.0e} ({dtype})"


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
