"""Host time of ``opt.step()`` when every step brings new gradient tensors (the pattern of
``zero_grad(set_to_none=True)``: autograd allocates them anew, usually at other addresses), over
GPT-2 124M's and issue 39's llama-small's parameter shapes on one CUDA device: torch fused AdamW,
trainops AdamW, trainops AdamW validating its tensors at every step (the multi-tensor table's
``gradient_column`` left out: the behaviour before the sixth session), and trainops AdamW again.
Three pools of gradients are assigned in turn; the host time is perf_counter around the step
(synchronised before and after, outside the timing), median and minimum of 50 steps after 10.

    PYTHONPATH=src python benchmarks/probe_optimizer_host_time.py out.json
"""
import json
import statistics
import sys
import time

import torch
import transformers

import trainops
from trainops.ops import multi_tensor as mt

out = sys.argv[1]
res = {}
orig = mt.TensorTable.tables
def no_skip(self, columns, scalars=(), validate=None, user_columns=None, gradient_column=None):
    return orig(self, columns, scalars, validate, user_columns, None)
for name, cfg in [("gpt2", transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)),
                  ("llama-small", transformers.LlamaConfig(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                                                           num_key_value_heads=4, intermediate_size=4096, vocab_size=32000))]:
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = [p.shape for p in m.parameters()]
    for variant in ["torch fused", "trainops (skip)", "trainops (validate every step)", "trainops (skip) 2"]:
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
        pools = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(3)]
        if variant.startswith("torch"):
            opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        else:
            opt = trainops.optim.AdamW(params, lr=1e-4)
        mt.TensorTable.tables = no_skip if "validate" in variant else orig
        times = []
        for i in range(60):
            for p, g in zip(params, pools[i % 3]):
                p.grad = g
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            times.append(1e6 * (time.perf_counter() - t0))
            torch.cuda.synchronize()
        mt.TensorTable.tables = orig
        res[f"{name}: {variant}"] = dict(tensors=len(shapes), host_us_median=statistics.median(times[10:]), host_us_min=min(times[10:]))
        print(name, variant, len(shapes), "host us median %.0f min %.0f" % (statistics.median(times[10:]), min(times[10:])), flush=True)
json.dump(res, open(out, "w"), indent=1)
