"""Fused optimizers against torch.optim: bit for bit on the CPU path, within float rounding on Triton."""

import pytest
import torch

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops.multi_tensor import MultiTensorHeuristics

from conftest import BACKEND_DEVICES
from numerics import interpreter_rounding, relative_error


@pytest.fixture(autouse=True, params=["block-default", "block-64"])
def block_size(request):
    """Default blocks (most of these small tensors are one tail block), or 64-element blocks, so
    that the unmasked full-block code and the masked tail code both run on every case (and 3
    partials a chunk: several chunks in the norm's second reduction stage)."""
    if request.param == "block-default":
        yield request.param
        return
    with trainops.heuristics(MultiTensorHeuristics(block=64, sum_chunk=3)):
        yield request.param


CASES = {
    "sgd": (dict(lr=0.05), {}),
    "sgd-momentum-wd": (dict(lr=0.05, momentum=0.9, weight_decay=0.01), {}),
    "sgd-nesterov-maximize": (dict(lr=0.05, momentum=0.8, nesterov=True, maximize=True), {}),
    "sgd-dampening": (dict(lr=0.05, momentum=0.9, dampening=0.3), {}),
    "adam": (dict(lr=0.01), {}),
    "adam-l2-amsgrad": (dict(lr=0.01, weight_decay=0.1, amsgrad=True), {}),
    "adam-maximize": (dict(lr=0.01, betas=(0.8, 0.99), maximize=True), {}),
    "adamw": (dict(lr=0.01, weight_decay=0.1), {}),
    "adamw-amsgrad": (dict(lr=0.01, weight_decay=0.1, amsgrad=True, eps=1e-6), {}),
}
CLASSES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}


def classes(case):
    name = CLASSES[case.split("-")[0]]
    return getattr(torch.optim, name), getattr(trainops.optim, name)


def make_model(device, dtype=torch.float32, seed=1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 3, bias=False))
    return model.to(device=device, dtype=dtype)


