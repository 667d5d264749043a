"""trainops.linear_cross_entropy: float64 references over every option and reduction, chunked
(several chunks, a short last one), dtypes, gradients only where asked, num_items_in_batch and
gradient accumulation, autocast, edge cases (ignored rows, all ignored, empty), errors, target
checks, torch.compile, the module, and GPU runs at LM-head sizes."""

import math

import pytest
import torch
import torch.nn.functional as F

import trainops
from trainops.errors import IndexOutOfRangeError, InvalidProblemError, UnsupportedError
from trainops.ops.linear_cross_entropy import LinearCrossEntropyHeuristics

from numerics import assert_close


def small_chunks(rows):
    """Chunks of ``rows`` tokens whatever the vocabulary (several chunks on test sizes)."""
    return trainops.heuristics(LinearCrossEntropyHeuristics(chunk_bytes=1, min_rows=rows))


def reference(h, w, t, b=None, *, class_weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss=0.0, softcap=None, num_items=None, logit_scale=1.0, temperature=1.0):
    """float64: torch's linear + cross_entropy, the z-loss term (z lse^2 over kept rows, divided by their
    count for "mean"), the logit scale, softcap and temperature written out."""
    logits = F.linear(h.double(), w.double(), None if b is None else b.double()) * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    logits2, t1 = logits.reshape(-1, logits.shape[-1]), t.reshape(-1)
    cw = None if class_weight is None else class_weight.double()
    kept = (t1 != ignore_index).double()
    z_rows = z_loss * torch.logsumexp(logits2, -1) ** 2 * kept
    if num_items is not None:
        ce = F.cross_entropy(logits2, t1, cw, ignore_index=ignore_index, reduction="sum",
                             label_smoothing=label_smoothing)
        return (ce + z_rows.sum()) / num_items
    ce = F.cross_entropy(logits2, t1, cw, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing)
    if reduction == "none":
        return (ce + z_rows).reshape(t.shape)
    return ce + (z_rows.sum() / kept.sum() if reduction == "mean" else z_rows.sum())


def inputs(n, h, v, dtype, device, *, bias=True, seed=0, ignored=(3,)):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, h, generator=gen) * 2).to(device, dtype).requires_grad_()
    w = (torch.randn(v, h, generator=gen) / math.sqrt(h) * 3).to(device, dtype).requires_grad_()
    b = (torch.randn(v, generator=gen) * 0.5).to(device, dtype).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=gen)
    for i in ignored:
        if i < n:
            t[i] = -100
    return x, w, b, t.to(device)


def grads_of(loss, tensors, reduction):
    upstream = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype, device=loss.device).reshape(loss.shape)
    return torch.autograd.grad(loss, tensors, upstream if reduction == "none" else torch.full_like(loss, 0.75))


