"""Multi-tensor optimizer steps: SGD, Adam / AdamW, LAMB. Triton kernels, CPU path, registration.

Every step reads each parameter-sized tensor once and writes each updated one once, over all the
tensors of a (device, dtype) bucket in one launch (see ops/multi_tensor.py). Math in float32.
Per element, with g the gradient after the optional fused pre-processing

    g <- g / grad_scale  (loss scale, when given)    g <- g * clip  (global-norm clip, when given)
    g <- -g              (maximize)

    sgd:   g += wd * p;  b = g (first step) or momentum * b + (1 - dampening) * g;
           d = g + momentum * b (nesterov) or b;                          p -= lr * d
    adam:  p *= 1 - lr * wd (AdamW) or g += wd * p (Adam);  m = lerp(m, g, 1 - beta1);
           v = beta2 * v + (1 - beta2) * g^2;  vmax = max(vmax, v) (amsgrad);
           p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    lamb:  m, v as adam; u = (m / bc1) / (sqrt(v / bc2) + eps) + wd * p   (bc = 1 when bias_correction=False)
           r = ||p|| / ||u|| per tensor (1 if either is 0);             p -= lr * r * u

``found_inf`` (a one-element float32 tensor, set by GradScaler or grad_stats): where it is nonzero
nothing is written and the step counters do not advance; no host synchronisation either way.
Step counters ``t`` are float32 one-element tensors on the parameters' device (as torch's fused
Adam keeps them), advanced by one small kernel; bias corrections are computed on the device.
``lr``, ``betas`` and ``weight_decay`` may be one-element tensors on the device (CUDA-graph friendly).

Half parameters may carry a float32 master copy (``masters``): the step reads and writes the
master and writes the parameter as its rounding. Optimizer state is float32, or bfloat16 on
request (``exp_avg`` etc. then round to bfloat16 after each step).

CPU path: the same semantics with torch ops, in the order torch.optim's single-tensor
implementations use, so a CPU run matches torch.optim bit for bit.

LAMB costs two passes: moments and the per-tensor norms of p and u first (u cannot be applied
before ||u|| is known), then p -= lr * r * u with u recomputed from the new moments. Bytes per
float32 parameter: adam 28, lamb 40. On tensors that are parts of larger ones (DTensor shards,
trainops.dtensor), ``reduce_squares(squares)`` receives the per-tensor sums of squares
([n_tensors, 2]: p, u; float32, float64 for float64 parameters on the CPU path) between the passes and sums them in place over the parts.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import InvalidProblemError, argument_error
from ..plan import KernelChoice
from ..registry import FLOATS, register, register_op, triton_available
from .amp import TRITON_FLOATS, unscaled_grads_cpu
from .multi_tensor import (MultiTensorLaunch, MultiTensorProblem, TensorTable, check_columns, check_scalar,
                           column_dtypes_ok, multi_tensor_describer, multi_tensor_launch, new_table)

_ACC = "float32 (float64 for float64 on the CPU path)"

for _op in ("sgd_step", "adam_step", "lamb_step"):
    register_op(_op, multi_tensor_describer(_op))


def _check_columns(op, names, columns, steps, state_dtype, masters) -> None:
    """Per-tensor checks: run when a bucket's tensors change (see ops/multi_tensor.py TensorTable)."""
    check_columns(op, names, columns)
    params = columns[0]
    dtype = params[0].dtype
    column_dtypes_ok(op, "grads", columns[1], dtype)
    for name, column in zip(names[2:], columns[2:]):
        column_dtypes_ok(op, name, column, torch.float32 if name == "masters" else state_dtype)
    if masters is not None and dtype not in (torch.float16, torch.bfloat16):
        raise argument_error(InvalidProblemError, op, "masters", f"are for half parameters; the parameters are {dtype}")
    if steps is not None:
        if len(steps) != len(params):
            raise argument_error(InvalidProblemError, op, "steps", f"has {len(steps)} tensors for {len(params)} parameters")
        for i, s in enumerate(steps):
            check_scalar(op, f"steps[{i}]", s, params[0].device)


def _check_step_scalars(op, device, grad_scale, found_inf, clip) -> None:
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf), ("clip", clip)):
        if t is not None:
            check_scalar(op, name, t, device)


def _hyper(value):
    """(kernel argument, is_pointer) of a hyper-parameter given as a number or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return float(value), False
        return value.to(torch.float32), True
    return float(value), False


def _check_hyper(op: str, **values) -> None:
    """Numbers must be finite, tensors hold one element (their values are not read: no host sync)."""
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise argument_error(InvalidProblemError, op, name,
                                     f"is a tensor of shape {tuple(value.shape)}; a hyper-parameter tensor has one element")
        elif not math.isfinite(value):
            raise argument_error(InvalidProblemError, op, name, f"is {value}; it must be finite")


PreparedStep = Callable[..., None]
"""A checked step: ``prepared(grad_scale=None, found_inf=None, clip=None)`` writes it."""


def _prepared(op: str, launch, columns, per_tensor, steps, table, validate, **hyper) -> PreparedStep:
    """Resolve the tables (validating the tensors when they changed) and return the step that writes.
    ``per_tensor``: the run's second argument (SGD's fresh flags, the others' step counters)."""
    scalars = [steps] if steps is not None else []
    tables = (table or new_table()).tables(columns, scalars, validate=validate, user_columns=2,  # params, grads
                                           gradient_column=1)
    device = columns[0][0].device

    def write(grad_scale=None, found_inf=None, clip=None) -> None:
        _check_step_scalars(op, device, grad_scale, found_inf, clip)
        launch.run(columns, per_tensor, tables=tables, grad_scale=grad_scale, found_inf=found_inf, clip=clip, **hyper)

    return write


