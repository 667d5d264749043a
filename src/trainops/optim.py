"""Fused multi-tensor optimizers: SGD, Adam, AdamW, LAMB (torch.optim.Optimizer subclasses);
8-bit states, stochastic rounding, the step inside the backward.

    opt = trainops.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()

Same constructor arguments, param groups, ``zero_grad`` and ``state_dict`` layout as torch.optim's
optimizer of the same name (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
``momentum_buffer``), so state moves between the two in both directions. One step launches a few
kernels per (param group, dtype), not one per tensor (see trainops.ops.optimizers for the math).

Options beyond torch:
    max_grad_norm    clip by the global L2 norm of all gradients inside the step (torch's
                     clip_grad_norm_ semantics); the norm is left in ``opt.grad_norm`` (a tensor).
    skip_nonfinite   skip the whole step (parameters, state and step counters untouched) when any
                     gradient is inf/NaN, with no host synchronisation. Always on under
                     trainops.amp.GradScaler and whenever max_grad_norm is set; off by default
                     otherwise, as torch (whose step writes NaN), since it costs one more read of
                     the gradients.
    master_weights   for float16/bfloat16 parameters: keep a float32 copy (state "master_param")
                     that the step updates; the parameter holds its rounding.
    state_dtype      dtype of the moment buffers: float32 (default; float64 for float64
                     parameters) or torch.bfloat16 to halve their memory (less precise).

Under torch.amp.GradScaler or trainops.amp.GradScaler, the step unscales the gradients itself
(``_step_supports_amp_scaling``) and skips when the scaler found inf/NaN, on the device.

Sharded parameters (DTensors: FSDP2's ``fully_shard``, tensor parallelism; see trainops.dtensor):
each rank steps its local shards in the same kernels, and keeps its state as DTensors of the
parameters' layout, as torch.optim does (so ``torch.distributed.checkpoint`` saves and reshards
it). What needs whole tensors is summed over the mesh: the ``max_grad_norm`` norm, LAMB's trust
ratios (norms of whole parameters), and the inf/NaN flag (``skip_nonfinite``, a GradScaler's
``found_inf``), so every rank skips or steps alike. These collectives are the only ones a step
makes, and only with DTensor parameters; every rank must step the same parameters. One device
mesh per optimizer. At the first step after construction, ``load_state_dict`` or
``add_param_group``, the ranks compare their steps' layouts (param groups; each parameter's dtype,
global shape, placements and whether it has a gradient; ``max_grad_norm``; ``skip_nonfinite``:
one ``all_gather_object`` per mesh dimension, a host synchronisation that once) and raise
InvalidProblemError on every rank if they differ, instead of hanging in mismatched collectives.
Later changes on one rank only (a parameter whose gradient goes None there, a ``max_grad_norm``
set on one rank) are not compared again; a GradScaler or ``check_finite`` on one rank only is not
compared.

Low-bit options (Adam, AdamW, LAMB; per param group, as bitsandbytes' per-parameter overrides;
the math and the codes in trainops.ops.lowbit_optimizers):
    optim_bits       32 (default) or 8: exp_avg and exp_avg_sq as one byte an element plus one
                     float32 scale per block of at most 256 elements (a chunk of a row along dim
                     0): 2.03 bytes an element instead of 8. Kept in float32 (said, not silent:
                     ``opt.state[p]`` shows "exp_avg" instead of "exp_avg_codes"): 1-D parameters
                     (norm weights, biases: small, and dim 0 would be one row), parameters of
                     fewer than ``min_8bit_size`` elements (default 4096, bitsandbytes' threshold)
                     and non-contiguous parameters (blocks follow memory order). 8-bit state
                     keys: exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales
                     (exp_avg_sq's code holds its square root). AdamW8bit, Adam8bit and LAMB8bit
                     are the classes with optim_bits=8. 4 bits are refused (UnsupportedError).
    stochastic_rounding  bfloat16 parameters without master weights: each updated parameter
                     rounded to bfloat16 stochastically (unbiased), the bits a hash of
                     (``rounding_seed``, the parameter's place in the optimizer, the step, the
                     element's index in the whole parameter): the same seed gives the same bits
                     for any launch configuration or sharding.
    Combinations: with master_weights (8-bit states, float32 masters) works; stochastic_rounding
    with master_weights, with float32/float16 parameters, optim_bits=8 or stochastic_rounding with
    amsgrad, with state_dtype other than float32, or with float64 parameters raise
    InvalidProblemError naming the argument at construction, add_param_group and the step (nothing
    written). The unscale, global-norm clip and inf/NaN skip are fused into the low-bit step as
    into the others. DTensor parameters: Shard(0) and Replicate placements (the blocks lie along
    dim 0's rows, so a sharded state is the whole state's rows and state_dict does not depend on
    the world size); other placements raise UnsupportedError. ``load_state_dict`` keeps the
    loading optimizer's optim_bits / min_8bit_size / stochastic_rounding: a float32 state loads
    into optim_bits=8 (quantised at the next step) and an 8-bit one into float32 (plain tensors).

``step_in_backward(model, optimizer)`` runs the step inside the backward (see its docstring).

Step counters are float32 tensors on the parameters' device, as in torch's fused Adam. A torch
state_dict with CPU counters loads fine (they move). Bad input: a param group spanning devices,
sparse or complex gradients raise InvalidProblemError / UnsupportedError; parameters without a
gradient are skipped, as torch does; a loaded state whose tensor shapes do not match raises.
"""

from __future__ import annotations

import math
import types
from typing import Iterable

import torch

from .dtensor import MeshSums, check_ranks_agree, is_dtensor, local
from .errors import InvalidProblemError, UnsupportedError
from .ops.multi_tensor import TableCache
from .ops import amp as amp_ops
from .ops import grad as grad_ops
from .ops import lowbit_optimizers as lowbit_ops
from .ops import optimizers as optimizer_ops

_HALF = (torch.float16, torch.bfloat16)


class FusedStep:
    """An optimizer whose ``step(closure=None, *, grad_scale=None, found_inf=None, check_finite=False)``
    unscales, checks for inf/NaN and skips on the device itself: trainops.amp.GradScaler passes it
    the scale and the flag instead of rewriting the gradients (FusedOptimizer, and
    trainops.distributed.ShardedOptimizer)."""


