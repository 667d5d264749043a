"""The convolution registry: conv2d and its backward against float64 torch on every backend (torch's
kernels on the CPU, Triton's depthwise kernels under the interpreter); geometries (kernel sizes,
strides, padding, dilation, groups), layouts, plans forced to split the weight gradient, masks
(frozen weights, inputs without a gradient), empty batches, determinism, the backend choice and
what the registry reports, the module and patch, gradcheck, torch.compile, errors."""

import pytest
import torch
import torch.nn.functional as torch_F

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import convolution as conv_ops
from trainops.ops.convolution import ConvHeuristics
from trainops.plan import clear_plan_cache

from numerics import FLOATS, assert_close, assert_sum_close, poison_new_output, stable_seed

# tiny tiles and many programs: several position and channel blocks, the weight gradient's
# positions split among programs (partials added by column_sum), steps that do not divide them
SPLIT = ConvHeuristics(block_positions=16, block_channels=4, programs_per_sm=8, reduce_block=4, reduce_parts=2)
PLANS = {"default": ConvHeuristics(), "split": SPLIT}

# (x shape, kernel (KH, KW), stride, padding, dilation): 3x3 and 1x1, 5x3 / 7x7, strided, dilated,
# padding beyond the dilated kernel's reach, odd sizes
GEOMETRIES = [((2, 6, 9, 8), (3, 3), 1, 1, 1), ((2, 6, 9, 8), (3, 3), 2, 1, 1), ((1, 4, 7, 10), (5, 3), (2, 1), (2, 1), 1),
              ((3, 5, 8, 8), (3, 3), 1, 2, 2), ((2, 3, 11, 6), (7, 7), 2, (3, 4), (1, 2)), ((2, 4, 5, 5), (1, 1), 1, 0, 1),
              ((1, 2, 4, 4), (3, 3), 3, 4, 1)]
