"""``python -m trainops train --model llama``: a Hugging Face LlamaForCausalLM trained on BPE tokens
of the Python standard library's sources, with trainops and beside what users run today.

The model is transformers's ``LlamaForCausalLM`` (RMSNorm, SwiGLU MLP, rotary position embedding,
grouped-query attention through torch's SDPA, tied embedding and LM head), built from a
configuration (``LLAMA_CONFIGS``) with random initial weights: nothing is downloaded. The text is
every ``*.py`` file of the running interpreter's standard library (``common.stdlib_source``, the
configuration's byte budget), split 95 / 5 into training and held-out text; a byte-level BPE
tokenizer (the ``tokenizers`` library, GPT-2's pre-tokenising rule, the 256 byte symbols as its
alphabet) is trained on the training text alone, up to the configuration's vocabulary size (it
stops earlier when no pair of symbols is left to merge; ids it never learned never occur). Batch
``s`` is drawn from a generator seeded by (seed, s), so every run sees the same batches.

Runs (``RUNS``), each from the same initial weights (same seed) on the same batches:

- ``trainops``: ``trainops.patch(model)`` (norms, gated MLP, rotary embedding, embedding, and the
  loss through ``trainops.linear_cross_entropy`` without materialising the logits), with
  ``trainops.optim.AdamW`` (or LAMB; the global-norm clip inside the step) and
  ``trainops.amp.GradScaler``; ``trainops-compile`` the same under ``torch.compile``.
- ``pytorch``: the model as transformers builds it, ``torch.optim.AdamW`` (fused on CUDA),
  ``clip_grad_norm_`` and ``torch.amp.GradScaler``; ``pytorch-compile`` the same under
  ``torch.compile``.
- ``liger``: the ``pytorch`` run after Liger-Kernel's ``apply_liger_kernel_to_llama(model=...)``
  (CUDA only; it patches transformers's module for the whole process, so it runs last).

Each run reports its loss curve, the held-out loss, tokens/s and the median step time (the first
``UNTIMED_STEPS`` steps, which compile kernels, left out), and peak memory: on CUDA the most memory
allocated during the training steps (weights, gradients and optimizer state included), on the CPU
the process's peak resident size so far (which only grows from run to run).
"""

from __future__ import annotations

import gc
import importlib.util
import math
import time
from dataclasses import dataclass

import torch

from . import common
from .common import (PARAM_DTYPES, Batches, RunResult, autocast_dtype, curves_table, learning_rate, optimizer_options,
                     parameter_groups, peak_memory_mb, plot_curves, results_table, run_summary, show_progress,
                     stdlib_source)

LLAMA_CONFIGS = {
    # tiny: CI. small: the CPU default, about two minutes on 2 cores. 1b: Llama-3.2-1B's shape (issue 19).
    "tiny": dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=192, vocab=1024, context=64, batch=8,
                 steps=20, lr=3e-3, data_bytes=1 << 20),
    "small": dict(n_layer=4, d_model=256, n_head=8, n_kv_head=2, d_ff=704, vocab=8192, context=256, batch=16,
                  steps=100, lr=2e-3, data_bytes=4 << 20),
    "1b": dict(n_layer=16, d_model=2048, n_head=32, n_kv_head=8, d_ff=8192, vocab=128256, context=2048, batch=4,
               steps=60, lr=3e-4, data_bytes=32 << 20),
}

# What each run is, in the order --compare runs them (liger last: it patches transformers for the process).
RUNS = {
    "trainops": "trainops.patch",
    "trainops-compile": "trainops.patch + torch.compile",
    "pytorch": "PyTorch eager",
    "pytorch-compile": "torch.compile",
    "liger": "Liger",
}
UNTIMED_STEPS = 3  # the first steps compile kernels (and, under torch.compile, the graph): not timed


@dataclass
class LlamaRunConfig:
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab: int
    context: int
    batch: int
    steps: int
    lr: float
    data_bytes: int
    seed: int = 0
    warmup: int = 10
    optimizer: str = "adamw"
    amp: str = "none"          # none | fp16 | bf16
    max_grad_norm: float = 1.0   # 0: no clip
    accumulate: int = 1        # one micro-batch per step (Batches reads it)
    # the trainops runs' optimizer options (common.optimizer_options, common.attach_step_in_backward)
    optim_bits: int = 32
    param_dtype: str = "float32"   # float32 | bfloat16
    master_weights: bool = False
    stochastic_rounding: bool = False
    step_in_backward: bool = False
    clip_with_previous_norm: bool = False


