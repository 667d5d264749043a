"""CUDA graphs around trainops ops (GPU only): ``torch.cuda.graph`` capture of an eager forward +
backward, and torch.compile's ``mode="reduce-overhead"`` (CUDA graph trees), for every op family.

What a capture needs from an op: no host synchronisation, no event query and no copy from pageable
memory while capturing; no tensor kept past the call (a plan-held tensor made during a capture or
a graph-tree warm-up would sit in the graph's memory pool); and random numbers drawn on the device,
so that every replay draws anew. Replays are compared with eager calls on the same values: exactly
for ``torch.cuda.graph`` (the same kernels run), within float32 rounding under torch.compile
(Inductor sums around our kernels in its own order). Also here: the index and target checks of a
compiled graph, which run on the device as in eager mode (no host synchronisation).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import trainops

B, T, H, D, C, V = 2, 64, 4, 32, 256, 1000


def _values(seed: int) -> dict:
    """Float32 inputs of every case on the GPU (leaves made by the caller), targets and indices."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cuda = dict(device="cuda")

    def randn(*shape):
        return torch.randn(*shape, generator=g, **cuda)
    return dict(x=randn(B * T, C), r=randn(B * T, C), w=randn(C), b=randn(C), gate_up=randn(B * T, 2 * C),
                q=randn(B, H, T, D), k=randn(B, H // 2, T, D), cos=randn(T, D), sin=randn(T, D),
                scores=randn(B, H, T, T) * 3, logits=randn(B * T, V) * 2, hidden=randn(B * T, C),
                head=randn(V, C) * 0.05, table=randn(V, C),
                targets=torch.randint(0, V, (B * T,), generator=g, **cuda),
                ids=torch.randint(0, V, (B * T,), generator=g, **cuda))


DIFFERENTIABLE = ("x", "r", "w", "b", "gate_up", "q", "k", "scores", "logits", "hidden", "head", "table")


def _leaves(values: dict) -> dict:
    return {k: v.clone().requires_grad_(k in DIFFERENTIABLE) for k, v in values.items()}


def _sq(*ts):
    return sum(t.square().sum() for t in ts)


CASES = {
    "rms_norm": lambda t: _sq(*trainops.rms_norm(t["x"], t["w"], 1e-5, residual=t["r"])),
    "layer_norm": lambda t: _sq(trainops.layer_norm(t["x"], (C,), t["w"], t["b"])),
    "swiglu": lambda t: _sq(trainops.swiglu(t["gate_up"])),
    "gelu": lambda t: _sq(trainops.gelu(t["x"], approximate="tanh")),
    "rotary_embedding": lambda t: _sq(*trainops.rotary_embedding(t["q"], t["k"], t["cos"], t["sin"])),
    "attention_softmax": lambda t: (trainops.attention_softmax(t["scores"], scale=0.125, causal=True)
                                    * t["scores"]).sum(),
    "softmax": lambda t: (trainops.softmax(t["x"], -1) * t["r"]).sum(),
    "log_softmax": lambda t: (trainops.log_softmax(t["x"], -1) * t["r"]).sum(),
    "cross_entropy": lambda t: trainops.cross_entropy(t["logits"], t["targets"]),
    "cross_entropy_inplace": lambda t: trainops.cross_entropy(t["logits"] * 1.0, t["targets"], inplace_backward=True),
    "linear_cross_entropy": lambda t: trainops.linear_cross_entropy(t["hidden"], t["head"], t["targets"]),
    "embedding": lambda t: _sq(trainops.embedding(t["ids"], t["table"])),
    "gather": lambda t: _sq(trainops.gather(t["table"], t["ids"], 0)),
    "gather_backward": lambda t: _sq(trainops.gather_backward(t["x"], t["ids"], 0, (V, C))),
    # issue 22's families, x seen as an (8, 16, 16, 16) batch of images
    "batch_norm": lambda t: _sq(trainops.batch_norm(_images(t["x"]), None, None, t["w"][:16], t["b"][:16], True)),
    "batch_norm_relu": lambda t: _sq(trainops.batch_norm_relu(_images(t["x"]), None, None, t["w"][:16], t["b"][:16],
                                                              True)),
    "conv2d": lambda t: _sq(trainops.conv2d(_images(t["x"]), t["w"].view(16, 16, 1, 1), t["b"][:16])),
    "gist_relu": lambda t: (trainops.gist.relu(t["x"]) * t["r"]).sum(),
    "sum_to_shape": lambda t: _sq(trainops.sum_to_shape(_images(t["x"]), (16, 1, 1))),
}
RANDOM_CASES = {
    "dropout": lambda t: trainops.dropout(t["x"], 0.25),
    "attention_softmax_dropout": lambda t: trainops.attention_softmax(t["scores"], scale=0.125, causal=True,
                                                                      dropout_p=0.25),
}


def _images(x):
    return x.view(8, 16, 16, 16)


def _grads(t: dict) -> dict:
    return {k: v.grad.clone() for k, v in t.items() if v.grad is not None}


def _eager(fn, values: dict):
    t = _leaves(values)
    loss = fn(t)
    loss.backward()
    return loss.detach(), _grads(t)


def _capture(fn, static: dict):
    """Warm up on a side stream (plans made, kernels compiled), then capture forward + backward."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for v in static.values():
                v.grad = None
            fn(static).backward()
    torch.cuda.current_stream().wait_stream(side)
    for v in static.values():
        v.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = fn(static)
        loss.backward()
    return graph, loss


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_captured_forward_backward_replays_the_eager_results(name):
    fn = CASES[name]
    static = _leaves(_values(0))
    graph, loss = _capture(fn, static)
    for seed in (1, 2):
        values = _values(seed)
        with torch.no_grad():
            for k, v in values.items():
                static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want_loss, want_grads = _eager(fn, values)
        assert torch.isfinite(loss).all()
        assert torch.equal(loss, want_loss), (name, seed, loss.item(), want_loss.item())
        got = _grads(static)
        assert got.keys() == want_grads.keys()
        for k in got:
            assert torch.equal(got[k], want_grads[k]), (name, seed, k)


def _reduce_overhead(fn):
    """``fn`` compiled with mode="reduce-overhead", Dynamo reset and its counters cleared (see
    ``_assert_graphs_recorded``)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, mode="reduce-overhead")


