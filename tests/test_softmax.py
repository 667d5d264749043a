"""Softmax family: forward and backward, every backend, against float64 references."""

import math
import random

import pytest
import torch

import trainops
from trainops.ops import softmax as softmax_ops
from trainops.plan import clear_plan_cache

from conftest import BACKEND_DEVICES, HAS_CUDA
from numerics import FLOATS, TOLERANCE, assert_close, interpreter_rounding

OPS = ["softmax", "log_softmax"]
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded", "offset"]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN, so an element left unwritten fails the test."""
    def new_output(self):
        out = torch.empty_strided(self.shape, self.out_strides, dtype=self.out_dtype, device=self.device)
        return out.fill_(float("nan"))
    monkeypatch.setattr(softmax_ops.SoftmaxProblem, "new_output", new_output)
    clear_plan_cache()
    yield
    clear_plan_cache()


def make_tensor(shape, dim, layout, dtype, device, gen, scale=3.0):
    """A random tensor of ``shape`` with the given memory layout (values never all zero)."""
    rank = len(shape)
    if layout == "contiguous" or rank == 0:
        base = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
        return base.to(dtype).to(device)
    if layout == "transposed":
        perm = list(reversed(range(rank)))
        base = torch.randn([shape[p] for p in perm], generator=gen, dtype=torch.float64) * scale
        return base.to(dtype).to(device).permute(*perm)
    if layout == "sliced":
        base = torch.randn([2 * s + 1 for s in shape], generator=gen, dtype=torch.float64) * scale
        return base.to(dtype).to(device)[tuple(slice(1, None, 2) for _ in shape)][tuple(slice(0, s) for s in shape)]
    if layout == "expanded":
        batch = [d for d in range(rank) if d != dim % rank] or [dim % rank]
        e = batch[0]
        small = list(shape)
        small[e] = 1
        base = torch.randn(small, generator=gen, dtype=torch.float64) * scale
        return base.to(dtype).to(device).expand(shape)
    if layout == "offset":
        flat = torch.randn(math.prod(shape) + 3, generator=gen, dtype=torch.float64) * scale
        return flat.to(dtype).to(device)[3:].view(shape)
    raise ValueError(layout)


def reference_forward(op, x, dim, out_dtype):
    x = x.to(out_dtype).double()
    return torch.softmax(x, dim) if op == "softmax" else torch.log_softmax(x, dim)


def reference_backward(op, dy, y, dim):
    dy, y = dy.double(), y.double()
    if op == "softmax":
        return y * (dy - (y * dy).sum(dim, keepdim=True))
    return dy - y.exp() * dy.sum(dim, keepdim=True)


def check_forward(op, x, dim, out_dtype=None):
    out_dtype = out_dtype or x.dtype
    y = getattr(trainops, op)(x, dim, dtype=out_dtype)
    assert y.dtype == out_dtype and y.device == x.device
    assert_close(y, reference_forward(op, x, dim, out_dtype), min(out_dtype, x.dtype, key=_precision),
                 f"{op} {tuple(x.shape)} dim={dim} {x.dtype}->{out_dtype} strides={x.stride()}")
    return y


def check_backward(op, dy, y, dim, input_dtype=None):
    dx = getattr(trainops, f"{op}_backward")(dy, y, dim, input_dtype)
    assert dx.dtype == (input_dtype or y.dtype)
    assert_close(dx, reference_backward(op, dy, y, dim), min(dx.dtype, y.dtype, key=_precision),
                 f"{op}_backward {tuple(y.shape)} dim={dim} {y.dtype} strides={dy.stride()},{y.stride()}")
    return dx


def _precision(dtype):
    return -TOLERANCE[dtype]


def random_case(seed, max_rank=4, max_size=24):
    rng = random.Random(seed)
    rank = rng.randint(1, max_rank)
    shape = tuple(rng.choice([1, 2, 3, rng.randint(1, max_size)]) for _ in range(rank))
    dim = rng.randrange(-rank, rank)
    return shape, dim, rng.choice(LAYOUTS)


# ---- forward and backward over random shapes, axes and layouts ----------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_axes_layouts(backend, device, op, dtype, seed):
    shape, dim, layout = random_case(seed * 7919 + FLOATS.index(dtype))
    gen = torch.Generator().manual_seed(seed)
    x = make_tensor(shape, dim, layout, dtype, device, gen)
    y = check_forward(op, x, dim)
    dy = make_tensor(shape, dim, random.Random(seed).choice(LAYOUTS), dtype, device, gen, scale=1.0)
    check_backward(op, dy, y, dim)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_every_layout_every_axis(backend, device, op, layout):
    shape = (3, 5, 17)
    gen = torch.Generator().manual_seed(1)
    for dim in range(-3, 3):
        x = make_tensor(shape, dim, layout, torch.float32, device, gen)
        y = check_forward(op, x, dim)
        check_backward(op, make_tensor(shape, dim, layout, torch.float32, device, gen), y, dim)


def test_expanded_along_the_reduced_axis(backend, device):
    x = torch.randn(4, 1, device=device).expand(4, 9)  # stride 0 along dim 1
    check_forward("softmax", x, 1)
    check_forward("log_softmax", x, 1)
    y = torch.softmax(torch.randn(4, 9, device=device), 1)
    check_backward("softmax", torch.randn(1, 9, device=device).expand(4, 9), y, 1)  # stride 0 across rows
    check_backward("log_softmax", torch.randn(1, 9, device=device).expand(4, 9), y.log(), 1)


def test_rank_8_without_mergeable_dims(backend, device):
    # Every dim sliced: no two batch dims merge, so leading dims run as host launches.
    gen = torch.Generator().manual_seed(3)
    shape = (2, 1, 2, 3, 2, 1, 2, 5)
    for dim in (-1, 3, 0):
        x = make_tensor(shape, dim, "sliced", torch.float32, device, gen)
        y = check_forward("log_softmax", x, dim)
        check_backward("log_softmax", make_tensor(shape, dim, "transposed", torch.float32, device, gen), y, dim)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                (torch.float16, torch.float64), (torch.float64, torch.float32)],
                         ids=str)
