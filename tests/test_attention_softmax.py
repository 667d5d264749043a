"""The attention softmax (scale, bias, mask, causal, dropout fused): forward and backward, every backend,
against float64 references and SDPA's weights; broadcast and strided layouts; dropout masks; plans forced on
small shapes; errors; torch.compile."""

import math

import pytest
import torch
import torch.nn.functional as torch_F

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import attention_softmax as attn_ops
from trainops.ops.attention_softmax import AttentionSoftmaxHeuristics
from trainops.ops.dropout import draw_seed, keep_mask
from trainops.plan import clear_plan_cache

from numerics import FLOATS, assert_close, interpreter_rounding, poison_new_output

# fully masked rows: the interpreter evaluates 1 / 0 before where() discards it
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")

# small shapes that still force every plan: looped rows, several rows and bias-gradient splits a program
LOOPED = AttentionSoftmaxHeuristics(fused_max=8, chunk=8)
MANY = AttentionSoftmaxHeuristics(forward_tile=32, backward_tile=32, bias_grad_programs_per_sm=8)
PLANS = {"default": AttentionSoftmaxHeuristics(), "looped": LOOPED, "many": MANY}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output trainops allocates starts as NaN, so an element left unwritten fails the test."""
    poison_new_output(monkeypatch, attn_ops.AttentionSoftmaxProblem)
    clear_plan_cache()
    yield
    clear_plan_cache()


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def causal_keep(q_len, k_len, shift, device="cpu"):
    return torch.arange(k_len, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None] + shift


def reference(scores, scale=1.0, mask=None, bias=None, shift=None, keep=None, p=0.0):
    """(out, y) in float64, differentiable: rows with every position masked give zeros (zero gradient)."""
    z = scores.double() * scale
    if bias is not None:
        z = z + bias.double()
    if mask is not None:
        z = z.masked_fill(~mask.to(z.device), float("-inf"))
    if shift is not None:
        z = z.masked_fill(~causal_keep(z.shape[-2], z.shape[-1], shift, z.device), float("-inf"))
    dead = (z == float("-inf")).all(-1, keepdim=True)
    y = torch.softmax(torch.where(dead, 0.0, z), -1)
    y = torch.where(dead, 0.0, y)
    out = y if keep is None else torch.where(keep.to(y.device), y / (1 - p), 0.0)
    return out, y


def call(scores, scale=1.0, mask=None, bias=None, causal=False, **kw):
    return trainops.attention_softmax(scores, scale=scale, mask=mask, bias=bias, causal=causal, **kw)


def _shift(causal, shape):
    return None if causal is False else (shape[-1] - shape[-2] if causal == "lower_right" else 0)


CASES = [  # scores, mask, bias, causal, scale
    ((2, 3, 5, 12), (2, 1, 1, 12), (1, 3, 5, 12), "lower_right", 0.5),
    ((2, 3, 6, 8), None, (2, 1, 1, 8), True, 1 / math.sqrt(8)),
    ((3, 7, 9), (7, 9), (3, 1, 9), False, 2.0),        # k_len % 4 != 0: one Philox call an element
    ((4, 33), (4, 1), (33,), False, -1.0),             # mask (4, 1): whole rows masked
    ((2, 2, 3, 8), None, (2, 1, 3, 8), True, 1.0),     # bias broadcast over heads only
]


def _backward_reference(y, dout, scale, bias_shape):
    """(d scores, d bias) in float64 from the saved (rounded) y, as the backward computes them."""
    y, g = y.double(), dout.double()
    dz = y * (g - (g * y).sum(-1, keepdim=True))
    return dz * scale, dz.sum_to_size(bias_shape)


@pytest.mark.parametrize("dtype, plan", [(d, "default") for d in FLOATS]
                         + [(torch.float32, "looped"), (torch.bfloat16, "many")])
def test_forward_and_backward_match_float64(backend, device, dtype, plan):
    gen = torch.Generator().manual_seed(sum(map(ord, f"{dtype} {plan}")))  # not hash(): salted per process
    with trainops.heuristics(PLANS[plan]):
        for shape, mask_shape, bias_shape, causal, scale in CASES:
            scores = _randn(shape, dtype, device, gen, 2.0).requires_grad_()
            mask = None if mask_shape is None else (torch.rand(mask_shape, generator=gen) > 0.3).to(device)
            bias_dtype = torch.float32 if dtype == torch.float64 else dtype
            bias = _randn(bias_shape, bias_dtype, device, gen).requires_grad_()
            out = call(scores, scale, mask, bias, causal)
            what = f"{shape} mask={mask_shape} bias={bias_shape} causal={causal}"
            ref, _ = reference(scores.detach(), scale, mask, bias.detach(), _shift(causal, shape))
            assert out.dtype == dtype and out.is_contiguous() and out.shape == shape
            assert_close(out, ref, dtype, what)
            dout = _randn(shape, dtype, device, gen)
            ds, db = torch.autograd.grad(out, (scores, bias), dout)
            if dtype.itemsize == 2:  # the backward reads y rounded to 16 bits: the reference does too
                rds, rdb = _backward_reference(out, dout, scale, bias_shape)
            else:
                sd, bd = scores.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
                rds, rdb = torch.autograd.grad(reference(sd, scale, mask, bd, _shift(causal, shape))[0], (sd, bd),
                                               dout.double())
            assert ds.dtype == dtype and db.dtype == bias_dtype and db.shape == bias_shape
            assert_close(ds, rds, dtype, what + " d scores")
            assert_close(db, rdb, torch.float32 if dtype == torch.float64 else dtype, what + " d bias")


def test_strided_expanded_and_many_axis_layouts(backend, device):
    """scores transposed and expanded (read in place), a user-expanded mask and bias (stride 0 on
    axes they have full size on), axes that do not merge (host launches), a strided d out."""
    gen = torch.Generator().manual_seed(1)
    for plan in ("default", "looped", "many"):
        with trainops.heuristics(PLANS[plan]):
            base = _randn((2, 3, 8, 6), torch.float32, device, gen, 2.0)
            scores = base.transpose(-1, -2).requires_grad_()                 # (2, 3, 6, 8), key stride 8
            bias_base = _randn((1, 3, 1, 8), torch.float32, device, gen).requires_grad_()
            bias = bias_base.expand(2, 3, 6, 8)                              # full shape, stride-0 axes
            mask = (torch.rand(1, 1, 6, 8, generator=gen) > 0.2).to(device).expand(2, 3, 6, 8)
            out = call(scores, 0.7, mask, bias, True)
            ref, _ = reference(scores.detach(), 0.7, mask, bias.detach(), 0)
            assert_close(out, ref, torch.float32, f"{plan} transposed")
            dout = _randn((2, 3, 8, 6), torch.float32, device, gen).transpose(-1, -2)
            ds, db = torch.autograd.grad(out, (scores, bias_base), dout)
            sd, bd = scores.detach().double().requires_grad_(), bias_base.detach().double().requires_grad_()
            rds, rdb = torch.autograd.grad(reference(sd, 0.7, mask, bd.expand(2, 3, 6, 8), 0)[0], (sd, bd),
                                           dout.double())
            assert_close(ds, rds, torch.float32, f"{plan} d scores")
            assert_close(db, rdb, torch.float32, f"{plan} d bias")
            # five batch axes in a scrambled order, an expanded one among them: no two merge
            raw = _randn((3, 2, 2, 2, 5), torch.float32, device, gen)
            scores = raw.permute(2, 0, 3, 1, 4)[:, :, :, :, None, :].expand(2, 3, 2, 2, 2, 5).requires_grad_()
            for bias_shape in ((2, 1, 2, 1, 2, 5), (2, 3, 2, 2, 2, 5)):  # the full one: kept rows over host launches
                bias = _randn(bias_shape, torch.float32, device, gen).requires_grad_()
                out = call(scores, 1.0, None, bias)
                assert_close(out, reference(scores.detach(), 1.0, None, bias.detach())[0], torch.float32, "many axes")
                # d out scrambled as scores: the backward's kept rows need host launches too
                dout = _randn((3, 2, 2, 2, 5), torch.float32, device, gen).permute(2, 0, 3, 1, 4)[:, :, :, :, None, :]
                dout = dout.expand(2, 3, 2, 2, 2, 5)
                ds, db = torch.autograd.grad(out, (scores, bias), dout)
                sd, bd = scores.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
                rds, rdb = torch.autograd.grad(reference(sd, 1.0, None, bd)[0], (sd, bd), dout.double())
                assert_close(ds, rds, torch.float32, f"many axes {bias_shape} d scores")
                assert_close(db, rdb, torch.float32, f"many axes {bias_shape} d bias")
    if backend == "triton":
        p = trainops.plan("attention_softmax", shape=(2, 3, 2, 2, 2, 5), dtype=torch.float32, device=device,
                          strides=(scores.stride(),))
        assert p.kernel["host_launches"] > 1
        p = trainops.plan("attention_softmax_backward", shape=(2, 3, 2, 2, 2, 5), dtype=torch.float32, device=device,
                          strides=(scores.stride(), out.stride()), bias_shape=(2, 3, 2, 2, 2, 5),
                          bias_dtype=torch.float32)
        assert p.kernel["host_launches"] > 1


@pytest.mark.filterwarnings("ignore:Lower right causal bias:UserWarning")
@pytest.mark.parametrize("causal", [True, "lower_right"])
def test_causal_matches_sdpa_weights(backend, device, causal):
    """SDPA's attention weights (V = identity: the output is the weight matrix): upper left is SDPA's
    is_causal=True, lower right its causal_lower_right bias; also with a boolean attn_mask."""
    from torch.nn.attention.bias import causal_lower_right

    gen = torch.Generator().manual_seed(2)
    for q_len, k_len in ((6, 6), (4, 9), (7, 5)):
        q = _randn((2, 3, q_len, 8), torch.float64, "cpu", gen)
        k = _randn((2, 3, k_len, 8), torch.float64, "cpu", gen)
        v = torch.eye(k_len, dtype=torch.float64).expand(2, 3, k_len, k_len)
        if causal is True:
            weights = torch_F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            weights = torch_F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, k_len))
        ours = call((q @ k.transpose(-1, -2)).to(device), 1 / math.sqrt(8), causal=causal)
        # lower right with q_len > k_len: the first q_len - k_len rows see no key; zeros in ours and in
        # SDPA's fused path (its math reference would give NaN)
        dead = max(0, q_len - k_len) if causal == "lower_right" else 0
        assert torch.equal(ours[..., :dead, :], torch.zeros_like(ours[..., :dead, :]))
        assert (ours[..., dead:, :].sum(-1) > 0.99).all()
        assert_close(ours, torch.nan_to_num(weights, nan=0.0), torch.float64, f"{causal} {q_len}x{k_len}")
    mask = torch.rand(2, 1, 6, 9, generator=gen) > 0.3
    q, k = _randn((2, 3, 6, 8), torch.float64, "cpu", gen), _randn((2, 3, 9, 8), torch.float64, "cpu", gen)
    mask[:, :, :, 0] = True  # no fully masked row (SDPA's math would give NaN)
    weights = torch_F.scaled_dot_product_attention(q, k, torch.eye(9, dtype=torch.float64), attn_mask=mask)
    assert_close(call((q @ k.transpose(-1, -2)).to(device), 1 / math.sqrt(8), mask.to(device)), weights,
                 torch.float64, "bool attn_mask")


def test_fully_masked_rows_and_special_values(backend, device):
    for plan in ("default", "looped"):
        with trainops.heuristics(PLANS[plan]):
            scores = torch.randn(3, 4, 10, device=device).requires_grad_()
            mask = torch.ones(3, 4, 10, dtype=torch.bool, device=device)
            mask[1, 2] = False          # one row fully masked by the mask
            scores_inf = scores.detach().clone()
            scores_inf[2, 0] = float("-inf")   # one row of -inf scores
            scores_inf[0, 1, :5] = float("-inf")
            scores_inf = scores_inf.requires_grad_()
            out = call(scores_inf, 1.0, mask)
            assert not out.isnan().any()
            assert torch.equal(out[1, 2], torch.zeros(10, device=device))
            assert torch.equal(out[2, 0], torch.zeros(10, device=device))
            assert torch.equal(out[0, 1, :5], torch.zeros(5, device=device))
            assert_close(out, reference(scores_inf.detach(), 1.0, mask)[0], torch.float32, plan)
            ds, = torch.autograd.grad(out, scores_inf, torch.randn_like(out))
            assert torch.equal(ds[1, 2], torch.zeros(10, device=device)) and not ds.isnan().any()
            assert torch.equal(ds[2, 0], torch.zeros(10, device=device))
            # huge scores: max-subtracted, as torch's softmax
            huge = torch.randn(4, 12, device=device) * 1e37
            assert_close(call(huge, 2.0), torch.softmax(huge.double() * 2.0, -1), torch.float32, "huge")
            # NaN poisons its row only; +inf gives a NaN row (inf - inf), as torch
            x = torch.randn(3, 8, device=device)
            x[1, 3] = float("nan")
            x[2, 5] = float("inf")
            y = call(x)
            assert torch.equal(y.isnan(), torch.softmax(x, -1).isnan())
            assert_close(y[0], torch.softmax(x[0].double(), -1), torch.float32, "row 0")


def test_bias_broadcast_along_the_keys(backend, device):
    """A bias of one value per row (last axis 1) shifts the row: out is unchanged and its gradient
    sum(dz) = sum(y * g) - sum(y) * sum(g * y) is 0 up to rounding (compared absolutely)."""
    gen = torch.Generator().manual_seed(6)
    for plan in ("default", "looped", "many"):
        with trainops.heuristics(PLANS[plan]):
            s = _randn((2, 2, 3, 8), torch.float32, device, gen).requires_grad_()
            b = _randn((2, 2, 3, 1), torch.float32, device, gen, 5.0).requires_grad_()
            out = call(s, 1.0, None, b, True)
            assert_close(out, reference(s.detach(), 1.0, None, None, 0)[0], torch.float32, plan)
            dout = _randn((2, 2, 3, 8), torch.float32, device, gen)
            ds, db = torch.autograd.grad(out, (s, b), dout)
            assert db.shape == b.shape and db.abs().max() < 1e-6 * dout.abs().max()
            sd = s.detach().double().requires_grad_()
            rds, = torch.autograd.grad(reference(sd, 1.0, None, None, 0)[0], (sd,), dout.double())
            assert_close(ds, rds, torch.float32, plan)


def test_empty_length_one_and_rank_one(backend, device):
    for shape in ((0, 3, 4), (2, 3, 0), (2, 0, 5)):
        s = torch.randn(shape, device=device, requires_grad=True)
        b = torch.randn(shape[-1:], device=device, requires_grad=True)
        y = call(s, 1.0, None, b)
        assert y.shape == shape
        ds, db = torch.autograd.grad(y.sum(), (s, b))
        assert ds.shape == shape and torch.equal(db, torch.zeros_like(b))
    s = torch.randn(5, 1, device=device)
    assert torch.equal(call(s), torch.ones(5, 1, device=device))
    s = torch.randn(7, device=device, dtype=torch.float64)
    assert_close(call(s, 0.5), torch.softmax(s * 0.5, 0), torch.float64, "rank 1")


def test_gradcheck_float64(backend, device):
    """Full Jacobians on the CPU backend; the interpreted kernels (slow) in gradcheck's fast mode."""
    gen = torch.Generator().manual_seed(3)
    s = _randn((2, 2, 3, 5), torch.float64, device, gen).requires_grad_()
    b = _randn((2, 1, 1, 5), torch.float64, device, gen).requires_grad_()
    r = _randn((3, 1), torch.float64, device, gen).requires_grad_()
    mask = (torch.rand(2, 1, 3, 5, generator=gen) > 0.3).to(device)
    mask[:, :, :, 0] = True
    fast = backend == "triton"
    for plan in ("default", "looped", "many"):
        with trainops.heuristics(PLANS[plan]):
            assert torch.autograd.gradcheck(lambda s, b: call(s, 0.8, mask, b, "lower_right"), (s, b), fast_mode=fast)
            assert torch.autograd.gradcheck(lambda s, r: call(s, -1.5, None, r, True), (s, r), fast_mode=fast)