# the split plan on the cases that reach its splits and channel blocks (CI time): strided 3x3, 5x3
# with stride and padding per axis, dilated 7x7
PLAN_GEOMETRIES = {"default": GEOMETRIES, "split": [GEOMETRIES[1], GEOMETRIES[2], GEOMETRIES[4]]}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN, so an element left unwritten fails the test."""
    poison_new_output(monkeypatch, conv_ops.Conv2dProblem)
    clear_plan_cache()
    yield
    clear_plan_cache()


def _randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def _run(x, w, b, dy, **geometry):
    """(y, dx, dweight, dbias) of trainops.conv2d for the leaves that need a gradient."""
    x, w = x.detach().clone().requires_grad_(x.requires_grad), w.detach().clone().requires_grad_(w.requires_grad)
    b = None if b is None else b.detach().clone().requires_grad_(b.requires_grad)
    y = trainops.conv2d(x, w, b, **geometry)
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(y, leaves, dy) if leaves else ()
    return y, grads


def _check(x, w, b, dy, y, grads, dtype, what, **geometry):
    """y and each gradient against float64 torch on the CPU, each held to the same sums of absolute
    values (the convolution of |x| and |w|, and so on: assert_sum_close), since each output element
    is a sum of products (a weight gradient's over N x OH x OW of them)."""
    def ref(xx, ww, bb, dd):
        xr = xx.detach().double().cpu().requires_grad_()
        wr = ww.detach().double().cpu().requires_grad_()
        br = None if bb is None else bb.detach().double().cpu().requires_grad_()
        yr = torch_F.conv2d(xr, wr, br, **geometry)
        leaves = [r for r, t in ((xr, x), (wr, w), (br, b)) if t is not None and t.requires_grad]
        return yr, (torch.autograd.grad(yr, leaves, dd.double().cpu()) if leaves else ())
    yr, gr = ref(x, w, b, dy)
    ya, ga = ref(x.abs(), w.abs(), None if b is None else b.abs(), dy.abs())
    assert y.dtype == dtype and y.shape == yr.shape
    assert_sum_close(y, yr, ya, dtype, f"{what} y")
    for i, (g, r, a) in enumerate(zip(grads, gr, ga)):
        assert g.dtype == dtype and g.shape == r.shape
        assert_sum_close(g, r, a, dtype, f"{what} grad {i}")


def _case(shape, kernel, groups, dtype, device, gen, bias=True, channels_last=False):
    n, c, h, w_ = shape
    out_channels = c if groups == c else 2 * c
    x = _randn(shape, dtype, device, gen).requires_grad_()
    if channels_last:
        x = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    w = _randn((out_channels, c // groups) + tuple(kernel), dtype, device, gen).requires_grad_()
    b = _randn((out_channels,), dtype, device, gen).requires_grad_() if bias else None
    return x, w, b


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_depthwise_matches_float64(backend, device, plan, channels_last):
    gen = torch.Generator().manual_seed(stable_seed("depthwise", plan, channels_last))
    with trainops.heuristics(PLANS[plan]):
        for shape, kernel, stride, padding, dilation in PLAN_GEOMETRIES[plan]:
            geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=shape[1])
            x, w, b = _case(shape, kernel, shape[1], torch.float32, device, gen, channels_last=channels_last)
            y = trainops.conv2d(x, w, b, **geometry)
            dy = _randn(y.shape, torch.float32, device, gen)
            y, grads = _run(x, w, b, dy, **geometry)
            _check(x, w, b, dy, y, grads, torch.float32, f"{shape} {kernel} s{stride} p{padding} d{dilation}", **geometry)
            assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
            assert grads[0].stride() == x.stride()


@pytest.mark.parametrize("dtype", FLOATS)
def test_dtypes(backend, device, dtype):
    gen = torch.Generator().manual_seed(stable_seed("dtypes", str(dtype)))
    shape, kernel, stride, padding, dilation = GEOMETRIES[1]
    geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=shape[1])
    x, w, b = _case(shape, kernel, shape[1], dtype, device, gen)
    dy = _randn(trainops.conv2d(x, w, b, **geometry).shape, dtype, device, gen)
    y, grads = _run(x, w, b, dy, **geometry)
    _check(x, w, b, dy, y, grads, dtype, str(dtype), **geometry)


@pytest.mark.parametrize("groups", [1, 2])
def test_dense_and_grouped(backend, device, groups):
    """Convolutions other than depthwise: torch's kernels; the Triton backend refuses them by name."""
    gen = torch.Generator().manual_seed(stable_seed("grouped", groups))
    x, w, b = _case((2, 4, 7, 6), (3, 3), groups, torch.float32, device, gen)
    geometry = dict(stride=(1, 2), padding=1, dilation=1, groups=groups)
    if backend == "triton":
        with pytest.raises(UnsupportedError, match="depthwise"):
            trainops.conv2d(x, w, b, **geometry)
        return
    dy = _randn(trainops.conv2d(x, w, b, **geometry).shape, torch.float32, device, gen)
    y, grads = _run(x, w, b, dy, **geometry)
    _check(x, w, b, dy, y, grads, torch.float32, f"groups {groups}", **geometry)


def test_masks_frozen_weight_and_input_without_gradient(backend, device):
    """Only the gradients autograd asks for are made (the backward's mask), each right."""
    gen = torch.Generator().manual_seed(3)
    geometry = dict(stride=1, padding=1, groups=4)
    for x_grad, w_grad, bias in ((True, False, True), (False, True, True), (False, False, True), (True, True, False),
                                 (False, True, False)):
        x, w, b = _case((2, 4, 5, 6), (3, 3), 4, torch.float32, device, gen, bias=bias)
        x.requires_grad_(x_grad)
        w.requires_grad_(w_grad)
        dy = _randn((2, 4, 5, 6), torch.float32, device, gen)
        y, grads = _run(x, w, b, dy, **geometry)
        assert len(grads) == x_grad + w_grad + bias
        _check(x, w, b, dy, y, grads, torch.float32, f"mask {x_grad, w_grad, bias}", **geometry)


def test_layouts_read_or_copied(backend, device):
    """A non-dense input (a slice) is copied to a contiguous one; an unbatched input works."""
    gen = torch.Generator().manual_seed(4)
    wide = _randn((2, 3, 6, 14), torch.float32, device, gen)
    x = wide[..., ::2].requires_grad_()
    w = _randn((3, 1, 3, 3), torch.float32, device, gen).requires_grad_()
    dy = _randn((2, 3, 6, 7), torch.float32, device, gen)
    y, grads = _run(x, w, None, dy, padding=1, groups=3)
    _check(x, w, None, dy, y, grads, torch.float32, "sliced", padding=1, groups=3)
    single = _randn((3, 5, 5), torch.float32, device, gen)
    y = trainops.conv2d(single, w, None, padding=1, groups=3)
    assert y.shape == (3, 5, 5)
    assert torch.allclose(y, torch_F.conv2d(single, w, None, padding=1, groups=3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel,dilation", [((4, 4), 1), ((3, 2), (1, 3)), ((3, 3), 2)])
def test_padding_same_and_valid(backend, device, kernel, dilation):
    """'same' (an odd total padding puts the extra row / column at the bottom / right, as torch's)
    and 'valid', values and gradients."""
    gen = torch.Generator().manual_seed(stable_seed("same", kernel, dilation))
    x, w, _ = _case((2, 3, 7, 6), kernel, 3, torch.float64, device, gen, bias=False)
    for padding in ("same", "valid"):
        y = trainops.conv2d(x, w, None, padding=padding, dilation=dilation, groups=3)
        ref = torch_F.conv2d(x.detach().cpu(), w.detach().cpu(), None, padding=padding, dilation=dilation, groups=3)
        assert y.shape == ref.shape and torch.allclose(y.cpu(), ref, rtol=1e-12, atol=1e-12), padding
        dy = _randn(y.shape, torch.float64, device, gen)
        ours = torch.autograd.grad(y, (x, w), dy)
        xr, wr = x.detach().cpu().requires_grad_(), w.detach().cpu().requires_grad_()
        theirs = torch.autograd.grad(torch_F.conv2d(xr, wr, None, padding=padding, dilation=dilation, groups=3),
                                     (xr, wr), dy.cpu())
        for a, r in zip(ours, theirs):
            assert torch.allclose(a.cpu(), r, rtol=1e-12, atol=1e-12), padding


def test_memory_formats_follow_torch(backend, device):
    """y and dx channels-last when x or the weight is, dweight in the weight's format, as torch's
    convolution gives them (torch.compile's fakes declare the same)."""
    gen = torch.Generator().manual_seed(12)
    for x_cl, w_cl in ((True, False), (False, True), (True, True), (False, False)):
        x, w, b = _case((2, 4, 5, 6), (3, 3), 4, torch.float32, device, gen, channels_last=x_cl)
        if w_cl:
            w = w.detach().to(memory_format=torch.channels_last).requires_grad_()
        y, (dx, dw, db) = _run(x, w, b, _randn((2, 4, 5, 6), torch.float32, device, gen), padding=1, groups=4)
        xr, wr = x.detach().cpu().requires_grad_(), w.detach().cpu().requires_grad_()
        yr = torch_F.conv2d(xr, wr, None, padding=1, groups=4)
        dxr, dwr = torch.autograd.grad(yr, (xr, wr), torch.ones_like(yr))
        cl = x_cl or w_cl
        y_format, w_format = (torch.channels_last if f else torch.contiguous_format for f in (cl, w_cl))
        assert y.stride() == yr.stride() == dx.stride() == dxr.stride(), (x_cl, w_cl)
        assert y.is_contiguous(memory_format=y_format) and dw.is_contiguous(memory_format=w_format), (x_cl, w_cl)


def test_memory_format_with_size_one_axes_follows_torch(backend, device):
    """Size-1 axes make a tensor both contiguous and channels-last, or give it strides of neither:
    the format is then torch's rule's (a width-1 channels-last tensor transposed is contiguous to
    torch)."""
    gen = torch.Generator().manual_seed(17)
    w = _randn((3, 1, 1, 3), torch.float32, device, gen)
    for x in (_randn((2, 3, 7, 1), torch.float32, device, gen).to(memory_format=torch.channels_last).transpose(2, 3),
              _randn((2, 3, 1, 7), torch.float32, device, gen).to(memory_format=torch.channels_last),
              _randn((1, 3, 4, 5), torch.float32, device, gen).to(memory_format=torch.channels_last)):
        y = trainops.conv2d(x, w, None, padding=(0, 1), groups=3)
        assert y.stride() == torch_F.conv2d(x.cpu(), w.cpu(), None, padding=(0, 1), groups=3).stride(), x.stride()


def test_strided_bias(backend, device):
    """A bias that is a view with a step is read as its values (copied to a dense one first)."""
    gen = torch.Generator().manual_seed(13)
    x, w, _ = _case((2, 4, 5, 6), (3, 3), 4, torch.float32, device, gen)
    b = _randn((8,), torch.float32, device, gen)[::2].requires_grad_()
    dy = _randn((2, 4, 5, 6), torch.float32, device, gen)
    y, grads = _run(x, w, b, dy, padding=1, groups=4)
    _check(x, w, b, dy, y, grads, torch.float32, "strided bias", padding=1, groups=4)


def test_plan_refuses_a_strided_bias(backend, device):
    """The plan API (which copies nothing) names a strided bias instead of reading it as dense."""
    x = torch.ones(1, 4, 5, 5, device=device)
    w = torch.ones(4, 1, 3, 3, device=device)
    plan = trainops.plan("conv2d", x_shape=x.shape, weight_shape=w.shape, dtype=torch.float32, device=device,
                         groups=4, bias=True)
    with pytest.raises(InvalidProblemError, match="bias"):
        plan.run(x, w, torch.ones(8, device=device)[::2])


def test_backward_on_another_thread_keeps_the_pinned_backend(backend, device):
    """Autograd runs a CUDA backward on its own thread, where the forward's pinned backend is not in
    force: the backward still runs on the forward's backend (here a thread of our own stands in,
    whose context starts empty as autograd's does)."""
    import threading

    x = torch.randn(1, 2, 4, 4, device=device, requires_grad=True)
    w = torch.randn(2, 1, 3, 3, device=device, requires_grad=True)
    y = trainops.conv2d(x, w, padding=1, groups=2)
    with trainops.track_kernels() as used:
        worker = threading.Thread(target=lambda: y.sum().backward())
        worker.start()
        worker.join()
    assert [k[:2] for k in used] == [("conv2d_backward", backend)]
    assert x.grad is not None and w.grad is not None


def test_double_backward_raises(backend, device):
    x = torch.randn(1, 2, 4, 4, device=device, requires_grad=True)
    w = torch.randn(2, 1, 3, 3, device=device, requires_grad=True)
    y = trainops.conv2d(x, w, padding=1, groups=2)
    with pytest.raises(UnsupportedError, match="double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_autocast(backend, device):
    """Under torch.autocast the convolution runs in autocast's dtype, as torch's does (a float32
    weight meeting a bf16 activation is cast, not refused)."""
    gen = torch.Generator().manual_seed(14)
    torch.manual_seed(14)
    ours = trainops.nn.Conv2d(4, 4, 3, padding=1, groups=4).to(device)
    ref = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4).to(device)
    ref.load_state_dict(ours.state_dict())
    x = _randn((2, 4, 6, 5), torch.float32, device, gen)
    with torch.autocast(device.type if isinstance(device, torch.device) else torch.device(device).type,
                        dtype=torch.bfloat16):
        y = ours(x)
        y2 = ours(y)                        # a bf16 activation into a float32 weight
        yr = ref(x)
    assert y.dtype == yr.dtype == torch.bfloat16 and y2.dtype == torch.bfloat16
    assert torch.allclose(y.float(), yr.float(), rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32


def test_empty_batch(backend, device):
    """N = 0: an empty output, and zero weight and bias gradients (sums of nothing), as torch's."""
    x = torch.empty(0, 3, 5, 5, device=device, requires_grad=True)
    w = torch.ones(3, 1, 3, 3, device=device, requires_grad=True)
    b = torch.ones(3, device=device, requires_grad=True)
    y = trainops.conv2d(x, w, b, padding=1, groups=3)
    assert y.shape == (0, 3, 5, 5)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), torch.empty_like(y))
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


def test_deterministic_weight_gradient(backend, device):
    gen = torch.Generator().manual_seed(5)
    x, w, b = _case((2, 6, 7, 7), (3, 3), 6, torch.float32, device, gen)
    dy = _randn((2, 6, 7, 7), torch.float32, device, gen) * 1e3
    with trainops.heuristics(SPLIT):
        first = _run(x, w, b, dy, padding=1, groups=6)[1]
        again = _run(x, w, b, dy, padding=1, groups=6)[1]
    assert all(torch.equal(a, f) for a, f in zip(again, first))


# 1x1 tiles of the smallest size tl.dot takes and many programs: K in several steps, column blocks
# spanning two images, the weight gradient's positions split (partials added by column_sum)
POINTWISE_SMALL = ConvHeuristics(pointwise_tile=(16, 16, 16, 1, 1), programs_per_sm=8, reduce_block=4, reduce_parts=2)
# (x shape, output channels): odd sizes, W = 1 (the positions' stride is H's), H = 1, one image
POINTWISE_SHAPES = [((3, 20, 5, 7), 24), ((2, 33, 4, 1), 17), ((2, 5, 1, 9), 40), ((1, 48, 6, 6), 16)]


@pytest.mark.parametrize("plan", ["default", "small"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_pointwise_matches_float64(backend, device, plan, channels_last):
    """1x1 convolutions (the Triton backend's matmul kernels): y and every gradient, with and without
    bias, a dilation (unused by a 1x1 kernel), against float64; the registry names the kernels."""
    gen = torch.Generator().manual_seed(stable_seed("pointwise", plan, channels_last))
    with trainops.heuristics(POINTWISE_SMALL if plan == "small" else ConvHeuristics()), \
            trainops.track_kernels() as ran:
        for i, (shape, out_channels) in enumerate(POINTWISE_SHAPES):
            x = _randn(shape, torch.float32, device, gen)
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            x.requires_grad_()
            w = _randn((out_channels, shape[1], 1, 1), torch.float32, device, gen).requires_grad_()
            b = _randn((out_channels,), torch.float32, device, gen).requires_grad_() if i % 2 == 0 else None
            geometry = dict(dilation=2 if i == 1 else 1)
            dy = _randn((shape[0], out_channels) + shape[2:], torch.float32, device, gen)
            y, grads = _run(x, w, b, dy, **geometry)
            _check(x, w, b, dy, y, grads, torch.float32, f"{shape} -> {out_channels}", **geometry)
            assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    if backend == "triton":
        names = {kernel for (_, _, kernel, _) in ran}
        assert names == {"conv2d_pointwise_triton", "conv2d_backward_pointwise_triton"}, names


@pytest.mark.parametrize("dtype", FLOATS)
def test_pointwise_dtypes_and_masks(backend, device, dtype):
    """Every dtype (the Triton 1x1 kernels refuse float64 by name), and each gradient alone."""
    gen = torch.Generator().manual_seed(stable_seed("pointwise dtypes", str(dtype)))
    x = _randn((2, 24, 3, 5), dtype, device, gen).requires_grad_()
    w = _randn((20, 24, 1, 1), dtype, device, gen).requires_grad_()
    b = _randn((20,), dtype, device, gen).requires_grad_()
    if backend == "triton" and dtype == torch.float64:
        with pytest.raises(UnsupportedError, match="float64"):
            trainops.conv2d(x, w, b)
        return
    dy = _randn((2, 20, 3, 5), dtype, device, gen)
    y, grads = _run(x, w, b, dy)
    _check(x, w, b, dy, y, grads, dtype, str(dtype))
    with trainops.heuristics(POINTWISE_SMALL):
        for wanted in ((True, False, False), (False, True, False), (False, False, True)):
            leaves = [t.detach().clone().requires_grad_(need) for t, need in zip((x, w, b), wanted)]
            y = trainops.conv2d(*leaves)
            (g,) = torch.autograd.grad(y, [t for t in leaves if t.requires_grad], dy)
            full = grads[wanted.index(True)]
            assert_sum_close(g, full.double(), full.double().abs() + 1e-30, dtype, f"{wanted}")


def test_pointwise_empty_batch_and_deterministic(backend, device):
    """N = 0 (zero weight and bias gradients), and a weight gradient split among programs
    bit-identical run to run."""
    x = torch.empty(0, 3, 4, 4, device=device, requires_grad=True)
    w = torch.ones(5, 3, 1, 1, device=device, requires_grad=True)
    b = torch.ones(5, device=device, requires_grad=True)
    y = trainops.conv2d(x, w, b)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), torch.empty_like(y))
    assert y.shape == (0, 5, 4, 4) and torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))
    gen = torch.Generator().manual_seed(6)
    x = _randn((4, 40, 6, 6), torch.float32, device, gen).requires_grad_()
    w = _randn((24, 40, 1, 1), torch.float32, device, gen).requires_grad_()
    dy = _randn((4, 24, 6, 6), torch.float32, device, gen) * 1e3
    with trainops.heuristics(POINTWISE_SMALL):
        first = _run(x, w, None, dy)[1]
        again = _run(x, w, None, dy)[1]
    assert all(torch.equal(a, f) for a, f in zip(again, first))


