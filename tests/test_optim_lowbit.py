"""Low-bit optimizer states (optim_bits=8) and stochastic rounding, against plain-torch references."""

import copy
import math

import pytest
import torch

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import lowbit_optimizers as lowbit
from trainops.ops.multi_tensor import MultiTensorHeuristics
from trainops.registry import triton_interpreting

from numerics import relative_error

# ----------------------------------------------------------------------------------------------
# The reference quantiser: the codes' value table enumerated from their definition (float64), and
# the nearest table value found by search (ties go up), written without the library's bit tricks.
# ----------------------------------------------------------------------------------------------


def reference_table(exponent_bits, mantissa_bits):
    """The magnitude of every code, in code order (float64)."""
    groups, steps = 2 ** exponent_bits, 2 ** mantissa_bits
    emin = 1 - groups
    values = []
    for group in range(groups):
        for mantissa in range(steps):
            if group == 0:
                values.append(mantissa / steps * 2.0 ** emin)
            else:
                values.append((1 + mantissa / steps) * 2.0 ** (group - 1 + emin))
    return torch.tensor(values, dtype=torch.float64)


def reference_quantize(x, exponent_bits, mantissa_bits, signed):
    """(codes, scales) of x: rows = dim 0 (1-D: one row), chunks of 256 along each row."""
    table = reference_table(exponent_bits, mantissa_bits)
    top = table[-1].item()
    rows = x.shape[0] if x.dim() >= 2 else 1
    flat = x.reshape(rows, -1).double()
    codes = torch.zeros(flat.shape, dtype=torch.int64)
    chunks = math.ceil(flat.shape[1] / 256)
    scales = torch.zeros(rows, chunks, dtype=torch.float64)
    for r in range(rows):
        for c in range(chunks):
            block = flat[r, c * 256:(c + 1) * 256]
            scale = torch.tensor(block.abs().max().item(), dtype=torch.float32) * torch.tensor(1 / top, dtype=torch.float32)
            scales[r, c] = scale.item()
            a = block.abs() / scale.double() if scale > 0 else torch.zeros_like(block)
            # nearest table value, ties up: the last index whose value <= a + half the gap above it
            index = torch.searchsorted(table, a, right=True).clamp(1, len(table)) - 1
            upper = index.clamp(max=len(table) - 2) + 1
            go_up = (index < len(table) - 1) & (a - table[index] >= table[upper] - a)
            index = torch.where(go_up, upper, index)
            if signed:
                index = index | ((block < 0).long() << (exponent_bits + mantissa_bits))
            codes[r, c * 256:(c + 1) * 256] = index
    return codes.reshape(x.shape), scales


def reference_dequantize(codes, scales, exponent_bits, mantissa_bits, signed):
    table = reference_table(exponent_bits, mantissa_bits)
    bits = exponent_bits + mantissa_bits
    rows = codes.shape[0] if codes.dim() >= 2 else 1
    k = codes.reshape(rows, -1).long()
    value = table[k & ((1 << bits) - 1)]
    if signed:
        value = torch.where((k >> bits) & 1 == 1, -value, value)
    column_scale = scales.double().repeat_interleave(256, dim=1)[:, :k.shape[1]]
    return (value * column_scale).reshape(codes.shape)


M_CODE = (4, 3, True)
V_CODE = (4, 4, False)
SHAPES = [(5, 300), (3, 256), (7, 40), (2, 3, 100), (1, 600)]


def random_moments(shape, gen):
    """Moments spanning several orders of magnitude, as a trained model's do."""
    m = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2) * 1e-2
    v = (torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2) * 1e-2).square()
    return m, v


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_matches_reference_codes(shape):
    gen = torch.Generator().manual_seed(0)
    m, v = random_moments(shape, gen)
    m[0].zero_()  # an all-zero row: scale 0, codes 0
    for x, code, ours in ((m, M_CODE, lowbit.EXP_AVG_CODE), (v.sqrt(), V_CODE, lowbit.EXP_AVG_SQ_CODE)):
        codes, scales = lowbit.quantize(x, ours)
        ref_codes, ref_scales = reference_quantize(x, *code)
        assert codes.dtype == torch.uint8 and codes.shape == x.shape and codes.is_contiguous()
        assert scales.shape == lowbit.scale_shape(shape) and scales.dtype == torch.float32
        assert torch.equal(scales.double(), ref_scales)
        assert torch.equal(codes.long(), ref_codes)
        assert torch.equal(lowbit.dequantize(codes, scales, ours), reference_dequantize(codes, scales, *code).float())