class FusedOptimizer(FusedStep, torch.optim.Optimizer):
    """Shared machinery: gathering grads per group, lazy state, fused unscale / clip / skip, state_dict."""

    _step_supports_amp_scaling = True
    _state_names: tuple[str, ...] = ()
    _has_step_counter = True
    _name = "optimizer"

    def __init__(self, params, defaults: dict, *, max_grad_norm: float | None = None, skip_nonfinite: bool = False,
                 master_weights: bool = False, state_dtype: torch.dtype | None = None, lowbit: dict | None = None):
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InvalidProblemError(f"trainops.optim.{self._name}: argument 'max_grad_norm' is {max_grad_norm}; "
                                      "it must be positive (or None)")
        if state_dtype not in (None, torch.float32, torch.bfloat16, torch.float64):
            raise UnsupportedError(f"trainops.optim.{self._name}: argument 'state_dtype' is {state_dtype}; "
                                   "expected None, torch.float32, torch.bfloat16 or torch.float64")
        defaults = dict(defaults, master_weights=bool(master_weights), state_dtype=state_dtype)
        self.rounding_seed = 0
        if lowbit is not None:   # the optimizers with low-bit options (Adam, AdamW, LAMB)
            self.rounding_seed = lowbit.pop("rounding_seed")
            if isinstance(self.rounding_seed, bool) or not isinstance(self.rounding_seed, int):
                raise InvalidProblemError(f"trainops.optim.{self._name}: argument 'rounding_seed' is "
                                          f"{self.rounding_seed!r}; it must be an int")
            defaults.update(lowbit)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = bool(skip_nonfinite)
        self.grad_norm: torch.Tensor | None = None
        self._tables = TableCache()
        self._lowbit_tables: dict = {}
        self._mesh_tables: dict = {}
        self._buckets: dict = {}
        self._state_version = 0
        self._ranks_checked = False   # see _check_ranks

    # -- hyper-parameters ----------------------------------------------------------------------

    # Hyper-parameters that must be finite and >= 0, and those that must only be finite.
    _non_negative_keys: tuple[str, ...] = ("lr", "weight_decay")
    _finite_keys: tuple[str, ...] = ()

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, with the group's hyper-parameters checked first (a group that
        fails is not added)."""
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            param_group = dict(param_group, params=[params])
        elif not isinstance(params, set):   # torch refuses sets
            param_group = dict(param_group, params=list(params))
        group = {key: value for key, value in self.defaults.items() if key not in param_group}
        group.update(param_group)
        self._check_group(group, f"param_groups[{len(self.param_groups)}]")
        super().add_param_group(param_group)
        self._ranks_checked = False

    def _check_group(self, group: dict, where: str) -> None:
        """InvalidProblemError unless every hyper-parameter of ``group`` is usable: numbers finite
        (and >= 0 where negative values make no sense), betas in [0, 1), tensors of one element
        (their values stay on the device: not read). ``where`` names the group in the message."""
        def fail(key, message):
            raise InvalidProblemError(f"trainops.optim.{self._name}: {where}['{key}'] {message}")

        for key in (*self._non_negative_keys, *self._finite_keys, "betas"):
            if key not in group:
                continue
            values = group[key] if key == "betas" else (group[key],)
            if key == "betas" and len(values) != 2:
                fail(key, f"must hold two values, got {values!r}")
            for value in values:
                if isinstance(value, torch.Tensor):
                    if value.numel() != 1:
                        fail(key, f"is a tensor of shape {tuple(value.shape)}; it must have one element")
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    fail(key, f"is {value!r}; it must be a number or a one-element tensor")
                if key == "betas":
                    if not 0.0 <= value < 1.0:
                        fail(key, f"holds {value}; each must be in [0, 1)")
                elif not math.isfinite(value):
                    fail(key, f"is {value}; it must be finite")
                elif key in self._non_negative_keys and value < 0:
                    fail(key, f"is {value}; it must be >= 0")
        if "optim_bits" in group:
            self._check_lowbit(group, fail)

    def _check_lowbit(self, group: dict, fail) -> None:
        """The low-bit options of ``group`` and their combinations (see the module docstring);
        ``fail(key, message)`` raises."""
        bits, sr = group["optim_bits"], group.get("stochastic_rounding", False)
        if isinstance(bits, bool) or bits not in (32, 8):
            if bits == 4:
                raise UnsupportedError(f"trainops.optim.{self._name}: optim_bits=4 is not implemented (4-bit "
                                       "states were not built); use 8 or 32")
            fail("optim_bits", f"is {bits!r}; it must be 32 (float32 states) or 8 (blockwise 8-bit states)")
        size = group.get("min_8bit_size", 4096)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            fail("min_8bit_size", f"is {size!r}; it must be an int >= 0")
        if not isinstance(sr, bool):
            fail("stochastic_rounding", f"is {sr!r}; it must be True or False")
        low = bits == 8 or sr
        what = "optim_bits=8" if bits == 8 else "stochastic_rounding=True"
        if low and group.get("amsgrad"):
            fail("amsgrad", f"is True with {what}; the low-bit step has no amsgrad (use optim_bits=32, "
                            "stochastic_rounding=False)")
        if low and group.get("state_dtype") not in (None, torch.float32):
            fail("state_dtype", f"is {group.get('state_dtype')} with {what}; low-bit steps keep float32 states for "
                                "the tensors they do not quantise (state_dtype None or torch.float32)")
        if sr and group.get("master_weights"):
            fail("stochastic_rounding", "is True with master_weights=True; stochastic rounding replaces the float32 "
                                        "master copy (choose one)")
        for p in group["params"] if low else ():   # (a plain float32 group skips the per-parameter loop)
            if sr and p.dtype != torch.bfloat16:
                fail("stochastic_rounding", f"is True for a parameter of dtype {p.dtype}; it rounds bfloat16 "
                                            "parameters only")
            if low and p.dtype == torch.float64:
                fail("optim_bits", f"is {bits} (stochastic_rounding={sr}) for a float64 parameter; low-bit steps "
                                   "take float32, float16 and bfloat16 parameters")
            if low and is_dtensor(p):
                for placement in p.placements:
                    if not (type(placement).__name__ == "Replicate"
                            or (type(placement).__name__ == "Shard" and placement.dim == 0)):
                        raise UnsupportedError(f"trainops.optim.{self._name}: {what} on a DTensor parameter with "
                                               f"placements {p.placements}: blocks and rounding indices follow dim "
                                               "0's rows; only Shard(0) and Replicate placements are supported")

    # -- per-group gathering -------------------------------------------------------------------

    def _state_dtype(self, group, p) -> torch.dtype:
        if group.get("state_dtype") is not None:
            return group["state_dtype"]
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def _init_state(self, group, p, state) -> None:
        """Create whatever state ``p`` lacks (lazily, at its first step); moments converted between
        float32 and 8-bit when a loaded state was stored the other way."""
        if "optim_bits" in group:
            if self._kind(group, p) == "8bit":
                _to_8bit_state(state, p, self._name)
            else:
                _to_float_state(state, p, self._name)
        dtype = self._state_dtype(group, p)
        if self._has_step_counter and "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for name in self._state_names if self._kind(group, p) != "8bit" else ():
            if name not in state:
                state[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if group.get("master_weights") and p.dtype in _HALF and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32)

    def _gather(self, index: int, group, params=None, cache_key=None) -> dict:
        """{(device, dtype): {"params", "grads", "states"}} for the group's params that have a grad.

        The buckets (params, their states, and the checks and lazy state creation behind them) are
        rebuilt only when the set of params with a gradient changes or the state was reloaded;
        a steady step only collects the current gradients.
        """
        if params is None:
            params = [p for p in group["params"] if p.grad is not None]
        if cache_key is None:
            cache_key = index
        key = (self._state_version, len(self.state), group.get("amsgrad"), group.get("master_weights"),
               group.get("state_dtype"), group.get("optim_bits"), group.get("min_8bit_size"),
               group.get("stochastic_rounding"), tuple(map(id, params)))
        cached = self._buckets.get(cache_key)
        if cached is None or cached[0] != key:
            cached = self._buckets[cache_key] = (key, self._build_buckets(index, group, params))
        buckets = {}
        for where, (bucket_params, locals_, states, mesh_sums, extra) in cached[1].items():
            grads = [p.grad for p in bucket_params]
            for g in grads:
                if g.is_sparse:
                    raise UnsupportedError(f"trainops.optim.{self._name}: a parameter of param group {index} has a "
                                           "sparse gradient; the fused optimizers take dense gradients only")
            if mesh_sums is not None:
                grads = [self._local_grad(p, g, index) for p, g in zip(bucket_params, grads)]
            buckets[where] = {"params": locals_, "grads": grads, "states": states, "originals": bucket_params,
                              "mesh_sums": mesh_sums, **extra}
        return buckets

    def _local_grad(self, p, g, index: int) -> torch.Tensor:
        """This rank's part of a DTensor parameter's gradient, which must be laid out as the parameter."""
        if not is_dtensor(g) or g.device_mesh != p.device_mesh or g.placements != p.placements:
            layout = f"{type(g).__name__} with placements {getattr(g, 'placements', None)}"
            raise UnsupportedError(f"trainops.optim.{self._name}: a DTensor parameter of param group {index} (placements "
                                   f"{p.placements}) has a gradient that is a {layout}; it must be a DTensor of the "
                                   "parameter's mesh and placements")
        return local(g)

    def _check_ranks(self) -> None:
        """Over DTensor parameters, once after construction, ``load_state_dict`` or
        ``add_param_group`` (events every rank shares): every rank's layout of the step (param
        groups, each parameter's dtype, global shape, placements and whether it has a gradient,
        ``max_grad_norm``, ``skip_nonfinite``) must be the same, else InvalidProblemError on every
        rank before anything is made or written (trainops.dtensor.check_ranks_agree)."""
        meshes = [p.device_mesh for g in self.param_groups for p in g["params"] if is_dtensor(p)]
        if meshes:
            facts = {"the optimizer": self._name, "the number of param groups": len(self.param_groups),
                     "max_grad_norm": self.max_grad_norm, "skip_nonfinite": self.skip_nonfinite}
            for i, group in enumerate(self.param_groups):
                facts[f"the number of parameters of param_groups[{i}]"] = len(group["params"])
                for j, p in enumerate(group["params"]):
                    facts[f"param_groups[{i}]['params'][{j}] (dtype, shape, placements, has a gradient)"] = (
                        str(p.dtype), tuple(p.shape), str(getattr(p, "placements", "plain")), p.grad is not None)
            check_ranks_agree(meshes[0], facts, f"trainops.optim.{self._name}")
        self._ranks_checked = True

    def _build_buckets(self, index: int, group, params) -> dict:
        buckets: dict = {}
        devices = set()
        for p in params:
            if p.is_complex() or not p.is_floating_point():
                raise UnsupportedError(f"trainops.optim.{self._name}: parameters must be real floating point; "
                                       f"param group {index} holds one of dtype {p.dtype}")
            devices.add(p.device)
            if len(devices) > 1:
                raise InvalidProblemError(f"trainops.optim.{self._name}: param group {index} holds parameters on "
                                          f"{' and '.join(sorted(map(str, devices)))}; put each device's parameters "
                                          "in its own param group")
            state = self.state[p]
            self._init_state(group, p, state)
            bucket_params, states = buckets.setdefault((p.device, p.dtype, self._kind(group, p)), ([], []))
            bucket_params.append(p)
            states.append(state)
        where = f"trainops.optim.{self._name} (param group {index})"
        return {key: (bucket_params, [local(p) for p in bucket_params], states, MeshSums.of(bucket_params, where),
                      self._bucket_extra(key, bucket_params))
                for key, (bucket_params, states) in buckets.items()}

    def _kind(self, group, p) -> str:
        """Which step a parameter takes: "plain" (ops/optimizers.py), or the low-bit step with 8-bit
        states ("8bit") or float32 states ("32bit": stochastic rounding alone, or a tensor kept in
        float32 under optim_bits=8): see the module docstring."""
        if group.get("optim_bits", 32) == 8 and self._quantizes(group, p):
            return "8bit"
        return "32bit" if group.get("stochastic_rounding") else "plain"

    @staticmethod
    def _quantizes(group, p) -> bool:
        """Whether ``p`` gets 8-bit states under optim_bits=8: 2-D or more, contiguous, at least
        min_8bit_size elements (its global shape for a DTensor)."""
        return p.dim() >= 2 and p.numel() >= group.get("min_8bit_size", 4096) and local(p).is_contiguous()

    def _bucket_extra(self, key, params) -> dict:
        """A low-bit bucket's stochastic rounding keys (each parameter's place in the optimizer) and
        global offsets (a Shard(0) part's first element in the whole parameter)."""
        if key[2] == "plain":
            return {"kind": "plain"}
        places = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return {"kind": key[2], "sr_keys": [places[id(p)] for p in params],
                "offsets": [_global_offset(p) for p in params]}

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
             check_finite: bool = False, clip: torch.Tensor | None = None):
        """One optimizer step over every param group (see the module docstring).

        Keywords, from a loss scaler or a sharded optimizer (ours pass them; torch.amp.GradScaler
        sets ``self.grad_scale`` / ``self.found_inf`` instead, torch's protocol for optimizers with
        ``_step_supports_amp_scaling``, which are read when the keywords are absent):
        ``grad_scale`` (float32, one element) divides every gradient; ``found_inf`` (float32, one
        element) skips the step where nonzero, and receives this step's own check; ``check_finite``
        checks the gradients for inf/NaN in the step (one read-only pass, fused with the norm);
        ``clip`` (float32, one element) multiplies every gradient: a clip coefficient computed by
        the caller (``max_grad_norm`` computes its own).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        caller_found_inf = found_inf
        if not self._ranks_checked:
            self._check_ranks()
        check = self.skip_nonfinite or self.max_grad_norm is not None or check_finite
        gathered = [(group, self._gather(i, group)) for i, group in enumerate(self.param_groups)]
        sharded = [b["mesh_sums"] for _, buckets in gathered for b in buckets.values() if b["mesh_sums"] is not None]
        meshes = {m.mesh for m in sharded}
        if len(meshes) > 1:
            raise UnsupportedError(f"trainops.optim.{self._name}: the parameters are DTensors on {len(meshes)} device "
                                   "meshes; one optimizer steps one mesh's parameters")
        # Every bucket is checked (kernel, layouts, hyper-parameters) before any is written: a step
        # that raises leaves parameters, state and step counters as they were.
        prepared = []
        for index, (group, buckets) in enumerate(gathered):
            self._check_group(group, f"param_groups[{index}]")
            for key, bucket in buckets.items():
                if bucket["kind"] == "plain":
                    table = self._tables.get((self._name, index, *key))
                else:
                    table = self._lowbit_tables.setdefault((index, *key), lowbit_ops.LowbitTable())
                prepared.append((key[0], self._prepare_bucket(group, bucket, table)))
        self.grad_norm = None
        if sharded and (check or found_inf is not None):
            found_inf, own_clip, self.grad_norm = self._mesh_stats(gathered, sharded[0].mesh, check, grad_scale,
                                                                   found_inf)
            clip = own_clip if own_clip is not None else clip
            if caller_found_inf is not None and found_inf is not caller_found_inf:
                caller_found_inf.copy_(found_inf)
        elif check:
            grads = [g for _, buckets in gathered for b in buckets.values() for g in b["grads"]]
            if grads:
                device = self._checks_device(grads)
                stats = amp_ops.grad_stats(grads, grad_scale=_on(grad_scale, device), found_inf=_on(found_inf, device),
                                           max_norm=self.max_grad_norm, tables=self._tables)
                found_inf, self.grad_norm = stats.found_inf, stats.norm
                clip = stats.clip if stats.clip is not None else clip   # the caller's, without max_grad_norm
                if caller_found_inf is not None and found_inf is not caller_found_inf:
                    caller_found_inf.copy_(found_inf)
        for device, write in prepared:
            write(_on(grad_scale, device), _on(found_inf, device), _on(clip, device))
        return loss

    def _mesh_stats(self, gathered, mesh, check: bool, grad_scale, found_inf):
        """(found_inf, clip, norm) of a step over DTensor parameters, the same on every rank of the mesh.

        Each rank reads its local gradients (grad_stats, once per set of shard dimensions), then one
        all_reduce per mesh dimension sums the squared norms over the ranks holding the parts and
        the inf/NaN flags over every rank; without ``check`` only the caller's flag is summed.
        """
        grads, dims = [], []
        for _, buckets in gathered:
            for bucket in buckets.values():
                grads += bucket["grads"]
                dims += bucket["mesh_sums"].dims if bucket["mesh_sums"] is not None else [()] * len(bucket["grads"])
        device = self._checks_device(grads)
        flag = torch.zeros((), dtype=torch.float32, device=device)
        if found_inf is not None:
            flag.copy_(found_inf)
        norms, classes = [], {}
        if check:
            for g, d in zip(grads, dims):
                classes.setdefault(d, []).append(g)
            for d, members in classes.items():
                stats = amp_ops.grad_stats(members, grad_scale=_on(grad_scale, device), found_inf=flag,
                                           tables=self._class_tables(d))
                norms.append(stats.norm)
        sums = MeshSums(mesh, [*classes, tuple(range(mesh.ndim))])
        values = torch.stack([*(n.to(torch.float64).square() for n in norms), flag.to(torch.float64)])
        sums.sum_rows_(values)
        flag = (values[-1] > 0).to(torch.float32)
        if not check:
            return flag, None, None
        norm = values[:-1].sum().sqrt()   # float64, rounded to float32 after the clip, as grad_stats's CPU path
        clip = None if self.max_grad_norm is None else amp_ops.clip_coefficient(norm, self.max_grad_norm).to(torch.float32)
        return flag, clip, norm.to(torch.float32)

    def _checks_device(self, grads) -> torch.device:
        """The one device of the gradients the step checks (norm, inf/NaN); UnsupportedError otherwise."""
        devices = {g.device for g in grads}
        if len(devices) > 1:
            raise UnsupportedError(f"trainops.optim.{self._name}: max_grad_norm / skip_nonfinite / GradScaler checks "
                                   f"need all parameters on one device; found {sorted(map(str, devices))}")
        return grads[0].device

    def _class_tables(self, dims) -> TableCache:
        """The pointer tables of one set of shard dimensions' gradients (kept apart: one cache per list)."""
        if dims not in self._mesh_tables:
            self._mesh_tables[dims] = TableCache()
        return self._mesh_tables[dims]

    def _prepare_bucket(self, group, bucket, table) -> optimizer_ops.PreparedStep:
        """The bucket's step with every check made and nothing written (see ops/optimizers.py)."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; ``set_to_none=False`` zeroes every gradient with one multi-tensor launch per device/dtype."""
        if set_to_none:
            return super().zero_grad(set_to_none=True)
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    grads.append(local(p.grad))
        with torch.no_grad():
            for device in {g.device for g in grads}:
                grad_ops.zero_([g for g in grads if g.device == device], tables=self._tables)

    @staticmethod
    def _column(bucket, name: str) -> list:
        """State ``name`` of each parameter of the bucket: its local shard for DTensor parameters (no
        call per tensor for plain ones: this runs every step)."""
        if bucket["mesh_sums"] is None:
            return [s[name] for s in bucket["states"]]
        return [local(s[name]) for s in bucket["states"]]

    @staticmethod
    def _masters(group, bucket):
        if group.get("master_weights") and bucket["params"][0].dtype in _HALF:
            return FusedOptimizer._column(bucket, "master_param")
        return None

    # -- state_dict ----------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then each state tensor restored in our dtypes (float32 moments and master
        copies, float32 step counters on the parameter's device) straight from ``state_dict``:
        torch's own load would first round moments to the parameter dtype. Every state tensor is
        checked against its parameter first: a state that does not fit raises and changes nothing."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            for key, value in (state_dict["state"].get(saved_id) or {}).items():
                if not isinstance(value, torch.Tensor) or key == "step":
                    continue
                where = f"trainops.optim.{self._name}.load_state_dict: state '{key}' of parameter {saved_id}"
                expected = lowbit_ops.scale_shape(p.shape) if key.endswith("_scales") else tuple(p.shape)
                if tuple(value.shape) != tuple(expected):
                    raise InvalidProblemError(f"{where} has shape {tuple(value.shape)}; expected {tuple(expected)} "
                                              f"(the parameter has shape {tuple(p.shape)})")
                if is_dtensor(p) and not is_dtensor(value):
                    raise UnsupportedError(f"{where} is a plain tensor and the parameter a DTensor; load sharded "
                                           "state with torch.distributed.checkpoint (set_optimizer_state_dict "
                                           "reshards a full state dict)")
        # How states are stored is the loading optimizer's choice, not the checkpoint's: a float32
        # state loads into optim_bits=8 (quantised at the next step) and an 8-bit one into float32.
        storage = [{key: group[key] for key in _STORAGE_KEYS if key in group} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, kept in zip(self.param_groups, storage):
            group.update(kept)
        self._state_version += 1
        self._ranks_checked = False
        groups = [g for g in self.param_groups for _ in g["params"]]
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        for saved_id, p, group in zip(saved_ids, params, groups):
            saved = state_dict["state"].get(saved_id)
            if not saved:
                continue
            state = self.state[p]
            for key, value in saved.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "step":
                    state[key] = value.detach().to(device=p.device, dtype=torch.float32).reshape(()).clone()
                    continue
                if key.endswith("_scales"):   # 8-bit block scales (not of the parameter's shape)
                    state[key] = value.detach().to(device=p.device, dtype=torch.float32).clone()
                    continue
                dtype = torch.float32 if key == "master_param" else self._state_dtype(group, p)
                dtype = torch.uint8 if key.endswith("_codes") else dtype
                state[key] = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format).copy_(value)


