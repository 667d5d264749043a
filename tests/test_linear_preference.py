"""trainops.linear_preference_loss (dpo, ipo, simpo, cpo, orpo) and its per-token op: float64
references on materialised logits (TRL's trainers' formulas written out) over every kind, label
smoothing, the logit transform, a reference as a head or as log-probabilities, several chunks;
float32 / bf16 against float64; ignored tokens and all-ignored rows; the metrics; no gradient work
under no_grad; determinism; gradcheck; torch.compile; the module; errors; GPU sizes."""

import math

import pytest
import torch
import torch.nn.functional as F

import trainops
from trainops.errors import IndexOutOfRangeError, InvalidProblemError, UnsupportedError
from trainops.ops import chunked_linear
from trainops.ops.chunked_linear import ChunkedLinearHeuristics
from trainops.ops.linear_preference import linear_token_logprobs

from numerics import assert_close

KINDS = ["dpo", "ipo", "simpo", "cpo", "orpo"]
AVERAGED = ("ipo", "simpo", "orpo")


def small_chunks(rows):
    return trainops.heuristics(ChunkedLinearHeuristics(chunk_bytes=1, min_rows=rows))


def path_chunks(path, length):
    """Chunks that take the given path: "pairs" (one pair of ``length``-token rows a chunk: the
    gradients in the forward) or "two-pass" (chunks shorter than a pair: the backward recomputes)."""
    return small_chunks(2 * length if path == "pairs" else max(1, length - 1))


PATHS = ["pairs", "two-pass"]


def sequence_logps(x, w, b, labels, averaged, *, logit_scale=1.0, softcap=None, temperature=1.0, ignore_index=-100):
    """float64: (sequence logps (B,), token logps (B, T), mask (B, T), logits (B, T, V))."""
    z = F.linear(x.double(), w.double(), None if b is None else b.double()) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    mask = labels != ignore_index
    tokens = torch.log_softmax(z, -1).gather(-1, torch.where(mask, labels, 0)[..., None]).squeeze(-1) * mask
    seq = tokens.sum(-1)
    return (seq / mask.sum(-1).clamp_min(1) if averaged else seq), tokens, mask, z


def reference(kind, x, w, labels, b=None, *, ref=None, beta=0.1, gamma=0.5, label_smoothing=0.0, nll_weight=None,
              **transform):
    """float64 (loss, chosen logps, rejected logps, chosen rewards, rejected rewards, logits means)."""
    averaged = kind in AVERAGED
    seq, tokens, mask, z = sequence_logps(x, w, b, labels, averaged, **transform)
    p = x.shape[0] // 2
    c, r = seq[:p], seq[p:]
    if ref is not None:
        ref_seq = ref if isinstance(ref, torch.Tensor) else sequence_logps(*ref, labels, averaged, **transform)[0]
        cr, rr = c - ref_seq[:p], r - ref_seq[p:]
    else:
        cr, rr = c, r

    def sigmoid_loss(v):
        return -(1 - label_smoothing) * F.logsigmoid(v) - label_smoothing * F.logsigmoid(-v)

    nll = -tokens[:p].sum() / mask[:p].sum().clamp_min(1)
    if kind == "dpo":
        loss = sigmoid_loss(beta * (cr - rr)).mean()
    elif kind == "ipo":
        loss = ((cr - rr - 1 / (2 * beta)) ** 2).mean()
    elif kind == "simpo":
        loss = sigmoid_loss(beta * (c - r) - gamma).mean()
    elif kind == "cpo":
        loss = sigmoid_loss(beta * (c - r)).mean()
    else:
        def log1mexp(v):   # TRL's ORPO, on our clamp
            v = v.clamp(max=-1e-7)
            return torch.log(-torch.expm1(v))
        log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
        loss = -beta * F.logsigmoid(log_odds).mean()
    weight = (1.0 if kind in ("cpo", "orpo") else 0.0) if nll_weight is None else nll_weight
    loss = loss + weight * nll
    means = [(z.mean(-1) * mask)[rows].sum() / mask[rows].sum().clamp_min(1) for rows in (slice(0, p), slice(p, None))]
    return loss, c, r, beta * cr, beta * rr, *means


