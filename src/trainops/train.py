"""``python -m trainops train``: a byte-level GPT trained on the Python standard library's sources.

The model is written with plain torch.nn modules (Embedding, Softmax in attention,
CrossEntropyLoss); the trainops run swaps them with ``trainops.patch`` and trains with
``trainops.optim.AdamW`` (or LAMB), ``trainops.amp.GradScaler`` under fp16 autocast, and
``trainops.grad.accumulate_`` across micro-batches. ``--compare`` trains the same model, from
the same initial weights on the same batches, with plain PyTorch, and prints both loss curves.

Data: every ``*.py`` file of the running interpreter's standard library (nothing is downloaded),
read in sorted path order up to the configuration's byte budget; the last 5% is held out. Batch
``s`` is drawn from a generator seeded by (seed, s), so a resumed run sees the same batches as an
uninterrupted one.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn

CONFIGS = {
    # layers, width, heads, context, batch, micro-batches, steps, lr, data bytes
    "tiny": dict(n_layer=2, d_model=64, n_head=4, context=64, batch=8, accumulate=2, steps=30, lr=3e-3,
                 data_bytes=1 << 20),
    "small": dict(n_layer=4, d_model=128, n_head=4, context=128, batch=16, accumulate=2, steps=600, lr=2e-3,
                  data_bytes=4 << 20),
    "medium": dict(n_layer=8, d_model=512, n_head=8, context=512, batch=64, accumulate=2, steps=300, lr=1e-3,
                   data_bytes=64 << 20),
}


@dataclass
class Config:
    n_layer: int
    d_model: int
    n_head: int
    context: int
    batch: int
    accumulate: int
    steps: int
    lr: float
    data_bytes: int
    vocab: int = 256
    seed: int = 0
    warmup: int = 10
    optimizer: str = "adamw"
    amp: str = "none"          # none | fp16 | bf16
    max_grad_norm: float = 1.0
    compile: bool = False      # torch.compile the model's forward (both variants)


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------

def stdlib_bytes(limit: int) -> torch.Tensor:
    """The standard library's .py files, concatenated in sorted path order, at most ``limit`` bytes."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    chunks, total = [], 0
    for path in sorted(paths):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data[: limit - total])
        total += len(chunks[-1])
        if total >= limit:
            break
    if total < 1024:
        raise RuntimeError(f"trainops train: found only {total} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class Batches:
    """Deterministic random windows: batch ``step`` depends only on (seed, step)."""

    def __init__(self, data: torch.Tensor, cfg: Config, device: torch.device):
        split = int(len(data) * 0.95)
        self.train, self.val = data[:split], data[split:]
        self.cfg, self.device = cfg, device

    def _windows(self, source: torch.Tensor, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(source) - self.cfg.context - 1, (n,), generator=gen)
        idx = starts[:, None] + torch.arange(self.cfg.context + 1)
        window = source[idx]
        return window[:, :-1].to(self.device), window[:, 1:].to(self.device)

    def train_batch(self, step: int):
        """``accumulate`` micro-batches of ``batch // accumulate`` sequences."""
        x, y = self._windows(self.train, self.cfg.batch, self.cfg.seed * 1_000_003 + step)
        return list(zip(x.chunk(self.cfg.accumulate), y.chunk(self.cfg.accumulate)))

    def val_batches(self, n: int = 4):
        return [self._windows(self.val, self.cfg.batch, 7_777_777 + i) for i in range(n)]


# ----------------------------------------------------------------------------------------------
# Model: plain torch.nn; trainops.patch swaps Embedding, Softmax and CrossEntropyLoss
# ----------------------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.softmax = nn.Softmax(dim=-1)
        self.register_buffer("causal", torch.ones(cfg.context, cfg.context, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)).float() * (1.0 / math.sqrt(c // self.n_head))
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        y = self.softmax(scores).to(v.dtype) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        self.positions = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layer)])
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.loss = nn.CrossEntropyLoss()
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x, y):
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.ln(self.blocks(self.tokens(x) + self.positions(pos)))
        logits = self.head(h)
        return self.loss(logits.view(-1, logits.shape[-1]), y.reshape(-1))


# ----------------------------------------------------------------------------------------------
# One run
# ----------------------------------------------------------------------------------------------

@dataclass
class RunResult:
    name: str
    losses: list
    val_loss: float
    tokens_per_s: float
    step_ms: float
    peak_memory_mb: float
    kernels: dict
    step_times_ms: list


