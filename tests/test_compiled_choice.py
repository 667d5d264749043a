"""trainops.compiled: each decomposition computes its op (values and gradients against the op's own
and float64), the table look-up (size classes, keys, errors), a plan's ``compiled`` property, the
traced path (the decomposition traced in place of the op where the table says "inductor", the op
elsewhere) and the measured table's form."""

import pytest
import torch

import trainops
from trainops.compiled import CompiledChoices, size_class
from trainops.compiled_table import TABLE
from trainops.errors import InvalidProblemError
from trainops.ops import normalization as norm_ops
from trainops.ops import rotary as rotary_ops

from numerics import assert_close


def _grads(outputs, inputs):
    outputs = [o for o in outputs if o.numel() and o.requires_grad]
    upstream = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64).to(o.dtype)
                for i, o in enumerate(outputs)]
    return torch.autograd.grad(outputs, [i for i in inputs if i is not None], upstream)


NORM_CASES = [
    ("rms_norm", dict(residual=False, weight=True, offset=0.0)),
    ("rms_norm", dict(residual=True, weight=True, offset=1.0)),
    ("rms_norm", dict(residual=False, weight=False, offset=0.0)),
    ("layer_norm", dict(residual=True, weight=True, bias=True)),
    ("layer_norm", dict(residual=False, weight=True, bias=False)),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op, case", NORM_CASES, ids=lambda c: str(c))
def test_norm_decomposition_matches_the_op(op, case, dtype):
    gen = torch.Generator().manual_seed(3)
    shape, n = (3, 5, 24), 24
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    residual = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() \
        if case["residual"] else None
    weight = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).float().requires_grad_() \
        if case["weight"] else None
    bias = torch.randn(n, generator=gen, dtype=torch.float64).float().requires_grad_() if case.get("bias") else None
    if op == "rms_norm":
        args = (x, weight, residual, 1, 1e-6, case["offset"])
        custom, decomposition = norm_ops.rms_norm_op, norm_ops.RMS_NORM_DECOMPOSITION
    else:
        args = (x, weight, bias, residual, 1, 1e-5)
        custom, decomposition = norm_ops.layer_norm_op, norm_ops.LAYER_NORM_DECOMPOSITION
    with trainops.backend("cpu"):
        y, h, stats = custom(*args)
        want = _grads((y, h) if residual is not None else (y,), (x, weight, bias, residual))
    dy, dh, dstats = decomposition.function(*args)
    got = _grads((dy, dh) if residual is not None else (dy,), (x, weight, bias, residual))
    assert dy.dtype == y.dtype == dtype and dstats.shape == stats.shape and dstats.dtype == stats.dtype
    tolerance = dtype if dtype != torch.float64 else torch.float64
    assert_close(dy, y, tolerance, "y")
    assert_close(dstats, stats, torch.float32 if dtype != torch.float64 else torch.float64, "stats")
    if residual is not None:
        assert torch.equal(dh, h)
    for i, (a, e) in enumerate(zip(got, want)):
        assert_close(a, e, tolerance, f"gradient {i}")
    assert decomposition.size(custom._by_name(*args)) == n


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cos_shape, rotary_dim", [((2, 7, 16), None), ((1, 7, 16), None), ((7, 8), 8)])
def test_rotary_decomposition_matches_the_op(cos_shape, rotary_dim, interleaved, dtype):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 7, 4, 16, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 2, 7, 16, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    angles = torch.rand(cos_shape, generator=gen, dtype=torch.float64) * 6
    cos, sin = angles.cos().float(), angles.sin().float()
    args = (q, k, cos, sin, None, interleaved, rotary_dim, False)
    with trainops.backend("cpu"):
        want_q, want_k = rotary_ops.rotary_op(*args)
        want = _grads((want_q, want_k), (q, k))
    got_q, got_k = rotary_ops.ROTARY_DECOMPOSITION.function(*args)
    got = _grads((got_q, got_k), (q, k))
    assert got_q.dtype == dtype and got_q.shape == q.shape
    assert_close(got_q, want_q, dtype, "q_out")
    assert_close(got_k, want_k, dtype, "k_out")
    for name, a, e in zip(("dq", "dk"), got, want):
        assert_close(a, e, dtype, name)
    size = rotary_ops.ROTARY_DECOMPOSITION.size(rotary_ops.rotary_op._by_name(*args))
    # partial rotary is never decomposed (its outputs would not take q's layout, as the op's do)
    assert size == (cos_shape[-1] if cos_shape[-1] == q.shape[-1] else None)
    with_ids = rotary_ops.rotary_op._by_name(q, k, cos, sin, torch.zeros(7, dtype=torch.long), False, None, False)
    assert rotary_ops.ROTARY_DECOMPOSITION.size(with_ids) is None   # position ids: never decomposed


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("across_heads, offset", [(False, 0.0), (False, 1.0), (True, 0.0)])
def test_qk_norm_rotary_decomposition_matches_the_op(across_heads, offset, dtype):
    from trainops.ops import qk_norm_rotary as qk_ops
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 5, 4, 16, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(2, 5, 2, 16, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    width_q, width_k = (4 * 16, 2 * 16) if across_heads else (16, 16)
    q_weight = (torch.rand(width_q, generator=gen, dtype=torch.float64) + 0.5).float().requires_grad_()
    k_weight = (torch.rand(width_k, generator=gen, dtype=torch.float64) + 0.5).float().requires_grad_()
    angles = torch.rand(1, 5, 16, generator=gen, dtype=torch.float64) * 6
    args = (q, k, q_weight, k_weight, angles.cos().float(), angles.sin().float(), 1e-6, offset, across_heads, None)
    inputs = (q, k, q_weight, k_weight)
    with trainops.backend("cpu"):
        want = qk_ops.qk_norm_rotary_op(*args)
        want_grads = _grads(want, inputs)
    got = qk_ops.DECOMPOSITION.function(*args)
    got_grads = _grads(got, inputs)
    for name, a, e in zip(("q_out", "k_out"), got, want):
        assert a.dtype == e.dtype == dtype
        assert_close(a, e, dtype, name)
    for i, (a, e) in enumerate(zip(got_grads, want_grads)):
        assert_close(a, e, dtype, f"gradient {i}")
    # the norm's width: the head dim, or across heads q's heads x head dim
    assert qk_ops.DECOMPOSITION.size(qk_ops.qk_norm_rotary_op._by_name(*args)) == (64 if across_heads else 16)
    plan = trainops.plan("qk_norm_rotary", q_shape=q.shape, k_shape=k.shape, cos_shape=angles.shape, dtype=dtype,
                         device="cpu", weight_dtype=torch.float32, cos_dtype=torch.float32, across_heads=across_heads)
    assert plan.problem.compiled_size == (64 if across_heads else 16)


def test_size_classes_and_lookup():
    assert [size_class(n) for n in (0, 1, 2, 3, 64, 65, 128, 129, 4096)] == [1, 1, 2, 4, 64, 128, 128, 256, 4096]
    choices = CompiledChoices(table={("cuda", "rms_norm", "bfloat16", 128): "inductor"})
    assert choices.backend("cuda", "rms_norm", torch.bfloat16, 128) == "inductor"
    assert choices.backend("cuda", "rms_norm", torch.bfloat16, 100) == "inductor"    # the class of 128
    assert choices.backend("cuda", "rms_norm", torch.bfloat16, 129) == "triton"
    assert choices.backend("cuda", "rms_norm", torch.float32, 128) == "triton"
    assert choices.backend("cpu", "rms_norm", torch.bfloat16, 128) == "triton"
    assert choices.backend("cuda", "layer_norm", torch.bfloat16, 128) == "triton"
    assert choices.rows() == [dict(device="cuda", op="rms_norm", dtype="bfloat16", size_class=128,
                                   backend="inductor")]


@pytest.mark.parametrize("table", [
    {("cuda", "rms_norm", "bfloat16", 100): "inductor"},     # not a power of two
    {("cuda", "rms_norm", "bfloat16", 128): "liger"},        # not a backend
    {("cuda", "rms_norm", 128): "inductor"},                 # a short key
    {("cuda", "rms_norm", torch.bfloat16, 128): "inductor"},  # a dtype, not its name
])
def test_bad_tables_are_refused_by_name(table):
    with pytest.raises(InvalidProblemError, match="argument 'table'"):
        CompiledChoices(table=table)


def test_the_shipped_table_is_valid_and_names_cuda_problems_of_decomposed_ops():
    CompiledChoices(table=TABLE)
    decomposed = {"rms_norm", "layer_norm", "rotary_embedding", "qk_norm_rotary"}
    for device, op, dtype, size in TABLE:
        assert device == "cuda" and op in decomposed, (device, op, dtype, size)


def test_a_plan_says_what_a_compiled_graph_runs():
    config = CompiledChoices(table={("cpu", "rms_norm", "float32", 64): "inductor"})
    with trainops.heuristics(config):
        assert trainops.plan("rms_norm", shape=(8, 64), dtype=torch.float32, device="cpu").compiled == "inductor"
        assert trainops.plan("rms_norm", shape=(8, 256), dtype=torch.float32, device="cpu").compiled == "triton"
    assert trainops.plan("rms_norm", shape=(8, 64), dtype=torch.float32, device="cpu").compiled == "triton"
    assert trainops.plan("softmax", shape=(8, 64), dim=-1, dtype=torch.float32, device="cpu").compiled is None


def _norm_and_rotary(x, w, q, k, cos, sin):
    y = trainops.rms_norm(x, w, 1e-6)
    q_out, k_out = trainops.rotary_embedding(q, k, cos, sin)
    return y.square().sum() + q_out.square().sum() + k_out.sum()


def test_the_traced_path_follows_the_table():
    """Under torch.compile the decomposition replaces the op exactly where the table names the
    problem: no trainops kernel runs then, and the values and gradients agree with the op's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=gen).requires_grad_()
    w = (torch.rand(32, generator=gen) + 0.5).requires_grad_()
    q = torch.randn(2, 4, 5, 16, generator=gen).requires_grad_()
    k = torch.randn(2, 2, 5, 16, generator=gen).requires_grad_()
    angles = torch.rand(2, 5, 16, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    inputs = (x, w, q, k, cos, sin)
    with trainops.backend("cpu"):
        want = _norm_and_rotary(*inputs)
        want_grads = torch.autograd.grad(want, (x, w, q, k))
    tables = {
        "ours": ({}, {"rms_norm", "rms_norm_backward", "rotary_embedding", "rotary_embedding_backward"}),
        "norm decomposed": ({("cpu", "rms_norm", "float32", 32): "inductor"},
                            {"rotary_embedding", "rotary_embedding_backward"}),
        "both decomposed": ({("cpu", "rms_norm", "float32", 32): "inductor",
                             ("cpu", "rotary_embedding", "float32", 16): "inductor"}, set()),
    }
    for name, (table, expected_ops) in tables.items():
        torch._dynamo.reset()
        with trainops.heuristics(CompiledChoices(table=table)), trainops.track_kernels() as used:
            compiled = torch.compile(_norm_and_rotary, fullgraph=True, backend="aot_eager")
            got = compiled(*inputs)
            got_grads = torch.autograd.grad(got, (x, w, q, k))
        assert {op for op, *_ in used} == expected_ops, name
        assert_close(got, want, torch.float32, name)
        for a, e in zip(got_grads, want_grads):
            assert_close(a, e, torch.float32, name)
    torch._dynamo.reset()


def test_kernels_command_prints_the_compiled_choices(capsys):
    from trainops.__main__ import main
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "under torch.compile" in out


def test_the_bench_writes_a_table_module_that_loads():
    from trainops.bench.compiled_choice import table_source
    table = {("cuda", "rms_norm", "bfloat16", 128): "inductor", ("cuda", "rotary_embedding", "float32", 64): "inductor"}
    source = table_source(table, dict(device="NVIDIA H200", torch="2.11.0", triton="3.6.0", date="2026-11-29T10:00"))
    namespace = {}
    exec(compile(source, "compiled_table.py", "exec"), namespace)
    assert namespace["TABLE"] == table
    assert CompiledChoices(table=namespace["TABLE"]).backend("cuda", "rms_norm", torch.bfloat16, 100) == "inductor"


def test_the_bench_flags_are_checked():
    from trainops.__main__ import main
    with pytest.raises(SystemExit):
        main(["bench", "--write-table", "x.py"])            # only with --compiled-choice
    with pytest.raises(SystemExit):
        main(["bench", "--compiled-choice", "--quick"])     # runs alone
    for ops in ("softmax", "qk_norm_rotary,qk_norm_rotary"):   # no decomposition; twice
        with pytest.raises(SystemExit) as refused:
            main(["bench", "--compiled-choice", "--ops", ops])
        assert refused.value.code == 2
    if not torch.cuda.is_available():   # an op with a decomposition passes the flags, then wants a GPU
        with pytest.raises(SystemExit, match="CUDA device"):
            main(["bench", "--compiled-choice", "--ops", "qk_norm_rotary", "--write-table", "x.py"])


def test_the_bench_measures_the_chosen_ops_and_keeps_the_others_entries():
    """--compiled-choice --ops qk_norm_rotary: its problems per head (head dims) and across heads
    (OLMo 2's widths); --write-table then keeps the other ops' shipped entries and replaces the
    measured op's, in both dtypes."""
    from trainops.bench.compiled_choice import OPS, merged_table, problems, table_source
    assert problems(("qk_norm_rotary",)) == [("qk_norm_rotary", n) for n in (64, 128, 256, 2048, 4096)]
    assert {op for op, _ in problems()} == set(OPS)
    old = {("cuda", "rms_norm", "bfloat16", 128): "inductor", ("cuda", "qk_norm_rotary", "float32", 128): "inductor",
           ("cuda", "qk_norm_rotary", "bfloat16", 64): "inductor"}
    new = {("cuda", "qk_norm_rotary", "bfloat16", 2048): "inductor"}
    merged = merged_table(old, new, ("qk_norm_rotary",))
    assert merged == {("cuda", "rms_norm", "bfloat16", 128): "inductor",
                      ("cuda", "qk_norm_rotary", "bfloat16", 2048): "inductor"}
    source = table_source(merged, dict(device="NVIDIA H200", torch="2.11.0", triton="3.6.0", date="2026-11-29T10:00"),
                          measured=("qk_norm_rotary",))
    namespace = {}
    exec(compile(source, "compiled_table.py", "exec"), namespace)
    assert namespace["TABLE"] == merged and "qk_norm_rotary; the other ops' entries kept" in source


def _rms(x, w):
    return trainops.rms_norm(x, w, 1e-6)


def test_dynamic_sizes_and_recompiles_follow_the_table():
    """Symbolic sizes (dynamic=True, or a width that turns dynamic on a recompile) trace: the look-up
    takes constants only and the size is compared in the graph, so each size gets its class's choice."""
    w32, w256 = torch.rand(32) + 0.5, torch.rand(256) + 0.5
    x32, x256 = torch.randn(4, 32), torch.randn(4, 256)
    table = {("cpu", "rms_norm", "float32", 32): "inductor"}
    for dynamic in (True, None):
        torch._dynamo.reset()
        compiled = torch.compile(_rms, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        for x, w, decomposed in ((x32, w32, True), (x256, w256, False), (x32, w32, True)):
            with trainops.heuristics(CompiledChoices(table=table)), trainops.track_kernels() as used:
                got = compiled(x, w)
            assert (("rms_norm" in {op for op, *_ in used}) != decomposed), (dynamic, x.shape)
            with trainops.backend("cpu"):
                assert_close(got, trainops.rms_norm(x, w, 1e-6), torch.float32, str(x.shape))
    torch._dynamo.reset()


def test_a_pinned_backend_and_torch_export_keep_the_op():
    x, w = torch.randn(4, 32), torch.rand(32) + 0.5
    table = CompiledChoices(table={("cpu", "rms_norm", "float32", 32): "inductor"})
    torch._dynamo.reset()
    with trainops.heuristics(table), trainops.backend("cpu"), trainops.track_kernels() as used:
        torch.compile(_rms, fullgraph=True, backend="aot_eager")(x, w)
    assert "rms_norm" in {op for op, *_ in used}   # the pinned backend's kernel ran

    class Norm(torch.nn.Module):
        def forward(self, x, w):
            return _rms(x, w)

    with trainops.heuristics(table):
        exported = torch.export.export(Norm(), (x, w))
    assert "trainops.rms_norm" in str(exported.graph)
    torch._dynamo.reset()