@pytest.mark.parametrize("loss", ["sum_over_h", "sum_over_w", "transposed", "cat_on_w"])
def test_pointwise_gradients_of_any_strides(backend, device, loss):
    """The upstream gradient in the strides autograd hands over (an expand from y.sum(2), a transpose,
    a slice of a cat): the 1x1 kernels copy an operand whose positions do not walk as one axis."""
    gen = torch.Generator().manual_seed(stable_seed("pointwise strides", loss))
    x = _randn((2, 12, 5, 3), torch.float32, device, gen).requires_grad_()
    w = _randn((20, 12, 1, 1), torch.float32, device, gen).requires_grad_()
    r = _randn((2, 20, 5, 3), torch.float32, device, gen)

    def scalar(y):
        if loss == "sum_over_h":
            return (y.sum(2) * r[:, :, 0]).sum()
        if loss == "sum_over_w":
            return (y.sum(3) * r[..., 0]).sum()
        if loss == "transposed":   # dy = a contiguous tensor's transpose
            return (y.transpose(2, 3) * r.transpose(2, 3).contiguous()).sum()
        return (torch.cat([y, r], 3) * torch.cat([r, r], 3)).sum()
    grads = torch.autograd.grad(scalar(trainops.conv2d(x, w)), (x, w))
    x64, w64 = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    r = r.double().cpu()
    want = torch.autograd.grad(scalar(torch_F.conv2d(x64, w64)), (x64, w64))
    for got, ref, name in zip(grads, want, ("dx", "dweight")):
        assert_close(got, ref, torch.float32, f"{loss} {name}")


