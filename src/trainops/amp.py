"""Dynamic loss scaling: ``trainops.amp.GradScaler``, torch.amp.GradScaler on trainops kernels.

    scaler = trainops.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x)
    scaler.scale(loss).backward()
    scaler.step(optimizer)          # any torch optimizer, or a trainops.optim one
    scaler.update()

Same interface, semantics and state_dict as torch.amp.GradScaler (it is a subclass); what changes
is the kernels, none of which synchronises with the host:

- ``unscale_`` runs the multi-tensor check-and-unscale kernel (ORT IsAllFinite + unscale).
- ``update`` runs the fused scale update (ORT MixedPrecisionScale's role): backoff on inf/NaN,
  growth after ``growth_interval`` clean steps.
- ``step`` with a torch optimizer: as torch (check, then a host read of found_inf to skip).
  With a trainops.optim optimizer (and no earlier ``unscale_``): the optimizer's step does the
  finite check itself in one read-only pass over the gradients (with the global-norm clip when it
  has ``max_grad_norm``), then unscales inside its update kernel and skips on the device when
  inf/NaN was found, so the gradients are read twice and never written, and nothing waits.

DTensor gradients (FSDP2): the kernels run on the local shards, and the inf/NaN flag is summed
over the device mesh, so every rank skips, backs off and grows alike (trainops.dtensor).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from .dtensor import MeshSums, local
from .errors import UnsupportedError
from .ops.multi_tensor import TableCache
from .ops import amp as amp_ops
from .optim import FusedStep


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose unscale, inf/NaN check and scale update run trainops kernels."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self._tables = TableCache()

    def _grads_per_device(self, optimizer, allow_fp16: bool) -> dict:
        grads = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not allow_fp16 and p.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if p.grad.is_sparse:
                    raise UnsupportedError("trainops.amp.GradScaler: sparse gradients are not supported")
                grads[p.grad.device].append(p.grad)
        return grads

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        found = {}
        with torch.no_grad():
            for device, grads in self._grads_per_device(optimizer, allow_fp16).items():
                sums = MeshSums.of(grads, "trainops.amp.GradScaler")   # raises before anything is written
                found[device] = found_inf.to(device) if found_inf.device != device else found_inf
                amp_ops.unscale_(_locals(grads, sums), inv_scale.to(device), found[device], tables=self._tables)
                _agree(sums, found[device])
        return found

    def _check_inf_per_device(self, optimizer):
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        found = {}
        with torch.no_grad():
            for device, grads in self._grads_per_device(optimizer, True).items():
                sums = MeshSums.of(grads, "trainops.amp.GradScaler")
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                amp_ops.all_finite(_locals(grads, sums), found[device], tables=self._tables)
                _agree(sums, found[device])
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def step(self, optimizer, *args, **kwargs):
        """As torch.amp.GradScaler.step; a trainops optimizer (FusedStep: trainops.optim's, and
        trainops.distributed.ShardedOptimizer) checks and unscales inside its own step, given the
        scale and the flag as arguments."""
        if not self._enabled or not isinstance(optimizer, FusedStep) or "closure" in kwargs:
            return super().step(optimizer, *args, **kwargs)
        state = self._per_optimizer_states[id(optimizer)]
        scale, _ = self._check_scale_growth_tracker("step")
        devices = {p.device for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
        if state["stage"] is not OptState.READY or devices - {scale.device}:
            return super().step(optimizer, *args, **kwargs)
        found = torch.zeros((), dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = {scale.device: found}
        result = optimizer.step(*args, grad_scale=scale, found_inf=found, check_finite=True, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As torch.amp.GradScaler.update, with the scale update on the device (trainops kernel)."""
        if not self._enabled:
            return
        if new_scale is not None:
            return super().update(new_scale)
        scale, growth_tracker = self._check_scale_growth_tracker("update")
        found_infs = [found.to(device=scale.device, non_blocking=True)
                      for state in self._per_optimizer_states.values()
                      for found in state["found_inf_per_device"].values()]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        combined = found_infs[0]
        for found in found_infs[1:]:
            combined = combined + found
        amp_ops.update_scale_(scale, growth_tracker, combined, self._growth_factor, self._backoff_factor,
                              self._growth_interval)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def _locals(grads, sums):
    return grads if sums is None else [local(g) for g in grads]


def _agree(sums, found: torch.Tensor) -> None:
    """For DTensor gradients (``sums`` not None): ``found`` (this rank's flag) becomes 1 on every
    rank of their mesh if it is nonzero on any (one all_reduce per mesh dimension)."""
    if sums is not None:
        flag = found.reshape(1).to(torch.float64)
        sums.sum_rows_(flag, [sums.every_dim()])
        found.copy_((flag[0] > 0).to(found.dtype))


__all__ = ["GradScaler"]