OPTIONS = [
    dict(),
    dict(label_smoothing=0.1),
    dict(z_loss=1e-3),
    dict(softcap=4.0),
    dict(class_weight=True),
    dict(class_weight=True, z_loss=1e-2, label_smoothing=0.2),
    dict(logit_scale=0.5, temperature=2.0),
    dict(softcap=4.0, logit_scale=3.0, temperature=0.5, z_loss=1e-3),
]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_float64_matches_the_reference_over_chunks(backend, device, reduction, options):
    x, w, b, t = inputs(37, 16, 29, torch.float64, device)
    options = dict(options)
    if options.pop("class_weight", False):
        options["class_weight"] = torch.rand(29, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
                                             ).to(device) + 0.5
    with small_chunks(8):   # 5 chunks, the last of 5 rows
        loss = trainops.linear_cross_entropy(x, w, t, b, reduction=reduction, **options)
        got = grads_of(loss, (x, w, b), reduction)
    want_loss = reference(x, w, t, b, reduction=reduction, **options)
    want = grads_of(want_loss, (x, w, b), reduction)
    assert loss.dtype == torch.float64 and loss.shape == want_loss.shape
    assert_close(loss, want_loss, torch.float64, "loss")
    for name, a, e in zip("xwb", got, want):
        assert_close(a, e, torch.float64, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_half_and_float32_against_float64(backend, device, dtype, reduction):
    x, w, b, t = inputs(40, 32, 70, dtype, device, seed=2)
    with small_chunks(16):
        loss = trainops.linear_cross_entropy(x, w, t, b, reduction=reduction, z_loss=1e-4, loss_dtype=torch.float32)
        got = grads_of(loss, (x, w, b), reduction)
    want_loss = reference(x, w, t, b, reduction=reduction, z_loss=1e-4)
    want = grads_of(want_loss, (x, w, b), reduction)
    assert loss.dtype == torch.float32
    assert_close(loss, want_loss, dtype if dtype != torch.float32 else torch.float32, "loss")
    for name, a, e, ref_input in zip("xwb", got, want, (x, w, b)):
        assert a.dtype == ref_input.dtype, name   # gradients in their tensors' own dtype
        assert_close(a, e, dtype, f"d{name}")


def test_the_loss_is_float32_and_the_weight_may_differ(backend, device):
    x, w, _, t = inputs(12, 8, 10, torch.bfloat16, device, bias=False)
    assert trainops.linear_cross_entropy(x, w, t).dtype == torch.float32   # computed in float32, returned so
    assert trainops.linear_cross_entropy(x, w, t, loss_dtype=torch.bfloat16).dtype == torch.bfloat16
    w32 = w.detach().float().requires_grad_()   # a float32 master weight with bf16 activations
    loss = trainops.linear_cross_entropy(x, w32, t)
    dx, dw = torch.autograd.grad(loss, (x, w32))
    assert dw.dtype == torch.float32 and dx.dtype == torch.bfloat16
    want = reference(x, w32.bfloat16(), t)
    assert_close(loss, want, torch.bfloat16, "loss")
    assert_close(dw, _dw_reference(x, w32, t), torch.bfloat16, "dw")


def _dw_reference(x, w, t):
    w64 = w.detach().double().requires_grad_()
    return torch.autograd.grad(reference(x.detach(), w64, t), w64)[0]


def test_only_the_gradients_asked_for_are_computed(backend, device):
    x, w, b, t = inputs(20, 16, 30, torch.float64, device)
    w.requires_grad_(False)   # a frozen head (LoRA fine-tuning): no dW work
    b.requires_grad_(False)
    computed = []
    from trainops.ops import linear_cross_entropy as module

    original = module.matmul_into

    def spy(out, a, b, accumulate):
        computed.append(tuple(out.shape))
        return original(out, a, b, accumulate)

    module.matmul_into = spy
    try:
        with small_chunks(8):
            for reduction in ("mean", "none"):
                loss = trainops.linear_cross_entropy(x, w, t, b, reduction=reduction)
                (dx,) = torch.autograd.grad(loss.sum(), x)
                assert_close(dx, torch.autograd.grad(reference(x, w, t, b, reduction=reduction).sum(), x)[0],
                             torch.float64, reduction)
    finally:
        module.matmul_into = original
    # dhidden's chunk matmuls ran (8 rows a chunk); no dW matmul (its output has the padded vocabulary's rows)
    assert computed and all(shape[0] <= 8 for shape in computed), computed
    x2 = x.detach()   # only the head trains
    w.requires_grad_(True)
    loss = trainops.linear_cross_entropy(x2, w, t, b)
    (dw,) = torch.autograd.grad(loss, w)
    assert_close(dw, torch.autograd.grad(reference(x2, w, t, b), w)[0], torch.float64, "dw")


def test_num_items_in_batch_and_gradient_accumulation(backend, device):
    """Two micro-batches, each divided by the whole batch's token count, sum to the full batch's mean."""
    x, w, b, t = inputs(30, 16, 25, torch.float64, device, ignored=(2, 17, 18))
    items = int((t != -100).sum())
    full = trainops.linear_cross_entropy(x, w, t, b)
    want = torch.autograd.grad(full, (x, w, b))
    total = 0
    got = [torch.zeros_like(p) for p in (x, w, b)]
    for k, part in enumerate((slice(0, 13), slice(13, 30))):
        count = torch.tensor(items, device=device) if k else items   # an int or a device tensor
        loss = trainops.linear_cross_entropy(x[part], w, t[part], b, num_items_in_batch=count)
        assert_close(loss, reference(x[part], w, t[part], b, num_items=items), torch.float64, "micro-batch loss")
        total = total + loss
        for g, d in zip(got, torch.autograd.grad(loss, (x, w, b))):
            g += d
    assert_close(total, full, torch.float64, "summed losses")
    for a, e in zip(got, want):
        assert_close(a, e, torch.float64, "accumulated gradient")


def test_ignored_rows_all_ignored_and_empty(backend, device):
    x, w, b, t = inputs(9, 8, 12, torch.float64, device, ignored=range(9))
    loss = trainops.linear_cross_entropy(x, w, t, b)
    assert loss.isnan()   # 0 / 0, as torch
    for g in torch.autograd.grad(loss, (x, w, b)):
        assert torch.equal(g, torch.zeros_like(g))
    s = trainops.linear_cross_entropy(x, w, t, b, reduction="sum")
    assert s.item() == 0.0
    x0, t0 = x[:0].detach().requires_grad_(), t[:0]
    assert trainops.linear_cross_entropy(x0, w, t0, b).isnan()
    assert trainops.linear_cross_entropy(x0, w, t0, b, reduction="none").shape == (0,)
    loss = trainops.linear_cross_entropy(x0, w, t0, b, reduction="sum")
    dx, dw = torch.autograd.grad(loss, (x0, w))
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros_like(dw))


