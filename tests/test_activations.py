"""Activations (gelu, quick_gelu, silu, bias_gelu, swiglu, geglu): forward and backward on every backend
against float64 references; plans forced on small shapes; layouts read in place; special values;
gradcheck; torch.compile; modules; the bias gradient's determinism; errors."""

import importlib
import inspect
import math
import threading

import pytest
import torch
import torch.nn.functional as torch_F

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import activations as act_ops
from trainops.ops.activations import ActivationHeuristics
from trainops.plan import clear_plan_cache

PLAN_CACHE = importlib.import_module("trainops.plan")._PLANS  # (op, backend, descriptor) -> Plan

from conftest import HAS_CUDA
from numerics import FLOATS, TOLERANCE, assert_close, poison_new_output, relative_error

# small shapes that still force many programs, tiles of several rows and column blocks, int64 offsets
SMALL = ActivationHeuristics(block=64, bias_programs_per_sm=1, reduce_block=8, reduce_parts=2)
INT64 = ActivationHeuristics(block=128, int64_from=0)
PLANS = {"default": ActivationHeuristics(), "small": SMALL, "int64": INT64}

# name -> (op, approximate)
SPECS = {
    "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "quick_gelu": ("quick_gelu", None),
    "silu": ("silu", None), "bias_gelu": ("bias_gelu", "none"), "bias_gelu_tanh": ("bias_gelu", "tanh"),
    "swiglu": ("swiglu", None), "geglu": ("geglu", "tanh"), "geglu_none": ("geglu", "none"),
}
INF = float("inf")


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN, so an element left unwritten fails the test."""
    poison_new_output(monkeypatch, act_ops.ActivationProblem)
    clear_plan_cache()
    yield
    clear_plan_cache()


def _randn(shape, dtype, device, gen, scale=2.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def act64(x, op, approximate):
    """The activation in float64 through torch's own functions."""
    if op in ("gelu", "bias_gelu", "geglu"):
        return torch_F.gelu(x, approximate=approximate)
    if op == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return torch_F.silu(x)


def reference(spec, a, b):
    """The float64 result of ``spec`` on (a, b) (b: bias or up; None for unary and packed ops)."""
    op, approximate = SPECS[spec]
    a = a.double()
    if op == "bias_gelu":
        return act64(a + b.double(), op, approximate)
    if op in ("swiglu", "geglu"):
        gate, up = (a, b.double()) if b is not None else a.chunk(2, -1)
        return act64(gate, op, approximate) * up
    return act64(a, op, approximate)


def call(spec, a, b=None):
    op, approximate = SPECS[spec]
    if op == "gelu":
        return trainops.gelu(a, approximate)
    if op in ("quick_gelu", "silu"):
        return getattr(trainops, op)(a)
    if op == "bias_gelu":
        return trainops.bias_gelu(a, b, approximate)
    if op == "swiglu":
        return trainops.swiglu(a, b)
    return trainops.geglu(a, b, approximate)


def second_input(spec, a_shape, dtype, device, gen):
    op = SPECS[spec][0]
    if op == "bias_gelu":
        return _randn(a_shape[-1:], dtype, device, gen, 1.0)
    if op in ("swiglu", "geglu"):
        return _randn(a_shape, dtype, device, gen)
    return None


def check_forward_backward(spec, a, b, dtype, what, dy=None, gen=None):
    """y and every gradient against float64 autograd of the reference on the same inputs."""
    leaves = [t for t in (a, b) if t is not None]
    for t in leaves:
        t.requires_grad_()
    kept = [t.detach().clone() for t in leaves]
    y = call(spec, a, b)
    ref = reference(spec, a.detach(), None if b is None else b.detach())
    assert y.dtype == dtype and y.is_contiguous()
    assert_close(y, ref, dtype, f"{what} y")
    if dy is None:
        dy = _randn(y.shape, dtype, y.device, gen)
    kept_dy = dy.clone()
    grads = torch.autograd.grad(y, leaves, dy)
    assert torch.equal(dy, kept_dy) and all(torch.equal(t, k) for t, k in zip(leaves, kept)), \
        f"{what}: an input or dy was written"
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_grads = torch.autograd.grad(reference(spec, *ref_leaves, *([None] * (2 - len(leaves)))), ref_leaves,
                                    dy.double())
    for name, got, want in zip(("a", "b"), grads, ref_grads):
        assert got.dtype == dtype and got.shape == want.shape
        assert_close(got, want, dtype, f"{what} d{name}")


