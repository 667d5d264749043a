"""q/k RMSNorm + rotary embedding in one pass: forward and backward (q, k and both weights), every
backend, against the unfused sequence in float64 (and Hugging Face's Qwen3 / Gemma 3 / OLMo 2
modules when transformers is installed); per-head and across-heads norms, GQA, layouts read in
place, broadcast cos / sin, odd widths, out_dtype, frozen weights, unused outputs, empty inputs,
determinism, gradcheck, torch.compile, errors. Tiny shapes: the interpreter is slow."""

import itertools
import sys

import pytest
import torch

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import qk_norm_rotary as qk_ops
from trainops.ops.qk_norm_rotary import QKNormRotaryHeuristics
from trainops.plan import clear_plan_cache

from numerics import FLOATS, TOLERANCE, assert_close, assert_sum_close, poison_new_output, stable_seed


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN, so an element left unwritten fails the test."""
    poison_new_output(monkeypatch, qk_ops.QKNormRotaryProblem)
    clear_plan_cache()
    yield
    clear_plan_cache()


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _table(t):
    """cos or sin in float64 as (batch | 1, seq | 1, 1, D), against (b, s, h, D)."""
    t = t.double()
    return (t if t.dim() == 3 else t[None])[:, :, None, :]


def reference(q, k, wq, wk, cos, sin, eps, weight_offset=0.0, across_heads=False):
    """The unfused sequence in float64 (differentiable: the backward's reference too): RMSNorm over
    each head's features (or the token's heads * D features), times (w + offset), then
    x * cos + rotate_half(x) * sin."""
    def one(x, w):
        x = x.double()
        dims = (-2, -1) if across_heads else (-1,)
        n = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
        w = w.double() + weight_offset
        y = n * (w.reshape(x.shape[2], x.shape[3]) if across_heads else w)
        return y * _table(cos) + rotate_half(y) * _table(sin)
    return one(q, wq), one(k, wk)


def weight_abs_sums(q, wq, cos, sin, dq_out, eps, across_heads):
    """sum over tokens (and heads) of |dy * n|, dy the rotation's transpose of dq_out: the scale of
    the weight gradient's float32 sums (numerics.assert_sum_close)."""
    x = q.double()
    dims = (-2, -1) if across_heads else (-1,)
    n = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    do = dq_out.double()
    z = do * _table(sin)
    half = x.shape[-1] // 2
    dy = do * _table(cos) + torch.cat((z[..., half:], -z[..., :half]), -1)
    terms = (dy * n).abs().sum((0, 1))
    return (terms if across_heads else terms.sum(0)).reshape(wq.shape)


def make_inputs(b, s, hq, hk, d, dtype, device, gen, *, across_heads=False, cos_shape="b", cos_dtype=torch.float32,
                weight_dtype=None, layout="dense"):
    """q (b, s, hq, d), k (b, s, hk, d) in ``layout`` ("dense"; "qkv": slices of a fused projection
    (b, s, hq + 2 hk, d); "transposed": transposed views of (b, h, s, d); "strided": feature stride
    2), weights near 1, HF-style cos and sin (cat(f, f)) of shape (b, s, d) ("b"), (1, s, d) ("1")
    or (s, d) ("none")."""
    if layout == "qkv":
        qkv = _randn((b, s, hq + 2 * hk, d), dtype, device, gen, 2.0)
        q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hk]
    elif layout == "transposed":
        q = _randn((b, hq, s, d), dtype, device, gen, 2.0).transpose(1, 2)
        k = _randn((b, hk, s, d), dtype, device, gen, 2.0).transpose(1, 2)
    elif layout == "strided":
        q = _randn((b, s, hq, 2 * d), dtype, device, gen, 2.0)[..., ::2]
        k = _randn((b, s, hk, 2 * d), dtype, device, gen, 2.0)[..., ::2]
    else:
        q, k = _randn((b, s, hq, d), dtype, device, gen, 2.0), _randn((b, s, hk, d), dtype, device, gen, 2.0)
    nq, nk = (hq * d, hk * d) if across_heads else (d, d)
    wdtype = dtype if weight_dtype is None else weight_dtype
    wq = (1.0 + _randn((nq,), torch.float64, device, gen, 0.3)).to(wdtype)
    wk = (1.0 + _randn((nk,), torch.float64, device, gen, 0.3)).to(wdtype)
    lead = {"b": (b, s), "1": (1, s), "none": (s,)}[cos_shape]
    theta = torch.rand(lead + (d // 2,), generator=gen, dtype=torch.float64) * 20 - 10
    theta = torch.cat((theta, theta), -1)
    return q, k, wq, wk, theta.cos().to(cos_dtype).to(device), theta.sin().to(cos_dtype).to(device)


def check(q, k, wq, wk, cos, sin, dtype, what, eps=1e-6, weight_offset=0.0, across_heads=False, out_dtype=None):
    """Forward and backward (q, k, both weights) against the float64 reference; returns them."""
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    wq, wk = wq.detach().requires_grad_(), wk.detach().requires_grad_()
    qo, ko = trainops.qk_norm_rotary(q, k, wq, wk, cos, sin, eps, weight_offset=weight_offset,
                                     across_heads=across_heads, out_dtype=out_dtype)
    assert qo.dtype == ko.dtype == (out_dtype or dtype)
    assert qo.is_contiguous() and ko.is_contiguous() and qo.shape == q.shape and ko.shape == k.shape
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, wq, wk)]
    rq, rk = reference(*leaves64, cos, sin, eps, weight_offset, across_heads)
    out_tol = out_dtype or dtype
    assert_close(qo, rq, out_tol, what + " q_out")
    assert_close(ko, rk, out_tol, what + " k_out")
    gen = torch.Generator().manual_seed(7)
    dq_out, dk_out = _randn(qo.shape, qo.dtype, q.device, gen), _randn(ko.shape, ko.dtype, q.device, gen)
    grads = torch.autograd.grad((qo, ko), (q, k, wq, wk), (dq_out, dk_out))
    refs = torch.autograd.grad((rq, rk), leaves64, (dq_out.double(), dk_out.double()))
    assert grads[0].is_contiguous() and grads[0].dtype == dtype and grads[2].dtype == wq.dtype
    tol = max((dtype, out_tol, wq.dtype), key=TOLERANCE.get)   # the dtype of the loosest tolerance
    assert_close(grads[0], refs[0], tol, what + " dq")
    assert_close(grads[1], refs[1], tol, what + " dk")
    for name, got, want, x, w, do in (("dq_weight", grads[2], refs[2], q, wq, dq_out),
                                      ("dk_weight", grads[3], refs[3], k, wk, dk_out)):
        scale = weight_abs_sums(x.detach(), w, cos, sin, do, eps, across_heads)
        assert_sum_close(got, want, scale, tol, f"{what} {name}")
    return (qo, ko), grads