def test_leading_axes_and_non_contiguous_hidden(backend, device):
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(3, 16, 7, dtype=torch.float64, generator=gen).to(device)
    x = base.transpose(1, 2).requires_grad_()   # (3, 7, 16), not contiguous; a leaf via the transpose's base
    w = torch.randn(11, 16, dtype=torch.float64, generator=gen).to(device).requires_grad_()
    t = torch.randint(0, 11, (3, 7), generator=gen).to(device)
    for reduction in ("mean", "none"):
        loss = trainops.linear_cross_entropy(x, w, t, reduction=reduction)
        want = reference(x, w, t, reduction=reduction)
        assert loss.shape == want.shape
        assert_close(loss, want, torch.float64, reduction)
        for a, e in zip(grads_of(loss, (x, w), reduction), grads_of(want, (x, w), reduction)):
            assert_close(a, e, torch.float64, reduction)


def test_deterministic_run_to_run(backend, device):
    x, w, b, t = inputs(50, 32, 40, torch.float32, device, seed=9)
    runs = []
    for _ in range(2):
        with small_chunks(16):
            loss = trainops.linear_cross_entropy(x, w, t, b, label_smoothing=0.1)
            runs.append((loss, *torch.autograd.grad(loss, (x, w, b))))
    for a, e in zip(*runs):
        assert torch.equal(a, e)


