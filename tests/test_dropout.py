"""Dropout and bias_dropout_add: forward and backward on every backend; the Philox mask (the CPU path
against Triton's tl.randint4x / tl.rand, bit for bit; independent of blocks, grids and strides);
statistics; seeds; both mask modes; dbias determinism; layouts; empty tensors; torch.compile; the
module; errors."""

import fractions
import math

import pytest
import torch

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import dropout as D
from trainops.ops.dropout import DropoutHeuristics, DropoutRandom
from trainops.plan import clear_plan_cache
from trainops.registry import triton_interpreting

from conftest import HAS_CUDA
from numerics import FLOATS, assert_close, interpreter_rounding

HAS_TRITON_HERE = HAS_CUDA or triton_interpreting()
# small blocks and row tiles: many programs, several row steps, split columns, on small shapes
SMALL = DropoutHeuristics(block=32, rows_block_n=8, rows_tile=16, rows_programs_per_sm=1)
PLANS = {"default": DropoutHeuristics(), "small": SMALL}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Outputs start as NaN (bits as 0b10101010), so an element or byte left unwritten fails."""
    original = D.DropoutProblem.new_output

    def new_output(self):
        return tuple(t.fill_(float("nan")) if t.is_floating_point() else t.fill_(0xAA) for t in original(self))
    monkeypatch.setattr(D.DropoutProblem, "new_output", new_output)
    clear_plan_cache()
    yield
    clear_plan_cache()


def _randn(shape, dtype, device, gen, scale=1.0, offset=0.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + offset).to(dtype).to(device)


def _gen(k):
    return torch.Generator().manual_seed(k)


def seed_of(k) -> int:
    """The seed a call given generator ``_gen(k)`` draws."""
    return int(D.draw_seed(_gen(k)))


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def expected(v, keep, p, backend, dtype):
    """v (float32 / float64 math values) * m, rounded to dtype as the backend rounds."""
    acc = v.dtype
    kept = v * torch.tensor(1.0 / (1.0 - p), dtype=acc)
    rounded = interpreter_rounding(kept, dtype) if backend == "triton" and dtype != acc else kept.to(dtype)
    return torch.where(keep.view(v.shape).to(v.device), rounded, (v * 0).to(dtype))


# ---- the mask: Philox on the CPU == Triton's ---------------------------------------------------

@pytest.mark.skipif(not HAS_TRITON_HERE, reason="needs Triton (a GPU or TRITON_INTERPRET=1)")
def test_cpu_philox_is_tritons_randint4x_and_rand():
    import triton
    import triton.language as tl

    @triton.jit
    def draw(C, R, U, seed, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        counter = tl.load(C + i, mask=i < n, other=0)
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        tl.store(R + i * 4, r0.to(tl.int32, bitcast=True), mask=i < n)
        tl.store(R + i * 4 + 1, r1.to(tl.int32, bitcast=True), mask=i < n)
        tl.store(R + i * 4 + 2, r2.to(tl.int32, bitcast=True), mask=i < n)
        tl.store(R + i * 4 + 3, r3.to(tl.int32, bitcast=True), mask=i < n)
        tl.store(U + i, tl.rand(seed, counter), mask=i < n)

    dev = "cuda" if HAS_CUDA else "cpu"
    counters = torch.tensor([0, 1, 2, 3, 1000, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 32 + 5, 2 ** 40 + 3,
                             2 ** 62 + 7], dtype=torch.int64)
    for seed in (0, 1, 12345, 2 ** 32 - 1, 2 ** 32 + 17, 2 ** 62 + 12345, 2 ** 63 - 2):
        r = torch.empty(len(counters) * 4, dtype=torch.int32, device=dev)
        u = torch.empty(len(counters), dtype=torch.float32, device=dev)
        draw[(1,)](counters.to(dev), r, u, seed, len(counters), BLOCK=16)
        ours = torch.stack(D.philox4x32(seed, counters), 1).reshape(-1)
        assert torch.equal(r.cpu().to(torch.int64) & 0xFFFFFFFF, ours), seed
        # tl.rand is lane 0 through its uint -> [0, 1) map: v = r or ~r (int31), times a float32 factor
        v = torch.where(ours[0::4] >= 2 ** 31, 0xFFFFFFFF - ours[0::4], ours[0::4])
        assert torch.equal(u.cpu(), v.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32))


def test_keep_threshold_is_the_rand_map_compared_with_p():
    """v > keep_threshold(p)  <=>  float32(v) * float32(4.6566127342e-10) >= float32(p), at the
    threshold's edge and on random draws, for every p including 0 and 1."""
    scale = torch.tensor(4.6566127342e-10, dtype=torch.float32)
    gen = _gen(1)
    for p in (0.0, 1e-9, 0.1, 0.25, 1 / 3, 0.5, 0.9, 0.999999, 1.0):
        t = D.keep_threshold(p)
        edge = torch.arange(max(t - 300, 0), min(t + 300, 2 ** 31), dtype=torch.int64)
        v = torch.cat([edge, torch.randint(0, 2 ** 31, (4000,), generator=gen)])
        by_rand = v.to(torch.float32) * scale >= torch.tensor(p, dtype=torch.float32)
        assert torch.equal(v > t, by_rand), p
    assert D.keep_threshold(0.0) == -1 and D.keep_threshold(1.0) == 2 ** 31 - 1


