"""``python -m trainops bench --step MODEL``: one whole training step of a Hugging Face causal LM,
run five ways, each in its own process.

The model is transformers's, built from a configuration (``MODELS``: the published shape of each
model, random initial weights, nothing downloaded), float32 parameters, bf16 autocast, SDPA
attention, ``use_cache=False``; a step is forward with ``labels`` (the model's own causal-LM loss),
backward, a fused AdamW step (lr 1e-4, weight decay 0.01) and ``zero_grad(set_to_none=True)``,
then one read of the loss (the step is done when it returns). Runs (``RUNS``):

- ``eager``: the model as transformers builds it, ``torch.optim.AdamW(fused=True)`` (CUDA; its
  default implementation on the CPU);
- ``compile``: the same, the model under ``torch.compile(model)`` (forward and backward compiled;
  the optimizer step runs outside the compiled graph, eager);
- ``liger``: the eager run after Liger-Kernel's ``apply_liger_kernel_to_<model>(model=...)`` where
  Liger has one for the model (CUDA only);
- ``trainops``: ``trainops.patch(model)`` (its defaults) and ``trainops.optim.AdamW``;
- ``trainops-compile``: the trainops run under ``torch.compile(model)``;
- ``eager-graphs`` and ``trainops-graphs``: the eager and trainops runs with the whole step
  (forward, backward, optimizer step) replayed as one CUDA graph (``trainops.capture_step``; the
  learning rate a CUDA tensor, torch's AdamW ``capturable=True``), captured in the last warm-up
  step (CUDA only).

Every run starts from the same weights (``torch.manual_seed(0)`` before building the model) and
sees the same batches (random token ids drawn once from a generator seeded 1; labels = the ids,
shifted by the model). Each is a child process (``python -m trainops bench --step MODEL --run-one
RUN``), so what one run patches (Liger patches transformers's module functions), compiles or
leaks is gone before the next. Per run: ``--warmup`` untimed steps (compilation happens there; the
first step's ms is reported), then the median ms of ``--steps`` timed steps, tokens/s, the peak
memory over those steps (CUDA: ``torch.cuda.max_memory_allocated``, weights, gradients, optimizer
state and activations; CPU: the child's peak resident size), then ``--profile-steps`` more steps
under ``torch.profiler`` (CUDA only): GPU time per step (the durations of the kernels, copies and
memsets, summed: launch gaps left out), launches per step, and the ten kernels with the most
time. The loss agreement of a run is the mean over steps of ``|loss - eager's| / |eager's|``
(warm-up and timed steps, the same batches): the row's ``error``.

A run that fails (out of memory, Liger missing or unable to patch the model, a child that dies)
is recorded in its row (``status`` "failed" or "skipped", ``reason``) and the others go on. On
the CPU, Liger and profiling are skipped, and the compile runs too unless ``--runs`` names them
(Inductor's C++ build would take most of the time): the reason is in the row.

JSON (``--out``, default ``./bench-step-<model>-<device>-<time>.json``; a directory: that name in
it): the bench's one schema (``trainops.bench.write_results``): ``{"environment", **meta,
"rows"}``, a row per run with the runner's keys (``op`` "train_step", ``case``, ``impl``, ``ms``,
``gbps`` None, ``pct_of_copy`` None, ``error`` the loss distance, ``pct_of_same_copy`` None) and
this mode's fields (``ROW_FIELDS``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

import trainops

# The generic size names a model row maps to its configuration's attribute names.
LLAMA_KEYS = dict(layers="num_hidden_layers", hidden="hidden_size", heads="num_attention_heads",
                  kv_heads="num_key_value_heads", head_dim="head_dim", intermediate="intermediate_size",
                  vocab="vocab_size", positions="max_position_embeddings")
# MoE rows: their experts, top-k and expert widths (so that --tiny shrinks them too)
MOE_KEYS = {"mixtral": dict(experts="num_local_experts", top_k="num_experts_per_tok"),
            "qwen3moe": dict(experts="num_experts", top_k="num_experts_per_tok",
                             expert_intermediate="moe_intermediate_size")}
# Configurations that derive head_dim from hidden_size / num_attention_heads (no head_dim argument)
NO_HEAD_DIM_KEYS = {name: key for name, key in LLAMA_KEYS.items() if name != "head_dim"}
GPT2_KEYS = dict(layers="n_layer", hidden="n_embd", heads="n_head", intermediate="n_inner", vocab="vocab_size",
                 positions="n_positions")


@dataclass(frozen=True)
class StepModel:
    """One row of MODELS: a transformers configuration class (by name) and its arguments, the
    batch x sequence it is benchmarked at, and Liger-Kernel's instance patch for it (None: none)."""

    config: str
    values: dict
    batch: int
    seq: int
    liger: str | None = None
    keys: dict = field(default_factory=lambda: dict(LLAMA_KEYS))
    source: str = ""


