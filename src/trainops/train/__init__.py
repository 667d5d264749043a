"""``python -m trainops train``: the training demos, one module per model.

- ``gpt``: the byte-level GPT written over trainops's ops (the default ``--model gpt``), its
  checkpoints (``--save`` / ``--resume``);
- ``fsdp``: that GPT sharded by FSDP2 under torchrun (``--fsdp``);
- ``llama``: transformers's LlamaForCausalLM on BPE tokens, patched by ``trainops.patch``
  (``--model llama``);
- ``cnn``: a small ResNet on generated images with trainops's batch norm and GIST (``--model cnn``);
- ``common``: what they share (the standard-library data, batches, learning-rate schedule,
  evaluation, progress, peak memory, ``RunResult`` and the reports, the command line's file checks);
- ``cli``: the command line (``main``), which parses the options and hands them to a model module.

Imports flow one way: ``cli`` -> ``gpt`` / ``llama`` / ``cnn`` (``fsdp`` -> ``gpt``) -> ``common``;
no model module imports ``cli`` or this package's ``__init__``. The gpt demo's names (``Config``,
``CONFIGS``, ``GPT``, ``Kernels``, ``run``, ``read_checkpoint`` ...) and ``main`` are re-exported
here, where they lived before the demos became a package.
"""

from .cli import main
from .common import (DEFAULT_PLOT, Batches, RunResult, base_lr, evaluate, learning_rate, stdlib_bytes, stdlib_source,
                     unwritable_reason)
from .gpt import (CHECKPOINT_ENTRIES, CONFIGS, GPT, MLP, TORCH_KERNELS, UNTIMED_STEPS, Attention, Block,
                  CheckpointError, Config, Kernels, build, check_continues, compare_table, config_name, plot,
                  read_checkpoint, restore, rotary_tables, run, save_checkpoint, summary, train_step, trainops_kernels)

__all__ = ["Attention", "Batches", "Block", "CHECKPOINT_ENTRIES", "CONFIGS", "CheckpointError", "Config", "DEFAULT_PLOT",
           "GPT", "Kernels", "MLP", "RunResult", "TORCH_KERNELS", "UNTIMED_STEPS", "base_lr", "build", "check_continues",
           "compare_table", "config_name", "evaluate", "learning_rate", "main", "plot", "read_checkpoint", "restore",
           "rotary_tables", "run", "save_checkpoint", "stdlib_bytes", "stdlib_source", "summary", "train_step",
           "trainops_kernels", "unwritable_reason"]
