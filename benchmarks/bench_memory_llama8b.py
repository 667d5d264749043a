"""Issue 41's first target: does a full-parameter AdamW fine-tune of Llama-3.1-8B's shape (32 layers,
hidden 4096, intermediate 14336, 32 / 8 heads, vocabulary 128256) train on one GPU at 1 x 4096
tokens, bf16 autocast, no activation checkpointing, and at what peak against torchao's and
bitsandbytes' AdamW8bit on bf16 weights?

    python benchmarks/bench_memory_llama8b.py --out results.json [--layers 32] [--seq 4096]
    python benchmarks/bench_memory_llama8b.py --only trainops,torchao --layers 2   # a quick look
    python benchmarks/bench_memory_llama8b.py --tiny --layers 2 --seq 32 --out /tmp/m.json   # a self-check

Each configuration runs in its own process (a clean allocator and peak): transformers's
LlamaForCausalLM built from the configuration in bf16 on the GPU (random weights, seed 0), random
tokens (seed 1), SDPA, bf16 autocast, AdamW lr 1e-5, weight decay 0.01, zero_grad(set_to_none=True),
2 warm-up steps then 3 timed steps (median). Configurations:
    trainops            trainops.patch + trainops.optim.AdamW8bit, bf16 weights, stochastic rounding
    trainops-in-backward  the same with trainops.optim.step_in_backward (each gradient freed once used)
    torchao             torchao's AdamW8bit on the same bf16 weights, transformers's own model and loss
    torchao-patched     torchao's AdamW8bit, the model patched by trainops (the optimizer alone differs)
    bnb                 bitsandbytes' AdamW8bit on the bf16 weights, transformers's own model and loss
    bnb-patched         bitsandbytes' AdamW8bit, the model patched by trainops
Per configuration: peak allocated and reserved over the third step, weights, ms per step and
tokens/s, the losses. A peer that is not installed gives a row saying so. Table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = ("trainops", "trainops-in-backward", "torchao", "torchao-patched", "bnb", "bnb-patched")
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=False, use_cache=False)


def _optimizer(name: str, params):
    import trainops
    lr, wd = 1e-5, 0.01
    if name.startswith("trainops"):
        return trainops.optim.AdamW8bit(params, lr=lr, weight_decay=wd, stochastic_rounding=True)
    if name.startswith("torchao"):
        try:
            from torchao.optim import AdamW8bit
        except ImportError:
            from torchao.prototype.low_bit_optim import AdamW8bit
        return AdamW8bit(params, lr=lr, weight_decay=wd)
    import bitsandbytes as bnb
    return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=wd)


TINY = dict(SHAPE, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)


def run_one(name: str, layers: int, seq: int, tiny: bool = False) -> dict:
    import torch
    import transformers
    import trainops

    row = dict(config=name, layers=layers, seq=seq)
    peer = {"torchao": "torchao", "bnb": "bitsandbytes"}.get(name.split("-")[0])
    if peer is not None:
        try:
            __import__(peer)
        except Exception as exc:   # not installed, or no CUDA build
            return dict(row, status="skipped", reason=f"{peer}: {type(exc).__name__}: {exc}"[:300])
    torch.manual_seed(0)
    shape = TINY if tiny else SHAPE
    config = transformers.LlamaConfig(num_hidden_layers=layers, **shape)
    config._attn_implementation = "sdpa"
    dev = "cuda" if torch.cuda.is_available() else "cpu"   # the CPU: a self-check at tiny sizes only
    cuda = dev == "cuda"
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.train()
    if name.startswith("trainops") or name.endswith("patched"):
        trainops.patch(model)
    row["parameters"] = sum(p.numel() for p in model.parameters())
    row["weights_gib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    opt = _optimizer(name, list(model.parameters()))
    handle = trainops.optim.step_in_backward(model, opt) if name.endswith("in-backward") else None
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(5):
        ids = torch.randint(0, shape["vocab_size"], (1, seq), generator=gen).to(dev)
        if cuda:
            torch.cuda.synchronize()
        if step == 2 and cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())   # the step's one sync
        times.append(time.perf_counter() - start)
        if step == 2:
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
    if handle is not None:
        handle.remove()
    timed = sorted(times[2:])
    row.update(status="ok", ms=timed[len(timed) // 2] * 1e3, losses=losses)
    row["tokens_per_s"] = seq / (row["ms"] / 1e3)
    return row


def spawn(name: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        command = [sys.executable, __file__, "--run-one", name, "--layers", str(args.layers), "--seq", str(args.seq),
                   "--out", out] + (["--tiny"] if args.tiny else [])
        try:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  timeout=args.run_timeout)
            code, err = done.returncode, done.stderr
        except subprocess.TimeoutExpired:
            code, err = None, f"killed after {args.run_timeout} s"
        if code == 0 and os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        return dict(config=name, status="failed", reason=err.strip()[-800:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--only", default=",".join(CONFIGS))
    p.add_argument("--run-timeout", type=float, default=240)
    p.add_argument("--tiny", action="store_true", help="hidden 64, vocabulary 512: a self-check (the CPU too)")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run_one is not None:
        row = run_one(args.run_one, args.layers, args.seq, args.tiny)
        with open(args.out, "w") as f:
            json.dump(row, f)
        return 0
    import torch
    import trainops
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"argument --only: {unknown} not among {CONFIGS}")
    versions = dict(torch=torch.__version__, trainops=getattr(trainops, "__version__", None))
    if torch.cuda.is_available():
        versions.update(device=torch.cuda.get_device_name(),
                        total_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    for peer in ("transformers", "torchao", "bitsandbytes", "triton"):
        try:
            versions[peer] = __import__(peer).__version__
        except Exception:
            versions[peer] = None
    print(json.dumps(versions))
    rows = []
    for name in names:   # the JSON rewritten after every row: a killed bench keeps the rows it finished
        started = time.perf_counter()
        rows.append(spawn(name, args))
        print(f"  {name:22s} {rows[-1].get('status')} ({time.perf_counter() - started:.0f} s)", flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(versions=versions, shape=TINY if args.tiny else SHAPE, layers=args.layers, seq=args.seq,
                           rows=rows), f, indent=1)
    print(f"{'config':22s} {'peak alloc':>10s} {'reserved':>9s} {'weights':>8s} {'ms/step':>8s} {'tok/s':>7s}  losses")
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['config']:22s} {r.get('status')}: {r.get('reason', '')[-300:]}")
            continue
        print(f"{r['config']:22s} {r['peak_allocated_gib']:10.2f} {r['peak_reserved_gib']:9.2f} {r['weights_gib']:8.2f} "
              f"{r['ms']:8.1f} {r['tokens_per_s']:7.0f}  {' '.join(f'{x:.4f}' for x in r['losses'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
