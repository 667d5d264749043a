"""Fused cross-entropy: loss, logsumexp and gradient against float64 references, every backend."""

import random
import zlib

import pytest
import torch
import torch.nn.functional as F

import trainops
from trainops.ops import cross_entropy as ce_ops
from trainops.plan import clear_plan_cache

from conftest import HAS_CUDA
from numerics import FLOATS, assert_close, interpreter_rounding


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Loss, lse and gradient buffers start as NaN, so anything left unwritten fails."""
    original = ce_ops.CrossEntropyProblem.new_output

    def new_output(self, *args):
        return tuple(t.fill_(float("nan")) if t.is_floating_point() else t for t in original(self, *args))
    monkeypatch.setattr(ce_ops.CrossEntropyProblem, "new_output", new_output)
    clear_plan_cache()
    yield
    clear_plan_cache()


@pytest.fixture(params=["registers", "two-pass", "exchange"])
def row_plan(request):
    """Run with rows in registers, or force a long-row plan with tiny chunks: two-pass streaming, or
    the exchange plan where it applies (class targets, no label smoothing; the rest streams)."""
    if request.param == "registers":
        yield request.param
        return
    tiny = {size: 4 for size in (1, 2, 4, 8)}
    with trainops.heuristics(ce_ops.CrossEntropyHeuristics(
            register_row=tiny, stream_block={size: 8 for size in tiny},
            exchange_block={1: 8, 2: 8, 4: 8} if request.param == "exchange" else {},
            sms=16)):  # up to 16 chunks a row
        yield request.param


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


def reference(x, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0):
    """(loss, lse, dloss/dx) in float64 from torch's own cross_entropy plus the z-loss term."""
    x = x.detach().double().cpu().requires_grad_()
    target = target.cpu()
    target = target.double() if target.is_floating_point() else target.long()
    w = None if weight is None else weight.double().cpu()
    loss = F.cross_entropy(x, target, w, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    lse = torch.logsumexp(x, dim=0 if x.dim() == 1 else 1)
    if z_loss:
        valid = torch.ones_like(lse, dtype=torch.bool) if target.is_floating_point() else target != ignore_index
        z = torch.where(valid, z_loss * lse * lse, 0)
        loss = loss + (z if reduction == "none" else z.sum() / (valid.sum() if reduction == "mean" else 1))
    if x.numel():
        grad, = torch.autograd.grad(loss.sum(), x) if loss.numel() else (torch.zeros_like(x),)
    else:
        grad = torch.zeros_like(x)
    return loss.detach(), lse.detach(), grad


def make_logits(shape, dtype, device, gen, layout="contiguous", scale=3.0):
    if layout == "transposed" and len(shape) == 2:
        base = torch.randn(shape[::-1], generator=gen, dtype=torch.float64) * scale
        return base.to(dtype).to(device).t()
    if layout == "sliced":
        base = torch.randn([s + 3 for s in shape], generator=gen, dtype=torch.float64) * scale
        return base.to(dtype).to(device)[tuple(slice(1, 1 + s) for s in shape)]
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def check(x, target, dtype, what, **options):
    """Loss (forward), gradient (backward with a random upstream scale) and lse against the reference."""
    x = x.detach().requires_grad_()
    loss, lse = trainops.cross_entropy(x, target, **options, return_lse=True)
    ref_options = {k: v for k, v in options.items() if k not in ("loss_dtype", "check_target")}
    ref_loss, ref_lse, ref_grad = reference(x, target, **ref_options)
    assert loss.dtype == options.get("loss_dtype", x.dtype) and loss.shape == ref_loss.shape
    tolerance_dtype = dtype if options.get("loss_dtype") is None else max(dtype, torch.float32, key=_bits)
    assert_close(loss, ref_loss, tolerance_dtype, f"{what}: loss")
    assert_close(lse, ref_lse, torch.float64 if dtype == torch.float64 else torch.float32, f"{what}: lse")
    gen = torch.Generator().manual_seed(seed_of("upstream", what, tuple(x.shape), str(x.dtype)))
    upstream = torch.rand(loss.shape, generator=gen, dtype=torch.float64) + 0.5  # the same whatever ran before
    loss.backward(upstream.to(loss.dtype).to(loss.device))
    expected = ref_grad * (upstream.to(loss.dtype).double().unsqueeze(-1 if x.dim() == 2 else 1)
                           if loss.dim() else upstream.to(loss.dtype).double())
    assert_close(x.grad, expected, dtype, f"{what}: grad")


def _bits(dtype):
    return {torch.float16: 16, torch.bfloat16: 8, torch.float32: 32, torch.float64: 64}[dtype]


# ---- class-index targets ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32])
def test_class_targets_random(backend, device, row_plan, dtype, target_dtype):
    gen = torch.Generator().manual_seed(seed_of(backend, row_plan, dtype, target_dtype))
    rnd = random.Random(gen.initial_seed())
    for trial in range(4):
        rank = rnd.choice([1, 2, 2, 3, 4])
        classes = rnd.randint(1, 40)
        shape = [classes] if rank == 1 else [rnd.randint(1, 6), classes] + [rnd.randint(1, 3) for _ in range(rank - 2)]
        batch = [] if rank == 1 else [shape[0]] + shape[2:]
        x = make_logits(shape, dtype, device, gen, layout=("transposed", "sliced", "contiguous")[trial % 3])
        target = torch.randint(0, classes, batch, generator=gen)
        if target.numel() > 1:
            target.view(-1)[0] = -100
        options = dict(reduction=rnd.choice(["mean", "sum", "none"]), label_smoothing=rnd.choice([0.0, 0.0, 0.15]),
                       z_loss=rnd.choice([0.0, 1e-3]))
        if rnd.random() < 0.5:
            options["weight"] = (torch.rand(classes, generator=gen, dtype=torch.float64) + 0.1).to(dtype).to(device)
        check(x, target.to(target_dtype).to(device), dtype, f"{shape} {options.keys()}", **options)


def test_ignore_index_label_smoothing_and_weights_together(backend, device, row_plan):
    gen = torch.Generator().manual_seed(2)
    x = make_logits([9, 13], torch.float64, device, gen)
    target = torch.tensor([3, 7, 7, 0, 12, 5, 5, 7, 1], device=device)
    weight = torch.rand(13, generator=gen, dtype=torch.float64).to(device)
    for reduction in ("mean", "sum", "none"):
        check(x, target, torch.float64, reduction, weight=weight, ignore_index=7, label_smoothing=0.3,
              reduction=reduction, z_loss=0.01)


def test_loss_dtype_float32_from_bfloat16(backend, device):
    gen = torch.Generator().manual_seed(3)
    x = make_logits([6, 50], torch.bfloat16, device, gen)
    check(x, torch.randint(0, 50, (6,), generator=gen).to(device), torch.bfloat16, "fp32 loss",
          loss_dtype=torch.float32)


def test_extreme_logits(backend, device, row_plan):
    x = torch.tensor([[0.0, float("-inf"), 2.0, 1e4], [-1e4, 3.0, float("-inf"), 0.0]], device=device)
    check(x, torch.tensor([3, 1], device=device), torch.float32, "huge and -inf")
    loss = trainops.cross_entropy(x, torch.tensor([1, 2], device=device), reduction="none")
    assert torch.isinf(loss).all()  # the target's logit is -inf, as torch


def test_every_row_ignored_and_empty_batch(backend, device):
    x = torch.randn(4, 5, device=device, requires_grad=True)
    ignored = torch.full((4,), -100, device=device)
    loss = trainops.cross_entropy(x, ignored)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(x.detach().cpu(), ignored.cpu()))
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert trainops.cross_entropy(x, ignored, reduction="sum").item() == 0
    empty = torch.randn(0, 5, device=device, requires_grad=True)
    target = torch.zeros(0, dtype=torch.long, device=device)
    loss = trainops.cross_entropy(empty, target)
    assert torch.isnan(loss)
    loss.backward()  # an empty training batch: an empty gradient, as torch
    assert empty.grad.shape == (0, 5)
    assert trainops.cross_entropy(empty, target, reduction="none").shape == (0,)


