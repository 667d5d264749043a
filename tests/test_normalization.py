"""RMSNorm and LayerNorm (with the fused residual add): forward and backward, every backend, against
float64 references; plans forced on small shapes; layouts; errors; modules; torch.compile."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as torch_F

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import normalization as norm_ops
from trainops.ops.normalization import NormHeuristics
from trainops.plan import clear_plan_cache

from conftest import HAS_CUDA
from numerics import FLOATS, assert_close, interpreter_rounding, stable_seed

# small shapes that still force every plan: looped rows, several rows a program, many programs
LOOPED = NormHeuristics(fused_max=16, chunk=8, row_exchange=False)
MANY_ROWS = NormHeuristics(forward_tile=64, backward_tile=64, backward_programs_per_sm=1)
# backward rows of more than 16 elements cut into chunks of 16 held by programs that trade partial sums
EXCHANGE = NormHeuristics(exchange_above=16, rms_exchange_above=16, exchange_tile=16)
# the fused backward's weight and bias gradients kept per (row slot, column), as wider row blocks do,
# over several steps a program
SLOT_SUMS = NormHeuristics(step_sums=0, small_rows_tile=64, small_rows_programs_per_sm=1)
PLANS = {"default": NormHeuristics(), "looped": LOOPED, "many_rows": MANY_ROWS, "exchange": EXCHANGE,
         "slot_sums": SLOT_SUMS}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN, so an element left unwritten fails the test."""
    original = norm_ops.NormProblem.new_output

    def new_output(self):
        return tuple(t.fill_(float("nan")) if t.is_floating_point() else t for t in original(self))
    monkeypatch.setattr(norm_ops.NormProblem, "new_output", new_output)
    clear_plan_cache()
    yield
    clear_plan_cache()


def _randn(shape, dtype, device, gen, scale=1.0, offset=0.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + offset).to(dtype).to(device)


def make_input(shape, layout, dtype, device, gen, scale=2.0, offset=0.0):
    """x of ``shape`` laid out as named (the normalized axis stays walkable except for 'copied')."""
    if layout == "contiguous":
        return _randn(shape, dtype, device, gen, scale, offset)
    if layout == "transposed":  # leading axes swapped: rows are not in memory order
        base = _randn((shape[1], shape[0]) + tuple(shape[2:]), dtype, device, gen, scale, offset)
        return base.transpose(0, 1)
    if layout == "strided_row":  # the row axis itself has stride 2
        base = _randn(tuple(shape[:-1]) + (2 * shape[-1],), dtype, device, gen, scale, offset)
        return base[..., ::2]
    if layout == "expanded":  # a broadcast batch axis (stride 0)
        base = _randn((1,) + tuple(shape[1:]), dtype, device, gen, scale, offset)
        return base.expand(shape)
    if layout == "offset":
        flat = _randn((math.prod(shape) + 5,), dtype, device, gen, scale, offset)
        return flat[5:].view(shape)
    raise ValueError(layout)


def reference(op, x, weight, bias, residual, eps, weight_offset, normalized_ndim):
    """(y, h) in float64, h = x + residual rounded to x's dtype as the kernels round it."""
    h = x
    if residual is not None:
        h = interpreter_rounding((x.double() + residual.double()).float(), x.dtype) if x.dtype != torch.float64 \
            else x + residual
    hd = h.double()
    dims = tuple(range(hd.dim() - normalized_ndim, hd.dim()))
    if op == "rms_norm":
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        y = hd * torch.rsqrt(hd.square().mean(dims, keepdim=True) + eps)
        if weight is not None:
            y = y * (weight.double() + weight_offset)
    else:
        y = torch_F.layer_norm(hd, hd.shape[hd.dim() - normalized_ndim:], None if weight is None else weight.double(),
                               None if bias is None else bias.double(), 1e-5 if eps is None else eps)
    return y, h


def call(op, x, weight, bias, residual, eps, weight_offset, normalized_ndim):
    if op == "rms_norm":
        return trainops.rms_norm(x, weight, eps, residual=residual, weight_offset=weight_offset)
    return trainops.layer_norm(x, x.shape[x.dim() - normalized_ndim:], weight, bias, 1e-5 if eps is None else eps,
                               residual=residual)


CASES = [  # shape, normalized_ndim
    ((7, 33), 1), ((2, 3, 40), 1), ((5, 4, 6), 2), ((1, 64), 1), ((3, 2, 2, 2, 17), 1),
]
# the forced plans on the cases that reach them (CI time): looped rows of one and of two normalized
# axes; several rows a program, over one and over four batch axes
PLAN_CASES = {"default": CASES, "looped": [CASES[0], CASES[2]], "many_rows": [CASES[2], CASES[4]],
              "exchange": [CASES[0], CASES[2], CASES[3]],  # a short last chunk, two normalized axes, one row
              "slot_sums": [CASES[0], ((40, 3, 17), 1)]}  # 120 rows: several steps a program


# Each forced plan with float32, float64 and one of the two 2-byte formats, the default plan with all
# four: float16 and bfloat16 take the same tiles, kernels and float32 accumulation (the plans key on
# the element size) and differ in the conversions at load and store alone, which the default plan
# and the plans named here check for each format (CI time: the exchange and slot-sums cases cost
# 5-14 s each under the interpreter).
TWO_BYTE_ON = {"exchange": torch.bfloat16, "looped": torch.float16, "many_rows": torch.bfloat16,
               "slot_sums": torch.float16}