def test_autocast_runs_the_matmuls_in_its_dtype_and_returns_a_float32_loss():
    x, w, b, t = inputs(24, 16, 20, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = trainops.linear_cross_entropy(x, w, t, b)
    assert loss.dtype == torch.float32
    dx, dw, db = torch.autograd.grad(loss, (x, w, b))
    assert dx.dtype == dw.dtype == db.dtype == torch.float32
    want = reference(x.bfloat16(), w.bfloat16(), t, b.bfloat16())
    assert_close(loss, want, torch.bfloat16, "loss")
    assert_close(dw, torch.autograd.grad(reference(x.bfloat16().float(), w, t, b), w)[0], torch.bfloat16, "dw")


def test_a_second_backward_raises_but_float64_allows_it(backend, device):
    x, w, b, t = inputs(10, 8, 12, torch.float32, device)
    loss = trainops.linear_cross_entropy(x, w, t, b)
    loss.backward(retain_graph=True)
    with pytest.raises(UnsupportedError, match="second backward"):
        loss.backward()
    x, w, b, t = inputs(6, 4, 5, torch.float64, device)
    assert torch.autograd.gradcheck(lambda x, w, b: trainops.linear_cross_entropy(x, w, t, b, z_loss=0.01,
                                                                                  softcap=2.0), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: trainops.linear_cross_entropy(x, w, t, reduction="none",
                                                                               label_smoothing=0.1), (x, w))


def test_bad_targets_raise(backend, device):
    x, w, b, t = inputs(10, 8, 12, torch.float32, device)
    t[4] = 12
    with torch.no_grad(), pytest.raises(IndexOutOfRangeError, match="argument 'target' holds class 12"):
        trainops.linear_cross_entropy(x, w, t, b, check_target="immediate")
    with pytest.raises(IndexOutOfRangeError, match="argument 'target' holds class 12"):   # before the launch
        trainops.linear_cross_entropy(x, w, t, b, check_target="immediate")
    with pytest.raises(IndexOutOfRangeError, match="argument 'target'"):   # eager training: the kernel's flag
        trainops.linear_cross_entropy(x, w, t, b).backward()
        if device == "cuda":
            torch.cuda.synchronize()
            trainops.linear_cross_entropy(x, w, t.clamp(max=11), b)
    # no gradient (an evaluation): the CPU raises at the call; the GPU flags it, raised by a later call
    with torch.no_grad(), pytest.raises(IndexOutOfRangeError, match="argument 'target'"):
        trainops.linear_cross_entropy(x, w, t, b)
        if device == "cuda":
            torch.cuda.synchronize()
            trainops.linear_cross_entropy(x, w, t.clamp(max=11), b)
    loss = trainops.linear_cross_entropy(x, w, t, b, check_target=False)   # unchecked: the row is left out
    t_kept = t.clone()
    t_kept[4] = -100
    assert_close(loss, reference(x, w, t_kept, b), torch.float32, "unchecked")


def test_float16_none_with_a_large_upstream_gradient(backend, device):
    """Reduction "none" in float16: each row's upstream gradient (here 20, a loss scale's size) is
    applied with the kernel's 2^k headroom divided out first, so nothing overflows."""
    x, w, b, t = inputs(40, 32, 70, torch.float16, device, seed=4)
    with small_chunks(16):
        loss = trainops.linear_cross_entropy(x, w, t, b, reduction="none")
        got = torch.autograd.grad(loss.sum() * 20, (x, w, b))
    want_loss = reference(x, w, t, b, reduction="none")
    want = torch.autograd.grad(want_loss.sum() * 20, (x, w, b))
    for name, a, e in zip("xwb", got, want):
        assert_close(a, e, torch.float16, f"d{name}")


def test_zero_total_class_weight_gives_nan_as_torch(backend, device):
    x, w, b, t = inputs(9, 8, 12, torch.float64, device, ignored=())
    cw = torch.ones(12, dtype=torch.float64, device=device)
    cw[t] = 0.0   # every kept row's class weighs 0: torch's weighted mean is 0 / 0
    loss = trainops.linear_cross_entropy(x, w, t, b, class_weight=cw, z_loss=1e-2)
    assert loss.isnan() and F.cross_entropy(F.linear(x, w, b), t, cw).isnan()


def test_class_weight_that_requires_grad_is_refused(backend, device):
    x, w, b, t = inputs(9, 8, 12, torch.float64, device)
    cw = torch.ones(12, dtype=torch.float64, device=device, requires_grad=True)
    with pytest.raises(UnsupportedError, match="argument 'class_weight'"):
        trainops.linear_cross_entropy(x, w, t, b, class_weight=cw)
    with torch.no_grad():   # no gradient wanted: fine
        trainops.linear_cross_entropy(x, w, t, b, class_weight=cw)


@pytest.mark.parametrize("vocab_align", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_vocabulary_layouts_agree(backend, device, vocab_align, dtype):
    """A vocabulary of 70 classes computed through chunks 70 (unpadded), 72 or 128 columns wide: the
    same loss and gradients as the float64 reference, the gradients in the tensors' own shapes."""
    x, w, b, t = inputs(33, 24, 70, dtype, device, seed=5)
    config = LinearCrossEntropyHeuristics(chunk_bytes=1, min_rows=16, vocab_align=vocab_align)
    assert config.padded_classes(70) == {1: 70, 8: 72, 64: 128}[vocab_align]
    for options in (dict(), dict(softcap=3.0, logit_scale=1.5, temperature=1.25)):
        for reduction in ("mean", "none"):
            with trainops.heuristics(config):
                loss = trainops.linear_cross_entropy(x, w, t, b, reduction=reduction, **options)
                got = grads_of(loss, (x, w, b), reduction)
            want_loss = reference(x, w, t, b, reduction=reduction, **options)
            want = grads_of(want_loss, (x, w, b), reduction)
            assert_close(loss, want_loss, dtype, f"loss {options} {reduction}")
            for name, a, e, ref_input in zip("xwb", got, want, (x, w, b)):
                assert a.shape == ref_input.shape and a.dtype == ref_input.dtype and a.is_contiguous(), name
                assert_close(a, e, dtype, f"d{name} {options} {reduction}")


def test_float16_rows_with_a_logit_scale(backend, device):
    """Reduction "none" in float16 with Granite's kind of logit scale: the scale's factor stays in the
    float32 scalar (not in each row's float16 factor, where it would underflow toward zero)."""
    x, w, b, t = inputs(256, 32, 70, torch.float16, device, seed=4)
    with small_chunks(64):
        loss = trainops.linear_cross_entropy(x, w, t, b, reduction="none", logit_scale=1 / 16, temperature=2.0)
        got = torch.autograd.grad(loss.mean(), (x, w, b))
    want = torch.autograd.grad(reference(x, w, t, b, reduction="none", logit_scale=1 / 16, temperature=2.0).mean(),
                               (x, w, b))
    for name, a, e in zip("xwb", got, want):
        assert a.abs().max() > 0, name
        assert_close(a, e, torch.float16, f"d{name}")


def test_logit_scale_and_temperature_gradcheck():
    x, w, b, t = inputs(9, 6, 11, torch.float64, "cpu", seed=7)
    with trainops.backend("cpu"):
        for reduction in ("mean", "none"):
            torch.autograd.gradcheck(
                lambda x, w, b: trainops.linear_cross_entropy(x, w, t, b, reduction=reduction, softcap=2.0,
                                                              logit_scale=0.75, temperature=1.5), (x, w, b))


@pytest.mark.parametrize("field, value", [("vocab_align", 0), ("vocab_align", True), ("min_rows", 0), ("min_chunks", 0),
                                          ("chunk_bytes", 1.5)])
def test_heuristics_fields_are_checked(field, value):
    with pytest.raises(InvalidProblemError, match=f"heuristics.{field}"):
        LinearCrossEntropyHeuristics(**{field: value})


def test_default_chunk_rows_within_the_budget_and_min_chunks():
    default = LinearCrossEntropyHeuristics()
    assert default.rows(10**6, 128256, 2) == 2048   # 512 MiB of bf16 logits: 2093 rows fit
    assert default.rows(10**6, 128256, 4) == 1024
    assert default.rows(100, 128256, 2) == 64       # two chunks, at least min_rows each
    assert default.rows(50, 128256, 2) == 50        # never more than the tokens
    assert default.rows(10**6, 2**40, 2) == 64      # a vocabulary too wide for the budget: min_rows
    assert default.rows(4096, 32064, 2) == 2048     # a small vocabulary: two chunks, not the one 8192 rows fit
    assert default.rows(4095, 32064, 2) == 2048
    assert default.rows(4097, 32064, 2) == 2112     # 2049 up to a multiple of 64: two chunks of about half
    assert default.rows(5000, 32064, 2) == 2560
    assert LinearCrossEntropyHeuristics(min_chunks=3).rows(3075, 32064, 2) == 1088   # three chunks
    assert default.rows(16384, 50304, 2) == 4096    # GPT-2's 16 x 1024: the budget's 4096 rows
    assert LinearCrossEntropyHeuristics(min_chunks=1).rows(4096, 32064, 2) == 4096
    assert LinearCrossEntropyHeuristics(min_rows=4096).rows(4096, 32064, 2) == 4096   # min_rows wins


@pytest.mark.parametrize("call, error, match", [
    (lambda x, w, t: trainops.linear_cross_entropy(x, w[:, :4], t), InvalidProblemError, "argument 'weight'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t[:3]), InvalidProblemError, "argument 'target'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t.float()), InvalidProblemError, "argument 'target'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x.long(), w, t), UnsupportedError, "argument 'hidden'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, torch.zeros(3)), InvalidProblemError, "argument 'bias'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, class_weight=torch.ones(3)), InvalidProblemError,
     "argument 'class_weight'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, reduction="avg"), InvalidProblemError,
     "argument 'reduction'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, label_smoothing=1.5), InvalidProblemError,
     "argument 'label_smoothing'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, z_loss=-1.0), InvalidProblemError, "argument 'z_loss'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, softcap=0.0), InvalidProblemError, "argument 'softcap'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, logit_scale=0.0), InvalidProblemError,
     "argument 'logit_scale'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, temperature=float("inf")), InvalidProblemError,
     "argument 'temperature'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, temperature=True), InvalidProblemError,
     "argument 'temperature'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, ignore_index=1.5), InvalidProblemError,
     "argument 'ignore_index'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, reduction="sum", num_items_in_batch=4),
     InvalidProblemError, "argument 'num_items_in_batch'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, num_items_in_batch=0), InvalidProblemError,
     "argument 'num_items_in_batch'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, num_items_in_batch=torch.tensor(2.0)),
     InvalidProblemError, "argument 'num_items_in_batch'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, loss_dtype=torch.int32), InvalidProblemError,
     "argument 'loss_dtype'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w[:0], t), InvalidProblemError, "argument 'weight'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x.tolist(), w, t), InvalidProblemError, "argument 'hidden'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x[:, :0], w[:, :0], t), InvalidProblemError, "argument 'hidden'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w.long(), t), UnsupportedError, "argument 'weight'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, torch.zeros(6).to(torch.float8_e4m3fn)),
     UnsupportedError, "argument 'bias'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, ignore_index=2**70), InvalidProblemError,
     "argument 'ignore_index'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, num_items_in_batch=2**70), InvalidProblemError,
     "argument 'num_items_in_batch'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x, w, t, check_target="yes"), InvalidProblemError,
     "argument 'check_target'"),
    (lambda x, w, t: trainops.linear_cross_entropy(x.to("meta"), w.to("meta"), t.to("meta")), UnsupportedError,
     "argument 'hidden'"),
])
def test_errors_name_the_argument(call, error, match):
    x, w, _, t = inputs(5, 8, 6, torch.float32, "cpu", bias=False)
    with pytest.raises(error, match=match):
        call(x, w, t)


