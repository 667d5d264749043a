"""GIST (trainops.gist): the ReLU that saves 1 bit an element (forward and backward against torch's,
bit for bit, every backend, layouts, special values, the saved state), the lossy stash formats
(error bounds, non-finite inputs, scales), saved_tensors (what it packs, once, and the gradients'
change), compress (swaps, hooks, errors), torch.compile, and real sizes on the GPU."""

import math

import pytest
import torch

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import gist as G
from trainops.ops.dropout import pack_bits
from trainops.ops.gist import GistHeuristics, pack_stash, unpack_stash
from trainops.plan import clear_plan_cache

from conftest import HAS_CUDA
from numerics import FLOATS, relative_error

SMALL = GistHeuristics(block=16)   # many programs on small shapes, a partial last one
PLANS = {"default": GistHeuristics(), "small": SMALL}
BITS_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Outputs start as NaN (bits and positions as 0b10101010), so an element or byte left unwritten
    fails."""
    def poisoned(original):
        def new_output(self):
            out = original(self)
            if isinstance(out, torch.Tensor):
                return out.fill_(float("nan"))
            y, bits = out
            return y.fill_(float("nan")), bits.fill_(0xAA)
        return new_output
    for problem in (G.GistReluProblem, G.GistPoolProblem):
        monkeypatch.setattr(problem, "new_output", poisoned(problem.new_output))
    clear_plan_cache()
    yield
    clear_plan_cache()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN payloads aside (torch's own NaN payloads differ between its paths)."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    ints = BITS_OF[a.element_size()]
    keep = ~a.isnan()
    return torch.equal(a.detach()[keep].view(ints), b.detach()[keep].view(ints))


def special(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    flat = x.view(-1)
    values = [float("nan"), 0.0, -0.0, float("-inf"), float("inf"), -1e-30, 1e-30]
    flat[:min(len(values), flat.numel())] = torch.tensor(values[:flat.numel()], dtype=torch.float64).to(dtype)
    return x.to(device)


def torch_relu_as(backend):
    """torch.relu as the backend's kernel computes it: the Triton kernel gives +0.0 for -0.0, as
    torch's CUDA relu does (checked on the H100); torch's CPU relu keeps -0.0."""
    if backend == "triton":
        return lambda x: torch.relu(x) + 0.0   # -0.0 + 0.0 = +0.0; every other value (NaN too) unchanged
    return torch.relu


def relu_and_grad(fn, x, dy):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5, 7), (4, 129), (2, 3, 17, 9)])
def test_relu_is_torchs_bit_for_bit(backend, device, dtype, shape, plan):
    x = special(shape, dtype, device)
    dy = torch.randn(shape, dtype=torch.float64).to(dtype).to(device)
    with trainops.heuristics(PLANS[plan]):
        y, dx = relu_and_grad(trainops.gist.relu, x, dy)
    ref_y, ref_dx = relu_and_grad(torch_relu_as(backend), x, dy)
    assert same_bits(y, ref_y) and same_bits(dx, ref_dx), (y, ref_y, dx, ref_dx)


def test_bits_are_the_backward_mask_packed(backend, device):
    x = special((5, 13), torch.float32, device)
    with trainops.heuristics(SMALL):
        y, bits = G.gist_relu_op(x)
    assert bits.dtype == torch.uint8 and bits.shape == ((x.numel() + 7) // 8,)
    assert torch.equal(bits.cpu(), pack_bits(~(y.cpu().reshape(-1) <= 0)))   # the last byte's spare bits are 0
    # a channels-last tensor's bits follow its memory order (N, H, W, C), not the logical one
    x = special((2, 3, 5, 7), torch.float32, device, seed=8).to(memory_format=torch.channels_last)
    with trainops.heuristics(SMALL):
        y, bits = G.gist_relu_op(x)
    in_memory = y.cpu().permute(0, 2, 3, 1).reshape(-1)
    assert torch.equal(bits.cpu(), pack_bits(~(in_memory <= 0)))
    assert not torch.equal(bits.cpu(), pack_bits(~(y.cpu().reshape(-1) <= 0)))


def test_only_the_bits_are_saved(backend, device):
    """The autograd graph keeps ceil(n / 8) bytes for the ReLU, not its input or output."""
    saved = []
    x = torch.randn(6, 11, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        trainops.gist.relu(x * 2)
    assert len(saved) == 1 and saved[0].dtype == torch.uint8 and saved[0].shape == (9,), saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.relu(x * 2)
    assert saved[0].dtype == torch.float32 and saved[0].numel() == 66   # torch keeps the output


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced", "expanded"])
def test_layouts(backend, device, layout):
    base = special((2, 3, 4, 5), torch.float32, device, seed=3)
    x = {"channels_last": base.to(memory_format=torch.channels_last),
         "transposed": base.transpose(1, 3),
         "sliced": base[:, :, 1:3],
         "expanded": base[:1, :1].expand(2, 3, 4, 5)}[layout]
    dy = torch.randn(x.shape, device=device)
    with trainops.heuristics(SMALL):
        y, dx = relu_and_grad(trainops.gist.relu, x, dy)
    ref_y, ref_dx = relu_and_grad(torch_relu_as(backend), x, dy)
    assert same_bits(y, ref_y) and same_bits(dx, ref_dx)
    if layout in ("channels_last", "transposed"):   # dense layouts are read in place and kept
        assert y.stride() == x.stride()
    else:
        assert y.is_contiguous()


def test_gradient_of_another_layout_than_the_output(backend, device):
    """dy in strides other than y's is brought to y's layout (the bits are in y's memory order)."""
    x = special((2, 3, 4, 5), torch.float32, device, seed=4).to(memory_format=torch.channels_last)
    dy = torch.randn(2, 3, 4, 5, device=device)                 # contiguous, y is channels_last
    y, dx = relu_and_grad(trainops.gist.relu, x, dy)
    ref_y, ref_dx = relu_and_grad(torch_relu_as(backend), x, dy)
    assert same_bits(y, ref_y) and same_bits(dx, ref_dx)


def test_empty_and_gradcheck(backend, device):
    for shape in ((0, 3), (4, 0), (2, 0, 3)):
        y, dx = relu_and_grad(trainops.gist.relu, torch.empty(shape, device=device), torch.empty(shape, device=device))
        assert y.shape == shape and dx.shape == shape
    for x in (torch.randn(0, 3, device=device), torch.randn(4, 0, device=device), torch.randn(1, 1, device=device)):
        torch.library.opcheck(torch.ops.trainops.gist_relu.default, (x.requires_grad_(),))
    x = torch.randn(4, 9, dtype=torch.float64, device=device)
    x = torch.where(x.abs() < 1e-3, 0.5, x).requires_grad_()   # no input within gradcheck's step of 0
    assert torch.autograd.gradcheck(trainops.gist.relu, (x,))


def test_module_is_a_drop_in(backend, device):
    for inplace in (False, True):
        module = trainops.gist.ReLU(inplace=inplace)
        assert isinstance(module, torch.nn.ReLU) and module.inplace is inplace and repr(module) == repr(
            torch.nn.ReLU(inplace=inplace))
        x = torch.randn(3, 8, device=device)
        before = x.clone()
        assert same_bits(module(x), torch_relu_as(backend)(x)) and torch.equal(x, before)   # a new tensor, input untouched


def test_torch_compile_fullgraph(backend, device):
    def f(x):
        return (trainops.gist.relu(x * 3) * 2).sum()

    x = torch.randn(4, 33, device=device, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(x)
    loss.backward()
    ref = x.detach().clone().requires_grad_()
    f_ref = (torch.relu(ref * 3) * 2).sum()
    f_ref.backward()
    assert torch.equal(loss.detach(), f_ref.detach()) and torch.equal(x.grad, ref.grad)


def test_relu_errors_name_the_argument():
    with pytest.raises(UnsupportedError, match=r"gist.relu: argument 'inplace'"):
        trainops.gist.relu(torch.randn(3), inplace=True)
    with pytest.raises(UnsupportedError, match=r"gist.relu: argument 'input' has dtype torch.int64"):
        trainops.gist.relu(torch.arange(3))
    with pytest.raises(InvalidProblemError, match=r"gist.relu: argument 'input' must be a torch.Tensor"):
        trainops.gist.relu([1.0, -1.0])
    with pytest.raises(InvalidProblemError, match=r"argument 'strides'"):
        trainops.plan("gist_relu", shape=(4, 4), dtype=torch.float32, device="cpu", strides=(8, 1))
    with pytest.raises(InvalidProblemError, match=r"argument 'heuristics'"):
        trainops.plan("gist_relu", shape=(4,), dtype=torch.float32, device="cpu", heuristics=GistHeuristics(block=12))
    with pytest.raises(InvalidProblemError, match=r"argument 'bits'"):
        G.gist_relu_backward_op(torch.randn(16), torch.zeros(3, dtype=torch.uint8), [1])
    with pytest.raises(UnsupportedError, match="double backward"):
        x = torch.randn(5, requires_grad=True)
        torch.autograd.grad(trainops.gist.relu(x).sum(), x, create_graph=True)


def test_plan_api_reports_the_kernel(backend, device):
    p = trainops.plan("gist_relu", shape=(10, 3), dtype=torch.bfloat16, device=device)
    assert p.kernel.backend == backend and p.precision.bitwise_reproducible
    x = special((10, 3), torch.bfloat16, device)
    y, bits = p.run(x)
    assert same_bits(y, torch_relu_as(backend)(x))


# ---- lossy stash formats -----------------------------------------------------------------------

BOUNDS = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
# the smallest normal of each format, relative to the largest magnitude after scaling (>= format max / 2)
NORMAL_RANGE = {"e4m3": 2.0 ** -6 / 224, "e5m2": 2.0 ** -14 / 28672, "fp16": 2.0 ** -14 / 32752, "bf16": 2.0 ** -126}


@pytest.mark.parametrize("format", list(BOUNDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 3e4])
def test_stash_error_is_the_formats_rounding(format, dtype, magnitude):
    gen = torch.Generator().manual_seed(7)
    if dtype == torch.float16 and magnitude == 1e-6:
        magnitude = 1e-3   # within float16's own range
    # magnitudes log-uniform over the format's normal range below the largest (and the input
    # dtype's: float16's normals end at 2**-14), both signs
    span = min(-math.log2(NORMAL_RANGE[format]), 20.0,
               math.log2(magnitude / 2.0 ** -14) if dtype == torch.float16 else 20.0)
    mags = torch.exp2(-torch.rand(4096, generator=gen, dtype=torch.float64) * span)
    signs = torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0).double()
    t = (mags * signs * magnitude).to(dtype)
    assert (t != 0).all()
    stashed = pack_stash(t, format)
    back = unpack_stash(stashed)
    assert back.dtype == dtype and back.shape == t.shape
    rel = ((back.double() - t.double()).abs() / t.double().abs()).max().item()
    bound = max(BOUNDS[format], 2.0 ** -8 if dtype == torch.bfloat16 else 0.0, 2.0 ** -11 if dtype == torch.float16 else 0)
    assert rel <= bound, (format, dtype, magnitude, rel)
    if stashed.scale is not None:
        s = stashed.scale.item()
        assert s == 2.0 ** round(math.log2(s))                                   # a power of two
        assert stashed.data.float().abs().max().item() <= (G.STASH_FORMATS[format].largest
                                                            or torch.finfo(torch.bfloat16).max)
    assert stashed.data.element_size() == (1 if format in ("e4m3", "e5m2") else 2)


@pytest.mark.parametrize("format", list(BOUNDS))
@pytest.mark.parametrize("magnitude", [1e300, 1e39, 1e-42, 1e-300])
def test_float64_stash_beyond_float32s_range(format, magnitude):
    t = torch.randn(512, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * magnitude
    t = torch.where(t.abs() < magnitude * 1e-3, magnitude, t)   # keep within a few binades of the largest
    back = unpack_stash(pack_stash(t, format))
    rel = ((back - t).abs() / t.abs()).max().item()
    assert rel <= BOUNDS[format], (format, magnitude, rel)


def test_float16_stash_of_small_values_clamps_its_scale():
    t = (torch.randn(512, generator=torch.Generator().manual_seed(4)) * 1e-4).to(torch.float16)
    stashed = pack_stash(t, "e4m3")
    assert stashed.scale.item() == 2.0 ** 15          # 448 / 4e-4 would need 2**20: float16 holds 2**15
    back = unpack_stash(stashed)
    normal = t.float().abs() >= 2.0 ** -6 / 2.0 ** 15   # e4m3's normals after the scale
    rel = ((back.float() - t.float()).abs() / t.float().abs())[normal].max().item()
    assert rel <= BOUNDS["e4m3"], rel


def test_stash_of_non_finite_zero_empty_and_layouts():
    t = torch.randn(64)
    for bad in (float("inf"), float("-inf"), float("nan")):
        u = t.clone()
        u[5] = bad
        for format in ("e4m3", "e5m2", "fp16"):
            assert unpack_stash(pack_stash(u, format)).isnan().all(), (format, bad)   # never finite and wrong
    assert torch.equal(unpack_stash(pack_stash(torch.zeros(9), "e4m3")), torch.zeros(9))
    assert unpack_stash(pack_stash(torch.empty(0, 4), "e5m2")).shape == (0, 4)
    cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert unpack_stash(pack_stash(cl, "e4m3")).stride() == cl.stride()
    with pytest.raises(InvalidProblemError, match="argument 'format' is 'fp8'"):
        pack_stash(t, "fp8")
    with pytest.raises(UnsupportedError, match="argument 't'"):
        pack_stash(torch.arange(4), "bf16")


# ---- saved_tensors and compress ----------------------------------------------------------------

class Net(torch.nn.Module):
    """conv -> batch norm -> ReLU -> conv -> ReLU -> pool -> linear: what a CNN stashes."""

    def __init__(self, inplace=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(inplace=inplace),
            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def loss_and_grads(model, x, y):
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def batch(seed=1, n=8):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def test_saved_tensors_packs_activations_once_and_leaves_the_rest():
    x, y = batch()
    model = Net()
    ref_loss, ref_grads = loss_and_grads(model, x, y)
    with trainops.gist.saved_tensors("e4m3", min_numel=1024) as stats:
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    # conv1 output (saved by batch norm), relu1 output (saved by relu1 and conv2: packed once), relu2's
    # output (by relu2 and the mean's backward? no: mean saves nothing), so 3 tensors of 8*16*16*16
    # floats; the input x, the weights and the small statistics are not packed
    numel = 8 * 16 * 16 * 16
    assert stats.packed == 3 and stats.reused >= 1, stats
    assert stats.original_bytes == 3 * numel * 4 and stats.stored_bytes == 3 * numel, stats
    assert torch.equal(loss, ref_loss)                  # the forward is untouched
    errors = [relative_error(g, r) for g, r in zip(grads, ref_grads)]
    assert 1e-4 < max(errors) < 0.1, errors              # changed, by about e4m3's rounding
    # outside the context nothing is packed: the same step gives the reference gradients again
    _, again = loss_and_grads(model, x, y)
    assert all(torch.equal(a, r) for a, r in zip(again, ref_grads))


def test_saved_tensors_bf16_and_min_numel():
    x, y = batch()
    model = Net()
    _, ref_grads = loss_and_grads(model, x, y)
    with trainops.gist.saved_tensors("bf16") as stats:
        loss = torch.nn.functional.cross_entropy(model(x), y)
    model.zero_grad()
    loss.backward()
    err = max(relative_error(p.grad, r) for p, r in zip(model.parameters(), ref_grads))
    assert 0 < err < 1e-2, err
    assert stats.stored_bytes * 2 == stats.original_bytes
    with trainops.gist.saved_tensors("bf16", min_numel=10 ** 9) as none:
        cross = torch.nn.functional.cross_entropy(model(x), y)
    assert none.packed == 0
    cross.backward()
    with pytest.raises(InvalidProblemError, match="argument 'min_numel'"):
        with trainops.gist.saved_tensors("bf16", min_numel=-1):
            pass
    with pytest.raises(InvalidProblemError, match="argument 'format'"):
        with trainops.gist.saved_tensors("int8"):
            pass


def test_compress_swaps_relus_exactly_and_stashes(backend, device):
    x, y = batch()
    x, y = x.to(device), y.to(device)
    plain = Net(inplace=True).to(device)
    ref_loss, ref_grads = loss_and_grads(plain, x, y)
    model = Net(inplace=True).to(device)
    handle = trainops.gist.compress(model)
    assert handle.swapped == ["body.2", "body.4"] and handle.stash is None and handle.stats is None
    assert all(type(model.body[i]) is trainops.gist.ReLU for i in (2, 4)) and model.body[2].inplace
    loss, grads = loss_and_grads(model, x, y)
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    assert trainops.gist.compress(model).swapped == []   # nothing left to swap

    handle = trainops.gist.compress(model, stash="e4m3", min_numel=1024)
    loss, grads = loss_and_grads(model, x, y)
    # with the ReLUs' bits, only conv1's output (batch norm's input) and relu1's (conv2's input) remain
    assert handle.stats.packed == 2 and handle.stats.reused == 0, handle.stats
    assert torch.equal(loss, ref_loss) and 0 < max(relative_error(g, r) for g, r in zip(grads, ref_grads)) < 0.1
    with pytest.raises(InvalidProblemError, match="has GIST stash hooks already"):
        trainops.gist.compress(model, stash="bf16")
    handle.remove()
    loss, grads = loss_and_grads(model, x, y)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))    # hooks off: exact again


def test_a_forward_that_raises_closes_the_stash():
    model = Net()
    handle = trainops.gist.compress(model, stash="e4m3", min_numel=1)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, 16, 16))   # wrong channel count: conv1 raises
    packed = handle.stats.packed
    a = torch.randn(64, 64, requires_grad=True)
    (a * 2).exp().sum().backward()     # exp saves its output: a leaked e4m3 hook would pack it
    assert torch.equal(a.grad, 2 * (a.detach() * 2).exp()) and handle.stats.packed == packed


