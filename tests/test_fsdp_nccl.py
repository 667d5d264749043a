"""trainops inside FSDP2 over NCCL, one process per GPU (issue 21): test_fsdp.py's checks at GPU
scale, on every GPU of the machine up to 4 (skipped with fewer than 2; CI, which has none, runs the
gloo versions). What the ranks measure is printed (``pytest -m gpu -s``) before it is asserted.

- trainops AdamW with ``max_grad_norm`` against torch's fused AdamW with ``clip_grad_norm_`` on
  the same FSDP2 model, step after step, float32 and bf16 parameters (MixedPrecisionPolicy);
- LAMB and AdamW with the clip on the FSDP2 model against the same optimizer on one unsharded
  replica fed the global batch (the trust ratios and the clip need whole-parameter norms);
- trainops.amp.GradScaler with an inf on the last rank: every rank backs off, then grows;
- ranks that disagree (a clip on rank 0 only) raise InvalidProblemError on every rank, no hang;
- a DCP checkpoint saved on N ranks continues on one rank along the N-rank curve.
"""

import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trainops
from trainops.errors import InvalidProblemError

from spawned import free_port, rank_outputs, run_cases

pytestmark = pytest.mark.gpu

WORLD = min(torch.cuda.device_count(), 4) if torch.cuda.is_available() else 0
GLOBAL_BATCH = 48   # divisible by 1 to 4 ranks


def blocks(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                                     torch.nn.Linear(512, 256)) for _ in range(4)]).to(device)


def sharded(model, mesh, mp_policy=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
    return fully_shard(model, mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy())


def batch(step, device, rank, world, whole=False):
    x = torch.randn(GLOBAL_BATCH, 256, generator=torch.Generator().manual_seed(step)).to(device)
    return x if whole else x.tensor_split(world)[rank]


def full(tensors):
    from torch.distributed.tensor import DTensor

    return [t.full_tensor().detach().float() if isinstance(t, DTensor) else t.detach().float() for t in tensors]


def rel(a, b) -> float:
    return max(((p - q).norm() / max(q.norm(), 1e-30)).item() for p, q in zip(a, b))


def step(model, opt, x, clip=None):
    opt.zero_grad()
    model(x).float().square().mean().backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def fused_cases(rank, world, mesh, device, out, tmp):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for label, policy in (("float32", None),
                          ("bf16 params", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
        ours, theirs = sharded(blocks(device), mesh, policy), sharded(blocks(device), mesh, policy)
        opt = trainops.optim.AdamW(ours.parameters(), lr=1e-3, max_grad_norm=0.5)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3, fused=True)
        diffs = []
        for i in range(6):
            x = batch(i, device, rank, world)
            step(ours, opt, x)
            step(theirs, ref, x, clip=0.5)
            diffs.append(rel(full(ours.parameters()), full(theirs.parameters())))
        out[f"vs torch fused {label}"] = diffs
        out[f"vs torch fused {label}: moved"] = rel(full(blocks(device).parameters()), full(theirs.parameters()))


def one_process_cases(rank, world, mesh, device, out, tmp):
    for name, make in (("LAMB", lambda ps: trainops.optim.LAMB(ps, lr=1e-3, max_grad_norm=0.5)),
                       ("AdamW", lambda ps: trainops.optim.AdamW(ps, lr=1e-3, max_grad_norm=0.5))):
        ours, whole = sharded(blocks(device), mesh), blocks(device)
        opt, ref = make(ours.parameters()), make(whole.parameters())
        for i in range(4):
            step(ours, opt, batch(i, device, rank, world))
            step(whole, ref, batch(i, device, rank, world, whole=True))
        out[f"vs one process {name}"] = rel(full(ours.parameters()), full(whole.parameters()))
        out[f"vs one process {name}: norm"] = rel([opt.grad_norm.float()], [ref.grad_norm.float()])
        out[f"vs one process {name}: moved"] = rel(full(blocks(device).parameters()), full(whole.parameters()))


def scaler_cases(rank, world, mesh, device, out, tmp):
    model = sharded(blocks(device), mesh)
    opt = trainops.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = trainops.amp.GradScaler(device.type, init_scale=256.0, growth_interval=1)
    scales = []
    for i in range(3):
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(batch(i, device, rank, world)).float().square().mean()
        scaler.scale(loss).backward()
        if i == 1 and rank == world - 1:
            model[0][0].weight.grad._local_tensor.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    out["scales"] = scales


def disagree_cases(rank, world, mesh, device, out, tmp):
    model = sharded(blocks(device), mesh)
    opt = trainops.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0 if rank == 0 else None)
    before = full(model.parameters())
    try:
        step(model, opt, batch(0, device, rank, world))
        out["disagree"] = "no error"
    except InvalidProblemError as e:
        out["disagree"] = str(e)
    out["disagree changed nothing"] = rel(full(model.parameters()), before) == 0.0


SAVED_AT, CONTINUED = 2, 3


def make_checkpointed(params):
    return trainops.optim.AdamW(params, lr=1e-3, max_grad_norm=0.5, amsgrad=True)


def save_cases(rank, world, mesh, device, out, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = sharded(blocks(device), mesh)
    opt = make_checkpointed(model.parameters())
    for i in range(SAVED_AT):
        step(model, opt, batch(i, device, rank, world))
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(tmp, "dcp"))
    for i in range(SAVED_AT, SAVED_AT + CONTINUED):
        step(model, opt, batch(i, device, rank, world))
    params = full(model.parameters())
    if rank == 0:
        torch.save([p.cpu() for p in params], os.path.join(tmp, "continued.pt"))


def load_cases(rank, world, mesh, device, out, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = sharded(blocks(device, seed=1), mesh)    # other weights: the load must replace them
    opt = make_checkpointed(model.parameters())
    model_state, optim_state = get_state_dict(model, opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(tmp, "dcp"))
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    for i in range(SAVED_AT, SAVED_AT + CONTINUED):
        # the global batch of each step, as the saving world saw it over its ranks
        step(model, opt, batch(i, device, rank, world))
    want = [p.to(device) for p in torch.load(os.path.join(tmp, "continued.pt"))]
    out["continued on fewer ranks"] = rel(full(model.parameters()), want)
    out["continued: moved"] = rel(full(blocks(device).parameters()), want)


def worker(rank, world, port, tmp, cases, results, device_type="cuda"):
    """One rank: NCCL on GPU ``rank`` (``device_type="cpu"``: gloo, for a dry run of the cases)."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a collective a rank never joins fails within two minutes instead of hanging the suite
    timeout = datetime.timedelta(seconds=120)
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    mesh = init_device_mesh(device_type, (world,))
    out = {}
    try:
        run_cases(cases, out, rank, world, mesh, device, out, tmp)
    finally:
        results[rank] = out
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world: {rank: results}}: the cases on WORLD ranks (which save the checkpoint), then the load on one."""
    if WORLD < 2:
        pytest.skip(f"needs 2 or more CUDA devices, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    tmp = str(tmp_path_factory.mktemp("fsdp-nccl"))
    found = {}
    with mp.Manager() as manager:
        for world, cases in ((WORLD, (fused_cases, one_process_cases, scaler_cases, disagree_cases, save_cases)),
                             (1, (load_cases,))):
            results = manager.dict()
            mp.spawn(worker, args=(world, free_port(), tmp, cases, results), nprocs=world, join=True)
            found[world] = {rank: dict(out) for rank, out in results.items()}
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      **{f"world {w}": r for w, r in found.items()}}, indent=1, default=str))
    return found




