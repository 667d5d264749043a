"""Helpers of the tests that spawn ranks (test_distributed.py, test_fsdp.py, test_fsdp_nccl.py,
test_sync_batch_norm.py)."""

import contextlib
import os
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


def rank_outputs(runs: dict, world: int, case) -> list:
    """Every rank's results of the ``world``-rank run (``runs[world][rank]``: what ``run_cases``
    wrote), after checking that ``case`` ran through on each rank (else its traceback fails)."""
    for rank in range(world):
        errors = [value for key, value in runs[world][rank].items() if key.startswith("error in")]
        assert f"ran {case.__name__}" in runs[world][rank], errors or "not run"
    return [runs[world][rank] for rank in range(world)]


@contextlib.contextmanager
def triton_interpreter():
    """TRITON_INTERPRET=1 for the ranks spawned inside (they run on the CPU: the Triton kernels under
    the interpreter, on a GPU machine too), the variable restored after."""
    interpret = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if interpret is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = interpret
