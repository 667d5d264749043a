"""Synchronised batch norm (trainops.sync_batch_norm, trainops.nn.SyncBatchNorm) over gloo on
loopback: spawned runs of 2 ranks (batches of 3 and 1 samples; a (N, C) input with one value per
channel on the second rank) and 3 ranks (2, 0 and 3 samples: an empty rank), each rank checking

- against batch norm of one process on the concatenated global batch in float64 (torch's
  batch_norm): y, dx, running statistics after two steps, and dweight / dbias as this rank's
  sums (torch's contract);
- against torch's own SyncBatchNorm autograd function (torch/nn/modules/_functions.py: its
  collectives, empty-rank masking and gradient contract) in the same dtype. Its per-rank
  kernels (batch_norm_stats, batch_norm_gather_stats_with_counts, batch_norm_elemt,
  batch_norm_backward_reduce / _elemt) exist for CUDA only, so the ranks register CPU
  transcriptions of them; the GPU test at the end compares with torch.nn.SyncBatchNorm itself;
- float64 and float32, (N, C, H, W) contiguous and channels-last, the CPU path and the Triton
  kernels (interpreter); eval mode and a group of one rank (no collective at all), exactly one
  all_gather a forward and one all_reduce a backward; errors before any collective or write;
  a converted model's gradients summed over the ranks against one process; torch.compile.
"""

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as torch_F

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError
from trainops.ops import batch_norm as bn_ops
from trainops.ops.batch_norm import BatchNormHeuristics

from numerics import TOLERANCE, assert_close, relative_error
from spawned import free_port, rank_outputs, run_cases, triton_interpreter

SIZES = {2: (3, 1), 3: (2, 0, 3)}   # samples a rank, by world size
C, H, W = 3, 4, 5
MOMENTUM, EPS = 0.3, 1e-5
SMALL = BatchNormHeuristics(tile=16, channel_block=2, spatial_block=4, programs_per_sm=16)


def poison_outputs():
    """Every output the batch-norm plans allocate starts as NaN: an element left unwritten shows."""
    original = bn_ops.BatchNormProblem.new_output

    def new_output(self):
        out = original(self)
        return out.fill_(float("nan")) if isinstance(out, torch.Tensor) else tuple(t.fill_(float("nan")) for t in out)
    bn_ops.BatchNormProblem.new_output = new_output
    return original


def global_batch(step, world, shape=(C, H, W)):
    """The step's global input of the world's ranks together (mean 3, spread 2) and upstream
    gradient, float64."""
    gen = torch.Generator().manual_seed(10 + step)
    n = sum(SIZES[world])
    return (torch.randn((n,) + shape, generator=gen, dtype=torch.float64) * 2 + 3,
            torch.randn((n,) + shape, generator=gen, dtype=torch.float64))


def rows(rank, world):
    start = sum(SIZES[world][:rank])
    return slice(start, start + SIZES[world][rank])


def parameters(dtype):
    gen = torch.Generator().manual_seed(1)
    return ((torch.rand(C, generator=gen, dtype=torch.float64) + 0.5).to(dtype),
            torch.randn(C, generator=gen, dtype=torch.float64).to(dtype))


def err(out, ref) -> float:
    """Relative error; a missing gradient (None: torch's on an empty rank) counts as zeros."""
    if out is None:
        out = torch.zeros_like(ref)
    if ref is None:
        ref = torch.zeros_like(out)
    return relative_error(out, ref) if out.numel() else 0.0


