"""Batch normalization: forward (training and eval, running statistics) and backward, every backend,
against torch's batch_norm in float64; layouts (channels-last, strided, copied views); plans forced
on small shapes; numerical stability; determinism; errors; modules; gradcheck; torch.compile."""

import pytest
import torch
import torch.nn.functional as torch_F

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import batch_norm as bn_ops
from trainops.ops.batch_norm import BatchNormHeuristics
from trainops.plan import clear_plan_cache

from numerics import FLOATS, assert_close, assert_sum_close, poison_new_output, stable_seed

# small tiles and many reduction programs: partials of several programs (some with no tile) merged,
# several channel blocks, spatial blocks that do not divide the spatial size
SMALL = BatchNormHeuristics(tile=16, channel_block=2, spatial_block=4, programs_per_sm=16)
PLANS = {"default": BatchNormHeuristics(), "small": SMALL}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN, so an element left unwritten fails the test."""
    poison_new_output(monkeypatch, bn_ops.BatchNormProblem)
    clear_plan_cache()
    yield
    clear_plan_cache()


def make_input(shape, layout, dtype, device, gen, scale=2.0, offset=0.5):
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + offset).to(dtype)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    elif layout == "strided":  # the last spatial axis with stride 2 (walked in place)
        wide = torch.randn(tuple(shape[:-1]) + (2 * shape[-1],), generator=gen, dtype=torch.float64)
        x = (wide * scale + offset).to(dtype)[..., ::2]
    elif layout == "copied":  # spatial axes swapped: they do not walk as one axis (copied first)
        x = (torch.randn(shape[:2] + (shape[3], shape[2]), generator=gen, dtype=torch.float64) * scale
             + offset).to(dtype).transpose(2, 3)
    return x.to(device)


def _params(channels, device, gen, dtype=torch.float32):
    w = (torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5).to(dtype).to(device)
    b = torch.randn(channels, generator=gen, dtype=torch.float64).to(dtype).to(device)
    rm = torch.randn(channels, generator=gen, dtype=torch.float64).to(torch.float32).to(device)
    rv = (torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5).to(torch.float32).to(device)
    return w, b, rm, rv


def _run_both(x, w, b, rm, rv, training, momentum=0.1, eps=1e-5, dy=None):
    """(ours, reference): y, running mean, running var and the gradients of x, w, b; the
    reference is torch's batch_norm on float64 copies of the same values."""
    xs = x.detach().clone().requires_grad_()
    ws = None if w is None else w.detach().clone().requires_grad_()
    bs = None if b is None else b.detach().clone().requires_grad_()
    rms, rvs = (None, None) if rm is None else (rm.clone(), rv.clone())
    y = trainops.batch_norm(xs, rms, rvs, ws, bs, training, momentum, eps)
    if dy is None:
        dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).to(y.dtype).to(y.device)
    leaves = [t for t in (xs, ws, bs) if t is not None]
    grads = torch.autograd.grad(y, leaves, dy)

    # the reference on the CPU: torch's CUDA float64 backward without a weight or running
    # statistics raised "tensor does not have a device" on the H100 (torch 2.11)
    xr = x.detach().double().cpu().requires_grad_()
    wr = None if w is None else w.detach().double().cpu().requires_grad_()
    br = None if b is None else b.detach().double().cpu().requires_grad_()
    rmr, rvr = (None, None) if rm is None else (rm.double().cpu(), rv.double().cpu())
    yr = torch_F.batch_norm(xr, rmr, rvr, wr, br, training, momentum, eps)
    ref_leaves = [t for t in (xr, wr, br) if t is not None]
    ref_grads = torch.autograd.grad(yr, ref_leaves, dy.double().cpu())
    # sum(|dy * xh|) and sum(|dy|) per channel: the scale of dweight's and dbias's float32 rounding
    xh = torch_F.batch_norm(xr.detach(), None if rmr is None else rmr.clone(), None if rvr is None else rvr.clone(),
                            None, None, training or rm is None, 0.0, eps)
    dims = [d for d in range(x.dim()) if d != 1]
    sum_scales = [(name, scale) for name, t, scale in (("dweight", w, (dy.double().cpu() * xh).abs().sum(dims)),
                                                         ("dbias", b, dy.double().cpu().abs().sum(dims)))
                  if t is not None]   # in the order of the parameters' gradients
    return (y, rms, rvs, grads), (yr, rmr, rvr, ref_grads, sum_scales)


