"""The softmax family's quack backend (the optional extra trainops[quack]): registration, the choice
rule, the wrapper's calls. On the CPU a fake ``quack.softmax`` (torch's softmax behind quack-kernels
0.6.5's signatures) stands in for quack; the GPU test runs the real one."""

import sys
import types
import warnings

import pytest
import torch

import trainops
from trainops import registry
from trainops.ops import softmax as S
from trainops.plan import clear_plan_cache

from conftest import HAS_CUDA
from numerics import assert_close

# The rule's ranges per op, as the H200 probes of 2026-11-30 measured them (S.QUACK_COLUMNS), and the row
# length's multiple per op (S.QUACK_COLUMN_MULTIPLE: quack's forward returned NaN at 151936 columns; its
# backward never did), written out so that a change of the constants fails here. Each boundary test tries
# lengths the other conditions allow, so that it fails only for its own reason: the ranges' ends on lengths
# that pass the multiple, the multiple on in-range lengths that are multiples of 8 elements (rows of whole
# 16-byte vectors in bf16 / fp16: ones quack's kernels could run).
RANGES = {"softmax": ((16384, 524288),), "softmax_backward": ((24576, 28672), (32776, 524288))}
MULTIPLES = {"softmax": 8192, "softmax_backward": 1}
MULTIPLE = MULTIPLES["softmax"]
NO_MULTIPLE = {"softmax": 1, "softmax_backward": 1}
LONG = 24576                # a row length the rule puts on quack, forward and backward (3 x 8192)
SHORT = 8192                # a multiple of 8192 the range keeps on Triton, forward and backward