@pytest.mark.skipif(not HAS_TRITON_HERE, reason="needs Triton (a GPU or TRITON_INTERPRET=1)")
def test_cpu_path_and_triton_give_the_same_mask_bit_for_bit():
    dev = "cuda" if HAS_CUDA else "cpu"
    gen = _gen(2)
    for shape, p in (((37, 50), 0.3), ((3, 5, 7), 0.5), ((129,), 0.9), ((2, 8), 0.05)):
        x = _randn(shape, torch.float32, "cpu", gen)
        seed = torch.tensor(seed_of(len(shape) * 7 + 1))
        outs = {}
        for backend, device in (("cpu", "cpu"), ("triton", dev)):
            with trainops.backend(backend):
                outs[backend] = [t.cpu() for t in D.dropout_op(x.to(device), None, None, seed, p, 0, True)]
        assert torch.equal(outs["cpu"][0], outs["triton"][0]), shape
        assert torch.equal(outs["cpu"][1], outs["triton"][1]), shape
        keep = D.keep_mask(x.numel(), int(seed), 0, p)
        assert torch.equal(D.pack_bits(keep), outs["cpu"][1])
        assert torch.equal(D.unpack_bits(outs["triton"][1], x.numel()), keep)


def test_mask_depends_only_on_seed_offset_and_logical_index(backend, device):
    """Blocks, grids, row tiles and strides change nothing; an offset o draws elements o.. of the stream."""
    gen = _gen(3)
    x = _randn((13, 24), torch.float32, device, gen, 1.0, 3.0)  # no zeros: y != 0 is the mask
    dy = _randn((13, 24), torch.float32, device, gen, 1.0, 3.0)
    b = _randn((24,), torch.float32, device, gen)
    results = []
    for config in (DropoutHeuristics(), DropoutHeuristics(block=8, rows_block_n=4, rows_tile=4),
                   DropoutHeuristics(block=64, rows_block_n=16, rows_tile=64, rows_programs_per_sm=3)):
        with trainops.heuristics(config):
            xs = x.clone().requires_grad_()
            bs = b.clone().requires_grad_()
            y = trainops.dropout(xs, 0.4, generator=_gen(4))
            (dx,) = torch.autograd.grad(y, xs, dy)
            z = trainops.bias_dropout_add(xs, bs, x, 0.4, generator=_gen(4))
            dzx, dzb = torch.autograd.grad(z, (xs, bs), dy)
            results.append((y, dx, z, dzx))
    for got in results[1:]:
        assert all(torch.equal(a, b_) for a, b_ in zip(results[0], got))
    keep = D.keep_mask(x.numel(), seed_of(4), 0, 0.4).view(x.shape)
    assert torch.equal(results[0][0] != 0, keep.to(device))
    # a transposed view: the mask follows the logical index, not memory order
    xt = x.t().contiguous().t()
    assert torch.equal(trainops.dropout(xt, 0.4, generator=_gen(4)), results[0][0])
    # a shard at element offset o (a multiple of 4) draws the whole tensor's mask there
    flat = x.reshape(-1)
    for o in (0, 4, 64, 100):
        y = D.dropout_op(flat[o:], None, None, torch.tensor(seed_of(4)), 0.4, o, False)[0]
        assert torch.equal(y, results[0][0].reshape(-1)[o:]), o


