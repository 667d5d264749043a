"""sum_to_shape (broadcast gradients): every backend against float64 torch ``sum_to_size``; the
shapes broadcasting backwards produce (bias, per-channel, attention bias, scalar), layouts
(channels-last, transposed, sliced, expanded, too many runs copied), plans forced to split the
summed elements, empty and length-1 shapes, determinism, autograd, torch.compile, errors."""

import pytest
import torch

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import broadcast as B
from trainops.ops.broadcast import BroadcastSumHeuristics
from trainops.plan import clear_plan_cache
from trainops.registry import triton_available, triton_interpreting

from numerics import FLOATS, assert_sum_close, poison_new_output, stable_seed

# tiny tiles, many programs wanted: the summed elements split among programs (partials added by
# column_sum), several output blocks, steps that do not divide the summed count
SPLIT = BroadcastSumHeuristics(tile=16, kept_block=4, programs_per_sm=64, reduce_block=4, reduce_parts=2)
PLANS = {"default": BroadcastSumHeuristics(), "split": SPLIT}

# (grad shape, target shape): bias of a linear layer, per-channel scale (NCHW and NLC), attention
# bias over heads, a scalar, a row vector, leading axes only, a middle axis, two kept runs
SHAPES = [((6, 5, 7), (7,)), ((4, 3, 5, 6), (3, 1, 1)), ((4, 3, 5, 6), (1, 3, 1, 1)), ((2, 3, 4, 4), (2, 1, 4, 4)),
          ((5, 9), ()), ((5, 9), (5, 1)), ((3, 4, 5), (4, 5)), ((3, 4, 5), (3, 1, 5)), ((2, 3, 4, 5, 6), (3, 1, 5, 1)),
          ((1, 37), (1,)), ((7,), (1,))]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN, so an element left unwritten fails the test."""
    poison_new_output(monkeypatch, B.SumToShapeProblem)
    clear_plan_cache()
    yield
    clear_plan_cache()


def _grad(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def _check(out, grad, shape, dtype):
    """out against float64 torch, held to the summed terms' absolute sums (assert_sum_close); the
    interpreter truncates float32 -> bfloat16 where the GPU rounds, so a bf16 result there is
    allowed its one-ulp difference by the tolerance (1e-2) already."""
    assert out.shape == torch.Size(shape) and out.dtype == dtype and out.is_contiguous()
    ref = grad.double().cpu().sum_to_size(shape) if shape != () else grad.double().cpu().sum()
    scale = grad.double().cpu().abs().sum_to_size(shape) if shape != () else grad.double().cpu().abs().sum()
    assert_sum_close(out, ref.reshape(shape), scale.reshape(shape), dtype, f"{tuple(grad.shape)} -> {shape}")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_matches_float64(backend, device, dtype, plan):
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), plan))
    with trainops.heuristics(PLANS[plan]):
        for grad_shape, shape in SHAPES:
            grad = _grad(grad_shape, dtype, device, gen)
            _check(trainops.sum_to_shape(grad, shape), grad, shape, dtype)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_layouts(backend, device, plan):
    """channels-last, a transpose, a slice with a step, an expanded grad (stride 0), a permutation
    that leaves more runs than the kernel walks (copied first): read where they lie."""
    gen = torch.Generator().manual_seed(stable_seed("layouts", plan))
    cl = _grad((4, 3, 5, 6), torch.float32, device, gen).to(memory_format=torch.channels_last)
    transposed = _grad((7, 6, 5), torch.float32, device, gen).transpose(0, 2)
    sliced = _grad((6, 10, 8), torch.float32, device, gen)[:, 1::3, ::2]
    expanded = _grad((1, 5, 1), torch.float32, device, gen).expand(4, 5, 3)
    # six summed axes in swapped pairs: sorted by stride, they walk as one run (read in place)
    swapped = _grad((2, 3, 2, 3, 2, 3), torch.float32, device, gen).permute(1, 0, 3, 2, 5, 4)
    # five summed axes that no order merges (a step of 2 on each): one more run than the kernel's
    # four slots, copied to a contiguous tensor first (where they merge into one)
    gapped = _grad((4, 4, 4, 4, 4), torch.float32, device, gen)[::2, ::2, ::2, ::2, ::2]
    reversed_ = _grad((7, 6, 5, 4, 3), torch.float32, device, gen).permute(4, 3, 2, 1, 0)
    # rank 7, kept and summed axes alternating from a kept one: four kept runs, three summed
    alternating = _grad((2, 3, 2, 3, 2, 3, 2), torch.float32, device, gen)
    cases = [(cl, (3, 1, 1)), (cl, (1, 1, 6)), (cl, (4, 1, 1, 6)), (transposed, (6, 1)), (transposed, (5, 1, 1)),
             (sliced, (4,)), (sliced, (6, 1, 1)), (expanded, (5, 1)), (expanded, (4, 1, 3)),
             (swapped, (1, 1, 1, 1, 1, 1)), (swapped, ()), (alternating, (2, 1, 2, 1, 2, 1, 2)), (gapped, ()),
             (reversed_, (1, 1, 1, 1, 1)), (reversed_, (3, 1, 1, 1, 7))]
    assert B.walk_of(B.runs(swapped.shape, swapped.stride(), B.summed_axes(swapped.shape, ()))) is not None
    assert B.walk_of(B.runs(gapped.shape, gapped.stride(), B.summed_axes(gapped.shape, ()))) is None
    with trainops.heuristics(PLANS[plan]):
        for grad, shape in cases:
            _check(trainops.sum_to_shape(grad, shape), grad, shape, torch.float32)


# (grad shape, target shape): tiles of 4-wide lanes blocks (widened where the other axis is short)
# over a kept innermost axis (one run; two runs whose inner one the block divides, or not) and a
# summed innermost axis (one run; inner runs of 32, 24 and 5)
NARROW = BroadcastSumHeuristics(tile=16, kept_block=4, programs_per_sm=64, reduce_block=4, reduce_parts=2)
INNER_RUNS = [((6, 5, 8), (8,)), ((6, 4, 8), (4, 8)), ((4, 3, 8), (4, 1, 8)), ((4, 3, 6), (4, 1, 6)), ((8, 12), (8, 1)),
              ((3, 8, 4, 8), (1, 8, 1, 1)), ((3, 8, 4, 6), (1, 8, 1, 1)), ((3, 8, 5), (1, 8, 1)), ((2, 40), (40,))]


def test_narrow_tiles_over_inner_runs(backend, device):
    gen = torch.Generator().manual_seed(stable_seed("inner runs"))
    with trainops.heuristics(NARROW):
        for grad_shape, shape in INNER_RUNS:
            grad = _grad(grad_shape, torch.float32, device, gen)
            _check(trainops.sum_to_shape(grad, shape), grad, shape, torch.float32)


def test_tiles_fill_the_tile(monkeypatch):
    """A short axis across the lanes' widens the lanes' block (the tile stays full), and the split
    gives at least programs_per_sm programs per SM where the summed elements allow."""
    problem = trainops.plan("sum_to_shape", grad_shape=(32, 4096), dtype=torch.bfloat16, device="cpu", shape=(4096,),
                            heuristics=BroadcastSumHeuristics(tile=4096, kept_block=64)).problem
    block_k, block_r, summed_inner, splits = B.tiles(problem)[:4]
    assert (block_k, block_r, summed_inner) == (128, 32, False)
    # an H100's 132 SMs: 501 output blocks of 64 are fewer than 4 programs per SM, so the summed
    # rows are split in two (rounded down, as before, one split: 501 programs)
    monkeypatch.setattr(B, "sm_count", lambda device: 132)
    problem = trainops.plan("sum_to_shape", grad_shape=(8192, 32001), dtype=torch.bfloat16, device="cpu",
                            shape=(32001,), heuristics=BroadcastSumHeuristics(tile=4096, kept_block=64,
                                                                              programs_per_sm=4)).problem
    block_k, block_r, _, splits = B.tiles(problem)[:4]
    assert (block_k, splits) == (64, 2) and -(-32001 // block_k) * splits >= 132 * 4


def test_walk_groups_axes_into_runs():
    """The kernel's view of grad: size-1 axes dropped; summed axes sorted by stride and merged where
    they walk as one, in R0..R3; kept axes in the output's order, merged likewise, in K0..K3."""
    summed = B.summed_axes((4, 3, 5, 6), (3, 1, 1))
    assert summed == (True, False, True, True)
    assert B.runs((4, 3, 5, 6), (90, 30, 6, 1), summed) == [(True, 4, 90), (True, 30, 1), (False, 3, 30)]
    walk = B.walk_of(B.runs((4, 3, 5, 6), (90, 30, 6, 1), summed))
    assert walk.summed == ((4, 90), (30, 1), (1, 0), (1, 0)) and walk.kept == ((3, 30), (1, 0), (1, 0), (1, 0))
    assert walk.inner == "summed" and walk.kept_count == 3 and walk.summed_count == 120
    # channels-last: C has stride 1; N, H and W walk as one summed run (strides 90 = 18 x 5, 18 = 3 x 6)
    walk = B.walk_of(B.runs((4, 3, 5, 6), (90, 1, 18, 3), summed))
    assert walk.summed == ((120, 3), (1, 0), (1, 0), (1, 0)) and walk.inner == "kept"
    # a reversed (transposed) rank-5 tensor summed whole: sorted, its axes merge into one run
    assert B.runs((3, 4, 5, 6, 7), (1, 3, 12, 60, 360), (True,) * 5) == [(True, 2520, 1)]
    # two kept runs that do not merge (a transpose)
    walk = B.walk_of(B.runs((5, 6), (1, 5), (False, False)))
    assert walk.kept == ((5, 1), (6, 5), (1, 0), (1, 0)) and walk.summed == ((1, 0),) * 4
    # five runs of one kind: more than the slots
    assert B.walk_of([(True, 2, 1)] * 5) is None and B.walk_of([(False, 2, 1)] * 5) is None


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_empty_and_length_one(backend, device, plan):
    gen = torch.Generator().manual_seed(7)
    with trainops.heuristics(PLANS[plan]):
        zero_summed = trainops.sum_to_shape(torch.empty(0, 4, device=device), (4,))
        assert torch.equal(zero_summed, torch.zeros(4, device=device))   # an empty sum is 0, as torch's
        assert trainops.sum_to_shape(torch.empty(3, 0, device=device), (1, 0)).shape == (1, 0)
        assert trainops.sum_to_shape(torch.empty(3, 0, device=device), (1, 1)).tolist() == [[0.0]]
        one = _grad((1, 1), torch.float32, device, gen)
        assert torch.equal(trainops.sum_to_shape(one, ()), one.reshape(()))
        x = _grad((5,), torch.float32, device, gen)
        assert trainops.sum_to_shape(x, (5,)) is x   # nothing summed: grad itself, as torch's sum_to_size