def _assert_graphs_recorded():
    """Inductor recorded CUDA graphs: none skipped (a silent fallback to plain launches would pass the rest)."""
    from torch._dynamo.utils import counters

    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    torch._dynamo.reset()


def _relative(a, b) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_reduce_overhead_compile_gives_the_eager_results(name):
    fn = CASES[name]
    compiled = _reduce_overhead(fn)
    for seed in range(4):   # warm-up, recording, then replays of the recorded graph
        values = _values(seed)
        t = _leaves(values)
        loss = compiled(t)
        loss.backward()
        torch.cuda.synchronize()
        want_loss, want_grads = _eager(fn, values)
        assert _relative(loss.detach(), want_loss) < 1e-5, (name, seed)
        got = _grads(t)
        assert got.keys() == want_grads.keys()
        for k in got:
            assert _relative(got[k], want_grads[k]) < 1e-5, (name, seed, k)
    _assert_graphs_recorded()


def _dropout_mask(name: str, t: dict, y: torch.Tensor, p: float) -> torch.Tensor:
    """The elements kept by a call (loss y.sum()). dropout: y = x * keep / (1 - p) and dx = keep /
    (1 - p) with the same mask, about 1 - p of them kept; attention: y's nonzeros."""
    if name != "dropout":
        return y != 0
    x, dx = t["x"], t["x"].grad
    keep = dx != 0
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02
    scale = float(torch.tensor(1 / (1 - p), dtype=torch.float32))
    assert torch.equal(dx, torch.where(keep, scale, 0.0))
    assert torch.equal(y, torch.where(keep, x * scale, 0.0))
    return keep


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(RANDOM_CASES))
def test_captured_dropout_draws_a_new_mask_at_every_replay(name):
    fn = RANDOM_CASES[name]
    p = 0.25
    static = _leaves(_values(0))
    out = {}

    def loss_of(t):
        out["y"] = fn(t)
        return out["y"].sum()
    graph, _ = _capture(loss_of, static)
    y = out["y"]   # the captured call's output, rewritten by every replay
    masks = []
    for _ in range(3):   # the same inputs: only a new seed changes the mask
        graph.replay()
        torch.cuda.synchronize()
        masks.append(_dropout_mask(name, static, y, p))
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(RANDOM_CASES))
def test_reduce_overhead_dropout_draws_a_new_mask_every_call(name):
    fn = RANDOM_CASES[name]
    compiled = _reduce_overhead(fn)
    masks = []
    values = _values(0)
    for _ in range(4):   # the same inputs every call (warm-up, recording, replays): only the seed changes
        t = _leaves(values)
        y = compiled(t)
        y.sum().backward()
        torch.cuda.synchronize()
        masks.append(_dropout_mask(name, t, y, 0.25))
    assert all(not torch.equal(a, b) for a, b in zip(masks, masks[1:]))
    _assert_graphs_recorded()


