"""trainops inside FSDP2 (``fully_shard``, DTensor parameters) over gloo on loopback (issue 21).

Spawned runs of 2 and 3 ranks (3 leaves some ranks empty shards of small parameters), each
running every case of its world (``SAVE_CASES`` for 2 ranks, ``LOAD_CASES`` for 3); the tests below
check what each rank reported. float64 on the CPU path, float32 where the Triton kernels run
(under the interpreter here).
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import trainops
from trainops.errors import InvalidProblemError, UnsupportedError

from spawned import free_port, rank_outputs, run_cases, triton_interpreter

GLOBAL_BATCH = 12   # divisible by 2 and 3 ranks
STEPS = 4


def make_model(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    # the last layer has 2 rows: over 3 ranks its weight and bias shards are 1, 1 and 0 rows
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 2)).to(dtype)


def shard(model, mesh):
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def batch(step, dtype=torch.float64):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=gen).to(dtype), torch.randn(GLOBAL_BATCH, 2, generator=gen).to(dtype)


def rows(t, rank, world):
    per = GLOBAL_BATCH // world
    return t[rank * per:(rank + 1) * per]


def backward(model, step, rank, world, dtype=torch.float64, whole=False):
    """The mean-squared loss of ``step``'s global batch: this rank's rows on a sharded model (FSDP2
    averages the gradients over ranks), all rows on a whole one."""
    x, y = batch(step, dtype)
    if not whole:
        x, y = rows(x, rank, world), rows(y, rank, world)
    (model(x) - y).square().mean().backward()


def full(tensors):
    return [t.full_tensor().detach().clone() if isinstance(t, DTensor) else t.detach().clone() for t in tensors]


def rel(a, b) -> float:
    """The largest relative difference (Frobenius norms) over pairs of tensors."""
    return max(((p - q).norm() / max(q.norm(), 1e-300)).item() for p, q in zip(a, b))


def train(model, opt, steps, rank, world, *, first=0, dtype=torch.float64, whole=False, clip=None, schedule=None):
    norms = []
    for step in range(first, first + steps):
        opt.zero_grad()
        backward(model, step, rank, world, dtype, whole)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).full_tensor()
                               if not whole else torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if getattr(opt, "grad_norm", None) is not None:
            norms.append(float(opt.grad_norm))
        if schedule is not None:
            schedule.step()
    return norms


def decay(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.7 ** step)


# ------------------------------------------------------------------------------------------------
# cases of the 2-rank run
# ------------------------------------------------------------------------------------------------

def torch_cases(rank, world, mesh, out, tmp):
    """trainops.optim against torch.optim (single-tensor path) on the same FSDP2 model, an LR
    scheduler stepping both; AdamW with the global-norm clip against torch's clip_grad_norm_."""
    configs = {
        "sgd": (lambda ps: trainops.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False),
                None),
        "adam": (lambda ps: trainops.optim.Adam(ps, lr=0.02, amsgrad=True, weight_decay=0.01),
                 lambda ps: torch.optim.Adam(ps, lr=0.02, amsgrad=True, weight_decay=0.01, foreach=False), None),
        "adamw clip": (lambda ps: trainops.optim.AdamW(ps, lr=0.02, max_grad_norm=0.05),
                       lambda ps: torch.optim.AdamW(ps, lr=0.02, foreach=False), 0.05),
    }
    for name, (ours, theirs, clip) in configs.items():
        results = []
        for make, torch_clip in ((ours, None), (theirs, clip)):
            model = shard(make_model(), mesh)
            opt = make(model.parameters())
            norms = train(model, opt, STEPS, rank, world, clip=torch_clip, schedule=decay(opt))
            results.append((full(model.parameters()), norms, opt))
        (got, got_norms, opt), (want, want_norms, torch_opt) = results
        out[f"{name} params"] = rel(got, want)
        out[f"{name} moved"] = rel(full(make_model().parameters()), want)
        out[f"{name} state is DTensor"] = all(isinstance(v, DTensor) for s in opt.state.values()
                                              for k, v in s.items() if k != "step")
        if clip is not None:
            out[f"{name} norms"] = (got_norms, want_norms)


