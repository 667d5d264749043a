"""The command line of ``python -m trainops train``: parses every option, checks the ones that
choose a model, and hands the rest to that model's module (``gpt.main_gpt``, ``fsdp.main_fsdp``,
``llama.main_llama``, ``cnn.main_cnn``), each of which checks its own before any work.

This module imports the model modules and no model module imports it: data flows one way.
"""

from __future__ import annotations

import argparse
import math

import torch

from . import cnn, gpt, llama
from .._argparse import positive_int
from .common import DEFAULT_PLOT, PARAM_DTYPES

# --help's description: the first line of the gpt demo's docstring before the demos became a package.
DESCRIPTION = "``python -m trainops train``: a byte-level GPT trained on the Python standard library's sources."




def _positive_float(text: str) -> float:
    """argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    """argparse type: a finite number of at least 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text!r}")
    return value


def _dropout_probability(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _training_device(text: str) -> torch.device:
    """argparse type: cpu, cuda or cuda:N, of which the CUDA ones only where torch sees that device."""
    allowed = "use cpu, cuda or cuda:N"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; {allowed}") from None
    if device.type == "cpu" and device.index in (None, 0):
        return device
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r} is not a device this command trains on; {allowed}")
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA support" if torch.version.cuda is None and torch.version.hip is None
               else "torch finds no CUDA device")
        raise argparse.ArgumentTypeError(f"{text} asked for, but {why}; use cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        present = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise argparse.ArgumentTypeError(f"{text} asked for, but this machine has {count} CUDA device"
                                         f"{'s' if count != 1 else ''} ({present})")
    return device


