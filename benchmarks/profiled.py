"""What the probe scripts share (``from profiled import kernel_ms, relative_error``; a script run as
``python benchmarks/<probe>.py`` has this folder on its path)."""

from __future__ import annotations

import torch

from trainops.bench import kernel_ms  # noqa: F401  (the probes import it from here)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (b's norm at least 1e-30)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