def _fake_quack_modules(calls: list, fail: bool = False):
    """``quack`` and ``quack.softmax`` modules whose ``_softmax_fwd(x, out)`` and
    ``_softmax_backward(dy, y, dx)`` check what quack's check (2-D, dtypes), what its compiled kernels
    assume (contiguous rows of a whole number of 16-byte vectors: ``ReductionBase._get_tiled_copy``'s
    assert; 16-byte aligned pointers: ``Softmax.compile``'s ``assumed_align``), record each call, and
    write torch's results into the output."""
    def check(*tensors):
        for t in tensors:
            assert t.dim() == 2 and t.is_contiguous() and t.dtype in S.QUACK_DTYPES, (t.shape, t.stride(), t.dtype)
            assert t.shape[1] % (16 // t.element_size()) == 0, f"Input N {t.shape[1]} is not divisible by vector size"
            assert t.data_ptr() % 16 == 0, f"pointer {t.data_ptr():#x} is off quack's assumed 16-byte alignment"
        assert len({t.shape for t in tensors}) == 1 and len({t.dtype for t in tensors}) == 1

    def softmax_fwd(x, out):
        check(x, out)
        calls.append(("fwd", x, out))
        if fail:
            raise RuntimeError("fake quack failed")
        out.copy_(torch.softmax(x.double(), -1))

    def softmax_backward(dy, y, dx):
        check(dy, y, dx)
        calls.append(("bwd", dy, y, dx))
        if fail:
            raise RuntimeError("fake quack failed")
        dyd, yd = dy.double(), y.double()
        dx.copy_(yd * (dyd - (yd * dyd).sum(-1, keepdim=True)))

    package = types.ModuleType("quack")
    module = types.ModuleType("quack.softmax")
    module._softmax_fwd, module._softmax_backward = softmax_fwd, softmax_backward
    package.softmax = module
    return package, module


def _isolated_registry(monkeypatch):
    """The registry without quack's kernels (had the real quack registered them); registrations made
    inside the test are undone after it."""
    monkeypatch.setattr(registry, "_KERNELS", {k: v for k, v in registry._KERNELS.items() if v.backend != "quack"})
    monkeypatch.setattr(registry, "_LOADERS", {})
    monkeypatch.setattr(registry, "_BACKEND_NOTES", {})
    monkeypatch.setattr(S, "_quack", None)
    monkeypatch.setattr(S, "quack_import_error", None)


def _install(monkeypatch, calls, fail=False):
    package, module = _fake_quack_modules(calls, fail)
    monkeypatch.setitem(sys.modules, "quack", package)
    monkeypatch.setitem(sys.modules, "quack.softmax", module)


@pytest.fixture(autouse=True)
def fresh_plans():
    clear_plan_cache()
    yield
    clear_plan_cache()


@pytest.fixture
def fake_quack(monkeypatch):
    """The fake quack registered as the quack backend, on a pretend sm_90 GPU; yields its calls."""
    calls = []
    _isolated_registry(monkeypatch)
    _install(monkeypatch, calls)
    assert S.register_quack()
    monkeypatch.setattr(S, "_capability", lambda device: (9, 0) if device.type == "cuda" else None)
    yield calls


def _rows():
    return [k.row() for k in trainops.kernels()]


# ---- registration --------------------------------------------------------------------------------

def test_without_quack_nothing_is_registered(monkeypatch):
    # decided now, not at collection (the loader has not run then): no import tried where there is no quack
    if S._quack_findable() and S.register_quack():
        pytest.skip("quack is installed: the registry holds its kernels")
    before = _rows()
    assert not any(r["backend"] == "quack" for r in before)
    _isolated_registry(monkeypatch)
    monkeypatch.setitem(sys.modules, "quack", None)   # `import quack` raises ImportError
    with warnings.catch_warnings():
        warnings.simplefilter("error")                # a failed import says nothing
        assert not S.register_quack()
    assert _rows() == before
    assert "ImportError" in S.quack_import_error or "ModuleNotFoundError" in S.quack_import_error
    with pytest.raises(trainops.UnsupportedError, match="no quack kernel is registered.*trainops\\[quack\\]"):
        with trainops.backend("quack"):
            trainops.plan("softmax", shape=(4, LONG), dim=-1, dtype=torch.bfloat16, device="cuda")
    p = trainops.plan("softmax", shape=(4, LONG), dim=-1, dtype=torch.bfloat16, device="cuda")
    assert p.info.backend == "triton"


def test_no_quack_package_leaves_no_note(monkeypatch):
    """Without any quack package, the rule's own register_quack() call (quack_beats_triton on an sm_90
    long bf16 row) registers nothing and notes nothing: no "a quack package is on the path" warning
    in ``backend_notes()`` / ``python -m trainops env``."""
    _isolated_registry(monkeypatch)
    monkeypatch.setitem(sys.modules, "quack", None)   # `import quack` raises ModuleNotFoundError(name="quack")
    monkeypatch.setattr(S, "_capability", lambda device: (9, 0))
    p = S._describe("softmax", (4, LONG), -1, torch.bfloat16, "cuda")
    assert S.choose_backend(p) is None
    assert "quack" not in registry.backend_notes()


def test_a_quack_without_the_softmax_api_registers_nothing(monkeypatch):
    before = [r for r in _rows() if r["backend"] != "quack"]
    _isolated_registry(monkeypatch)
    package, module = _fake_quack_modules([])
    del module._softmax_backward                      # another quack version's API
    monkeypatch.setitem(sys.modules, "quack", package)
    monkeypatch.setitem(sys.modules, "quack.softmax", module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not S.register_quack()
    assert "AttributeError" in S.quack_import_error and _rows() == before


def test_quack_is_imported_only_where_needed(monkeypatch):
    """import trainops leaves quack unimported (a loader is registered where a quack package is on the
    path); the first listing, a pinned look-up or a problem the rule puts on quack imports it."""
    monkeypatch.setattr(S, "_capability", lambda device: (9, 0))
    for trigger in ("listing", "pinned", "chosen"):
        _isolated_registry(monkeypatch)
        _install(monkeypatch, [])
        assert S._quack_findable()
        registry.register_loader("quack", S.register_quack)   # what ops/softmax.py does at import
        clear_plan_cache()
        assert _backend("softmax", (4, SHORT)) == "triton" and _backend("softmax", (4, LONG), device="cpu") == "cpu"
        assert _backend("log_softmax", (4, LONG)) == "triton" and S._quack is None
        if trigger == "listing":
            assert any(r["backend"] == "quack" for r in _rows())
        elif trigger == "pinned":
            with trainops.backend("quack"):
                assert trainops.lookup("softmax", "cuda", torch.bfloat16).backend == "quack"
        else:
            assert _backend("softmax", (4, LONG)) == "quack"
        assert S._quack is sys.modules["quack.softmax"] and registry._LOADERS.get("quack") in (None, [])
    monkeypatch.setitem(sys.modules, "quack", None)
    assert not S._quack_findable()


def test_registration_with_quack(fake_quack):
    rows = [r for r in _rows() if r["backend"] == "quack"]
    assert [(r["op"], r["kernel"], r["devices"], r["dtypes"], r["deterministic"]) for r in rows] == [
        ("softmax", "softmax_quack", "cuda", "float32,float16,bfloat16", "yes"),
        ("softmax_backward", "softmax_backward_quack", "cuda", "float32,float16,bfloat16", "yes")]
    assert S.register_quack()                         # a second call registers nothing twice
    assert len([r for r in _rows() if r["backend"] == "quack"]) == 2
    with trainops.backend("quack"):
        assert trainops.lookup("softmax", "cuda", torch.float32).name == "softmax_quack"
        for op, device, dtype in [("log_softmax", "cuda", torch.bfloat16), ("softmax", "cuda", torch.float64),
                                  ("softmax", "cpu", torch.bfloat16)]:
            with pytest.raises(trainops.UnsupportedError, match="quack"):
                trainops.lookup(op, device, dtype)


def test_cli_kernels_lists_quack_and_the_rule(fake_quack, capsys):
    from trainops.__main__ import main
    main(["kernels"])
    out = capsys.readouterr().out
    assert "softmax_quack" in out and "softmax_backward_quack" in out
    assert "softmax: quack's kernels on bf16 / fp16 CUDA (sm_90)" in out


# ---- the choice ---------------------------------------------------------------------------------

def _backend(op="softmax", shape=(4, LONG), dim=-1, dtype=torch.bfloat16, device="cuda", **kwargs):
    return trainops.plan(op, shape=shape, dim=dim, dtype=dtype, device=device, **kwargs).info.backend


@pytest.mark.parametrize("op", ["softmax", "softmax_backward"])
def test_choice_on_the_rule_boundary(fake_quack, op):
    # the H200 probes of 2026-11-30: quack faster from 16384 columns forward to 524288 (the longest); backward
    # from 24576, except where Triton's one-tile backward (up to 32768) is faster (32000, 32768 measured)
    step = MULTIPLES[op] if MULTIPLES[op] > 1 else 8     # the next length the multiple (or quack's vectors) allows
    for first, last in RANGES[op]:
        below, above = first - step, last + step
        for n in (below, first, last, above):    # lengths quack's kernels run, on the multiple: only the range decides
            assert S.quack_unsupported(S._describe(op, (4, n), -1, torch.bfloat16, "cuda")) is None, n
            assert n % MULTIPLES[op] == 0, n
        assert _backend(op, (4, below)) == "triton", below
        assert _backend(op, (4, first)) == "quack", first
        assert _backend(op, (4, last)) == "quack", last
        assert _backend(op, (4, above)) == "triton", above
    assert _backend(op, (4, SHORT)) == "triton"
    assert _backend(op, (2, 3, 40960)) == "quack"                        # any rank, viewed as (rows, N)
    assert _backend(op, (LONG,)) == "quack"                              # one row
    assert _backend(op, (2, 1, LONG), strides=(LONG, 7, 1)) == "quack"   # a size-1 axis's stride does not matter
    assert _backend(op, (4, LONG), dtype=torch.float16) == "quack"
    for dtype in (torch.float32, torch.float64):                         # not measured / not quack's
        assert _backend(op, (4, LONG), dtype=dtype) == "triton"
    assert _backend(op, (4, LONG), out_dtype=torch.float32) == "triton"  # softmax(x, dtype=...): another dtype
    assert _backend(op, (4, LONG, 2), dim=1) == "triton"                 # not the last axis
    assert _backend(op, (LONG, 4), dim=0) == "triton"
    assert _backend(op, (4, LONG), strides=(1, 4)) == "triton"           # transposed
    assert _backend(op, (4, LONG), strides=(2 * LONG, 1)) == "triton"    # rows of a wider tensor
    assert _backend(op, (4, LONG), strides=(0, 1)) == "triton"           # expanded
    assert _backend(op, (4, LONG), device="cpu") == "cpu"                # the CPU: its default
    with trainops.backend("triton"):
        assert _backend(op, (4, LONG)) == "triton"                       # a pinned backend wins
    for columns in ({op: ()}, {}):                         # no range, or the op left out: Triton
        with trainops.heuristics(S.SoftmaxHeuristics(quack_columns=columns)):
            assert _backend(op, (4, LONG)) == "triton"
    other = "softmax_backward" if op == "softmax" else "softmax"
    # 128 columns: the multiple turned off (1), so that only the moved range decides
    with trainops.heuristics(S.SoftmaxHeuristics(quack_columns={op: ((64, 128),), other: ()},
                                                 quack_column_multiple=NO_MULTIPLE)):
        assert _backend(op, (4, 128)) == "quack" and _backend(op, (4, LONG)) == "triton"
        assert _backend(other, (4, 128)) == "triton"      # per op: the other op's range is its own


def test_choice_row_length_multiple_forward(fake_quack):
    """Inside the forward's range, among lengths quack's kernels run (multiples of 8), only multiples of
    8192 go to quack: quack's forward returned NaN at 151936 (18.5 x 8192) on the H200; 32760 (correct
    there, and faster) is lost with it. A multiple of 1 turns the condition off; a pinned quack ignores it."""
    op = "softmax"
    off, on = (151936, 24584, 32760), (40960, 57344)
    for n in off + on:
        assert S.quack_unsupported(S._describe(op, (4, n), -1, torch.bfloat16, "cuda")) is None, n
        (low, high), = RANGES[op]
        assert low <= n <= high, n                        # inside the range: only the multiple decides
    for n in off:
        assert _backend(op, (4, n)) == "triton", n
        assert _backend(op, (4, n), dtype=torch.float16) == "triton", n
        assert S.choose_backend(S._describe(op, (4, n), -1, torch.bfloat16, "cuda")) is None, n
    for n in on:
        assert _backend(op, (4, n)) == "quack", n
    assert S.QUACK_COLUMN_MULTIPLE == MULTIPLES == S.SoftmaxHeuristics().quack_column_multiple
    with trainops.heuristics(S.SoftmaxHeuristics(quack_column_multiple=NO_MULTIPLE)):   # 1: no condition
        for n in (32760, 24584, 40960):
            assert _backend(op, (4, n)) == "quack", n
        assert _backend(op, (4, 151936)) == "triton"      # quack_forward_fills_every_warp still says no
    with trainops.heuristics(S.SoftmaxHeuristics(quack_column_multiple={"softmax_backward": 1})):
        assert _backend(op, (4, 32760)) == "triton"       # the op left out: QUACK_COLUMN_MULTIPLE's 8192
        assert _backend(op, (4, 40960)) == "quack"
    with trainops.heuristics(S.SoftmaxHeuristics(quack_column_multiple={op: 8})):
        assert _backend(op, (4, 32760)) == "quack"
        assert _backend(op, (4, 151936)) == "triton"
    with trainops.backend("quack"):                       # pinned: the rule is not asked
        assert _backend(op, (4, 151936)) == "quack"
        assert _backend(op, (4, 32760)) == "quack"
    for bad in ({op: 0}, {op: -8192}, {op: 8192.0}, {op: True}, 8192, (8192, 1), {"log_softmax": 8192},
                {"Softmax": 8192}):
        with pytest.raises(trainops.InvalidProblemError, match="quack_column_multiple"):
            S.SoftmaxHeuristics(quack_column_multiple=bad)


# quack-kernels 0.6.5's forward at each row length measured on the H200 (2026-11-30, bf16): right or NaN
QUACK_FORWARD_MEASURED = {8192: True, 16384: True, 24576: True, 32000: True, 32760: True, 32768: True, 40960: True,
                          49152: True, 50264: True, 57344: True, 65536: True, 98304: True, 128256: True,
                          131072: True, 151936: False, 152064: False, 163840: True, 262144: True, 524288: True}


def test_quack_forward_model_explains_every_measured_length():
    """quack_forward_fills_every_warp (quack's tiling: a warp with no column of the row makes the row
    NaN) says right / NaN exactly where the H200 measured it, in both 16-bit dtypes; and it puts the
    multiples of 8192 it predicts NaN at (139264 = 17 x 8192, never measured) on Triton forward."""
    for n, right in QUACK_FORWARD_MEASURED.items():
        assert S.quack_forward_fills_every_warp(n, 2) is right, n
    unsafe = [n for n in range(16384, 524289, 8192) if not S.quack_forward_fills_every_warp(n, 2)]
    assert unsafe == [139264, 147456, 172032, 180224, 204800, 212992, 237568, 245760, 270336, 303104, 335872,
                      368640]


def test_choice_forward_follows_the_model(fake_quack):
    for n in (139264, 245760, 368640):          # multiples of 8192 in range, NaN by the model
        assert S.quack_unsupported(S._describe("softmax", (4, n), -1, torch.bfloat16, "cuda")) is None, n
        assert _backend("softmax", (4, n)) == "triton", n
        assert _backend("softmax", (4, n), dtype=torch.float16) == "triton", n
        assert _backend("softmax_backward", (4, n)) == "quack", n   # no exp of a -inf maximum backward
    for n in (131072, 163840, 262144, 376832):
        assert _backend("softmax", (4, n)) == "quack", n


def test_choice_backward_has_no_multiple(fake_quack):
    """quack's backward was correct at every length probed (151936 among them, where its forward was not):
    in-range lengths that are no multiple of 8192 go to quack backward; a forward multiple moves nothing
    backward."""
    for n in (24584, 28672, 40968, 50264, 100352, 128256, 151936, 152064, 256000):
        assert _backend("softmax_backward", (4, n)) == "quack", n
    with trainops.heuristics(S.SoftmaxHeuristics(quack_column_multiple={"softmax": 8192})):
        assert _backend("softmax_backward", (4, 151936)) == "quack"
    with trainops.heuristics(S.SoftmaxHeuristics(quack_column_multiple={"softmax_backward": 8192})):
        assert _backend("softmax_backward", (4, 151936)) == "triton"
        assert _backend("softmax_backward", (4, 40960)) == "quack"


def test_choice_forward_and_backward_ranges_differ(fake_quack):
    """16384 columns: quack forward, Triton backward (quack's backward was not faster at 16384; nothing
    measured between 16384 and 24576); 32000 and 32768: Triton's one-tile backward beat quack's; 151936:
    quack backward only (its forward's NaN)."""
    assert (_backend("softmax", (4, 16384)), _backend("softmax_backward", (4, 16384))) == ("quack", "triton")
    # 16392 and 24568 are in the forward range but not multiples of 8192, and below the backward's range:
    # Triton both ways; with the multiple off, the forward's range alone puts them on quack
    for n in (16392, 24568):
        assert (_backend("softmax", (4, n)), _backend("softmax_backward", (4, n))) == ("triton", "triton"), n
        with trainops.heuristics(S.SoftmaxHeuristics(quack_column_multiple=NO_MULTIPLE)):
            assert (_backend("softmax", (4, n)), _backend("softmax_backward", (4, n))) == ("quack", "triton"), n
    assert (_backend("softmax", (4, 32768)), _backend("softmax_backward", (4, 32768))) == ("quack", "triton")
    assert (_backend("softmax", (4, 32000)), _backend("softmax_backward", (4, 32000))) == ("triton", "triton")
    assert (_backend("softmax", (4, 151936)), _backend("softmax_backward", (4, 151936))) == ("triton", "quack")
    for n in (24576, 40960, 524288):
        assert (_backend("softmax", (4, n)), _backend("softmax_backward", (4, n))) == ("quack", "quack"), n
    assert S.SoftmaxHeuristics().quack_columns == RANGES == S.QUACK_COLUMNS
    assert S.SoftmaxHeuristics().quack_columns is not S.SoftmaxHeuristics().quack_columns   # a copy each
    assert S.SoftmaxHeuristics().quack_column_multiple is not S.SoftmaxHeuristics().quack_column_multiple


def test_choice_one_input_off_layout_backward(fake_quack):
    """Backward: dy and y must both be contiguous."""
    contiguous, transposed = (LONG, 1), (1, 4)
    assert _backend("softmax_backward", strides=(contiguous, contiguous)) == "quack"
    assert _backend("softmax_backward", strides=(contiguous, transposed)) == "triton"
    assert _backend("softmax_backward", strides=(transposed, contiguous)) == "triton"


def test_choice_log_softmax_never_quack(fake_quack):
    for op in ("log_softmax", "log_softmax_backward"):
        assert _backend(op, (4, LONG)) == "triton"
        assert registry.op_spec(op).choose_backend is None


def test_choice_other_gpus_stay_on_triton(fake_quack, monkeypatch):
    for capability in [(8, 0), (10, 0), (12, 0), None]:
        monkeypatch.setattr(S, "_capability", lambda device, c=capability: c)
        clear_plan_cache()
        assert _backend("softmax", (4, LONG)) == "triton", capability


def test_choice_function_on_problems(fake_quack):
    """choose_backend itself: "quack" or None (the device's default), as QUACK_COLUMNS says."""
    problem = S._describe("softmax", (4, LONG), -1, torch.bfloat16, "cuda")
    assert S.choose_backend(problem) == "quack"
    assert S.choose_backend(S._describe("softmax", (4, SHORT), -1, torch.bfloat16, "cuda")) is None
    assert S.choose_backend(S._describe("softmax_backward", (4, 16384), -1, torch.bfloat16, "cuda")) is None
    assert S.choose_backend(S._describe("softmax", (4, 151936), -1, torch.bfloat16, "cuda")) is None
    assert S.choose_backend(S._describe("softmax", (4, LONG), -1, torch.bfloat16, "cpu")) is None


# ---- the wrapper --------------------------------------------------------------------------------

def _launch(op, shape, dtype=torch.bfloat16):
    p = trainops.plan(op, shape=shape, dim=-1, dtype=dtype, device="cuda")
    assert p.info.backend == "quack" and p.kernel.backend == "quack"
    return p


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wrapper_calls_quack_on_row_views(fake_quack, dtype):
    """The launch views each contiguous operand as (rows, N) in place, forward and backward (run
    here on CPU tensors: the plan is for CUDA, its launch only takes pointers and views)."""
    shape = (2, 3, LONG)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    p = _launch("softmax", shape, dtype)
    assert p.kernel["rows"] == 6 and p.kernel["N"] == LONG and p.kernel["align_bytes"] == 16
    assert p.precision.deterministic and p.precision.accumulator == torch.float32
    y = torch.full(shape, float("nan"), dtype=dtype)
    p.launch.run((x,), y)
    (kind, qx, qout), = fake_quack
    assert kind == "fwd" and qx.shape == qout.shape == (6, LONG)
    assert qx.data_ptr() == x.data_ptr() and qout.data_ptr() == y.data_ptr()
    assert_close(y, torch.softmax(x.double(), -1), dtype, "forward")

    dy = torch.randn(shape, generator=gen).to(dtype)
    dx = torch.full(shape, float("nan"), dtype=dtype)
    _launch("softmax_backward", shape, dtype).launch.run((dy, y), dx)
    kind, qdy, qy, qdx = fake_quack[-1]
    assert kind == "bwd" and qdy.shape == qy.shape == qdx.shape == (6, LONG)
    assert (qdy.data_ptr(), qy.data_ptr(), qdx.data_ptr()) == (dy.data_ptr(), y.data_ptr(), dx.data_ptr())
    yd, dyd = y.double(), dy.double()
    assert_close(dx, yd * (dyd - (yd * dyd).sum(-1, keepdim=True)), dtype, "backward")


def test_wrapper_empty_problem_calls_nothing(fake_quack):
    p = trainops.plan("softmax", shape=(0, LONG), dim=-1, dtype=torch.bfloat16, device="cuda")
    assert p.info.backend == "quack"
    p.launch.run((torch.empty(0, LONG, dtype=torch.bfloat16),), torch.empty(0, LONG, dtype=torch.bfloat16))
    assert fake_quack == []


def test_rows_quack_cannot_load_in_vectors_stay_on_triton(fake_quack):
    """quack loads rows in 16-byte vectors (it asserts N % (16 / element size) == 0 when it compiles):
    a row length off it inside the rule's range goes to Triton, and a pinned quack refuses it. (The
    multiple of 8192 turned off, so that only the vectors decide.)"""
    with trainops.heuristics(S.SoftmaxHeuristics(quack_column_multiple=NO_MULTIPLE)):
        for n in (LONG + 1, LONG + 4, 151937, 262144 - 2):
            assert _backend("softmax", (4, n)) == "triton", n
            assert _backend("softmax_backward", (4, n)) == "triton", n
        assert _backend("softmax", (4, LONG + 8)) == "quack"
        assert _backend("softmax_backward", (4, LONG + 8)) == "quack"
    with trainops.backend("quack"):
        assert _backend("softmax", (4, 1004), dtype=torch.float32) == "quack"     # float32: vectors of 4
        for dtype in (torch.bfloat16, torch.float16):
            with pytest.raises(trainops.UnsupportedError, match="argument 'shape'.*multiple of 8"):
                _backend("softmax", (4, 1004), dtype=dtype)


@pytest.mark.skipif(not registry.triton_interpreting(), reason="runs the Triton plan on CPU tensors")
@pytest.mark.parametrize("op", ["softmax", "softmax_backward"])
def test_unaligned_inputs_are_planned_on_triton_visibly(fake_quack, op, monkeypatch):
    """A view at an odd storage offset is off quack's assumed 16-byte boundary: its descriptor says
    so (align), the rule puts it on Triton, and the plan and track_kernels name Triton; quack is not
    called. (The plans run here on CPU tensors: the descriptor is made for CUDA.)"""
    shape = (2, LONG)
    assert _backend(op, shape, align=2) == "triton" and _backend(op, shape, align=16) == "quack"
    with trainops.backend("quack"):
        with pytest.raises(trainops.UnsupportedError, match="argument 'align'"):
            _backend(op, shape, align=8)
    gen = torch.Generator().manual_seed(1)
    flat = (torch.randn(2 * LONG + 1, generator=gen) * 3).to(torch.bfloat16)
    x = flat[1:].view(shape)
    assert S.pointer_align([x]) == 2 and S.pointer_align([flat]) == 16
    cuda = torch.device("cuda")
    real_descriptor_of = S.descriptor_of
    # descriptor_of on these CPU tensors, as on CUDA ones (the CPU's own backend never reaches quack)
    monkeypatch.setattr(S, "descriptor_of", lambda o, ts, dim, out_dtype=None: real_descriptor_of(
        o, ts, dim, out_dtype)._replace(device=cuda))
    monkeypatch.setattr(S.SoftmaxProblem, "new_output", lambda self: torch.empty_strided(
        self.shape, self.out_strides, dtype=self.out_dtype))
    with trainops.track_kernels() as used:
        if op == "softmax":
            y = S._softmax_impl(x, -1)
            expected = torch.softmax(x.double(), -1)
        else:
            dy = torch.randn(shape, generator=gen).to(torch.bfloat16)
            y = S._softmax_backward_impl(dy, x, -1)
            expected = x.double() * (dy.double() - (x.double() * dy.double()).sum(-1, keepdim=True))
    assert fake_quack == []
    assert [(o, backend) for o, backend, _, _ in used] == [(op, "triton")]
    assert_close(y, expected, torch.bfloat16, f"unaligned {op}")
    with trainops.track_kernels() as used:                 # the aligned tensor: quack, counted as quack
        S._softmax_impl(flat[:-1].view(shape), -1) if op == "softmax" else S._softmax_backward_impl(
            flat[:-1].view(shape), flat[:-1].view(shape), -1)
    assert [(o, backend) for o, backend, _, _ in used] == [(op, "quack")] and len(fake_quack) == 1


def test_a_quack_plan_refuses_unaligned_operands(fake_quack):
    """Plan.run / the launch on tensors off a 16-byte boundary (not what the plan was made for): an
    error naming the operand, not another kernel run in quack's name."""
    shape = (2, LONG)
    p = _launch("softmax", shape)
    flat = torch.randn(2 * LONG + 8).to(torch.bfloat16)
    for x, y, name in [(flat[1:1 + 2 * LONG].view(shape), torch.empty(shape, dtype=torch.bfloat16), "x"),
                       (flat[:2 * LONG].view(shape), flat[4:4 + 2 * LONG].view(shape), "out")]:
        with pytest.raises(trainops.InvalidProblemError, match=f"argument '{name}'.*16-byte boundary"):
            p.launch.run((x,), y)
    assert fake_quack == []


def test_a_failed_quack_import_is_listed(monkeypatch, capsys):
    """A quack on the path that does not import registers nothing, and says why where the kernels
    are listed (python -m trainops kernels, env), not at each call."""
    _isolated_registry(monkeypatch)
    monkeypatch.setitem(sys.modules, "quack", None)
    registry.register_loader("quack", S.register_quack)
    assert "quack" in registry.backend_notes() and "did not import" in registry.backend_notes()["quack"]
    from trainops.__main__ import main
    main(["kernels"])
    assert "the quack backend: not registered" in capsys.readouterr().out
    from trainops import env
    assert any(w.startswith("the quack backend: not registered") for w in env.collect()["warnings"])


def test_quack_errors_are_raised_not_retried(monkeypatch):
    calls = []
    _isolated_registry(monkeypatch)
    _install(monkeypatch, calls, fail=True)
    assert S.register_quack()
    monkeypatch.setattr(S, "_capability", lambda device: (9, 0))
    shape = (2, LONG)
    x = torch.randn(shape).to(torch.bfloat16)
    y = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fake quack failed"):
        _launch("softmax", shape).launch.run((x,), y)
    assert len(calls) == 1 and y.isnan().all()        # nothing else wrote the output


def test_pinned_quack_refuses_what_it_cannot_run(fake_quack):
    """Pinned, quack takes any row length but only the problems its kernels run; errors name the argument."""
    with trainops.backend("quack"):
        assert _backend("softmax", (4, 1000)) == "quack"
        assert _backend("softmax", (4, 1000), dtype=torch.float32) == "quack"
        for kwargs, argument in [(dict(shape=(LONG, 4), dim=0), "dim"), (dict(shape=(), dim=0), "dim"),
                                 (dict(strides=(1, 4)), "x"), (dict(out_dtype=torch.float32), "dtype")]:
            with pytest.raises(trainops.UnsupportedError, match=f"argument '{argument}'"):
                trainops.plan("softmax", **{**dict(shape=(4, LONG), dim=-1, dtype=torch.bfloat16,
                                                   device="cuda"), **kwargs})
        with pytest.raises(trainops.UnsupportedError, match="argument 'y'"):
            trainops.plan("softmax_backward", shape=(4, LONG), dim=-1, dtype=torch.bfloat16, device="cuda",
                          strides=((LONG, 1), (1, 4)))
        with pytest.raises(trainops.UnsupportedError, match="no quack kernel"):
            trainops.plan("log_softmax", shape=(4, LONG), dim=-1, dtype=torch.bfloat16, device="cuda")


def test_cpu_tensors_never_reach_quack(fake_quack):
    x = torch.randn(2, LONG).to(torch.bfloat16).requires_grad_()
    with trainops.track_kernels() as used:
        trainops.softmax(x, -1).sum().backward()
    assert fake_quack == [] and {backend for _, backend, _, _ in used} == {"cpu"}


# ---- the GPU: quack itself --------------------------------------------------------------------------

@pytest.fixture
def real_quack():
    """quack-kernels itself, on CUDA. Decided when the test runs, by the loader (register_quack), not from
    ``S._quack`` at collection, which is None until the lazy loader has run (so quack's tests were
    skipped where it is installed). Skips without CUDA (no import tried) or where quack does not import
    (the reason says why)."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    if not S.register_quack():
        pytest.skip(f"needs quack-kernels (trainops[quack]); quack.softmax did not import: {S.quack_import_error}")
    return S._quack


# Row lengths the rule puts on quack forward (all) and backward (all but 16384): multiples of 8192 from
# 16384 to 524288, among them lengths never probed (40960, 57344, 98304, 163840).
GPU_SHAPES = [(512, 16384), (256, 24576), (128, 40960), (128, 57344), (64, 98304), (32, 163840), (16, 524288)]


def _needs_sm90():
    if torch.cuda.get_device_capability() not in S.QUACK_MEASURED_CAPABILITIES:
        pytest.skip("the rule puts quack on sm_90 only")


def _run_against_float64(shape, dtype, what):
    """trainops.softmax forward and backward on random rows: the kernels used (track_kernels), and the
    results finite and within the dtype's tolerance of float64."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, device="cuda", generator=gen) * 3).to(dtype).requires_grad_()
    dy = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    with trainops.track_kernels() as used:
        y = trainops.softmax(x, -1)
        y.backward(dy)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all(), f"{what} forward: {(~torch.isfinite(y)).sum().item()} non-finite"
    assert torch.isfinite(x.grad).all(), f"{what} backward: {(~torch.isfinite(x.grad)).sum().item()} non-finite"
    assert_close(y, torch.softmax(x.detach().double(), -1), dtype, f"{what} forward")
    dyd = dy.double()
    # the reference backward from the kernel's own y (what autograd saved), in float64
    y64 = y.detach().double()
    assert_close(x.grad, y64 * (dyd - (y64 * dyd).sum(-1, keepdim=True)), dtype, f"{what} backward")
    return {(op, backend) for op, backend, _, _ in used}, x, y


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_quack_against_float64(real_quack, shape, dtype):
    _needs_sm90()
    expected = {"softmax": "quack", "softmax_backward": "quack" if shape[-1] > 16384 else "triton"}
    for op, backend in expected.items():
        p = trainops.plan(op, shape=shape, dim=-1, dtype=dtype, device="cuda")
        assert p.info.backend == backend, (op, p.kernel)
    used, x, y = _run_against_float64(shape, dtype, f"{shape} {dtype}")
    assert used == set(expected.items())
    again = trainops.softmax(x.detach(), -1)
    assert torch.equal(again, y.detach())              # bit-identical run to run
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [139264, 147456, 163840, 32000])
def test_gpu_quack_forward_matches_the_model(real_quack, n):
    """quack_forward_fills_every_warp against quack's own forward (pinned) on the GPU: NaN exactly where
    the model says a warp gets no column (139264, 147456: multiples of 8192 never measured before the
    model), right elsewhere; trainops's default forward is finite either way."""
    _needs_sm90()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((64, n), device="cuda", generator=gen).to(torch.bfloat16)
    with trainops.backend("quack"):
        y = trainops.softmax(x, -1)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(y).all()) is S.quack_forward_fills_every_warp(n, 2), n
    assert torch.isfinite(trainops.softmax(x, -1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [151936, 128256, 50264])
def test_gpu_vocabulary_rows_forward_on_triton_backward_on_quack(real_quack, n):
    """quack-kernels 0.6.5's forward returned NaN at 883x151936 and 2048x151936 bf16 on the H200
    (2026-11-30; cause not found): the forward's multiple of 8192 keeps such rows on Triton; quack's
    backward was right at every length probed, so it runs them. Results finite and within tolerance."""
    _needs_sm90()
    shape, dtype = (64, n), torch.bfloat16
    expected = {"softmax": "triton", "softmax_backward": "quack"}
    for op, backend in expected.items():
        assert trainops.plan(op, shape=shape, dim=-1, dtype=dtype, device="cuda").info.backend == backend, op
    used, _, _ = _run_against_float64(shape, dtype, f"64x{n} bfloat16")
    assert used == set(expected.items())
