"""trainops: training kernels for PyTorch (Triton on the GPU, a CPU path, one kernel registry).

    import trainops
    y = trainops.softmax(x, dim=-1)                 # autograd, torch.compile, any strides
    e = trainops.embedding(tokens, weight)          # deterministic, fast weight gradient
    y, h = trainops.rms_norm(x, w, residual=h)      # pre-norm block: add, then normalize (also layer_norm)
    loss = trainops.cross_entropy(logits, labels)   # loss and gradient in one pass
    loss = trainops.linear_cross_entropy(h, head.weight, labels)   # LM head + loss, no whole logits
    p = trainops.plan("softmax", shape=x.shape, dim=-1, dtype=x.dtype, device=x.device)
    opt = trainops.optim.AdamW(model.parameters())  # multi-tensor fused step (SGD, Adam, AdamW, LAMB)
    scaler = trainops.amp.GradScaler("cuda")        # torch's GradScaler on trainops kernels
    handle = trainops.gist.compress(model, stash="e4m3")   # ReLUs keep 1 bit; stashed activations 1 byte
    with trainops.backend("cpu"): ...               # pin a backend
"""

from . import ops  # noqa: F401  (registers every kernel)
from . import errors, functional, library, nn, registry
from . import amp, distributed, gist, grad, optim
from .errors import IndexOutOfRangeError, InvalidProblemError, TrainopsError, UnsupportedError
from .functional import (cross_entropy, embedding, gather, gather_backward, layer_norm, log_softmax, log_softmax_backward,
                         rms_norm, rotary_embedding, softmax, softmax_backward)
from .functional import bias_gelu, geglu, gelu, quick_gelu, silu, swiglu
from .functional import bias_dropout_add, dropout
from .functional import attention_softmax
from .functional import linear_cross_entropy
from .functional import linear_distillation_loss, linear_preference_loss
from .functional import batch_norm, sync_batch_norm
from .functional import batch_norm_relu
from .functional import conv2d, sum_to_shape
from .functional import qk_norm_rotary
from .ops._common import check_pending
from .graphs import CapturedStep, capture_step
from .patch import PatchReport, patch
from .patch import unpatch
from .plan import KernelChoice, Plan, Precision, heuristics, plan, track_kernels
from .registry import backend, kernels, lookup

__version__ = "0.2.0.dev0"

__all__ = [
    "IndexOutOfRangeError", "InvalidProblemError", "amp", "distributed", "gist", "grad", "optim", "KernelChoice", "Plan", "Precision", "TrainopsError",
    "UnsupportedError", "PatchReport", "patch", "track_kernels", "backend", "heuristics", "cross_entropy", "embedding", "errors", "functional", "gather", "gather_backward", "kernels",
    "layer_norm", "library", "log_softmax", "rms_norm", "rotary_embedding", "log_softmax_backward", "lookup", "nn", "plan", "registry", "softmax",
    "softmax_backward", "bias_gelu", "geglu", "gelu", "quick_gelu", "silu", "swiglu",
    "bias_dropout_add", "dropout",
    "attention_softmax", "linear_cross_entropy", "check_pending", "batch_norm",
    "sync_batch_norm", "sum_to_shape", "conv2d",
    "unpatch",
    "qk_norm_rotary",
    "linear_distillation_loss", "linear_preference_loss",
    "CapturedStep", "capture_step",
    "batch_norm_relu",
]
