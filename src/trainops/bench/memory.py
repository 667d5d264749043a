"""``python -m trainops bench --memory``: training-step memory by optimizer configuration (issue 41,
item 4): weights, gradients, optimizer states, activations and the peak, side by side.

    python -m trainops bench --memory                       # on the GPU; JSON ./bench-memory-<device>-<time>.json
    python -m trainops bench --memory --out m.json --width 4096 --layers 4
    python -m trainops bench --memory --cpu --out /tmp/m.json   # a tiny self-check on the CPU
    python -m trainops bench --memory --dry-run             # the model and configurations, nothing built

(``benchmarks/bench_optim_memory.py`` is a front-end to this module.)

The model: a decoder of --layers pre-norm transformer layers (torch.nn.TransformerEncoderLayer,
causal mask) of width --width, MLP 4 x width, heads width / 128, vocabulary --vocab, nothing
tied; a batch of --batch sequences of --length tokens (random, never zero loss). Defaults:
width 2048, 8 layers, vocab 32000: 0.53 B parameters. Configurations, one at a time (each
freed before the next): torch fused AdamW (float32), trainops AdamW (float32), AdamW8bit
(float32 parameters), AdamW bf16 parameters + stochastic rounding, AdamW8bit bf16 + SR,
AdamW8bit bf16 + SR with the step in the backward; torchao AdamW8bit / AdamW4bit /
_AdamW(bf16_stochastic_round) and bitsandbytes AdamW8bit when importable (a peer that fails is a
row with its error). ``--only`` keeps the configurations whose name contains one of its
comma-separated substrings.

Per configuration, from torch.cuda.memory_allocated (bytes):
    weights      the parameters
    gradients    what the backward leaves allocated (0 with the step in the backward)
    states       what the optimizer keeps after its steps (gradients freed)
    activations  what the forward leaves allocated for the backward
    peak         max_memory_allocated over the third training step (forward, backward, step)
On the CPU (no allocator statistics) only weights, gradients and states (the optimizer's state
tensors) are measured; activations and peak are 0. Table last, JSON to --out. About a minute on an
H200.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os

import torch

from .._argparse import positive_int

PROG = "python -m trainops bench --memory"
DEFAULT = dict(width=2048, layers=8, vocab=32000, batch=4, length=1024)
TINY = dict(width=128, layers=2, vocab=500, batch=2, length=32)   # --cpu's defaults


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


def parameter_count(width: int, layers: int, vocab: int, length: int) -> int:
    """The Decoder's parameters, counted without building it."""
    layer = 4 * width * width + 4 * width + 2 * 4 * width * width + 4 * width + width + 4 * width   # attn, MLP, 2 norms
    return 2 * vocab * width + length * width + layers * layer + 2 * width


def configurations(cpu: bool, peers: bool = True):
    """(name, parameter dtype, optimizer factory, step in backward), in run order; peers (torchao,
    bitsandbytes) only on the GPU and when importable."""
    from .. import optim

    configs = [
        ("torch fused AdamW fp32", torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=not cpu), False),
        ("trainops AdamW fp32", torch.float32, lambda ps: optim.AdamW(ps, lr=1e-4), False),
        ("trainops AdamW8bit fp32", torch.float32, lambda ps: optim.AdamW8bit(ps, lr=1e-4), False),
        ("trainops AdamW bf16+SR", torch.bfloat16, lambda ps: optim.AdamW(ps, lr=1e-4, stochastic_rounding=True),
         False),
        ("trainops AdamW8bit bf16+SR", torch.bfloat16,
         lambda ps: optim.AdamW8bit(ps, lr=1e-4, stochastic_rounding=True), False),
        ("trainops AdamW8bit bf16+SR in backward", torch.bfloat16,
         lambda ps: optim.AdamW8bit(ps, lr=1e-4, stochastic_rounding=True), True),
    ]
    if cpu or not peers:
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