def lamb_cases(rank, world, mesh, out, tmp):
    """LAMB's trust ratios from whole-parameter norms: FSDP2 LAMB (clip too) equals one process's
    LAMB on the unsharded model and the global batch, on the CPU path (float64) and the Triton
    kernels (float32); AdamW with the clip on the Triton kernels too. (Without the sums over the
    mesh, LAMB's parameters differ from one process's by about 1e-2 here: checked by hand.)"""
    runs = [("cpu", torch.float64, "lamb", lambda ps: trainops.optim.LAMB(ps, lr=0.05, weight_decay=0.01,
                                                                         max_grad_norm=0.05)),
            ("triton", torch.float32, "lamb", lambda ps: trainops.optim.LAMB(ps, lr=0.05, weight_decay=0.01,
                                                                            max_grad_norm=0.05)),
            ("triton", torch.float32, "adamw", lambda ps: trainops.optim.AdamW(ps, lr=0.02, max_grad_norm=0.05))]
    for backend, dtype, name, make in runs:
        with trainops.backend(backend):
            sharded = shard(make_model(dtype), mesh)
            whole = make_model(dtype)
            opt, ref = make(sharded.parameters()), make(whole.parameters())
            train(sharded, opt, 3, rank, world, dtype=dtype)
            train(whole, ref, 3, rank, world, dtype=dtype, whole=True)
            out[f"{name} {backend} params"] = rel(full(sharded.parameters()), full(whole.parameters()))
            out[f"{name} {backend} norm"] = rel([opt.grad_norm], [ref.grad_norm])
            out[f"{name} {backend} moved"] = rel(full(make_model(dtype).parameters()), full(whole.parameters()))
    # HSDP: a 2-D mesh replicating over the ranks and sharding over one: placements (Replicate(), Shard(0));
    # the squares must be summed over the shard dimension only (over both, the norms would double)
    hybrid = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    sharded, whole = shard(make_model(), hybrid), make_model()
    opt = trainops.optim.LAMB(sharded.parameters(), lr=0.05, weight_decay=0.01, max_grad_norm=0.05)
    ref = trainops.optim.LAMB(whole.parameters(), lr=0.05, weight_decay=0.01, max_grad_norm=0.05)
    train(sharded, opt, 3, rank, world)
    train(whole, ref, 3, rank, world, whole=True)
    out["hsdp placements"] = str(next(sharded.parameters()).placements)
    out["hsdp lamb params"] = rel(full(sharded.parameters()), full(whole.parameters()))


def skip_cases(rank, world, mesh, out, tmp):
    """An inf in one rank's shard skips the step on every rank (skip_nonfinite, and both GradScaler
    paths), so the ranks never diverge."""
    last = world - 1
    model = shard(make_model(), mesh)
    opt = trainops.optim.AdamW(model.parameters(), lr=0.02, skip_nonfinite=True)
    train(model, opt, 1, rank, world)
    before = full(model.parameters())
    opt.zero_grad()
    backward(model, 1, rank, world)
    if rank == last:
        model[0].weight.grad._local_tensor[0, 0] = float("inf")
    opt.step()
    out["skip params"] = rel(full(model.parameters()), before)
    out["skip steps"] = sorted({float(s["step"]) for s in opt.state.values()})
    train(model, opt, 1, rank, world, first=2)
    out["skip then step"] = rel(full(model.parameters()), before)

    for path in ("step", "unscale_"):
        model = shard(make_model(torch.float32), mesh)
        opt = trainops.optim.AdamW(model.parameters(), lr=0.02)
        scaler = trainops.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
        scales, moved = [], []
        for step in range(3):
            before = full(model.parameters())
            opt.zero_grad()
            x, y = (rows(t, rank, world) for t in batch(step, torch.float32))
            scaler.scale((model(x) - y).square().mean()).backward()
            if step == 1 and rank == last:
                model[2].weight.grad._local_tensor.view(-1)[0] = float("nan")
            if path == "unscale_":
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
            moved.append(rel(full(model.parameters()), before) > 0)
        out[f"scaler {path}"] = (scales, moved)