def train(model, opt, steps, *, seed=2, clip=None, scaler=None, bad_steps=()):
    """A few steps on random data; gradients of ``bad_steps`` get an inf. Returns the per-step scales."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    scales = []
    for step in range(steps):
        x = torch.randn(16, 7, generator=gen).to(device)
        opt.zero_grad()
        loss = model(x).square().mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if step in bad_steps:
            next(model.parameters()).grad[0, 0] = float("inf")
        if clip is not None:
            if scaler:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
    return scales


def assert_same_params(ours, ref, exact, what):
    for i, (a, b) in enumerate(zip(ours.parameters(), ref.parameters())):
        if exact:
            assert torch.equal(a, b), f"{what}: parameter {i} differs"
        else:
            assert relative_error(a, b) < 2e-6, f"{what}: parameter {i}: {relative_error(a, b):.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch(case, backend, device):
    kwargs, _ = CASES[case]
    torch_cls, our_cls = classes(case)
    ref, ours = make_model("cpu"), make_model(device)
    train(ref, torch_cls(ref.parameters(), **kwargs), 5)
    opt = our_cls(ours.parameters(), **kwargs)
    train(ours, opt, 5)
    assert_same_params(ours, ref, backend == "cpu", case)
    assert all("step" not in s or s["step"].item() == 5 for s in opt.state.values())


@pytest.mark.parametrize("case", ["sgd-momentum-wd", "adamw-amsgrad", "adam-l2-amsgrad"])
def test_clip_by_global_norm_matches_torch(case, backend, device):
    kwargs, _ = CASES[case]
    torch_cls, our_cls = classes(case)
    ref, ours = make_model("cpu"), make_model(device)
    train(ref, torch_cls(ref.parameters(), **kwargs), 4, clip=0.01)
    opt = our_cls(ours.parameters(), max_grad_norm=0.01, **kwargs)
    train(ours, opt, 4)
    assert_same_params(ours, ref, backend == "cpu", case)
    assert opt.grad_norm is not None and opt.grad_norm.item() > 0.01


def test_param_groups_and_params_without_grad(backend, device):
    def groups(model):
        layers = [m for m in model if isinstance(m, torch.nn.Linear)]
        return [{"params": layers[0].parameters(), "lr": 0.02},
                {"params": list(layers[1].parameters()) + list(layers[2].parameters()), "weight_decay": 0.3}]
    ref, ours = make_model("cpu"), make_model(device)
    for m in (ref, ours):
        m[2].bias.requires_grad_(False)
    train(ref, torch.optim.AdamW(groups(ref), lr=0.01), 3)
    opt = trainops.optim.AdamW(groups(ours), lr=0.01)
    train(ours, opt, 3)
    assert_same_params(ours, ref, backend == "cpu", "groups")
    assert ours[2].bias not in opt.state


def test_tensor_learning_rate(backend, device):
    ref, ours = make_model("cpu"), make_model(device)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), 3)
    lr = torch.tensor(0.01, device=device)
    train(ours, trainops.optim.AdamW(ours.parameters(), lr=lr), 3)
    assert_same_params(ours, ref, backend == "cpu", "tensor lr")


def _lamb_reference(params, grads_per_step, lr, betas, eps, wd):
    """LAMB in float64, straight from the formula."""
    params = [p.double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(grads_per_step, start=1):
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            u = (m[i] / (1 - betas[0] ** step)) / ((v[i] / (1 - betas[1] ** step)).sqrt() + eps) + wd * p
            ratio = p.norm() / u.norm() if p.norm() > 0 and u.norm() > 0 else 1.0
            params[i] = p - lr * ratio * u
    return params


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_lamb_matches_float64_formula(wd, backend, device):
    gen = torch.Generator().manual_seed(3)
    shapes = [(37, 5), (300,), (1,), (4, 4, 3)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    start[2].zero_()  # ||p|| = 0: trust ratio 1
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    params = [p.clone().to(device).requires_grad_() for p in start]
    opt = trainops.optim.LAMB(params, lr=0.02, weight_decay=wd)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(device)
        opt.step()
    ref = _lamb_reference(start, grads, 0.02, (0.9, 0.999), 1e-6, wd)
    for p, r, s in zip(params, ref, start):
        assert relative_error(p.detach() - s.to(device), r - s.double()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opt_name", ["AdamW", "SGD", "LAMB"])
def test_half_params_with_master_weights(opt_name, dtype, backend, device):
    """The float32 master follows a float32 run fed the same (half) gradients; the parameter is its rounding."""
    gen = torch.Generator().manual_seed(4)
    shapes = [(64, 9), (130,)]
    start = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    kwargs = dict(lr=0.01, momentum=0.9) if opt_name == "SGD" else dict(lr=0.01)
    half = [p.clone().to(device).requires_grad_() for p in start]
    full = [p.float().clone().to(device).requires_grad_() for p in start]
    ours = getattr(trainops.optim, opt_name)(half, master_weights=True, **kwargs)
    ref = getattr(trainops.optim, opt_name)(full, **kwargs)
    for _ in range(4):
        for h, f in zip(half, full):
            g = torch.randn(h.shape, generator=gen).to(dtype).to(device)
            h.grad, f.grad = g, g.float()
        ours.step()
        ref.step()
    for h, f in zip(half, full):
        master = ours.state[h]["master_param"]
        assert master.dtype == torch.float32
        assert relative_error(master, f.detach()) < 2e-6
        assert torch.equal(h.detach(), interpreter_rounding(master, dtype) if backend == "triton" else master.to(dtype))


def test_bfloat16_state(backend, device):
    ref, ours = make_model("cpu"), make_model(device)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), 3)
    opt = trainops.optim.AdamW(ours.parameters(), lr=0.01, state_dtype=torch.bfloat16)
    train(ours, opt, 3)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert relative_error(a, b) < 1e-3


def round_trip_with_torch(case, torch_device, our_device, exact):
    """torch -> ours -> torch: both continue as an uninterrupted torch run (exactly when ``exact``).
    Returns our optimizer."""
    kwargs, _ = CASES[case]
    torch_cls, our_cls = classes(case)
    ref = make_model(torch_device)
    ref_opt = torch_cls(ref.parameters(), **kwargs)
    train(ref, ref_opt, 3, seed=5)

    ours = make_model(our_device)
    ours.load_state_dict(ref.state_dict())
    opt = our_cls(ours.parameters(), **kwargs)
    opt.load_state_dict(ref_opt.state_dict())
    train(ours, opt, 2, seed=6)

    back = make_model(torch_device)
    back.load_state_dict(ours.state_dict())
    back_opt = torch_cls(back.parameters(), **kwargs)
    back_opt.load_state_dict(opt.state_dict())
    train(back, back_opt, 2, seed=7)

    train(ref, ref_opt, 2, seed=6)
    assert_same_params(ours, ref, exact, f"{case} after loading torch's state")
    train(ref, ref_opt, 2, seed=7)
    assert_same_params(back, ref, exact, f"{case} after torch loaded ours")
    return opt


@pytest.mark.parametrize("case", ["sgd-momentum-wd", "adamw-amsgrad", "adam-l2-amsgrad"])
def test_state_dict_round_trips_with_torch(case, backend, device):
    """Exactly on the CPU path; our state stays float32."""
    opt = round_trip_with_torch(case, "cpu", device, exact=backend == "cpu")
    for s in opt.state.values():
        assert all(t.dtype == torch.float32 for t in s.values() if torch.is_tensor(t))


def test_load_state_dict_rejects_mismatched_shapes():
    model = make_model("cpu")
    opt = trainops.optim.AdamW(model.parameters())
    train(model, opt, 1)
    state = opt.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(InvalidProblemError, match="exp_avg"):
        trainops.optim.AdamW(make_model("cpu").parameters()).load_state_dict(state)


@pytest.mark.parametrize("opt_name", ["SGD", "AdamW", "LAMB"])
def test_nonfinite_gradient_skips_the_step(opt_name, backend, device):
    model = make_model(device)
    kwargs = dict(lr=0.1, momentum=0.9) if opt_name == "SGD" else dict(lr=0.1)
    opt = getattr(trainops.optim, opt_name)(model.parameters(), skip_nonfinite=True, **kwargs)
    train(model, opt, 2)
    params = [p.detach().clone() for p in model.parameters()]
    states = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    train(model, opt, 2, bad_steps=(0, 1))
    for p, before in zip(model.parameters(), params):
        assert torch.equal(p.detach(), before)
        for key, value in states[id(p)].items():
            assert torch.equal(opt.state[p][key], value), key
    train(model, opt, 1)
    assert not all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), params))


# ----------------------------------------------------------------------------------------------
# GradScaler
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scaler_cls, opt_cls", [
    (trainops.amp.GradScaler, torch.optim.AdamW), (trainops.amp.GradScaler, trainops.optim.AdamW),
    (torch.amp.GradScaler, trainops.optim.AdamW)], ids=["ours-torch-opt", "ours-ours", "torch-scaler-ours"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_grad_scaler_matches_torch(scaler_cls, opt_cls, clip, backend, device):
    """Growth, back-off on injected infs, skipped steps and parameters as torch's GradScaler."""
    kwargs = dict(lr=0.01, weight_decay=0.1)
    ref = make_model("cpu")
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    ref_scales = train(ref, torch.optim.AdamW(ref.parameters(), **kwargs), 7, clip=clip, scaler=ref_scaler,
                       bad_steps=(1, 4))
    ours = make_model(device)
    scaler = scaler_cls(device, init_scale=2.0 ** 10, growth_interval=2)
    scales = train(ours, opt_cls(ours.parameters(), **kwargs), 7, clip=clip, scaler=scaler, bad_steps=(1, 4))
    assert scales == ref_scales
    assert scaler.state_dict() == ref_scaler.state_dict()
    assert_same_params(ours, ref, backend == "cpu", "scaler")