@pytest.mark.parametrize("code", [M_CODE, V_CODE], ids=["exp_avg", "sqrt_exp_avg_sq"])
def test_quantization_error_bound(code):
    """|x - q(x)| <= 2^-(M+1) |x| (normal range) + 2^(emin-M-1) * scale (the linear range below)."""
    exponent_bits, mantissa_bits, signed = code
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1000, generator=gen) * torch.exp(torch.randn(64, 1000, generator=gen) * 3)
    if not signed:
        x = x.abs()
    ours = lowbit.BlockCode(exponent_bits, mantissa_bits, signed)
    codes, scales = lowbit.quantize(x, ours)
    back = lowbit.dequantize(codes, scales, ours).double()
    scale = scales.double().repeat_interleave(256, dim=1)[:, :1000]
    emin = 1 - 2 ** exponent_bits
    bound = 2.0 ** -(mantissa_bits + 1) * x.double().abs() * (1 + 1e-6) + 2.0 ** (emin - mantissa_bits - 1) * scale
    assert ((back - x.double()).abs() <= bound).all()
    assert (back.sign() * x.sign() >= 0).all()
    nan = x.clone()
    nan[3, 5] = float("nan")
    _, nan_scales = lowbit.quantize(nan, ours)
    assert nan_scales[3, 0].isnan() and not nan_scales[2].isnan().any()


# ----------------------------------------------------------------------------------------------
# One step against a float64 reference
# ----------------------------------------------------------------------------------------------

def _adam64(p, g, m, v, t, lr, b1, b2, eps, wd, decoupled):
    p, g = p.double(), g.double()
    if decoupled:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr / (1 - b1 ** t) * m / (v.sqrt() / math.sqrt(1 - b2 ** t) + eps)
    return p, m, v


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("blocks", ["default", "one-chunk-a-program"])
def test_8bit_step_matches_float64_reference(decoupled, blocks, backend, device):
    gen = torch.Generator().manual_seed(2)
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.99, 1e-8, 0.1
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    states = [lowbit.quantize_moments(*random_moments(s, gen)) for s in SHAPES]
    steps = [torch.tensor(4.0) for _ in SHAPES]
    ref = []
    for p, g, s in zip(params, grads, states):
        m0 = reference_dequantize(s["exp_avg_codes"], s["exp_avg_scales"], *M_CODE)
        v0 = reference_dequantize(s["exp_avg_sq_codes"], s["exp_avg_sq_scales"], *V_CODE).square()
        ref.append(_adam64(p, g, m0, v0, 5, lr, b1, b2, eps, wd, decoupled))
    ours = [p.clone().to(device) for p in params]
    st = [{k: t.clone().to(device) for k, t in s.items()} for s in states]
    heuristics = MultiTensorHeuristics(block=256) if blocks != "default" else MultiTensorHeuristics()
    with trainops.heuristics(heuristics):
        lowbit.prepare_adam_lowbit_step(
            ours, [g.to(device) for g in grads], [s["exp_avg_codes"] for s in st], [s["exp_avg_sq_codes"] for s in st],
            [s["exp_avg_scales"] for s in st], [s["exp_avg_sq_scales"] for s in st], [t.to(device) for t in steps],
            lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, decoupled=decoupled, maximize=False)()
    for p, s, (p64, m64, v64), shape in zip(ours, st, ref, SHAPES):
        assert relative_error(p.cpu() - params[SHAPES.index(shape)], p64 - params[SHAPES.index(shape)].double()) < 1e-5
        m = reference_dequantize(s["exp_avg_codes"].cpu(), s["exp_avg_scales"].cpu(), *M_CODE)
        root = reference_dequantize(s["exp_avg_sq_codes"].cpu(), s["exp_avg_sq_scales"].cpu(), *V_CODE)
        # m rounds to nearest (half a step), sqrt(v) stochastically (up to a whole step)
        for new, exact, code, steps in ((m, m64, M_CODE, 0.5), (root, v64.sqrt(), V_CODE, 1.0)):
            scale = new.abs().reshape(new.shape[0], -1).amax(dim=1).view(-1, *[1] * (new.dim() - 1))
            bound = steps * 2.0 ** -code[1] * (exact.abs() * 1.001 + 2.0 ** -15 * scale) + 1e-12
            assert ((new - exact).abs() <= bound).all()