def test_adamw_steps_like_torch_fused_on_fsdp2_over_nccl(runs):
    for out in rank_outputs(runs, WORLD, fused_cases):
        # float32 rounding of two implementations (2x H200: 1.2e-6 .. 4.2e-6, NOTES "FSDP2 on two GPUs");
        # bf16 parameters amplify it (2.9e-4 after 6 steps); the steps moved the parameters by ~1e-1
        assert max(out["vs torch fused float32"]) < 5e-5, out["vs torch fused float32"]
        assert max(out["vs torch fused bf16 params"]) < 2e-3, out["vs torch fused bf16 params"]
        assert out["vs torch fused float32: moved"] > 1e-2 and out["vs torch fused bf16 params: moved"] > 1e-2, out


def test_lamb_and_clip_use_whole_parameter_norms_over_nccl(runs):
    for out in rank_outputs(runs, WORLD, one_process_cases):
        for name in ("LAMB", "AdamW"):
            # the gradients differ from one process's by float32 rounding of the reduce-scatter only
            assert out[f"vs one process {name}"] < 1e-4, (name, out[f"vs one process {name}"])
            assert out[f"vs one process {name}: norm"] < 1e-5, (name, out[f"vs one process {name}: norm"])
            assert out[f"vs one process {name}: moved"] > 1e-3, name


def test_scaler_agrees_across_ranks_over_nccl(runs):
    for out in rank_outputs(runs, WORLD, scaler_cases):
        assert out["scales"] == [512.0, 256.0, 512.0], out["scales"]


def test_ranks_that_disagree_raise_over_nccl(runs):
    for out in rank_outputs(runs, WORLD, disagree_cases):
        assert "disagree on max_grad_norm" in out["disagree"], out["disagree"]
        assert out["disagree changed nothing"]


def test_dcp_checkpoint_of_n_ranks_continues_on_one(runs):
    rank_outputs(runs, WORLD, save_cases)
    (out,) = rank_outputs(runs, 1, load_cases)
    assert out["continued on fewer ranks"] < 1e-4, out["continued on fewer ranks"]
    assert out["continued: moved"] > 1e-2, out["continued: moved"]