def main(argv=None) -> int:
    """``python -m trainops train``: check every argument and the --resume checkpoint, then train;
    returns 0. A user error ends in ``parser.error`` (exit status 2, one line naming the argument)
    before any data is read or any step runs."""
    models = (("gpt", gpt.CONFIGS), ("llama", llama.LLAMA_CONFIGS), ("cnn", cnn.CNN_CONFIGS))
    default_steps = "; ".join(f"{model}: " + ", ".join(f"{name} {entries['steps']}" for name, entries in configs.items())
                              for model, configs in models)
    parser = argparse.ArgumentParser(prog="python -m trainops train", description=DESCRIPTION)
    parser.add_argument("--device", default="cpu", type=_training_device, help="cpu (default), cuda or cuda:N")
    parser.add_argument("--model", default="gpt", choices=["gpt", "llama", "cnn"],
                        help="gpt (default): the byte-level GPT written over trainops's ops; llama: transformers's "
                             "LlamaForCausalLM on BPE tokens, patched by trainops.patch (needs the hf extra); cnn: "
                             "a small ResNet on generated images with trainops's batch norm and GIST")
    parser.add_argument("--config", default="small", choices=sorted({name for _, configs in models for name in configs}),
                        help=f"model size and data budget (default: small); gpt: {', '.join(gpt.CONFIGS)}; "
                             f"llama: {', '.join(llama.LLAMA_CONFIGS)}; cnn: {', '.join(cnn.CNN_CONFIGS)}")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help=f"optimizer steps, at least 1 (default: the config's: {default_steps})")
    parser.add_argument("--lr", type=_positive_float, default=None,
                        help="peak learning rate, above 0 (default: the config's; LAMB uses 10x)")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "lamb"])
    parser.add_argument("--amp", default=None, choices=["none", "fp16", "bf16"],
                        help="autocast dtype (default on cuda: fp16 for gpt, bf16 for llama; none on cpu)")
    parser.add_argument("--compare", action="store_true",
                        help="also train with plain PyTorch, from step 0 even when resuming, and compare (adamw only)")
    parser.add_argument("--plot", default=None,
                        help=f"image of both loss curves, with --compare (default: {DEFAULT_PLOT}); "
                             "the extension picks the format")
    parser.add_argument("--save", default=None, help="checkpoint of the trainops run, written at the end")
    parser.add_argument("--resume", default=None,
                        help="checkpoint to continue (from --save): same --config, --optimizer, --amp and --lr, "
                             "and --steps past its step")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads, at least 1 (torch.set_num_threads)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (gpt: both runs; llama: the trainops run, --compare's "
                             "pytorch-compile being PyTorch's)")
    parser.add_argument("--dropout", type=_dropout_probability, default=0.0,
                        help="dropout probability in [0, 1) on attention probabilities and each block's branch "
                             "outputs (default: 0)")
    parser.add_argument("--fsdp", action="store_true",
                        help="under torchrun: shard the gpt model with FSDP2 over the ranks (NCCL on cuda, one GPU "
                             "a rank; gloo on cpu); --compare trains plain FSDP2 beside it")
    parser.add_argument("--runs", default=None,
                        help=f"--model llama: the runs to train, comma-separated, from {', '.join(llama.RUNS)} "
                             "(default: trainops; --compare: trainops, pytorch, pytorch-compile and liger); "
                             f"--model cnn: from {', '.join(cnn.CNN_RUNS)}")
    parser.add_argument("--gist", default=None, choices=cnn.GIST_CHOICES,
                        help="--model cnn: what the trainops run stores compressed for the backward (default: relu, "
                             "1 bit a ReLU output, exact; bf16 / fp16 / e5m2 / e4m3: also every other saved "
                             "activation, lossy; none: nothing)")
    parser.add_argument("--optim-bits", type=int, default=32, choices=[32, 8],
                        help="the trainops run's optimizer states: 32 (float32, default) or 8 (blockwise 8-bit "
                             "moments, trainops.optim's optim_bits=8)")
    parser.add_argument("--param-dtype", default="float32", choices=list(PARAM_DTYPES),
                        help="the trainops run's parameters (and gradients): float32 (default) or bfloat16")
    parser.add_argument("--master-weights", action="store_true",
                        help="with --param-dtype bfloat16: the optimizer keeps float32 master copies")
    parser.add_argument("--stochastic-rounding", action="store_true",
                        help="with --param-dtype bfloat16, without --master-weights: round each updated "
                             "parameter to bfloat16 stochastically (seeded by the run's seed)")
    parser.add_argument("--step-in-backward", action="store_true",
                        help="the trainops run steps inside the backward (trainops.optim.step_in_backward), freeing "
                             "each gradient as it is used; no fp16, and no clip (--max-grad-norm 0) unless "
                             "--clip-with-previous-norm")
    parser.add_argument("--clip-with-previous-norm", action="store_true",
                        help="with --step-in-backward: clip each step with the coefficient of the previous step's "
                             "global gradient norm (the first step unclipped)")
    parser.add_argument("--max-grad-norm", type=_non_negative_float, default=None,
                        help="global gradient-norm clip of every run, 0 for none (default: 1.0)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="--model cnn, --device cuda: record each run's training step (forward, backward, "
                             "optimizer step) once as a CUDA graph (trainops.capture_step) and replay it every later "
                             "step: no host time per module (not the torch.compile run)")
    args = parser.parse_args(argv)
    if args.model == "cnn":
        return cnn.main_cnn(parser, args)
    if args.gist is not None:
        parser.error("argument --gist: only with --model cnn")
    if args.cuda_graphs:
        parser.error("argument --cuda-graphs: only with --model cnn")
    if args.model == "llama":
        if args.fsdp:
            parser.error("argument --fsdp: only with --model gpt (the default)")
        return llama.main_llama(parser, args)
    if args.runs is not None:
        parser.error("argument --runs: only with --model llama (the gpt model's --compare trains trainops and "
                     "pytorch)")
    if args.fsdp and args.step_in_backward:
        parser.error("argument --step-in-backward: not available with --fsdp (FSDP2 writes the sharded gradients "
                     "outside autograd's accumulation, where the step's hooks run)")
    if args.fsdp and args.param_dtype != "float32":
        parser.error("argument --param-dtype: bfloat16 parameters are not available with --fsdp (untested there)")
    cfg, plot_path = gpt.config_from_args(parser, args)
    if args.fsdp:
        from . import fsdp   # torch.distributed: imported only for --fsdp
        return fsdp.main_fsdp(parser, args, cfg, plot_path)
    return gpt.main_gpt(parser, args, cfg, plot_path)
