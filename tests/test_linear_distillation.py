"""trainops.linear_distillation_loss: float64 references (TRL's generalised JSD written out with
F.kl_div on materialised logits, the hard cross-entropy) over beta, temperature, the logit
transform and several chunks; float32 / bf16 against float64; ignored and all-ignored tokens;
gradients only where asked and none under no_grad; determinism; gradcheck; torch.compile; the
module; errors; GPU runs at LM-head sizes."""

import math

import pytest
import torch
import torch.nn.functional as F

import trainops
from trainops.errors import IndexOutOfRangeError, InvalidProblemError, UnsupportedError
from trainops.ops import chunked_linear
from trainops.ops.chunked_linear import ChunkedLinearHeuristics

from numerics import assert_close


def small_chunks(rows):
    return trainops.heuristics(ChunkedLinearHeuristics(chunk_bytes=1, min_rows=rows))


def transform(x, w, b, logit_scale=1.0, softcap=None):
    z = F.linear(x.double(), w.double(), None if b is None else b.double()) * logit_scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def reference(xs, ws, xt, wt, labels=None, *, bs=None, bt=None, beta=0.5, temperature=1.0, weight_soft_loss=1.0,
              weight_hard_loss=0.0, ignore_index=-100, logit_scale=1.0, softcap=None):
    """float64, logits materialised: TRL's generalized_jsd_loss (reduction batchmean) + cross-entropy."""
    zs, zt = transform(xs, ws, bs, logit_scale, softcap), transform(xt, wt, bt, logit_scale, softcap)
    zs, zt = zs.reshape(-1, zs.shape[-1]), zt.reshape(-1, zt.shape[-1])
    ls, lt = F.log_softmax(zs / temperature, -1), F.log_softmax(zt / temperature, -1)
    if beta == 0:
        jsd = F.kl_div(ls, lt, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(lt, ls, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=ls.dtype, device=ls.device)
        lm = torch.logsumexp(torch.stack([ls + torch.log1p(-b), lt + torch.log(b)]), 0)
        jsd = (b * F.kl_div(lm, lt, reduction="none", log_target=True)
               + (1 - b) * F.kl_div(lm, ls, reduction="none", log_target=True))
    jsd = jsd.sum(-1)
    if labels is None:
        return weight_soft_loss * jsd.sum() / max(1, jsd.shape[0])
    t = labels.reshape(-1)
    mask = t != ignore_index
    count = mask.sum().clamp_min(1)
    soft = jsd[mask].sum() / count
    hard = F.cross_entropy(zs, t, ignore_index=ignore_index, reduction="sum") / count
    return weight_soft_loss * soft + weight_hard_loss * hard


def inputs(n, hs, ht, v, dtype, *, bias=True, seed=0, ignored=(3,), lead=None):
    gen = torch.Generator().manual_seed(seed)
    shape = lead or (n,)
    xs = (torch.randn(*shape, hs, generator=gen)).to(dtype).requires_grad_()
    ws = (torch.randn(v, hs, generator=gen) / math.sqrt(hs) * 3).to(dtype).requires_grad_()
    bs = (torch.randn(v, generator=gen) * 0.5).to(dtype).requires_grad_() if bias else None
    xt = torch.randn(*shape, ht, generator=gen).to(dtype)
    wt = (torch.randn(v, ht, generator=gen) / math.sqrt(ht) * 3).to(dtype)
    labels = torch.randint(0, v, shape, generator=gen)
    flat = labels.view(-1)
    for i in ignored:
        if i < flat.numel():
            flat[i] = -100
    return xs, ws, bs, xt, wt, labels


SETTINGS = [
    dict(beta=0.0),
    dict(beta=1.0),
    dict(beta=0.5),
    dict(beta=0.3, temperature=2.0),
    dict(beta=0.7, weight_hard_loss=0.5, weight_soft_loss=0.25),
    dict(beta=0.0, temperature=0.5, weight_hard_loss=1.0, logit_scale=0.5, softcap=4.0),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_float64_matches_the_reference_over_chunks(settings):
    xs, ws, bs, xt, wt, labels = inputs(23, 12, 10, 17, torch.float64)
    with small_chunks(5):
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, **settings)
        got = torch.autograd.grad(loss * 0.75, (xs, ws, bs))
    want = reference(xs, ws, xt, wt, labels, bs=bs, **settings)
    expected = torch.autograd.grad(want * 0.75, (xs, ws, bs))
    assert loss.dtype == torch.float64
    assert_close(loss, want, torch.float64, "loss")
    for name, a, e in zip(("dx", "dw", "db"), got, expected):
        assert_close(a, e, torch.float64, name)


@pytest.mark.parametrize("settings", SETTINGS + [dict(weight_soft_loss=0.0, weight_hard_loss=1.0)],
                         ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_float32_each_backend_against_float64(backend, device, settings):
    """The per-chunk kernel (Triton under the interpreter here; torch ops on the CPU backend) over
    every mode, a vocabulary that is not a multiple of its block, ignored rows."""
    xs, ws, bs, xt, wt, labels = inputs(19, 12, 10, 37, torch.float32, ignored=(0, 5))
    with small_chunks(8), trainops.track_kernels() as used:
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, **settings)
        got = torch.autograd.grad(loss, (xs, ws, bs))
    # the row kernel, and the backward's scaling by the upstream gradient (cross_entropy.scale_unless_one_)
    assert {(op, kernel_backend) for op, kernel_backend, *_ in used} == {("linear_distillation_rows", backend),
                                                                         ("cross_entropy_grad_scale", backend)}
    leaves = [t.detach().double().requires_grad_() for t in (xs, ws, bs)]
    want = reference(leaves[0], leaves[1], xt, wt, labels, bs=leaves[2], **settings)
    expected = torch.autograd.grad(want, leaves)
    assert_close(loss, want, torch.float32, "loss")
    for name, a, e in zip(("dx", "dw", "db"), got, expected):
        assert_close(a, e, torch.float32, name)
    with torch.no_grad(), small_chunks(8):
        assert_close(trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, **settings), want,
                     torch.float32, "no_grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_labels", [True, False])
