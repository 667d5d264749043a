"""Fused linear post-training losses (issue 43): time and memory of distillation (generalised JSD)
and DPO from the last hidden states and LM heads, forward + backward.

    python benchmarks/bench_linear_post_training.py [--tokens 8192] [--seq 1024] [--out results.json]
        [--budget 180] [--no-profile]

Side by side in one process, bf16 hidden (N x H) and heads (V x H), H = 4096, V = 128256, trainops
at its default chunk (ChunkedLinearHeuristics: 2048 tokens here) with the weight gradient
accumulated in bf16 ("weight", the default) and in float32 ("float32"), at --chunks sizes:
- distillation (beta 0.5, temperature 1): trainops.linear_distillation_loss; the unfused formulation
  (F.linear, float32 log-softmaxes, TRL's generalized_jsd_loss) under torch.compile; Liger's
  LigerFusedLinearJSDLoss when installed; the four matmuls alone (student logits, dX, dW, teacher
  logits: the time floor).
- DPO (N policy tokens as N / seq sequences: chosen then rejected, plus a reference of as many):
  trainops.linear_preference_loss(kind="dpo") (whole pairs a chunk at the default chunk; chunk 1024 < a
  pair's 2048 tokens runs the two-pass path); the unfused formulation under torch.compile;
  Liger's LigerFusedLinearDPOLoss when installed; the four matmuls alone (policy logits, dX, dW,
  reference logits).
Time: triton.testing.do_bench median of a forward + backward, gradients set to None before each.
Memory: the peak allocated during one forward + backward minus what is allocated after it (inputs
and gradients), MiB. Each row's loss and gradients are compared with the unfused float32 formula's
on the same bf16 inputs (relative-norm error), so a fast wrong variant shows. A peer that fails
(e.g. out of memory) is reported and skipped. Liger (liger_kernel.chunked_loss, its defaults:
chunks of 1024 tokens for JSD, one pair for DPO, its torch.compile'd chunk function) runs right
after trainops (those two always run); the runs go in order of importance and any other left when
--budget seconds have passed is reported as skipped (the torch.compile unfused formulation last: its compile is the slowest;
half the budget for distillation, the rest for DPO), so that with one run started just before the
deadline (a compile: up to a minute, unmeasured) the whole stays under about four minutes. Three profiled trainops steps per task, back to back (unless
--no-profile), print where a step's GPU time goes (the matmuls, the row kernels, the rest) and how
long the GPU sat idle within them (launch and host gaps).
The last table: each run's ms, x the matmuls' own time, extra MiB, and for trainops the ratios
to Liger's time and extra memory (the targets: time <= Liger's and <= 1.1x the matmuls, extra
memory <= Liger's).

Old against new in one run (the distill branch's changes that are switchable): "trainops before
distill" runs distillation's teacher logits in chunks as large as the student's (the layout before
the teacher's sub-chunks), "trainops alternating passes" the row kernel's read-only passes in
alternate directions (ChunkedLinearHeuristics.alternate_passes, off by default until this row has
been timed); distillation also runs other row-kernel tiles ("row block B / W warps"). The
backward's scaling (now cross_entropy's scale_unless_one_ for both losses, torch's mul_ before) is
not switchable: compare the "scale_unless_one" profile group against the earlier runs'
elementwise_kernel group. Each task's header prints the byte floor:
the four matmuls' time plus the row kernels' least traffic at 4.2 TB/s (distillation: student and
teacher float32 logits read once and the bf16 dlogits written, 10 bytes a logit, and the three-pass
kernel beta in (0, 1) needs, 26; DPO: 14, the policy's forward and backward row kernels and the
reference's forward).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import time

import torch
import torch.nn.functional as F

import trainops

H, V = 4096, 128256
ESSENTIAL = ("trainops", "liger", "trainops before distill")   # run whatever the budget says
COPY_BYTES_PER_S = 4.2e12   # the H200's copy speed, the byte floors' rate


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def generalized_jsd(zs, zt, labels, beta=0.5, temperature=1.0):
    """TRL's generalized_jsd_loss (reduction batchmean) on materialised logits."""
    ls = F.log_softmax(zs.float() / temperature, -1)
    lt = F.log_softmax(zt.float() / temperature, -1)
    b = torch.tensor(beta, dtype=ls.dtype, device=ls.device)
    lm = torch.logsumexp(torch.stack([ls + torch.log1p(-b), lt + torch.log(b)]), 0)
    jsd = (b * F.kl_div(lm, lt, reduction="none", log_target=True)
           + (1 - b) * F.kl_div(lm, ls, reduction="none", log_target=True)).sum(-1)
    mask = labels != -100
    return (jsd * mask).sum() / mask.sum().clamp_min(1)