def test_grad_scaler_fused_path_clips_inside_the_step(backend, device):
    """A trainops optimizer with max_grad_norm under the scaler: one check+norm pass, no unscale_ call."""
    ref = make_model("cpu")
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
    ref_scales = train(ref, torch.optim.Adam(ref.parameters(), lr=0.01), 6, clip=0.1, scaler=ref_scaler,
                       bad_steps=(2,))
    ours = make_model(device)
    scaler = trainops.amp.GradScaler(device, init_scale=2.0 ** 8, growth_interval=3)
    opt = trainops.optim.Adam(ours.parameters(), lr=0.01, max_grad_norm=0.1)
    assert train(ours, opt, 6, scaler=scaler, bad_steps=(2,)) == ref_scales
    assert_same_params(ours, ref, backend == "cpu", "fused scaler + clip")


@pytest.mark.parametrize("found, tracker, interval, scale", [
    (0.0, 0, 3, 4.0), (0.0, 2, 3, 4.0), (1.0, 2, 3, 4.0), (0.0, 0, 1, 3e38), (3.0, 0, 1, 8.0)])
def test_update_scale_matches_torch(found, tracker, interval, scale, backend, device):
    args = [torch.tensor(scale), torch.tensor(tracker, dtype=torch.int32), torch.tensor(found)]
    ref = [a.clone() for a in args]
    torch._amp_update_scale_(ref[0], ref[1], ref[2], 2.0, 0.5, interval)
    ours = [a.to(device) for a in args]
    trainops.ops.amp.update_scale_(ours[0], ours[1], ours[2], 2.0, 0.5, interval)
    assert torch.equal(ours[0].cpu(), ref[0]) and torch.equal(ours[1].cpu(), ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_and_unscale(dtype, backend, device):
    gen = torch.Generator().manual_seed(8)
    tensors = [torch.randn(s, generator=gen).to(dtype).to(device) for s in [(5000,), (3, 7), (0,), (1,)]]
    found = torch.zeros((), device=device)
    trainops.ops.amp.all_finite(tensors, found)
    assert found.item() == 0
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = [x.clone() for x in tensors]
        t[0][4321] = bad
        found = torch.zeros((), device=device)
        trainops.ops.amp.all_finite(t, found)
        assert found.item() == 1
    inv = torch.tensor(0.25, device=device)
    expected = [x.float() * 0.25 for x in tensors]
    found = torch.zeros((), device=device)
    trainops.ops.amp.unscale_(tensors, inv, found)
    assert found.item() == 0
    for x, e in zip(tensors, expected):
        assert torch.equal(x, e.to(dtype))


def test_grad_stats_norm(backend, device):
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(s, generator=gen).to(device) for s in [(9000,), (33, 7), (2,)]]
    stats = trainops.ops.amp.grad_stats(grads, grad_scale=torch.tensor(4.0, device=device), max_norm=1.0)
    ref = torch.cat([g.double().flatten() / 4 for g in grads]).norm()
    assert abs(stats.norm.item() - ref.item()) / ref.item() < 1e-6
    assert abs(stats.clip.item() - 1.0 / (ref.item() + 1e-6)) < 1e-6
    assert stats.found_inf.item() == 0


