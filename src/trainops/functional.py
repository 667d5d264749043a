"""User-facing functions, with torch.nn.functional's signatures.

Each checks its arguments and calls its ``torch.ops.trainops`` custom op, declared in its family's
module (``ops/<family>.py``; in plain eager mode the op's own implementation and autograd formula,
without the dispatcher): autograd, torch.compile and the kernel registry come with it.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .dtensor import is_dtensor
from .errors import InvalidProblemError, UnsupportedError, argument_error
from .library import PLAIN_TENSORS
from .ops import activations as activation_ops
from .ops import attention_softmax as attention_ops
from .ops import batch_norm as batch_norm_ops
from .ops import broadcast as broadcast_ops
from .ops import convolution as convolution_ops
from .ops._common import FLOAT_NAMES, float_dtype
from .registry import FLOATS
from .ops import cross_entropy as cross_entropy_ops
from .ops import dropout as dropout_ops
from .ops import gather as gather_ops
from .ops import linear_cross_entropy as linear_cross_entropy_ops
from .ops import linear_distillation as linear_distillation_ops
from .ops import linear_preference as linear_preference_ops
from .ops._common import check_mode, raise_flagged
from .ops import normalization as norm_ops
from .ops import rotary as rotary_ops
from .ops import qk_norm_rotary as qk_norm_rotary_ops
from .ops import softmax as softmax_ops


def _float_tensor(op: str, name: str, t) -> None:
    """``t`` a torch.Tensor of a floating dtype, else InvalidProblemError (not a tensor) or
    UnsupportedError (its dtype) naming the argument ``name``."""
    if not isinstance(t, Tensor):
        raise argument_error(InvalidProblemError, op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise argument_error(UnsupportedError, op, name, f"has dtype {t.dtype}; supported: {FLOAT_NAMES}")


def _check(op: str, name: str, t, dim) -> None:
    if not isinstance(t, Tensor):
        raise argument_error(InvalidProblemError, op, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise argument_error(InvalidProblemError, op, "dim", f"must be an int, got {dim!r}")


def softmax(x: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """y = exp(x - max x) / sum exp(x - max x) along ``dim``, as ``torch.softmax(x, dim, dtype)``.

    x: any shape (rank 0..8) and strides; float32/float16/bfloat16/float64. ``dtype`` casts x first
    and is the output's dtype. Accumulates in float32 (float64 for float64). Deterministic,
    bit-identical run to run. Backward: ``softmax_backward``. Errors: InvalidProblemError for a
    bad ``dim``; UnsupportedError for other dtypes or ranks.
    """
    _check("softmax", "x", x, dim)
    return softmax_ops.softmax_op(x, dim, dtype)


def log_softmax(x: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """y = (x - max x) - log sum exp(x - max x) along ``dim``, as ``torch.log_softmax(x, dim, dtype)``.

    Shapes, dtypes and guarantees as ``softmax``. Backward: ``log_softmax_backward``.
    """
    _check("log_softmax", "x", x, dim)
    return softmax_ops.log_softmax_op(x, dim, dtype)


def softmax_backward(dy: Tensor, y: Tensor, dim: int, input_dtype: torch.dtype | None = None) -> Tensor:
    """dx = y * (dy - sum(y * dy)) along ``dim``, from the saved softmax output ``y``.

    dy and y: the same shape and dtype, any strides. ``input_dtype``: dtype of dx (default y's),
    as in torch's ``_softmax_backward_data``. Accumulates in float32 (float64 for float64).
    """
    _check("softmax_backward", "dy", dy, dim)
    _check("softmax_backward", "y", y, dim)
    return softmax_ops.softmax_backward_op(dy, y, dim, input_dtype)


def log_softmax_backward(dy: Tensor, y: Tensor, dim: int, input_dtype: torch.dtype | None = None) -> Tensor:
    """dx = dy - exp(y) * sum(dy) along ``dim``, from the saved log-softmax output ``y``.

    As ``softmax_backward``; the sum reads only dy.
    """
    _check("log_softmax_backward", "dy", dy, dim)
    _check("log_softmax_backward", "y", y, dim)
    return softmax_ops.log_softmax_backward_op(dy, y, dim, input_dtype)


def _raise_pending() -> None:
    """An earlier call's error that the GPU has flagged by now (eager mode; never waits)."""
    if not torch.compiler.is_compiling():
        raise_flagged()


def _check_index(op: str, index) -> None:
    if not isinstance(index, Tensor):
        raise argument_error(InvalidProblemError, op, "index", f"must be a torch.Tensor, got {type(index).__name__}")


def _deferred_on_device(check: bool, immediate: bool, index: Tensor) -> bool:
    """Whether a call's index check runs on the device without the host waiting (CUDA, the default
    mode; the op flags bad indices and a later call raises: gather.defer_index_check), rather than
    before the launch (immediate mode; on the CPU, where it costs no sync)."""
    return check and not immediate and index.device.type == "cuda"


def gather(x: Tensor, index: Tensor, dim: int = 0, *, check_index: bool | str = True) -> Tensor:
    """out = x.index_select(dim, index.flatten()) reshaped to x.shape[:dim] + index.shape + x.shape[dim+1:].

    ONNX Gather: ``index`` any rank, int32 or int64, negative values count from the end of ``dim``.
    x: float32/float16/bfloat16/float64, any strides. Differentiable in x (gradient:
    ``gather_backward``, deterministic). ``check_index=True`` raises ``IndexError`` (a trainops
    ``IndexOutOfRangeError``) for an index outside [-x.shape[dim], x.shape[dim]): on the CPU before
    anything is written; on the GPU (eager or inside a torch.compile graph) the check runs on the
    device without the host waiting for it, and the error is raised by a later trainops call once
    the GPU has run it (meanwhile such indices read nothing: zeros); inside a CUDA graph capture
    it is a device-side assert at every replay. ``check_index="immediate"``: before
    anything is written everywhere (on the GPU one min/max and one host synchronisation per call).
    ``check_index=False``: no check (out-of-range indices still read nothing and give zeros).
    """
    _check("gather", "x", x, dim)
    _check_index("gather", index)
    check, immediate = check_mode("gather", "check_index", check_index)
    _raise_pending()
    return gather_ops.gather_op(x, index, dim, True, check, _deferred_on_device(check, immediate, index))


def gather_backward(dy: Tensor, index: Tensor, dim: int, input_shape, *, deterministic: bool = True,
                    check_index: bool | str = True) -> Tensor:
    """GatherGrad: dx of ``input_shape``, zero, then dx[.., index[n], ..] += dy[.., n, ..] along ``dim``.

    dy: shape input_shape[:dim] + index.shape + input_shape[dim+1:], any float dtype, any strides;
    dx has dy's dtype. Sums accumulate in float32 (float64 for float64).
    ``deterministic=True`` (default): sorted-index kernel, bit-identical run to run, no float
    atomics; repeated and skewed indices are split across programs. ``False``: float atomics
    (half types then add into a float32 workspace the size of dx). ``check_index`` as ``gather``.
    """
    _check("gather_backward", "dy", dy, dim)
    _check_index("gather_backward", index)
    try:
        input_shape = [int(s) for s in input_shape]
    except TypeError:
        raise argument_error(InvalidProblemError, "gather_backward", "input_shape",
                             f"must be a sequence of ints, got {input_shape!r}") from None
    check, immediate = check_mode("gather_backward", "check_index", check_index)
    _raise_pending()
    return gather_ops.gather_backward_op(dy, index, dim, input_shape, deterministic, None, False, True, check,
                                         _deferred_on_device(check, immediate, index))


def embedding(input: Tensor, weight: Tensor, padding_idx: int | None = None, max_norm: float | None = None,
              norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False, *,
              check_index: bool | str = True) -> Tensor:
    """out = weight[input], as ``torch.nn.functional.embedding`` (same signature and semantics).

    input: int32/int64 of any shape, values in [0, num_embeddings); weight: (num_embeddings, D).
    Gradient to weight through the deterministic sorted-index GatherGrad kernel: the padding_idx
    row receives none; ``scale_grad_by_freq`` divides each row's gradient by its count in input.
    ``check_index`` as ``gather`` (IndexError names the range; on the GPU reported by
    a later call). ``max_norm`` and ``sparse=True`` are not supported (UnsupportedError).
    """
    op = "embedding"
    _check_index(op, input)
    if not isinstance(weight, Tensor):
        raise argument_error(InvalidProblemError, op, "weight", f"must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise argument_error(InvalidProblemError, op, "weight", f"must be 2-D, got shape {tuple(weight.shape)}")
    if max_norm is not None:
        raise argument_error(UnsupportedError, op, "max_norm", "is not supported (renormalising rows in place)")
    if sparse:
        raise argument_error(UnsupportedError, op, "sparse", "is not supported (sparse gradients)")
    rows = weight.shape[0]
    if padding_idx is not None:
        if not isinstance(padding_idx, int) or not -rows <= padding_idx < rows:
            raise argument_error(InvalidProblemError, op, "padding_idx",
                                 f"is {padding_idx!r}; must be within [{-rows}, {rows - 1}]")
        padding_idx %= rows
    check, immediate = check_mode(op, "check_index", check_index)
    _raise_pending()
    return gather_ops.embedding_op(input, weight, padding_idx, bool(scale_grad_by_freq), check,
                                   _deferred_on_device(check, immediate, input))


def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, size_average=None,
                  ignore_index: int = -100, reduce=None, reduction: str = "mean", label_smoothing: float = 0.0, *,
                  z_loss: float = 0.0, return_lse: bool = False, loss_dtype: torch.dtype | None = None,
                  check_target: bool | str = True, inplace_backward: bool = False):
    """Softmax cross-entropy, as ``torch.nn.functional.cross_entropy`` (same signature and results).

    input: (C,), (N, C) or (N, C, d1, ...) logits, float32/float16/bfloat16/float64, any strides.
    target: class indices (int32/int64, shape without C; ``ignore_index`` rows count for nothing)
    or class probabilities (input's shape and dtype). weight: (C,) per-class weights.
    reduction "mean" divides by the summed target weights of the non-ignored rows (by the row
    count for probability targets); an all-ignored batch gives NaN, as torch.
    Extras: ``z_loss`` adds z_loss * lse^2 per non-ignored row (averaged over those rows for
    "mean"); ``return_lse`` also returns the per-row logsumexp (float32, float64 for float64;
    not differentiable); ``loss_dtype`` (e.g. torch.float32 for bf16 logits) sets the loss dtype.
    When input requires grad, the gradient is computed in the same pass as the loss (one read of
    the logits, one write of the gradient; label smoothing, probability targets and float64 read
    rows longer than 32768 classes twice); backward scales it in place by the upstream gradient
    on the device (nothing to do when that is 1: no host sync) and hands the buffer over. Double
    backward and a second backward through the same loss raise UnsupportedError, except for
    float64 logits and under torch.compile, where the scaling is out of place. float16 logits keep
    the stored gradient times a power of two (its entries, ~p / rows, would fall below float16's
    range before a GradScaler's scale lifts them) that the backward divides out.
    ``check_target`` raises IndexError for a class index outside [0, C) that is not ignore_index.
    On the GPU (eager, or inside a torch.compile graph) the kernel flags such rows (no host sync;
    the loss leaves them out) and the first call of cross_entropy, linear_cross_entropy,
    embedding, gather or gather_backward, or cross_entropy's eager backward, after the GPU has set
    the flag raises (usually the next step's); ``trainops.check_pending()`` waits for the GPU and
    raises it (the end of an evaluation), and one never raised is printed at exit; inside a CUDA
    graph capture the flag is a device-side assert at every replay. On the CPU the backward raises
    in eager training, the call itself otherwise (before the launch). ``check_target="immediate"``:
    before the launch everywhere (one min/max and one host sync on the GPU every call). Unchecked,
    such rows are left out.
    ``inplace_backward=True`` writes the gradient over the logits (saving a logits-sized buffer):
    input must be a non-leaf tensor nothing else needs afterwards (e.g. the LM head's output); its
    values are gone after the call (autograd raises if another op saved them). Accumulates in
    float32; deterministic.
    """
    if size_average is not None or reduce is not None:
        raise argument_error(UnsupportedError, "cross_entropy", "size_average", "and 'reduce' are deprecated in "
                             "torch; use reduction=")
    for name, t in (("input", input), ("target", target)):
        if not isinstance(t, Tensor):
            raise argument_error(InvalidProblemError, "cross_entropy", name,
                                 f"must be a torch.Tensor, got {type(t).__name__}")
    check, immediate = check_mode("cross_entropy", "check_target", check_target)
    loss, lse = cross_entropy_ops.cross_entropy(input, target, weight, ignore_index, reduction, float(label_smoothing),
                                                float(z_loss), loss_dtype, check, inplace_backward, immediate)
    return (loss, lse) if return_lse else loss


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
                         class_weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                         logit_scale: float = 1.0, temperature: float = 1.0,
                         num_items_in_batch: int | Tensor | None = None, loss_dtype: torch.dtype | None = None,
                         check_target: bool | str = True, token_accuracy: bool = False,
                         entropy: bool = False) -> Tensor | linear_cross_entropy_ops.LinearCrossEntropyOutput:
    """``cross_entropy(linear(hidden, weight, bias), target)`` of an LM head, without its N x V
    logits held whole: chunks of tokens go matmul, trainops's fused loss-and-gradient kernel in
    place, then the gradient matmuls (ops/linear_cross_entropy.py), so the extra memory is one
    chunk's logits (LinearCrossEntropyHeuristics.chunk_bytes, 512 MiB by default), a float32
    weight-gradient accumulator during the forward for a half weight, and a copy of the weight in
    hidden's dtype when the two differ or when the vocabulary is padded to a multiple of 8 (its
    rows then 16-byte aligned for cuBLAS: LinearCrossEntropyHeuristics.vocab_align).

    hidden: (..., H) float32 / float16 / bfloat16 / float64 (under autocast, cast to its dtype as
    ``F.linear`` is). weight: (V, H), bias: (V,), any float dtype (cast once to hidden's; their
    gradients in their own dtype). target: hidden's leading shape, int64 / int32 class indices.
    class_weight (V,), ignore_index, reduction ("mean" | "sum" | "none", then hidden's leading
    shape), label_smoothing and z_loss as ``trainops.cross_entropy`` (and torch's). The logits are
    z = softcap(logit_scale * (hidden @ weight^T + bias)) / temperature, the transform every fused
    loss of trainops takes under these names: softcap c gives c * tanh(u / c) (Gemma 2's
    final_logit_softcapping), None for none; logit_scale > 0 (Granite's 1 / logits_scaling) and
    temperature > 0, 1 by default (neither costs a pass over the logits). num_items_in_batch:
    with reduction "mean", divide the summed loss by it instead of this call's own count (Hugging
    Face's loss under gradient accumulation); an int or a one-element integer tensor, read on the
    device (a tensor's value is not checked: 0 gives inf, as dividing by it would); inside a CUDA
    graph capture a tensor on the GPU (a CPU tensor raises UnsupportedError; an int is captured as
    a constant). loss_dtype: the
    loss's dtype (default float32, float64 for float64 hidden: the loss is computed in that
    precision, as Hugging Face's upcast logits give it).

    With reduction "mean" or "sum" the gradients are computed in the forward pass and the backward
    scales them in place by the upstream gradient, on the device (nothing to do when it is 1; three
    matmuls in all; a second backward through the same loss raises UnsupportedError, except in
    float64 and under torch.compile); "none" recomputes the chunks in its backward (four matmuls).
    Only the gradients of the tensors that require grad are computed (a frozen head costs no dW).
    Targets are checked as ``trainops.cross_entropy`` checks them (``check_target``: on the GPU
    the kernels flag a bad index without a host sync, "immediate" checks before the launch). Deterministic (fixed chunk order,
    no atomics). Errors name the argument (InvalidProblemError, UnsupportedError).

    token_accuracy / entropy (keyword-only, False by default): the metrics a trainer logs from the
    logits (TRL's mean_token_accuracy and entropy), computed without them. When either is True the
    call returns ``LinearCrossEntropyOutput(loss, token_accuracy, entropy)`` (a NamedTuple; the one
    not asked for None); with both False, the loss tensor alone, through the same op as before
    (nothing else computed). Over the rows whose target is a class index other than ignore_index
    (the rows the loss counts), with z the transformed logits above (softcap, logit_scale and
    temperature as the loss sees them, in the matmuls' dtype):
        token_accuracy = mean over those rows of [argmax(z) == target] (torch.argmax's tie rule:
                         the first maximum)
        entropy        = mean over those rows of H(softmax(z)) = logsumexp(z) - sum softmax(z) z
    Unweighted means of this call's rows (class_weight, label_smoothing, z_loss and
    num_items_in_batch do not enter them); float32 scalars, accumulated in float32 (float64 for
    float64 hidden) on the device (no host sync) and divided at the end; without gradient. No
    counted row (all ignored, or empty): both 0, as TRL logs then, never NaN. Reduction "none"
    with either raises UnsupportedError naming it (they are batch means). Cost: each chunk's
    logits are read by torch ops before the loss kernel overwrites them with the gradients: one
    argmax pass for the accuracy; for the entropy a max, the shifted values, their exp, a product
    and two sums (six passes), in row blocks whose two float32 temporaries together take
    at most the chunk's own bytes, so memory stays one chunk. Under torch.compile(fullgraph=True)
    it runs as its own custom op, torch.ops.trainops.linear_cross_entropy_metrics.
    """
    return linear_cross_entropy_ops.linear_cross_entropy(
        hidden, weight, target, bias, class_weight=class_weight, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, logit_scale=logit_scale,
        temperature=temperature, num_items_in_batch=num_items_in_batch, loss_dtype=loss_dtype,
        check_target=check_target, token_accuracy=token_accuracy, entropy=entropy)