def test_stash_leaves_parameters_their_views_and_expanded_views():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128))
    x = torch.randn(64, 128)
    seen = []
    with trainops.gist.saved_tensors("e4m3", min_numel=1024) as stats:
        h = model(x)                                   # Linear saves weight.t(): a view of a leaf
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)                                   # under autocast, the weights' bf16 copies
        wide = h[:1].expand(64, 128) * h              # mul saves an expanded view (not dense)
    # packed: the ReLU's output (saved by the ReLU and the second linear: once), in the float32 and
    # the bf16 forward, and h (saved by the mul); never x, a weight's transpose or its bf16 copy,
    # nor the expanded view of h
    assert stats.packed == 3 and stats.reused == 2, stats
    assert stats.original_bytes == 64 * 128 * (4 + 2 + 4), stats
    wide.sum().backward()


def test_packed_copies_go_with_the_graph():
    import gc

    model = Net()
    x, y = batch()
    counts = []
    with trainops.gist.saved_tensors("e4m3", min_numel=1024):
        for _ in range(4):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            gc.collect()
            counts.append(sum(isinstance(o, G.Stashed) for o in gc.get_objects()))
    assert counts == [0, 0, 0, 0], counts


def test_compress_keeps_hooks_sharing_and_leaves_subclasses():
    class MyReLU(torch.nn.ReLU):
        pass

    shared = torch.nn.ReLU()
    calls = []
    shared.register_forward_hook(lambda *args: calls.append(1))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), shared, torch.nn.Linear(4, 4), shared, MyReLU())
    handle = trainops.gist.compress(model)
    assert handle.swapped == ["1"] and handle.left == ["4"], handle
    assert model[1] is model[3] is shared and type(shared) is trainops.gist.ReLU
    model(torch.randn(2, 4))
    assert calls == [1, 1]
    root = torch.nn.ReLU()
    assert trainops.gist.compress(root).swapped == [""] and type(root) is trainops.gist.ReLU


