"""Tensors on one GPU while another is current (2 GPUs or more): a model spread over several GPUs
(Hugging Face's ``device_map="auto"``, pipeline stages in one process) calls each layer's ops on
that layer's device without making it current. Triton launches on the current device, so every
trainops launch must make the tensors' device current for itself (launch.py, multi_tensor.py).

Each case runs forward + backward (or an optimizer / scaler step) on cuda:1, first with cuda:0
current on cold plan caches (the first-call paths: compiles, warm-ups, occupancy queries), then
with cuda:1 current: the results must be the same bits, every kernel of the first run must have
run on device 1 (the profiler's record, which does not rely on Triton refusing a pointer of
another device: with peer access on it would not), and the current device must be left as it
was. The Triton backend is pinned, so that no case passes on a torch fallback. The cases include
the exchange kernels of long rows (a 32000-class loss, a 40000-wide softmax), which launch outside
the launcher, and a loop alternating two devices whose deferred index and target checks share the
flag pool.
"""

import pytest
import torch

import trainops
from trainops.plan import clear_plan_cache

from conftest import HAS_CUDA
from test_cuda_graphs import CASES as GRAPH_CASES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

B, T, H, D, C, V = 2, 64, 4, 32, 256, 1000
DIFFERENTIABLE = ("x", "r", "w", "b", "gate_up", "q", "k", "scores", "logits", "hidden", "head", "table", "image",
                  "depthwise", "grad", "vocab_logits", "wide")


