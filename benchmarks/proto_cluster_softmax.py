"""Experiment (H100 only, not part of the library): long-row softmax whose chunks meet at a
thread-block cluster barrier instead of an atomic counter.

Triton 3.6 cannot compile a reduction across the CTAs of a cluster (``num_ctas > 1`` fails in
TritonGPUPlanCTAPass), so a normal (num_ctas=1) kernel is compiled and launched by hand with a
cluster dimension of C CTAs (the launcher's packed metadata); the C chunks of a row are held by the
C CTAs of one cluster, which publish their partials to global memory (L2) and meet at the hardware
barrier (barrier.cluster.arrive.release / wait.acquire, inline PTX). Persistent over rows: the
next row's chunk loads between arrive and wait. Sweeps cluster size, warps, clusters per SM.

Result (benchmarks/results/softmax-cluster-proto-h100-20261123.json, benchmarks/NOTES.md): correct;
best settings against the counter exchange of the same run, bf16: 128x262144 forward 86.7 us
against 69.7, backward 105 against 84; 1024x131072 forward 234 against 243 (the exchange now
takes 225), backward 345 against 305. Not taken up. Run:
``PYTHONPATH=src python benchmarks/proto_cluster_softmax.py`` (writes cluster_proto.json to $OUT or .).
"""
import json, os, sys
import torch, triton, triton.language as tl, triton.testing


