"""Four 8-bit AdamW steps (float32 parameters, optim_bits=8) on 439 M parameters in the Llama-shaped
list of bench_optim_lowbit.py (6 layers), for Nsight Compute to profile one launch of the step:

    ncu -k regex:_lowbit_blocks --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
        python benchmarks/ncu_optim_lowbit.py

(PYTHONPATH=src; results/ncu-lowbit-adamw8bit-h200-20261129-s5.txt)
"""
import sys, os, torch
sys.path.insert(0, os.path.dirname(__file__))
import trainops
from bench_optim_lowbit import model_shapes
shapes = model_shapes(layers=6)
g = torch.Generator(device="cuda").manual_seed(0)
ps = [torch.randn(s, device="cuda", generator=g).requires_grad_() for s in shapes]
for p in ps:
    p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-2
opt = trainops.optim.AdamW(ps, lr=1e-4, optim_bits=8)
for _ in range(4):
    opt.step()
torch.cuda.synchronize()
print("params", sum(p.numel() for p in ps))