def _compare(ours, ref, dtype):
    (y, rm, rv, grads), (yr, rmr, rvr, ref_grads, sum_scales) = ours, ref
    assert_close(y, yr, dtype, "y")
    if rm is not None:
        assert_close(rm, rmr, torch.float32, "running_mean")
        assert_close(rv, rvr, torch.float32, "running_var")
    assert_close(grads[0], ref_grads[0], dtype, "dx")
    # dweight and dbias: per-channel sums over N * spatial terms, held to their terms' absolute sums
    # (one channel of 45 terms summing near 0 failed the plain relative norm at 2.7e-5 in float32);
    # the parameters are in x's dtype in these tests
    assert len(grads) == len(ref_grads) == 1 + len(sum_scales)
    for g, gr, (name, scale) in zip(grads[1:], ref_grads[1:], sum_scales):
        assert_sum_close(g, gr, scale, dtype, name)


CASES = [((4, 3, 5, 6), "contiguous"), ((4, 3, 5, 6), "channels_last"), ((2, 3, 2, 3, 4), "channels_last"),
         ((8, 5), "contiguous"), ((3, 4, 7), "contiguous"), ((2, 3, 4, 6), "strided"), ((2, 3, 4, 5), "copied"),
         ((1, 3, 4, 5), "contiguous"), ((5, 1, 3, 3), "contiguous")]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape,layout", CASES)
def test_matches_torch(backend, device, shape, layout, training):
    gen = torch.Generator().manual_seed(stable_seed(shape, layout))
    x = make_input(shape, layout, torch.float32, device, gen)
    w, b, rm, rv = _params(shape[1], device, gen)
    ours, ref = _run_both(x, w, b, rm, rv, training)
    _compare(ours, ref, torch.float32)
    # y and dx keep x's memory format where x is dense (channels-last stays channels-last)
    y = ours[0]
    if layout in ("contiguous", "channels_last"):
        assert y.stride() == x.stride() and ours[3][0].stride() == x.stride()


@pytest.mark.parametrize("dtype", sorted(FLOATS, key=str))
@pytest.mark.parametrize("plan", PLANS)
def test_dtypes_and_plans(backend, device, dtype, plan):
    gen = torch.Generator().manual_seed(3)
    for shape, layout in (((4, 6, 5, 7), "contiguous"), ((3, 5, 4, 6), "channels_last"), ((37, 9), "contiguous")):
        x = make_input(shape, layout, dtype, device, gen)
        w, b, rm, rv = _params(shape[1], device, gen, dtype)
        with trainops.heuristics(PLANS[plan]):
            ours, ref = _run_both(x, w, b, rm, rv, True)
        _compare(ours, ref, dtype)
        assert ours[0].dtype == dtype and ours[3][1].dtype == dtype  # y in x's dtype, dweight in weight's


