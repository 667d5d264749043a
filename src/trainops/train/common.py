"""What the ``python -m trainops train`` demos share: data, the learning-rate schedule, evaluation,
progress, memory, the run result and its reports, and the command line's file checks.

The model modules (``gpt``, ``llama``, ``cnn``; ``fsdp`` on top of ``gpt``) import from here and
this module imports none of them: data flows one way (``cli`` -> model modules -> ``common``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import secrets
import sys
import sysconfig
from dataclasses import dataclass

import torch

# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------

def stdlib_bytes(limit: int) -> torch.Tensor:
    """The standard library's .py files, concatenated in sorted path order, at most ``limit`` bytes,
    as an int64 tensor of byte values."""
    return torch.frombuffer(bytearray(stdlib_source(limit)), dtype=torch.uint8).long()


def stdlib_source(limit: int) -> bytes:
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
    return b"".join(chunks)


class Batches:
    """Deterministic random windows: batch ``step`` depends only on (seed, step)."""

    def __init__(self, data: torch.Tensor, cfg, device: torch.device, split: int | None = None):
        """``data``: token ids; the first ``split`` (default 95%) train, the rest is held out.
        ``cfg``: any configuration with ``context``, ``batch``, ``accumulate`` and ``seed``."""
        split = int(len(data) * 0.95) if split is None else split
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
# Runs
# ----------------------------------------------------------------------------------------------

@dataclass
class RunResult:
    """One run: its name, loss per step, held-out loss, throughput (tokens/s; images/s for the cnn),
    mean ms a timed step, peak memory (MiB), the trainops kernels that ran
    ({(op, backend, kernel, dtype): calls}) and each timed step's ms."""

    name: str
    losses: list
    val_loss: float
    tokens_per_s: float
    step_ms: float
    peak_memory_mb: float
    kernels: dict
    step_times_ms: list


