"""``python -m trainops train`` (``--model gpt``, the default): a byte-level GPT trained on the Python
standard library's sources.

(``--model llama`` trains transformers's LlamaForCausalLM on BPE tokens of the same sources instead:
``trainops.train.llama``; ``--fsdp`` under torchrun shards this GPT with FSDP2 over the ranks:
``trainops.train.fsdp``; ``trainops.train.cli`` parses the command line for all of them and hands
the gpt model's arguments to ``config_from_args`` and ``main_gpt`` here.)

The model is Llama-style: pre-norm blocks with RMSNorm, rotary position embeddings, causal
attention with an explicit softmax, a SwiGLU MLP, tied embeddings, dropout available
(``--dropout``). It is written once over a set of ops (``Kernels``): the PyTorch run uses torch's
(nn.RMSNorm, Hugging Face's rotate-half, a masked float32 softmax, silu(gate) * up, F.dropout),
the trainops run trainops's (trainops.nn.RMSNorm with the residual add fused into it where the
stream and the branch share a dtype, rotary_embedding, attention_softmax, swiglu, dropout), and
``trainops.patch`` swaps its Embedding and CrossEntropyLoss. The trainops run trains with
``trainops.optim.AdamW`` (or LAMB), ``trainops.amp.GradScaler`` under fp16 autocast, and
``trainops.grad.accumulate_`` across micro-batches. ``--compare`` trains the same model, from
the same initial weights on the same batches, with plain PyTorch, and prints both loss curves.

Data: every ``*.py`` file of the running interpreter's standard library (nothing is downloaded),
read in sorted path order up to the configuration's byte budget; the last 5% is held out. Batch
``s`` is drawn from a generator seeded by (seed, s), so a resumed run sees the same batches as an
uninterrupted one; so are dropout's random numbers (the global generator reseeded from (seed, step)
before each step).

Checkpoints: ``--save`` writes one at the end of the trainops run, atomically (a crash mid-save
leaves the previous file intact); ``--resume`` reads one with ``torch.load(weights_only=True)``, since
a checkpoint file is untrusted input, and continues only the run it came from.

The command line checks every argument, and the ``--resume`` checkpoint, before it reads data or
trains: a user error exits with status 2 and one line ``python -m trainops train: error: argument
--<name>: ...`` (argparse's convention). A traceback means a bug.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import (PARAM_DTYPES, Batches, RunResult, attach_step_in_backward, autocast_dtype, base_lr,
                     check_optimizer_options, checked_plot_path, create_scratch_file, evaluate, learning_rate,
                     optimizer_description, optimizer_options, parameter_groups, peak_memory_mb, run_summary,
                     show_progress, stdlib_bytes, unwritable_reason)

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
    dropout: float = 0.0       # on attention probabilities and each block's two branch outputs
    # the trainops run's optimizer options (common.optimizer_options, common.attach_step_in_backward)
    optim_bits: int = 32
    param_dtype: str = "float32"   # float32 | bfloat16
    master_weights: bool = False
    stochastic_rounding: bool = False
    step_in_backward: bool = False
    clip_with_previous_norm: bool = False

    @property
    def d_ff(self) -> int:
        """SwiGLU's hidden width: 8/3 of the model's (Llama's ratio), a multiple of 64."""
        return 64 * math.ceil(8 * self.d_model / 3 / 64)


# ----------------------------------------------------------------------------------------------
# Model: a Llama-style block (pre-norm RMSNorm, rotary attention, SwiGLU MLP) written once, run
# with either PyTorch's ops or trainops's (Kernels below); trainops.patch swaps Embedding and
# CrossEntropyLoss in the trainops run
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kernels:
    """The block's ops, PyTorch's (``TORCH_KERNELS``: what a user writes without trainops) or
    trainops's (``trainops_kernels()``). Both compute the same function on the same parameters.

    rms_norm: the norm module class. add_norm(norm, branch, residual) -> (norm(s), s) with
    s = residual + branch (branch None: s = residual; dtypes promoted as torch's add).
    rotary(q, k, cos, sin) -> (q, k) rotated (rotate-half). attention_softmax(scores, scale, causal,
    p) -> dropout(softmax(scores * scale, causally masked), p) in scores' dtype (``causal``: the
    (t, t) boolean mask, True = keep). swiglu(x) -> silu(x[..., :n]) * x[..., n:]. dropout(x, p)
    -> F.dropout(x, p)."""

    name: str
    rms_norm: type
    add_norm: Callable
    rotary: Callable
    attention_softmax: Callable
    swiglu: Callable
    dropout: Callable


def _torch_add_norm(norm, branch, residual):
    s = residual if branch is None else residual + branch
    return norm(s), s


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _torch_rotary(q, k, cos, sin):  # Hugging Face's apply_rotary_pos_emb
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _torch_attention_softmax(scores, scale, causal, p):
    z = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale   # half scores: float32 math
    probs = torch.softmax(z.masked_fill(~causal, float("-inf")), dim=-1)
    return F.dropout(probs, p).to(scores.dtype) if p else probs.to(scores.dtype)


def _torch_swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


TORCH_KERNELS = Kernels("pytorch", nn.RMSNorm, _torch_add_norm, _torch_rotary, _torch_attention_softmax,
                        _torch_swiglu, F.dropout)


def trainops_kernels() -> Kernels:
    import trainops

    def add_norm(norm, branch, residual):
        if branch is None or branch.dtype != residual.dtype:
            # autocast: a half branch into the float32 residual stream (the embedding's dtype); the fused
            # add takes one dtype, and casting the branch first would move more bytes than torch's add
            return _torch_add_norm(norm, branch, residual)
        return norm(branch, residual)

    def attention_softmax(scores, scale, causal, p):
        return trainops.attention_softmax(scores, scale=scale, causal=True, dropout_p=p)

    return Kernels("trainops", trainops.nn.RMSNorm, add_norm, trainops.rotary_embedding, attention_softmax,
                   trainops.swiglu, trainops.dropout)


def rotary_tables(context: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (context, head_dim) float32, in Hugging Face's duplicated rotate-half layout."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(context, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


class Attention(nn.Module):
    def __init__(self, cfg: Config, kernels: Kernels):
        super().__init__()
        self.kernels, self.n_head, self.dropout = kernels, cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.register_buffer("causal", torch.ones(cfg.context, cfg.context, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x, cos, sin):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = self.kernels.rotary(q, k, cos, sin)
        scores = q @ k.transpose(-2, -1)
        probs = self.kernels.attention_softmax(scores, 1.0 / math.sqrt(c // self.n_head), self.causal[:t, :t],
                                               self.dropout if self.training else 0.0)
        y = probs.to(v.dtype) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: Config, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down(self.kernels.swiglu(self.gate_up(x)))


class Block(nn.Module):
    """Pre-norm: takes the residual stream and the previous block's branch output not yet added to
    it (None for the first block), returns both for the next; the add is fused into the norm."""

    def __init__(self, cfg: Config, kernels: Kernels):
        super().__init__()
        self.kernels, self.dropout = kernels, cfg.dropout
        self.norm1, self.norm2 = kernels.rms_norm(cfg.d_model, eps=1e-5), kernels.rms_norm(cfg.d_model, eps=1e-5)
        self.attn = Attention(cfg, kernels)
        self.mlp = MLP(cfg, kernels)

    def _branch_dropout(self, y):
        return self.kernels.dropout(y, self.dropout) if self.dropout and self.training else y

    def forward(self, x, branch, cos, sin):
        h, x = self.kernels.add_norm(self.norm1, branch, x)
        h, x = self.kernels.add_norm(self.norm2, self._branch_dropout(self.attn(h, cos, sin)), x)
        return x, self._branch_dropout(self.mlp(h))


class GPT(nn.Module):
    def __init__(self, cfg: Config, kernels: Kernels = TORCH_KERNELS):
        super().__init__()
        self.kernels = kernels
        self.tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg, kernels) for _ in range(cfg.n_layer)])
        self.norm = kernels.rms_norm(cfg.d_model, eps=1e-5)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.loss = nn.CrossEntropyLoss()
        cos, sin = rotary_tables(cfg.context, cfg.d_model // cfg.n_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, x, y):
        t = x.shape[1]
        h, branch = self.tokens(x), None
        for block in self.blocks:
            h, branch = block(h, branch, self.cos[:t], self.sin[:t])
        h, _ = self.kernels.add_norm(self.norm, branch, h)
        logits = self.head(h)
        return self.loss(logits.view(-1, logits.shape[-1]), y.reshape(-1))


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that this run cannot continue; the message is one line."""


# A checkpoint is a dict of exactly these entries; its values hold nothing but tensors, dtypes, strings,
# numbers, booleans and None, in dicts, lists and tuples (all within torch's weights-only allow-list).
CHECKPOINT_ENTRIES = {"variant": str, "config": dict, "model": dict, "optimizer": dict, "scaler": dict, "step": int,
                      "losses": list}
_CHECKPOINT_LEAF_TYPES = (torch.Tensor, torch.dtype, str, int, float, bool, type(None))
# The Config fields a command line sets besides --config, with their options.
_OPTION_FIELDS = {"steps": "--steps", "lr": "--lr", "optimizer": "--optimizer", "amp": "--amp", "compile": "--compile",
                  "dropout": "--dropout", "max_grad_norm": "--max-grad-norm", "optim_bits": "--optim-bits",
                  "param_dtype": "--param-dtype", "master_weights": "--master-weights",
                  "stochastic_rounding": "--stochastic-rounding", "step_in_backward": "--step-in-backward",
                  "clip_with_previous_norm": "--clip-with-previous-norm"}


def _first_type_outside(value, allowed: tuple) -> type | None:
    """The type of the first value in ``value`` (dicts, lists and tuples walked, keys included) that
    is none of ``allowed``; None when every one is."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending += item.keys()
            pending += item.values()
        elif isinstance(item, (list, tuple)):
            pending += item
        elif not isinstance(item, allowed):
            return type(item)
    return None


def read_checkpoint(path: str) -> dict:
    """The checkpoint at ``path``, loaded onto the CPU with ``torch.load(weights_only=True)``: loading
    it cannot import or call anything. Raises CheckpointError for a file that cannot be read, is not
    a torch file (or is truncated), is refused by the weights-only loader, or does not have the
    entries of a checkpoint written by ``run(save=...)`` (CHECKPOINT_ENTRIES)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on foreign pickle protocols: the outcome is reported below
            state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # torch.load reports a bad file with many types: KeyError, EOFError, RuntimeError...
        blocked = re.search(r"GLOBAL (\S+)", str(exc)) if isinstance(exc, pickle.UnpicklingError) else None
        if blocked:
            raise CheckpointError(f"refused {path}: loading it would import {blocked.group(1)}, which no checkpoint "
                                  "does (read with torch.load(weights_only=True))") from None
        raise CheckpointError(f"{path} is not a checkpoint: torch.load(weights_only=True) cannot read it (truncated, "
                              "not written by torch.save, or holding more than tensors and plain values)") from None
    entries = ", ".join(CHECKPOINT_ENTRIES)
    if not (isinstance(state, dict) and set(state) == set(CHECKPOINT_ENTRIES)
            and all(isinstance(state[k], t) for k, t in CHECKPOINT_ENTRIES.items())):
        raise CheckpointError(f"{path} is a torch file but not a checkpoint of python -m trainops train "
                              f"(a dict of {entries})")
    outside = _first_type_outside(state, _CHECKPOINT_LEAF_TYPES)
    if outside is not None:
        raise CheckpointError(f"{path} holds a {outside.__module__}.{outside.__qualname__}, which no checkpoint does")
    if set(state["config"]) != {f.name for f in fields(Config)}:
        raise CheckpointError(f"{path} holds a configuration with other fields than this version's: "
                              f"{', '.join(sorted(state['config']))}")
    if (state["variant"] not in ("trainops", "pytorch") or state["step"] < 0 or len(state["losses"]) != state["step"]
            or not all(isinstance(x, float) for x in state["losses"])):
        raise CheckpointError(f"{path} is inconsistent: variant {state['variant']!r}, step {state['step']}, "
                              f"{len(state['losses'])} losses")
    return state


def config_name(cfg: Config) -> str | None:
    """The --config whose entries ``cfg`` has (the fields the command line sets aside), or None."""
    for name, entries in CONFIGS.items():
        named = replace(Config(**entries), **{f: getattr(cfg, f) for f in _OPTION_FIELDS})
        if named == cfg:
            return name
    return None


def _config_option(cfg: Config) -> str:
    name = config_name(cfg)
    return f"--config {name}" if name else "a configuration that no --config gives"


def check_continues(checkpoint: dict, cfg: Config, variant: str, path: str) -> None:
    """Raise CheckpointError unless ``checkpoint`` (from read_checkpoint) can be continued by this run:
    the same variant, --config, --optimizer, --amp, --lr, --dropout, --param-dtype and --master-weights, and
    ``cfg.steps`` past its step. --steps, --compile, --max-grad-norm and the optimizer's other options may
    differ (the learning-rate schedule then follows this run's steps; 8-bit and float32 optimizer states
    convert on load)."""
    if checkpoint["variant"] != variant:
        raise CheckpointError(f"{path} is a checkpoint of the {checkpoint['variant']} run; this is the {variant} run")
    saved = Config(**checkpoint["config"])
    from_config = [f.name for f in fields(Config) if f.name not in _OPTION_FIELDS]
    if any(getattr(saved, f) != getattr(cfg, f) for f in from_config):
        raise CheckpointError(f"{path} was saved by a {_config_option(saved)} run; this run has {_config_option(cfg)}")
    for field in ("optimizer", "amp", "lr", "dropout", "param_dtype", "master_weights"):
        option, before, now = _OPTION_FIELDS[field], getattr(saved, field), getattr(cfg, field)
        if before != now:
            raise CheckpointError(f"{path} was trained with {option} {before}; this run has {option} {now} "
                                  f"(resume with {option} {before})")
    if checkpoint["step"] >= cfg.steps:
        raise CheckpointError(f"{path} is at step {checkpoint['step']}, and this run ends at step {cfg.steps} "
                              f"(pass --steps greater than {checkpoint['step']} to train it further)")


def restore(checkpoint: dict, model: nn.Module, opt, scaler, path: str) -> None:
    """Load the checkpoint's model, optimizer and scaler states; CheckpointError when they do not fit."""
    try:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise CheckpointError(f"{path} does not fit this run's model and optimizer: {reason}") from None


def save_checkpoint(checkpoint: dict, path: str) -> None:
    """Write ``checkpoint`` to ``path`` atomically: into a new file in the same folder, flushed to
    disk, then renamed over ``path``. A crash mid-save leaves whatever was at ``path`` as it was."""
    descriptor, scratch = create_scratch_file(path)
    try:
        with os.fdopen(descriptor, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(scratch, path)
    except BaseException:
        if os.path.exists(scratch):
            os.remove(scratch)
        raise


# ----------------------------------------------------------------------------------------------
# One run
# ----------------------------------------------------------------------------------------------

UNTIMED_STEPS = 2  # the first steps of a run (resumed or not) compile kernels: left out of the timings


def build(cfg: Config, device: torch.device, use_trainops: bool, shard: Callable | None = None):
    """Model, its (optionally compiled) forward, optimizer, scaler, autocast dtype, patch report.
    Same initial weights for both variants (same seed). ``shard(model)``: FSDP2's wrapping
    (trainops.train.fsdp), applied after the patch and before the optimizer sees the parameters."""
    import trainops

    torch.manual_seed(cfg.seed)
    model = GPT(cfg, trainops_kernels() if use_trainops else TORCH_KERNELS).to(device)
    report = None
    if use_trainops:
        model.to(PARAM_DTYPES[cfg.param_dtype])
        report = trainops.patch(model)
        model.loss.loss_dtype = torch.float32   # half logits in, float32 loss out (torch's autocast does the same)
        model.tokens.check_index = False  # bytes: valid by construction
    if shard is not None:
        shard(model)
    amp_dtype = autocast_dtype(cfg)
    groups = parameter_groups(model, weight_decay=0.1)
    if use_trainops:
        opt_cls = trainops.optim.LAMB if cfg.optimizer == "lamb" else trainops.optim.AdamW
        opt = opt_cls(groups, lr=base_lr(cfg), betas=(0.9, 0.95), **optimizer_options(cfg))
        scaler = trainops.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    else:
        if cfg.optimizer == "lamb":
            raise ValueError("trainops train: the PyTorch run has no LAMB (torch.optim has none)")
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
        if shard is not None:   # what torch offers for sharded gradients: found_inf agreed over the ranks
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
            scaler = ShardedGradScaler(device.type, enabled=amp_dtype == torch.float16)
        else:
            scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    forward = torch.compile(model) if cfg.compile else model
    return model, forward, opt, scaler, amp_dtype, report


def train_step(model, forward, opt, scaler, micro_batches, amp_dtype, use_trainops, device, max_grad_norm,
               sharded=False, in_backward=False):
    """Forward/backward over the micro-batches (gradients summed), then one optimizer step.
    ``sharded``: an FSDP2 model, which sums the micro-batches' gradients into its sharded ones.
    ``in_backward``: the optimizer steps in the last micro-batch's backward (a step_in_backward
    handle, whose accumulation_steps are the micro-batches: autograd sums their gradients);
    ``opt.step`` and ``zero_grad`` are then no-ops. ``max_grad_norm`` 0: no clip."""
    import trainops

    params = [p for p in model.parameters() if p.requires_grad]
    accumulated = None
    total = 0.0
    for x, y in micro_batches:
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = forward(x, y) / len(micro_batches)
        scaler.scale(loss).backward()
        total += loss.detach()
        if use_trainops and not sharded and not in_backward:
            # Gradients of each micro-batch land in fresh buffers and are summed by one multi-tensor launch.
            if accumulated is None:
                accumulated = [p.grad for p in params]
            else:
                trainops.grad.accumulate_(accumulated, [p.grad for p in params])
            for p in params:
                p.grad = None
    if use_trainops and not sharded and not in_backward:
        for p, g in zip(params, accumulated):
            p.grad = g
    elif not use_trainops and max_grad_norm:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return total


def run(cfg: Config, device: torch.device, use_trainops: bool, data: torch.Tensor, *,
        resume: str | dict | None = None, save: str | None = None, quiet: bool = False) -> RunResult:
    """Train ``cfg.steps`` steps (from the checkpoint's step when resuming) and evaluate.

    ``resume``: a checkpoint path, or a checkpoint read_checkpoint returned; it must continue this
    run (check_continues), else CheckpointError before any step. ``save``: path of the checkpoint
    written at the end (save_checkpoint)."""
    import trainops

    name = "trainops" if use_trainops else "pytorch"
    checkpoint = read_checkpoint(resume) if isinstance(resume, str) else resume
    resume_path = resume if isinstance(resume, str) else "the checkpoint"
    if checkpoint is not None:
        check_continues(checkpoint, cfg, name, resume_path)
    model, forward, opt, scaler, amp_dtype, report = build(cfg, device, use_trainops)
    start, losses = 0, []
    if checkpoint is not None:
        restore(checkpoint, model, opt, scaler, resume_path)
        start, losses = checkpoint["step"], list(checkpoint["losses"])
    handle = attach_step_in_backward(model, opt, cfg) if use_trainops else None
    if report is not None and not quiet:
        print(report)
    batches = Batches(data, cfg, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens_per_step = cfg.batch * cfg.context
    timed_tokens, timed_seconds, step_times = 0, 0.0, []
    with trainops.track_kernels() as used:
        for step in range(start, cfg.steps):
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg, step)
            if cfg.dropout:
                # dropout's random numbers depend on (seed, step) only, like the batches: a resumed run
                # draws what an uninterrupted one would have
                torch.manual_seed(cfg.seed * 1_000_003 + step)
            t0 = time.perf_counter()
            loss = train_step(model, forward, opt, scaler, batches.train_batch(step), amp_dtype, use_trainops,
                              device, cfg.max_grad_norm, in_backward=handle is not None)
            losses.append(float(loss))  # one host read per step (the progress bar shows it)
            elapsed = time.perf_counter() - t0
            if step - start >= UNTIMED_STEPS:
                timed_tokens += tokens_per_step
                timed_seconds += elapsed
                step_times.append(1e3 * elapsed)
            if not quiet:
                show_progress(name, step + 1, cfg.steps, losses[-1],
                              timed_tokens / timed_seconds if timed_seconds else 0, final=step + 1 == cfg.steps)
    if handle is not None:
        handle.remove()
    val = evaluate(model, batches.val_batches(), amp_dtype, device)
    if save:
        save_checkpoint(dict(variant=name, config=asdict(cfg), model=model.state_dict(), optimizer=opt.state_dict(),
                             scaler=scaler.state_dict(), step=cfg.steps, losses=losses), save)
    peak = peak_memory_mb(device)
    timed_steps = timed_tokens // tokens_per_step
    return RunResult(name, losses, val, timed_tokens / timed_seconds if timed_seconds else float("nan"),
                     1e3 * timed_seconds / timed_steps if timed_steps else float("nan"), peak, dict(used), step_times)


def summary(result: RunResult) -> str:
    """The run's report lines (``common.run_summary`` with this demo's UNTIMED_STEPS)."""
    return run_summary(result, UNTIMED_STEPS)


def compare_table(ours: RunResult, ref: RunResult, every: int) -> str:
    """Both runs' losses, every ``every`` steps, their differences, the largest, and the step-time ratio."""
    lines = [f"{'step':>6s} {'trainops':>10s} {'pytorch':>10s} {'diff':>10s}"]
    for i in range(0, len(ours.losses), every):
        lines.append(f"{i + 1:6d} {ours.losses[i]:10.4f} {ref.losses[i]:10.4f} {ours.losses[i] - ref.losses[i]:10.2e}")
    worst = max(abs(a - b) for a, b in zip(ours.losses, ref.losses))
    ratio = f"{ours.step_ms / ref.step_ms:.2f}" if ours.step_times_ms and ref.step_times_ms else "not measured"
    lines.append(f"largest difference over {len(ours.losses)} steps: {worst:.2e}; "
                 f"step time trainops / pytorch: {ratio}")
    return "\n".join(lines)


def plot(ours: RunResult, ref: RunResult, path: str) -> str:
    """Both loss curves as an image at ``path``; what was done, as a line."""
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
    plt.close(fig)
    return f"wrote {path}"


# ----------------------------------------------------------------------------------------------
# Command line (``trainops.train.cli`` parses the arguments and hands ``--model gpt`` here)
# ----------------------------------------------------------------------------------------------

def _checkpoint_to_resume(path: str, cfg: Config) -> dict:
    """read_checkpoint and check_continues, then a trial restore into a throw-away CPU copy of the
    trainops run, so that a checkpoint that does not fit fails before any work, not at the first step."""
    checkpoint = read_checkpoint(path)
    check_continues(checkpoint, cfg, "trainops", path)
    model, _, opt, scaler, _, _ = build(replace(cfg, compile=False), torch.device("cpu"), True)
    restore(checkpoint, model, opt, scaler, path)
    return checkpoint


def config_from_args(parser, args) -> tuple[Config, str | None]:
    """The run's Config from --config and the options, and --compare's plot path (checked), or
    parser.error naming the argument; shared by the single-process run and --fsdp."""
    if args.config not in CONFIGS:
        parser.error(f"argument --config: --model gpt has {', '.join(CONFIGS)}; got {args.config!r}")
    device = args.device
    cfg = Config(**CONFIGS[args.config])
    cfg = replace(cfg, optimizer=args.optimizer, amp=args.amp or ("fp16" if device.type == "cuda" else "none"),
                  steps=cfg.steps if args.steps is None else args.steps, lr=cfg.lr if args.lr is None else args.lr,
                  compile=args.compile, dropout=args.dropout)
    check_optimizer_options(parser, args, cfg.amp)
    cfg = replace(cfg, max_grad_norm=cfg.max_grad_norm if args.max_grad_norm is None else args.max_grad_norm,
                  optim_bits=args.optim_bits, param_dtype=args.param_dtype, master_weights=args.master_weights,
                  stochastic_rounding=args.stochastic_rounding, step_in_backward=args.step_in_backward,
                  clip_with_previous_norm=args.clip_with_previous_norm)
    if args.compare and cfg.optimizer == "lamb":
        parser.error("argument --compare: the PyTorch run has no LAMB (torch.optim has none); "
                     "compare with --optimizer adamw")
    return cfg, checked_plot_path(parser, args)


def main_gpt(parser, args, cfg: Config, plot_path: str | None) -> int:
    """``python -m trainops train`` (single process): check --save and the --resume checkpoint
    (parser.error before any work), read the data, train, report."""
    if args.save is not None:
        reason = unwritable_reason(args.save)
        if reason:
            parser.error(f"argument --save: {reason}")
    checkpoint = None
    if args.resume is not None:
        try:
            checkpoint = _checkpoint_to_resume(args.resume, cfg)
        except CheckpointError as exc:
            parser.error(f"argument --resume: {exc}")

    device = args.device
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    data = stdlib_bytes(cfg.data_bytes)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"trainops train: {args.config} GPT ({cfg.n_layer} layers, width {cfg.d_model}, {params / 1e6:.2f} M "
          f"parameters), {len(data) / 2**20:.1f} MiB of standard-library source, {cfg.steps} steps of "
          f"{cfg.batch}x{cfg.context} tokens ({cfg.accumulate} micro-batches), {cfg.optimizer}, amp {cfg.amp}, "
          f"{optimizer_description(cfg)[2:] + ', ' if optimizer_description(cfg) else ''}"
          f"{'torch.compile, ' if cfg.compile else ''}on {device}"
          + (f", resuming at step {checkpoint['step']} from {args.resume}" if checkpoint is not None else ""))
    ours = run(cfg, device, True, data, resume=checkpoint, save=args.save)
    print(summary(ours))
    if args.compare:
        ref = run(cfg, device, False, data, resume=None, quiet=False)
        print(summary(ref))
        print(compare_table(ours, ref, every=max(1, len(ours.losses) // 15)))
        print(plot(ours, ref, plot_path) if plot_path
              else "matplotlib is not installed: no plot (pip install matplotlib)")
    return 0