CAPTURED_CHECKS = {   # a call whose index check runs inside the captured graph: deferred or immediate mode
    "embedding": "trainops.embedding(ids, table).sum()",
    "cross_entropy_immediate": "trainops.cross_entropy(table, ids, check_target='immediate')",
    "gather_immediate": "trainops.gather(table, ids, 0, check_index='immediate').sum()",
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CAPTURED_CHECKS))
def test_a_bad_index_in_a_replayed_graph_is_a_device_assert(name):
    """While capturing, index checks become device-side asserts (neither the deferred flag nor the
    immediate host check can run at a replay); a replay with an out-of-range index fails as torch's
    own index kernels do. In a subprocess: the assert ends the CUDA context."""
    call = CAPTURED_CHECKS[name]
    script = textwrap.dedent(f"""
        import torch, trainops
        table = torch.randn(16, 10, device="cuda", requires_grad=True)
        ids = torch.randint(0, 10, (16,), device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ({call}).backward()
        torch.cuda.current_stream().wait_stream(side)
        table.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ({call}).backward()
        graph.replay()
        torch.cuda.synchronize()
        print("good replay ok", flush=True)
        ids[3] = 16
        graph.replay()
        torch.cuda.synchronize()
        print("bad replay passed", flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "good replay ok" in run.stdout, run.stderr[-3000:]
    assert "bad replay passed" not in run.stdout
    assert run.returncode != 0 and "device-side assert" in run.stderr, run.stderr[-3000:]


class _Net(torch.nn.Module):
    """A pre-norm block between an embedding and a loss, every op but the matmuls trainops's."""

    def __init__(self):
        super().__init__()
        self.embed = trainops.nn.Embedding(V, C)
        self.norm = trainops.nn.RMSNorm(C)
        self.up = torch.nn.Linear(C, 2 * C)
        self.down = torch.nn.Linear(C, C)
        self.head = torch.nn.Linear(C, V, bias=False)

    def forward(self, ids, targets):
        h = self.embed(ids)
        h = h + self.down(trainops.dropout(trainops.swiglu(self.up(self.norm(h))), 0.0))
        return trainops.cross_entropy(self.head(h), targets)


def _twin_nets(batch_seed: int, steps: int, device: str = "cuda"):
    """Two identical _Nets (one to step eagerly, one to capture) and ``steps`` batches of (ids, targets)."""
    import copy

    torch.manual_seed(0)
    eager_net = _Net().to(device)
    g = torch.Generator(device=device).manual_seed(batch_seed)
    batches = [(torch.randint(0, V, (B * T,), generator=g, device=device),
                torch.randint(0, V, (B * T,), generator=g, device=device)) for _ in range(steps)]
    return eager_net, copy.deepcopy(eager_net), batches


@pytest.mark.gpu
def test_a_captured_training_step_replays_the_eager_steps():
    """Forward, backward and a trainops AdamW step (clipping by the global norm, a learning-rate
    schedule through a device tensor) captured in one graph: its replays give the eager steps'
    losses and parameters bit for bit. The optimizer's tensor tables made while capturing are
    copied from pinned memory the graph keeps."""
    eager_net, graph_net, batches = _twin_nets(1, 7)

    def step(net, opt, ids, targets):
        loss = net(ids, targets)
        loss.backward()
        opt.step()
        return loss

    schedule = [1e-3 * (1 - i / 10) for i in range(len(batches))]
    lr = torch.tensor(schedule[0], device="cuda")
    opt = trainops.optim.AdamW(eager_net.parameters(), lr=lr, max_grad_norm=1.0)
    eager_losses = []
    for i, (ids, targets) in enumerate(batches):
        lr.fill_(schedule[i])
        opt.zero_grad(set_to_none=True)
        eager_losses.append(step(eager_net, opt, ids, targets).detach().clone())

    lr = torch.tensor(schedule[0], device="cuda")
    opt = trainops.optim.AdamW(graph_net.parameters(), lr=lr, max_grad_norm=1.0)
    static_ids, static_targets = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i, (ids, targets) in enumerate(batches[:3]):   # warm-up: plans, kernels, optimizer state; real steps
            opt.zero_grad(set_to_none=True)
            lr.fill_(schedule[i])
            static_ids.copy_(ids)
            static_targets.copy_(targets)
            loss = step(graph_net, opt, static_ids, static_targets)
            assert torch.equal(loss, eager_losses[i]), i
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(graph_net, opt, static_ids, static_targets)
    for i, (ids, targets) in enumerate(batches[3:], start=3):
        lr.fill_(schedule[i])
        static_ids.copy_(ids)
        static_targets.copy_(targets)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_loss, eager_losses[i]), (i, static_loss.item(), eager_losses[i].item())
    for (name, p), q in zip(graph_net.named_parameters(), eager_net.parameters()):
        assert torch.equal(p, q), name


