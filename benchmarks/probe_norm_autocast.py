"""Pre-norms under autocast (trainops.hf, "Pre-norms under autocast"): a decoder layer's RMSNorm
writing the autocast dtype itself, against the float32 output its projections cast one by one
(``trainops.patch(model, autocast_norms=False)``: main's behaviour before the change).

    python benchmarks/probe_norm_autocast.py --out probe.json [--device cuda] [--parts numerics,model,step]
        [--tokens 1024] [--steps 20] [--layers 16]

Parts (``--parts``, default all that run on the device):
- ``numerics``: one norm and its readers at Llama-3.2-1B's widths (hidden 2048; q 2048, k and v
  512: the attention's pre-norm; gate and up 8192: the MLP's), ``--tokens`` rows, float32 x and
  parameters under bf16 autocast, random bf16 upstream gradients of the projections' outputs. Both
  paths give the norm's input gradient dx and its weight gradient dw; each is compared with a
  float64 run of the same function (no autocast): relative-norm errors, and the distance between
  the two paths. Path "f32": y float32, each F.linear casts it (autograd sums the float32 copies of
  the projections' bf16 input gradients); path "bf16": y written in bf16 (autograd sums the bf16
  gradients in bf16, two adds for three readers, one for two).
- ``model``: transformers's Llama, small widths (hidden 256, 4 layers, vocabulary 1000), batch 2 x
  128, patched both ways, under bf16 autocast: the two forward losses (the same bits expected on
  the CPU path and on the GPU), every parameter gradient's relative error against a float64 run of
  the unpatched model, the activation casts of one forward (aten._to_copy float32 -> bf16 on
  tensors that are not parameters) and the ToCopyBackward0 nodes of its graph.
- ``step`` (CUDA): Llama-3.2-1B's shape (``trainops.bench.step.MODELS["llama"]``, batch 4 x 2048,
  ``--layers`` layers), forward with labels and backward under bf16 autocast, patched both ways
  in one process, alternated: wall ms per step (median of ``--steps``), then 3 steps each under
  torch.profiler: GPU time per step, launches, and the time and calls of the cast kernels
  (float32 -> bf16: ``bfloat16_copy_kernel_cuda``; to float32: ``direct_copy_kernel_cuda``'s
  float outputs) and of float32 / bf16 adds.

The JSON (``--out``) holds the settings, versions and every figure; a summary prints last.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as torch_F

import trainops
from trainops.bench import environment

HIDDEN, Q, KV, INTERMEDIATE = 2048, 2048, 512, 8192   # Llama-3.2-1B


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double().to(a.device)
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def numerics(device: str, tokens: int) -> list[dict]:
    """Part 1: dx and dw of one norm feeding 3 (attention) or 2 (MLP) projections."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for block, widths in (("attention (q, k, v)", (Q, KV, KV)), ("mlp (gate, up)", (INTERMEDIATE, INTERMEDIATE))):
        x = (torch.randn(tokens, HIDDEN, generator=gen) * 3).to(device)   # a residual stream of rms about 3
        w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(device)
        projections = [(torch.randn(n, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(device) for n in widths]
        upstream = [torch.randn(tokens, n, generator=gen).to(device).to(torch.bfloat16) for n in widths]

        def run(out_dtype, autocast: bool, dtype=torch.float32):
            xs = x.detach().clone().to(dtype).requires_grad_()   # a leaf of its own each run
            ws = w.detach().clone().to(dtype).requires_grad_()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                y = trainops.rms_norm(xs, ws, 1e-5, out_dtype=out_dtype)
                outs = [torch_F.linear(y, p.to(dtype)) for p in projections]
            torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(upstream, outs)])
            return xs.grad, ws.grad, y

        want_dx, want_dw, _ = run(None, False, torch.float64)
        f32_dx, f32_dw, y32 = run(None, True)
        b16_dx, b16_dw, y16 = run(torch.bfloat16, True)
        rows.append(dict(block=block, tokens=tokens, readers=len(widths),
                         forward_identical=bool(torch.equal(y16, y32.to(torch.bfloat16))),
                         dx_f32_vs_f64=relative(f32_dx, want_dx), dx_bf16_vs_f64=relative(b16_dx, want_dx),
                         dx_bf16_vs_f32=relative(b16_dx, f32_dx),
                         dw_f32_vs_f64=relative(f32_dw, want_dw), dw_bf16_vs_f64=relative(b16_dw, want_dw),
                         dw_bf16_vs_f32=relative(b16_dw, f32_dw)))
    return rows


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten._to_copy float32 -> bf16 of tensors that are not the given parameters."""

    def __init__(self, parameters):
        super().__init__()
        self.parameters = {id(p) for p in parameters}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and id(args[0]) not in self.parameters
                and args[0].dtype == torch.float32 and kwargs.get("dtype") == torch.bfloat16):
            self.count += 1
        return func(*args, **kwargs)


def _to_copy_nodes(loss: torch.Tensor) -> int:
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == "ToCopyBackward0"
        stack.extend(next_node for next_node, _ in node.next_functions)
    return count


def model_part(device: str) -> dict:
    """Part 2: a small Llama patched both ways, against float64."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to(device).train()
    exact = copy.deepcopy(base).double()
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(1)).to(device)
    exact(input_ids=ids, labels=ids).loss.backward()
    want = {n: p.grad for n, p in exact.named_parameters()}
    result = {}
    for name, autocast_norms in (("f32", False), ("bf16", True)):
        model = copy.deepcopy(base)
        trainops.patch(model, autocast_norms=autocast_norms)
        casts = _Casts(model.parameters())
        with torch.autocast(device, dtype=torch.bfloat16), casts:
            loss = model(input_ids=ids, labels=ids).loss
        nodes = _to_copy_nodes(loss)
        loss.backward()
        errors = {n: relative(p.grad, want[n]) for n, p in model.named_parameters()}
        result[name] = dict(loss=loss.item(), activation_casts=casts.count, to_copy_backward_nodes=nodes,
                            grad_error_max=max(errors.values()), grad_error_median=statistics.median(errors.values()),
                            grad_errors=errors)
    result["loss_identical"] = result["f32"]["loss"] == result["bf16"]["loss"]
    return result


