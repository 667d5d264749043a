"""Test set-up: without a GPU, Triton kernels run under Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton (and trainops) are imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import trainops  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# Where each backend's kernels run in this process.
BACKEND_DEVICES = {"triton": "cuda" if HAS_CUDA else "cpu", "cpu": "cpu"}


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine: pytest -m gpu)"))


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if ``python -m trainops train`` reads the training data or starts a run."""
    from trainops.train import fsdp, gpt

    def work(*args, **kwargs):
        raise AssertionError("the command started work before refusing its arguments")
    monkeypatch.setattr(gpt, "stdlib_bytes", work)
    monkeypatch.setattr(gpt, "run", work)
    monkeypatch.setattr(fsdp, "stdlib_bytes", work)
    return work


@pytest.fixture(params=["triton", "cpu"])
def backend(request):
    """Run the test under each backend pinned, on the device that backend runs on here."""
    with trainops.backend(request.param):
        yield request.param


@pytest.fixture
def device(backend):
    return BACKEND_DEVICES[backend]