PLAN_DTYPES = [(plan, dtype) for plan in sorted(PLANS) for dtype in FLOATS
               if plan == "default" or dtype.itemsize != 2 or dtype == TWO_BYTE_ON[plan]]


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("plan,dtype", PLAN_DTYPES, ids=str)
def test_forward_and_backward_match_float64(backend, device, op, dtype, plan):
    gen = torch.Generator().manual_seed(stable_seed(op, str(dtype), plan))
    with trainops.heuristics(PLANS[plan]):
        for shape, k in PLAN_CASES[plan]:
            for with_weight, with_residual in ((True, False), (True, True), (False, False), (False, True)):
                if op == "rms_norm" and not with_weight:
                    k = 1  # rms_norm without a weight normalizes the last axis
                nshape = shape[len(shape) - k:]
                x = _randn(shape, dtype, device, gen, 2.0, 0.5).requires_grad_()
                weight = _randn(nshape, torch.float32, device, gen, 0.5, 1.0).requires_grad_() if with_weight else None
                bias = (_randn(nshape, torch.float32, device, gen).requires_grad_()
                        if with_weight and op == "layer_norm" else None)
                residual = _randn(shape, dtype, device, gen).requires_grad_() if with_residual else None
                offset = 1.0 if op == "rms_norm" and with_weight else 0.0
                out = call(op, x, weight, bias, residual, None, offset, k)
                y, h = out if with_residual else (out, None)
                ref_y, ref_h = reference(op, x.detach(), None if weight is None else weight.detach(),
                                         None if bias is None else bias.detach(),
                                         None if residual is None else residual.detach(), None, offset, k)
                what = f"{op} {shape} k={k} w={with_weight} r={with_residual}"
                assert y.dtype == dtype and y.is_contiguous()
                assert_close(y, ref_y, dtype, what + " y")
                if with_residual:
                    assert_close(h, ref_h, dtype, what + " h")
                # backward: dy into y (and dh into h); reference through float64 autograd on the same h
                dy = _randn(shape, dtype, device, gen)
                dh = _randn(shape, dtype, device, gen) if with_residual else None
                leaves = [t for t in (x, weight, bias, residual) if t is not None]
                grads = torch.autograd.grad((y, h) if with_residual else (y,), leaves,
                                            (dy, dh) if with_residual else (dy,))
                xd = x.detach().double().requires_grad_()
                rd = None if residual is None else residual.detach().double().requires_grad_()
                wd = None if weight is None else weight.detach().double().requires_grad_()
                bd = None if bias is None else bias.detach().double().requires_grad_()
                hd = xd if rd is None else xd + rd
                # h as rounded forward: the gradient passes through the rounding unchanged
                hd = hd + (ref_h.double() - hd).detach() if rd is not None else hd
                ry, _ = reference(op, hd, wd, bd, None, torch.finfo(dtype).eps if op == "rms_norm" else None, offset, k)
                outs, gouts = [ry], [dy.double()]
                if rd is not None:
                    outs.append(hd)
                    gouts.append(dh.double())
                ref_grads = torch.autograd.grad(outs, [t for t in (xd, wd, bd, rd) if t is not None], gouts)
                names = [n for n, t in zip(("x", "weight", "bias", "residual"), (x, weight, bias, residual))
                         if t is not None]
                for name, got, want in zip(names, grads, ref_grads):
                    assert got.dtype == {"x": dtype, "residual": dtype}.get(name, torch.float32)
                    # weight and bias are float32: their gradients carry float32 rounding at most
                    tol = torch.float32 if dtype == torch.float64 and name in ("weight", "bias") else dtype
                    assert_close(got, want, tol, f"{what} d{name}")


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("layout", ["transposed", "strided_row", "expanded", "offset"])
def test_strided_inputs_are_read_in_place(backend, device, op, layout):
    gen = torch.Generator().manual_seed(11)
    for plan in (NormHeuristics(), LOOPED, EXCHANGE):
        with trainops.heuristics(plan):
            x = make_input((6, 5, 24), layout, torch.float32, device, gen).requires_grad_()
            residual = make_input((6, 5, 24), "transposed", torch.float32, device, gen)
            weight = _randn((24,), torch.float32, device, gen, 0.5, 1.0).requires_grad_()
            y, h = call(op, x, weight, None, residual, None, 0.0, 1)
            ref_y, ref_h = reference(op, x.detach(), weight.detach(), None, residual, None, 0.0, 1)
            assert_close(y, ref_y, torch.float32, f"{layout} y")
            assert_close(h, ref_h, torch.float32, f"{layout} h")
            dy = make_input((6, 5, 24), "strided_row", torch.float32, device, gen)
            dx, dw = torch.autograd.grad(y, (x, weight), dy)
            xd, wd = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
            ry, _ = reference(op, xd + residual.double(), wd, None, None, None, 0.0, 1)
            rdx, rdw = torch.autograd.grad(ry, (xd, wd), dy.double())
            assert_close(dx, rdx, torch.float32, f"{layout} dx")
            assert_close(dw, rdw, torch.float32, f"{layout} dweight")


def test_many_unmergeable_batch_axes_launch_per_host_index(backend, device):
    """Five batch axes in a scrambled order: the leading ones become host launches."""
    gen = torch.Generator().manual_seed(12)
    base = _randn((3, 2, 4, 2, 3, 16), torch.float32, device, gen)
    x = base.permute(4, 0, 3, 1, 2, 5).requires_grad_()  # no two batch axes merge
    weight = _randn((16,), torch.float32, device, gen, 0.5, 1.0).requires_grad_()
    # rows of 16 cut into 2 chunks: the exchange backward's host launches each write their own
    # workspace rows (dw_part[written:])
    exchange = NormHeuristics(exchange_above=8, rms_exchange_above=8, exchange_tile=8)
    for plan, heuristics in (("default", PLANS["default"]), ("many_rows", MANY_ROWS), ("exchange", exchange)):
        with trainops.heuristics(heuristics):
            y = trainops.rms_norm(x, weight)
            assert_close(y, reference("rms_norm", x.detach(), weight.detach(), None, None, None, 0.0, 1)[0],
                         torch.float32, plan)
            dy = torch.randn(x.shape, generator=gen).to(device)
            with trainops.track_kernels():
                plan_ = trainops.plan("rms_norm", shape=x.shape, dtype=x.dtype, device=x.device,
                                      weight_dtype=weight.dtype, strides=(x.stride(), None))
                backward = trainops.plan("rms_norm_backward", shape=x.shape, dtype=x.dtype, device=x.device,
                                         weight_dtype=weight.dtype, strides=(dy.stride(), x.stride(), None))
            if backend == "triton":
                assert plan_.kernel["host_launches"] > 1 and backward.kernel["host_launches"] > 1
                assert (backward.kernel["plan"] == "exchange") == (plan == "exchange")
            dx, dw = torch.autograd.grad(y, (x, weight), dy)
            xd, wd = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
            ry, _ = reference("rms_norm", xd, wd, None, None, None, 0.0, 1)
            rdx, rdw = torch.autograd.grad(ry, (xd, wd), dy.double())
            assert_close(dx, rdx, torch.float32, "dx")
            assert_close(dw, rdw, torch.float32, "dweight")


def test_matches_torch_functional_and_special_values(backend, device):
    gen = torch.Generator().manual_seed(13)
    x = _randn((4, 32), torch.float32, device, gen, 1e15)  # huge but squares stay finite in float32
    w = _randn((32,), torch.float32, device, gen)
    assert_close(trainops.rms_norm(x, w, 1e-6), torch_F.rms_norm(x, (32,), w, 1e-6), torch.float32, "huge rms")
    assert_close(trainops.layer_norm(x, 32, w, w), torch_F.layer_norm(x, (32,), w, w), torch.float32, "huge ln")
    x = torch.zeros(3, 8, device=device)  # zero rows: rstd = 1/sqrt(eps), y = 0 (bias for LayerNorm)
    assert torch.equal(trainops.rms_norm(x, None), torch.zeros_like(x))
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    for y, ref in ((trainops.rms_norm(x, None), torch_F.rms_norm(x, (8,))),
                   (trainops.layer_norm(x, 8), torch_F.layer_norm(x, (8,)))):
        assert torch.equal(y.isnan(), ref.isnan()), "NaN / inf rows must poison their row only, as torch"
        assert torch.equal(y[0], ref[0])


