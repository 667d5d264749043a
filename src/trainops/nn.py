"""Modules, drop-in for torch.nn's."""

from __future__ import annotations

import inspect
import warnings

import torch
from torch import Tensor

from . import functional as F
from .errors import InvalidProblemError, UnsupportedError, argument_error


def _legacy_softmax_dim(name: str, ndim: int) -> int:
    # torch.nn's rule for dim=None, with torch's warning
    warnings.warn(f"Implicit dimension choice for {name} has been deprecated. "
                  "Change the call to include dim=X as an argument.", stacklevel=3)
    return 0 if ndim in (0, 1, 3) else 1


class Softmax(torch.nn.Module):
    """``trainops.functional.softmax`` along ``dim``; drop-in for ``torch.nn.Softmax``."""

    __constants__ = ["dim"]

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: Tensor) -> Tensor:
        dim = self.dim if self.dim is not None else _legacy_softmax_dim("softmax", input.dim())
        return F.softmax(input, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(torch.nn.Module):
    """``trainops.functional.log_softmax`` along ``dim``; drop-in for ``torch.nn.LogSoftmax``."""

    __constants__ = ["dim"]

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: Tensor) -> Tensor:
        dim = self.dim if self.dim is not None else _legacy_softmax_dim("log_softmax", input.dim())
        return F.log_softmax(input, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Embedding(torch.nn.Embedding):
    """``torch.nn.Embedding`` whose lookup and weight gradient run ``trainops.functional.embedding``.

    Same constructor, parameters, state dict and ``from_pretrained``; the weight gradient comes
    from the deterministic sorted-index kernel. ``max_norm`` and ``sparse=True`` raise
    UnsupportedError. ``check_index`` (attribute, default True: True, False or "immediate") as in
    ``trainops.gather``.
    """

    check_index: bool = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.max_norm is not None:
            raise argument_error(UnsupportedError, "nn.Embedding", "max_norm", "is not supported")
        if self.sparse:
            raise argument_error(UnsupportedError, "nn.Embedding", "sparse", "is not supported (sparse gradients)")

    def forward(self, input: Tensor) -> Tensor:
        return F.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse, check_index=self.check_index)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` computed by ``trainops.functional.cross_entropy`` (fused gradient).

    Same constructor, buffers and results; extra keyword-only ``z_loss`` and ``loss_dtype``.
    ``check_target`` (attribute, default True: True, False or "immediate") as in
    ``trainops.cross_entropy``.
    """

    check_target: bool | str = True

    def __init__(self, *args, z_loss: float = 0.0, loss_dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.z_loss, self.loss_dtype = z_loss, loss_dtype

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(input, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
                               label_smoothing=self.label_smoothing, z_loss=self.z_loss, loss_dtype=self.loss_dtype,
                               check_target=self.check_target)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by ``trainops.functional.rms_norm`` (same constructor,
    parameters and state dict). ``forward(x, residual=None)``: with a residual, returns
    ``(y, x + residual)`` (the pre-norm block's fused add). ``weight_offset`` (keyword, default
    0.0): multiply by (weight + weight_offset), Gemma's 1.0; the weight then starts at
    1 - weight_offset (zeros for Gemma), so that a new module scales by 1 as torch's does."""

    def __init__(self, *args, weight_offset: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if weight_offset and self.weight is None:
            raise argument_error(InvalidProblemError, "nn.RMSNorm", "weight_offset",
                                 f"is {weight_offset}, but elementwise_affine=False gives no weight to offset")
        self.weight_offset = weight_offset
        if weight_offset:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        offset = getattr(self, "weight_offset", 0.0)  # torch's __init__ calls this before it is set
        if self.weight is not None and offset:
            with torch.no_grad():
                self.weight.fill_(1.0 - offset)

    def forward(self, x: Tensor, residual: Tensor | None = None):  # torch.nn.RMSNorm names it x
        k = len(self.normalized_shape)
        if isinstance(x, Tensor) and tuple(x.shape[max(0, x.dim() - k):]) != tuple(self.normalized_shape):
            raise argument_error(InvalidProblemError, "rms_norm", "x",
                                 f"has shape {tuple(x.shape)}; its last {k} axes must be the module's "
                                 f"normalized_shape {tuple(self.normalized_shape)}")
        if self.weight is None:
            x_rows = x.flatten(x.dim() - len(self.normalized_shape)) if len(self.normalized_shape) > 1 else x
            r_rows = residual
            if residual is not None and len(self.normalized_shape) > 1:
                r_rows = residual.flatten(residual.dim() - len(self.normalized_shape))
            out = F.rms_norm(x_rows, None, self.eps, residual=r_rows, weight_offset=self.weight_offset)
            if len(self.normalized_shape) > 1:
                out = out.view(x.shape) if residual is None else (out[0].view(x.shape), out[1].view(x.shape))
            return out
        return F.rms_norm(x, self.weight, self.eps, residual=residual, weight_offset=self.weight_offset)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by ``trainops.functional.layer_norm`` (same constructor,
    parameters and state dict). ``forward(x, residual=None)``: with a residual, returns
    ``(y, x + residual)``."""

    def forward(self, input: Tensor, residual: Tensor | None = None):
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, residual=residual)


class GELU(torch.nn.GELU):
    """``torch.nn.GELU`` computed by ``trainops.functional.gelu`` (same constructor, repr and state)."""

    def forward(self, input: Tensor) -> Tensor:
        return F.gelu(input, approximate=self.approximate)


class SiLU(torch.nn.SiLU):
    """``torch.nn.SiLU`` computed by ``trainops.functional.silu`` (same constructor, repr and state;
    ``inplace=True`` as ``trainops.functional.silu``'s)."""

    def forward(self, input: Tensor) -> Tensor:
        return F.silu(input, self.inplace)


class Dropout(torch.nn.Dropout):
    """``torch.nn.Dropout`` computed by ``trainops.functional.dropout`` (same constructor, repr and
    state; identity in eval mode, returning the input itself). Keyword ``mask_mode``: "regenerate"
    (default: the backward regenerates the mask from the seed) or "bits" (a 1-bit-per-element mask is
    stored). ``inplace=True`` as ``trainops.functional.dropout``'s."""

    def __init__(self, p: float = 0.5, inplace: bool = False, *, mask_mode: str = "regenerate") -> None:
        from .ops.dropout import MASK_MODES
        if mask_mode not in MASK_MODES:
            raise argument_error(InvalidProblemError, "nn.Dropout", "mask_mode",
                                 f"is {mask_mode!r}; expected one of {MASK_MODES}")
        super().__init__(p, inplace)
        self.mask_mode = mask_mode

    def forward(self, input: Tensor) -> Tensor:
        return F.dropout(input, self.p, self.training, self.inplace, mask_mode=self.mask_mode)


class Conv2d(torch.nn.Conv2d):
    """``torch.nn.Conv2d`` on ``trainops.functional.conv2d`` (the convolution registry): same
    constructor, parameters and state dict; every ``padding_mode`` ("zeros", or the input padded by
    ``F.pad`` first, as torch's own module does). Unlike torch's, no double backward
    (``create_graph=True`` through it raises UnsupportedError: gradient penalties need torch's)."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.padding_mode != "zeros":
            padded = torch.nn.functional.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return F.conv2d(padded, weight, bias, self.stride, 0, self.dilation, self.groups)
        return F.conv2d(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)


class _BatchNormForward:
    """The forward of trainops's BatchNorm modules: torch's ``_BatchNorm.forward`` (momentum None is
    the cumulative average, ``num_batches_tracked`` counted in training, eval on the running
    statistics when tracked) with ``trainops.functional.batch_norm``."""

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        return self._normalize(input, self.running_mean if tracked else None, self.running_var if tracked else None,
                               use_batch, factor)

    def _normalize(self, input: Tensor, running_mean, running_var, use_batch: bool, factor: float) -> Tensor:
        return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, use_batch, factor, self.eps)


class _BatchNormReLUForward(_BatchNormForward):
    def _normalize(self, input: Tensor, running_mean, running_var, use_batch: bool, factor: float) -> Tensor:
        return F.batch_norm_relu(input, running_mean, running_var, self.weight, self.bias, use_batch, factor,
                                 self.eps)


class BatchNorm1d(_BatchNormForward, torch.nn.BatchNorm1d):
    """``torch.nn.BatchNorm1d`` on ``trainops.functional.batch_norm``: same constructor, parameters,
    buffers and state dict; (N, C) or (N, C, L) input."""


class BatchNorm2d(_BatchNormForward, torch.nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` on ``trainops.functional.batch_norm`` (channels-last inputs stay
    channels-last); same constructor, parameters, buffers and state dict."""


class BatchNorm3d(_BatchNormForward, torch.nn.BatchNorm3d):
    """``torch.nn.BatchNorm3d`` on ``trainops.functional.batch_norm``; same constructor, parameters,
    buffers and state dict."""


class BatchNormReLU2d(_BatchNormReLUForward, BatchNorm2d):
    """``torch.nn.Sequential(torch.nn.BatchNorm2d(...), torch.nn.ReLU())`` as one module on
    ``trainops.functional.batch_norm_relu`` (one pass writes the ReLU's output; its backward adds no
    launch and saves nothing more than batch norm's input): BatchNorm2d's constructor, parameters,
    buffers and state dict keys. ``trainops.patch(model, block_ops=True)`` turns a BatchNorm2d
    followed by a ReLU in a Sequential into one."""


class FusedReLU(torch.nn.Module):
    """What ``trainops.patch`` makes of a torch.nn.ReLU whose work the BatchNormReLU2d before it in
    the same Sequential does: returns its input. ``trainops.unpatch`` makes it a ReLU again."""

    def forward(self, input: Tensor) -> Tensor:
        return input

    def extra_repr(self) -> str:
        return "fused into the batch norm before it"


_HAS_BIAS_KEYWORD = "bias" in inspect.signature(torch.nn.SyncBatchNorm.__init__).parameters


class SyncBatchNorm(_BatchNormForward, torch.nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` on ``trainops.functional.sync_batch_norm``: same constructor
    (num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype, bias),
    parameters, buffers and state dict, and ``convert_sync_batchnorm``.

    In training (torch.distributed initialized, ``process_group`` or the default group of 2 or
    more ranks) the statistics are the group's whole batch: one all_gather of 3C + 1 float64
    values a forward, one all_reduce of 2C float32 (float64 for float64 input) values a backward
    (see ``trainops.sync_batch_norm``); each rank's weight and bias gradients are its own
    elements' sums, as torch's (DistributedDataParallel averages them). In eval, on one rank or
    without torch.distributed: ``trainops.batch_norm``, as torch's. Unlike torch's, CPU tensors
    (gloo) are taken too, though DistributedDataParallel refuses a SyncBatchNorm module on the CPU
    (torch's check, which sees this subclass). Every rank must call it alike (training, input
    requiring grad or not), as torch's, or the others wait in its collective; under torch.compile
    a training call over 2 or more ranks is a graph break (``fullgraph=True`` raises).
    Input (N, C, ...) of rank 2 to 8, any strides (channels-last kept),
    float32 / float16 / bfloat16 / float64. Errors: InvalidProblemError (a ValueError, as torch's)
    for an input of rank below 2 or without channels, then those of ``trainops.sync_batch_norm``,
    each before the running statistics are written (``num_batches_tracked`` is counted first,
    as torch's). ``trainops.patch(model, batch_norm=True)`` swaps torch's SyncBatchNorm for it.
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if not isinstance(input, Tensor) or input.dim() < 2 or input.shape[1] == 0:
            shape = tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__
            raise argument_error(InvalidProblemError, "nn.SyncBatchNorm", "input",
                                 f"is {shape}; expected a tensor (N, C, ...) with C > 0 channels")

    def _normalize(self, input: Tensor, running_mean, running_var, use_batch: bool, factor: float) -> Tensor:
        if not self.training:   # torch's synchronises in training only
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, use_batch, factor, self.eps)
        return F.sync_batch_norm(input, running_mean, running_var, self.weight, self.bias, True, factor, self.eps,
                                 process_group=self.process_group)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group=None) -> torch.nn.Module:
        """torch's ``convert_sync_batchnorm`` making trainops's SyncBatchNorm: every BatchNorm*d
        (torch's or trainops's; a SyncBatchNorm too) in ``module`` becomes one, sharing the
        original's parameters and buffers, with its training flag (and qconfig); a BatchNorm
        ``module`` itself gives a new module, any other is changed in place and returned."""
        output = module
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            # torch's bias= keyword (affine without a bias) is newer than torch 2.11
            keywords = {"bias": module.bias is not None} if _HAS_BIAS_KEYWORD else {}
            output = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                         process_group, **keywords)
            if module.affine:
                with torch.no_grad():
                    output.weight = module.weight
                    output.bias = module.bias
            output.running_mean = module.running_mean
            output.running_var = module.running_var
            output.num_batches_tracked = module.num_batches_tracked
            output.training = module.training
            if hasattr(module, "qconfig"):
                output.qconfig = module.qconfig
        for name, child in module.named_children():
            output.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return output


class LinearCrossEntropyLoss(torch.nn.Module):
    """``trainops.functional.linear_cross_entropy`` as a loss module (no parameters of its own: the
    LM head's weight is an argument, so FSDP or ZeRO-3 can gather it).

        loss_fn = trainops.nn.LinearCrossEntropyLoss(ignore_index=-100)
        loss = loss_fn(hidden, model.lm_head.weight, labels)

    Constructor: class_weight (a buffer, as CrossEntropyLoss's weight), ignore_index, reduction,
    label_smoothing, z_loss, softcap, logit_scale, temperature, loss_dtype. forward(hidden, weight,
    target, bias=None, *,
    num_items_in_batch=None). ``check_target`` (attribute, default True: True, False or
    "immediate") as in ``trainops.linear_cross_entropy``."""

    check_target: bool | str = True

    def __init__(self, class_weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, z_loss: float = 0.0, softcap: float | None = None,
                 logit_scale: float = 1.0, temperature: float = 1.0, loss_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        from .ops.linear_cross_entropy import check_settings
        check_settings(class_weight, ignore_index, reduction, label_smoothing, z_loss, softcap, loss_dtype,
                       logit_scale, temperature)
        self.register_buffer("class_weight", class_weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap, self.loss_dtype = z_loss, softcap, loss_dtype
        self.logit_scale, self.temperature = logit_scale, temperature

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
                num_items_in_batch: int | Tensor | None = None) -> Tensor:
        return F.linear_cross_entropy(hidden, weight, target, bias, class_weight=self.class_weight,
                                      ignore_index=self.ignore_index, reduction=self.reduction,
                                      label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                                      logit_scale=self.logit_scale, temperature=self.temperature,
                                      num_items_in_batch=num_items_in_batch, loss_dtype=self.loss_dtype,
                                      check_target=self.check_target)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}, "
                f"logit_scale={self.logit_scale}, temperature={self.temperature}")


class LinearDistillationLoss(torch.nn.Module):
    """``trainops.functional.linear_distillation_loss`` as a loss module (no parameters: both heads'
    weights are arguments, so FSDP or ZeRO-3 can gather them).

        loss_fn = trainops.nn.LinearDistillationLoss(beta=0.5, temperature=2.0)
        loss = loss_fn(student_hidden, student.lm_head.weight, teacher_hidden, teacher.lm_head.weight, labels)

    Constructor: beta, temperature, weight_soft_loss, weight_hard_loss, ignore_index, logit_scale,
    softcap. forward(student_hidden, student_weight, teacher_hidden, teacher_weight, labels=None, *,
    student_bias=None, teacher_bias=None)."""

    def __init__(self, beta: float = 0.5, temperature: float = 1.0, weight_soft_loss: float = 1.0,
                 weight_hard_loss: float = 0.0, ignore_index: int = -100, *, logit_scale: float = 1.0,
                 softcap: float | None = None) -> None:
        super().__init__()
        from .ops.linear_distillation import check_settings
        check_settings(beta, temperature, weight_soft_loss, weight_hard_loss, ignore_index, logit_scale, softcap)
        self.beta, self.temperature, self.ignore_index = beta, temperature, ignore_index
        self.weight_soft_loss, self.weight_hard_loss = weight_soft_loss, weight_hard_loss
        self.logit_scale, self.softcap = logit_scale, softcap

    def forward(self, student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
                labels: Tensor | None = None, *, student_bias: Tensor | None = None,
                teacher_bias: Tensor | None = None) -> Tensor:
        return F.linear_distillation_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
                                          student_bias=student_bias, teacher_bias=teacher_bias, beta=self.beta,
                                          temperature=self.temperature, weight_soft_loss=self.weight_soft_loss,
                                          weight_hard_loss=self.weight_hard_loss, ignore_index=self.ignore_index,
                                          logit_scale=self.logit_scale, softcap=self.softcap)

    def extra_repr(self) -> str:
        return (f"beta={self.beta}, temperature={self.temperature}, weight_soft_loss={self.weight_soft_loss}, "
                f"weight_hard_loss={self.weight_hard_loss}, ignore_index={self.ignore_index}")


class LinearPreferenceLoss(torch.nn.Module):
    """``trainops.functional.linear_preference_loss`` as a loss module (no parameters).

        loss_fn = trainops.nn.LinearPreferenceLoss("dpo", beta=0.1)
        out = loss_fn(hidden, model.lm_head.weight, labels, ref_hidden=ref_hidden, ref_weight=ref.lm_head.weight)
        out.loss.backward()

    Constructor: kind, beta, gamma, label_smoothing, nll_weight, ignore_index, logit_scale, softcap,
    temperature. forward(hidden, weight, labels, *, bias=None, ref_hidden=None, ref_weight=None,
    ref_bias=None, ref_chosen_logps=None, ref_rejected_logps=None) -> PreferenceOutput."""

    def __init__(self, kind: str = "dpo", beta: float = 0.1, *, gamma: float = 0.5, label_smoothing: float = 0.0,
                 nll_weight: float | None = None, ignore_index: int = -100, logit_scale: float = 1.0,
                 softcap: float | None = None, temperature: float = 1.0) -> None:
        super().__init__()
        from .ops.linear_preference import check_settings
        check_settings(kind, beta, gamma, label_smoothing, nll_weight, ignore_index, logit_scale, softcap, temperature)
        self.kind, self.beta, self.gamma, self.label_smoothing = kind, beta, gamma, label_smoothing
        self.nll_weight, self.ignore_index = nll_weight, ignore_index
        self.logit_scale, self.softcap, self.temperature = logit_scale, softcap, temperature

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                ref_hidden: Tensor | None = None, ref_weight: Tensor | None = None, ref_bias: Tensor | None = None,
                ref_chosen_logps: Tensor | None = None, ref_rejected_logps: Tensor | None = None):
        return F.linear_preference_loss(hidden, weight, labels, bias=bias, kind=self.kind, beta=self.beta,
                                        ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias,
                                        ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
                                        gamma=self.gamma, label_smoothing=self.label_smoothing,
                                        nll_weight=self.nll_weight, ignore_index=self.ignore_index,
                                        logit_scale=self.logit_scale, softcap=self.softcap,
                                        temperature=self.temperature)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, beta={self.beta}, gamma={self.gamma}, label_smoothing={self.label_smoothing}"