def missing_packages() -> list[str]:
    """The packages ``--model llama`` needs that are not installed (the ``hf`` extra has them)."""
    return [name for name in ("transformers", "tokenizers") if importlib.util.find_spec(name) is None]


def liger_unavailable_reason(device: torch.device) -> str | None:
    """Why the ``liger`` run cannot run here (None when it can)."""
    if device.type != "cuda":
        return "Liger-Kernel runs on CUDA only"
    if importlib.util.find_spec("liger_kernel") is None:
        return "Liger-Kernel is not installed (pip install liger-kernel)"
    try:   # imported here, not after the other runs have trained: a broken install is refused up front
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: F401
    except Exception as error:
        return f"Liger-Kernel does not import here ({type(error).__name__}: {str(error)[:200]})"
    return None


# ----------------------------------------------------------------------------------------------
# Data: a BPE tokenizer learned from the standard library's sources
# ----------------------------------------------------------------------------------------------

@dataclass
class Tokens:
    ids: torch.Tensor          # int64, the training text's tokens then the held-out text's
    split: int                 # ids[:split] train, ids[split:] held out
    vocab_learned: int         # the tokenizer's vocabulary (at most the configuration's)
    text_bytes: int            # all the text (training and held out), in bytes
    train_text_bytes: int      # the text the vocabulary was learned from, in bytes
    seconds: float             # learning the vocabulary and encoding the text
    tokenizer: object          # the tokenizers.Tokenizer (decode(ids) gives the text back)

    def describe(self, cfg: LlamaRunConfig) -> str:
        import tokenizers
        short = (f"; it stopped at {self.vocab_learned:,}, no pair being left to merge, so ids "
                 f"{self.vocab_learned:,} to {cfg.vocab - 1:,} never occur" if self.vocab_learned < cfg.vocab else "")
        return (f"byte-level BPE (tokenizers {tokenizers.__version__}) learned from the {self.train_text_bytes / 2**20:.1f} "
                f"MiB of training text (learning and encoding took {self.seconds:.1f} s): vocabulary "
                f"{self.vocab_learned:,} of the model's {cfg.vocab:,}{short}; {self.text_bytes / len(self.ids):.2f} "
                f"bytes per token, {self.split:,} training and {len(self.ids) - self.split:,} held-out tokens")


def _line_batches(text: str, lines_per_batch: int = 1000):
    lines = text.splitlines(keepends=True)
    return ["".join(lines[i:i + lines_per_batch]) for i in range(0, len(lines), lines_per_batch)]


def stdlib_tokens(cfg: LlamaRunConfig) -> Tokens:
    """The configuration's byte budget of standard-library source, split 95 / 5, tokenized by a
    byte-level BPE learned from the first part (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    started = time.perf_counter()
    source = stdlib_source(cfg.data_bytes)
    text = source.decode("utf-8", errors="replace")   # the budget may cut a character in two
    text_bytes = len(text.encode())
    cut = int(len(text) * 0.95)
    train_text, held_out_text = text[:cut], text[cut:]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    train_batches = _line_batches(train_text)
    tokenizer.train_from_iterator(train_batches, trainer=trainer)

    def encode(batches):
        return [i for encoding in tokenizer.encode_batch(batches) for i in encoding.ids]

    train_ids, held_out_ids = encode(train_batches), encode(_line_batches(held_out_text))
    ids = torch.tensor(train_ids + held_out_ids, dtype=torch.long)
    return Tokens(ids, len(train_ids), tokenizer.get_vocab_size(), text_bytes, len(train_text.encode()),
                  time.perf_counter() - started, tokenizer)


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------

def build_model(cfg: LlamaRunConfig, device: torch.device):
    """transformers's LlamaForCausalLM of the configuration's shape, random weights from ``cfg.seed``
    (the same for every run), SDPA attention, tied embedding and LM head, float32 parameters."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head, max_position_embeddings=cfg.context,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def build_run(cfg: LlamaRunConfig, device: torch.device, run: str):
    """(model, forward, optimizer, scaler, patch report or None) of one of RUNS."""
    import trainops

    if run not in RUNS:
        raise ValueError(f"trainops train: no run {run!r}; the runs are {', '.join(RUNS)}")
    model = build_model(cfg, device)
    report = None
    uses_trainops = run.startswith("trainops")
    if uses_trainops:
        model.to(PARAM_DTYPES[cfg.param_dtype])
        report = trainops.patch(model)
        opt_cls = trainops.optim.LAMB if cfg.optimizer == "lamb" else trainops.optim.AdamW
        lr = cfg.lr * (10 if cfg.optimizer == "lamb" else 1)
        opt = opt_cls(parameter_groups(model), lr=lr, betas=(0.9, 0.95), **optimizer_options(cfg))
        scaler = trainops.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")
    else:
        if cfg.optimizer == "lamb":
            raise ValueError("trainops train: the PyTorch runs have no LAMB (torch.optim has none)")
        if run == "liger":
            reason = liger_unavailable_reason(device)
            if reason:
                raise RuntimeError(f"trainops train: the liger run cannot run: {reason}")
            from liger_kernel.transformers import apply_liger_kernel_to_llama
            apply_liger_kernel_to_llama(model=model)
        opt = torch.optim.AdamW(parameter_groups(model), lr=cfg.lr, betas=(0.9, 0.95),
                                fused=device.type == "cuda")
        scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16")
    forward = torch.compile(model) if run.endswith("-compile") else model
    return model, forward, opt, scaler, report


