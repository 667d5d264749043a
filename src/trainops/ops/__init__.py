"""One module per op family: Triton kernels, launcher, CPU path and registrations together."""

from . import cross_entropy, gather, softmax  # noqa: F401
