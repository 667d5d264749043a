"""The fused q/k norm + rotary attention of trainops.patch on a Qwen3-like model, one eager training
step, with and without it (issue 39 item 3, issue 40 item 1).

    python benchmarks/bench_qk_wiring.py --out benchmarks/results/qk-wiring-h200.json

Qwen3-0.6B's shape at 8 layers (hidden 1024, intermediate 3072, 16 query / 8 KV heads of 128,
vocabulary 151936, tied embeddings), random initial weights from the config (the same seed for
every variant, nothing downloaded), float32 parameters under bf16 autocast, SDPA attention, batch
8 x 2048 random tokens (labels = inputs). A step is forward + backward + zero_grad (no optimizer:
every step of every variant sees the same model). Variants, one after the other in this process:

    eager      transformers unpatched (its logits made: more memory; the loss reference)
    unfused    trainops.patch with the attention as before this change: transformers's forward,
               q_norm / k_norm by trainops.rms_norm, then trainops.rotary_embedding
    fused      trainops.patch as it is: q/k norm + rotary in one trainops.qk_norm_rotary

and, when asked for (``--variants ...,unfused-compile,fused-compile``; ~1 minute of compilation
each), those two under ``torch.compile(model)`` (Inductor; the compiled-choice table decides
whether each trainops op runs its kernel or Inductor's fusion of its decomposition: today
rms_norm and rotary_embedding at head_dim 128 go to Inductor, qk_norm_rotary has no entry and
runs its kernel).

Each: ``--warmup`` steps, then the median of ``--steps`` synchronised steps (ms), the peak memory
allocated during them, the first step's loss, the trainops ops that ran; one step profiled
(torch.profiler: GPU kernel time and launches per step; the time and calls of trainops's fused
q/k kernels, rotary kernels, RMSNorm kernels (all the model's norms) and weight-gradient column
sums, whose total is the table's "norm+rope ms": its drop from unfused to fused is what fusing
the q / k norms and the rotation saved; the ten longest kernels). ``grads_rel_diff``: fused against
unfused, per parameter ||g_fused - g_unfused|| / ||g_unfused|| (median and largest: bf16 noise,
~1e-3 to 1e-2, expected). Prints a table last; writes JSON to --out. ``--small`` shrinks every
size (a CPU smoke test: ``--device cpu --small --steps 1 --warmup 0``).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time

import torch


def build(args, device):
    import transformers

    if args.small:
        sizes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    else:
        sizes = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128)
    config = transformers.Qwen3Config(**sizes, num_hidden_layers=args.layers,
                                      max_position_embeddings=max(4096, args.seq),
                                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.Qwen3ForCausalLM(config)


def unfused_attention_class():
    """Qwen3Attention as trainops.patch swapped it before the fused path: transformers's forward with
    trainops's rotary embedding (its q_norm / k_norm modules are patch's trainops.rms_norm)."""
    from transformers.models.qwen3 import modeling_qwen3

    from trainops.hf._common import ROTARY_ATTENTION

    attributes, reasons = ROTARY_ATTENTION.make(modeling_qwen3.Qwen3Attention)
    if attributes is None:
        raise RuntimeError(f"the rotary-only attention cannot be made: {reasons}")
    return type("Qwen3Attention", (modeling_qwen3.Qwen3Attention,), attributes)


# trainops's kernels whose GPU time the profile reports apart (category -> the Triton function's
# name, which the profiler's kernel name contains): the fused op, the rotary embedding, RMSNorm
# (every norm of the model, the q / k ones of the unfused path among them) and the weight
# gradients' column sums (the norms' and the fused op's). Inductor's kernels are named otherwise.
NAMED_KERNELS = {"qk_norm_rotary": "_qk_norm_rotary_", "rotary": "_rotary_rows", "norm": "_norm_",
                 "sum_columns": "_sum_columns"}


def profile_step(step) -> dict:
    """One step under torch.profiler (CUDA: kernels, copies, memsets): GPU ms, launches, the ms and
    calls of the kernels whose names contain each of NAMED_KERNELS, and the ten longest kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.device_time / 1e3
        entry[1] += 1
    named = {}
    for name, (t, c) in totals.items():
        category = next((cat for cat, piece in NAMED_KERNELS.items() if piece in name), None)
        if category is not None:
            entry = named.setdefault(category, {"ms": 0.0, "calls": 0})
            entry["ms"] += t
            entry["calls"] += c
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:10]
    return {"gpu_kernel_ms": sum(t for t, _ in totals.values()), "launches": sum(c for _, c in totals.values()),
            "named_kernels": named, "top_kernels": [{"name": n[:160], "ms": t, "calls": c} for n, (t, c) in top]}