def build(cfg: Config, device: torch.device, use_trainops: bool):
    """Model, its (optionally compiled) forward, optimizer, scaler, autocast dtype, patch report.
    Same initial weights for both variants (same seed)."""
    import trainops

    torch.manual_seed(cfg.seed)
    model = GPT(cfg).to(device)
    report = None
    if use_trainops:
        report = trainops.patch(model)
        model.loss.loss_dtype = torch.float32   # half logits in, float32 loss out (torch's autocast does the same)
        model.tokens.check_index = model.positions.check_index = False  # bytes and positions: valid by construction
    amp_dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[cfg.amp]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if use_trainops:
        opt_cls = trainops.optim.LAMB if cfg.optimizer == "lamb" else trainops.optim.AdamW
        opt = opt_cls(groups, lr=base_lr(cfg), betas=(0.9, 0.95), max_grad_norm=cfg.max_grad_norm)
        scaler = trainops.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    else:
        if cfg.optimizer == "lamb":
            raise SystemExit("trainops train: --compare with --optimizer lamb has no PyTorch counterpart")
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
        scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    forward = torch.compile(model) if cfg.compile else model
    return model, forward, opt, scaler, amp_dtype, report


def base_lr(cfg: Config) -> float:
    """The configuration's peak learning rate; LAMB's is 10x (its step is lr * ||p|| per tensor)."""
    return cfg.lr * (10 if cfg.optimizer == "lamb" else 1)


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    peak = base_lr(cfg)
    if step < cfg.warmup:
        return peak * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_step(model, forward, opt, scaler, micro_batches, amp_dtype, use_trainops, device, max_grad_norm):
    """Forward/backward over the micro-batches (gradients summed), then one optimizer step."""
    import trainops

    params = [p for p in model.parameters() if p.requires_grad]
    accumulated = None
    total = 0.0
    for x, y in micro_batches:
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = forward(x, y) / len(micro_batches)
        scaler.scale(loss).backward()
        total += loss.detach()
        if use_trainops:
            # Gradients of each micro-batch land in fresh buffers and are summed by one multi-tensor launch.
            if accumulated is None:
                accumulated = [p.grad for p in params]
            else:
                trainops.grad.accumulate_(accumulated, [p.grad for p in params])
            for p in params:
                p.grad = None
    if use_trainops:
        for p, g in zip(params, accumulated):
            p.grad = g
    else:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def evaluate(model, batches, amp_dtype, device) -> float:
    model.eval()
    losses = []
    for x, y in batches:
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            losses.append(float(model(x, y)))
    model.train()
    return sum(losses) / len(losses)