@pytest.mark.parametrize("dtype", FLOATS)
def test_matches_float64_reference(backend, device, dtype):
    gen = torch.Generator().manual_seed(stable_seed(str(dtype)))
    # Qwen3: per head, GQA, per-batch float32 cos / sin
    check(*make_inputs(2, 3, 4, 2, 16, dtype, device, gen), dtype, "qwen3-like")
    # Gemma 3: (1 + w), cos / sin (s, D) in q's dtype, a half head of 5 (not a power of two)
    check(*make_inputs(1, 4, 2, 1, 10, dtype, device, gen, cos_shape="none", cos_dtype=dtype), dtype, "gemma-like",
          weight_offset=1.0, eps=1e-5)
    # OLMo 2: the norm over every head of the token, weights (heads * D,); cos / sin (1, s, D)
    check(*make_inputs(2, 2, 3, 3, 8, dtype, device, gen, across_heads=True, cos_shape="1"), dtype, "olmo2-like",
          across_heads=True)


@pytest.mark.parametrize("d", [64, 128, 80])
def test_head_dims(backend, device, d):
    gen = torch.Generator().manual_seed(d)
    check(*make_inputs(1, 2, 2, 1, d, torch.float32, device, gen), torch.float32, f"D={d}")
    check(*make_inputs(1, 2, 2, 1, d, torch.float32, device, gen, across_heads=True), torch.float32,
          f"D={d} across heads", across_heads=True)


@pytest.mark.parametrize("layout", ["qkv", "transposed", "strided"])
def test_layouts_are_read_in_place(backend, device, layout, monkeypatch):
    """Slices of a fused qkv projection, transposed views of (b, h, s, d), a strided feature axis,
    cos / sin expanded over the batch: read without a copy."""
    gen = torch.Generator().manual_seed(stable_seed(layout))
    q, k, wq, wk, cos, sin = make_inputs(2, 3, 3, 1, 8, torch.float32, device, gen, layout=layout, cos_shape="1")
    assert not q.is_contiguous()
    cos, sin = cos.expand(2, 3, 8), sin.expand(2, 3, 8)   # stride 0 over the batch

    def no_copy(self, *args, **kwargs):
        raise AssertionError("a hidden .contiguous()")
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "contiguous", no_copy)
        check(q, k, wq, wk, cos, sin, torch.float32, layout)


def test_random_shapes(backend, device):
    gen = torch.Generator().manual_seed(17)
    for trial in range(4):
        b, s, hq, hk = (int(torch.randint(1, 4, (1,), generator=gen)) for _ in range(4))
        d = 2 * int(torch.randint(1, 9, (1,), generator=gen))
        across = bool(trial % 2)
        layout = ("dense", "qkv", "transposed", "strided")[trial]
        cos_shape = ("b", "1", "none", "b")[trial]
        check(*make_inputs(b, s, hq, hk, d, torch.float32, device, gen, across_heads=across, layout=layout,
                           cos_shape=cos_shape),
              torch.float32, f"trial {trial}: {(b, s, hq, hk, d)} {layout} across={across}", across_heads=across)