# ----------------------------------------------------------------------------------------------
# Gradient accumulation and zeroing
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dst_dtype, src_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_accumulate(dst_dtype, src_dtype, backend, device):
    gen = torch.Generator().manual_seed(10)
    shapes = [(4100,), (3, 5), (0,), (1,)]
    dst = [torch.randn(s, generator=gen).to(dst_dtype).to(device) for s in shapes]
    src = [torch.randn(s, generator=gen).to(src_dtype).to(device) for s in shapes]
    expected = [d.double() + 0.5 * s.double() for d, s in zip(dst, src)]
    trainops.grad.accumulate_(dst, src, scale=0.5)
    tol = {torch.float32: 1e-7, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dst_dtype]
    for d, e in zip(dst, expected):
        assert relative_error(d, e) < tol


def test_optimizer_zero_grad_keeps_zeroed_tensors(backend, device):
    model = make_model(device)
    opt = trainops.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, 1)
    grads = [p.grad for p in model.parameters()]
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is g and bool((g == 0).all()) for p, g in zip(model.parameters(), grads))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_zero(backend, device):
    tensors = [torch.full(s, float("nan"), device=device, dtype=dt)
               for s, dt in [((4097,), torch.float32), ((3, 3), torch.bfloat16), ((5,), torch.float32)]]
    trainops.grad.zero_(tensors)
    assert all(bool((t == 0).all()) for t in tensors)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