def test_huge_and_special_values(backend, device):
    """inf and NaN propagate as in a float64 sum; float32 values near the top of its range sum as
    torch's float32 sum does."""
    x = torch.tensor([[1.0, float("inf")], [2.0, 3.0], [float("nan"), 1.0]], device=device)
    out = trainops.sum_to_shape(x, (2,))
    assert out[0].isnan() and out[1] == float("inf")
    big = torch.full((2, 3), 1e38, device=device)
    assert torch.equal(trainops.sum_to_shape(big, (3,)), big.sum(0))


def test_deterministic(backend, device):
    gen = torch.Generator().manual_seed(8)
    grad = _grad((24, 6, 17), torch.float32, device, gen, scale=1e3)
    with trainops.heuristics(SPLIT):
        first = trainops.sum_to_shape(grad, (6, 1))
        assert torch.equal(trainops.sum_to_shape(grad, (6, 1)), first)


def test_split_plan_splits():
    """The SPLIT plan reaches the partial sums (more than one split) on these tests' shapes."""
    problem = trainops.plan("sum_to_shape", grad_shape=(24, 6, 17), dtype=torch.float32,
                            device="cpu", shape=(6, 1), heuristics=SPLIT).problem
    assert B.tiles(problem)[3] > 1


def test_autograd_and_gradcheck(backend, device):
    gen = torch.Generator().manual_seed(9)
    grad = _grad((3, 4, 5), torch.float64, device, gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: trainops.sum_to_shape(t, (4, 1)), (grad,))
    out = trainops.sum_to_shape(grad, (4, 1))
    dout = _grad((4, 1), torch.float64, device, gen)
    (dgrad,) = torch.autograd.grad(out, grad, dout)
    assert torch.equal(dgrad, dout.expand(3, 4, 5))


