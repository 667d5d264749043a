"""``python -m trainops env``: what a bug report needs to say about this machine.

Versions (trainops, Python, torch with its CUDA build, Triton, NumPy), the CUDA driver and
devices, whether Triton's interpreter is on, the environment variables trainops reads, and for
every registered op the backend and kernel that would run it here, per device type and dtype
(the registry's own dispatch: ``trainops.lookup``). It only reads: nothing is compiled or
launched, and it works without a GPU and without Triton.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

import torch

from . import registry
from .errors import UnsupportedError

# The range this release is tested on (pyproject.toml and the README say the same).
TESTED_TORCH = ((2, 11), (2, 15))
TESTED_TRITON = ((3, 6), (3, 9))
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _module_version(name: str) -> str | None:
    try:
        module = __import__(name)
    except ImportError:
        return None
    return getattr(module, "__version__", "unknown")


def cuda_driver_version() -> str | None:
    """The installed CUDA driver's version (``cuDriverGetVersion``), or None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _placements() -> list[tuple[str, str | None, str]]:
    """(device type, pinned backend or None, label) for every way ops can run in this process: the
    CPU, CUDA when a device is visible, and Triton pinned on CPU tensors under the interpreter."""
    placements = [("cpu", None, "cpu")]
    if torch.cuda.is_available():
        placements.append(("cuda", None, "cuda"))
    if registry.triton_interpreting() and registry.triton_available():
        placements.append(("cpu", "triton", "cpu, triton pinned"))
    return placements


def kernel_table() -> list[dict]:
    """One row per (op, placement, kernel): the backend and kernel ``lookup`` picks for each float
    dtype, and a row of the dtypes for which it raises UnsupportedError."""
    rows = []
    for op in registry.ops():
        for device_type, backend, label in _placements():
            picked: dict[tuple[str, str], list[str]] = {}
            missing = []
            for dtype in _DTYPES:
                try:
                    info = registry.lookup(op, device_type, dtype, backend=backend)
                except UnsupportedError:
                    missing.append(registry.dtype_name(dtype))
                    continue
                picked.setdefault((info.backend, info.name), []).append(registry.dtype_name(dtype))
            for (kernel_backend, name), dtypes in picked.items():
                rows.append({"op": op, "device": label, "backend": kernel_backend, "kernel": name,
                             "dtypes": ",".join(dtypes)})
            if missing:
                rows.append({"op": op, "device": label, "backend": "-", "kernel": "none (UnsupportedError)",
                             "dtypes": ",".join(missing)})
    return rows


def warnings_for(torch_version: str, triton_version: str | None, numpy_version: str | None,
                 interpreting: bool) -> list[str]:
    """Known problems of this combination of versions, one line each."""
    found = []
    torch_v = _version_tuple(torch_version)
    if not TESTED_TORCH[0] <= torch_v <= TESTED_TORCH[1]:
        found.append(f"torch {torch_version} is outside the tested range "
                     f"{'.'.join(map(str, TESTED_TORCH[0]))} to {'.'.join(map(str, TESTED_TORCH[1]))}")
    if triton_version is not None:
        triton_v = _version_tuple(triton_version)
        if not TESTED_TRITON[0] <= triton_v <= TESTED_TRITON[1]:
            found.append(f"triton {triton_version} is outside the tested range "
                         f"{'.'.join(map(str, TESTED_TRITON[0]))} to {'.'.join(map(str, TESTED_TRITON[1]))}")
        if interpreting and triton_v <= (3, 6) and numpy_version and _version_tuple(numpy_version) >= (2, 4):
            found.append(f"Triton {triton_version}'s interpreter fails on numpy {numpy_version} (its loop bounds "
                         "are 1-element arrays, which numpy 2.4 no longer turns into ints): pip install 'numpy<2.4'")
    elif sys.platform.startswith("linux"):
        found.append("triton is not installed: only the CPU backend runs")
    return found


def collect() -> dict:
    """Everything ``python -m trainops env`` prints, as a dict."""
    from . import __version__

    triton_version = _module_version("triton")
    numpy_version = _module_version("numpy")
    interpreting = registry.triton_interpreting()
    devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(f"cuda:{index} {props.name}, sm_{props.major}{props.minor}, "
                           f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB")
    return {
        "trainops": __version__,
        "python": f"{platform.python_version()} ({platform.platform()})",
        "torch": torch.__version__,
        "torch CUDA build": torch.version.cuda or "none (CPU build)",
        "triton": triton_version or "not installed",
        "numpy": numpy_version or "not installed",
        "CUDA driver": cuda_driver_version() or "none",
        "CUDA devices": devices or ["none"],
        "Triton interpreter": "on (TRITON_INTERPRET=1: Triton kernels run on CPU tensors)" if interpreting else "off",
        "TRAINOPS_ROW_EXCHANGE": os.environ.get("TRAINOPS_ROW_EXCHANGE", "unset (row exchange on)"),
        "warnings": warnings_for(torch.__version__, triton_version, numpy_version, interpreting)
                    + [f"the {name} backend: {note}" for name, note in registry.backend_notes().items()],
        "kernels": kernel_table(),
    }


def format_report(info: dict) -> str:
    """The report as text: ``key: value`` lines, then the kernel table."""
    lines = []
    for key, value in info.items():
        if key == "kernels":
            continue
        if isinstance(value, list):
            lines.append(f"{key}:" + ("" if value else " none"))
            lines.extend(f"  {item}" for item in value)
        else:
            lines.append(f"{key}: {value}")
    rows = info["kernels"]
    cols = ["op", "device", "backend", "kernel", "dtypes"]
    widths = [max(len(c), *(len(r[c]) for r in rows)) for c in cols]
    lines.append("")
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(r[c].ljust(w) for c, w in zip(cols, widths)).rstrip() for r in rows)
    return "\n".join(lines)