def test_torch_compile_fullgraph(backend, device):
    x, w, b, t = inputs(20, 16, 18, torch.float32, device)
    cw = torch.rand(18).to(device) + 0.5

    def f(x, w, b, reduction):
        return trainops.linear_cross_entropy(x, w, t, b, class_weight=cw, reduction=reduction, z_loss=1e-3,
                                             logit_scale=2.0, temperature=0.5).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for reduction in ("mean", "none"):
        loss = compiled(x, w, b, reduction)
        got = torch.autograd.grad(loss, (x, w, b))
        want_loss = f(x, w, b, reduction)
        want = torch.autograd.grad(want_loss, (x, w, b))
        assert_close(loss, want_loss, torch.float32, reduction)
        for a, e in zip(got, want):
            assert_close(a, e, torch.float32, reduction)
    torch._dynamo.reset()


def test_the_module(backend, device):
    cw = torch.rand(14).to(device) + 0.5
    module = trainops.nn.LinearCrossEntropyLoss(cw, ignore_index=-1, label_smoothing=0.05, z_loss=1e-3, softcap=5.0,
                                                logit_scale=0.5, temperature=1.5)
    assert "class_weight" in module.state_dict()
    x, w, b, t = inputs(11, 8, 14, torch.float64, device, ignored=())
    t[2] = -1
    loss = module(x, w, t, b)
    want = reference(x, w, t, b, class_weight=cw, ignore_index=-1, label_smoothing=0.05, z_loss=1e-3, softcap=5.0,
                     logit_scale=0.5, temperature=1.5)
    assert_close(loss, want, torch.float64, "module")
    with pytest.raises(InvalidProblemError, match="argument 'reduction'"):
        trainops.nn.LinearCrossEntropyLoss(reduction="avg")
    with pytest.raises(InvalidProblemError, match="argument 'temperature'"):
        trainops.nn.LinearCrossEntropyLoss(temperature=-1.0)