def test_dtype_argument(backend, device, op, in_dtype, out_dtype):
    x = (torch.randn(6, 40) * 4).to(in_dtype).to(device)
    y = getattr(trainops, op)(x, -1, dtype=out_dtype)
    assert y.dtype == out_dtype
    x_cast = interpreter_rounding(x, out_dtype) if backend == "triton" else x.to(out_dtype)
    assert_close(y, reference_forward(op, x_cast, -1, out_dtype), min(out_dtype, in_dtype, key=_precision), op)
    torch_y = getattr(torch, op)(x_cast.cpu(), -1)
    assert_close(y, torch_y, min(out_dtype, in_dtype, key=_precision), "matches torch's dtype= semantics")
    dx = check_backward(op, torch.randn_like(y), y, -1, input_dtype=in_dtype)
    assert dx.dtype == in_dtype


# ---- every plan: fused, looped (long rows), split (few long rows), row and column layouts -------

# The streaming, split and exchange plans' (op, dtype) cases: every dtype through softmax, and
# log_softmax in float32. The op is one constexpr branch (LOG) of each kernel, on values already in
# the accumulator's dtype: loads, the accumulator (float64 or float32), the workspace, windows (VEC
# by element size) and stores follow the dtype alone, so the full op x dtype product ran the LOG
# lines again for nothing (about a fifth of this file's time under the interpreter). Every
# (plan, op) and (plan, dtype) pair stays; log_softmax at every dtype stays on the fused plan
# (test_random_shapes_axes_layouts, test_dtype_argument, test_fused_rows_through_aligned_windows).
PLAN_OP_DTYPES = [("softmax", torch.float32), ("softmax", torch.bfloat16), ("softmax", torch.float64),
                  ("log_softmax", torch.float32)]


@pytest.fixture
def small_tiles():
    """Shrink the register and stream tiles so small shapes take the looped and split plans."""
    with trainops.heuristics(softmax_ops.SoftmaxHeuristics(
            register_tile={1: 64, 2: 64, 4: 32, 8: 16}, stream_tile={1: 128, 2: 128, 4: 64, 8: 64}, sms=2,
            row_exchange=False)):
        yield


@pytest.fixture
def exchange_tiles():
    """Shrink the register and exchange tiles so small shapes take the exchange plan (up to 16 chunks a row)."""
    with trainops.heuristics(softmax_ops.SoftmaxHeuristics(
            register_tile={1: 64, 2: 64, 4: 32, 8: 16}, exchange_tile={1: 64, 2: 64, 4: 64, 8: 64}, sms=16)):
        yield


@pytest.mark.parametrize("op,dtype", PLAN_OP_DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,expected", [
    ((3, 1000), -1, "split"),      # 3 rows < 2 per SM: rows split into chunks
    ((20, 150), -1, "looped"),     # enough rows: one program streams each row twice
    ((2, 300, 5), 1, "split"),     # column layout, long reduced axis, few programs
    ((6, 70, 12), 1, "looped"),    # column layout streamed
    ((7, 40), 0, "split"),
])
def test_streaming_plans(small_tiles, op, dtype, shape, dim, expected):
    device = BACKEND_DEVICES["triton"]
    gen = torch.Generator().manual_seed(5)
    with trainops.backend("triton"):
        x = make_tensor(shape, dim, "contiguous", dtype, device, gen)
        plan = trainops.plan(op, shape=shape, dim=dim, dtype=dtype, device=device)
        assert plan.kernel["plan"] == expected, plan.kernel
        assert plan.workspace_bytes > 0 if expected == "split" else plan.workspace_bytes == 0
        y = check_forward(op, x, dim)
        bwd = trainops.plan(f"{op}_backward", shape=shape, dim=dim, dtype=dtype, device=device)
        assert bwd.kernel["plan"] == expected, bwd.kernel
        check_backward(op, make_tensor(shape, dim, "transposed", dtype, device, gen), y, dim)


@pytest.mark.parametrize("op,dtype", PLAN_OP_DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,layout", [
    ((3, 1000), -1, "contiguous"),    # 16 chunks a row (15 full, a short last one), 3 rows
    ((20, 150), -1, "sliced"),        # 3 chunks a row, more rows than groups: a persistent loop
    ((2, 5, 130), 2, "offset"),       # rank 3, rows over two batch dims
    ((4, 3, 100), 2, "expanded"),     # stride-0 batch dim
])
def test_exchange_plan(exchange_tiles, op, dtype, shape, dim, layout):
    device = BACKEND_DEVICES["triton"]
    gen = torch.Generator().manual_seed(6)
    with trainops.backend("triton"):
        x = make_tensor(shape, dim, layout, dtype, device, gen)
        plan = trainops.plan(op, shape=shape, dim=dim, dtype=dtype, device=device, strides=x.stride())
        assert plan.kernel["plan"] == "exchange" and plan.kernel["splits"] > 1, plan.kernel
        y = check_forward(op, x, dim)
        bwd = trainops.plan(f"{op}_backward", shape=shape, dim=dim, dtype=dtype, device=device)
        assert bwd.kernel["plan"] == "exchange", bwd.kernel
        check_backward(op, make_tensor(shape, dim, layout, dtype, device, gen), y, dim)


@pytest.mark.parametrize("tiles", ["small_tiles", "exchange_tiles"])
def test_long_row_plans_with_minus_inf_prefix(tiles, request):
    request.getfixturevalue(tiles)
    # The first chunks of a row are all -inf: the online max (or a chunk's partial) must not turn them into NaN.
    device = BACKEND_DEVICES["triton"]
    with trainops.backend("triton"):
        for rows in (3, 20):
            x = torch.randn(rows, 300, device=device)
            x[:, :200] = float("-inf")
            x[0] = float("-inf")            # a whole row of -inf is NaN, as in torch
            x[1, 250] = float("nan")        # NaN propagates along its row only
            for op in OPS:
                assert_close(getattr(trainops, op)(x, -1), getattr(torch, op)(x.cpu(), -1), torch.float32, op)


