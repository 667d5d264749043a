"""Batch norm + ReLU fused (trainops.batch_norm_relu, nn.BatchNormReLU2d, patch's fusion) against
relu(torch's batch_norm) in float64, both backends; the one-launch statistics and gradient sums
(tickets left zeroed, launches counted, bit-identical); edge cases; gradcheck; torch.compile."""

import pytest
import torch
import torch.nn.functional as torch_F

import trainops
from trainops.errors import InvalidProblemError
from trainops.ops import batch_norm as bn_ops
from trainops.ops.batch_norm import BatchNormHeuristics
from trainops.plan import clear_plan_cache

from numerics import assert_close, poison_new_output

# several programs a channel block (the last one to arrive combines), several channel blocks
SMALL = BatchNormHeuristics(tile=16, channel_block=2, spatial_block=4, programs_per_sm=16)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN: an element left unwritten fails the test."""
    poison_new_output(monkeypatch, bn_ops.BatchNormProblem)
    clear_plan_cache()
    yield
    clear_plan_cache()


def _inputs(shape, layout="contiguous", dtype=torch.float32, device="cpu", seed=0, affine=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.3
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "strided":
        x = torch.cat([x, x], -1)[..., ::2]
    c = shape[1]
    w = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5
    b = torch.randn(c, generator=gen, dtype=torch.float64) * 0.5
    rm = torch.randn(c, generator=gen, dtype=torch.float64)
    rv = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    cast = [t.to(dtype).to(device) for t in (x, w, b)]
    return (cast[0], *(cast[1:] if affine else (None, None)), rm.float().to(device), rv.float().to(device),
            dy.to(dtype).to(device))


def _both(x, w, b, rm, rv, dy, training, momentum=0.1):
    """(ours, reference float64 on the CPU): (y, running mean, running var, grads of x [, w, b])."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    xs, *params = leaves
    ws, bs = params if params else (None, None)
    stats = (rm.clone(), rv.clone())
    y = trainops.batch_norm_relu(xs, *stats, ws, bs, training, momentum)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in (x, w, b) if t is not None]
    xr, *ref_params = ref_leaves
    wr, br = ref_params if ref_params else (None, None)
    ref_stats = (rm.double().cpu(), rv.double().cpu())
    yr = torch.relu(torch_F.batch_norm(xr, *ref_stats, wr, br, training, momentum))
    ref_grads = torch.autograd.grad(yr, ref_leaves, dy.double().cpu())
    return (y, *stats, grads), (yr, *ref_stats, ref_grads)


CASES = [((4, 3, 5, 6), "contiguous", True), ((4, 3, 5, 6), "channels_last", True), ((3, 4, 7), "contiguous", True),
         ((2, 3, 4, 6), "strided", False), ((4, 3, 5, 6), "channels_last", False)]


@pytest.mark.parametrize("shape,layout,training", CASES)
def test_matches_relu_of_torchs_batch_norm(backend, device, shape, layout, training):
    x, w, b, rm, rv, dy = _inputs(shape, layout, device=device, seed=len(shape) + training)
    (y, rm1, rv1, grads), (yr, rmr, rvr, ref_grads) = _both(x, w, b, rm, rv, dy, training)
    assert_close(y, yr, torch.float32, "y")
    assert (y == 0).any() and (y > 0).any()   # the ReLU cut something and kept something
    assert_close(rm1, rmr, torch.float32, "running_mean")
    assert_close(rv1, rvr, torch.float32, "running_var")
    for name, g, r in zip(("dx", "dweight", "dbias"), grads, ref_grads):
        assert_close(g, r, torch.float32, name)
    if layout == "channels_last":
        assert y.stride() == x.stride() and grads[0].stride() == x.stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_dtypes_without_affine_and_with_small_tiles(backend, device, dtype):
    x, w, b, rm, rv, dy = _inputs((3, 5, 4, 3), "channels_last", dtype, device, seed=3, affine=False)
    with trainops.heuristics(SMALL):
        (y, rm1, rv1, grads), (yr, rmr, rvr, ref_grads) = _both(x, w, b, rm, rv, dy, True)
    assert y.dtype == dtype and len(grads) == 1
    # half y: the interpreter truncates float32 -> half where the GPU rounds (one ulp)
    assert_close(y, yr, dtype, "y")
    assert_close(grads[0], ref_grads[0], dtype, "dx")
    assert_close(rm1, rmr, torch.float32, "running_mean")