# ---- GPU: LM-head sizes ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_gpu_lm_head_against_float64(weight_dtype):
    """bf16 hidden, a 32000-class head (bf16 weights, or float32 master weights whose float32
    gradient the chunks accumulate into directly), several default-size chunks."""
    torch.manual_seed(0)
    n, h, v = 6144, 1024, 32000
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda") / 32).to(weight_dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    t[::7] = -100
    with trainops.heuristics(LinearCrossEntropyHeuristics(chunk_bytes=2048 * v * 2)):
        loss = trainops.linear_cross_entropy(x, w, t, z_loss=1e-4, label_smoothing=0.1)
        dx, dw = torch.autograd.grad(loss, (x, w))
    assert dw.dtype == weight_dtype
    x64, w64 = x.detach().double().requires_grad_(), w.detach().bfloat16().double().requires_grad_()
    want = reference(x64, w64, t, z_loss=1e-4, label_smoothing=0.1)
    want_dx, want_dw = torch.autograd.grad(want, (x64, w64))
    assert_close(loss.float(), want, torch.bfloat16, "loss")
    assert abs(loss.item() - want.item()) < 2e-3 * abs(want.item())
    assert_close(dx, want_dx, torch.bfloat16, "dx")
    assert_close(dw, want_dw, torch.bfloat16, "dw")


