"""``python -m trainops bench --compiled-choice``: measure, per (op, dtype, size class), whether a
torch.compile graph should run our kernel or Inductor's fusion of the op's decomposition, and
write the table trainops ships (``trainops/compiled_table.py``; ``trainops.compiled`` explains).

For each op with a decomposition (RMSNorm and LayerNorm by row length, the rotary embedding by
rotated features, the fused q/k norm + rotary by the norm's width: the head dim per head, q's heads x
the head dim across heads), each dtype and size (``--ops`` picks ops; ``--write-table`` then keeps
the shipped table's entries of the other ops): two functions compiled alone with ``fullgraph=True`` and
static shapes, one traced with our op (the table naming nothing: "triton") and one with the
decomposition (the table naming the problem: "inductor"); forward + backward (a fixed upstream
gradient) timed on the GPU: the durations of the kernels a step launches, summed under
torch.profiler (``kernel_ms``; a compiled forward + backward costs 0.3-0.9 ms of host time on the
H200 machine, more than these kernels take, so wall-clock timing measured the host: the first run,
benchmarks/NOTES.md), the outputs first compared with each other. "inductor" enters the table only
where it is faster by more than ``MARGIN``. Rows carry ms,
GB/s (x read and y written forward, dy read and dx written backward: the fewest bytes) and % of the
copy ceiling measured in the same run. What this cannot see: fusion with the op's neighbours in a
model (a cast, the rotary embedding after a q/k norm); the whole-step profile is the arbiter there.
"""

from __future__ import annotations

import datetime as _dt
import os

import torch

import trainops
from ..compiled import CompiledChoices, size_class
from . import Row, copy_ceiling_gbps, environment, kernel_ms, write_results

MARGIN = 0.03   # the decomposition must be this much faster: 3 %, above the spread of repeated profiles
ELEMENTS = 1 << 25   # elements of x per norm problem (rows = ELEMENTS / row length): Qwen3-0.6B's q-norm at 8 x 2048
NORM_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
ROTARY_SIZES = (64, 128, 256)
QK_SIZES = (64, 128, 256)
QK_ACROSS_SIZES = (2048, 4096)   # OLMo 2's norm across heads of 128: 16 heads (1B), 32 (7B)
DTYPES = (torch.bfloat16, torch.float32)
OPS = ("rms_norm", "layer_norm", "rotary_embedding", "qk_norm_rotary")   # the ops with a decomposition


def problems(ops=OPS) -> list[tuple[str, int]]:
    """(op, size) measured for ``ops``; qk_norm_rotary's size is the norm's width (its
    Decomposition's), so that sizes above 256 are its across-heads problems."""
    out = []
    for op in ops:
        if op in ("rms_norm", "layer_norm"):
            out += [(op, n) for n in NORM_SIZES]
        elif op == "rotary_embedding":
            out += [(op, r) for r in ROTARY_SIZES]
        elif op == "qk_norm_rotary":
            out += [(op, d) for d in QK_SIZES + QK_ACROSS_SIZES]
        else:
            raise ValueError(f"no decomposition to measure for {op!r}; the ops with one: {', '.join(OPS)}")
    return out


def merged_table(old: dict, new: dict, ops, dtypes=DTYPES) -> dict:
    """The table after measuring ``ops`` in ``dtypes``: ``old``'s entries for every other (op, dtype)
    kept, ``new``'s for these."""
    names = {str(d).replace("torch.", "") for d in dtypes}
    kept = {key: v for key, v in old.items() if not (key[1] in ops and key[2] in names)}
    return {**kept, **new}