def test_pointwise_plan_reads_a_strided_x():
    """The plan API hands x over as given: a transposed x is copied where its positions do not walk
    as one axis (the depthwise kernels read every stride)."""
    if not trainops.registry.triton_available():
        pytest.skip("needs Triton")
    device = "cpu" if trainops.registry.triton_interpreting() else "cuda"
    gen = torch.Generator().manual_seed(8)
    x = _randn((2, 6, 3, 5), torch.float32, device, gen).transpose(2, 3)   # (2, 6, 5, 3), H stride 1
    w = _randn((4, 6, 1, 1), torch.float32, device, gen)
    with trainops.backend("triton"):
        y = trainops.plan("conv2d", x_shape=x.shape, weight_shape=w.shape, dtype=torch.float32, device=device).run(
            x, w, None)
    assert_close(y, torch_F.conv2d(x.double().cpu(), w.double().cpu()), torch.float32, "y")


def test_pointwise_heuristics_and_no_input_channel(backend, device):
    """pointwise_tile as a list works as its tuple; no input channel: y is the bias and the bias
    gradient is dy's sums (the CPU backend's torch kernels disagree on y's shape there: skipped)."""
    x = torch.ones(2, 3, 4, 4, device=device)
    w = torch.ones(5, 3, 1, 1, device=device)
    with trainops.heuristics(ConvHeuristics(pointwise_tile=[16, 16, 16, 1, 1])):
        assert torch.equal(trainops.conv2d(x, w), torch.full((2, 5, 4, 4), 3.0, device=device))
    with pytest.raises(InvalidProblemError, match="pointwise_tile"):
        trainops.plan("conv2d", x_shape=(2, 3, 4, 4), weight_shape=(5, 3, 1, 1), dtype=torch.float32, device=device,
                      heuristics=ConvHeuristics(pointwise_tile=(16, 16, 8, 1, 1)))
    if backend != "triton":
        return
    x0 = torch.empty(2, 0, 3, 3, device=device)
    b0 = torch.arange(4.0, device=device, requires_grad=True)
    y0 = trainops.conv2d(x0, torch.empty(4, 0, 1, 1, device=device), b0)
    assert torch.equal(y0, b0.detach().view(1, 4, 1, 1).expand(2, 4, 3, 3))
    (db,) = torch.autograd.grad(y0, b0, torch.ones_like(y0))
    assert torch.equal(db, torch.full((4,), 18.0, device=device))