def test_out_dtype_and_weight_dtype(backend, device):
    """Qwen3 with float32 weights and bf16 activations returns float32 (torch's promotion): out_dtype;
    the weight gradients come in the weights' dtype, dq in q's."""
    gen = torch.Generator().manual_seed(18)
    inputs = make_inputs(2, 3, 2, 1, 8, torch.bfloat16, device, gen, weight_dtype=torch.float32)
    check(*inputs, torch.bfloat16, "float32 out", out_dtype=torch.float32)
    check(*inputs, torch.bfloat16, "bf16 out")


def test_hugging_face_modules(backend, device):
    """Our op reproduces Qwen3's, Gemma 3's and OLMo 2's q_norm / k_norm + apply_rotary_pos_emb (their
    modules and functions), float32 and bf16, called as an attention forward would call it."""
    pytest.importorskip("transformers")
    from transformers.models.gemma3 import modeling_gemma3 as gemma3
    from transformers.models.olmo2 import modeling_olmo2 as olmo2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    gen = torch.Generator().manual_seed(19)
    b, s, hq, hk, d = 2, 3, 4, 2, 8
    for (name, module, norm_cls, across, offset), dtype in itertools.product(
            (("qwen3", qwen3, qwen3.Qwen3RMSNorm, False, 0.0), ("gemma3", gemma3, gemma3.Gemma3RMSNorm, False, 1.0),
             ("olmo2", olmo2, olmo2.Olmo2RMSNorm, True, 0.0)), (torch.float32, torch.bfloat16)):
        # bf16: HF's own bf16 arithmetic (several roundings) against ours (one), within bf16 tolerance
        q, k, _, _, cos, sin = make_inputs(b, s, hq, hk, d, dtype, device, gen, cos_dtype=dtype)
        q_norm, k_norm = norm_cls(hq * d if across else d, eps=1e-6), norm_cls(hk * d if across else d, eps=1e-6)
        q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
        with torch.no_grad():
            for norm in (q_norm, k_norm):
                norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen) * 0.3 + (0.0 if offset else 1.0))
        if across:
            hf_q = q_norm(q.flatten(2)).view(q.shape).transpose(1, 2)
            hf_k = k_norm(k.flatten(2)).view(k.shape).transpose(1, 2)
        else:
            hf_q, hf_k = q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2)
        hf_q, hf_k = module.apply_rotary_pos_emb(hf_q, hf_k, cos, sin)
        qo, ko = trainops.qk_norm_rotary(q, k, q_norm.weight.detach(), k_norm.weight.detach(), cos, sin, 1e-6,
                                         weight_offset=offset, across_heads=across)
        assert_close(qo.transpose(1, 2), hf_q, dtype, f"{name} q {dtype}")
        assert_close(ko.transpose(1, 2), hf_k, dtype, f"{name} k {dtype}")


def test_frozen_weights_unused_outputs_and_empty(backend, device):
    gen = torch.Generator().manual_seed(20)
    q, k, wq, wk, cos, sin = make_inputs(2, 3, 2, 2, 8, torch.float32, device, gen)
    # frozen weights (LoRA): no weight gradient is computed, dq and dk still are
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    qo, ko = trainops.qk_norm_rotary(qr, kr, wq, wk, cos, sin)
    dq, dk = torch.autograd.grad((qo * qo).sum() + ko.sum(), (qr, kr))
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    rq, rk = reference(q64, k64, wq, wk, cos, sin, 1e-6)
    rdq, rdk = torch.autograd.grad((rq * rq).sum() + rk.sum(), (q64, k64))
    assert_close(dq, rdq, torch.float32, "frozen weights dq")
    assert_close(dk, rdk, torch.float32, "frozen weights dk")
    # only q_out used: k's gradient is exactly zero (read from a stride-0 tensor of zeros), k_weight's too
    wkr = wk.detach().requires_grad_()
    qo, _ = trainops.qk_norm_rotary(qr, kr, wq, wkr, cos, sin)
    dk, dwk = torch.autograd.grad(qo.sum(), (kr, wkr))
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dwk, torch.zeros_like(dwk))
    # empty batch, empty sequence, no k heads
    for shape in ((0, 3, 2, 1, 8), (2, 0, 2, 1, 8), (1, 2, 2, 0, 8)):
        b, s, hq, hk, d = shape
        for across in (False, True):
            qe, ke, wqe, wke, ce, se = make_inputs(b, s, hq, hk, d, torch.float32, device, gen, across_heads=across,
                                                   cos_shape="1")
            (qo, ko), grads = check(qe, ke, wqe, wke, ce, se, torch.float32, f"empty {shape}", across_heads=across)
            if b * s == 0:
                assert torch.equal(grads[2], torch.zeros_like(grads[2]))