def _global_offset(p) -> int:
    """The flat index in the whole parameter of this rank's first element (0 for a plain tensor);
    a DTensor parameter here is split along dim 0 at most (checked by _check_lowbit)."""
    if not is_dtensor(p):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] * lowbit_ops.rows_of(p.shape)[1] if p.dim() >= 2 else offset[0]


_STORAGE_KEYS = ("optim_bits", "min_8bit_size", "stochastic_rounding")
_CODE_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


def _to_8bit_state(state: dict, p, name: str) -> None:
    """Give ``p`` (an 8-bit parameter) its 8-bit moments: new zeros, or its float moments quantised
    (a float32 state loaded into optim_bits=8)."""
    if all(key in state for key in _CODE_KEYS):
        return
    if is_dtensor(p):
        if "exp_avg" in state:
            raise UnsupportedError(f"trainops.optim.{name}: a float32 state was loaded for a DTensor parameter under "
                                   "optim_bits=8; convert it before sharding (or load it into optim_bits=32)")
        from torch.distributed.tensor import zeros as dtensor_zeros

        for key in _CODE_KEYS:
            if key.endswith("_codes"):
                state[key] = torch.zeros_like(p, dtype=torch.uint8)
            else:
                state[key] = dtensor_zeros(lowbit_ops.scale_shape(p.shape), dtype=torch.float32,
                                           device_mesh=p.device_mesh, placements=p.placements)
                if local(state[key]).shape[0] != local(p).shape[0]:
                    raise UnsupportedError(f"trainops.optim.{name}: the block scales of a DTensor parameter of shape "
                                           f"{tuple(p.shape)} do not shard along dim 0 as the parameter does")
        return
    with torch.no_grad():
        if "exp_avg" in state:
            state.update(lowbit_ops.quantize_moments(state.pop("exp_avg"), state.pop("exp_avg_sq")))
        else:   # zero moments: code 0, scale 0 (no float32 zeros made on the way)
            for key in _CODE_KEYS:
                state[key] = (torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
                              if key.endswith("_codes") else
                              torch.zeros(lowbit_ops.scale_shape(p.shape), dtype=torch.float32, device=p.device))