def test_split_plan_splits():
    """The SPLIT plan splits the weight gradient's positions among programs on these tests' shapes."""
    for shape in ((2, 6, 7, 7), (2, 6, 9, 8)):
        problem = trainops.plan("conv2d_backward", x_shape=shape, weight_shape=(6, 1, 3, 3), dtype=torch.float32,
                                device="cpu", padding=1, groups=6, heuristics=SPLIT).problem
        assert conv_ops._weight_grad_splits(problem, *conv_ops._depthwise_tiles(problem))[0] > 1


def test_backend_choice_and_report():
    """On CUDA the registry picks cuDNN where the Triton kernels were not measured faster: the
    deterministic kernel under torch's deterministic switch, else cuDNN's own choice; a pinned
    backend wins. Planning needs no GPU."""
    desc = dict(x_shape=(8, 32, 56, 56), weight_shape=(32, 1, 3, 3), dtype=torch.float16, device="cuda", padding=1,
                groups=32)
    assert trainops.plan("conv2d", **desc, deterministic=False).kernel.name == "conv2d_cudnn_nondeterministic"
    assert trainops.plan("conv2d", **desc, deterministic=True).kernel.name == "conv2d_cudnn"
    assert trainops.plan("conv2d_backward", **desc, deterministic=True).info.backend == "cudnn"
    with trainops.backend("triton"):
        if trainops.registry.triton_available():
            assert trainops.plan("conv2d", **desc).kernel.name == "conv2d_depthwise_triton"
    with trainops.backend("cudnn"):
        with pytest.raises(UnsupportedError, match="cudnn"):
            trainops.plan("conv2d", **{**desc, "device": "cpu"})
    rows = [(k.op, k.backend, k.deterministic) for k in trainops.kernels() if k.op.startswith("conv2d")]
    assert ("conv2d", "cudnn", True) in rows and ("conv2d", "cudnn", False) in rows and ("conv2d", "cpu", True) in rows


