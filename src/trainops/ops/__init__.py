"""One module per op family: Triton kernels, launcher, CPU path and registrations together."""

from . import amp, cross_entropy, gather, grad, optimizers, softmax  # noqa: F401