def test_empty_and_length_one(backend, device):
    for op in ("rms_norm", "layer_norm"):
        x = torch.randn(0, 5, device=device, requires_grad=True)
        w = torch.randn(5, device=device, requires_grad=True)
        y = call(op, x, w, None, None, None, 0.0, 1)
        assert y.shape == (0, 5)
        dx, dw = torch.autograd.grad(y.sum(), (x, w))
        assert dx.shape == (0, 5) and torch.equal(dw, torch.zeros(5, device=device))
        x = torch.randn(4, 1, device=device, dtype=torch.float64)
        w = torch.randn(1, device=device, dtype=torch.float64)
        ref, _ = reference(op, x, w, None, None, None, 0.0, 1)
        assert_close(call(op, x, w, None, None, None, 0.0, 1), ref, torch.float64, op)
        # one element a row: dx is the eps term alone (cancellation: compared absolutely, in float64 terms)
        x32 = torch.randn(9, 1, device=device, requires_grad=True)
        dx, = torch.autograd.grad(call(op, x32, None, None, None, None, 0.0, 1).sum(), (x32,))
        xd = x32.detach().double().requires_grad_()
        eps = torch.finfo(torch.float32).eps if op == "rms_norm" else None
        rdx, = torch.autograd.grad(reference(op, xd, None, None, None, eps, 0.0, 1)[0].sum(), (xd,))
        # float32 rounding of the cancelling terms, each of size rstd = 1 / sqrt(x^2 + eps)
        rstd = (xd.detach().square() + torch.finfo(torch.float32).eps).rsqrt() if op == "rms_norm" else 1 / math.sqrt(1e-5)
        bound = 8 * torch.finfo(torch.float32).eps * float(torch.as_tensor(rstd).max())
        assert (dx.double() - rdx).abs().max() < bound, (dx, rdx)


def test_weight_gradient_is_bit_identical_run_to_run(backend, device):
    gen = torch.Generator().manual_seed(14)
    x = _randn((100, 48), torch.float32, device, gen).requires_grad_()
    w = _randn((48,), torch.float32, device, gen).requires_grad_()
    b = _randn((48,), torch.float32, device, gen).requires_grad_()
    dy = _randn((100, 48), torch.float32, device, gen)
    # On a GPU three repeats, where the programs' order can change from call to call. Under Triton's
    # interpreter (and on the CPU path) the programs run one after another in one order and each call
    # zeroes its own exchange buffer (ops/exchange.py): one repeat checks that a call carries nothing
    # over from the last; more would replay it bit for bit.
    for plan in (MANY_ROWS, EXCHANGE):
        with trainops.heuristics(plan):
            first = torch.autograd.grad(trainops.layer_norm(x, 48, w, b), (x, w, b), dy)
            for _ in range(3 if x.is_cuda else 1):
                again = torch.autograd.grad(trainops.layer_norm(x, 48, w, b), (x, w, b), dy)
                assert all(torch.equal(a, b_) for a, b_ in zip(first, again))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_gradcheck_float64(backend, device, op):
    gen = torch.Generator().manual_seed(15)
    x = _randn((3, 2, 7), torch.float64, device, gen).requires_grad_()
    r = _randn((3, 2, 7), torch.float64, device, gen).requires_grad_()
    w = _randn((7,), torch.float64, device, gen).requires_grad_()
    b = _randn((7,), torch.float64, device, gen).requires_grad_()
    for plan in (NormHeuristics(), LOOPED, NormHeuristics(exchange_above=4, rms_exchange_above=4, exchange_tile=4)):
        with trainops.heuristics(plan):
            if op == "rms_norm":
                def f(x, r, w, b):
                    y, h = trainops.rms_norm(x, w, 1e-6, residual=r, weight_offset=0.5)
                    return y, h
            else:
                def f(x, r, w, b):
                    return trainops.layer_norm(x, 7, w, b, residual=r)
            # random projections under the interpreter (CI time); the CPU path in full
            assert torch.autograd.gradcheck(f, (x, r, w, b), fast_mode=backend == "triton")


# out_dtype: y in another dtype than x, the float32 (float64) result rounded once; dy in y's dtype
OUT_DTYPE_CASES = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
                   (torch.float64, torch.float32)]


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_out_dtype_is_the_default_result_rounded_once(backend, device, op):
    """y in out_dtype holds the bits of the default call's y rounded to it (from a float32 x: the
    cast autocast makes before a matmul; under Triton's interpreter rounded as it rounds), h stays
    in x's dtype, and the backward of a dy in y's dtype is the backward of that dy in x's dtype:
    dx in x's dtype, dweight in weight's, the same bits (a bf16 dy widens exactly). Forced plans:
    looped rows and the exchange backward."""
    gen = torch.Generator().manual_seed(stable_seed(op, "out_dtype"))
    for plan in ("default", "looped", "exchange"):
        with trainops.heuristics(PLANS[plan]):
            for x_dtype, out_dtype in OUT_DTYPE_CASES if plan == "default" else OUT_DTYPE_CASES[:1]:
                for with_residual in (False, True):
                    x = _randn((3, 5, 24), x_dtype, device, gen, 2.0, 0.5).requires_grad_()
                    w = _randn((24,), torch.float32, device, gen, 0.5, 1.0).requires_grad_()
                    r = _randn((3, 5, 24), x_dtype, device, gen) if with_residual else None
                    if op == "rms_norm":
                        def f(**kw):
                            return trainops.rms_norm(x, w, 1e-6, residual=r, weight_offset=0.25, **kw)
                    else:
                        def f(**kw):
                            return trainops.layer_norm(x, 24, w, w, residual=r, **kw)
                    what = f"{plan} {x_dtype} -> {out_dtype} r={with_residual}"
                    got, want = f(out_dtype=out_dtype), f()
                    (y, h), (y_want, h_want) = (got, want) if with_residual else ((got, None), (want, None))
                    assert y.dtype == out_dtype and y.is_contiguous(), what
                    if out_dtype.itemsize < x_dtype.itemsize:   # narrower: the default's y, rounded once
                        rounded = (interpreter_rounding(y_want, out_dtype) if backend == "triton"
                                   else y_want.to(out_dtype))
                        assert torch.equal(y, rounded), what
                    else:   # wider: closer to the exact y than the default's
                        ref, _ = reference(op, x.detach() if r is None else h_want.detach(), w.detach(),
                                           w.detach() if op == "layer_norm" else None, None, 1e-6,
                                           0.25 if op == "rms_norm" else 0.0, 1)
                        assert_close(y, ref, out_dtype if x_dtype == torch.float64 else torch.float32, what)
                    if with_residual:
                        assert h.dtype == x_dtype and torch.equal(h, h_want), what
                    dy = _randn((3, 5, 24), out_dtype, device, gen)
                    grads = torch.autograd.grad(y, (x, w), dy)
                    want_grads = torch.autograd.grad(y_want, (x, w), dy.to(x_dtype))
                    assert grads[0].dtype == x_dtype and grads[1].dtype == torch.float32, what
                    if out_dtype.itemsize < x_dtype.itemsize:
                        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads)), what
                    else:   # the default's dy was rounded to x's dtype first
                        for a, b in zip(grads, want_grads):
                            assert_close(a, b, x_dtype, what)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_out_dtype_ops_pass_opcheck_and_gradcheck(op):
    """The custom ops' schema and fakes with out_dtype (y in it; the backward's dx in h's dtype
    whatever dy's), and gradcheck of the out_dtype path in float64 (out_dtype float64: the same op)."""
    gen = torch.Generator().manual_seed(stable_seed(op, "opcheck"))
    x = _randn((4, 16), torch.float32, "cpu", gen).requires_grad_()
    w = _randn((16,), torch.float32, "cpu", gen).requires_grad_()
    forward = norm_ops.rms_norm_op if op == "rms_norm" else norm_ops.layer_norm_op
    args = ((x, w, None, 1, 1e-6, 0.0, torch.bfloat16) if op == "rms_norm" else
            (x, w, None, None, 1, 1e-6, torch.bfloat16))
    torch.library.opcheck(forward.op, args, test_utils=("test_schema", "test_faketensor"))
    y, _, stats = forward(*args)
    assert y.dtype == torch.bfloat16
    dy = torch.randn(4, 16, generator=gen).to(torch.bfloat16)
    backward_args = ((dy, x.detach(), w.detach(), stats, None, 1, 0.0, True) if op == "rms_norm" else
                     (dy, x.detach(), w.detach(), stats, None, 1, False, None, True))
    backward = norm_ops.rms_norm_backward_op if op == "rms_norm" else norm_ops.layer_norm_backward_op
    torch.library.opcheck(backward.op, backward_args, test_utils=("test_schema", "test_faketensor"))
    assert backward(*backward_args)[0].dtype == torch.float32
    xd, rd, wd = (_randn(shape, torch.float64, "cpu", gen).requires_grad_() for shape in ((3, 7), (3, 7), (7,)))
    if op == "rms_norm":
        def f(x, r, w):
            return trainops.rms_norm(x, w, 1e-6, residual=r, weight_offset=0.5, out_dtype=torch.float64)
    else:
        def f(x, r, w):
            return trainops.layer_norm(x, 7, w, w, residual=r, out_dtype=torch.float64)
    assert torch.autograd.gradcheck(f, (xd, rd, wd))


