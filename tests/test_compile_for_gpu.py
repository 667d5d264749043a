"""Kernels compiled for a GPU target on the CPU (no GPU needed): CI runs the Triton kernels under
the interpreter, which accepts code that Triton's compiler refuses. Found on the H200: float64
cross-entropy failed to compile there ("Inconsistent return types: fp64 and fp32"), because the
compiler also generates the code after an ``if ACC == tl.float64: return ...`` in ``from_bits``,
while every CPU test passed; softmax's ``_tile`` had the same pattern (64-bit offsets from 32-bit
strides). Here the compiler's front end and code generation run for an sm_90 target in a process
without the interpreter. ``benchmarks/compile_for_gpu.py`` does the same for every kernel that the
op families launch in float64.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from trainops.registry import triton_available


def _compile_offline(tmp_path, name: str, source: str, **env_extra: str) -> subprocess.CompletedProcess:
    """Run ``source`` as a script in a fresh process without Triton's interpreter (its own Triton
    cache under tmp_path, plus ``env_extra``) and check that it exited 0; returns the process."""
    script = tmp_path / name
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), **env_extra)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done

_SCRIPT = textwrap.dedent('''
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trainops.ops._common import from_bits
    from trainops.ops.softmax import _tile

    @triton.jit
    def float_constant(out, bits, ACC: tl.constexpr):
        tl.store(out, from_bits(bits, ACC))

    @triton.jit
    def tile_offsets(out, s_i, s_n, WIDE: tl.constexpr):
        offsets = _tile(tl.arange(0, 16), tl.arange(0, 16), s_i, s_n, WIDE)
        tl.store(out + tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :], offsets.to(tl.int64))

    target = GPUTarget("cuda", 90, 32)
    for acc, pointer, integer in [(tl.float64, "*fp64", "i64"), (tl.float32, "*fp32", "i32")]:
        source = ASTSource(float_constant, {"out": pointer, "bits": integer, "ACC": "constexpr"}, {(2,): acc})
        triton.compile(source, target=target)
        print("compiled", acc)
    # softmax's tile offsets: 64-bit (WIDE) from 32-bit strides, as a tile of 2**31 elements or more
    # over a non-last axis gets them; and 32-bit
    for wide in (True, False):
        signature = {"out": "*i64", "s_i": "i32", "s_n": "i32", "WIDE": "constexpr"}
        triton.compile(ASTSource(tile_offsets, signature, {(3,): wide}), target=target)
        print("compiled tile", wide)
''')


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_helpers_of_two_return_types_compile_for_the_gpu_with_triton(tmp_path):
    done = _compile_offline(tmp_path, "compile_helpers.py", _SCRIPT)
    assert done.stdout.split("\n")[:4] == ["compiled fp64", "compiled fp32", "compiled tile True",
                                           "compiled tile False"], done.stdout


_OCCUPANCY_SCRIPT = textwrap.dedent('''
    import re, sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trainops.ops.softmax import SoftmaxHeuristics, _softmax_bwd_exchange, _softmax_fwd_exchange

    h = SoftmaxHeuristics()
    block = h.exchange_tile[2]
    kernels = ((_softmax_fwd_exchange, "softmax", False, ("x", "y")),
               (_softmax_bwd_exchange, "softmax_backward", True, ("dy", "y", "dx")))
    for kernel, op, backward, operands in kernels:
        warps = h.exchange_warps[op]
        for splits in (16, 32):   # bf16 rows of 131072 and 262144 elements, contiguous, 1024 rows
            n = splits * block
            values = dict(ws_ptr="*fp32", count_ptr="*i32", N=n, INNER=1, OUTER1=1, ROWS=1024)
            for name in operands:
                values.update({name + "_ptr": "*bf16", name + "_base": 0, name + "_so0": n, name + "_so1": 0,
                               name + "_si": 0, name + "_sn": 1})
            meta = dict(LOG=False, ACC=tl.float32, BLOCK_N=block, WIDE=False, SPLITS=splits, SPLITS_P2=splits,
                        PHASE=0, VEC=0)
            signature, constants, attrs = {}, {}, {}
            for p in kernel.params:   # the launch's specialisation: 16-byte pointers, ints == 1 or % 16
                value = meta.get(p.name, values.get(p.name))
                if p.name in meta or value == 1:
                    signature[p.name] = "constexpr"
                    constants[(p.num,)] = value
                else:
                    signature[p.name] = value if isinstance(value, str) else "i32"
                    if isinstance(value, str) or value % 16 == 0:
                        attrs[(p.num,)] = [["tt.divisibility", 16]]
            triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps))
            sys.stdout.flush()
            print("asked", op, splits, h.exchange_per_sm[backward], warps, flush=True)
''')


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_softmax_exchange_fits_its_programs_per_sm_with_triton(tmp_path):
    """The softmax exchange plans ask for SoftmaxHeuristics.exchange_per_sm programs per SM (forward: 3
    of 16 warps; backward: 2 of 8), which the compiled kernels' registers must allow for the bf16 rows
    they were measured on (ExchangeGrid caps the grid by them, silently; float32 forwards get 2).
    A reordering of the kernel's plain path once took Triton 3.6 from 40 to 46 registers a thread at
    16 chunks a row: 2 programs per SM instead of 3, softmax 1024x131072 bf16 0.255 ms against 0.225
    on the H100 (benchmarks/NOTES.md). Registers as ptxas reports them compiling for sm_90 (Triton's
    own ptxas, log dumped); 65536 a SM, allocated 8 a thread at a time."""
    done = _compile_offline(tmp_path, "occupancy.py", _OCCUPANCY_SCRIPT, TRITON_DUMP_PTXAS_LOG="1")
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", done.stdout)]
    asked = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("asked")]
    assert len(registers) == len(asked) == 4, done.stdout[-3000:]
    for used, (op, splits, per_sm, warps) in zip(registers, asked):
        allocated = -(-used // 8) * 8
        assert 65536 // (allocated * 32 * int(warps)) >= int(per_sm), (op, splits, used, done.stdout[-2000:])


_FLAT_ACTIVATION_SCRIPT = textwrap.dedent('''
    import re
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trainops.ops.activations import SILU, ActivationHeuristics, _act_bwd_flat, _act_fwd_flat

    h = ActivationHeuristics()
    block = h.block
    warps = h.num_warps(block)
    numel = 4097 * 1000   # swiglu 4097 x 1000 fp16: 8 mod 16, so Triton marks no divisibility on it
    meta = dict(ACT=SILU, GATED=True, NEED_A=True, NEED_B=True, ACC=tl.float32, PRECISE=True, DIV_RN=True,
                INT64=False, BLOCK=block, TAIL_APART=numel % 16 != 0)   # as _prepare_triton's flat plan
    for kernel in (_act_fwd_flat, _act_bwd_flat):
        signature, constants, attrs = {}, {}, {}
        for p in kernel.params:   # the launch's specialisation: 16-byte aligned pointers, numel plain
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constants[(p.num,)] = meta[p.name]
            elif p.name == "numel":
                signature[p.name] = "i32"
            else:
                signature[p.name] = "*fp16"
                attrs[(p.num,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=1))
        ptx = compiled.asm["ptx"]
        print(kernel.__name__, block, warps, len(re.findall(r"ld\\.global\\.v4\\.b32", ptx)),
              len(re.findall(r"st\\.global\\.v4\\.b32", ptx)))
''')


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_flat_activation_blocks_vectorise_when_numel_is_not_a_multiple_of_16_with_triton(tmp_path):
    """swiglu 4097 x 1000 fp16 forward + backward took 0.052 ms against torch.compile's 0.020 on the
    H200 (the sweep's kernel time): its numel, 4,097,000, is 8 mod 16, so Triton's launch marks no
    divisibility on it, the mask ``offs < numel`` is not provably constant over a vector, and every
    load and store of the flat kernels was one 2-byte element (0 ``ld.global.v4`` in the sm_90 PTX).
    Whole blocks now run unmasked (TAIL_APART, set by the plan where numel is not a multiple of 16):
    each operand of a whole block moves in 16-byte vectors, as with a numel divisible by 16; only the
    last, partial block's accesses are masked."""
    done = _compile_offline(tmp_path, "flat_activation.py", _FLAT_ACTIVATION_SCRIPT)
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [r[0] for r in rows] == ["_act_fwd_flat", "_act_bwd_flat"], done.stdout
    for (name, block, warps, loads, stores), operands in zip(rows, ((2, 1), (3, 2))):
        vectors = int(block) * 2 // (32 * int(warps) * 16)   # 16-byte vectors of fp16 a thread, per operand
        assert int(loads) >= operands[0] * vectors and int(stores) >= operands[1] * vectors, (name, done.stdout)