# ---- forward and backward values --------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_forward_and_backward_values(backend, device, dtype):
    """Kept elements are exactly x * float32(1 / (1 - p)) rounded once, dropped ones 0; dx = dy * m;
    both mask modes, every plan."""
    gen = _gen(5)
    acc = _acc(dtype)
    for plan in PLANS.values():
        with trainops.heuristics(plan):
            for shape, p in (((9, 30), 0.3), ((3, 5, 7), 0.9), ((1,), 0.5), ((), 0.5), ((2, 9), 1 / 3)):
                k = hash((shape, p)) % 1000
                keep = D.keep_mask(math.prod(shape), seed_of(k), 0, p)
                x = _randn(shape, dtype, device, gen).requires_grad_()
                dy = _randn(shape, dtype, device, gen)
                grads = []
                for mode in ("regenerate", "bits"):
                    y = trainops.dropout(x, p, generator=_gen(k), mask_mode=mode)
                    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
                    assert torch.equal(y, expected(x.detach().to(acc), keep, p, backend, dtype)), (shape, p, mode)
                    (dx,) = torch.autograd.grad(y, x, dy)
                    assert torch.equal(dx, expected(dy.to(acc), keep, p, backend, dtype)), (shape, p, mode)
                    grads.append(dx)
                assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dtype", FLOATS)
def test_bias_dropout_add_matches_float64(backend, device, dtype):
    gen = _gen(6)
    p = 0.25
    for plan in PLANS.values():
        with trainops.heuristics(plan):
            # (7, 5): a last axis not a multiple of 4 (each element its own Philox call in the row kernel)
            for shape, with_bias in (((6, 40), True), ((3, 4, 12), True), ((7, 5), True), ((5, 8), False)):
                k = hash((shape, with_bias)) % 1000
                m = D.keep_mask(math.prod(shape), seed_of(k), 0, p).view(shape).double() / (1 - p)
                x = _randn(shape, dtype, device, gen).requires_grad_()
                r = _randn(shape, dtype, device, gen).requires_grad_()
                b = _randn(shape[-1:], torch.float32, device, gen).requires_grad_() if with_bias else None
                dy = _randn(shape, dtype, device, gen)
                for mode in ("regenerate", "bits"):
                    y = trainops.bias_dropout_add(x, b, r, p, generator=_gen(k), mask_mode=mode)
                    h = x.detach().double() + (b.detach().double() if with_bias else 0)
                    ref = r.detach().double() + h * m.to(device)
                    assert y.dtype == dtype and y.is_contiguous()
                    assert_close(y, ref, dtype, f"{shape} {mode} y")
                    leaves = [t for t in (x, b, r) if t is not None]
                    grads = dict(zip(("x", "b", "r") if with_bias else ("x", "r"),
                                     torch.autograd.grad(y, leaves, dy)))
                    rdx = dy.double() * m.to(device)
                    assert_close(grads["x"], rdx, dtype, f"{shape} {mode} dx")
                    assert grads["r"] is dy or torch.equal(grads["r"], dy)
                    if with_bias:
                        assert grads["b"].dtype == torch.float32
                        # dbias sums dx in float32 (unrounded): float32 accuracy for float32 / float64 x
                        assert_close(grads["b"], rdx.reshape(-1, shape[-1]).sum(0),
                                     torch.float32 if dtype == torch.float64 else dtype, f"{shape} {mode} dbias")


def test_bias_dropout_add_in_eval_and_low_precision_bias(backend, device):
    gen = _gen(7)
    x = _randn((6, 16), torch.bfloat16, device, gen).requires_grad_()
    r = _randn((6, 16), torch.bfloat16, device, gen).requires_grad_()
    b = _randn((16,), torch.bfloat16, device, gen).requires_grad_()
    state = torch.random.get_rng_state()
    for training, p in ((False, 0.5), (True, 0.0)):
        y = trainops.bias_dropout_add(x, b, r, p, training)
        assert_close(y, x.double() + b.double() + r.double(), torch.bfloat16, "eval")
        dy = _randn((6, 16), torch.bfloat16, device, gen)
        dx, db, dr = torch.autograd.grad(y, (x, b, r), dy)
        assert torch.equal(dx, dy) and torch.equal(dr, dy)
        assert db.dtype == torch.bfloat16
        assert_close(db, dy.double().sum(0), torch.bfloat16, "eval dbias")
    assert torch.equal(state, torch.random.get_rng_state()), "nothing is drawn in eval or with p = 0"
    # a frozen bias: no dbias computed; only the residual needing a gradient: no kernel at all
    y = trainops.bias_dropout_add(x, b.detach(), r, 0.5, generator=_gen(8))
    dx, dr = torch.autograd.grad(y, (x, r), torch.ones_like(y))
    assert torch.equal(dr, torch.ones_like(y)) and torch.equal(dx != 0, y.detach() != r.detach())