@pytest.mark.parametrize("bias_correction", [True, False])
def test_8bit_lamb_matches_float64_reference(bias_correction, backend, device):
    """The stored moments are the float64 ones within the codes' rounding, and the parameters moved
    by lr * ratio * u with u and the trust ratio taken from the stored moments (float64)."""
    gen = torch.Generator().manual_seed(12)
    lr, b1, b2, eps, wd = 0.02, 0.9, 0.99, 1e-6, 0.05
    shapes = SHAPES[:3]
    start = [torch.randn(s, generator=gen) for s in shapes]
    start[1].zero_()   # ||p|| = 0: ratio 1
    grads = [torch.randn(s, generator=gen) for s in shapes]
    init = [lowbit.quantize_moments(*random_moments(s, gen)) for s in shapes]
    params = [p.clone().to(device).requires_grad_() for p in start]
    opt = trainops.optim.LAMB(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, optim_bits=8, min_8bit_size=0,
                              bias_correction=bias_correction)
    for p, g, s in zip(params, grads, init):
        opt.state[p].update({k: t.clone().to(device) for k, t in s.items()})
        opt.state[p]["step"] = torch.tensor(2.0, device=device)
        p.grad = g.to(device)
    opt.step()
    for p, p0, g, s0 in zip(params, start, grads, init):
        s = {k: t.cpu() for k, t in opt.state[p].items()}
        m0 = reference_dequantize(s0["exp_avg_codes"], s0["exp_avg_scales"], *M_CODE)
        v0 = reference_dequantize(s0["exp_avg_sq_codes"], s0["exp_avg_sq_scales"], *V_CODE).square()
        m64, v64 = b1 * m0 + (1 - b1) * g.double(), b2 * v0 + (1 - b2) * g.double().square()
        m = reference_dequantize(s["exp_avg_codes"], s["exp_avg_scales"], *M_CODE)
        root = reference_dequantize(s["exp_avg_sq_codes"], s["exp_avg_sq_scales"], *V_CODE)
        assert ((m - m64).abs() <= 2.0 ** -4 * (m64.abs() * 1.001 + 2.0 ** -15 * m.abs().max()) + 1e-12).all()
        assert ((root - v64.sqrt()).abs() <= 2.0 ** -4 * (v64.sqrt() * 1.001 + 2.0 ** -15 * root.max()) + 1e-12).all()
        bc1, bc2 = (1 - b1 ** 3, 1 - b2 ** 3) if bias_correction else (1.0, 1.0)
        u = (m / bc1) / ((root.square() / bc2).sqrt() + eps) + wd * p0.double()
        ratio = p0.double().norm() / u.norm() if p0.norm() > 0 else 1.0
        assert relative_error(p.detach().cpu() - p0, -lr * ratio * u) < 1e-5


def test_found_inf_writes_nothing(backend, device):
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(4, 300, generator=gen).to(device)
    state = {k: t.to(device) for k, t in lowbit.quantize_moments(*random_moments((4, 300), gen)).items()}
    before = [p.clone()] + [t.clone() for t in state.values()]
    step = torch.tensor(2.0, device=device)
    lowbit.prepare_adam_lowbit_step(
        [p], [torch.randn(4, 300, generator=gen).to(device)], [state["exp_avg_codes"]], [state["exp_avg_sq_codes"]],
        [state["exp_avg_scales"]], [state["exp_avg_sq_scales"]], [step], lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8,
        weight_decay=0.0, decoupled=True, maximize=False)(found_inf=torch.ones((), device=device))
    assert all(torch.equal(a, b) for a, b in zip([p] + list(state.values()), before))
    assert step.item() == 2.0


