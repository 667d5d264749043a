"""Where each probe_host_time.py call's host time goes on a GPU host: cProfile of 2000 calls
(tottime, top 28) and the CUDA runtime / driver calls and kernels per call (torch.profiler over 50),
trainops against torch; cross-entropy and embedding also with their checks off.

    PYTHONPATH=src python benchmarks/probe_host_profile.py OUT.json
"""
import cProfile, io, pstats, sys, os, json, collections
sys.path.insert(0, os.path.dirname(__file__))
import torch
import probe_host_time as P
out = sys.argv[1]
device = torch.device("cuda")
res = {}
for no_check in (False, True):
    for name, kind, make in P._cases(device, torch.bfloat16, not no_check):
        if no_check and not ("cross_entropy" in name or "embedding" in name):
            continue
        made = make()
        if made is None:
            continue
        ours, theirs, _ = made
        tag = name + (" [no check]" if no_check else "")
        for fn in (ours, theirs):
            for _ in range(100):
                fn()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            ours()
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
        counts = {}
        for label, fn in (("trainops", ours), ("torch", theirs)):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
            c = collections.Counter()
            for e in prof.events():
                if e.name.startswith(("cuda", "cu")) and e.device_type == torch.autograd.DeviceType.CPU:
                    c[e.name] += 1
            counts[label] = {k: v / 50 for k, v in c.most_common()}
            kern = collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
            counts[label + "_kernels"] = {k: v / 50 for k, v in kern.most_common()}
        res[tag] = dict(profile=s.getvalue(), api=counts)
        print("=" * 30, tag, json.dumps(counts, indent=1), s.getvalue()[:6000], sep="\n", flush=True)
json.dump(res, open(out, "w"), indent=1)