def test_weight_gradient_is_deterministic(backend, device):
    """Bit-identical run to run; the Triton plan's partial rows (several tokens a program, one token a
    program) agree within float32 rounding."""
    gen = torch.Generator().manual_seed(21)
    q, k, wq, wk, cos, sin = make_inputs(3, 4, 2, 1, 8, torch.float32, device, gen)
    wq, wk = wq.requires_grad_(), wk.requires_grad_()
    dq_out, dk_out = _randn(q.shape, torch.float32, device, gen), _randn(k.shape, torch.float32, device, gen)

    def weight_grads():
        qo, ko = trainops.qk_norm_rotary(q, k, wq, wk, cos, sin)
        return torch.autograd.grad((qo, ko), (wq, wk), (dq_out, dk_out))
    first, again = weight_grads(), weight_grads()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for h in (QKNormRotaryHeuristics(backward_kernel="tiles", tile_programs_per_sm=1, backward_tile=16),
              QKNormRotaryHeuristics(backward_kernel="tiles", tile_programs_per_sm=2, backward_tile=8),
              QKNormRotaryHeuristics(backward_kernel="tokens", programs_per_sm=1000, tile=8)):
        with trainops.heuristics(h):
            other = weight_grads()
        for a, b in zip(first, other):
            assert_close(a, b, torch.float32, f"{h}")
    if backend == "triton":
        def plan(**fields):
            return trainops.plan("qk_norm_rotary_backward", q_shape=q.shape, k_shape=k.shape, cos_shape=cos.shape,
                                 dtype=q.dtype, device=q.device, heuristics=QKNormRotaryHeuristics(**fields))
        p = plan(backward_kernel="tiles", tile_programs_per_sm=1, backward_tile=16)   # 12 tokens, a token a tile, over 4 "SMs": 3 tiles each
        assert p.kernel["grid"] == (8,) and p.kernel["programs"] == 4 and p.kernel["tiles"] == (12, 12)
        assert p.kernel["BLOCK_T"] == 1 and p.kernel["BLOCK_H"] == (2, 1)
        p = plan(backward_kernel="tokens", programs_per_sm=1)
        assert p.kernel["grid"] == (4,) and p.kernel["rows_per_program"] == 3   # 12 tokens over 4 "SMs"


def test_forced_plans(backend, device):
    """One and two heads a step (the loop over a token's heads), the loop kept where one step holds
    every head, weight sums per head slot: all give the reference's result."""
    gen = torch.Generator().manual_seed(22)
    inputs = make_inputs(2, 2, 5, 3, 8, torch.float32, device, gen)
    tokens = dict(backward_kernel="tokens")   # the straight-line and head-step options are the tokens kernel's
    with trainops.heuristics(QKNormRotaryHeuristics(straight_line=False, step_head_sums=False, **tokens)):
        check(*inputs, torch.float32, "loop of one step, per-slot weight sums")
        check(*make_inputs(1, 2, 3, 2, 8, torch.float32, device, gen, across_heads=True), torch.float32,
              "loop of one step, across heads", across_heads=True)
    with trainops.heuristics(QKNormRotaryHeuristics(tile=8, step_head_sums=False, **tokens)):
        check(*inputs, torch.float32, "one head a step, per-slot weight sums")
    with trainops.heuristics(QKNormRotaryHeuristics(tile=16, **tokens)):
        check(*inputs, torch.float32, "two heads a step")
        p = trainops.plan("qk_norm_rotary", q_shape=inputs[0].shape, k_shape=inputs[1].shape,
                          cos_shape=inputs[4].shape, dtype=torch.float32, device=device)
    if backend == "triton":
        assert p.kernel["BLOCK_HQ"] == 2 and p.kernel["grid"] == (4,)   # 5 heads: steps of 2, 2, 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_backward_plans(backend, device, dtype):
    """The tiles backward (opt-in until timed on a GPU) where its plan branches: one head a tile (head blocks, q's 5
    heads and k's 3 in separate tiles), several tokens a tile with a ragged last tile, programs
    walking several tiles, the norm across heads with two tokens a tile and Gemma's weight offset;
    read in place from transposed and strided views; against float64 (q, k and both weights)."""
    gen = torch.Generator().manual_seed(30)
    cases = [
        (dict(backward_tile=8, tile_programs_per_sm=1, tile_stages=3), (2, 3, 5, 3, 8), dict(layout="transposed"), {},
         dict(BLOCK_T=1, BLOCK_H=(1, 1), tiles=(30, 18), programs=4, stages=3)),
        (dict(backward_tile=128), (1, 7, 5, 3, 8), dict(layout="strided", cos_shape="1"), {},
         dict(BLOCK_T=2, BLOCK_H=(8, 4), tiles=(4, 4))),
        (dict(backward_tile=64, tile_programs_per_sm=1), (1, 5, 3, 2, 8), dict(across_heads=True, cos_shape="none"),
         dict(across_heads=True, weight_offset=1.0), dict(BLOCK_T=2, BLOCK_H=(4, 2), tiles=(3, 3), programs=3)),
    ]
    for fields, (b, s, hq, hk, d), make, call, want in cases:
        with trainops.heuristics(QKNormRotaryHeuristics(backward_kernel="tiles", **fields)):
            inputs = make_inputs(b, s, hq, hk, d, dtype, device, gen, **make)
            check(*inputs, dtype, f"{fields} {make}", **call)
            if backend == "triton":
                q, k, *_, cos, _ = inputs
                p = trainops.plan("qk_norm_rotary_backward", q_shape=q.shape, k_shape=k.shape, cos_shape=cos.shape,
                                  dtype=dtype, device=device, across_heads=call.get("across_heads", False))
                assert {key: p.kernel[key] for key in want} == want, p.kernel


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")   # the interpreter computes the padded 1 / sqrt(0)
def test_eps_zero_with_padded_lanes(backend, device):
    """eps = 0 where the Triton plans pad (5 q heads and 3 k heads held as 8 and 4; a ragged last
    tile of tokens): the padded lanes' 1 / sqrt(0) must not reach the weight gradients (it did, as
    NaN, before); both backward kernels, per head and across heads, against float64."""
    gen = torch.Generator().manual_seed(31)
    for fields in (dict(backward_kernel="tiles", backward_tile=128), dict(backward_kernel="tokens")):
        with trainops.heuristics(QKNormRotaryHeuristics(**fields)):
            for across in (False, True):
                inputs = make_inputs(1, 3, 5, 3, 8, torch.float32, device, gen, across_heads=across)
                check(*inputs, torch.float32, f"eps 0 {fields} across={across}", eps=0.0, across_heads=across)