def _norm_problem(op: str, n: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(ELEMENTS // n, n, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    w = (torch.rand(n, device="cuda", generator=gen) + 0.5).requires_grad_()
    dy = torch.randn(x.shape, device="cuda", dtype=dtype, generator=gen)
    if op == "rms_norm":
        def f(x, w):
            return trainops.rms_norm(x, w, 1e-6)
    else:
        b = torch.randn(n, device="cuda", generator=gen).requires_grad_()

        def f(x, w):
            return trainops.layer_norm(x, (n,), w, b, 1e-5)
    nbytes = 4 * x.numel() * x.element_size()   # x, y forward; dy, dx backward
    return f, (x, w), (dy,), nbytes


def _rotary_problem(r: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(r)
    batch, seq, q_heads, k_heads = 4, 2048, 32, 8
    # Hugging Face's layout: (batch, seq, heads, head_dim) projections seen as (batch, heads, seq, head_dim)
    q = torch.randn(batch, seq, q_heads, r, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
    k = torch.randn(batch, seq, k_heads, r, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
    q, k = q.requires_grad_(), k.requires_grad_()
    angles = torch.rand(batch, seq, r, device="cuda", generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    dq = torch.randn(q.shape, device="cuda", dtype=dtype, generator=gen)
    dk = torch.randn(k.shape, device="cuda", dtype=dtype, generator=gen)

    def f(q, k):
        return trainops.rotary_embedding(q, k, cos, sin)
    nbytes = 4 * (q.numel() + k.numel()) * q.element_size()
    return f, (q, k), (dq, dk), nbytes


def _qk_norm_rotary_problem(size: int, dtype: torch.dtype):
    """Per head (size = head dim): Qwen3-0.6B's attention at 8 x 2048 (16 / 8 heads; d = 128);
    across heads (size = heads x 128 above 256): OLMo 2's (as many k heads as q heads). Weights and
    cos / sin float32, as a model under autocast holds them."""
    gen = torch.Generator(device="cuda").manual_seed(size)
    across = size > max(QK_SIZES)
    batch, seq = 8, 2048
    d, q_heads, k_heads = (128, size // 128, size // 128) if across else (size, 16, 8)
    q = torch.randn(batch, seq, q_heads, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(batch, seq, k_heads, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    wq, wk = (q_heads * d, k_heads * d) if across else (d, d)
    q_weight = (torch.rand(wq, device="cuda", generator=gen) + 0.5).requires_grad_()
    k_weight = (torch.rand(wk, device="cuda", generator=gen) + 0.5).requires_grad_()
    angles = torch.rand(batch, seq, d, device="cuda", generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    dq = torch.randn(q.shape, device="cuda", dtype=dtype, generator=gen)
    dk = torch.randn(k.shape, device="cuda", dtype=dtype, generator=gen)

    def f(q, k):
        return trainops.qk_norm_rotary(q, k, q_weight, k_weight, cos, sin, 1e-6, across_heads=across)
    nbytes = 4 * (q.numel() + k.numel()) * q.element_size()
    return f, (q, k), (dq, dk), nbytes


def _compiled_step(f, inputs, upstream, backend: str, key):
    """A forward + backward of ``f`` compiled with the table choosing ``backend`` for ``key``."""
    table = {key: "inductor"} if backend == "inductor" else {}
    with trainops.heuristics(CompiledChoices(table=table)):
        compiled = torch.compile(lambda *a: f(*a), fullgraph=True, dynamic=False)
        outputs = compiled(*inputs)   # traced here, inside the block
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)

    def step():
        out = compiled(*inputs)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), upstream)
        for t in inputs:
            t.grad = None
    return step, [o.detach() for o in outputs]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def measure(dtype: torch.dtype, ceiling: float, log=print, ops=OPS) -> tuple[list[Row], dict]:
    """Every (op, size) of ``ops`` in ``dtype``: rows for both backends, and the table of the faster
    decompositions."""
    rows, table = [], {}
    dname = str(dtype).replace("torch.", "")
    for op, size in problems(ops):
        f, inputs, upstream, nbytes = (_rotary_problem(size, dtype) if op == "rotary_embedding"
                                       else _qk_norm_rotary_problem(size, dtype) if op == "qk_norm_rotary"
                                       else _norm_problem(op, size, dtype))
        key = ("cuda", op, dname, size_class(size))
        times, outputs = {}, {}
        for backend in ("triton", "inductor"):
            torch._dynamo.reset()
            step, outputs[backend] = _compiled_step(f, inputs, upstream, backend, key)
            times[backend] = kernel_ms(step, steps=10, windows=3, warmup=3)
        error = max(_relative(a, b) for a, b in zip(outputs["inductor"], outputs["triton"]))
        choice = "inductor" if times["inductor"] < (1 - MARGIN) * times["triton"] else "triton"
        if choice == "inductor":
            table[key] = "inductor"
        shape = tuple(inputs[0].shape)
        for backend, ms in times.items():
            gbps = nbytes / ms / 1e6
            rows.append(Row(op, f"{shape} fwd+bwd", "trainops" if backend == "triton" else "inductor decomposition",
                            ms, gbps, 100 * gbps / ceiling, error if backend == "inductor" else None,
                            fields=dict(dtype=dname, size=size, size_class=size_class(size), choice=choice)))
        log(f"  {op:17s} {dname:8s} size {size:5d}: trainops {times['triton']:.4f} ms, decomposition "
            f"{times['inductor']:.4f} ms ({times['triton'] / times['inductor']:.2f}x) -> {choice} "
            f"(outputs differ by {error:.1e})")
        del f, inputs, upstream
    torch._dynamo.reset()
    return rows, table


def table_source(table: dict, env: dict, measured=None) -> str:
    """compiled_table.py's text for ``table`` measured in ``env`` (``measured``: where only those ops
    were measured in ``env``, the other entries kept from the table before)."""
    entries = "".join(f"    {key!r}: {value!r},\n" for key, value in sorted(table.items()))
    return (f'"""Generated by ``python -m trainops bench --compiled-choice --write-table``: do not edit by hand.\n\n'
            f"(device type, op, dtype, size class) -> \"inductor\" where Inductor's fusion of the op's\n"
            f"decomposition measured faster than our kernel under torch.compile (trainops.compiled); every other\n"
            f"problem runs our kernel. Measured on {env['device']}, torch {env['torch']}, Triton {env['triton']},\n"
            f"{env['date'][:10]}"
            + (f" ({', '.join(measured)}; the other ops' entries kept from the table before)" if measured else "")
            + f".\n\"\"\"\n\nTABLE = {{\n{entries}}}\n")


def main(out: str | None = None, write_table: str | None = None, ops=OPS) -> int:
    """Measure ``ops`` (default: every op with a decomposition). With ``write_table``: the table
    written holds this run's entries for ``ops`` and the shipped table's for the other ops."""
    if not torch.cuda.is_available():
        raise SystemExit("--compiled-choice measures torch.compile on a CUDA device; none is available")
    env = environment()
    print(f"trainops bench --compiled-choice on {env['device']} (torch {env['torch']}, triton {env['triton']})")
    ceiling = copy_ceiling_gbps("cuda")
    print(f"copy ceiling {ceiling:.0f} GB/s; the decomposition wins where it is > {MARGIN:.0%} faster")
    if out is None:
        out = f"compiled-choice-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    rows, table = [], {}
    for dtype in DTYPES:   # the JSON is rewritten after each dtype: a run cut short keeps what it measured
        dtype_rows, dtype_table = measure(dtype, ceiling, ops=ops)
        rows += dtype_rows
        table.update(dtype_table)
        write_results(out, env, {"margin": MARGIN, "copy_ceiling_gbps": round(ceiling, 1),
                                 "table": [list(k) + [v] for k, v in sorted(table.items())]}, rows=rows)
        print(f"wrote {out}")
    if write_table:
        from ..compiled_table import TABLE
        full = merged_table(TABLE, table, ops)
        kept = sorted({op for _, op, _, _ in full} - set(ops))
        os.makedirs(os.path.dirname(write_table) or ".", exist_ok=True)
        with open(write_table, "w") as f:
            f.write(table_source(full, env, measured=ops if set(ops) != set(OPS) else None))
        print(f"wrote {write_table} ({len(full)} entries; measured now: {', '.join(ops)}"
              + (f"; kept from the shipped table: {', '.join(kept)}" if kept else "") + ")")
    return 0
