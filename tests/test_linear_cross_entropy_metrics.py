"""trainops.linear_cross_entropy(..., token_accuracy=True, entropy=True): the metrics against a
float64 reference from materialised logits (ignored rows, the logit transform, several chunks,
float32 / bf16), every row ignored, the plain loss unchanged, no gradient, errors,
torch.compile(fullgraph=True), and the patched Hugging Face model's ``outputs.token_accuracy`` /
``outputs.entropy`` against the unpatched model's logits."""

import math

import pytest
import torch
import torch.nn.functional as F

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops.linear_cross_entropy import LinearCrossEntropyHeuristics, LinearCrossEntropyOutput

from numerics import assert_close, relative_error


def small_chunks(rows):
    return trainops.heuristics(LinearCrossEntropyHeuristics(chunk_bytes=1, min_rows=rows))


def inputs(n, h, v, dtype, *, bias=True, seed=0, ignored=(3, 7)):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, h, generator=gen) * 2).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=gen) / math.sqrt(h) * 3).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=gen) * 0.5).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=gen)
    # every third row's target its logits' argmax (the transforms keep it): right and wrong rows both
    z = F.linear(x.detach().double(), w.detach().double(), None if b is None else b.detach().double())
    t[::3] = z.argmax(-1)[::3]
    for i in ignored:
        if i < n:
            t[i] = -100
    return x, w, b, t


def reference_metrics(x, w, t, b=None, *, softcap=None, logit_scale=1.0, temperature=1.0, ignore_index=-100):
    """float64 (accuracy, entropy) over the kept rows, from the whole logits (torch ops)."""
    z = F.linear(x.detach().double(), w.detach().double(), None if b is None else b.detach().double()) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    kept = t != ignore_index
    accuracy = (z.argmax(-1) == t)[kept].double().mean()
    entropy = (torch.logsumexp(z, -1) - (z.softmax(-1) * z).sum(-1))[kept].mean()
    return accuracy, entropy


TRANSFORMS = [dict(), dict(softcap=4.0, logit_scale=3.0, temperature=0.5)]


@pytest.mark.parametrize("rows", [8, 7])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_float64_against_the_materialised_logits_over_chunks(backend, transform, rows):
    """Chunks of 8 rows: two and a short one; of 7: the entropy's row blocks (half a chunk's rows in
    float64) end with a short one."""
    x, w, b, t = inputs(22, 16, 19, torch.float64)
    with small_chunks(rows):
        out = trainops.linear_cross_entropy(x, w, t, b, token_accuracy=True, entropy=True, **transform)
        plain = trainops.linear_cross_entropy(x, w, t, b, **transform)
    assert isinstance(out, LinearCrossEntropyOutput)
    accuracy, entropy = reference_metrics(x, w, t, b, **transform)
    assert out.token_accuracy.dtype == out.entropy.dtype == torch.float32
    assert out.token_accuracy.shape == out.entropy.shape == ()
    assert 0 < accuracy < 1   # some rows right, some wrong: the comparison can fail
    assert abs(out.token_accuracy.item() - accuracy.item()) < 1e-6
    assert relative_error(out.entropy.double(), entropy) < 1e-6
    assert torch.equal(out.loss, plain)   # the loss is the plain call's