def test_a_kept_table_still_refuses_stochastic_rounding_on_float32(backend, device):
    """The options are checked at every call, not only when the tensors change: a float32 step
    with a kept table, then the same tensors (fresh gradients) with stochastic rounding: refused."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(4, 300, generator=gen).to(device)
    state = {k: t.to(device) for k, t in lowbit.quantize_moments(*random_moments((4, 300), gen)).items()}
    step = torch.tensor(1.0, device=device)
    table = lowbit.LowbitTable()

    def run(**options):
        lowbit.prepare_adam_lowbit_step(
            [p], [torch.randn(4, 300, generator=gen).to(device)], [state["exp_avg_codes"]],
            [state["exp_avg_sq_codes"]], [state["exp_avg_scales"]], [state["exp_avg_sq_scales"]], [step], lr=0.1,
            beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled=True, maximize=False, table=table,
            **options)()

    run()
    before = p.clone()
    with pytest.raises(InvalidProblemError, match="stochastic_rounding"):
        run(stochastic_rounding=True)
    assert torch.equal(p, before)


# ----------------------------------------------------------------------------------------------
# Blocks on the parameter's global offsets; stochastic rounding
# ----------------------------------------------------------------------------------------------

def _step_parts(parts_p, parts_g, parts_state, steps, offsets, device, sr_seed=None, steps_taken=3):
    for _ in range(steps_taken):
        lowbit.prepare_adam_lowbit_step(
            parts_p, parts_g, [s["exp_avg_codes"] for s in parts_state], [s["exp_avg_sq_codes"] for s in parts_state],
            [s["exp_avg_scales"] for s in parts_state], [s["exp_avg_sq_scales"] for s in parts_state], steps,
            lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False,
            stochastic_rounding=sr_seed is not None, seed=sr_seed or 0, keys=[7] * len(parts_p), offsets=offsets)()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shards_at_unaligned_offsets_step_as_the_whole_tensor(dtype, backend, device):
    """A [10, 300] parameter split along dim 0 as [3, 4, 3] rows (flat offsets 900 and 2100, not
    multiples of 256) steps to the same codes, scales and parameters as the whole (bf16: with
    stochastic rounding, whose indices are the global ones)."""
    gen = torch.Generator().manual_seed(4)
    whole = torch.randn(10, 300, generator=gen).to(dtype).to(device)
    grad = torch.randn(10, 300, generator=gen).to(dtype).to(device)
    state = {k: t.to(device) for k, t in lowbit.quantize_moments(*random_moments((10, 300), gen)).items()}
    rows = [(0, 3), (3, 7), (7, 10)]
    parts_p = [whole[a:b].clone() for a, b in rows]
    parts_state = [{k: t[a:b].clone() for k, t in state.items()} for a, b in rows]
    sr = 11 if dtype == torch.bfloat16 else None
    _step_parts([whole], [grad], [state], [torch.zeros((), device=device)], [0], device, sr)
    _step_parts(parts_p, [grad[a:b] .clone() for a, b in rows], parts_state, [torch.zeros((), device=device)
                                                                            for _ in rows],
                [a * 300 for a, _ in rows], device, sr)
    assert torch.equal(torch.cat(parts_p), whole)
    for key in state:
        assert torch.equal(torch.cat([s[key] for s in parts_state]), state[key]), key


@pytest.mark.parametrize("name, dtype, options", [
    ("adamw8bit", torch.float32, dict(optim_bits=8)),
    ("adamw8bit-bf16-sr", torch.bfloat16, dict(optim_bits=8, stochastic_rounding=True, rounding_seed=7)),
    ("lamb8bit", torch.float32, dict(optim_bits=8)),
])
@pytest.mark.skipif(not triton_interpreting(), reason="the interpreter's one-tile layout against the GPU's tiles, "
                    "on CPU tensors: under the Triton interpreter only")
def test_a_program_in_tiles_steps_as_one_tile(name, dtype, options, monkeypatch):
    """The Triton step's programs loop over tiles of row chunks (the GPU's 2 chunks a tile at 4
    warps: 4 elements a thread); the interpreter runs one tile a program. Both give the same
    parameters, codes and scales (LAMB's trust ratios sum p^2 and u^2 tile by tile: within float32
    rounding). Rows of 512 and 256 (the unmasked loop over 8 chunks, and a short program) and of 700
    (the masked loop)."""
    gen = torch.Generator().manual_seed(9)
    start = [torch.randn(s, generator=gen).to(dtype) for s in [(8, 512), (3, 256), (3, 700)]]
    grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in start]
    cls = trainops.optim.LAMB if name.startswith("lamb") else trainops.optim.AdamW

    def run():
        params = [p.clone().requires_grad_() for p in start]
        groups = [{"params": params[:2]}, {"params": params[2:]}]   # aligned rows / not: two buckets
        opt = cls(groups, lr=1e-2, min_8bit_size=0, **options)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        with trainops.backend("triton"):
            opt.step()
        return [p.detach() for p in params], [opt.state[p] for p in params]

    whole_params, whole_states = run()
    monkeypatch.setattr(lowbit, "INTERPRETED_ELEMENTS_PER_THREAD", lowbit.TILE_ELEMENTS_PER_THREAD)
    tiled_params, tiled_states = run()
    for a, b, sa, sb in zip(whole_params, tiled_params, whole_states, tiled_states):
        if name.startswith("lamb"):
            assert relative_error(b, a) < 1e-6
            assert (sa["exp_avg_codes"] != sb["exp_avg_codes"]).float().mean() < 1e-3
        else:
            assert torch.equal(a, b)
            for key in ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales"):
                assert torch.equal(sa[key], sb[key]), key


def test_stochastic_rounding_bits_do_not_depend_on_the_launch(backend, device):
    """Same seed: the same bits whatever the programs' size; another seed: other bits."""
    gen = torch.Generator().manual_seed(5)
    start = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in [(6, 700), (3, 256)]]
    grads = [torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in start]

    def run(block, seed):
        params = [p.clone().to(device).requires_grad_() for p in start]
        with trainops.heuristics(MultiTensorHeuristics(block=block)):
            opt = trainops.optim.AdamW(params, lr=1e-3, stochastic_rounding=True, rounding_seed=seed, optim_bits=8,
                                       min_8bit_size=0)
            for _ in range(2):
                for p, g in zip(params, grads):
                    p.grad = g.to(device)
                opt.step()
        return [p.detach() for p in params]

    a, b, c = run(2048, 3), run(256, 3), run(2048, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_stochastic_round_is_unbiased_and_pure():
    x = torch.full((1 << 16,), 1.0 + 0.3 * 2.0 ** -7)   # 0.3 of a bfloat16 step above 1
    rounded = lowbit.stochastic_round_bf16(x, seed=1, key=0, step=1)
    assert set(rounded.float().unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    up = (rounded.float() > 1.0).double().mean().item()
    assert abs(up - 0.3) < 4 * math.sqrt(0.3 * 0.7 / x.numel())
    assert torch.equal(rounded, lowbit.stochastic_round_bf16(x, seed=1, key=0, step=1))
    assert not torch.equal(rounded, lowbit.stochastic_round_bf16(x, seed=1, key=0, step=2))
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -2.0])
    out = lowbit.stochastic_round_bf16(special, seed=0, key=0, step=1).float()
    assert out[0].isnan() and out[1] == float("inf") and out[2] == -float("inf") and out[3] == 0 and out[4] == -2