def test_mixed_devices_in_a_group_raise():
    a = torch.zeros(3, requires_grad=True)
    b = torch.zeros(3, device="meta", requires_grad=True)
    a.grad, b.grad = torch.ones(3), torch.ones(3, device="meta")
    with pytest.raises(InvalidProblemError, match="param group 0 holds parameters on cpu and meta"):
        trainops.optim.AdamW([a, b]).step()


def test_sparse_gradient_raises():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(UnsupportedError, match="sparse"):
        trainops.optim.SGD(emb.parameters(), lr=0.1).step()


def test_bad_arguments_raise():
    params = make_model("cpu").parameters()
    with pytest.raises(InvalidProblemError, match="max_grad_norm"):
        trainops.optim.AdamW(params, max_grad_norm=0.0)
    with pytest.raises(InvalidProblemError, match="betas"):
        trainops.optim.Adam(make_model("cpu").parameters(), betas=(0.9, 1.5))
    with pytest.raises(UnsupportedError, match="state_dtype"):
        trainops.optim.Adam(make_model("cpu").parameters(), state_dtype=torch.int8)
    with pytest.raises(InvalidProblemError, match="nesterov"):
        trainops.optim.SGD(make_model("cpu").parameters(), nesterov=True)


def test_mismatched_columns_raise():
    p, g = [torch.zeros(4)], [torch.zeros(5)]
    with pytest.raises(InvalidProblemError, match=r"grads\[0\]"):
        trainops.ops.optimizers.adam_step(p, g, [torch.zeros(4)], [torch.zeros(4)], None, [torch.zeros(())], lr=0.1,
                                          beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled=True,
                                          amsgrad=False, maximize=False)
    with pytest.raises(InvalidProblemError, match="src"):
        trainops.grad.accumulate_([torch.zeros(3)], [torch.zeros(3), torch.zeros(2)])


# ----------------------------------------------------------------------------------------------
# Hardening: nothing half-applied, re-assigned gradients re-checked, unusable hyper-parameters
# ----------------------------------------------------------------------------------------------

def _float32_and_float64_params(device):
    """Two params of one group: float32 (a bucket the Triton backend runs) and float64 (one it lacks)."""
    torch.manual_seed(3)
    p32 = torch.randn(5, 4, device=device, requires_grad=True)
    p64 = torch.randn(6, device=device, dtype=torch.float64, requires_grad=True)
    p32.grad, p64.grad = torch.randn_like(p32), torch.randn_like(p64)
    return p32, p64


@pytest.mark.parametrize("opt_name, kwargs", [("AdamW", dict(lr=0.1)), ("SGD", dict(lr=0.1, momentum=0.9)),
                                              ("LAMB", dict(lr=0.1))])
def test_unsupported_bucket_leaves_the_whole_step_unapplied(opt_name, kwargs, block_size):
    """A group of float32 and float64 params under the Triton backend (no float64 multi-tensor
    kernels): the step raises before writing anything, the float32 bucket included."""
    with trainops.backend("triton"):
        p32, p64 = _float32_and_float64_params(BACKEND_DEVICES["triton"])
        before = [p32.detach().clone(), p64.detach().clone()]
        opt = getattr(trainops.optim, opt_name)([p32, p64], **kwargs)
        with pytest.raises(UnsupportedError, match="float64"):
            opt.step()
        assert torch.equal(p32, before[0]) and torch.equal(p64, before[1])
        for p in (p32, p64):
            state = opt.state[p]
            assert "momentum_buffer" not in state  # SGD's first-step buffers are kept only once a step writes
            if "step" in state:
                assert state["step"].item() == 0


