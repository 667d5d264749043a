"""Kernels compiled for a GPU target on the CPU (no GPU needed): CI runs the Triton kernels under
the interpreter, which accepts code that Triton's compiler refuses. Found on the H200: float64
cross-entropy failed to compile there ("Inconsistent return types: fp64 and fp32"), because the
compiler also generates the code after an ``if ACC == tl.float64: return ...`` in ``from_bits``,
while every CPU test passed. Here the compiler's front end and code generation run for an sm_90
target in a process without the interpreter.
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

    @triton.jit
    def float_constant(out, bits, ACC: tl.constexpr):
        tl.store(out, from_bits(bits, ACC))

    for acc, pointer, integer in [(tl.float64, "*fp64", "i64"), (tl.float32, "*fp32", "i32")]:
        source = ASTSource(float_constant, {"out": pointer, "bits": integer, "ACC": "constexpr"}, {(2,): acc})
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
        print("compiled", acc)
''')


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
def test_float_constants_compile_for_the_gpu_in_float64_and_float32_with_triton(tmp_path):
    script = tmp_path / "compile_float_constant.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["compiled fp64", "compiled fp32"], done.stdout