# ----------------------------------------------------------------------------------------------
# Public launchers (one bucket: same device and dtype). ``prepare_*`` make every check of a step
# (kernel lookup, tensor layouts, hyper-parameters) and write nothing; a step over several buckets
# prepares them all before writing any. ``*_step`` prepares and writes at once.
# ----------------------------------------------------------------------------------------------

def prepare_sgd_step(params, grads, momentum_buffers, fresh, *, lr, momentum, dampening, weight_decay, nesterov,
                     maximize, masters=None, table: TensorTable | None = None) -> PreparedStep:
    """An SGD step over a bucket, checked (see sgd_step)."""
    has_momentum = momentum_buffers is not None
    names = ["params", "grads", *(["momentum_buffers"] if has_momentum else []), *(["masters"] if masters else [])]
    columns = [params, grads, *([momentum_buffers] if has_momentum else []), *([masters] if masters else [])]
    state_dtype = momentum_buffers[0].dtype if has_momentum else torch.float32
    _check_hyper("sgd_step", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    launch = multi_tensor_launch("sgd_step", params[0].device, params[0].dtype, momentum=has_momentum,
                                 nesterov=bool(nesterov), maximize=bool(maximize), master=masters is not None,
                                 state_dtype=state_dtype)
    validate = lambda: _check_columns("sgd_step", names, columns, None, state_dtype, masters)  # noqa: E731
    return _prepared("sgd_step", launch, columns, list(fresh) if has_momentum else None, None, table, validate,
                     lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)


def prepare_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                      weight_decay, decoupled, amsgrad, maximize, masters=None,
                      table: TensorTable | None = None) -> PreparedStep:
    """An Adam / AdamW step over a bucket, checked (see adam_step)."""
    names = ["params", "grads", "exp_avgs", "exp_avg_sqs", *(["max_exp_avg_sqs"] if amsgrad else []),
             *(["masters"] if masters else [])]
    columns = [params, grads, exp_avgs, exp_avg_sqs, *([max_exp_avg_sqs] if amsgrad else []),
               *([masters] if masters else [])]
    state_dtype = exp_avgs[0].dtype
    _check_hyper("adam_step", lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    launch = multi_tensor_launch("adam_step", params[0].device, params[0].dtype, decoupled=bool(decoupled),
                                 amsgrad=bool(amsgrad), maximize=bool(maximize), master=masters is not None,
                                 state_dtype=state_dtype)
    validate = lambda: _check_columns("adam_step", names, columns, steps, state_dtype, masters)  # noqa: E731
    return _prepared("adam_step", launch, columns, steps, steps, table, validate, lr=lr, beta1=beta1, beta2=beta2,
                     eps=eps, weight_decay=weight_decay)


def prepare_lamb_step(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
                      bias_correction, maximize, masters=None, table: TensorTable | None = None,
                      reduce_squares: Callable[[torch.Tensor], None] | None = None) -> PreparedStep:
    """A LAMB step over a bucket, checked (see lamb_step; ``reduce_squares``: the module docstring)."""
    names = ["params", "grads", "exp_avgs", "exp_avg_sqs", *(["masters"] if masters else [])]
    columns = [params, grads, exp_avgs, exp_avg_sqs, *([masters] if masters else [])]
    state_dtype = exp_avgs[0].dtype
    _check_hyper("lamb_step", lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    launch = multi_tensor_launch("lamb_step", params[0].device, params[0].dtype,
                                 bias_correction=bool(bias_correction), maximize=bool(maximize),
                                 master=masters is not None, state_dtype=state_dtype)
    validate = lambda: _check_columns("lamb_step", names, columns, steps, state_dtype, masters)  # noqa: E731
    return _prepared("lamb_step", launch, columns, steps, steps, table, validate, lr=lr, beta1=beta1, beta2=beta2,
                     eps=eps, weight_decay=weight_decay, reduce_squares=reduce_squares)


def sgd_step(params, grads, momentum_buffers, fresh, *, grad_scale=None, found_inf=None, clip=None,
             **options) -> None:
    """One SGD step over a bucket. ``momentum_buffers`` (None without momentum) are updated in place;
    where ``fresh[i]`` the buffer is new and set to the gradient (torch's first step). ``options``:
    prepare_sgd_step's."""
    if params:
        prepare_sgd_step(params, grads, momentum_buffers, fresh, **options)(grad_scale, found_inf, clip)


def adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, grad_scale=None, found_inf=None,
              clip=None, **options) -> None:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) step over a bucket, in place."""
    if params:
        prepare_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, **options)(
            grad_scale, found_inf, clip)


def lamb_step(params, grads, exp_avgs, exp_avg_sqs, steps, *, grad_scale=None, found_inf=None, clip=None,
              **options) -> None:
    """One LAMB step over a bucket, in place (trust ratio per tensor; see the module docstring)."""
    if params:
        prepare_lamb_step(params, grads, exp_avgs, exp_avg_sqs, steps, **options)(grad_scale, found_inf, clip)


# ----------------------------------------------------------------------------------------------
# CPU path: torch.optim's single-tensor order of operations
# ----------------------------------------------------------------------------------------------

def _cpu_grads(grads, grad_scale, clip, maximize):
    grads = unscaled_grads_cpu(grads, grad_scale)
    if clip is not None:
        grads = [g * clip for g in grads]
    return [-g for g in grads] if maximize else grads


def _skipped(found_inf) -> bool:
    return found_inf is not None and bool(found_inf.item())


def _value(x) -> float:
    return float(x) if isinstance(x, torch.Tensor) else x


class _Working:
    """The tensor a CPU step updates: the tensor itself, or a float32 copy written back at the end
    (master weights, or state kept in a different dtype than the math)."""

    def __init__(self, stored: torch.Tensor, dtype: torch.dtype):
        self.stored = stored
        self.value = stored if stored.dtype == dtype else stored.to(dtype)

    def write_back(self):
        if self.value is not self.stored:
            self.stored.copy_(self.value)


def _cpu_param(params, masters, i):
    return _Working(masters[i], torch.float32) if masters else _Working(params[i], params[i].dtype)


def _finish_param(params, masters, i, work: _Working):
    work.write_back()
    if masters:
        params[i].copy_(masters[i])


def _prepare_sgd_cpu(problem: MultiTensorProblem) -> MultiTensorLaunch:
    has_momentum, nesterov = problem.option("momentum"), problem.option("nesterov")
    maximize, master = problem.option("maximize"), problem.option("master")

    def run(columns, fresh, *, tables, lr, momentum, dampening, weight_decay, grad_scale, found_inf, clip):
        if _skipped(found_inf):
            return
        params, grads = columns[0], columns[1]
        buffers = columns[2] if has_momentum else None
        masters = columns[-1] if master else None
        lr, momentum, dampening, weight_decay = map(_value, (lr, momentum, dampening, weight_decay))
        for i, g in enumerate(_cpu_grads(grads, grad_scale, clip, maximize)):
            p = _cpu_param(params, masters, i)
            if g.dtype != p.value.dtype:
                g = g.to(p.value.dtype)
            if weight_decay != 0:
                g = g.add(p.value, alpha=weight_decay)
            if has_momentum:
                buf = _Working(buffers[i], p.value.dtype)
                if fresh[i]:
                    buf.value.copy_(g)
                else:
                    buf.value.mul_(momentum).add_(g, alpha=1 - dampening)
                buf.write_back()
                g = g.add(buf.value, alpha=momentum) if nesterov else buf.value
            p.value.add_(g, alpha=-lr)
            _finish_param(params, masters, i, p)

    return MultiTensorLaunch(run, KernelChoice("sgd_step_cpu", "cpu"), problem.dtype)


def _prepare_adam_cpu(problem: MultiTensorProblem) -> MultiTensorLaunch:
    decoupled, amsgrad = problem.option("decoupled"), problem.option("amsgrad")
    maximize, master = problem.option("maximize"), problem.option("master")

    def run(columns, steps, *, tables, lr, beta1, beta2, eps, weight_decay, grad_scale, found_inf, clip):
        if _skipped(found_inf):
            return
        params, grads, exp_avgs, exp_avg_sqs = columns[:4]
        max_sqs = columns[4] if amsgrad else None
        masters = columns[-1] if master else None
        lr, beta1, beta2, weight_decay = map(_value, (lr, beta1, beta2, weight_decay))
        for i, g in enumerate(_cpu_grads(grads, grad_scale, clip, maximize)):
            p = _cpu_param(params, masters, i)
            if g.dtype != p.value.dtype:
                g = g.to(p.value.dtype)
            steps[i] += 1
            if weight_decay != 0:
                if decoupled:
                    p.value.mul_(1 - lr * weight_decay)
                else:
                    g = g.add(p.value, alpha=weight_decay)
            m, v = _Working(exp_avgs[i], p.value.dtype), _Working(exp_avg_sqs[i], p.value.dtype)
            m.value.lerp_(g, 1 - beta1)
            v.value.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            step = steps[i].item()
            bias_correction1 = 1 - beta1 ** step
            bias_correction2 = 1 - beta2 ** step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = bias_correction2 ** 0.5
            if amsgrad:
                vmax = _Working(max_sqs[i], p.value.dtype)
                torch.maximum(vmax.value, v.value, out=vmax.value)
                denom = (vmax.value.sqrt() / bias_correction2_sqrt).add_(eps)
                vmax.write_back()
            else:
                denom = (v.value.sqrt() / bias_correction2_sqrt).add_(eps)
            p.value.addcdiv_(m.value, denom, value=-step_size)
            m.write_back()
            v.write_back()
            _finish_param(params, masters, i, p)

    return MultiTensorLaunch(run, KernelChoice("adam_step_cpu", "cpu"), problem.dtype)


def _lamb_update_cpu(m, v, p, bc1, bc2, eps, weight_decay):
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    return update.add(p, alpha=weight_decay) if weight_decay != 0 else update


def _prepare_lamb_cpu(problem: MultiTensorProblem) -> MultiTensorLaunch:
    bias_correction = problem.option("bias_correction")
    maximize, master = problem.option("maximize"), problem.option("master")

    def run(columns, steps, *, tables, lr, beta1, beta2, eps, weight_decay, grad_scale, found_inf, clip,
            reduce_squares=None):
        if _skipped(found_inf):
            return
        params, grads, exp_avgs, exp_avg_sqs = columns[:4]
        masters = columns[-1] if master else None
        lr, beta1, beta2, weight_decay = map(_value, (lr, beta1, beta2, weight_decay))
        if reduce_squares is not None:
            return _lamb_cpu_over_parts(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps,
                                        weight_decay, grad_scale, clip, reduce_squares)
        for i, g in enumerate(_cpu_grads(grads, grad_scale, clip, maximize)):
            p, m, v, update = moments(i, g, params, masters, exp_avgs, exp_avg_sqs, steps, beta1, beta2, eps,
                                      weight_decay)
            p_norm, u_norm = torch.linalg.vector_norm(p.value), torch.linalg.vector_norm(update)
            ratio = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.ones_like(p_norm))
            p.value.sub_(update * (lr * ratio))
            m.write_back()
            v.write_back()
            _finish_param(params, masters, i, p)

    def moments(i, g, params, masters, exp_avgs, exp_avg_sqs, steps, beta1, beta2, eps, weight_decay):
        """Tensor i's step counter and moments advanced (in its working dtype), and its update u."""
        p = _cpu_param(params, masters, i)
        if g.dtype != p.value.dtype:
            g = g.to(p.value.dtype)
        steps[i] += 1
        step = steps[i].item()
        bc1 = 1 - beta1 ** step if bias_correction else 1.0
        bc2 = 1 - beta2 ** step if bias_correction else 1.0
        m, v = _Working(exp_avgs[i], p.value.dtype), _Working(exp_avg_sqs[i], p.value.dtype)
        m.value.lerp_(g, 1 - beta1)
        v.value.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        return p, m, v, _lamb_update_cpu(m.value, v.value, p.value, bc1, bc2, eps, weight_decay)

    def _lamb_cpu_over_parts(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps,
                             weight_decay, grad_scale, clip, reduce_squares):
        """The same step on parts of tensors: every update first, then the norms from the per-tensor
        sums of squares summed over the parts by ``reduce_squares``, then every parameter."""
        wide = params and (masters or params)[0].dtype == torch.float64
        pending, squares = [], torch.zeros(len(params), 2, dtype=torch.float64 if wide else torch.float32)
        for i, g in enumerate(_cpu_grads(grads, grad_scale, clip, maximize)):
            p, m, v, update = moments(i, g, params, masters, exp_avgs, exp_avg_sqs, steps, beta1, beta2, eps,
                                      weight_decay)
            m.write_back()
            v.write_back()
            squares[i, 0], squares[i, 1] = torch.sum(p.value * p.value), torch.sum(update * update)
            pending.append((p, update))
        squares = squares.to(params[0].device) if params else squares
        reduce_squares(squares)
        norms = squares.sqrt()
        ratios = torch.where((norms[:, 0] > 0) & (norms[:, 1] > 0), norms[:, 0] / norms[:, 1], 1.0)
        for i, (p, update) in enumerate(pending):
            p.value.sub_(update * (lr * ratios[i].to(update.dtype)))
            _finish_param(params, masters, i, p)

    return MultiTensorLaunch(run, KernelChoice("lamb_step_cpu", "cpu"), problem.dtype)


