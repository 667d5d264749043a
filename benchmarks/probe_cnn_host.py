"""Host (Python) time of one eager training step of the cnn demo's ResNet-18, on the CPU with every
Triton launch stubbed: trainops's model against the same model with torch's modules (issue 42,
item 4; benchmarks/notes/cnn-host.md).

    PYTHONPATH=src python benchmarks/probe_cnn_host.py [--steps 300] [--rounds 3] [--profile 100] [--out F.json]

The model is ``train/cnn.py``'s ResNet (ResNet-18's layout: 4 stages of 2 basic blocks) at small
widths (``--widths``, default 4,8,16,32) on a (``--batch`` 2) x 3 x 16 x 16 channels-last float32
input, so that torch's CPU kernels (the convolutions, and in the pytorch run its batch norms) do
little work and the step's time is mostly host time. A step is the demo's eager step: forward,
cross-entropy, backward, optimizer step, gradients set to None.

trainops run: TRITON_INTERPRET=1 (set before trainops is imported: Triton plans for CPU tensors),
the triton backend pinned, each op module's ``launcher`` stubbed and the optimizers' Triton kernels
replaced by no-ops, as ``probe_host_time.py --python-only`` does: every Python layer a GPU call runs
(modules, functional checks, custom-op shortcut, descriptors, plan cache, outputs, autograd) and
none of the launches (their own Python cost, in ``trainops.launch``'s direct path, is not counted).
The outputs are garbage; nothing is compared. pytorch run: torch's modules and its foreach SGD
(the demo's eager pytorch run), whose CPU kernels do real (small) work.

Figures: the step's thread CPU time (``time.thread_time_ns``), median of ``--rounds`` rounds of
``--steps`` steps after warm-up; then a cProfile of ``--profile`` steps, each op kind's cumulative
time a step (the functions named in ``KINDS``) and the step's own time in Python frames (tottime of
every function that is not a C built-in), which is the part comparable across the two runs.
cProfile inflates Python-heavy code about 1.5-2x; its figures are for proportions.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")   # before trainops is imported

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import time

import torch

import trainops
from trainops.train.cnn import ResNet

# (label, (file suffix, function name)): cProfile's cumulative time of these functions, a step
KINDS = (
    ("module __call__ (own time, all modules)", ("torch/nn/modules/module.py", "_call_impl"), "tottime"),
    ("batch norm forward (module)", ("trainops/nn.py", "_BatchNormForward.forward"), None),
    ("  of which batch_norm (functional)", ("trainops/functional.py", "batch_norm"), "cumtime"),
    ("  of which batch_norm_relu (functional)", ("trainops/functional.py", "batch_norm_relu"), "cumtime"),
    ("batch norm backward (bn _grad)", ("trainops/ops/batch_norm.py", "_grad"), "cumtime"),
    ("GIST ReLU forward (module)", ("trainops/gist.py", "ReLU.forward"), None),
    ("GIST ReLU backward (gist _grad)", ("trainops/ops/gist.py", "_grad"), "cumtime"),
    ("GIST ReLU backward (eager node)", ("trainops/ops/gist.py", "_EagerGistRelu.backward"), "cumtime"),
    ("custom-op backward wrapper (_gradients)", ("trainops/library.py", "_gradients"), "tottime"),
    ("SGD step", ("trainops/optim.py", "step"), "cumtime"),
    ("torch BatchNorm2d.forward", ("torch/nn/modules/batchnorm.py", "forward"), "cumtime"),
    ("torch ReLU.forward", ("torch/nn/modules/activation.py", "forward"), "cumtime"),
    ("torch optimizer step", ("torch/optim/optimizer.py", "wrapper"), "cumtime"),
)


def _stub_launches() -> None:
    """Every op module's ``launcher`` a no-op factory (probe_host_time.stub_op_launchers); the
    optimizers' jitted kernels no-ops."""
    from probe_host_time import stub_op_launchers

    class _NoKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    stub_op_launchers()
    from triton.runtime.jit import KernelInterface

    from trainops.ops import optimizers
    for name, value in list(vars(optimizers).items()):
        if isinstance(value, KernelInterface):   # a JITFunction, or the interpreter's InterpretedFunction
            setattr(optimizers, name, _NoKernel())