def test_exchange_plan_special_values(exchange_tiles):
    # Chunks of 64: the softmax output is e * exp(m_chunk - m) / s from each chunk's own max, which must
    # stay 0 for an all -inf chunk (also under a very negative row max) and NaN wherever torch has NaN.
    device = BACKEND_DEVICES["triton"]
    x = torch.randn(9, 300) * 3
    x[0] = float("-inf")                      # all -inf: NaN row
    x[1, :70] = float("-inf")                 # a whole chunk of -inf and part of the next
    x[2, 7] = float("nan")                    # NaN row
    x[3] = 1e30                               # huge but equal
    x[4, 3] = 3e38                            # near float32 max
    x[5, 130] = float("inf")                  # +inf: NaN row as torch
    x[6] = -1e30
    x[7, :64] = float("-inf")                 # a -inf chunk under a row max of about -1000
    x[7, 64:] -= 1000
    x[8, 200:] = float("-inf")                # trailing chunks of -inf
    with trainops.backend("triton"):
        x = x.to(device)
        for op in OPS:
            plan = trainops.plan(op, shape=x.shape, dim=-1, dtype=x.dtype, device=device)
            assert plan.kernel["plan"] == "exchange" and plan.kernel["splits"] == 5, plan.kernel
            assert_close(getattr(trainops, op)(x, -1), getattr(torch, op)(x.cpu(), -1), torch.float32, op)