def test_zero_outputs_pass_no_gradient_and_nan_stays(backend, device):
    """y = 0 exactly (weight and bias 0): torch's threshold_backward passes nothing (y <= 0); a NaN
    input stays NaN in y, as torch.relu."""
    x = torch.randn(4, 2, 3, 3, device=device, requires_grad=True)
    w = torch.zeros(2, device=device, requires_grad=True)
    b = torch.zeros(2, device=device, requires_grad=True)
    y = trainops.batch_norm_relu(x, None, None, w, b, True)
    assert torch.equal(y, torch.zeros_like(y))
    for g in torch.autograd.grad(y, (x, w, b), torch.ones_like(y)):
        assert torch.equal(g, torch.zeros_like(g))
    rm, rv = torch.zeros(2, device=device), torch.ones(2, device=device)
    x = torch.randn(2, 2, 3, device=device)
    x[0, 1, 2] = float("nan")
    y = trainops.batch_norm_relu(x, rm, rv, training=False)
    assert y[0, 1, 2].isnan() and not y[:, 0].isnan().any()


def test_edge_cases_as_torch(backend, device):
    """N * H * W = 1: training refused (as torch), eval computed; an empty batch: empty y, the
    running statistics left alone, zero parameter gradients."""
    rm, rv = torch.zeros(3, device=device), torch.ones(3, device=device)
    with pytest.raises(InvalidProblemError, match="batch_norm_relu.*more than 1 value per channel"):
        trainops.batch_norm_relu(torch.randn(1, 3, 1, 1, device=device), rm, rv, training=True)
    x = torch.randn(1, 3, 1, 1, device=device)
    assert_close(trainops.batch_norm_relu(x, rm, rv), torch.relu(torch_F.batch_norm(x, rm, rv)), torch.float32, "y")
    x = torch.empty(0, 3, 4, 4, device=device, requires_grad=True)
    w, b = torch.ones(3, device=device, requires_grad=True), torch.zeros(3, device=device, requires_grad=True)
    y = trainops.batch_norm_relu(x, rm, rv, w, b, True)
    assert y.shape == x.shape and torch.equal(rm, torch.zeros(3, device=device))
    dx, dw, db = torch.autograd.grad(y.sum(), (x, w, b))
    assert dx.shape == x.shape and not dw.any() and not db.any()


def test_errors_name_the_op_and_argument(backend, device):
    x = torch.randn(4, 3, 5, device=device)
    with pytest.raises(InvalidProblemError, match="batch_norm_relu.*'weight'"):
        trainops.batch_norm_relu(x, None, None, torch.ones(4, device=device), training=True)
    with pytest.raises(InvalidProblemError, match="batch_norm_relu.*'running_mean'"):
        trainops.batch_norm_relu(x, None, None, training=False)
    with pytest.raises(InvalidProblemError, match="'relu'"):
        trainops.plan("batch_norm_stats", shape=(4, 3, 5), dtype=torch.float32, device=device, relu=True)


@pytest.mark.parametrize("training", [True, False])
def test_gradcheck_float64(backend, device, training):
    x, w, b, rm, rv, _ = _inputs((3, 2, 4), dtype=torch.float64, device=device, seed=9)
    leaves = [t.requires_grad_() for t in (x, w, b)]

    def f(x, w, b):
        return trainops.batch_norm_relu(x, rm.double(), rv.double(), w, b, training)
    assert torch.autograd.gradcheck(f, leaves, fast_mode=backend == "triton")


def test_torch_compile_fullgraph():
    """The op's schema, fake and autograd under dynamo + AOTAutograd (the op stays whole: the
    backend does not matter to the trace; the CPU's is the cheaper here)."""
    x, w, b, rm, rv, _ = _inputs((4, 3, 5, 5), "channels_last", seed=8)

    def block(x, w, b, rm, rv):
        return (trainops.batch_norm_relu(x, rm, rv, w, b, True) * 2).sum()
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    stats = [rm.clone(), rv.clone()]
    loss = torch.compile(block, fullgraph=True, backend="aot_eager")(*leaves, *stats)
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    ref_stats = [rm.clone(), rv.clone()]
    ref = block(*ref_leaves, *ref_stats)
    assert_close(loss, ref, torch.float32, "loss")
    for g, r in zip(grads, torch.autograd.grad(ref, ref_leaves)):
        assert_close(g, r, torch.float32, "grad")
    for s, r in zip(stats, ref_stats):
        assert torch.allclose(s, r, rtol=1e-6, atol=1e-7)