def inputs(pairs, t, h, v, dtype, *, bias=True, seed=0, ref_h=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * pairs, t, h, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=gen) / math.sqrt(h) * 3).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=gen) * 0.5).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (2 * pairs, t), generator=gen)
    labels[:, :2] = -100          # the prompt
    labels[0, -1] = -100          # padding
    rh = ref_h or h
    rx = torch.randn(2 * pairs, t, rh, generator=gen).to(dtype)
    rw = (torch.randn(v, rh, generator=gen) / math.sqrt(rh) * 3).to(dtype)
    return x, w, b, labels, rx, rw


def reference_kwargs(kind, rx, rw):
    return dict(ref_hidden=rx, ref_weight=rw) if kind in ("dpo", "ipo") else {}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("settings", [dict(), dict(label_smoothing=0.2, beta=0.5, gamma=0.3),
                                      dict(logit_scale=0.7, softcap=3.0, temperature=1.5, nll_weight=0.5)],
                         ids=["plain", "smoothing", "transform"])
def test_float64_matches_the_reference_over_chunks(kind, settings, path, monkeypatch):
    """float64 runs the torch ops (the kernels are float32); test_float32_each_backend runs the kernels."""
    settings = dict(settings)
    if kind in ("ipo", "orpo"):
        settings.pop("label_smoothing", None)
    x, w, b, labels, rx, rw = inputs(3, 7, 8, 13, torch.float64, ref_h=6)
    whole = []   # ChunkedHead.logits: the two-pass path's chunks of consecutive tokens
    original = chunked_linear.ChunkedHead.logits
    monkeypatch.setattr(chunked_linear.ChunkedHead, "logits", lambda self, *a: (whole.append(1), original(self, *a))[1])
    with path_chunks(path, 7):
        out = trainops.linear_preference_loss(x, w, labels, bias=b, kind=kind, **reference_kwargs(kind, rx, rw),
                                              **settings)
        got = torch.autograd.grad(out.loss * 0.75, (x, w, b))
    # the reference's chunks always go through logits(): 42 tokens, 14 or 6 rows a chunk; the two-pass
    # policy: 7 chunks forward, 7 backward
    reference_chunks = 3 if path == "pairs" else 7
    policy_chunks = len(whole) - (reference_chunks if kind in ("dpo", "ipo") else 0)
    assert policy_chunks == (0 if path == "pairs" else 14), len(whole)
    want = reference(kind, x, w, labels, b, ref=(rx, rw, None) if kind in ("dpo", "ipo") else None, **settings)
    expected = torch.autograd.grad(want[0] * 0.75, (x, w, b))
    assert isinstance(out, trainops.ops.linear_preference.PreferenceOutput)
    for name, a, e in zip(out._fields, out, want):
        assert_close(a, e, torch.float64, name)
        assert not (a.requires_grad and name != "loss")
    for name, a, e in zip(("dx", "dw", "db"), got, expected):
        assert_close(a, e, torch.float64, name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("settings", [dict(label_smoothing=0.2, beta=0.5, gamma=0.3),
                                      dict(logit_scale=0.7, softcap=3.0, temperature=1.5, nll_weight=0.5)],
                         ids=["smoothing", "transform"])
def test_float32_each_backend(backend, kind, settings, path):
    """The per-chunk kernels (Triton under the interpreter; torch ops on the CPU backend), float32
    against the float64 reference, a vocabulary that is not a multiple of the kernels' block."""
    settings = dict(settings)
    if kind in ("ipo", "orpo"):
        settings.pop("label_smoothing", None)
    x, w, b, labels, rx, rw = inputs(2, 6, 8, 37, torch.float32)
    with path_chunks(path, 6), trainops.track_kernels() as used:
        out = trainops.linear_preference_loss(x, w, labels, bias=b, kind=kind, **reference_kwargs(kind, rx, rw),
                                              **settings)
        got = torch.autograd.grad(out.loss, (x, w, b))
    # the pairs path's backward scales the forward's gradients by the upstream gradient (scale_unless_one_)
    assert {(op, kernel_backend) for op, kernel_backend, *_ in used} == {("linear_token_rows", backend)} | (
        {("cross_entropy_grad_scale", backend)} if path == "pairs" else set())
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = reference(kind, *leaves[:2], labels, leaves[2], ref=(rx, rw, None) if kind in ("dpo", "ipo") else None,
                     **settings)
    expected = torch.autograd.grad(want[0], leaves)
    for name, a, e in zip(out._fields, out, want):
        assert_close(a, e, torch.float32, name)
    for name, a, e in zip(("dx", "dw", "db"), got, expected):
        assert_close(a, e, torch.float32, name)


@pytest.mark.parametrize("path", PATHS)
def test_weight_gradient_accumulated_in_the_weight_dtype(path):
    """weight_grad_accumulator="weight": a bf16 head's dW summed in bf16 over the chunks, on both
    paths (the two-pass backward reads the setting its forward saw)."""
    x, w, b, labels, rx, rw = inputs(3, 6, 16, 37, torch.bfloat16)
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    want = torch.autograd.grad(reference("dpo", *leaves, labels, ref=(rx, rw, None), beta=0.5)[0], leaves)
    rows = 12 if path == "pairs" else 5
    config = ChunkedLinearHeuristics(chunk_bytes=1, min_rows=rows, weight_grad_accumulator="weight")
    with trainops.heuristics(config):
        out = trainops.linear_preference_loss(x, w, labels, ref_hidden=rx, ref_weight=rw, beta=0.5)
    got = torch.autograd.grad(out.loss, (x, w))   # outside the block: the forward's setting holds
    assert got[1].dtype == torch.bfloat16
    assert_close(got[0], want[0], torch.bfloat16, "dx")
    assert_close(got[1], want[1], torch.bfloat16, "dw")


@pytest.mark.parametrize("kind", ["dpo", "ipo"])
def test_the_reference_as_log_probabilities(kind):
    x, w, b, labels, rx, rw = inputs(2, 6, 8, 11, torch.float64)
    averaged = kind in AVERAGED
    ref_seq = sequence_logps(rx, rw, None, labels, averaged)[0]
    out = trainops.linear_preference_loss(x, w, labels, bias=b, kind=kind, ref_chosen_logps=ref_seq[:2],
                                          ref_rejected_logps=ref_seq[2:])
    by_head = trainops.linear_preference_loss(x, w, labels, bias=b, kind=kind, ref_hidden=rx, ref_weight=rw)
    want = reference(kind, x, w, labels, b, ref=ref_seq)
    for name, a, e, h in zip(out._fields, out, want, by_head):
        assert_close(a, e, torch.float64, name)
        assert_close(h, e, torch.float64, name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_float32_and_bf16_against_float64(backend, dtype, kind, path):
    x, w, b, labels, rx, rw = inputs(2, 9, 16, 37, dtype)
    smoothing = 0.1 if kind in ("dpo", "simpo", "cpo") else 0.0
    with path_chunks(path, 9):
        out = trainops.linear_preference_loss(x, w, labels, bias=b, kind=kind, label_smoothing=smoothing, beta=0.5,
                                              **reference_kwargs(kind, rx, rw))
        got = torch.autograd.grad(out.loss, (x, w, b))
    assert out.loss.dtype == torch.float32 and [g.dtype for g in got] == [dtype] * 3
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = reference(kind, *leaves[:2], labels, leaves[2], ref=(rx, rw, None) if kind in ("dpo", "ipo") else None,
                     label_smoothing=smoothing, beta=0.5)
    expected = torch.autograd.grad(want[0], leaves)
    for name, a, e in zip(out._fields, out, want):
        assert_close(a, e, dtype, name)
    for name, a, e in zip(("dx", "dw", "db"), got, expected):
        assert_close(a, e, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_all_ignored_rows(backend, kind, path, dtype):
    """A rejected row (and a chosen one) with no kept token, through each backend (float32: its
    kernels, Triton under the interpreter): finite, as the textbook formula in float64 on logps 0
    (averaged: 0 / max(1, 0)) within the dtype's tolerance, and no gradient on those rows."""
    x, w, b, labels, rx, rw = inputs(3, 5, 8, 9, dtype)
    labels[1] = -100
    labels[4] = -100
    with path_chunks(path, 5):
        out = trainops.linear_preference_loss(x, w, labels, bias=b, kind=kind, **reference_kwargs(kind, rx, rw))
        got = torch.autograd.grad(out.loss, (x, w, b))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    want = reference(kind, x64, w64, labels, b64, ref=(rx.double(), rw.double(), None) if kind in ("dpo", "ipo") else None)
    expected = torch.autograd.grad(want[0], (x64, w64, b64))
    assert out.chosen_logps[1] == 0 and out.rejected_logps[1] == 0
    for name, a, e in zip(out._fields, out, want):
        assert_close(a, e, dtype, name)
    for name, a, e in zip(("dx", "dw", "db"), got, expected):
        assert torch.isfinite(a).all(), name
        assert_close(a, e, dtype, name)
    assert torch.count_nonzero(got[0][1]) == 0 and torch.count_nonzero(got[0][4]) == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_logprobs_against_log_softmax_and_ignored_tokens(backend, dtype):
    x, w, b, labels, _, _ = inputs(2, 5, 8, 9, dtype)
    with small_chunks(3):
        logp, logit_sum = linear_token_logprobs(x, w, labels, b, softcap=2.0, temperature=0.5)
    _, tokens, mask, z = sequence_logps(x, w, b, labels, False, softcap=2.0, temperature=0.5)
    assert_close(logp, tokens, dtype, "logp")
    assert_close(logit_sum, z.sum(-1) * mask, dtype, "logit_sum")
    assert torch.count_nonzero(logp[~mask]) == 0 and not logit_sum.requires_grad
    upstream = torch.randn(logp.shape, dtype=torch.float64)
    with small_chunks(3):
        got = torch.autograd.grad(logp, (x, w, b), upstream.to(dtype))
    expected = torch.autograd.grad(tokens, (x, w, b), upstream)
    for a, e in zip(got, expected):
        assert_close(a, e, dtype, "gradient")


@pytest.mark.parametrize("path", PATHS)
def test_no_gradient_work_under_no_grad_and_only_what_is_asked(monkeypatch, path):
    x, w, b, labels, rx, rw = inputs(2, 6, 8, 9, torch.float32)
    calls = []
    original = chunked_linear.ChunkedHead.backward_of
    monkeypatch.setattr(chunked_linear.ChunkedHead, "backward_of",
                        lambda self, *a: (calls.append((self.dx is not None, self.dw is not None)), original(self, *a)))
    with path_chunks(path, 6):
        with torch.no_grad():
            out = trainops.linear_preference_loss(x, w, labels, bias=b, ref_hidden=rx, ref_weight=rw)
        assert not calls and not out.loss.requires_grad
        out = trainops.linear_preference_loss(x, w.detach(), labels, ref_hidden=rx, ref_weight=rw)
        # the pairs path computes the gradients in the forward, the two-pass path in the backward
        assert bool(calls) == (path == "pairs")
        out.loss.backward()
    assert calls and set(calls) == {(True, False)}
    assert x.grad is not None and w.grad is None


def test_the_pairs_path_refuses_a_second_backward_but_float64_allows_it():
    x, w, b, labels, rx, rw = inputs(2, 6, 8, 9, torch.float32)
    with path_chunks("pairs", 6):
        out = trainops.linear_preference_loss(x, w, labels, ref_hidden=rx, ref_weight=rw)
    out.loss.backward(retain_graph=True)
    with pytest.raises(UnsupportedError, match="second backward"):
        out.loss.backward()
    x, w, b, labels, rx, rw = inputs(2, 6, 8, 9, torch.float64)
    with path_chunks("pairs", 6):
        out = trainops.linear_preference_loss(x, w, labels, ref_hidden=rx, ref_weight=rw)
    first = torch.autograd.grad(out.loss, (x,), retain_graph=True)[0]
    assert torch.equal(first, torch.autograd.grad(out.loss, (x,))[0])


@pytest.mark.parametrize("path", PATHS)
def test_deterministic_run_to_run(backend, path):
    x, w, b, labels, rx, rw = inputs(3, 8, 16, 21, torch.float32)
    runs = []
    for _ in range(2):
        with path_chunks(path, 8):
            out = trainops.linear_preference_loss(x, w, labels, bias=b, ref_hidden=rx, ref_weight=rw)
            runs.append((*out, *torch.autograd.grad(out.loss, (x, w, b))))
    assert all(torch.equal(a, c) for a, c in zip(*runs))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_gradcheck(kind, path):
    x, w, b, labels, rx, rw = inputs(2, 4, 3, 5, torch.float64)

    def f(x, w, b):
        return trainops.linear_preference_loss(x, w, labels, bias=b, kind=kind, beta=0.7, softcap=2.0,
                                               **reference_kwargs(kind, rx, rw)).loss
    with path_chunks(path, 4):
        assert torch.autograd.gradcheck(f, (x, w, b))


@pytest.mark.parametrize("path", PATHS)
def test_torch_compile_fullgraph(path):
    x, w, b, labels, rx, rw = inputs(2, 6, 8, 11, torch.float32)

    def f(x, w, b):
        out = trainops.linear_preference_loss(x, w, labels, bias=b, kind="dpo", ref_hidden=rx, ref_weight=rw,
                                              label_smoothing=0.1)
        return out.loss, out.chosen_rewards

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    with path_chunks(path, 6):
        loss, rewards = compiled(x, w, b)
        got = torch.autograd.grad(loss, (x, w, b))
        want_loss, want_rewards = f(x, w, b)
        want = torch.autograd.grad(want_loss, (x, w, b))
    assert_close(loss, want_loss, torch.float32, "loss")
    assert_close(rewards, want_rewards, torch.float32, "rewards")
    for a, e in zip(got, want):
        assert_close(a, e, torch.float32, "gradient")
    torch._dynamo.reset()


def test_the_module():
    module = trainops.nn.LinearPreferenceLoss("simpo", beta=2.0, gamma=0.4, label_smoothing=0.1)
    x, w, b, labels, _, _ = inputs(2, 6, 8, 11, torch.float64)
    out = module(x, w, labels, bias=b)
    want = reference("simpo", x, w, labels, b, beta=2.0, gamma=0.4, label_smoothing=0.1)
    assert_close(out.loss, want[0], torch.float64, "module")
    assert "simpo" in repr(module)
    with pytest.raises(InvalidProblemError, match="argument 'kind'"):
        trainops.nn.LinearPreferenceLoss("kto")


def _call(**overrides):
    x, w, b, labels, rx, rw = inputs(2, 4, 8, 6, torch.float32)
    kwargs = dict(kind="dpo", ref_hidden=rx, ref_weight=rw)
    kwargs.update(overrides)
    args = [kwargs.pop("hidden", x), kwargs.pop("weight", w), kwargs.pop("labels", labels)]
    return lambda: trainops.linear_preference_loss(*args, **kwargs)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(kind="kto"), InvalidProblemError, "argument 'kind'"),
    (dict(beta=0.0), InvalidProblemError, "argument 'beta'"),
    (dict(label_smoothing=0.7), InvalidProblemError, "argument 'label_smoothing'"),
    (dict(kind="ipo", label_smoothing=0.1), InvalidProblemError, "argument 'label_smoothing'"),
    (dict(gamma=float("inf")), InvalidProblemError, "argument 'gamma'"),
    (dict(nll_weight=-1.0), InvalidProblemError, "argument 'nll_weight'"),
    (dict(temperature=-1.0), InvalidProblemError, "argument 'temperature'"),
    (dict(logit_scale=float("inf")), InvalidProblemError, "argument 'logit_scale'"),
    (dict(logit_scale=-1.0), InvalidProblemError, "argument 'logit_scale'"),
    (dict(softcap=0), InvalidProblemError, "argument 'softcap'"),
    (dict(ignore_index=True), InvalidProblemError, "argument 'ignore_index'"),
    (dict(ref_hidden=None, ref_weight=None), InvalidProblemError, "argument 'ref_hidden'"),
    (dict(ref_weight=None), InvalidProblemError, "argument 'ref_weight'"),
    (dict(kind="simpo"), InvalidProblemError, "argument 'ref_hidden'"),
    (dict(ref_chosen_logps=torch.zeros(2), ref_rejected_logps=torch.zeros(2)), InvalidProblemError,
     "argument 'ref_chosen_logps'"),
    (dict(ref_hidden=None, ref_weight=None, ref_chosen_logps=torch.zeros(3), ref_rejected_logps=torch.zeros(2)),
     InvalidProblemError, "argument 'ref_chosen_logps'"),
    (dict(ref_hidden=None, ref_weight=None, ref_chosen_logps=torch.zeros(2), ref_rejected_logps=None),
     InvalidProblemError, "argument 'ref_rejected_logps'"),
    (dict(ref_hidden=torch.zeros(4, 3, 8)), InvalidProblemError, "argument 'ref_hidden'"),
    (dict(hidden=torch.zeros(3, 4, 8)), InvalidProblemError, "argument 'hidden'"),
    (dict(hidden=torch.zeros(4, 8)), InvalidProblemError, "argument 'hidden'"),
    (dict(hidden=torch.zeros(4, 4, 8, dtype=torch.int32)), UnsupportedError, "argument 'hidden'"),
    (dict(weight=torch.zeros(6, 7)), InvalidProblemError, "argument 'weight'"),
    (dict(bias=torch.zeros(5)), InvalidProblemError, "argument 'bias'"),
    (dict(labels=torch.zeros(4, 3, dtype=torch.long)), InvalidProblemError, "argument 'labels'"),
    (dict(labels=torch.zeros(4, 4)), InvalidProblemError, "argument 'labels'"),
])
def test_errors_name_the_argument(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)()