# ---- few long rows split across programs (exchange.fill_tile) --------------------------------------

FEW_ROWS = ce_ops.CrossEntropyHeuristics(sms=8, fill_per_sm=4, fill_min_bytes=256, fill_min_row_bytes=0)  # 3 x 1500: 6 x 256


def few_rows_options(options, gen, dtype):
    """(the call's options, weight=True made a class-weight tensor of 1500 classes; the plan's: all
    but the weight)."""
    options = dict(options)
    if options.pop("weight", False):
        options["weight"] = (torch.rand(1500, generator=gen, dtype=torch.float64) + 0.1).to(dtype)
    return options, {k: v for k, v in options.items() if k != "weight"}


@pytest.mark.parametrize("dtype,layout,options", [
    (torch.float32, "contiguous", dict(reduction="mean", weight=True)),
    (torch.bfloat16, "sliced", dict(reduction="sum", z_loss=1e-3)),
    (torch.float16, "contiguous", dict(reduction="none")),
], ids=str)
def test_few_long_rows_split_across_programs(dtype, layout, options):
    gen = torch.Generator().manual_seed(seed_of("few rows", dtype, layout))
    x = make_logits([3, 1500], dtype, "cpu", gen, layout=layout)
    x[0, 256:768] = float("-inf")   # two whole chunks of -inf: partial max -inf, sum 0, no NaN once merged
    x[2, :1280] = float("-inf")     # only the last chunk has values, the target among them
    target = torch.tensor([1499, -100, 1300])
    options, described = few_rows_options(options, gen, dtype)
    with trainops.backend("triton"), trainops.heuristics(FEW_ROWS):
        kernel = trainops.plan("cross_entropy", shape=x.shape, dtype=dtype, target_dtype=torch.int64,
                               strides=x.stride(), has_weight="weight" in options, **described).kernel
        assert kernel["plan"] == "exchange" and kernel["splits"] == 6 and kernel["BLOCK_C"] == 256, kernel
        assert kernel["num_warps"] == 4 and kernel["per_sm"] == 4, kernel
        check(x, target, dtype, f"few rows {options.keys()}", **options)
        with trainops.heuristics(ce_ops.CrossEntropyHeuristics(sms=8, fill_min_bytes=256, fill_min_row_bytes=0,
                                                               fill_per_sm=0)):
            assert trainops.plan("cross_entropy", shape=x.shape, dtype=dtype, target_dtype=torch.int64,
                                 **described).kernel["plan"] == "fused"   # one row a program, as before
        assert trainops.plan("cross_entropy", shape=(8, 1500), dtype=dtype, target_dtype=torch.int64,
                             **described).kernel["plan"] == "fused"       # as many rows as SMs


@pytest.mark.parametrize("dtype,options", [
    (torch.float32, dict(label_smoothing=0.1, weight=True)),
    (torch.bfloat16, dict(label_smoothing=0.3, z_loss=1e-3, reduction="none")),
], ids=str)
def test_few_long_rows_with_label_smoothing(dtype, options):
    """Label smoothing in the exchange plan (few rows only): the chunks also trade sum_c w_c x_c."""
    gen = torch.Generator().manual_seed(seed_of("few rows, smoothing", dtype))
    x = make_logits([3, 1500], dtype, "cpu", gen)
    target = torch.tensor([3, -100, 1499])
    options, described = few_rows_options(options, gen, dtype)
    with trainops.backend("triton"), trainops.heuristics(FEW_ROWS):
        kernel = trainops.plan("cross_entropy", shape=x.shape, dtype=dtype, target_dtype=torch.int64,
                               has_weight="weight" in options, **described).kernel
        assert kernel["plan"] == "exchange" and kernel["splits"] == 6, kernel
        check(x, target, dtype, f"few rows, label smoothing {options.keys()}", **options)
        # many long rows with label smoothing keep the streaming plans (the exchange was measured without it)
        assert trainops.plan("cross_entropy", shape=(8, 1500), dtype=dtype, target_dtype=torch.int64,
                             **described).kernel["plan"] == "fused"


def test_fill_choices_at_real_sizes():
    """What the H200 (132 SMs) plans for few long rows: (BLOCK_C, chunks a row, warps, programs per SM)."""
    def config(shape, dtype=torch.bfloat16, label_smoothing=0.0, **options):
        problem = ce_ops._describe(shape, dtype, torch.int64, "cpu", label_smoothing=label_smoothing,
                                   heuristics=ce_ops.CrossEntropyHeuristics(sms=132, **{"fill_per_sm": 4, **options}))
        return ce_ops._exchange_config(problem)
    assert config((1, 262144)) == (2048, 128, 4, 4)      # 128 programs, not 8
    assert ce_ops.CrossEntropyHeuristics().fill_per_sm == 4   # the default (H200-measured)
    assert config((16, 65536)) == (2048, 32, 4, 4)       # 512, not 32
    assert config((64, 32768)) == (4096, 8, 8, 4)        # 512, not 64 pipelined ones
    assert config((8, 16000)) == (2048, 8, 4, 4)         # short of half a block: was fused, 8 programs
    assert config((8, 1048576), torch.float32) == (16384, 64, 16, 1)   # 512 chunks already: unchanged
    assert config((8, 1048576)) == (32768, 32, 16, 1)
    assert config((64, 32768), fill_per_sm=0) == (32768, 1, 32, 1)   # pipelined bf16: pipelined_warps
    assert config((200, 32768)) == (32768, 1, 32, 1)     # more rows than SMs
    assert config((8, 16000), fill_per_sm=0) is None
    assert config((8, 8191)) is None                     # rows under 16 KiB: latency-bound, one a program
    assert config((8, 16000), label_smoothing=0.1) == (2048, 8, 4, 4)   # few rows: label smoothing too
    assert config((8, 131072), label_smoothing=0.1) == (2048, 64, 4, 4)
    assert config((512, 131072), label_smoothing=0.1) is None             # many: the two-pass plan
    # 32 rows: 160 exchange programs without label smoothing (unchanged), 32 two-pass ones with it (split)
    assert config((32, 151936)) == (32768, 5, 16, 1)
    assert config((32, 151936), label_smoothing=0.1) == (16384, 10, 16, 4)
    assert config((512, 131072)) == (32768, 4, 16, 1)


# ---- aligned windows (exchange.window): rows off a multiple of 16 elements --------------------------

WINDOW_VEC = {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8}   # elements in 16 bytes
WINDOW_ROWS = 11   # rows of an odd length start at every offset from a 16-byte boundary (8 rows suffice)


@pytest.fixture
def launched_windows(monkeypatch):
    """The VEC each exchange-plan launch ran with (0: the plain chunks), in launch order."""
    seen = []
    original = ce_ops.launch_exchange

    def record(fn, grid, args, meta, device):
        seen.append(meta.get("VEC", 0))
        return original(fn, grid, args, meta, device)
    monkeypatch.setattr(ce_ops, "launch_exchange", record)
    return seen