def test_unsupported_bucket_leaves_accumulate_zero_and_unscale_unapplied(block_size):
    with trainops.backend("triton"):
        device = BACKEND_DEVICES["triton"]
        a, b = torch.randn(7, device=device), torch.randn(3, device=device, dtype=torch.float64)
        before = [a.clone(), b.clone()]
        found_inf = torch.zeros((), device=device)
        calls = {"accumulate_": lambda: trainops.grad.accumulate_([a, b], [torch.ones_like(a), torch.ones_like(b)]),
                 "zero_": lambda: trainops.grad.zero_([a, b]),
                 "unscale_": lambda: trainops.ops.amp.unscale_([a, b], torch.full((), 0.5, device=device), found_inf)}
        for name, call in calls.items():
            with pytest.raises(UnsupportedError, match="float64"):
                call()
            assert torch.equal(a, before[0]) and torch.equal(b, before[1]), name


def test_reassigned_gradient_view_is_checked_again(backend, device, block_size):
    """The same memory as gradient twice, first laid out like the parameter, then transposed: the
    cached tensor table must notice the new strides (the address alone is the same)."""
    p = torch.randn(64, 32, device=device, requires_grad=True)
    opt = trainops.optim.AdamW([p], lr=0.01)
    buf = torch.randn(2048, device=device)
    p.grad = buf.view(64, 32)
    opt.step()
    after_first = p.detach().clone()
    p.grad = buf.view(32, 64).t()
    with pytest.raises(InvalidProblemError, match=r"grads\[0\]"):
        opt.step()
    assert torch.equal(p, after_first)
    p.grad = buf.view(64, 32).clone()  # laid out like the parameter again: steps as before
    opt.step()
    assert not torch.equal(p, after_first)


def test_new_gradients_skip_validation_only_when_nothing_else_changed(block_size):
    """zero_grad(set_to_none=True) makes new gradients at every step: when only the gradient column's
    addresses changed, the table is rebuilt (the new addresses) without validating again; any
    other change (a parameter's address, a gradient's strides or dtype, the sizes) validates."""
    from trainops.ops.multi_tensor import TensorTable

    block = 64 if block_size == "block-64" else MultiTensorHeuristics().block
    shapes = [(64, 32), (7,), (3, 5)]
    params = [torch.randn(s) for s in shapes]
    states = [torch.zeros(s) for s in shapes]
    calls = []

    def tables(grads, params=params):
        return table.tables(
            [params, grads, states], validate=lambda: calls.append(1), user_columns=2, gradient_column=1)

    def grad_addresses(t):
        return t.addresses[1].tolist()

    table = TensorTable(block)
    grads = [torch.randn(s) for s in shapes]
    tables(grads)
    assert len(calls) == 1
    tables(grads)
    assert len(calls) == 1
    fresh = [torch.randn(s) for s in shapes]
    t = tables(fresh)
    assert len(calls) == 1 and grad_addresses(t) == [g.data_ptr() for g in fresh]
    assert t.addresses[0].tolist() == [p.data_ptr() for p in params]
    changed = {
        "strides": [torch.randn(32, 64).t(), *[torch.randn(s) for s in shapes[1:]]],
        "dtype": [torch.randn(s, dtype=torch.float64) for s in shapes],
        "expanded": [torch.randn(1, 32).expand(64, 32), *[torch.randn(s) for s in shapes[1:]]],
    }
    for name, other in changed.items():
        before = len(calls)
        tables(other)
        assert len(calls) == before + 1, name
        tables([torch.randn(s) for s in shapes])   # back to the validated layout: validated again
        assert len(calls) == before + 2, name
    before = len(calls)
    tables([torch.randn(s) for s in shapes], params=[torch.randn(s) for s in shapes])   # new parameters
    assert len(calls) == before + 1


