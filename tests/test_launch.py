"""trainops.launch.launcher: the compiled kernel launched directly gives the JIT path's results for
every argument specialisation (pointer alignment, integers equal to 1 / divisible by 16 / past 32
bits, None, bool), and falls back to the JIT where it must."""

import pytest
import torch

from trainops.launch import launcher
from trainops.registry import triton_available

from conftest import HAS_CUDA

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _affine(X, Y, B, n, k, offset, flag, BLOCK: tl.constexpr, HAS_B: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(X + i, mask=m, other=0.0)
        y = x * k + (i % k).to(tl.float32) + offset
        if HAS_B:
            y += tl.load(B + i, mask=m, other=0.0)
        if flag:
            y = -y
        tl.store(Y + i, y, mask=m)


def _reference(x, b, k, offset, flag):
    i = torch.arange(x.numel(), device=x.device)
    y = x.double() * k + (i % k).double() + offset
    if b is not None:
        y = y + b.double()
    return (-y if flag else y).float()


def _check(device):
    launch = launcher(_affine, (4,), BLOCK=64, HAS_B=True)
    launch_no_b = launcher(_affine, (4,), BLOCK=64, HAS_B=False)
    # small integers and halves: every sum and product is exact, so any rounding order gives the same bits
    base = torch.randint(-50, 50, (300,), device=device).float()
    bias = torch.randint(-50, 50, (300,), device=device).float() / 2
    # the same launcher across specialisations: 16-byte aligned or not, k == 1, % 16 == 0 or neither, flag
    for start, k, offset, flag in [(0, 16, 0.5, False), (1, 16, 0.5, False), (0, 1, 2.0, True), (3, 7, -1.0, True),
                                   (0, 16, 0.5, False), (1, 7, 0.0, False), (2, 1, 1.0, False), (0, 7, 0.0, True)]:
        x, b = base[start:start + 256], bias[start:start + 256]
        y = torch.full((256 + start,), float("nan"), device=device)[start:]
        launch(x, y, b, 256, k, offset, flag)
        assert torch.equal(y, _reference(x, b, k, offset, flag)), (start, k, offset, flag)
        y2 = torch.full((256,), float("nan"), device=device)
        launch_no_b(x, y2, None, 256, k, offset, flag)  # None: a constexpr-specialised argument
        assert torch.equal(y2, _reference(x, None, k, offset, flag)), (start, k, "no bias")
    return launch


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_launcher_matches_the_jit_path_here():
    """Under the interpreter (CI) the launcher is the JIT path; on a GPU machine, the direct one."""
    _check("cuda" if HAS_CUDA else "cpu")


@pytest.mark.gpu
def test_direct_launch_caches_one_kernel_per_specialisation():
    launch = _check("cuda")
    keys = list(launch.compiled)
    assert len(keys) >= 4, keys  # aligned / unaligned pointers, k == 1 / % 16 / neither, flag
    # another specialisation after many cached ones, still right
    x = torch.randint(-50, 50, (64,), device="cuda").float()
    y = torch.empty(64, device="cuda")
    launch(x, y, x, 64, 3, 0.0, False)
    assert torch.equal(y, _reference(x, x, 3, 0.0, False))


def _check_trailing(device):
    """Arguments bound once (``trailing``): one launcher per (k, offset, flag), the tensors per call."""
    base = torch.randint(-50, 50, (300,), device=device).float()
    bias = torch.randint(-50, 50, (300,), device=device).float() / 2
    launchers = []
    for n, k, offset, flag in [(256, 16, 0.5, False), (256, 1, 2.0, True), (200, 7, -1.0, True)]:
        launch = launcher(_affine, (4,), trailing=(n, k, offset, flag), BLOCK=64, HAS_B=True)
        for start in (0, 1, 0, 3):  # aligned and unaligned pointers through one launcher
            x, b = base[start:start + 256], bias[start:start + 256]
            y = torch.full((256,), float("nan"), device=device)
            launch(x, y, b)
            want = _reference(x[:n], b[:n], k, offset, flag)
            assert torch.equal(y[:n], want), (n, k, start)
            assert torch.isnan(y[n:]).all(), "wrote past n"
        launchers.append(launch)
    return launchers


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_trailing_arguments_are_bound_once():
    _check_trailing("cuda" if HAS_CUDA else "cpu")


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_trailing_arguments_must_be_numbers():
    with pytest.raises(TypeError, match="trailing"):
        launcher(_affine, (4,), trailing=(torch.zeros(1),), BLOCK=64, HAS_B=True)


@pytest.mark.gpu
def test_direct_launch_with_trailing_keys_only_the_call_arguments():
    for launch in _check_trailing("cuda"):
        keys = list(launch.compiled)
        assert 1 <= len(keys) <= 2, keys  # aligned and unaligned x / b pointers
        # the three tensors of the call; no integer keyed (all four scalars are bound)
        assert all(len(key[1]) == 3 and key[3] == () for key in keys), keys