def window_heuristics(block, **options):
    """The exchange plan at ``block`` classes a chunk (half and float32 logits) on 16 SMs: rows of
    more than block / 2 classes take it, one chunk a row ("pipelined") up to ``block``."""
    return ce_ops.CrossEntropyHeuristics(exchange_block={2: block, 4: block}, sms=16, **options)


def window_logits(rows, classes, dtype, gen, pad=0, edges=True):
    """Logits of ``rows`` rows; ``pad``: the rows of a wider tensor (row stride classes + pad);
    ``edges``: -inf at row 1's first class and row 2's last (in their windows' first and last
    partial vectors)."""
    x = make_logits([rows, classes + pad], dtype, "cpu", gen)[:, :classes]
    if edges:
        x[1, 0] = float("-inf")
        x[2, -1] = float("-inf")
    return x


def window_targets(rows, classes, gen):
    """Class indices with the first class (rows 0 and 5) and the last (rows 3 and 6), ignored rows
    (4 and 9), and rows 1 and 2 off their -inf logits (window_logits)."""
    target = torch.randint(1, classes - 1, (rows,), generator=gen)
    target[[0, 5]] = 0
    target[[3, 6]] = classes - 1
    target[[4, 9]] = -100
    target[1], target[2] = 2, 1
    return target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("classes,block", [(37, 16), (41, 16), (33, 16), (45, 64)])
def test_exchange_plan_aligned_windows(launched_windows, dtype, classes, block):
    """Rows of a length off a multiple of 16 elements (odd, prime, 8k + 1) through the aligned
    windows of the exchange plan (3 chunks of 16 classes a row) and of the pipelined plan (one of
    64): 11 rows, so that the rows start at every offset from a 16-byte boundary; targets in the
    windows' first and last partial vectors and in their bodies, ignored rows (-100 and a class
    index), class weights, z-loss, every reduction, float16's scaled gradient; against float64."""
    gen = torch.Generator().manual_seed(seed_of("windows", dtype, classes, block))
    vec = WINDOW_VEC[dtype]
    x = window_logits(WINDOW_ROWS, classes, dtype, gen)
    target = window_targets(WINDOW_ROWS, classes, gen)
    weight = (torch.rand(classes, generator=gen, dtype=torch.float64) + 0.1).to(dtype)
    with trainops.backend("triton"), trainops.heuristics(window_heuristics(block)):
        kernel = trainops.plan("cross_entropy", shape=x.shape, dtype=dtype, target_dtype=torch.int64,
                               strides=x.stride()).kernel
        assert kernel["plan"] == ("pipelined" if block == 64 else "exchange") and kernel["window"] == vec, kernel
        for t, options in ((target, dict(weight=weight)),
                           (target, dict(reduction="sum", z_loss=1e-3)),
                           (torch.where(target == -100, 7, target), dict(reduction="none", ignore_index=7,
                                                                          weight=weight))):
            launched_windows.clear()
            check(x, t, dtype, f"windows, {classes} classes, {options.keys()}", **options)
            assert launched_windows and set(launched_windows) == {vec}, launched_windows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("classes", [1499, 1497])