@pytest.mark.gpu
@pytest.mark.parametrize("vocab_align", [1, 8])
def test_gpu_gpt2_head_odd_vocabulary_against_float64(vocab_align):
    """GPT-2's 50257-word head (bf16, H = 768): padded (the default) and unpadded layouts both match
    float64, and the padded one returns gradients of the weight's own shape."""
    torch.manual_seed(0)
    n, h, v = 4096, 768, 50257
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    t[::7] = -100
    with trainops.heuristics(LinearCrossEntropyHeuristics(vocab_align=vocab_align)):
        loss = trainops.linear_cross_entropy(x, w, t, logit_scale=0.5)
        dx, dw = torch.autograd.grad(loss, (x, w))
    want = reference(x, w, t, logit_scale=0.5)
    want_dx, want_dw = torch.autograd.grad(want, (x, w))
    assert dw.shape == (v, h) and dw.is_contiguous()
    assert_close(loss, want, torch.bfloat16, "loss")
    assert_close(dx, want_dx, torch.bfloat16, "dx")
    assert_close(dw, want_dw, torch.bfloat16, "dw")


@pytest.mark.gpu
def test_gpu_extra_memory_is_one_chunk_and_the_accumulator():
    """bf16 head, 2048-token chunks: the peak over the step's steady state is one chunk's logits, the
    float32 dW accumulator and a float32 dhidden chunk (plus the cross-entropy's small buffers)."""
    torch.manual_seed(0)
    n, h, v, rows = 8192, 1024, 32000, 2048
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda") / 32).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    config = LinearCrossEntropyHeuristics(chunk_bytes=rows * v * 2)
    with trainops.heuristics(config):
        trainops.linear_cross_entropy(x, w, t).backward()   # warm-up: cuBLAS workspaces, plans
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainops.linear_cross_entropy(x, w, t).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    expected = rows * v * 2 + v * h * 4 + rows * h * 4
    assert extra <= expected + 16 * 2**20, (extra / 2**20, expected / 2**20)


@pytest.mark.gpu
def test_gpu_compiled_after_eager_calls():
    """Eager training calls leave bad-target flags pending (read later without a sync); tracing a
    compiled forward + backward afterwards must not touch them (they are real tensors)."""
    x, w, b, t = inputs(64, 32, 50, torch.bfloat16, "cuda")
    trainops.linear_cross_entropy(x, w, t, b).backward()   # eager: a flag is noted
    x.grad = w.grad = b.grad = None

    def f(x, w, b):
        return trainops.linear_cross_entropy(x, w, t, b)

    loss = torch.compile(f)(x, w, b)
    got = torch.autograd.grad(loss, (x, w, b))
    want_loss = f(x, w, b)
    want = torch.autograd.grad(want_loss, (x, w, b))
    assert torch.equal(loss, want_loss)
    for a, e in zip(got, want):
        assert_close(a, e, torch.bfloat16, "compiled gradient")
    torch._dynamo.reset()