def error_cases(rank, world, mesh, out, tmp):
    """Refused before any collective, naming what is wrong."""
    other = init_device_mesh("cpu", (1, world))
    a = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3, dtype=torch.float64), mesh, [Replicate()]))
    b = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3, dtype=torch.float64), other, [Replicate(), Replicate()]))
    a.grad, b.grad = torch.zeros_like(a), torch.zeros_like(b)
    try:
        trainops.optim.AdamW([{"params": [a]}, {"params": [b]}], max_grad_norm=1.0).step()
        out["two meshes"] = "no error"
    except UnsupportedError as e:
        out["two meshes"] = str(e)
    c = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3, dtype=torch.float64), mesh, [Replicate()]))
    c.grad = DTensor.from_local(torch.ones(4, 3, dtype=torch.float64), mesh, [Partial()])
    try:
        trainops.optim.AdamW([c]).step()
        out["partial grad"] = "no error"
    except UnsupportedError as e:
        out["partial grad"] = str(e)
    # ranks that would make different collectives (a clip summed on one rank only; other parameters)
    # raise on every rank at the first step, before any state is made, instead of hanging
    def two_groups_on_rank_1(m):
        params = list(m.parameters())
        return trainops.optim.AdamW([{"params": params}] if rank == 0 else [{"params": params[:2]},
                                                                            {"params": params[2:]}])

    for case, make, drop in (
            ("clip on rank 0", lambda m: trainops.optim.AdamW(m.parameters(), max_grad_norm=1.0 if rank == 0 else None),
             False),
            ("fewer parameters", lambda m: trainops.optim.AdamW(list(m.parameters())[:2 + 2 * rank]), False),
            ("param groups", two_groups_on_rank_1, False),
            ("a gradient None on rank 0", lambda m: trainops.optim.AdamW(m.parameters(), max_grad_norm=1.0), True)):
        model = shard(make_model(), mesh)
        opt = make(model)
        backward(model, 0, rank, world)
        if drop and rank == 0:
            model[2].bias.grad = None
        before = full(model.parameters())
        try:
            opt.step()
            out[f"disagree {case}"] = "no error"
        except InvalidProblemError as e:
            out[f"disagree {case}"] = str(e)
        out[f"disagree {case} changed nothing"] = rel(full(model.parameters()), before) == 0.0 and not opt.state
    # what one rank alone does to its optimizer between steps (reading the state of a frozen
    # parameter adds an entry to opt.state's defaultdict there) makes no collective: no hang
    model = shard(make_model(), mesh)
    model[4].bias.requires_grad_(False)
    opt = trainops.optim.AdamW(model.parameters(), lr=0.02, max_grad_norm=1.0)
    train(model, opt, 2, rank, world)
    if rank == 0:
        out["frozen state entries"] = sum(len(opt.state[p]) for p in model.parameters())
    train(model, opt, 2, rank, world, first=2)
    out["stepped after a rank-local state read"] = True
    model = shard(make_model(), mesh)
    opt = trainops.optim.AdamW(model.parameters())
    train(model, opt, 1, rank, world)
    state = opt.state_dict()
    state["state"] = {i: {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in s.items()}
                      for i, s in state["state"].items()}
    for group in state["param_groups"]:
        group["lr"] = 123.0
    try:
        opt.load_state_dict(state)
        out["plain state"] = "no error"
    except UnsupportedError as e:
        out["plain state"] = str(e)
    out["plain state changed nothing"] = (opt.param_groups[0]["lr"] != 123.0 and all(
        isinstance(v, DTensor) for s in opt.state.values() for k, v in s.items() if k != "step"))
    for name, make in (("GradientSync", lambda ps: trainops.distributed.GradientSync(ps)),
                       ("ShardedOptimizer", lambda ps: trainops.distributed.ShardedOptimizer(ps))):
        try:
            make(model.parameters())
            out[name] = "no error"
        except UnsupportedError as e:
            out[name] = str(e)
    # an op given a sharded parameter outside its module's forward: refused, naming the argument
    head = fully_shard(torch.nn.Linear(6, 5, bias=False).to(torch.float64), mesh=mesh)
    try:
        trainops.linear_cross_entropy(torch.randn(4, 6, dtype=torch.float64), head.weight, torch.tensor([0, 1, 2, 3]))
        out["dtensor to an op"] = "no error"
    except UnsupportedError as e:
        out["dtensor to an op"] = str(e)
    # trainops.grad on sharded gradients: their local parts (the Triton kernels here); pairs laid out alike
    with trainops.backend("triton"):
        a = distribute_tensor(torch.ones(5, 3), mesh, [Shard(0)])
        b = distribute_tensor(torch.full((5, 3), 2.0), mesh, [Shard(0)])
        trainops.grad.accumulate_([a], [b], scale=0.5)
        out["accumulate dtensor"] = a.full_tensor().tolist() == torch.full((5, 3), 2.0).tolist()
        trainops.grad.zero_([a])
        out["zero dtensor"] = a.full_tensor().abs().sum().item() == 0.0
        try:
            trainops.grad.accumulate_([a], [torch.ones(5, 3)])
            out["accumulate mixed"] = "no error"
        except Exception as e:
            out["accumulate mixed"] = str(e)
    # a caller's clip coefficient is kept with a found_inf (what torch.amp.GradScaler passes)
    model = shard(make_model(), mesh)
    opt = trainops.optim.SGD(model.parameters(), lr=0.1)
    before = full(model.parameters())
    backward(model, 0, rank, world)
    opt.step(clip=torch.zeros((), dtype=torch.float32), found_inf=torch.zeros((), dtype=torch.float32))
    out["caller clip kept"] = rel(full(model.parameters()), before) == 0.0
    # zero_grad(set_to_none=False) zeroes the local shards in place (the Triton kernel on them here)
    model = shard(make_model(torch.float32), mesh)
    opt = trainops.optim.AdamW(model.parameters())
    backward(model, 0, rank, world, torch.float32)
    grads = [p.grad for p in model.parameters()]
    with trainops.backend("triton"):
        opt.zero_grad(set_to_none=False)
    out["zeroed in place"] = all(p.grad is g and float(g.full_tensor().abs().sum()) == 0.0
                                 for p, g in zip(model.parameters(), grads))