def autocast_dtype(cfg):
    """The autocast dtype of ``cfg.amp`` (none | fp16 | bf16): None, float16 or bfloat16."""
    return {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[cfg.amp]


def parameter_groups(model, weight_decay: float = 0.1):
    """Weight decay on matrices and kernels (2 or more dimensions), none on norms and biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def base_lr(cfg) -> float:
    """The configuration's peak learning rate; LAMB's is 10x (its step is lr * ||p|| per tensor).
    ``cfg``: any configuration with ``lr`` and ``optimizer``."""
    return cfg.lr * (10 if cfg.optimizer == "lamb" else 1)


def learning_rate(cfg, step: int) -> float:
    """Linear warm-up, then cosine decay to 10% (``cfg``: with ``lr``, ``optimizer``, ``warmup`` and
    ``steps``)."""
    peak = base_lr(cfg)
    if step < cfg.warmup:
        return peak * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


# ----------------------------------------------------------------------------------------------
# The trainops run's optimizer options (--optim-bits, --param-dtype, --master-weights,
# --stochastic-rounding, --step-in-backward, --clip-with-previous-norm, --max-grad-norm)
# ----------------------------------------------------------------------------------------------

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_runs(parser: argparse.ArgumentParser, text: str, choices, kind: str = "a run") -> list[str]:
    """``--runs``'s comma-separated names, each one of ``choices`` and none twice, or parser.error
    naming the argument (``kind``: what a name must be, e.g. "a --model cnn run")."""
    runs = [name.strip() for name in text.split(",")]
    unknown = [name for name in runs if name not in choices]
    if unknown or not runs:
        parser.error(f"argument --runs: {', '.join(map(repr, unknown)) or 'nothing'} is not {kind}; "
                     f"choose from {', '.join(choices)} (comma-separated)")
    if len(set(runs)) != len(runs):
        parser.error(f"argument --runs: a run is named twice in {text!r}")
    return runs


def check_optimizer_options(parser: argparse.ArgumentParser, args: argparse.Namespace, amp: str) -> None:
    """parser.error naming the flag for the optimizer options' combinations the trainops run
    cannot do (``amp``: the run's autocast, none | fp16 | bf16, defaults resolved), before any work.

    - ``--master-weights`` and ``--stochastic-rounding`` are for bfloat16 parameters
      (``--param-dtype bfloat16``), and exclude each other: stochastic rounding rounds the bfloat16
      parameters themselves, master weights keep the update in float32 copies;
    - ``--step-in-backward`` (trainops.optim.step_in_backward): no fp16 autocast (its GradScaler's
      inf/NaN skip needs every gradient before any update), and no global-norm clip unless
      ``--clip-with-previous-norm`` (the clip coefficient of the previous step's norm) or
      ``--max-grad-norm 0`` (no clip); gradient accumulation over micro-batches is the handle's
      ``accumulation_steps`` (the configuration's micro-batches), so it is supported;
    - ``--clip-with-previous-norm`` only with ``--step-in-backward`` and a clip."""
    bf16 = args.param_dtype == "bfloat16"
    if args.master_weights and not bf16:
        parser.error("argument --master-weights: float32 master weights are for bfloat16 parameters "
                     "(--param-dtype bfloat16); the parameters are float32")
    if args.stochastic_rounding:
        if not bf16:
            parser.error("argument --stochastic-rounding: rounds bfloat16 parameters (--param-dtype bfloat16); "
                         "the parameters are float32, which the step writes exactly")
        if args.master_weights:
            parser.error("argument --stochastic-rounding: rounds the bfloat16 parameters themselves; with "
                         "--master-weights the float32 masters take the update (choose one)")
    clips = args.max_grad_norm is None or args.max_grad_norm > 0   # None: the configuration's clip (1.0)
    if args.clip_with_previous_norm:
        if not args.step_in_backward:
            parser.error("argument --clip-with-previous-norm: only with --step-in-backward (a plain step clips "
                         "with this step's norm)")
        if not clips:
            parser.error("argument --clip-with-previous-norm: --max-grad-norm 0 turns the clip off")
    if args.step_in_backward:
        if amp == "fp16":
            parser.error("argument --step-in-backward: fp16 autocast needs a GradScaler, whose inf/NaN skip needs "
                         "every gradient before any update, which a step in the backward cannot wait for; use "
                         "--amp bf16 or --amp none")
        if clips and not args.clip_with_previous_norm:
            parser.error("argument --step-in-backward: a global-norm clip needs every gradient before the first "
                         "update; pass --max-grad-norm 0 (no clip) or --clip-with-previous-norm (the clip "
                         "coefficient of the previous step's norm)")


def optimizer_options(cfg) -> dict:
    """The trainops optimizer's keywords of a run configuration (``cfg``: with ``optim_bits``,
    ``master_weights``, ``stochastic_rounding``, ``seed`` and ``max_grad_norm``, 0 for no clip)."""
    options = dict(max_grad_norm=cfg.max_grad_norm or None, optim_bits=cfg.optim_bits,
                   master_weights=cfg.master_weights)
    if cfg.stochastic_rounding:
        options.update(stochastic_rounding=True, rounding_seed=cfg.seed)
    return options


def optimizer_description(cfg) -> str:
    """The trainops run's optimizer options that differ from the defaults, as ", ..." (or "")."""
    parts = [f"{cfg.optim_bits}-bit optimizer states"] if cfg.optim_bits != 32 else []
    if cfg.param_dtype != "float32":
        parts.append(f"{cfg.param_dtype} parameters" + (" with float32 masters" if cfg.master_weights else "")
                     + (" rounded stochastically" if cfg.stochastic_rounding else ""))
    if cfg.step_in_backward:
        parts.append("step in the backward" + (" (clip from the previous step's norm)"
                                               if cfg.clip_with_previous_norm else ""))
    if not cfg.max_grad_norm:
        parts.append("no gradient clip")
    return "".join(", " + part for part in parts)


def attach_step_in_backward(model, opt, cfg):
    """``trainops.optim.step_in_backward(model, opt)`` when ``cfg.step_in_backward`` (its
    ``accumulation_steps`` the configuration's micro-batches, ``clip_with_previous_norm`` as
    asked), else None. The handle's ``remove()`` gives the plain optimizer back."""
    if not cfg.step_in_backward:
        return None
    import trainops

    return trainops.optim.step_in_backward(model, opt, accumulation_steps=getattr(cfg, "accumulate", 1),
                                           clip_with_previous_norm=cfg.clip_with_previous_norm)


@torch.no_grad()
def evaluate(model, batches, amp_dtype, device, loss_of=lambda model, x, y: model(x, y)) -> float:
    """Mean held-out loss of ``loss_of(model, x, y)`` over the batches, in eval mode under the run's autocast."""
    model.eval()
    losses = []
    for x, y in batches:
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            losses.append(float(loss_of(model, x, y)))
    model.train()
    return sum(losses) / len(losses)


def show_progress(name, step, steps, loss, tokens_per_s, final=False, unit="tok/s"):
    """One progress line on stderr: redrawn in place on a terminal, else every tenth of the steps."""
    width = 24
    done = int(width * step / steps)
    line = f"\r{name:9s} [{'#' * done}{'.' * (width - done)}] step {step}/{steps} loss {loss:.4f} {tokens_per_s:,.0f} {unit}"
    if sys.stderr.isatty():
        sys.stderr.write(line + ("\n" if final else ""))
    elif final or step % max(1, steps // 10) == 0:
        sys.stderr.write(line.lstrip("\r") + "\n")
    sys.stderr.flush()


def peak_memory_mb(device: torch.device) -> float:
    """MiB: on CUDA the most allocated on ``device`` since its peak was reset; on the CPU the
    process's peak resident size so far (which only grows)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median(values) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def run_summary(result: RunResult, untimed_steps: int) -> str:
    """The run's final and validation loss, speed, peak memory and the trainops kernels that ran
    (``untimed_steps``: how many first steps of a run its demo leaves out of the timings)."""
    speed = (f"{result.tokens_per_s:,.0f} tokens/s, {result.step_ms:.1f} ms/step (median "
             f"{median(result.step_times_ms):.1f})" if result.step_times_ms else
             f"speed not measured (the first {untimed_steps} steps of a run are not timed)")
    lines = [f"{result.name}: final loss {sum(result.losses[-5:]) / len(result.losses[-5:]):.4f} (mean of last 5 "
             f"steps), validation loss {result.val_loss:.4f}, {speed}, peak memory {result.peak_memory_mb:,.0f} MiB"]
    if result.kernels:
        lines.append("  trainops kernels that ran (op, backend, kernel, dtype: calls):")
        for (op, backend, kernel, dtype), calls in sorted(result.kernels.items()):
            lines.append(f"    {op:22s} {backend:7s} {kernel:34s} {dtype:9s} {calls}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------

def reference_run(results: list[RunResult]) -> RunResult | None:
    """The run the others are compared with: PyTorch eager when it ran, else the first non-trainops one."""
    others = [r for r in results if not r.name.startswith("trainops")]
    return next((r for r in others if r.name == "pytorch"), others[0] if others else None)


def largest_relative_difference(losses: list, reference: list) -> float:
    """max over steps of |loss - reference| / |reference|."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def mean_relative_difference(losses: list, reference: list) -> float:
    """mean over steps of |loss - reference| / |reference|."""
    return sum(abs(a - b) / abs(b) for a, b in zip(losses, reference)) / len(reference)


def results_table(results: list[RunResult], device: torch.device, runs: dict, untimed_steps: int,
                  unit: str = "tokens/s") -> str:
    """One line per run: ``unit`` (a result's throughput), median step, speed against the reference
    run (of the medians), peak memory, final and held-out loss, and the largest and the mean relative
    distance of its loss curve from the reference's, step by step. ``runs``: each run's label;
    ``untimed_steps``: how many first steps of a run its demo leaves out of the timings."""
    reference = reference_run(results)
    memory = "peak MiB" if device.type == "cuda" else "peak RSS so far"
    lines = [f"{'run':32s} {unit:>10s} {'ms/step':>8s} {'speed':>6s} {memory:>15s} {'final':>7s} "
             f"{'held-out':>8s} {'curve vs ' + (reference.name if reference else '-') + ': max, mean':>32s}"]
    for r in results:
        timed = bool(r.step_times_ms)
        speed = (f"{median(reference.step_times_ms) / median(r.step_times_ms):5.2f}x"
                 if reference and timed and reference.step_times_ms else "     -")
        curve = (f"{100 * largest_relative_difference(r.losses, reference.losses):24.2f}%, "
                 f"{100 * mean_relative_difference(r.losses, reference.losses):5.2f}%"
                 if reference and r is not reference else f"{'-':>32s}")
        lines.append(f"{runs[r.name]:32s} {r.tokens_per_s if timed else math.nan:10,.0f} "
                     f"{median(r.step_times_ms):8.1f} {speed:>6s} {r.peak_memory_mb:15,.0f} "
                     f"{sum(r.losses[-5:]) / len(r.losses[-5:]):7.4f} {r.val_loss:8.4f} {curve}")
    if any(not r.step_times_ms for r in results):
        lines.append(f"(runs of at most {untimed_steps} steps are not timed)")
    return "\n".join(lines)


def curves_table(results: list[RunResult], every: int) -> str:
    """The runs' losses side by side, every ``every`` steps and the last."""
    lines = [f"{'step':>6s} " + " ".join(f"{r.name:>16s}" for r in results)]
    steps = len(results[0].losses)
    for i in sorted(set(range(0, steps, every)) | {steps - 1}):
        lines.append(f"{i + 1:6d} " + " ".join(f"{r.losses[i]:16.4f}" for r in results))
    return "\n".join(lines)


def plot_curves(results: list[RunResult], path: str, title: str, runs: dict) -> str:
    """The runs' loss curves (labelled ``runs[name]``) as an image at ``path``; what was done, as a line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(results):
        ax.plot(range(1, len(r.losses) + 1), r.losses, label=runs[r.name], lw=2 if i == 0 else 1,
                ls="-" if i == 0 else "--", alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


# ----------------------------------------------------------------------------------------------
# Files and the command line
# ----------------------------------------------------------------------------------------------

DEFAULT_PLOT = "train-compare.png"


def create_scratch_file(path: str) -> tuple[int, str]:
    """A new, uniquely named file next to ``path`` (``.<name>.<random>.tmp``), opened for writing,
    with the permissions a plain open would give: (descriptor, its path)."""
    folder, name = os.path.split(os.path.abspath(path))
    scratch = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    return os.open(scratch, flags, 0o666), scratch


def unwritable_reason(path: str) -> str | None:
    """Why no file can be written at ``path`` (None when one can), found by creating and removing a
    scratch file next to it, as save_checkpoint does."""
    if not path:
        return "the path is empty"
    if os.path.isdir(path) or path.endswith(os.sep):
        return f"{path} names a directory, not a file"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{path} exists and is not writable"
    try:
        descriptor, scratch = create_scratch_file(path)
    except OSError as exc:
        return f"cannot create a file in {os.path.dirname(os.path.abspath(path))}: {exc.strerror or exc}"
    os.close(descriptor)
    os.remove(scratch)
    return None


def checked_plot_path(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """Where --compare writes its plot, checked to be writable in a format matplotlib writes; None
    without --compare, or when matplotlib is not installed and --plot was not given."""
    if not args.compare:
        if args.plot is not None:
            parser.error("argument --plot: only used with --compare (it plots the two runs' loss curves)")
        return None
    path = DEFAULT_PLOT if args.plot is None else args.plot
    if importlib.util.find_spec("matplotlib") is None:
        if args.plot is not None:
            parser.error("argument --plot: needs matplotlib, which is not installed (pip install matplotlib)")
        return None
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if os.path.splitext(path)[1].lstrip(".").lower() not in formats:
        parser.error(f"argument --plot: {path} must end in an image format matplotlib writes "
                     f"(.{', .'.join(formats)})")
    reason = unwritable_reason(path)
    if reason:
        parser.error(f"argument --plot: {reason}")
    for option, other in (("--save", args.save), ("--resume", args.resume)):
        if other is not None and os.path.realpath(other) == os.path.realpath(path):
            parser.error(f"argument --plot: {path} is also the {option} checkpoint")
    return path