def _to_float_state(state: dict, p, name: str) -> None:
    """An 8-bit state loaded for a parameter that keeps float32 moments: dequantised."""
    if "exp_avg_codes" not in state:
        return
    if is_dtensor(p):
        raise UnsupportedError(f"trainops.optim.{name}: an 8-bit state was loaded for a DTensor parameter that keeps "
                               "float32 states; load it with optim_bits=8")
    m, v = lowbit_ops.dequantize_moments(state)
    for key in _CODE_KEYS:
        del state[key]
    state["exp_avg"], state["exp_avg_sq"] = m.reshape(p.shape), v.reshape(p.shape)


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)


class SGD(FusedOptimizer):
    """torch.optim.SGD, fused: momentum, dampening, nesterov, weight_decay, maximize (state: momentum_buffer)."""

    _has_step_counter = False
    _name = "SGD"
    _non_negative_keys = ("lr", "momentum", "weight_decay")
    _finite_keys = ("dampening",)

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float | torch.Tensor = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 max_grad_norm: float | None = None, skip_nonfinite: bool = False, master_weights: bool = False,
                 state_dtype: torch.dtype | None = None):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise InvalidProblemError("trainops.optim.SGD: nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize),
                         max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, master_weights=master_weights,
                         state_dtype=state_dtype)

    def _prepare_bucket(self, group, bucket, table) -> optimizer_ops.PreparedStep:
        buffers, fresh, new_buffers = None, None, {}
        if group["momentum"] != 0:
            buffers, fresh = [], []
            for p, state in zip(bucket["originals"], bucket["states"]):
                buffer = state.get("momentum_buffer")
                fresh.append(buffer is None)
                if buffer is None:
                    # The kernel sets a fresh buffer to the gradient (torch's first step). Zeros, in case
                    # that step is skipped on the device (found_inf): the next step then starts from 0,
                    # which is torch's first step again whenever dampening is 0. Kept in the state only
                    # once the step writes.
                    buffer = new_buffers[id(state)] = torch.zeros_like(p, dtype=self._state_dtype(group, p),
                                                                       memory_format=torch.preserve_format)
                buffers.append(buffer if bucket["mesh_sums"] is None else local(buffer))
        step = optimizer_ops.prepare_sgd_step(
            bucket["params"], bucket["grads"], buffers, fresh, lr=group["lr"], momentum=group["momentum"],
            dampening=group["dampening"], weight_decay=group["weight_decay"], nesterov=group["nesterov"],
            maximize=group["maximize"], masters=self._masters(group, bucket), table=table)
        if not new_buffers:
            return step

        def write(grad_scale=None, found_inf=None, clip=None) -> None:
            for state in bucket["states"]:
                if id(state) in new_buffers:
                    state["momentum_buffer"] = new_buffers[id(state)]
            step(grad_scale, found_inf, clip)

        return write


