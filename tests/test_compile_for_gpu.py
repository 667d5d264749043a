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
import subprocess
import sys
import textwrap

import pytest

from trainops.registry import triton_available

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
    script = tmp_path / "compile_helpers.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:4] == ["compiled fp64", "compiled fp32", "compiled tile True",
                                           "compiled tile False"], done.stdout
