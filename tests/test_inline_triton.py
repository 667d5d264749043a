"""Under torch.compile on CUDA, the ops declared with ``inline_triton`` (norms, activations, rotary
embedding, attention softmax without dropout) are traced into the graph: Inductor's generated code launches trainops's Triton kernels
itself, with no custom-op call at run time, and gives the eager results (within bf16 rounding:
Inductor sums the gradient contributions of a tensor used twice in another order). Calls that
read the host (checked position ids, a dropout seed) stay custom-op calls; so does every op off the GPU."""

import pytest
import torch

import trainops
from trainops.compiled import CompiledChoices

GRADS = ("x", "w", "gate", "up", "a", "q", "k", "scores", "bias")


def _block(x, w, gate, up, a, q, k, cos, sin, scores, bias, mask):
    y, s = trainops.rms_norm(x, w, 1e-5, residual=x * 0.5)
    z = trainops.layer_norm(x, (x.shape[-1],), w, None)
    m = trainops.swiglu(gate, up) + trainops.swiglu(torch.cat([gate, up], -1))   # separate and packed
    g = trainops.gelu(a, approximate="tanh")
    qo, ko = trainops.rotary_embedding(q, k, cos, sin)
    p = trainops.attention_softmax(scores, scale=0.125, causal=True)
    pb = trainops.attention_softmax(scores, scale=0.125, bias=bias, mask=mask)   # bias gradient summed over heads
    return (y.float().square().sum() + s.float().sum() + z.float().square().sum() + m.float().square().sum()
            + g.float().square().sum() + qo.float().square().sum() + ko.float().square().sum()
            + (p.float() * scores.float()).sum() + (pb.float() * scores.float()).square().sum())


def _inputs(device):
    torch.manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    t = dict(x=torch.randn(64, 256, **bf), w=torch.rand(256, device=device) + 0.5, gate=torch.randn(64, 512, **bf),
             up=torch.randn(64, 512, **bf), a=torch.randn(64, 512, **bf), q=torch.randn(2, 4, 32, 64, **bf),
             k=torch.randn(2, 2, 32, 64, **bf), cos=torch.randn(32, 64, device=device),
             sin=torch.randn(32, 64, device=device), scores=torch.randn(2, 4, 32, 48, **bf) * 4,
             bias=torch.randn(2, 1, 32, 48, **bf), mask=torch.rand(2, 1, 1, 48, device=device) > 0.2)
    for name in GRADS:
        t[name].requires_grad_(True)
    return t


def _close(a, b, tol=4e-3):
    """Relative-norm error within ``tol`` (a few bf16 roundings of the summed contributions), no NaN."""
    a, b = a.double(), b.double()
    return bool(torch.isfinite(a).all()) and (a - b).norm().item() <= tol * b.norm().item()


@pytest.mark.gpu
def test_compiled_graph_launches_the_trainops_kernels_with_eager_results():
    from torch._inductor.utils import run_and_get_code

    t = _inputs("cuda")
    eager = _block(**t)
    eager_grads = torch.autograd.grad(eager, [t[n] for n in GRADS])
    compiled = torch.compile(_block, fullgraph=True)

    def step():
        loss = compiled(**t)
        return loss, torch.autograd.grad(loss, [t[n] for n in GRADS])

    # our kernels everywhere (the shipped table hands these short bf16 rows to Inductor's fusion)
    with trainops.heuristics(CompiledChoices(table={})):
        (loss, grads), code = run_and_get_code(step)
    source = "\n".join(code)
    for kernel in ("_norm_fwd", "_norm_bwd", "_sum_columns", "_act_fwd", "_act_bwd", "_rotary_rows",
                   "_attention_softmax_fwd", "_attention_softmax_bwd"):
        assert kernel in source, f"{kernel} is not launched by the compiled code"
    assert "torch.ops.trainops" not in source, "a trainops custom op is still called at run time"
    assert _close(loss, eager), (loss, eager)
    for name, a, b in zip(GRADS, grads, eager_grads):
        assert _close(a, b), name


@pytest.mark.gpu
def test_calls_that_cannot_be_inlined_stay_custom_ops():
    """check_position_ids reads the ids on the host, and a dropout seed is a host value: those calls stay
    custom-op calls under compile, with the eager results, beside an inlined packed SwiGLU."""
    from torch._inductor.utils import run_and_get_code

    from trainops.ops.attention_softmax import attention_softmax_op

    t = _inputs("cuda")
    pos = torch.arange(32, device="cuda")
    packed = torch.cat([t["gate"].detach(), t["up"].detach()], -1).requires_grad_(True)
    # the op with its seed as an input: eager and compiled runs drop the same elements (under
    # Inductor, trainops.attention_softmax's seed draw comes from Inductor's random numbers)
    seed = torch.tensor(1234, dtype=torch.int64)

    def f(q, k, cos, sin, packed, scores, seed):
        qo, ko = trainops.rotary_embedding(q, k, cos, sin, position_ids=pos, check_position_ids=True)
        dropped, _ = attention_softmax_op(scores, None, None, 1.0, 0, 0.25, seed)
        return (qo.float().square().sum() + ko.float().sum() + trainops.swiglu(packed).float().square().sum()
                + (dropped.float() * scores.float()).sum())

    args = [t[n] for n in ("q", "k", "cos", "sin")] + [packed, t["scores"], seed]
    wrt = [args[0], args[1], packed, t["scores"]]
    eager = f(*args)
    eager_grads = torch.autograd.grad(eager, wrt)

    def step():
        loss = torch.compile(f, fullgraph=True)(*args)
        return loss, torch.autograd.grad(loss, wrt)

    (loss, grads), code = run_and_get_code(step)
    source = "\n".join(code)
    assert "torch.ops.trainops.rotary_embedding.default" in source
    assert "torch.ops.trainops.attention_softmax.default" in source
    assert "torch.ops.trainops.attention_softmax_backward.default" in source
    assert "torch.ops.trainops.swiglu" not in source and "_act_bwd_strided" in source
    assert _close(loss, eager)
    for a, b in zip(grads, eager_grads):
        assert _close(a, b)


@pytest.mark.gpu
def test_dynamic_shapes_keep_the_ops_whole():
    """Plans are made for concrete shapes: with symbolic sizes the ops stay custom-op calls (and
    work), instead of failing to trace."""
    from torch._inductor.utils import run_and_get_code

    t = _inputs("cuda")
    eager = _block(**t)
    # our ops everywhere (the shipped table hands these short bf16 rows to Inductor's fusion)
    with trainops.heuristics(CompiledChoices(table={})):
        compiled, code = run_and_get_code(torch.compile(_block, fullgraph=True, dynamic=True), **t)
    assert "torch.ops.trainops.rms_norm.default" in "\n".join(code)
    assert _close(compiled, eager)


def _recorded_graphs(fn, *args, **kwargs):
    """Run ``fn`` compiled through AOTAutograd (no Inductor); return the forward graphs' code."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return gm

    out = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=record))(*args, **kwargs)
    return out, "\n".join(graphs)


def test_ops_stay_whole_off_the_gpu():
    """On the CPU (CI) the compiled graph calls the custom ops (their CPU or interpreter path runs):
    no decomposition into the impl's own operations."""
    t = _inputs("cpu")
    eager = _block(**t)
    compiled, graph = _recorded_graphs(_block, **t)
    for op in ("rms_norm", "layer_norm", "swiglu", "gelu", "rotary_embedding", "attention_softmax"):
        assert f"torch.ops.trainops.{op}.default" in graph, op
    assert "triton_kernel_wrapper" not in graph
    assert _close(compiled, eager)
