"""trainops.library: every op's CPU and CUDA kernels are its impl, registered with the dispatcher
directly (custom_op's backend wrapper cost 155 us a call inside compiled graphs); calls through
``torch.ops.trainops`` keep autograd, mutation version counters and the impl's results, and every
op passes torch.library.opcheck's schema (no output aliasing an input, mutations as declared) and
fake-tensor checks on the arguments the public functions give it."""

import pytest
import torch

import trainops
from trainops import library


def _trainops_ops():
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("trainops::"))


def test_every_op_has_direct_cpu_and_cuda_kernels():
    names = _trainops_ops()
    assert len(names) >= 30, names
    for name in names:
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)


def test_dispatcher_call_gives_the_impl_results_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(6, 33, dtype=torch.float64, requires_grad=True)
    w = torch.rand(33, dtype=torch.float64, requires_grad=True)
    y, _, _ = torch.ops.trainops.rms_norm(x, w, None, 1, 1e-6, 0.0)   # the dispatcher, not the eager shortcut
    ref = torch.nn.functional.rms_norm(x, (33,), w, 1e-6)
    assert torch.allclose(y, ref, rtol=1e-12, atol=0)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), g)
    want = torch.autograd.grad(ref, (x, w), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_dispatcher_call_of_a_mutating_op_writes_in_place_and_bumps_the_version():
    torch.manual_seed(0)
    logits = torch.randn(4, 10, dtype=torch.float64)
    target = torch.randint(0, 10, (4,))
    want_loss = torch.nn.functional.cross_entropy(logits, target)
    want_grad = (torch.softmax(logits, -1) - torch.nn.functional.one_hot(target, 10)) / 4
    before = logits._version
    loss, _, _ = torch.ops.trainops.cross_entropy_inplace(logits, target, None, -100, "mean", 0.0, 0.0, None, False)
    assert logits._version > before
    assert torch.allclose(loss, want_loss, rtol=1e-12, atol=0)
    assert torch.allclose(logits, want_grad, rtol=1e-10, atol=1e-14)   # the gradient, written over the logits


def _softmax_both_ways(x, **grad_kwargs):
    """(y, dx) of softmax through the eager shortcut and through the dispatcher (torch.ops.trainops)."""
    results = []
    for call in (lambda t: trainops.softmax(t, -1), lambda t: torch.ops.trainops.softmax(t, -1, None)):
        t = x.detach().clone().requires_grad_(x.requires_grad)
        y = call(t)
        dx = torch.autograd.grad(y, t, torch.ones_like(y)) if y.requires_grad else None
        results.append((y, dx, t))
    return results


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_eager_shortcut_matches_the_dispatcher(mode, requires_grad):
    """The eager shortcut (autograd.Function without the dispatcher, or the impl alone) keeps the
    op's semantics in grad mode, no_grad and inference mode, with and without requires_grad."""
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=requires_grad)
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with context():
        (y, dx, _), (y_op, dx_op, _) = _softmax_both_ways(x)
    assert torch.equal(y, y_op)
    assert y.requires_grad == y_op.requires_grad == (requires_grad and mode == "grad")
    assert y.is_inference() == y_op.is_inference() == (mode == "inference_mode")
    if dx is not None:
        assert torch.allclose(dx[0], dx_op[0], rtol=1e-12, atol=1e-15)
        assert y.grad_fn is not None and y_op.grad_fn is not None