MODELS = {
    "llama": StepModel(
        "LlamaConfig", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                            rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072),
        batch=4, seq=2048, liger="apply_liger_kernel_to_llama",
        source="Llama-3.2-1B's shape (its config.json; rope_scaling left out: it does not change the cost)"),
    "llama-small": StepModel(
        "LlamaConfig", dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                            intermediate_size=4096, vocab_size=32000, max_position_embeddings=4096),
        batch=8, seq=1024, liger="apply_liger_kernel_to_llama",
        source="issue 39's smaller Llama-style model (untied LM head, LlamaConfig's default)"),
    "qwen3": StepModel(
        "Qwen3Config", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                            rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
        batch=8, seq=2048, liger="apply_liger_kernel_to_qwen3", source="Qwen3-0.6B's shape (its config.json)"),
    "gpt2": StepModel(
        "GPT2Config", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        batch=16, seq=1024, liger=None, keys=dict(GPT2_KEYS),
        source="GPT-2 124M (dropout off, so that every run computes the same function)"),
    "gemma3": StepModel(
        "Gemma3TextConfig", dict(hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                 head_dim=256, intermediate_size=6912, vocab_size=262144, sliding_window=512,
                                 query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                 rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True),
        batch=4, seq=2048, liger="apply_liger_kernel_to_gemma3_text", source="Gemma-3-1B's shape (its config.json)"),
    "phi3": StepModel(
        "Phi3Config", dict(hidden_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                           intermediate_size=8192, vocab_size=32064, rope_theta=10000.0, rms_norm_eps=1e-5,
                           max_position_embeddings=4096, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
        batch=2, seq=2048, liger="apply_liger_kernel_to_phi3",
        source="Phi-3-mini-4k's shape (its config.json; dropout off)"),
    "olmo2": StepModel(
        "Olmo2Config", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                            intermediate_size=8192, vocab_size=100352, rope_theta=500000.0, rms_norm_eps=1e-6,
                            max_position_embeddings=4096, tie_word_embeddings=False),
        batch=4, seq=2048, liger="apply_liger_kernel_to_olmo2", source="OLMo-2-0425-1B's shape (its config.json)"),
    "mixtral": StepModel(
        "MixtralConfig", dict(hidden_size=4096, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                              intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                              rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=32768),
        batch=2, seq=2048, liger="apply_liger_kernel_to_mixtral", keys=dict(LLAMA_KEYS, **MOE_KEYS["mixtral"]),
        source="Mixtral-8x7B's layer widths, 2 of its 32 layers (the whole model does not train on one GPU)"),
    "qwen3moe": StepModel(
        "Qwen3MoeConfig", dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                               head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                               norm_topk_prob=True, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
                               max_position_embeddings=40960, tie_word_embeddings=False),
        batch=2, seq=2048, liger="apply_liger_kernel_to_qwen3_moe", keys=dict(LLAMA_KEYS, **MOE_KEYS["qwen3moe"]),
        source="Qwen3-30B-A3B's layer widths, 4 of its 48 layers (the whole model does not train on one GPU)"),
    "smollm3": StepModel(
        "SmolLM3Config", dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                              intermediate_size=11008, vocab_size=128256, tie_word_embeddings=True,
                              rope_theta=5000000.0, rms_norm_eps=1e-6, max_position_embeddings=65536,
                              no_rope_layer_interval=4, use_sliding_window=False),
        batch=4, seq=2048, liger="apply_liger_kernel_to_smollm3", keys=dict(NO_HEAD_DIM_KEYS),
        source="SmolLM3-3B's shape (its config.json as quoted in third-party copies; every 4th layer without "
               "rotary, no_rope_layers derived from the interval)"),
    "glm4": StepModel(
        "Glm4Config", dict(hidden_size=4096, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=2,
                           head_dim=128, intermediate_size=13696, vocab_size=151552, attention_bias=True,
                           partial_rotary_factor=0.5, rope_theta=10000.0, rms_norm_eps=1e-5,
                           max_position_embeddings=32768, tie_word_embeddings=False),
        batch=2, seq=2048, liger="apply_liger_kernel_to_glm4",
        source="GLM-4-9B-0414's layer widths, 16 of its 40 layers (the whole model, 9.4B parameters at 16 bytes, "
               "does not train on one GPU; config.json as quoted in third-party copies)"),
    "granite": StepModel(
        "GraniteConfig", dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                              intermediate_size=8192, vocab_size=49159, tie_word_embeddings=True,
                              rope_theta=10000000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                              embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22,
                              logits_scaling=8.0, attention_dropout=0.0),
        batch=4, seq=2048, liger="apply_liger_kernel_to_granite", keys=dict(NO_HEAD_DIM_KEYS),
        source="Granite-3.3-2B's shape with its four multipliers (its config.json as quoted in third-party copies; "
               "dropout off)"),
}
# Every model: no KV cache in training.
COMMON_VALUES = dict(use_cache=False)
# --tiny: the widths of a model small enough for the CPU self-check (a generic size name -> value).
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, experts=4, top_k=2,
            expert_intermediate=32)

