"""Cross-entropy forward + backward (bf16 / float32 logits, class targets, mean loss) at issue 42's
vocabulary shapes: trainops's default plan and CrossEntropyHeuristics candidates against quack,
Liger (where installed) and torch.compile of F.cross_entropy(x.float(), t). Each result is checked
against float64 (loss and gradient, relative error under 1e-2) before it is timed: do_bench median
(host-inclusive) and trainops.bench.sweep.kernel_time (a CUDA-graph replay, else the profiler's
kernel sum: GPU time only).

    PYTHONPATH=src python benchmarks/probe_ce_vocab.py OUT.json

CUDA only; about 2-3 minutes on an H200 (the float64 references take 8 GiB at 10240 x 65536).
"""
import contextlib, gc, json, sys
import torch, triton
import torch.nn.functional as F
import trainops
from trainops.ops.cross_entropy import CrossEntropyHeuristics as H, _describe, _exchange_config, _choose_block

out = sys.argv[1]
bf, f32 = torch.bfloat16, torch.float32
cands = {
    "default": None,
    "old_w16": H(pipelined_warps={}),
    "pipe_w32_all": H(pipelined_warps={2: 32, 4: 32}),
    "x_w32": H(exchange_warps=32),
    "xoff": H(exchange_block={}),
}
from trainops.bench.sweep import kernel_time

shapes = [((10240, 32000), bf), ((4096, 32000), bf), ((10240, 20000), bf), ((10240, 65536), bf),
          ((8192, 16000), f32), ((8192, 128256), bf)]
peers = {}
try:
    import quack; peers["quack"] = quack.cross_entropy
except Exception as e: print("no quack", e)
try:
    from liger_kernel.transformers.functional import liger_cross_entropy; peers["liger"] = liger_cross_entropy
except Exception as e: print("no liger", e)
peers["torch.compile"] = torch.compile(lambda x, t: F.cross_entropy(x.float(), t), dynamic=False)
rows = []
for shape, dt in shapes:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, device="cuda", generator=g) * 2).to(dt).requires_grad_()
    t = torch.randint(0, shape[1], shape[:1], device="cuda", generator=g)
    with torch.no_grad():   # the float64 loss and gradient (softmax - onehot) / rows, without autograd's copies
        ref = F.cross_entropy(x.double(), t)
        refg = torch.softmax(x.double(), -1)
        refg[torch.arange(shape[0], device="cuda"), t] -= 1
        refg /= shape[0]
    impls = {}
    for name, h in cands.items():
        def f(h=h):
            x.grad = None
            with (trainops.heuristics(h) if h is not None else contextlib.nullcontext()):
                l = trainops.cross_entropy(x, t); l.backward()
            return l, x.grad
        impls["trainops " + name] = (f, h)
    for name, p in peers.items():
        def f(p=p):
            x.grad = None; l = p(x, t); l.backward(); return l, x.grad
        impls[name] = (f, None)
    for name, (f, h) in impls.items():
        r = dict(shape=list(shape), dtype=str(dt), impl=name)
        try:
            if name.startswith("trainops"):
                with (trainops.heuristics(h) if h is not None else contextlib.nullcontext()):
                    pr = _describe(shape, dt, torch.int64, "cuda")
                    ex = _exchange_config(pr)
                    r["plan"] = str(("exchange", ex) if ex else ("rows", _choose_block(pr)))
            l, gr = f(); torch.cuda.synchronize()
            r["err_loss"] = abs(float(l.detach()) - float(ref)) / abs(float(ref))
            r["err_grad"] = float((gr.double() - refg).norm() / refg.norm())
            if not (r["err_grad"] < 1e-2 and r["err_loss"] < 1e-2):
                r["failed"] = True
            else:
                r["ms"] = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
                r["gbps_2pass"] = x.numel() * x.element_size() * 2 / r["ms"] / 1e6
                r.update(kernel_time(f))
        except Exception as e:
            r["error"] = repr(e)[:300]
        rows.append(r); print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
        json.dump(rows, open(out, "w"), indent=1)
    refg = None
    gc.collect(); torch.cuda.empty_cache()   # the CUDA graphs' pools of the last shape go too