def test_eager_shortcut_takes_a_dead_functorch_wrapper():
    """A tensor that escaped a finished functorch transform (a dead wrapper) takes the autograd path
    of the eager shortcut (which unwraps it, as autograd.Function.apply does) and gives torch's
    values and gradients."""
    from torch.func import grad

    escaped = []

    def f(t):
        escaped.append(t)
        return t.sum()

    grad(f)(torch.randn(3, 5, dtype=torch.float64))
    dead = escaped[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = trainops.rms_norm(dead, w, 1e-6)   # w requires grad: the autograd path
    (dw,) = torch.autograd.grad(y, w, torch.ones_like(y))
    ref = torch.nn.functional.rms_norm(dead.detach(), (5,), w, 1e-6)
    assert torch.allclose(y, ref, rtol=1e-12, atol=0)
    assert torch.allclose(dw, torch.autograd.grad(ref, w, torch.ones_like(ref))[0], rtol=1e-10, atol=1e-12)


def _recorded_calls():
    """Each custom op's first call (op, args, kwargs), from forward + backward passes of the public
    functions on small CPU inputs."""
    calls = {}
    original = library.CustomOp.__call__

    def record(self, *args, **kwargs):
        calls.setdefault(self.name, (self.op, args, kwargs))
        return original(self, *args, **kwargs)

    torch.manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    def run(out):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        sum((o.float() * torch.randn_like(o.float())).sum() for o in outs if o.requires_grad).backward()

    x, w, b = leaf(4, 16), leaf(16), leaf(16)
    q, k, cos, sin = leaf(2, 4, 8, 16), leaf(2, 2, 8, 16), torch.randn(8, 16), torch.randn(8, 16)
    # the eager paths that run the ops' plans without calling the ops: off, so that the ops are reached
    from trainops.ops import batch_norm as bn_ops, gist as gist_ops
    eager = (bn_ops.eager_training, gist_ops.eager_relu)
    bn_ops.eager_training, gist_ops.eager_relu = (lambda *args: None), (lambda *args: None)
    library.CustomOp.__call__ = record
    try:
        run(trainops.softmax(x, 1))
        run(trainops.log_softmax(x, 1))
        run(trainops.rms_norm(x, w, 1e-6, residual=leaf(4, 16)))
        run(trainops.layer_norm(x, (16,), w, b))
        for name in ("gelu", "quick_gelu", "silu"):
            run(getattr(trainops, name)(x))
        run(trainops.bias_gelu(x, b))
        run(trainops.swiglu(x, leaf(4, 16)))
        run(trainops.geglu(x, leaf(4, 16)))
        run(trainops.rotary_embedding(q, k, cos, sin))
        run(trainops.qk_norm_rotary(q.transpose(1, 2), k.transpose(1, 2), leaf(16), leaf(16), cos, sin))
        run(trainops.dropout(x, 0.25))
        run(trainops.attention_softmax(leaf(2, 2, 8, 8), scale=0.5, causal=True, dropout_p=0.25))
        run(trainops.cross_entropy(leaf(4, 16), torch.randint(0, 16, (4,))))
        run(trainops.cross_entropy(leaf(4, 16) * 1.0, torch.randint(0, 16, (4,)), inplace_backward=True))
        run(trainops.embedding(torch.randint(0, 16, (5,)), leaf(16, 8)))
        run(trainops.linear_cross_entropy(leaf(2, 3, 16), leaf(10, 16), torch.randint(0, 10, (2, 3)), leaf(10)))
        run(trainops.linear_cross_entropy(leaf(5, 16), leaf(10, 16), torch.randint(0, 10, (5,)), reduction="none"))
        run(trainops.linear_cross_entropy(leaf(5, 16), leaf(10, 16), torch.randint(0, 10, (5,)), token_accuracy=True,
                                          entropy=True))
        run(trainops.gather(leaf(6, 5), torch.randint(0, 6, (3, 5)), 0))
        run(trainops.batch_norm(leaf(4, 3, 5), torch.zeros(3), torch.ones(3), leaf(3), leaf(3), training=True))
        # the backward op: reached where the saved x comes back in another layout than the forward's
        # plan was made for (else the eager backward runs the forward's plan without calling it)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t.contiguous()):
            run(trainops.batch_norm(leaf(2, 3, 4, 5).to(memory_format=torch.channels_last), None, None, leaf(3),
                                    leaf(3), training=True))
        run(trainops.gist.relu(leaf(3, 7)))
        run(trainops.gist.relu(leaf(2, 3, 4, 5).to(memory_format=torch.channels_last)))
        run(trainops.gist.relu_max_pool2d(leaf(2, 3, 6, 5), 3, 2, 1))
        run(trainops.gist.relu_max_pool2d(leaf(2, 3, 6, 5).to(memory_format=torch.channels_last), 2))
        run(trainops.sum_to_shape(leaf(4, 3, 5), (3, 1)))
        run(trainops.conv2d(leaf(2, 3, 5, 4), leaf(3, 1, 3, 3), leaf(3), padding=1, groups=3))
        run(trainops.linear_distillation_loss(leaf(5, 16), leaf(10, 16), leaf(5, 8), leaf(10, 8),
                                              torch.randint(0, 10, (5,)), weight_hard_loss=0.5))
        run(trainops.linear_preference_loss(leaf(2, 3, 16), leaf(10, 16), torch.randint(0, 10, (2, 3)),
                                            ref_hidden=leaf(2, 3, 16), ref_weight=leaf(10, 16)).loss)
        from trainops.ops.chunked_linear import ChunkedLinearHeuristics
        with trainops.heuristics(ChunkedLinearHeuristics(chunk_bytes=1, min_rows=2)):   # the two-pass path
            run(trainops.linear_preference_loss(leaf(2, 3, 16), leaf(10, 16), torch.randint(0, 10, (2, 3)),
                                                kind="simpo").loss)
    finally:
        library.CustomOp.__call__ = original
        bn_ops.eager_training, gist_ops.eager_relu = eager
    return calls


_CALLS = {}


@pytest.mark.parametrize("name", [n.split("::")[1] for n in _trainops_ops()])
def test_every_op_passes_opcheck(name):
    if not _CALLS:
        _CALLS.update(_recorded_calls())
    assert name in _CALLS, f"no public function reached trainops::{name}: add a call to _recorded_calls"
    op, args, kwargs = _CALLS[name]
    torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_faketensor"))