RUNS = {
    "eager": "transformers's model, torch fused AdamW",
    "compile": "torch.compile (optimizer step outside the graph, eager), torch fused AdamW",
    "liger": "Liger-Kernel's apply_liger_kernel_to_<model>(model=...), torch fused AdamW",
    "trainops": "trainops.patch(model), trainops.optim.AdamW",
    "trainops-compile": "trainops.patch(model) + torch.compile, trainops.optim.AdamW",
    "eager-graphs": "transformers's model, torch fused AdamW (capturable), the step as one CUDA graph "
                    "(trainops.capture_step)",
    "trainops-graphs": "trainops.patch(model), trainops.optim.AdamW, the step as one CUDA graph (trainops.capture_step)",
}
SETUP = ("random initial weights from the configuration (seed 0), random tokens (seed 1), float32 parameters, "
         "bf16 autocast, SDPA attention, use_cache=False, AdamW lr 1e-4 weight decay 0.01, "
         "zero_grad(set_to_none=True), one loss read per step")
ROW_FIELDS = ("model", "batch", "seq", "layers", "tokens_per_step", "status", "reason", "tokens_per_s",
              "peak_memory_gib", "peak_memory_kind", "first_step_ms", "step_ms", "kernel_ms", "launches",
              "top_kernels", "profile_note", "losses", "max_loss_distance", "swapped_modules", "trainops_kernels",
              "setup", "compile_scope", "wall_s")
COMPILE_SCOPES = ("model", "layers")
DEFAULT_STEPS, DEFAULT_WARMUP, DEFAULT_PROFILE_STEPS = 10, 4, 3
CHILD_TIMEOUT_S = 1200   # default --run-timeout: a run still going after this is killed and recorded as failed
LR, WEIGHT_DECAY = 1e-4, 0.01