def test_compress_errors():
    with pytest.raises(InvalidProblemError, match="gist.compress: argument 'model'"):
        trainops.gist.compress(torch.nn.functional.relu)
    with pytest.raises(InvalidProblemError, match="argument 'stash' is 'e3m4'"):
        trainops.gist.compress(Net(), stash="e3m4")
    model = Net()
    with pytest.raises(InvalidProblemError, match="argument 'min_numel'"):
        trainops.gist.compress(model, stash="bf16", min_numel=-2)
    assert type(model.body[2]) is torch.nn.ReLU   # refused before anything changed


# ---- real sizes on the GPU ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_relu_real_size(dtype):
    x = torch.randn(32, 56, 56, 256, device="cuda", dtype=dtype)
    x.view(-1)[:4] = torch.tensor([float("nan"), 0.0, -0.0, float("-inf")], dtype=dtype)
    x = x.permute(0, 3, 1, 2)   # channels_last, its first elements the special values
    dy = torch.randn_like(x)
    y, dx = relu_and_grad(trainops.gist.relu, x, dy)
    ref_y, ref_dx = relu_and_grad(torch.relu, x, dy)
    assert same_bits(y, ref_y) and same_bits(dx, ref_dx) and y.stride() == x.stride()


@pytest.mark.gpu
def test_gpu_compress_saves_memory():
    torch.manual_seed(0)

    def make():
        torch.manual_seed(0)
        layers = []
        for _ in range(6):
            layers += [torch.nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64),
                       torch.nn.ReLU(inplace=True)]
        return torch.nn.Sequential(*layers).cuda().to(memory_format=torch.channels_last)

    x = torch.randn(64, 64, 56, 56, device="cuda").to(memory_format=torch.channels_last)
    peaks, grads = {}, {}
    for name in ("torch", "relu", "relu+bf16", "relu+e4m3"):
        model = make()
        if name != "torch":
            trainops.gist.compress(model, stash=name.split("+")[1] if "+" in name else None)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(x).square().mean().backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        grads[name] = [p.grad for p in model.parameters()]
    errors = {name: max(relative_error(a, b) for a, b in zip(grads[name], grads["torch"])) for name in grads}
    print(peaks, errors)
    assert errors["relu"] == 0.0                                      # exact
    assert errors["relu+bf16"] < 1e-2 and 0 < errors["relu+e4m3"] < 0.5, errors
    # conv-bn-relu: each ReLU output is the next convolution's saved input, so the bits alone save
    # nothing here; the out-of-place ReLU adds at most one activation for a moment
    activation = x.numel() * x.element_size()
    assert peaks["relu"] <= peaks["torch"] + activation and peaks["relu+e4m3"] < 0.6 * peaks["torch"], peaks
    assert peaks["relu+bf16"] < 0.8 * peaks["torch"], peaks


