"""Every architecture trainops.patch covers, one training step on the GPU (issue 40): transformers
eager unpatched, trainops.patch, and Liger where it is installed and supports the family.

    python benchmarks/check_hf_archs.py --out results/hf_archs.json [--families llama,mixtral] [--steps 5]

Each family at a small but real size (hidden 1024, 4 layers, 16 query / 4 KV heads of 64,
vocabulary 32000 (GPT-2: 50257), MoE: 8 experts, top 2), random initial weights from the config
(the same seed for every variant, nothing downloaded), float32 parameters under bf16 autocast,
SDPA attention (Gemma 2: eager, which transformers requires), batch 4 x 1024 random tokens
(labels = inputs). A step is forward + backward + zero_grad (no optimizer: the weights stay put,
so every step of every variant sees the same model).
Each variant: 2 warm-up steps, then the median of ``--steps`` steps (each synchronised), the peak
memory allocated during them, and the loss of the first step; ``loss_rel_diff`` is
|loss - eager's| / eager's (bf16 autocast: expect ~1e-3 or less). trainops: ``trainops.patch``
on the eager model itself, after its runs (the kernels that ran are listed). Liger (when
``liger_kernel`` imports): ``_apply_liger_kernel_to_instance`` on a fresh copy, run last in a
family, since it rebinds functions of that family's transformers module for the whole process.
A family that raises is recorded with its error and the next one runs. Families not reached within
``--budget`` seconds are recorded as skipped. Prints the table last; writes JSON to --out.
``--small`` shrinks every size (a CPU smoke test of the script itself: ``--device cpu --small``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# family -> (config class, model class, config settings beyond the common ones)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", TOKENS),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": 30.0, "attn_implementation": "eager"}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"final_logit_softcapping": 30.0, "sliding_window": 256}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", TOKENS),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", TOKENS),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"partial_rotary_factor": 0.5, **TOKENS}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0, "embedding_multiplier": 12.0,
                                                         "residual_multiplier": 0.22,
                                                         "attention_multiplier": 0.015625}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, **MOE}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "moe_intermediate_size": 1408,
                                                            "norm_topk_prob": True, **MOE}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
}
LIGER_TYPES = {"llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
               "glm4", "granite", "mixtral", "qwen3_moe", "gpt2"}   # tried only where liger_kernel imports


def build(family: str, small: bool, device: str):
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    hidden, layers, heads, vocab = (64, 2, 4, 512) if small else (1024, 4, 16, 32000)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=509 if small else 50257, n_positions=2048, n_embd=hidden,
                                         n_layer=layers, n_head=heads, attn_implementation="sdpa",
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)   # comparable losses
    else:
        config = getattr(transformers, config_name)(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads // 4, head_dim=hidden // heads,
            max_position_embeddings=2048,
            **{"attn_implementation": "sdpa", **extra,
               **({"moe_intermediate_size": 32} if small and family == "qwen3_moe" else {})})
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(transformers, model_name)(config)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(model, batches, steps: int, device: str) -> dict:
    model.train()
    times, losses = [], []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for i, (ids, labels) in enumerate(batches[:steps + 2]):
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return dict(ms=1e3 * statistics.median(times), peak_gib=peak, loss=losses[0], losses=losses)


def check(family: str, args, batches_for) -> list[dict]:
    import trainops

    rows = []
    model = build(family, args.small, args.device)
    batches = batches_for(model.config.vocab_size)
    eager = run(model, batches, args.steps, args.device)
    rows.append(dict(family=family, impl="eager", **eager))
    report = trainops.patch(model)
    with trainops.track_kernels() as used, torch.autocast(args.device, dtype=torch.bfloat16):
        model(input_ids=batches[0][0], labels=batches[0][1]).loss.backward()   # untimed: which kernels ran
    model.zero_grad(set_to_none=True)
    patched = run(model, batches, args.steps, args.device)
    rows.append(dict(family=family, impl="trainops", swapped=len(report.swapped), skipped=report.skipped,
                     kernels=sorted({op for op, *_ in used}), **patched))
    del model
    liger = _liger()
    if liger is not None:
        fresh = build(family, args.small, args.device)
        if fresh.config.model_type in LIGER_TYPES:
            try:
                liger(model=fresh)
                rows.append(dict(family=family, impl="liger", **run(fresh, batches, args.steps, args.device)))
            except Exception as error:   # a family this Liger version lacks
                rows.append(dict(family=family, impl="liger", error=f"{type(error).__name__}: {error}"[:300]))
        del fresh
    for row in rows[1:]:
        if "loss" in row:
            row["loss_rel_diff"] = abs(row["loss"] - eager["loss"]) / abs(eager["loss"])
            row["speedup"] = eager["ms"] / row["ms"]
    return rows


def _liger():
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except Exception:
        return None
    return _apply_liger_kernel_to_instance


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, of: " + ", ".join(FAMILIES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--budget", type=float, default=210.0, help="seconds; families after it are skipped")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny sizes: a smoke test of the script")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or args.steps < 1 or args.batch < 1 or args.seq < 2:
        parser.error(f"unknown families {unknown}" if unknown else "--steps, --batch and --seq must be positive")
    import transformers
    import trainops

    def batches_for(vocab: int):
        gen = torch.Generator().manual_seed(1)
        out = []
        for _ in range(args.steps + 2):
            ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(args.device)
            out.append((ids, ids.clone()))
        return out

    start = time.perf_counter()
    rows = []
    for family in families:
        if time.perf_counter() - start > args.budget:
            rows.append(dict(family=family, impl="-", skipped_for_time=True))
            continue
        try:
            rows += check(family, args, batches_for)
        except Exception as error:
            rows.append(dict(family=family, impl="?", error=f"{type(error).__name__}: {error}"[:500]))
        if args.device == "cuda":
            torch.cuda.empty_cache()
        print(f"# {family} done at {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    meta = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                torch=torch.__version__, transformers=transformers.__version__, trainops=trainops.__version__,
                batch=args.batch, seq=args.seq, steps=args.steps, small=args.small,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), seconds=time.perf_counter() - start)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\n{meta['device']}  torch {meta['torch']}  transformers {meta['transformers']}  "
          f"batch {args.batch} x {args.seq}, bf16 autocast, median of {args.steps} steps")
    print(f"{'family':10s} {'impl':9s} {'ms/step':>9s} {'speedup':>8s} {'peak GiB':>9s} {'loss':>9s} {'rel diff':>9s}")
    for row in rows:
        if "ms" in row:
            print(f"{row['family']:10s} {row['impl']:9s} {row['ms']:9.1f} {row.get('speedup', 1.0):8.2f} "
                  f"{row['peak_gib']:9.2f} {row['loss']:9.4f} {row.get('loss_rel_diff', 0.0):9.1e}")
        else:
            print(f"{row['family']:10s} {row['impl']:9s} {row.get('error', 'skipped: time budget')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