class Collectives:
    """Counts the torch.distributed collectives called inside the block (by name)."""

    NAMES = ("all_gather", "all_reduce", "all_gather_into_tensor", "all_gather_single", "broadcast")

    def __enter__(self):
        self.calls, self._saved = [], {}
        for name in self.NAMES:
            if hasattr(dist, name):
                self._saved[name] = original = getattr(dist, name)
                setattr(dist, name, self._counted(name, original))
        return self

    def _counted(self, name, original):
        def call(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


# ------------------------------------------------------------------------------------------------
# torch's SyncBatchNorm function on the CPU: its CUDA-only kernels transcribed
# ------------------------------------------------------------------------------------------------

def _acc(t):
    return t.double() if t.dtype == torch.float64 else t.float()


def _channel(v, x):
    return v.reshape((1, -1) + (1,) * (x.dim() - 2))


def _dims(x):
    return [0] + list(range(2, x.dim()))


def _stats(x, eps):
    xa = _acc(x)
    return xa.mean(_dims(x)), torch.rsqrt(xa.var(_dims(x), unbiased=False) + eps)


def _gather_stats(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    # batch_norm_reduce_statistics_kernel: Chan's update rank by rank, then the running statistics
    n, avg, var_n = 0.0, torch.zeros_like(mean_all[0]), torch.zeros_like(mean_all[0])
    for m, invstd, count in zip(mean_all, invstd_all, counts.tolist()):
        v = ((1 / invstd) ** 2 - eps) * count
        factor = 1.0 / (n + count)
        var_n = var_n + v + (avg - m) ** 2 * n * count * factor
        avg = n * factor * avg + count * factor * m
        n += count
    if running_mean is not None:
        running_mean.copy_((1 - momentum) * running_mean + momentum * avg)
        running_var.copy_((1 - momentum) * running_var + momentum * var_n / (n - 1))
    return avg, torch.rsqrt(var_n / n + eps)


def _elemt(x, weight, bias, mean, invstd, eps):
    y = (_acc(x) - _channel(mean, x)) * _channel(invstd, x)
    y = y * _channel(weight, x) if weight is not None else y
    return (y + _channel(bias, x) if bias is not None else y).to(x.dtype)


def _backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    dya, xmu = _acc(dy), _acc(x) - _channel(mean, x)
    sum_dy, sum_dy_xmu = dya.sum(_dims(x)), (dya * xmu).sum(_dims(x))
    return sum_dy, sum_dy_xmu, sum_dy_xmu * invstd, sum_dy.clone()


def _backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    norm = 1.0 / count.sum().item()
    xmu = _acc(x) - _channel(mean, x)
    w = _channel(weight, x) if weight is not None else 1.0
    dx = (_acc(dy) - _channel(sum_dy * norm, x) - xmu * _channel(invstd ** 2 * sum_dy_xmu * norm, x))
    return (dx * _channel(invstd, x) * w).to(x.dtype)


def register_torch_sync_kernels_on_cpu():
    library = torch.library.Library("aten", "IMPL")
    for name, fn in (("batch_norm_stats", _stats), ("batch_norm_gather_stats_with_counts", _gather_stats),
                     ("batch_norm_elemt", _elemt), ("batch_norm_backward_reduce", _backward_reduce),
                     ("batch_norm_backward_elemt", _backward_elemt)):
        library.impl(name, fn, "CPU")
    return library


def torch_sync_step(x, dy, weight, bias, running_mean, running_var, group, world):
    """torch's SyncBatchNorm function (as torch.nn.SyncBatchNorm calls it in training)."""
    from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNorm

    x, w, b = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    y = TorchSyncBatchNorm.apply(x, w, b, running_mean, running_var, EPS, MOMENTUM, group, world)
    y.backward(dy)
    return y, x.grad, w.grad, b.grad


# ------------------------------------------------------------------------------------------------
# cases each rank runs
# ------------------------------------------------------------------------------------------------

def reference_step(x_global, dy_global, mine, weight, bias, running_mean, running_var):
    """One process, float64, torch's batch_norm on the global batch: this rank's y and dx, and
    dweight / dbias as this rank's sums (the upstream gradient of the other rows zeroed)."""
    x = x_global.clone().requires_grad_()
    w, b = (t.detach().double().requires_grad_() for t in (weight, bias))
    y = torch_F.batch_norm(x, running_mean, running_var, w, b, True, MOMENTUM, EPS)
    dx, = torch.autograd.grad(y, x, dy_global, retain_graph=True)
    mask = torch.zeros_like(dy_global)
    mask[mine] = 1
    dw, db = torch.autograd.grad(y, (w, b), dy_global * mask)
    return y[mine], dx[mine], dw, db


def compare_steps(rank, world, out, label, dtype, layout="contiguous", shape=(C, H, W), steps=2):
    """``steps`` training steps of trainops.nn.SyncBatchNorm on this rank's rows, against the
    global float64 reference and torch's function in ``dtype``; out[label quantity ref] = error."""
    weight, bias = parameters(dtype)
    ours = trainops.nn.SyncBatchNorm(C, eps=EPS, momentum=MOMENTUM).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ours.bias.copy_(bias)
    ref_mean, ref_var = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    torch_mean, torch_var = torch.zeros(C, dtype=dtype), torch.ones(C, dtype=dtype)
    mine = rows(rank, world)
    found = {}
    for step in range(steps):
        x_global, dy_global = global_batch(step, world, shape)
        x, dy = x_global[mine].to(dtype), dy_global[mine].to(dtype)
        if layout == "channels_last":
            x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
        x.requires_grad_()
        ours.zero_grad()
        with Collectives() as collectives:
            y = ours(x)
            y.backward(dy)
        found[f"{label} collectives"] = collectives.calls
        found[f"{label} strides kept"] = y.stride() == x.stride() and x.grad.stride() == x.stride()
        got = (y, x.grad, ours.weight.grad, ours.bias.grad)
        refs = {"global": reference_step(x_global, dy_global, mine, weight, bias, ref_mean, ref_var),
                "torch": torch_sync_step(x, dy, weight, bias, torch_mean, torch_var, dist.group.WORLD, world)}
        for ref_name, ref in refs.items():
            for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, ref):
                key = f"{label} {name} {ref_name}"
                found[key] = max(found.get(key, 0.0), err(a, b))
    for ref_name, (m, v) in (("global", (ref_mean, ref_var)), ("torch", (torch_mean, torch_var))):
        found[f"{label} running_mean {ref_name}"] = err(ours.running_mean, m)
        found[f"{label} running_var {ref_name}"] = err(ours.running_var, v)
    found[f"{label} num_batches_tracked"] = int(ours.num_batches_tracked)
    out.update(found)


def cpu_cases(rank, world, out):
    for dtype in (torch.float64, torch.float32):
        for layout in ("contiguous", "channels_last"):
            compare_steps(rank, world, out, f"cpu {layout} {dtype}", dtype, layout)
    # (N, C): one value per channel on the 2-rank run's second rank, allowed in a group
    compare_steps(rank, world, out, f"cpu (N, C) {torch.float64}", torch.float64, shape=(C,))


def triton_cases(rank, world, out):
    with trainops.backend("triton"):
        compare_steps(rank, world, out, f"triton channels_last {torch.float32}", torch.float32, "channels_last",
                      steps=1)


def eval_and_solo_cases(rank, world, out):
    """Eval (running statistics, and batch statistics without them) and a group of one rank: no
    collective; the same bits as the unsynchronised module on this rank's rows."""
    x = global_batch(0, world)[0][rows(rank, world)].float()
    weight, bias = parameters(torch.float32)
    solo = [dist.new_group([r]) for r in range(world)][rank]   # every rank creates every group
    ours = trainops.nn.SyncBatchNorm(C, momentum=MOMENTUM, process_group=solo)
    plain = trainops.nn.BatchNorm2d(C, momentum=MOMENTUM)
    untracked = trainops.nn.SyncBatchNorm(C, track_running_stats=False)
    for m in (ours, plain):
        with torch.no_grad():
            m.weight.copy_(weight)
            m.bias.copy_(bias)
            m.running_mean.normal_(generator=torch.Generator().manual_seed(3))
    with Collectives() as collectives:
        same = [torch.equal(ours(x), plain(x)), torch.equal(ours.running_mean, plain.running_mean),
                torch.equal(ours.running_var, plain.running_var)]
        ours.eval(), plain.eval(), untracked.eval()
        same += [torch.equal(ours(x), plain(x))]
        y = untracked(x)   # eval without running statistics: this rank's batch statistics, as torch's
        if x.shape[0]:
            same += [err(y, torch_F.batch_norm(x.double(), None, None, training=True)) < 1e-5]
    out["solo and eval same as unsynchronised"] = same
    out["solo and eval collectives"] = collectives.calls


def error_cases(rank, world, out):
    """Errors name the argument and come before any collective or write; the ranks stay in step."""
    x = global_batch(0, world)[0][rows(rank, world)]
    mean, var = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    raised = []
    with Collectives() as collectives:
        for kwargs, name in (({"weight": torch.ones(C + 1, dtype=torch.float64)}, "weight"),
                             ({"momentum": 1.5}, "momentum"), ({"eps": -1.0}, "eps"),
                             ({"process_group": "world"}, "process_group"),
                             ({"running_var": None}, "running_var"),
                             ({"running_var": torch.ones(C, dtype=torch.float32)}, "running_var"),
                             ({"running_mean": torch.zeros(2 * C, dtype=torch.float64)[::2]}, "running_mean")):
            arguments = {"running_mean": mean, "running_var": var, **kwargs}
            try:
                trainops.sync_batch_norm(x, training=True, **arguments)
            except InvalidProblemError as e:
                raised.append(f"'{name}'" in str(e))
            else:
                raised.append(False)
    out["errors name the argument"] = raised
    out["errors collectives"] = collectives.calls
    out["errors left the running statistics"] = torch.equal(mean, torch.zeros(C, dtype=torch.float64)) and \
        torch.equal(var, torch.ones(C, dtype=torch.float64))
    # the ranks are still in step: a good call synchronises
    y = trainops.sync_batch_norm(x, mean, var, training=True)
    out["after errors"] = err(y, torch_F.batch_norm(global_batch(0, world)[0], None, None,
                                                    training=True)[rows(rank, world)])


def summed_gradient_cases(rank, world, out):
    """convert_sync_batchnorm's model (conv + BatchNorm2d), its gradients summed over the ranks (what
    DistributedDataParallel does, averaging; it refuses SyncBatchNorm modules on the CPU): one
    process's gradients on the global batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(C, C, 1, bias=False), torch.nn.BatchNorm2d(C)).double()
    whole = copy.deepcopy(model)
    synced = trainops.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    out["converted"] = isinstance(synced[1], trainops.nn.SyncBatchNorm) and synced[1].weight is model[1].weight
    x_global, dy_global = global_batch(0, world)
    mine = rows(rank, world)
    (synced(x_global[mine]) * dy_global[mine]).sum().backward()
    (whole(x_global) * dy_global).sum().backward()
    for p in synced.parameters():
        dist.all_reduce(p.grad)
    out["summed grads"] = max(err(p.grad, q.grad) for p, q in zip(synced.parameters(), whole.parameters()))
    out["summed running stats"] = max(err(synced[1].running_mean, whole[1].running_mean),
                                      err(synced[1].running_var, whole[1].running_var))


def compile_cases(rank, world, out):
    """torch.compile (Dynamo, eager backend) around conv + SyncBatchNorm: the synchronised batch
    norm runs eagerly between two graphs, with the eager module's results (2 ranks only: time)."""
    if world != 2:
        return
    torch.manual_seed(0)
    compiled = torch.nn.Sequential(torch.nn.Conv2d(C, C, 1), trainops.nn.SyncBatchNorm(C), torch.nn.ReLU()).double()
    eager = copy.deepcopy(compiled)
    x_global, dy_global = global_batch(0, world)
    mine = rows(rank, world)
    (torch.compile(compiled, backend="eager")(x_global[mine]) * dy_global[mine]).sum().backward()
    (eager(x_global[mine]) * dy_global[mine]).sum().backward()
    out["compiled"] = max([err(p.grad, q.grad) for p, q in zip(compiled.parameters(), eager.parameters())] +
                          [err(compiled[1].running_var, eager[1].running_var)])


def offset_cases(rank, world, out):
    """Means far from zero (1e4 in float32, 1e8 in float64, spread 1): the group's unbiased variance
    (momentum 1: the running variance is it) keeps the precision of one process's statistics."""
    for dtype, offset in ((torch.float32, 1e4), (torch.float64, 1e8)):
        x_global = global_batch(0, world)[0] / 2 + offset    # spread 1 around the offset (+1.5)
        x = x_global[rows(rank, world)].to(dtype)
        running_mean, running_var = torch.zeros(C, dtype=dtype), torch.ones(C, dtype=dtype)
        trainops.sync_batch_norm(x, running_mean, running_var, training=True, momentum=1.0)
        # the deviations from the offset are exact in float64 (torch's var of the raw values at 1e8
        # is off by about 1e-8 itself)
        reference = (x_global.to(dtype).double() - offset).transpose(0, 1).reshape(C, -1).var(1)
        out[f"offset {dtype} running_var"] = err(running_var, reference)
        out[f"offset {dtype} running_mean"] = err(running_mean, x_global.to(dtype).double().mean((0, 2, 3)))


def subgroup_cases(rank, world, out):
    """A group of ranks 0 and 2 of 3: its members synchronise over their rows; rank 1, outside it
    (new_group gives it GroupMember.NON_GROUP_MEMBER), normalizes its own batch alone, as torch's."""
    if world != 3:
        return
    group = dist.new_group([0, 2])   # every rank calls new_group
    module = trainops.nn.SyncBatchNorm(C, momentum=MOMENTUM, process_group=group).double()
    if rank == 1:
        x = torch.randn(4, C, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        reference = torch_F.batch_norm(x, None, None, module.weight.detach(), module.bias.detach(), training=True)
        out["outside the group"] = err(module(x), reference)
    else:
        x_global = global_batch(0, world)[0]
        members = torch.cat([x_global[rows(0, world)], x_global[rows(2, world)]])
        mine = x_global[rows(rank, world)]
        reference = torch_F.batch_norm(members, None, None, module.weight.detach(), module.bias.detach(),
                                       training=True)
        offset = 0 if rank == 0 else SIZES[3][0]
        out["inside the group"] = err(module(mine), reference[offset:offset + mine.shape[0]])


CASES = (cpu_cases, triton_cases, eval_and_solo_cases, error_cases, summed_gradient_cases, compile_cases,
         offset_cases, subgroup_cases)


def worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a collective a rank never joins fails within a minute instead of hanging the suite
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    library = register_torch_sync_kernels_on_cpu()
    poison_outputs()
    out = {}
    try:
        run_cases(CASES, out, rank, world, out)
    finally:
        results[rank] = out
        del library
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    """{world: {rank: results}} of the 2-rank and the 3-rank runs."""
    found = {}
    with triton_interpreter():   # the ranks run on the CPU, Triton under the interpreter
        with mp.Manager() as manager:
            for world in SIZES:
                results = manager.dict()
                mp.spawn(worker, args=(world, free_port(), results), nprocs=world, join=True)
                found[world] = dict(results)
    return found




def _check_steps(results, prefix):
    labels = {key.rsplit(" ", 2)[0] for key in results if key.startswith(prefix) and key.endswith(" global")}
    assert labels
    for label in labels:
        dtype = torch.float64 if "float64" in label else torch.float32
        for quantity in ("y", "dx", "dweight", "dbias", "running_mean", "running_var"):
            for ref in ("global", "torch"):
                value = results[f"{label} {quantity} {ref}"]
                assert value <= TOLERANCE[dtype], (label, quantity, ref, value)   # NaN fails too
        assert results[f"{label} collectives"] == ["all_gather", "all_reduce"], label
        assert results[f"{label} strides kept"], label


@pytest.mark.parametrize("world", SIZES)
def test_matches_one_process_and_torchs_sync_batch_norm(runs, world):
    for results in rank_outputs(runs, world, cpu_cases):
        _check_steps(results, "cpu ")
        assert results[f"cpu contiguous {torch.float64} num_batches_tracked"] == 2


@pytest.mark.parametrize("world", SIZES)
def test_triton_kernels_under_the_interpreter(runs, world):
    for results in rank_outputs(runs, world, triton_cases):
        _check_steps(results, "triton ")


@pytest.mark.parametrize("world", SIZES)
def test_eval_and_a_group_of_one_do_not_synchronise(runs, world):
    for results in rank_outputs(runs, world, eval_and_solo_cases):
        assert all(results["solo and eval same as unsynchronised"]), results["solo and eval same as unsynchronised"]
        assert results["solo and eval collectives"] == []


@pytest.mark.parametrize("world", SIZES)
def test_errors_before_any_collective_or_write(runs, world):
    for results in rank_outputs(runs, world, error_cases):
        assert results["errors name the argument"] == [True] * 7
        assert results["errors collectives"] == []
        assert results["errors left the running statistics"]
        assert results["after errors"] <= TOLERANCE[torch.float64]


@pytest.mark.parametrize("world", SIZES)
def test_means_far_from_zero_keep_their_precision(runs, world):
    for results in rank_outputs(runs, world, offset_cases):
        assert results[f"offset {torch.float32} running_var"] <= 1e-5, results
        assert results[f"offset {torch.float64} running_var"] <= 1e-12, results
        assert results[f"offset {torch.float32} running_mean"] <= 1e-7, results   # float32's rounding of 1e4
        assert results[f"offset {torch.float64} running_mean"] <= 1e-15, results


def test_a_rank_outside_the_group_normalizes_alone(runs):
    outs = rank_outputs(runs, 3, subgroup_cases)
    assert outs[1]["outside the group"] <= TOLERANCE[torch.float64], outs[1]
    for rank in (0, 2):
        assert outs[rank]["inside the group"] <= TOLERANCE[torch.float64], outs[rank]


@pytest.mark.parametrize("world", SIZES)
def test_summed_gradients_of_a_converted_model_match_one_process(runs, world):
    for results in rank_outputs(runs, world, summed_gradient_cases):
        assert results["converted"]
        assert results["summed grads"] <= TOLERANCE[torch.float64]
        assert results["summed running stats"] <= TOLERANCE[torch.float64]


def test_torch_compile_runs_it_between_graphs(runs):
    for results in rank_outputs(runs, 2, compile_cases):
        assert results["compiled"] <= TOLERANCE[torch.float64]


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def poisoned():
    original = poison_outputs()
    yield
    bn_ops.BatchNormProblem.new_output = original


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_rank_pieces_give_the_single_process_gradient(backend, device, poisoned, layout):
    """The rank's ops on forced small plans: local statistics against torch's mean and variance;
    reduce's sums divided by R, then elemt, against batch_norm's backward."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 5, 6, 7, generator=gen, dtype=torch.float64) * 2 + 3).float().to(device)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64).float().to(device)
    if layout == "channels_last":
        x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
    w = (torch.rand(5, generator=gen) + 0.5).to(device)
    r = x.numel() // x.shape[1]
    with trainops.heuristics(SMALL):
        relative_and_shift, var = trainops.plan("batch_norm_local_stats", shape=x.shape, dtype=x.dtype,
                                                device=x.device, strides=(x.stride(),)).run(x)
        # rows: the mean relative to a shift near it, and the shift
        assert (relative_and_shift[0].abs() < relative_and_shift[1].abs() + 5).all()
        mean = relative_and_shift[0] + relative_and_shift[1]
        assert_close(mean, x.double().mean((0, 2, 3)), torch.float32, "mean")
        assert_close(var, x.double().var((0, 2, 3), unbiased=False), torch.float32, "var")
        rstd = torch.rsqrt(var + EPS)
        sums, dw, db = bn_ops._run_backward(bn_ops.REDUCE_OP, dy, x, w, mean, rstd, weight_grad=True,
                                            bias_dtype=torch.float32)
        dx = bn_ops._run_backward(bn_ops.ELEMT_OP, dy, x, w, mean, rstd, sums / r)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = torch.autograd.grad(torch_F.batch_norm(xr, None, None, wr, None, True, 0.1, EPS), (xr, wr), dy.double())
    assert_close(dx, ref[0], torch.float32, "dx")
    assert dx.stride() == x.stride()
    assert_close(dw, ref[1], torch.float32, "dweight")
    assert_close(sums[1], ref[1], torch.float32, "sum(dy * xh)")
    assert_close(db, dy.double().sum((0, 2, 3)), torch.float32, "dbias")


def test_without_torch_distributed_it_is_batch_norm():
    """No process group (torch.distributed not initialized): the plain module's bits."""
    x = torch.randn(4, C, 5, 6)
    ours, plain = trainops.nn.SyncBatchNorm(C), trainops.nn.BatchNorm2d(C)
    assert torch.equal(ours(x), plain(x))
    assert torch.equal(ours.running_var, plain.running_var)
    assert torch.equal(trainops.sync_batch_norm(x, None, None, training=True), trainops.batch_norm(x, None, None,
                                                                                                     training=True))


def test_module_and_function_errors_name_the_argument():
    with pytest.raises(InvalidProblemError, match="'process_group'"):
        trainops.sync_batch_norm(torch.randn(4, C), None, None, training=True, process_group=object())
    with pytest.raises(InvalidProblemError, match="'input'"):
        trainops.nn.SyncBatchNorm(C)(torch.randn(C))
    with pytest.raises(InvalidProblemError, match="'input'"):
        trainops.nn.SyncBatchNorm(0)(torch.randn(4, 0))
    m = trainops.nn.SyncBatchNorm(C)
    with pytest.raises(InvalidProblemError, match="'input'"):   # one value per channel on a single process
        m(torch.randn(1, C))
    assert torch.equal(m.running_mean, torch.zeros(C)) and torch.equal(m.running_var, torch.ones(C))
    with pytest.raises(UnsupportedError, match="'input'"):
        trainops.sync_batch_norm(torch.randint(0, 3, (4, C)), None, None, training=True)


def test_convert_sync_batchnorm_keeps_torchs_state_dict():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, C, 1), torch.nn.BatchNorm2d(C, momentum=None),
                                torch.nn.Sequential(trainops.nn.BatchNorm1d(C, affine=False)))
    model.eval()
    ours = trainops.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    theirs = torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))
    assert [type(m).__module__ for m in (ours[1], ours[2][0])] == ["trainops.nn"] * 2
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    assert ours[1].momentum is None and not ours[1].training and ours[2][0].weight is None
    direct = trainops.nn.SyncBatchNorm.convert_sync_batchnorm(model[1])
    assert isinstance(direct, trainops.nn.SyncBatchNorm) and direct.weight is model[1].weight
    assert trainops.nn.SyncBatchNorm(C).state_dict().keys() == torch.nn.SyncBatchNorm(C).state_dict().keys()


