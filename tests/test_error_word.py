"""The error word of deferred checks (ops/_common.py): check kernels store a message's code into one
int32 of host memory, and a later call raises it once without waiting for the GPU.

On the CPU the kernels run under Triton's interpreter and write the word in plain memory; on the GPU
(``-m gpu``) the word is pinned host memory that the kernels store into directly, from any device.
"""

import pytest
import torch

import trainops
from trainops.ops import _common, gather as gather_ops
from trainops.registry import triton_interpreting

from conftest import HAS_CUDA

needs_triton = pytest.mark.skipif(not HAS_CUDA and not triton_interpreting(), reason="needs Triton")
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def clear_word():
    """Each test starts and ends with nothing reported (an error left over would leak into others):
    every device synchronised first, so that a check still in flight cannot land mid-test."""
    def clear():
        for d in range(torch.cuda.device_count() if HAS_CUDA else 0):
            torch.cuda.synchronize(d)
        if _common._WORD:
            _common._WORD[1][0] = 0
    clear()
    yield
    clear()


def test_message_codes_are_stable_and_never_0_1_or_a_multiple_of_16():
    codes = [_common.message_code(f"test message {k}") for k in range(40)]
    assert len(set(codes)) == 40
    assert all(c > 1 and c % 16 for c in codes)
    assert [_common.message_code(f"test message {k}") for k in range(40)] == codes
    assert all(_common._MESSAGES[c] == f"test message {k}" for k, c in enumerate(codes))


def test_messages_past_the_limit_share_the_overflow_code(monkeypatch):
    # private copies: the codes this test makes must not outlive it (a rerun in the same process
    # would find "... 1" cached and give "... 2" its own code)
    monkeypatch.setattr(_common, "_CODES", dict(_common._CODES))
    monkeypatch.setattr(_common, "_MESSAGES", list(_common._MESSAGES))
    monkeypatch.setattr(_common, "_MESSAGES_LIMIT", len(_common._CODES) + 1)
    first = _common.message_code("a message past the limit, 1")
    second = _common.message_code("a message past the limit, 2")
    third = _common.message_code("a message past the limit, 3")
    assert second == third != first
    assert _common._MESSAGES[second] == _common._OVERFLOW_MESSAGE


@needs_triton
def test_a_reported_flag_raises_once_with_its_message():
    message = "test: the flag was set"
    _common.report_flag(torch.zeros(2, dtype=torch.int32, device=DEVICE), "test: a zero flag was reported")
    if HAS_CUDA:
        torch.cuda.synchronize()   # report_flag notes no device: check_pending would not wait
    _common.raise_flagged()        # a zero flag reports nothing
    _common.report_flag(torch.tensor([3, 0], dtype=torch.int32, device=DEVICE), message)
    if HAS_CUDA:
        torch.cuda.synchronize()
    with pytest.raises(trainops.IndexOutOfRangeError, match="the flag was set"):
        _common.raise_flagged()
    _common.raise_flagged()    # reported once
    trainops.check_pending()


@needs_triton
@pytest.mark.parametrize("n, bad_at", [(1, None), (1, 0), (5000, None), (5000, 4999), (70000, 40000)])
def test_out_of_range_indices_are_reported_by_every_program(n, bad_at):
    """Up to 32 programs of 1024 indices each; whichever program finds the bad index stores the
    code, and nothing is stored when every index is in range."""
    index = torch.randint(-3, 7, (n,), device=DEVICE)
    if bad_at is not None:
        index[bad_at] = 7
    gather_ops.report_out_of_range(index, -3, 7, "test: an index out of [-3, 6]")
    if HAS_CUDA:
        torch.cuda.synchronize()   # report_out_of_range notes no device: check_pending would not wait
    if bad_at is None:
        assert int(_common.error_word()[0]) == 0
    else:
        with pytest.raises(trainops.IndexOutOfRangeError, match=r"out of \[-3, 6\]"):
            _common.raise_flagged()


@needs_triton
def test_check_pending_raises_what_the_word_holds():
    _common.report_flag(torch.ones(1, dtype=torch.int32, device=DEVICE), "test: pending at the end")
    if HAS_CUDA:
        _common.note_device(torch.device("cuda"))
    with pytest.raises(trainops.IndexOutOfRangeError, match="pending at the end"):
        trainops.check_pending()
    trainops.check_pending()


def test_an_unknown_code_is_reported_as_such():
    _common.error_word()[0] = 16
    with pytest.raises(trainops.IndexOutOfRangeError, match="unknown error code 16"):
        _common.raise_flagged()


@pytest.mark.gpu
def test_gpu_word_is_pinned_and_written_from_every_device():
    word = _common.error_word()
    assert word.is_pinned()
    for d in range(torch.cuda.device_count()):
        with torch.cuda.device(d):
            ids = torch.tensor([0, 5], device=f"cuda:{d}")
            table = torch.randn(5, 4, device=f"cuda:{d}")
            trainops.embedding(ids, table)   # the check kernel, on device d, stores into host memory
        with pytest.raises(trainops.IndexOutOfRangeError,
                           match=r"argument 'input' held an index out of range \[0, 4\]"):
            trainops.check_pending()


@pytest.mark.gpu
def test_gpu_eager_calls_with_checks_launch_no_copy_fill_or_event():
    """A deferred check costs one kernel launch at most: no pinned copy, fill or event record
    (the host time issue 39 measured)."""
    from torch.profiler import ProfilerActivity, profile

    logits = torch.randn(64, 512, device="cuda")
    target = torch.randint(0, 512, (64,), device="cuda")
    ids = torch.randint(0, 1000, (64,), device="cuda")
    table = torch.randn(1000, 64, device="cuda")
    for _ in range(3):
        trainops.embedding(ids, table)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:   # CUDA: runtime calls
        trainops.embedding(ids, table)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert not any("Memcpy" in n or "EventRecord" in n or n in ("aten::zeros", "aten::fill_", "aten::copy_")
                   for n in names), names
    with torch.no_grad():
        trainops.cross_entropy(logits, target)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.no_grad():
        trainops.cross_entropy(logits, target)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert not any("Memcpy" in n or "EventRecord" in n or n == "aten::copy_" for n in names), names
