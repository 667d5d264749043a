"""A whole training step replayed as one CUDA graph: ``trainops.capture_step``.

An eager step of a small model is host-bound: the GPU waits while Python runs the model's modules,
autograd and each kernel's launch (a 16-layer, 1024-wide Llama-family model at 8 x 1024 tokens on
an H200: 38 ms of GPU kernels in a 73 ms patched step). A CUDA graph records the step's kernels
once and replays them with one launch, so the step costs its GPU time. trainops kernels are
capture-safe (no host synchronisation, no event query, device-side random numbers and index
checks), so a step built from them, torch ops, and a capturable optimizer records whole::

    opt = trainops.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4, device="cuda"))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)   # fills the lr tensor

    def train_step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    step = trainops.capture_step(train_step, optimizers=[opt])
    for ids in batches:
        loss = step(ids)          # the first warmup_steps calls run eagerly, then one capture
        scheduler.step()

What the step function may do: anything that records into a graph, that is no host
synchronisation (``.item()``, printing a tensor, a GradScaler's inf check, data-dependent shapes)
and no CPU work whose result must change from step to step. Python runs only while warming up
and capturing: a replay runs the recorded kernels on the recorded tensors.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable

import torch
from torch.utils import _pytree as pytree

from .errors import InvalidProblemError, UnsupportedError, argument_error

__all__ = ["CapturedStep", "capture_step"]

_OP = "capture_step"


def capture_step(step: Callable, optimizers: Iterable[torch.optim.Optimizer] = (), *,
                 warmup_steps: int = 3) -> "CapturedStep":
    """Wrap ``step`` so that, after ``warmup_steps`` eager calls, it runs as one CUDA graph.

    Every call is a real training step on its arguments:

    - calls ``1 .. warmup_steps`` run ``step`` eagerly on a side stream (lazy initialisation:
      kernel compilation, plans, optimizer state, cuBLAS workspaces);
    - the next call captures ``step`` on static copies of its tensor arguments, then replays the
      graph once;
    - every later call copies its tensor arguments into those static copies and replays.

    Before each eager call and the capture, the gradients of every parameter of ``optimizers`` are
    set to None, so each call computes its gradients afresh (the captured backward then writes
    rather than accumulates): gradient accumulation belongs inside ``step`` (several micro-batches
    in one call). Parameters of no listed optimizer keep their gradients: a step that neither zeroes
    nor frees them records an in-place accumulation, which every replay repeats.

    Args:
        step: a function of tensors (and constants) that runs the forward, backward and the
            optimizer step on CUDA. Its result (a tensor, or a tuple / list / dict of them, or None)
            is returned from each call as fresh tensors (clones of the graph's outputs; the eager
            calls' outputs detached).
        optimizers: the optimizers ``step`` steps. Their hyper-parameters are recorded at the
            capture: a value that is a Python number then lives in the graph, so a later change of
            it (an LR scheduler writing a float) raises rather than being ignored; a CPU tensor is
            read at launch, so it is recorded by value too. Pass the learning rate as a CUDA tensor
            (``lr=torch.tensor(1e-3, device="cuda")``): torch's LR schedulers fill it in place and
            every replay reads it (a scheduler that also writes momentum or betas, such as
            OneCycleLR's ``cycle_momentum``, is refused at the first replay after it does). torch's own optimizers need
            ``capturable=True`` (torch refuses the capture otherwise); trainops.optim's are
            capturable as they are.
        warmup_steps: eager calls before the capture (at least 1).

    Returns:
        A :class:`CapturedStep`; call it as ``step``.

    Errors (argument named): ``warmup_steps`` below 1; ``optimizers`` not optimizers. At a call:
    a tensor argument whose shape, dtype or device differs from the captured call's, a tensor
    argument that requires grad, a non-tensor argument that differs (a graph replays fixed shapes
    and constants: capture another step for another shape); a hyper-parameter that changed since
    the capture and is not a CUDA tensor; a capture entered inside ``torch.autocast`` with its weight
    cache on (enter autocast inside ``step``, as the example does). Errors of the capture itself (a
    host synchronisation inside ``step``) are torch's, raised at the capturing call, after which
    the CapturedStep is as before that call (gradients set to None, no graph; the next call
    captures again).

    Memory: the graph keeps its own memory pool, the size of one step's peak of temporaries, for as
    long as the CapturedStep lives.
    """
    return CapturedStep(step, optimizers, warmup_steps=warmup_steps)


class CapturedStep:
    """A training step that runs eagerly ``warmup_steps`` times, then as one CUDA graph (see
    :func:`capture_step`). ``captured`` says whether the graph exists; ``calls`` counts the calls."""

    def __init__(self, step: Callable, optimizers: Iterable[torch.optim.Optimizer] = (), *,
                 warmup_steps: int = 3):
        if not callable(step):
            raise argument_error(InvalidProblemError, _OP, "step", f"must be callable, got {type(step).__name__}")
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        for i, opt in enumerate(optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise argument_error(InvalidProblemError, _OP, "optimizers",
                                     f"item {i} is a {type(opt).__name__}, not a torch.optim.Optimizer")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise argument_error(InvalidProblemError, _OP, "warmup_steps",
                                 f"must be an int >= 1 (eager calls before the capture), got {warmup_steps!r}")
        self.step = step
        self.optimizers = optimizers
        self.warmup_steps = warmup_steps
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._signature = None
        self._static_args: list = []
        self._static_outputs = None
        self._hyper: list = []
        self._side = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        names = _leaf_names(args, kwargs)
        if self._signature is None:
            self._signature = (spec, [_describe(leaf, name) for leaf, name in zip(leaves, names)])
        else:
            self._check_signature(spec, leaves, names)
        self.calls += 1
        if self.calls <= self.warmup_steps:
            return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t,
                                   self._eager(args, kwargs))
        if self.graph is None:
            try:
                self._capture(leaves, spec)
            except BaseException:
                self.calls -= 1
                self._static_args = []
                self._zero_grads()   # what the failed capture's backward left in the graph's pool
                raise
        else:
            self._check_hyper_parameters()
            for static, leaf in zip(self._static_args, leaves):
                if static is not None:
                    static.copy_(leaf)
        self.graph.replay()
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self._static_outputs)

    # -- phases ---------------------------------------------------------------------------------

    def _zero_grads(self):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def _eager(self, args, kwargs):
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._zero_grads()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            out = self.step(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(self._side)
        return out

    def _capture(self, leaves, spec):
        for device in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device) and torch.is_autocast_cache_enabled():
                raise argument_error(UnsupportedError, _OP, "step",
                                     f"is captured inside torch.autocast({device!r}) with its weight cache on: "
                                     "the graph would read the casts made before the capture; enter autocast "
                                     "inside the step (or pass cache_enabled=False)")
        self._static_args = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        static_leaves = [s if s is not None else leaf for s, leaf in zip(self._static_args, leaves)]
        args, kwargs = pytree.tree_unflatten(static_leaves, spec)
        torch.cuda.synchronize()
        self._zero_grads()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.step(*args, **kwargs)
        self._static_outputs = pytree.tree_map(
            lambda t: t.detach() if isinstance(t, torch.Tensor) else t, outputs)
        self._hyper = [[_hyper_parameters(group) for group in opt.param_groups] for opt in self.optimizers]
        self.graph = graph

    # -- checks ---------------------------------------------------------------------------------

    def _check_signature(self, spec, leaves, names):
        recorded_spec, described = self._signature
        if spec != recorded_spec:
            raise argument_error(InvalidProblemError, _OP, "args",
                                 "differ in structure from the first call's (positions, keywords, nesting): "
                                 "a captured step replays one call signature")
        for leaf, name, before in zip(leaves, names, described):
            now = _describe(leaf, name)
            if now != before:
                raise argument_error(InvalidProblemError, _OP, name,
                                     f"is {now[1]}, the captured step's was {before[1]}: a graph replays fixed "
                                     "shapes, dtypes, devices and constants (capture another step for this one)")

    def _check_hyper_parameters(self):
        for i, (opt, recorded) in enumerate(zip(self.optimizers, self._hyper)):
            if len(opt.param_groups) != len(recorded):
                raise argument_error(UnsupportedError, _OP, "optimizers",
                                     f"item {i} has {len(opt.param_groups)} parameter groups, "
                                     f"{len(recorded)} at the capture")
            for g, (group, before) in enumerate(zip(opt.param_groups, recorded)):
                now = _hyper_parameters(group)
                if now != before:
                    key = next(k for k in sorted(set(now) | set(before), key=str) if now.get(k) != before.get(k))
                    raise argument_error(
                        UnsupportedError, _OP, "optimizers",
                        f"item {i}: param_groups[{g}][{key!r}] changed after the capture ({before.get(key)!r} -> "
                        f"{now.get(key)!r}); the graph holds the value it had. Give it as a CUDA tensor "
                        f"(e.g. lr=torch.tensor(1e-3, device='cuda')), which schedulers fill in place")


def _leaf_names(args, kwargs) -> list[str]:
    """A name per pytree leaf of (args, kwargs), in tree_flatten's order: 'args[0]' (every leaf of
    a nested positional argument), or the keyword ('ids')."""
    names = []
    for i, a in enumerate(args):
        names += [f"args[{i}]"] * len(pytree.tree_leaves(a))
    for k in kwargs:   # tree_flatten sorts no dict keys: insertion order
        names += [k] * len(pytree.tree_leaves(kwargs[k]))
    return names


def _describe(leaf, name: str):
    """What a replay needs unchanged of an argument: a tensor's shape, dtype and device; any other
    value itself."""
    if isinstance(leaf, torch.Tensor):
        if leaf.requires_grad:
            raise argument_error(UnsupportedError, _OP, name,
                                 "requires grad: the graph's input copies are not leaves of your autograd graph "
                                 "(pass data, and keep parameters inside the step's modules)")
        if leaf.device.type != "cuda":
            raise argument_error(InvalidProblemError, _OP, name,
                                 f"is on {leaf.device}: a CUDA graph reads CUDA tensors")
        return ("tensor", f"a {leaf.dtype} tensor of shape {tuple(leaf.shape)} on {leaf.device}")
    return ("value", repr(leaf))


def _hyper_parameters(group: dict) -> dict:
    """A parameter group's settings as the graph holds them: CUDA tensors by identity (a replay reads
    them), CPU tensors (read at launch) and everything else by value (copied: an in-place change of
    a list shows)."""
    def held(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", id(v)) if v.device.type == "cuda" else ("cpu tensor", tuple(v.flatten().tolist()))
        return copy.deepcopy(v)
    return {k: held(v) for k, v in group.items() if k != "params"}