def build(run: str, widths, batch: int, size: int):
    """(step(), the model) of ``run``: "trainops" (the demo's trainops model, GIST ReLUs, fused SGD) or
    "pytorch" (torch's modules, torch's SGD)."""
    from trainops.train.common import parameter_groups

    torch.manual_seed(0)
    if run == "trainops":
        model = ResNet(widths, 2, trainops.nn.BatchNorm2d, norm_relu=trainops.nn.BatchNormReLU2d)
        trainops.gist.compress(model, relu=True)
        opt = trainops.optim.SGD(parameter_groups(model, 5e-4), lr=0.1, momentum=0.9, nesterov=True)
    else:
        model = ResNet(widths, 2)
        opt = torch.optim.SGD(parameter_groups(model, 5e-4), lr=0.1, momentum=0.9, nesterov=True)
    model = model.to(memory_format=torch.channels_last).train()
    x = torch.randn(batch, 3, size, size).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))

    def step():
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model


def timed_us(step, steps: int) -> float:
    started = time.thread_time_ns()
    for _ in range(steps):
        step()
    return (time.thread_time_ns() - started) / steps / 1e3


def profile(step, steps: int) -> dict:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    stats = pstats.Stats(pr).stats   # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    python_own = sum(v[2] for (f, _, _), v in stats.items() if f != "~") / steps * 1e6
    everything = sum(v[2] for v in stats.values()) / steps * 1e6
    kinds = {}
    for label, (suffix, name), column in KINDS:
        short = name.rsplit(".", 1)[-1]
        total, calls = 0.0, 0
        for (f, line, fn), v in stats.items():
            if f.endswith(suffix) and fn == short and (("." not in name) or _qualified(f, line, name)):
                total += v[2] if column == "tottime" else v[3]
                calls += v[1]
        if calls:
            kinds[label] = {"us_a_step": total / steps * 1e6, "calls_a_step": calls / steps}
    top = sorted(((v[2], f"{os.path.basename(f)}:{line}({fn})", v[1]) for (f, line, fn), v in stats.items()),
                 reverse=True)[:25]
    return {"python_own_us": python_own, "profiled_us": everything, "kinds": kinds,
            "top_tottime": [{"function": name, "us_a_step": t / steps * 1e6, "calls_a_step": n / steps}
                            for t, name, n in top]}


def _qualified(path: str, line: int, name: str) -> bool:
    """Whether the function at ``path``:``line`` is ``Class.method`` (cProfile keys carry no class)."""
    cls = name.split(".")[0]
    try:
        with open(path) as f:
            lines = f.readlines()[:line]
    except OSError:
        return False
    for text in reversed(lines):
        if text.startswith("class "):
            return text[len("class "):].split("(")[0].split(":")[0].strip() == cls
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="trainops,pytorch")
    parser.add_argument("--widths", default="4,8,16,32")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=int, default=100, help="profiled steps (0: no profile)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _stub_launches()
    widths = tuple(int(w) for w in args.widths.split(","))
    results = {}
    with trainops.backend("triton"):
        steps = {run: build(run, widths, args.batch, args.size)[0] for run in args.runs.split(",")}
        for step in steps.values():
            for _ in range(args.warmup):
                step()
        rounds = {run: [] for run in steps}
        for _ in range(args.rounds):
            for run, step in steps.items():
                rounds[run].append(timed_us(step, args.steps))
        for run, step in steps.items():
            results[run] = {"step_us": statistics.median(rounds[run]), "rounds_us": rounds[run]}
            if args.profile:
                results[run]["profile"] = profile(step, args.profile)
    for run, r in results.items():
        print(f"\n{run}: {r['step_us']:.0f} us a step (thread time, median of {r['rounds_us']})")
        p = r.get("profile")
        if p:
            print(f"  profiled: {p['profiled_us']:.0f} us a step, own time in Python frames {p['python_own_us']:.0f}")
            for label, k in p["kinds"].items():
                print(f"  {label:45s} {k['us_a_step']:8.0f} us  ({k['calls_a_step']:.0f} calls)")
            print("  top own time:")
            for t in p["top_tottime"][:15]:
                print(f"    {t['function'][:70]:70s} {t['us_a_step']:7.0f} us  {t['calls_a_step']:.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"probe": "cnn_host", "settings": vars(args),
                       "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
