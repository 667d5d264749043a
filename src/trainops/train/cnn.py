"""``python -m trainops train --model cnn``: a small ResNet trained on generated images, with trainops's
batch norm and GIST, beside PyTorch eager and torch.compile (issue 22's main job).

The images: 10 classes of 3 x 32 x 32 oriented sinusoidal gratings (class c: orientation c * 18
degrees, spatial frequency 0.2 + 0.05 (c mod 5) radians a pixel, a random phase, the same wave in
the three channels) plus Gaussian noise of standard deviation ``noise``; batch ``s`` is drawn from
a generator seeded by (seed, s) (held-out batches from seeds no training batch uses), so every
run sees the same images and nothing is downloaded or read.

The model (``CNN_CONFIGS``): a CIFAR-style ResNet: a 3x3 stem convolution, batch norm and ReLU,
then stages of basic blocks (two 3x3 convolutions with batch norms, ReLUs, an identity or a strided
1x1 convolution shortcut; each stage after the first halves the resolution and doubles the
width), global average pooling and a linear head. Every run's convolutions are torch's: the
convolution registry (``trainops.nn.Conv2d``) would choose cuDNN for every one of them (this
network has no depthwise convolution, where alone its Triton kernels run), torch's own kernel, so
routing them through it only added a custom op's host time to each call.

Runs (``CNN_RUNS``), from the same initial weights (same seed) on the same batches, SGD with
Nesterov momentum 0.9, weight decay 5e-4 (not on batch norms and biases), warm-up then cosine
decay of the learning rate, autocast bf16 and channels-last on CUDA, float32 on the CPU:

- ``trainops``: ``trainops.nn.BatchNormReLU2d`` for each batch norm followed by a ReLU (the stem's
  and each block's first: batch norm and ReLU in one pass, no ReLU node in the backward),
  ``trainops.nn.BatchNorm2d`` for the others, ``trainops.gist.compress`` (the remaining
  ReLUs, after the residual additions, keep 1 bit an element; with ``--gist`` bf16 / fp16 / e5m2 /
  e4m3 also every other saved activation packed, lossy; under bf16 autocast only the 1-byte
  formats pack anything, so bf16 / fp16 are refused there), ``trainops.optim.SGD``. In this
  network each ReLU's output is the next convolution's saved input, so the 1-bit ReLUs alone save
  about nothing: the stash does;
- ``pytorch``: the same model with torch's modules and ``torch.optim.SGD``;
- ``pytorch-compile``: the pytorch run under ``torch.compile``.

``--cuda-graphs`` (CUDA): the trainops and pytorch runs' training step (forward, backward, optimizer
step) is recorded once as a CUDA graph by ``trainops.capture_step`` after ``GRAPH_WARMUP`` eager steps
and replayed for every later step, so a step costs its GPU time and no host time per module. The
learning rate then lives in a CUDA tensor that the schedule fills before each step; the pytorch run
uses torch's fused SGD (the foreach one reads a tensor learning rate on the host). The
pytorch-compile run stays as it is.

Each run reports its loss curve, held-out loss and accuracy, images/s and the median step time
(the first ``UNTIMED_STEPS`` steps left out), and peak memory (CUDA: the most allocated during the
training steps; CPU: the process's peak resident size so far, which only grows from run to run).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass

import torch

from .common import (RunResult, autocast_dtype, checked_plot_path, curves_table, median, parameter_groups,
                     parse_runs, peak_memory_mb, plot_curves, results_table, show_progress)

CNN_CONFIGS = {
    # tiny: CI. small: the CPU default, about a minute on 2 cores. resnet18: ResNet-18's widths (GPU).
    "tiny": dict(widths=(8, 16), blocks=1, batch=16, steps=8, lr=0.05, noise=0.5),
    "small": dict(widths=(16, 32, 64), blocks=1, batch=64, steps=60, lr=0.1, noise=0.5),
    "resnet18": dict(widths=(64, 128, 256, 512), blocks=2, batch=256, steps=100, lr=0.1, noise=0.5),
}
CNN_RUNS = {"trainops": "trainops (BatchNorm, GIST)", "pytorch": "PyTorch eager", "pytorch-compile": "torch.compile"}
GIST_CHOICES = ("none", "relu", "bf16", "fp16", "e5m2", "e4m3")   # relu + a stash format, for the last four
UNTIMED_STEPS = 3
GRAPH_WARMUP = UNTIMED_STEPS - 1   # --cuda-graphs: eager steps before the capture (the next, untimed, step)
WEIGHT_DECAY = 5e-4   # SGD's usual decay for ResNets, on kernels and weights only
VAL_BATCHES = 4
CLASSES = 10


@dataclass(frozen=True)
class CnnRunConfig:
    widths: tuple
    blocks: int
    batch: int
    steps: int
    lr: float
    noise: float
    gist: str = "relu"
    amp: str = "none"
    seed: int = 0
    warmup: int = 5
    cuda_graphs: bool = False


def gratings(batch: int, seed: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (batch, 3, 32, 32) float32, labels (batch,) int64) of the batch seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (batch,), generator=gen)
    angle = labels.double() * math.pi / CLASSES
    freq = 0.2 + 0.05 * (labels % 5).double()
    phase = torch.rand(batch, generator=gen, dtype=torch.float64) * 2 * math.pi
    ys, xs = torch.meshgrid(torch.arange(32.0, dtype=torch.float64), torch.arange(32.0, dtype=torch.float64),
                            indexing="ij")
    along = xs * torch.cos(angle)[:, None, None] + ys * torch.sin(angle)[:, None, None]
    wave = torch.sin(freq[:, None, None] * along + phase[:, None, None])
    images = wave[:, None].expand(batch, 3, 32, 32) + noise * torch.randn(batch, 3, 32, 32, generator=gen,
                                                                          dtype=torch.float64)
    return images.float(), labels


class BasicBlock(torch.nn.Module):
    """``norm_relu(channels)``: a module computing relu(batch norm) in one (trainops.nn.BatchNormReLU2d),
    used for ``bn1`` in place of ``norm`` then ``relu1`` (None then); the parameters and their order
    are the same either way."""

    def __init__(self, cin: int, cout: int, stride: int, norm, conv=torch.nn.Conv2d, norm_relu=None):
        super().__init__()
        self.conv1 = conv(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = (norm_relu or norm)(cout)
        self.relu1 = None if norm_relu else torch.nn.ReLU(inplace=True)
        self.conv2 = conv(cout, cout, 3, padding=1, bias=False)
        self.bn2 = norm(cout)
        self.relu2 = torch.nn.ReLU(inplace=True)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = torch.nn.Sequential(conv(cin, cout, 1, stride=stride, bias=False), norm(cout))

    def forward(self, x):
        out = self.bn1(self.conv1(x))
        if self.relu1 is not None:
            out = self.relu1(out)
        out = self.bn2(self.conv2(out))
        return self.relu2(out + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(torch.nn.Module):
    """The CIFAR-style ResNet of the module docstring; ``norm(channels)`` makes each batch norm,
    ``conv`` (torch.nn.Conv2d's constructor) each convolution, ``norm_relu(channels)`` (optional)
    each batch norm that a ReLU follows, the two in one module (the stem's and each block's first;
    the same parameters, in the same order, as with ``norm``)."""

    def __init__(self, widths, blocks: int, norm=torch.nn.BatchNorm2d, conv=torch.nn.Conv2d, norm_relu=None):
        super().__init__()
        stem = [conv(3, widths[0], 3, padding=1, bias=False)]
        stem += [norm_relu(widths[0])] if norm_relu else [norm(widths[0]), torch.nn.ReLU(inplace=True)]
        self.stem = torch.nn.Sequential(*stem)
        layers, cin = [], widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks):
                layers.append(BasicBlock(cin, width, 2 if i > 0 and j == 0 else 1, norm, conv, norm_relu))
                cin = width
        self.stages = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(cin, CLASSES)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


def build_model(cfg: CnnRunConfig, device: torch.device, use_trainops: bool) -> torch.nn.Module:
    """The ResNet with torch's or trainops's batch norms (trainops's: BatchNormReLU2d where a ReLU
    follows), the same initial weights either way."""
    import trainops

    torch.manual_seed(cfg.seed)
    if use_trainops:
        model = ResNet(cfg.widths, cfg.blocks, trainops.nn.BatchNorm2d, norm_relu=trainops.nn.BatchNormReLU2d)
    else:
        model = ResNet(cfg.widths, cfg.blocks)
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model


def learning_rate(cfg: CnnRunConfig, step: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def graphed(cfg: CnnRunConfig, run: str) -> bool:
    """Whether ``run`` trains as a CUDA graph (``--cuda-graphs``; not the torch.compile run)."""
    return cfg.cuda_graphs and run != "pytorch-compile"


def build_run(cfg: CnnRunConfig, device: torch.device, run: str):
    """(model, forward, optimizer, GistHandle or None) of one of CNN_RUNS. Graphed runs
    (``graphed``): the learning rate is one CUDA tensor shared by the parameter groups."""
    import trainops

    if run not in CNN_RUNS:
        raise ValueError(f"trainops train: no run {run!r}; the runs are {', '.join(CNN_RUNS)}")
    use_trainops = run == "trainops"
    model = build_model(cfg, device, use_trainops)
    handle = None
    lr = torch.tensor(cfg.lr, device=device) if graphed(cfg, run) else cfg.lr
    if use_trainops:
        if cfg.gist != "none":
            handle = trainops.gist.compress(model, relu=True, stash=None if cfg.gist == "relu" else cfg.gist)
        opt = trainops.optim.SGD(parameter_groups(model, WEIGHT_DECAY), lr=lr, momentum=0.9, nesterov=True)
    else:
        # a tensor learning rate: torch's fused SGD reads it on the device (the foreach one calls .item())
        fused = {"fused": True} if graphed(cfg, run) else {}
        opt = torch.optim.SGD(parameter_groups(model, WEIGHT_DECAY), lr=lr, momentum=0.9, nesterov=True, **fused)
    forward = torch.compile(model) if run == "pytorch-compile" else model
    return model, forward, opt, handle


def _images(cfg: CnnRunConfig, seed: int, device: torch.device):
    x, y = gratings(cfg.batch, seed, cfg.noise)
    x = x.to(device, non_blocking=True)
    if device.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y.to(device, non_blocking=True)


def evaluate(model, cfg: CnnRunConfig, device: torch.device) -> tuple[float, float]:
    """(mean held-out loss, accuracy) over VAL_BATCHES batches, eval mode (running statistics)."""
    amp_dtype = autocast_dtype(cfg)
    model.eval()
    losses, correct, seen = [], 0, 0
    with torch.no_grad():
        for i in range(VAL_BATCHES):
            x, y = _images(cfg, 1_000_000 + cfg.seed * 1000 + i, device)
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                logits = model(x)
            losses.append(float(torch.nn.functional.cross_entropy(logits.float(), y)))
            correct += int((logits.argmax(1) == y).sum())
            seen += y.numel()
    model.train()
    return sum(losses) / len(losses), correct / seen


@dataclass
class CnnResult:
    run: RunResult        # tokens_per_s holds images/s
    accuracy: float
    stash: object = None  # the GIST handle's StashStats of the last forward, with a stash


def _step_function(cfg: CnnRunConfig, run: str, device: torch.device, forward, opt):
    """(step(x, y) -> the loss, the CUDA learning-rate tensor or None): one training step, eager
    (gradients set to None after the optimizer step) or, for a graphed run, a CapturedStep."""
    import trainops

    amp_dtype = autocast_dtype(cfg)

    def train_step(x, y):
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = torch.nn.functional.cross_entropy(forward(x).float(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    if graphed(cfg, run):   # capture_step sets the gradients to None before each eager call and the capture
        return trainops.capture_step(train_step, [opt], warmup_steps=GRAPH_WARMUP), opt.param_groups[0]["lr"]

    def eager_step(x, y):
        loss = train_step(x, y)
        opt.zero_grad(set_to_none=True)
        return loss
    return eager_step, None


def run_cnn(cfg: CnnRunConfig, device: torch.device, run: str, *, quiet: bool = False) -> CnnResult:
    """Train ``cfg.steps`` steps of one of CNN_RUNS and evaluate it."""
    import trainops

    model, forward, opt, handle = build_run(cfg, device, run)
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    step_fn, lr_tensor = _step_function(cfg, run, device, forward, opt)
    losses, step_times = [], []
    with trainops.track_kernels() as used:
        for step in range(cfg.steps):
            if lr_tensor is not None:
                lr_tensor.fill_(learning_rate(cfg, step))
            else:
                for group in opt.param_groups:
                    group["lr"] = learning_rate(cfg, step)
            x, y = _images(cfg, cfg.seed * 1_000_003 + step, device)
            started = time.perf_counter()
            loss = step_fn(x, y)
            losses.append(float(loss))   # one host read per step: the step is done when it returns
            if step >= UNTIMED_STEPS:   # a graphed run's warm-up steps and capture among them
                step_times.append(1e3 * (time.perf_counter() - started))
            if not quiet:
                timed = sum(step_times)
                show_progress(run, step + 1, cfg.steps, losses[-1],
                              1e3 * len(step_times) * cfg.batch / timed if timed else 0, final=step + 1 == cfg.steps,
                              unit="images/s")
    peak = peak_memory_mb(device)
    stash = handle.stats if handle is not None else None   # the last training step's (evaluation packs nothing)
    val, accuracy = evaluate(model, cfg, device)
    timed = sum(step_times)
    result = RunResult(run, losses, val, 1e3 * len(step_times) * cfg.batch / timed if timed else math.nan,
                       timed / len(step_times) if step_times else math.nan, peak, dict(used), step_times)
    del model, forward, opt, handle, step_fn   # a graphed step holds its graph's memory pool
    gc.collect()
    if run.endswith("-compile"):
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return CnnResult(result, accuracy, stash)


def summary(result: CnnResult) -> str:
    r = result.run
    speed = (f"{r.tokens_per_s:,.0f} images/s, {r.step_ms:.1f} ms/step (median {median(r.step_times_ms):.1f})"
             if r.step_times_ms else f"speed not measured (the first {UNTIMED_STEPS} steps of a run are not timed)")
    lines = [f"{r.name}: final loss {sum(r.losses[-5:]) / len(r.losses[-5:]):.4f} (mean of last 5 steps), held-out "
             f"loss {r.val_loss:.4f}, accuracy {100 * result.accuracy:.1f}%, {speed}, peak memory "
             f"{r.peak_memory_mb:,.0f} MiB"]
    if result.stash is not None:
        s = result.stash
        lines.append(f"  GIST stash: {s.packed} saved activations packed a step, {s.original_bytes / 2**20:,.1f} -> "
                     f"{s.stored_bytes / 2**20:,.1f} MiB")
    if r.kernels:
        lines.append("  trainops kernels that ran (op, backend, kernel, dtype: calls):")
        for (op, backend, kernel, dtype), calls in sorted(r.kernels.items()):
            lines.append(f"    {op:22s} {backend:7s} {kernel:34s} {dtype:9s} {calls}")
    return "\n".join(lines)


def main_cnn(parser, args) -> int:
    """``python -m trainops train --model cnn``: check the arguments (parser.error before any work),
    train every run, report."""
    if args.config not in CNN_CONFIGS:
        parser.error(f"argument --config: --model cnn has {', '.join(CNN_CONFIGS)}; got {args.config!r}")
    for option, given in (("--save", args.save is not None), ("--resume", args.resume is not None),
                          ("--dropout", args.dropout != 0.0), ("--fsdp", args.fsdp),
                          ("--optimizer", args.optimizer != "adamw"), ("--optim-bits", args.optim_bits != 32),
                          ("--param-dtype", args.param_dtype != "float32"), ("--master-weights", args.master_weights),
                          ("--stochastic-rounding", args.stochastic_rounding),
                          ("--step-in-backward", args.step_in_backward),
                          ("--clip-with-previous-norm", args.clip_with_previous_norm),
                          ("--max-grad-norm", args.max_grad_norm is not None)):
        if given:
            parser.error(f"argument {option}: not available with --model cnn (its runs train with SGD)")
    if args.compile:
        parser.error("argument --compile: --model cnn's --compare trains torch.compile's run itself; the trainops "
                     "run is eager")
    if args.runs is not None:
        if args.compare:
            parser.error("argument --runs: names the runs itself; leave out --compare")
        runs = parse_runs(parser, args.runs, CNN_RUNS, "a --model cnn run")
    else:
        runs = ["trainops"] + (["pytorch", "pytorch-compile"] if args.compare else [])
    device = args.device
    if args.cuda_graphs and device.type != "cuda":
        parser.error("argument --cuda-graphs: needs --device cuda (a CUDA graph records CUDA kernels)")
    amp = args.amp or ("bf16" if device.type == "cuda" else "none")
    if device.type == "cuda" and amp == "bf16" and not torch.cuda.is_bf16_supported():
        parser.error(f"argument --amp: bf16 is not supported by {torch.cuda.get_device_name(device)}; use --amp fp16 "
                     "or none")
    if amp == "fp16":
        parser.error("argument --amp: --model cnn runs bf16 or none (fp16 would need a loss scaler in every run)")
    gist = "relu" if args.gist is None else args.gist   # the default: 1 bit a ReLU output, exact
    if amp == "bf16" and gist in ("bf16", "fp16"):
        parser.error(f"argument --gist: {gist} packs nothing under --amp bf16 (the saved activations are 2 "
                     "bytes already); choose e4m3 or e5m2, or --amp none")
    base = CNN_CONFIGS[args.config]
    cfg = CnnRunConfig(**{**base, "steps": base["steps"] if args.steps is None else args.steps,
                          "lr": base["lr"] if args.lr is None else args.lr}, gist=gist, amp=amp,
                        cuda_graphs=args.cuda_graphs)
    plot_path = checked_plot_path(parser, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    params = sum(p.numel() for p in ResNet(cfg.widths, cfg.blocks).parameters())
    print(f"trainops train: {args.config} ResNet (widths {', '.join(map(str, cfg.widths))}, {cfg.blocks} basic "
          f"block(s) a stage, {params / 1e6:.2f} M parameters), {cfg.steps} steps of {cfg.batch} 3x32x32 gratings "
          f"(10 classes, noise {cfg.noise}), SGD, amp {cfg.amp}, GIST {cfg.gist}, on {device}"
          f"{', CUDA graphs (not the torch.compile run)' if cfg.cuda_graphs else ''}; runs: {', '.join(runs)}")
    results = []
    for run in runs:
        result = run_cnn(cfg, device, run)
        print(summary(result))
        results.append(result)
    if len(results) > 1:
        plain = [r.run for r in results]
        print(curves_table(plain, every=max(1, cfg.steps // 15)))
        print(results_table(plain, device, CNN_RUNS, UNTIMED_STEPS, unit="images/s"))
    if plot_path:
        print(plot_curves([r.run for r in results], plot_path, f"{args.config} ResNet on {device}, batch {cfg.batch}",
                          runs=CNN_RUNS))
    return 0


__all__ = ["CNN_CONFIGS", "CNN_RUNS", "GIST_CHOICES", "ResNet", "gratings", "main_cnn", "run_cnn"]