def test_float32_and_bf16_against_float64(backend, dtype, with_labels):
    xs, ws, bs, xt, wt, labels = inputs(40, 16, 24, 33, dtype, ignored=(0, 7, 8))
    settings = dict(beta=0.4, temperature=1.5, weight_hard_loss=0.3 if with_labels else 0.0, softcap=6.0)
    labels = labels if with_labels else None
    with small_chunks(16):
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, teacher_bias=bs.detach(),
                                                 **settings)
        got = torch.autograd.grad(loss, (xs, ws, bs))
    assert loss.dtype == torch.float32 and [g.dtype for g in got] == [dtype] * 3
    leaves = [t.detach().double().requires_grad_() for t in (xs, ws, bs)]
    want = reference(leaves[0], leaves[1], xt, wt, labels, bs=leaves[2], bt=bs.detach(), **settings)
    expected = torch.autograd.grad(want, leaves)
    assert_close(loss, want, dtype, "loss")
    for name, a, e in zip(("dx", "dw", "db"), got, expected):
        assert_close(a, e, dtype, name)


def test_weight_gradient_accumulated_in_the_weight_dtype():
    """ChunkedLinearHeuristics(weight_grad_accumulator="weight"): a bf16 head's dW summed in bf16 over
    the chunks (one rounding a chunk), within bf16 tolerance; a float32 head's unchanged."""
    xs, ws, bs, xt, wt, labels = inputs(40, 16, 16, 33, torch.bfloat16)
    leaves = [t.detach().double().requires_grad_() for t in (xs, ws)]
    want = torch.autograd.grad(reference(*leaves, xt, wt, labels, beta=0.3, weight_hard_loss=0.5), leaves)
    for accumulator in ("float32", "weight"):
        config = ChunkedLinearHeuristics(chunk_bytes=1, min_rows=8, weight_grad_accumulator=accumulator)
        with trainops.heuristics(config):
            loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, beta=0.3, weight_hard_loss=0.5)
            dx, dw = torch.autograd.grad(loss, (xs, ws))
        assert dw.dtype == torch.bfloat16
        assert_close(dx, want[0], torch.bfloat16, f"dx {accumulator}")
        assert_close(dw, want[1], torch.bfloat16, f"dw {accumulator}")
    xs, ws, bs, xt, wt, labels = inputs(20, 8, 8, 9, torch.float32)
    grads = []
    for accumulator in ("float32", "weight"):
        config = ChunkedLinearHeuristics(chunk_bytes=1, min_rows=8, weight_grad_accumulator=accumulator)
        with trainops.heuristics(config):
            grads.append(torch.autograd.grad(trainops.linear_distillation_loss(xs, ws, xt, wt, labels), (ws,))[0])
    assert torch.equal(*grads)
    # a bf16 head under float32 hidden states (the matmuls' dtype): the dW matmul adds into float32
    # either way (an output in the weight's dtype would round the float32 operands' products)
    xs, ws, bs, xt, wt, labels = inputs(20, 8, 8, 9, torch.float32)
    ws = ws.detach().to(torch.bfloat16).requires_grad_()
    grads = []
    for accumulator in ("float32", "weight"):
        config = ChunkedLinearHeuristics(chunk_bytes=1, min_rows=8, weight_grad_accumulator=accumulator)
        with trainops.heuristics(config):
            grads.append(torch.autograd.grad(trainops.linear_distillation_loss(xs, ws, xt, wt, labels), (ws,))[0])
    assert grads[0].dtype == torch.bfloat16 and torch.equal(*grads)
    with pytest.raises(InvalidProblemError, match="weight_grad_accumulator"):
        ChunkedLinearHeuristics(weight_grad_accumulator="bf16")