def test_bias_gradient_bit_identical_and_frozen_bias(backend, device):
    from trainops.plan import _PLANS
    gen = torch.Generator().manual_seed(4)
    s = _randn((3, 4, 5, 16), torch.float32, device, gen).requires_grad_()
    b = _randn((1, 4, 1, 16), torch.float32, device, gen).requires_grad_()
    dout = _randn((3, 4, 5, 16), torch.float32, device, gen)
    with trainops.heuristics(MANY):
        first = torch.autograd.grad(call(s, 0.3, None, b), (s, b), dout)
        for _ in range(2):
            again = torch.autograd.grad(call(s, 0.3, None, b), (s, b), dout)
            assert all(torch.equal(x, y) for x, y in zip(first, again))
        if backend == "triton":
            backward = [p for p in _PLANS.values() if p.problem.op == "attention_softmax_backward"]
            assert backward[0].kernel["splits"] > 1  # the partial-row path is the one tested
        clear_plan_cache()
        ds, = torch.autograd.grad(call(s, 0.3, None, b.detach()), (s,), dout)  # frozen bias: no d bias computed
        assert torch.equal(ds, first[0])
        assert [p.problem.bias_shape for p in _PLANS.values() if p.problem.op == "attention_softmax_backward"] == [None]


# ---- dropout -------------------------------------------------------------------------------------