@pytest.mark.skipif(not trainops.registry.triton_available(), reason="the choice needs the Triton backend")
def test_triton_chosen_where_measured_faster():
    """choose_backend follows the measured table (conv_ops.triton_beats_cudnn): bf16 and float32
    depthwise on contiguous x like the measured problems (square kernels up to 5 x 5, padding
    k // 2, strides 1 and 2, batches from 32); forward from 14 x 14 output positions (28 x 28 at
    stride 2); input and weight gradients from 56 x 56 input positions with at most 3 x 3 taps; the
    input gradient alone from 14 x 14; cuDNN for the rest (channels-last, float16, grouped, the
    weight gradient alone, more channel blocks than the grid takes)."""
    def kernel(op, x_shape, k=3, stride=1, dtype=torch.bfloat16, groups=None, padding=None, **extra):
        c = x_shape[1]
        groups = c if groups is None else groups
        desc = dict(x_shape=x_shape, weight_shape=(c, c // groups, k, k), dtype=dtype, device="cuda",
                    padding=k // 2 if padding is None else padding, stride=stride, groups=groups, deterministic=False,
                    **extra)
        return trainops.plan(op, **desc).info.backend

    mobilenet = (32, 144, 56, 56)
    assert kernel("conv2d", mobilenet) == "triton"
    assert kernel("conv2d_backward", mobilenet) == "triton"
    assert kernel("conv2d_backward", mobilenet, mask=(True, True, True)) == "triton"
    assert kernel("conv2d", (32, 960, 7, 7)) == "cudnn"                   # 7 x 7 outputs
    assert kernel("conv2d", (32, 576, 14, 14), stride=2) == "cudnn"       # 7 x 7 outputs
    assert kernel("conv2d", (32, 384, 14, 14)) == "triton"
    assert kernel("conv2d", (32, 240, 28, 28), k=5) == "triton"
    assert kernel("conv2d", (32, 96, 56, 56), k=7) == "cudnn"              # 7 x 7: not measured on contiguous x
    assert kernel("conv2d_backward", (32, 192, 28, 28)) == "cudnn"        # below 56 x 56
    assert kernel("conv2d_backward", (32, 144, 56, 56), k=5, stride=2) == "cudnn"   # 5 x 5 taps
    assert kernel("conv2d_backward", (32, 192, 28, 28), mask=(True, False, False)) == "triton"
    assert kernel("conv2d_backward", (32, 960, 7, 7), mask=(True, False, False)) == "cudnn"
    assert kernel("conv2d_backward", mobilenet, mask=(False, True, False)) == "cudnn"
    assert kernel("conv2d", mobilenet, channels_last=True) == "cudnn"
    assert kernel("conv2d", mobilenet, dtype=torch.float32) == "triton"
    assert kernel("conv2d_backward", mobilenet, dtype=torch.float32) == "triton"
    assert kernel("conv2d", mobilenet, dtype=torch.float16) == "cudnn"
    assert kernel("conv2d_backward", mobilenet, dtype=torch.float16) == "cudnn"
    assert kernel("conv2d", mobilenet, groups=72) == "cudnn"              # grouped, not depthwise
    assert kernel("conv2d", (32, 144, 56, 56), stride=2) == "triton"       # 28 x 28 outputs at stride 2
    assert kernel("conv2d", (32, 192, 28, 28), stride=2) == "cudnn"        # 14 x 14 outputs at stride 2
    assert kernel("conv2d", (32, 144, 56, 56), stride=3) == "cudnn"        # strides 1 and 2 measured
    assert kernel("conv2d", (16, 144, 56, 56)) == "cudnn"                  # batches from 32 measured
    assert kernel("conv2d", mobilenet, padding=0) == "cudnn"               # padding k // 2 measured
    assert kernel("conv2d", mobilenet, dilation=2, padding=2) == "cudnn"   # no dilation measured
    wide = (32, 16 * 65535 + 16, 14, 14)                                    # more channel blocks than the grid takes
    assert kernel("conv2d", wide) == "cudnn"
    with trainops.backend("triton"), pytest.raises(UnsupportedError, match="channel blocks"):
        kernel("conv2d", wide)
    with trainops.backend("cudnn"):
        assert kernel("conv2d", mobilenet) == "cudnn"
    # 1x1 convolutions: the Triton kernels were measured slower than cuDNN (never chosen)
    for dtype, channels_last in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)):
        for op in ("conv2d", "conv2d_backward"):
            desc = dict(x_shape=(32, 1024, 14, 14), weight_shape=(256, 1024, 1, 1), dtype=dtype, device="cuda",
                        channels_last=channels_last)
            assert trainops.plan(op, **desc).info.backend == "cudnn"