def test_ignored_all_ignored_and_empty(monkeypatch):
    xs, ws, bs, xt, wt, labels = inputs(9, 8, 8, 7, torch.float64, ignored=range(9))
    loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, weight_hard_loss=1.0)
    grads = torch.autograd.grad(loss, (xs, ws, bs))
    assert loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads)   # TRL: 0 / max(1, 0)
    # the ignored rows of a partly ignored batch get no gradient; others do
    labels[:4] = 2
    loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, weight_hard_loss=1.0)
    dx, = torch.autograd.grad(loss, (xs,))
    assert torch.count_nonzero(dx[4:]) == 0 and torch.count_nonzero(dx[:4]) == 4 * 8
    assert_close(loss, reference(xs, ws, xt, wt, labels, bs=bs, weight_hard_loss=1.0), torch.float64, "partly")
    empty = [t[:0] for t in (xs, xt, labels)]
    new_empty = torch.empty   # poisoned: the weight gradient's buffer is allocated, no chunk writes it

    def poisoned(*args, **kwargs):
        t = new_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)
    loss = trainops.linear_distillation_loss(empty[0], ws, empty[1], wt, empty[2])
    dw, = torch.autograd.grad(loss, (ws,))
    assert loss.item() == 0.0 and torch.count_nonzero(dw) == 0


def test_all_ignored_rows_float32_each_backend(backend):
    """Every row ignored, then half of them, through each backend's float32 kernels (Triton under
    the interpreter), in chunks smaller than the batch: a zero loss and zero gradients, then the
    float64 formula within float32 tolerance with no gradient on the ignored rows."""
    xs, ws, bs, xt, wt, labels = inputs(9, 8, 8, 7, torch.float32, ignored=range(9))
    with small_chunks(4):
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, weight_hard_loss=1.0)
        grads = torch.autograd.grad(loss, (xs, ws, bs))
    assert loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads)
    labels[:4] = 2
    with small_chunks(4):
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, weight_hard_loss=1.0,
                                                 beta=0.3)
        dx, dw = torch.autograd.grad(loss, (xs, ws))
    x64, w64 = (t.detach().double().requires_grad_() for t in (xs, ws))
    want = reference(x64, w64, xt.double(), wt.double(), labels, bs=bs.detach().double(), weight_hard_loss=1.0, beta=0.3)
    dx64, dw64 = torch.autograd.grad(want, (x64, w64))
    assert_close(loss, want, torch.float32, "loss")
    assert_close(dx, dx64, torch.float32, "dx")
    assert_close(dw, dw64, torch.float32, "dw")
    assert torch.count_nonzero(dx[4:]) == 0


def test_num_items_in_batch_divides_the_sum():
    xs, ws, bs, xt, wt, labels = inputs(10, 8, 8, 7, torch.float64, ignored=(1, 2))
    settings = dict(beta=0.4, weight_hard_loss=0.5)
    whole = reference(xs, ws, xt, wt, labels, bs=bs, **settings) * 8   # 8 kept tokens: the sum
    for num_items in (23, torch.tensor([23])):
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, num_items_in_batch=num_items,
                                                 **settings)
        assert_close(loss, whole / 23, torch.float64, "loss")
        assert_close(torch.autograd.grad(loss, (xs,))[0],
                     torch.autograd.grad(whole / 23, (xs,), retain_graph=True)[0], torch.float64, "dx")