def test_special_values(backend, device):
    """Per head, a NaN poisons only its own head (its whole head: the norm mixes the features)."""
    gen = torch.Generator().manual_seed(23)
    q, k, wq, wk, cos, sin = make_inputs(1, 2, 3, 1, 8, torch.float32, device, gen)
    q[0, 1, 2, 5] = float("nan")
    qo, ko = trainops.qk_norm_rotary(q, k, wq, wk, cos, sin)
    rq, rk = reference(q, k, wq, wk, cos, sin, 1e-6)
    assert_close(qo, rq, torch.float32, "q_out")
    assert qo[0, 1, 2].isnan().all() and qo.isnan().sum() == 8


def test_gradcheck_float64(backend, device):
    gen = torch.Generator().manual_seed(24)
    for across in (False, True):
        q, k, wq, wk, cos, sin = make_inputs(1, 2, 2, 1, 6, torch.float64, device, gen, across_heads=across,
                                             cos_dtype=torch.float64)
        cos = cos + 0.1 * torch.rand(cos.shape, generator=gen, dtype=torch.float64).to(device)  # not duplicated
        leaves = [t.detach().requires_grad_() for t in (q, k, wq, wk)]

        def f(q, k, wq, wk):
            return trainops.qk_norm_rotary(q, k, wq, wk, cos, sin, 1e-6, weight_offset=0.5, across_heads=across)
        # the interpreter takes ~10 ms a program: random projections of the Jacobians (fast_mode) there
        assert torch.autograd.gradcheck(f, leaves, fast_mode=backend == "triton")
    qo, _ = f(*leaves)
    with pytest.raises(UnsupportedError, match="double backward"):
        torch.autograd.grad(qo.sum(), leaves[0], create_graph=True)


def test_torch_compile_fullgraph(backend, device):
    gen = torch.Generator().manual_seed(25)
    q, k, wq, wk, cos, sin = make_inputs(2, 3, 4, 2, 8, torch.float32, device, gen)
    leaves = [t.detach().requires_grad_() for t in (q, k, wq, wk)]

    def f(q, k, wq, wk):
        qo, ko = trainops.qk_norm_rotary(q, k, wq, wk, cos, sin, 1e-6)
        return (qo.transpose(1, 2) * qo.transpose(1, 2)).sum() + (ko * torch.arange(8.0, device=device)).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    torch._dynamo.reset()
    eager_loss = f(*leaves)
    eager_grads = torch.autograd.grad(eager_loss, leaves)
    assert_close(loss, eager_loss, torch.float32, "loss")
    for got, want in zip(grads, eager_grads):
        assert_close(got, want, torch.float32, "grad")


def test_plan_api(backend, device):
    gen = torch.Generator().manual_seed(26)
    q, k, wq, wk, cos, sin = make_inputs(1, 3, 2, 1, 8, torch.float32, device, gen, cos_shape="none")
    p = trainops.plan("qk_norm_rotary", q_shape=q.shape, k_shape=k.shape, cos_shape=cos.shape, dtype=q.dtype,
                      device=device, eps=1e-6)
    assert p.precision.bitwise_reproducible and p.precision.accumulator == torch.float32
    qo, ko = p.run(q, k, wq, wk, cos, sin)
    rq, rk = reference(q, k, wq, wk, cos, sin, 1e-6)
    assert_close(qo, rq, torch.float32, "plan q")
    assert_close(ko, rk, torch.float32, "plan k")
    assert not p.can_implement(q.transpose(1, 2).contiguous().transpose(1, 2), k, wq, wk, cos, sin)
    assert not p.can_implement(q, k, wq, wk, cos, sin.double())
    assert not p.can_implement(q, k, wq[:4], wk, cos, sin)


# ---- errors: named, before anything is written -------------------------------------------------------