@pytest.mark.parametrize("op,dtype", PLAN_OP_DTYPES, ids=str)
@pytest.mark.parametrize("n", [65, 129, 301])
def test_exchange_plan_aligned_windows(exchange_tiles, op, dtype, n):
    """Rows of a length off a multiple of 16 elements are read and written through windows from the
    16-byte boundary below each row's start (first and last partial vectors apart); every row's
    start sits at another offset from that boundary. Rows with an element of -inf, NaN and +inf in
    the first or last partial vector, one row whose window needs one more chunk than its length."""
    device = BACKEND_DEVICES["triton"]
    gen = torch.Generator().manual_seed(n)
    rows = 9
    x = torch.randn(rows, n, generator=gen).to(dtype) * 3
    x[1, 0] = float("-inf")                # first element of a row: in its window's first vector
    x[2, -1] = float("nan")                # last element: in the window's last partial vector
    x[3, :3] = float("-inf")
    x[4, -2] = float("inf")
    with trainops.backend("triton"):
        x = x.to(device)
        for op_name in (op,):
            plan = trainops.plan(op_name, shape=x.shape, dim=-1, dtype=dtype, device=device, strides=x.stride())
            vec = 16 // x.element_size()
            assert plan.kernel["plan"] == "exchange" and plan.kernel["window"] == vec, plan.kernel
            # the window of a row starting VEC - 1 past a boundary covers n + VEC - 1 positions
            assert plan.kernel["splits"] == -(-(n + vec - 1) // 64), plan.kernel
            assert x.data_ptr() % 16 == 0
            assert_close(getattr(trainops, op_name)(x, -1), getattr(torch, op_name)(x.cpu().double(), -1).to(dtype),
                         dtype, f"{op_name} windows")
            # the same rows one element into the allocation: the pointer is off a 16-byte boundary, so
            # the launch takes the plain chunks (the plan's windows need aligned pointers)
            shifted = torch.empty(rows * n + 1, dtype=dtype, device=device)[1:].view(rows, n).copy_(x)
            assert shifted.data_ptr() % 16 != 0
            assert_close(getattr(trainops, op_name)(shifted, -1),
                         getattr(torch, op_name)(x.cpu().double(), -1).to(dtype), dtype, f"{op_name} unaligned")
            # the backward through the same windows (dy, y and dx rows alike), and unaligned
            bwd = trainops.plan(f"{op_name}_backward", shape=x.shape, dim=-1, dtype=dtype, device=device)
            assert bwd.kernel["plan"] == "exchange" and bwd.kernel["window"] == vec, bwd.kernel
            y = getattr(torch, op_name)(torch.randn(rows, n, generator=gen).double() * 3, -1).to(dtype).to(device)
            dy = torch.randn(rows, n, generator=gen).to(dtype).to(device)
            check_backward(op_name, dy, y, -1)
            check_backward(op_name, torch.empty(rows * n + 1, dtype=dtype, device=device)[1:].view(rows, n).copy_(dy),
                           y, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_fused_rows_through_aligned_windows(op, dtype):
    """The fused plan's one row a program (rows of more than 1/8 of a register tile) reads and writes
    a row of a length off a multiple of 16 through its aligned window when that fits the same tile;
    poisoned output (every element written), guard bands (nothing outside), -inf and NaN."""
    device = BACKEND_DEVICES["triton"]
    tiles = softmax_ops.SoftmaxHeuristics(register_tile={1: 64, 2: 64, 4: 64, 8: 64}, sms=16)
    gen = torch.Generator().manual_seed(11)
    with trainops.heuristics(tiles), trainops.backend("triton"):
        for n, expected in ((37, 16 // torch.tensor([], dtype=dtype).element_size()), (64, 0)):
            rows = 6
            x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
            x[0, 0] = float("-inf")
            x[1, -1] = float("nan")
            x = x.to(device)
            plan = trainops.plan(op, shape=x.shape, dim=-1, dtype=dtype, device=device)
            assert plan.kernel["plan"] == "fused" and plan.kernel["BLOCK_I"] == 1, plan.kernel
            assert plan.kernel["window"] == expected, plan.kernel
            guard = torch.full((rows * n + 40,), 7.0, dtype=dtype, device=device)
            out = guard[16:16 + rows * n].view(rows, n).fill_(float("nan"))
            plan.run(x, out=out)
            assert (guard[:16] == 7).all() and (guard[16 + rows * n:] == 7).all()
            assert_close(out, getattr(torch, op)(x.cpu().double(), -1).to(dtype), dtype, f"{op} n={n}")
            # one element into its allocation: the plain kernel of the same plan
            shifted = torch.empty(rows * n + 1, dtype=dtype, device=device)[1:].view(rows, n).copy_(x)
            assert_close(getattr(trainops, op)(shifted, -1), getattr(torch, op)(x.cpu().double(), -1).to(dtype),
                         dtype, f"{op} n={n} unaligned")
        # a row whose window would need a tile twice as long keeps the plain one (61 + 7 > 64 for bf16)
        plan = trainops.plan(op, shape=(3, 61), dim=-1, dtype=torch.bfloat16, device=device)
        assert plan.kernel["window"] == 0, plan.kernel


def test_exchange_plan_windows_only_where_they_fit(exchange_tiles):
    """Windows need x and y rows at the same offset from a 16-byte boundary, unit stride, one
    element size, and are not used where the plain chunks are aligned already."""
    device = BACKEND_DEVICES["triton"]
    cases = [((5, 301), (301, 1), torch.bfloat16, None, 8),        # packed odd rows
             ((5, 320), (320, 1), torch.bfloat16, None, 0),        # aligned already
             ((5, 301), (306, 1), torch.bfloat16, None, 0),        # padded input rows, packed output rows
             ((5, 301), (305, 1), torch.float32, None, 4),         # stride congruent to 301 modulo 4
             ((5, 301), (301, 1), torch.bfloat16, torch.float32, 0),   # output of another element size
             ((3, 1021), (1021, 1), torch.bfloat16, None, 0)]      # 16 chunks = the SMs; a window would need 17
    with trainops.backend("triton"):
        for strides, window in (((301, 1), 4), ((302, 1), 0)):   # dy's strides; y packed
            bwd = trainops.plan("softmax_backward", shape=(5, 301), dim=-1, dtype=torch.float32, device=device,
                                strides=(strides, (301, 1)))
            assert bwd.kernel["plan"] == "exchange" and bwd.kernel["window"] == window, bwd.kernel
        for shape, strides, dtype, out_dtype, window in cases:
            plan = trainops.plan("softmax", shape=shape, dim=-1, dtype=dtype, device=device, strides=strides,
                                 out_dtype=out_dtype)
            assert plan.kernel["plan"] == "exchange" and plan.kernel["window"] == window, (shape, strides, plan.kernel)
            assert plan.kernel["splits"] <= 16, plan.kernel   # the exchange kept, not the windows
            base = torch.randn(shape[0] * strides[0], device=device).to(dtype)
            x = base.as_strided(shape, strides)
            assert_close(trainops.softmax(x, -1, dtype=out_dtype), torch.softmax(x.cpu().double(), -1).to(
                out_dtype or dtype), out_dtype or dtype, str((shape, strides)))


# ---- edge cases ---------------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_special_values_match_torch(backend, device, op):
    x = torch.randn(8, 33) * 3
    x[0] = float("-inf")                      # all -inf: NaN row
    x[1, :5] = float("-inf")                  # partly -inf: zeros / -inf there
    x[2, 7] = float("nan")                    # NaN row
    x[3] = 1e30                               # huge but equal
    x[4, 3] = 3e38                            # near float32 max
    x[5, 0] = float("inf")                    # +inf: NaN row as torch
    x[6] = -1e30
    x = x.to(device)
    y = getattr(trainops, op)(x, -1)
    assert_close(y, getattr(torch, op)(x.cpu(), -1), torch.float32, op)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape,dim", [((0,), 0), ((3, 0), 1), ((0, 5), 1), ((4, 0, 2), 0), ((), 0), ((), -1),
                                       ((1,), 0), ((5, 1), 1), ((1, 7), 0)])
def test_empty_scalar_and_length_one(backend, device, op, shape, dim):
    x = torch.randn(shape).to(device)
    y = getattr(trainops, op)(x, dim)
    assert y.shape == x.shape
    assert_close(y, getattr(torch, op)(x.cpu(), dim), torch.float32, op)
    dx = getattr(trainops, f"{op}_backward")(torch.randn(shape).to(device), y, dim)
    assert dx.shape == x.shape and not dx.isnan().any()


def test_long_row_large_values(backend, device):
    x = (torch.randn(2, 5000, dtype=torch.float64) * 50 + 1e4).float().to(device)
    for op in OPS:
        check_forward(op, x, -1)


def test_bitwise_reproducible(backend, device):
    gen = torch.Generator().manual_seed(11)
    x = make_tensor((9, 130), -1, "contiguous", torch.bfloat16, device, gen)
    dy = make_tensor((9, 130), -1, "contiguous", torch.bfloat16, device, gen)
    for op in OPS:
        a, b = getattr(trainops, op)(x, -1), getattr(trainops, op)(x, -1)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        ga = getattr(trainops, f"{op}_backward")(dy, a, -1)
        gb = getattr(trainops, f"{op}_backward")(dy, a, -1)
        assert torch.equal(ga.view(torch.int16), gb.view(torch.int16))


# ---- autograd, torch.compile, modules ------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_gradcheck_float64(backend, device, op):
    gen = torch.Generator().manual_seed(2)
    for shape, dim, layout in [((3, 7), -1, "contiguous"), ((2, 4, 3), 1, "transposed")]:
        x = make_tensor(shape, dim, layout, torch.float64, device, gen).detach().requires_grad_()
        fn = getattr(trainops, op)
        fast = backend == "triton"  # random projections under the interpreter (CI time); the CPU path in full
        assert torch.autograd.gradcheck(lambda t: fn(t, dim), (x,), fast_mode=fast)
        assert torch.autograd.gradgradcheck(lambda t: fn(t, dim), (x,), fast_mode=fast)


def test_gradients_match_torch_with_dtype(backend, device):
    x = torch.randn(5, 12, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = torch.randn(5, 12, device=device)
    for op in OPS:
        (getattr(trainops, op)(x, -1, dtype=torch.float32) * w).sum().backward()
        ours, x.grad = x.grad, None
        (getattr(torch, op)(x, -1, dtype=torch.float32) * w).sum().backward()
        assert ours.dtype == torch.bfloat16
        assert_close(ours, x.grad, torch.bfloat16, op)
        x.grad = None


def test_torch_compile_fullgraph(backend, device):
    def f(x, w):
        return (trainops.softmax(x, -1) * w).sum() + trainops.log_softmax(x.t(), 0).mean()

    x = torch.randn(6, 10, device=device, requires_grad=True)
    w = torch.randn(6, 10, device=device)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(x, w)
    loss.backward()
    expected_x = x.detach().clone().requires_grad_()
    (torch.softmax(expected_x, -1) * w).sum().add(torch.log_softmax(expected_x.t(), 0).mean()).backward()
    assert_close(loss, f(x, w), torch.float32, "loss")
    assert_close(x.grad, expected_x.grad, torch.float32, "grad")


@pytest.mark.slow
def test_torch_compile_inductor():
    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), trainops.nn.LogSoftmax(dim=-1))
    compiled = torch.compile(m, fullgraph=True)
    x = torch.randn(4, 8)
    assert_close(compiled(x), torch.log_softmax(m[0](x), -1), torch.float32, "inductor")


def test_nn_modules_drop_in(backend, device):
    x = torch.randn(3, 4, 5, device=device)
    for ours, theirs in [(trainops.nn.Softmax(dim=1), torch.nn.Softmax(dim=1)),
                         (trainops.nn.LogSoftmax(dim=-1), torch.nn.LogSoftmax(dim=-1))]:
        assert repr(ours).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
        assert_close(ours(x), theirs(x.cpu()), torch.float32, repr(ours))
    with pytest.warns(UserWarning, match="Implicit dimension"):
        assert_close(trainops.nn.Softmax()(x), torch.softmax(x.cpu(), 0), torch.float32, "legacy dim")


# ---- the plan API --------------------------------------------------------------------------------

def test_plan_run_and_out(backend, device):
    x = torch.randn(16, 64, device=device).t()  # transposed: reduce dim 0 contiguous-ly
    p = trainops.plan("softmax", shape=x.shape, dim=0, dtype=x.dtype, device=device, strides=x.stride())
    assert p.can_implement(x)
    assert not p.can_implement(x.contiguous())  # other strides: another plan
    assert not p.can_implement(x.double())
    out = torch.full((16, 64), float("nan"), device=device).t()
    assert p.run(x, out=out) is out
    assert_close(out, torch.softmax(x.cpu(), 0), torch.float32, "out=")
    assert p.precision.accumulator == torch.float32 and p.precision.deterministic
    assert p.precision.bitwise_reproducible
    assert p.kernel.backend == backend


def test_functional_calls_reuse_plans(backend, device):
    from trainops.plan import plan_cache_info
    x = torch.randn(64, 64, device=device)
    trainops.softmax(x, -1)
    before = plan_cache_info()
    trainops.softmax(x, -1)
    trainops.softmax(x.t(), -1)  # another layout: another plan
    after = plan_cache_info()
    assert (after["hits"], after["misses"]) == (before["hits"] + 1, before["misses"] + 1)


# ---- registry ------------------------------------------------------------------------------------

def test_registry_table_and_dispatch():
    rows = {(k.op, k.backend) for k in trainops.kernels()}
    for op in ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward"]:
        assert (op, "triton") in rows and (op, "cpu") in rows
    assert trainops.lookup("softmax", "cuda", torch.bfloat16).backend == "triton"
    assert trainops.lookup("softmax", "cpu", torch.float32).backend == "cpu"
    if not HAS_CUDA:  # the interpreter is on: Triton kernels take CPU tensors
        with trainops.backend("triton"):
            assert trainops.lookup("softmax", "cpu", torch.float32).backend == "triton"
    with trainops.backend("cpu"):
        with pytest.raises(trainops.UnsupportedError, match="device 'cuda'"):
            trainops.lookup("softmax", "cuda", torch.float32)
    with pytest.raises(trainops.UnsupportedError, match="int32"):
        trainops.lookup("softmax", "cuda", torch.int32)
    for k in trainops.kernels():
        assert k.row()["accumulator"]
        if k.op in ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward"):
            assert k.deterministic


def test_cli_kernels_table(capsys):
    from trainops.__main__ import main
    main(["kernels"])
    out = capsys.readouterr().out
    assert "log_softmax_backward" in out and "triton" in out and "cpu" in out


# ---- errors: type and message name the argument --------------------------------------------------

def test_error_dim_out_of_range(backend, device):
    with pytest.raises(trainops.InvalidProblemError, match="'dim' is 2, out of range"):
        trainops.softmax(torch.randn(3, 4, device=device), 2)
    with pytest.raises(trainops.InvalidProblemError, match="'dim'"):
        trainops.log_softmax(torch.randn(3, device=device), -2)
    with pytest.raises(trainops.InvalidProblemError, match="'dim' must be an int"):
        trainops.softmax(torch.randn(3, device=device), None)


def test_error_rank_too_large(backend, device):
    with pytest.raises(trainops.UnsupportedError, match="'x' has rank 9"):
        trainops.softmax(torch.randn([1] * 9, device=device), 0)


def test_error_integer_dtype(backend, device):
    with pytest.raises(trainops.UnsupportedError, match="'x' has dtype torch.int64"):
        trainops.softmax(torch.arange(6, device=device), 0)
    with pytest.raises(trainops.UnsupportedError, match="'dtype' is torch.int32"):
        trainops.softmax(torch.randn(6, device=device), 0, dtype=torch.int32)


def test_error_backward_mismatch(backend, device):
    y = torch.softmax(torch.randn(3, 4), -1).to(device)
    with pytest.raises(trainops.InvalidProblemError, match="'dy' has shape"):
        trainops.softmax_backward(torch.randn(3, 5, device=device), y, -1)
    with pytest.raises(trainops.InvalidProblemError, match="'dy' has dtype"):
        trainops.log_softmax_backward(torch.randn(3, 4, device=device, dtype=torch.float64), y, -1)


def test_error_not_a_tensor():
    with pytest.raises(trainops.InvalidProblemError, match="'x' must be a torch.Tensor"):
        trainops.softmax([1.0, 2.0], 0)


def test_error_plan_descriptor():
    with pytest.raises(trainops.InvalidProblemError, match="'shape' has a negative size"):
        trainops.plan("softmax", shape=(3, -1), dim=0, dtype=torch.float32, device="cpu")
    with pytest.raises(trainops.InvalidProblemError, match="'x' has strides"):
        trainops.plan("softmax", shape=(3, 4), dim=0, dtype=torch.float32, device="cpu", strides=(1,))
    with pytest.raises(trainops.InvalidProblemError, match="'device'"):
        trainops.plan("softmax", shape=(3, 4), dim=0, dtype=torch.float32, device="nowhere")
    with pytest.raises(trainops.UnsupportedError, match="unknown op 'softmaxx'"):
        trainops.plan("softmaxx", shape=(3, 4), dim=0, dtype=torch.float32, device="cpu")
    with pytest.raises(trainops.InvalidProblemError, match="'name'"):
        with trainops.backend("cuda"):
            pass


def test_error_plan_run_wrong_tensors():
    p = trainops.plan("softmax", shape=(3, 4), dim=1, dtype=torch.float32, device="cpu")
    with pytest.raises(trainops.InvalidProblemError, match="'out' has shape"):
        p.run(torch.randn(3, 4), out=torch.empty(3, 3))  # buffer too small
    with pytest.raises(trainops.InvalidProblemError, match="'out' has dtype"):
        p.run(torch.randn(3, 4), out=torch.empty(3, 4, dtype=torch.float16))
    with pytest.raises(trainops.InvalidProblemError, match="'x' has shape"):
        p.run(torch.randn(4, 4))
    with pytest.raises(trainops.InvalidProblemError, match="expected 1 tensors"):
        p.run(torch.randn(3, 4), torch.randn(3, 4))
    if HAS_CUDA:
        with pytest.raises(trainops.InvalidProblemError, match="'x' is on device cuda"):
            p.run(torch.randn(3, 4, device="cuda"))
    cuda_plan = trainops.plan("softmax", shape=(3, 4), dim=1, dtype=torch.float32, device="cuda:0")
    with pytest.raises(trainops.InvalidProblemError, match="'x' is on device cpu"):
        cuda_plan.run(torch.randn(3, 4))


# ---- few long rows split across programs (exchange.fill_tile) ----------------------------------

@pytest.fixture
def few_rows_tiles():
    """8 SMs and chunks of at least 256 bytes: rows of 1500 elements, fewer than 8 of them, are cut
    into 6 chunks of 256 (exchange.fill_tile: 1500 / 8 SMs rounds up to 256)."""
    with trainops.heuristics(softmax_ops.SoftmaxHeuristics(sms=8, fill_per_sm=4, fill_min_bytes=256, fill_min_row_bytes=0)):
        yield


def assert_within_one_ulp(out, ref, what):
    """Every element of a half-precision ``out`` within one ulp of the float64 ``ref`` rounded to its
    dtype (the interpreter truncates where the GPU rounds to nearest: one ulp apart at most)."""
    rounded = ref.to(out.dtype).double()
    mantissa = {torch.float16: 10, torch.bfloat16: 7}[out.dtype]
    magnitude = torch.maximum(out.double().abs(), rounded.abs()).clamp_min(torch.finfo(out.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa)
    diff = (out.double() - rounded).abs()
    assert (diff <= ulp).all(), f"{what}: {(diff > ulp).sum()} elements more than one ulp away"


@pytest.mark.parametrize("op,dtype,layout", [("softmax", torch.float32, "contiguous"),
                                             ("log_softmax", torch.bfloat16, "sliced"),
                                             ("softmax", torch.float16, "offset")], ids=str)
def test_few_long_rows_split_across_programs(few_rows_tiles, op, dtype, layout):
    device = BACKEND_DEVICES["triton"]
    gen = torch.Generator().manual_seed(11)
    shape = (2, 1500)
    with trainops.backend("triton"):
        x = make_tensor(shape, -1, layout, dtype, device, gen)
        for name in (op, f"{op}_backward"):
            plan = trainops.plan(name, shape=shape, dim=-1, dtype=dtype, device=device, strides=x.stride())
            assert plan.kernel["plan"] == "exchange" and plan.kernel["splits"] == 6, plan.kernel
            assert plan.kernel["BLOCK_N"] == 256 and plan.kernel["num_warps"] == 4, plan.kernel
        y = check_forward(op, x, -1)
        if dtype != torch.float32:
            assert_within_one_ulp(y, reference_forward(op, x, -1, dtype), op)
        check_backward(op, make_tensor(shape, -1, layout, dtype, device, gen, scale=1.0), y, -1)
        # enough rows (8 SMs): one row a program again, as with fill_per_sm=0
        assert trainops.plan(op, shape=(8, 1500), dim=-1, dtype=dtype, device=device).kernel["plan"] == "fused"
        with trainops.heuristics(softmax_ops.SoftmaxHeuristics(sms=8, fill_min_bytes=256, fill_min_row_bytes=0,
                                                               fill_per_sm=0)):
            assert trainops.plan(op, shape=shape, dim=-1, dtype=dtype, device=device).kernel["plan"] == "fused"


def test_few_long_rows_split_plan_without_the_exchange():
    """TRAINOPS_ROW_EXCHANGE=0 (row_exchange=False): the two-launch split plan at the same chunks."""
    device = BACKEND_DEVICES["triton"]
    gen = torch.Generator().manual_seed(12)
    with trainops.backend("triton"), trainops.heuristics(softmax_ops.SoftmaxHeuristics(
            sms=8, fill_per_sm=4, fill_min_bytes=256, fill_min_row_bytes=0, row_exchange=False)):
        x = make_tensor((3, 1024), -1, "sliced", torch.float32, device, gen)
        plan = trainops.plan("softmax_backward", shape=x.shape, dim=-1, dtype=x.dtype, device=device)
        assert plan.kernel["plan"] == "split" and plan.kernel["chunk"] == 128, plan.kernel
        y = check_forward("softmax", x, -1)
        check_backward("softmax", make_tensor((3, 1024), -1, "offset", torch.float32, device, gen), y, -1)


def test_few_long_rows_special_values(few_rows_tiles):
    # Chunks of 256: a chunk of -inf only has partial max -inf and sum 0, which the merge must weigh
    # as 0 (not exp(-inf - -inf) = NaN); a row of -inf only is NaN, as torch.
    device = BACKEND_DEVICES["triton"]
    x = torch.randn(5, 1536) * 3
    x[0] = float("-inf")
    x[1, :600] = float("-inf")           # two whole chunks and part of a third
    x[2, 256:512] = float("-inf")        # a chunk in the middle
    x[2, 1535] = 80.0                    # the row's max in the last chunk
    x[3, 7] = float("nan")
    x[4, :1400] = float("-inf")          # only the last chunk has values
    with trainops.backend("triton"):
        assert trainops.plan("softmax", shape=x.shape, dim=-1, dtype=x.dtype, device=device).kernel["splits"] == 6
        for op in OPS:
            y = getattr(trainops, op)(x.to(device), -1)
            assert_close(y, getattr(torch, op)(x, -1), torch.float32, op)
        y = torch.softmax(x[1:3], -1)
        dy = torch.randn(2, 1536)
        assert_close(trainops.softmax_backward(dy.to(device), y.to(device), -1),
                     reference_backward("softmax", dy, y, -1), torch.float32, "backward, -inf chunks")


def test_few_long_rows_under_torch_compile(few_rows_tiles):
    device = BACKEND_DEVICES["triton"]
    x = torch.randn(2, 1024, device=device, requires_grad=True)
    w = torch.randn(2, 1024, device=device)

    def f(x):
        return (trainops.softmax(x, -1) * w).sum()
    with trainops.backend("triton"):
        assert trainops.plan("softmax", shape=x.shape, dim=-1, dtype=x.dtype, device=device).kernel["plan"] == "exchange"
        loss = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
        loss.backward()
    expected = x.detach().clone().requires_grad_()
    (torch.softmax(expected, -1) * w).sum().backward()
    assert_close(loss, (torch.softmax(x.detach(), -1) * w).sum(), torch.float32, "loss")
    assert_close(x.grad, expected.grad, torch.float32, "grad")


def test_fill_tile_choices_at_real_sizes():
    """What the H200 (132 SMs) plans for few long rows: no kernel runs."""
    from trainops.layout import reduction_layout

    def config(shape, dtype=torch.bfloat16, op="softmax", **options):
        problem = softmax_ops._describe(op, shape, -1, dtype, "cpu",
                                        heuristics=softmax_ops.SoftmaxHeuristics(sms=132, **{"fill_per_sm": 4,
                                                                                               **options}))
        layout = reduction_layout(problem.shape, problem.dim, problem.strides + (problem.out_strides,))
        c = softmax_ops._choose_config(problem, layout)
        return c.kind, c.block_n, c.splits, c.num_warps
    assert config((1, 262144)) == ("exchange", 2048, 128, 4)      # 128 programs, not 32
    assert config((4, 131072)) == ("exchange", 2048, 64, 4)       # 256 programs, not 64
    assert config((16, 65536)) == ("exchange", 2048, 32, 4)
    assert config((64, 32768)) == ("exchange", 4096, 8, 8)        # 512 programs, not 64 fused ones
    assert config((64, 32768), op="softmax_backward") == ("exchange", 4096, 8, 8)
    assert config((8, 1048576)) == ("exchange", 8192, 128, 16)    # long enough already: unchanged
    assert config((64, 32768), fill_per_sm=0)[0] == "fused"
    assert config((132, 32768))[0] == "fused"                     # as many rows as SMs
    assert config((1, 262144), row_exchange=False) == ("split", 2048, 128, 8)
    assert config((200, 32768), row_exchange=False)[0] == "fused"
    assert config((8, 16777216))[0] == "split"                    # more chunks than SMs: the two-launch split
    assert config((8, 8191))[0] == "fused"                         # rows under 16 KiB: latency-bound, one a program
    assert config((8, 8192)) == ("exchange", 2048, 4, 4)



def test_column_backward_splits_at_real_sizes():
    """dim=0 of a matrix on the H200 (132 SMs): the backward's split plan aims at
    column_backward_split_per_sm (2) programs an SM, the forward's at split_programs_per_sm (16)."""
    from trainops.layout import reduction_layout

    def config(op, shape, dtype=torch.bfloat16, **options):
        problem = softmax_ops._describe(op, shape, 0, dtype, "cpu",
                                        heuristics=softmax_ops.SoftmaxHeuristics(sms=132, **options))
        layout = reduction_layout(problem.shape, problem.dim, problem.strides + (problem.out_strides,))
        c = softmax_ops._choose_config(problem, layout)
        return c.kind, c.block_i, c.block_n, c.splits
    # 4096 columns in tiles of 64: 64 programs; 2 x 132 / 64 -> 8 splits of 512 rows (16 -> 32 splits)
    assert config("softmax_backward", (4096, 4096)) == ("split", 64, 128, 8)
    assert config("softmax_backward", (4096, 4096), column_backward_split_per_sm=16) == ("split", 64, 128, 32)
    assert config("softmax_backward", (32000, 512)) == ("split", 64, 128, 64)
    assert config("softmax_backward", (8192, 1024)) == ("split", 64, 128, 32)
    assert config("softmax_backward", (4096, 4096), torch.float32) == ("split", 32, 128, 4)
    assert config("softmax", (4096, 4096)) == ("split", 32, 256, 16)   # the forward: split_programs_per_sm
    assert config("softmax", (4096, 4096), split_programs_per_sm=4)[3] == 8
    assert config("softmax", (4096, 4096), column_backward_split_per_sm=1) == config("softmax", (4096, 4096))
    assert config("softmax_backward", (1024, 8192))[0] == "fused"   # fits a register tile: no split


def test_fused_backward_warps_leave_column_tiles_alone():
    """fused_backward_warps was measured on rows of 32000 only: column-layout fused backward tiles
    over 16384 elements (dim=0 of 1024x8192: 32 x 1024; dim=1 of 32x512x4096: 64 x 512) keep the
    8 warps they were measured at (probe-softmax-classes-2: 1024x8192 dim=0 0.0246 ms, w8)."""
    from trainops.layout import reduction_layout

    def config(op, shape, dim):
        problem = softmax_ops._describe(op, shape, dim, torch.bfloat16, "cpu",
                                        heuristics=softmax_ops.SoftmaxHeuristics(sms=132))
        layout = reduction_layout(problem.shape, problem.dim, problem.strides + (problem.out_strides,))
        c = softmax_ops._choose_config(problem, layout)
        return c.kind, c.block_i * c.block_n, c.num_warps
    for op in ("softmax_backward", "log_softmax_backward"):
        assert config(op, (1024, 8192), 0) == ("fused", 32768, 8)
        assert config(op, (32, 512, 4096), 1) == ("fused", 32768, 8)
        assert config(op, (4096, 32000), -1) == ("fused", 32768, 16)    # the measured row layout


def test_fused_backward_warps_at_real_sizes():
    """The fused backward: one warp per 256 tile elements, 4 to 8, and up to fused_backward_warps
    (16) for tiles over 16384 elements (bf16 rows of 32000 on the H200); the forward unchanged."""
    from trainops.layout import reduction_layout

    def warps(op, shape, dtype=torch.bfloat16, **options):
        problem = softmax_ops._describe(op, shape, -1, dtype, "cpu",
                                        heuristics=softmax_ops.SoftmaxHeuristics(sms=132, **options))
        layout = reduction_layout(problem.shape, problem.dim, problem.strides + (problem.out_strides,))
        c = softmax_ops._choose_config(problem, layout)
        assert c.kind == "fused", c
        return c.num_warps
    assert warps("softmax_backward", (4096, 32000)) == 16
    assert warps("softmax_backward", (4096, 32000), fused_backward_warps=8) == 8
    assert warps("softmax_backward", (4096, 16384)) == 8          # a tile of 16384: the H100's cap
    assert warps("softmax_backward", (4096, 16384), fused_backward_warps=32) == 8
    assert warps("softmax_backward", (4096, 1024)) == 8           # 4 rows a program: a tile of 4096
    assert warps("softmax_backward", (1, 512)) == 4
    assert warps("softmax", (4096, 32000)) == 32                   # the forward: one per 1024, 4 to 32


@pytest.mark.parametrize("field, bad", [("column_backward_split_per_sm", 0), ("column_backward_split_per_sm", 2.0),
                                        ("column_backward_split_per_sm", True), ("fused_backward_warps", 12),
                                        ("fused_backward_warps", 0), ("fused_backward_warps", 64),
                                        ("quack_columns", {"softmax": (16384, None)}),
                                        ("quack_columns", {"softmax": 16384}), ("quack_columns", (16384, 524288)),
                                        ("quack_columns", {"softmax": (16384, 524288)}),
                                        ("quack_column_multiple", 8192), ("quack_column_multiple", {"softmax": 0}),
                                        ("quack_columns", {"log_softmax": ((1, 2),)}),
                                        ("quack_column_multiple", {"log_softmax": 1})])
def test_backward_and_quack_heuristics_are_checked(field, bad):
    """The newer SoftmaxHeuristics fields refuse values a rule or a launch could not use, naming the field."""
    with pytest.raises(trainops.InvalidProblemError, match=field):
        softmax_ops.SoftmaxHeuristics(**{field: bad})
    softmax_ops.SoftmaxHeuristics(column_backward_split_per_sm=1, fused_backward_warps=32,
                                  quack_columns={"softmax": ()}, quack_column_multiple={})

# ---- real sizes on the GPU machine ------------------------------------------------------------

GPU_CASES = [((4096, 32768), -1), ((1024, 131072), -1), ((128, 262144), -1), ((32, 512, 4096), 1),
             ((32768, 1024), -1), ((8, 1048576), -1), ((3, 1048577), -1), ((4096, 4096), 0), ((1000, 77, 3), 1),
             ((1000, 40000), -1), ((3, 7, 50001), -1), ((8, 16777216), -1)]


@pytest.fixture
def fill_on():
    """The few-rows split (SoftmaxHeuristics.fill_per_sm), off by default (no net gain on the H200): on here."""
    with trainops.heuristics(softmax_ops.SoftmaxHeuristics(fill_per_sm=4)):
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((1, 262144), torch.bfloat16), ((4, 131072), torch.bfloat16),
                                         ((16, 65536), torch.float16), ((64, 32768), torch.float32),
                                         ((3, 100003), torch.bfloat16)], ids=str)