def test_statistics_stay_accurate_for_a_large_mean(backend, device):
    """float32 values of mean 1e4 and spread 1: a float32 sum of squares would lose every digit of
    the variance (x^2 ~ 1e8, whose float32 spacing is 8); the tile-by-tile combination keeps it.
    The variance (running_var) is checked against float64; y and dx carry the float32 mean's own
    rounding (spacing 1e-3 at 1e4), so they are held to torch's float32 result's error instead."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 4, 8, 8, generator=gen, dtype=torch.float64) + 1e4).float().to(device)
    w, b, rm, rv = _params(4, device, gen)
    with trainops.heuristics(SMALL):
        (y, rm_out, rv_out, grads), (yr, rmr, rvr, ref_grads, _) = _run_both(x, w, b, rm, rv, True)
    assert_close(rv_out, rvr, torch.float32, "running_var")
    assert_close(rm_out, rmr, torch.float32, "running_mean")
    y32 = torch_F.batch_norm(x.cpu(), rm.cpu().clone(), rv.cpu().clone(), w.cpu(), b.cpu(), True)
    torch_error = ((y32.double() - yr).norm() / yr.norm()).item()
    our_error = ((y.double().cpu() - yr).norm() / yr.norm()).item()
    assert our_error <= 2 * torch_error + 1e-6, (our_error, torch_error)


def test_affine_and_running_statistics_optional(backend, device):
    gen = torch.Generator().manual_seed(1)
    x = make_input((4, 3, 5, 5), "contiguous", torch.float32, device, gen)
    w, b, rm, rv = _params(3, device, gen)
    for weight, bias, stats in ((None, None, True), (w, None, True), (None, b, False), (w, b, False)):
        ours, ref = _run_both(x, weight, bias, rm if stats else None, rv if stats else None, True)
        _compare(ours, ref, torch.float32)
    # eval without affine
    ours, ref = _run_both(x, None, None, rm, rv, False)
    _compare(ours, ref, torch.float32)


def test_frozen_parameters_get_no_gradient_and_the_rest_is_right(backend, device):
    gen = torch.Generator().manual_seed(2)
    x = make_input((4, 3, 5, 5), "channels_last", torch.float32, device, gen).requires_grad_()
    w, b, rm, rv = _params(3, device, gen)
    w.requires_grad_()
    y = trainops.batch_norm(x, rm.clone(), rv.clone(), w, b, True)   # b frozen
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = torch_F.batch_norm(xr, rm.double(), rv.double(), wr, b.double(), True)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy.double())
    assert_close(dx, dxr, torch.float32, "dx")
    assert_close(dw, dwr, torch.float32, "dweight")
    # only the weight needs a gradient (x frozen): dweight alone
    y = trainops.batch_norm(x.detach(), None, None, w, b, True)
    (dw2,) = torch.autograd.grad(y, (w,), dy)
    assert_close(dw2, dwr, torch.float32, "dweight without dx")


def test_bit_identical_run_to_run(backend, device):
    gen = torch.Generator().manual_seed(4)
    x = make_input((6, 5, 7, 9), "contiguous", torch.float32, device, gen)
    w, b, rm, rv = _params(5, device, gen)
    with trainops.heuristics(SMALL):
        first = _run_both(x, w, b, rm, rv, True)[0]
        second = _run_both(x, w, b, rm, rv, True)[0]
    for a, c in zip((first[0], first[1], first[2], *first[3]), (second[0], second[1], second[2], *second[3])):
        assert torch.equal(a, c)


def test_empty_batch_as_torch(backend, device):
    """N = 0: an empty y, the running statistics left alone (as torch), zero parameter gradients."""
    x = torch.empty(0, 3, 4, 4, device=device, requires_grad=True)
    w = torch.ones(3, device=device, requires_grad=True)
    b = torch.zeros(3, device=device, requires_grad=True)
    rm, rv = torch.randn(3, device=device), torch.rand(3, device=device) + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    y = trainops.batch_norm(x, rm, rv, w, b, True)
    assert y.shape == x.shape
    assert torch.equal(rm, rm0) and torch.equal(rv, rv0)
    dx, dw, db = torch.autograd.grad(y.sum(), (x, w, b))
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros(3, device=device)) and torch.equal(db, dw)


def test_running_statistics_bump_their_version(backend, device):
    x = torch.randn(4, 3, 2, 2, device=device, requires_grad=True)
    rm, rv = torch.zeros(3, device=device), torch.ones(3, device=device)
    before = rm._version, rv._version
    trainops.batch_norm(x, rm, rv, training=True)
    assert rm._version > before[0] and rv._version > before[1]


def test_errors_name_the_argument(backend, device):
    x = torch.randn(4, 3, 5, device=device)
    rm, rv = torch.zeros(3, device=device), torch.ones(3, device=device)
    with pytest.raises(InvalidProblemError, match="running_mean"):
        trainops.batch_norm(x, None, None, training=False)
    with pytest.raises(InvalidProblemError, match="more than 1 value per channel"):
        trainops.batch_norm(torch.randn(1, 3, device=device), None, None, training=True)
    with pytest.raises(InvalidProblemError, match="weight"):
        trainops.batch_norm(x, rm, rv, torch.ones(4, device=device))
    with pytest.raises(InvalidProblemError, match="running_var"):
        trainops.batch_norm(x, rm, torch.ones(2, device=device))
    with pytest.raises(InvalidProblemError, match="running_var"):
        trainops.batch_norm(x, rm, rv.double(), training=True)
    with pytest.raises(InvalidProblemError, match="momentum"):
        trainops.batch_norm(x, rm, rv, training=True, momentum=1.5)
    with pytest.raises(InvalidProblemError, match="eps"):
        trainops.batch_norm(x, rm, rv, eps=-1.0)
    with pytest.raises(InvalidProblemError, match="input"):
        trainops.batch_norm(torch.randn(3, device=device), None, None, training=True)
    with pytest.raises(UnsupportedError, match="input"):
        trainops.batch_norm(torch.ones(4, 3, dtype=torch.int64, device=device), None, None, training=True)
    with pytest.raises(InvalidProblemError, match="running_mean"):
        trainops.batch_norm(x, torch.zeros(3, device=device, requires_grad=True), rv, training=True)


@pytest.mark.parametrize("training", [True, False])
def test_gradcheck_float64(backend, device, training):
    gen = torch.Generator().manual_seed(7)
    x = make_input((3, 2, 4), "contiguous", torch.float64, device, gen).requires_grad_()
    w, b, rm, rv = _params(2, device, gen, torch.float64)
    w.requires_grad_(), b.requires_grad_()

    def f(x, w, b):
        return trainops.batch_norm(x, rm.clone().double(), rv.clone().double(), w, b, training)
    assert torch.autograd.gradcheck(f, (x, w, b), fast_mode=backend == "triton")


def test_torch_compile_fullgraph(backend, device):
    gen = torch.Generator().manual_seed(8)
    x = make_input((4, 3, 5, 5), "channels_last", torch.float32, device, gen)
    w, b, rm, rv = _params(3, device, gen)

    def block(x, w, b, rm, rv):
        return (trainops.batch_norm(x, rm, rv, w, b, True) * 2).relu().sum()
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    stats = [rm.clone(), rv.clone()]
    loss = torch.compile(block, fullgraph=True, backend="aot_eager")(*leaves, *stats)
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    ref_stats = [rm.clone(), rv.clone()]
    ref = block(*ref_leaves, *ref_stats)
    ref_grads = torch.autograd.grad(ref, ref_leaves)
    assert_close(loss, ref, torch.float32, "loss")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, "grad")
    for s, r in zip(stats, ref_stats):  # the running statistics written through the compiled graph too
        assert torch.allclose(s, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("cls", ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d"])
def test_modules_are_drop_ins(backend, device, cls, momentum):
    shape = {"BatchNorm1d": (6, 4, 5), "BatchNorm2d": (3, 4, 5, 3), "BatchNorm3d": (2, 4, 3, 2, 3)}[cls]
    torch.manual_seed(0)
    theirs = getattr(torch.nn, cls)(4, momentum=momentum).to(device)
    ours = getattr(trainops.nn, cls)(4, momentum=momentum).to(device)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
        theirs.bias.uniform_(-1, 1)
        ours.load_state_dict(theirs.state_dict())
    for step in range(3):
        x = torch.randn(shape, device=device) * 2 + step
        y_ours, y_theirs = ours(x), theirs(x)
        assert_close(y_ours, y_theirs.double(), torch.float32, f"step {step}")
        y_ours.square().sum().backward()
        y_theirs.square().sum().backward()
    for name in ("running_mean", "running_var"):
        assert_close(getattr(ours, name), getattr(theirs, name), torch.float32, name)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 3
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert_close(p.grad, q.grad, torch.float32, "parameter gradient")
    ours.eval(), theirs.eval()
    x = torch.randn(shape, device=device)
    assert_close(ours(x), theirs(x), torch.float32, "eval")
    untracked = getattr(trainops.nn, cls)(4, track_running_stats=False, affine=False).to(device)
    reference = getattr(torch.nn, cls)(4, track_running_stats=False, affine=False).to(device)
    untracked.eval(), reference.eval()   # no running statistics: batch statistics even in eval
    assert_close(untracked(x), reference(x), torch.float32, "untracked eval")
    wrong_rank = {"BatchNorm1d": (4,), "BatchNorm2d": (2, 4, 3), "BatchNorm3d": (2, 4, 3, 3)}[cls]
    with pytest.raises(ValueError, match="input"):   # torch's rank check, kept
        ours(torch.randn(wrong_rank, device=device))


GPU_CASES = [(shape, layout) for shape in ((32, 64, 56, 56), (32, 256, 14, 14), (64, 2048, 7, 7))
             for layout in ("contiguous", "channels_last")] + [((256, 512), "contiguous")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,layout", GPU_CASES)
def test_real_sizes_on_gpu(shape, layout, dtype):
    gen = torch.Generator().manual_seed(11)
    x = make_input(shape, layout, dtype, "cuda", gen)
    w, b, rm, rv = _params(shape[1], "cuda", gen, dtype)
    ours, ref = _run_both(x, w, b, rm, rv, True)
    _compare(ours, ref, dtype)
    again = _run_both(x, w, b, rm, rv, True)[0]
    for a, c in zip((ours[0], *ours[3]), (again[0], *again[3])):
        assert torch.equal(a, c), "not bit-identical run to run"


@pytest.mark.parametrize("layout", ["copied", "channels_last_crop", "channels_last", "strided"])
def test_fakes_report_the_real_strides(backend, device, layout):
    """torch.library.opcheck's fake-tensor test: the fakes give y and dx the strides the real op
    gives them (a copied view and a channels-last crop come out contiguous), which Inductor relies on."""
    gen = torch.Generator().manual_seed(12)
    if layout == "channels_last_crop":
        x = make_input((2, 3, 6, 7), "channels_last", torch.float32, device, gen)[:, :, 1:-1, 1:-1]
    else:
        x = make_input((2, 3, 4, 6), layout, torch.float32, device, gen)
    w, b, _, _ = _params(3, device, gen)
    mean, rstd = bn_ops.batch_norm_stats_op(x, None, None, 0.1, 1e-5)
    torch.library.opcheck(bn_ops.batch_norm_op.op, (x, w, b, mean, rstd, True),
                          test_utils=("test_schema", "test_faketensor"))
    dy = torch.randn(x.shape, device=device)
    torch.library.opcheck(bn_ops.batch_norm_backward_op.op, (dy, x, w, mean, rstd, True, True, True, b.dtype),
                          test_utils=("test_schema", "test_faketensor"))


def test_strided_weight_trains(backend, device):
    """A weight that is a view (an expanded scalar): forward and backward as torch's."""
    x = torch.randn(4, 3, 5, device=device, dtype=torch.float64, requires_grad=True)
    g = torch.full((1,), 1.5, device=device, dtype=torch.float64, requires_grad=True)
    y = trainops.batch_norm(x, None, None, g.expand(3), None, True)
    dx, dg = torch.autograd.grad(y.square().sum(), (x, g))
    xr, gr = x.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
    yr = torch_F.batch_norm(xr, None, None, gr.expand(3), None, True)
    dxr, dgr = torch.autograd.grad(yr.square().sum(), (xr, gr))
    # float32's bound: dx of a square loss over 20 elements a channel is ill-conditioned (1e-11 off
    # in float64, torch's own float64 result included)
    assert_close(dx, dxr, torch.float32, "dx")
    assert_close(dg, dgr, torch.float32, "dweight")


