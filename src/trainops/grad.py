"""Gradient control over many tensors, one launch per (device, dtype):

    trainops.grad.accumulate_(acc_buffers, [p.grad for p in params], scale=1 / micro_batches)
    trainops.grad.zero_([p.grad for p in params])

``accumulate_`` is ORT's InPlaceAccumulator (``dst += scale * src``, float32 math, dst and src
dtypes may differ); ``zero_`` its ZeroGradient. Both deterministic.
"""

from .ops.grad import accumulate_, zero_

__all__ = ["accumulate_", "zero_"]
