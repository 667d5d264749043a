"""Rotary position embedding: forward and backward, every backend, both conventions, against float64
references (ours, and Hugging Face's / GPT-J's formulas written out); GQA, partial rotary,
position ids, layouts read in place, plans forced on small shapes, edge cases, gradcheck,
torch.compile, errors."""

import pytest
import torch

import trainops
from trainops.errors import IndexOutOfRangeError, InvalidProblemError, UnsupportedError
from trainops.ops import rotary as rotary_ops
from trainops.ops.rotary import RotaryHeuristics
from trainops.plan import clear_plan_cache

from numerics import FLOATS, assert_close, poison_new_output, stable_seed


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN, so an element left unwritten fails the test."""
    poison_new_output(monkeypatch, rotary_ops.RotaryProblem)
    clear_plan_cache()
    yield
    clear_plan_cache()


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def make_qk(b, hq, hk, s, d, dtype, device, gen, layout="hf"):
    """q and k of shapes (b, h, s, d): 'hf' transposed views of (b, s, h, d) (as HF's attention makes
    them), or 'contiguous'."""
    if layout == "hf":
        return (_randn((b, s, hq, d), dtype, device, gen).transpose(1, 2),
                _randn((b, s, hk, d), dtype, device, gen).transpose(1, 2))
    return _randn((b, hq, s, d), dtype, device, gen), _randn((b, hk, s, d), dtype, device, gen)


def angles(shape, rotary_dim, interleaved, device, gen, dtype=torch.float32):
    """HF-style cos and sin of shape (..., rotary_dim) from random angles: each frequency twice,
    cat(f, f) (rotate_half) or repeat_interleave(f, 2) (interleaved)."""
    theta = torch.rand(tuple(shape) + (rotary_dim // 2,), generator=gen, dtype=torch.float64) * 20 - 10
    theta = theta.repeat_interleave(2, -1) if interleaved else torch.cat((theta, theta), -1)
    return theta.cos().to(dtype).to(device), theta.sin().to(dtype).to(device)


def reference(q, k, cos, sin, position_ids=None, interleaved=False, rotary_dim=None):
    """float64 (q_out, k_out) from the definition (differentiable: the backward's reference too)."""
    r = cos.shape[-1] if rotary_dim is None else rotary_dim
    c, s = cos.double(), sin.double()
    if position_ids is not None:
        c, s = c[position_ids.long()], s[position_ids.long()]
    if c.dim() == 2:
        c, s = c[None], s[None]
    c, s = c[:, None], s[:, None]  # (batch | 1, 1, seq, R): the same for every head

    def rotate(x):
        x = x.double()
        xr = x[..., :r]
        if interleaved:
            turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
        else:
            turned = torch.cat((-xr[..., r // 2:], xr[..., :r // 2]), -1)
        return torch.cat((xr * c + turned * s, x[..., r:]), -1)
    return rotate(q), rotate(k)


def check_forward_backward(q, k, cos, sin, dtype, what, **kw):
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    qo, ko = trainops.rotary_embedding(q, k, cos, sin, **kw)
    rq, rk = reference(q.detach(), k.detach(), cos, sin, kw.get("position_ids"), kw.get("interleaved", False),
                       kw.get("rotary_dim"))
    assert qo.dtype == dtype and ko.dtype == dtype
    assert_close(qo, rq, dtype, what + " q_out")
    assert_close(ko, rk, dtype, what + " k_out")
    gen = torch.Generator().manual_seed(7)
    dq_out, dk_out = _randn(qo.shape, dtype, q.device, gen), _randn(ko.shape, dtype, q.device, gen)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (dq_out, dk_out))
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = reference(qd, kd, cos, sin, kw.get("position_ids"), kw.get("interleaved", False), kw.get("rotary_dim"))
    rdq, rdk = torch.autograd.grad((rq, rk), (qd, kd), (dq_out.double(), dk_out.double()))
    assert_close(dq, rdq, dtype, what + " dq")
    assert_close(dk, rdk, dtype, what + " dk")
    return qo, ko, dq, dk


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_matches_float64_reference(backend, device, dtype, interleaved):
    gen = torch.Generator().manual_seed(stable_seed(str(dtype), interleaved))
    # GQA, HF's transposed layout, per-batch cos / sin (b, s, R), full rotary
    q, k = make_qk(2, 4, 2, 3, 16, dtype, device, gen)
    cos, sin = angles((2, 3), 16, interleaved, device, gen)
    check_forward_backward(q, k, cos, sin, dtype, "gqa hf", interleaved=interleaved)
    # partial rotary (GPT-NeoX / Phi), cos / sin (s, R) in q's dtype, contiguous q and k
    q, k = make_qk(1, 3, 1, 4, 24, dtype, device, gen, "contiguous")
    cos, sin = angles((4,), 8, interleaved, device, gen, dtype)
    check_forward_backward(q, k, cos, sin, dtype, "partial", interleaved=interleaved)
    # batch-1 cos / sin broadcast over the batch
    q, k = make_qk(3, 2, 2, 2, 8, dtype, device, gen)
    cos, sin = angles((1, 2), 8, interleaved, device, gen)
    check_forward_backward(q, k, cos, sin, dtype, "broadcast", interleaved=interleaved)
    # position ids into tables, partial rotary whose half is not a power of two
    q, k = make_qk(2, 2, 1, 5, 16, dtype, device, gen)
    cos, sin = angles((9,), 12, interleaved, device, gen)
    pos = torch.randint(0, 9, (2, 5), generator=gen).to(device)
    check_forward_backward(q, k, cos, sin, dtype, "positions", interleaved=interleaved, position_ids=pos,
                           rotary_dim=12)
    # any cos and sin (not HF's duplicated layout: each feature's own angle is read, forward and backward)
    q, k = make_qk(2, 1, 3, 2, 8, dtype, device, gen)
    cos, sin = _randn((2, 2, 6), torch.float32, device, gen), _randn((2, 2, 6), torch.float32, device, gen)
    check_forward_backward(q, k, cos, sin, dtype, "free angles", interleaved=interleaved)


def _hf_llama_apply(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' modeling_llama ``apply_rotary_pos_emb``, written out from its formula."""
    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _hf_gptj_apply(x, sin, cos):
    """transformers' modeling_gptj ``apply_rotary_pos_emb`` (x of (b, s, h, d), sin / cos of (b, s, d/2))."""
    def rotate_every_two(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (x * cos) + (rotate_every_two(x) * sin)


def test_hugging_face_formulas_and_numerics(backend, device):
    """Our reference is HF's formulas (Llama's rotate_half, GPT-J's rotate_every_two); in bf16 the op
    matches HF's bf16 arithmetic (cos / sin cast to q's dtype first) within bf16 tolerance."""
    gen = torch.Generator().manual_seed(3)
    b, hq, hk, s, d = 2, 4, 2, 6, 16
    # HF's LlamaRotaryEmbedding: float32 angles from position ids, cat(freqs, freqs), then cast to x's dtype
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    position_ids = torch.arange(100, 100 + s)[None].expand(b, s)
    freqs = (inv_freq[None, :, None] * position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos32, sin32 = emb.cos().to(device), emb.sin().to(device)
    q, k = make_qk(b, hq, hk, s, d, torch.float64, device, gen)
    for got, want in zip(reference(q, k, cos32, sin32), _hf_llama_apply(q, k, cos32.double(), sin32.double())):
        assert_close(got, want, torch.float64, "our reference is HF's Llama formula")
    x = q.transpose(1, 2)  # GPT-J's layout (b, s, h, d)
    theta = torch.rand(b, s, d // 2, generator=gen, dtype=torch.float64).to(device) * 6
    ours_ref = reference(q, k, theta.cos().repeat_interleave(2, -1), theta.sin().repeat_interleave(2, -1),
                         interleaved=True)[0]
    assert_close(ours_ref.transpose(1, 2), _hf_gptj_apply(x, theta.sin(), theta.cos()), torch.float64,
                 "our interleaved reference is GPT-J's formula")
    qb, kb = q.to(torch.bfloat16), k.to(torch.bfloat16)
    hf_q, hf_k = _hf_llama_apply(qb, kb, cos32.to(torch.bfloat16), sin32.to(torch.bfloat16))
    for cos, sin in ((cos32, sin32), (cos32.to(torch.bfloat16), sin32.to(torch.bfloat16))):
        qo, ko = trainops.rotary_embedding(qb, kb, cos, sin)
        rq, rk = reference(qb, kb, cos, sin)
        assert_close(qo, rq, torch.bfloat16, f"q_out, cos {cos.dtype}")
        assert_close(ko, rk, torch.bfloat16, f"k_out, cos {cos.dtype}")
        assert_close(qo, hf_q, torch.bfloat16, f"q_out against HF's bf16 arithmetic, cos {cos.dtype}")
        assert_close(ko, hf_k, torch.bfloat16, f"k_out against HF's bf16 arithmetic, cos {cos.dtype}")


def test_layouts_are_read_in_place_and_kept(backend, device, monkeypatch):
    """HF's transposed q, a slice of a fused qkv projection, a strided feature axis, expanded output
    gradients: all read without a copy; outputs and gradients take the inputs' layout."""
    gen = torch.Generator().manual_seed(4)
    b, hq, hk, s, d = 2, 4, 2, 3, 8
    qkv = _randn((b, s, hq + 2 * hk, d), torch.float32, device, gen)
    q_fused = qkv[:, :, :hq].transpose(1, 2)  # not dense: k and v sit between its rows
    k_strided = _randn((b, hk, s, 2 * d), torch.float32, device, gen)[..., ::2]  # feature stride 2
    cos, sin = angles((b, s), d, False, device, gen)
    q_hf, k_hf = make_qk(b, hq, hk, s, d, torch.float32, device, gen)

    def no_copy(self, *args, **kwargs):
        raise AssertionError("a hidden .contiguous()")
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "contiguous", no_copy)
        qo, ko, dq, dk = check_forward_backward(q_hf, k_hf, cos, sin, torch.float32, "hf layout")
        assert qo.stride() == q_hf.stride() and dq.stride() == q_hf.stride(), "outputs keep HF's (b, s, h, d) order"
        assert ko.stride() == k_hf.stride() and dk.stride() == k_hf.stride()
        qo, ko, dq, dk = check_forward_backward(q_fused, k_strided, cos, sin, torch.float32, "fused / strided")
        assert qo.is_contiguous(memory_format=torch.contiguous_format) is False and qo.transpose(1, 2).is_contiguous()
        assert ko.is_contiguous() and dk.is_contiguous()
        # only q_out is used: k's gradient is zero, read from a stride-0 tensor of zeros
        q = q_hf.detach().requires_grad_()
        k = k_hf.detach().requires_grad_()
        qo, _ = trainops.rotary_embedding(q, k, cos, sin)
        dq, dk = torch.autograd.grad(qo.sum(), (q, k))  # dq_out: an expanded tensor of ones
        qd = q.detach().double().requires_grad_()
        rdq, = torch.autograd.grad(reference(qd, k, cos, sin)[0].sum(), (qd,))
        assert_close(dq, rdq, torch.float32, "expanded dy")
        assert torch.equal(dk, torch.zeros_like(dk))


def test_position_ids_shapes_and_range(backend, device):
    gen = torch.Generator().manual_seed(5)
    b, s, d = 2, 4, 8
    q, k = make_qk(b, 2, 1, s, d, torch.float32, device, gen)
    cos, sin = angles((6,), 6, False, device, gen)
    for pos in (torch.tensor([[5, 0, 2, 2]]), torch.tensor([1, 2, 3, 4], dtype=torch.int32),
                torch.tensor([[3], [1]], dtype=torch.int32), torch.randint(0, 6, (b, 2 * s), generator=gen)[:, ::2]):
        pos = pos.to(device)
        qo, ko = trainops.rotary_embedding(q, k, cos, sin, position_ids=pos)
        rq, rk = reference(q, k, cos, sin, pos.expand(b, s) if pos.dim() == 2 else pos)
        assert_close(qo, rq, torch.float32, f"positions {pos.shape}")
        assert_close(ko, rk, torch.float32, f"positions {pos.shape}")
    for bad in (6, -1):
        pos = torch.tensor([[0, 1, bad, 2], [0, 1, 2, 3]], device=device)
        with pytest.raises(IndexOutOfRangeError, match=f"'position_ids' holds {bad}"):
            trainops.rotary_embedding(q, k, cos, sin, position_ids=pos, check_position_ids=True)
        # unchecked (the default: no host sync): the bad row's rotated features are NaN, the rest exact
        qo, ko = trainops.rotary_embedding(q, k, cos, sin, position_ids=pos)
        rq, _ = reference(q, k, cos, sin, pos.clamp(0, 5))
        bad_row = torch.zeros(b, s, dtype=torch.bool, device=device)
        bad_row[0, 2] = True
        assert qo[:, :, 2, :6][0].isnan().all() and ko[0, :, 2, :6].isnan().all()
        assert torch.equal(qo[0, :, 2, 6:], q[0, :, 2, 6:])
        keep = ~bad_row[:, None, :, None].expand_as(qo)
        assert_close(qo[keep], rq[keep], torch.float32, "rows with valid ids")


def test_empty_and_length_one(backend, device):
    gen = torch.Generator().manual_seed(6)
    for b, hq, hk, s, d, r in ((2, 3, 1, 0, 8, 8), (0, 2, 2, 3, 8, 8), (2, 2, 0, 3, 8, 4), (1, 1, 1, 1, 8, 8),
                               (2, 3, 2, 1, 2, 2), (1, 2, 1, 3, 4, 0)):
        for interleaved in (False, True):
            q, k = make_qk(b, hq, hk, s, d, torch.float64, device, gen)
            cos, sin = angles((b, s), r, interleaved, device, gen, torch.float64)
            check_forward_backward(q, k, cos, sin, torch.float64, f"{(b, hq, hk, s, d, r)}", interleaved=interleaved)


def test_special_values(backend, device):
    """inf and NaN poison only their own features' outputs, as the formula in float64; huge finite
    values stay finite."""
    gen = torch.Generator().manual_seed(8)
    q, k = make_qk(1, 2, 1, 3, 8, torch.float32, device, gen, "contiguous")
    q = q * 1e30
    q[0, 0, 1, 2] = float("inf")
    q[0, 1, 2, 5] = float("nan")
    k[0, 0, 0, 7] = float("-inf")
    cos, sin = angles((3,), 8, False, device, gen)
    qo, ko = trainops.rotary_embedding(q, k, cos, sin)
    rq, rk = reference(q, k, cos, sin)
    assert_close(qo, rq, torch.float32, "q_out")
    assert_close(ko, rk, torch.float32, "k_out")
    assert qo[0, 0, 0].isfinite().all() and qo.isnan().sum() == rq.isnan().sum() > 0


def test_forced_plans(backend, device):
    """One head a step (the loop over a program's heads), no split of a row's heads, every head its
    own program: all the same result."""
    gen = torch.Generator().manual_seed(9)
    q, k = make_qk(2, 3, 5, 2, 16, torch.float32, device, gen)  # more k heads than q heads: legal
    cos, sin = angles((2, 2), 12, True, device, gen)
    plans = {"one_head_a_step": RotaryHeuristics(tile=8), "no_split": RotaryHeuristics(programs_per_sm=0),
             "split_all": RotaryHeuristics(programs_per_sm=1000, tile=16)}
    seen = {}
    for name, h in plans.items():
        with trainops.heuristics(h):
            check_forward_backward(q, k, cos, sin, torch.float32, name, interleaved=True, rotary_dim=12)
            p = trainops.plan("rotary_embedding", q_shape=q.shape, k_shape=k.shape, cos_shape=cos.shape,
                              dtype=q.dtype, device=q.device, q_strides=q.stride(), k_strides=k.stride(),
                              interleaved=True)
            seen[name] = p.kernel
    if backend == "triton":
        assert seen["one_head_a_step"]["BLOCK_HQ"] == 1
        assert seen["no_split"]["grid"] == (4, 1)
        assert seen["split_all"]["grid"] == (4, 5) and seen["split_all"]["heads_per_program"] == (1, 1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_gradcheck_float64(backend, device, interleaved):
    gen = torch.Generator().manual_seed(10)
    q, k = make_qk(2, 2, 1, 3, 6, torch.float64, device, gen)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = angles((5,), 4, interleaved, device, gen, torch.float64)
    cos = cos + 0.1 * torch.rand(cos.shape, generator=gen, dtype=torch.float64).to(device)  # not duplicated
    sin = sin + 0.1 * torch.rand(sin.shape, generator=gen, dtype=torch.float64).to(device)
    pos = torch.tensor([[4, 0, 2], [1, 1, 3]], device=device)

    def f(q, k):
        return trainops.rotary_embedding(q, k, cos, sin, position_ids=pos, interleaved=interleaved)
    # the interpreter takes ~10 ms a program: random projections of the Jacobians (fast_mode) there
    fast = backend == "triton"
    with trainops.heuristics(RotaryHeuristics(programs_per_sm=0)):
        assert torch.autograd.gradcheck(f, (q, k), fast_mode=fast)
        assert torch.autograd.gradgradcheck(f, (q, k), fast_mode=fast)


def test_torch_compile_fullgraph(backend, device):
    gen = torch.Generator().manual_seed(11)
    q, k = make_qk(2, 4, 2, 3, 8, torch.float32, device, gen)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = angles((7,), 8, False, device, gen)
    pos = torch.tensor([[0, 3, 6], [2, 2, 1]], device=device)

    def f(q, k):
        qo, ko = trainops.rotary_embedding(q, k, cos, sin, position_ids=pos)
        return (qo * qo).sum() + (ko * torch.arange(8.0, device=device)).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k)
    grads = torch.autograd.grad(loss, (q, k))
    torch._dynamo.reset()
    eager_loss = f(q, k)
    eager_grads = torch.autograd.grad(eager_loss, (q, k))
    assert_close(loss, eager_loss, torch.float32, "loss")
    for got, want in zip(grads, eager_grads):
        assert_close(got, want, torch.float32, "grad")


def test_plan_api(backend, device):
    gen = torch.Generator().manual_seed(12)
    q, k = make_qk(1, 2, 1, 3, 8, torch.float32, device, gen, "contiguous")
    cos, sin = angles((3,), 8, False, device, gen)
    p = trainops.plan("rotary_embedding", q_shape=q.shape, k_shape=k.shape, cos_shape=cos.shape, dtype=q.dtype,
                      device=device)
    assert p.precision.bitwise_reproducible and p.precision.accumulator == torch.float32
    qo, ko = p.run(q, k, cos, sin, None)
    rq, rk = reference(q, k, cos, sin)
    assert_close(qo, rq, torch.float32, "plan q")
    assert_close(ko, rk, torch.float32, "plan k")
    assert not p.can_implement(q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin, None)
    assert not p.can_implement(q, k, cos, sin.double(), None)
    assert not p.can_implement(q, k, cos, sin, torch.zeros(1, 3, dtype=torch.long, device=device))


# ---- errors: named, before anything is written -------------------------------------------------------

def test_errors_name_the_argument():
    gen = torch.Generator().manual_seed(13)
    q, k = make_qk(2, 4, 2, 3, 8, torch.float32, "cpu", gen)
    cos, sin = angles((2, 3), 8, False, "cpu", gen)
    table_c, table_s = angles((10,), 8, False, "cpu", gen)
    pos = torch.zeros(2, 3, dtype=torch.long)
    rot = trainops.rotary_embedding
    cases = [
        (lambda: rot("q", k, cos, sin), InvalidProblemError, "'q' must be a torch.Tensor"),
        (lambda: rot(q, k, cos, sin, position_ids=[0, 1, 2]), InvalidProblemError, "'position_ids' must be a torch"),
        (lambda: rot(q.int(), k, cos, sin), UnsupportedError, "'q' has dtype torch.int32"),
        (lambda: rot(q, k.long(), cos, sin), UnsupportedError, "'k' has dtype torch.int64"),
        (lambda: rot(q, k, cos.int(), sin), UnsupportedError, "'cos' has dtype torch.int32"),
        (lambda: rot(q, k.double(), cos, sin), InvalidProblemError, "'k' has dtype torch.float64"),
        (lambda: rot(q[0], k, cos, sin), InvalidProblemError, "'q' has shape"),
        (lambda: rot(q, k[:1], cos, sin), InvalidProblemError, "'k' has shape"),
        (lambda: rot(q, k[:, :, :2], cos, sin), InvalidProblemError, "'k' has shape"),
        (lambda: rot(q, k[..., :6], cos, sin), InvalidProblemError, "'k' has shape"),
        (lambda: rot(q, k, cos[:, :2], sin[:, :2]), InvalidProblemError, "'cos' has shape"),
        (lambda: rot(q, k, cos[None], sin[None]), InvalidProblemError, "'cos' has shape"),
        (lambda: rot(q, k, cos, sin[:1]), InvalidProblemError, "'sin' has shape"),
        (lambda: rot(q, k, cos, sin.double()), InvalidProblemError, "'sin' has shape"),
        (lambda: rot(q, k, cos[..., :7], sin[..., :7]), InvalidProblemError, "'rotary_dim' is 7"),
        (lambda: rot(q, k, cos, sin, rotary_dim=7), InvalidProblemError, "'rotary_dim' is 7"),
        (lambda: rot(q[..., :6], k[..., :6], cos, sin), InvalidProblemError, "'rotary_dim' is 8"),
        (lambda: rot(q, k, cos, sin, rotary_dim=6), InvalidProblemError, "'cos' has 8 features"),
        (lambda: rot(q, k, cos, sin, rotary_dim=8.0), InvalidProblemError, "'rotary_dim' must be an int"),
        (lambda: rot(q, k, table_c, table_s, position_ids=pos.float()), InvalidProblemError,
         "'position_ids' has dtype torch.float32"),
        (lambda: rot(q, k, table_c, table_s, position_ids=pos.short()), UnsupportedError,
         "'position_ids' has dtype torch.int16"),
        (lambda: rot(q, k, table_c, table_s, position_ids=pos[:, :2]), InvalidProblemError, "'position_ids' has shape"),
        (lambda: rot(q, k, table_c, table_s, position_ids=pos[None]), InvalidProblemError, "'position_ids' has shape"),
        (lambda: rot(q, k, cos, sin, position_ids=pos), InvalidProblemError, "'cos' has shape"),
        (lambda: rot(q, k, table_c, table_s, position_ids=pos + 10, check_position_ids=True), IndexOutOfRangeError,
         "'position_ids' holds 10"),
        (lambda: rot(q, k.to("meta"), cos, sin), InvalidProblemError, "'k' is on meta"),
        (lambda: rot(q, k, cos.to("meta"), sin), InvalidProblemError, "'cos' is on meta"),
        (lambda: rot(q, k, table_c, table_s, position_ids=pos.to("meta")), InvalidProblemError,
         "'position_ids' is on meta"),
        (lambda: rot(q, k, cos.requires_grad_(), sin), UnsupportedError, "'cos' requires grad"),
        (lambda: rot(q, k, cos.detach(), sin.detach().requires_grad_()), UnsupportedError, "'sin' requires grad"),
    ]
    for fn, cls, text in cases:
        with pytest.raises(cls) as info:
            fn()
        assert text in str(info.value), str(info.value)
    with torch.no_grad():  # nothing is differentiated: angles that require grad are fine
        rot(q, k, cos.detach().requires_grad_(), sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("positions", [False, True], ids=["cos_rows", "position_ids"])
def test_gpu_real_sizes(dtype, interleaved, positions):
    """q 4x32x2048x128, k 4x8x2048x128 as HF's transposed views; float32 cos / sin as HF computes them."""
    gen = torch.Generator(device="cuda").manual_seed(14)
    b, hq, hk, s, d = 4, 32, 8, 2048, 128
    q = torch.randn(b, s, hq, d, device="cuda", generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hk, d, device="cuda", generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float32, device="cuda") / d))
    if positions:
        freqs = torch.arange(8192, device="cuda", dtype=torch.float32)[:, None] * inv_freq  # (8192, d / 2)
        pos = torch.randint(0, 8192, (b, s), device="cuda", generator=gen)
    else:
        start = torch.randint(0, 4096, (b, 1), device="cuda", generator=gen)
        freqs = (start + torch.arange(s, device="cuda"))[..., None].float() * inv_freq  # (b, s, d / 2)
        pos = None
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    qo, ko = trainops.rotary_embedding(q, k, cos, sin, position_ids=pos, interleaved=interleaved)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = reference(qd, kd, cos, sin, pos, interleaved)
    assert_close(qo, rq, dtype, "q_out")
    assert_close(ko, rk, dtype, "k_out")
    dq_out = torch.randn(qo.shape, device="cuda", generator=gen).to(dtype)
    dk_out = torch.randn(ko.shape, device="cuda", generator=gen).to(dtype)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (dq_out, dk_out))
    rdq, rdk = torch.autograd.grad((rq, rk), (qd, kd), (dq_out.double(), dk_out.double()))
    assert_close(dq, rdq, dtype, "dq")
    assert_close(dk, rdk, dtype, "dk")
    assert dq.stride() == q.stride()
    again = trainops.rotary_embedding(q, k, cos, sin, position_ids=pos, interleaved=interleaved)
    assert torch.equal(again[0], qo) and torch.equal(again[1], ko), "bit-identical run to run"


def test_outputs_of_broadcast_inputs_are_laid_out_as_torch_empty_like(backend, device):
    """An expanded k (a broadcast head axis) gives k_out torch.empty_like's strides, not a permutation."""
    gen = torch.Generator().manual_seed(41)
    q, _ = make_qk(2, 4, 1, 5, 8, torch.float32, device, gen)
    k = torch.randn(2, 1, 5, 8, generator=gen).to(device).expand(2, 4, 5, 8)
    cos, sin = angles((5,), 8, False, device, gen)
    qo, ko = trainops.rotary_embedding(q, k, cos, sin)
    assert ko.stride() == torch.empty_like(k).stride() and qo.stride() == torch.empty_like(q).stride()
    rq, rk = reference(q, k, cos, sin)
    assert_close(ko, rk, torch.float32, "expanded k")