def _check_norm_tensors(op: str, x, params: dict) -> None:
    """x a float tensor; each given parameter a tensor on x's device (weight / bias: the normalized
    shape; residual: x's shape and dtype)."""
    _float_tensor(op, "x", x)
    for name, (t, shape) in params.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise argument_error(InvalidProblemError, op, name, f"must be a torch.Tensor or None, got {type(t).__name__}")
        if t.device != x.device:
            raise argument_error(InvalidProblemError, op, name, f"is on {t.device} but x is on {x.device}")
        if tuple(t.shape) != tuple(shape):
            raise argument_error(InvalidProblemError, op, name, f"has shape {tuple(t.shape)}; expected {tuple(shape)}")
        if name == "residual" and t.dtype != x.dtype:
            raise argument_error(InvalidProblemError, op, name, f"has dtype {t.dtype} but x has {x.dtype}")


def batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None = None,
               bias: Tensor | None = None, training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """Batch normalization over the channel axis (axis 1) of ``input`` (N, C, ...), as
    ``torch.nn.functional.batch_norm`` (same signature and semantics).

    training=True: each channel normalized by its batch mean and biased variance over N and the
    spatial axes; ``running_mean`` / ``running_var`` (when given) updated in place with
    ``momentum`` (running_var from the unbiased variance). training=False: normalized by the
    running statistics, which must be given. y = (x - mean) / sqrt(var + eps) * weight + bias.
    input: rank 2 to 8, any strides (channels-last stays channels-last in y and in the gradient),
    float32/float16/bfloat16/float64; weight, bias, running statistics (C,) in any float dtype.
    Statistics and sums in float32 (float64 for float64). Backward: dx, dweight, dbias,
    deterministic (per-program partial sums added in a fixed order by the last program to finish;
    its ticket is the only atomic), bit-identical run to run. Triton: 2 kernels a training
    forward, 2 a backward. Double backward raises UnsupportedError.
    Errors: InvalidProblemError (shapes or devices of the per-channel tensors, running statistics
    missing in eval, one value per channel in training, momentum outside [0, 1], eps < 0),
    UnsupportedError (integer or other dtypes, rank above 8, DTensor parameters, forward-mode AD in
    training). Every check runs before the running statistics are written.
    """
    op = "batch_norm"
    eps = _batch_norm_checks(op, input, running_mean, running_var, weight, bias, training, momentum, eps)
    return _batch_norm(input, running_mean, running_var, weight, bias, bool(training), float(momentum), eps)