def test_leading_axes_and_non_contiguous_hidden():
    xs, ws, bs, xt, wt, labels = inputs(0, 8, 6, 13, torch.float64, lead=(3, 5))
    xs_t = xs.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    loss = trainops.linear_distillation_loss(xs_t, ws, xt, wt, labels, beta=0.2)
    dx, = torch.autograd.grad(loss, (xs_t,))
    want = reference(xs_t, ws, xt, wt, labels, beta=0.2)
    assert_close(loss, want, torch.float64, "loss")
    assert dx.shape == xs.shape
    assert_close(dx, torch.autograd.grad(want, (xs_t,))[0], torch.float64, "dx")


def test_only_the_gradients_asked_for_and_none_under_no_grad(monkeypatch):
    xs, ws, bs, xt, wt, labels = inputs(12, 8, 8, 9, torch.float32)
    calls = []
    original = chunked_linear.ChunkedHead.backward
    monkeypatch.setattr(chunked_linear.ChunkedHead, "backward", 
                        lambda self, *a: (calls.append((self.dx is not None, self.dw is not None)), original(self, *a)))
    with torch.no_grad():
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs)
    assert not calls and not loss.requires_grad
    frozen = ws.detach()
    loss = trainops.linear_distillation_loss(xs, frozen, xt, wt, labels)
    assert calls and calls[-1] == (True, False)
    dx, = torch.autograd.grad(loss, (xs,))
    want = reference(xs, frozen, xt, wt, labels)
    assert_close(dx, torch.autograd.grad(want, (xs,))[0], torch.float32, "dx")
    # the teacher takes no gradient, even when its tensors require one
    wt.requires_grad_()
    loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels)
    assert torch.autograd.grad(loss, (wt,), allow_unused=True) == (None,)


def test_deterministic_run_to_run(backend):
    xs, ws, bs, xt, wt, labels = inputs(50, 16, 16, 21, torch.float32)
    runs = []
    for _ in range(2):
        with small_chunks(8):
            loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, weight_hard_loss=0.5)
            runs.append((loss, *torch.autograd.grad(loss, (xs, ws, bs))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_second_backward_raises_but_float64_allows_it():
    xs, ws, bs, xt, wt, labels = inputs(6, 8, 8, 9, torch.float32)
    loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(UnsupportedError, match="second backward"):
        loss.backward()
    xs, ws, bs, xt, wt, labels = inputs(6, 8, 8, 9, torch.float64)
    loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels)
    first = torch.autograd.grad(loss, (xs,), retain_graph=True)[0]
    assert torch.equal(first, torch.autograd.grad(loss, (xs,))[0])


def test_gradcheck():
    xs, ws, bs, xt, wt, labels = inputs(5, 4, 4, 6, torch.float64, ignored=(1,))

    def f(xs, ws, bs):
        return trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, beta=0.3, temperature=1.7,
                                                 weight_hard_loss=0.4, softcap=2.0)
    with small_chunks(2):
        assert torch.autograd.gradcheck(f, (xs, ws, bs))


def test_autocast_runs_the_matmuls_in_its_dtype():
    xs, ws, bs, xt, wt, labels = inputs(10, 8, 8, 9, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs)
    dx, dw = torch.autograd.grad(loss, (xs, ws))
    assert loss.dtype == torch.float32 and dx.dtype == torch.float32 and dw.dtype == torch.float32
    assert_close(loss, reference(xs, ws, xt, wt, labels, bs=bs), torch.bfloat16, "loss")


def test_torch_compile_fullgraph():
    xs, ws, bs, xt, wt, labels = inputs(14, 8, 8, 11, torch.float32)

    def f(xs, ws, bs):
        return trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, beta=0.6,
                                                 weight_hard_loss=0.5)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(xs, ws, bs)
    got = torch.autograd.grad(loss * 2, (xs, ws, bs))
    want_loss = f(xs, ws, bs)
    want = torch.autograd.grad(want_loss * 2, (xs, ws, bs))
    assert_close(loss, want_loss, torch.float32, "loss")
    for a, e in zip(got, want):
        assert_close(a, e, torch.float32, "gradient")
    torch._dynamo.reset()


def test_the_module():
    module = trainops.nn.LinearDistillationLoss(beta=0.2, temperature=2.0, weight_hard_loss=0.5, ignore_index=-1)
    xs, ws, bs, xt, wt, labels = inputs(11, 8, 6, 14, torch.float64, ignored=())
    labels[2] = -1
    loss = module(xs, ws, xt, wt, labels, student_bias=bs)
    want = reference(xs, ws, xt, wt, labels, bs=bs, beta=0.2, temperature=2.0, weight_hard_loss=0.5, ignore_index=-1)
    assert_close(loss, want, torch.float64, "module")
    assert "beta=0.2" in repr(module)
    with pytest.raises(InvalidProblemError, match="argument 'beta'"):
        trainops.nn.LinearDistillationLoss(beta=1.5)