def test_torch_compile_fullgraph(backend, device):
    gen = torch.Generator().manual_seed(16)
    x = _randn((4, 16), torch.float32, device, gen).requires_grad_()
    r = _randn((4, 16), torch.float32, device, gen)
    w = _randn((16,), torch.float32, device, gen).requires_grad_()

    def block(x, r, w):
        y, h = trainops.rms_norm(x, w, residual=r)
        half = trainops.rms_norm(h, w, out_dtype=torch.bfloat16)   # y of another dtype: the fake's
        return (trainops.layer_norm(y, 16) * h).sum() + (half.float() * h).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    loss = compiled(x, r, w)
    grads = torch.autograd.grad(loss, (x, w))
    torch._dynamo.reset()
    eager_loss = block(x, r, w)
    eager_grads = torch.autograd.grad(eager_loss, (x, w))
    assert_close(loss, eager_loss, torch.float32, "loss")
    for got, want in zip(grads, eager_grads):
        assert_close(got, want, torch.float32, "grad")


def test_modules_are_drop_ins(backend, device):
    torch.manual_seed(17)
    for torch_cls, ours_cls, kwargs in ((torch.nn.RMSNorm, trainops.nn.RMSNorm, dict(eps=1e-6)),
                                        (torch.nn.RMSNorm, trainops.nn.RMSNorm, dict(elementwise_affine=False)),
                                        (torch.nn.LayerNorm, trainops.nn.LayerNorm, {}),
                                        (torch.nn.LayerNorm, trainops.nn.LayerNorm, dict(bias=False))):
        theirs = torch_cls((3, 8), device=device, **kwargs)
        ours = ours_cls((3, 8), device=device, **kwargs)
        with torch.no_grad():
            for p in theirs.parameters():
                p.uniform_(0.5, 1.5)
        ours.load_state_dict(theirs.state_dict())
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        x = torch.randn(5, 3, 8, device=device)
        assert_close(ours(x), theirs(x), torch.float32, f"{torch_cls.__name__} {kwargs}")
        y, h = ours(x, residual=x)
        assert_close(y, theirs(2 * x), torch.float32, "residual")
        assert torch.equal(h, 2 * x)
    gemma = trainops.nn.RMSNorm(8, weight_offset=1.0, device=device)
    torch.nn.init.zeros_(gemma.weight)
    x = torch.randn(4, 8, device=device)
    assert_close(gemma(x), torch_F.rms_norm(x, (8,)), torch.float32, "weight_offset")


def test_plan_api_runs_and_reports_precision(backend, device):
    p = trainops.plan("layer_norm", shape=(8, 32), dtype=torch.float32, device=device, weight_dtype=torch.float32,
                      bias_dtype=torch.float32)
    assert p.precision.accumulator == torch.float32 and p.precision.bitwise_reproducible
    x, w, b = torch.randn(8, 32, device=device), torch.randn(32, device=device), torch.randn(32, device=device)
    y, h, stats = p.run(x, w, b, None)
    assert h.numel() == 0 and stats.shape == (2, 8)
    assert_close(y, torch_F.layer_norm(x.double(), (32,), w.double(), b.double()), torch.float32, "plan")
    assert not p.can_implement(x, w, None, None)
    assert not p.can_implement(x.t().contiguous().t(), w, b, None)  # other strides: another plan


# ---- errors: named, before anything is written -------------------------------------------------------