def _keep(shape, seed_gen_seed, p):
    return keep_mask(math.prod(shape), int(draw_seed(torch.Generator().manual_seed(seed_gen_seed))), 0, p).view(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dropout_keeps_exactly_the_rescaled_softmax(backend, device, dtype):
    """out = round(round(y) * float32(1 / (1 - p))) where ops/dropout.py's mask keeps, 0 elsewhere, y
    the softmax the op saves; the mask is the CPU Philox's bit for bit (so CPU == Triton), whatever
    the plan."""
    gen = torch.Generator().manual_seed(5)
    p = 0.3
    for shape in ((2, 3, 4, 12), (3, 5, 7)):   # k_len 12: Philox per 4 lanes; 7: per element
        scores = _randn(shape, dtype, device, gen, 2.0)
        mask = (torch.rand(shape[-2:], generator=gen) > 0.2).to(device)
        bias = _randn(shape[-1:], dtype, device, gen)
        keep = _keep(shape, 7, p).to(device)
        ks = torch.tensor(1 / (1 - p), dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        for plan in ("default", "looped"):
            with trainops.heuristics(PLANS[plan]):
                seed = draw_seed(torch.Generator().manual_seed(7))
                out, y = attn_ops.attention_softmax_op(scores, mask, bias, 0.5, None, p, seed)
                expected = torch.where(keep, interpreter_rounding(y.to(ks.dtype) * ks, dtype) if backend == "triton"
                                       else (y.to(ks.dtype) * ks).to(dtype), torch.zeros((), dtype=dtype))
                assert torch.equal(out, expected), plan
                assert_close(y, reference(scores, 0.5, mask, bias)[0], dtype, f"{plan} y")
                functional = call(scores, 0.5, mask, bias, dropout_p=p, generator=torch.Generator().manual_seed(7))
                assert torch.equal(functional, out)


def test_dropout_statistics_seeds_and_trainops_dropout_mask(backend, device):
    p = 0.3
    scores = torch.randn(32, 256, device=device)
    torch.manual_seed(11)
    out = call(scores, dropout_p=p)
    kept = (out != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / out.numel()), kept
    torch.manual_seed(11)
    assert torch.equal(call(scores, dropout_p=p), out), "torch.manual_seed repeats the mask"
    assert not torch.equal(call(scores, dropout_p=p), out), "a fresh seed each call"
    # trainops.dropout with the same generator state drops the same elements
    with trainops.backend("cpu"):
        ones = torch.ones(32, 256)
        theirs = trainops.dropout(ones, p, generator=torch.Generator().manual_seed(12))
    ours = call(scores, dropout_p=p, generator=torch.Generator().manual_seed(12))
    assert torch.equal(ours.cpu() != 0, theirs != 0)


def test_dropout_gradient_uses_the_forward_mask(backend, device):
    gen = torch.Generator().manual_seed(13)
    p = 0.4
    for plan in ("default", "looped", "many"):
        with trainops.heuristics(PLANS[plan]):
            for shape, bias_shape in (((2, 3, 4, 8), (1, 3, 4, 8)), ((3, 6, 5), (3, 1, 5))):
                scores = _randn(shape, torch.float32, device, gen, 2.0).requires_grad_()
                bias = _randn(bias_shape, torch.float32, device, gen).requires_grad_()
                out = call(scores, 0.6, None, bias, True, dropout_p=p, generator=torch.Generator().manual_seed(14))
                keep = _keep(shape, 14, p)
                assert_close(out, reference(scores.detach(), 0.6, None, bias.detach(), 0, keep, p)[0],
                             torch.float32, f"{plan} {shape}")
                dout = _randn(shape, torch.float32, device, gen)
                ds, db = torch.autograd.grad(out, (scores, bias), dout)
                sd, bd = scores.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
                rds, rdb = torch.autograd.grad(reference(sd, 0.6, None, bd, 0, keep, p)[0], (sd, bd), dout.double())
                assert_close(ds, rds, torch.float32, f"{plan} {shape} d scores")
                assert_close(db, rdb, torch.float32, f"{plan} {shape} d bias")


# ---- torch.compile, plans ------------------------------------------------------------------------------

def test_torch_compile_fullgraph(backend, device):
    """Compiled (fullgraph) against eager without dropout; with dropout, the compiled call repeats
    under torch.manual_seed and matches the float64 reference with the mask it drew. On the CPU
    compiled and eager calls draw the same seeds; on CUDA the compiled call draws its seed on the
    device (ops.dropout.draw_seed), so its mask is not eager's, as torch's own dropout under
    Inductor."""
    gen = torch.Generator().manual_seed(15)
    q = _randn((2, 2, 5, 8), torch.float32, device, gen).requires_grad_()
    k = _randn((2, 2, 7, 8), torch.float32, device, gen).requires_grad_()
    v = _randn((2, 2, 7, 8), torch.float32, device, gen)
    bias = _randn((1, 2, 1, 7), torch.float32, device, gen).requires_grad_()
    mask = (torch.rand(2, 1, 1, 7, generator=gen) > 0.2).to(device)
    scale = 1 / math.sqrt(8)

    def attention(q, k, bias, p):
        w = trainops.attention_softmax(q @ k.transpose(-1, -2), scale=scale, mask=mask, bias=bias,
                                       causal="lower_right", dropout_p=p)
        return (w @ v).square().sum(), w

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    for p in (0.0, 0.25):
        torch.manual_seed(16)
        loss, w = compiled(q, k, bias, p)
        grads = torch.autograd.grad(loss, (q, k, bias))
        torch.manual_seed(16)
        eager_loss, _ = attention(q, k, bias, p)
        eager_grads = torch.autograd.grad(eager_loss, (q, k, bias))
        if p == 0 or device == "cpu":
            assert_close(loss, eager_loss, torch.float32, f"loss p={p}")
            for got, want in zip(grads, eager_grads):
                assert_close(got, want, torch.float32, f"grad p={p}")
        if p == 0:
            continue
        torch.manual_seed(16)
        assert torch.equal(compiled(q, k, bias, p)[1], w), "torch.manual_seed repeats the compiled mask"
        keep = w.detach() != 0
        q64, k64, b64 = (t.detach().double().requires_grad_() for t in (q, k, bias))
        out, y64 = reference(q64 @ k64.transpose(-1, -2), scale, mask, b64, 7 - 5, keep, p)
        dropped = (y64.detach() > 0) & ~keep.to(y64.device)
        assert 0 < dropped.sum() < (y64 > 0).sum(), "some probabilities of unmasked positions dropped, not all"
        ref_loss = (out @ v.double()).square().sum()
        assert_close(loss, ref_loss, torch.float32, f"loss p={p} against float64 with the compiled mask")
        for got, want in zip(grads, torch.autograd.grad(ref_loss, (q64, k64, b64))):
            assert_close(got, want, torch.float32, f"grad p={p} against float64 with the compiled mask")
    torch._dynamo.reset()


def test_plan_api_runs_and_reports_precision(backend, device):
    p = trainops.plan("attention_softmax", shape=(4, 6, 16), dtype=torch.float32, device=device,
                      mask_strides=(0, 16, 1), bias_dtype=torch.float32, bias_strides=(0, 0, 1), scale=0.5,
                      causal_shift=0)
    assert p.precision.accumulator == torch.float32 and p.precision.bitwise_reproducible
    s, b = torch.randn(4, 6, 16, device=device), torch.randn(16, device=device)
    mask = torch.rand(6, 16, device=device) > 0.3
    out, y = p.run(s, mask, b, None)
    assert y.numel() == 0
    assert_close(out, reference(s, 0.5, mask, b, 0)[0], torch.float32, "plan")
    assert not p.can_implement(s, None, b, None)                     # the plan has a mask
    assert not p.can_implement(s, mask.expand(4, 6, 16).contiguous(), b, None)  # other broadcast strides
    assert not p.can_implement(s, mask, b, 3)                        # a seed without dropout


def test_bench_cases_run_on_the_cpu():
    """The benchmark cases (trainops.bench.cases_attention) build, check against their reference and time."""
    from trainops.bench import run_cases
    from trainops.bench.cases_attention import attention_cases

    rows = run_cases(attention_cases("cpu", quick=True), peers=False, ceiling=None, log=lambda *a: None)
    assert {r.impl for r in rows} == {"trainops", "torch"} and len(rows) == 4
    assert all(r.error is not None and r.error < 1e-5 for r in rows), [(r.case, r.impl, r.error) for r in rows]


# ---- errors: named, before anything is written -------------------------------------------------------

def test_errors_name_the_argument():
    s = torch.randn(2, 3, 4, 5)
    cases = [
        (lambda: trainops.attention_softmax("s"), InvalidProblemError, "'scores' must be a torch.Tensor"),
        (lambda: trainops.attention_softmax(s.int()), UnsupportedError, "'scores' has dtype torch.int32"),
        (lambda: trainops.attention_softmax(s, mask=torch.ones(5)), InvalidProblemError, "'mask' has dtype"),
        (lambda: trainops.attention_softmax(s, mask=torch.ones(3, 2, 5, dtype=torch.bool)), InvalidProblemError,
         "'mask' has shape (3, 2, 5), which does not broadcast"),
        (lambda: trainops.attention_softmax(s, mask=torch.ones(1, 2, 3, 4, 5, dtype=torch.bool)),
         InvalidProblemError, "'mask' has shape"),
        (lambda: trainops.attention_softmax(s, mask=torch.ones(5, dtype=torch.bool, device="meta")),
         InvalidProblemError, "'mask' is on meta"),
        (lambda: trainops.attention_softmax(s, mask=[True] * 5), InvalidProblemError, "'mask' must be a torch.Tensor"),
        (lambda: trainops.attention_softmax(s, bias=torch.ones(4, 1, dtype=torch.int64)), UnsupportedError,
         "'bias' has dtype torch.int64"),
        (lambda: trainops.attention_softmax(s, bias=torch.ones(2, 1, 1, 1, 5)), InvalidProblemError,
         "'bias' has shape"),
        (lambda: trainops.attention_softmax(s, bias=torch.ones(3, 4)), InvalidProblemError, "'bias' has shape (3, 4)"),
        (lambda: trainops.attention_softmax(s, bias=torch.ones(5, device="meta")), InvalidProblemError,
         "'bias' is on meta"),
        (lambda: trainops.attention_softmax(s, dropout_p=1.0), InvalidProblemError, "'dropout_p' must be a number in"),
        (lambda: trainops.attention_softmax(s, dropout_p=-0.1), InvalidProblemError, "'dropout_p'"),
        (lambda: trainops.attention_softmax(s, dropout_p="0.1"), InvalidProblemError, "'dropout_p'"),
        (lambda: trainops.attention_softmax(s, scale=float("inf")), InvalidProblemError, "'scale' must be a finite"),
        (lambda: trainops.attention_softmax(s, scale=float("nan")), InvalidProblemError, "'scale'"),
        (lambda: trainops.attention_softmax(s, scale=None), InvalidProblemError, "'scale'"),
        (lambda: trainops.attention_softmax(s, causal="upper"), InvalidProblemError, "'causal' must be a bool"),
        (lambda: trainops.attention_softmax(torch.randn(5), causal=True), InvalidProblemError, "'causal' needs"),
        (lambda: trainops.attention_softmax(s, dropout_p=0.1, generator=3), InvalidProblemError, "'generator'"),
        (lambda: trainops.attention_softmax(torch.randn([1] * 9)), UnsupportedError, "'scores' has rank 9"),
        (lambda: attn_ops.attention_softmax_op(s, None, None, 1.0, None, 0.5, None), InvalidProblemError, "'seed'"),
        (lambda: attn_ops.attention_softmax_op(s, None, None, 1.0, None, 0.5, torch.tensor(-1)), InvalidProblemError,
         "'seed' must be in"),
        (lambda: trainops.plan("attention_softmax", shape=(3, 4), dtype=torch.float32, device="cpu",
                               bias_dtype=torch.float32), InvalidProblemError, "'bias_strides'"),
        (lambda: trainops.plan("attention_softmax", shape=(3, 4), dtype=torch.float32, device="cpu", heuristics=1),
         InvalidProblemError, "'heuristics'"),
        (lambda: trainops.plan("attention_softmax_backward", shape=(3, 4), dtype=torch.float32, device="cpu",
                               bias_shape=(2, 4), bias_dtype=torch.float32), InvalidProblemError, "'bias_shape'"),
    ]
    for fn, cls, text in cases:
        with pytest.raises(cls) as info:
            fn()
        assert text in str(info.value), str(info.value)
    # nothing was written: a failed call leaves a caller's tensors as they were
    before = s.clone()
    with pytest.raises(InvalidProblemError):
        trainops.attention_softmax(s, bias=torch.ones(3, 2, 5))
    assert torch.equal(s, before)


def test_double_backward_raises(backend, device):
    s = torch.randn(3, 5, device=device, dtype=torch.float64, requires_grad=True)
    y = call(s, 0.5)
    with pytest.raises(UnsupportedError, match="double backward"):
        torch.autograd.grad((y * y).sum(), s, create_graph=True)


# ---- GPU, real sizes -------------------------------------------------------------------------------

def _chunked_reference(scores, scale, mask, bias, shift):
    """float64 reference of (4, 16, 1024, 1024)-sized problems, one batch at a time (mask and bias
    of batch size); the 2 GB result stays on the GPU."""
    return torch.cat([reference(scores[i:i + 1], scale, mask[i:i + 1], bias[i:i + 1], shift)[0]
                      for i in range(scores.shape[0])])


@pytest.mark.gpu
@pytest.mark.parametrize("bias_grad", [False, True])
def test_gpu_causal_with_padding_bias(bias_grad):
    gen = torch.Generator(device="cuda").manual_seed(20)
    b, h, n = 4, 16, 1024
    scores = (torch.randn(b, h, n, n, device="cuda", generator=gen) * 8).to(torch.bfloat16).requires_grad_()
    bias = torch.zeros(b, 1, 1, n, device="cuda", dtype=torch.bfloat16)
    bias[1, ..., 900:] = float("-inf")     # padding as an additive bias
    bias[2] = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    bias.requires_grad_(bias_grad)
    padding = torch.ones(b, 1, 1, n, dtype=torch.bool, device="cuda")
    padding[3, ..., 1000:] = False         # padding as a boolean mask
    scale = 1 / math.sqrt(128)
    out = call(scores, scale, padding, bias, True)
    assert_close(out, _chunked_reference(scores.detach(), scale, padding, bias.detach(), 0), torch.bfloat16, "out")
    dout = torch.randn(b, h, n, n, device="cuda", generator=gen).to(torch.bfloat16)
    leaves = (scores, bias) if bias_grad else (scores,)
    grads = torch.autograd.grad(out, leaves, dout)
    for i in range(b):  # float64, one batch at a time, from the saved bf16 y (what a bf16 backward can do)
        rds, rdb = _backward_reference(out[i:i + 1], dout[i:i + 1], scale, (1, 1, 1, n))
        assert_close(grads[0][i:i + 1], rds, torch.bfloat16, f"d scores {i}")
        if bias_grad:
            assert_close(grads[1][i:i + 1], rdb, torch.bfloat16, f"d bias {i}")
    again = torch.autograd.grad(call(scores, scale, padding, bias, True), leaves, dout)
    assert all(torch.equal(x, y) for x, y in zip(grads, again)), "bit-identical run to run"


@pytest.mark.gpu
@pytest.mark.parametrize("k_len", [1000, 1001])
def test_gpu_dropout_mask_is_the_cpu_philox(k_len):
    p = 0.1
    scores = torch.randn(2, 4, 64, k_len, device="cuda")
    seed = draw_seed(torch.Generator().manual_seed(21))
    out, y = attn_ops.attention_softmax_op(scores, None, None, 0.5, None, p, seed)
    keep = _keep(scores.shape, 21, p)
    assert torch.equal(out.cpu() != 0, keep)
    assert torch.equal(out, torch.where(keep.cuda(), y * torch.tensor(1 / (1 - p), dtype=torch.float32), 0.0))
    assert_close(y, reference(scores, 0.5)[0], torch.float32, "y")


@pytest.mark.gpu
def test_gpu_long_rows_and_fp32():
    gen = torch.Generator(device="cuda").manual_seed(22)
    for shape in ((2, 4, 64, 20000), (8, 128, 4096)):
        scores = torch.randn(shape, device="cuda", generator=gen).requires_grad_()
        bias = torch.randn(shape[-1], device="cuda", generator=gen).requires_grad_()
        out = call(scores, 0.3, None, bias)
        assert_close(out, reference(scores.detach(), 0.3, None, bias.detach())[0], torch.float32, f"{shape}")
        dout = torch.randn(shape, device="cuda", generator=gen)
        ds, db = torch.autograd.grad(out, (scores, bias), dout)
        sd, bd = scores.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
        rds, rdb = torch.autograd.grad(reference(sd, 0.3, None, bd)[0], (sd, bd), dout.double())
        assert_close(ds, rds, torch.float32, f"{shape} d scores")
        assert_close(db, rdb, torch.float32, f"{shape} d bias")