@pytest.mark.parametrize("call, error, match", [
    (lambda a: trainops.linear_distillation_loss(*a, beta=-0.1), InvalidProblemError, "argument 'beta'"),
    (lambda a: trainops.linear_distillation_loss(*a, temperature=0.0), InvalidProblemError, "argument 'temperature'"),
    (lambda a: trainops.linear_distillation_loss(*a, weight_soft_loss=float("nan")), InvalidProblemError,
     "argument 'weight_soft_loss'"),
    (lambda a: trainops.linear_distillation_loss(*a, weight_hard_loss=-1.0), InvalidProblemError,
     "argument 'weight_hard_loss'"),
    (lambda a: trainops.linear_distillation_loss(*a, ignore_index=1.5), InvalidProblemError, "argument 'ignore_index'"),
    (lambda a: trainops.linear_distillation_loss(*a, logit_scale=0.0), InvalidProblemError, "argument 'logit_scale'"),
    (lambda a: trainops.linear_distillation_loss(*a, num_items_in_batch=0), InvalidProblemError,
     "argument 'num_items_in_batch'"),
    (lambda a: trainops.linear_distillation_loss(*a, num_items_in_batch=torch.ones(2)), InvalidProblemError,
     "argument 'num_items_in_batch'"),
    (lambda a: trainops.linear_distillation_loss(*a, softcap=-1.0), InvalidProblemError, "argument 'softcap'"),
    (lambda a: trainops.linear_distillation_loss(a[0], a[1], a[2], a[3], None, weight_hard_loss=1.0),
     InvalidProblemError, "argument 'labels'"),
    (lambda a: trainops.linear_distillation_loss(a[0], a[1], a[2], a[3], a[4][:-1]), InvalidProblemError,
     "argument 'labels'"),
    (lambda a: trainops.linear_distillation_loss(a[0], a[1], a[2], a[3], a[4].float()), InvalidProblemError,
     "argument 'labels'"),
    (lambda a: trainops.linear_distillation_loss(a[0], a[1][:, :-1], a[2], a[3], a[4]), InvalidProblemError,
     "argument 'student_weight'"),
    (lambda a: trainops.linear_distillation_loss(a[0], a[1], a[2][:-1], a[3], a[4]), InvalidProblemError,
     "argument 'teacher_hidden'"),
    (lambda a: trainops.linear_distillation_loss(a[0], a[1], a[2], a[3][:-1], a[4]), InvalidProblemError,
     "argument 'teacher_weight'"),
    (lambda a: trainops.linear_distillation_loss(a[0], a[1], a[2], a[3], a[4], student_bias=a[1][0]),
     InvalidProblemError, "argument 'student_bias'"),
    (lambda a: trainops.linear_distillation_loss(a[0].int(), a[1], a[2], a[3], a[4]), UnsupportedError,
     "argument 'student_hidden'"),
    (lambda a: trainops.linear_distillation_loss(a[0], "w", a[2], a[3], a[4]), InvalidProblemError,
     "argument 'student_weight'"),
    (lambda a: trainops.linear_distillation_loss(a[0].to("meta"), a[1].to("meta"), a[2], a[3], a[4]),
     UnsupportedError, "argument 'student_hidden'"),
])
def test_errors_name_the_argument(call, error, match):
    xs, ws, bs, xt, wt, labels = inputs(5, 8, 8, 6, torch.float32, bias=False)
    with pytest.raises(error, match=match):
        call((xs, ws, xt, wt, labels))


def test_a_label_out_of_range_raises_but_ignored_ones_do_not(backend):
    xs, ws, bs, xt, wt, labels = inputs(6, 8, 8, 5, torch.float32)
    labels[2] = -7   # a negative index that is not ignore_index
    with pytest.raises(IndexOutOfRangeError, match="argument 'labels'"):
        trainops.linear_distillation_loss(xs, ws, xt, wt, labels, weight_hard_loss=1.0)
    labels[2] = 5
    with pytest.raises(IndexOutOfRangeError, match="argument 'labels'"):
        trainops.linear_distillation_loss(xs, ws, xt, wt, labels, weight_hard_loss=1.0)
    labels[2] = -100
    trainops.linear_distillation_loss(xs, ws, xt, wt, labels, weight_hard_loss=1.0)