def test_gpu_few_long_rows(fill_on, shape, dtype):
    """Fewer rows than SMs, cut into chunks for every SM (exchange.fill_tile; odd row lengths through the
    aligned windows): against float64, bit-identical run to run."""
    gen = torch.Generator().manual_seed(7)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with trainops.backend("triton"):
        for op in OPS:
            for name in (op, f"{op}_backward"):
                kernel = trainops.plan(name, shape=shape, dim=-1, dtype=dtype, device="cuda").kernel
                # at least three quarters of the SMs get a program (1 x 262144: 128 chunks of 2048 on 132 SMs)
                assert kernel["plan"] == "exchange" and kernel["splits"] * shape[0] >= sms * 3 // 4, (name, kernel)
            x = (torch.randn(shape, generator=gen) * 3).to(dtype).cuda()
            y = check_forward(op, x, -1)
            assert torch.equal(getattr(trainops, op)(x, -1), y)
            dy = torch.randn(shape, generator=gen).to(dtype).cuda()
            dx = check_backward(op, dy, y, -1)
            assert torch.equal(getattr(trainops, f"{op}_backward")(dy, y, -1), dx)


@pytest.mark.gpu
def test_gpu_long_rows_take_the_exchange_plan():
    for shape in ((128, 262144), (1024, 131072), (1000, 40000), (3, 1048577)):
        for op in OPS + [f"{op}_backward" for op in OPS]:
            plan = trainops.plan(op, shape=shape, dim=-1, dtype=torch.bfloat16, device="cuda")
            assert plan.kernel["plan"] == "exchange", (shape, op, plan.kernel)
    # Rows of more chunks than the device has SMs stream instead.
    assert trainops.plan("softmax", shape=(8, 16777216), dim=-1, dtype=torch.bfloat16,
                         device="cuda").kernel["plan"] in ("split", "looped")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape,dim", GPU_CASES, ids=str)
