"""Data-parallel training over gloo on loopback: N ranks must train as one process on the global batch."""

import gc
import os
import socket
import traceback
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError

GLOBAL_BATCH = 12
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(seed=0, width=9):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Tanh(), torch.nn.Linear(width, 3),
                               torch.nn.Tanh(), torch.nn.Linear(3, 2, bias=False))


def batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 5, generator=gen), torch.randn(GLOBAL_BATCH, 2, generator=gen)


def local(rows, rank, world):
    per = GLOBAL_BATCH // world
    return rows[rank * per:(rank + 1) * per]


def loss_of(model, x, y):
    return (model(x) - y).square().mean()


def reference(steps=STEPS, max_grad_norm=None, start=None):
    """Single process on the global batch, trainops AdamW on the CPU path."""
    model = make_model()
    opt = trainops.optim.AdamW(model.parameters(), lr=0.05, max_grad_norm=max_grad_norm)
    if start is not None:
        model.load_state_dict(start[0])
        opt.load_state_dict(start[1])
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    return model, opt


def _close(a, b, tol):
    return all((p - q).norm() <= tol * max(q.norm(), 1e-12) for p, q in zip(a, b))


def worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    try:
        ref_model, ref_opt = reference()
        ref_params = [p.detach() for p in ref_model.parameters()]

        # GradientSync + any optimizer (float32 and bfloat16 communication)
        for comm, tol in ((None, 1e-5), (torch.bfloat16, 2e-2)):
            model = make_model()
            opt = trainops.optim.AdamW(model.parameters(), lr=0.05)
            sync = trainops.distributed.GradientSync(model.parameters(), bucket_mb=0.0001, comm_dtype=comm)
            for step in range(STEPS):
                x, y = batch(step)
                opt.zero_grad()
                loss_of(model, local(x, rank, world), local(y, rank, world)).backward()
                sync.wait()
                opt.step()
            out[f"sync {comm}"] = _close(list(model.parameters()), ref_params, tol)

        # a parameter used only in the first step gets zeros after that (not its stale gradient);
        # gradients zeroed in place stay bucket views (autograd accumulates into the bucket)
        model = make_model()
        spare = torch.nn.Parameter(torch.ones(4))
        opt = trainops.optim.AdamW(model.parameters(), lr=0.05)
        sync = trainops.distributed.GradientSync([*model.parameters(), spare], bucket_mb=0.0001)
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad(set_to_none=False)
            loss = loss_of(model, local(x, rank, world), local(y, rank, world))
            (loss + spare.square().sum() if step == 0 else loss).backward()
            sync.wait()
            opt.step()
        in_buckets = [any(0 <= p.grad.data_ptr() - b.grad.data_ptr() < b.grad.numel() * b.grad.element_size()
                          for b in sync.buckets) for p in [*model.parameters(), spare]]
        out["unused"] = (spare.grad is not None and not spare.grad.any() and all(in_buckets)
                         and _close(list(model.parameters()), ref_params, 1e-5))
        sync.remove()

        # a dropped GradientSync or ShardedOptimizer is freed with its buffers (the hooks on the
        # parameters hold it weakly, and go with it); the model trains on without them
        model, other = make_model(), make_model()
        dropped = [weakref.ref(trainops.distributed.GradientSync(model.parameters())),
                   weakref.ref(trainops.distributed.ShardedOptimizer(other.parameters(), trainops.optim.AdamW))]
        gc.collect()
        loss_of(model, *batch(0)).backward()
        loss_of(other, *batch(0)).backward()
        out["freed"] = all(ref() is None for ref in dropped) and model[0].weight.grad is not None

        # torch's DistributedDataParallel with a trainops optimizer
        model = make_model()
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        opt = trainops.optim.AdamW(model.parameters(), lr=0.05)
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            loss_of(wrapped, local(x, rank, world), local(y, rank, world)).backward()
            opt.step()
        out["ddp"] = _close(list(model.parameters()), ref_params, 1e-5)

        # ShardedOptimizer (ZeRO-1) with a global-norm clip, several padded buckets
        ref_clip, ref_clip_opt = reference(max_grad_norm=0.05)
        model = make_model()
        opt = trainops.distributed.ShardedOptimizer(model.parameters(), trainops.optim.AdamW, bucket_mb=0.0001,
                                                    max_grad_norm=0.05, lr=0.05)
        out["buckets"] = len(opt.buckets)
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            loss_of(model, local(x, rank, world), local(y, rank, world)).backward()
            opt.step()
        out["sharded"] = _close(list(model.parameters()), [p.detach() for p in ref_clip.parameters()], 1e-5)
        full = opt.state_dict()
        ref_full = ref_clip_opt.state_dict()
        out["full state"] = all(
            torch.allclose(full["state"][i][k], ref_full["state"][i][k], rtol=1e-4, atol=1e-9)
            for i in ref_full["state"] for k in ("exp_avg", "exp_avg_sq", "step"))

        # the full state loads into a fresh ShardedOptimizer, and both continue as the reference does
        model2 = make_model()
        model2.load_state_dict(model.state_dict())
        opt2 = trainops.distributed.ShardedOptimizer(model2.parameters(), trainops.optim.AdamW, bucket_mb=0.0001,
                                                     max_grad_norm=0.05, lr=0.05)
        opt2.load_state_dict(full)
        sharded = opt.sharded_state_dict()
        opt3 = trainops.distributed.ShardedOptimizer(make_model().parameters(), trainops.optim.AdamW,
                                                     bucket_mb=0.0001, max_grad_norm=0.05, lr=0.05)
        opt3.load_sharded_state_dict(sharded)
        out["sharded state"] = all(torch.equal(a, b) for a, b in zip(
            [t for s in opt3.inner.state.values() for t in s.values()],
            [t for s in opt.inner.state.values() for t in s.values()]))
        for step in range(STEPS, STEPS + 2):
            x, y = batch(step)
            opt2.zero_grad()
            loss_of(model2, local(x, rank, world), local(y, rank, world)).backward()
            opt2.step()
        cont, _ = reference(steps=2 + STEPS, max_grad_norm=0.05)
        out["resumed"] = _close(list(model2.parameters()), [p.detach() for p in cont.parameters()], 1e-5)

        # GradScaler: an inf on one rank makes every rank skip the step and back off the same way
        model = make_model()
        opt = trainops.distributed.ShardedOptimizer(model.parameters(), trainops.optim.AdamW, lr=0.05)
        scaler = trainops.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        scales, changed = [], []
        for step in range(3):
            x, y = batch(step)
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            loss = scaler.scale(loss_of(model, local(x, rank, world), local(y, rank, world)))
            handle = None
            if step == 1 and rank == world - 1:
                # one inf, in the first element of the first bucket: a slice that rank 0 owns, so
                # the other ranks see finite slices and skip only because the flag is agreed
                handle = model[4].weight.register_hook(lambda g: g.clone().index_fill_(1, torch.tensor([0]),
                                                                                       float("inf")))
            loss.backward()
            if handle is not None:
                handle.remove()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            changed.append(any(not torch.equal(p, b) for p, b in zip(model.parameters(), before)))
        out["scaler"] = (scales, changed)

        # a rank with a different model: a clear error on every rank, no hang
        try:
            trainops.distributed.GradientSync(make_model(width=9 + rank).parameters())
            out["mismatch"] = "no error"
        except InvalidProblemError as e:
            out["mismatch"] = str(e)
        try:
            trainops.distributed.ShardedOptimizer(make_model().parameters(), trainops.optim.LAMB)
            out["lamb"] = "no error"
        except UnsupportedError as e:
            out["lamb"] = str(e)
    except Exception:
        out["error"] = traceback.format_exc()
    finally:
        results[rank] = out
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_data_parallel_training_matches_one_process(world):
    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(world, port, results), nprocs=world, join=True)
        results = dict(results)
    for rank in range(world):
        out = results[rank]
        assert "error" not in out, out.get("error")
        assert out["sync None"] and out["sync torch.bfloat16"] and out["ddp"] and out["unused"] and out["freed"], out
        assert out["buckets"] > 2
        assert out["sharded"] and out["full state"] and out["sharded state"] and out["resumed"], out
        scales, changed = out["scaler"]
        assert scales == [256.0, 128.0, 128.0] and changed == [True, False, True], out["scaler"]
        if world > 1:
            assert "rank 1 has parameters" in out["mismatch"], out["mismatch"]
        assert "LAMB" in out["lamb"]
    assert len({str(results[r]["scaler"]) for r in range(world)}) == 1