def measure(name, dtype, factory, in_backward, sizes: dict, device: str) -> dict:
    """One configuration's row: three training steps, the third measured (see the module docstring)."""
    from .. import optim

    allocated = torch.cuda.memory_allocated if device == "cuda" else (lambda: 0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    base = allocated()
    torch.manual_seed(0)
    model = Decoder(sizes["vocab"], sizes["width"], sizes["layers"], sizes["length"]).to(device=device, dtype=dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = factory(list(model.parameters()))
    handle = optim.step_in_backward(model, opt) if in_backward else None
    gen = torch.Generator().manual_seed(1)
    row = dict(name=name, param_dtype=str(dtype).replace("torch.", ""), weights=weights)
    for step in range(3):
        x = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["length"] + 1), generator=gen).to(device)
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


def table(rows: list[dict]) -> list[str]:
    """The rows as lines, GiB."""
    gib = lambda b: f"{b / 2 ** 30:8.3f}"  # noqa: E731
    lines = [f"{'configuration':40s} {'weights':>8s} {'grads':>8s} {'states':>8s} {'activ.':>8s} {'peak':>8s}  (GiB)"]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['name']:40s} failed: {row['error']}")
        else:
            lines.append(f"{row['name']:40s} " + " ".join(gib(row[k]) for k in ("weights", "gradients", "states",
                                                                                  "activations", "peak")))
    return lines




def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None,
                   help="JSON path (default: ./bench-memory-<device>-<time>.json; a directory: that name in it)")
    for name, value in DEFAULT.items():
        p.add_argument(f"--{name}", type=positive_int, default=None,
                       help=f"default {value} (with --cpu: {TINY[name]})")
    p.add_argument("--only", default="", help="comma-separated substrings: the configurations whose name has one")
    p.add_argument("--no-peers", action="store_true", help="leave out torchao and bitsandbytes")
    p.add_argument("--cpu", action="store_true",
                   help="on the CPU, tiny sizes by default (a self-check: only weights, gradients and states are "
                        "measured there)")
    p.add_argument("--dry-run", action="store_true", help="print the model and the configurations; build nothing")
    return p


def _out_path(out: str | None, device: str) -> str:
    name = f"bench-memory-{device}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    if out is None:
        return name
    return os.path.join(out, name) if os.path.isdir(out) else out


def main(argv: list[str] | None = None, log=print) -> int:
    """Parse ``argv`` (this mode's options, ``--memory`` itself left out), measure, print the table
    last and write the JSON; returns 0. A bad argument: argparse's error (exit status 2)."""
    p = parser()
    args = p.parse_args(argv)
    given = {k: getattr(args, k) for k in TINY if getattr(args, k) is not None}
    sizes = {**(TINY if args.cpu else DEFAULT), **given}
    device = "cpu" if args.cpu else "cuda"
    wanted = [w for w in args.only.split(",") if w]
    configs = [c for c in configurations(args.cpu or args.dry_run, peers=not args.no_peers)
               if not wanted or any(w in c[0] for w in wanted)]
    if not configs:
        p.error(f"argument --only: {args.only!r} matches no configuration")
    n = parameter_count(sizes["width"], sizes["layers"], sizes["vocab"], sizes["length"])
    log(f"decoder: width {sizes['width']}, {sizes['layers']} layers, vocabulary {sizes['vocab']}, {n / 1e9:.3f} B "
        f"parameters; batch {sizes['batch']} x {sizes['length']} tokens; on {device}")
    if args.dry_run:
        log("configurations" + (" (peers: only on a GPU run, when importable)" if not args.no_peers else "") + ":")
        for name, dtype, _, in_backward in configs:
            log(f"  {name} ({str(dtype).replace('torch.', '')} parameters"
                f"{', step in the backward' if in_backward else ''})")
        return 0
    if device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device here (--cpu runs a tiny self-check)")
    out = _out_path(args.out, device)
    rows = []
    for name, dtype, factory, in_backward in configs:
        try:
            rows.append(measure(name, dtype, factory, in_backward, sizes, device))
        except Exception as error:  # a peer that fails (old torchao, no bnb CUDA build) is a row with its error
            rows.append(dict(name=name, error=f"{type(error).__name__}: {error}"))
        log(json.dumps(rows[-1]))
    log("\n" + "\n".join(table(rows)))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   "model": dict(sizes, params=n), "rows": rows}, f, indent=1)
    log(f"wrote {out}")
    return 0