def test_optimizer_refuses_a_bad_gradient_after_fresh_ones(backend, device, block_size):
    """Steps over gradients made anew each time (validation skipped), then a gradient that is
    not dense: refused by name, nothing written; then fresh dense gradients step again."""
    p = torch.randn(64, 32, device=device, requires_grad=True)
    opt = trainops.optim.AdamW([p], lr=0.01)
    for _ in range(3):
        p.grad = torch.randn(64, 32, device=device)
        opt.step()
    after = p.detach().clone()
    for _ in range(2):   # refused again when the same bad layout comes back in a fresh tensor
        p.grad = torch.randn(1, 32, device=device).expand(64, 32)
        with pytest.raises(InvalidProblemError, match=r"grads\[0\]"):
            opt.step()
        assert torch.equal(p, after)
    p.grad = torch.randn(64, 32, device=device)
    opt.step()
    assert not torch.equal(p, after)


def test_functional_step_with_a_kept_table_checks_fresh_gradients(backend, device, block_size):
    """The functional launchers take any gradient list: with a kept table, a fresh gradient of
    another shape (same element count, or fewer elements) is refused by name, as without one."""
    from trainops.ops import optimizers as optimizer_ops
    from trainops.ops.multi_tensor import TensorTable

    block = 64 if block_size == "block-64" else MultiTensorHeuristics().block
    table = TensorTable(block)
    params = [torch.randn(6, 4, device=device)]
    states = [torch.zeros(6, 4, device=device), torch.zeros(6, 4, device=device)]
    steps = [torch.zeros((), device=device)]
    hyper = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, amsgrad=False,
                 maximize=False, table=table)

    def step(grad):
        optimizer_ops.adam_step(params, [grad], states[:1], states[1:], None, steps, **hyper)

    step(torch.randn(6, 4, device=device))
    before = params[0].clone()
    big = torch.randn(48, device=device)
    for bad in (big[:24].view(4, 6), big[:12].view(3, 4)):
        with pytest.raises(InvalidProblemError, match=r"grads\[0\]"):
            step(bad)
        assert torch.equal(params[0], before)


def test_grad_stats_checks_a_reshaped_view_at_a_kept_table():
    """The Triton grad_stats keeps its tables between calls: a later tensor with the same element
    count and strides but another shape that is not dense (an overlapping unfold) is refused, not
    read (the CPU path computes on any layout)."""
    from trainops.ops import amp as amp_ops

    device = BACKEND_DEVICES["triton"]
    with trainops.backend("triton"):
        amp_ops.grad_stats([torch.randn(8, 1, device=device)])
        overlapping = torch.arange(1.0, 6.0, device=device).unfold(0, 2, 1)   # [4, 2], strides (1, 1)
        with pytest.raises(InvalidProblemError, match="dense"):
            amp_ops.grad_stats([overlapping])


BAD_VALUES = [float("nan"), float("inf"), -1.0]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=str)
@pytest.mark.parametrize("opt_name, key", [("SGD", "lr"), ("SGD", "momentum"), ("SGD", "weight_decay"),
                                           ("SGD", "dampening"), ("Adam", "lr"), ("Adam", "eps"),
                                           ("AdamW", "weight_decay"), ("AdamW", "betas"), ("LAMB", "eps"),
                                           ("LAMB", "betas")])
