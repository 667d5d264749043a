"""Issue 41's bf16 + stochastic rounding curve, its causes separated: ``python -m trainops train
--model llama`` (the demo's model, data, schedule and optimizer) with variants the demo's flags do
not all offer, in one process (the tokenizer learned once), a JSON row written after each run.

    PYTHONPATH=src python benchmarks/curve_bf16_sr_llama.py --config small --device cpu --steps 300 \
        --runs fp32,bf16-sr,f32c-bf16-sr --out benchmarks/results/curves-bf16-sr-llama-small-cpu-20261129.json

Runs (all trainops.patch + trainops.optim.AdamW, betas (0.9, 0.95), weight decay 0.1 on matrices,
the demo's warm-up + cosine learning rate, no gradient clip: ``--max-grad-norm 0``):

    fp32               float32 parameters and compute (the reference)
    bf16-sr            bfloat16 parameters, stochastic_rounding=True; forward / backward in bf16
                       (the demo's --param-dtype bfloat16 --stochastic-rounding)
    bf16-nearest       bfloat16 parameters rounded to nearest (--param-dtype bfloat16)
    bf16-master        bfloat16 parameters with float32 masters (--master-weights): bf16 compute,
                       exact parameter storage
    f32c-bf16-sr       float32 compute, parameters held at bfloat16 values: float32 parameters,
                       each rounded stochastically to a bfloat16 value after every step (the same
                       bits as stochastic_rounding=True: seed, key = place, step)
    f32c-bf16-nearest  the same rounded to nearest
    bf16-kahan-sim     bfloat16 parameters with a simulated bfloat16 compensation buffer (Kahan):
                       float32 masters cut, after every step, to p + bf16(master - p), the value a
                       parameter p plus a bfloat16 buffer of its lost low bits holds (no library
                       option: a measurement of the idea before building it)
    8bit               float32 parameters, optim_bits=8 (the demo's --optim-bits 8)
    in-backward        float32 parameters, trainops.optim.step_in_backward (--step-in-backward)
    torchao-8bit       float32 parameters, torchao.optim.AdamW8bit (the same groups, betas and
                       learning rates) in place of trainops's optimizer (needs torchao)

The f32c runs isolate the parameter storage from the bf16 arithmetic of the forward / backward.
Final loss: mean training loss of the last 5 steps (as benchmarks/NOTES.md); validation: the
demo's held-out loss. ``--seed`` changes the initial weights and the batches (the demo's seed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from trainops.ops.lowbit_optimizers import stochastic_round_bf16  # noqa: E402
from trainops.train import common, llama  # noqa: E402

RUNS = {
    "fp32": ("float32", {}, None),
    "bf16-sr": ("bfloat16", {"stochastic_rounding": True}, None),
    "bf16-nearest": ("bfloat16", {}, None),
    "bf16-master": ("bfloat16", {"master_weights": True}, None),
    "f32c-bf16-sr": ("float32", {}, "sr"),
    "f32c-bf16-nearest": ("float32", {}, "nearest"),
    "bf16-kahan-sim": ("bfloat16", {"master_weights": True}, "kahan"),
    "8bit": ("float32", {"optim_bits": 8}, None),
    "in-backward": ("float32", {"step_in_backward": True}, None),
    "torchao-8bit": ("float32", {}, "torchao"),
}


@torch.no_grad()
def _round_parameters(params, how: str, seed: int, step: int) -> None:
    for key, p in enumerate(params):
        if how == "sr":
            p.copy_(stochastic_round_bf16(p.detach().float(), seed, key, step).float())
        else:
            p.copy_(p.detach().to(torch.bfloat16).float())


@torch.no_grad()
def _compensate(opt, params) -> None:
    """Each float32 master cut to what a bfloat16 parameter and a bfloat16 compensation hold."""
    for p in params:
        master = opt.state[p]["master_param"]
        master.copy_(p.float() + (master - p.float()).to(torch.bfloat16).float())


def run(name, cfg_base, tokens, device, seed, progress, amp="none", partial=lambda row: None):
    param_dtype, options, simulate = RUNS[name]
    cfg = llama.LlamaRunConfig(**{**cfg_base, "seed": seed, "param_dtype": param_dtype, "max_grad_norm": 0.0,
                                  "amp": amp})
    amp_dtype = common.autocast_dtype(cfg)
    for key in ("stochastic_rounding", "master_weights", "step_in_backward"):
        setattr(cfg, key, options.get(key, False))
    cfg.optim_bits = options.get("optim_bits", 32)
    model, forward, opt, scaler, _ = llama.build_run(cfg, device, "trainops")
    if simulate == "torchao":
        from torchao.optim import AdamW8bit

        opt = AdamW8bit(llama.parameter_groups(model), lr=cfg.lr, betas=(0.9, 0.95))
        simulate = None
    handle = common.attach_step_in_backward(model, opt, cfg)
    params = [p for g in opt.param_groups for p in g["params"]]
    if simulate in ("sr", "nearest"):
        _round_parameters(params, "nearest", seed, 0)   # as model.to(bfloat16) rounds the initial weights
    batches = common.Batches(tokens.ids, cfg, device, split=tokens.split)
    model.train()
    losses, started = [], time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):   # torchao's optimizers hold lr as a tensor
                group["lr"].fill_(common.learning_rate(cfg, step))
            else:
                group["lr"] = common.learning_rate(cfg, step)
        ((ids, _),) = batches.train_batch(step)
        losses.append(float(llama.train_step(model, forward, opt, scaler, ids, amp_dtype, device, None)))
        if simulate == "kahan":
            _compensate(opt, params)
        elif simulate:
            _round_parameters(params, simulate, seed, step + 1)
        if (step + 1) % 25 == 0:
            partial(dict(name=name, seed=seed, steps=cfg.steps, partial=True, losses=[round(v, 5) for v in losses]))
        if progress and (step + 1) % 25 == 0:
            print(f"  {name} seed {seed} step {step + 1}: loss {losses[-1]:.4f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    if handle is not None:
        handle.remove()
    val = llama.evaluate(model, batches.val_batches(), amp_dtype, device)
    del model, forward, opt, scaler, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tail = losses[-5:]
    return dict(name=name, seed=seed, steps=cfg.steps, final_loss=sum(tail) / len(tail), validation_loss=val,
                losses=[round(v, 5) for v in losses], seconds=round(time.perf_counter() - started, 1))


def plot(rows, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    base = {r["seed"]: r for r in rows if r["name"] == "fp32"}
    window = min(10, min(len(r["losses"]) for r in rows))
    colors = {name: f"C{i}" for i, name in enumerate(RUNS)}
    styles = ["-", "--", ":", "-."]
    for r in rows:
        label = f"{r['name']} (seed {r['seed']}): {r['final_loss']:.3f} / {r['validation_loss']:.3f}"
        smooth = torch.tensor(r["losses"]).unfold(0, window, 1).mean(1).tolist()
        look = dict(color=colors[r["name"]], ls=styles[r["seed"] % len(styles)], lw=1.2)
        axes[0].plot(range(window, len(r["losses"]) + 1), smooth, label=label, **look)
        if r["seed"] in base and r is not base[r["seed"]]:
            ref = torch.tensor(base[r["seed"]]["losses"]).unfold(0, window, 1).mean(1)
            axes[1].plot(range(window, len(r["losses"]) + 1), (torch.tensor(smooth) / ref - 1).mul(100).tolist(),
                         label=f"{r['name']} (seed {r['seed']})", **look)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel(f"training loss ({window}-step mean)")
    axes[0].legend(fontsize=7)
    axes[1].axhline(1.0, color="gray", ls=":")
    axes[1].axhline(-1.0, color="gray", ls=":")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel(f"% above fp32 of the same seed ({window}-step means)")
    axes[1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small", choices=list(llama.LLAMA_CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the configuration's)")
    parser.add_argument("--runs", default="fp32,bf16-sr")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; every run at every seed")
    parser.add_argument("--out", required=True, help="JSON (rows appended to an existing file); PNG beside it")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--replot", action="store_true", help="no runs: the table and plot of --out's rows")
    parser.add_argument("--amp", default=None, choices=["none", "bf16"],
                        help="autocast, as the demo's --amp: none on the CPU, bf16 on CUDA by default")
    args = parser.parse_args(argv)
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"argument --runs: {unknown} not in {list(RUNS)}")
    device = torch.device(args.device)
    amp = args.amp or ("bf16" if device.type == "cuda" else "none")
    if args.threads:
        torch.set_num_threads(args.threads)
    base = {**llama.LLAMA_CONFIGS[args.config], "steps": args.steps}
    if args.lr is not None:
        base["lr"] = args.lr
    tokens = None if args.replot else llama.stdlib_tokens(llama.LlamaRunConfig(**base))
    rows = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            stored = json.load(f)
        rows = [r for r in stored["rows"] if not r.get("partial")]
        if args.replot:   # the title says where the rows were trained, not this command's defaults
            device = torch.device(stored.get("device", args.device))
            amp = stored.get("amp") or ("bf16" if device.type == "cuda" else "none")

    def save(rows):
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "config": args.config, "device": str(device), "amp": amp,
                       "torch": torch.__version__, "rows": rows}, f)

    for seed in [] if args.replot else map(int, args.seeds.split(",")):
        for name in names:
            row = run(name, base, tokens, device, seed, not args.quiet, amp, partial=lambda r: save(rows + [r]))
            rows = [r for r in rows if (r["name"], r["seed"], r["steps"]) != (name, seed, args.steps)] + [row]
            save(rows)
            print(f"{name:18s} seed {seed}: final {row['final_loss']:.4f} validation {row['validation_loss']:.4f} "
                  f"({row['seconds']:.0f} s)", flush=True)
    print("\nrun                seed  steps  final    valid    vs fp32 of the seed (final / validation)")
    fp32 = {(r["seed"], r["steps"]): r for r in rows if r["name"] == "fp32"}
    for r in sorted(rows, key=lambda r: (r["steps"], r["seed"], list(RUNS).index(r["name"]))):
        ref = fp32.get((r["seed"], r["steps"]))
        versus = (f"{100 * (r['final_loss'] / ref['final_loss'] - 1):+6.2f}% / "
                  f"{100 * (r['validation_loss'] / ref['validation_loss'] - 1):+6.2f}%") if ref else "   (no fp32)"
        print(f"{r['name']:18s} {r['seed']:4d}  {r['steps']:5d}  {r['final_loss']:.4f}   {r['validation_loss']:.4f}   "
              f"{versus}")
    steps = max(r["steps"] for r in rows)
    print(plot([r for r in rows if r["steps"] == steps], os.path.splitext(args.out)[0] + ".png",
               f"{args.config} Llama on {device}, {steps} steps, AdamW lr {base['lr']}, no clip, amp {amp}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