def test_step_rounds_bf16_parameters_without_bias(backend, device):
    """Every element takes the same float32 update (1 - 0.6 of a bfloat16 step below 1): the
    fraction rounded up is 0.4 within 4 standard deviations."""
    n = 1 << 14
    p = torch.ones(16, n // 16, dtype=torch.bfloat16, device=device, requires_grad=True)
    p.grad = torch.ones_like(p)
    opt = trainops.optim.AdamW([p], lr=0.6 * 2.0 ** -8, weight_decay=0.0, eps=0.0, stochastic_rounding=True)
    opt.step()
    up = (p.detach().float() == 1.0).double().mean().item()
    assert set(p.detach().float().unique().tolist()) == {1.0 - 2.0 ** -8, 1.0}
    assert abs(up - 0.4) < 4 * math.sqrt(0.4 * 0.6 / n)


# ----------------------------------------------------------------------------------------------
# The optimizers: which tensors are quantised, state_dict, resume, curves, combinations
# ----------------------------------------------------------------------------------------------

def make_mlp(dtype=torch.float32, seed=0, width=16):
    """32 -> width -> width / 2 -> 1 (width 16: small for the interpreter)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.Tanh(), torch.nn.Linear(width, width // 2),
                               torch.nn.Tanh(), torch.nn.Linear(width // 2, 1)).to(dtype)


_TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(123)) / 4


def teacher_batch(n, gen, noise=0.3):
    """A regression with a noise floor of 0.09: y = sum(sin(x W)) + noise."""
    x = torch.randn(n, 16, generator=gen)
    return x, torch.sin(x @ _TEACHER).sum(1, keepdim=True) + noise * torch.randn(n, 1, generator=gen)


def regression(seed=0, n=512):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=gen)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=gen)
    return x, y


def fit(model, opt, steps, seed=0):
    x, y = regression(seed)
    losses = []
    for step in range(steps):
        batch = slice((step * 64) % 512, (step * 64) % 512 + 64)
        opt.zero_grad()
        loss = (model(x[batch].to(next(model.parameters()).dtype)).float() - y[batch]).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        final = (model(x.to(next(model.parameters()).dtype)).float() - y).square().mean().item()
    return losses, final


def test_which_tensors_keep_float32_state():
    model = make_mlp(width=128)
    opt = trainops.optim.AdamW8bit(model.parameters(), min_8bit_size=5000)
    fit(model, opt, 1)
    kinds = {name: ("8bit" if "exp_avg_codes" in opt.state[p] else str(opt.state[p]["exp_avg"].dtype))
             for name, p in model.named_parameters()}
    assert kinds == {"0.weight": "torch.float32", "0.bias": "torch.float32", "2.weight": "8bit",
                     "2.bias": "torch.float32", "4.weight": "torch.float32", "4.bias": "torch.float32"}
    per_group = trainops.optim.AdamW([{"params": model[0].parameters()},
                                      {"params": model[2].parameters(), "optim_bits": 32}], optim_bits=8, min_8bit_size=0)
    fit(model, per_group, 1)
    assert "exp_avg_codes" in per_group.state[model[0].weight] and "exp_avg" in per_group.state[model[2].weight]
    assert isinstance(opt, trainops.optim.AdamW) and opt.param_groups[0]["optim_bits"] == 8
    assert trainops.optim.Adam8bit(model.parameters()).param_groups[0]["optim_bits"] == 8


@pytest.mark.parametrize("cls, options", [
    ("AdamW", dict(optim_bits=8, min_8bit_size=0)), ("AdamW", dict(optim_bits=8, min_8bit_size=0,
                                                                   stochastic_rounding=True)),
    ("LAMB8bit", dict(min_8bit_size=0, stochastic_rounding=True))], ids=["8bit", "8bit-sr-bf16", "lamb-8bit-sr-bf16"])
def test_state_dict_round_trip_and_resume(cls, options, backend, device):
    """Stop after 3 steps, save, load into a new optimizer: the next 3 steps are the same bits as
    an uninterrupted run's (and the state_dict holds the codes and scales as saved)."""
    dtype = torch.bfloat16 if options.get("stochastic_rounding") else torch.float32
    model = make_mlp(dtype).to(device)
    opt = getattr(trainops.optim, cls)(model.parameters(), lr=1e-2, rounding_seed=5, **options)
    fit(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    fit(model, opt, 3, seed=1)
    resumed = make_mlp(dtype, seed=9).to(device)
    resumed.load_state_dict(saved_model)
    opt2 = getattr(trainops.optim, cls)(resumed.parameters(), lr=1e-2, rounding_seed=5, **options)
    opt2.load_state_dict(saved_opt)
    for i, p in enumerate(resumed.parameters()):
        for key, value in saved_opt["state"][i].items():
            assert opt2.state[p][key].dtype == value.dtype and torch.equal(opt2.state[p][key], value), key
    fit(resumed, opt2, 3, seed=1)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_float32_state_loads_into_8bit_and_back():
    model = make_mlp()
    opt = trainops.optim.AdamW(model.parameters(), lr=1e-2)
    fit(model, opt, 3)
    state32 = copy.deepcopy(opt.state_dict())
    opt8 = trainops.optim.AdamW(model.parameters(), lr=1e-2, optim_bits=8, min_8bit_size=0)
    opt8.load_state_dict(state32)
    fit(model, opt8, 1)
    w = model[0].weight
    assert "exp_avg_codes" in opt8.state[w] and "exp_avg" not in opt8.state[w]
    m, v = lowbit.dequantize_moments(opt8.state[w])
    opt32 = trainops.optim.AdamW(model.parameters(), lr=1e-2)
    opt32.load_state_dict(opt8.state_dict())
    fit(model, opt32, 1)
    assert opt32.state[w]["exp_avg"].dtype == torch.float32 and "exp_avg_codes" not in opt32.state[w]
    assert relative_error(m, state32["state"][0]["exp_avg"]) < 0.5   # one step and 8-bit rounding apart


def test_8bit_training_curve_within_one_percent_of_float32():
    """200 steps of a small MLP on a noisy regression (fresh batches, noise floor 0.09): the mean
    training loss of the last 50 steps and the held-out loss of AdamW8bit (every weight matrix
    quantised), of bf16 parameters with stochastic rounding, and of both, within 1% of float32
    AdamW's (CPU path; benchmarks/curve_optim_lowbit.py runs the GPU curves)."""
    results = {}
    for name, dtype, options in (("float32", torch.float32, {}),
                                 ("8bit", torch.float32, dict(optim_bits=8, min_8bit_size=0)),
                                 ("bf16-sr", torch.bfloat16, dict(stochastic_rounding=True)),
                                 ("bf16-sr-8bit", torch.bfloat16, dict(stochastic_rounding=True, optim_bits=8,
                                                                       min_8bit_size=0))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 1)).to(dtype)
        opt = trainops.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, **options)
        gen, losses = torch.Generator().manual_seed(1), []
        with trainops.backend("cpu"):
            for _ in range(200):
                x, y = teacher_batch(128, gen)
                opt.zero_grad()
                loss = (model(x.to(dtype)).float() - y).square().mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        x, y = teacher_batch(4096, torch.Generator().manual_seed(2))
        with torch.no_grad():
            held_out = (model(x.to(dtype)).float() - y).square().mean().item()
        results[name] = (sum(losses[-50:]) / 50, held_out)
    print(results)
    base = results["float32"]
    for name, (train_loss, held_out) in results.items():
        assert train_loss < base[0] * 1.01 and held_out < base[1] * 1.01, (name, results)