def train_step(model, forward, opt, scaler, ids, amp_dtype, device, clip_norm):
    """One step on one batch of token ids (the model shifts the labels): the loss (a 0-dim tensor).
    ``clip_norm``: the global-norm clip done outside the optimizer (None when the optimizer does it)."""
    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        loss = forward(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    if clip_norm is not None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def evaluate(model, batches, amp_dtype, device) -> float:
    """Mean held-out loss, the uncompiled model in eval mode (logits computed, as without trainops)."""
    return common.evaluate(model, batches, amp_dtype, device,
                        loss_of=lambda model, x, y: model(input_ids=x, labels=x).loss)


def run_llama(cfg: LlamaRunConfig, device: torch.device, run: str, tokens: Tokens, *,
              quiet: bool = False) -> RunResult:
    """Train ``cfg.steps`` steps of one of RUNS on ``tokens`` and evaluate it; the result's
    ``name`` is the run's. Peak memory is measured over the training steps only."""
    import trainops

    model, forward, opt, scaler, report = build_run(cfg, device, run)
    if report is not None and not quiet:
        print(report)
    amp_dtype = autocast_dtype(cfg)
    clip_norm = None if run.startswith("trainops") or not cfg.max_grad_norm else cfg.max_grad_norm
    handle = common.attach_step_in_backward(model, opt, cfg) if run.startswith("trainops") else None
    batches = Batches(tokens.ids, cfg, device, split=tokens.split)
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses, step_times = [], []
    with trainops.track_kernels() as used:
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg, step)
            ((ids, _),) = batches.train_batch(step)
            started = time.perf_counter()
            loss = train_step(model, forward, opt, scaler, ids, amp_dtype, device, clip_norm)
            losses.append(float(loss))   # one host read per step: the step is done when it returns
            if step >= UNTIMED_STEPS:
                step_times.append(1e3 * (time.perf_counter() - started))
            if not quiet:
                timed = sum(step_times)
                show_progress(run, step + 1, cfg.steps, losses[-1],
                              1e3 * len(step_times) * ids.numel() / timed if timed else 0, final=step + 1 == cfg.steps)
    peak = peak_memory_mb(device)
    if handle is not None:
        handle.remove()
    val = evaluate(model, batches.val_batches(), amp_dtype, device)
    tokens_per_step = cfg.batch * cfg.context
    timed = sum(step_times)
    result = RunResult(run, losses, val, 1e3 * len(step_times) * tokens_per_step / timed if timed else math.nan,
                       timed / len(step_times) if step_times else math.nan, peak, dict(used), step_times)
    del model, forward, opt, scaler, handle
    gc.collect()
    if run.endswith("-compile"):
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ----------------------------------------------------------------------------------------------
# Command line (``trainops.train.cli`` parses the arguments and hands ``--model llama`` here)
# ----------------------------------------------------------------------------------------------

def _runs_to_train(parser, args, device: torch.device) -> tuple[list[str], list[str]]:
    """(the runs to train, notes on --compare's runs left out), or parser.error naming the argument."""
    if args.runs is not None:
        if args.compare:
            parser.error("argument --runs: names the runs itself; leave out --compare")
        if args.compile:
            parser.error("argument --compile: with --runs, name trainops-compile or pytorch-compile instead")
        runs = common.parse_runs(parser, args.runs, RUNS)
        if "liger" in runs:
            reason = liger_unavailable_reason(device)
            if reason:
                parser.error(f"argument --runs: liger cannot run: {reason}")
        runs.sort(key=list(RUNS).index)   # liger last: it patches transformers for the whole process
        return runs, []
    runs = ["trainops-compile" if args.compile else "trainops"]
    notes = []
    if args.compare:
        runs += ["pytorch", "pytorch-compile"]
        reason = liger_unavailable_reason(device)
        if reason:
            notes.append(f"liger not run: {reason}")
        else:
            runs.append("liger")
    return runs, notes