def batch_norm_relu(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                    weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
                    momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``relu(batch_norm(input, ...))`` in one pass: ``batch_norm``'s arguments, semantics, dtypes,
    statistics and errors, y = max((x - mean) / sqrt(var + eps) * weight + bias, 0) (NaN kept, as
    torch.relu) written once. Backward: dy zeroed where y <= 0 (torch's threshold_backward on y),
    then batch norm's gradient; y is recomputed from the saved input in the backward kernels, so
    nothing more is saved than batch norm's own (the input), and the ReLU adds no launch. Same
    determinism as ``batch_norm``."""
    op = "batch_norm_relu"
    eps = _batch_norm_checks(op, input, running_mean, running_var, weight, bias, training, momentum, eps)
    return _batch_norm(input, running_mean, running_var, weight, bias, bool(training), float(momentum), eps, relu=True)


def _batch_norm_checks(op: str, input, running_mean, running_var, weight, bias, training, momentum, eps,
                       one_value_per_channel_ok: bool = False) -> float:
    """batch_norm's argument checks (all of them, before anything is written); returns eps as a float."""
    if not isinstance(input, Tensor):
        raise argument_error(InvalidProblemError, op, "input", f"must be a torch.Tensor, got {type(input).__name__}")
    float_dtype(op, "input", input.dtype)   # the four float dtypes (a float8 input is refused here too)
    if input.dim() < 2:
        raise argument_error(InvalidProblemError, op, "input", f"has shape {tuple(input.shape)}; batch norm takes "
                             "(N, C, ...)")
    channels = (input.shape[1],)
    device = input.device
    # every check before the statistics op writes the running statistics: nothing half-applied
    for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        if t is None or (type(t) in PLAIN_TENSORS and t.dtype in FLOATS and t.shape == channels
                         and t.device == device):
            continue   # (the usual case, which every check below passes: a few us of host time less a call)
        if not isinstance(t, Tensor):
            raise argument_error(InvalidProblemError, op, name, f"must be a torch.Tensor or None, got {type(t).__name__}")
        if is_dtensor(t):
            raise argument_error(UnsupportedError, op, name, "is a DTensor (a sharded parameter); call batch norm "
                                 "inside the module's forward, where FSDP2 has gathered its parameters")
        float_dtype(op, name, t.dtype)
        if t.device != input.device:
            raise argument_error(InvalidProblemError, op, name, f"is on {t.device} but input is on {input.device}")
        if tuple(t.shape) != channels:
            raise argument_error(InvalidProblemError, op, name, f"has shape {tuple(t.shape)}; expected {channels}, "
                                 "one value per channel")
    for name, t in (("running_mean", running_mean), ("running_var", running_var)):
        if t is not None and t.requires_grad:
            raise argument_error(InvalidProblemError, op, name, "requires grad; running statistics are buffers")
    if not (type(momentum) is float and 0 <= momentum <= 1) and (
            isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0 <= momentum <= 1):
        raise argument_error(InvalidProblemError, op, "momentum", f"must be a number in [0, 1], got {momentum!r}")
    eps = _eps(op, eps) if eps is not None else 1e-5
    training = bool(training)
    reduced = input.shape[0] * math.prod(input.shape[2:])
    if training and reduced == 1 and not one_value_per_channel_ok:
        raise argument_error(InvalidProblemError, op, "input", f"has shape {tuple(input.shape)}: training needs more "
                             "than 1 value per channel (as torch)")
    if not training and (running_mean is None or running_var is None):
        raise argument_error(InvalidProblemError, op, "running_mean" if running_mean is None else "running_var",
                             "is None in eval mode (training=False): eval normalizes with the running statistics")
    if training and forward_ad._current_level >= 0 and forward_ad.unpack_dual(input).tangent is not None:
        raise argument_error(UnsupportedError, op, "input", "carries a forward-mode tangent: forward-mode AD of "
                             "batch norm in training is not supported (use reverse mode)")
    return eps


def _batch_norm(input, running_mean, running_var, weight, bias, training: bool, momentum: float,
                eps: float, relu: bool = False) -> Tensor:
    """batch_norm (relu: batch_norm_relu) on checked arguments."""
    if training:
        # plain eager: statistics and normalisation in one call, the same plans and bits as the ops
        y = batch_norm_ops.eager_training(input, running_mean, running_var, weight, bias, momentum, eps, relu)
        if y is not None:
            return y
        # the statistics (running ones updated in place) carry no autograd: the forward op's
        # backward is batch norm's whole gradient
        mean, rstd = batch_norm_ops.batch_norm_stats_op(input.detach(), running_mean, running_var, momentum, eps)
    else:  # read, not written: no statistics op (whose in-place contract would bump their versions)
        acc = torch.float64 if input.dtype == torch.float64 else torch.float32
        mean, rstd = running_mean.to(acc), torch.rsqrt(running_var.to(acc) + eps)
    return batch_norm_ops.batch_norm_op(input, weight, bias, mean, rstd, training, relu)


def _process_group(op: str, process_group):
    """(group, its world size) that ``sync_batch_norm`` synchronises over: ``process_group`` or the
    default group; (None, 1) when torch.distributed is unavailable or not initialized. The size is
    torch's (-1 on a rank outside the group, which then normalizes alone, as torch's)."""
    import torch.distributed as dist

    available = dist.is_available()
    if available and isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        return None, -1   # new_group's answer on a rank outside it: this rank normalizes alone, as torch's
    if process_group is not None and not (available and isinstance(process_group, dist.ProcessGroup)):
        raise argument_error(InvalidProblemError, op, "process_group", "must be a torch.distributed.ProcessGroup or "
                             f"None, got {type(process_group).__name__}")
    if not (available and dist.is_initialized()):
        return None, 1
    group = process_group if process_group is not None else dist.group.WORLD
    return group, dist.get_world_size(group)


def sync_batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                    weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
                    momentum: float = 0.1, eps: float = 1e-5, process_group=None) -> Tensor:
    """Synchronised batch normalization: ``batch_norm`` whose training statistics are those of the
    whole batch of ``process_group``'s ranks (default: the default group), as
    ``torch.nn.SyncBatchNorm`` computes them (trainops.nn.SyncBatchNorm is the module).

    training=True with torch.distributed initialized and a group of 2 or more ranks: per channel
    c, over the elements of every rank (n_r on rank r, N = sum n_r; ranks may differ in batch size,
    and a rank may have none): mean = sum(x) / N, var = sum((x - mean)^2) / N (biased), y = (x -
    mean) / sqrt(var + eps) * weight + bias on each rank's own x; ``running_mean`` /
    ``running_var`` (when given, the same on every rank) become (1 - momentum) * running +
    momentum * (mean, var * N / (N - 1)) on every rank (N = 1 gives NaN, as torch's; N = 0 leaves
    them). Backward: dx = weight * rstd * (dy - sum(dy) / N - xh * sum(dy * xh) / N) with the
    group's sums; dweight = sum(dy * xh) and dbias = sum(dy) over this rank's elements only, as
    torch's (DistributedDataParallel then averages them over ranks; a rank without an element gets
    zeros where torch's gives None). Otherwise (eval, one rank,
    torch.distributed not initialized, a rank outside the group): ``batch_norm`` itself.

    Shapes and dtypes as ``batch_norm``: input (N, C, ...) of rank 2 to 8, any strides,
    channels-last kept; float32 / float16 / bfloat16 / float64; per-channel tensors (C,) of any
    float dtype. Accumulators: each rank's statistics and gradient sums as ``batch_norm``'s
    (float32, float64 for float64, fixed-order partial sums); the ranks' statistics combined in
    float64 (Chan's formula, in rank order: every rank gets the same bits). Collectives on
    ``process_group``: one all_gather of 3C + 1 float64 values a forward, one all_reduce (SUM) of
    2C accumulator-dtype values a backward when input needs its gradient (none for dweight and
    dbias), no other host synchronisation. Determinism: y, the statistics, dweight and dbias are
    bit-identical run to run; dx too where the backend's all_reduce adds the ranks' sums in a
    fixed order. Every rank of the group must call it alike (same
    C, dtypes, training, and input requiring grad or not), as torch's: a rank that skips a call
    leaves the others waiting in the collective. Under torch.compile it runs eagerly (a graph break
    in training over 2 or more ranks, so ``fullgraph=True`` raises there; eval and one rank compile).
    Errors: those of ``batch_norm``, raised before any collective and before the running
    statistics are written (one value per channel is allowed on a rank of a group of 2 or more,
    as torch's); InvalidProblemError when ``process_group`` is not a ProcessGroup or None. Double
    backward and forward-mode AD in training raise UnsupportedError.
    """
    op = "sync_batch_norm"
    group, world_size = _process_group(op, process_group)
    world_size = world_size if training else 1
    eps = _batch_norm_checks(op, input, running_mean, running_var, weight, bias, training, momentum, eps,
                             one_value_per_channel_ok=world_size > 1)
    if world_size > 1:   # batch_norm checks these in its statistics op; here before the collectives
        batch_norm_ops.check_running(op, running_mean, running_var, input.shape[1], input.device)
    if world_size <= 1:
        return _batch_norm(input, running_mean, running_var, weight, bias, bool(training), float(momentum), eps)
    return batch_norm_ops.sync_batch_norm(input, weight, bias, running_mean, running_var, float(momentum), eps, group,
                                          world_size)


def _eps(op: str, eps):
    if eps is None:
        return None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise argument_error(InvalidProblemError, op, "eps", f"must be a finite number >= 0, got {eps!r}")
    return float(eps)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float | None = None, *, residual: Tensor | None = None,
             weight_offset: float = 0.0, out_dtype: torch.dtype | None = None):
    """RMSNorm over the trailing axes of ``weight``'s shape (the last axis when weight is None):
    y = h / sqrt(mean(h^2) + eps) * (weight + weight_offset), with h = x, or x + residual.

    As ``torch.nn.functional.rms_norm(x, weight.shape, weight, eps)``; eps None is
    torch.finfo(x.dtype).eps. ``residual`` (x's shape and dtype): the pre-norm block's fused add,
    returning ``(y, h)`` with h = x + residual (rounded to x's dtype, then normalized).
    ``weight_offset=1.0`` multiplies by (1 + weight), as Gemma. x: any shape and strides,
    float32/float16/bfloat16/float64; weight any float dtype; h in x's dtype; y in ``out_dtype``
    (default x's dtype; any of the four): y is computed in float32 (float64 for float64 x) and
    rounded once to it, so ``out_dtype=torch.bfloat16`` of a float32 x gives exactly
    ``rms_norm(x, ...).to(torch.bfloat16)`` without the float32 y and the cast. Outputs contiguous.
    Statistics and sums in float32 (float64 for float64 x). Backward: dy in y's dtype; dx
    (= d residual) in x's, dweight in weight's; deterministic (fixed-order reduction, no atomics),
    bit-identical run to run. Under torch.autocast nothing is cast: the statistics are float32
    anyway and y keeps x's dtype, or out_dtype (as torch's rms_norm; torch's autocast runs
    layer_norm in float32 and returns float32). Double backward raises UnsupportedError.
    Errors: InvalidProblemError (shapes, devices, eps < 0, residual dtype, weight_offset without
    weight, out_dtype not a torch.dtype), UnsupportedError (integer or other dtypes, rank above 8).
    """
    op = "rms_norm"
    if isinstance(weight, (int, list, tuple, torch.Size)):
        raise argument_error(InvalidProblemError, op, "weight",
                             f"is {weight!r}: trainops.rms_norm takes (x, weight, eps); the normalized shape is "
                             "weight's shape (torch.nn.functional.rms_norm(x, normalized_shape, weight, eps) is "
                             "trainops.rms_norm(x, weight, eps), or trainops.nn.RMSNorm without a weight)")
    normalized_ndim = 1 if weight is None else (weight.dim() if isinstance(weight, Tensor) else 0)
    if isinstance(x, Tensor) and not 1 <= normalized_ndim <= x.dim():
        raise argument_error(InvalidProblemError, op, "weight", f"has {normalized_ndim} axes; x has {x.dim()}: "
                             f"expected 1 to {x.dim()}")
    shape = x.shape[x.dim() - normalized_ndim:] if isinstance(x, Tensor) else ()
    _check_norm_tensors(op, x, {"weight": (weight, shape), "residual": (residual, getattr(x, "shape", ()))})
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)):
        raise argument_error(InvalidProblemError, op, "weight_offset", f"must be a number, got {weight_offset!r}")
    _check_out_dtype(op, out_dtype)
    y, h, _ = norm_ops.rms_norm_op(x, weight, residual, normalized_ndim, _eps(op, eps), float(weight_offset),
                                   out_dtype)
    return y if residual is None else (y, h)


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5, *, residual: Tensor | None = None, out_dtype: torch.dtype | None = None):
    """LayerNorm over the trailing ``normalized_shape`` axes, as ``torch.nn.functional.layer_norm``:
    y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias (biased variance), with h = x, or
    x + residual.

    ``residual`` (x's shape and dtype): the pre-norm block's fused add, returning ``(y, h)``.
    Shapes, dtypes (``out_dtype``: y's, rounded once), accumulation, determinism and errors as
    ``rms_norm``; backward gives dx (= d residual), dweight and dbias, each reduced in a fixed order.
    """
    op = "layer_norm"
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    try:
        if isinstance(normalized_shape, str):
            raise TypeError
        normalized_shape = tuple(int(s) for s in normalized_shape)
    except (TypeError, ValueError):
        raise argument_error(InvalidProblemError, op, "normalized_shape",
                             f"must be an int or a sequence of ints, got {normalized_shape!r}") from None
    if isinstance(x, Tensor) and (not 1 <= len(normalized_shape) <= x.dim()
                                  or tuple(x.shape[x.dim() - len(normalized_shape):]) != normalized_shape):
        raise argument_error(InvalidProblemError, op, "normalized_shape",
                             f"is {list(normalized_shape)}; x has shape {tuple(x.shape)}")
    _check_norm_tensors(op, x, {"weight": (weight, normalized_shape), "bias": (bias, normalized_shape),
                                "residual": (residual, getattr(x, "shape", ()))})
    _check_out_dtype(op, out_dtype)
    y, h, _ = norm_ops.layer_norm_op(x, weight, bias, residual, len(normalized_shape), _eps(op, eps), out_dtype)
    return y if residual is None else (y, h)