# ---- ReLU followed by max pooling --------------------------------------------------------------

POOLS = [(3, 2, 1), (2, 2, 0), (3, 1, 1), (2, 1, 0), ((3, 2), (2, 1), (1, 0))]


def pool_reference(backend):
    relu = torch_relu_as(backend)
    return lambda x, k, s, p: torch.nn.functional.max_pool2d(relu(x), k, s, p)


@pytest.mark.parametrize("window", POOLS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_relu_max_pool2d_is_torchs(backend, device, dtype, window):
    k, s, p = window
    x = special((2, 3, 9, 7), dtype, device, seed=11)   # NaN, +-0.0, +-inf first (channel 0, row 0)
    x[0, 1, :3, :3] = -1.0                                # a window of negatives only: no gradient there
    x[1, 0, 2, 2] = x[1, 0, 2, 4] = float("nan")          # two NaNs in a window: the last takes the gradient
    x[1, 2, 4:6, 4:6] = 2.5                               # ties: the first in row-major order wins
    dz = torch.randn(torch.nn.functional.max_pool2d(x, k, s, p).shape, dtype=torch.float64).to(dtype).to(device)
    with trainops.heuristics(SMALL):
        z, dx = relu_and_grad(lambda t: trainops.gist.relu_max_pool2d(t, k, s, p), x, dz)
    ref_z, ref_dx = relu_and_grad(lambda t: pool_reference(backend)(t, k, s, p), x, dz)
    assert same_bits(z, ref_z)
    overlapping = any(kk > ss for kk, ss in zip(*(v if isinstance(v, tuple) else (v, v) for v in (k, s))))
    if overlapping and dtype != torch.float64:   # overlapping windows sum in float32, then round once
        assert relative_error(dx, ref_dx) <= {torch.float32: 1e-7, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
        assert torch.equal(dx.isnan(), ref_dx.isnan())
    elif overlapping:
        assert relative_error(dx, ref_dx) <= 1e-15
    else:
        assert same_bits(dx, ref_dx)


@pytest.mark.parametrize("layout", ["channels_last", "sliced", "batch_of_one", "height_of_one"])
def test_relu_max_pool2d_layouts(backend, device, layout):
    base = special((2, 4, 10, 8), torch.float32, device, seed=12)
    x = {"channels_last": base.to(memory_format=torch.channels_last), "sliced": base[:, :, 1:9],
         "batch_of_one": base[:1].to(memory_format=torch.channels_last),
         # an output height of 2 from an input height of 1: the output stays channels-last, as torch's
         "height_of_one": base[:, :, :1].contiguous(memory_format=torch.channels_last)}[layout]
    window = (2, 1, 1) if layout == "height_of_one" else (3, 2, 1)
    dz = torch.randn(torch.nn.functional.max_pool2d(x, *window).shape, device=device)
    with trainops.heuristics(SMALL):
        z, dx = relu_and_grad(lambda t: trainops.gist.relu_max_pool2d(t, *window), x, dz)
    ref_z, ref_dx = relu_and_grad(lambda t: pool_reference(backend)(t, *window), x, dz)
    assert same_bits(z, ref_z) and relative_error(dx, ref_dx) <= 1e-7
    if layout == "height_of_one":
        assert z.shape[2] == 2
    if layout != "sliced":
        assert z.stride() == ref_z.stride()   # channels_last in, channels_last out (as torch)


def test_relu_max_pool2d_saves_one_byte_a_window(backend, device):
    saved = []
    x = torch.randn(2, 3, 8, 8, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        trainops.gist.relu_max_pool2d(x * 2, 3, 2, 1)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(torch.uint8, (2, 3, 4, 4))], saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.nn.functional.max_pool2d(torch.relu(x * 2), 3, 2, 1)
    assert sorted(str(t.dtype) for t in saved) == ["torch.float32", "torch.float32", "torch.int64"]   # torch's


def test_relu_max_pool2d_empty_opcheck_and_compile(backend, device):
    z, dx = relu_and_grad(lambda t: trainops.gist.relu_max_pool2d(t, 2), torch.empty(0, 3, 4, 4, device=device),
                          torch.empty(0, 3, 2, 2, device=device))
    assert z.shape == (0, 3, 2, 2) and dx.shape == (0, 3, 4, 4)
    for x in (torch.randn(2, 3, 6, 5, device=device), torch.randn(2, 3, 6, 5, device=device).to(
            memory_format=torch.channels_last)):
        torch.library.opcheck(torch.ops.trainops.gist_relu_max_pool2d.default, (x.requires_grad_(), [3, 3], [2, 2],
                                                                                 [1, 1]))
    x = torch.randn(2, 3, 8, 8, device=device, requires_grad=True)
    compiled = torch.compile(lambda t: trainops.gist.relu_max_pool2d(t * 2, 3, 2, 1).sum(), fullgraph=True,
                             backend="aot_eager")
    compiled(x).backward()
    ref = x.detach().clone().requires_grad_()
    pool_reference(backend)(ref * 2, 3, 2, 1).sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_relu_max_pool2d_errors():
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(InvalidProblemError, match="height and width must be non-zero"):
        trainops.gist.relu_max_pool2d(torch.randn(2, 3, 0, 4), 2, 1, 1)
    with pytest.raises(InvalidProblemError, match=r"gist.relu_max_pool2d: argument 'input' has shape \(3, 8, 8\)"):
        trainops.gist.relu_max_pool2d(x[0], 2)
    with pytest.raises(InvalidProblemError, match=r"argument 'padding' is \(2, 2\); it must be at most half"):
        trainops.gist.relu_max_pool2d(x, 3, 1, 2)
    with pytest.raises(UnsupportedError, match=r"argument 'kernel_size' is \(16, 16\)"):
        trainops.gist.relu_max_pool2d(torch.randn(1, 1, 16, 16), 16)
    with pytest.raises(InvalidProblemError, match=r"argument 'stride' is 0"):
        trainops.gist.relu_max_pool2d(x, 2, 0)
    with pytest.raises(UnsupportedError, match="argument 'input' has dtype torch.int64"):
        trainops.gist.relu_max_pool2d(torch.zeros(1, 1, 4, 4, dtype=torch.int64), 2)
    for kwargs, name in ((dict(dilation=2), "dilation"), (dict(return_indices=True), "return_indices"),
                         (dict(ceil_mode=True), "ceil_mode")):
        with pytest.raises(UnsupportedError, match=f"argument '{name}'"):
            trainops.gist.ReLUMaxPool2d(3, 2, 1, **kwargs)


def test_compress_fuses_relu_and_max_pool_in_a_sequential(backend, device):
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                   torch.nn.ReLU(inplace=True), torch.nn.MaxPool2d(3, 2, 1),
                                   torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU()).to(device)

    x = torch.randn(4, 3, 16, 16, device=device)
    plain, model = make(), make()
    handle = trainops.gist.compress(model)
    assert handle.fused == [("2", "3")] and handle.swapped == ["2", "5"], handle
    assert type(model) is trainops.gist.FusingSequential and type(model[2]) is trainops.gist.ReLU
    assert type(model[3]) is torch.nn.MaxPool2d
    with trainops.track_kernels() as used:
        out, ref = model(x), plain(x)
        out.square().mean().backward()
    ref.square().mean().backward()
    assert any(op == "gist_relu_max_pool2d" for op, *_ in used) and torch.equal(out, ref)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert relative_error(p.grad, q.grad) <= 1e-6   # the pooling's overlapping windows sum in float32
    # the modules are unchanged: slicing or iterating applies the ReLU, unbatched input runs unfused
    assert torch.equal(model[:3](x), plain[:3](x)) and (model[:3](x) >= 0).all()
    pair, plain_pair = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(2)), torch.nn.Sequential(
        torch.nn.ReLU(), torch.nn.MaxPool2d(2))
    trainops.gist.compress(pair)
    with trainops.track_kernels() as used:
        assert torch.equal(pair(x[0]), plain_pair(x[0]))   # an unbatched (C, H, W) input: not fused
    assert [op for op, *_ in used] == ["gist_relu"]
    # a hook added afterwards is honoured: that call runs the two modules
    seen = []
    model[2].register_forward_hook(lambda *args: seen.append(1))
    assert torch.equal(model(x), plain(x)) and seen == [1]


