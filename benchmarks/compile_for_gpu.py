"""Compile, on a machine without a GPU, every Triton kernel that the op families launch in float64
for an sm_90 target: the check that CPU CI (the interpreter) cannot make, and that found float64
cross-entropy, attention softmax and dropout failing to compile on the GPU (NOTES, "float64
cross-entropy did not compile on the GPU").

    python benchmarks/compile_for_gpu.py [--dtype float64]

Step 1 (this process, Triton's interpreter): run the cases of tests/test_multi_device.py (every
family, forward + backward) in ``--dtype`` on CPU tensors with the Triton backend pinned, and
record each distinct launch (``record_triton_launches.py``: kernel, argument kinds: pointer
dtypes, integer widths, constexprs). That module also records over the test suite, as a pytest
plugin (its docstring); step 2 then compiles those. Step 2 (a subprocess without the interpreter): compile each recorded launch with
``triton.compile`` for ``GPUTarget("cuda", 90, 32)``. Integers are typed by width only (no
``== 1`` specialisation), so this checks compilation, not the exact binaries a GPU run makes.
Prints the kernels that fail with the compiler's message; exit status 1 if any. Triton 3.6's
interpreter fails under numpy 2.4 (CI pins numpy < 2.4 for it); to compile with 3.6, record with
a newer Triton and run step 2 alone: ``python benchmarks/compile_for_gpu.py --compile RECORDS``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def record(dtype_name: str, path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    sys.path.insert(0, HERE)
    import torch

    import trainops
    from record_triton_launches import install
    from test_multi_device import CASES, DIFFERENTIABLE, _values

    dtype = getattr(torch, dtype_name)
    launches: dict = {}
    install(launches)
    failed = {}
    with trainops.backend("triton"):
        for name, case in sorted(CASES.items()):
            values = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in _values("cpu").items()}
            t = {k: v.clone().requires_grad_(k in DIFFERENTIABLE and v.is_floating_point()) for k, v in values.items()}
            try:
                case(t).float().backward()
            except Exception as e:  # noqa: BLE001 - reported, the rest still recorded
                failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
    print(f"{len(CASES)} cases in {dtype_name}, {len(launches)} distinct launches; failed under the interpreter: "
          f"{failed or 'none'}", flush=True)
    with open(path, "wb") as f:
        pickle.dump(launches, f)


def compile_all(path: str) -> int:
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import trainops  # noqa: F401 (registers the kernels' modules)

    pointers = {"torch.float64": "*fp64", "torch.float32": "*fp32", "torch.float16": "*fp16",
                "torch.bfloat16": "*bf16", "torch.int64": "*i64", "torch.int32": "*i32", "torch.int16": "*i16",
                "torch.int8": "*i8", "torch.uint8": "*u8", "torch.bool": "*i1"}
    dtypes = {str(d): d for d in (tl.float64, tl.float32, tl.float16, tl.bfloat16, tl.int64, tl.int32, tl.int16,
                                  tl.int8, tl.uint8, tl.int1, tl.uint32, tl.uint64)}

    def constexpr(k):
        return {"dtype": lambda: dtypes[k[1]], "bool": lambda: k[1], "str": lambda: k[1], "float": lambda: k[1],
                "int": lambda: k[2], "none": lambda: None}[k[0]]()

    with open(path, "rb") as f:
        launches = pickle.load(f)
    target = GPUTarget("cuda", 90, 32)
    compiled, failures = 0, []
    for (module, name, arguments), _ in sorted(launches.items()):
        fn = getattr(importlib.import_module(module), name)
        arguments = dict(arguments)
        signature, constexprs = {}, {}
        try:
            for p in fn.params:
                k = arguments.get(p.name, ("none",))
                if p.is_constexpr or k[0] == "none":
                    signature[p.name] = "constexpr"
                    constexprs[(p.num,)] = constexpr(k)
                else:
                    signature[p.name] = {"ptr": lambda: pointers[k[1]], "int": lambda: k[1], "float": lambda: "fp32",
                                         "bool": lambda: "i1"}[k[0]]()
            triton.compile(ASTSource(fn, signature, constexprs), target=target)
            compiled += 1
        except Exception as e:  # noqa: BLE001 - every failure reported
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            failures.append(f"{module}.{name}: {type(cause).__name__}: {str(cause)[-300:]}".replace("\n", " | "))
    print(f"compiled {compiled} of {len(launches)} for sm_90 (Triton {triton.__version__})")
    for line in failures:
        print("FAILED", line)
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float64")
    parser.add_argument("--compile", metavar="RECORDS", help="step 2 alone, on a file of step 1's records")
    parser.add_argument("--keep", metavar="RECORDS", help="step 1: also write the records here")
    args = parser.parse_args(argv)
    if args.compile:
        return compile_all(args.compile)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.pkl")
        record(args.dtype, path)
        if args.keep:
            with open(path, "rb") as src, open(args.keep, "wb") as dst:
                dst.write(src.read())
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = os.path.join(tmp, "cache")
        return subprocess.run([sys.executable, os.path.abspath(__file__), "--compile", path], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