def test_clip_and_skip_inside_the_8bit_step(backend, device):
    """max_grad_norm's clip is the clip of the gradients fed in; an inf gradient skips the step."""
    models = [make_mlp().to(device) for _ in range(2)]
    x, y = regression()
    clipped = trainops.optim.AdamW(models[0].parameters(), lr=1e-2, optim_bits=8, min_8bit_size=0, max_grad_norm=0.05)
    plain = trainops.optim.AdamW(models[1].parameters(), lr=1e-2, optim_bits=8, min_8bit_size=0)
    for step in range(3):
        for model, opt in zip(models, (clipped, plain)):
            opt.zero_grad()
            (model(x[:64].to(device)) - y[:64].to(device)).square().mean().backward()
            if opt is plain:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        assert clipped.grad_norm.item() > 0.05
    for a, b in zip(*(m.parameters() for m in models)):
        assert relative_error(a, b) < 1e-6
    before = [copy.deepcopy(clipped.state_dict()), [p.detach().clone() for p in models[0].parameters()]]
    clipped.zero_grad()
    (models[0](x[:64].to(device)) - y[:64].to(device)).square().mean().backward()
    models[0][0].weight.grad[0, 0] = float("nan")
    clipped.step()
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), before[1]))
    for i, state in before[0]["state"].items():
        for key, value in state.items():
            assert torch.equal(clipped.state_dict()["state"][i][key], value)