# ---- every op x dtype x backend x plan -------------------------------------------------------------

@pytest.mark.parametrize("spec", sorted(SPECS))
def test_forward_and_backward_match_float64(backend, device, spec):
    gen = torch.Generator().manual_seed(sum(map(ord, spec)))
    for plan in ("default", "small") if backend == "triton" else ("default",):
        with trainops.heuristics(PLANS[plan]):
            for dtype in FLOATS:
                shape = (3, 5, 24) if plan == "default" else (7, 40)
                a = _randn(shape, dtype, device, gen)
                b = second_input(spec, shape, dtype, device, gen)
                check_forward_backward(spec, a, b, dtype, f"{spec} {dtype} {plan}", gen=gen)


@pytest.mark.parametrize("spec", ["swiglu", "geglu"])
def test_packed_gate_and_up_halves(backend, device, spec):
    """One tensor holding gate and up on its last axis: read in place, one gradient of its shape."""
    gen = torch.Generator().manual_seed(3)
    for plan in ("default", "small"):
        with trainops.heuristics(PLANS[plan]):
            for dtype in (torch.float32, torch.bfloat16):
                x = _randn((2, 3, 2 * 20), dtype, device, gen)
                check_forward_backward(spec, x, None, dtype, f"packed {spec} {dtype} {plan}", gen=gen)
                strided = _randn((3, 2, 2 * 2 * 12), dtype, device, gen)[..., ::2].transpose(0, 1)  # no unit stride
                check_forward_backward(spec, strided, None, dtype, f"packed strided {spec} {dtype} {plan}", gen=gen)
                x.grad = None
                y = call(spec, x)
                assert y.shape == (2, 3, 20)
                y.backward(torch.ones_like(y))
                assert x.grad.shape == x.shape and x.grad.is_contiguous()


# ---- layouts: read in place, never copied -------------------------------------------------------------

def make_input(shape, layout, dtype, device, gen):
    """A tensor of ``shape`` laid out as named."""
    if layout == "contiguous":
        return _randn(shape, dtype, device, gen)
    if layout == "transposed":  # leading axes swapped
        return _randn((shape[1], shape[0]) + tuple(shape[2:]), dtype, device, gen).transpose(0, 1)
    if layout == "last_transposed":  # the last axis strided by the rows
        return _randn(tuple(shape[:-2]) + (shape[-1], shape[-2]), dtype, device, gen).transpose(-1, -2)
    if layout == "strided":  # the last axis has stride 3
        return _randn(tuple(shape[:-1]) + (3 * shape[-1],), dtype, device, gen)[..., ::3]
    if layout == "expanded":  # a broadcast batch axis (stride 0)
        return _randn((1,) + tuple(shape[1:]), dtype, device, gen).expand(shape)
    if layout == "offset":
        return _randn((math.prod(shape) + 5,), dtype, device, gen)[5:].view(shape)
    if layout == "scrambled":  # five batch axes in an order no two of which merge: host launches
        base = _randn((2, 3, 2, 3, 2) + tuple(shape[-1:]), dtype, device, gen)
        return base.permute(3, 0, 4, 1, 2, 5)
    raise ValueError(layout)


LAYOUT_SHAPE = {"scrambled": (3, 2, 2, 3, 2, 8)}