def test_broadcasting_backward_end_to_end(backend, device):
    """The use it exists for: the gradient of a / b with b broadcast, reduced to b's shape, equals
    autograd's for b (torch's own sum_to_size inside its DivBackward)."""
    gen = torch.Generator().manual_seed(10)
    a = _grad((8, 4, 6), torch.float64, device, gen).requires_grad_()
    b = (_grad((4, 1), torch.float64, device, gen).abs() + 1).requires_grad_()
    dy = _grad((8, 4, 6), torch.float64, device, gen)
    (db,) = torch.autograd.grad(a / b, b, dy)
    ours = trainops.sum_to_shape(-dy * a.detach() / b.detach() ** 2, b.shape)
    assert torch.allclose(ours, db, rtol=1e-12, atol=0)


def test_compile_fullgraph(backend, device):
    gen = torch.Generator().manual_seed(11)
    grad = _grad((6, 4, 5), torch.float32, device, gen).requires_grad_()

    def f(t):
        return trainops.sum_to_shape(t * 2.0, (4, 1)) + 1.0

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    out = compiled(grad)
    _check(out - 1.0, grad.detach() * 2.0, (4, 1), torch.float32)
    (dgrad,) = torch.autograd.grad(out.sum(), grad)
    assert torch.equal(dgrad, torch.full_like(grad, 2.0))