def test_errors_name_the_argument():
    gen = torch.Generator().manual_seed(27)
    q, k, wq, wk, cos, sin = make_inputs(2, 3, 4, 2, 8, torch.float32, "cpu", gen)
    f = trainops.qk_norm_rotary
    cases = [
        (lambda: f("q", k, wq, wk, cos, sin), InvalidProblemError, "'q' must be a torch.Tensor"),
        (lambda: f(q, k, None, wk, cos, sin), InvalidProblemError, "'q_weight' must be a torch.Tensor"),
        (lambda: f(q.int(), k, wq, wk, cos, sin), UnsupportedError, "'q' has dtype torch.int32"),
        (lambda: f(q, k, wq, wk.long(), cos, sin), UnsupportedError, "'k_weight' has dtype torch.int64"),
        (lambda: f(q, k, wq, wk, cos.int(), sin), UnsupportedError, "'cos' has dtype torch.int32"),
        (lambda: f(q, k.double(), wq, wk, cos, sin), InvalidProblemError, "'k' has dtype torch.float64"),
        (lambda: f(q, k, wq, wk.double(), cos, sin), InvalidProblemError, "'k_weight' has dtype torch.float64"),
        (lambda: f(q, k, wq, wk, cos, sin.double()), InvalidProblemError, "'sin' has shape"),
        (lambda: f(q, k, wq, wk, cos, sin, out_dtype=torch.int32), UnsupportedError, "'out_dtype' has dtype"),
        (lambda: f(q, k, wq, wk, cos, sin, out_dtype="bf16"), InvalidProblemError, "'out_dtype' must be"),
        (lambda: f(q[0], k, wq, wk, cos, sin), InvalidProblemError, "'q' has shape"),
        (lambda: f(q, k[:1], wq, wk, cos, sin), InvalidProblemError, "'k' has shape"),
        (lambda: f(q, k[..., :6], wq, wk, cos, sin), InvalidProblemError, "'k' has shape"),   # mismatched D
        (lambda: f(q[..., :7], k[..., :7], wq[:7], wk[:7], cos[..., :7], sin[..., :7]), InvalidProblemError,
         "'q' has head_dim 7"),                                                                # odd D
        (lambda: f(q, k, wq[:6], wk, cos, sin), InvalidProblemError, "'q_weight' has shape (6,)"),
        (lambda: f(q, k, wq, wk[None], cos, sin), InvalidProblemError, "'k_weight' has shape (1, 8)"),
        (lambda: f(q, k, wq, wk, cos, sin, across_heads=True), InvalidProblemError, "'q_weight' has shape (8,)"),
        (lambda: f(q, k, wq, wk, cos[..., :6], sin[..., :6]), InvalidProblemError, "'cos' has shape"),
        (lambda: f(q, k, wq, wk, cos[:, :2], sin[:, :2]), InvalidProblemError, "'cos' has shape"),
        (lambda: f(q, k, wq, wk, cos[None], sin[None]), InvalidProblemError, "'cos' has shape"),
        (lambda: f(q, k, wq, wk, cos, sin[:1]), InvalidProblemError, "'sin' has shape"),
        (lambda: f(q, k.to("meta"), wq, wk, cos, sin), InvalidProblemError, "'k' is on meta"),
        (lambda: f(q, k, wq.to("meta"), wk, cos, sin), InvalidProblemError, "'q_weight' is on meta"),
        (lambda: f(q, k, wq, wk, cos.to("meta"), sin), InvalidProblemError, "'cos' is on meta"),
        (lambda: f(q, k, wq, wk, cos, sin, -1.0), InvalidProblemError, "'eps' must be a finite number"),
        (lambda: f(q, k, wq, wk, cos, sin, float("nan")), InvalidProblemError, "'eps' must be a finite number"),
        (lambda: f(q, k, wq, wk, cos, sin, weight_offset="1"), InvalidProblemError, "'weight_offset' must be"),
        (lambda: f(q, k, wq, wk, cos, sin, weight_offset=float("inf")), InvalidProblemError, "'weight_offset' must"),
        (lambda: f(q, k, wq, wk, cos, sin, across_heads=1), InvalidProblemError, "'across_heads' must be a bool"),
        (lambda: f(q, k, wq, wk, cos.requires_grad_(), sin), UnsupportedError, "'cos' requires grad"),
        (lambda: f(q, k, wq, wk, cos.detach(), sin.detach().requires_grad_()), UnsupportedError,
         "'sin' requires grad"),
    ]
    for fn, cls, text in cases:
        with pytest.raises(cls) as info:
            fn()
        assert text in str(info.value) and "trainops.qk_norm_rotary" in str(info.value), str(info.value)
    with torch.no_grad():  # nothing is differentiated: angles that require grad are fine
        f(q, k, wq, wk, cos.detach().requires_grad_(), sin)
    for fields, text in ((dict(backward_kernel="rows"), "backward_kernel must be one of"),
                         (dict(backward_tile=3000), "backward_tile must be a power of two"),
                         (dict(tile_reduce_block=0), "tile_reduce_block must be a power of two"),
                         (dict(tile_programs_per_sm=0), "tile_programs_per_sm must be an int >= 1"),
                         (dict(tile_stages=0), "tile_stages must be an int >= 1")):
        with pytest.raises(InvalidProblemError, match="argument 'heuristics'") as info:
            trainops.plan("qk_norm_rotary_backward", q_shape=q.shape, k_shape=k.shape, cos_shape=cos.shape,
                          dtype=q.dtype, device="cpu", heuristics=QKNormRotaryHeuristics(**fields))
        assert text in str(info.value), str(info.value)
    big = torch.zeros(1, 1, 300, 64)
    with pytest.raises(UnsupportedError, match="'across_heads' norms over 300 heads"):
        f(big, big, torch.ones(300 * 64), torch.ones(300 * 64), torch.ones(1, 64), torch.ones(1, 64),
          across_heads=True)