def test_an_error_leaves_the_running_statistics_alone(backend, device):
    x = torch.randn(4, 3, 5, device=device)
    rm, rv = torch.randn(3, device=device), torch.rand(3, device=device) + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    for kwargs in (dict(weight=torch.ones(3, device=device).to(torch.float8_e4m3fn)),
                   dict(bias=torch.ones(3, device=device).to(torch.float8_e4m3fn)),
                   dict(weight=torch.ones(4, device=device)), dict(eps=-1.0)):
        with pytest.raises((InvalidProblemError, UnsupportedError)):
            trainops.batch_norm(x, rm, rv, training=True, **kwargs)
        assert torch.equal(rm, rm0) and torch.equal(rv, rv0), kwargs


def test_eval_leaves_the_running_statistics_versions_alone(backend, device):
    """Eval reads the running statistics and writes nothing: their versions stay (as torch), so a
    backward that saved them still runs."""
    x = torch.randn(4, 3, 5, device=device, requires_grad=True)
    rm, rv = torch.zeros(3, device=device), torch.ones(3, device=device)
    before = rm._version, rv._version
    trainops.batch_norm(x, rm, rv, training=False).sum().backward()
    assert (rm._version, rv._version) == before


def test_forward_mode_ad_in_training_raises(backend, device):
    from torch.autograd import forward_ad

    x = torch.randn(4, 3, 5, device=device)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.randn_like(x))
        with pytest.raises(UnsupportedError, match="forward-mode"):
            trainops.batch_norm(dual, None, None, training=True)