def test_one_launch_each_way_for_the_sums_and_bit_identical(monkeypatch):
    """Triton: a training step is 4 kernel launches (statistics + their finishing; apply; gradient
    sums + their totals; dx; 6 before), eval 1 + 2. The plan keeps its tickets (on the CPU, as on a
    CUDA default stream) and the last programs set them back to 0: a second step finishes too
    (outputs start as NaN) and gives the same bits."""
    launches = []

    def counting(kernel, grid, trailing=(), **meta):
        run = launcher(kernel, grid, trailing, **meta)
        return lambda *args: (launches.append(kernel.fn.__name__), run(*args))[1]
    launcher = bn_ops.launcher
    monkeypatch.setattr(bn_ops, "launcher", counting)
    x, w, b, rm, rv, dy = _inputs((3, 3, 2, 3), "channels_last", seed=4)
    with trainops.backend("triton"), trainops.heuristics(SMALL):
        results = []
        for _ in range(2):
            launches.clear()
            results.append(_both(x, w, b, rm, rv, dy, True)[0])
            assert launches == ["_bn_stats", "_bn_apply", "_bn_grad_sums", "_bn_grad_input"], launches
        first, second = results
        for a, c in zip((*first[:3], *first[3]), (*second[:3], *second[3])):
            assert torch.equal(a, c)
        launches.clear()
        _both(x, w, b, rm, rv, dy, False)   # eval: the weight and bias gradients still need their sums
        assert launches == ["_bn_apply", "_bn_grad_sums", "_bn_grad_input"], launches


def test_module_is_a_drop_in_for_batch_norm_then_relu(backend, device):
    torch.manual_seed(0)
    for momentum in (0.1, None):
        ours = trainops.nn.BatchNormReLU2d(3, momentum=momentum).to(device)
        ref = torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=momentum), torch.nn.ReLU()).to(device)
        ref[0].load_state_dict(ours.state_dict())
        for _ in range(2):
            x = torch.randn(4, 3, 2, 3, device=device)
            assert_close(ours(x), ref(x), torch.float32, "train")
        assert_close(ours.running_var, ref[0].running_var, torch.float32, "running_var")
        assert ours.num_batches_tracked == ref[0].num_batches_tracked == 2
        ours.eval(), ref.eval()
        assert_close(ours(x), ref(x), torch.float32, "eval")


@pytest.mark.parametrize("relu", [False, True])
def test_saved_tensor_hooks_that_change_xs_layout(backend, device, relu):
    """A saved-tensor hook may hand x back in another layout (save_on_cpu returns a contiguous copy
    of a channels-last x): the backward follows the tensors it gets, not the forward's plan."""
    torch.manual_seed(0)
    x0 = torch.randn(4, 3, 5, 6, device=device).to(memory_format=torch.channels_last)
    dy = torch.randn(4, 3, 5, 6, device=device).to(memory_format=torch.channels_last)
    w0, b0 = torch.rand(3, device=device) + 0.5, torch.randn(3, device=device)
    fn = trainops.batch_norm_relu if relu else trainops.batch_norm

    def grads(f, hooked):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t.contiguous()) if hooked \
                else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = f(x, None, None, w, b, True)
        return torch.autograd.grad(y, (x, w, b), dy)

    def reference(x, rm, rv, w, b, training):
        y = torch_F.batch_norm(x.double(), rm, rv, w.double(), b.double(), training)
        return y.relu() if relu else y

    expected = grads(reference, False)
    for got, want, name in zip(grads(fn, True), expected, ("dx", "dweight", "dbias")):
        assert_close(got, want.float(), torch.float32, name)


@pytest.mark.parametrize("relu, saved", [(relu, saved) for relu in (False, True)
                                         for saved in ("none", "weight", "mean", "rstd", "bias")
                                         if relu or saved != "bias"])   # the bias is saved for the ReLU only