def test_registry_reports_the_kernels(backend, device):
    x = torch.ones(1, 2, 4, 4, device=device, requires_grad=True)
    w = torch.ones(2, 1, 3, 3, device=device, requires_grad=True)
    with trainops.track_kernels() as used:
        trainops.conv2d(x, w, padding=1, groups=2).sum().backward()
    suffix = "depthwise_triton" if backend == "triton" else "cpu"
    assert sorted(k[:3] for k in used) == [("conv2d", backend, f"conv2d_{suffix}"),
                                           ("conv2d_backward", backend, f"conv2d_backward_{suffix}")]


def test_gradcheck(backend, device):
    gen = torch.Generator().manual_seed(6)
    x, w, b = _case((1, 2, 4, 3), (3, 2), 2, torch.float64, device, gen)
    assert torch.autograd.gradcheck(lambda *t: trainops.conv2d(*t, stride=(2, 1), padding=1, groups=2), (x, w, b))


def test_compile_channels_last_model(backend, device):
    """The usual recipe: a patched model moved to channels-last, compiled, trained: the fakes declare
    the formats the kernels return."""
    torch.manual_seed(15)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1, groups=4), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)).to(device)
    reference = torch.nn.Sequential(*(m for m in [torch.nn.Conv2d(4, 4, 3, padding=1, groups=4), torch.nn.ReLU(),
                                                  torch.nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)])).to(device)
    reference.load_state_dict(model.state_dict())
    trainops.patch(model, convolution=True)
    model, reference = (m.to(memory_format=torch.channels_last) for m in (model, reference))
    x = torch.randn(2, 4, 6, 6, device=device).to(memory_format=torch.channels_last)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    compiled(x).square().sum().backward()
    reference(x).square().sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(ours.grad, theirs.grad, rtol=1e-4, atol=1e-4)