def unfused_distillation(xs, ws, xt, wt, labels):
    with torch.no_grad():
        zt = F.linear(xt, wt)
    return generalized_jsd(F.linear(xs, ws), zt, labels)


def sequence_logps(z, labels):
    mask = labels != -100
    logp = torch.log_softmax(z.float(), -1).gather(-1, torch.where(mask, labels, 0)[..., None]).squeeze(-1)
    return (logp * mask).sum(-1)


def unfused_dpo(x, w, labels, rx, beta=0.1):
    logps = sequence_logps(F.linear(x, w), labels)
    with torch.no_grad():
        ref = sequence_logps(F.linear(rx, w), labels)
    p = x.shape[0] // 2
    delta = (logps[:p] - ref[:p]) - (logps[p:] - ref[p:])
    return -F.logsigmoid(beta * delta).mean()


def liger_version():
    try:
        from importlib.metadata import version
        return version("liger-kernel")
    except Exception:   # not installed
        return None


def liger_jsd():
    """LigerFusedLinearJSDLoss(student_input, student_weight, teacher_input, teacher_weight, true_labels):
    the generalised JSD over the tokens whose label is not ignore_index, / their count (as ours)."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    except ImportError as error:
        print(f"  liger JSD not run: {error}", flush=True)
        return None
    try:
        fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5, ignore_index=-100,
                                     temperature=1.0)
    except TypeError:   # versions without the hard / soft weights
        try:
            fn = LigerFusedLinearJSDLoss(beta=0.5, ignore_index=-100, temperature=1.0)
        except TypeError as error:
            print(f"  liger JSD skipped: {error}", flush=True)
            return None

    def loss(xs, ws, xt, wt, labels):
        out = fn(xs, ws, xt, wt, labels)
        return out[0] if isinstance(out, tuple) else out
    return loss


def liger_dpo():
    """LigerFusedLinearDPOLoss(lin_weight, _input, target, bias, ref_input, ref_weight): _input (2P, T, H)
    chosen then rejected, sequence log-probabilities summed (average_log_prob=False), loss "sigmoid"."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
    except ImportError as error:
        print(f"  liger DPO not run: {error}", flush=True)
        return None
    try:
        fn = LigerFusedLinearDPOLoss(beta=0.1, compute_nll_loss=False, use_ref_model=True, average_log_prob=False,
                                     loss_type="sigmoid")
    except TypeError:   # versions before loss_type: sigmoid is their only loss
        try:
            fn = LigerFusedLinearDPOLoss(beta=0.1, compute_nll_loss=False, use_ref_model=True,
                                         average_log_prob=False)
        except TypeError as error:   # another version's constructor: reported, the rest still runs
            print(f"  liger DPO skipped: {error}", flush=True)
            return None

    def loss(x, w, labels, rx):
        out = fn(w, x, labels, ref_input=rx, ref_weight=w.detach())
        return out[0] if isinstance(out, tuple) else out
    return loss


def chunked(fn, rows: int = 2048, accumulator: str = "weight", **fields):
    """``fn`` with chunks of ``rows`` tokens (DPO: fewer than a pair's 2 x seq tokens takes the two-pass
    path), the weight gradient accumulated in ``accumulator`` ("float32" or "weight": bf16) and other
    ChunkedLinearHeuristics ``fields`` (read by the forward, where both losses compute everything)."""
    from trainops.ops.chunked_linear import ChunkedLinearHeuristics

    config = ChunkedLinearHeuristics(chunk_bytes=rows * V * 4, min_rows=1, weight_grad_accumulator=accumulator,
                                     **fields)

    def loss(*args):
        with trainops.heuristics(config):
            return fn(*args)
    return loss