BAD_INPUT = {"cross_entropy": "targets", "cross_entropy_inplace": "targets", "linear_cross_entropy": "targets",
             "embedding": "ids", "gather": "ids", "gather_backward": "ids"}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_compiled_index_checks_never_wait_for_the_gpu_and_a_later_call_raises(name):
    """Inside a torch.compile graph (default mode) the target / index checks run on the device, as
    in eager mode: a steady call makes no host synchronisation (torch's sync debug mode would raise),
    and a bad index is raised by the next call once the GPU has flagged it."""
    fn = CASES[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn)
    for seed in range(2):   # compile, warm up
        compiled(_leaves(_values(seed))).backward()
    torch.cuda.synchronize()
    t = _leaves(_values(2))
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = compiled(t)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert _relative(loss.detach(), _eager(fn, _values(2))[0]) < 1e-5
    bad = _values(3)
    bad[BAD_INPUT[name]][5] = V   # one past the last class / row
    compiled(_leaves(bad))
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match="out of range"):
        compiled(_leaves(_values(4)))
    trainops.check_pending()   # nothing left pending
    torch._dynamo.reset()


@pytest.mark.gpu
def test_a_capture_never_hands_its_unreplayed_tables_to_the_next():
    """The optimizer tables a capture makes are filled at its replays only: a second capture (here
    after the first graph was deleted unreplayed) builds its own, and its replays match eager steps."""
    eager_net, graph_net, batches = _twin_nets(2, 5)
    eager_opt = trainops.optim.AdamW(eager_net.parameters(), lr=1e-3)
    graph_opt = trainops.optim.AdamW(graph_net.parameters(), lr=1e-3)

    def step(net, opt, ids, targets):
        for p in net.parameters():
            if p.grad is not None:
                p.grad.zero_()
        net(ids, targets).backward()
        opt.step()

    for ids, targets in batches:
        step(eager_net, eager_opt, ids, targets)
    static_ids, static_targets = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for ids, targets in batches[:2]:
            static_ids.copy_(ids)
            static_targets.copy_(targets)
            step(graph_net, graph_opt, static_ids, static_targets)
    torch.cuda.current_stream().wait_stream(side)
    graph_opt.zero_grad(set_to_none=True)
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        step(graph_net, graph_opt, static_ids, static_targets)
    del first   # never replayed: its tables hold no addresses
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second):
        step(graph_net, graph_opt, static_ids, static_targets)
    for ids, targets in batches[2:]:
        static_ids.copy_(ids)
        static_targets.copy_(targets)
        second.replay()
    torch.cuda.synchronize()
    for (name, p), q in zip(graph_net.named_parameters(), eager_net.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["dropout", "attention_softmax"])