def test_gpu_real_sizes(shape, dim, dtype):
    gen = torch.Generator().manual_seed(0)
    with trainops.backend("triton"):
        for op in OPS:
            x = (torch.randn(shape, generator=gen) * 3).to(dtype).cuda()
            y = check_forward(op, x, dim)
            check_backward(op, (torch.randn(shape, generator=gen)).to(dtype).cuda(), y, dim)
            a = getattr(trainops, op)(x, dim)
            assert torch.equal(a, getattr(trainops, op)(x, dim))


def test_eager_calls_skip_the_dispatcher_with_the_same_results(backend, device):
    from trainops.ops import softmax as softmax_ops

    x = torch.randn(4, 9, dtype=torch.float64, device=device, requires_grad=True)
    fast, slow = softmax_ops.softmax_op(x, 1, None), softmax_ops.softmax_op.op(x, 1, None)
    assert type(fast.grad_fn).__name__ == "softmax_functionBackward"  # the autograd.Function path
    assert "trainops_softmax" in type(slow.grad_fn).__name__          # the custom op
    assert torch.equal(fast, slow)
    dy = torch.randn_like(fast)
    assert torch.equal(torch.autograd.grad(fast, x, dy)[0], torch.autograd.grad(slow, x, dy)[0])
    with torch.no_grad():
        assert softmax_ops.softmax_op(x, 1, None).grad_fn is None
    assert torch.equal(softmax_ops.softmax_op(x, dim=1), fast)  # keywords go through the op