def _check_out_dtype(op: str, out_dtype) -> None:
    """None or a torch.dtype (which ones the op supports, its descriptor says: UnsupportedError)."""
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise argument_error(InvalidProblemError, op, "out_dtype", f"must be a torch.dtype or None, got {out_dtype!r}")


def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, position_ids: Tensor | None = None,
                     interleaved: bool = False, rotary_dim: int | None = None,
                     check_position_ids: bool = False) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of queries and keys, Hugging Face's ``apply_rotary_pos_emb(q, k,
    cos, sin)``: returns (q_out, k_out) with, on the first R = rotary_dim features of every head,

        out = x * cos + rotate(x) * sin        (the features R.. are passed through unchanged)

    rotate(x) = cat(-x[R/2:R], x[:R/2]) (rotate_half, Llama / GPT-NeoX); with ``interleaved=True``
    (GPT-J) rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i] (cos and sin then per element:
    cos[2i] == cos[2i+1]). Every feature's own cos and sin are read (HF's duplicated layout is not
    assumed).

    q: (batch, q_heads, seq, head_dim); k: (batch, k_heads, seq, head_dim) (head counts may differ,
    GQA); any strides, read in place (HF's transposed views are not copied). cos, sin: (batch, seq,
    R), (1, seq, R) or (seq, R), the same for every head; R defaults to cos.shape[-1] and must equal
    it, be even and at most head_dim (partial rotary: GPT-NeoX, Phi). ``position_ids`` (int32 /
    int64, (batch, seq), (1, seq) or (seq,)): cos and sin are then (max_position, R) tables and row
    (b, s) uses row position_ids[b, s], read by the kernel (no gathered copy). Out-of-range ids
    (outside [0, max_position)): by default nothing is synchronised with the host and such a row's
    rotated features come out NaN (the error shows in the loss); ``check_position_ids=True`` raises
    IndexError (IndexOutOfRangeError) before anything is written, at the cost of one min/max and
    one host synchronisation per call on the GPU.

    Dtypes: q and k float32/float16/bfloat16/float64, one dtype; cos and sin any float dtype (HF's
    float32 tables with bf16 q are fine). Math in float32 (float64 for float64), each output rounded
    once to q's dtype (HF rounds cos/sin to q's dtype and each product: results agree within a few
    units in the last place). Outputs: q's and k's dtype and layout (as torch.empty_like).
    Deterministic. Backward: dq = dy * cos + rotate^T(dy * sin) (the rotation by the negative
    angle), same for dk, in one launch; dq takes q's layout; double backward works. cos and sin get
    no gradient: UnsupportedError if either requires grad (with grad mode on).
    Errors (before anything is written): InvalidProblemError for shapes that do not fit (q / k
    batch, seq or head_dim; cos / sin not broadcastable to (batch, seq, R); rotary_dim odd, too
    large or not cos.shape[-1]; position_ids' shape), mismatched dtypes of q and k or of cos and
    sin, tensors on other devices; UnsupportedError for integer or other dtypes.
    """
    op = "rotary_embedding"
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _float_tensor(op, name, t)
    if position_ids is not None and not isinstance(position_ids, Tensor):
        raise argument_error(InvalidProblemError, op, "position_ids",
                             f"must be a torch.Tensor, got {type(position_ids).__name__}")
    if torch.is_grad_enabled():
        for name, t in (("cos", cos), ("sin", sin)):
            if t.requires_grad:
                raise argument_error(UnsupportedError, op, name, "requires grad; rotary_embedding gives cos and sin "
                                     "no gradient (detach them)")
    if rotary_dim is not None and (not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool)):
        raise argument_error(InvalidProblemError, op, "rotary_dim", f"must be an int or None, got {rotary_dim!r}")
    return rotary_ops.rotary_op(q, k, cos, sin, position_ids, bool(interleaved), rotary_dim, bool(check_position_ids))


def qk_norm_rotary(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                   eps: float = 1e-6, *, weight_offset: float = 0.0, across_heads: bool = False,
                   out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """RMSNorm of queries and keys, then the rotary embedding, in one pass (Qwen3, Gemma 3, OLMo 2):
    returns (q_out, k_out) with, for x = q (weight q_weight) and x = k (k_weight),

        y = x / sqrt(mean(x^2) + eps) * (weight + weight_offset)
        out = y * cos + rotate_half(y) * sin          rotate_half(y) = cat(-y[D/2:], y[:D/2])

    the mean over each head's D features (weights of shape (D,): Qwen3, Gemma 3 with
    ``weight_offset=1.0``) or, with ``across_heads=True``, over the token's heads * D features
    (weights of shape (q_heads * D,) and (k_heads * D,): OLMo 2). Every feature's own cos and sin are
    read; the rotation covers the whole head.

    q: (batch, seq, q_heads, D) and k: (batch, seq, k_heads, D), the projections' layout before HF's
    ``.transpose(1, 2)`` (head counts may differ: GQA); D even; any strides, read in place (views of
    a fused qkv projection). cos, sin: (batch, seq, D), (1, seq, D) or (seq, D), the same for every
    head (HF's position embeddings). Outputs: (batch, seq, heads, D), contiguous: ``.transpose(1, 2)``
    gives attention's (batch, heads, seq, D) as a view.

    Dtypes: q and k float32/float16/bfloat16/float64, one dtype; the weights any float dtype, one
    dtype; cos and sin any float dtype, one dtype. Outputs in ``out_dtype`` (default q's dtype; HF's
    Qwen3 norm returns torch.promote_types(q.dtype, weight.dtype): pass that to match it). Math in
    float32 (float64 for float64), each output rounded once. Backward: dq, dk (contiguous, q's and
    k's dtype) and the weight gradients (their dtype), recomputed from the saved q and k in one
    launch; deterministic (fixed-order sums, no atomics), bit-identical run to run. cos and sin get
    no gradient (UnsupportedError if either requires one); double backward raises UnsupportedError.
    Errors (before anything is written): InvalidProblemError for shapes that do not fit (q / k not
    4-d, their batch, seq or head_dim, an odd head_dim, weight shapes, cos / sin not broadcastable
    to (batch, seq, D)), mismatched dtypes (k against q, k_weight against q_weight, sin against
    cos), tensors on other devices, eps < 0; UnsupportedError for integer or other dtypes.
    """
    op = "qk_norm_rotary"
    for name, t in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos), ("sin", sin)):
        _float_tensor(op, name, t)
    if torch.is_grad_enabled():
        for name, t in (("cos", cos), ("sin", sin)):
            if t.requires_grad:
                raise argument_error(UnsupportedError, op, name, "requires grad; qk_norm_rotary gives cos and sin "
                                     "no gradient (detach them)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise argument_error(InvalidProblemError, op, "eps", f"must be a finite number >= 0, got {eps!r}")
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)):
        raise argument_error(InvalidProblemError, op, "weight_offset", f"must be a number, got {weight_offset!r}")
    if not isinstance(across_heads, bool):
        raise argument_error(InvalidProblemError, op, "across_heads", f"must be a bool, got {across_heads!r}")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise argument_error(InvalidProblemError, op, "out_dtype", f"must be a torch.dtype or None, got {out_dtype!r}")
    return qk_norm_rotary_ops.qk_norm_rotary_op(q, k, q_weight, k_weight, cos, sin, float(eps), float(weight_offset),
                                                across_heads, out_dtype)


# -- activations (ops/activations.py) ------------------------------------------------------------------

def _check_activation_tensor(op: str, name: str, t, optional: bool = False) -> None:
    if (t is not None or not optional) and not isinstance(t, Tensor):
        raise argument_error(InvalidProblemError, op, name, f"must be a torch.Tensor, got {type(t).__name__}")


def _check_approximate(op: str, approximate) -> None:
    if not isinstance(approximate, str) or approximate not in ("none", "tanh"):
        raise argument_error(InvalidProblemError, op, "approximate", f"is {approximate!r}; expected 'none' or 'tanh'")


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    """GELU, as ``torch.nn.functional.gelu(input, approximate)``: y = x * 0.5 * (1 + erf(x / sqrt 2))
    ("none"), or 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))) ("tanh").

    input: any shape (0-d too) and strides, read in place; float32/float16/bfloat16/float64. Math in
    float32 (float64 for float64), torch's CUDA expressions (the GPU forward matches torch's bits);
    y in input's dtype, contiguous. At -inf y = 0 and at +-inf the gradient is its limit (0, 1)
    where torch gives NaN. Backward saves only the input. Errors: InvalidProblemError for an
    unknown ``approximate``; UnsupportedError for integer or other dtypes.
    """
    _check_activation_tensor("gelu", "input", input)
    _check_approximate("gelu", approximate)
    return activation_ops.gelu_op(input, approximate)


def quick_gelu(input: Tensor) -> Tensor:
    """QuickGELU (CLIP, OpenAI GPT-2 variants): y = x * sigmoid(1.702 x), computed in float32 and
    rounded once. Shapes, dtypes, limits at +-inf and errors as ``gelu``."""
    _check_activation_tensor("quick_gelu", "input", input)
    return activation_ops.quick_gelu_op(input)


def silu(input: Tensor, inplace: bool = False) -> Tensor:
    """SiLU (swish), as ``torch.nn.functional.silu``: y = x / (1 + exp(-x)) (= x * sigmoid(x)).

    Shapes, dtypes, limits at +-inf (silu(-inf) = 0, not NaN) and errors as ``gelu``.
    ``inplace=True`` writes the result into ``input`` and returns it, as torch's ``silu_``; where a
    gradient is recorded, the backward's input is a copy taken first (torch keeps one too), so
    in place saves no memory there. torch's in-place rules hold (a leaf that requires grad raises
    RuntimeError).
    """
    _check_activation_tensor("silu", "input", input)
    if not inplace:
        return activation_ops.silu_op(input)
    source = input.clone() if torch.is_grad_enabled() and input.requires_grad else input
    return input.copy_(activation_ops.silu_op(source))


def bias_gelu(input: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """ONNX Runtime's BiasGelu: y = gelu(input + bias), bias of shape input.shape[-1:] broadcast over
    the leading axes (``approximate`` as ``gelu``; "tanh" is FastGelu with bias).

    input + bias is added in float32 (float64 for float64) and not rounded before the GELU (torch's
    ``gelu(x + b)`` rounds the sum to the input's dtype first). bias: any float dtype (read in the
    accumulator dtype; an fp32 bias beside bf16 input, as fp32 master parameters give, is fine: the
    output keeps the input's dtype), the input's device, any strides. Backward: d input = dy *
    gelu'(input + bias); d bias = the sum of d input over every leading element, in the bias's
    dtype, deterministic (per-program float32 partial sums added in a fixed order by a second
    kernel, no atomics: bit-identical run to run). Errors as ``gelu``, InvalidProblemError for a
    bias of another shape or device, UnsupportedError for a non-float bias.
    """
    _check_activation_tensor("bias_gelu", "input", input)
    _check_activation_tensor("bias_gelu", "bias", bias)
    _check_approximate("bias_gelu", approximate)
    return activation_ops.bias_gelu_op(input, bias, approximate)


def swiglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """SwiGLU (Llama, Mistral, Qwen MLPs): y = silu(gate) * up, in one pass.

    gate, up: the same shape, dtype and device, any strides (read in place). ``up=None``: gate holds
    both on its last axis (gate = x[..., :n], up = x[..., n:], n = x.shape[-1] // 2; an odd last
    axis is an InvalidProblemError), and the backward writes one gradient of x's shape. Math in
    float32 (float64 for float64), rounded once (torch's ``silu(gate) * up`` rounds silu(gate) to
    the dtype first; in float32 the results are torch's). Backward recomputes sigmoid(gate) from
    the saved gate and up (no output is saved: torch's memory): d gate = dy * up * silu'(gate),
    d up = dy * silu(gate), each only when needed. Errors: InvalidProblemError for mismatched
    shapes, dtypes or devices; UnsupportedError for integer or other dtypes.
    """
    _check_activation_tensor("swiglu", "gate", gate)
    _check_activation_tensor("swiglu", "up", up, optional=True)
    return activation_ops.swiglu_op(gate, up)


def geglu(gate: Tensor, up: Tensor | None = None, approximate: str = "tanh") -> Tensor:
    """GeGLU (Gemma, T5 v1.1): y = gelu(gate, approximate) * up, in one pass; "tanh" by default
    (Gemma's gelu_pytorch_tanh), "none" for the erf form. Layouts, ``up=None``, dtypes, backward
    and errors as ``swiglu``."""
    _check_activation_tensor("geglu", "gate", gate)
    _check_activation_tensor("geglu", "up", up, optional=True)
    _check_approximate("geglu", approximate)
    return activation_ops.geglu_op(gate, up, approximate)


def _check_generator(op: str, generator) -> None:
    """None, or a CPU torch.Generator outside torch.compile (eager seeds are drawn on the host)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise argument_error(InvalidProblemError, op, "generator",
                             f"must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise argument_error(InvalidProblemError, op, "generator",
                             f"is a {generator.device.type} generator; seeds are drawn on the host from a CPU "
                             "generator (a device draw would synchronize)")
    if torch.compiler.is_compiling():
        raise argument_error(UnsupportedError, op, "generator",
                             "cannot be traced by torch.compile; leave it None (seeds then come from torch's "
                             "default generator: torch.manual_seed makes runs repeat)")


def _dropout_args(op: str, x, p, generator, mask_mode, name: str = "x") -> float:
    """p as a float; x (the argument ``name``) a float tensor, generator a CPU torch.Generator or
    None, mask_mode known."""
    _float_tensor(op, name, x)
    p = dropout_ops.check_p(op, p)
    if mask_mode not in dropout_ops.MASK_MODES:
        raise argument_error(InvalidProblemError, op, "mask_mode",
                             f"is {mask_mode!r}; expected one of {dropout_ops.MASK_MODES}")
    _check_generator(op, generator)
    return p


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *,
            generator: torch.Generator | None = None, mask_mode: str = "regenerate") -> Tensor:
    """y = x * keep / (1 - p) (x: ``input``), each element kept with probability 1 - p, as
    ``torch.nn.functional.dropout(input, p, training, inplace)``.

    ``training=False`` or ``p == 0`` returns x itself (as torch: no copy, nothing drawn); ``p == 1``
    gives x * 0 (zeros; NaN where x is NaN or infinite, as torch). Dropped elements are x * 0, so
    NaN and inf propagate as in torch. The mask is Philox-4x32-10 (Triton's ``tl.randint4x`` /
    ``tl.rand``) of a seed drawn from ``generator`` (a CPU torch.Generator; default torch's default
    CPU generator, so ``torch.manual_seed`` makes runs repeat; each call draws a new seed, without
    a GPU sync); the same seed gives the same mask on the CPU path and on the GPU, but not
    torch's mask (its statistics are torch's). ``mask_mode="regenerate"`` (default): the backward
    regenerates the mask from the seed (nothing else saved); ``"bits"``: the forward also stores
    it, 1 bit an element, and the backward reads it. Gradient: dx = dy * keep / (1 - p), the same
    in both modes.

    x: any shape and strides (read in place), float32/float16/bfloat16/float64; y contiguous, x's
    dtype; math in float32 (float64 for float64): a kept element is x * float32(1 / (1 - p))
    rounded once. Deterministic. On a CUDA device under torch.compile or while a CUDA graph is being
    captured, the seed is drawn on the device by ``torch.randint`` (torch's CUDA generator, also
    seeded by ``torch.manual_seed``): every replay of a captured graph draws a new mask (a
    ``generator`` cannot be traced or captured: UnsupportedError). See ``trainops.ops.dropout``.
    ``inplace=True``: the result is written into ``input``, which is returned (as torch's
    ``dropout_``; the kernel writes a new buffer that is copied over, so it saves no memory; torch's
    in-place rules hold: a leaf that requires grad raises RuntimeError).
    Errors: InvalidProblemError (p not a number in [0, 1], mask_mode, a non-CPU generator),
    UnsupportedError (integer dtypes; a generator under torch.compile); double backward raises
    UnsupportedError.
    """
    op = "dropout"
    x = input
    p = _dropout_args(op, x, p, generator, mask_mode, "input")
    if not training or p == 0:
        return x
    y, _ = dropout_ops.dropout_op(x, None, None, dropout_ops.draw_seed(generator, x.device, op), p, 0,
                                  mask_mode == "bits")
    return x.copy_(y) if inplace else y


def bias_dropout_add(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, training: bool = True, *,
                     generator: torch.Generator | None = None, mask_mode: str = "regenerate") -> Tensor:
    """y = residual + dropout(x + bias, p, training) in one pass (ORT's BiasDropout; Megatron's
    bias_dropout_add).

    bias: (x.shape[-1],) or None, any float dtype (read in float32; not promoted: y has x's dtype);
    residual: x's shape and dtype; both any strides. Math in float32 (float64 for float64), y
    rounded once. Eval (``training=False``) or p == 0: y = residual + x + bias, nothing drawn.
    Seeds, mask and ``mask_mode`` as ``dropout``. Backward: dx = dy * keep / (1 - p); dbias = dx
    summed over the leading axes in float32, deterministically (per-program partial rows summed in
    a fixed order: bit-identical run to run); d residual = dy itself.
    Errors as ``dropout``, and InvalidProblemError for a bias or residual of the wrong shape,
    device or (residual) dtype.
    """
    op = "bias_dropout_add"
    p = _dropout_args(op, x, p, generator, mask_mode)
    if not isinstance(residual, Tensor):
        raise argument_error(InvalidProblemError, op, "residual", f"must be a torch.Tensor, got "
                             f"{type(residual).__name__}")
    if bias is not None and x.dim() == 0:
        raise argument_error(InvalidProblemError, op, "bias", "needs x of rank >= 1 (it runs along x's last axis)")
    _check_norm_tensors(op, x, {"bias": (bias, x.shape[-1:]), "residual": (residual, x.shape)})
    seed = dropout_ops.draw_seed(generator, x.device, op) if training and p > 0 else None
    y, _ = dropout_ops.dropout_op(x, bias, residual, seed, p, 0, mask_mode == "bits")
    return y


# -- attention softmax (ops/attention_softmax.py) -------------------------------------------------------

_CAUSAL_MODES = ("upper_left", "lower_right")


def attention_softmax(scores: Tensor, *, scale: float = 1.0, mask: Tensor | None = None, bias: Tensor | None = None,
                      causal: bool | str = False, dropout_p: float = 0.0,
                      generator: torch.Generator | None = None) -> Tensor:
    """The softmax of an explicit attention, fused: dropout(softmax(scores * scale + bias, masked)),
    forward and backward in one pass each (ONNX Runtime's BiasSoftmax / BiasSoftmaxDropout).

    scores: (..., q_len, k_len), e.g. q @ k^T of shape (batch, heads, q_len, k_len); the softmax
    runs over the last axis. Per row, in float32 (float64 for float64 scores):
    z = scores * scale (+ bias), then z = -inf where ``mask`` is False or the causal mask hides the
    key; y = softmax(z); with dropout_p = p > 0, out = y * keep / (1 - p) (each element kept with
    probability 1 - p), else out = y. As torch's explicit attention
    ``torch.softmax(scores * scale + bias.masked_fill(~mask, -inf), -1)`` (then ``F.dropout``),
    and as the weights of ``F.scaled_dot_product_attention`` with a boolean ``attn_mask``.

    mask: bool, broadcastable to scores' shape, **True = keep** (SDPA's boolean ``attn_mask``; the
    inverse of nn.MultiheadAttention's key_padding_mask): False positions get -inf.
    bias: additive, any float dtype, broadcastable to scores' shape ((1, 1, q, k), (b, 1, 1, k),
    (b, h, q, k), ...). Both are read through their broadcast strides: never expanded in memory.
    causal: False; True or "upper_left" masks key k in row q when k > q (SDPA's ``is_causal=True``:
    the upper-left aligned lower triangle, also for q_len != k_len); "lower_right" masks k > q +
    (k_len - q_len) (the diagonal ends at the bottom-right corner: torch's ``causal_lower_right``,
    flash-attention's convention, the one for queries that are the last q_len of k_len positions).
    A row whose every position is masked (or whose every z is -inf) gives zeros, not NaN (torch's
    softmax gives NaN; SDPA's memory-efficient kernel zeros), and a zero gradient. A NaN in a row
    makes the row NaN, as torch.
    dropout_p: in [0, 1); pass 0 in evaluation (as SDPA, this function always applies it).
    The mask is ops/dropout.py's Philox mask of each element's row-major index under a seed drawn
    from ``generator`` (a CPU torch.Generator) or torch's default CPU generator, a host op with no
    device synchronisation (``torch.manual_seed`` makes runs repeat; ``trainops.dropout`` of a tensor
    of scores' shape with the same seed drops the same elements); on CUDA under torch.compile or a
    CUDA graph capture, a seed drawn on the device, new at every replay (as ``trainops.dropout``).
    The backward regenerates it.

    Dtypes: scores float32 / float16 / bfloat16 / float64; out in scores' dtype, contiguous. Any
    strides for scores (read in place). Backward: d scores = scale * y * (g - sum(g * y)), g = d out
    * keep / (1 - p); d bias = the same dz (before the scale) summed over bias's broadcast axes, in
    bias's dtype, only when bias requires grad. Saved: y (the output itself without dropout; with
    dropout the pre-dropout y, a second tensor of scores' size) and the seed. Deterministic,
    bit-identical run to run (fixed-order sums, no atomics). Double backward raises UnsupportedError.
    Errors, before anything is written: InvalidProblemError for a mask that is not bool or not
    broadcastable, a bias not broadcastable, tensors on different devices, dropout_p outside [0, 1),
    a scale that is not a finite number, an unknown causal, causal with scores of rank 1, a CUDA
    generator; UnsupportedError for integer (or other) dtypes of scores or bias, rank above 8, or a
    generator under torch.compile.
    """
    op = "attention_softmax"
    _float_tensor(op, "scores", scores)
    for name, t in (("mask", mask), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise argument_error(InvalidProblemError, op, name, f"must be a torch.Tensor or None, got {type(t).__name__}")
        if t.device != scores.device:
            raise argument_error(InvalidProblemError, op, name, f"is on {t.device} but scores is on {scores.device}")
    if mask is not None and mask.dtype != torch.bool:
        raise argument_error(InvalidProblemError, op, "mask", f"has dtype {mask.dtype}; it must be torch.bool (True = "
                             "keep); pass an additive float mask as bias")
    if bias is not None and not bias.is_floating_point():
        raise argument_error(UnsupportedError, op, "bias", f"has dtype {bias.dtype}; supported: float32, float16, "
                             "bfloat16, float64")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not -float("inf") < scale < float("inf"):
        raise argument_error(InvalidProblemError, op, "scale", f"must be a finite number, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise argument_error(InvalidProblemError, op, "dropout_p", f"must be a number in [0, 1), got {dropout_p!r}")
    if not isinstance(causal, bool) and not (isinstance(causal, str) and causal in _CAUSAL_MODES):
        raise argument_error(InvalidProblemError, op, "causal", f"must be a bool, 'upper_left' or 'lower_right', "
                             f"got {causal!r}")
    shift = None
    if causal is not False:
        if scores.dim() < 2:
            raise argument_error(InvalidProblemError, op, "causal", f"needs scores of rank 2 or more (q_len, k_len), "
                                 f"got shape {tuple(scores.shape)}")
        shift = scores.shape[-1] - scores.shape[-2] if causal == "lower_right" else 0
    _check_generator(op, generator)
    seed = dropout_ops.draw_seed(generator, scores.device, op) if dropout_p > 0 else None
    out, _ = attention_ops.attention_softmax_op(scores, mask, bias, float(scale), shift, float(dropout_p), seed)
    return out


def sum_to_shape(grad: Tensor, shape) -> Tensor:
    """``grad`` summed down to ``shape`` (torch's ``Tensor.sum_to_size``): the reduction that ends the
    backward of a broadcasting elementwise op, for the operand that was broadcast.

    grad: any shape and strides, float32 / float16 / bfloat16 / float64. shape: a sequence of ints
    expandable to grad's shape (right-aligned; each size 1 or grad's). Returns a contiguous tensor of
    ``shape`` in grad's dtype, accumulated in float32 (float64 for float64), deterministic; grad
    itself when ``shape`` is grad's shape (as torch's). Differentiable (the backward expands).
    Errors: InvalidProblemError naming ``grad`` (not a tensor) or ``shape`` (not ints, not
    expandable); UnsupportedError for another dtype.
    """
    op = "sum_to_shape"
    _float_tensor(op, "grad", grad)
    if isinstance(shape, Tensor) or not hasattr(shape, "__iter__"):
        raise argument_error(InvalidProblemError, op, "shape", f"must be a sequence of ints, got {shape!r}")
    shape = broadcast_ops.check_expandable(op, grad.shape, shape)
    if shape == tuple(grad.shape):
        return grad
    return broadcast_ops.sum_to_shape_op(grad, list(shape))


def conv2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """torch.nn.functional.conv2d through the convolution registry (ops/convolution.py): on CUDA,
    Triton's depthwise kernels where they were measured faster than cuDNN (bf16 / float32 NCHW
    depthwise layers of many positions: ``convolution.choose_backend``), cuDNN elsewhere; torch's
    CPU kernels on the CPU; ``trainops.backend`` pins one, ``trainops.track_kernels`` names the
    kernel that ran.

    input: (N, C, H, W) or unbatched (C, H, W); weight: (O, C / groups, KH, KW); bias: (O,) or None;
    all of one dtype (float32, float16, bfloat16, float64; under torch.autocast each is cast to its
    dtype but float64 ones, as torch's convolution). stride, dilation: int or pair (>= 1);
    padding: int, pair (>= 0), "valid" or "same" (stride 1; an odd total padding puts the extra
    row / column at the bottom / right, as torch's). Returns (N, O, OH, OW), channels-last when the
    input or the weight is (as torch's).
    Errors: InvalidProblemError naming the argument (shapes, groups, geometry), UnsupportedError
    for another dtype, and in a double backward (``create_graph=True``).
    """
    op = "conv2d"
    _float_tensor(op, "input", input)
    _float_tensor(op, "weight", weight)
    if bias is not None:
        _float_tensor(op, "bias", bias)
    if input.dim() not in (3, 4):
        raise argument_error(InvalidProblemError, op, "input", f"must be (N, C, H, W) or (C, H, W), got shape "
                             f"{tuple(input.shape)}")
    if weight.dim() != 4:
        raise argument_error(InvalidProblemError, op, "weight", f"must be (O, C / groups, KH, KW), got shape "
                             f"{tuple(weight.shape)}")
    unbatched = input.dim() == 3
    x = input.unsqueeze(0) if unbatched else input
    if torch.is_autocast_enabled(x.device.type):   # as torch's autocast casts a convolution's tensors
        autocast_dtype = torch.get_autocast_dtype(x.device.type)
        x, weight, bias = (t if t is None or t.dtype == torch.float64 else t.to(autocast_dtype)
                           for t in (x, weight, bias))
    stride = convolution_ops.pair(op, "stride", stride, 1)
    dilation = convolution_ops.pair(op, "dilation", dilation, 1)
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            if stride != (1, 1):
                raise argument_error(InvalidProblemError, op, "padding", f"'same' needs stride 1, got stride {stride}")
            totals = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
            padding = tuple(t // 2 for t in totals)
            extra = [t % 2 for t in totals]
            if any(extra):   # the odd row / column after the data, as torch's
                x = torch.nn.functional.pad(x, [0, extra[1], 0, extra[0]])
        else:
            raise argument_error(InvalidProblemError, op, "padding", f"must be an int, a pair, 'valid' or 'same', "
                                 f"got {padding!r}")
    padding = convolution_ops.pair(op, "padding", padding, 0)
    if bias is not None and bias.dim() != 1:
        raise argument_error(InvalidProblemError, op, "bias", f"must be (O,), got shape {tuple(bias.shape)}")
    y = convolution_ops.conv2d_op(x, weight, bias, list(stride), list(padding), list(dilation), groups)
    return y.squeeze(0) if unbatched else y


def linear_distillation_loss(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                             teacher_weight: Tensor, labels: Tensor | None = None, *,
                             student_bias: Tensor | None = None, teacher_bias: Tensor | None = None,
                             beta: float = 0.5, temperature: float = 1.0, weight_soft_loss: float = 1.0,
                             weight_hard_loss: float = 0.0, ignore_index: int = -100,
                             logit_scale: float = 1.0, softcap: float | None = None,
                             num_items_in_batch: int | Tensor | None = None) -> Tensor:
    """Knowledge distillation from a teacher's LM head to a student's, without either model's N x V
    logits held whole (ops/linear_distillation.py: chunks of tokens, gradients in the forward).

        z = softcap(logit_scale * (hidden W^T + b)) / temperature          each model's logits
        soft = TRL's generalized_jsd_loss(z_student, z_teacher, labels, beta)   beta 0: KL(teacher || student),
               1: KL(student || teacher), else the JSD of the mixture (1 - beta) student + beta teacher; no T^2
        hard = cross-entropy of the student at temperature 1 against labels
        loss = weight_soft_loss * soft + weight_hard_loss * hard

    Both are means over the tokens whose label is not ``ignore_index`` (every token when labels is
    None), divided by max(1, their count): an all-ignored batch gives 0 and zero gradients (TRL's
    "batchmean"). ``num_items_in_batch`` (an int or a one-element tensor, read on the device) replaces
    that count (TRL's and Hugging Face's loss under gradient accumulation). Labels are aligned with
    the hidden states (the caller shifts).

    student_hidden (..., Hs), teacher_hidden (..., Ht) with the same leading axes; student_weight
    (V, Hs), teacher_weight (V, Ht), biases (V,); labels (...) int64 / int32 or None (then
    weight_hard_loss must be 0). Each model's matmuls run in its hidden's dtype (autocast's under
    autocast); math and the loss in float32 (float64 for a float64 student); dW accumulates in a
    half head's own dtype (ChunkedLinearHeuristics.weight_grad_accumulator). The teacher takes no gradient. Only the student gradients that are needed are computed
    (none under no_grad); they are computed in the forward and scaled by the upstream gradient in the
    backward (a second backward through the same loss raises, except in float64 and under
    torch.compile). Deterministic (fixed chunk order, no atomics), no host syncs. Errors name the
    argument (InvalidProblemError, UnsupportedError).
    """
    return linear_distillation_ops.linear_distillation_loss(
        student_hidden, student_weight, teacher_hidden, teacher_weight, labels, student_bias=student_bias,
        teacher_bias=teacher_bias, beta=beta, temperature=temperature, weight_soft_loss=weight_soft_loss,
        weight_hard_loss=weight_hard_loss, ignore_index=ignore_index, logit_scale=logit_scale, softcap=softcap,
        num_items_in_batch=num_items_in_batch)


def linear_preference_loss(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                           kind: str = "dpo", beta: float = 0.1, ref_hidden: Tensor | None = None,
                           ref_weight: Tensor | None = None, ref_bias: Tensor | None = None,
                           ref_chosen_logps: Tensor | None = None, ref_rejected_logps: Tensor | None = None,
                           gamma: float = 0.5, label_smoothing: float = 0.0, nll_weight: float | None = None,
                           ignore_index: int = -100, logit_scale: float = 1.0, softcap: float | None = None,
                           temperature: float = 1.0):
    """A paired preference loss (``kind``: "dpo", "ipo", "simpo", "cpo", "orpo") from the policy's
    last hidden states and LM head, without the logits held whole (ops/linear_preference.py).

    hidden (B, T, H), labels (B, T): the B / 2 chosen rows, then the B / 2 rejected rows (TRL's
    layout), labels aligned with the hidden states, ``ignore_index`` tokens left out; weight (V, H),
    bias (V,); z = softcap(logit_scale * (hidden W^T + b)) / temperature. Sequence log-probabilities
    are summed over the kept tokens (dpo, cpo) or averaged (ipo, simpo, orpo), as TRL's trainers.
    The reference (dpo, ipo; none for the others) is ref_hidden (B, T, H') with ref_weight (V, H')
    and ref_bias, run without gradient, or ref_chosen_logps and ref_rejected_logps (B / 2,) in this
    kind's normalisation (summed or averaged). Losses, averaged over the pairs, with
    delta = (c - c_ref) - (r - r_ref) and sigma_ls(x) = -(1 - ls) log sigmoid(x) - ls log sigmoid(-x):
    dpo sigma_ls(beta delta); ipo (delta - 1 / (2 beta))^2; simpo sigma_ls(beta (c - r) - gamma);
    cpo sigma_ls(beta (c - r)); orpo -beta log sigmoid(log odds ratio); plus ``nll_weight`` (default 1
    for cpo and orpo, else 0) times the chosen rows' token-mean NLL. label_smoothing (ls) in [0, 0.5]
    for dpo, simpo and cpo.

    Returns a PreferenceOutput (a NamedTuple): loss; chosen_logps, rejected_logps (B / 2,);
    chosen_rewards, rejected_rewards (beta (logps - ref logps), or beta logps without a reference);
    chosen_logits_mean, rejected_logits_mean (mean of z over the vocabulary and the kept tokens);
    all but the loss without gradient. Float32 (float64 for float64 hidden). With gradients the
    policy costs three matmuls when a pair's 2T tokens fit a chunk (whole pairs a chunk, gradients
    in the forward; a second backward through the loss then raises, except in float64 and under
    torch.compile), four otherwise (the backward recomputes the chunks' logits); one without; the
    reference one. Deterministic, no host syncs. Errors name the argument (InvalidProblemError,
    UnsupportedError; IndexOutOfRangeError for a kept label out of range on the CPU).
    """
    return linear_preference_ops.linear_preference_loss(
        hidden, weight, labels, bias=bias, kind=kind, beta=beta, ref_hidden=ref_hidden, ref_weight=ref_weight,
        ref_bias=ref_bias, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps, gamma=gamma,
        label_smoothing=label_smoothing, nll_weight=nll_weight, ignore_index=ignore_index, logit_scale=logit_scale,
        softcap=softcap, temperature=temperature)