def run_variant(name, args, device, ids):
    import trainops

    base, compiled = name.removesuffix("-compile"), name.endswith("-compile")
    if base not in ("eager", "unfused", "fused"):
        raise ValueError(f"unknown variant {name!r}")
    model = build(args, device)
    report = None
    if base != "eager":
        report = trainops.patch(model)
        if report.skipped:
            raise RuntimeError(f"patch refused modules: {report.skipped}")
        if base == "unfused":
            unfused = unfused_attention_class()
            for layer in model.model.layers:
                layer.self_attn.__class__ = unfused
    model.train()
    forward = torch.compile(model) if compiled else model
    cuda = device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    model.zero_grad(set_to_none=True)
    with trainops.track_kernels() as used:
        first_loss = step().item()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    ops = sorted({op for op, *_ in used})
    for _ in range(args.warmup):
        model.zero_grad(set_to_none=True)
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    profile = None
    if cuda and not args.no_profile:
        model.zero_grad(set_to_none=True)
        profile = profile_step(step)
    row = {"variant": name, "ms_per_step": statistics.median(times), "ms_all": times, "peak_gib": peak,
           "loss": first_loss, "trainops_ops": ops, "profile": profile,
           "attention_swap": None if report is None else report.descriptions.get("model.layers.0.self_attn")}
    if base == "unfused":
        row["attention_swap"] = "attention: rotary embedding (q_norm / k_norm modules)"
    return row, grads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default="eager,unfused,fused",
                        help="comma-separated: eager, unfused, fused, and each with -compile")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke test of the script)")
    args = parser.parse_args(argv)
    import transformers

    import trainops

    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(1)
    vocab = 512 if args.small else 151936
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
    started = time.perf_counter()
    rows, grads = [], {}
    for name in args.variants.split(","):
        try:
            row, variant_grads = run_variant(name, args, device, ids)
            if name in ("fused", "unfused"):
                grads[name] = variant_grads
            del variant_grads
        except Exception as e:   # recorded; the next variant runs
            row = {"variant": name, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        gc.collect()   # the variant's model, before the next one is built
        if name.endswith("-compile"):
            torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"[{time.perf_counter() - started:.0f} s] {name}: {row.get('ms_per_step', row.get('error'))}",
              file=sys.stderr, flush=True)
    by_name = {r["variant"]: r for r in rows if "error" not in r}
    reference = by_name.get("eager") or by_name.get("unfused")
    for row in by_name.values():
        if reference is not None:
            rel = abs(row["loss"] - reference["loss"]) / abs(reference["loss"])
            row["loss_rel_diff_vs_" + reference["variant"]] = rel
    if "fused" in grads and "unfused" in grads:
        diffs = sorted(((grads["fused"][n].float() - g.float()).norm() / g.float().norm().clamp_min(1e-30)).item()
                       for n, g in grads["unfused"].items())
        by_name["fused"]["grads_rel_diff_vs_unfused"] = {"median": statistics.median(diffs), "max": diffs[-1],
                                                         "params": len(diffs)}
    for suffix in ("", "-compile"):
        fused, unfused = by_name.get("fused" + suffix), by_name.get("unfused" + suffix)
        if fused and unfused:
            fused["speedup_vs_unfused"] = unfused["ms_per_step"] / fused["ms_per_step"]
    result = {
        "bench": "qk_wiring", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "trainops": getattr(trainops, "__version__", None),
                     "triton": getattr(sys.modules.get("triton"), "__version__", None)},
        "shape": {"batch": args.batch, "seq": args.seq, "layers": args.layers, "small": args.small,
                  "dtype": "float32 parameters, bf16 autocast", "attention": "sdpa"},
        "steps": args.steps, "warmup": args.warmup, "seconds": time.perf_counter() - started, "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nQwen3-like, {args.layers} layers, batch {args.batch} x {args.seq}, bf16 autocast, {result['device']}")
    print(f"{'variant':<15} {'ms/step':>9} {'GPU ms':>8} {'launches':>8} {'peak GiB':>9} {'loss':>10} "
          f"{'rel diff':>9} {'norm+rope ms':>12}")
    for row in rows:
        if "error" in row:
            print(f"{row['variant']:<15} ERROR {row['error'][:100]}")
            continue
        prof = row["profile"] or {}
        rel = next((v for k, v in row.items() if k.startswith("loss_rel_diff")), float("nan"))
        peak = row["peak_gib"]
        qk = sum(v["ms"] for v in prof.get("named_kernels", {}).values())
        print(f"{row['variant']:<15} {row['ms_per_step']:>9.2f} {prof.get('gpu_kernel_ms', float('nan')):>8.2f} "
              f"{prof.get('launches', 0):>8} {peak if peak is not None else float('nan'):>9.2f} {row['loss']:>10.5f} "
              f"{rel:>9.1e} {qk if prof else float('nan'):>12.2f}")
    for name in ("fused", "fused-compile"):
        if "speedup_vs_unfused" in by_name.get(name, {}):
            print(f"{name} vs un{name}: {by_name[name]['speedup_vs_unfused']:.3f}x")
    g = by_name.get("fused", {}).get("grads_rel_diff_vs_unfused")
    if g:
        print(f"fused vs unfused gradients: relative difference median {g['median']:.1e}, largest {g['max']:.1e} "
              f"over {g['params']} parameters")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