@pytest.fixture
def no_copies(monkeypatch):
    """Fail if the op makes a contiguous copy of a strided input on the host."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("activations must read strided inputs in place (.contiguous() called)")
    monkeypatch.setattr(torch.Tensor, "contiguous", refuse)


@pytest.mark.parametrize("layout", ["transposed", "last_transposed", "strided", "expanded", "offset", "scrambled"])
def test_strided_inputs_are_read_in_place(backend, device, layout, no_copies):
    gen = torch.Generator().manual_seed(5)
    shape = LAYOUT_SHAPE.get(layout, (4, 6, 10))
    for spec in ("gelu", "bias_gelu", "swiglu"):
        for plan in ("default", "small"):
            with trainops.heuristics(PLANS[plan]):
                a = make_input(shape, layout, torch.float32, device, gen)
                b = second_input(spec, shape, torch.float32, device, gen)
                if spec == "swiglu":
                    b = make_input(shape, "transposed", torch.float32, device, gen)  # gate and up: other strides
                if spec == "bias_gelu":
                    b = _randn((shape[-1], 2), torch.float32, device, gen)[:, 1]   # a stride-2 bias
                dy = make_input(shape, "strided", torch.float32, device, gen)     # a strided upstream gradient
                check_forward_backward(spec, a, b, torch.float32, f"{spec} {layout} {plan}", dy=dy)
    if backend == "triton" and layout == "scrambled":
        p = trainops.plan("gelu", shape=a.shape, dtype=a.dtype, device=a.device, strides=(a.stride(),))
        assert p.kernel["plan"] == "strided" and p.kernel["host_launches"] > 1


def test_explicit_halves_views_and_expanded_upstream_gradient(backend, device):
    gen = torch.Generator().manual_seed(6)
    x = _randn((5, 2 * 12), torch.float32, device, gen).requires_grad_()
    y = trainops.swiglu(x[:, :12], x[:, 12:])  # two views of one tensor: autograd adds their gradients into x
    y.sum().backward()  # dy is an expanded (stride 0) tensor
    xd = x.detach().double().requires_grad_()
    (torch_F.silu(xd[:, :12]) * xd[:, 12:]).sum().backward()
    assert_close(y, torch_F.silu(x.detach().double()[:, :12]) * x.detach().double()[:, 12:], torch.float32, "y")
    assert_close(x.grad, xd.grad, torch.float32, "dx")


@trainops.backend("triton")
def test_contiguous_inputs_take_the_flat_plan():
    device = "cuda" if HAS_CUDA else "cpu"
    flat = trainops.plan("swiglu", shape=(64, 96), dtype=torch.bfloat16, device=device)
    assert flat.kernel["plan"] == "flat" and flat.kernel["BLOCK"] == 4096 and not flat.kernel["int64"]
    # a numel that is not a multiple of 16 (4,097,000 is 8 mod 16): whole blocks unmasked, the last one
    # masked apart (test_compile_for_gpu: their accesses vectorise); a multiple of 16 keeps one path
    assert not flat.kernel["tail_apart"]
    for op in ("swiglu", "swiglu_backward"):
        odd = trainops.plan(op, shape=(4097, 1000), dtype=torch.float16, device=device)
        assert odd.kernel["plan"] == "flat" and odd.kernel["tail_apart"], odd.kernel
    packed = trainops.plan("swiglu", shape=(64, 96), dtype=torch.bfloat16, device=device, packed=True,
                           strides=((96, 1), None))
    assert packed.kernel["plan"] == "strided" and packed.kernel["BLOCK_C"] == 16  # 48 columns: 3 blocks of 16
    bias = trainops.plan("bias_gelu_backward", shape=(64, 96), dtype=torch.float32, device=device)
    assert bias.kernel["plan"] == "strided" and bias.workspace_bytes > 0 and bias.precision.bitwise_reproducible


def test_int64_offsets(backend, device):
    """The int64 offset path (taken from 2^31 elements) on small tensors, every kernel."""
    gen = torch.Generator().manual_seed(7)
    with trainops.heuristics(INT64):
        for spec in ("gelu_tanh", "bias_gelu", "swiglu"):
            a = make_input((6, 40), "transposed" if spec == "swiglu" else "contiguous", torch.float32, device, gen)
            check_forward_backward(spec, a, second_input(spec, (6, 40), torch.float32, device, gen), torch.float32,
                                   f"int64 {spec}", gen=gen)
        if backend == "triton":
            assert trainops.plan("gelu", shape=(6, 40), dtype=torch.float32, device=device).kernel["int64"]


def test_rank0_empty_and_length_one(backend, device):
    gen = torch.Generator().manual_seed(8)
    for spec in ("gelu", "silu", "bias_gelu"):
        x = _randn((), torch.float32, device, gen)
        b = _randn((), torch.float32, device, gen) if spec == "bias_gelu" else None
        check_forward_backward(spec, x, b, torch.float32, f"0-d {spec}", gen=gen)
    for spec in ("gelu_tanh", "bias_gelu", "swiglu"):
        for shape in ((0, 5), (3, 0), (1, 1)):
            a = _randn(shape, torch.float32, device, gen).requires_grad_()
            b = second_input(spec, shape, torch.float32, device, gen)
            b = None if b is None else b.requires_grad_()
            y = call(spec, a, b)
            assert y.shape == shape
            grads = torch.autograd.grad(y, [t for t in (a, b) if t is not None], torch.ones(shape, device=device))
            if spec == "bias_gelu" and shape[0] == 0:
                assert torch.equal(grads[1], torch.zeros(shape[1], device=device))  # a sum of no rows
            if shape == (1, 1):
                check_forward_backward(spec, a.detach(), None if b is None else b.detach(), torch.float32, spec,
                                       gen=gen)
    x = torch.empty(4, 0, device=device, requires_grad=True)  # packed, nothing in either half
    y = trainops.swiglu(x)
    assert y.shape == (4, 0)
    assert torch.autograd.grad(y.sum(), x)[0].shape == (4, 0)


# ---- special values ---------------------------------------------------------------------------------------

SPECIAL = [-INF, INF, float("nan"), -3e38, 3e38, -1e4, 1e4, -89.0, 89.0, -20.0, 20.0, -5.0, -0.5, 0.0, 1.5, 7.0]


def limits64(x, op, approximate):
    """(f, f') in float64: torch's values where finite, the limits at +-inf (torch gives NaN there)."""
    xd = x.double().detach().requires_grad_()
    f = act64(xd, op, approximate)
    df, = torch.autograd.grad(f.sum(), xd)
    f, df = f.detach().clone(), df.clone()
    f[xd.detach() == -INF], f[xd.detach() == INF] = 0.0, INF
    df[xd.detach() == -INF], df[xd.detach() == INF] = 0.0, 1.0
    return f, df


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_special_values_match_torch_float64_and_limits(backend, device, dtype):
    x = torch.tensor(SPECIAL, dtype=dtype).to(device)
    dy = torch.linspace(-2, 2, len(SPECIAL), dtype=dtype).to(device)
    for spec in ("gelu", "gelu_tanh", "quick_gelu", "silu"):
        op, approximate = SPECS[spec]
        f, df = limits64(x, op, approximate)
        xr = x.clone().requires_grad_()
        y = call(spec, xr)
        dx, = torch.autograd.grad(y, xr, dy)
        assert_close(y, f, dtype, f"{spec} y")
        assert_close(dx, dy.double() * df, dtype, f"{spec} dx")
        assert y[0] == 0 and not y[0].isnan(), f"{spec}(-inf) must be 0"
    # gated: gate takes the special values, up finite; and up = +-inf where silu(gate) = 0 gives NaN (0 * inf)
    up = torch.linspace(0.25, 1, len(SPECIAL), dtype=dtype).to(device)  # |f * up| stays in range
    for spec in ("swiglu", "geglu"):
        op, approximate = SPECS[spec]
        f, df = limits64(x, op, approximate)
        g, u = x.clone().requires_grad_(), up.clone().requires_grad_()
        y = call(spec, g, u)
        dg, du = torch.autograd.grad(y, (g, u), dy)
        assert_close(y, f * up.double(), dtype, f"{spec} y")
        assert_close(dg, dy.double() * up.double() * df, dtype, f"{spec} dgate")
        assert_close(du, dy.double() * f, dtype, f"{spec} dup")
        zero_gate = torch.zeros(2, dtype=dtype, device=device)
        assert call(spec, zero_gate, torch.tensor([INF, 1.0], dtype=dtype, device=device))[0].isnan()


def test_constants_are_torchs():
    """The literals written in the kernels are the module's constants (torch's math.h products)."""
    module = inspect.getsource(act_ops)
    source = module[module.index("def _act("):module.index("def _act_fwd_flat(")]
    for value in (act_ops.M_SQRT1_2, act_ops.K_BETA_ERF, act_ops.K_BETA_TANH, act_ops.K_KAPPA, 3 * act_ops.K_KAPPA,
                  act_ops.QUICK_GELU_ALPHA):
        assert repr(value) in source, value
    assert act_ops.K_BETA_ERF == pytest.approx(1 / math.sqrt(2 * math.pi), rel=1e-15)
    assert act_ops.K_BETA_TANH == pytest.approx(math.sqrt(2 / math.pi), rel=1e-15)


# ---- gradients: gradcheck, determinism, what is computed ----------------------------------------------------

def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(9)
    with trainops.backend("cpu"):
        x = _randn((3, 4), torch.float64, "cpu", gen).requires_grad_()
        b = _randn((4,), torch.float64, "cpu", gen).requires_grad_()
        u = _randn((3, 4), torch.float64, "cpu", gen).requires_grad_()
        for spec in ("gelu", "gelu_tanh", "quick_gelu", "silu"):
            assert torch.autograd.gradcheck(lambda t: call(spec, t), (x,)), spec
        for spec in ("bias_gelu", "bias_gelu_tanh", "swiglu", "geglu", "geglu_none"):
            assert torch.autograd.gradcheck(lambda s, t: call(spec, s, t), (x, b if spec.startswith("bias") else u))
        assert torch.autograd.gradcheck(lambda t: trainops.swiglu(t), (x,))
        assert torch.autograd.gradcheck(lambda t: trainops.geglu(t, approximate="none"), (x,))


def test_bias_gradient_is_bit_identical_run_to_run(backend, device):
    gen = torch.Generator().manual_seed(10)
    x = _randn((10, 3, 24), torch.float32, device, gen).requires_grad_()
    bias = _randn((24,), torch.float32, device, gen).requires_grad_()
    dy = _randn((10, 3, 24), torch.float32, device, gen)
    for plan in ("default", "small"):
        with trainops.heuristics(PLANS[plan]):
            first = torch.autograd.grad(trainops.bias_gelu(x, bias), (x, bias), dy)
            again = torch.autograd.grad(trainops.bias_gelu(x, bias), (x, bias), dy)
            assert all(torch.equal(p, q) for p, q in zip(first, again)), plan
            xd, bd = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
            ref = torch.autograd.grad(torch_F.gelu(xd + bd), (xd, bd), dy.double())
            assert_close(first[1], ref[1], torch.float32, f"dbias {plan}")
            if backend == "triton" and plan == "small":
                p = trainops.plan("bias_gelu_backward", shape=x.shape, dtype=x.dtype, device=x.device)
                assert p.workspace_bytes >= 2 * 24 * 4, "several partial rows summed by the second kernel"


def test_bias_of_another_float_dtype(backend, device):
    """bias_gelu's bias in any float dtype (float32 master weights beside a bfloat16 input under
    autocast): read in the accumulator dtype; y and dx in the input's dtype, dbias in the bias's."""
    gen = torch.Generator().manual_seed(12)
    pairs = ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float64),
             (torch.float64, torch.float32))
    for plan in ("default", "small") if backend == "triton" else ("default",):
        with trainops.heuristics(PLANS[plan]):
            for x_dtype, b_dtype in pairs:
                what = f"x {x_dtype} bias {b_dtype} {plan}"
                x = _randn((6, 5, 24), x_dtype, device, gen).requires_grad_()
                bias = _randn((24,), b_dtype, device, gen, 1.0).requires_grad_()
                dy = _randn((6, 5, 24), x_dtype, device, gen)
                y = trainops.bias_gelu(x, bias)
                dx, dbias = torch.autograd.grad(y, (x, bias), dy)
                assert (y.dtype, dx.dtype, dbias.dtype) == (x_dtype, x_dtype, b_dtype), what
                xd, bd = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
                ref = torch_F.gelu(xd + bd)
                ref_dx, ref_dbias = torch.autograd.grad(ref, (xd, bd), dy.double())
                assert_close(y, ref, x_dtype, f"{what} y")
                assert_close(dx, ref_dx, x_dtype, f"{what} dx")
                # dbias: from dx in the accumulator (not rounded to x's dtype), rounded once to the bias's
                acc = torch.float64 if x_dtype == torch.float64 else torch.float32
                assert_close(dbias, ref_dbias, max(acc, b_dtype, key=TOLERANCE.get), f"{what} dbias")
    compiled = torch.compile(lambda t, b: trainops.bias_gelu(t, b), fullgraph=True, backend="aot_eager")
    x = _randn((4, 8), torch.bfloat16, device, gen)
    bias = _randn((8,), torch.float32, device, gen, 1.0).requires_grad_()
    dbias, = torch.autograd.grad(compiled(x, bias).sum(), bias)
    assert dbias.dtype == torch.float32
    torch._dynamo.reset()


def test_gradients_only_for_inputs_that_need_them(backend, device):
    gen = torch.Generator().manual_seed(11)
    gate, up = _randn((4, 8), torch.float32, device, gen), _randn((4, 8), torch.float32, device, gen)
    bias = _randn((8,), torch.float32, device, gen)
    gate_t = _randn((8, 4), torch.float32, device, gen).t()  # the strided plan
    for spec, a, b, needs in (("swiglu", gate, up.clone().requires_grad_(), (False, True)),
                              ("swiglu", gate_t, up.clone().requires_grad_(), (False, True)),
                              ("geglu", gate_t.clone().requires_grad_(), up, (True, False)),
                              ("geglu", gate.clone().requires_grad_(), up, (True, False)),
                              ("bias_gelu", gate.clone().requires_grad_(), bias, (True, False)),
                              ("bias_gelu", gate, bias.clone().requires_grad_(), (False, True))):
        clear_plan_cache()
        y = call(spec, a, b)
        leaf = a if a.requires_grad else b
        dy = torch.linspace(-1, 1, y.numel(), device=device).view(y.shape)
        grad, = torch.autograd.grad(y, leaf, dy)
        assert torch.equal(dy, torch.linspace(-1, 1, y.numel(), device=device).view(y.shape)), "dy was written"
        ad, bd = (t.detach().double().requires_grad_() for t in (a, b))
        want, = torch.autograd.grad(reference(spec, ad, bd), ad if leaf is a else bd, dy.double())
        assert_close(grad, want, torch.float32, spec)
        used = [key[2] for key in PLAN_CACHE if key[0] == f"{SPECS[spec][0]}_backward"]
        assert [d.needs for d in used] == [needs], spec
    dg, du = act_ops.swiglu_backward_op(torch.ones(4, 8, device=device), gate, up, False, True)
    assert dg.numel() == 0 and du.shape == (4, 8)
    assert_close(du, torch_F.silu(gate.double()), torch.float32, "dup")


def test_double_backward_raises(backend, device):
    x = torch.randn(4, 8, device=device, dtype=torch.float64, requires_grad=True)
    y = trainops.gelu(x)
    with pytest.raises(UnsupportedError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_backward_plans_with_the_forward_heuristics_on_any_thread(backend, device):
    x = torch.randn(6, 40, device=device, requires_grad=True)
    with trainops.heuristics(SMALL):
        y = trainops.swiglu(x)
    clear_plan_cache()

    def run_backward():
        with trainops.backend(backend):  # the thread's own context: the backend pinned, no heuristics
            y.backward(torch.ones_like(y))
    worker = threading.Thread(target=run_backward)
    worker.start()
    worker.join()
    used = [key[2].heuristics for key in PLAN_CACHE if key[0] == "swiglu_backward"]
    assert used == [SMALL] and x.grad.isfinite().all()


# ---- torch.compile, modules, plan API ---------------------------------------------------------------------

def test_torch_compile_fullgraph(backend, device):
    gen = torch.Generator().manual_seed(13)
    x = _randn((4, 16), torch.float32, device, gen).requires_grad_()
    w = _randn((16,), torch.float32, device, gen).requires_grad_()

    def block(x, w):
        h = trainops.bias_gelu(x, w, "tanh") + trainops.gelu(x) + trainops.silu(x) + trainops.quick_gelu(x)
        return (trainops.swiglu(torch.cat([h, x], -1)) * trainops.geglu(h, x)).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    loss = compiled(x, w)
    grads = torch.autograd.grad(loss, (x, w))
    torch._dynamo.reset()
    eager_loss = block(x, w)
    eager_grads = torch.autograd.grad(eager_loss, (x, w))
    assert_close(loss, eager_loss, torch.float32, "loss")
    for got, want in zip(grads, eager_grads):
        assert_close(got, want, torch.float32, "grad")


def test_modules_are_drop_ins(backend, device):
    x = torch.randn(5, 7, device=device)
    for approximate in ("none", "tanh"):
        ours, theirs = trainops.nn.GELU(approximate=approximate), torch.nn.GELU(approximate=approximate)
        assert isinstance(ours, torch.nn.GELU) and repr(ours) == repr(theirs)
        assert ours.state_dict() == theirs.state_dict() == {}
        assert_close(ours(x), theirs(x.double()), torch.float32, f"GELU {approximate}")
    ours, theirs = trainops.nn.SiLU(), torch.nn.SiLU()
    assert isinstance(ours, torch.nn.SiLU) and repr(ours) == repr(theirs)
    assert_close(ours(x), theirs(x.double()), torch.float32, "SiLU")
    ours, theirs = trainops.nn.SiLU(inplace=True), torch.nn.SiLU(inplace=True)
    assert repr(ours) == repr(theirs)
    y = x.clone()
    assert ours(y) is y and torch.equal(y, trainops.silu(x)), "inplace: the input holds the result"


def test_plan_api(backend, device):
    p = trainops.plan("geglu", shape=(4, 10), dtype=torch.float32, device=device)
    gate, up = torch.randn(4, 10, device=device), torch.randn(4, 10, device=device)
    assert_close(p.run(gate, up), torch_F.gelu(gate.double(), approximate="tanh") * up.double(), torch.float32, "run")
    assert p.can_implement(gate, up) and not p.can_implement(gate, up.t().contiguous().t()[:, :9])
    assert not p.can_implement(gate, None)
    assert p.precision.accumulator == torch.float32 and p.precision.bitwise_reproducible


# ---- errors: named, before anything is written ----------------------------------------------------------

def test_errors_name_the_argument():
    x, b = torch.randn(4, 8), torch.randn(8)
    cases = [
        (lambda: trainops.gelu(x.int()), UnsupportedError, "'input' has dtype torch.int32"),
        (lambda: trainops.silu(torch.ones(3, dtype=torch.int64)), UnsupportedError, "'input' has dtype torch.int64"),
        (lambda: trainops.swiglu(x.long(), x.long()), UnsupportedError, "'gate' has dtype torch.int64"),
        (lambda: trainops.gelu(x, "fast"), InvalidProblemError, "'approximate' is 'fast'"),
        (lambda: trainops.gelu(x, None), InvalidProblemError, "'approximate'"),
        (lambda: trainops.geglu(x, x, "erf"), InvalidProblemError, "'approximate'"),
        (lambda: trainops.bias_gelu(x, b, "exact"), InvalidProblemError, "'approximate'"),
        (lambda: trainops.gelu("x"), InvalidProblemError, "'input' must be a torch.Tensor"),
        (lambda: trainops.swiglu(x, [1.0]), InvalidProblemError, "'up' must be a torch.Tensor"),
        (lambda: trainops.swiglu(x, x[:2]), InvalidProblemError, "'up' has shape (2, 8); expected (4, 8)"),
        (lambda: trainops.swiglu(x, x.double()), InvalidProblemError, "'up' has dtype torch.float64"),
        (lambda: trainops.geglu(x, x.to("meta")), InvalidProblemError, "'up' is on meta"),
        (lambda: trainops.swiglu(torch.randn(4, 7)), InvalidProblemError, "'gate' has an odd last axis (7)"),
        (lambda: trainops.swiglu(torch.randn(())), InvalidProblemError, "'gate' is a 0-d tensor"),
        (lambda: trainops.bias_gelu(x, torch.randn(4)), InvalidProblemError, "'bias' has shape (4,); expected (8,)"),
        (lambda: trainops.bias_gelu(x, torch.randn(1, 8)), InvalidProblemError, "'bias' has shape (1, 8)"),
        (lambda: trainops.bias_gelu(x, b.int()), UnsupportedError, "'bias' has dtype torch.int32"),
        (lambda: trainops.plan("gelu", shape=(4,), dtype=torch.float32, bias_dtype=torch.float32),
         InvalidProblemError, "'bias_dtype'"),
        (lambda: trainops.plan("bias_gelu", shape=(4,), dtype=torch.float32, bias_dtype=torch.int8), UnsupportedError,
         "'bias' has dtype torch.int8"),
        (lambda: trainops.bias_gelu(x, b.to("meta")), InvalidProblemError, "'bias' is on meta"),
        (lambda: trainops.bias_gelu(x, None), InvalidProblemError, "'bias' must be a torch.Tensor"),
        (lambda: act_ops.gelu_backward_op(x[:2], x, "none"), InvalidProblemError, "'dy' has shape (2, 8)"),
        (lambda: act_ops.swiglu_backward_op(x.double(), x, x, True, True), InvalidProblemError, "'dy' has dtype"),
        (lambda: trainops.plan("silu", shape=(4,), dtype=torch.float32, approximate="tanh"), InvalidProblemError,
         "'approximate'"),
        (lambda: trainops.plan("gelu", shape=(4,), dtype=torch.float32, packed=True), InvalidProblemError, "'packed'"),
        (lambda: trainops.plan("gelu", shape=(4,), dtype=torch.float32, strides=((1, 1),)), InvalidProblemError,
         "'input' has strides"),
        (lambda: trainops.plan("gelu", shape=(4,), dtype=torch.float32, heuristics=ActivationHeuristics(block=100)),
         InvalidProblemError, "'heuristics'"),
    ]
    for fn, cls, text in cases:
        with pytest.raises(cls) as info:
            fn()
        assert text in str(info.value), str(info.value)
    compiled = torch.compile(lambda g, u: trainops.swiglu(g, u), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception) as info:  # the fake checks too: torch.compile wraps the trainops error
        compiled(x, x[:2])
    assert "'up' has shape" in str(info.value)
    torch._dynamo.reset()


# ---- the GPU at real sizes ----------------------------------------------------------------------------------

GPU_CASES = [  # spec, shape of the first input, dtype
    ("swiglu", (8192, 14336), torch.bfloat16), ("swiglu", (16384, 8192), torch.bfloat16),
    ("swiglu", (8192, 2 * 14336), torch.bfloat16),  # packed halves (up=None)
    ("geglu", (8192, 14336), torch.bfloat16), ("gelu", (8192, 4096), torch.bfloat16),
    ("gelu_tanh", (8192, 14336), torch.bfloat16), ("silu", (8192, 4096), torch.float32),
    ("quick_gelu", (8192, 4096), torch.float16), ("bias_gelu", (8192, 4096), torch.bfloat16),
    ("swiglu", (4096, 14336), torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("spec,shape,dtype", GPU_CASES)
def test_gpu_real_sizes(spec, shape, dtype):
    gen = torch.Generator(device="cuda").manual_seed(14)
    a = (torch.randn(shape, device="cuda", generator=gen) * 2).to(dtype)
    packed = spec == "swiglu" and shape[-1] == 2 * 14336
    b = None
    if SPECS[spec][0] == "bias_gelu":
        b = torch.randn(shape[-1:], device="cuda", generator=gen).to(dtype)
    elif SPECS[spec][0] in ("swiglu", "geglu") and not packed:
        b = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    out_shape = shape[:-1] + (shape[-1] // 2,) if packed else shape
    dy = torch.randn(out_shape, device="cuda", generator=gen).to(dtype)
    check_forward_backward(spec, a, b, dtype, f"{spec} {shape} {dtype}", dy=dy)
    if b is not None and SPECS[spec][0] == "bias_gelu":
        first = torch.autograd.grad(call(spec, a, b), b, dy)[0]
        assert torch.equal(first, torch.autograd.grad(call(spec, a, b), b, dy)[0]), "bit-identical run to run"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_forward_bitwise_equal_to_torch(dtype):
    """The unary forwards use torch's CUDA expressions with libdevice's expf / erff / tanhf and IEEE
    division (precise_math): tanh-gelu and silu give torch's bits; the gated ones round once, so they
    equal torch's ``silu(gate) * up`` in float32 only. Exact (erf) gelu does not match torch's bits
    (H100: 9% of float32 elements differ): its error against float64 must be no larger than torch's."""
    gen = torch.Generator(device="cuda").manual_seed(15)
    x = (torch.randn(8192, 4096, device="cuda", generator=gen) * 3).to(dtype)
    u = torch.randn(8192, 4096, device="cuda", generator=gen).to(dtype)
    pairs = [(trainops.gelu(x, "tanh"), torch_F.gelu(x, approximate="tanh")), (trainops.silu(x), torch_F.silu(x))]
    if dtype == torch.float32:
        pairs += [(trainops.swiglu(x, u), torch_F.silu(x) * u),
                  (trainops.geglu(x, u), torch_F.gelu(x, approximate="tanh") * u)]
    for i, (ours, theirs) in enumerate(pairs):
        differ = (ours != theirs).sum().item()
        assert differ == 0, f"case {i}: {differ} elements differ from torch's ({dtype})"
    reference = torch_F.gelu(x.double())
    ours, theirs = relative_error(trainops.gelu(x), reference), relative_error(torch_F.gelu(x), reference)
    assert ours <= 1.01 * theirs, f"exact gelu: error {ours:.3e} against float64, torch's {theirs:.3e}"