class Adam(FusedOptimizer):
    """torch.optim.Adam, fused: amsgrad, maximize, L2 weight_decay (``decoupled_weight_decay=True`` is AdamW)."""

    _state_names = ("exp_avg", "exp_avg_sq")
    _name = "Adam"
    _decoupled_default = False
    _non_negative_keys = ("lr", "eps", "weight_decay")

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | torch.Tensor = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool | None = None, max_grad_norm: float | None = None,
                 skip_nonfinite: bool = False, master_weights: bool = False, state_dtype: torch.dtype | None = None,
                 optim_bits: int = 32, min_8bit_size: int = 4096, stochastic_rounding: bool = False,
                 rounding_seed: int = 0):
        decoupled = self._decoupled_default if decoupled_weight_decay is None else bool(decoupled_weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=decoupled),
                         max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, master_weights=master_weights,
                         state_dtype=state_dtype,
                         lowbit=dict(optim_bits=optim_bits, min_8bit_size=min_8bit_size,
                                     stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed))

    def _init_state(self, group, p, state) -> None:
        super()._init_state(group, p, state)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=self._state_dtype(group, p),
                                                       memory_format=torch.preserve_format)

    def _prepare_bucket(self, group, bucket, table) -> optimizer_ops.PreparedStep:
        states = bucket["states"]
        beta1, beta2 = group["betas"]
        if bucket["kind"] != "plain":
            quantized = bucket["kind"] == "8bit"
            m, v = ("exp_avg_codes", "exp_avg_sq_codes") if quantized else ("exp_avg", "exp_avg_sq")
            return lowbit_ops.prepare_adam_lowbit_step(
                bucket["params"], bucket["grads"], self._column(bucket, m), self._column(bucket, v),
                self._column(bucket, "exp_avg_scales") if quantized else None,
                self._column(bucket, "exp_avg_sq_scales") if quantized else None, [s["step"] for s in states],
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled=group["decoupled_weight_decay"], maximize=group["maximize"],
                masters=self._masters(group, bucket),
                stochastic_rounding=group["stochastic_rounding"], seed=self.rounding_seed, keys=bucket["sr_keys"],
                offsets=bucket["offsets"], table=table)
        return optimizer_ops.prepare_adam_step(
            bucket["params"], bucket["grads"], self._column(bucket, "exp_avg"), self._column(bucket, "exp_avg_sq"),
            self._column(bucket, "max_exp_avg_sq") if group["amsgrad"] else None, [s["step"] for s in states],
            lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            decoupled=group["decoupled_weight_decay"], amsgrad=group["amsgrad"], maximize=group["maximize"],
            masters=self._masters(group, bucket), table=table)