def _cast_class(name: str) -> str | None:
    if "bfloat16_copy_kernel_cuda" in name:
        return "cast to bf16 (bfloat16_copy_kernel_cuda)"
    if "direct_copy_kernel_cuda" in name:
        return "cast or copy (direct_copy_kernel_cuda)"
    if "CUDAFunctor_add<float>" in name:
        return "add float32"
    if "CUDAFunctor_add<c10::BFloat16>" in name:
        return "add bf16"
    return None


def step_part(steps: int, layers: int) -> dict:
    """Part 3 (CUDA): Llama-3.2-1B-shaped forward + backward, both ways, alternated."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from trainops.bench.step import MODELS, build_config, build_model, make_batches

    spec = MODELS["llama"]
    config = build_config("llama", layers, spec.seq)
    models = {}
    for name, autocast_norms in (("f32", False), ("bf16", True)):
        model = build_model(config, "cuda")
        trainops.patch(model, autocast_norms=autocast_norms)
        models[name] = model
    batches = make_batches(4, spec.batch, spec.seq, config.vocab_size, "cuda")

    def step(model, i):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batches[i % 4], labels=batches[i % 4]).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    times = {name: [] for name in models}
    losses = {name: [] for name in models}
    for i in range(3 + steps):   # 3 warm-up steps each, then alternated timed steps
        for name, model in models.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step(model, i)
            losses[name].append(loss.item())
            if i >= 3:
                times[name].append(1e3 * (time.perf_counter() - t0))
    result = {"layers": layers, "batch": spec.batch, "seq": spec.seq,
              "losses_identical": losses["f32"] == losses["bf16"]}
    for name, model in models.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                step(model, i)
            torch.cuda.synchronize()
        total, launches, classes = 0.0, 0, collections.defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
                continue
            total += event.device_time
            launches += 1
            kind = _cast_class(event.name)
            if kind is not None:
                classes[kind][0] += event.device_time
                classes[kind][1] += 1
        result[name] = dict(ms=statistics.median(times[name]), gpu_ms=total / 1e3 / 3, launches=launches / 3,
                            kernels={k: dict(ms=t / 1e3 / 3, calls=n / 3) for k, (t, n) in sorted(classes.items())})
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--parts", default=None, help="comma-separated: numerics, model, step (default: all that run)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args(argv)
    parts = args.parts.split(",") if args.parts else ["numerics", "model"] + (["step"] if args.device == "cuda" else [])
    results = {"environment": environment(), "settings": vars(args)}
    if "numerics" in parts:
        results["numerics"] = numerics(args.device, args.tokens)
        for row in results["numerics"]:
            print(f"{row['block']:22} forward identical {row['forward_identical']}; dx vs float64: f32 sum "
                  f"{row['dx_f32_vs_f64']:.3e}, bf16 sum {row['dx_bf16_vs_f64']:.3e} (apart {row['dx_bf16_vs_f32']:.3e});"
                  f" dw: {row['dw_f32_vs_f64']:.3e}, {row['dw_bf16_vs_f64']:.3e} (apart {row['dw_bf16_vs_f32']:.3e})")
    if "model" in parts:
        results["model"] = found = model_part(args.device)
        for name in ("f32", "bf16"):
            r = found[name]
            print(f"small Llama, norms {name:4}: loss {r['loss']:.6f}, activation casts a forward "
                  f"{r['activation_casts']}, ToCopyBackward0 nodes {r['to_copy_backward_nodes']}, gradient error vs "
                  f"float64 max {r['grad_error_max']:.3e} median {r['grad_error_median']:.3e}")
        print(f"losses identical: {found['loss_identical']}")
    if "step" in parts:
        if args.device != "cuda":
            print("step: CUDA only, skipped", file=sys.stderr)
        else:
            results["step"] = found = step_part(args.steps, args.layers)
            for name in ("f32", "bf16"):
                r = found[name]
                print(f"Llama-3.2-1B shape, norms {name:4}: {r['ms']:.2f} ms a step (wall), GPU {r['gpu_ms']:.2f} ms, "
                      f"{r['launches']:.0f} launches; " + "; ".join(f"{k} {v['ms']:.2f} ms / {v['calls']:.0f}"
                                                                   for k, v in r["kernels"].items()))
            print(f"losses identical: {found['losses_identical']}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