def test_one_metric_asked_the_other_none_and_sum_reduction(backend):
    x, w, b, t = inputs(13, 8, 11, torch.float64, seed=1)
    accuracy, entropy = reference_metrics(x, w, t, b)
    with small_chunks(4):
        only_accuracy = trainops.linear_cross_entropy(x, w, t, b, token_accuracy=True)
        only_entropy = trainops.linear_cross_entropy(x, w, t, b, entropy=True, reduction="sum")
    assert only_accuracy.entropy is None and only_entropy.token_accuracy is None
    assert abs(only_accuracy.token_accuracy.item() - accuracy.item()) < 1e-6
    assert relative_error(only_entropy.entropy.double(), entropy) < 1e-6
    assert torch.equal(only_entropy.loss, trainops.linear_cross_entropy(x, w, t, b, reduction="sum"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_and_bf16_hidden(backend, dtype):
    x, w, b, t = inputs(40, 16, 37, dtype, seed=2, ignored=(0, 5, 39))
    with small_chunks(8):
        out = trainops.linear_cross_entropy(x, w, t, b, token_accuracy=True, entropy=True, softcap=5.0)
    accuracy, entropy = reference_metrics(x, w, t, b, softcap=5.0)
    kept = int((t != -100).sum())
    # the argmax of the rounded logits: a row within rounding of a tie may flip (at most one here)
    assert abs(out.token_accuracy.item() - accuracy.item()) <= (1e-6 if dtype == torch.float32 else 1.01 / kept)
    assert relative_error(out.entropy.double(), entropy) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_every_row_ignored_gives_zero_metrics_not_nan(backend):
    x, w, b, t = inputs(6, 8, 11, torch.float32)
    t[:] = -100
    out = trainops.linear_cross_entropy(x, w, t, b, token_accuracy=True, entropy=True)
    assert out.token_accuracy.item() == 0.0 and out.entropy.item() == 0.0   # TRL logs 0.0 then
    assert torch.isnan(out.loss)   # the loss as before: 0 / 0, torch's
    empty = trainops.linear_cross_entropy(x[:0], w, t[:0], b, token_accuracy=True, entropy=True, reduction="sum")
    assert empty.token_accuracy.item() == 0.0 and empty.entropy.item() == 0.0 and empty.loss.item() == 0.0


def test_plain_call_is_a_tensor_and_the_gradients_are_unchanged(backend):
    x, w, b, t = inputs(20, 8, 13, torch.float32)
    with small_chunks(8):
        plain = trainops.linear_cross_entropy(x, w, t, b, logit_scale=2.0)
        want = torch.autograd.grad(plain, (x, w, b))
        out = trainops.linear_cross_entropy(x, w, t, b, logit_scale=2.0, token_accuracy=False, entropy=False)
        assert type(out) is torch.Tensor
        out = trainops.linear_cross_entropy(x, w, t, b, logit_scale=2.0, token_accuracy=True, entropy=True)
        got = torch.autograd.grad(out.loss, (x, w, b))
    assert not out.token_accuracy.requires_grad and not out.entropy.requires_grad   # detached metrics
    assert torch.equal(out.loss, plain)
    for a, e in zip(got, want):
        assert torch.equal(a, e)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(token_accuracy=True, reduction="none"), UnsupportedError, "token_accuracy"),
    (dict(entropy=True, reduction="none"), UnsupportedError, "entropy"),
    (dict(token_accuracy=1), InvalidProblemError, "token_accuracy"),
    (dict(entropy="yes"), InvalidProblemError, "entropy"),
])
def test_errors_name_the_argument(kwargs, error, name):
    x, w, b, t = inputs(4, 8, 11, torch.float32)
    with pytest.raises(error, match=f"'{name}'"):
        trainops.linear_cross_entropy(x, w, t, b, **kwargs)


def test_torch_compile_fullgraph():
    x, w, b, t = inputs(20, 16, 18, torch.float32)

    def f(x, w, b):
        out = trainops.linear_cross_entropy(x, w, t, b, softcap=4.0, temperature=0.5, token_accuracy=True,
                                            entropy=True)
        return out.loss, out.token_accuracy, out.entropy

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(x, w, b), f(x, w, b)
    for a, e in zip(got, want):
        assert_close(a, e, torch.float32, "compiled")
    for a, e in zip(torch.autograd.grad(got[0], (x, w, b)), torch.autograd.grad(want[0], (x, w, b))):
        assert_close(a, e, torch.float32, "compiled gradient")
    torch._dynamo.reset()


def test_patched_hugging_face_model_returns_the_metrics():
    pytest.importorskip("transformers")
    from test_hf import batch, patched_and_unpatched

    model, reference = patched_and_unpatched("llama")
    ids, labels = batch()
    with torch.no_grad():   # every other label the model's own prediction: right and wrong tokens both
        predicted = reference(input_ids=ids).logits.argmax(-1)
    labels[:, 1::2] = predicted[:, :-1:2]
    labels[0, :4] = -100
    with trainops.backend("cpu"):   # the decoder's kernels on the CPU path: the interpreter is slow
        check_the_metrics(model, reference, ids, labels)