def test_saved_tensor_hooks_that_change_a_per_channel_tensors_dtype(backend, device, monkeypatch, relu, saved):
    """A hook that hands back the weight, mean, rstd (or the fused ReLU's bias) in another dtype:
    the forward's plan (made for the dtypes saved) does not run on it. The backward op does: it
    plans for a float64 weight or bias (torch's values), and names mean or rstd, which must be in
    the accumulator's dtype (InvalidProblemError), where the forward's plan read them silently.
    A hook that changes nothing ("none"): the forward's plan, no backward op."""
    torch.manual_seed(0)
    x0, dy = torch.randn(4, 3, 5, 6, device=device), torch.randn(4, 3, 5, 6, device=device)
    w0, b0 = torch.rand(3, device=device) + 0.5, torch.randn(3, device=device)
    fn = trainops.batch_norm_relu if relu else trainops.batch_norm
    calls = []
    real = bn_ops.batch_norm_backward_op
    monkeypatch.setattr(bn_ops, "batch_norm_backward_op", lambda *a: (calls.append(1), real(*a))[1])
    for eager in (True, False):
        calls.clear()
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        names = {id(x): "x", id(w): "weight", id(b): "bias"}
        others = ["mean", "rstd"]   # saved in this order, after x and the weight

        def pack(t):
            return (names[id(t)] if id(t) in names else others.pop(0)), t

        with monkeypatch.context() as m:
            if not eager:
                m.setattr(bn_ops, "eager_training", lambda *args: None)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[1].double() if p[0] == saved else p[1]):
                y = fn(x, None, None, w, b, True)
        assert type(y.grad_fn).__name__ == ("_EagerTrainingBackward" if eager else "batch_norm_functionBackward")
        if saved in ("mean", "rstd"):
            with pytest.raises(InvalidProblemError, match=saved):
                torch.autograd.grad(y, (x, w, b), dy)
        else:
            got = torch.autograd.grad(y, (x, w, b), dy)
            xr, wr, br = (t.double().requires_grad_() for t in (x0, w0, b0))
            yr = torch_F.batch_norm(xr, None, None, wr, br, True)
            want = torch.autograd.grad(yr.relu() if relu else yr, (xr, wr, br), dy.double())
            for g, r, name in zip(got, want, ("dx", "dweight", "dbias")):
                assert_close(g, r.float(), torch.float32, name)
        assert calls == ([] if saved == "none" else [1]), (eager, calls)


def _net():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.ReLU(inplace=True)),
                               torch.nn.BatchNorm2d(4))


def test_patch_fuses_sequential_pairs_and_unpatch_undoes_it():
    model, ref = _net(), _net()
    ref.load_state_dict(model.state_dict())
    assert trainops.patch(model, block_ops=True, dry_run=True).swapped and type(model[1]) is torch.nn.BatchNorm2d
    report = trainops.patch(model, block_ops=True)
    assert [(n, new) for n, _, new in report.swapped] == [
        ("1", "trainops.nn.BatchNormReLU2d"), ("2", "trainops.nn.FusedReLU"),
        ("3.0", "trainops.nn.BatchNormReLU2d"), ("3.1", "trainops.nn.FusedReLU")]
    assert report.descriptions["1"] == "fused with the ReLU 2" and "fused into 3.0" in str(report)
    assert type(model[4]) is torch.nn.BatchNorm2d   # no ReLU after it (batch_norm=False: kept)
    x = torch.randn(2, 3, 6, 6)
    assert_close(model(x), ref(x), torch.float32, "patched")
    trainops.unpatch(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]


def test_patch_fuses_only_pairs_certain_to_run_back_to_back():
    """A ReLU shared with another place, a hook on either module, a BatchNorm + ReLU called from a
    block's own forward (torchvision's BasicBlock): not fused."""
    shared = torch.nn.ReLU()
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(4), shared, torch.nn.BatchNorm2d(4), shared)
    assert not trainops.patch(model, block_ops=True).swapped
    hooked = torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    hooked[1].register_forward_hook(lambda *args: None)
    assert not trainops.patch(hooked, block_ops=True).swapped

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn1, self.relu = torch.nn.BatchNorm2d(4), torch.nn.ReLU()

        def forward(self, x):
            return self.relu(self.bn1(x) + x)
    assert not trainops.patch(Block(), block_ops=True).swapped
    plain = _net()   # batch_norm=True alone: plain batch norms, nothing fused
    report = trainops.patch(plain, batch_norm=True)
    assert {new for _, _, new in report.swapped} == {"trainops.nn.BatchNorm2d"} and not report.descriptions
    assert type(plain[2]) is torch.nn.ReLU


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_real_sizes_on_gpu(layout):
    """The demo's largest batch norm (256 x 64 x 32 x 32, bf16) and a deep one: against float64,
    bit-identical run to run."""
    for shape in ((256, 64, 32, 32), (256, 512, 4, 4)):
        x, w, b, rm, rv, dy = _inputs(shape, layout, torch.bfloat16, "cuda", seed=1)
        ours, ref = _both(x, w, b, rm, rv, dy, True)
        again = _both(x, w, b, rm, rv, dy, True)[0]
        assert_close(ours[0], ref[0], torch.bfloat16, "y")
        assert_close(ours[3][0], ref[3][0], torch.bfloat16, "dx")
        for a, c in zip((ours[0], *ours[3]), (again[0], *again[3])):
            assert torch.equal(a, c), "not bit-identical run to run"