class AdamW(Adam):
    """torch.optim.AdamW, fused: decoupled weight decay (default 0.01), amsgrad, maximize."""

    _name = "AdamW"
    _decoupled_default = True

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | torch.Tensor = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 max_grad_norm: float | None = None, skip_nonfinite: bool = False, master_weights: bool = False,
                 state_dtype: torch.dtype | None = None, optim_bits: int = 32, min_8bit_size: int = 4096,
                 stochastic_rounding: bool = False, rounding_seed: int = 0):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, decoupled_weight_decay=True,
                         max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, master_weights=master_weights,
                         state_dtype=state_dtype, optim_bits=optim_bits, min_8bit_size=min_8bit_size,
                         stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed)


class AdamW8bit(AdamW):
    """AdamW with 8-bit blockwise states (``optim_bits=8``): the name bitsandbytes and torchao use."""

    _name = "AdamW8bit"

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | torch.Tensor = 1e-2, amsgrad: bool = False, *, optim_bits: int = 8, **options):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits=optim_bits, **options)


class Adam8bit(Adam):
    """Adam with 8-bit blockwise states (``optim_bits=8``): the name bitsandbytes and torchao use."""

    _name = "Adam8bit"

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | torch.Tensor = 0.0, amsgrad: bool = False, *, optim_bits: int = 8, **options):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits=optim_bits, **options)


