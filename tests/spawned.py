"""Helpers of the tests that spawn ranks over gloo (test_distributed.py, test_fsdp.py)."""

import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(cases, out: dict, *args) -> None:
    """Run ``case(*args)`` for each case in order (``args`` holding ``out``, where the cases write
    their results), marking ``ran <name>`` in ``out``; the first that raises is recorded as
    ``error in <name>`` (its traceback) and ends the run."""
    for case in cases:
        try:
            case(*args)
        except Exception:
            out[f"error in {case.__name__}"] = traceback.format_exc()
            break
        out[f"ran {case.__name__}"] = True