def test_dbias_is_bit_identical_run_to_run(backend, device):
    gen = _gen(9)
    x = _randn((96, 48), torch.float32, device, gen).requires_grad_()
    b = _randn((48,), torch.float32, device, gen).requires_grad_()
    r = _randn((96, 48), torch.float32, device, gen)
    dy = _randn((96, 48), torch.float32, device, gen)
    with trainops.heuristics(DropoutHeuristics(rows_block_n=16, rows_tile=64)):
        first = torch.autograd.grad(trainops.bias_dropout_add(x, b, r, 0.1, generator=_gen(10)), (x, b), dy)
        for _ in range(2):
            again = torch.autograd.grad(trainops.bias_dropout_add(x, b, r, 0.1, generator=_gen(10)), (x, b), dy)
            assert all(torch.equal(a, c) for a, c in zip(first, again))


def test_gradcheck_float64(backend, device):
    gen = _gen(11)
    x = _randn((3, 2, 8), torch.float64, device, gen).requires_grad_()
    b = _randn((8,), torch.float64, device, gen).requires_grad_()
    r = _randn((3, 2, 8), torch.float64, device, gen).requires_grad_()
    # a fresh generator each call: the same mask every evaluation
    assert torch.autograd.gradcheck(lambda x, b, r: trainops.bias_dropout_add(x, b, r, 0.3, generator=_gen(12)),
                                    (x, b, r), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x: trainops.dropout(x, 0.3, generator=_gen(12), mask_mode="bits"), (x,),
                                    fast_mode=True)


def test_p_one_special_values_and_nan_propagation(backend, device):
    """p = 1 gives x * 0; dropped NaN and inf give NaN, as torch (x * mask)."""
    x = torch.tensor([1.0, -2.0, float("nan"), float("inf"), 0.0, 3.0, -1.0, 5.0, 7.0], device=device)
    y = trainops.dropout(x, 1.0, generator=_gen(13))
    assert torch.equal(y.isnan(), (x * 0).isnan()) and torch.equal(y.nan_to_num(), torch.zeros_like(x))
    keep = D.keep_mask(9, seed_of(14), 0, 0.5).to(device)
    y = trainops.dropout(x, 0.5, generator=_gen(14))
    assert torch.equal(y.isnan(), (x.isnan() | (x.isinf() & ~keep))), "NaN kept, dropped inf is NaN"
    assert torch.equal(y[keep & x.isinf()], x[keep & x.isinf()] * 2)


# ---- statistics --------------------------------------------------------------------------------

def _check_statistics(y: torch.Tensor, y2: torch.Tensor, p: float) -> None:
    """Keep fraction, mean scale, independence of neighbours (1, 4 and 8 apart) and of two calls,
    each within 6 binomial sigma: a p off by 0.01 on 1e5 elements fails."""
    keep = (y != 0).reshape(-1).double()
    n = keep.numel()
    q = 1 - p

    def within(count, trials, prob, what):
        sigma = math.sqrt(trials * prob * (1 - prob))
        assert abs(count - trials * prob) <= 6 * sigma, f"{what}: {count} of {trials}, expected {trials * prob:.1f}"
    within(keep.sum().item(), n, q, "kept")
    # x = 1: y = scale where kept; its mean is 1 (+- the keep count's 6 sigma, scaled)
    mean = y.double().mean().item()
    assert abs(mean - 1) <= 6 * math.sqrt(q * (1 - q) / n) / q, mean
    assert set(torch.unique(y.double()).tolist()) <= {0.0, float(torch.tensor(1 / q, dtype=y.dtype))}
    for lag in (1, 4, 8):
        within((keep[lag:] * keep[:-lag]).sum().item(), n - lag, q * q, f"pairs {lag} apart")
    within((keep * (y2 != 0).reshape(-1).double()).sum().item(), n, q * q, "two calls")


def test_statistics(backend, device):
    x = torch.ones(100_000, device=device)
    for p in (0.1, 0.5):
        torch.manual_seed(15)
        _check_statistics(trainops.dropout(x, p), trainops.dropout(x, p), p)


# ---- seeds -------------------------------------------------------------------------------------