def _progress(name, step, steps, loss, tokens_per_s, final=False):
    width = 24
    done = int(width * step / steps)
    line = f"\r{name:9s} [{'#' * done}{'.' * (width - done)}] step {step}/{steps} loss {loss:.4f} {tokens_per_s:,.0f} tok/s"
    if sys.stderr.isatty():
        sys.stderr.write(line + ("\n" if final else ""))
    elif final or step % max(1, steps // 10) == 0:
        sys.stderr.write(line.lstrip("\r") + "\n")
    sys.stderr.flush()


def run(cfg: Config, device: torch.device, use_trainops: bool, data: torch.Tensor, *, resume: str | None = None,
        save: str | None = None, quiet: bool = False) -> RunResult:
    import trainops

    name = "trainops" if use_trainops else "pytorch"
    model, forward, opt, scaler, amp_dtype, report = build(cfg, device, use_trainops)
    if report is not None and not quiet:
        print(report)
    batches = Batches(data, cfg, device)
    start, losses = 0, []
    if resume:
        state = torch.load(resume, map_location=device, weights_only=False)
        if state["variant"] != name:
            raise SystemExit(f"trainops train: {resume} is a {state['variant']} checkpoint; this run is {name}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start, losses = state["step"], state["losses"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens_per_step = cfg.batch * cfg.context
    timed_tokens, timed_seconds, step_times = 0, 0.0, []
    with trainops.track_kernels() as used:
        for step in range(start, cfg.steps):
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg, step)
            t0 = time.perf_counter()
            loss = train_step(model, forward, opt, scaler, batches.train_batch(step), amp_dtype, use_trainops,
                              device, cfg.max_grad_norm)
            losses.append(float(loss))  # one host read per step (the progress bar shows it)
            elapsed = time.perf_counter() - t0
            if step - start >= 2:  # the first steps compile kernels
                timed_tokens += tokens_per_step
                timed_seconds += elapsed
                step_times.append(1e3 * elapsed)
            if not quiet:
                _progress(name, step + 1, cfg.steps, losses[-1], timed_tokens / timed_seconds if timed_seconds else 0,
                          final=step + 1 == cfg.steps)
    val = evaluate(model, batches.val_batches(), amp_dtype, device)
    if save:
        torch.save(dict(variant=name, config=asdict(cfg), model=model.state_dict(), optimizer=opt.state_dict(),
                        scaler=scaler.state_dict(), step=cfg.steps, losses=losses), save)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else _cpu_peak_mb()
    return RunResult(name, losses, val, timed_tokens / timed_seconds if timed_seconds else float("nan"),
                     1e3 * timed_seconds / max(1, timed_tokens // tokens_per_step), peak, dict(used), step_times)


def _cpu_peak_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _median(values) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def summary(result: RunResult) -> str:
    lines = [f"{result.name}: final loss {sum(result.losses[-5:]) / len(result.losses[-5:]):.4f} (mean of last 5 "
             f"steps), validation loss {result.val_loss:.4f}, {result.tokens_per_s:,.0f} tokens/s, "
             f"{result.step_ms:.1f} ms/step (median {_median(result.step_times_ms):.1f}), "
             f"peak memory {result.peak_memory_mb:,.0f} MiB"]
    if result.kernels:
        lines.append("  trainops kernels that ran (op, backend, kernel, dtype: calls):")
        for (op, backend, kernel, dtype), calls in sorted(result.kernels.items()):
            lines.append(f"    {op:22s} {backend:7s} {kernel:34s} {dtype:9s} {calls}")
    return "\n".join(lines)


def compare_table(ours: RunResult, ref: RunResult, every: int) -> str:
    lines = [f"{'step':>6s} {'trainops':>10s} {'pytorch':>10s} {'diff':>10s}"]
    for i in range(0, len(ours.losses), every):
        lines.append(f"{i + 1:6d} {ours.losses[i]:10.4f} {ref.losses[i]:10.4f} {ours.losses[i] - ref.losses[i]:10.2e}")
    worst = max(abs(a - b) for a, b in zip(ours.losses, ref.losses))
    lines.append(f"largest difference over {len(ours.losses)} steps: {worst:.2e}; "
                 f"step time trainops / pytorch: {ours.step_ms / ref.step_ms:.2f}")
    return "\n".join(lines)


def plot(ours: RunResult, ref: RunResult, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(ref.losses) + 1), ref.losses, label="pytorch", lw=2, alpha=0.6)
    ax.plot(range(1, len(ours.losses) + 1), ours.losses, label="trainops", lw=1, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainops train", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--config", default="small", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW's; LAMB uses 10x)")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "lamb"])
    parser.add_argument("--amp", default=None, choices=["none", "fp16", "bf16"],
                        help="autocast dtype (default: fp16 on cuda, none on cpu)")
    parser.add_argument("--compare", action="store_true", help="also train with plain PyTorch and compare")
    parser.add_argument("--plot", default="train-compare.png", help="PNG of both loss curves (with --compare)")
    parser.add_argument("--save", default=None, help="checkpoint path written at the end")
    parser.add_argument("--resume", default=None, help="checkpoint to continue from (same config)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (both runs)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("trainops train: --device cuda asked for, but no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Config(**CONFIGS[args.config])
    amp = args.amp or ("fp16" if device.type == "cuda" else "none")
    cfg = replace(cfg, optimizer=args.optimizer, amp=amp, steps=args.steps or cfg.steps, lr=args.lr or cfg.lr,
                  compile=args.compile)
    data = stdlib_bytes(cfg.data_bytes)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"trainops train: {args.config} GPT ({cfg.n_layer} layers, width {cfg.d_model}, {params / 1e6:.2f} M "
          f"parameters), {len(data) / 2**20:.1f} MiB of standard-library source, {cfg.steps} steps of "
          f"{cfg.batch}x{cfg.context} tokens ({cfg.accumulate} micro-batches), {cfg.optimizer}, amp {cfg.amp}, "
          f"{'torch.compile, ' if cfg.compile else ''}on {device}")
    ours = run(cfg, device, True, data, resume=args.resume, save=args.save)
    print(summary(ours))
    if args.compare:
        ref = run(cfg, device, False, data, resume=None, quiet=False)
        print(summary(ref))
        print(compare_table(ours, ref, every=max(1, len(ours.losses) // 15)))
        print(plot(ours, ref, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