def test_unusable_hyper_parameters_raise(opt_name, key, bad):
    """torch raises ValueError for NaN (and negative) hyper-parameters; so do we (InvalidProblemError
    is a ValueError), naming the key, at construction, in add_param_group and at the step."""
    if key == "dampening" and bad == -1.0:
        return  # torch allows any finite dampening
    value = (0.9, bad) if key == "betas" else bad
    cls = getattr(trainops.optim, opt_name)
    with pytest.raises(ValueError, match=f"'{key}'"):
        cls(make_model("cpu").parameters(), **{key: value})
    model = make_model("cpu")
    opt = cls(list(model.parameters())[:2])
    with pytest.raises(InvalidProblemError, match=rf"param_groups\[1\]\['{key}'\]"):
        opt.add_param_group({"params": list(model.parameters())[2:], key: value})
    assert len(opt.param_groups) == 1
    model(torch.randn(4, 7)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0][key] = value  # e.g. a scheduler gone wrong
    with pytest.raises(InvalidProblemError, match=rf"param_groups\[0\]\['{key}'\]"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ----------------------------------------------------------------------------------------------
# GPU: real sizes and CUDA graphs
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("case", ["adamw-amsgrad", "sgd-nesterov-maximize", "adam-l2-amsgrad"])
def test_gpu_large_matches_torch(case):
    kwargs, _ = CASES[case]
    torch_cls, our_cls = classes(case)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 4097), (1 << 20,), (3,), (129, 257)]
    ref = [torch.randn(s, device="cuda", generator=gen).requires_grad_() for s in shapes]
    ours = [p.detach().clone().requires_grad_() for p in ref]
    ref_opt, opt = torch_cls(ref, **kwargs), our_cls(ours, **kwargs)
    for _ in range(3):
        for a, b in zip(ref, ours):
            a.grad = torch.randn(a.shape, device="cuda", generator=gen)
            b.grad = a.grad.clone()
        ref_opt.step()
        opt.step()
    for a, b in zip(ours, ref):
        assert relative_error(a, b) < 1e-6


@pytest.mark.gpu
def test_gpu_step_captures_in_a_cuda_graph():
    params = [torch.randn(1000, device="cuda", requires_grad=True) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    lr = torch.tensor(0.01, device="cuda")
    opt = trainops.optim.AdamW(params, lr=lr, max_grad_norm=1.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        opt.step()  # warm-up: state, tables and kernels built outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    ref = [p.detach().clone() for p in params]
    ref_opt = trainops.optim.AdamW(ref, lr=0.01, max_grad_norm=1.0)
    ref_opt.load_state_dict(opt.state_dict())
    for r, p in zip(ref, params):
        r.grad = p.grad.clone()
    graph.replay()
    lr.fill_(0.005)
    graph.replay()
    ref_opt.step()
    ref_opt.param_groups[0]["lr"] = 0.005
    ref_opt.step()
    torch.cuda.synchronize()
    for a, b in zip(params, ref):
        assert relative_error(a, b) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["sgd-momentum-wd", "adamw-amsgrad", "adam-l2-amsgrad"])
def test_gpu_state_dict_round_trips_with_torch(case):
    """torch (CUDA) -> ours -> torch, within float rounding."""
    round_trip_with_torch(case, "cuda", "cuda", exact=False)


def test_is_dense_follows_the_strides_not_the_sizes():
    from trainops.ops.multi_tensor import is_dense

    t = torch.empty(5, 7, 300)
    assert is_dense(t.permute(2, 0, 1)) and is_dense(t.transpose(0, 1)) and is_dense(t[:1])
    assert not is_dense(t[:, :, ::2]) and not is_dense(t[:, 1:]) and not is_dense(t[:, :1]) and not is_dense(t.expand(2, 5, 7, 300))


def test_runs_of_small_and_empty_tensors_among_large_ones(block_size):
    """One program a block over a bucket that mixes runs of one-block and empty tensors (longer than
    64 blocks) with tensors of many blocks: every element of every tensor is accumulated once."""
    from trainops.ops.multi_tensor import TensorTable

    block = 64 if block_size == "block-64" else MultiTensorHeuristics().block
    gen = torch.Generator().manual_seed(41)
    sizes = ([block // 2, 0, block] * 64 + [block * 131 + 5] + [1, 0, 0, block + 1] * 32 + [block * 64 - 1, 3])
    device = BACKEND_DEVICES["triton"]
    dst = [torch.randn(n, generator=gen).to(device) for n in sizes]
    src = [torch.randn(n, generator=gen).to(device) for n in sizes]
    want = [d + 0.5 * s for d, s in zip(dst, src)]
    assert TensorTable(block).tables([dst]).n_blocks == sum(-(-n // block) for n in sizes)
    with trainops.backend("triton"):
        trainops.grad.accumulate_(dst, src, scale=0.5)
    for i, (got, expected) in enumerate(zip(dst, want)):
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6), (i, sizes[i])