# ---- GPU: real sizes -------------------------------------------------------------------------------

def _assert_rounded_once(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """bf16 outputs of float32 math rounded once: within one bf16 ulp of the float64 value everywhere
    (plus float32 rounding where the rotation cancels), and equal to its correctly rounded value at
    nearly every element."""
    ref = ref.detach().to(out.device)
    assert_close(out, ref, torch.bfloat16, what)
    rounded = ref.to(torch.bfloat16)
    exact = (out == rounded).float().mean().item()
    assert exact > 0.98, f"{what}: only {exact:.4f} of the elements are the correctly rounded value"
    ulp = torch.pow(2.0, torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    slack = ulp + 1e-5 * ref.abs().max()
    assert ((out.double() - ref).abs() <= slack).all(), f"{what}: an element more than one ulp away"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["tiles", "tokens"])
@pytest.mark.parametrize("shape,across", [((8, 2048, 16, 8, 128), False), ((4, 2048, 32, 8, 64), False),
                                          ((4, 2048, 16, 16, 128), True), ((4, 2048, 32, 8, 128), False),
                                          ((4, 2048, 4, 1, 256), False)],
                         ids=["qwen3-0.6b", "llama-3.2-1b-like", "olmo2-1b-across-heads", "qwen3-8b-like",
                              "gemma3-1b"])
def test_gpu_real_sizes(shape, across, kernel):
    b, s, hq, hk, d = shape
    gen = torch.Generator().manual_seed(28)
    q, k, wq, wk, cos, sin = make_inputs(b, s, hq, hk, d, torch.bfloat16, "cuda", gen, across_heads=across,
                                         cos_shape="1", cos_dtype=torch.bfloat16)
    q, k, wq, wk = (t.requires_grad_() for t in (q, k, wq, wk))
    with trainops.heuristics(QKNormRotaryHeuristics(backward_kernel=kernel)):
        _gpu_real_sizes(q, k, wq, wk, cos, sin, across)


def _gpu_real_sizes(q, k, wq, wk, cos, sin, across):
    qo, ko = trainops.qk_norm_rotary(q, k, wq, wk, cos, sin, 1e-6, across_heads=across)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, wq, wk)]
    rq, rk = reference(*leaves64, cos, sin, 1e-6, 0.0, across)
    _assert_rounded_once(qo, rq, "q_out")
    _assert_rounded_once(ko, rk, "k_out")
    dq_out = torch.randn(qo.shape, device="cuda", dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    dk_out = torch.randn(ko.shape, device="cuda", dtype=torch.bfloat16)
    grads = torch.autograd.grad((qo, ko), (q, k, wq, wk), (dq_out, dk_out))
    refs = torch.autograd.grad((rq, rk), leaves64, (dq_out.double(), dk_out.double()))
    _assert_rounded_once(grads[0], refs[0], "dq")
    _assert_rounded_once(grads[1], refs[1], "dk")
    for name, got, want, x, w, do in (("dq_weight", grads[2], refs[2], q, wq, dq_out),
                                      ("dk_weight", grads[3], refs[3], k, wk, dk_out)):
        scale = weight_abs_sums(x.detach(), w, cos, sin, do, 1e-6, across)
        assert_sum_close(got, want, scale, torch.bfloat16, name)
    again = torch.autograd.grad(trainops.qk_norm_rotary(q, k, wq, wk, cos, sin, 1e-6, across_heads=across),
                                (q, k, wq, wk), (dq_out, dk_out))
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "bit-identical run to run"


@pytest.mark.gpu
@pytest.mark.parametrize("backward_kernel", ["tokens", "tiles"])
def test_gpu_compiled_graph_launches_the_kernels(backward_kernel):
    """Under torch.compile on CUDA the op is inlined: Inductor launches the forward and backward
    kernels itself (no custom-op call at run time), with the eager results; both backward kernels."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(29)
    q, k, wq, wk, cos, sin = make_inputs(2, 64, 4, 2, 64, torch.bfloat16, "cuda", gen)
    leaves = [t.requires_grad_() for t in (q, k, wq, wk)]

    def f(q, k, wq, wk):
        qo, ko = trainops.qk_norm_rotary(q, k, wq, wk, cos, sin, 1e-6)
        return qo.float().square().sum() + ko.float().sum()

    # compile's caches key on the graph, not on trainops's heuristics: off, so that the second
    # parameter compiles its own kernels instead of the first one's (benchmarks/NOTES.md)
    with trainops.heuristics(QKNormRotaryHeuristics(backward_kernel=backward_kernel)), \
            torch._inductor.config.patch(force_disable_caches=True):
        eager_grads = torch.autograd.grad(f(*leaves), leaves)
        compiled = torch.compile(f, fullgraph=True)

        def step():
            return torch.autograd.grad(compiled(*leaves), leaves)
        grads, code = run_and_get_code(step)
    torch._dynamo.reset()
    source = "\n".join(code)
    for kernel in ("_qk_norm_rotary_fwd", "_qk_norm_rotary_bwd", "_sum_columns"):
        assert kernel in source, f"{kernel} is not launched by the compiled code"
    assert ("_qk_norm_rotary_bwd_tiles" in source) == (backward_kernel == "tiles"), backward_kernel
    assert "torch.ops.trainops" not in source
    for got, want in zip(grads, eager_grads):
        assert_close(got, want, torch.bfloat16, "compiled grad")


@pytest.mark.parametrize("chosen", ["tokens", "tiles"])
def test_backward_kernel_reaches_the_backward_on_another_thread(monkeypatch, chosen):
    """The forward's backward_kernel is an argument of the backward op, so it holds where the
    backward is planned without the forward's heuristics in force (a thread of its own, as autograd's
    device threads, where a compiled graph's backward calls the op at run time), compiled or not;
    and a second step plans nothing new (the derived heuristics are the same object)."""
    import threading

    from trainops.plan import plan_cache_info

    prepared = []
    real = qk_ops._prepare_tiles
    monkeypatch.setattr(qk_ops, "_prepare_tiles", lambda *a, **kw: prepared.append("tiles") or real(*a, **kw))
    gen = torch.Generator().manual_seed(31)
    q, k, wq, wk, cos, sin = make_inputs(1, 5, 3, 1, 8, torch.float32, "cpu", gen)
    leaves = [t.requires_grad_() for t in (q, k, wq, wk)]

    def f(q, k, wq, wk):
        qo, ko = trainops.qk_norm_rotary(q, k, wq, wk, cos, sin, 1e-6)
        return qo.square().sum() + ko.sum()

    other = "tiles" if chosen == "tokens" else "tokens"
    chosen_heuristics, other_heuristics = (QKNormRotaryHeuristics(backward_kernel=kernel) for kernel in (chosen, other))

    def step(run):
        with trainops.backend("triton"), trainops.heuristics(chosen_heuristics):
            loss = run(*leaves)
        grads = []

        def backward():   # the other kernel in force here: the forward's choice must win
            with trainops.backend("triton"), trainops.heuristics(other_heuristics):
                grads.append(torch.autograd.grad(loss, leaves))
        thread = threading.Thread(target=backward)
        thread.start()
        thread.join()
        assert len(grads) == 1

    try:
        for label, run in (("eager", f), ("compiled", torch.compile(f, fullgraph=True, backend="aot_eager"))):
            clear_plan_cache()
            prepared.clear()
            step(run)
            assert prepared == (["tiles"] if chosen == "tiles" else []), (label, prepared)
            misses = plan_cache_info()["misses"]
            step(run)
            assert plan_cache_info()["misses"] == misses, f"{label}: the second step planned again"
    finally:
        torch._dynamo.reset()


def test_bench_front_end_on_the_cpu(tmp_path, capsys, monkeypatch):
    """benchmarks/bench_qk_norm_rotary.py --cpu --sweep: every implementation checked against
    float64 and timed in interleaved rounds, the tiles and tokens backwards side by side, the sweep's
    variants, rows written (a self-check of the GPU script)."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_qk_norm_rotary.py")
    spec = importlib.util.spec_from_file_location("_bench_qk_norm_rotary", path)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)   # its dataclass looks its module up
    spec.loader.exec_module(script)
    out = tmp_path / "qk.json"
    with trainops.backend("cpu"):
        assert script.main(["--cpu", "--sweep", "--rounds", "2", "--shapes", "qwen3-tiny,olmo2-tiny",
                            "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    for shape in ("qwen3-tiny", "olmo2-tiny"):
        got = {(r["direction"], r["impl"]) for r in rows if r["shape"] == shape and " tile=" not in r["impl"]}
        assert got == {("bwd", "trainops tiles"), ("bwd", "trainops tokens"), ("bwd", "torch eager (HF)"),
                       ("fwd+bwd", "trainops tiles"), ("fwd+bwd", "trainops tokens"),
                       ("fwd+bwd", "torch eager (HF)"), ("fwd", "trainops"), ("fwd", "torch eager (HF)")}
        assert sum(r["shape"] == shape and " tile=" in r["impl"] for r in rows) == len(script.SWEEP)
    assert all(len(r["rounds"]) == 2 and r["ms"] > 0 for r in rows)
    assert all(r["max_error"] < 1e-2 for r in rows)   # every row checked against float64 (bf16); NaN fails
    assert "summary" in capsys.readouterr().out