def test_bf16_master_weights_with_8bit_states(backend, device):
    """bf16 parameters + float32 masters + 8-bit states: the masters follow a float32-parameter 8-bit run."""
    half, full = make_mlp(torch.bfloat16).to(device), make_mlp().to(device)
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    opts = [trainops.optim.AdamW(half.parameters(), lr=1e-2, optim_bits=8, min_8bit_size=0, master_weights=True),
            trainops.optim.AdamW(full.parameters(), lr=1e-2, optim_bits=8, min_8bit_size=0)]
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        for h, f in zip(half.parameters(), full.parameters()):
            g = torch.randn(h.shape, generator=gen).to(torch.bfloat16).to(device)
            h.grad, f.grad = g, g.float()
        for opt in opts:
            opt.step()
    for h, f in zip(half.parameters(), full.parameters()):
        assert relative_error(opts[0].state[h]["master_param"], f.detach()) < 1e-6


# ----------------------------------------------------------------------------------------------
# Refusals: by name, before anything is made or written
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, error, name", [
    (dict(optim_bits=7), InvalidProblemError, "optim_bits"),
    (dict(optim_bits=4), UnsupportedError, "optim_bits"),
    (dict(optim_bits=True), InvalidProblemError, "optim_bits"),
    (dict(optim_bits=8, min_8bit_size=-1), InvalidProblemError, "min_8bit_size"),
    (dict(optim_bits=8, amsgrad=True), InvalidProblemError, "amsgrad"),
    (dict(optim_bits=8, state_dtype=torch.bfloat16), InvalidProblemError, "state_dtype"),
    (dict(stochastic_rounding=True), InvalidProblemError, "stochastic_rounding"),   # float32 parameters
    (dict(stochastic_rounding="yes"), InvalidProblemError, "stochastic_rounding"),
    (dict(rounding_seed=1.5), InvalidProblemError, "rounding_seed"),
])
def test_bad_options_are_refused_by_name(options, error, name):
    with pytest.raises(error, match=name):
        trainops.optim.AdamW(make_mlp().parameters(), **options)


def test_refusals_on_half_parameters_and_groups():
    half = make_mlp(torch.float16)
    with pytest.raises(InvalidProblemError, match="stochastic_rounding.*float16"):
        trainops.optim.AdamW(half.parameters(), stochastic_rounding=True)
    with pytest.raises(InvalidProblemError, match="stochastic_rounding.*master_weights"):
        trainops.optim.AdamW(make_mlp(torch.bfloat16).parameters(), stochastic_rounding=True, master_weights=True)
    model = make_mlp()
    opt = trainops.optim.AdamW(model[0].parameters(), optim_bits=8)
    with pytest.raises(InvalidProblemError, match=r"param_groups\[1\]\['optim_bits'\]"):
        opt.add_param_group({"params": model[2].parameters(), "optim_bits": 7})
    assert len(opt.param_groups) == 1
    fit_model = make_mlp()
    opt = trainops.optim.AdamW(fit_model.parameters(), optim_bits=8, min_8bit_size=0)
    fit(fit_model, opt, 1)
    before = [p.detach().clone() for p in fit_model.parameters()]
    opt.param_groups[0]["optim_bits"] = 7
    with pytest.raises(InvalidProblemError, match="optim_bits"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(fit_model.parameters(), before))


def test_load_state_dict_refuses_mismatched_scales():
    model = make_mlp()
    opt = trainops.optim.AdamW(model.parameters(), optim_bits=8, min_8bit_size=0)
    fit(model, opt, 1)
    state = opt.state_dict()
    state["state"][0]["exp_avg_scales"] = torch.zeros(3, 3)
    fresh = trainops.optim.AdamW(make_mlp().parameters(), optim_bits=8, min_8bit_size=0)
    with pytest.raises(InvalidProblemError, match="exp_avg_scales"):
        fresh.load_state_dict(state)
    assert not fresh.state


# ----------------------------------------------------------------------------------------------
# GPU: real sizes
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("cls, dtype, options", [
    ("AdamW", torch.float32, dict(optim_bits=8, max_grad_norm=1.0)),
    ("AdamW", torch.bfloat16, dict(optim_bits=8, stochastic_rounding=True)),
    ("AdamW", torch.bfloat16, dict(stochastic_rounding=True)),
    ("LAMB", torch.float32, dict(optim_bits=8))], ids=["adamw-8bit-clip", "adamw-8bit-bf16-sr", "adamw-bf16-sr",
                                                        "lamb-8bit"])