def main_llama(parser, args) -> int:
    """``python -m trainops train --model llama``: check the arguments (parser.error, exit status 2,
    one line naming the argument, before any work), learn the tokenizer, train every run, report."""
    missing = missing_packages()
    if missing:
        parser.error(f"argument --model: llama needs {' and '.join(missing)}, not installed here "
                     "(pip install 'trainops[hf]')")
    if args.config not in LLAMA_CONFIGS:
        parser.error(f"argument --config: --model llama has {', '.join(LLAMA_CONFIGS)}; got {args.config!r}")
    for option, given in (("--save", args.save is not None), ("--resume", args.resume is not None),
                          ("--dropout", args.dropout != 0.0)):
        if given:
            parser.error(f"argument {option}: not available with --model llama (the gpt model's runs have it)")
    device = args.device
    runs, notes = _runs_to_train(parser, args, device)
    if device.type == "cuda" and (args.amp or "bf16") == "bf16" and not torch.cuda.is_bf16_supported():
        parser.error(f"argument --amp: bf16{' (the default on cuda)' if args.amp is None else ''} is not supported "
                     f"by {torch.cuda.get_device_name(device)}; use --amp fp16 or none")
    base = LLAMA_CONFIGS[args.config]
    amp = args.amp or ("bf16" if device.type == "cuda" else "none")
    common.check_optimizer_options(parser, args, amp)
    cfg = LlamaRunConfig(**{**base, "steps": base["steps"] if args.steps is None else args.steps,
                            "lr": base["lr"] if args.lr is None else args.lr},
                         optimizer=args.optimizer, amp=amp,
                         max_grad_norm=1.0 if args.max_grad_norm is None else args.max_grad_norm,
                         optim_bits=args.optim_bits, param_dtype=args.param_dtype, master_weights=args.master_weights,
                         stochastic_rounding=args.stochastic_rounding, step_in_backward=args.step_in_backward,
                         clip_with_previous_norm=args.clip_with_previous_norm)
    if cfg.optimizer == "lamb" and any(not run.startswith("trainops") for run in runs):
        parser.error(f"argument {'--runs' if args.runs else '--compare'}: the PyTorch runs have no LAMB "
                     "(torch.optim has none); compare with --optimizer adamw")
    plot_path = None
    if args.compare or args.runs is not None:
        plot_path = common.checked_plot_path(parser, argparse_namespace(args, compare=True))
    elif args.plot is not None:
        parser.error("argument --plot: only used with --compare or --runs (it plots the runs' loss curves)")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tokens = stdlib_tokens(cfg)
    params = sum(p.numel() for p in build_model(cfg, torch.device("meta")).parameters())
    print(f"trainops train: {args.config} Llama (transformers LlamaForCausalLM: {cfg.n_layer} layers, width "
          f"{cfg.d_model}, {cfg.n_head} query / {cfg.n_kv_head} key-value heads, vocabulary {cfg.vocab:,}, "
          f"{params / 1e6:.2f} M parameters), {cfg.steps} steps of {cfg.batch}x{cfg.context} tokens, "
          f"{cfg.optimizer}{common.optimizer_description(cfg)}, amp {cfg.amp}, on {device}; runs: {', '.join(runs)}")
    print(f"tokenizer: {tokens.describe(cfg)}")
    for note in notes:
        print(note)
    results = []
    for run in runs:
        result = run_llama(cfg, device, run, tokens)
        print(run_summary(result, UNTIMED_STEPS))
        if run.endswith("-compile") and result.kernels:
            print("  (under torch.compile: the ops Inductor inlines are counted once per compilation, the others "
                  "per call)")
        results.append(result)
    if len(results) > 1:
        print(curves_table(results, every=max(1, cfg.steps // 15)))
        print(results_table(results, device, RUNS, UNTIMED_STEPS))
    if plot_path:
        print(plot_curves(results, plot_path, f"{args.config} Llama on {device}, {cfg.batch}x{cfg.context} tokens",
                          RUNS))
    elif args.compare or args.runs is not None:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


def argparse_namespace(args, **changes):
    import argparse
    return argparse.Namespace(**{**vars(args), **changes})