def test_compile_dynamic_shapes(backend, device):
    """Under torch.compile with symbolic sizes (a recompile for a second shape, or dynamic=True) the
    shape check decides on symbols, as torch's sum_to_size does."""
    def f(t, b):
        return trainops.sum_to_shape(t * b, b.shape)

    for dynamic in (None, True):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
        for cols in (8, 10, 13):
            t, b = torch.randn(4, cols, device=device), torch.randn(cols, device=device)
            _check(compiled(t, b), t * b, (cols,), torch.float32)


def test_compile_dynamic_shapes_compile_once(backend, device):
    """With dynamic=True, three sizes make one graph (the shape check does not fix the sizes), as
    torch's sum_to_size does."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda t, b: trainops.sum_to_shape(t * b, b.shape), backend=counter, dynamic=True)
    for cols in (8, 10, 13):
        t, b = torch.randn(4, cols, device=device), torch.randn(cols, device=device)
        _check(compiled(t, b), t * b, (cols,), torch.float32)
    assert counter.frame_count == 1


def test_registry_reports_the_kernel(backend, device):
    with trainops.track_kernels() as used:
        trainops.sum_to_shape(torch.ones(4, 3, device=device), (3,))
    assert [k[:3] for k in used] == [("sum_to_shape", backend, f"sum_to_shape_{backend}")]


def test_errors(backend, device):
    x = torch.ones(2, 3, device=device)
    with pytest.raises(InvalidProblemError, match="shape"):
        trainops.sum_to_shape(x, (2,))          # right-aligned: 2 against 3
    with pytest.raises(InvalidProblemError, match="shape"):
        trainops.sum_to_shape(x, (1, 2, 3))     # more axes than grad
    with pytest.raises(InvalidProblemError, match="shape"):
        trainops.sum_to_shape(x, 3)
    with pytest.raises(InvalidProblemError, match="shape"):
        trainops.sum_to_shape(x, ("a",))
    with pytest.raises(InvalidProblemError, match="shape"):
        trainops.sum_to_shape(x, torch.tensor([3]))
    with pytest.raises(InvalidProblemError, match="grad"):
        trainops.sum_to_shape([1.0, 2.0], (1,))
    with pytest.raises(UnsupportedError, match="grad"):
        trainops.sum_to_shape(torch.ones(2, 3, dtype=torch.int64, device=device), (3,))
    for bad in (BroadcastSumHeuristics(tile=12), BroadcastSumHeuristics(reduce_block=48),
                BroadcastSumHeuristics(programs_per_sm=0), BroadcastSumHeuristics(reduce_parts=3),
                BroadcastSumHeuristics(warps=64), BroadcastSumHeuristics(tile=64, kept_block=128),
                BroadcastSumHeuristics(kept_block=2.0), BroadcastSumHeuristics(programs_per_sm=1.5),
                BroadcastSumHeuristics(reduce_block=None), BroadcastSumHeuristics(kept_run_walk=1)):
        with pytest.raises(InvalidProblemError, match="heuristics"):
            with trainops.heuristics(bad):
                trainops.sum_to_shape(x, (3,))


def test_more_runs_than_the_kernel_walks(backend, device):
    """Rank 10, kept and summed axes alternating: five runs of each kind even when contiguous. The
    Triton backend says so by name (no silent fallback); the CPU backend takes it."""
    alternating = torch.randn((2,) * 10, device=device)
    if backend == "triton":
        with pytest.raises(UnsupportedError, match="runs"):
            trainops.sum_to_shape(alternating, (2, 1) * 5)
    else:
        _check(trainops.sum_to_shape(alternating, (2, 1) * 5), alternating, (2, 1) * 5, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_real_sizes(dtype):
    """The shapes of a transformer's and a CNN's broadcasting backwards, at training sizes."""
    gen = torch.Generator().manual_seed(12)
    for grad_shape, shape, layout in [((8, 1024, 4096), (4096,), None), ((32, 256, 56, 56), (256, 1, 1), None),
                                      ((32, 256, 56, 56), (256, 1, 1), torch.channels_last),
                                      ((8, 32, 1024, 1024), (8, 1, 1024, 1024), None), ((4096, 4096), (4096, 1), None)]:
        grad = _grad(grad_shape, dtype, "cuda", gen)
        if layout is not None:
            grad = grad.to(memory_format=layout)
        out = trainops.sum_to_shape(grad, shape)
        _check(out, grad, shape, dtype)
        assert torch.equal(trainops.sum_to_shape(grad, shape), out)


def test_rule_picks_the_measured_tiles(monkeypatch):
    """The default tiles (every heuristics field None) follow the sweep's winners on 132 SMs: row
    sums and NCHW per-channel sums along 1024-wide summed lanes; kept lanes as wide as two output
    blocks per SM allow, 32 below that (256-row tiles in bf16, 64-row ones in float32), 1024
    where grad's rows are not 16-byte aligned (those walked as (outer index, innermost run))."""
    monkeypatch.setattr(B, "sm_count", lambda device: 132)

    def rule_of(grad_shape, shape, dtype=torch.bfloat16, channels_last=False):
        strides = torch.empty(grad_shape, dtype=dtype).to(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format).stride()
        problem = trainops.plan("sum_to_shape", grad_shape=grad_shape, dtype=dtype, device="cpu", shape=shape,
                                strides=strides, heuristics=BroadcastSumHeuristics()).problem
        return B.rule(problem), B.tiles(problem)

    assert rule_of((8192, 4096), (8192, 1))[0] == (1024, 2048, 2, 8, False)
    assert rule_of((32, 2048, 7, 7), (2048, 1, 1))[1][:3] == (32, 64, True)   # lanes capped by the 49 positions
    assert rule_of((8, 1024, 4096), (4096,))[0] == (32, 8192, 2, 8, False)
    assert rule_of((8, 1024, 4096), (4096,))[1][:2] == (32, 256)
    assert rule_of((8, 1024, 4096), (4096,), torch.float32)[0] == (32, 2048, 8, 4, False)
    assert rule_of((32, 256, 56, 56), (256, 1, 1), channels_last=True)[0] == (32, 8192, 2, 8, False)
    assert rule_of((8, 1024, 4096), (8, 1, 4096))[0] == (64, 8192, 2, 4, False)    # 32768 outputs: 512 blocks of 64
    assert rule_of((4, 32, 1024, 1024), (4, 1, 1024, 1024))[0] == (1024, 2048, 2, 4, False)
    assert rule_of((4, 2047, 32001), (32001,))[0] == (1024, 2048, 8, 4, True)       # rows of 64002 bytes
    # a field given overrides the rule's value, the others stay the rule's
    problem = trainops.plan("sum_to_shape", grad_shape=(8192, 4096), dtype=torch.bfloat16, device="cpu",
                            shape=(8192, 1), heuristics=BroadcastSumHeuristics(warps=2)).problem
    assert B.tiles(problem).warps == 2 and B.tiles(problem)[:2] == (2, 1024)


