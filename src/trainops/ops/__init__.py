"""One module per op family: heuristics, problem and descriptor, Triton kernels, launcher, CPU
path, registrations and custom ops together. Adding a family: CONTRIBUTING.md (five files)."""

from . import amp, cross_entropy, gather, grad, normalization, optimizers, softmax  # noqa: F401
from . import lowbit_optimizers  # noqa: F401
from . import activations  # noqa: F401
from . import rotary  # noqa: F401
from . import dropout  # noqa: F401
from . import attention_softmax  # noqa: F401
from . import linear_cross_entropy  # noqa: F401
from . import batch_norm  # noqa: F401
from . import gist  # noqa: F401
from . import broadcast  # noqa: F401
from . import convolution  # noqa: F401
from . import qk_norm_rotary  # noqa: F401
from . import linear_distillation, linear_preference  # noqa: F401
