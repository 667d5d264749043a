"""trainops.library: every op's CPU and CUDA kernels are its impl, registered with the dispatcher
directly (custom_op's backend wrapper cost 155 us a call inside compiled graphs); calls through
``torch.ops.trainops`` keep autograd, mutation version counters and the impl's results."""

import torch

import trainops


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