@pytest.mark.parametrize("run_walk", [True, False])
def test_both_walks_of_kept_lanes(backend, device, run_walk):
    """Kept runs along the lanes walked as one flat index or as (outer index, innermost run): the
    same sums, with blocks that do not divide the innermost run (6 outputs in 4-wide blocks) and
    with the summed elements split."""
    gen = torch.Generator().manual_seed(stable_seed("kept lanes walks"))
    with trainops.heuristics(BroadcastSumHeuristics(tile=16, kept_block=4, programs_per_sm=64, reduce_block=4,
                                                    reduce_parts=2, kept_run_walk=run_walk)):
        for grad_shape, shape in [((5, 3, 6), (3, 6)), ((4, 3, 6), (4, 1, 6)), ((2, 3, 4, 6), (3, 1, 6)),
                                  ((7, 2, 3, 6), (2, 3, 1))]:
            grad = _grad(grad_shape, torch.float32, device, gen)
            problem = trainops.plan("sum_to_shape", grad_shape=grad_shape, dtype=torch.float32, device=device,
                                    shape=shape, strides=grad.stride()).problem
            t = B.tiles(problem)
            assert t.kept_run_walk == (run_walk and not t.summed_inner)
            _check(trainops.sum_to_shape(grad, shape), grad, shape, torch.float32)
            swapped = grad.transpose(-1, -2)   # grad's last two axes swapped in a strided view
            target = (*shape[:-2], shape[-1], shape[-2])
            _check(trainops.sum_to_shape(swapped, target), swapped, target, torch.float32)