def test_few_long_rows_with_label_smoothing_through_windows(launched_windows, dtype, classes):
    """Few long rows (exchange.fill_tile: 6 chunks of 256 a row) of a prime and an 8k + 1 length:
    label smoothing's sum_c w_c x_c and the class weights taken from the windows' three parts."""
    gen = torch.Generator().manual_seed(seed_of("windows, few rows", dtype, classes))
    vec = WINDOW_VEC[dtype]
    x = window_logits(11, classes, dtype, gen, edges=False)   # a -inf logit would make a smoothed loss inf
    target = window_targets(11, classes, gen)
    weight = (torch.rand(classes, generator=gen, dtype=torch.float64) + 0.1).to(dtype)
    heuristics = ce_ops.CrossEntropyHeuristics(sms=32, fill_per_sm=4, fill_min_bytes=256, fill_min_row_bytes=0)
    with trainops.backend("triton"), trainops.heuristics(heuristics):
        for options in (dict(label_smoothing=0.1, weight=weight), dict(label_smoothing=0.3, z_loss=1e-3,
                                                                       reduction="none"),
                        dict(weight=weight, reduction="sum")):
            kernel = trainops.plan("cross_entropy", shape=x.shape, dtype=dtype, target_dtype=torch.int64,
                                   has_weight="weight" in options,
                                   **{k: v for k, v in options.items() if k != "weight"}).kernel
            assert kernel["plan"] == "exchange" and kernel["splits"] == 6 and kernel["BLOCK_C"] == 256, kernel
            assert kernel["window"] == vec, kernel
            launched_windows.clear()
            check(x, target, dtype, f"few rows through windows {options}", **options)
            assert launched_windows == [vec], launched_windows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aligned_windows_only_where_they_fit(launched_windows, dtype):
    """Windows need logits and gradient rows at one offset from a 16-byte boundary, unit class
    stride, 16-byte aligned pointers (else the call runs the plain chunks of the same plan), no
    more chunks than the plain plan, and rows that the plain chunks would not keep aligned;
    ``aligned_windows=False`` turns them off. Every case against float64."""
    vec = WINDOW_VEC[dtype]
    gen = torch.Generator().manual_seed(seed_of("windows where they fit", dtype))
    flat = make_logits([WINDOW_ROWS * 37 + 1], dtype, "cpu", gen)
    cases = [  # (what, logits, heuristics' options, the plan's window, the launches' VEC)
        ("packed rows", window_logits(WINDOW_ROWS, 37, dtype, gen), {}, vec, vec),
        ("rows a whole number of vectors apart from the gradient's",
         window_logits(WINDOW_ROWS, 37, dtype, gen, pad=vec), {}, vec, vec),
        ("rows at other offsets than the gradient's", window_logits(WINDOW_ROWS, 37, dtype, gen, pad=3), {}, 0, 0),
        ("logits off a 16-byte boundary", flat[1:].view(WINDOW_ROWS, 37), {}, vec, 0),
        ("transposed: class stride 11", make_logits([WINDOW_ROWS, 37], dtype, "cpu", gen, layout="transposed"), {},
         0, 0),
        ("48 classes: aligned rows", window_logits(WINDOW_ROWS, 48, dtype, gen), {}, 0, 0),
        ("switched off", window_logits(WINDOW_ROWS, 37, dtype, gen), dict(aligned_windows=False), 0, 0),
        # 45 + 7 bfloat16 positions need a 4th chunk of 16 (the plain plan has 3): the windows give way
        ("45 classes", window_logits(WINDOW_ROWS, 45, dtype, gen), {}, 4 if dtype == torch.float32 else 0,
         4 if dtype == torch.float32 else 0),
    ]
    with trainops.backend("triton"):
        for what, x, options, window, launched in cases:
            classes = x.shape[1]
            with trainops.heuristics(window_heuristics(16, **options)):
                kernel = trainops.plan("cross_entropy", shape=x.shape, dtype=dtype, target_dtype=torch.int64,
                                       strides=x.stride()).kernel
                assert kernel["plan"] == "exchange" and kernel["splits"] == -(-classes // 16), (what, kernel)
                assert kernel["window"] == window, (what, kernel)
                launched_windows.clear()
                check(x, window_targets(WINDOW_ROWS, classes, gen), dtype, what, reduction="sum")
                assert launched_windows == [launched], (what, launched_windows)


def test_inplace_backward_through_windows(launched_windows):
    """The gradient written over channels-last logits (N, C, S) of unit class stride: its rows are
    the logits' own (N and S strides alike), so they take the windows, which the plain gradient
    (class stride S) does not."""
    gen = torch.Generator().manual_seed(seed_of("windows in place"))
    dtype = torch.bfloat16
    leaf = make_logits([3, 5, 37], dtype, "cpu", gen).requires_grad_()   # (N, S, C)
    target = torch.randint(0, 37, (3, 5), generator=gen)
    target[0, 0], target[1, 2], target[2, 4] = 0, 36, -100
    with trainops.backend("triton"), trainops.heuristics(window_heuristics(16)):
        logits = (leaf * 1.0).permute(0, 2, 1)  # (N, C, S), strides (185, 1, 37)
        describe = dict(shape=logits.shape, dtype=dtype, target_dtype=torch.int64, strides=logits.stride())
        assert trainops.plan("cross_entropy", **describe, grad_into_input=True).kernel["window"] == 8
        assert trainops.plan("cross_entropy", **describe).kernel["window"] == 0   # the gradient: class stride 5
        for reduction in ("mean", "none"):
            leaf.grad = None
            logits = (leaf * 1.0).permute(0, 2, 1)
            ref_loss, _, ref_grad = reference(logits, target, reduction=reduction, z_loss=1e-3)
            launched_windows.clear()
            loss = trainops.cross_entropy(logits, target, reduction=reduction, z_loss=1e-3, inplace_backward=True)
            assert launched_windows == [8], launched_windows
            loss.sum().backward()
            assert_close(loss, ref_loss, dtype, f"in place through windows, {reduction}: loss")
            assert_close(leaf.grad.permute(0, 2, 1), ref_grad, dtype, f"in place through windows, {reduction}: grad")
            plain = make_logits([3, 37, 5], dtype, "cpu", gen).requires_grad_()   # class stride 5: the plain chunks
            check(plain, target, dtype, f"plain gradient rows, {reduction}", reduction=reduction)


def test_bad_target_flagged_through_windows(launched_windows):
    """The kernel's bad-target flag from a windowed launch: the row counts for nothing, and the
    deferred check raises at the backward (on the CPU)."""
    gen = torch.Generator().manual_seed(seed_of("windows, bad target"))
    x = window_logits(WINDOW_ROWS, 41, torch.bfloat16, gen)
    target = window_targets(WINDOW_ROWS, 41, gen)
    bad = target.clone()
    bad[7] = 41
    with trainops.backend("triton"), trainops.heuristics(window_heuristics(16)):
        loss = trainops.cross_entropy(x, bad, reduction="none", check_target=False)
        assert launched_windows == [8] and loss[7] == 0
        ref_loss, _, _ = reference(x, torch.where(bad == 41, -100, bad), reduction="none")
        assert_close(loss, ref_loss, torch.bfloat16, "unchecked bad class through windows")
        logits = x.detach().requires_grad_()
        loss = trainops.cross_entropy(logits, bad)
        with pytest.raises(IndexError, match="found by the fused kernel"):
            loss.backward()


# ---- probability targets ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_probability_targets(backend, device, row_plan, dtype):
    gen = torch.Generator().manual_seed(seed_of("probs", backend, row_plan, dtype))
    for shape, options in [([5, 11], {}), ([3, 7, 2, 2], dict(label_smoothing=0.2, reduction="sum")),
                           ([4, 9], dict(reduction="none", z_loss=0.05)), ([17], {})]:
        x = make_logits(shape, dtype, device, gen)
        q = torch.softmax(torch.randn(shape, generator=gen, dtype=torch.float64), dim=0 if len(shape) == 1 else 1)
        q = interpreter_rounding(q.float(), dtype).to(dtype) if dtype != torch.float64 else q
        if len(shape) > 1 and shape[1] == 11:
            options = dict(weight=(torch.rand(11, generator=gen, dtype=torch.float64) + 0.2).to(dtype).to(device))
        check(x, q.to(device), dtype, f"probabilities {shape}", **options)


# ---- module, autograd, compile -----------------------------------------------------------------------

def test_nn_cross_entropy_loss_is_drop_in(backend, device):
    weight = torch.rand(6, device=device) + 0.1
    ours = trainops.nn.CrossEntropyLoss(weight=weight, ignore_index=1, label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(weight=weight.cpu(), ignore_index=1, label_smoothing=0.1)
    assert isinstance(ours, torch.nn.CrossEntropyLoss) and "weight" in dict(ours.named_buffers())
    x = torch.randn(8, 6, device=device)
    t = torch.randint(0, 6, (8,), device=device)
    assert_close(ours(x, t), theirs(x.cpu(), t.cpu()), torch.float32, "module")


def test_gradcheck(backend, device):
    x = torch.randn(4, 5, dtype=torch.float64, device=device, requires_grad=True)
    t = torch.tensor([0, 4, -100, 2], device=device)
    w = torch.rand(5, dtype=torch.float64, device=device) + 0.5
    for reduction in ("mean", "sum", "none"):
        # the factor 2 keeps the upstream gradient away from 1; float64 scales out of place, so
        # gradcheck's repeated backwards through one graph are allowed
        f = lambda x: 2 * trainops.cross_entropy(x, t, w, reduction=reduction, label_smoothing=0.1,  # noqa: E731
                                                 z_loss=0.01)
        assert torch.autograd.gradcheck(f, (x,))
    q = torch.softmax(torch.randn(4, 5, dtype=torch.float64, device=device), 1)
    assert torch.autograd.gradcheck(lambda x: 3 * trainops.cross_entropy(x, q, label_smoothing=0.2), (x,))


def test_backward_hand_over_and_its_limits(backend, device):
    x = torch.randn(3, 4, device=device, requires_grad=True)
    t = torch.tensor([1, 2, 3], device=device)
    for upstream in (1.0, 0.25):  # the buffer is handed over (scaled in place when not 1) either way
        x.grad = None
        loss = trainops.cross_entropy(x, t)
        loss.backward(torch.tensor(upstream, device=device), retain_graph=True)
        assert_close(x.grad, reference(x, t)[2] * upstream, torch.float32, "handed-over gradient")
        with pytest.raises(trainops.UnsupportedError, match="second backward"):
            loss.backward()
    loss = trainops.cross_entropy(x, t)
    with pytest.raises(trainops.UnsupportedError, match="double backward"):
        torch.autograd.grad(loss, x, create_graph=True)
    with torch.no_grad():
        loss = trainops.cross_entropy(x, t)  # no gradient computed, no buffer allocated
    assert loss.grad_fn is None


def test_torch_compile_fullgraph(backend, device):
    torch._dynamo.reset()
    x = torch.randn(6, 10, device=device, requires_grad=True)
    t = torch.tensor([0, 9, -100, 3, 3, 5], device=device)
    w = torch.rand(10, device=device) + 0.5

    def step(x):
        return trainops.cross_entropy(x * 2, t, w, label_smoothing=0.1, z_loss=1e-3)

    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    loss.backward()
    x_ref = x.detach().clone().requires_grad_()
    step(x_ref).backward()
    assert torch.allclose(loss, step(x)) and torch.allclose(x.grad, x_ref.grad)


def test_torch_compile_inductor():
    torch._dynamo.reset()
    model = torch.nn.Linear(8, 12)
    criterion = trainops.nn.CrossEntropyLoss(label_smoothing=0.05)
    x, t = torch.randn(5, 8), torch.tensor([0, 11, 3, 3, 7])
    compiled = torch.compile(lambda x: criterion(model(x), t), fullgraph=True)
    compiled(x).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.cross_entropy(model(x), t, label_smoothing=0.05).backward()
    for ours, theirs in zip(grads, model.parameters()):
        assert_close(ours, theirs.grad, torch.float32, "inductor")


# ---- bad input ---------------------------------------------------------------------------------------

def test_bad_arguments_name_the_argument(backend, device):
    x = torch.randn(4, 5, device=device)
    t = torch.tensor([0, 1, 2, 3], device=device)
    cases = [
        (IndexError, r"'target' holds class 5, out of range \[0, 4\]",
         lambda: trainops.cross_entropy(x, torch.tensor([0, 5, 1, 1], device=device), check_target="immediate")),
        (trainops.IndexOutOfRangeError, "class -3", lambda: trainops.cross_entropy(x, t - 3, check_target="immediate")),
        (trainops.InvalidProblemError, "'check_target' must be True, False or 'immediate', got 'yes'",
         lambda: trainops.cross_entropy(x, t, check_target="yes")),
        (trainops.InvalidProblemError, "'target' has shape", lambda: trainops.cross_entropy(x, t[:3])),
        (trainops.InvalidProblemError, "'target' has dtype torch.int16",
         lambda: trainops.cross_entropy(x, t.to(torch.int16))),
        (trainops.InvalidProblemError, "'target' holds probabilities of dtype torch.float64",
         lambda: trainops.cross_entropy(x, x.double())),
        (trainops.InvalidProblemError, r"'weight' has shape \(4,\); expected \(5,\)",
         lambda: trainops.cross_entropy(x, t, torch.ones(4, device=device))),
        (trainops.InvalidProblemError, "'reduction'", lambda: trainops.cross_entropy(x, t, reduction="avg")),
        (trainops.InvalidProblemError, "'label_smoothing'", lambda: trainops.cross_entropy(x, t, label_smoothing=2.0)),
        (trainops.InvalidProblemError, "'z_loss'", lambda: trainops.cross_entropy(x, t, z_loss=-1.0)),
        (trainops.UnsupportedError, "'input' has dtype torch.int64", lambda: trainops.cross_entropy(t[:, None], t)),
        (trainops.InvalidProblemError, "'input' has shape", lambda: trainops.cross_entropy(x[:, :0], t)),
        (trainops.InvalidProblemError, "'target' must be a torch.Tensor", lambda: trainops.cross_entropy(x, [0])),
    ]
    for error, pattern, call in cases:
        with pytest.raises(error, match=pattern):
            call()
    # training in eager mode: the fused kernel flags the bad class and backward raises
    xg = x.clone().requires_grad_()
    loss = trainops.cross_entropy(xg, torch.tensor([0, 5, -100, 1], device=device))
    with pytest.raises(IndexError, match="'target' holds a class index out of range"):
        loss.backward()
    assert xg.grad is None
    unchecked = trainops.cross_entropy(x, torch.tensor([0, 5, 1, 1], device=device), check_target=False,
                                       reduction="none")
    assert unchecked[1] == 0 and torch.isfinite(unchecked).all()  # an unchecked bad class counts for nothing
    # "immediate": training too is checked before the launch
    with pytest.raises(IndexError, match="'target' holds class 5"):
        trainops.cross_entropy(xg, torch.tensor([0, 5, -100, 1], device=device), check_target="immediate")


def test_bad_target_without_grad_is_reported_now_on_the_cpu_later_on_the_gpu(backend, device):
    """No gradient (an evaluation): on the CPU the call raises; on the GPU the kernel flags the row
    (no host sync: the loss leaves it out) and the next checking call after the GPU ran it raises."""
    x = torch.randn(4, 5, device=device)
    bad = torch.tensor([0, 5, 1, 1], device=device)
    match = "'target' holds (class 5|a class index out of range)"
    if device != "cuda":
        with pytest.raises(IndexError, match=match):
            trainops.cross_entropy(x, bad)
        return
    loss = trainops.cross_entropy(x, bad, reduction="none")
    assert loss[1] == 0
    torch.cuda.synchronize()
    good = torch.tensor([0, 1, 1, 1], device=device)
    with pytest.raises(IndexError, match="found by the fused kernel of a call on the GPU"):
        trainops.cross_entropy(x, good)
    trainops.cross_entropy(x, good)   # reported once


def test_plan_reports_the_row_plan():
    device = "cuda" if HAS_CUDA else "cpu"

    def plan(classes, dtype=torch.bfloat16, target_dtype=torch.int64, **options):
        return trainops.plan("cross_entropy", shape=(512, classes), dtype=dtype, target_dtype=target_dtype,
                             device=device, **options).kernel["plan"]
    with trainops.backend("triton"):
        assert plan(16384) == plan(8192, dtype=torch.float32) == "fused"
        assert plan(16385) == plan(32000) == plan(8193, dtype=torch.float32) == "pipelined"  # one chunk a row
        assert plan(32000, label_smoothing=0.1) == plan(16384, dtype=torch.float64) == "fused"
        assert plan(131072) == "exchange"  # 4 chunks of 32768 classes
        assert plan(131072, label_smoothing=0.1) == plan(131072, dtype=torch.float64) == "two-pass"
        assert plan(131072, target_dtype=torch.bfloat16, target_shape=(512, 131072)) == "two-pass"  # probabilities
        warps = lambda classes, dtype=torch.bfloat16: trainops.plan(  # noqa: E731
            "cross_entropy", shape=(512, classes), dtype=dtype, target_dtype=torch.int64, device=device).kernel["num_warps"]
        defaults = ce_ops.CrossEntropyHeuristics()
        assert warps(32000) == defaults.pipelined_warps[2] == 32      # pipelined bf16: its own warps
        assert warps(8193, torch.float32) == defaults.exchange_warps == 16   # no pipelined entry for 4 bytes
        assert warps(131072) == defaults.exchange_warps                   # several chunks: the exchange's
        with trainops.heuristics(ce_ops.CrossEntropyHeuristics(pipelined_warps={})):
            assert warps(32000) == defaults.exchange_warps
        short = trainops.plan("cross_entropy", shape=(8, 32000), dtype=torch.bfloat16, target_dtype=torch.int64,
                              device=device)
    assert short.precision.deterministic and short.precision.accumulator == torch.float32
    for bad in ({2: 12}, {2: 64}, {2: 32.0}, {2: True}, 32, {"bf16": 32}):
        with pytest.raises(trainops.InvalidProblemError, match="pipelined_warps"):
            ce_ops.CrossEntropyHeuristics(pipelined_warps=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipelined_rows(backend, device, dtype):
    """One chunk a row (classes up to the exchange block): each program loads its next row while it
    writes this one; more rows than programs, so every program goes round its loop several times."""
    with trainops.heuristics(ce_ops.CrossEntropyHeuristics(exchange_block={2: 8, 4: 8}, sms=4)):
        _check_pipelined_rows(backend, device, dtype)


def _check_pipelined_rows(backend, device, dtype):
    gen = torch.Generator().manual_seed(seed_of("pipelined", backend, dtype))
    for classes, options in ((5, {}), (8, dict(reduction="sum", z_loss=1e-3)), (7, dict(reduction="none"))):
        x = make_logits([37, classes], dtype, device, gen, layout="sliced")
        target = torch.randint(0, classes, (37,), generator=gen)
        target[[0, 11, 36]] = -100
        weight = (torch.rand(classes, generator=gen, dtype=torch.float64) + 0.1).to(dtype).to(device)
        kernel = trainops.plan("cross_entropy", shape=x.shape, dtype=dtype, target_dtype=torch.int64,
                               device=device).kernel
        assert kernel.name == "cross_entropy_cpu" if backend == "cpu" else kernel["plan"] == "pipelined"
        check(x, target.to(device), dtype, f"pipelined {classes}", weight=weight, **options)


def test_exchange_plan_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("TRAINOPS_ROW_EXCHANGE", "0")
    device = "cuda" if HAS_CUDA else "cpu"
    with trainops.backend("triton"):
        assert trainops.plan("cross_entropy", shape=(8, 131072), dtype=torch.bfloat16, target_dtype=torch.int64,
                             device=device).kernel["plan"] == "two-pass"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_grad_scale_kernel(backend, device, dtype, layout):
    gen = torch.Generator().manual_seed(seed_of("scale", backend, dtype, layout))
    g = torch.randn(5, 7, 300, generator=gen, dtype=torch.float64).to(dtype).to(device)
    if layout == "permuted":
        g = g.permute(2, 0, 1)  # dense, not contiguous
    before = g.clone()
    flags = torch.zeros(2, dtype=torch.int32, device=device)  # [bad target, k]: the gradient is stored times 2^k
    ce_ops.scale_gradient_(g, torch.ones((), dtype=torch.float32, device=device), flags)
    assert torch.equal(g, before)  # exactly 1: untouched
    ce_ops.scale_gradient_(g, torch.tensor([0.375], dtype=dtype, device=device), flags)
    assert_close(g, before.double() * 0.375, dtype, "scaled")
    scaled = g.clone()
    flags[1] = 3
    ce_ops.scale_gradient_(g, torch.tensor([8.0], dtype=dtype, device=device), flags)  # 8 * 2^-3 == 1: untouched
    assert torch.equal(g, scaled)
    flags[1] = 2
    ce_ops.scale_gradient_(g, torch.tensor([3.0], dtype=dtype, device=device), flags)
    assert_close(g, scaled.double() * 0.75, dtype, "scaled by dloss * 2^-k")
    with pytest.raises(trainops.InvalidProblemError, match="'dloss' must be one element"):
        ce_ops.scale_gradient_(g, torch.ones(2, device=device), flags)
    with pytest.raises(trainops.InvalidProblemError, match="'grad' is not dense"):
        ce_ops.scale_gradient_(g[:, :, ::2], torch.ones(1, device=device), flags)


# ---- GPU, real sizes ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_bad_target_is_reported_without_a_host_sync():
    x = torch.randn(4, 50000, device="cuda", requires_grad=True)
    good = torch.tensor([0, 1, 1, 1], device="cuda")
    # Reported by the backward or by the next call, whichever comes after the GPU has run the kernel.
    with pytest.raises(IndexError, match="found by the fused kernel of a call on the GPU"):
        trainops.cross_entropy(x, torch.tensor([0, 50000, 1, 1], device="cuda")).backward()
        torch.cuda.synchronize()
        trainops.cross_entropy(x, good)
    torch.cuda.synchronize()
    trainops.cross_entropy(x, good).backward()  # reported once
    torch.cuda.synchronize()
    trainops.cross_entropy(x, good)

@pytest.mark.gpu
@pytest.mark.parametrize("rows,classes", [(8192, 32000), (2048, 128256), (512, 262144), (1000, 50001)])
@pytest.mark.parametrize("options", [dict(label_smoothing=0.1), dict(z_loss=1e-4), dict(weight=True)], ids=str)
def test_real_vocabularies(rows, classes, options):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, classes, device="cuda", generator=gen) * 2).bfloat16().requires_grad_()
    t = torch.randint(0, classes, (rows,), device="cuda", generator=gen)
    t[::7] = -100
    if options.get("weight"):
        options = dict(weight=torch.rand(classes, device="cuda", generator=gen) + 0.5)
    loss = trainops.cross_entropy(x, t, loss_dtype=torch.float32, **options)
    loss.backward()
    xd = x.detach().double().requires_grad_()
    z = options.pop("z_loss", 0.0)
    ref = F.cross_entropy(xd, t, **{k: v.double() if torch.is_tensor(v) else v for k, v in options.items()})
    if z:
        lse = torch.logsumexp(xd, 1)[t != -100]
        ref = ref + z * (lse * lse).mean()
    ref.backward()
    assert_close(loss, ref, torch.float32, "loss")
    assert_close(x.grad, xd.grad, torch.bfloat16, "grad")
    again = trainops.cross_entropy(x.detach().requires_grad_(), t, loss_dtype=torch.float32,
                                   **dict(options, z_loss=z))
    assert torch.equal(again, loss)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,classes,dtype", [(4096, 16001, torch.float32), (8192, 32000, torch.float16),
                                                (600, 131072, torch.bfloat16)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gpu_reductions_in_the_kernel(rows, classes, dtype, reduction):
    """The pipelined and exchange plans reduce "mean" / "sum" in the kernel (the last program to finish
    sums the rows): against float64, bit-identical run to run; an all-ignored batch gives NaN for "mean"."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(rows, classes, device="cuda", generator=gen) * 2).to(dtype).requires_grad_()
    t = torch.randint(0, classes, (rows,), device="cuda", generator=gen)
    t[::5] = -100
    assert trainops.plan("cross_entropy", shape=x.shape, dtype=dtype, target_dtype=t.dtype,
                         reduction=reduction).kernel["plan"] in ("pipelined", "exchange")
    loss = trainops.cross_entropy(x, t, reduction=reduction, loss_dtype=torch.float32)
    upstream = torch.rand(loss.shape, device="cuda", generator=gen) + 0.5
    if reduction == "mean":  # gradients of order p, not p / rows (float16 would flush those to subnormals)
        upstream *= (t != -100).sum()
    loss.backward(upstream)
    xd = x.detach().double().requires_grad_()
    ref = F.cross_entropy(xd, t, reduction=reduction)
    ref.backward(upstream.double())
    assert_close(loss, ref, torch.float32, "loss")
    assert_close(x.grad, xd.grad, dtype, "grad")
    assert torch.equal(trainops.cross_entropy(x.detach(), t, reduction=reduction, loss_dtype=torch.float32), loss)
    if reduction == "mean":
        ignored = torch.full_like(t, -100)
        x.grad = None
        none = trainops.cross_entropy(x, ignored)
        none.backward()
        assert torch.isnan(none) and not x.grad.any()


@pytest.mark.gpu
@pytest.mark.parametrize("rows,classes,dtype", [(1, 262144, torch.bfloat16), (4, 131072, torch.bfloat16),
                                                (16, 65536, torch.float16), (64, 32768, torch.float32),
                                                (8, 1048576, torch.bfloat16)])
def test_gpu_few_long_rows(rows, classes, dtype):
    """Fewer rows than SMs, cut into chunks for every SM (exchange.fill_tile): against float64, bit-identical
    run to run, and in place (the gradient over the logits) the same."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(rows, classes, device="cuda", generator=gen) * 2).to(dtype)
    t = torch.randint(0, classes, (rows,), device="cuda", generator=gen)
    t[1::3] = -100   # ignored rows, none of them the first (one row: a loss that is not 0 / 0)
    kernel = trainops.plan("cross_entropy", shape=x.shape, dtype=dtype, target_dtype=t.dtype).kernel
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert kernel["plan"] == "exchange" and kernel["splits"] * rows >= sms * 3 // 4, kernel   # 3/4 of the SMs busy
    xg = x.clone().requires_grad_()
    loss = trainops.cross_entropy(xg, t, loss_dtype=torch.float32)
    loss.backward()
    xd = x.double().requires_grad_()
    ref = F.cross_entropy(xd, t)
    ref.backward()
    assert_close(loss, ref, torch.float32, "loss")
    assert_close(xg.grad, xd.grad, dtype, "grad")
    again = x.clone().requires_grad_()
    assert torch.equal(trainops.cross_entropy(again, t, loss_dtype=torch.float32), loss)
    inplace = x.clone().requires_grad_()
    y = inplace * 1   # a non-leaf whose buffer the gradient may take over
    rows_loss = trainops.cross_entropy(y, t, reduction="none", inplace_backward=True, loss_dtype=torch.float32)
    (rows_loss.sum() / (t != -100).sum()).backward()
    assert_close(rows_loss, F.cross_entropy(x.double(), t, reduction="none"), torch.float32, "in place, per row")
    assert_close(inplace.grad, xd.grad, dtype, "grad in place")
    weight = torch.rand(classes, device="cuda", generator=gen) + 0.5
    smooth = x.clone().requires_grad_()
    loss = trainops.cross_entropy(smooth, t, weight.to(dtype), label_smoothing=0.1, loss_dtype=torch.float32)
    loss.backward()
    xd = x.double().requires_grad_()
    ref = F.cross_entropy(xd, t, weight.to(dtype).double(), label_smoothing=0.1)
    ref.backward()
    assert_close(loss, ref, torch.float32, "label smoothing, loss")
    assert_close(smooth.grad, xd.grad, dtype, "label smoothing, grad")


@pytest.mark.gpu
@pytest.mark.parametrize("classes", [32000, 128256, 262144])
def test_gpu_inplace_backward_long_rows(classes):
    # The exchange plan writes each chunk's gradient as soon as the row's partials are in: the
    # target's logit must have been read before (it may sit in another program's chunk).
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = 1024
    base = (torch.randn(rows, classes, device="cuda", generator=gen) * 2).bfloat16()
    t = torch.randint(0, classes, (rows,), device="cuda", generator=gen)
    t[::5] = -100
    ref_x = base.double().requires_grad_()
    ref = F.cross_entropy(ref_x, t, reduction="none")  # per row: one wrong target logit stands out
    ref.sum().backward()
    leaf = base.clone().requires_grad_()
    logits = leaf * 1  # a non-leaf whose buffer the gradient may take over
    loss = trainops.cross_entropy(logits, t, reduction="none", inplace_backward=True, loss_dtype=torch.float32)
    loss.sum().backward()
    assert_close(loss, ref, torch.float32, "in-place loss")
    assert_close(leaf.grad, ref_x.grad, torch.bfloat16, "in-place gradient")


@pytest.mark.parametrize("z_loss", [1e-4, 0.01, 1.0])
def test_float16_z_loss_gradient_stays_finite(backend, device, row_plan, z_loss):
    """The 2^k that float16 gradients are stored with leaves room for the z-loss term, whose
    2 z lse p / rows can reach 2 z (65504 + log C) / rows. The issue's case: 4 rows, lse = 1000,
    z = 0.01 give 5.0, which 2^k sized without the z-loss term (k = 14) stored as inf."""
    issue = torch.zeros(4, 8, dtype=torch.float16)
    issue[:, 0] = 1000.0
    mixed = torch.zeros(6, 8, dtype=torch.float16)
    mixed[:, 0] = 2000.0
    mixed[1, 3] = -2000.0
    cases = [(issue, torch.zeros(4, dtype=torch.int64)), (mixed, torch.tensor([0, 3, 0, -100, 0, 5]))]
    for x, target in cases:
        ref_loss, _, ref_grad = reference(x, target, z_loss=z_loss)
        for upstream in (1.0, 1024.0):  # as is, and under a loss scale where the result fits float16
            if (ref_grad * upstream).abs().max() > torch.finfo(torch.float16).max:
                continue
            logits = x.clone().to(device).requires_grad_()
            loss = trainops.cross_entropy(logits, target.to(device), z_loss=z_loss, loss_dtype=torch.float32)
            (loss * upstream).backward()
            what = f"{tuple(x.shape)}, z_loss={z_loss}, upstream {upstream}"
            assert torch.isfinite(logits.grad).all(), (what, logits.grad)
            assert_close(logits.grad, ref_grad * upstream, torch.float16, what)
            assert_close(loss, ref_loss, torch.float32, f"{what}: loss")


def test_float16_gradient_exponent_bounds_the_z_loss_term():
    """k leaves |stored gradient| <= 2^12 (1 + w_max / norm * ...) however large lse is: check the bound."""
    norm, z_norm, w_max = torch.tensor(4.0), torch.tensor(4.0), torch.tensor(1.0)
    assert ce_ops.gradient_exponent(norm, z_norm, w_max, 0.0).item() == 12 + 2  # no z-loss: as before
    for z_loss in (1e-6, 1e-4, 1e-2, 1.0, 10.0):
        z_bound = ce_ops.z_gradient_bound(z_loss, 128256)
        k = ce_ops.gradient_exponent(norm, z_norm, w_max, z_bound).item()
        largest = (w_max / norm + z_bound / z_norm).item() * 2.0**k  # the largest stored |entry|
        assert largest <= 2.0**ce_ops.GRAD_HEADROOM_BITS * 1.0001 and largest > 2.0**(ce_ops.GRAD_HEADROOM_BITS - 1), \
            (z_loss, k, largest)
    for zero in (torch.tensor(0.0),):  # every row ignored: nothing to scale
        assert ce_ops.gradient_exponent(zero, zero, w_max, 1.0).item() == 0
        assert ce_ops.gradient_exponent(zero, zero, w_max, 0.0).item() == 0


def test_constants_beyond_float32_reach_the_kernels_as_inf(backend, device):
    """The kernels take float constants as their bits (float_bits): a z-loss whose gradient bound
    2 z (65504 + log C) passes float32's range is inf there, as a float32 tensor of it would be,
    not a packing error; the loss and gradient match the float64 reference."""
    from trainops.ops._common import float_bits

    for v in (1e36, -1e39, 3.4028235e38, 3.40282357e38, 1e-50, float("inf"), float("-inf")):
        assert float_bits(v, torch.float32) == torch.tensor(v, dtype=torch.float32).view(torch.int32).item(), v
        assert float_bits(v, torch.float64) == torch.tensor(v, dtype=torch.float64).view(torch.int64).item(), v
    x = torch.randn(6, 9, generator=torch.Generator().manual_seed(3))
    target = torch.tensor([0, 3, 8, -100, 2, 5])
    ref_loss, _, ref_grad = reference(x, target, z_loss=1e34)
    logits = x.clone().to(device).requires_grad_()
    loss = trainops.cross_entropy(logits, target.to(device), z_loss=1e34)
    loss.backward()
    assert_close(loss, ref_loss, torch.float32, "loss")
    assert_close(logits.grad, ref_grad, torch.float32, "grad")


@pytest.mark.parametrize("plan", ["fused", "exchange", "two-pass"])
def test_float16_mean_gradient_survives_loss_scaling(backend, device, plan):
    """float16 "mean": the gradient for an upstream gradient of 1 (~p / rows) lies below float16's
    normal range (6.1e-5). Stored times 2^k it keeps its bits until a loss scale (GradScaler's)
    lifts it; stored as is it loses them in the forward (here: 2000 classes, p ~ 5e-4, 64 rows:
    subnormals of about 7 significant bits; at real sizes they flush to zero, see the GPU tests)."""
    default = ce_ops.CrossEntropyHeuristics()
    heuristics = {"fused": default,
                  "exchange": ce_ops.CrossEntropyHeuristics(exchange_block={2: 1024}),  # 2 chunks a row
                  "two-pass": ce_ops.CrossEntropyHeuristics(register_row={**default.register_row, 2: 1024},
                                                            stream_block={**default.stream_block, 2: 512},
                                                            exchange_block={})}[plan]
    with trainops.heuristics(heuristics):
        _check_float16_mean_gradient(backend, device, plan)


def _check_float16_mean_gradient(backend, device, plan):
    gen = torch.Generator().manual_seed(seed_of("fp16 mean", backend, plan))
    x = make_logits([64, 2000], torch.float16, device, gen, scale=0.5)
    target = torch.randint(0, 2000, (64,), generator=gen)
    target[::9] = -100
    unused_class = next(c for c in range(2000) if c not in target.tolist())
    for dtype, weighted, k in ((torch.float16, False, 12 + 5), (torch.float16, True, 12 + 2), (torch.bfloat16, False, 0)):
        # k = 12 + floor(log2(summed target weights / largest class weight)): 56 targets (8 ignored);
        # weighted: ones, but 8 for a class no row targets (56 / 8 = 7)
        w = None
        if weighted:
            w = torch.ones(2000, dtype=dtype)
            w[unused_class] = 8
            w = w.to(device)
        plan = trainops.plan("cross_entropy", shape=x.shape, dtype=dtype, target_dtype=torch.int64, device=device,
                             has_weight=w is not None)
        flags = plan.run(x.to(dtype), target.to(device), *([] if w is None else [w]))[3]
        assert flags.tolist() == [0, k], (dtype, weighted, flags)
    _, _, ref_grad = reference(x, target)
    for inplace in (False, True):
        leaf = x.detach().float().requires_grad_()
        logits = leaf.half() if inplace else x.detach().requires_grad_()
        loss = trainops.cross_entropy(logits, target.to(device), inplace_backward=inplace)
        (loss * 1024.0).backward()
        grad = logits.detach() if inplace else logits.grad
        assert_close(grad, ref_grad * 1024, torch.float16, f"loss-scaled float16 gradient (inplace={inplace})")
        others = torch.ones(64, 2000, dtype=torch.bool)  # the p-only part, small next to the target entries
        others[torch.arange(64)[target != -100], target[target != -100]] = False
        assert_close(grad.cpu()[others], (ref_grad * 1024)[others], torch.float16, "non-target entries")


# ---- gradient written over the logits --------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_inplace_backward_matches_torch(backend, device, row_plan, reduction):
    gen = torch.Generator().manual_seed(seed_of("inplace", backend, row_plan, reduction))
    hidden = torch.randn(7, 6, generator=gen, dtype=torch.float64).to(device)
    head = torch.randn(6, 19, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    target = torch.randint(0, 19, (7,), generator=gen).to(device)
    target[3] = -100
    logits = hidden @ head
    loss = trainops.cross_entropy(logits, target, reduction=reduction, label_smoothing=0.1, z_loss=0.01,
                                  inplace_backward=True)
    upstream = torch.rand(loss.shape, generator=gen, dtype=torch.float64).to(device) + 0.5
    loss.backward(upstream)
    ref_loss, _, ref_grad = reference(hidden @ head.detach(), target, reduction=reduction, label_smoothing=0.1,
                                      z_loss=0.01)
    scale = upstream.cpu().unsqueeze(1) if reduction == "none" else upstream.cpu()
    assert_close(loss, ref_loss, torch.float64, "in-place loss")
    assert_close(head.grad, hidden.cpu().t() @ (ref_grad * scale), torch.float64, "in-place grad through the head")
    assert_close(logits.detach(), ref_grad * scale, torch.float64, "the logits now hold the gradient")


def test_inplace_backward_under_torch_compile(backend, device):
    torch._dynamo.reset()
    hidden = torch.randn(6, 7, device=device)
    head = torch.randn(7, 5, device=device, requires_grad=True)
    target = torch.tensor([0, 4, 4, -100, 2, 1], device=device)
    step = torch.compile(lambda w: trainops.cross_entropy(hidden @ w, target, inplace_backward=True),
                         fullgraph=True, backend="aot_eager")
    step(head).backward()
    ours, head.grad = head.grad, None
    F.cross_entropy(hidden @ head, target).backward()
    assert_close(ours, head.grad, torch.float32, "compiled in-place")


def test_inplace_backward_needs_a_non_leaf(backend, device):
    x = torch.randn(3, 4, device=device, requires_grad=True)
    with pytest.raises(trainops.InvalidProblemError, match="'inplace_backward' needs a non-leaf"):
        trainops.cross_entropy(x, torch.tensor([0, 1, 2], device=device), inplace_backward=True)
    with torch.no_grad():  # nothing to write: the flag is moot
        trainops.cross_entropy(x, torch.tensor([0, 1, 2], device=device), inplace_backward=True)


def test_loss_modules_take_the_check_mode(backend, device):
    x = torch.randn(4, 5, device=device, requires_grad=True)
    bad = torch.tensor([0, 5, 1, 1], device=device)
    loss_fn = trainops.nn.CrossEntropyLoss()
    assert loss_fn.check_target is True
    loss_fn.check_target = "immediate"
    with pytest.raises(IndexError, match="'target' holds class 5"):   # at the call, training or not
        loss_fn(x, bad)
    loss_fn.check_target = False
    assert torch.isfinite(loss_fn(x, bad))
    loss_fn.check_target = "sometimes"
    with pytest.raises(trainops.InvalidProblemError, match="'check_target' must be True, False or 'immediate'"):
        loss_fn(x, bad)
    head = trainops.nn.LinearCrossEntropyLoss()
    head.check_target = "immediate"
    h, w = torch.randn(4, 3, device=device, requires_grad=True), torch.randn(5, 3, device=device)
    with pytest.raises(IndexError, match="argument 'target' holds class 5"):
        head(h, w, bad)


def test_check_pending_without_anything_pending_does_nothing():
    trainops.check_pending()


@pytest.mark.gpu
def test_gpu_evaluation_errors_are_raised_by_check_pending_or_printed_at_exit():
    import subprocess
    import sys

    x = torch.randn(4, 50, device="cuda")
    bad = torch.tensor([0, 50, 1, 1], device="cuda")
    with torch.no_grad():
        loss = trainops.cross_entropy(x, bad)   # no host sync: the bad row is flagged on the GPU
    with pytest.raises(IndexError, match="found by the fused kernel of a call on the GPU"):
        trainops.check_pending()
    assert torch.isfinite(loss)
    trainops.check_pending()   # reported once
    # a later call in another mode still raises what is pending
    with torch.no_grad():
        trainops.cross_entropy(x, bad)
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match="found by the fused kernel"):
        trainops.gather(x, torch.tensor([0], device="cuda"), 0, check_index="immediate")
    script = ("import torch, trainops\n"
              "x = torch.randn(4, 50, device='cuda')\n"
              "with torch.no_grad():\n"
              "    print(float(trainops.cross_entropy(x, torch.tensor([0, 50, 1, 1], device='cuda'))))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "trainops: at exit, an error found on the GPU that no later call raised" in done.stderr


@pytest.mark.gpu
def test_deferred_target_check_on_a_side_stream_raises_at_a_later_call():
    """The flag's report into the error word is ordered on the stream the call ran on (a side stream here): the
    error is raised by a later call once that stream has run it, and calls on the default stream
    in between see nothing of it before."""
    torch.cuda.synchronize()
    logits = torch.randn(8, 16, device="cuda", requires_grad=True)
    bad = torch.tensor([0, 1, 2, 3, 4, 5, 6, 99], device="cuda")
    good = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        trainops.cross_entropy(logits, bad)
    side.synchronize()
    with pytest.raises(trainops.IndexOutOfRangeError, match="cross_entropy"):
        trainops.cross_entropy(logits, good)
    trainops.cross_entropy(logits, good).backward()  # reported once: later calls run