class LAMB(FusedOptimizer):
    """LAMB (You et al. 2019): Adam moments, update u = m^ / (sqrt(v^) + eps) + weight_decay * p,
    per-tensor trust ratio ||p|| / ||u|| (1 when either norm is 0), p -= lr * ratio * u.

    Global gradient clipping as in NVIDIA's FusedLAMB is ``max_grad_norm`` (off by default).
    State: step, exp_avg, exp_avg_sq (torch has no LAMB; the keys follow torch's Adam).
    """

    _state_names = ("exp_avg", "exp_avg_sq")
    _name = "LAMB"
    _non_negative_keys = ("lr", "eps", "weight_decay")

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float | torch.Tensor = 0.01, *, bias_correction: bool = True, maximize: bool = False,
                 max_grad_norm: float | None = None, skip_nonfinite: bool = False, master_weights: bool = False,
                 state_dtype: torch.dtype | None = None, optim_bits: int = 32, min_8bit_size: int = 4096,
                 stochastic_rounding: bool = False, rounding_seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, maximize=maximize),
                         max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, master_weights=master_weights,
                         state_dtype=state_dtype,
                         lowbit=dict(optim_bits=optim_bits, min_8bit_size=min_8bit_size,
                                     stochastic_rounding=stochastic_rounding, rounding_seed=rounding_seed))

    def _prepare_bucket(self, group, bucket, table) -> optimizer_ops.PreparedStep:
        states = bucket["states"]
        beta1, beta2 = group["betas"]
        mesh_sums = bucket["mesh_sums"]
        if bucket["kind"] != "plain":
            quantized = bucket["kind"] == "8bit"
            m, v = ("exp_avg_codes", "exp_avg_sq_codes") if quantized else ("exp_avg", "exp_avg_sq")
            return lowbit_ops.prepare_lamb_lowbit_step(
                bucket["params"], bucket["grads"], self._column(bucket, m), self._column(bucket, v),
                self._column(bucket, "exp_avg_scales") if quantized else None,
                self._column(bucket, "exp_avg_sq_scales") if quantized else None, [s["step"] for s in states],
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                bias_correction=group["bias_correction"], maximize=group["maximize"],
                masters=self._masters(group, bucket), stochastic_rounding=group["stochastic_rounding"],
                seed=self.rounding_seed, keys=bucket["sr_keys"], offsets=bucket["offsets"], table=table,
                reduce_squares=None if mesh_sums is None else mesh_sums.sum_rows_)
        return optimizer_ops.prepare_lamb_step(
            bucket["params"], bucket["grads"], self._column(bucket, "exp_avg"), self._column(bucket, "exp_avg_sq"),
            [s["step"] for s in states], lr=group["lr"], beta1=beta1,
            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"], maximize=group["maximize"],
            masters=self._masters(group, bucket), table=table,
            reduce_squares=None if mesh_sums is None else mesh_sums.sum_rows_)


class LAMB8bit(LAMB):
    """LAMB with 8-bit blockwise states (``optim_bits=8``)."""

    _name = "LAMB8bit"

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float | torch.Tensor = 0.01, *, optim_bits: int = 8, **options):
        super().__init__(params, lr, betas, eps, weight_decay, optim_bits=optim_bits, **options)


_IN_BACKWARD_CACHE = 256   # cached buckets (sets of parameters stepped together) before they are dropped


