"""SASS instructions of the 8-bit optimizer step (``_lowbit_blocks``, issue 41), counted offline:
the kernel compiled for sm_90 on a machine without a GPU (Triton's ptxas / nvdisasm), in the
configurations that trainops.optim's 8-bit AdamW launches.

    PYTHONPATH=src python benchmarks/count_lowbit_sass.py [--maxnreg 64] [--dump DIR] [--json PATH]

Configurations (MODE 0, AdamW, bias correction folded, 8-bit states, the default hyper-parameters
as Python floats, 16-byte aligned tables; QB = MultiTensorHeuristics.block / 256 = 8 chunks a
program, R = TILE_ELEMENTS_PER_THREAD * 32 * warps / 256 chunks a tile, maxnreg
lowbit_optimizers.MAX_REGISTERS unless --maxnreg):

    fp32            float32 parameters and gradients, no grad scale / clip / found_inf (the default
                    optimizer step; what Nsight Compute measured)
    fp32+scale+clip the same under a GradScaler (grad_scale, found_inf) and the optimizer's clip
    bf16+SR         bfloat16 parameters and gradients, stochastic rounding
    bf16+SR+scale+clip

each with ROWS_ALIGNED (every row length a multiple of 256: all 2-D Llama / GPT weights; the
unmasked path the benchmarks time) and without (the masked general path).

Reported per configuration: registers and spill bytes (ptxas -v on the kernel's PTX with the
flags Triton passes), total SASS instructions of the kernel (NOPs not counted), the instructions of
the main tile loop of the taken path (found by its back edge; ROWS_ALIGNED: the unmasked loop, the
one without predicated loads; else the masked loop), of those the fast path ("fast": without the
out-of-line special cases of div_rn / sqrt_rn, which a forward branch skips unless an operand is
denormal, huge or zero, and without the BSSY / BSYNC around them), and instructions per element.

Normalisation: one iteration of the tile loop steps a [R, 256] tile, R * 256 elements over
warps * 32 threads: TILE_ELEMENTS_PER_THREAD (4) elements a thread. A SASS instruction is issued
once per warp and covers 32 threads, so warp instructions per element = fast-path loop
instructions / (32 * 4) and, in Nsight Compute's unit (SASS instructions per element = warp
instructions * 32 / elements), instr/el = fast-path loop instructions / 4. The per-program
prologue (tables, hyper-parameters, bias corrections, the tensor's random stream: about 200
instructions a program on the aligned path, over QB * 256 / 128 = 16 elements a thread) is left
out: it adds about 12 an element on top, which is why Nsight Compute's 143 an element (dynamic,
every program) sits above the baseline's 118 here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

CONFIGS = {
    "fp32": dict(P_DTYPE="fp32", SR=False, HAS_SCALE=False, HAS_FOUND_INF=False, HAS_CLIP=False),
    "fp32+scale+clip": dict(P_DTYPE="fp32", SR=False, HAS_SCALE=True, HAS_FOUND_INF=True, HAS_CLIP=True),
    "bf16+SR": dict(P_DTYPE="bf16", SR=True, HAS_SCALE=False, HAS_FOUND_INF=False, HAS_CLIP=False),
    "bf16+SR+scale+clip": dict(P_DTYPE="bf16", SR=True, HAS_SCALE=True, HAS_FOUND_INF=True, HAS_CLIP=True),
}


def compile_kernel(config: dict, rows_aligned: bool, maxnreg, warps: int, qb: int, r: int):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trainops.ops import lowbit_optimizers as lowbit

    fn = lowbit._lowbit_blocks
    pointers = {"addresses": "*i64", "block_tensor": "*i32", "first_block": "*i32", "units": "*i64",
                "meta": "*i64", "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "clip_ptr": "*fp32",
                "partials": "*fp32", "ratios": "*fp32"}
    scalars = {"n_tensors": "i32", "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32",
               "weight_decay": "fp32", "seed_stream": "i32"}
    constexprs = dict(P_DTYPE=tl.bfloat16 if config["P_DTYPE"] == "bf16" else tl.float32, LR_POINTER=False,
                      BETA1_POINTER=False, BETA2_POINTER=False, WD_POINTER=False, MODE=0, DECOUPLED=True,
                      BIAS_CORRECTION=False, MASTER_ROW=-1, STEP_ROW=6, QUANTIZED=True, SR=config["SR"],
                      HAS_SCALE=config["HAS_SCALE"], HAS_FOUND_INF=config["HAS_FOUND_INF"],
                      HAS_CLIP=config["HAS_CLIP"], MAXIMIZE=False, ALIGNED=True, ROWS_ALIGNED=rows_aligned, QB=qb,
                      R=r, W=lowbit.BLOCK_WIDTH)
    signature, consts, attrs = {}, {}, {}
    for param in fn.params:
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
            consts[(param.num,)] = constexprs[name]
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(param.num,)] = [["tt.divisibility", 16]]   # torch allocations, as a GPU launch specialises
        else:
            signature[name] = scalars[name]
    options = {"num_warps": warps, "enable_fp_fusion": True}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_usage(ptx: str) -> dict:
    """Registers and spill bytes of the PTX (ptxas -v with Triton's flags)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path   # the ptxas Triton compiles sm_90 with
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", src, "-o",
                               os.path.join(tmp, "k.o")], capture_output=True, text=True)
    log = done.stderr + done.stdout
    if done.returncode:
        raise RuntimeError(f"ptxas failed: {log[-2000:]}")
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {"registers": int(regs.group(1)), "spill_store_bytes": int(stores.group(1)),
            "spill_load_bytes": int(loads.group(1)), "stack_bytes": int(stack.group(1))}


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass_instructions(cubin: bytes) -> list[tuple[int, str]]:
    """(address, text) of every SASS instruction (nvdisasm-style, via cuobjdump -sass)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.remove(path)
    out = []
    for line in text.splitlines():
        m = _INSTRUCTION.search(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def loops(instructions) -> list[tuple[int, int]]:
    """(first index, last index) of each loop, found by its backward branch (innermost-first order)."""
    index = {address: i for i, (address, _) in enumerate(instructions)}
    found = []
    for i, (address, text) in enumerate(instructions):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m:
            target = int(m.group(1), 16)
            if target <= address and target in index:
                found.append((index[target], i))
    return found


def _slow_paths(instructions, first: int, last: int) -> set[int]:
    """Indices in [first, last] of out-of-line slow paths: the instructions a forward conditional
    branch skips when the skipped range calls a subroutine (div_rn / sqrt_rn's special cases, taken
    only for denormal, huge or zero operands)."""
    index = {address: i for i, (address, _) in enumerate(instructions)}
    slow = set()
    for i in range(first, last + 1):
        m = re.match(r"@!?U?P\d+\s+BRA\s+(0x[0-9a-f]+)", instructions[i][1])
        if m:
            target = index.get(int(m.group(1), 16))
            if target is not None and i < target <= last + 1:
                skipped = range(i + 1, target)
                if any("CALL" in instructions[j][1] for j in skipped):
                    slow.update(skipped)
    return slow


def count(name: str, config: dict, rows_aligned: bool, maxnreg, warps: int, qb: int, per_thread: int,
          dump: str | None) -> dict:
    r = max(1, warps * 32 * per_thread // 256)
    kernel = compile_kernel(config, rows_aligned, maxnreg, warps, qb, r)
    instructions = sass_instructions(kernel.asm["cubin"])
    usage = ptxas_usage(kernel.asm["ptx"])
    real = [t for _, t in instructions if not t.startswith("NOP")]
    found = loops(instructions)
    if not found:
        raise RuntimeError(f"{name}: no loop found (unrolled?)")

    def predicated_loads(fl):
        body = [t for _, t in instructions[fl[0]:fl[1] + 1]]
        return sum(1 for t in body if re.match(r"@!?P\d+\s+LDG", t)) / max(1, sum(1 for t in body if "LDG" in t))

    # the taken path's tile loop: ROWS_ALIGNED, the unmasked loop (no predicated loads); else the masked one
    first, last = (min if rows_aligned else max)(found, key=predicated_loads)
    slow = _slow_paths(instructions, first, last)
    body = [t for i, (_, t) in enumerate(instructions[first:last + 1], first) if not t.startswith("NOP")]
    fast = [t for i, (_, t) in enumerate(instructions[first:last + 1], first)
            if not t.startswith("NOP") and i not in slow and not re.match(r"BSSY|BSYNC", t)]
    elements = r * 256 // (warps * 32)
    row = {"config": name, "rows_aligned": rows_aligned, "maxnreg": maxnreg, "warps": warps, "QB": qb, "R": r,
           "total": len(real), "loop": len(body), "loop_fast_path": len(fast), "loops_found": len(found),
           "elements_per_iteration_per_thread": elements, **usage,
           "per_element": round(len(fast) / elements, 2),
           "local_ops_in_loop": sum(1 for t in body if re.search(r"\b(LDL|STL)", t)),
           "local_ops_total": sum(1 for t in real if re.search(r"\b(LDL|STL)", t)),
           "bar_in_loop": sum(1 for t in body if t.startswith("BAR")),
           "mufu_in_loop": sum(1 for t in fast if "MUFU" in t)}
    if dump:
        os.makedirs(dump, exist_ok=True)
        stem = f"{name}-{'aligned' if rows_aligned else 'masked'}-r{maxnreg}".replace("+", "_")
        with open(os.path.join(dump, stem + ".sass"), "w") as f:
            f.write("\n".join(f"/*{a:04x}*/ {'S ' if i in slow else ('L ' if first <= i <= last else '  ')}{t};"
                              for i, (a, t) in enumerate(instructions)))
        with open(os.path.join(dump, stem + ".ptx"), "w") as f:
            f.write(kernel.asm["ptx"])
    return row


def main(argv=None) -> int:
    from trainops.ops import lowbit_optimizers as lowbit
    from trainops.ops.multi_tensor import MultiTensorHeuristics

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxnreg", type=int, default=lowbit.MAX_REGISTERS, help="0: uncapped")
    parser.add_argument("--warps", type=int, default=MultiTensorHeuristics.warps)
    parser.add_argument("--block", type=int, default=MultiTensorHeuristics.block)
    parser.add_argument("--per-thread", type=int, default=lowbit.TILE_ELEMENTS_PER_THREAD)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--masked", action="store_true", help="also the masked path (ROWS_ALIGNED False)")
    parser.add_argument("--dump", help="write each kernel's SASS and PTX here")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    rows = []
    header = (f"{'config':20} {'path':8} {'regs':>4} {'spill st/ld B':>13} {'total':>6} {'loop':>5} "
              f"{'fast':>5} {'el/it/thr':>9} {'instr/el':>8} {'LDL/STL loop':>12}")
    print(header)
    for name in args.configs.split(","):
        for aligned in (True, False) if args.masked else (True,):
            row = count(name, CONFIGS[name], aligned, args.maxnreg or None, args.warps, args.block // 256,
                        args.per_thread, args.dump)
            rows.append(row)
            print(f"{name:20} {'aligned' if aligned else 'masked':8} {row['registers']:>4} "
                  f"{row['spill_store_bytes']:>6}/{row['spill_load_bytes']:<6} {row['total']:>6} {row['loop']:>5} "
                  f"{row['loop_fast_path']:>5} "
                  f"{row['elements_per_iteration_per_thread']:>9} {str(row['per_element']):>8} "
                  f"{row['local_ops_in_loop']:>12}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
