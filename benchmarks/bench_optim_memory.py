"""Training-step memory by optimizer configuration (issue 41, item 4): weights, gradients,
optimizer states, activations and the peak, side by side.

    PYTHONPATH=src python benchmarks/bench_optim_memory.py --out benchmarks/results/optim-memory-h200.json
    PYTHONPATH=src python benchmarks/bench_optim_memory.py --cpu --out /tmp/x.json   # self-check, tiny

The model: a decoder of --layers pre-norm transformer layers (torch.nn.TransformerEncoderLayer,
causal mask) of width --width, MLP 4 x width, heads width / 128, vocabulary --vocab, tied
nothing; a batch of --batch sequences of --length tokens (random, never zero loss). Defaults:
width 2048, 8 layers, vocab 32000: 0.53 B parameters. Configurations, one at a time (each
freed before the next): torch fused AdamW (float32), trainops AdamW (float32), AdamW8bit
(float32 parameters), AdamW bf16 parameters + stochastic rounding, AdamW8bit bf16 + SR,
AdamW8bit bf16 + SR with the step in the backward; torchao AdamW8bit / AdamW4bit /
_AdamW(bf16_stochastic_round) and bitsandbytes AdamW8bit when importable.

Per configuration, from torch.cuda.memory_allocated (bytes):
    weights      the parameters
    gradients    what the backward leaves allocated (0 with the step in the backward)
    states       what the optimizer keeps after its steps (gradients freed)
    activations  what the forward leaves allocated for the backward
    peak         max_memory_allocated over the third training step (forward, backward, step)
Table last, JSON to --out. About a minute on an H200.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import trainops  # noqa: E402


class Decoder(torch.nn.Module):
    def __init__(self, vocab, width, layers, length):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(length, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, max(1, width // 128), 4 * width, dropout=0.0,
                                                 batch_first=True, norm_first=True, activation="gelu")
        self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, x):
        n = x.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=x.device, dtype=self.head.weight.dtype)
        return self.head(self.norm(self.layers(self.embed(x) + self.position[:n], mask=mask, is_causal=True)))


def configurations(cpu: bool):
    """(name, parameter dtype, optimizer factory, step in backward)."""
    configs = [
        ("torch fused AdamW fp32", torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=not cpu), False),
        ("trainops AdamW fp32", torch.float32, lambda ps: trainops.optim.AdamW(ps, lr=1e-4), False),
        ("trainops AdamW8bit fp32", torch.float32, lambda ps: trainops.optim.AdamW8bit(ps, lr=1e-4), False),
        ("trainops AdamW bf16+SR", torch.bfloat16,
         lambda ps: trainops.optim.AdamW(ps, lr=1e-4, stochastic_rounding=True), False),
        ("trainops AdamW8bit bf16+SR", torch.bfloat16,
         lambda ps: trainops.optim.AdamW8bit(ps, lr=1e-4, stochastic_rounding=True), False),
        ("trainops AdamW8bit bf16+SR in backward", torch.bfloat16,
         lambda ps: trainops.optim.AdamW8bit(ps, lr=1e-4, stochastic_rounding=True), True),
    ]
    if cpu:
        return configs
    for module in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            ao = __import__(module, fromlist=["AdamW8bit"])
        except ImportError:
            continue
        configs += [("torchao AdamW8bit fp32", torch.float32, lambda ps: ao.AdamW8bit(ps, lr=1e-4), False),
                    ("torchao AdamW4bit fp32", torch.float32, lambda ps: ao.AdamW4bit(ps, lr=1e-4), False)]
        if hasattr(ao, "_AdamW"):
            configs.append(("torchao AdamW bf16+SR", torch.bfloat16,
                            lambda ps: ao._AdamW(ps, lr=1e-4, bf16_stochastic_round=True), False))
        break
    try:
        import bitsandbytes as bnb
        configs.append(("bitsandbytes AdamW8bit fp32", torch.float32, lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-4),
                        False))
    except Exception:  # not installed, or no CUDA build
        pass
    return configs


def measure(name, dtype, factory, in_backward, args, device):
    allocated = torch.cuda.memory_allocated if device == "cuda" else (lambda: 0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    base = allocated()
    torch.manual_seed(0)
    model = Decoder(args.vocab, args.width, args.layers, args.length).to(device=device, dtype=dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = factory(list(model.parameters()))
    handle = trainops.optim.step_in_backward(model, opt) if in_backward else None
    gen = torch.Generator().manual_seed(1)
    row = dict(name=name, param_dtype=str(dtype).replace("torch.", ""), weights=weights)
    for step in range(3):
        x = torch.randint(0, args.vocab, (args.batch, args.length + 1), generator=gen).to(device)
        sync()
        if step == 2 and device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = allocated()
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())
        sync()
        activations = allocated() - start
        loss.backward()
        sync()
        gradients = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        sync()
        if device == "cuda":
            states = allocated() - base - weights - x.numel() * x.element_size()
        else:   # no allocator statistics: the optimizer's state tensors
            states = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                         if torch.is_tensor(t))
        if step == 2:
            row.update(gradients=gradients, activations=activations, states=states,
                       peak=torch.cuda.max_memory_allocated() if device == "cuda" else 0)
    if handle is not None:
        handle.remove()
    del model, opt
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--cpu", action="store_true", help="tiny, on the CPU (a self-check: only weights, gradients "
                                                           "and states are measured there)")
    args = parser.parse_args(argv)
    if min(args.width, args.layers, args.vocab, args.batch, args.length) < 1:
        parser.error("sizes must be >= 1")
    if args.cpu:
        args.width, args.layers, args.vocab, args.batch, args.length = 128, 2, 500, 2, 32
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (--cpu runs a tiny self-check)")
    rows = []
    for name, dtype, factory, in_backward in configurations(args.cpu):
        try:
            rows.append(measure(name, dtype, factory, in_backward, args, device))
        except Exception as error:  # a peer that fails (old torchao, no bnb CUDA build) is a row with its error
            rows.append(dict(name=name, error=f"{type(error).__name__}: {error}"))
        print(rows[-1], flush=True)
    gib = lambda b: f"{b / 2 ** 30:8.3f}"  # noqa: E731
    print(f"\n{'configuration':40s} {'weights':>8s} {'grads':>8s} {'states':>8s} {'activ.':>8s} {'peak':>8s}  (GiB)")
    for row in rows:
        if "error" in row:
            print(f"{row['name']:40s} failed: {row['error']}")
        else:
            print(f"{row['name']:40s} " + " ".join(gib(row[k]) for k in ("weights", "gradients", "states",
                                                                           "activations", "peak")))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   "model": dict(width=args.width, layers=args.layers, vocab=args.vocab, batch=args.batch,
                                 length=args.length), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
