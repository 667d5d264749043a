"""Where the host time of an eager call with a deferred index / target check goes on a GPU host,
and the cost of each piece of the deferred-check schemes (issue 39, item 5: "the deferred checks
made cheaper").

    python benchmarks/probe_deferred_checks.py --out checks.json

Needs CUDA. Per call of ``probe_host_time.py``'s forward-only and forward + backward cases
(softmax 64x64, cross-entropy without grad, embedding, cross-entropy and softmax forward +
backward): us a call for trainops and torch, with the checks on and off (``check_target`` /
``check_index``), each the median of 3 rounds of 1,000 synchronised-at-the-end calls; then one
cProfile (500 calls, top 25 by own time) and one torch.profiler table (20 calls) of the checked
trainops calls, printed.

Then the pieces, each timed alone over 2,000 calls: the former scheme's pinned copy of a one-element
flag plus its event record, the event query, the host read of the pinned copy (``bool(host[0])``),
a one-element ``torch.zeros`` (the flag's fill) and ``torch.empty``; the error word's: a Triton
launch whose pointer argument is pinned host memory against one whose argument is device memory,
and the host read of the word through its numpy view. It also checks that a Triton kernel stores
into pinned host memory (through ``triton.jit`` and ``trainops.launch.launcher``), that a kernel
that finds nothing stores nothing, and how long the store takes to show on the host without a
synchronisation.

The JSON (``--out``) holds the versions, each case's (trainops, torch) us, and the pieces.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import probe_host_time as P  # noqa: E402
import trainops  # noqa: E402

CASES = ("softmax 64x64", "cross_entropy, no grad", "embedding forward", "cross_entropy, forward + backward",
         "softmax 64x4096, forward + backward")


def _us(fn, calls: int = 1000) -> float:
    """us a call after 50 warm-up calls (probe_host_time's timer: wall clock, one sync at each end)."""
    for _ in range(50):
        fn()
    return P._time_us(fn, calls, torch.device("cuda"))


def _calls(device) -> dict:
    out = {}
    for check in (True, False):
        for name, _, make in P._cases(device, torch.bfloat16, check):
            if name not in CASES:
                continue
            ours, theirs, _ = make()
            rounds = sorted((_us(ours), _us(theirs)) for _ in range(3))
            out[f"{name}, checks {'on' if check else 'off'}"] = rounds[1]
            print(f"{name}, checks {'on' if check else 'off'}: trainops {rounds[1][0]:.1f} us, "
                  f"torch {rounds[1][1]:.1f} us", flush=True)
    return out


def _profiles(device) -> None:
    from torch.profiler import ProfilerActivity, profile

    for name, _, make in P._cases(device, torch.bfloat16, True):
        if name not in CASES:
            continue
        ours, _, _ = make()
        for _ in range(100):
            ours()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(500):
            ours()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(f"=== cProfile {name} (500 calls)\n{text.getvalue()[:6000]}", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                ours()
            torch.cuda.synchronize()
        print(f"=== torch.profiler {name} (20 calls)\n"
              f"{prof.key_averages().table(sort_by='cpu_time_total', row_limit=30)}", flush=True)


def _pieces(device) -> dict:
    import triton
    import triton.language as tl

    from trainops.launch import launcher

    @triton.jit
    def _store_if_negative(x_ptr, word_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0)
        bad = tl.max((x < 0).to(tl.int32), 0)
        tl.store(word_ptr, bad + 6, mask=bad > 0)

    res = {}
    word = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    bad = torch.tensor([1, 2, -3, 4], device=device)
    good = torch.tensor([1, 2, 3, 4], device=device)
    _store_if_negative[(1,)](bad, word, 4, BLOCK=4)
    torch.cuda.synchronize()
    res["jit_store"] = int(word[0])
    word.zero_()
    _store_if_negative[(1,)](good, word, 4, BLOCK=4)
    torch.cuda.synchronize()
    res["jit_no_store"] = int(word[0])
    launch = launcher(_store_if_negative, (1,), BLOCK=4)
    launch(good, word, 4)
    launch(bad, word, 4)
    torch.cuda.synchronize()
    res["launcher_store"] = int(word[0])
    view = word.numpy()
    word.zero_()
    launch(bad, word, 4)
    start, seen = time.perf_counter(), None
    while time.perf_counter() - start < 1:
        if view[0]:
            seen = time.perf_counter() - start
            break
    res["visible_after_s_without_sync"] = seen
    start = time.perf_counter()
    for _ in range(100000):
        view[0]
    res["numpy_read_us"] = (time.perf_counter() - start) / 100000 * 1e6
    res["launch_device_pointer_us"] = _us(lambda: launch(good, bad, 4), 2000)
    res["launch_host_pointer_us"] = _us(lambda: launch(good, word, 4), 2000)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    host = torch.empty(1, dtype=torch.int32, pin_memory=True)
    event = torch.cuda.Event()

    def copy_and_record():
        host.copy_(flag, non_blocking=True)
        event.record()
    res["pinned_copy_plus_event_us"] = _us(copy_and_record, 2000)
    res["event_query_us"] = _us(event.query, 2000)
    res["zeros1_us"] = _us(lambda: torch.zeros(1, dtype=torch.int32, device=device), 2000)
    res["empty1_us"] = _us(lambda: torch.empty(1, dtype=torch.int32, device=device), 2000)
    res["host_index_read_us"] = _us(lambda: bool(host[0]), 2000)
    print("pieces", json.dumps(res, indent=1), flush=True)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_deferred_checks.py needs CUDA")
    device = torch.device("cuda")
    import triton

    out = {"probe": "deferred_checks", "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "trainops": trainops.__version__}
    out["calls_us_trainops_torch"] = _calls(device)
    _profiles(device)
    out["pieces"] = _pieces(device)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