class StepInBackward:
    """The handle step_in_backward returns: ``remove()`` restores the plain optimizer. While it is
    active, ``handle.grad_norm`` is the previous backward's global gradient norm (with
    ``clip_with_previous_norm``) and ``handle.steps`` counts the optimizer steps taken."""

    def __init__(self, params, optimizer, accumulation_steps: int, clip_with_previous_norm: bool, bucket_bytes: int):
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.bucket_bytes = bucket_bytes
        self.max_norm = optimizer.max_grad_norm if clip_with_previous_norm else None
        self.grad_norm: torch.Tensor | None = None
        self.steps = 0
        self._clip: torch.Tensor | None = None
        self._norm_squares: torch.Tensor | None = None
        self._backward = 0          # backward passes since the last step (accumulation)
        self._pending: list = []
        self._pending_bytes = 0
        self._queued = False
        self._norm_tables = TableCache()
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in params]
        self._saved = {name: optimizer.__dict__[name] for name in ("step", "zero_grad") if name in optimizer.__dict__}
        handle = self

        # Methods of the optimizer (torch's LR schedulers rebind ``optimizer.step.__func__`` to it).
        def step(optimizer, closure=None, **keywords):
            return handle._no_step(closure, **keywords)

        def zero_grad(optimizer, set_to_none: bool = True) -> None:
            """Gradients are freed by the step in the backward (and kept between accumulated micro-batches)."""

        step.step_in_backward = handle
        step._wrapped_by_lr_sched = True   # it sets _opt_called itself: no wrapper (nor warning) needed
        optimizer.step = types.MethodType(step, optimizer)
        optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
        optimizer.max_grad_norm = None   # the clip is this handle's (previous norm), or refused
        self._removed = False

    def _no_step(self, closure=None, **keywords):
        """The optimizer's step while steps run in the backward: nothing to do (the closure runs)."""
        if keywords.get("grad_scale") is not None or getattr(self.optimizer, "grad_scale", None) is not None:
            raise UnsupportedError("trainops.optim.step_in_backward: a GradScaler stepped the optimizer; its inf/NaN "
                                   "skip needs every gradient before any parameter changes, which a step in the "
                                   "backward cannot wait for (use bf16 autocast, or remove() the handle)")
        self.optimizer._opt_called = True   # what torch's LR schedulers check before their step
        return closure() if closure is not None else None

    def _ready(self, p) -> None:
        if self._backward + 1 < self.accumulation_steps:
            if not self._queued:
                self._queue()
            return
        self._pending.append(p)
        self._pending_bytes += p.grad.numel() * p.grad.element_size()
        if not self._queued:
            self._queue()
        if self._pending_bytes >= self.bucket_bytes:
            self._flush()

    def _queue(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._queued = True

    @torch.no_grad()
    def _flush(self) -> None:
        """One fused step over the pending parameters (per param group, device and dtype), their
        gradients freed."""
        params, self._pending, self._pending_bytes = self._pending, [], 0
        if not params:
            return
        opt = self.optimizer
        if len(opt._buckets) > _IN_BACKWARD_CACHE:   # flush sets that changed step to step: drop their caches
            for cache in (opt._buckets, opt._tables._tables, opt._lowbit_tables):
                for key in [k for k in cache if "in-backward" in str(k)]:
                    del cache[key]
        groups = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        by_group: dict = {}
        for p in params:
            by_group.setdefault(groups[id(p)], []).append(p)
        if self.max_norm is not None:
            grads = [p.grad for p in params]
            norm = amp_ops.grad_stats(grads, tables=self._norm_tables.get(len(grads))).norm.to(torch.float32)
            squares = norm.square()
            self._norm_squares = squares if self._norm_squares is None else self._norm_squares + squares
        prepared = []
        for index, members in by_group.items():
            group = opt.param_groups[index]
            opt._check_group(group, f"param_groups[{index}]")
            buckets = opt._gather(index, group, members, ("in-backward", index, tuple(map(id, members))))
            for key, bucket in buckets.items():
                if bucket["kind"] == "plain":
                    table = opt._tables.get((opt._name, "in-backward", index, tuple(map(id, members)), *key))
                else:
                    table = opt._lowbit_tables.setdefault(("in-backward", index, tuple(map(id, members)), *key),
                                                          lowbit_ops.LowbitTable())
                prepared.append((key[0], opt._prepare_bucket(group, bucket, table)))
        for device, write in prepared:
            write(None, None, _on(self._clip, device))
        for p in params:
            p.grad = None

    def _end_of_backward(self) -> None:
        self._queued = False
        self._backward += 1
        if self._backward < self.accumulation_steps:
            return
        self._flush()
        self._backward = 0
        self.steps += 1
        if self.max_norm is not None and self._norm_squares is not None:
            self.grad_norm = self._norm_squares.sqrt()
            self.optimizer.grad_norm = self.grad_norm
            self._clip = amp_ops.clip_coefficient(self.grad_norm, self.max_norm).to(torch.float32)
            self._norm_squares = None

    def remove(self) -> None:
        """Remove the hooks and give the optimizer back its step, zero_grad and max_grad_norm."""
        if self._removed:
            return
        for hook in self._hooks:
            hook.remove()
        for name in ("step", "zero_grad"):
            self.optimizer.__dict__.pop(name, None)
        self.optimizer.__dict__.update(self._saved)
        if self.max_norm is not None:
            self.optimizer.max_grad_norm = self.max_norm
        self._removed = True


def step_in_backward(model, optimizer: FusedOptimizer, *, accumulation_steps: int = 1,
                     clip_with_previous_norm: bool = False, bucket_bytes: int = 32 << 20) -> StepInBackward:
    """Run ``optimizer``'s step inside the backward: each parameter's gradient, once accumulated
    (``register_post_accumulate_grad_hook``), joins a pending bucket; a bucket of ``bucket_bytes``
    of gradients (and the rest at the end of the backward) takes one fused multi-tensor step and
    its gradients are freed, so at most about ``bucket_bytes`` of gradients live at once instead
    of all of them.

    ``model``: an nn.Module or parameters; every trainable one must belong to ``optimizer`` (a
    trainops optimizer). Afterwards ``optimizer.step()`` and ``zero_grad()`` do nothing (a
    closure still runs), so training loops (the Hugging Face Trainer's) keep working, and LR
    schedulers act through ``param_groups``, read at every bucket's step. ``handle.remove()``
    restores the plain optimizer.

    What it cannot do, explicitly:
    - a global-norm clip needs every gradient before the first update: ``max_grad_norm`` is refused,
      unless ``clip_with_previous_norm=True``: each step is clipped with the coefficient of the
      *previous* backward's global norm (the first step is not clipped); the norm is left in
      ``handle.grad_norm`` and ``optimizer.grad_norm``;
    - ``skip_nonfinite`` and GradScaler's inf/NaN skip (every gradient checked before any update)
      are refused: at construction, and for a GradScaler when it calls ``optimizer.step`` (after
      the backward already stepped with scaled gradients: use bf16 autocast instead);
    - gradient accumulation: ``accumulation_steps=N`` lets N - 1 backward passes accumulate (the
      gradients live as usual) and steps in the N-th; calling backward more often than declared
      between steps is not detected.
    - DTensor (FSDP2) parameters are refused: FSDP2 writes reduced gradients outside autograd's
      accumulation.
    With the Hugging Face Trainer, set ``max_grad_norm=0`` (its clip runs after the backward, on
    gradients already freed, and clips nothing) and use ``clip_with_previous_norm`` if a clip is wanted.
    """
    name = "trainops.optim.step_in_backward"
    if not isinstance(optimizer, FusedOptimizer):
        raise UnsupportedError(f"{name}: argument 'optimizer' is a {type(optimizer).__name__}; a trainops optimizer "
                               "(trainops.optim.AdamW, ...) is needed")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise InvalidProblemError(f"{name}: argument 'accumulation_steps' is {accumulation_steps!r}; it must be an "
                                  "int >= 1")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise InvalidProblemError(f"{name}: argument 'bucket_bytes' is {bucket_bytes!r}; it must be an int >= 0")
    if optimizer.max_grad_norm is not None and not clip_with_previous_norm:
        raise UnsupportedError(f"{name}: the optimizer has max_grad_norm={optimizer.max_grad_norm}; a global-norm "
                               "clip needs every gradient before the first update. Pass clip_with_previous_norm=True "
                               "to clip with the previous step's norm, or drop max_grad_norm")
    if clip_with_previous_norm and optimizer.max_grad_norm is None:
        raise InvalidProblemError(f"{name}: argument 'clip_with_previous_norm' is True but the optimizer has no "
                                  "max_grad_norm")
    if optimizer.skip_nonfinite:
        raise UnsupportedError(f"{name}: the optimizer has skip_nonfinite=True; skipping a step on inf/NaN needs every "
                               "gradient before the first update")
    if getattr(getattr(optimizer.step, "__func__", None), "step_in_backward", None) is not None:
        raise InvalidProblemError(f"{name}: the optimizer already steps in the backward (remove() its handle first)")
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
    params = [p for p in params if p.requires_grad]
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for i, p in enumerate(params):
        if id(p) not in owned:
            raise InvalidProblemError(f"{name}: trainable parameter {i} of argument 'model' (shape {tuple(p.shape)}) "
                                      "is not in the optimizer")
        if is_dtensor(p):
            raise UnsupportedError(f"{name}: parameter {i} is a DTensor; FSDP2 writes its gradients outside autograd's "
                                   "accumulation, where no post-accumulate hook runs")
        if p.grad is not None:
            raise InvalidProblemError(f"{name}: trainable parameter {i} of argument 'model' already has a gradient "
                                      "(accumulated before the handle): the first step in the backward would add it "
                                      "in. Call optimizer.zero_grad() first; accumulate with accumulation_steps")
    return StepInBackward(params, optimizer, accumulation_steps, clip_with_previous_norm, bucket_bytes)


__all__ = ["Adam", "Adam8bit", "AdamW", "AdamW8bit", "FusedOptimizer", "FusedStep", "LAMB", "LAMB8bit", "SGD",
           "StepInBackward", "step_in_backward"]