@pytest.mark.gpu
def test_gpu_torch_compile_inductor():
    x = torch.randn(256, 2 * 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def mlp(x):
        return trainops.swiglu(x).float().square().mean()

    compiled = torch.compile(mlp, fullgraph=True)
    loss = compiled(x)
    grad, = torch.autograd.grad(loss, x)
    eager_grad, = torch.autograd.grad(mlp(x), x)
    assert torch.equal(grad, eager_grad)


def test_silu_inplace_keeps_the_gradient(backend, device):
    """silu(x, inplace=True) on a non-leaf: the result replaces x, and the gradient is silu's at the
    original x (the backward reads a copy taken before the write), as torch's silu_."""
    leaf = torch.randn(5, 12, dtype=torch.float64, device=device, requires_grad=True)
    h = leaf * 1.5
    out = trainops.silu(h, inplace=True)
    assert out is h
    dy = torch.randn(5, 12, dtype=torch.float64, device=device)
    (dx,) = torch.autograd.grad(out, leaf, dy)
    ref = leaf.detach().clone().requires_grad_()
    (rdx,) = torch.autograd.grad(torch_F.silu(ref * 1.5), ref, dy)
    assert_close(dx, rdx, torch.float64, "inplace silu gradient")
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        trainops.silu(leaf, inplace=True)
