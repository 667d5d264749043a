"""GIST on a small ResNet (issue 22): what each policy saves and what it does to training.

    python benchmarks/bench_gist.py [--device cuda] [--steps 60] [--batch 64] [--width 32] [--out f.json]

Policies: none (torch's ReLU), relu (trainops.gist.ReLU: 1 bit an element, exact), relu + a stash
format (bf16, fp16, e5m2, e4m3: every other saved activation packed). For each, from the same
weights on the same batches:
  saved bytes    what the autograd graph holds after one forward (the stash's StashStats, and the
                 ReLUs' bits against torch's saved outputs, counted from the saved tensors)
  peak memory    CUDA only: max_memory_allocated over a forward + backward, above the weights
  step ms        median of the timed steps (CUDA: synchronised)
  grad error     the largest relative-norm distance of a parameter's gradient at step 0 from the
                 policy "none"'s (float32 gradients, compared in float64): what the packing changes
  loss curve     the training loss each step (SGD with momentum), and its largest and mean
                 relative distance from "none"

The images: trainops.train.cnn's gratings (10 classes of 3 x 32 x 32 sinusoidal gratings, a frequency
and orientation per class, random phase, Gaussian noise 0.5), from a seed; nothing is downloaded.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import trainops  # noqa: E402
from trainops.train.cnn import gratings  # noqa: E402

POLICIES = (("none", False, None), ("relu", True, None), ("relu+bf16", True, "bf16"), ("relu+fp16", True, "fp16"),
            ("relu+e5m2", True, "e5m2"), ("relu+e4m3", True, "e4m3"))


def batch_of(batch: int, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s gratings (trainops.train.cnn's, noise 0.5) on ``device``."""
    images, labels = gratings(batch, 1000 + step, 0.5)
    return images.to(device), labels.to(device)


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.relu1 = torch.nn.ReLU(inplace=True)
        self.conv2 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(width)
        self.relu2 = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu2(self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))) + x)


def resnet(width: int, device, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, width, 3, padding=1, bias=False), torch.nn.BatchNorm2d(width),
                               torch.nn.ReLU(inplace=True), Block(width), Block(width), torch.nn.MaxPool2d(2),
                               Block(width), Block(width), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(width, 10)).to(device=device, dtype=dtype)


def saved_bytes(model, x) -> int:
    """Bytes of the distinct tensors the autograd graph saves in one forward (each storage once)."""
    seen = {}

    def pack(t):
        if isinstance(t, trainops.ops.gist.Stashed):
            key, size = id(t), t.data.numel() * t.data.element_size()
        else:
            key, size = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()), t.untyped_storage().nbytes()
        seen[key] = (size, t)   # keep it alive: no address reused within the count
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(size for size, _ in seen.values())


def run(policy, device, steps: int, batch: int, width: int) -> dict:
    name, relu, stash = policy
    model = resnet(width, device)
    handle = trainops.gist.compress(model, relu=relu, stash=stash) if relu or stash else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x0, y0 = batch_of(batch, 0, device)
    out = {"policy": name}
    # bytes the graph keeps: with a stash, count what its hooks store (the packed copies, and the
    # tensors they leave, through an outer count of the model run without the stash's hooks)
    if handle is not None and stash is not None:
        model(x0)
        stats = handle.stats
        handle.remove()
        unpacked = saved_bytes(model, x0)
        handle = trainops.gist.compress(model, relu=False, stash=stash)
        out["saved MiB"] = (unpacked - stats.original_bytes + stats.stored_bytes) / 2**20
        out["stash"] = vars(stats).copy()
    else:
        out["saved MiB"] = saved_bytes(model, x0) / 2**20
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        x, y = batch_of(batch, step, device)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if step == 0:
            out["grads"] = [p.grad.detach().double().cpu() for p in model.parameters()]
            if device.type == "cuda":
                out["peak MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        opt.step()
        losses.append(float(loss.detach()))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    out["losses"] = losses
    out["step ms"] = statistics.median(times[2:]) if len(times) > 2 else times[-1]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = [run(p, device, args.steps, args.batch, args.width) for p in POLICIES]
    base_grads = results[0]["grads"]
    base = results[0]
    table = []
    for r in results:
        grad_err = max(((g - b).norm() / b.norm()).item() for g, b in zip(r.pop("grads"), base_grads))
        dist = [abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])]
        r.update({"grad error vs none": grad_err, "loss distance max": max(dist),
                  "loss distance mean": sum(dist) / len(dist),
                  "final loss (mean of last 5)": sum(r["losses"][-5:]) / 5})
        table.append(r)
    print(f"GIST on a small ResNet (width {args.width}, batch {args.batch} of 3x32x32 gratings, {args.steps} steps, "
          f"{device}, torch {torch.__version__})")
    print(f"{'policy':12} {'saved MiB':>10} {'peak MiB':>9} {'step ms':>8} {'grad err':>9} {'loss dist max':>14} "
          f"{'mean':>8} {'final loss':>10}")
    for r in table:
        peak = f"{r['peak MiB']:9.1f}" if "peak MiB" in r else f"{'-':>9}"
        print(f"{r['policy']:12} {r['saved MiB']:10.2f} {peak} {r['step ms']:8.2f} {r['grad error vs none']:9.2e} "
              f"{r['loss distance max']:14.2e} {r['loss distance mean']:8.2e} {r['final loss (mean of last 5)']:10.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                       "torch": torch.__version__, "args": vars(args), "results": table}, f, indent=1)


if __name__ == "__main__":
    main()