def test_kept_run_walk_writes_only_its_run(monkeypatch):
    """The run walk's last block of an innermost kept run (6 outputs, blocks of 4) writes that run's
    outputs and nothing past it: the programs of the first run alone (a cut-down grid) into a
    poisoned output leave the second run untouched. (With the whole grid the second run's programs
    would overwrite a stray write under the interpreter, which runs programs in order.)"""
    if not triton_available():
        pytest.skip("needs Triton")
    device = "cpu" if triton_interpreting() else "cuda"   # the kernel launched directly: where Triton runs
    monkeypatch.setattr(B, "sm_count", lambda device: 1)     # the same plan on any machine
    gen = torch.Generator().manual_seed(stable_seed("run walk bounds"))
    grad = _grad((2, 5, 6), torch.float32, device, gen)   # kept runs (2, stride 30) and (6, stride 1)
    heuristics = BroadcastSumHeuristics(tile=16, kept_block=4, programs_per_sm=1, warps=1, kept_run_walk=True)
    problem = trainops.plan("sum_to_shape", grad_shape=(2, 5, 6), dtype=torch.float32, device=device,
                            shape=(2, 1, 6), heuristics=heuristics).problem
    t, grid, trailing, meta = B.kernel_arguments(problem)
    assert t.kept_run_walk and t.block_k == 4 and grid == (4, 1), (t, grid)
    out = torch.full((12,), float("nan"), device=device)
    B._sum_to_shape[(2, 1)](grad, out, *trailing, **meta)   # outer index 0 only: outputs 0-5
    assert torch.isnan(out[6:]).all(), out
    assert torch.allclose(out[:6], grad.sum(1).reshape(-1)[:6], rtol=1e-6, atol=1e-6)


def test_short_summed_runs_take_kept_lanes(backend, device, monkeypatch):
    """A stride-1 summed run of 2-3 elements over few outputs would leave a summed-lanes tile of a
    few elements: the kept runs take the lanes instead (the tile stays full), same sums."""
    monkeypatch.setattr(B, "sm_count", lambda device: 132)
    for grad_shape, shape in [((262144, 8, 2), (1, 8, 1)), ((4096, 16, 2, 2), (16, 1, 1)), ((8192, 64, 3), (64, 1))]:
        problem = trainops.plan("sum_to_shape", grad_shape=grad_shape, dtype=torch.bfloat16, device=device,
                                shape=shape, heuristics=BroadcastSumHeuristics()).problem
        t = B.tiles(problem)
        assert problem.walk.inner == "summed" and not t.summed_inner and t.block_k * t.block_r == 2048, t
    gen = torch.Generator().manual_seed(stable_seed("short summed runs"))
    for grad_shape, shape in [((64, 8, 2), (1, 8, 1)), ((16, 16, 2, 2), (16, 1, 1)), ((64, 64, 3), (64, 1))]:
        grad = _grad(grad_shape, torch.float32, device, gen)
        _check(trainops.sum_to_shape(grad, shape), grad, shape, torch.float32)


def test_summed_lanes_split_across_and_within_the_inner_run(backend, device):
    """Summed along the lanes, the summed elements split over the outer summed index and within the
    innermost summed run at once (3 outer indices, 8 splits of a 32-long run)."""
    gen = torch.Generator().manual_seed(stable_seed("summed lanes splits"))
    with trainops.heuristics(NARROW):
        problem = trainops.plan("sum_to_shape", grad_shape=(3, 8, 4, 8), dtype=torch.float32, device=device,
                                shape=(1, 8, 1, 1)).problem
        t = B.tiles(problem)
        assert t.summed_inner and t.splits3 > 1 and t.splits > t.splits3, t
        grad = _grad((3, 8, 4, 8), torch.float32, device, gen)
        _check(trainops.sum_to_shape(grad, (1, 8, 1, 1)), grad, (1, 8, 1, 1), torch.float32)
