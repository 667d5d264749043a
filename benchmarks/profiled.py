"""What the probe scripts share (``from profiled import kernel_ms, relative_error``; a script run as
``python benchmarks/<probe>.py`` has this folder on its path)."""

from __future__ import annotations

import statistics

import torch


def kernel_ms(fn, steps: int = 20, windows: int = 1) -> float:
    """ms of one call on the GPU: the durations of the kernels and copies it launched, summed, per
    call, over ``steps`` calls under torch.profiler (launch gaps and ``record_function`` ranges left
    out); the median of ``windows`` such profiles. One call first, unprofiled (compiles, caches)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
        total_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                       and not getattr(e, "is_user_annotation", False))
        times.append(total_us / 1e3 / steps)
    return statistics.median(times)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (b's norm at least 1e-30)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
