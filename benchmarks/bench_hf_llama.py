"""A Hugging Face LlamaForCausalLM training step (issue 19): PyTorch eager, trainops.patch, Liger.

    python benchmarks/bench_hf_llama.py [--layers 16] [--steps 8] [--out results.json]

Llama-3.2-1B's shape by default (hidden 2048, 32 query / 8 KV heads, intermediate 8192, vocabulary
128256 tied, 16 layers), random initial weights (same seed for every variant, nothing downloaded),
batch 4 x 2048 random tokens, float32 parameters under bf16 autocast, SDPA attention, torch's fused
AdamW. Each variant: 3 warm-up steps, then the median of ``--steps`` steps (each synchronised by
reading its loss), peak memory allocated, and the losses (the same batches: the curves should
agree). Liger (apply_liger_kernel_to_llama on the instance) runs last: it patches transformers's
module functions for the whole process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

import trainops


def build(layers: int):
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config)
    return model


def run(name: str, model, steps: int, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model.train()
    times, losses = [], []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for i, (ids, labels) in enumerate(batches[:steps + 3]):
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if i >= 3:
            times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30
    tokens = ids.numel()
    print(f"  {name:32s} {ms:8.1f} ms/step  {tokens / ms * 1e3:9.0f} tokens/s  peak {peak:5.1f} GiB  "
          f"losses {losses[0]:.4f} .. {losses[-1]:.4f}", flush=True)
    del opt
    return dict(impl=name, ms=ms, tokens_per_s=tokens / ms * 1e3, peak_gib=peak, losses=losses)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", default="eager,patch,liger",
                        help="comma-separated: eager, patch, patch-unchecked, compile, patch-compile, liger (last)")
    parser.add_argument("--chunk-mib", type=int, default=None,
                        help="trainops.linear_cross_entropy's chunk_bytes in MiB (default: its heuristics')")
    args = parser.parse_args()
    if args.chunk_mib is not None:
        from trainops.ops.linear_cross_entropy import LinearCrossEntropyHeuristics
        context = trainops.heuristics(LinearCrossEntropyHeuristics(chunk_bytes=args.chunk_mib * 2**20))
        context.__enter__()
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps + 3):
        ids = torch.randint(0, 128256, (4, 2048), generator=gen).cuda()
        batches.append((ids, ids))
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
                   layers=args.layers, rows=[])
    print(f"== LlamaForCausalLM, {args.layers} layers, hidden 2048, vocab 128256, batch 4 x 2048, bf16 autocast",
          flush=True)
    names = {"eager": "PyTorch eager", "patch": "trainops.patch", "patch-unchecked": "trainops.patch, check_index=False",
             "compile": "torch.compile", "patch-compile": "trainops.patch + torch.compile", "liger": "Liger"}
    for kind in args.variants.split(","):
        name = names[kind]
        model = build(args.layers)
        if kind.startswith("patch"):
            report = trainops.patch(model)
            if kind == "patch-unchecked":
                model.model.embed_tokens.check_index = False   # no host sync per step for the index check
            print(f"  ({len(report.swapped)} modules swapped, {len(report.skipped)} kept)", flush=True)
        if kind.endswith("compile"):
            model.compile()
        elif kind == "liger":
            try:
                from liger_kernel.transformers import apply_liger_kernel_to_llama
                apply_liger_kernel_to_llama(model=model)
            except Exception as error:
                print(f"  {name}: not run: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
        try:
            results["rows"].append(run(name, model, args.steps, batches))
        except Exception as error:
            print(f"  {name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
        del model
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