def checkpoint_cases(rank, world, mesh, out, tmp):
    """DCP saves on this world after 2 steps (a scheduler stepping), of trainops's AdamW and of
    torch's, and the curve they continue on (the same: they step alike)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    continued = []
    for name, make, clip in SAVED:
        model = shard(make_model(), mesh)
        opt = make(model.parameters())
        schedule = decay(opt)
        train(model, opt, 2, rank, world, schedule=schedule, clip=clip)
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(tmp, name))
        train(model, opt, 3, rank, world, first=2, schedule=schedule, clip=clip)
        continued.append(full(model.parameters()))
    out["continued alike"] = rel(*continued)
    if rank == 0:
        torch.save({"params": continued[0]}, os.path.join(tmp, "continued.pt"))


SAVED = (("dcp-trainops", lambda ps: trainops.optim.AdamW(ps, lr=0.02, max_grad_norm=0.5, amsgrad=True), None),
         ("dcp-torch", lambda ps: torch.optim.AdamW(ps, lr=0.02, amsgrad=True, foreach=False), 0.5))


class TinyLM(torch.nn.Module):
    """Embedding, RMSNorm, Linear, GELU, LM head and CrossEntropyLoss: what patch swaps, in one model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb, self.norm, self.proj = torch.nn.Embedding(20, 8), torch.nn.RMSNorm(8), torch.nn.Linear(8, 8)
        self.act, self.head, self.loss = torch.nn.GELU(), torch.nn.Linear(8, 20, bias=False), torch.nn.CrossEntropyLoss()
        with torch.no_grad():
            self.norm.weight.add_(torch.randn(8) * 0.2)

    def forward(self, ids, labels):
        h = self.act(self.proj(self.norm(self.emb(ids))))
        return self.loss(self.head(h).flatten(0, 1), labels.flatten())


def module_cases(rank, world, mesh, out, tmp):
    """trainops.nn modules and trainops.patch (before and after fully_shard) inside FSDP2 models:
    the loss and every gradient of the torch model, and the same parameters after two steps."""
    from torch.distributed.fsdp import FSDPModule

    def make(kind):
        model = TinyLM().to(torch.float64)
        if kind == "patched first":
            trainops.patch(model, block_ops=True)
        for name in ("emb", "norm", "proj", "head"):
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)
        if kind == "patched after":
            report = trainops.patch(model, block_ops=True)
            out["patched after report"] = sorted((name, new) for name, _, new in report.swapped)
        return model

    gen = torch.Generator().manual_seed(9)
    ids, labels = torch.randint(0, 20, (GLOBAL_BATCH, 5), generator=gen), torch.randint(0, 20, (GLOBAL_BATCH, 5),
                                                                                     generator=gen)
    ids, labels = rows(ids, rank, world), rows(labels, rank, world)
    results = {}
    for kind in ("torch", "patched first", "patched after"):
        model = make(kind)
        opt = trainops.optim.AdamW(model.parameters(), lr=0.02)
        losses = []
        for _ in range(2):
            opt.zero_grad()
            loss = model(ids, labels)
            loss.backward()
            grads = full(p.grad for p in model.parameters())
            opt.step()
            losses.append(loss.detach())
        swapped = all(isinstance(m, cls) for m, cls in ((model.norm, trainops.nn.RMSNorm),
                                                        (model.emb, trainops.nn.Embedding),
                                                        (model.act, trainops.nn.GELU),
                                                        (model.loss, trainops.nn.CrossEntropyLoss)))
        results[kind] = (losses, grads, full(model.parameters()), swapped,
                         all(isinstance(getattr(model, n), FSDPModule) for n in ("emb", "norm", "proj", "head")))
    for kind in ("patched first", "patched after"):
        out[f"{kind} swapped"] = results[kind][3] and results[kind][4]
        out[f"{kind} loss"] = rel(results[kind][0], results["torch"][0])
        out[f"{kind} grads"] = rel(results[kind][1], results["torch"][1])
        out[f"{kind} params"] = rel(results[kind][2], results["torch"][2])
    out["torch swapped"] = results["torch"][3]