def test_gpu_lowbit_step_matches_cpu_path(cls, dtype, options):
    """Real sizes (rows of 4096, 1000: masked chunks, 768): the GPU kernel against the CPU path,
    3 steps; float32 within 1e-5 (bfloat16 with stochastic rounding: within 1e-2, a float32
    rounding apart may round an element the other way)."""
    gen = torch.Generator().manual_seed(9)
    shapes = [(4096, 4096), (1000, 1000), (50257, 768), (4096,)]
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    results = {}
    for backend, device in (("cpu", "cpu"), ("triton", "cuda")):
        with trainops.backend(backend):
            ps = [p.clone().to(device).requires_grad_() for p in params]
            opt = getattr(trainops.optim, cls)(ps, lr=1e-3, **options)
            for _ in range(3):
                for p, g in zip(ps, grads):
                    p.grad = g.to(device)
                opt.step()
            results[backend] = ([p.detach().cpu() for p in ps], opt.state[ps[0]])
    for a, b in zip(results["cpu"][0], results["triton"][0]):
        assert relative_error(a.float(), b.float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    if options.get("optim_bits") == 8:
        # The two paths agree but where a float32 rounding apart (an FMA, the clip's norm summed in
        # another order) moves a block's scale by an ulp (about 30 % of the blocks on the H200,
        # 2026-11-29) or puts a moment on the other side of a code boundary (under 1e-6 of the
        # codes there, one code step apart). So: codes nearly all equal, scales and dequantised
        # moments within float32 rounding (but for the clip, below).
        cpu_state = {k: v.cpu() for k, v in results["cpu"][1].items() if torch.is_tensor(v)}
        gpu_state = {k: v.cpu() for k, v in results["triton"][1].items() if torch.is_tensor(v)}
        for key in ("exp_avg_codes", "exp_avg_sq_codes"):
            assert (gpu_state[key] != cpu_state[key]).float().mean() < 1e-4, key
        # With the clip, the CPU path follows torch's clip_grad_norm_ (torch.linalg.vector_norm, which
        # on the CPU lost 0.27 % of a 38.6 M-element float32 norm against float64), while the GPU
        # kernel sums in float32 blocks: on the H200 its clip coefficient was float64's to 1e-6, the
        # CPU path's 0.20 % above, and the first moments' block scales 2.0e-3 apart with it.
        clipped = "max_grad_norm" in options
        for key, bound in (("exp_avg_scales", 3e-3 if clipped else 1e-6), ("exp_avg_sq_scales", 6e-3 if clipped else 1e-6)):
            assert relative_error(gpu_state[key], cpu_state[key]) < bound, key
        m_cpu, v_cpu = lowbit.dequantize_moments(cpu_state)
        m_gpu, v_gpu = lowbit.dequantize_moments(gpu_state)
        bound = 3e-3 if clipped else 1e-3
        assert relative_error(m_gpu, m_cpu) < bound and relative_error(v_gpu, v_cpu) < 2 * bound


@pytest.mark.parametrize("base", [0, (1 << 32) - 3, 5 * (1 << 32) + 7], ids=["low", "crossing-2^32", "high"])
def test_kernel_random_bits_are_the_torch_function(base):
    """The Triton hash (interpreter here) and random_bits agree bit for bit, across the 2^32 index word."""
    if not trainops.registry.triton_available():
        pytest.skip("needs Triton")
    import triton
    import triton.language as tl

    @triton.jit
    def bits_kernel(out, stream, base, N: tl.constexpr):
        index = base + tl.arange(0, N).to(tl.int64)
        tl.store(out + tl.arange(0, N), lowbit._random_bits_tl(stream.to(tl.uint32), index).to(tl.int64))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.zeros(64, dtype=torch.int64, device=device)
    bits_kernel[(1,)](out, 123456789, base, N=64)
    assert torch.equal(out.cpu(), lowbit.random_bits(123456789, base + torch.arange(64)))


@pytest.mark.gpu
def test_gpu_8bit_sr_step_captures_in_a_cuda_graph():
    """Two replays of a captured AdamW8bit + stochastic rounding step (lr a device tensor changed
    between them) equal two eager steps from the same state, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
              for s in [(512, 768), (1000, 300), (768,)]]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(torch.bfloat16)
    lr = torch.tensor(1e-3, device="cuda")
    opt = trainops.optim.AdamW(params, lr=lr, optim_bits=8, min_8bit_size=0, stochastic_rounding=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        opt.step()   # warm-up: state, tables and kernels built outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    ref = [p.detach().clone().requires_grad_() for p in params]
    ref_opt = trainops.optim.AdamW(ref, lr=1e-3, optim_bits=8, min_8bit_size=0, stochastic_rounding=True)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for r, p in zip(ref, params):
        r.grad = p.grad.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    graph.replay()
    lr.fill_(5e-4)
    graph.replay()
    ref_opt.step()
    ref_opt.param_groups[0]["lr"] = 5e-4
    ref_opt.step()
    torch.cuda.synchronize()
    for a, b in zip(params, ref):
        assert torch.equal(a, b)