def test_compress_leaves_pairs_it_cannot_fuse():
    other = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(2, dilation=2), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2, ceil_mode=True))
    handle = trainops.gist.compress(other)
    assert handle.fused == [] and type(other) is torch.nn.Sequential and handle.swapped == ["0", "2"]

    class Custom(torch.nn.Sequential):   # a subclass's forward is its own: not swapped
        pass

    custom = Custom(torch.nn.ReLU(), torch.nn.MaxPool2d(2))
    assert trainops.gist.compress(custom).fused == [] and type(custom) is Custom


@pytest.mark.gpu
def test_gpu_relu_max_pool2d_resnet_stem():
    x = torch.randn(32, 64, 112, 112, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    dz = torch.randn(32, 64, 56, 56, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    z, dx = relu_and_grad(lambda t: trainops.gist.relu_max_pool2d(t, 3, 2, 1), x, dz)
    ref_z, ref_dx = relu_and_grad(lambda t: torch.nn.functional.max_pool2d(torch.relu(t), 3, 2, 1), x, dz)
    assert same_bits(z, ref_z) and z.stride() == ref_z.stride()
    assert relative_error(dx, ref_dx) <= 1e-2


def _relu_step(x0, dy, op_path: bool, monkeypatch):
    x = x0.detach().clone().requires_grad_()
    with monkeypatch.context() as m:
        if op_path:
            m.setattr(G, "eager_relu", lambda t: None)
        y = trainops.gist.relu(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    return y, dx, type(y.grad_fn).__name__


@pytest.mark.parametrize("plan", ["default", "small"])
def test_eager_relu_is_taken_and_bit_identical_to_the_op_path(backend, device, monkeypatch, plan):
    """Plain eager calls run G.eager_relu (its autograd node, the backward's plan made in the
    forward): the op path's values, bits and strides, with dy in y's layout and in another (the
    op's copy), and without gradients."""
    x = torch.randn(4, 3, 5, 6, device=device).to(memory_format=torch.channels_last)
    x[0, 0, 0, :3] = torch.tensor([0.0, -0.0, float("nan")])
    dys = {"as y": torch.randn(4, 3, 5, 6, device=device).to(memory_format=torch.channels_last),
           "contiguous": torch.randn(4, 3, 5, 6, device=device)}
    with trainops.heuristics(PLANS[plan]):
        for name, dy in dys.items():
            y, dx, node = _relu_step(x, dy, False, monkeypatch)
            ry, rdx, rnode = _relu_step(x, dy, True, monkeypatch)
            assert node == "_EagerGistReluBackward" and rnode != node, (node, rnode)
            assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(ry)) and y.stride() == ry.stride(), name
            assert torch.equal(dx, rdx) and dx.stride() == rdx.stride(), name
            assert torch.equal(dx, torch.where(x > 0, dy, 0).where(~x.isnan(), dy)), name
        with torch.no_grad():
            y = trainops.gist.relu(x)
        assert y.grad_fn is None and torch.equal(torch.nan_to_num(y), torch.nan_to_num(torch.relu(x)).abs())


def test_eager_relu_falls_back_where_it_must(backend, device, monkeypatch):
    """A layout the op copies first, a __torch_function__ mode: the op path (its node), same values."""
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    base = torch.randn(4, 3, 5, 12, device=device)
    for name, x0, mode in (("strided", base[..., ::2], None), ("mode", base, Passing)):
        x = x0.detach().clone() if name == "mode" else x0.detach()
        x.requires_grad_()
        if mode is not None:
            with mode():
                y = trainops.gist.relu(x)
        else:
            y = trainops.gist.relu(x)
        assert type(y.grad_fn).__name__ != "_EagerGistReluBackward", name
        assert torch.equal(y, torch.relu(x.detach())), name
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        assert torch.equal(dx, torch.where(x.detach() > 0, dy, 0)), name


def test_eager_relu_counts_the_op_paths_kernels(backend, device, monkeypatch):
    """track_kernels counts what the op path counts, a backward through the op (dy in another
    layout) included."""
    x = torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    counted = []
    for op_path in (False, True):
        with trainops.track_kernels() as used:
            for dy in (torch.ones_like(x), torch.ones(x.shape, device=device)):
                _relu_step(x, dy, op_path, monkeypatch)
        counted.append(dict(used))
    assert counted[0] == counted[1] and len(counted[0]) == 2, counted


def test_eager_relu_backward_runs_its_plan_and_checks_the_bits_it_gets_back(backend, device, monkeypatch):
    """dy in y's layout and the bits as saved: the forward-made plan, no backward op. Bits a
    saved-tensor hook hands back changed (strided, another dtype): not that plan but the backward
    op, which names them (InvalidProblemError)."""
    calls = []
    real = G.gist_relu_backward_op
    monkeypatch.setattr(G, "gist_relu_backward_op", lambda *a: (calls.append(1), real(*a))[1])
    hooks = {"as saved": lambda t: t, "strided": lambda t: torch.stack([t, t], 1)[:, 0],
             "int8": lambda t: t.view(torch.int8)}
    for name, unpack in hooks.items():
        x = torch.randn(4, 3, 5, 6, device=device).to(memory_format=torch.channels_last).requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            y = trainops.gist.relu(x)
        assert type(y.grad_fn).__name__ == "_EagerGistReluBackward", name
        calls.clear()
        dy = torch.randn_like(y)
        if name == "as saved":
            (dx,) = torch.autograd.grad(y, x, dy)
            assert torch.equal(dx, torch.where(x.detach() > 0, dy, 0)) and calls == [], name
        else:
            with pytest.raises(InvalidProblemError, match="bits"):
                torch.autograd.grad(y, x, dy)
            assert calls == [1], name