def test_seeds_repeat_with_manual_seed_and_generators(backend, device):
    x = torch.ones(4, 64, device=device)
    torch.manual_seed(16)
    a, b = trainops.dropout(x, 0.5), trainops.dropout(x, 0.5)
    torch.manual_seed(16)
    a2, b2 = trainops.dropout(x, 0.5), trainops.dropout(x, 0.5)
    assert torch.equal(a, a2) and torch.equal(b, b2), "torch.manual_seed makes runs repeat"
    assert not torch.equal(a, b), "each call advances the generator"
    g = _gen(17)
    c, d = trainops.dropout(x, 0.5, generator=g), trainops.dropout(x, 0.5, generator=g)
    assert not torch.equal(c, d)
    assert torch.equal(c, trainops.dropout(x, 0.5, generator=_gen(17)))
    state = torch.random.get_rng_state()
    trainops.dropout(x, 0.5, generator=_gen(18))
    assert torch.equal(state, torch.random.get_rng_state()), "a generator given: the default one is untouched"
    assert trainops.dropout(x, 0.5, training=False) is x and trainops.dropout(x, 0.0) is x
    assert torch.equal(state, torch.random.get_rng_state()), "nothing drawn in eval or with p = 0"
    assert not torch.equal(trainops.dropout(x, 0.5, generator=_gen(19)), trainops.dropout(x, 0.5, generator=_gen(20)))


# ---- layouts and empty tensors -----------------------------------------------------------------

def make_input(shape, layout, dtype, device, gen):
    if layout == "contiguous":
        return _randn(shape, dtype, device, gen, 1.0, 2.0)
    if layout == "transposed":
        return _randn((shape[1], shape[0]) + tuple(shape[2:]), dtype, device, gen, 1.0, 2.0).transpose(0, 1)
    if layout == "strided_last":
        return _randn(tuple(shape[:-1]) + (2 * shape[-1],), dtype, device, gen, 1.0, 2.0)[..., ::2]
    if layout == "expanded":
        return _randn((1,) + tuple(shape[1:]), dtype, device, gen, 1.0, 2.0).expand(shape)
    if layout == "offset":
        return _randn((math.prod(shape) + 3,), dtype, device, gen, 1.0, 2.0)[3:].view(shape)
    if layout == "scrambled":  # five axes no two of which merge: the one layout copied first
        return _randn((3, 2, 2, 2, 3, 5), dtype, device, gen, 1.0, 2.0).permute(4, 0, 3, 1, 2, 5)[..., 1:4]
    raise ValueError(layout)


@pytest.mark.parametrize("layout", ["transposed", "strided_last", "expanded", "offset", "scrambled"])
def test_strided_inputs_give_the_contiguous_results(backend, device, layout, monkeypatch):
    """Any strides: the same outputs as the contiguous copy (the mask follows the logical index), read
    in place (no copy) up to four merged axes."""
    gen = _gen(21)
    shape = (3, 3, 2, 2, 2, 3) if layout == "scrambled" else (6, 5, 12)
    x = make_input(shape, layout, torch.float32, device, gen).requires_grad_()
    r = make_input(shape, "transposed" if layout != "scrambled" else layout, torch.float32, device, gen)
    b = _randn(shape[-1:], torch.float32, device, gen).requires_grad_()
    dy = make_input(shape, layout, torch.float32, device, gen)
    copies = []
    original = torch.Tensor.contiguous

    def spy(self, *args, **kwargs):
        if not self.is_contiguous(*args, **kwargs):
            copies.append(tuple(self.shape))
        return original(self, *args, **kwargs)
    for plan in PLANS.values() if layout == "transposed" else (DropoutHeuristics(),):
        with trainops.heuristics(plan):
            monkeypatch.setattr(torch.Tensor, "contiguous", spy)
            y = trainops.bias_dropout_add(x, b, r, 0.3, generator=_gen(22))
            dx, db = torch.autograd.grad(y, (x, b), dy)
            z = trainops.dropout(x, 0.3, generator=_gen(22), mask_mode="bits")
            (dz,) = torch.autograd.grad(z, x, dy)
            monkeypatch.setattr(torch.Tensor, "contiguous", original)
            xc = x.detach().contiguous().requires_grad_()
            bc = b.detach().clone().requires_grad_()
            yc = trainops.bias_dropout_add(xc, bc, r.contiguous(), 0.3, generator=_gen(22))
            dxc, dbc = torch.autograd.grad(yc, (xc, bc), dy.contiguous())
            zc = trainops.dropout(xc, 0.3, generator=_gen(22))
            (dzc,) = torch.autograd.grad(zc, xc, dy.contiguous())
            for got, want, what in ((y, yc, "y"), (dx, dxc, "dx"), (z, zc, "z"), (dz, dzc, "dz")):
                assert torch.equal(got, want), what
            assert_close(db, dbc, torch.float32, "dbias")  # partial rows may fall differently: same sums
    assert (copies == []) == (layout != "scrambled"), copies