@pytest.mark.parametrize("path", PATHS)
def test_a_label_out_of_range_raises(path):
    x, w, b, labels, rx, rw = inputs(2, 5, 8, 9, torch.float32)
    labels[1, 3] = 9
    with path_chunks(path, 5), pytest.raises(IndexOutOfRangeError, match="argument 'labels'"):
        trainops.linear_preference_loss(x, w, labels, kind="simpo")


# ---- GPU: LM-head sizes ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1024, 512], ids=["pairs", "two-pass"])
@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_gpu_lm_head_against_float64(kind, rows):
    """bf16 policy and reference at a 32000-class head: 4 pairs of 512 tokens, chunks of ``rows``
    tokens (1024: one pair a chunk; 512: the two-pass path)."""
    torch.manual_seed(0)
    b, t, h, v = 8, 512, 1024, 32000
    x = torch.randn(b, t, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda") / 32).to(torch.bfloat16).requires_grad_()
    rx = torch.randn(b, t, h, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, v, (b, t), device="cuda")
    labels[:, :100] = -100
    kwargs = dict(ref_hidden=rx, ref_weight=w.detach()) if kind == "dpo" else {}
    with trainops.heuristics(ChunkedLinearHeuristics(chunk_bytes=rows * v * 4)):
        out = trainops.linear_preference_loss(x, w, labels, kind=kind, beta=0.5, **kwargs)
        dx, dw = torch.autograd.grad(out.loss, (x, w))
    leaves = [t_.detach().double().requires_grad_() for t_ in (x, w)]
    want = reference(kind, leaves[0], leaves[1], labels, ref=(rx, w.detach(), None) if kind == "dpo" else None,
                     beta=0.5)
    want_dx, want_dw = torch.autograd.grad(want[0], leaves)
    for name, a, e in zip(out._fields, out, want):
        assert_close(a, e, torch.bfloat16, name)
    assert_close(dx, want_dx, torch.bfloat16, "dx")
    assert_close(dw, want_dw, torch.bfloat16, "dw")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gradient_written_over_the_logits_own_storage(backend, device, dtype):
    """The backward row kernel writes dlogits (times the softcap / logit_scale factor) straight in a
    half head's dtype into ChunkedHead.gradient_buffer, the first half of each float32 logits row's
    bytes: the float32 gradient rounded once (as the kernel rounds), over several blocks; the float32
    gradient is float64's."""
    from numerics import interpreter_rounding
    from trainops.ops.linear_preference import token_rows_backward_, token_rows_forward

    # on a GPU (the Triton backend there): an LM head's vocabulary, 256 rows a launch
    rows, v, cap, scale, temperature = ((3, 2 * 4096 + 37, 5.0, 1.25, 0.8) if device == "cpu"
                                        else (256, 128256, 5.0, 1.25, 0.8))
    gen = torch.Generator().manual_seed(2)
    u = (cap * torch.tanh(torch.randn(rows, v, generator=gen) * 2)).to(device)
    index = torch.tensor([0, v - 1, 4100] * (rows // 3) + [5] * (rows % 3), device=device)
    factor = torch.tensor([0.5, -2.0, 0.0] * (rows // 3) + [1.0] * (rows % 3), device=device)
    head = chunked_linear.ChunkedHead(torch.zeros(rows, 4, dtype=dtype, device=device),
                                      torch.zeros(v, 4, dtype=dtype, device=device), None, scale, cap)
    lse = token_rows_forward(u, index, torch.ones(rows, device=device), temperature)[0]
    want = token_rows_backward_(u.double(), index, lse.double(), factor.double(), temperature, chain=head.chain)
    full = token_rows_backward_(u.clone(), index, lse, factor, temperature, chain=head.chain)
    assert_close(full, want, torch.float32, "float32 dlogits")
    half_u = u.clone()
    du = head.gradient_buffer(half_u)
    assert du.untyped_storage().data_ptr() == half_u.untyped_storage().data_ptr() and du.stride() == (2 * v, 1)
    assert token_rows_backward_(half_u, index, lse, factor, temperature, du, head.chain) is du
    if device == "cpu":   # bit-exact (the interpreter truncates bf16); on a GPU within one ulp
        rounded = interpreter_rounding(full, dtype) if backend == "triton" else full.to(dtype)
        assert torch.equal(du, rounded)
    else:
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        assert torch.allclose(du.float(), full, rtol=ulp, atol=1e-7), (du.float() - full).abs().max()