# -- the command line -------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--step`` options of ``python -m trainops bench`` (None: not given; see resolve)."""
    parser.add_argument("--step", metavar="MODEL", default=None,
                        help=f"time whole training steps of a Hugging Face model ({', '.join(MODELS)}): eager, "
                             "torch.compile, Liger, trainops, trainops + torch.compile, each in its own process")
    parser.add_argument("--batch", type=int, default=None,
                        help="with --step: sequences per step (default: the model's)")
    parser.add_argument("--seq", type=int, default=None, help="with --step: tokens per sequence (default: the model's)")
    parser.add_argument("--layers", type=int, default=None, help="with --step: decoder layers (default: the model's)")
    parser.add_argument("--steps", type=int, default=None, help=f"with --step: timed steps (default {DEFAULT_STEPS})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"with --step: untimed steps first (default {DEFAULT_WARMUP})")
    parser.add_argument("--profile-steps", type=int, default=None,
                        help=f"with --step: steps under torch.profiler after the timed ones (default "
                             f"{DEFAULT_PROFILE_STEPS}; 0: none)")
    parser.add_argument("--runs", default=None,
                        help=f"with --step: comma-separated, of {', '.join(RUNS)} (default: all)")
    parser.add_argument("--device", default=None, help="with --step: cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--compile-scope", choices=COMPILE_SCOPES, default=None,
                        help="with --step: what the compile runs compile: model (torch.compile(model), the default) or "
                             "layers (each decoder layer, module.compile(): one graph reused by every layer, a "
                             "fraction of the compile time; embedding, final norm and loss eager)")
    parser.add_argument("--run-timeout", type=float, default=None,
                        help=f"with --step: seconds after which a run's process is killed and its row marked failed "
                             f"(more than 0, at most 1e6; default {CHILD_TIMEOUT_S})")
    parser.add_argument("--tiny", action="store_true",
                        help="with --step: tiny widths (hidden 64, vocabulary 512): a self-check, not a benchmark")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)   # a child process: one run


STEP_OPTIONS = ("batch", "seq", "layers", "steps", "warmup", "profile_steps", "runs", "device", "compile_scope",
                "run_timeout", "run_one")


def given(args) -> bool:
    """Whether any --step option was given (so the step mode is what was asked for)."""
    return args.step is not None or args.tiny or any(getattr(args, name) is not None for name in STEP_OPTIONS)