register("sgd_step", backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=_ACC,
         name="sgd_step_cpu")(_prepare_sgd_cpu)
register("adam_step", backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=_ACC,
         name="adam_step_cpu")(_prepare_adam_cpu)
register("lamb_step", backend="cpu", dtypes=FLOATS, deterministic=True, accumulator=_ACC,
         name="lamb_step_cpu")(_prepare_lamb_cpu)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from .multi_tensor import TL_DTYPES, block_of_program, column_pointer, load_block, runtime_scalar, store_block

    # Each kernel runs one block per program: full blocks take the unmasked (vectorised) body,
    # a tensor's tail block the masked one. found_inf set => limit 0 => nothing read or written.

    @triton.jit
    def _advance_steps(addresses, n_tensors, ROW: tl.constexpr, found_inf_ptr, HAS_FOUND_INF: tl.constexpr,
                       BLOCK: tl.constexpr):
        """One program: t += 1 for every step counter (address row ROW), unless found_inf."""
        increment = 1.0
        if HAS_FOUND_INF:
            increment = 1.0 - (tl.load(found_inf_ptr) != 0).to(tl.float32)
        for start in range(0, n_tensors, BLOCK):
            i = start + tl.arange(0, BLOCK)
            pointers = tl.load(addresses + ROW * n_tensors + i, mask=i < n_tensors, other=0).to(
                tl.pointer_type(tl.float32))
            tl.store(pointers, tl.load(pointers, mask=i < n_tensors) + increment, mask=i < n_tensors)

    @triton.jit
    def _block_limit(block_tensor, first_block, numels, found_inf_ptr, HAS_FOUND_INF: tl.constexpr,
                     BLOCK: tl.constexpr):
        """(tensor, offsets, limit, full): limit is the numel, or 0 when found_inf is set."""
        t, start, limit = block_of_program(block_tensor, first_block, numels, BLOCK)
        if HAS_FOUND_INF:
            limit = tl.where(tl.load(found_inf_ptr) == 0, limit, 0)
        return t, start + tl.arange(0, BLOCK), limit, start + BLOCK <= limit

    @triton.jit
    def _gradient(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, G_DTYPE: tl.constexpr,
                  HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr,
                  MASKED: tl.constexpr):
        """The block's gradient in float32 after unscale (1 / grad_scale), clip and maximize."""
        g = load_block(column_pointer(addresses, n_tensors, 1, t, G_DTYPE, ALIGNED), offsets, limit,
                       MASKED).to(tl.float32)
        if HAS_SCALE:
            g = g * (1.0 / tl.load(grad_scale_ptr))
        if HAS_CLIP:
            g = g * tl.load(clip_ptr)
        if MAXIMIZE:
            g = -g
        return g

    @triton.jit
    def _load_param(addresses, n_tensors, t, offsets, limit, P_DTYPE: tl.constexpr, MASTER_ROW: tl.constexpr,
                    ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        """The float32 value the step updates: the master copy (MASTER_ROW >= 0) or the parameter."""
        if MASTER_ROW >= 0:
            p = load_block(column_pointer(addresses, n_tensors, MASTER_ROW, t, tl.float32, ALIGNED), offsets, limit,
                           MASKED)
        else:
            p = load_block(column_pointer(addresses, n_tensors, 0, t, P_DTYPE, ALIGNED), offsets, limit, MASKED)
        return p.to(tl.float32)

    @triton.jit
    def _store_param(addresses, n_tensors, t, offsets, limit, p, P_DTYPE: tl.constexpr, MASTER_ROW: tl.constexpr,
                     ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        if MASTER_ROW >= 0:
            store_block(column_pointer(addresses, n_tensors, MASTER_ROW, t, tl.float32, ALIGNED), offsets, limit, p,
                        MASKED)
        store_block(column_pointer(addresses, n_tensors, 0, t, P_DTYPE, ALIGNED), offsets, limit, p.to(P_DTYPE),
                    MASKED)

    @triton.jit
    def _step_of(addresses, n_tensors, t, STEP_ROW: tl.constexpr):
        return tl.load(tl.load(addresses + STEP_ROW * n_tensors + t).to(tl.pointer_type(tl.float32)))

    @triton.jit
    def _bias_correction(beta, step):
        """1 - beta^step, for step >= 1 (beta = 0 gives 1)."""
        return 1.0 - tl.exp2(step * tl.log2(beta))

    # -- SGD -------------------------------------------------------------------------------------

    @triton.jit
    def _sgd_block(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, lr, momentum, dampening,
                   weight_decay, P_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, MOMENTUM: tl.constexpr,
                   FRESH: tl.constexpr, NESTEROV: tl.constexpr, MASTER_ROW: tl.constexpr, HAS_SCALE: tl.constexpr,
                   HAS_CLIP: tl.constexpr, MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        g = _gradient(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, P_DTYPE, HAS_SCALE, HAS_CLIP,
                      MAXIMIZE, ALIGNED, MASKED)
        p = _load_param(addresses, n_tensors, t, offsets, limit, P_DTYPE, MASTER_ROW, ALIGNED, MASKED)
        g = g + weight_decay * p
        if MOMENTUM:
            buf_ptr = column_pointer(addresses, n_tensors, 2, t, S_DTYPE, ALIGNED)
            if FRESH:
                buf = g
            else:
                buf = load_block(buf_ptr, offsets, limit, MASKED).to(tl.float32) * momentum + (1.0 - dampening) * g
            store_block(buf_ptr, offsets, limit, buf.to(S_DTYPE), MASKED)
            if NESTEROV:
                g = g + momentum * buf
            else:
                g = buf
        _store_param(addresses, n_tensors, t, offsets, limit, p - lr * g, P_DTYPE, MASTER_ROW, ALIGNED, MASKED)

    @triton.jit
    def _sgd_blocks(addresses, n_tensors, block_tensor, first_block, numels, grad_scale_ptr, found_inf_ptr, clip_ptr,
                    lr, momentum, dampening, weight_decay,
                    P_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, LR_POINTER: tl.constexpr, WD_POINTER: tl.constexpr,
                    MOMENTUM: tl.constexpr, FRESH: tl.constexpr, NESTEROV: tl.constexpr, MASTER_ROW: tl.constexpr,
                    HAS_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr,
                    MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        t, offsets, limit, full = _block_limit(block_tensor, first_block, numels, found_inf_ptr, HAS_FOUND_INF, BLOCK)
        lr = runtime_scalar(lr, LR_POINTER)
        weight_decay = runtime_scalar(weight_decay, WD_POINTER)
        if full:
            _sgd_block(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, lr, momentum, dampening,
                       weight_decay, P_DTYPE, S_DTYPE, MOMENTUM, FRESH, NESTEROV, MASTER_ROW, HAS_SCALE, HAS_CLIP,
                       MAXIMIZE, ALIGNED, False)
        else:
            _sgd_block(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, lr, momentum, dampening,
                       weight_decay, P_DTYPE, S_DTYPE, MOMENTUM, FRESH, NESTEROV, MASTER_ROW, HAS_SCALE, HAS_CLIP,
                       MAXIMIZE, ALIGNED, True)

    # -- Adam / AdamW ----------------------------------------------------------------------------

    @triton.jit
    def _adam_block(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, lr, beta1, beta2, eps,
                    weight_decay, step_size, bias_correction2_sqrt, P_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr,
                    DECOUPLED: tl.constexpr, AMSGRAD: tl.constexpr, MASTER_ROW: tl.constexpr,
                    HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr,
                    MASKED: tl.constexpr):
        g = _gradient(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, P_DTYPE, HAS_SCALE, HAS_CLIP,
                      MAXIMIZE, ALIGNED, MASKED)
        p = _load_param(addresses, n_tensors, t, offsets, limit, P_DTYPE, MASTER_ROW, ALIGNED, MASKED)
        if DECOUPLED:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m_ptr = column_pointer(addresses, n_tensors, 2, t, S_DTYPE, ALIGNED)
        v_ptr = column_pointer(addresses, n_tensors, 3, t, S_DTYPE, ALIGNED)
        m = load_block(m_ptr, offsets, limit, MASKED).to(tl.float32)
        v = load_block(v_ptr, offsets, limit, MASKED).to(tl.float32)
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * g * g
        store_block(m_ptr, offsets, limit, m.to(S_DTYPE), MASKED)
        store_block(v_ptr, offsets, limit, v.to(S_DTYPE), MASKED)
        if AMSGRAD:
            vmax_ptr = column_pointer(addresses, n_tensors, 4, t, S_DTYPE, ALIGNED)
            v = tl.maximum(load_block(vmax_ptr, offsets, limit, MASKED).to(tl.float32), v)
            store_block(vmax_ptr, offsets, limit, v.to(S_DTYPE), MASKED)
        denom = tl.sqrt_rn(v) / bias_correction2_sqrt + eps
        p = p - step_size * tl.div_rn(m, denom)
        _store_param(addresses, n_tensors, t, offsets, limit, p, P_DTYPE, MASTER_ROW, ALIGNED, MASKED)

    @triton.jit
    def _adam_blocks(addresses, n_tensors, block_tensor, first_block, numels, grad_scale_ptr, found_inf_ptr, clip_ptr,
                     lr, beta1, beta2, eps, weight_decay,
                     P_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, LR_POINTER: tl.constexpr,
                     BETA1_POINTER: tl.constexpr, BETA2_POINTER: tl.constexpr, WD_POINTER: tl.constexpr,
                     DECOUPLED: tl.constexpr, AMSGRAD: tl.constexpr, MASTER_ROW: tl.constexpr, STEP_ROW: tl.constexpr,
                     HAS_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr,
                     MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        t, offsets, limit, full = _block_limit(block_tensor, first_block, numels, found_inf_ptr, HAS_FOUND_INF, BLOCK)
        lr = runtime_scalar(lr, LR_POINTER)
        beta1 = runtime_scalar(beta1, BETA1_POINTER)
        beta2 = runtime_scalar(beta2, BETA2_POINTER)
        weight_decay = runtime_scalar(weight_decay, WD_POINTER)
        step = _step_of(addresses, n_tensors, t, STEP_ROW)
        step_size = lr / _bias_correction(beta1, step)
        bias_correction2_sqrt = tl.sqrt_rn(_bias_correction(beta2, step))
        if full:
            _adam_block(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, lr, beta1, beta2, eps,
                        weight_decay, step_size, bias_correction2_sqrt, P_DTYPE, S_DTYPE, DECOUPLED, AMSGRAD,
                        MASTER_ROW, HAS_SCALE, HAS_CLIP, MAXIMIZE, ALIGNED, False)
        else:
            _adam_block(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, lr, beta1, beta2, eps,
                        weight_decay, step_size, bias_correction2_sqrt, P_DTYPE, S_DTYPE, DECOUPLED, AMSGRAD,
                        MASTER_ROW, HAS_SCALE, HAS_CLIP, MAXIMIZE, ALIGNED, True)

    # -- LAMB ------------------------------------------------------------------------------------

    @triton.jit
    def _lamb_update(m, v, p, bc1, bc2, eps, weight_decay):
        return tl.div_rn(m / bc1, tl.sqrt_rn(v / bc2) + eps) + weight_decay * p

    @triton.jit
    def _lamb_corrections(addresses, n_tensors, t, beta1, beta2, STEP_ROW: tl.constexpr,
                          BIAS_CORRECTION: tl.constexpr):
        bc1 = 1.0
        bc2 = 1.0
        if BIAS_CORRECTION:
            step = _step_of(addresses, n_tensors, t, STEP_ROW)
            bc1 = _bias_correction(beta1, step)
            bc2 = _bias_correction(beta2, step)
        return bc1, bc2

    @triton.jit
    def _lamb_moments_block(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, partials, beta1, beta2,
                            eps, weight_decay, bc1, bc2, P_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr,
                            MASTER_ROW: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
                            MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        g = _gradient(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, P_DTYPE, HAS_SCALE, HAS_CLIP,
                      MAXIMIZE, ALIGNED, MASKED)
        p = _load_param(addresses, n_tensors, t, offsets, limit, P_DTYPE, MASTER_ROW, ALIGNED, MASKED)
        m_ptr = column_pointer(addresses, n_tensors, 2, t, S_DTYPE, ALIGNED)
        v_ptr = column_pointer(addresses, n_tensors, 3, t, S_DTYPE, ALIGNED)
        m = load_block(m_ptr, offsets, limit, MASKED).to(tl.float32)
        v = load_block(v_ptr, offsets, limit, MASKED).to(tl.float32)
        m = (m + (1.0 - beta1) * (g - m)).to(S_DTYPE)
        v = (v * beta2 + (1.0 - beta2) * g * g).to(S_DTYPE)
        store_block(m_ptr, offsets, limit, m, MASKED)
        store_block(v_ptr, offsets, limit, v, MASKED)
        u = _lamb_update(m.to(tl.float32), v.to(tl.float32), p, bc1, bc2, eps, weight_decay)
        if MASKED:
            u = tl.where(offsets < limit, u, 0.0)
        pid = tl.program_id(0)
        tl.store(partials + 2 * pid, tl.sum(p * p, axis=0))
        tl.store(partials + 2 * pid + 1, tl.sum(u * u, axis=0))

    @triton.jit
    def _lamb_moments_blocks(addresses, n_tensors, block_tensor, first_block, numels, grad_scale_ptr, found_inf_ptr,
                             clip_ptr, partials, beta1, beta2, eps, weight_decay,
                             P_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, BETA1_POINTER: tl.constexpr,
                             BETA2_POINTER: tl.constexpr, WD_POINTER: tl.constexpr, BIAS_CORRECTION: tl.constexpr,
                             MASTER_ROW: tl.constexpr, STEP_ROW: tl.constexpr, HAS_SCALE: tl.constexpr,
                             HAS_FOUND_INF: tl.constexpr, HAS_CLIP: tl.constexpr, MAXIMIZE: tl.constexpr,
                             ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 1: new moments; partials[2 * block] = sum(p^2), partials[2 * block + 1] = sum(u^2)."""
        t, offsets, limit, full = _block_limit(block_tensor, first_block, numels, found_inf_ptr, HAS_FOUND_INF, BLOCK)
        beta1 = runtime_scalar(beta1, BETA1_POINTER)
        beta2 = runtime_scalar(beta2, BETA2_POINTER)
        weight_decay = runtime_scalar(weight_decay, WD_POINTER)
        bc1, bc2 = _lamb_corrections(addresses, n_tensors, t, beta1, beta2, STEP_ROW, BIAS_CORRECTION)
        if full:
            _lamb_moments_block(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, partials, beta1,
                                beta2, eps, weight_decay, bc1, bc2, P_DTYPE, S_DTYPE, MASTER_ROW, HAS_SCALE, HAS_CLIP,
                                MAXIMIZE, ALIGNED, False)
        else:
            _lamb_moments_block(addresses, n_tensors, t, offsets, limit, grad_scale_ptr, clip_ptr, partials, beta1,
                                beta2, eps, weight_decay, bc1, bc2, P_DTYPE, S_DTYPE, MASTER_ROW, HAS_SCALE, HAS_CLIP,
                                MAXIMIZE, ALIGNED, True)

    @triton.jit
    def _lamb_trust_ratios(partials, first_block, numels, ratios, STEP_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                           SQUARES: tl.constexpr):
        """One program per tensor: ratio = ||p|| / ||u|| (1 if either is 0) from its blocks' partials, in order;
        with SQUARES, ratios[2 t] and ratios[2 t + 1] receive the sums of squares instead (parts of tensors)."""
        t = tl.program_id(0)
        first = tl.load(first_block + t)
        n_blocks = tl.cdiv(tl.load(numels + t), STEP_BLOCK).to(tl.int32)
        squares_p = tl.zeros([BLOCK], dtype=tl.float32)
        squares_u = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_blocks, BLOCK):
            i = start + tl.arange(0, BLOCK)
            squares_p += tl.load(partials + 2 * (first + i), mask=i < n_blocks, other=0.0)
            squares_u += tl.load(partials + 2 * (first + i) + 1, mask=i < n_blocks, other=0.0)
        if SQUARES:
            tl.store(ratios + 2 * t, tl.sum(squares_p, axis=0))
            tl.store(ratios + 2 * t + 1, tl.sum(squares_u, axis=0))
        else:
            norm_p = tl.sqrt_rn(tl.sum(squares_p, axis=0))
            norm_u = tl.sqrt_rn(tl.sum(squares_u, axis=0))
            tl.store(ratios + t, tl.where((norm_p > 0) & (norm_u > 0), norm_p / norm_u, 1.0))

    @triton.jit
    def _lamb_apply_block(addresses, n_tensors, t, offsets, limit, lr, ratio, eps, weight_decay, bc1, bc2,
                          P_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, MASTER_ROW: tl.constexpr,
                          ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        p = _load_param(addresses, n_tensors, t, offsets, limit, P_DTYPE, MASTER_ROW, ALIGNED, MASKED)
        m = load_block(column_pointer(addresses, n_tensors, 2, t, S_DTYPE, ALIGNED), offsets, limit, MASKED)
        v = load_block(column_pointer(addresses, n_tensors, 3, t, S_DTYPE, ALIGNED), offsets, limit, MASKED)
        u = _lamb_update(m.to(tl.float32), v.to(tl.float32), p, bc1, bc2, eps, weight_decay)
        _store_param(addresses, n_tensors, t, offsets, limit, p - (lr * ratio) * u, P_DTYPE, MASTER_ROW, ALIGNED,
                     MASKED)

    @triton.jit
    def _lamb_apply_blocks(addresses, n_tensors, block_tensor, first_block, numels, found_inf_ptr, ratios,
                           lr, beta1, beta2, eps, weight_decay,
                           P_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, LR_POINTER: tl.constexpr,
                           BETA1_POINTER: tl.constexpr, BETA2_POINTER: tl.constexpr, WD_POINTER: tl.constexpr,
                           BIAS_CORRECTION: tl.constexpr, MASTER_ROW: tl.constexpr, STEP_ROW: tl.constexpr,
                           HAS_FOUND_INF: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        """Pass 2: p -= lr * ratio * u, u recomputed from the stored moments."""
        t, offsets, limit, full = _block_limit(block_tensor, first_block, numels, found_inf_ptr, HAS_FOUND_INF, BLOCK)
        lr = runtime_scalar(lr, LR_POINTER)
        beta1 = runtime_scalar(beta1, BETA1_POINTER)
        beta2 = runtime_scalar(beta2, BETA2_POINTER)
        weight_decay = runtime_scalar(weight_decay, WD_POINTER)
        bc1, bc2 = _lamb_corrections(addresses, n_tensors, t, beta1, beta2, STEP_ROW, BIAS_CORRECTION)
        ratio = tl.load(ratios + t)
        if full:
            _lamb_apply_block(addresses, n_tensors, t, offsets, limit, lr, ratio, eps, weight_decay, bc1, bc2,
                              P_DTYPE, S_DTYPE, MASTER_ROW, ALIGNED, False)
        else:
            _lamb_apply_block(addresses, n_tensors, t, offsets, limit, lr, ratio, eps, weight_decay, bc1, bc2,
                              P_DTYPE, S_DTYPE, MASTER_ROW, ALIGNED, True)

    def _flags(grad_scale, found_inf, clip, columns):
        """Run-time pointers (a dummy where absent) and their HAS_* flags."""
        dummy = columns[0][0]
        return dict(grad_scale_ptr=grad_scale if grad_scale is not None else dummy,
                    found_inf_ptr=found_inf if found_inf is not None else dummy,
                    clip_ptr=clip if clip is not None else dummy), \
            dict(HAS_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None, HAS_CLIP=clip is not None)

    def _table_args(tables):
        return (tables.addresses, tables.n_tensors, tables.block_tensor, tables.first_block, tables.numels)

    def _advance(tables, step_row, found_inf):
        _advance_steps[(1,)](tables.addresses, tables.n_tensors, step_row,
                             found_inf if found_inf is not None else tables.numels, HAS_FOUND_INF=found_inf is not None,
                             BLOCK=128)

    def _kernel_choice(name, problem: MultiTensorProblem):
        return KernelChoice(name, "triton", (("BLOCK", problem.heuristics.block), ("num_warps", problem.heuristics.warps)))

    def _prepare_sgd_triton(problem: MultiTensorProblem) -> MultiTensorLaunch:
        has_momentum, master = problem.option("momentum"), problem.option("master")
        p_dtype, s_dtype = TL_DTYPES[problem.dtype], TL_DTYPES[problem.option("state_dtype")]

        def run(columns, fresh, *, tables, lr, momentum, dampening, weight_decay, grad_scale, found_inf, clip):
            lr, lr_pointer = _hyper(lr)
            weight_decay, wd_pointer = _hyper(weight_decay)
            pointers, has = _flags(grad_scale, found_inf, clip, columns)
            # Fresh momentum buffers (first step) and the others take different code: one launch each.
            groups = [(False, list(range(len(columns[0]))))] if not has_momentum else \
                [(f, idx) for f in (True, False) if (idx := [i for i in range(len(fresh)) if fresh[i] == f])]
            for is_fresh, idx in groups:
                sub = columns if len(idx) == len(columns[0]) else [[c[i] for i in idx] for c in columns]
                sub_tables = tables if len(groups) == 1 else TensorTable(tables.block).tables(sub)  # checked whole
                if not sub_tables.n_blocks:
                    continue
                _sgd_blocks[(sub_tables.n_blocks,)](
                    *_table_args(sub_tables), **pointers, lr=lr, momentum=float(momentum), dampening=float(dampening),
                    weight_decay=weight_decay, P_DTYPE=p_dtype, S_DTYPE=s_dtype, LR_POINTER=lr_pointer,
                    WD_POINTER=wd_pointer, MOMENTUM=has_momentum, FRESH=bool(is_fresh),
                    NESTEROV=problem.option("nesterov"), MASTER_ROW=len(sub) - 1 if master else -1, **has,
                    MAXIMIZE=problem.option("maximize"), ALIGNED=sub_tables.aligned, BLOCK=sub_tables.block,
                    num_warps=problem.heuristics.warps)

        return MultiTensorLaunch(run, _kernel_choice("sgd_blocks", problem), torch.float32)

    def _moment_step_launch(problem: MultiTensorProblem, kernel_name: str, launch) -> MultiTensorLaunch:
        """The launch of the Adam and LAMB steps. Its run builds what both kernels share: the tables
        (step counters advanced first), the hyper-parameter values with their *_POINTER flags, the
        optional pointers with their HAS_* flags, and the dtype and row constexprs; then
        ``launch(tables, values, flags, pointers, has, eps, rows, **extra)`` launches (``extra``: the
        run's other keywords, LAMB's ``reduce_squares``), also on tables without blocks: a collective
        in ``reduce_squares`` must run on every rank."""
        master = problem.option("master")
        dtypes = dict(P_DTYPE=TL_DTYPES[problem.dtype], S_DTYPE=TL_DTYPES[problem.option("state_dtype")])

        def run(columns, steps, *, tables, eps, grad_scale, found_inf, clip, **hyper):
            _advance(tables, len(columns), found_inf)
            values, flags = {}, {}
            for name, flag in (("lr", "LR_POINTER"), ("beta1", "BETA1_POINTER"), ("beta2", "BETA2_POINTER"),
                               ("weight_decay", "WD_POINTER")):
                values[name], flags[flag] = _hyper(hyper.pop(name))
            pointers, has = _flags(grad_scale, found_inf, clip, columns)
            rows = dict(dtypes, MASTER_ROW=len(columns) - 1 if master else -1, STEP_ROW=len(columns))
            launch(tables, values, flags, pointers, has, float(eps), rows, **hyper)

        return MultiTensorLaunch(run, _kernel_choice(kernel_name, problem), torch.float32)

    def _prepare_adam_triton(problem: MultiTensorProblem) -> MultiTensorLaunch:
        def launch(tables, values, flags, pointers, has, eps, rows):
            if not tables.n_blocks:
                return
            _adam_blocks[(tables.n_blocks,)](
                *_table_args(tables), **pointers, **values, eps=eps, **rows, **flags,
                DECOUPLED=problem.option("decoupled"), AMSGRAD=problem.option("amsgrad"), **has,
                MAXIMIZE=problem.option("maximize"), ALIGNED=tables.aligned, BLOCK=tables.block, num_warps=problem.heuristics.warps)

        return _moment_step_launch(problem, "adam_blocks", launch)

    def _prepare_lamb_triton(problem: MultiTensorProblem) -> MultiTensorLaunch:
        def launch(tables, values, flags, pointers, has, eps, rows, reduce_squares=None):
            device = tables.addresses.device
            if not tables.n_blocks:
                if reduce_squares is not None:  # this rank's parts are empty; the others' sums still need it
                    reduce_squares(torch.zeros(tables.n_tensors, 2, dtype=torch.float32, device=device))
                return
            partials = torch.empty(2 * tables.n_blocks, dtype=torch.float32, device=device)
            ratios = torch.empty(tables.n_tensors * (1 if reduce_squares is None else 2), dtype=torch.float32,
                                 device=device)
            lr, lr_pointer = values.pop("lr"), flags.pop("LR_POINTER")
            common = dict(**values, eps=eps, **rows, **flags, BIAS_CORRECTION=problem.option("bias_correction"),
                          HAS_FOUND_INF=has["HAS_FOUND_INF"], ALIGNED=tables.aligned, BLOCK=tables.block,
                          num_warps=problem.heuristics.warps)
            _lamb_moments_blocks[(tables.n_blocks,)](
                *_table_args(tables), **pointers, partials=partials, HAS_SCALE=has["HAS_SCALE"],
                HAS_CLIP=has["HAS_CLIP"], MAXIMIZE=problem.option("maximize"), **common)
            _lamb_trust_ratios[(tables.n_tensors,)](partials, tables.first_block, tables.numels, ratios,
                                                    STEP_BLOCK=tables.block, BLOCK=256,
                                                    SQUARES=reduce_squares is not None, num_warps=4)
            if reduce_squares is not None:
                squares = ratios.view(tables.n_tensors, 2)
                reduce_squares(squares)
                norms = squares.sqrt()  # correctly rounded, as the kernel's sqrt_rn and division
                ratios = torch.where((norms[:, 0] > 0) & (norms[:, 1] > 0), norms[:, 0] / norms[:, 1], 1.0)
            _lamb_apply_blocks[(tables.n_blocks,)](*_table_args(tables), pointers["found_inf_ptr"], ratios, lr=lr,
                                                   LR_POINTER=lr_pointer, **common)

        return _moment_step_launch(problem, "lamb_moments_blocks+trust_ratios+apply_blocks", launch)

    register("sgd_step", backend="triton", dtypes=TRITON_FLOATS, deterministic=True, accumulator="float32",
             name="sgd_step_triton")(_prepare_sgd_triton)
    register("adam_step", backend="triton", dtypes=TRITON_FLOATS, deterministic=True, accumulator="float32",
             name="adam_step_triton")(_prepare_adam_triton)
    register("lamb_step", backend="triton", dtypes=TRITON_FLOATS, deterministic=True, accumulator="float32",
             name="lamb_step_triton")(_prepare_lamb_triton)