def test_patch_swaps_sync_batch_norm_only_when_asked():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, C, 1), torch.nn.SyncBatchNorm(C), torch.nn.BatchNorm2d(C))
    bn = model[1]
    report = trainops.patch(model)
    assert type(model[1]) is torch.nn.SyncBatchNorm and not report.swapped and not report.skipped
    report = trainops.patch(model, batch_norm=True)
    assert type(model[1]) is trainops.nn.SyncBatchNorm and model[1] is bn
    assert type(model[2]) is trainops.nn.BatchNorm2d
    assert ("1", "torch.nn.SyncBatchNorm", "trainops.nn.SyncBatchNorm") in report.swapped
    x = torch.randn(4, 3, 5, 5)
    assert torch.equal(model[1](model[0](x)), trainops.nn.BatchNorm2d(C)(model[0](x)))
    with pytest.raises(InvalidProblemError, match="'batch_norm'"):
        trainops.patch(model, batch_norm=1)


# ------------------------------------------------------------------------------------------------
# GPU: against torch.nn.SyncBatchNorm itself over NCCL
# ------------------------------------------------------------------------------------------------

GPU_WORLD = min(torch.cuda.device_count(), 4) if torch.cuda.is_available() else 0


def gpu_worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", rank))
    out = {}
    try:
        gen = torch.Generator().manual_seed(0)
        unequal, empty = (40,) + (8,) * (world - 1), (24,) + (8,) * (world - 2) + (0,)
        # no bf16 with an empty rank: torch's own then gathers and reduces bf16 there, float32 elsewhere
        for sizes, dtype in ((unequal, torch.float32), (unequal, torch.bfloat16), (empty, torch.float32)):
            n = sum(sizes)
            x_global = torch.randn(n, 64, 28, 28, generator=gen) * 2 + 3
            dy_global = torch.randn(x_global.shape, generator=gen)
            mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
            x = x_global[mine].to("cuda", dtype).to(memory_format=torch.channels_last)
            dy = dy_global[mine].to("cuda", dtype).to(memory_format=torch.channels_last)
            found = []
            for cls in (trainops.nn.SyncBatchNorm, torch.nn.SyncBatchNorm):
                torch.manual_seed(1)
                m = cls(64, momentum=MOMENTUM).cuda()
                with torch.no_grad():
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.normal_()
                xs = x.clone().requires_grad_()
                for _ in range(2):
                    m.zero_grad()
                    xs.grad = None
                    y = m(xs)
                    y.backward(dy)
                found.append((y.float(), xs.grad, m.weight.grad, m.bias.grad, m.running_mean, m.running_var))
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            names = ("y", "dx", "dweight", "dbias", "running_mean", "running_var")
            for name, a, b in zip(names, *found):
                out[f"{sizes} {dtype} {name}"] = (err(a, b), tol)   # checked after every rank is done
    except Exception:
        import traceback
        out["error"] = traceback.format_exc()
    finally:
        results[rank] = out
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(GPU_WORLD < 2, reason="needs 2 GPUs")
def test_matches_torch_sync_batch_norm_on_gpus():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(gpu_worker, args=(GPU_WORLD, free_port(), results), nprocs=GPU_WORLD, join=True)
        results = dict(results)
    for rank, out in results.items():
        print(rank, out)
        assert "error" not in out, out["error"]
        assert len(out) == 18
        for key, (value, tol) in out.items():
            assert value <= tol, (rank, key, value)