def check_the_metrics(model, reference, ids, labels):
    out = model(input_ids=ids, labels=labels, return_token_accuracy=True, return_entropy=True)
    plain = model(input_ids=ids, labels=labels)
    assert out.logits is None
    assert "token_accuracy" not in plain and "entropy" not in plain
    with torch.no_grad():
        want = reference(input_ids=ids, labels=labels)
    logits, shifted = want.logits[:, :-1].double(), labels[:, 1:]
    kept = shifted != -100
    accuracy = (logits.argmax(-1) == shifted)[kept].double().mean()
    assert 0.4 < accuracy < 0.7
    entropy = (torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1))[kept].mean()
    assert abs(out.token_accuracy.item() - accuracy.item()) < 1e-5
    assert out["entropy"] is out.entropy
    assert relative_error(out.entropy.double(), entropy) < 1e-5
    assert_close(out.loss, want.loss, torch.float32, "loss")
    only = model(input_ids=ids, labels=labels, return_entropy=True)
    items = torch.tensor(40.0)   # the Trainer's float token count: the summed loss divided by it
    divided = model(input_ids=ids, labels=labels, num_items_in_batch=items, return_token_accuracy=True)
    with torch.no_grad():
        want_divided = reference(input_ids=ids, labels=labels, num_items_in_batch=items)
    assert_close(divided.loss, want_divided.loss, torch.float32, "loss over num_items_in_batch")
    assert torch.equal(divided.token_accuracy, out.token_accuracy)
    assert "token_accuracy" not in only and torch.equal(only.entropy, out.entropy)
    model.train()   # a training call the fused loss does not take: a metric asked for is refused by name
    with pytest.raises(trainops.UnsupportedError, match="return_token_accuracy=True"):
        model(input_ids=ids, labels=labels, logits_to_keep=1, return_token_accuracy=True)
    model.eval()   # the original forward: logits, no metrics (the keywords taken out of the call)
    with torch.no_grad():
        evaluated = model(input_ids=ids, labels=labels, return_token_accuracy=True, return_entropy=True)
    assert evaluated.logits is not None and "token_accuracy" not in evaluated and "entropy" not in evaluated


@pytest.mark.gpu
def test_gpu_llama_sized_head_metrics_and_memory():
    """bf16 head (8192 tokens, 32000 words, 2048-token chunks): the metrics against float32
    materialised logits, the loss and gradients equal to the plain call's, and the metrics' extra
    peak memory within one chunk's logits (their row blocks' two float32 temporaries)."""
    torch.manual_seed(0)
    n, h, v, rows = 8192, 1024, 32000, 2048
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    t[::3] = (x.detach() @ w.detach().t()).argmax(-1)[::3]
    t[::7] = -100
    peaks = {}
    with trainops.heuristics(LinearCrossEntropyHeuristics(chunk_bytes=rows * v * 2)):
        for asked in (False, True, False, True):   # the first two warm up
            x.grad = w.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out = trainops.linear_cross_entropy(x, w, t, token_accuracy=asked, entropy=asked)
            loss = out.loss if asked else out
            loss.backward()
            torch.cuda.synchronize()
            peaks[asked] = torch.cuda.max_memory_allocated() - before
            grads = (x.grad.clone(), w.grad.clone())
            if asked:
                metrics, metric_loss, metric_grads = out, loss.detach(), grads
            else:
                plain_loss, plain_grads = loss.detach(), grads
    assert torch.equal(metric_loss, plain_loss)
    for a, e in zip(metric_grads, plain_grads):
        assert torch.equal(a, e)
    z = (x.detach() @ w.detach().t()).float()
    kept = t != -100
    accuracy = (z.argmax(-1) == t)[kept].float().mean()
    entropy = (torch.logsumexp(z, -1) - (z.softmax(-1) * z).sum(-1))[kept].mean()
    assert 0.3 < accuracy < 0.4   # every third row right by construction, a few more by chance
    # the chunks' matmuls may round a few near-tie rows otherwise than the whole matmul
    assert abs(metrics.token_accuracy.item() - accuracy.item()) <= 3 / kept.sum().item()
    assert relative_error(metrics.entropy, entropy) < 1e-3
    extra = peaks[True] - peaks[False]
    assert extra <= rows * v * 2 + 2**20, (extra / 2**20, peaks)