def resolve(args, error) -> dict:
    """The step mode's settings from parsed arguments, defaults filled; ``error(message)`` (argparse's)
    for a bad or missing one."""
    if args.step is None:
        error("arguments --batch/--seq/--layers/--steps/--warmup/--profile-steps/--runs/--device/--compile-scope/"
              "--run-timeout/--tiny: only with --step MODEL")
    if args.step not in MODELS:
        error(f"argument --step: {args.step!r} is not one of {', '.join(MODELS)}")
    if args.sweep or args.quick or args.no_peers or args.ops != "all":
        error("argument --step: times whole steps of one model; leave out --sweep, --quick, --no-peers and --ops")
    spec = MODELS[args.step]
    settings = dict(model=args.step, batch=spec.batch if args.batch is None else args.batch,
                    seq=spec.seq if args.seq is None else args.seq,
                    layers=spec.values[spec.keys["layers"]] if args.layers is None else args.layers,
                    steps=DEFAULT_STEPS if args.steps is None else args.steps,
                    warmup=DEFAULT_WARMUP if args.warmup is None else args.warmup,
                    profile_steps=DEFAULT_PROFILE_STEPS if args.profile_steps is None else args.profile_steps,
                    compile_scope=args.compile_scope or "model", tiny=args.tiny, out=args.out,
                    run_timeout=CHILD_TIMEOUT_S if args.run_timeout is None else args.run_timeout)
    if not 0 < settings["run_timeout"] <= 10**6:   # subprocess overflows past ~1e9 s; inf and nan refused too
        error(f"argument --run-timeout: must be more than 0 and at most 1e6 seconds, got {settings['run_timeout']:g}")
    for name in ("batch", "seq", "layers", "steps"):
        if settings[name] < 1:
            error(f"argument --{name}: must be at least 1, got {settings[name]}")
    for name in ("warmup", "profile_steps"):
        if settings[name] < 0:
            error(f"argument --{name.replace('_', '-')}: must be at least 0, got {settings[name]}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        error(f"argument --device: must be cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        error("argument --device: cuda asked for, but torch sees no CUDA device")
    settings["device"] = device
    runs = list(RUNS) if args.runs is None else args.runs.split(",")
    unknown = [r for r in runs if r not in RUNS]
    if unknown or len(set(runs)) != len(runs) or not runs:
        error(f"argument --runs: {args.runs!r}: each of {', '.join(RUNS)} at most once")
    settings["runs"], settings["runs_named"] = runs, args.runs is not None
    if args.run_one is not None and args.run_one not in RUNS:
        error(f"argument --run-one: {args.run_one!r} is not one of {', '.join(RUNS)}")
    settings["run_one"] = args.run_one
    return settings


def main(args, error) -> int:
    """``python -m trainops bench --step ...``: the parent (every run in a child, then the table and
    the JSON) or, with ``--run-one``, one child (its row to ``--out``)."""
    settings = resolve(args, error)
    if settings["run_one"] is not None:
        if settings["out"] is None:
            error("argument --run-one: needs --out (the row's JSON path)")
        row = run_one(settings, settings["run_one"])
        with open(settings["out"], "w") as f:
            json.dump(row, f)
        return 0
    return run_all(settings)


# -- one run (a child process) -----------------------------------------------------------------------

def build_config(model: str, layers: int | None = None, seq: int | None = None, tiny: bool = False):
    """The transformers configuration of MODELS[model]: ``layers`` decoder layers, room for ``seq``
    positions, tiny widths (TINY) with ``tiny``."""
    import transformers

    spec = MODELS[model]
    values = {**COMMON_VALUES, **spec.values}
    if layers is not None:
        values[spec.keys["layers"]] = layers
    if tiny:   # (no special token ids: the tiny vocabulary may not hold the model's)
        values.update({spec.keys[name]: value for name, value in TINY.items() if name in spec.keys},
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if seq is not None:
        values[spec.keys["positions"]] = max(values.get(spec.keys["positions"], 0), seq)
    return getattr(transformers, spec.config)(**values)


def build_model(config, device: str) -> torch.nn.Module:
    """The causal LM of ``config`` on ``device`` in float32, SDPA attention, seed-0 weights."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=torch.float32)
    return model.train()


def make_batches(count: int, batch: int, seq: int, vocab: int, device: str) -> list[torch.Tensor]:
    """``count`` batches of random token ids (a CPU generator seeded 1: the same in every process)."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq), generator=generator).to(device) for _ in range(count)]


def decoder_layers(model: torch.nn.Module, layers: int) -> torch.nn.ModuleList:
    """The model's decoder layers: its first ModuleList of ``layers`` modules (``model.layers``,
    GPT-2's ``transformer.h``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers:
            return module
    raise ValueError(f"no ModuleList of {layers} decoder layers in {type(model).__name__}")


def _compiled(model: torch.nn.Module, scope: str, layers: int) -> torch.nn.Module:
    """The forward of a compile run: ``torch.compile(model)``, or with scope "layers" the model
    whose decoder layers were each compiled in place."""
    if scope == "model":
        return torch.compile(model)
    for layer in decoder_layers(model, layers):
        layer.compile()
    return model


def _setup(run: str, model, settings: dict):
    """(forward, optimizer, swapped module count or None) of a run of RUNS other than liger."""
    device = settings["device"]
    swapped = None
    graphs = run.endswith("graphs")   # a replayed graph reads the learning rate from a device tensor
    lr = torch.tensor(LR, device=device) if graphs else LR
    if run.startswith("trainops"):
        report = trainops.patch(model)
        swapped = len(report.swapped)
        opt = trainops.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, fused=device == "cuda",
                                capturable=graphs)
    forward = _compiled(model, settings["compile_scope"], settings["layers"]) if run.endswith("compile") else model
    return forward, opt, swapped


def skip_reason(settings: dict, run: str) -> str | None:
    """Why ``run`` does not run with these settings (None: it runs)."""
    device, spec = settings["device"], MODELS[settings["model"]]
    if device == "cpu" and run.endswith("compile") and not settings["runs_named"]:
        return "torch.compile on the CPU (Inductor's C++ build): skipped unless --runs names it"
    if device != "cuda" and run.endswith("graphs"):
        return "CUDA graphs need CUDA"
    if run.endswith("graphs") and settings["warmup"] < 2:
        return "a graphs run captures in its last warm-up step after at least one eager one: --warmup 2 or more"
    if run == "liger":
        if spec.liger is None:
            return f"Liger-Kernel has no patch for {settings['model']}"
        if device != "cuda":
            return "Liger-Kernel's kernels are Triton kernels for CUDA: not run on the CPU"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel is not installed (pip install liger-kernel)"
    return None


def _liger(model_name: str, model):
    """The liger run's (forward, optimizer, None), skip_reason checked first."""
    import liger_kernel.transformers as liger
    getattr(liger, MODELS[model_name].liger)(model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return model, opt, None


def _peak_memory_gib(device: str) -> tuple[float, str]:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30, "torch.cuda.max_memory_allocated over the timed steps"
    import resource
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "the process's peak resident size (ru_maxrss), model building included")


def profile_steps(step, count: int) -> dict:
    """GPU time and launches per step over ``count`` calls of ``step(i)`` under torch.profiler
    (CUDA activity: kernels, memcpys and memsets), and the ten kernels with the most time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(count):
            step(i)
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.device_time
        entry[1] += 1
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:10]
    return dict(kernel_ms=sum(t for t, _ in totals.values()) / 1e3 / count,
                launches=sum(n for _, n in totals.values()) / count,
                top_kernels=[dict(name=name[:200], ms=t / 1e3 / count, calls=n / count) for name, (t, n) in top])


def run_one(settings: dict, run: str) -> dict:
    """One run of RUNS (in this process): its row's fields (ms None when it did not run)."""
    started = time.perf_counter()
    model_name, device = settings["model"], settings["device"]
    batch, seq = settings["batch"], settings["seq"]
    row = dict(impl=run, ms=None, status="ok", reason=None, tokens_per_s=None, peak_memory_gib=None,
               peak_memory_kind=None, first_step_ms=None, step_ms=[], kernel_ms=None, launches=None, top_kernels=[],
               profile_note=None, losses=[], swapped_modules=None, trainops_kernels=None, setup=RUNS[run])
    skip = skip_reason(settings, run)
    if skip is not None:
        return {**row, "status": "skipped", "reason": skip, "wall_s": 0.0}
    try:
        config = build_config(model_name, settings["layers"], seq, settings["tiny"])
        model = build_model(config, device)
        if run == "liger":
            forward, opt, swapped = _liger(model_name, model)
        else:
            forward, opt, swapped = _setup(run, model, settings)
        row["swapped_modules"] = swapped
        n_steps = settings["warmup"] + settings["steps"]
        batches = make_batches(n_steps, batch, seq, config.vocab_size, device)

        def train_step(ids: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        if run.endswith("graphs"):   # captured in the last warm-up step
            train_step = trainops.capture_step(train_step, [opt], warmup_steps=settings["warmup"] - 1)

        def step(i: int) -> float:
            return train_step(batches[i % len(batches)]).item()

        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []

        def steps(first: int, last: int):
            for i in range(first, last):
                t0 = time.perf_counter()
                row["losses"].append(step(i))
                times.append(1e3 * (time.perf_counter() - t0))

        if run.startswith("trainops") and settings["warmup"]:
            with trainops.track_kernels() as used:   # the warm-up steps (under compile: what was traced)
                steps(0, settings["warmup"])
            row["trainops_kernels"] = {" ".join(map(str, key)): calls for key, calls in sorted(used.items(), key=str)}
        else:
            steps(0, settings["warmup"])
        steps(settings["warmup"], n_steps)
        row["first_step_ms"] = times[0]
        row["step_ms"] = times[settings["warmup"]:]
        row["ms"] = statistics.median(row["step_ms"])
        row["tokens_per_s"] = batch * seq / row["ms"] * 1e3
        row["peak_memory_gib"], row["peak_memory_kind"] = _peak_memory_gib(device)
        if device != "cuda":
            row["profile_note"] = "not profiled: GPU kernel time and launches are measured on CUDA only"
        elif settings["profile_steps"] == 0:
            row["profile_note"] = "not profiled: --profile-steps 0"
        else:
            try:   # the timings stand without it
                row.update(profile_steps(step, settings["profile_steps"]))
                row["profile_note"] = (f"{settings['profile_steps']} steps after the timed ones under torch.profiler: "
                                       "kernel, memcpy and memset durations summed per step")
            except Exception as e:
                row["profile_note"] = f"the profile failed: {type(e).__name__}: {str(e)[:300]}"
    except Exception as e:   # out of memory, a patch that fails on this model: recorded, not fatal
        row.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:500]}")
    finally:
        gc.collect()
    row["wall_s"] = time.perf_counter() - started
    return row


# -- the parent --------------------------------------------------------------------------------------

def _child_command(settings: dict, run: str, out: str) -> list[str]:
    command = [sys.executable, "-m", "trainops", "bench", "--step", settings["model"], "--run-one", run,
               "--batch", str(settings["batch"]), "--seq", str(settings["seq"]), "--layers", str(settings["layers"]),
               "--steps", str(settings["steps"]), "--warmup", str(settings["warmup"]),
               "--profile-steps", str(settings["profile_steps"]), "--device", settings["device"],
               "--compile-scope", settings["compile_scope"], "--out", out]
    if settings["runs_named"]:
        command += ["--runs", ",".join(settings["runs"])]
    return command + (["--tiny"] if settings["tiny"] else [])


def _child_env() -> dict:
    """This process's environment, with the directory trainops was imported from first on the path
    (a source checkout run through PYTHONPATH or from its src/ folder works as an installed wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(trainops.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def spawn(settings: dict, run: str) -> dict:
    """One run in a child process (none for a run skip_reason skips); a child that dies or hangs
    gives a failed row."""
    if skip_reason(settings, run) is not None:
        return run_one(settings, run)
    with tempfile.TemporaryDirectory(prefix="trainops-step-") as tmp:
        out = os.path.join(tmp, "row.json")
        started = time.perf_counter()
        try:
            done = subprocess.run(_child_command(settings, run, out), env=_child_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, timeout=settings["run_timeout"])
            returncode, stderr = done.returncode, done.stderr
        except subprocess.TimeoutExpired:
            returncode, stderr = None, f"killed after {settings['run_timeout']:g} s (--run-timeout)"
        if returncode == 0 and os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        reason = f"the child process {'exited with ' + str(returncode) if returncode is not None else 'hung'}: " \
                 f"{stderr.strip()[-600:]}"
        return dict(impl=run, ms=None, status="failed", reason=reason, wall_s=time.perf_counter() - started)


def loss_distance(losses: list[float], reference: list[float]) -> tuple[float | None, float | None]:
    """(mean, max) over steps of |loss - reference| / |reference| (None without both curves)."""
    pairs = list(zip(losses, reference))
    if not pairs:
        return None, None
    distances = [abs(a - b) / max(abs(b), 1e-30) for a, b in pairs]
    return sum(distances) / len(distances), max(distances)


def case_label(settings: dict) -> str:
    return (f"{settings['model']}{' tiny' if settings['tiny'] else ''} {settings['batch']}x{settings['seq']}, "
            f"{settings['layers']} layers")


def to_rows(settings: dict, results: list[dict]) -> list:
    """The runner's Row objects of the runs' results (loss distances from the eager run's)."""
    from . import Row

    eager = next((r for r in results if r["impl"] == "eager" and r.get("status") == "ok"), None)
    rows = []
    for r in results:
        mean, worst = (None, None) if eager is None or r.get("status") != "ok" else \
            loss_distance(r["losses"], eager["losses"])
        fields = {name: r.get(name) for name in ROW_FIELDS}
        fields.update(compile_scope=settings["compile_scope"] if r["impl"].endswith("compile") else None,
                      model=settings["model"], batch=settings["batch"], seq=settings["seq"],
                      layers=settings["layers"], tokens_per_step=settings["batch"] * settings["seq"],
                      max_loss_distance=worst, setup=RUNS[r["impl"]])
        ms = None if r.get("ms") is None else round(r["ms"], 3)
        rows.append(Row("train_step", case_label(settings), r["impl"], ms, None, None, mean, None, fields))
    return rows


def table(rows) -> list[str]:
    """The printed summary: a line per run."""
    eager = next((r for r in rows if r.impl == "eager" and r.ms is not None), None)

    def num(value, fmt):
        return format(value, fmt) if value is not None else format("-", ">" + fmt.split(".")[0])

    lines = [f"{'run':17s} {'ms/step':>9s} {'tokens/s':>10s} {'vs eager':>8s} {'peak GiB':>8s} {'GPU ms':>8s} "
             f"{'GPU %':>5s} {'launches':>8s} {'loss dist':>9s}  status"]
    for r in rows:
        f = r.fields
        speed = None if eager is None or r.ms is None else eager.ms / r.ms
        busy = None if f["kernel_ms"] is None or not r.ms else 100 * f["kernel_ms"] / r.ms   # of the step's time
        status = f["status"] if f["status"] == "ok" else f"{f['status']}: {f['reason']}"
        lines.append(f"{r.impl:17s} {num(r.ms, '9.1f')} {num(f['tokens_per_s'], '10.0f')} "
                     f"{num(speed, '7.2f')}{'x' if speed is not None else ' '} "
                     f"{num(f['peak_memory_gib'], '8.2f')} {num(f['kernel_ms'], '8.1f')} {num(busy, '5.0f')} "
                     f"{num(f['launches'], '8.0f')} "
                     f"{num(r.error, '9.2e')}  {status[:160]}")
    return lines


def run_all(settings: dict, log=print) -> int:
    """Every run of ``settings['runs']`` in its own process, then the table and the JSON."""
    from . import environment, write_results

    env = environment()
    config = build_config(settings["model"], settings["layers"], settings["seq"], settings["tiny"])
    log(f"trainops bench --step {settings['model']}: {case_label(settings)} on {env['device']} (torch {env['torch']}, "
        f"transformers {env.get('transformers')}, liger {env.get('liger_kernel') or 'not installed'}); "
        f"{settings['warmup']} warm-up + {settings['steps']} timed steps, each run in its own process")
    meta = dict(mode="step", model=settings["model"], source=MODELS[settings["model"]].source, tiny=settings["tiny"],
                device_type=settings["device"], steps=settings["steps"], warmup=settings["warmup"],
                profile_steps=settings["profile_steps"], compile_scope=settings["compile_scope"], setup=SETUP,
                config=config.to_diff_dict())
    out = settings["out"]
    name = (f"bench-step-{settings['model']}-{settings['device']}-"
            f"{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    if out is None:
        out = name
    elif os.path.isdir(out) or out.endswith(os.sep):
        out = os.path.join(out, name)
    results = []
    for run in settings["runs"]:
        result = spawn(settings, run)
        results.append(result)
        ms = result.get("ms")
        log(f"  {run:17s} {'-' if ms is None else f'{ms:.1f} ms/step'}  {result['status']}"
            + (f": {result['reason'][:200]}" if result.get("reason") else "") + f"  ({result.get('wall_s', 0):.0f} s)")
        write_results(out, env, meta, rows=to_rows(settings, results))   # so far: a killed run keeps the rows before it
    log("")
    log("\n".join(table(to_rows(settings, results))))
    log(f"wrote {out}")
    return 0