def test_momentum_may_be_any_real_number(backend, device):
    import numpy as np

    x = torch.randn(4, 3, 5, device=device)
    rm, rv = torch.zeros(3, device=device), torch.ones(3, device=device)
    rm2, rv2 = rm.clone(), rv.clone()
    trainops.batch_norm(x, rm, rv, training=True, momentum=np.float32(0.25))
    torch_F.batch_norm(x, rm2, rv2, training=True, momentum=0.25)
    assert_close(rm, rm2, torch.float32, "running_mean")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "copied"])
def test_inductor_compiled_module_matches_eager(layout):
    """torch.compile (Inductor) of a conv + BatchNorm2d + ReLU block: the loss, the gradients and
    the running statistics of the eager run."""
    torch.manual_seed(0)
    # no conv bias (as ResNet): batch norm in training cancels it, so its gradient is rounding noise
    make = lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),  # noqa: E731
                                       trainops.nn.BatchNorm2d(8), torch.nn.ReLU()).cuda()
    eager, compiled = make(), make()
    compiled.load_state_dict(eager.state_dict())
    step = torch.compile(lambda m, x: m(x).square().mean())
    gen = torch.Generator().manual_seed(1)
    x = make_input((4, 3, 10, 12), layout, torch.float32, "cuda", gen)
    for _ in range(2):
        loss_e, loss_c = eager(x).square().mean(), step(compiled, x)
        loss_e.backward(), loss_c.backward()
        assert_close(loss_c, loss_e, torch.float32, "loss")
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert_close(q.grad, p.grad, torch.float32, name)
    for name in ("running_mean", "running_var"):
        assert_close(getattr(compiled[1], name), getattr(eager[1], name), torch.float32, name)