# ---- GPU: LM-head sizes ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gpu_lm_head_against_float64(beta):
    """bf16 student and teacher at a 32000-class head, several default-size chunks."""
    torch.manual_seed(0)
    n, h, v = 3072, 1024, 32000
    xs = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    ws = (torch.randn(v, h, device="cuda") / 32).to(torch.bfloat16).requires_grad_()
    xt = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    wt = (torch.randn(v, h, device="cuda") / 32).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[::7] = -100
    with trainops.heuristics(ChunkedLinearHeuristics(chunk_bytes=1024 * v * 4)):
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, beta=beta, temperature=2.0,
                                                 weight_hard_loss=0.5)
        dx, dw = torch.autograd.grad(loss, (xs, ws))
    leaves = [t.detach().double().requires_grad_() for t in (xs, ws)]
    want = reference(leaves[0], leaves[1], xt, wt, labels, beta=beta, temperature=2.0, weight_hard_loss=0.5)
    want_dx, want_dw = torch.autograd.grad(want, leaves)
    assert_close(loss, want, torch.bfloat16, "loss")
    assert_close(dx, want_dx, torch.bfloat16, "dx")
    assert_close(dw, want_dw, torch.bfloat16, "dw")


@pytest.mark.parametrize("dtype, beta", [(torch.bfloat16, 0.0), (torch.float16, 0.4)])
def test_half_gradient_written_over_the_logits_own_storage(backend, device, dtype, beta):
    """The row kernel writes dlogits (times the softcap / logit_scale factor) straight in a half
    head's dtype into ChunkedHead.gradient_buffer, the first half of each float32 logits row's
    bytes: the values are the float32 gradient rounded once (as the kernel rounds), over a
    vocabulary of several blocks, and the float32 gradient is float64's."""
    from trainops.ops.linear_distillation import distillation_rows

    # on a GPU (the Triton backend there): an LM head's vocabulary, 256 rows a launch
    rows, v, cap, scale = (3, 2 * 4096 + 37, 5.0, 0.75) if device == "cpu" else (256, 128256, 5.0, 0.75)
    gen = torch.Generator().manual_seed(1)
    us = (cap * torch.tanh(torch.randn(rows, v, generator=gen) * 2)).to(device)   # capped: the factor matters
    ut = (torch.randn(rows, v, generator=gen) * 3).to(device)
    labels = torch.tensor([0, v - 1, 4100] * (rows // 3) + [5] * (rows % 3), device=device)
    soft_w = torch.tensor([0.5, 0.0, 1.5] * (rows // 3) + [1.0] * (rows % 3), device=device)
    hard_w = torch.tensor([0.25, 1.0, 0.0] * (rows // 3) + [1.0] * (rows % 3), device=device)
    head = chunked_linear.ChunkedHead(torch.zeros(rows, 4, dtype=dtype, device=device),
                                      torch.zeros(v, 4, dtype=dtype, device=device), None, scale, cap)
    assert head.chain == (1 / cap, scale)
    want = us.double()
    distillation_rows(want, ut.double(), labels, soft_w.double(), hard_w.double(), beta, 1.5, hard=True, grad=True,
                      chain=head.chain)
    full = us.clone()
    distillation_rows(full, ut.clone(), labels, soft_w, hard_w, beta, 1.5, hard=True, grad=True, chain=head.chain)
    assert_close(full, want, torch.float32, "float32 dlogits")
    half_u = us.clone()
    du = head.gradient_buffer(half_u)
    assert du.dtype == dtype and du.shape == (rows, v) and du.stride() == (2 * v, 1)
    assert du.untyped_storage().data_ptr() == half_u.untyped_storage().data_ptr()
    distillation_rows(half_u, ut.clone(), labels, soft_w, hard_w, beta, 1.5, hard=True, grad=True, du=du,
                      chain=head.chain)
    assert_rounded_once(du, full, backend, device)


def assert_rounded_once(du, full, backend, device):
    """du is float32 ``full`` rounded once: bit-exact here (the interpreter truncates bf16); on a GPU
    within one ulp (a race between the half store and the float32 loads would be far off)."""
    from numerics import interpreter_rounding

    if device == "cpu":
        rounded = interpreter_rounding(full, du.dtype) if backend == "triton" else full.to(du.dtype)
        assert torch.equal(du, rounded)
    else:
        ulp = 2.0 ** -7 if du.dtype == torch.bfloat16 else 2.0 ** -10
        assert torch.allclose(du.float(), full, rtol=ulp, atol=1e-7), (du.float() - full).abs().max()


# ---- the row kernel's passes, the teacher's sub-chunks, the memory formula ---------------------------

@pytest.mark.parametrize("alternate", [True, False], ids=["alternate", "forwards"])
@pytest.mark.parametrize("beta, soft, hard, grad", [(0.0, True, True, True), (1.0, True, False, True),
                                                    (1.0, True, True, False), (0.5, True, True, True),
                                                    (0.5, True, False, False), (0.3, False, True, True)],
                         ids=["fwd-kl-hard", "rev-kl", "rev-kl-no-grad", "jsd-hard", "jsd-no-grad", "hard-only"])
def test_row_kernel_passes_over_several_blocks(beta, soft, hard, grad, alternate):
    """Each pass layout of the Triton row kernel (MODE 1's loss from its online first pass, MODE 2's
    three passes; the read-only passes backwards or, alternate_passes=False, every pass forwards)
    over a vocabulary of 3 blocks + 5 entries (row_block 16), float32 against float64: the per-row
    losses and dlogits within 1e-5; a row of weight 0 (ignored) gets a zero gradient row; nothing
    written without grad."""
    from trainops.ops.linear_distillation import distillation_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, v, block = 4, 3 * 16 + 5, 16
    gen = torch.Generator().manual_seed(7)
    us = (torch.randn(rows, v, generator=gen) * 3).to(device)
    ut = (us + torch.randn(rows, v, generator=gen) * 2).to(device)   # a teacher near the student
    labels = torch.tensor([0, v - 1, 2 * block + 5, 17], device=device)
    soft_w = torch.tensor([0.5, 0.0, 1.5, 1.0], device=device) if grad and soft else None
    hard_w = torch.tensor([0.25, 0.0, 1.0, 2.0], device=device) if grad and hard else None
    args = dict(hard=hard, grad=grad, chain=(0.2, 0.75))
    want = us.double()
    w_soft, w_hard = distillation_rows(want, ut.double() if soft else None, labels,
                                       None if soft_w is None else soft_w.double(),
                                       None if hard_w is None else hard_w.double(), beta, 1.5, **args)
    got = us.clone()
    soft_out = torch.full((rows,), float("nan"), device=device) if soft else torch.zeros(rows, device=device)
    hard_out = torch.full((rows,), float("nan"), device=device) if hard else torch.zeros(rows, device=device)
    config = ChunkedLinearHeuristics(row_block=block, row_warps=1, alternate_passes=alternate)
    with trainops.backend("triton"), trainops.heuristics(config), trainops.track_kernels() as used:
        distillation_rows(got, ut.clone() if soft else None, labels, soft_w, hard_w, beta, 1.5, **args,
                          soft_out=soft_out, hard_out=hard_out)
    assert {(op, kernel_backend) for op, kernel_backend, *_ in used} == {("linear_distillation_rows", "triton")}
    assert_close(soft_out, w_soft, torch.float32, "soft")
    assert_close(hard_out, w_hard, torch.float32, "hard")
    if grad:
        assert_close(got, want, torch.float32, "dlogits")
        assert torch.count_nonzero(got[1]) == 0 and torch.count_nonzero(got[0]) == v
    else:
        assert torch.equal(got, us)   # nothing written without grad


@pytest.mark.parametrize("field, value", [("row_block", 24), ("row_block", 8), ("row_block", True), ("row_warps", 3),
                                          ("alternate_passes", 1), ("teacher_chunk_bytes", 0), ("chunk_bytes", 1.5)])
def test_heuristics_errors_name_the_field(field, value):
    with pytest.raises(InvalidProblemError, match=f"argument '{field}'"):
        ChunkedLinearHeuristics(**{field: value})


@pytest.mark.parametrize("backend_name, dtype", [("cpu", torch.float64), ("triton", torch.float32),
                                                 ("triton", torch.bfloat16)])
def test_teacher_sub_chunks_against_float64(backend_name, dtype):
    """The teacher's logits in sub-chunks of the student's chunk (ChunkedLinearHeuristics
    .teacher_chunk_bytes < chunk_bytes: 8-token chunks, 2-token teacher sub-chunks, a last chunk of
    3), the half head's float32 dhidden chunk in the teacher's dead buffer: float64 (the torch ops)
    within 1e-12, float32 (the Triton kernel) within 1e-5, bf16 within 1e-2; ignored tokens; an
    all-ignored batch gives 0 and zero gradients."""
    v, h = 61, 8
    xs, ws, bs, xt, wt, labels = inputs(11, h, 6, v, dtype, ignored=(0, 5, 9))
    config = ChunkedLinearHeuristics(chunk_bytes=8 * v * 4, min_rows=1, teacher_chunk_bytes=3 * v * 4)
    assert config.rows(11, v) == 8 and config.teacher_rows(11, v) == 2
    settings = dict(beta=0.4, temperature=1.5, weight_hard_loss=0.3, softcap=6.0)
    with trainops.heuristics(config), trainops.backend(backend_name):
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, **settings)
        got = torch.autograd.grad(loss, (xs, ws, bs))
    leaves = [t.detach().double().requires_grad_() for t in (xs, ws, bs)]
    want = reference(leaves[0], leaves[1], xt, wt, labels, bs=leaves[2], **settings)
    expected = torch.autograd.grad(want, leaves)
    assert_close(loss, want, dtype, "loss")
    for name, a, e in zip(("dx", "dw", "db"), got, expected):
        assert_close(a, e, dtype, name)
    labels = torch.full_like(labels, -100)
    with trainops.heuristics(config), trainops.backend(backend_name):
        loss = trainops.linear_distillation_loss(xs, ws, xt, wt, labels, student_bias=bs, **settings)
        grads = torch.autograd.grad(loss, (xs, ws, bs))
    assert loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads)


def test_backward_scales_by_the_upstream_gradient(backend, device):
    """The eager backward scales the forward's gradients in place (scale_unless_one_): an upstream
    gradient of 0.75 gives the gradients of 1 times 0.75 rounded once (float32 and bf16 heads; the
    interpreter truncates to bf16 where the GPU rounds: one ulp there)."""
    from numerics import interpreter_rounding

    for dtype in (torch.float32, torch.bfloat16):
        xs, ws, bs, xt, wt, labels = (t.to(device) if t is not None else t for t in inputs(12, 8, 8, 9, dtype))
        leaves = [t.detach().requires_grad_() for t in (xs, ws, bs)]
        ones = torch.autograd.grad(trainops.linear_distillation_loss(leaves[0], leaves[1], xt, wt, labels,
                                                                     student_bias=leaves[2]), leaves)
        scaled = torch.autograd.grad(trainops.linear_distillation_loss(leaves[0], leaves[1], xt, wt, labels,
                                                                       student_bias=leaves[2]) * 0.75, leaves)
        for name, a, e in zip(("dx", "dw", "db"), scaled, ones):
            want = e.float() * 0.75
            if dtype == torch.float32 or backend == "cpu":
                assert torch.equal(a, want.to(dtype)), name
            elif device == "cpu":
                assert torch.equal(a, interpreter_rounding(want, dtype)), name
            else:
                assert torch.allclose(a.float(), want, rtol=2.0 ** -7, atol=0), name


def test_extra_memory_formula_at_the_benchmark_shape():
    """ChunkedLinearHeuristics' defaults at H 4096, V 128256, 8192 tokens: 2048-token student chunks
    and 1024-token teacher sub-chunks, so the float32 logits buffers take 4 V (2048 + 1024) bytes,
    1503 MiB (Liger's fused JSD measured 1996 MiB extra on the H200)."""
    default = ChunkedLinearHeuristics()
    rows, teacher = default.rows(8192, 128256), default.teacher_rows(8192, 128256)
    assert (rows, teacher) == (2048, 1024)
    assert 4 * 128256 * (rows + teacher) / 2**20 < 1504
    assert default.teacher_rows(8192, 1000) == default.rows(8192, 1000) == 8192   # a small head: one chunk


@pytest.mark.gpu
def test_gpu_extra_memory_at_the_benchmark_shape():
    """The peak memory a bf16 forward + backward adds beyond inputs and gradients, H 4096, V 128256,
    8192 tokens: at most Liger's 1996 MiB (the formula's 1503 MiB plus per-token vectors)."""
    n, h, v = 8192, 4096, 128256
    xs = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    ws = (torch.randn(v, h, device="cuda") / 64).to(torch.bfloat16).requires_grad_()
    xt = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    wt = (torch.randn(v, h, device="cuda") / 64).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[::11] = -100
    trainops.linear_distillation_loss(xs, ws, xt, wt, labels).backward()
    xs.grad = ws.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainops.linear_distillation_loss(xs, ws, xt, wt, labels).backward()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()) / 2**20
    assert extra <= 1996, extra
