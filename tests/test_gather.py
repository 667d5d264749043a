"""Gather, GatherGrad and embedding: every backend and kernel, against float64 references."""

import os
import math
import random
import zlib

import pytest
import torch

import trainops
from trainops.ops import gather as gather_ops
from trainops.plan import clear_plan_cache

from conftest import HAS_CUDA
from numerics import FLOATS, TOLERANCE, assert_close

LAYOUTS = ["contiguous", "transposed", "sliced", "expanded"]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN, so an element left unwritten fails the test."""
    for cls in (gather_ops.GatherProblem, gather_ops.GatherBackwardProblem):
        def new_output(self, _original=cls.new_output):
            return _original(self).fill_(float("nan"))
        monkeypatch.setattr(cls, "new_output", new_output)
    clear_plan_cache()
    yield
    clear_plan_cache()


@pytest.fixture(params=[True, False], ids=["sorted", "atomic"])
def deterministic(request):
    return request.param


def seed_of(*key) -> int:
    """A seed stable across processes (str hashes are salted per process)."""
    return zlib.crc32(repr(key).encode())


def layout_tensor(shape, layout, dtype, device, gen):
    """A random tensor of ``shape`` stored in ``layout``."""
    rank = len(shape)
    if layout == "contiguous" or rank < 2:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 2).to(dtype).to(device)
    if layout == "transposed":
        return layout_tensor(shape[::-1], "contiguous", dtype, device, gen).permute(*reversed(range(rank)))
    if layout == "sliced":
        big = layout_tensor([s + 2 for s in shape], "contiguous", dtype, device, gen)
        return big[tuple(slice(1, 1 + s) for s in shape)]
    if layout == "expanded":
        small = [1] + list(shape[1:])
        return layout_tensor(small, "contiguous", dtype, device, gen).expand(shape)
    raise ValueError(layout)


def random_index(shape, size, dtype, device, gen, negative=True):
    low = -size if negative else 0
    return torch.randint(low, size, shape, generator=gen, dtype=torch.int64).to(dtype).to(device)


def reference_gather(x, index, dim):
    dim %= x.dim()
    rows = torch.where(index < 0, index + x.shape[dim], index).long().flatten().to(x.device)
    out = x.double().index_select(dim, rows)
    return out.reshape(x.shape[:dim] + index.shape + x.shape[dim + 1:])


def reference_gather_backward(dy, index, dim, input_shape, padding_idx=None, scale_grad_by_freq=False):
    dim %= len(input_shape)
    size = input_shape[dim]
    b, i = math.prod(input_shape[:dim]), math.prod(input_shape[dim + 1:])
    rows = torch.where(index < 0, index + size, index).long().flatten().cpu()
    dx = torch.zeros(b, size, i, dtype=torch.float64)
    dx.index_add_(1, rows, dy.detach().double().cpu().reshape(b, rows.numel(), i))
    if scale_grad_by_freq:
        dx /= torch.bincount(rows, minlength=size).clamp(min=1).double().view(1, size, 1)
    if padding_idx is not None:
        dx[:, padding_idx] = 0
    return dx.reshape(input_shape)


# ---- gather ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_random_shapes(backend, device, dtype, index_dtype):
    gen = torch.Generator().manual_seed(seed_of(backend, dtype, index_dtype))
    rnd = random.Random(gen.initial_seed())
    for trial in range(6):
        rank = rnd.randint(1, 4)
        shape = [rnd.randint(1, 6) for _ in range(rank)]
        dim = rnd.randrange(-rank, rank)
        index_shape = [rnd.randint(0 if trial == 5 else 1, 4) for _ in range(rnd.randint(0, 3))]
        layout = LAYOUTS[trial % len(LAYOUTS)]
        x = layout_tensor(shape, layout, dtype, device, gen)
        index = random_index(index_shape, shape[dim], index_dtype, device, gen)
        out = trainops.gather(x, index, dim)
        ref = reference_gather(x, index, dim)
        assert out.dtype == dtype and out.shape == ref.shape
        assert torch.equal(out.double().cpu(), ref.cpu()), (shape, dim, index_shape, layout)


def test_gather_long_inner_rows_and_many_blocks(backend, device):
    gen = torch.Generator().manual_seed(1)
    x = layout_tensor([2, 9, 2100], "contiguous", torch.float32, device, gen)  # inner spans two row blocks
    index = random_index([3, 5], 9, torch.int32, device, gen)
    assert torch.equal(trainops.gather(x, index, 1).double().cpu(), reference_gather(x, index, 1).cpu())


def test_gather_scalar_index_and_empty_axes(backend, device):
    x = torch.arange(12.0, device=device).reshape(3, 4)
    assert torch.equal(trainops.gather(x, torch.tensor(-1, device=device), 1).cpu(), x[:, 3].cpu())
    empty = trainops.gather(x, torch.zeros(0, 2, dtype=torch.long, device=device), 0)
    assert empty.shape == (0, 2, 4)
    no_rows = torch.empty(0, 5, device=device)
    assert trainops.gather(no_rows, torch.tensor([1, 4], device=device), 1).shape == (0, 2)


# ---- gather_backward ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_backward_random_shapes(backend, device, deterministic, dtype, index_dtype):
    gen = torch.Generator().manual_seed(seed_of(backend, deterministic, dtype, index_dtype))
    rnd = random.Random(gen.initial_seed())
    for trial in range(5):
        rank = rnd.randint(1, 3)
        shape = [rnd.randint(1, 5) for _ in range(rank)]
        dim = rnd.randrange(-rank, rank)
        index_shape = [rnd.randint(0 if trial == 4 else 1, 6) for _ in range(rnd.randint(0, 2))]
        index = random_index(index_shape, shape[dim], index_dtype, device, gen)
        d = dim % rank
        dy_shape = shape[:d] + index_shape + shape[d + 1:]
        dy = layout_tensor(dy_shape, LAYOUTS[trial % len(LAYOUTS)], dtype, device, gen)
        dx = trainops.gather_backward(dy, index, dim, shape, deterministic=deterministic)
        assert dx.dtype == dtype and dx.shape == tuple(shape)
        assert_close(dx, reference_gather_backward(dy, index, dim, shape), dtype,
                     f"{shape} dim={dim} index={index_shape} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_backward_hot_rows(backend, device, deterministic, dtype):
    """Runs longer than a chunk take the partial-sum path; small chunks exercise it at test sizes."""
    with trainops.heuristics(gather_ops.GatherHeuristics(chunk=4)):
        _check_hot_rows(device, deterministic, dtype)


def _check_hot_rows(device, deterministic, dtype):
    gen = torch.Generator().manual_seed(7)
    size, inner = 23, 5
    # a Zipf-like stream: row 3 takes half the positions, then 1/k decay, plus one long run at the end
    ranks = torch.arange(1, size + 1, dtype=torch.float64)
    index = torch.multinomial(1 / ranks, 120, replacement=True, generator=gen)
    index[::2] = 3
    index = torch.cat([index, torch.full((13,), size - 1)]).to(device)
    dy = layout_tensor([2, index.numel(), inner], "contiguous", dtype, device, gen)
    dx = trainops.gather_backward(dy, index, 1, [2, size, inner], deterministic=deterministic)
    assert_close(dx, reference_gather_backward(dy, index, 1, [2, size, inner]), dtype, "hot rows")
    # the embedding options on hot rows: the hottest row is padding, every row scaled by its count
    dx = trainops.ops.gather.gather_backward_op(dy, index, 1, [2, size, inner], deterministic, 3, True, False, True)
    ref = reference_gather_backward(dy, index, 1, [2, size, inner], padding_idx=3, scale_grad_by_freq=True)
    assert_close(dx, ref, dtype, "hot rows, padding and scale")


def test_gather_backward_every_index_equal(backend, device):
    dy = torch.randn(50, 3, dtype=torch.float64).to(device)
    index = torch.full((50,), 2, device=device)
    with trainops.heuristics(gather_ops.GatherHeuristics(chunk=4)):
        dx = trainops.gather_backward(dy, index, 0, [4, 3])
    assert_close(dx, reference_gather_backward(dy, index, 0, [4, 3]), torch.float64, "one row")


def test_gather_backward_is_bitwise_reproducible(backend, device):
    gen = torch.Generator().manual_seed(3)
    index = torch.randint(0, 6, (200,), generator=gen).to(device)
    dy = torch.randn(200, 7, generator=gen).to(device)
    with trainops.heuristics(gather_ops.GatherHeuristics(chunk=8)):
        first = trainops.gather_backward(dy, index, 0, [6, 7])
        clear_plan_cache()
        second = trainops.gather_backward(dy.clone(), index.clone(), 0, [6, 7])
    assert torch.equal(first.view(torch.int32), second.view(torch.int32))


def test_gather_backward_expanded_dy(backend, device, deterministic):
    index = torch.tensor([[1, 1], [0, 3]], device=device)
    dy = torch.tensor(2.5, device=device).expand(3, 2, 2)
    dx = trainops.gather_backward(dy, index, 1, [3, 4], deterministic=deterministic)
    assert_close(dx, reference_gather_backward(dy, index, 1, [3, 4]), torch.float32, "expanded dy")


# ---- embedding ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_embedding_matches_torch(backend, device, dtype, padding_idx, scale_grad_by_freq):
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(9, 6, generator=gen).to(dtype).to(device)
    index = torch.randint(0, 9, (4, 7), generator=gen)
    index[0, :5] = 2  # repeats, and the padding row
    index = index.to(device)
    w = weight.clone().requires_grad_()
    out = trainops.embedding(index, w, padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    ref_w = weight.double().cpu().requires_grad_()
    ref = torch.nn.functional.embedding(index.cpu(), ref_w, padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    assert torch.equal(out.double().cpu(), ref.detach())
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    out.backward(g.to(dtype).to(device))
    ref.backward(g.to(dtype).double())
    assert_close(w.grad, ref_w.grad, dtype, "embedding weight grad")


def test_nn_embedding_is_drop_in(backend, device):
    torch.manual_seed(0)
    ours = trainops.nn.Embedding(10, 4, padding_idx=0).to(device)
    theirs = torch.nn.Embedding(10, 4, padding_idx=0).to(device)
    theirs.load_state_dict(ours.state_dict())
    assert isinstance(ours, torch.nn.Embedding) and torch.all(ours.weight[0] == 0)
    index = torch.tensor([[0, 3, 3], [9, 0, 1]], device=device)
    ours(index).pow(2).sum().backward()
    theirs(index).pow(2).sum().backward()
    assert_close(ours.weight.grad, theirs.weight.grad, torch.float32, "nn.Embedding grad")
    pretrained = trainops.nn.Embedding.from_pretrained(theirs.weight.detach(), freeze=True)
    assert isinstance(pretrained, trainops.nn.Embedding)
    assert torch.equal(pretrained(index), theirs(index))


# ---- autograd, torch.compile -------------------------------------------------------------------------

def test_gradcheck_gather_and_gather_backward(backend, device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 2, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    index = torch.tensor([[4, -1], [0, 4], [2, 2]], device=device)
    fast = backend == "triton"  # random projections under the interpreter (CI time); the CPU path in full
    assert torch.autograd.gradcheck(lambda x: trainops.gather(x, index, 1), (x,), fast_mode=fast)
    assert torch.autograd.gradgradcheck(lambda x: trainops.gather(x, index, 1), (x,), fast_mode=fast)
    dy = torch.randn(3, 3, 2, 2, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda dy: trainops.gather_backward(dy, index, 1, [3, 5, 2]), (dy,),
                                    fast_mode=fast)


@pytest.mark.parametrize("padding_idx,scale", [(None, False), (1, True)])
def test_gradcheck_embedding(backend, device, padding_idx, scale):
    weight = torch.randn(5, 3, dtype=torch.float64, device=device, requires_grad=True)
    index = torch.tensor([[1, 1, 4], [0, 1, 3]], device=device)
    f = lambda w: trainops.embedding(index, w, padding_idx, scale_grad_by_freq=scale)  # noqa: E731
    if padding_idx is None and not scale:  # padding and scaling make the "gradient" differ from the Jacobian
        assert torch.autograd.gradcheck(f, (weight,))
    assert torch.autograd.gradgradcheck(f, (weight,))  # the weight gradient's own derivative in dy


def test_torch_compile_fullgraph(backend, device):
    torch._dynamo.reset()
    weight = torch.randn(11, 4, device=device, requires_grad=True)
    x = torch.randn(4, 6, device=device, requires_grad=True)
    index = torch.tensor([[3, 3, 10], [0, 5, 3]], device=device)

    def step(weight, x):
        e = trainops.embedding(index, weight, padding_idx=5)
        g = trainops.gather(x, index.clamp(max=5), 1)
        return e.sum() * 2 + (g * g).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(weight, x)
    loss.backward()
    w_ref, x_ref = weight.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    step(w_ref, x_ref).backward()
    assert torch.allclose(loss, step(weight, x))
    assert torch.equal(weight.grad, w_ref.grad) and torch.equal(x.grad, x_ref.grad)


def test_torch_compile_inductor_embedding_training_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(trainops.nn.Embedding(13, 8, padding_idx=0), torch.nn.Linear(8, 3))
    reference = torch.nn.Sequential(torch.nn.Embedding(13, 8, padding_idx=0), torch.nn.Linear(8, 3))
    reference.load_state_dict(model.state_dict())
    index = torch.tensor([[0, 4, 4, 12], [7, 0, 1, 4]])
    compiled = torch.compile(model, fullgraph=True)
    compiled(index).square().sum().backward()
    reference(index).square().sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert_close(ours.grad, theirs.grad, torch.float32, "inductor embedding step")


# ---- bad input --------------------------------------------------------------------------------------

def _raises_now_or_at_a_later_call(device, match, call):
    """On the CPU the call raises before writing; eager calls on the GPU check on the device without
    waiting, and the next trainops call after the GPU has run the check raises."""
    if device != "cuda":
        with pytest.raises(trainops.IndexOutOfRangeError, match=match):
            call()
        return
    out = call()
    torch.cuda.synchronize()
    with pytest.raises(trainops.IndexOutOfRangeError, match=match):
        trainops.gather(torch.zeros(2, 1, device=device), torch.zeros(1, dtype=torch.long, device=device), 0)
    trainops.gather(torch.zeros(2, 1, device=device), torch.zeros(1, dtype=torch.long, device=device), 0)  # reported once
    return out


def test_out_of_range_index_raises(backend, device):
    x = torch.randn(4, 3, device=device)
    for bad in (4, -5):
        out = _raises_now_or_at_a_later_call(device, r"argument 'index' (holds -?\d+, |held an index )out of range \[-4, 3\]",
                                             lambda: trainops.gather(x, torch.tensor([0, bad], device=device), 0))
        if out is not None:   # the GPU's unchecked launch: the bad index read nothing
            assert torch.equal(out[0], x[0]) and torch.all(out[1] == 0)
    _raises_now_or_at_a_later_call(device, r"trainops.embedding: argument 'input'.* out of range \[0, 3\]",
                                   lambda: trainops.embedding(torch.tensor([-1], device=device), x))
    _raises_now_or_at_a_later_call(device, "out of range", lambda: trainops.gather_backward(
        torch.randn(2, 3, device=device), torch.tensor([0, 9], device=device), 0, [4, 3]))
    p = trainops.plan("gather_backward", input_shape=(4, 3), dim=0, index_shape=(2,), dtype=torch.float32,
                      index_dtype=torch.int64, device=device)
    out = torch.full((4, 3), 7.0, device=device)
    with pytest.raises(IndexError):
        p.run(torch.randn(2, 3, device=device), torch.tensor([1, 4], device=device), out=out)
    assert torch.all(out == 7.0), "an out-of-range index must fail before anything is written"


def test_immediate_index_check_raises_at_the_call(backend, device):
    """check_index="immediate": before anything is written, on every device (one sync on the GPU)."""
    x = torch.randn(4, 3, device=device)
    bad = torch.tensor([0, 4], device=device)
    with pytest.raises(trainops.IndexOutOfRangeError, match=r"argument 'index' holds 4, out of range \[-4, 3\]"):
        trainops.gather(x, bad, 0, check_index="immediate")
    with pytest.raises(trainops.IndexOutOfRangeError, match=r"trainops.embedding: argument 'input' holds 4"):
        trainops.embedding(bad, x, check_index="immediate")
    with pytest.raises(trainops.IndexOutOfRangeError, match="out of range"):
        trainops.gather_backward(torch.randn(2, 3, device=device), bad, 0, [4, 3], check_index="immediate")
    emb = trainops.nn.Embedding(4, 3, device=device)
    emb.check_index = "immediate"
    with pytest.raises(trainops.IndexOutOfRangeError, match="argument 'input' holds 4"):
        emb(bad)
    for call in (lambda: trainops.gather(x, bad, 0, check_index="later"),
                 lambda: trainops.embedding(bad, x, check_index=1)):
        with pytest.raises(trainops.InvalidProblemError, match="'check_index' must be True, False or 'immediate'"):
            call()


def test_unchecked_out_of_range_is_safe(backend, device, deterministic):
    x = torch.randn(4, 3, device=device)
    index = torch.tensor([1, 40, -9, 2], device=device)
    out = trainops.gather(x, index, 0, check_index=False)
    assert torch.equal(out[[0, 3]], x[[1, 2]]) and torch.all(out[1:3] == 0)
    dy = torch.randn(4, 3, device=device)
    dx = trainops.gather_backward(dy, index, 0, [4, 3], deterministic=deterministic, check_index=False)
    expected = torch.zeros(4, 3, device=device)
    expected[1], expected[2] = dy[0], dy[3]
    assert torch.allclose(dx, expected)


def test_bad_arguments_name_the_argument(backend, device):
    x = torch.randn(4, 3, device=device)
    index = torch.tensor([0, 1], device=device)
    cases = [
        (trainops.InvalidProblemError, "'index'.*integers", lambda: trainops.gather(x, index.float(), 0)),
        (trainops.UnsupportedError, "'index'.*int32, int64", lambda: trainops.gather(x, index.to(torch.int16), 0)),
        (trainops.InvalidProblemError, "'dim' is 2", lambda: trainops.gather(x, index, 2)),
        (trainops.InvalidProblemError, "'index' must be a torch.Tensor", lambda: trainops.gather(x, [0, 1], 0)),
        (trainops.UnsupportedError, "'x' has dtype torch.int64", lambda: trainops.gather(index, index, 0)),
        (trainops.InvalidProblemError, "'dy' has shape", lambda: trainops.gather_backward(x, index, 0, [4, 3])),
        (trainops.InvalidProblemError, "'input_shape'", lambda: trainops.gather_backward(x, index, 0, 4)),
        (trainops.InvalidProblemError, "'weight' must be 2-D", lambda: trainops.embedding(index, x[0])),
        (trainops.InvalidProblemError, "'padding_idx'", lambda: trainops.embedding(index, x, padding_idx=4)),
        (trainops.UnsupportedError, "'max_norm'", lambda: trainops.embedding(index, x, max_norm=1.0)),
        (trainops.UnsupportedError, "'sparse'", lambda: trainops.nn.Embedding(4, 3, sparse=True)),
    ]
    for error, pattern, call in cases:
        with pytest.raises(error, match=pattern):
            call()


# ---- plans and registry ------------------------------------------------------------------------------

def test_plans_and_registry_pick_the_asked_kernel():
    det = trainops.lookup("gather_backward", "cuda", torch.bfloat16, torch.int32)
    atomic = trainops.lookup("gather_backward", "cuda", torch.bfloat16, torch.int32, deterministic=False)
    assert det.deterministic and not atomic.deterministic and det.backend == atomic.backend == "triton"
    cpu = trainops.lookup("gather_backward", "cpu", torch.float32, torch.int64, backend="cpu", deterministic=False)
    assert cpu.deterministic  # the CPU path is deterministic only; asking for speed may get it
    with pytest.raises(trainops.UnsupportedError, match="index dtype int16"):
        trainops.lookup("gather", "cuda", torch.float32, torch.int16)
    rows = {(k.op, k.backend, k.deterministic) for k in trainops.kernels()}
    assert {("gather", "triton", True), ("gather_backward", "triton", True), ("gather_backward", "triton", False),
            ("gather", "cpu", True), ("gather_backward", "cpu", True)} <= rows


@pytest.mark.skipif(not HAS_CUDA and not trainops.registry.triton_interpreting(), reason="needs Triton")
def test_plan_reports_kernel_precision_and_workspace():
    device = "cuda" if HAS_CUDA else "cpu"
    with trainops.backend("triton"):
        common = dict(input_shape=(100, 8), dim=0, index_shape=(64,), dtype=torch.bfloat16,
                      index_dtype=torch.int32, device=device)
        sorted_plan = trainops.plan("gather_backward", **common)
        atomic_plan = trainops.plan("gather_backward", deterministic=False, **common)
    assert sorted_plan.kernel.name == "gather_grad_sorted" and sorted_plan.precision.bitwise_reproducible
    assert sorted_plan.precision.accumulator == torch.float32 and sorted_plan.workspace_bytes > 0
    assert atomic_plan.kernel.name == "gather_grad_atomic" and not atomic_plan.precision.deterministic
    assert atomic_plan.workspace_bytes == 100 * 8 * 4  # bf16 adds into a float32 copy of dx


# ---- GPU, real sizes ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tokens,dim,rows,dtype", [(32768, 4096, 128256, torch.bfloat16),
                                                   (65536, 1024, 50257, torch.float32)])
@pytest.mark.parametrize("stream", ["uniform", "zipf"])
def test_embedding_backward_real_sizes(tokens, dim, rows, dtype, stream):
    gen = torch.Generator(device="cuda").manual_seed(0)
    if stream == "uniform":
        index = torch.randint(0, rows, (tokens,), device="cuda", generator=gen)
    else:
        weights = 1.0 / torch.arange(1, rows + 1, device="cuda", dtype=torch.float32) ** 1.1
        index = torch.multinomial(weights, tokens, replacement=True, generator=gen)
    dy = torch.randn(tokens, dim, device="cuda", dtype=dtype, generator=gen)
    ref = torch.zeros(rows, dim, device="cuda", dtype=torch.float64).index_add_(0, index, dy.double())
    for deterministic in (True, False):
        dx = trainops.gather_backward(dy, index, 0, [rows, dim], deterministic=deterministic)
        assert_close(dx, ref, dtype, f"{stream} deterministic={deterministic}")
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    first = trainops.gather_backward(dy, index, 0, [rows, dim])
    again = trainops.gather_backward(dy, index, 0, [rows, dim])
    assert torch.equal(first.view(bits), again.view(bits))


@pytest.mark.parametrize("n", [1, 700, 5000, 100_000])
def test_out_of_range_flag_kernel(n):
    """The device-side check behind eager GPU calls' index checks (run here under the interpreter on
    the CPU, on the GPU there): 1 exactly when some index is outside [low, high), any position."""
    from trainops.ops.gather import out_of_range_flag

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel needs a GPU or the interpreter")
    gen = torch.Generator().manual_seed(n)
    for dtype in (torch.int64, torch.int32):
        index = torch.randint(-7, 50, (n,), generator=gen).to(device, dtype)
        assert out_of_range_flag(index, -7, 50).tolist() == [0]
        for position in sorted({0, n // 2, n - 1}):
            for bad in (-8, 50):
                corrupted = index.clone()
                corrupted[position] = bad
                assert out_of_range_flag(corrupted, -7, 50).tolist() == [1], (dtype, position, bad)


def _bad_calls():
    """(name, call raising for an out-of-range index / target, the function and argument it names)."""
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    bad = torch.tensor([0, 3, 7, 1])
    return {
        "gather": (lambda: trainops.gather(x, torch.tensor([0, 6, 1]), 0), "gather", "index"),
        "embedding": (lambda: trainops.embedding(bad, w), "embedding", "input"),
        "gather_backward": (lambda: trainops.gather_backward(torch.randn(4, 5, dtype=torch.float64), bad, 0, (7, 5)),
                            "gather_backward", "index"),
        "cross_entropy_no_grad": (lambda: trainops.cross_entropy(x.detach()[:4], bad), "cross_entropy", "target"),
        "cross_entropy": (lambda: trainops.cross_entropy(x[:4], bad), "cross_entropy", "target"),
        "linear_cross_entropy": (lambda: trainops.linear_cross_entropy(x[:4], w, bad), "linear_cross_entropy",
                                 "target"),
    }


@pytest.mark.parametrize("name", sorted(_bad_calls()))
def test_compiled_calls_on_the_cpu_check_before_the_launch(name):
    """On the CPU a compiled call checks its indices before the launch (no host sync to save there)
    and raises at the call itself, naming the function and its argument, with or without a gradient."""
    call, op, argument = _bad_calls()[name]
    torch._dynamo.reset()
    with pytest.raises(IndexError, match=f"trainops.{op}: argument '{argument}'"):
        torch.compile(call, backend="aot_eager", fullgraph=True)()
    torch._dynamo.reset()


def test_the_ops_check_before_the_launch_on_the_cpu_even_when_asked_to_defer():
    """``deferred_check`` defers only on CUDA: a CPU call given it still checks first."""
    from trainops.ops import gather as gather_ops

    x = torch.randn(6, 5)
    with pytest.raises(IndexError, match="out of range"):
        gather_ops.gather_op(x, torch.tensor([0, 6]), 0, False, True, True)
    with pytest.raises(IndexError, match="out of range"):
        gather_ops.embedding_op(torch.tensor([0, 6]), x, None, False, True, True)
    with pytest.raises(IndexError, match="out of range"):
        gather_ops.gather_backward_op(torch.randn(2, 5), torch.tensor([0, 6]), 0, [6, 5], True, None, False, False,
                                      True, True)