def byte_floor(matmuls_ms: float, n: int, bytes_per_logit: float) -> float:
    return matmuls_ms + bytes_per_logit * n * V / COPY_BYTES_PER_S * 1e3


def measure(fn, args, leaves, reps):
    from triton.testing import do_bench

    def step():
        for t in leaves:
            t.grad = None
        fn(*args).backward()

    step()   # warm-up (compiles)
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()) / 2**20
    for t in leaves:
        t.grad = None
    loss = fn(*args)
    grads = torch.autograd.grad(loss, leaves)
    ms = do_bench(step, warmup=2, rep=reps * 60, return_mode="median")
    return ms, extra, loss.detach().float(), [g.detach().float() for g in grads]


def matmul_floor(n, x, w, reps):
    """Four bf16 matmuls: logits, dX, dW of one head and a second head's logits."""
    from triton.testing import do_bench

    g = torch.randn(n, V, device="cuda", dtype=torch.bfloat16)
    xd, wd = x.detach(), w.detach()
    return do_bench(lambda: (torch.mm(xd, wd.t()), torch.mm(g, wd), torch.mm(g.t(), xd), torch.mm(xd, wd.t())),
                    warmup=2, rep=reps * 60, return_mode="median")


def record(results, task, name, fn, args, leaves, floor, reference, reps, deadline):
    """Measure run ``name``: ``fn`` a loss, or (loss, context factory) whose context is held over the
    whole forward + backward (a module switch the backward's thread reads too)."""
    fn, context = fn if isinstance(fn, tuple) else (fn, contextlib.nullcontext)
    if deadline is not None and time.monotonic() > deadline:
        print(f"  {name}: skipped (past --budget)", flush=True)
        results["skipped"].append(f"{task}: {name}")
        return
    try:
        with context():
            ms, extra, loss, grads = measure(fn, args, leaves, reps)
    except Exception as error:   # a peer that fails is reported, not fatal
        print(f"  {name}: failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
        torch.cuda.empty_cache()
        return
    errors = [rel(loss, reference[0])] + [rel(g, r) for g, r in zip(grads, reference[1])]
    results["rows"].append(dict(task=task, impl=name, ms=ms, extra_mib=extra, vs_matmuls=ms / floor, matmuls_ms=floor,
                                err_loss=errors[0], err_dx=errors[1], err_dw=errors[2]))
    print(f"  {name:36s} {ms:8.2f} ms ({ms / floor:.2f}x matmuls)  extra {extra:9.0f} MiB  "
          f"err loss {errors[0]:.1e} dx {errors[1]:.1e} dw {errors[2]:.1e}", flush=True)
    torch.cuda.empty_cache()


def float32_reference(fn, args, leaf_index):
    """The unfused formula in float32 from the same bf16 values: (loss, [grads of the leaves])."""
    args = list(args)
    leaves = []
    for i in leaf_index:
        args[i] = args[i].detach().float().requires_grad_()
        leaves.append(args[i])
    for i, a in enumerate(args):
        if i not in leaf_index and a.is_floating_point():
            args[i] = a.float()
    loss = fn(*args)
    grads = torch.autograd.grad(loss, leaves)
    out = loss.detach(), [g.detach() for g in grads]
    del args, leaves, loss, grads
    torch.cuda.empty_cache()
    return out


def profile(fn, args, leaves, label):
    """One forward + backward under torch.profiler: the GPU time by kernel class, printed (a failure
    is reported, not fatal)."""
    try:
        return _profile(fn, args, leaves, label)
    except Exception as error:
        print(f"  profile of {label} failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
        return {}


PROFILED_STEPS = 3   # back to back, no synchronisation between them (as do_bench runs them)


def _profile(fn, args, leaves, label):
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            for t in leaves:
                t.grad = None
            fn(*args).backward()
        torch.cuda.synchronize()
    timeline = _gpu_timeline(prof)
    groups: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if not us or event.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) and "gemm" not in event.key:
            continue
        key = event.key
        name = ("matmul (cuBLAS)" if any(k in key.lower() for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas"))
                else key if key.startswith(("_distillation_rows", "_token_rows", "_scale_unless_one"))
                else "other: " + key[:48])
        groups[name] = groups.get(name, 0.0) + us / 1000 / PROFILED_STEPS
    total = sum(groups.values())
    print(f"  profile of {label} (a step, the mean of {PROFILED_STEPS} back to back): {total:.2f} ms of kernels"
          + (f"; the GPU busy {timeline['busy_ms']:.2f} ms of a {timeline['span_ms']:.2f} ms span, idle "
             f"{timeline['idle_ms']:.2f} ms (largest gap {timeline['largest_gap_ms']:.2f} ms)" if timeline else ""),
          flush=True)
    for name, ms in sorted(groups.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {ms:8.2f} ms  {100 * ms / max(total, 1e-9):5.1f}%  {name}", flush=True)
    for t in leaves:
        t.grad = None
    return {**{name: ms for name, ms in groups.items()}, **{f"timeline {k}": v for k, v in timeline.items()}}


def _gpu_timeline(prof) -> dict:
    """A step's GPU time from the profiled steps' device events: busy (the union of their
    intervals), span (first start to last end) and idle (span - busy: launch and host gaps), ms a
    step; {} when the events carry no device times (another torch version)."""
    try:
        from torch.autograd import DeviceType

        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if getattr(e, "device_type", None) == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    except Exception:   # reported as absent, the rest of the profile stands
        return {}
    if not spans:
        return {}
    busy, gap, (start, end) = 0.0, 0.0, spans[0]
    first = start
    for a, b in spans[1:]:
        if a > end:
            busy += end - start
            gap = max(gap, a - end)
            start, end = a, b
        else:
            end = max(end, b)
    busy += end - start
    span = end - first
    steps = PROFILED_STEPS
    return dict(busy_ms=busy / 1000 / steps, span_ms=span / 1000 / steps, idle_ms=(span - busy) / 1000 / steps,
                largest_gap_ms=gap / 1000)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=1024, help="DPO sequence length (tokens / seq sequences)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", choices=["distillation", "dpo"], default=None)
    parser.add_argument("--chunks", type=int, nargs="*", default=[1024, 4096],
                        help="trainops chunk sizes (tokens) to run besides the default (2048 at this vocabulary)")
    parser.add_argument("--budget", type=float, default=180.0,
                        help="seconds after which the remaining runs are skipped (reported)")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import triton
    start = time.monotonic()
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   liger=liger_version(), host=platform.node(), tokens=args.tokens, H=H, V=V, rows=[], skipped=[],
                   profiles={}, floors={})
    n = args.tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    tasks = [args.only] if args.only else ["distillation", "dpo"]
    # each task gets its share of the budget: the runs after it are skipped
    share = args.budget / len(tasks)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    if "distillation" in tasks:
        deadline = start + share
        xs, ws = randn(n, H).requires_grad_(), randn(V, H, scale=1 / math.sqrt(H)).requires_grad_()
        xt, wt = randn(n, H), randn(V, H, scale=1 / math.sqrt(H))
        labels = torch.randint(0, V, (n,), device="cuda", generator=gen)
        labels[::11] = -100
        floor = matmul_floor(n, xs, ws, args.reps)
        one_pass, three_pass = byte_floor(floor, n, 10), byte_floor(floor, n, 26)
        results["floors"]["distillation"] = dict(matmuls_ms=floor, one_pass_ms=one_pass, three_pass_ms=three_pass)
        print(f"== distillation, {n} tokens, H {H}, V {V}: four matmuls alone {floor:.2f} ms; byte floor "
              f"{one_pass:.2f} ms ({one_pass / floor:.3f}x) with the logits read once, {three_pass:.2f} ms "
              f"({three_pass / floor:.3f}x) with beta in (0, 1)'s three passes", flush=True)
        call = (xs, ws, xt, wt, labels)
        reference = float32_reference(unfused_distillation, call, (0, 1))

        def distill(xs, ws, xt, wt, labels):
            return trainops.linear_distillation_loss(xs, ws, xt, wt, labels)
        runs = {"trainops": distill}
        liger = liger_jsd()
        if liger is not None:
            runs["liger"] = liger
        runs["trainops before distill"] = chunked(distill, teacher_chunk_bytes=2048 * V * 4)
        runs["trainops alternating passes"] = chunked(distill, alternate_passes=True)
        for block, warps in ((4096, 16), (8192, 16), (2048, 4)):
            runs[f"trainops row block {block} / {warps} warps"] = chunked(distill, row_block=block, row_warps=warps)
        runs["trainops dW in float32"] = chunked(distill, accumulator="float32")
        runs.update({f"trainops chunk {rows}": chunked(distill, rows) for rows in args.chunks if rows <= n})
        runs["torch.compile unfused"] = torch.compile(unfused_distillation)
        for name, fn in runs.items():
            record(results, "distillation", name, fn, call, (xs, ws), floor, reference, args.reps,
                   None if name in ESSENTIAL else deadline)
            if name == "trainops" and not args.no_profile:
                results["profiles"]["distillation"] = profile(distill, call, (xs, ws), "trainops distillation")
        del xs, ws, xt, wt, labels, call, reference
        torch.cuda.empty_cache()

    if "dpo" in tasks:
        deadline = start + args.budget
        b = n // args.seq
        x, w = randn(b, args.seq, H).requires_grad_(), randn(V, H, scale=1 / math.sqrt(H)).requires_grad_()
        rx = randn(b, args.seq, H)
        labels = torch.randint(0, V, (b, args.seq), device="cuda", generator=gen)
        labels[:, : args.seq // 4] = -100   # the prompts
        floor = matmul_floor(n, x.view(n, H), w, args.reps)
        bytes_floor = byte_floor(floor, n, 14)
        results["floors"]["dpo"] = dict(matmuls_ms=floor, two_pass_ms=bytes_floor)
        print(f"== DPO, {b} sequences of {args.seq} tokens (+ the reference's), H {H}, V {V}: four matmuls alone "
              f"{floor:.2f} ms; byte floor {bytes_floor:.2f} ms ({bytes_floor / floor:.3f}x)", flush=True)
        call = (x, w, labels, rx)
        reference = float32_reference(unfused_dpo, call, (0, 1))

        def ours(x, w, labels, rx):
            return trainops.linear_preference_loss(x, w, labels, kind="dpo", beta=0.1, ref_hidden=rx,
                                                   ref_weight=w.detach()).loss
        runs = {"trainops": ours}
        liger = liger_dpo()
        if liger is not None:
            runs["liger"] = liger
        runs["trainops dW in float32"] = chunked(ours, accumulator="float32")
        runs.update({f"trainops chunk {rows}": chunked(ours, rows) for rows in args.chunks if rows <= n})
        runs["torch.compile unfused"] = torch.compile(unfused_dpo)
        for name, fn in runs.items():
            record(results, "dpo", name, fn, call, (x, w), floor, reference, args.reps,
                   None if name in ESSENTIAL else deadline)
            if name == "trainops" and not args.no_profile:
                results["profiles"]["dpo"] = profile(ours, call, (x, w), "trainops DPO")

    liger_rows = {r["task"]: r for r in results["rows"] if r["impl"] == "liger"}
    print("\ntask          impl                                    ms  x matmuls   extra MiB   x liger ms  x liger MiB   "
          "err loss / dx / dw")
    for r in results["rows"]:
        peer = liger_rows.get(r["task"])
        if peer is not None and r["impl"].startswith("trainops"):
            r["vs_liger_ms"], r["vs_liger_mib"] = r["ms"] / peer["ms"], r["extra_mib"] / max(peer["extra_mib"], 1.0)
        vs = (f"{r['vs_liger_ms']:11.2f} {r['vs_liger_mib']:12.2f}" if "vs_liger_ms" in r else " " * 24)
        print(f"{r['task']:13s} {r['impl']:36s} {r['ms']:8.2f} {r['vs_matmuls']:9.2f} {r['extra_mib']:11.0f} {vs}   "
              f"{r['err_loss']:.0e} / {r['err_dx']:.0e} / {r['err_dw']:.0e}")
    for name in results["skipped"]:
        print(f"skipped (budget): {name}")
    results["seconds"] = time.monotonic() - start
    print(f"{results['seconds']:.0f} s in all; liger-kernel {results['liger']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