def hf_cases(rank, world, mesh, out, tmp):
    """trainops.patch of a transformers Llama whose LM head is its own FSDP2 unit: the fused linear
    cross-entropy runs inside the head's FSDP forward (weight gathered, its gradient reduce-scattered)."""
    transformers = pytest.importorskip("transformers")

    def make(patched, sharded=True):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          attn_implementation="eager", tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config).to(torch.float64)
        if patched:
            trainops.patch(model)
        if not sharded:
            return model
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    gen = torch.Generator().manual_seed(1)
    all_ids = torch.randint(0, 97, (GLOBAL_BATCH, 16), generator=gen)
    ids = rows(all_ids, rank, world)
    results = []
    for patched in (False, True):
        model = make(patched)
        out_ = model(input_ids=ids, labels=ids)
        out_.loss.backward()
        results.append((out_.loss.detach(), full(p.grad for p in model.parameters()), out_.logits))
    (loss, grads, _), (patched_loss, patched_grads, logits) = results
    whole = make(True, sharded=False)
    whole(input_ids=all_ids, labels=all_ids).loss.backward()
    out["hf loss"] = rel([patched_loss], [loss])
    out["hf grads"] = rel(patched_grads, grads)
    out["hf grads against one process"] = rel(patched_grads, full(p.grad for p in whole.parameters()))
    out["hf logits skipped"] = logits is None
    # unpatch of a model fully_shard wrapped after patch: the FSDP wrappers stay, around transformers's classes
    from torch.distributed.fsdp import FSDPModule

    model = make(True)
    restored = {name for name, *_ in trainops.unpatch(model).swapped}
    out["hf unpatched"] = (restored >= {"", "model.norm", "model.layers.0.mlp", "model.layers.1.self_attn"}
                           and isinstance(model, FSDPModule) and isinstance(model.model.layers[0], FSDPModule)
                           and type(model).__mro__[2] is transformers.LlamaForCausalLM
                           and type(model.model.norm) is transformers.models.llama.modeling_llama.LlamaRMSNorm)
    unpatched_out = model(input_ids=ids, labels=ids)
    out["hf unpatched loss"] = rel([unpatched_out.loss.detach()], [loss])
    out["hf unpatched logits"] = unpatched_out.logits is not None


SAVE_CASES = (torch_cases, lamb_cases, skip_cases, error_cases, checkpoint_cases, module_cases, hf_cases)


# ------------------------------------------------------------------------------------------------
# cases of the 3-rank run
# ------------------------------------------------------------------------------------------------