def test_fakes_match_the_kernels_in_every_format(backend, device):
    """opcheck (schema, fake tensors against the real outputs' shapes and strides) of both ops with
    channels-last inputs and weights, depthwise (every backend) and dense (torch's kernels)."""
    gen = torch.Generator().manual_seed(16)
    groups_cases = (3,) if backend == "triton" else (3, 1)
    for groups in groups_cases:
        for x_cl, w_cl in ((True, False), (False, True), (True, True)):
            x = _randn((2, 3, 5, 4), torch.float32, device, gen)
            w = _randn((3, 3 // groups, 3, 3), torch.float32, device, gen)
            x = x.to(memory_format=torch.channels_last) if x_cl else x
            w = w.to(memory_format=torch.channels_last) if w_cl else w
            args = (x, w, None, [1, 1], [1, 1], [1, 1], groups)
            torch.library.opcheck(torch.ops.trainops.conv2d.default, args, test_utils=("test_schema", "test_faketensor"))
            dy = torch.ops.trainops.conv2d.default(*args)
            torch.library.opcheck(torch.ops.trainops.conv2d_backward.default,
                                  (dy, x, w, [1, 1], [1, 1], [1, 1], groups, [True, True, False]),
                                  test_utils=("test_schema", "test_faketensor"))


def test_compile_fullgraph(backend, device):
    gen = torch.Generator().manual_seed(7)
    x, w, b = _case((2, 3, 6, 6), (3, 3), 3, torch.float32, device, gen)

    def f(x, w, b):
        return torch.relu(trainops.conv2d(x * 2.0, w, b, padding=1, groups=3))

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    y = compiled(x, w, b)
    dy = _randn(y.shape, torch.float32, device, gen)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    xr, wr, br = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    yr = torch.relu(torch_F.conv2d(xr * 2.0, wr, br, padding=1, groups=3))
    ref = torch.autograd.grad(yr, (xr, wr, br), dy.double().cpu())
    assert torch.allclose(y.double().cpu(), yr, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref):
        assert torch.allclose(g.double().cpu(), r, rtol=1e-4, atol=1e-4)


def test_module_and_patch(backend, device):
    """trainops.nn.Conv2d is torch's module (state dict, padding modes) on the registry; patch swaps
    Conv2d only when asked."""
    torch.manual_seed(8)
    for mode in ("zeros", "reflect", "circular"):
        ref = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4, padding_mode=mode).to(device)
        ours = trainops.nn.Conv2d(4, 4, 3, padding=1, groups=4, padding_mode=mode).to(device)
        ours.load_state_dict(ref.state_dict())
        assert ours.state_dict().keys() == ref.state_dict().keys()
        x = torch.randn(2, 4, 6, 5, device=device)
        assert torch.allclose(ours(x), ref(x), rtol=1e-5, atol=1e-5), mode
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, groups=3), torch.nn.ReLU())
    assert not any("Conv2d" in row[1] for row in trainops.patch(model).swapped)
    report = trainops.patch(model, convolution=True)
    assert [row[1:] for row in report.swapped] == [("torch.nn.Conv2d", "trainops.nn.Conv2d")]
    assert type(model[0]) is trainops.nn.Conv2d
    with pytest.raises(InvalidProblemError, match="convolution"):
        trainops.patch(model, convolution="yes")


def test_errors(backend, device):
    x = torch.ones(2, 4, 5, 5, device=device)
    w = torch.ones(4, 1, 3, 3, device=device)
    cases = [(dict(weight=torch.ones(4, 2, 3, 3, device=device), groups=4), InvalidProblemError, "weight_shape"),
             (dict(groups=3), InvalidProblemError, "groups"),
             (dict(weight=torch.ones(4, 1, 9, 9, device=device), groups=4), InvalidProblemError, "kernel"),
             (dict(groups=4, stride=0), InvalidProblemError, "stride"),
             (dict(groups=4, padding=-1), InvalidProblemError, "padding"),
             (dict(groups=4, padding="full"), InvalidProblemError, "padding"),
             (dict(groups=4, padding="same", stride=2), InvalidProblemError, "padding"),
             (dict(groups=4, dilation=(1, 2, 3)), InvalidProblemError, "dilation"),
             (dict(weight=torch.ones(4, 1, 3, 3, dtype=torch.float64, device=device), groups=4), InvalidProblemError,
              "weight"),
             (dict(bias=torch.ones(3, device=device), groups=4), InvalidProblemError, "bias"),
             (dict(input=torch.ones(4, 5, 5, 5, 5, device=device), groups=4), InvalidProblemError, "input"),
             (dict(input=torch.ones(2, 4, 5, 5, dtype=torch.int32, device=device), groups=4), UnsupportedError, "input")]
    for bad in (ConvHeuristics(block_positions=12), ConvHeuristics(reduce_block=48), ConvHeuristics(programs_per_sm=0),
                ConvHeuristics(reduce_parts=3), ConvHeuristics(warps=64)):
        with trainops.heuristics(bad), pytest.raises(InvalidProblemError, match="heuristics"):
            trainops.conv2d(x, w, None, groups=4)
    for overrides, error, says in cases:
        args = dict(input=x, weight=w, bias=None, stride=1, padding=0, dilation=1, groups=1, **{})
        args.update(overrides)
        with pytest.raises(error, match=says):
            trainops.conv2d(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_real_sizes(dtype):
    """MobileNet / ConvNeXt depthwise layers at training sizes on each backend, and a ResNet 3x3
    on cuDNN, against float64 (TF32 off for the float32 cuDNN rows)."""
    gen = torch.Generator().manual_seed(9)
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        for shape, kernel, stride, groups, channels_last in [((32, 144, 56, 56), (3, 3), 1, 144, True),
                                                             ((32, 240, 28, 28), (5, 5), 2, 240, True),
                                                             ((16, 384, 28, 28), (7, 7), 1, 384, False),
                                                             ((32, 64, 56, 56), (3, 3), 1, 1, True)]:
            for backend in (("cudnn", "triton") if groups == shape[1] else ("cudnn",)):
                x, w, b = _case(shape, kernel, groups, dtype, "cuda", gen, channels_last=channels_last)
                geometry = dict(stride=stride, padding=kernel[0] // 2, groups=groups)
                with trainops.backend(backend):
                    y = trainops.conv2d(x, w, b, **geometry)
                    dy = _randn(y.shape, dtype, "cuda", gen)
                    y, grads = _run(x, w, b, dy, **geometry)
                _check(x, w, b, dy, y, grads, dtype, f"{backend} {shape} {kernel}", **geometry)
    finally:
        torch.backends.cudnn.allow_tf32 = previous
