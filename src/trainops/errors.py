"""Errors raised by trainops.

Every message names the op and the argument at fault, e.g.
``trainops.softmax: argument 'dim' is 3, out of range for a tensor of rank 2``.
"""


class TrainopsError(Exception):
    """Base class of every error trainops raises on purpose."""


class UnsupportedError(TrainopsError, NotImplementedError):
    """The problem is valid, but no registered kernel implements it (dtype, rank, device, backend)."""


class InvalidProblemError(TrainopsError, ValueError):
    """The problem itself is wrong: axis out of range, mismatched shapes, buffer too small, wrong device."""


class IndexOutOfRangeError(TrainopsError, IndexError):
    """An index value names a position outside the axis it indexes (checked before anything is written)."""


def argument_error(cls: type[TrainopsError], op: str, argument: str, message: str) -> TrainopsError:
    """Build ``cls`` with the uniform message ``trainops.<op>: argument '<argument>' <message>``."""
    return cls(f"trainops.{op}: argument '{argument}' {message}")