def test_a_seed_on_the_device_gives_the_host_seeds_mask(op):
    """The kernels read a device seed (SEED_ON_DEVICE) as they take a host one: same outputs and
    gradients, forward and backward (dropout with bias and residual and its bias gradient; attention
    softmax with a bias gradient)."""
    from trainops.ops import attention_softmax as attention_ops
    from trainops.ops import dropout as dropout_ops

    torch.manual_seed(0)
    seed = 1234567890123
    results = []
    for device_seed in (False, True):
        s = torch.tensor(seed, dtype=torch.int64, device="cuda" if device_seed else "cpu")
        x = torch.randn(64, 96, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1), requires_grad=True)
        b = torch.randn(96, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2), requires_grad=True)
        if op == "dropout":
            r = torch.randn(64, 96, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
            y, _ = dropout_ops.dropout_op(x, b, r, s, 0.3, 0, False)
        else:
            y, _ = attention_ops.attention_softmax_op(x.view(2, 2, 16, 96), None, b, 0.5, None, 0.3, s)
        (y * torch.arange(y.numel(), device="cuda").view(y.shape).sin()).sum().backward()
        results.append((y.detach(), x.grad, b.grad))
    for host, device in zip(*results):
        assert torch.equal(host, device)
    dropped = results[0][1] == 0 if op == "dropout" else results[0][0] == 0   # dx = 0 / out = 0 where dropped
    assert dropped.any()


def _capture_step_run(net, opt, scheduler, batches, warmup_steps):
    """Losses of ``batches`` through trainops.capture_step (scheduler stepped after each call)."""
    def step(ids, targets):
        loss = net(ids, targets)
        loss.backward()
        opt.step()
        return loss

    captured = trainops.capture_step(step, [opt], warmup_steps=warmup_steps)
    losses = []
    for ids, targets in batches:
        losses.append(captured(ids, targets))
        scheduler.step()
    assert captured.captured and captured.calls == len(batches)
    return losses


@pytest.mark.gpu
def test_capture_step_replays_the_eager_steps_with_a_schedule():
    """trainops.capture_step over a trainops AdamW whose learning rate is a CUDA tensor filled by
    torch's LambdaLR: the warm-up calls, the capturing call and every replay give the eager loop's
    losses and parameters bit for bit; returned losses are fresh tensors (not overwritten later)."""
    eager_net, graph_net, batches = _twin_nets(3, 8)
    factor = lambda i: 1 - i / 10   # noqa: E731

    def setup(net):
        opt = trainops.optim.AdamW(net.parameters(), lr=torch.tensor(1e-3, device="cuda"), max_grad_norm=1.0)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)

    opt, scheduler = setup(eager_net)
    eager_losses = []
    for ids, targets in batches:
        opt.zero_grad(set_to_none=True)
        loss = eager_net(ids, targets)
        loss.backward()
        opt.step()
        scheduler.step()
        eager_losses.append(loss.detach().clone())
    opt, scheduler = setup(graph_net)
    losses = _capture_step_run(graph_net, opt, scheduler, batches, warmup_steps=2)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(losses, eager_losses)):
        assert torch.equal(a, b), (i, a.item(), b.item())
    for (name, p), q in zip(graph_net.named_parameters(), eager_net.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.gpu
def test_capture_step_refuses_a_float_learning_rate_that_a_scheduler_changes():
    """A Python-float lr is baked into the graph: the first replay after a scheduler changed it
    raises (naming the parameter group and key) instead of training at the old rate."""
    _, net, batches = _twin_nets(4, 5)
    opt = trainops.optim.AdamW(net.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / 10)
    with pytest.raises(trainops.UnsupportedError, match=r"param_groups\[0\]\['lr'\] changed after the capture"):
        _capture_step_run(net, opt, scheduler, batches, warmup_steps=1)


@pytest.mark.gpu
def test_capture_step_of_a_patched_hugging_face_model():
    """A tiny patched Llama (transformers), bf16 autocast, fused linear cross-entropy, trainops
    AdamW: the captured step's losses equal the eager patched step's bit for bit."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    g = torch.Generator(device="cuda").manual_seed(5)
    batches = [torch.randint(0, 1000, (2, 64), generator=g, device="cuda") for _ in range(6)]
    results = []
    for capture in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).cuda().train()
        trainops.patch(model)
        opt = trainops.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))

        def step(ids):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        if capture:
            step = trainops.capture_step(step, [opt], warmup_steps=2)
        results.append([step(ids).detach() for ids in batches])
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), (i, a.item(), b.item())


@pytest.mark.gpu
def test_capture_step_refuses_another_shape_after_the_capture():
    """A graph replays one shape: a batch of another length (or another constant) is refused by
    name at the call, before any copy."""
    _, net, batches = _twin_nets(6, 3)
    opt = trainops.optim.AdamW(net.parameters(), lr=torch.tensor(1e-3, device="cuda"))

    def step(ids, targets, scale):
        loss = net(ids, targets) * scale
        loss.backward()
        opt.step()
        return loss

    captured = trainops.capture_step(step, opt, warmup_steps=1)
    for ids, targets in batches[:2]:
        captured(ids, targets, 1.0)
    ids, targets = batches[2]
    with pytest.raises(trainops.InvalidProblemError, match=r"argument 'args\[1\]' is a torch.int64 tensor of shape"):
        captured(ids, targets[:-1], 1.0)
    with pytest.raises(trainops.InvalidProblemError, match=r"argument 'args\[2\]' is 2.0"):
        captured(ids, targets, 2.0)