def test_empty_tensors(backend, device):
    for shape in ((0,), (0, 5), (3, 0)):
        x = torch.randn(shape, device=device, requires_grad=True)
        b = torch.randn(shape[-1:], device=device, requires_grad=True)
        y = trainops.dropout(x, 0.5, mask_mode="bits")
        assert y.shape == x.shape
        (dx,) = torch.autograd.grad(y.sum(), x)
        assert dx.shape == x.shape
        z = trainops.bias_dropout_add(x, b, x.detach(), 0.5)
        dx, db = torch.autograd.grad(z.sum(), (x, b))
        assert dx.shape == x.shape and torch.equal(db, torch.zeros_like(b))


# ---- torch.compile, the module, the plan API ---------------------------------------------------

def test_torch_compile_fullgraph(backend, device):
    """Seeds are drawn in the graph from torch's default generator: each call differs, manual_seed
    repeats them; the gradient is the forward's mask."""
    gen = _gen(23)
    x = _randn((4, 32), torch.float32, device, gen, 1.0, 3.0).requires_grad_()
    b = _randn((32,), torch.float32, device, gen).requires_grad_()
    r = _randn((4, 32), torch.float32, device, gen)

    def f(x, b, r):
        return trainops.dropout(x, 0.3) * 2, trainops.bias_dropout_add(x, b, r, 0.5, mask_mode="bits")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(24)
    y, z = compiled(x, b, r)
    y2, z2 = compiled(x, b, r)
    torch.manual_seed(24)
    y3, z3 = compiled(x, b, r)
    assert torch.equal(y, y3) and torch.equal(z, z3) and not torch.equal(y, y2)
    keep_y, keep_z = y != 0, z != r
    assert torch.equal(y, torch.where(keep_y, x.detach() * torch.tensor(1 / 0.7) * 2, 0.0))
    dy = _randn((4, 32), torch.float32, device, gen)
    dx, db = torch.autograd.grad((y, z), (x, b), (dy, dy))
    want = torch.where(keep_y, dy * torch.tensor(1 / 0.7) * 2, 0.0) + torch.where(keep_z, dy * 2.0, 0.0)
    assert_close(dx, want, torch.float32, "dx")
    assert_close(db, torch.where(keep_z, dy * 2.0, 0.0).sum(0), torch.float32, "dbias")
    torch._dynamo.reset()
    g = _gen(1)  # a generator cannot be traced: our UnsupportedError, wrapped by dynamo's
    with pytest.raises(Exception, match="argument 'generator' cannot be traced by torch.compile"):
        torch.compile(lambda t: trainops.dropout(t, 0.3, generator=g), fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()


def test_module_is_a_drop_in(backend, device):
    ours, theirs = trainops.nn.Dropout(0.3), torch.nn.Dropout(0.3)
    assert isinstance(ours, torch.nn.Dropout) and repr(ours) == repr(theirs)
    assert ours.state_dict().keys() == theirs.state_dict().keys() == set()
    x = torch.ones(8, 64, device=device)
    torch.manual_seed(25)
    y = ours(x)
    assert set(torch.unique(y).tolist()) == {0.0, float(torch.tensor(1 / 0.7))}
    torch.manual_seed(25)
    assert torch.equal(trainops.nn.Dropout(0.3, mask_mode="bits")(x), y)
    ours.eval()
    assert ours(x) is x, "eval: the input itself, as torch.nn.Dropout"
    with pytest.raises(ValueError):
        trainops.nn.Dropout(1.5)
    with pytest.raises(InvalidProblemError, match="'mask_mode'"):
        trainops.nn.Dropout(0.3, mask_mode="bytes")


def test_plan_api(backend, device):
    p = trainops.plan("dropout", shape=(8, 32), dtype=torch.float32, device=device, mask_bits=True)
    assert p.precision.bitwise_reproducible
    x = torch.randn(8, 32, device=device) + 3
    y, bits = p.run(x, None, None, DropoutRandom(seed=123, offset=8, p=0.2))
    keep = D.keep_mask(256, 123, 8, 0.2)
    assert torch.equal(y != 0, keep.view(8, 32).to(device)) and torch.equal(bits.cpu(), D.pack_bits(keep))
    pb = trainops.plan("dropout_backward", shape=(8, 32), dtype=torch.float32, device=device, mask_bits=True,
                       bias_dtype=torch.float32)
    dx, db = pb.run(x, bits, DropoutRandom(0, 0, 0.2))
    assert torch.equal(dx, y)
    assert not p.can_implement(x, None, None, DropoutRandom(123, 2, 0.2)), "offset not a multiple of 4"
    assert not pb.can_implement(x, None, DropoutRandom(0, 0, 0.2)), "the plan reads bits"


# ---- errors ------------------------------------------------------------------------------------

def test_errors_name_the_argument():
    x = torch.randn(4, 8)
    cases = [
        (lambda: trainops.dropout(x, -0.1), InvalidProblemError, "'p'"),
        (lambda: trainops.dropout(x, 1.5), InvalidProblemError, "'p'"),
        (lambda: trainops.dropout(x, float("nan")), InvalidProblemError, "'p'"),
        (lambda: trainops.dropout(x, "0.5"), InvalidProblemError, "'p'"),
        (lambda: trainops.dropout(x, True), InvalidProblemError, "'p'"),
        (lambda: trainops.dropout(x, 0.5, mask_mode="bytes"), InvalidProblemError, "'mask_mode'"),
        (lambda: trainops.dropout(x, 0.5, generator=1), InvalidProblemError, "'generator'"),
        (lambda: trainops.dropout(x.int(), 0.5), UnsupportedError, "'input' has dtype"),
        (lambda: trainops.dropout("x", 0.5), InvalidProblemError, "'input' must be a torch.Tensor"),
        (lambda: trainops.bias_dropout_add(x, torch.randn(7), x, 0.5), InvalidProblemError, "'bias' has shape"),
        (lambda: trainops.bias_dropout_add(x, None, x[:2], 0.5), InvalidProblemError, "'residual' has shape"),
        (lambda: trainops.bias_dropout_add(x, None, x.double(), 0.5), InvalidProblemError, "'residual' has dtype"),
        (lambda: trainops.bias_dropout_add(x, None, "r", 0.5), InvalidProblemError, "'residual' must be"),
        (lambda: trainops.bias_dropout_add(x, None, x.to("meta"), 0.5), InvalidProblemError, "'residual' is on"),
        (lambda: trainops.bias_dropout_add(torch.tensor(1.0), torch.randn(1), torch.tensor(1.0), 0.5),
         InvalidProblemError, "'bias'"),
        (lambda: trainops.plan("dropout", shape=(4,), dtype=torch.int32, device="cpu"), UnsupportedError, "'x'"),
        (lambda: trainops.plan("dropout", shape=(4,), dtype=torch.float32, device="cpu",
                               heuristics=DropoutHeuristics(block=12)), InvalidProblemError, "'heuristics'"),
        (lambda: trainops.plan("dropout", shape=(4,), dtype=torch.float32, device="cpu").run(
            x[0, :4], None, None, DropoutRandom(-1, 0, 0.5)), InvalidProblemError, "'seed'"),
        (lambda: trainops.plan("dropout", shape=(4,), dtype=torch.float32, device="cpu").run(
            x[0, :4], None, None, DropoutRandom(1, 2, 0.5)), InvalidProblemError, "'offset'"),
        (lambda: D.dropout_op(x, None, None, torch.tensor(1.0), 0.5, 0, False), InvalidProblemError, "'seed'"),
    ]
    for fn, cls, text in cases:
        with pytest.raises(cls) as info:
            fn()
        assert text in str(info.value), str(info.value)


def test_p_any_real_number_as_torch(backend, device):
    """numpy scalars and other real numbers are probabilities (torch takes them); bools, tensors,
    NaN and values outside [0, 1] are not."""
    np = pytest.importorskip("numpy")
    x = torch.ones(4, 64, device=device)
    for p in (np.float32(0.25), np.float64(0.5), np.float16(0.75), fractions.Fraction(1, 2)):
        got = trainops.dropout(x, p, generator=_gen(21))
        assert torch.equal(got, trainops.dropout(x, float(p), generator=_gen(21))), repr(p)
    assert trainops.dropout(x, np.int64(0)) is x and trainops.dropout(x, np.float32(0.0)) is x
    assert torch.equal(trainops.dropout(x, np.int64(1)), torch.zeros_like(x))
    assert D.check_p("dropout", np.float32(0.1)) == float(np.float32(0.1))
    assert type(D.check_p("dropout", np.float64(0.5))) is float
    for p in (np.float32("nan"), np.float64(1.5), np.float32(-0.1), np.int64(2), np.bool_(True), torch.tensor(0.5),
              10 ** 400, complex(0.5)):
        with pytest.raises(InvalidProblemError) as info:
            trainops.dropout(x, p)
        assert "'p'" in str(info.value), repr(p)


def test_double_backward_raises(backend, device):
    x = torch.randn(4, 8, device=device, dtype=torch.float64, requires_grad=True)
    y = trainops.dropout(x, 0.5)
    with pytest.raises(UnsupportedError, match="double backward"):
        torch.autograd.grad((y * y).sum(), x, create_graph=True)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_a_cuda_generator_is_refused():
    with pytest.raises(InvalidProblemError, match="'generator'"):
        trainops.dropout(torch.randn(4, device="cuda"), 0.5, generator=torch.Generator(device="cuda"))


# ---- real sizes on the GPU ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["regenerate", "bits"])
def test_gpu_dropout_real_size(mode):
    shape, p = (8192, 4096), 0.1
    x = torch.ones(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.manual_seed(26)
    y = trainops.dropout(x, p, mask_mode=mode)
    _check_statistics(y[:64], trainops.dropout(x, p)[:64], p)  # bf16: the kept value is bf16(1 / (1 - p))
    keep = y != 0
    assert keep.float().mean().item() == pytest.approx(1 - p, abs=6 * math.sqrt(p * (1 - p) / x.numel()))
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    (dx,) = torch.autograd.grad(y, x, dy)
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32, device="cuda")
    assert torch.equal(dx, torch.where(keep, (dy.float() * scale).to(torch.bfloat16), 0.0))
    assert torch.equal(y[keep], torch.full_like(y[keep], float(scale.to(torch.bfloat16))))
    # the CPU path's mask of a slice (its stream offset) is the GPU's
    g = _gen(27)
    z = trainops.dropout(x.detach(), p, generator=g)
    o = 4096 * 3000
    assert torch.equal((z != 0).reshape(-1)[o:o + 65536].cpu(), D.keep_mask(65536, seed_of(27), o, p))


@pytest.mark.gpu
def test_gpu_bias_dropout_add_real_size():
    shape, p = (8192, 4096), 0.1
    gen = torch.Generator(device="cuda").manual_seed(28)
    x = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    r = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    b = torch.randn(shape[-1], device="cuda", generator=gen).requires_grad_()
    y = trainops.bias_dropout_add(x, b, r, p, generator=_gen(29))
    keep = D.keep_mask(x.numel(), seed_of(29), 0, p).view(shape).cuda()
    m = keep.double() / (1 - p)
    assert_close(y, r.double() + (x.double() + b.double()) * m, torch.bfloat16, "y")
    dy = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
    dx, db, dr = torch.autograd.grad(y, (x, b, r), dy)
    assert_close(dx, dy.double() * m, torch.bfloat16, "dx")
    assert_close(db, (dy.double() * m).sum(0), torch.float32, "dbias")
    assert torch.equal(dr, dy)
    again = torch.autograd.grad(trainops.bias_dropout_add(x, b, r, p, generator=_gen(29)), (x, b, r), dy)
    assert all(torch.equal(a, c) for a, c in zip((dx, db, dr), again)), "bit-identical run to run"


def test_inplace_as_torch(backend, device):
    """inplace=True writes into the input and returns it (torch's dropout_); eval and p = 0 return the
    input untouched; gradients flow through the in-place result; a leaf that requires grad raises, as
    in torch; the keyword ``input`` is torch's name."""
    x = torch.randn(6, 40, device=device)
    assert trainops.dropout(x, 0.5, training=False, inplace=True) is x
    g = _gen(31)
    y = x.clone()
    out = trainops.dropout(input=y, p=0.4, inplace=True, generator=g)
    assert out is y
    assert torch.equal(y, trainops.dropout(x, 0.4, generator=_gen(31)))
    assert trainops.nn.Dropout(0.4, inplace=True).inplace
    leaf = torch.randn(6, 40, device=device, requires_grad=True)
    h = leaf * 2
    out = trainops.dropout(h, 0.4, inplace=True, generator=_gen(32))
    assert out is h
    (dx,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
    keep = trainops.dropout(torch.ones(6, 40, device=device), 0.4, generator=_gen(32)) != 0
    scale = torch.tensor(1 / 0.6, dtype=torch.float32, device=device)  # dx = 2 * float32(1 / (1 - p)) where kept
    assert torch.equal(dx, torch.where(keep, 2 * scale, torch.zeros_like(dx)))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        trainops.dropout(leaf, 0.4, inplace=True)