def load_cases(rank, world, mesh, out, tmp):
    """The 2-rank checkpoints loaded on 3 ranks continue the 2-rank curve: trainops's into trainops's
    AdamW (DCP's default, strict planner) and into torch's, torch's into trainops's. Across the two
    the state tensors match; the hyper-parameter keys only one of them has (torch's foreach, fused,
    ...; trainops's master_weights, state_dtype) need ``allow_partial_load`` and keep the loading
    optimizer's values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    want = torch.load(os.path.join(tmp, "continued.pt"))["params"]
    (ours, make_ours, _), (theirs, make_theirs, clip) = SAVED
    for saved, make, loader in ((ours, make_ours, "trainops"), (ours, make_theirs, "torch"),
                                (theirs, make_ours, "trainops")):
        model = shard(make_model(seed=1), mesh)   # other weights: the load must replace them
        opt = make(model.parameters())
        schedule = decay(opt)
        model_state, optim_state = get_state_dict(model, opt)
        planner = DefaultLoadPlanner(allow_partial_load=saved != ours or loader != "trainops")
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(tmp, saved),
                 planner=planner)
        set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
        schedule.last_epoch = 2   # the saved run's scheduler had stepped twice (its lr came with the state)
        train(model, opt, 3, rank, world, first=2, clip=clip if loader == "torch" else None, schedule=schedule)
        key = f"{saved} into {loader}"
        out[key] = rel(full(model.parameters()), want)
        out[f"{key} state is DTensor"] = all(isinstance(v, DTensor) for s in opt.state.values()
                                             for k, v in s.items() if k != "step")


def uneven_cases(rank, world, mesh, out, tmp):
    """3 ranks: some ranks hold empty shards; LAMB and AdamW with the clip still equal one process."""
    for backend, dtype in (("cpu", torch.float64), ("triton", torch.float32)):
        with trainops.backend(backend):
            for name, make in (("lamb", lambda ps: trainops.optim.LAMB(ps, lr=0.05, max_grad_norm=0.05)),
                               ("adamw", lambda ps: trainops.optim.AdamW(ps, lr=0.02, max_grad_norm=0.05))):
                sharded, whole = shard(make_model(dtype), mesh), make_model(dtype)
                opt, ref = make(sharded.parameters()), make(whole.parameters())
                train(sharded, opt, 2, rank, world, dtype=dtype)
                train(whole, ref, 2, rank, world, dtype=dtype, whole=True)
                out[f"uneven {name} {backend}"] = rel(full(sharded.parameters()), full(whole.parameters()))
    out["empty shards"] = sorted(p._local_tensor.numel() for p in shard(make_model(), mesh).parameters())


def lowbit_cases(rank, world, mesh, out, tmp):
    """3 ranks (row shards at flat offsets that are not multiples of 256, empty shards): 8-bit states
    and stochastically rounded bf16 parameters of FSDP2 parameters are the whole tensors', bit for bit
    (LAMB's parameters within the rounding of its mesh-summed norms); the states are DTensors."""
    for backend in ("cpu", "triton"):
        with trainops.backend(backend):
            for name, dtype, cls, options in (
                    ("adamw 8bit", torch.float32, "AdamW", dict(optim_bits=8, min_8bit_size=0)),
                    ("adamw 8bit bf16 sr", torch.bfloat16, "AdamW",
                     dict(optim_bits=8, min_8bit_size=0, stochastic_rounding=True)),
                    ("lamb 8bit", torch.float32, "LAMB", dict(optim_bits=8, min_8bit_size=0))):
                sharded, whole = shard(make_model(dtype), mesh), make_model(dtype)
                opts = [getattr(trainops.optim, cls)(m.parameters(), lr=0.02, **options) for m in (sharded, whole)]
                gen = torch.Generator().manual_seed(5)
                for _ in range(3):
                    for ps, pw in zip(sharded.parameters(), whole.parameters()):
                        g = torch.randn(pw.shape, generator=gen).to(dtype)
                        _, offset = compute_local_shape_and_global_offset(ps.shape, mesh, ps.placements)
                        part = g[offset[0]:offset[0] + ps._local_tensor.shape[0]].clone()
                        pw.grad = g.clone()
                        ps.grad = DTensor.from_local(part, mesh, ps.placements, shape=ps.shape, stride=ps.stride())
                    for opt in opts:
                        opt.step()
                out[f"{name} {backend} params"] = rel([t.double() for t in full(sharded.parameters())],
                                                      [t.double() for t in full(whole.parameters())])
                same, dtensors = True, True
                for ps, pw in zip(sharded.parameters(), whole.parameters()):
                    for key, value in opts[1].state[pw].items():
                        mine = opts[0].state[ps][key]
                        dtensors &= key == "step" or isinstance(mine, DTensor)
                        same &= torch.equal(full([mine])[0], value)
                out[f"{name} {backend} state equal"] = same
                out[f"{name} {backend} state is DTensor"] = dtensors


LOAD_CASES = (load_cases, uneven_cases, lowbit_cases)


def worker(rank, world, port, tmp, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a collective a rank never joins fails within a minute instead of hanging the suite
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    try:
        run_cases(SAVE_CASES if world == 2 else LOAD_CASES, out, rank, world, mesh, out, tmp)
    finally:
        results[rank] = out
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world: {rank: results}} of the 2-rank run (which saves the checkpoint) then the 3-rank one."""
    tmp = str(tmp_path_factory.mktemp("fsdp"))
    found = {}
    with triton_interpreter():   # the ranks run on the CPU, Triton under the interpreter
        with mp.Manager() as manager:
            for world in (2, 3):
                results = manager.dict()
                mp.spawn(worker, args=(world, free_port(), tmp, results), nprocs=world, join=True)
                found[world] = dict(results)
    return found




def test_optimizers_step_like_torch_optim_on_fsdp2(runs):
    for out in rank_outputs(runs, 2, torch_cases):
        for name in ("sgd", "adam", "adamw clip"):
            # trainops's clip coefficient is a float32 scalar (torch's clip_grad_norm_ keeps float64's)
            assert out[f"{name} params"] <= (1e-8 if "clip" in name else 1e-13), (name, out[f"{name} params"])
            assert out[f"{name} moved"] > 1e-3, name          # the steps did something
            assert out[f"{name} state is DTensor"], name
        got, want = out["adamw clip norms"]
        assert len(got) == len(want) == STEPS
        assert rel([torch.tensor(got)], [torch.tensor(want)]) <= 1e-7, (got, want)   # float32 norm


def test_lamb_and_clip_use_whole_parameter_norms(runs):
    for out in rank_outputs(runs, 2, lamb_cases):
        assert out["lamb cpu params"] <= 1e-8, out["lamb cpu params"]   # float32 clip coefficient, as above
        assert out["lamb cpu norm"] <= 1e-13
        assert out["lamb triton params"] <= 1e-5 and out["adamw triton params"] <= 1e-5, out
        assert out["lamb triton norm"] <= 1e-6 and out["adamw triton norm"] <= 1e-6, out
        for name in ("lamb cpu", "lamb triton", "adamw triton"):
            assert out[f"{name} moved"] > 1e-3, name
        assert out["hsdp placements"] == "(Replicate(), Shard(dim=0))", out["hsdp placements"]
        assert out["hsdp lamb params"] <= 1e-8, out["hsdp lamb params"]


def test_an_inf_on_one_rank_skips_every_rank(runs):
    for out in rank_outputs(runs, 2, skip_cases):
        assert out["skip params"] == 0.0 and out["skip steps"] == [1.0], out
        assert out["skip then step"] > 0
        for path in ("step", "unscale_"):
            assert out[f"scaler {path}"] == ([512.0, 256.0, 512.0], [True, False, True]), (path, out[f"scaler {path}"])


def test_sharded_errors_name_the_problem(runs):
    for out in rank_outputs(runs, 2, error_cases):
        assert "2 device meshes" in out["two meshes"], out["two meshes"]
        expected = {"clip on rank 0": "disagree on max_grad_norm: rank 0 has 1.0, rank 1 has None",
                    "fewer parameters": "disagree on the number of parameters of param_groups[0]: rank 0 has 2, "
                                        "rank 1 has 4",
                    "param groups": "disagree on the number of param groups: rank 0 has 1, rank 1 has 2",
                    "a gradient None on rank 0": "disagree on param_groups[0]['params'][3] (dtype, shape, "
                                                 "placements, has a gradient)"}
        for case, message in expected.items():
            assert message in out[f"disagree {case}"], (case, out[f"disagree {case}"])
            assert out[f"disagree {case} changed nothing"], case
        assert out["stepped after a rank-local state read"]
        assert "Partial" in out["partial grad"] or "placements" in out["partial grad"], out["partial grad"]
        assert "torch.distributed.checkpoint" in out["plain state"], out["plain state"]
        assert out["plain state changed nothing"]
        for name in ("GradientSync", "ShardedOptimizer"):
            assert "holds DTensors" in out[name] and "trainops.optim" in out[name], out[name]
        assert out["zeroed in place"]
        assert out["accumulate dtensor"] and out["zero dtensor"] and out["caller clip kept"], out
        assert "must be laid out as dst[0]" in out["accumulate mixed"], out["accumulate mixed"]
        assert "trainops.linear_cross_entropy: argument 'weight' is a DTensor" in out["dtensor to an op"], \
            out["dtensor to an op"]


def test_dcp_checkpoint_of_2_ranks_continues_on_3(runs):
    for out in rank_outputs(runs, 2, checkpoint_cases):
        assert out["continued alike"] <= 1e-8, out["continued alike"]   # float32 clip coefficient (see above)
    for out in rank_outputs(runs, 3, load_cases):
        for key in ("dcp-trainops into trainops", "dcp-trainops into torch", "dcp-torch into trainops"):
            tolerance = 1e-12 if key == "dcp-trainops into trainops" else 1e-8   # float32 clip coefficient
            assert out[key] <= tolerance and out[f"{key} state is DTensor"], (key, out[key])


def test_uneven_shards(runs):
    outs = rank_outputs(runs, 3, uneven_cases)
    assert [out["empty shards"][0] for out in outs] == [1, 1, 0]   # the last rank's shards of Linear(7, 2) are empty
    for out in outs:
        # with the clip: its float32 coefficient may round differently from the sums in another order
        assert out["uneven lamb cpu"] <= 1e-8 and out["uneven adamw cpu"] <= 1e-8, out
        assert out["uneven lamb triton"] <= 1e-5 and out["uneven adamw triton"] <= 1e-5, out


def test_lowbit_states_do_not_depend_on_the_world_size(runs):
    for out in rank_outputs(runs, 3, lowbit_cases):
        for backend in ("cpu", "triton"):
            for name in ("adamw 8bit", "adamw 8bit bf16 sr", "lamb 8bit"):
                key = f"{name} {backend}"
                assert out[f"{key} state equal"] and out[f"{key} state is DTensor"], (key, out)
                assert out[f"{key} params"] <= (1e-6 if "lamb" in name else 0.0), (key, out[f"{key} params"])


def test_modules_and_patch_inside_fully_shard(runs):
    for out in rank_outputs(runs, 2, module_cases):
        assert not out["torch swapped"]
        for kind in ("patched first", "patched after"):
            assert out[f"{kind} swapped"], kind    # trainops classes, still FSDP modules
            assert out[f"{kind} loss"] <= 1e-13 and out[f"{kind} grads"] <= 1e-12 and out[f"{kind} params"] <= 1e-12, \
                (kind, out)
        assert out["patched after report"] == [("act", "trainops.nn.GELU"), ("emb", "trainops.nn.Embedding"),
                                               ("loss", "trainops.nn.CrossEntropyLoss"),
                                               ("norm", "trainops.nn.RMSNorm")], out["patched after report"]


def test_hf_fused_loss_with_a_sharded_lm_head(runs):
    for out in rank_outputs(runs, 2, hf_cases):
        assert out["hf logits skipped"]
        # transformers's own loss casts the float64 logits to float32: agreement to float32's precision
        assert out["hf loss"] <= 1e-6 and out["hf grads"] <= 1e-6, out
        # against the patched model in one process on the global batch: float64's
        assert out["hf grads against one process"] <= 1e-12, out["hf grads against one process"]
        assert out["hf unpatched"] and out["hf unpatched logits"] and out["hf unpatched loss"] <= 1e-12, out


def disagree_2d_worker(rank, world, port, results):
    """A 2 x 2 mesh (HSDP's layout), the clip on rank 0 only: every rank raises (a rank whose first
    dimension agreed must not wait in the second dimension's gather for ranks that already left)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3, dtype=torch.float64), mesh, [Replicate(), Shard(0)]))
        p.grad = distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, [Replicate(), Shard(0)])
        try:
            trainops.optim.AdamW([p], max_grad_norm=1.0 if rank == 0 else None).step()
            results[rank] = "no error"
        except InvalidProblemError as e:
            results[rank] = str(e)
        except Exception as e:   # a timeout of a collective the other ranks left
            results[rank] = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()


def test_ranks_that_disagree_raise_on_a_2d_mesh():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(disagree_2d_worker, args=(4, free_port(), results), nprocs=4, join=True)
        found = dict(results)
    assert sorted(found) == [0, 1, 2, 3], found
    for rank, message in found.items():
        assert "disagree on max_grad_norm: rank 0 has 1.0, rank 1 has None" in message, (rank, message)


# ------------------------------------------------------------------------------------------------
# the main job: torchrun --nproc_per_node N -m trainops train --fsdp
# ------------------------------------------------------------------------------------------------

def test_train_fsdp_under_torchrun_on_gloo(tmp_path):
    """Two ranks on the CPU: trainops's FSDP2 run and plain FSDP2's follow the same loss curve, and
    the report gives tokens/s, ms per step and every rank's peak memory for both."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)   # the CPU path of the ops, as a user's run on the CPU
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "-m", "trainops", "train", "--fsdp", "--config", "tiny",
                           "--steps", "8", "--compare", "--plot", str(tmp_path / "fsdp.png")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "sharded over 2 ranks (cpu, gloo)" in out, out
    for name in ("trainops fsdp x2", "pytorch fsdp x2"):
        assert f"{name}: final loss" in out, out
    assert out.count("peak memory per rank (MiB): ") == 2, out
    worst = float(out.split("largest difference over 8 steps: ")[1].split(";")[0])
    assert worst < 1e-4, out     # float32, the same math in another order
    assert "step time trainops / pytorch: " in out and (tmp_path / "fsdp.png").exists()


def test_train_fsdp_arguments_are_checked_first(capsys, monkeypatch, no_work):
    from trainops import train

    monkeypatch.delenv("RANK", raising=False)
    cases = ((["--fsdp"], "argument --fsdp: run it under torchrun"),
             (["--fsdp", "--model", "llama"], "argument --fsdp: only with --model gpt"),
             (["--fsdp", "--save", "x.pt"], "argument --save: not available with --fsdp"),
             (["--fsdp", "--compile"], "argument --compile: not available with --fsdp"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            train.main(["--config", "tiny", *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, argv
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit):
        train.main(["--config", "tiny", "--fsdp"])
    assert "micro-batches of 4 sequences do not split evenly over 3 ranks" in capsys.readouterr().err