def _values(device) -> dict:
    """Float32 inputs of every case, made on the CPU from one seed, then moved to ``device``."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)
    values = dict(x=randn(B * T, C), r=randn(B * T, C), w=randn(C), b=randn(C), gate_up=randn(B * T, 2 * C),
                  q=randn(B, H, T, D), k=randn(B, H // 2, T, D), cos=randn(T, D), sin=randn(T, D),
                  scores=randn(B, H, T, T) * 3, logits=randn(B * T, V) * 2, hidden=randn(B * T, C),
                  head=randn(V, C) * 0.05, table=randn(V, C), image=randn(4, 16, 12, 12),
                  depthwise=randn(16, 1, 3, 3), grad=randn(4, T, C),
                  targets=torch.randint(0, V, (B * T,), generator=g), ids=torch.randint(0, V, (B * T,), generator=g),
                  vocab_logits=randn(16, 32000), vocab_targets=torch.randint(0, 32000, (16,), generator=g),
                  wide=randn(4, 40000))
    return {k: v.to(device) for k, v in values.items()}


def _sq(*ts):
    return sum(t.float().square().sum() for t in ts)


def _batch_norm(t):
    running_mean, running_var = torch.zeros(16, device=t["image"].device), torch.ones(16, device=t["image"].device)
    y = trainops.batch_norm(t["image"], running_mean, running_var, t["w"][:16], t["b"][:16], training=True)
    return _sq(y) + running_mean.sum() + running_var.sum()


SHARED = ("rms_norm", "layer_norm", "swiglu", "gelu", "rotary_embedding", "attention_softmax", "softmax",
          "cross_entropy", "linear_cross_entropy", "embedding")
CASES = {
    **{name: GRAPH_CASES[name] for name in SHARED},   # the CUDA-graph tests' cases, the same inputs by name
    "log_softmax_bf16": lambda t: (trainops.log_softmax(t["x"].bfloat16(), 0).float() * t["r"]).sum(),
    "dropout": lambda t: _sq(trainops.dropout(t["x"], 0.25, generator=torch.Generator().manual_seed(3))),
    "sum_to_shape": lambda t: _sq(trainops.sum_to_shape(t["grad"], (C,))),
    "batch_norm": _batch_norm,
    "conv2d_depthwise": lambda t: _sq(trainops.conv2d(t["image"], t["depthwise"], padding=1, groups=16)),
    "gist_relu": lambda t: _sq(trainops.gist.relu(t["image"] * 1.0)),
    "cross_entropy_32000_classes": lambda t: trainops.cross_entropy(t["vocab_logits"], t["vocab_targets"]),
    "softmax_40000_wide": lambda t: (trainops.softmax(t["wide"], -1) * t["wide"]).sum(),
    "qk_norm_rotary": lambda t: _sq(*trainops.qk_norm_rotary(t["q"].transpose(1, 2), t["k"].transpose(1, 2),
                                                             t["w"][:D], t["w"][D:2 * D], t["cos"], t["sin"])),
}


def _run(fn, device) -> tuple:
    t = {k: v.clone().requires_grad_(k in DIFFERENTIABLE and v.is_floating_point())
         for k, v in _values(device).items()}
    loss = fn(t)
    loss.backward()
    torch.cuda.synchronize(device)
    return loss.detach(), {k: v.grad for k, v in t.items() if v.grad is not None}


def _kernel_devices(fn) -> set:
    """The devices of the CUDA kernels ``fn()`` ran (torch.profiler's record)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
    devices = {e.device_index for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return result, devices


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_runs_on_its_tensors_device_whatever_device_is_current(name):
    fn = CASES[name]
    with trainops.backend("triton"):
        clear_plan_cache()
        with torch.cuda.device(0):
            (got_loss, got_grads), devices = _kernel_devices(lambda: _run(fn, "cuda:1"))
            assert torch.cuda.current_device() == 0
        with torch.cuda.device(1):
            want_loss, want_grads = _run(fn, "cuda:1")
    assert devices == {1}, devices
    assert torch.isfinite(want_loss) and want_grads
    assert got_loss.device == torch.device("cuda:1")
    assert torch.equal(got_loss, want_loss), (got_loss.item(), want_loss.item())
    assert got_grads.keys() == want_grads.keys()
    for k in want_grads:
        assert got_grads[k].device == torch.device("cuda:1")
        assert torch.equal(got_grads[k], want_grads[k]), k


def test_checks_deferred_on_two_devices_in_turn():
    """An embedding (index check) on cuda:0 and a cross-entropy (target check) on cuda:1, in turn:
    each device's check kernels store into the one error word of pinned host memory, check_pending
    waits for both devices, and a bad target on cuda:1 is still reported."""
    table0 = torch.randn(100, 8, device="cuda:0", requires_grad=True)
    ids0 = torch.randint(0, 100, (32,), device="cuda:0")
    logits1 = torch.randn(32, 50, device="cuda:1", requires_grad=True)
    targets1 = torch.randint(0, 50, (32,), device="cuda:1")
    with torch.cuda.device(0):
        for _ in range(4):
            trainops.embedding(ids0, table0).sum().backward()
            trainops.cross_entropy(logits1, targets1).backward()
            torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        trainops.check_pending()
        bad = targets1.clone()
        bad[3] = 50
        trainops.cross_entropy(logits1.detach(), bad)
        with pytest.raises(trainops.IndexOutOfRangeError):
            trainops.check_pending()


OPTIMIZERS = {
    "SGD": lambda ps: trainops.optim.SGD(ps, lr=0.1, momentum=0.9),
    "AdamW": lambda ps: trainops.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "LAMB": lambda ps: trainops.optim.LAMB(ps, lr=1e-2),
}


def _steps(make, device) -> list:
    """Three GradScaler-driven steps of an optimizer over three parameters on ``device``."""
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g).to(device)) for s in [(64, 33), (7,), (1000,)]]
    targets = [[torch.randn(p.shape, generator=g).to(device) for p in params] for _ in range(3)]
    optimizer = make(params)
    scaler = trainops.amp.GradScaler("cuda", init_scale=1024.0)
    for step_targets in targets:
        loss = sum((p * target).square().sum() for p, target in zip(params, step_targets))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    torch.cuda.synchronize(device)
    return [p.detach().clone() for p in params] + [torch.tensor(scaler.get_scale())]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_and_scaler_step_on_their_tensors_device(name):
    with trainops.backend("triton"):
        clear_plan_cache()
        with torch.cuda.device(0):
            got, devices = _kernel_devices(lambda: _steps(OPTIMIZERS[name], "cuda:1"))
            assert torch.cuda.current_device() == 0
        with torch.cuda.device(1):
            want = _steps(OPTIMIZERS[name], "cuda:1")
    assert devices == {1}, devices
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.cpu(), b.cpu()), (name, k)
    assert not torch.equal(want[0].cpu(), _initial_param()), "the steps changed nothing"


def _initial_param():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 33, generator=g)
