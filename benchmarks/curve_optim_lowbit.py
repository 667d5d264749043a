"""Training curves of the low-bit optimizer options against float32 AdamW, on one GPU (issue 41).

    PYTHONPATH=src python benchmarks/curve_optim_lowbit.py --out benchmarks/results/curve-optim-lowbit-h200.json
    PYTHONPATH=src python benchmarks/curve_optim_lowbit.py --cpu --steps 20 --out /tmp/x.json   # self-check

A byte-level language model (embedding 256 -> 4 pre-norm transformer layers of width 256, 4
heads, MLP 1024 -> 256 logits; 3.2 M parameters, every weight matrix quantised under
optim_bits=8) on this Python installation's standard library sources (no download), sequences of
256 bytes, batch 32, --steps steps (default 400) of AdamW (lr 1e-3, 20 warm-up steps then cosine
to 10% through torch's LambdaLR, weight decay 0.01, no gradient clipping: a step in the backward
cannot clip by the global norm), the same batches and the same initial weights for every run:

    fp32              trainops.optim.AdamW, float32 parameters and states (the reference)
    8bit              optim_bits=8
    bf16-sr           bf16 parameters (no master copy), stochastic_rounding=True
    bf16-nearest      bf16 parameters rounded to nearest (what stochastic rounding fixes)
    in-backward       float32, trainops.optim.step_in_backward
    bf16-sr-8bit-in-backward   all three

Per run: the mean training loss of the last 20 steps, the validation loss (20 batches of held-out
bytes: the last 5% of the corpus), peak memory, ms per step; and the relative difference of
both losses to fp32's (the issue's target: within 1% for 8bit, bf16-sr and in-backward). Table
last; JSON to --out. About a minute on an H200.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import trainops  # noqa: E402

RUNS = {
    "fp32": (torch.float32, dict(), False),
    "8bit": (torch.float32, dict(optim_bits=8), False),
    "bf16-sr": (torch.bfloat16, dict(stochastic_rounding=True), False),
    "bf16-nearest": (torch.bfloat16, dict(), False),
    "in-backward": (torch.float32, dict(), True),
    "bf16-sr-8bit-in-backward": (torch.bfloat16, dict(stochastic_rounding=True, optim_bits=8), True),
}
TARGETS = ("8bit", "bf16-sr", "in-backward")


def corpus(limit: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, sorted by path (the same corpus every run)."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).to(torch.int64)


class ByteLM(torch.nn.Module):
    def __init__(self, width=256, layers=4, heads=4):
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.position = torch.nn.Parameter(torch.randn(256, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True, activation="gelu")
        self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 256, bias=False)

    def forward(self, x):
        n = x.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=x.device, dtype=self.head.weight.dtype)
        h = self.layers(self.embed(x) + self.position[:n], mask=mask, is_causal=True)
        return self.head(self.norm(h))


def batch(data: torch.Tensor, gen: torch.Generator, size: int, length: int, device) -> tuple:
    starts = torch.randint(0, data.numel() - length - 1, (size,), generator=gen)
    rows = torch.stack([data[s:s + length + 1] for s in starts.tolist()]).to(device)
    return rows[:, :-1], rows[:, 1:]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))


def run(name, train, val, args, device):
    dtype, options, in_backward = RUNS[name]
    torch.manual_seed(0)
    model = ByteLM().to(device=device, dtype=dtype)
    opt = trainops.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **options)
    warmup = 20
    schedule = lambda s: (s + 1) / warmup if s < warmup else 0.1 + 0.45 * (  # noqa: E731
        1 + math.cos(math.pi * (s - warmup) / max(1, args.steps - warmup)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    handle = trainops.optim.step_in_backward(model, opt) if in_backward else None
    gen = torch.Generator().manual_seed(1)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, start = [], time.perf_counter()
    for _ in range(args.steps):
        x, y = batch(train, gen, args.batch, args.length, device)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        losses.append(loss.detach())
    losses = [v.item() for v in losses]
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    val_gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        val_loss = sum(loss_of(model, *batch(val, val_gen, args.batch, args.length, device)).item()
                       for _ in range(20)) / 20
    if handle is not None:
        handle.remove()
    tail = losses[-20:]
    return dict(name=name, train_loss=sum(tail) / len(tail), val_loss=val_loss, peak_bytes=peak,
                ms_per_step=1e3 * elapsed / args.steps, finite=all(math.isfinite(v) for v in losses),
                curve=[round(v, 4) for v in losses[::10]])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--cpu", action="store_true", help="the CPU path, small (a self-check, not the curves)")
    args = parser.parse_args(argv)
    if args.steps < 21 or args.batch < 1 or not 1 <= args.length <= 256:
        parser.error("--steps must be > 20, --batch >= 1, --length in 1..256")
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (--cpu runs a small self-check)")
    data = corpus(2_000_000 if args.cpu else 20_000_000)
    split = int(data.numel() * 0.95)
    train, val = data[:split], data[split:]
    print(f"corpus: {data.numel() / 1e6:.1f} MB of stdlib sources; {args.steps} steps of {args.batch} x {args.length}",
          flush=True)
    rows = []
    for name in RUNS:
        row = run(name, train, val, args, device)
        rows.append(row)
        print(f"{name:26s} train {row['train_loss']:.4f}  val {row['val_loss']:.4f}  peak "
              f"{row['peak_bytes'] / 2 ** 20:8.1f} MiB  {row['ms_per_step']:7.2f} ms/step", flush=True)
    base = rows[0]
    for row in rows:
        row["train_vs_fp32"] = row["train_loss"] / base["train_loss"] - 1
        row["val_vs_fp32"] = row["val_loss"] / base["val_loss"] - 1
        row["within_1pct"] = abs(row["train_vs_fp32"]) <= 0.01 and abs(row["val_vs_fp32"]) <= 0.01
    print("\nrun                         train   val     vs fp32 (train / val)   peak MiB   target")
    for row in rows:
        target = ("PASS" if row["within_1pct"] else "FAIL") if row["name"] in TARGETS else ""
        print(f"{row['name']:26s} {row['train_loss']:.4f}  {row['val_loss']:.4f}  {100 * row['train_vs_fp32']:+6.2f}% / "
              f"{100 * row['val_vs_fp32']:+6.2f}%    {row['peak_bytes'] / 2 ** 20:8.1f}   {target}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"environment": {"torch": torch.__version__, "device": torch.cuda.get_device_name()
                                   if device == "cuda" else "cpu"}, "steps": args.steps, "batch": args.batch,
                   "length": args.length, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