# ----------------------------------------------------------------------------------------------
# The eager training path (bn_ops.eager_training): one call, the op path's plans and bits
# ----------------------------------------------------------------------------------------------

def _step(fn, x0, w0, b0, rm0, rv0, dy, op_path: bool, monkeypatch=None):
    """(y, running mean, running var, their versions, grads, grad_fn's name) of one training call of
    ``fn`` (trainops.batch_norm or batch_norm_relu), through the op path when ``op_path``."""
    leaves = [t.detach().clone().requires_grad_() for t in (x0, w0, b0) if t is not None]
    x, *params = leaves
    w, b = params if params else (None, None)
    rm, rv = (None, None) if rm0 is None else (rm0.clone(), rv0.clone())
    if op_path:
        with monkeypatch.context() as m:
            m.setattr(bn_ops, "eager_training", lambda *args: None)
            y = fn(x, rm, rv, w, b, True, 0.1)
    else:
        y = fn(x, rm, rv, w, b, True, 0.1)
    grads = torch.autograd.grad(y, leaves, dy)
    versions = None if rm is None else (rm._version, rv._version)
    return y, rm, rv, versions, grads, type(y.grad_fn).__name__


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("affine,running", [(True, True), (False, False), (True, False)])
def test_eager_training_path_is_taken_and_bit_identical_to_the_op_path(backend, device, monkeypatch, relu, layout,
                                                                        affine, running):
    x, w, b, rm, rv, dy = _inputs((4, 3, 5, 6), layout, device=device, seed=7, affine=affine)
    if not running:
        rm = rv = None
    fn = trainops.batch_norm_relu if relu else trainops.batch_norm
    for heuristics in (BatchNormHeuristics(), SMALL):   # a new key for other heuristics
        with trainops.heuristics(heuristics):
            fast = _step(fn, x, w, b, rm, rv, dy, False)
            slow = _step(fn, x, w, b, rm, rv, dy, True, monkeypatch)
        assert fast[-1] == "_EagerTrainingBackward" and slow[-1] != fast[-1], (fast[-1], slow[-1])
        for got, want in zip((*fast[:3], *fast[4]), (*slow[:3], *slow[4])):
            assert (got is None and want is None) or torch.equal(got, want)
        assert fast[3] == slow[3]   # the running statistics' versions bumped alike
        assert fast[0].stride() == slow[0].stride()
    # against float64, once
    (y, *_), (yr, *_) = _both(x, w, b, rm if running else torch.zeros(3), rv if running else torch.ones(3), dy, True)
    assert_close(y, yr.float(), torch.float32, "y")


def test_eager_training_without_gradients_and_kernel_counts(backend, device, monkeypatch):
    """No input needing a gradient (or grad mode off): no autograd node, the same bits; the kernels
    ``track_kernels`` counts are the op path's."""
    x, w, b, rm, rv, dy = _inputs((4, 3, 5, 6), "channels_last", device=device, seed=3)
    outs = []
    for op_path in (False, True):
        stats = (rm.clone(), rv.clone())
        with monkeypatch.context() as m, trainops.track_kernels() as used:
            if op_path:
                m.setattr(bn_ops, "eager_training", lambda *args: None)
            with torch.no_grad():
                y = trainops.batch_norm(x, *stats, w, b, True)
            y2 = trainops.batch_norm_relu(x.requires_grad_(), *stats, w, b, True)
            x.requires_grad_(False)
        outs.append((y, y2.detach(), *stats, dict(used)))
    (y, y2, rm1, rv1, used), (ry, ry2, rrm, rrv, rused) = outs
    assert y.grad_fn is None and torch.equal(y, ry) and torch.equal(y2, ry2)
    assert torch.equal(rm1, rrm) and torch.equal(rv1, rrv)
    assert used == rused, (used, rused)


