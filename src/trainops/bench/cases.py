"""Benchmark cases: every registered GPU kernel family at the ../shared/ANCHORS.md shapes.

A case builds its inputs once and returns ``{implementation: factory}``; a factory allocates what
that implementation needs (an optimizer's state, say) and returns the zero-argument call that is
timed. The call returns its output (or None) so the runner can compare it with the case's float64
reference. Bytes are the fewest the op must move (each input read once, each output written once).
Inputs are random normal data, never zeros; every GPU shape here is larger than the L2 cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import trainops

Factory = Callable[[], Callable[[], object]]


@dataclass
class Case:
    op: str                                   # registry op timed (the family's main op)
    label: str                                # shape and dtype
    nbytes: int                               # fewest bytes moved
    build: Callable[[bool], tuple[dict[str, Factory], Callable[[], torch.Tensor] | None]]


def _peer(module: str, name: str):
    """``module.name`` of a peer library when it is installed and imports, else None."""
    try:
        mod = __import__(module, fromlist=[name])
        return getattr(mod, name)
    except Exception:
        return None


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _randn(shape, dtype, device, seed, scale=1.0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, device=device, generator=gen) * scale).to(dtype)


# -- softmax family ------------------------------------------------------------------------------

def _softmax_case(op: str, shape, dim: int, dtype, device) -> Case:
    backward = op.endswith("_backward")
    log = op.startswith("log_")

    def build(peers):
        x = _randn(shape, dtype, device, 0, 3.0)
        if not backward:
            inputs = (x,)
            torch_fn = (lambda t: torch.log_softmax(t, dim)) if log else (lambda t: torch.softmax(t, dim))
            reference = lambda: torch_fn(x.double())  # noqa: E731
        else:
            y = torch.log_softmax(x, dim) if log else torch.softmax(x, dim)
            dy = _randn(shape, dtype, device, 1)
            inputs = (dy, y)

            def torch_fn(dy, y):
                if log:
                    return torch._log_softmax_backward_data(dy, y, dim, y.dtype)
                return torch._softmax_backward_data(dy, y, dim, y.dtype)

            def reference():
                yd, dyd = y.double(), dy.double()
                if log:
                    return dyd - yd.exp() * dyd.sum(dim, keepdim=True)
                return yd * (dyd - (yd * dyd).sum(dim, keepdim=True))
        ours = getattr(trainops, op)
        impls = {"trainops": lambda: (lambda: ours(*inputs, dim)), "torch": lambda: (lambda: torch_fn(*inputs))}
        if peers:
            compiled = torch.compile(torch_fn, dynamic=False)
            impls["torch.compile"] = lambda: (lambda: compiled(*inputs))
            liger = _peer("liger_kernel.ops.softmax", "LigerSoftmaxFunction")
            if liger is not None and op == "softmax" and dim in (-1, len(shape) - 1):
                impls["liger"] = lambda: (lambda: liger.apply(*inputs))
            quack_softmax = _peer("quack", "softmax")
            if quack_softmax is not None and op == "softmax" and dim in (-1, len(shape) - 1) and len(shape) == 2:
                impls["quack"] = lambda: (lambda: quack_softmax(*inputs))
        return impls, reference

    nbytes = math.prod(shape) * dtype.itemsize * (3 if backward else 2)
    label = "x".join(map(str, shape)) + (f" dim={dim}" if dim not in (-1, len(shape) - 1) else "") + f" {_dt(dtype)}"
    return Case(op, label, nbytes, build)


def softmax_cases(device, quick: bool) -> list[Case]:
    if quick:
        return [_softmax_case("softmax", (4096, 4096), -1, torch.bfloat16, device),
                _softmax_case("log_softmax_backward", (32, 512, 1024), 1, torch.float32, device)]
    ops = ("softmax", "softmax_backward", "log_softmax", "log_softmax_backward")
    rows = [(32768, 1024), (16384, 4096), (4096, 32768), (1024, 131072), (128, 262144)]
    out = [_softmax_case(op, s, -1, torch.bfloat16, device) for op in ops for s in rows]
    out += [_softmax_case(op, (4096, 32768), -1, torch.float32, device) for op in ops]
    out += [_softmax_case(op, (32, 512, 4096), 1, torch.bfloat16, device) for op in ops]
    return out


# -- gather / embedding ----------------------------------------------------------------------------

def _embedding_backward_case(tokens, dim, rows, dtype, device) -> Case:
    def build(peers):
        dy = _randn((tokens, dim), dtype, device, 2)
        gen = torch.Generator(device=device).manual_seed(3)
        idx = torch.randint(0, rows, (tokens,), device=device, generator=gen)
        ours = lambda: trainops.ops.gather.gather_backward_op(dy, idx, 0, [rows, dim], True, None, False, False,  # noqa
                                                         False)
        def torch_backward(dy, idx):
            return torch.ops.aten.embedding_dense_backward(dy, idx, rows, -1, False)

        atomic = lambda: trainops.ops.gather.gather_backward_op(dy, idx, 0, [rows, dim], False, None, False, False,  # noqa
                                                           False)
        impls = {"trainops": lambda: ours, "trainops atomic (deterministic=False)": lambda: atomic,
                 "torch": lambda: (lambda: torch_backward(dy, idx)),
                 "torch index_add_": lambda: (lambda: torch.zeros(rows, dim, device=device, dtype=dtype)
                                              .index_add_(0, idx, dy))}
        if peers:
            compiled = torch.compile(torch_backward, dynamic=False)
            impls["torch.compile"] = lambda: (lambda: compiled(dy, idx))
        reference = lambda: torch.zeros(rows, dim, device=device, dtype=torch.float64).index_add_(0, idx, dy.double())  # noqa
        return impls, reference

    nbytes = tokens * dim * dtype.itemsize + tokens * 8 + rows * dim * dtype.itemsize
    return Case("gather_backward", f"{tokens}x{dim} into {rows} {_dt(dtype)}", nbytes, build)


def _embedding_forward_case(tokens, dim, rows, dtype, device) -> Case:
    def build(peers):
        weight = _randn((rows, dim), dtype, device, 4)
        gen = torch.Generator(device=device).manual_seed(5)
        idx = torch.randint(0, rows, (tokens,), device=device, generator=gen)
        impls = {"trainops": lambda: (lambda: trainops.embedding(idx, weight, check_index=False)),
                 "torch": lambda: (lambda: F.embedding(idx, weight))}
        if peers:
            compiled = torch.compile(F.embedding, dynamic=False)
            impls["torch.compile"] = lambda: (lambda: compiled(idx, weight))
        return impls, lambda: weight.double()[idx]

    return Case("gather", f"{tokens} rows of {rows}x{dim} {_dt(dtype)}", 2 * tokens * dim * dtype.itemsize + tokens * 8,
                build)


def gather_cases(device, quick: bool) -> list[Case]:
    if quick:
        return [_embedding_backward_case(4096, 1024, 32000, torch.bfloat16, device)]
    return [_embedding_forward_case(32768, 4096, 128256, torch.bfloat16, device),
            _embedding_backward_case(32768, 4096, 128256, torch.bfloat16, device),
            _embedding_backward_case(8192, 4096, 128256, torch.bfloat16, device)]


# -- cross-entropy -------------------------------------------------------------------------------------

def _cross_entropy_case(rows, classes, dtype, device) -> Case:
    def build(peers):
        x = _randn((rows, classes), dtype, device, 6, 2.0).requires_grad_()
        gen = torch.Generator(device=device).manual_seed(7)
        target = torch.randint(0, classes, (rows,), device=device, generator=gen)

        def step(loss_fn, on=None):
            def run():
                x.grad = None
                inp = x if on is None else on()
                loss_fn(inp, target).backward()
                return x.grad
            return run

        impls = {"trainops": lambda: step(trainops.cross_entropy), "torch": lambda: step(F.cross_entropy)}
        if peers:
            compiled = torch.compile(F.cross_entropy, dynamic=False)
            impls["torch.compile"] = lambda: step(compiled)
            liger = _peer("liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction")
            if liger is not None:
                # Liger writes the gradient over its input: give it a copy, so x stays the logits.
                impls["liger"] = lambda: _liger_ce_step(liger, x, target)
            quack_ce = _peer("quack", "cross_entropy")
            if quack_ce is not None:
                impls["quack"] = lambda: step(quack_ce)

        def reference():
            xd = x.detach().double().requires_grad_()
            F.cross_entropy(xd, target).backward()
            return xd.grad
        return impls, reference

    return Case("cross_entropy", f"{rows}x{classes} {_dt(dtype)} fwd+bwd", 2 * rows * classes * dtype.itemsize, build)


def _liger_ce_step(liger, x, target):
    work = x.detach().clone().requires_grad_()

    def run():
        work.grad = None
        liger.apply(work, target, None)[0].backward()
        return work.grad
    return run


def cross_entropy_cases(device, quick: bool) -> list[Case]:
    if quick:
        return [_cross_entropy_case(2048, 32000, torch.bfloat16, device)]
    return [_cross_entropy_case(8192, 32000, torch.bfloat16, device),
            _cross_entropy_case(8192, 128256, torch.bfloat16, device),
            _cross_entropy_case(4096, 262144, torch.bfloat16, device)]


# -- optimizers, loss scaling, gradient accumulation ------------------------------------------------------

def _param_list(total, count, dtype, device, seed=8):
    n = total // count
    params = [_randn((n,), dtype, device, seed + i).requires_grad_() for i in range(count)]
    for i, p in enumerate(params):
        p.grad = _randn((n,), dtype, device, 1000 + seed + i, 1e-2)
    return params


def _optimizer_case(name, total, count, bytes_per_param, device) -> Case:
    def build(peers):
        params = _param_list(total, count, torch.float32, device)
        kwargs = dict(lr=1e-3, momentum=0.9) if name == "SGD" else dict(lr=1e-3)
        op_cls = getattr(trainops.optim, name)
        impls = {"trainops": lambda: op_cls(params, **kwargs).step}
        if hasattr(torch.optim, name):
            torch_cls = getattr(torch.optim, name)
            impls["torch fused"] = lambda: torch_cls(params, fused=True, **kwargs).step
            impls["torch foreach"] = lambda: torch_cls(params, foreach=True, **kwargs).step
            if peers:
                impls["torch.compile (foreach step)"] = lambda: _compiled_step(torch_cls(params, foreach=True, **kwargs))
        return impls, None

    op = {"SGD": "sgd_step", "AdamW": "adam_step", "LAMB": "lamb_step"}[name]
    return Case(op, f"{name} {total / 1e9:.3f} B fp32 params in {count} tensors", total * bytes_per_param, build)


def _compiled_step(opt):
    """torch.compile of a torch optimizer's step (PyTorch's "compiled optimizer" recipe)."""
    step = torch.compile(opt.step, fullgraph=False)
    step()  # compiles
    return step


def _tensor_list_case(op, total, count, device) -> Case:
    """all_finite / unscale / grad_stats / accumulate / zero over a model-sized list of float32 tensors."""
    def build(peers):
        tensors = _param_list(total, count, torch.float32, device)
        grads = [p.grad for p in tensors]
        found = torch.zeros((), device=device)
        inv = torch.tensor(1.0, device=device)
        if op == "all_finite":
            impls = {"trainops": lambda: (lambda: trainops.ops.amp.all_finite(grads, found)),
                     "torch (check and unscale by 1)":
                         lambda: (lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv))}
        elif op == "unscale":
            impls = {"trainops": lambda: (lambda: trainops.ops.amp.unscale_(grads, inv, found)),
                     "torch": lambda: (lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv))}
        elif op == "grad_stats":
            impls = {"trainops": lambda: (lambda: trainops.ops.amp.grad_stats(grads, max_norm=1.0).norm),
                     "torch get_total_norm": lambda: (lambda: torch.linalg.vector_norm(
                         torch.stack(torch._foreach_norm(grads, 2.0)), 2.0))}
        elif op == "accumulate":
            acc = [t.detach() for t in tensors]
            impls = {"trainops": lambda: (lambda: trainops.grad.accumulate_(acc, grads, 1.0)),
                     "torch foreach": lambda: (lambda: torch._foreach_add_(acc, grads))}
        else:
            impls = {"trainops": lambda: (lambda: trainops.grad.zero_(grads)),
                     "torch foreach": lambda: (lambda: torch._foreach_zero_(grads))}
        return impls, None

    per = {"all_finite": 4, "unscale": 8, "grad_stats": 4, "accumulate": 12, "zero": 4}[op]
    return Case(op, f"{total / 1e9:.3f} B fp32 in {count} tensors", total * per, build)


def _update_scale_case(device) -> Case:
    """The loss-scale update: one program on three scalars (a launch-latency measurement)."""
    def build(peers):
        scale, tracker = torch.full((), 65536.0, device=device), torch.zeros((), dtype=torch.int32, device=device)
        found = torch.zeros((), device=device)
        impls = {"trainops": lambda: (lambda: trainops.ops.amp.update_scale_(scale, tracker, found, 2.0, 0.5, 2000)),
                 "torch": lambda: (lambda: torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2000))}
        return impls, None

    return Case("update_scale", "scale, tracker, found_inf", 12, build)


def multi_tensor_cases(device, quick: bool) -> list[Case]:
    total, count = (16_000_000, 16) if quick else (1_485_000_000, 96)
    cases = [_optimizer_case("AdamW", total, count, 28, device)]
    if quick:
        return cases
    cases += [_optimizer_case("SGD", total, count, 20, device), _optimizer_case("LAMB", total, count, 28, device)]
    cases += [_tensor_list_case(op, total // 2, count, device)
              for op in ("all_finite", "unscale", "grad_stats", "accumulate", "zero")]
    return cases + [_update_scale_case(device)]


def gpu_cases(quick: bool) -> list[Case]:
    device = torch.device("cuda")
    return (softmax_cases(device, quick) + gather_cases(device, quick) + cross_entropy_cases(device, quick)
            + multi_tensor_cases(device, quick))


def cpu_cases() -> list[Case]:
    """Small shapes for the CPU path (a self-check and a rough comparison, not a benchmark)."""
    device = torch.device("cpu")
    return [_softmax_case("softmax", (256, 1024), -1, torch.float32, device),
            _softmax_case("log_softmax_backward", (64, 256, 64), 1, torch.float32, device),
            _embedding_backward_case(2048, 64, 1000, torch.float32, device),
            _cross_entropy_case(256, 1000, torch.float32, device),
            _optimizer_case("AdamW", 1_000_000, 8, 28, device)]