def test_errors_name_the_argument():
    x, w = torch.randn(4, 8), torch.randn(8)
    cases = [
        (lambda: trainops.rms_norm(x, torch.randn(7)), InvalidProblemError, "'weight' has shape"),
        (lambda: trainops.rms_norm(x, torch.randn(2, 4, 8)), InvalidProblemError, "'weight'"),
        (lambda: trainops.rms_norm(x, w, -1e-5), InvalidProblemError, "'eps'"),
        (lambda: trainops.rms_norm(x, w, float("nan")), InvalidProblemError, "'eps'"),
        (lambda: trainops.rms_norm(x.int(), None), UnsupportedError, "'x' has dtype torch.int32"),
        (lambda: trainops.rms_norm(x, w, residual=x.double()), InvalidProblemError, "'residual' has dtype"),
        (lambda: trainops.rms_norm(x, w, residual=x[:2]), InvalidProblemError, "'residual' has shape"),
        (lambda: trainops.rms_norm(x, w, residual=x.to("meta")), InvalidProblemError, "'residual' is on meta"),
        (lambda: trainops.rms_norm(x, None, weight_offset=1.0), InvalidProblemError, "'weight_offset'"),
        (lambda: trainops.rms_norm(x, w, weight_offset="1"), InvalidProblemError, "'weight_offset'"),
        (lambda: trainops.rms_norm("x", w), InvalidProblemError, "'x' must be a torch.Tensor"),
        (lambda: trainops.rms_norm(x, w.int()), UnsupportedError, "'weight' has dtype torch.int32"),
        (lambda: trainops.layer_norm(x, (4,)), InvalidProblemError, "'normalized_shape' is [4]"),
        (lambda: trainops.layer_norm(x, (2, 4, 8)), InvalidProblemError, "'normalized_shape'"),
        (lambda: trainops.layer_norm(x, 8, w, torch.randn(3)), InvalidProblemError, "'bias' has shape"),
        (lambda: trainops.layer_norm(x, 8, w.to("meta")), InvalidProblemError, "'weight' is on meta"),
        (lambda: trainops.layer_norm(x, "8"), InvalidProblemError, "'normalized_shape'"),
        (lambda: trainops.rms_norm(x, w, out_dtype="bf16"), InvalidProblemError, "'out_dtype' must be a torch.dtype"),
        (lambda: trainops.rms_norm(x, w, out_dtype=torch.int32), UnsupportedError, "'out_dtype' has dtype"),
        (lambda: trainops.layer_norm(x, 8, out_dtype=torch.int8), UnsupportedError, "'out_dtype' has dtype"),
        # the backward: dy in y's dtype, grad_h in h's (x's)
        (lambda: norm_ops.rms_norm_backward_op(x.bfloat16(), x, w, torch.ones(1, 4), x.bfloat16(), 1, 0.0),
         InvalidProblemError, "'grad_h' has dtype torch.bfloat16; the plan is for torch.float32"),
    ]
    for fn, cls, text in cases:
        with pytest.raises(cls) as info:
            fn()
        assert text in str(info.value), str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("shape", [(8192, 4096), (32768, 768), (4, 2048, 5120), (1000, 50000), (3, 16384),
                                   (1000, 20000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_sizes(op, shape, dtype):
    gen = torch.Generator(device="cuda").manual_seed(18)
    n = shape[-1]
    x = (torch.randn(shape, device="cuda", generator=gen) * 2 + 0.5).to(dtype).requires_grad_()
    r = torch.randn(shape, device="cuda", generator=gen).to(dtype).requires_grad_()
    w = (torch.rand(n, device="cuda", generator=gen) + 0.5).requires_grad_()
    b = torch.randn(n, device="cuda", generator=gen).requires_grad_() if op == "layer_norm" else None
    y, h = call(op, x, w, b, r, 1e-6, 0.0, 1)
    ref_y, ref_h = reference(op, x.detach(), w.detach(), None if b is None else b.detach(), r.detach(), 1e-6, 0.0, 1)
    assert torch.equal(h, x.detach() + r.detach())  # the GPU rounds the sum as torch does
    assert_close(y, ref_y, dtype, "y")
    dy = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    dh = torch.randn(shape, device="cuda", generator=gen).to(dtype)  # the residual stream's own gradient
    leaves = [t for t in (x, r, w, b) if t is not None]
    grads = torch.autograd.grad((y, h), leaves, (dy, dh))
    hd = h.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    ry, _ = reference(op, hd, wd, bd, None, 1e-6, 0.0, 1)
    rdh, *rdp = torch.autograd.grad(ry, [t for t in (hd, wd, bd) if t is not None], dy.double())
    for got, want, name in zip(grads, [rdh + dh.double(), rdh + dh.double(), *rdp], ("x", "residual", "w", "b")):
        assert_close(got, want, dtype, f"d{name}")
    assert torch.equal(grads[0], grads[1]), "dx and d residual are the same gradient"
    again = torch.autograd.grad(call(op, x, w, b, r, 1e-6, 0.0, 1), leaves, (dy, dh))
    assert all(torch.equal(a, c) for a, c in zip(grads, again)), "bit-identical run to run"


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("shape", [(4, 2048, 2048), (8192, 4096), (1000, 20000)])
def test_gpu_out_dtype_is_the_cast_of_the_float32_result(op, shape):
    """On the GPU (round to nearest even, as torch's cast): a bf16 y of a float32 x holds the bits
    of the float32 call's y cast to bf16 (Llama-3.2-1B's pre-norm at 4 x 2048 tokens, a wide row,
    rows of 20000: the looped forward and the exchange backward); the backward of a bf16 dy holds
    the bits of the backward of that dy widened to float32."""
    gen = torch.Generator(device="cuda").manual_seed(24)
    n = shape[-1]
    x = (torch.randn(shape, device="cuda", generator=gen) * 3).requires_grad_()
    w = (torch.rand(n, device="cuda", generator=gen) + 0.5).requires_grad_()
    b = torch.randn(n, device="cuda", generator=gen).requires_grad_() if op == "layer_norm" else None
    y = call(op, x, w, b, None, 1e-5, 0.0, 1)
    if op == "rms_norm":
        half = trainops.rms_norm(x, w, 1e-5, out_dtype=torch.bfloat16)
    else:
        half = trainops.layer_norm(x, n, w, b, 1e-5, out_dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, y.to(torch.bfloat16))
    dy = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
    leaves = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(half, leaves, dy)
    want = torch.autograd.grad(y, leaves, dy.float())
    assert all(a.dtype == t.dtype and torch.equal(a, c) for a, c, t in zip(got, want, leaves))


def test_backward_plans_with_the_forward_heuristics_on_any_thread(backend, device):
    """The forward's trainops.heuristics(...) block holds for its backward, even when autograd runs it
    on another thread (as it does for CUDA tensors) or after the block has closed."""
    import threading

    x = torch.randn(6, 40, device=device, requires_grad=True)
    with trainops.heuristics(LOOPED):
        y = trainops.rms_norm(x, None)
    seen = []
    original = norm_ops._choose_config

    def spy(problem):
        seen.append((problem.op, problem.heuristics))
        return original(problem)
    norm_ops._choose_config = spy
    try:
        clear_plan_cache()
        def run_backward():
            with trainops.backend(backend):  # the thread's own context: the backend pinned, no heuristics
                y.backward(torch.ones_like(y))
        worker = threading.Thread(target=run_backward)
        worker.start()
        worker.join()
    finally:
        norm_ops._choose_config = original
    if backend == "triton":
        assert seen == [("rms_norm_backward", LOOPED)]
    assert x.grad is not None and x.grad.isfinite().all()


def test_backward_pipeline_stages_fit_the_staging_budget():
    """Fewer stages where stages x a step's tiles would pass pipeline_bytes (shared memory on the GPU)."""
    def stages(dtype, n, residual=False):
        strides = ((n, 1), (n, 1), (n, 1) if residual else None)
        with trainops.backend("triton"):
            return trainops.plan("rms_norm_backward", shape=(8, n), dtype=dtype, device="cuda" if HAS_CUDA else "cpu",
                                 has_residual=residual, strides=strides).kernel["stages"]
    if not HAS_CUDA and not trainops.registry.triton_interpreting():
        pytest.skip("no Triton kernels here")
    # a step holds 16 KB of x: 2 bf16 rows of 4096, or 1 float32 row
    assert stages(torch.bfloat16, 4096) == 3
    assert stages(torch.float32, 4096, True) == 3     # three 16 KB tiles a step: 3 x 48 KB
    assert stages(torch.float32, 5120) == 1           # a row block of 8192 float32 is 16384 units: 1 stage
    assert stages(torch.bfloat16, 16384) == 1         # the stages table: one stage for rows of 16384
    assert stages(torch.float32, 768) == 3            # small rows: 4 rows of 1024 a step
    big = NormHeuristics(backward_stages=((1 << 62, 3),))
    with trainops.backend("triton"):  # 2 x 32 KB a step of a float32 row of 8192: 2 stages fit 147456 bytes
        assert trainops.plan("rms_norm_backward", shape=(8, 5120), dtype=torch.float32,
                             device="cuda" if HAS_CUDA else "cpu", heuristics=big).kernel["stages"] == 2


def _row_offsets(t: torch.Tensor, k: int) -> set[int]:
    """Element offsets (from the data pointer) of every row of ``t``'s trailing ``k`` axes."""
    lead, strides = t.shape[:t.dim() - k], t.stride()[:t.dim() - k]
    return {sum(i * st for i, st in zip(index, strides)) for index in
            itertools.product(*(range(d) for d in lead))}


@pytest.mark.parametrize("case", ["1000", "1001", "1000_offset_1", "1000_of_1008", "strided_row",
                                  "transposed_batch", "two_axes", "float64"])
def test_row_alignment_divides_the_row_length_and_every_row_start(case):
    """The kernels tell the compiler that n and every row's offset are multiples of ``align``
    (``tl.multiple_of``): a wrong claim would make misaligned vector accesses on the GPU. The plan's
    align is checked here against every row start of the actual views."""
    if not HAS_CUDA and not trainops.registry.triton_interpreting():
        pytest.skip("no Triton kernels here")
    dtype = torch.float64 if case == "float64" else torch.bfloat16
    k = 2 if case == "two_axes" else 1
    base = torch.zeros(6, 2016, dtype=dtype)
    x = {"1000": base[:, :1000].contiguous(), "1001": base[:, :1001].contiguous(),
         "1000_offset_1": base[:, 1:1001], "1000_of_1008": base[:, 8:1008],
         "strided_row": base[:, :2000:2], "transposed_batch": base.reshape(2, 3, 2016).transpose(0, 1)[..., :1000],
         "two_axes": base.reshape(6, 2, 1008), "float64": base[:, :1000].contiguous()}[case]
    shape, n = tuple(x.shape), math.prod(x.shape[x.dim() - k:])
    with trainops.backend("triton"):
        plan = trainops.plan("rms_norm", shape=shape, dtype=dtype, device="cuda" if HAS_CUDA else "cpu",
                             normalized_ndim=k, strides=(x.stride(), None))
    align = plan.kernel["align"]
    assert n % align == 0 and all(offset % align == 0 for offset in _row_offsets(x, k))
    expected = {"1000": 8, "1001": 1, "1000_offset_1": 8, "1000_of_1008": 8, "strided_row": 1,
                "transposed_batch": 8, "two_axes": 8, "float64": 2}[case]
    assert align == expected


def test_strided_weight_and_bias_are_read_correctly(backend, device):
    gen = torch.Generator().manual_seed(19)
    x = _randn((5, 16), torch.float32, device, gen)
    big = _randn((16, 2), torch.float32, device, gen, 0.5, 1.0)
    w, b = big[:, 0], big[:, 1]  # stride 2
    assert_close(trainops.rms_norm(x, w), torch_F.rms_norm(x.double(), (16,), w.double(), torch.finfo(torch.float32).eps),
                 torch.float32, "rms")
    assert_close(trainops.layer_norm(x, 16, w, b), torch_F.layer_norm(x.double(), (16,), w.double(), b.double()),
                 torch.float32, "layer")


def test_double_backward_raises(backend, device):
    x = torch.randn(4, 8, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, device=device, dtype=torch.float64, requires_grad=True)
    y = trainops.rms_norm(x, w)
    with pytest.raises(UnsupportedError, match="double backward"):
        torch.autograd.grad((y * y).sum(), x, create_graph=True)


def test_frozen_parameters_get_no_gradient_and_no_sum(backend, device):
    """A frozen weight (or bias) gets no gradient, and the backward plan sums no partials for it."""
    from trainops.plan import _PLANS
    gen = torch.Generator().manual_seed(21)
    x = _randn((9, 24), torch.float32, device, gen).requires_grad_()
    w = _randn((24,), torch.float32, device, gen, 0.5, 1.0)
    b = _randn((24,), torch.float32, device, gen)
    dy = _randn((9, 24), torch.float32, device, gen)
    for plan in (NormHeuristics(), LOOPED):
        with trainops.heuristics(plan):
            for frozen in ("weight", "bias", "both"):
                clear_plan_cache()
                wt = w.clone().requires_grad_(frozen == "bias")
                bt = b.clone().requires_grad_(frozen == "weight")
                y = trainops.layer_norm(x, 24, wt, bt)
                y.backward(dy)
                xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
                rdx, rdw, rdb = torch.autograd.grad(torch_F.layer_norm(xd, (24,), wd, bd), (xd, wd, bd), dy.double())
                assert_close(x.grad, rdx, torch.float32, f"{frozen} frozen: dx")
                assert (wt.grad is None) == (frozen != "bias") and (bt.grad is None) == (frozen != "weight")
                if wt.grad is not None:
                    assert_close(wt.grad, rdw, torch.float32, "dweight")
                if bt.grad is not None:
                    assert_close(bt.grad, rdb, torch.float32, "dbias")
                backward = [p.problem for p in _PLANS.values() if p.problem.op == "layer_norm_backward"]
                assert [(k.weight_grad, k.bias_dtype is not None) for k in backward] == \
                    [(frozen == "bias", frozen == "weight")], backward
                x.grad = None
    dx, dw, db = norm_ops.layer_norm_backward_op(dy, x.detach(), w, torch.zeros(2, 9, device=device), None, 1,
                                                 False, None, False)
    assert dw.numel() == 0 and db.numel() == 0 and dx.shape == x.shape


def test_unused_outputs_get_no_materialized_gradient(backend, device):
    """stats (and h without a residual) are not differentiable; an output nobody used costs nothing."""
    gen = torch.Generator().manual_seed(22)
    x = _randn((5, 16), torch.float32, device, gen).requires_grad_()
    r = _randn((5, 16), torch.float32, device, gen).requires_grad_()
    w = _randn((16,), torch.float32, device, gen, 0.5, 1.0).requires_grad_()
    y, h, stats = norm_ops.rms_norm_op(x, w, None, 1, None, 0.0)
    assert y.requires_grad and not stats.requires_grad and not h.requires_grad
    y, h = trainops.rms_norm(x, w, residual=r)
    dh = _randn((5, 16), torch.float32, device, gen)
    dx, dr, dw = torch.autograd.grad(h, (x, r, w), dh, retain_graph=True)  # only the residual stream used
    assert torch.equal(dx, dh) and torch.equal(dr, dh) and torch.equal(dw, torch.zeros_like(dw))
    dy = _randn((5, 16), torch.float32, device, gen)
    dx, dw = torch.autograd.grad(y, (x, w), dy)  # only y used: dh is None, not a tensor of zeros
    hd, wd = (x.detach() + r.detach()).double().requires_grad_(), w.detach().double().requires_grad_()
    rdx, rdw = torch.autograd.grad(reference("rms_norm", hd, wd, None, None, torch.finfo(torch.float32).eps, 0.0, 1)[0],
                                   (hd, wd), dy.double())
    assert_close(dx, rdx, torch.float32, "dx")
    assert_close(dw, rdw, torch.float32, "dweight")


def test_rows_of_length_zero_have_the_same_statistics_on_every_backend(backend, device):
    for op, expected in (("rms_norm", [[math.nan] * 3]), ("layer_norm", [[0.0] * 3, [math.nan] * 3])):
        p = trainops.plan(op, shape=(3, 0), dtype=torch.float32, device=device)
        y, h, stats = p.run(torch.randn(3, 0, device=device), None, None, None)
        assert y.shape == (3, 0)
        assert torch.equal(stats.isnan(), torch.tensor(expected).isnan()), (op, stats)
        assert torch.equal(stats.nan_to_num(), torch.tensor(expected).nan_to_num()), (op, stats)


def test_bias_without_weight_and_low_precision_weights(backend, device):
    gen = torch.Generator().manual_seed(23)
    x = _randn((6, 2, 20), torch.bfloat16, device, gen, 2.0, 0.5).requires_grad_()
    for wdtype in (torch.bfloat16, torch.float16):
        for with_weight in (False, True):
            w = _randn((20,), wdtype, device, gen, 0.5, 1.0).requires_grad_() if with_weight else None
            b = _randn((20,), wdtype, device, gen).requires_grad_()
            y = trainops.layer_norm(x, 20, w, b)
            dy = _randn((6, 2, 20), torch.bfloat16, device, gen)
            leaves = [t for t in (x, w, b) if t is not None]
            grads = torch.autograd.grad(y, leaves, dy)
            dl = [t.detach().double().requires_grad_() for t in leaves]
            xd, wd, bd = dl[0], (dl[1] if with_weight else None), dl[-1]
            ry = torch_F.layer_norm(xd, (20,), wd, bd)
            assert_close(y, ry, torch.bfloat16, f"{wdtype} w={with_weight} y")
            for got, want, t in zip(grads, torch.autograd.grad(ry, dl, dy.double()), leaves):
                assert got.dtype == t.dtype
                assert_close(got, want, t.dtype if t.dtype != torch.float16 else torch.bfloat16, "grad")


def test_strided_inputs_are_not_copied(backend, device, monkeypatch):
    """Views whose normalized axis walks as one strided axis reach the kernels as they are."""
    copies = []
    original = torch.Tensor.contiguous

    def spy(self, *args, **kwargs):
        if not self.is_contiguous(*args, **kwargs):
            copies.append(tuple(self.shape))
        return original(self, *args, **kwargs)
    gen = torch.Generator().manual_seed(24)
    xs = [make_input((6, 5, 24), layout, torch.float32, device, gen).requires_grad_()
          for layout in ("transposed", "strided_row", "expanded", "offset")]
    w = _randn((24,), torch.float32, device, gen).requires_grad_()
    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    for x in xs:
        y, h = trainops.rms_norm(x, w, residual=make_input((6, 5, 24), "transposed", torch.float32, device, gen))
        torch.autograd.grad((y, h), (x, w), (make_input((6, 5, 24), "strided_row", torch.float32, device, gen),
                                             make_input((6, 5, 24), "transposed", torch.float32, device, gen)))
    assert copies == []
    x = _randn((4, 6, 4), torch.float32, device, gen).transpose(1, 2)  # 2 normalized axes that do not walk
    trainops.layer_norm(x, (4, 6))
    assert copies[-1] == (4, 4, 6), "a view whose normalized axes do not walk as one is copied (and said so)"


def test_rms_norm_module_checks_its_shape_and_starts_at_scale_one(backend, device):
    m = trainops.nn.RMSNorm((3, 8), elementwise_affine=False, device=device)
    with pytest.raises(InvalidProblemError, match="'x' has shape"):
        m(torch.randn(4, 2, 8, device=device))
    with pytest.raises(InvalidProblemError, match="'weight_offset' is 1.0, but elementwise_affine=False"):
        trainops.nn.RMSNorm(8, elementwise_affine=False, weight_offset=1.0)
    gemma = trainops.nn.RMSNorm(8, weight_offset=1.0, device=device)
    assert torch.equal(gemma.weight.detach(), torch.zeros(8, device=device))  # (1 + w) = 1, as Gemma starts
    x = torch.randn(4, 8, device=device)
    assert_close(gemma(x), torch_F.rms_norm(x, (8,)), torch.float32, "new Gemma module")
    gemma.reset_parameters()
    assert torch.equal(gemma.weight.detach(), torch.zeros(8, device=device))
    with pytest.raises(InvalidProblemError, match="'weight' is \\(8,\\): trainops.rms_norm takes"):
        trainops.rms_norm(x, (8,), None)


def test_row_alignment_counts_every_operand_of_the_backward_and_the_residual():
    """The least aligned operand decides: dy rows of 1000 (8), h a slice of rows of 2016 (8), the
    gradient of h a slice of rows of 1004 (4 bf16 elements: 8 bytes)."""
    if not HAS_CUDA and not trainops.registry.triton_interpreting():
        pytest.skip("no Triton kernels here")
    device = "cuda" if HAS_CUDA else "cpu"
    with trainops.backend("triton"):
        mixed = trainops.plan("rms_norm_backward", shape=(6, 1000), dtype=torch.bfloat16, device=device,
                              has_residual=True, strides=((1000, 1), (2016, 1), (1004, 1)))
        aligned = trainops.plan("rms_norm_backward", shape=(6, 1000), dtype=torch.bfloat16, device=device,
                                has_residual=True, strides=((1000, 1), (2016, 1), (1008, 1)))
        residual = trainops.plan("layer_norm", shape=(6, 1000), dtype=torch.bfloat16, device=device,
                                 has_residual=True, strides=((1000, 1), (1002, 1)))
    assert (mixed.kernel["align"], aligned.kernel["align"], residual.kernel["align"]) == (4, 8, 2)


def _triton_plan(op, n, rows=4096, dtype=torch.bfloat16, heuristics=None):
    if not HAS_CUDA and not trainops.registry.triton_interpreting():
        pytest.skip("no Triton kernels here")
    with trainops.backend("triton"):
        return trainops.plan(op, shape=(rows, n), dtype=dtype, device="cuda" if HAS_CUDA else "cpu",
                             weight_dtype=torch.float32, heuristics=heuristics)


def test_wide_backwards_take_the_exchange_plan_and_stay_whole_under_inductor():
    """LayerNorm backwards over rows of more than 8192 elements, RMSNorm ones over more than 16384,
    cut into chunks of 4096 (NOTES "Wide rows"); forwards keep the fused or looped plan; with the
    exchange off (or more chunks than SMs) the backward loops, 4 rows a step. An exchange backward
    is not inlined into a compiled graph (its grid follows the kernel's occupancy)."""
    def sms():
        return trainops.heuristics(NormHeuristics(sms=132))
    with sms():
        assert _triton_plan("layer_norm_backward", 16384).kernel["plan"] == "exchange"
        assert _triton_plan("layer_norm_backward", 16384).kernel["splits"] == 4
        assert _triton_plan("layer_norm_backward", 8192).kernel["plan"] == "fused"
        assert _triton_plan("rms_norm_backward", 16384).kernel["plan"] == "fused"
        plan = _triton_plan("rms_norm_backward", 20000, dtype=torch.float32)
        assert (plan.kernel["plan"], plan.kernel["splits"], plan.kernel["num_warps"]) == ("exchange", 5, 4)
        looped = _triton_plan("layer_norm", 20000).kernel
        assert (looped["plan"], looped["BLOCK_M"], looped["num_warps"]) == ("looped", 2, 8)
    for off in (NormHeuristics(sms=132, row_exchange=False), NormHeuristics(sms=4)):
        plan = _triton_plan("layer_norm_backward", 20000, heuristics=off).kernel
        assert (plan["plan"], plan["BLOCK_M"], plan["num_warps"]) == ("looped", 4, 16)
    args = norm_ops.rms_norm_backward_op._by_name
    dy = torch.empty((4, 20000), dtype=torch.bfloat16, device="meta")
    with sms():
        assert not norm_ops._inlinable("rms_norm")(args(dy, dy, None, dy, None, 1, 0.0))
        assert norm_ops._inlinable("rms_norm")(args(dy[:, :16384], dy, None, dy, None, 1, 0.0))
        assert not norm_ops._inlinable("layer_norm")(norm_ops.layer_norm_backward_op._by_name(
            dy[:, :16384], dy, None, dy, None, 1, False, None))


def test_the_exchange_cases_take_the_exchange_plan_and_empty_batches_of_wide_rows_work(backend, device):
    """The EXCHANGE heuristics reach the exchange backward on every case they test (CPU: 4 SMs), and
    a wide row with no rows at all gives zero weight and bias gradients (the plan sizes its
    workspace without dividing by the rows)."""
    if backend == "triton":
        for shape, k in PLAN_CASES["exchange"]:
            n = math.prod(shape[len(shape) - k:])
            for op in ("rms_norm_backward", "layer_norm_backward"):
                plan = trainops.plan(op, shape=shape, dtype=torch.float32, device=device, normalized_ndim=k,
                                     weight_dtype=torch.float32, heuristics=EXCHANGE)
                assert plan.kernel["plan"] == "exchange" and plan.kernel["splits"] == -(-n // 16), (shape, op)
    wide = NormHeuristics(exchange_above=16, rms_exchange_above=16, exchange_tile=16, sms=8)
    x = torch.randn(0, 100, device=device, requires_grad=True)
    w = torch.randn(100, device=device, requires_grad=True)
    b = torch.randn(100, device=device, requires_grad=True)
    with trainops.heuristics(wide):
        dx, dw, db = torch.autograd.grad(trainops.layer_norm(x, 100, w, b).sum(), (x, w, b))
        assert dx.shape == (0, 100) and torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))
        dx, dw = torch.autograd.grad(trainops.rms_norm(x, w).sum(), (x, w))
        assert torch.equal(dw, torch.zeros_like(w))


def test_default_plans_follow_the_measured_rule():
    """NormHeuristics' defaults (measured on the H200, NOTES "Normalization's tiles and odd widths")."""
    def kernel(op, n, dtype=torch.bfloat16):
        plan = _triton_plan(op, n, dtype=dtype)
        k = plan.kernel
        if op.endswith("backward"):
            return k["BLOCK_M"], k["num_warps"], k["stages"], k["programs"]
        return k["BLOCK_M"], k["num_warps"]
    sms = trainops.registry.sm_count(torch.device("cuda" if HAS_CUDA else "cpu"))

    def programs(per_sm, block_m, rows=4096):  # the plan's split of 4096 rows over per_sm programs a SM
        per_program = -(-max(block_m, -(-rows // (sms * per_sm))) // block_m) * block_m
        return -(-rows // per_program)
    # forward: 8192 units a program, at least 2 rows of a 2-byte dtype; 4 warps up to 2048 units and at 8192
    assert kernel("rms_norm", 768) == (8, 4)
    assert kernel("rms_norm", 2048) == (4, 4)
    assert kernel("rms_norm", 4096) == (2, 8)
    assert kernel("rms_norm", 5120) == (2, 4)                     # a row block of 8192
    assert kernel("layer_norm", 16384) == (2, 8)
    assert kernel("rms_norm", 4096, torch.float32) == (1, 4)      # 8192 units: one row, 4 warps
    assert kernel("rms_norm", 768, torch.float32) == (4, 4)
    # backward: 8192 units a step, 8 warps, 3 stages, one program a SM; 16384 units: 32 warps, 1 stage
    assert kernel("rms_norm_backward", 4096) == (2, 8, 3, programs(1, 2))
    assert kernel("layer_norm_backward", 8192) == (1, 8, 3, programs(1, 1))
    assert kernel("rms_norm_backward", 16384) == (1, 32, 1, programs(1, 1))   # LayerNorm's: the exchange
    assert kernel("rms_norm_backward", 4096, torch.float32) == (1, 8, 3, programs(1, 1))
    assert kernel("rms_norm_backward", 8192, torch.float32) == (1, 32, 1, programs(1, 1))
    # small rows (row blocks of 1024 elements or less): 4096 elements a step, 4 warps, 2 programs a SM
    assert kernel("rms_norm_backward", 768) == (4, 4, 3, programs(2, 4))
    assert kernel("rms_norm_backward", 768, torch.float32) == (4, 4, 3, programs(2, 4))


def test_heuristics_tables_need_only_reach_the_blocks_they_serve():
    """warps steps serve fused row blocks (up to next_pow2(fused_max)); stages serve looped chunks too."""
    # float32: an element is 2 units, so a fused row block of 1024 looks the tables up at 2048
    plan = _triton_plan("rms_norm", 64, rows=8, dtype=torch.float32,
                        heuristics=NormHeuristics(fused_max=1024, warps=((2048, 4),), backward_warps=((2048, 8),)))
    assert plan.kernel["num_warps"] == 4
    with pytest.raises(InvalidProblemError, match="heuristics.*backward_stages"):
        _triton_plan("rms_norm_backward", 64, rows=8, dtype=torch.float32,
                     heuristics=NormHeuristics(fused_max=1024, chunk=4096, backward_stages=((2048, 3),)))
    with pytest.raises(InvalidProblemError, match="heuristics.*warps"):
        _triton_plan("rms_norm", 64, rows=8, dtype=torch.float32,
                     heuristics=NormHeuristics(fused_max=1024, warps=((1024, 4),)))


@pytest.mark.parametrize("field,value", [("forward_tile", 3000), ("forward_rows", 0), ("forward_rows", 3),
                                         ("backward_programs_per_sm", 0), ("warps", ((1 << 62, 64),)),
                                         ("warps", ((4096, 8),)), ("backward_warps", ((1 << 62, 3),)),
                                         ("backward_stages", 3), ("backward_stages", ((1 << 62, 0),)),
                                         ("warps", ((4096, 8.0), (1 << 62, 8))), ("exchange_tile", 3000),
                                         ("exchange_warps", 64), ("looped_backward_warps", 64),
                                         ("exchange_above", 0), ("exchange_programs_per_sm", 0),
                                         ("looped_backward_rows", 3), ("step_sums", -1), ("step_sums", True)])
def test_bad_heuristics_are_refused_by_name(field, value):
    with pytest.raises(InvalidProblemError, match=f"heuristics.*{field}"):
        _triton_plan("rms_norm_backward", 64, rows=8, dtype=torch.float32, heuristics=NormHeuristics(**{field: value}))