def test_eager_training_falls_back_where_it_must(backend, device, monkeypatch):
    """The op path runs (with its results) for an x it copies first, a strided weight, a
    __torch_function__ mode, a tensor subclass; in each case the values are torch's."""
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    x, w, b, rm, rv, dy = _inputs((4, 3, 5, 6), "contiguous", device=device, seed=5)
    # (leaves, the call's x, weight, bias (views of the leaves), mode)
    wide, double_w = torch.cat([x, x], -1), torch.stack([w, w], 1)
    cases = {
        "copied x": ((wide, w, b), lambda t: (t[0][..., :5], t[1], t[2]), None),   # spatial axes not one axis
        "strided weight": ((x, double_w, b), lambda t: (t[0], t[1][:, 0], t[2]), None),
        "mode": ((x, w, b), lambda t: t, Passing),
        "subclass": ((x, w, b), lambda t: (t[0].as_subclass(Sub), t[1], t[2]), None),
    }
    for name, (leaf_values, views, mode) in cases.items():
        leaves = [t.detach().clone().requires_grad_() for t in leaf_values]
        xs, ws, bs = views(leaves)
        calls = []
        real = bn_ops._EagerTraining.apply
        with monkeypatch.context() as m:
            m.setattr(bn_ops._EagerTraining, "apply", lambda *a: (calls.append(1), real(*a))[1])
            if mode is not None:
                with mode():
                    y = trainops.batch_norm(xs, None, None, ws, bs, True)
            else:
                y = trainops.batch_norm(xs, None, None, ws, bs, True)
        assert calls == [], name
        plain = [t.detach().as_subclass(torch.Tensor).double() for t in (xs, ws, bs)]
        ref = torch_F.batch_norm(plain[0], None, None, plain[1], plain[2], True)
        assert_close(y.detach().as_subclass(torch.Tensor), ref.float(), torch.float32, name)
        grads = torch.autograd.grad(y.as_subclass(torch.Tensor), leaves, dy[..., :xs.shape[-1]].contiguous())
        assert all(g is not None for g in grads), name


def test_clear_plan_cache_empties_the_eager_paths_plans(backend, device):
    """clear_plan_cache() empties the plans batch norm's and GIST ReLU's eager paths keep: the next
    call makes new ones (a registry or heuristics change reaches them)."""
    from trainops.ops import gist as gist_ops
    x = torch.randn(4, 3, 5, 6, device=device, requires_grad=True)
    w = torch.ones(3, device=device, requires_grad=True)
    trainops.batch_norm(x, None, None, w, None, True)
    trainops.gist.relu(x)
    kept = (next(iter(bn_ops._EAGER_PLANS.values())), next(iter(gist_ops._EAGER_PLANS.values())))
    assert all(isinstance(p, tuple) for p in kept)   # _EagerPlans, not the op path's marker
    clear_plan_cache()
    assert not bn_ops._EAGER_PLANS and not gist_ops._EAGER_PLANS
    trainops.batch_norm(x, None, None, w, None, True)
    trainops.gist.relu(x)
    again = (next(iter(bn_ops._EAGER_PLANS.values())), next(iter(gist_ops._EAGER_PLANS.values())))
    assert again[0].forward is not kept[0].forward and again[1].forward is not kept[1].forward


def test_functorch_transforms_take_the_op_path(backend, device, monkeypatch):
    """Under vmap the eager paths stand aside: GIST ReLU's op (its batching fallback) gives
    torch's values; batch norm's statistics op raises its missing batching rule, as on main."""
    from trainops.ops import gist as gist_ops
    runs = []
    for module, name in ((bn_ops, "_eager_run"), (gist_ops._EagerGistRelu, "apply")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real: (runs.append(1), _real(*a))[1])
    x = torch.randn(2, 4, 3, 5, 6, device=device)
    assert torch.equal(torch.func.vmap(trainops.gist.relu)(x), torch.relu(x))
    with pytest.raises(RuntimeError, match="batch_norm_stats"):
        torch.func.vmap(lambda t: trainops.batch_norm(t, None, None, None, None, True))(x)
    assert runs == []
    trainops.batch_norm(x[0].requires_grad_(), None, None, None, None, True)   # (the spies see eager calls)
    assert runs == [1]