def test_default_tiles_follow_the_measured_rule(monkeypatch):
    """Fields left None take the measured rule's values (``batch_norm.rule``: by layout, channels and
    positions); a field given overrides its rule value, the others keep theirs."""
    monkeypatch.setattr(bn_ops, "sm_count", lambda device: 132)

    def config(shape, channels_last=False, heuristics=None):
        strides = None
        if channels_last:
            n, c, h, w = shape
            strides = ((h * w * c, 1, w * c, c),)
        problem = bn_ops._describe(bn_ops.STATS_OP, shape, torch.bfloat16, "cpu", strides=strides,
                                   heuristics=heuristics)
        return bn_ops._config(problem)
    # channels-first: the spatial block first (1024 at most), channels fill the 2048-element tile;
    # 8 reduction programs per SM from 14 x 14 positions, 2 below
    big, small = config((32, 128, 28, 28)), config((64, 512, 7, 7))
    assert (big.block_s, big.block_c) == (1024, 2) and (small.block_s, small.block_c) == (64, 32), (big, small)
    assert big.programs == 132 * 8 // (128 // 2), big
    assert small.programs <= 132 * 2 // (512 // 32), small
    # channels-last: 128 channels a program from 256 channels and 14 x 14 positions, 32 below
    wide, narrow, late = (config(s, True) for s in ((32, 256, 56, 56), (32, 128, 28, 28), (32, 2048, 7, 7)))
    assert (wide.block_c, wide.block_s) == (128, 64) and (narrow.block_c, narrow.block_s) == (32, 256), (wide, narrow)
    assert late.block_c == 32, late
    assert config((4096, 512)).block_c == 64   # (N, C): the earlier values
    forced = config((32, 256, 56, 56), True, BatchNormHeuristics(channel_block=16))
    assert (forced.block_c, forced.block_s) == (16, 8192 // 16), forced
    fewer = config((32, 256, 56, 56), True, BatchNormHeuristics(programs_per_sm=1))
    assert fewer.programs < wide.programs and fewer.block_c == wide.block_c


@pytest.mark.parametrize("field,value", [("tile", 0), ("tile", 3000), ("channel_block", 48), ("spatial_block", -4),
                                         ("programs_per_sm", 0), ("warps", 3), ("tile", 4096.0)])
def test_bad_heuristics_are_refused_by_name(field, value):
    with pytest.raises(InvalidProblemError, match=f"heuristics.*{field}"):
        trainops.plan("batch_norm_stats", shape=(4, 8, 5, 5), dtype=torch.float32, device="cpu",
                      heuristics=BatchNormHeuristics(**{field: value}))