@triton.jit
def cluster_arrive(token):
    return tl.inline_asm_elementwise("barrier.cluster.arrive.release;\n\tmov.u32 $0, 0;", "=r,r", [token],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cluster_wait(token):
    return tl.inline_asm_elementwise("barrier.cluster.wait.acquire;\n\tmov.u32 $0, 0;", "=r,r", [token],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cluster_place(N, C: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rank in cluster, cluster, clusters, positions of this CTA's chunk, their mask, ranks 0..C-1)."""
    pid = tl.program_id(0)
    k = pid % C
    n = k * BLOCK_N + tl.arange(0, BLOCK_N)
    return k, pid // C, tl.num_programs(0) // C, n, n < N, tl.arange(0, C)


@triton.jit
def fwd_cluster(x_ptr, y_ptr, ws_ptr, N, ROWS, C: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_SYNC: tl.constexpr):
    k, g, G, n, mask, kk = cluster_place(N, C, BLOCK_N)
    x_next = tl.load(x_ptr + g.to(tl.int64) * N + n, mask=mask & (g < ROWS), other=float("-inf"))
    it = 0
    for r in range(g, ROWS, G):
        x_raw = x_next
        x = x_raw.to(tl.float32)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)
        slot = ws_ptr + (g * 2 + (it % 2)) * 2 * C
        tl.store(slot + k, m)
        tl.store(slot + C + k, s)
        tok = cluster_arrive(it)
        if SPLIT_SYNC:
            x_next = tl.load(x_ptr + (r + G).to(tl.int64) * N + n, mask=mask & (r + G < ROWS), other=float("-inf"))
            tok = cluster_wait(tok)
        else:
            tok = cluster_wait(tok)
            x_next = tl.load(x_ptr + (r + G).to(tl.int64) * N + n, mask=mask & (r + G < ROWS), other=float("-inf"))
        m_k = tl.load(slot + tok + kk, volatile=True)
        s_k = tl.load(slot + tok + C + kk, volatile=True)
        mm = tl.max(m_k, axis=0)
        m_ref = tl.where(mm == float("-inf"), 0.0, mm)
        total = tl.sum(s_k * tl.exp(m_k - m_ref), axis=0)
        y = tl.exp(x - m_ref) * (1.0 / total)
        tl.store(y_ptr + r.to(tl.int64) * N + n, y.to(y_ptr.dtype.element_ty), mask=mask)
        it += 1


@triton.jit
def bwd_cluster(dy_ptr, y_ptr, dx_ptr, ws_ptr, N, ROWS, C: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_SYNC: tl.constexpr):
    k, g, G, n, mask, kk = cluster_place(N, C, BLOCK_N)
    dy_next = tl.load(dy_ptr + g.to(tl.int64) * N + n, mask=mask & (g < ROWS), other=0.0)
    y_next = tl.load(y_ptr + g.to(tl.int64) * N + n, mask=mask & (g < ROWS), other=0.0)
    it = 0
    for r in range(g, ROWS, G):
        dy = dy_next.to(tl.float32)
        y = y_next.to(tl.float32)
        part = tl.sum(dy * y, axis=0)
        slot = ws_ptr + (g * 2 + (it % 2)) * C
        tl.store(slot + k, part)
        tok = cluster_arrive(it)
        dy_next = tl.load(dy_ptr + (r + G).to(tl.int64) * N + n, mask=mask & (r + G < ROWS), other=0.0)
        y_next = tl.load(y_ptr + (r + G).to(tl.int64) * N + n, mask=mask & (r + G < ROWS), other=0.0)
        tok = cluster_wait(tok)
        total = tl.sum(tl.load(slot + tok + kk, volatile=True), axis=0)
        dx = y * (dy - total)
        tl.store(dx_ptr + r.to(tl.int64) * N + n, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        it += 1


def compile_only(fn, args, meta, warps):
    return fn.warmup(*args, grid=(1,), num_warps=warps, **meta)


class ClusterLaunch:
    def __init__(self, fn, args, meta, warps, C, clusters):
        self.k = compile_only(fn, args, meta, warps)
        self.k._init_handles()
        self.packed = (self.k.metadata.num_warps, C, self.k.metadata.shared)
        self.clusters = clusters
        self.meta = meta

    def __call__(self, *args):
        stream = torch.cuda.current_stream().cuda_stream
        self.k.run(self.clusters, 1, 1, stream, self.k.function, self.packed, None, None, None,
                   *args, *self.meta.values())


def main():
    out_dir = os.environ.get("OUT", ".")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_out = []
    import trainops

    def emit(r):
        print(json.dumps(r), flush=True); rows_out.append(r)

    for rows, n in ((128, 262144), (1024, 131072), (4096, 32768)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        xs = [torch.randn(rows, n, device="cuda", generator=gen).bfloat16() for _ in range(2)]
        dys = [torch.randn(rows, n, device="cuda", generator=gen).bfloat16() for _ in range(2)]
        ys = [torch.softmax(x.float(), -1).bfloat16() for x in xs]
        ref_f = ys[0].double()
        yd = ys[0].double(); dyd = dys[0].double()
        ref_b = yd * (dyd - (yd * dyd).sum(-1, keepdim=True))
        nbytes = rows * n * 2
        out = torch.empty_like(xs[0])
        i = [0]
        def copy():
            i[0] ^= 1
            out.copy_(xs[i[0]])
        emit(dict(shape=f"{rows}x{n}", op="copy", ms=round(triton.testing.do_bench(copy, warmup=25, rep=300, return_mode="median"), 4)))
        for op in ("fwd", "bwd"):
            for name, fn in (("trainops", None),):
                f = (lambda j: trainops.softmax(xs[j], -1)) if op == "fwd" else (lambda j: trainops.softmax_backward(dys[j], ys[j], -1))
                def run():
                    i[0] ^= 1
                    f(i[0])
                ms = triton.testing.do_bench(run, warmup=25, rep=300, return_mode="median")
                emit(dict(shape=f"{rows}x{n}", op=op, variant="trainops", ms=round(ms, 4),
                          pct=round(nbytes * (2 if op == "fwd" else 3) / ms / 1e6 / 30.0, 1)))
            for C in (4, 8, 16):
                for warps in (4, 8, 16):
                    chunk = n // C
                    if chunk > 32768 or chunk < 2048 or chunk // (32 * warps) > 128 or chunk // (32 * warps) < 8:
                        continue
                    for per_sm in (1, 2, 3, 4, 0):
                        for split in ((0, 1) if op == "fwd" else (1,)):
                            clusters = rows if per_sm == 0 else min(rows, max(1, sms * per_sm // C))
                            if per_sm and clusters == rows and per_sm > 1:
                                continue
                            # balance: same rounds, fewer clusters
                            rounds = -(-rows // clusters)
                            clusters = -(-rows // rounds)
                            ws = torch.zeros(clusters * 2 * 2 * C, device="cuda", dtype=torch.float32)
                            o = torch.empty_like(xs[0])
                            meta = dict(C=C, BLOCK_N=chunk, SPLIT_SYNC=split)
                            try:
                                if op == "fwd":
                                    L = ClusterLaunch(fwd_cluster, (xs[0], o, ws, n, rows), meta, warps, C, clusters)
                                    a = [(xs[j], o, ws, n, rows) for j in range(2)]
                                    ref = ref_f
                                else:
                                    L = ClusterLaunch(bwd_cluster, (dys[0], ys[0], o, ws, n, rows), meta, warps, C, clusters)
                                    a = [(dys[j], ys[j], o, ws, n, rows) for j in range(2)]
                                    ref = ref_b
                                o.fill_(float("nan"))
                                L(*a[0]); torch.cuda.synchronize()
                                err = ((o.double() - ref).norm() / ref.norm()).item()
                                def run():
                                    i[0] ^= 1
                                    L(*a[i[0]])
                                ms = triton.testing.do_bench(run, warmup=25, rep=300, return_mode="median")
                                emit(dict(shape=f"{rows}x{n}", op=op, variant=f"C{C} w{warps} per_sm{per_sm} split{split}",
                                          clusters=clusters, ms=round(ms, 4),
                                          pct=round(nbytes * (2 if op == "fwd" else 3) / ms / 1e6 / 30.0, 1), err=err,
                                          regs=L.k.n_regs, spills=L.k.n_spills))
                            except Exception as e:
                                emit(dict(shape=f"{rows}x{n}", op=op, variant=f"C{C} w{warps} per_sm{per_sm}", error=repr(e)[:300]))
    json.dump(rows_out, open(out_dir + "/cluster_proto.json", "w"), indent=1)


if __name__ == "__main__":
    main()
