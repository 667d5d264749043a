"""Where the convolution registry's Triton kernels win: each direction of a depthwise convolution
(forward; input gradient; weight gradient) timed against torch's cuDNN at MobileNet-V2,
EfficientNet-B0 and ConvNeXt-T depthwise shapes, both memory formats, over a grid of
``ConvHeuristics``; and ResNet-50's 1x1 convolutions: cuDNN against the same matmuls timed alone
(cuBLAS), and against the registry's Triton 1x1 kernels over a grid of tiles.

    python benchmarks/probe_conv.py --out conv.json [--quick]

Every Triton result is checked against float64 torch before it is timed (relative-norm error).
Times are ``triton.testing.do_bench`` medians (ms) on random data. The JSON holds every row; the
printout gives, per shape, the best Triton configuration of each direction and torch's time.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

import trainops
from trainops.ops.convolution import ConvHeuristics

from profiled import relative_error

# (name, channels, size, kernel, stride): depthwise layers at 224 x 224 input
DEPTHWISE = [
    ("mbv2", 32, 112, 3, 1), ("mbv2", 96, 112, 3, 2), ("mbv2", 144, 56, 3, 1), ("mbv2", 144, 56, 3, 2),
    ("mbv2", 192, 28, 3, 1), ("mbv2", 384, 14, 3, 1), ("mbv2", 576, 14, 3, 2), ("mbv2", 960, 7, 3, 1),
    ("effb0", 144, 56, 5, 2), ("effb0", 240, 28, 5, 1), ("effb0", 480, 14, 5, 1), ("effb0", 1152, 7, 5, 1),
    ("convnext", 96, 56, 7, 1), ("convnext", 192, 28, 7, 1), ("convnext", 384, 14, 7, 1), ("convnext", 768, 7, 7, 1),
]
# (block_positions, block_channels, warps); None: the layout's default tile
TILES = [(None, None, 4), (64, 32, 4), (32, 64, 4), (16, 128, 4), (128, 32, 4), (64, 64, 4), (128, 64, 8), (256, 16, 4), (128, 16, 4)]
# ResNet-50's 1x1 convolutions: (in, out, size)
POINTWISE = [(256, 64, 56), (64, 256, 56), (512, 128, 28), (128, 512, 28), (1024, 256, 14), (256, 1024, 14),
             (2048, 512, 7), (512, 2048, 7)]
# the Triton 1x1 kernels' tiles: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs_per_sm); None: the default
POINTWISE_TILES = [None, (128, 128, 64, 8, 3, 4), (128, 64, 64, 4, 3, 4), (64, 64, 64, 4, 4, 4), (128, 128, 32, 4, 4, 4),
                   (64, 256, 32, 8, 3, 4), (128, 256, 64, 8, 3, 2), (256, 128, 64, 8, 3, 2), (64, 128, 64, 4, 3, 2)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def depthwise_rows(batch, dtype, channels_last, shapes, tiles, rows, save):
    """Append a row per shape to ``rows`` (calling ``save`` after each)."""
    for (net, c, size, k, s) in shapes:
        x = torch.randn(batch, c, size, size, device="cuda", dtype=dtype)
        w = torch.randn(c, 1, k, k, device="cuda", dtype=dtype) * 0.2
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        geom = dict(stride=s, padding=k // 2, groups=c)
        y_ref = F.conv2d(x.double(), w.double(), **geom)
        dy = torch.randn(y_ref.shape, device="cuda", dtype=dtype)
        if channels_last:
            dy = dy.contiguous(memory_format=torch.channels_last)
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        dx_ref, dw_ref = torch.autograd.grad(F.conv2d(xd, wd, **geom), (xd, wd), dy.double())
        desc = dict(x_shape=x.shape, weight_shape=w.shape, dtype=dtype, device="cuda", stride=s, padding=k // 2,
                    groups=c, channels_last=channels_last)
        label = f"{net} {batch}x{c}x{size}x{size} k{k} s{s} {str(dtype)[6:]} {'cl' if channels_last else 'nchw'}"
        row = {"label": label, "net": net, "batch": batch, "channels": c, "size": size, "kernel": k, "stride": s,
               "dtype": str(dtype), "channels_last": channels_last, "triton": {}}
        # torch: cuDNN's own choice (what F.conv2d runs by default), deterministic, and benchmark=True
        for mode in ("default", "deterministic", "benchmark"):
            torch.backends.cudnn.deterministic = mode == "deterministic"
            torch.backends.cudnn.benchmark = mode == "benchmark"
            fwd = bench(lambda: F.conv2d(x, w, **geom))
            dx = bench(lambda: torch.ops.aten.convolution_backward(dy, x, w, None, [s, s], [k // 2] * 2, [1, 1], False,
                                                                   [0, 0], c, [True, False, False]))
            dw = bench(lambda: torch.ops.aten.convolution_backward(dy, x, w, None, [s, s], [k // 2] * 2, [1, 1], False,
                                                                   [0, 0], c, [False, True, False]))
            both = bench(lambda: torch.ops.aten.convolution_backward(dy, x, w, None, [s, s], [k // 2] * 2, [1, 1],
                                                                     False, [0, 0], c, [True, True, False]))
            row[f"torch_{mode}"] = {"forward": fwd, "input_grad": dx, "weight_grad": dw, "backward": both}
        torch.backends.cudnn.deterministic = False
        torch.backends.cudnn.benchmark = False
        with trainops.backend("triton"):
            for tile in tiles:
                h = ConvHeuristics(block_positions=tile[0], block_channels=tile[1], warps=tile[2])
                key = "x".join(map(str, tile)) if tile[0] else "layout-default"
                try:
                    fplan = trainops.plan("conv2d", **desc, heuristics=h)
                    dxplan = trainops.plan("conv2d_backward", **desc, mask=(True, False, False), heuristics=h)
                    dwplan = trainops.plan("conv2d_backward", **desc, mask=(False, True, False), heuristics=h)
                    bplan = trainops.plan("conv2d_backward", **desc, mask=(True, True, False), heuristics=h)
                    y = fplan.run(x, w, None)
                    dx_t = dxplan.run(dy, x, w)[0]
                    dw_t = dwplan.run(dy, x, w)[1]
                    errors = (relative_error(y, y_ref), relative_error(dx_t, dx_ref), relative_error(dw_t, dw_ref))
                    times = {"forward": bench(lambda: fplan.run(x, w, None)),
                             "input_grad": bench(lambda: dxplan.run(dy, x, w)),
                             "weight_grad": bench(lambda: dwplan.run(dy, x, w)),
                             "backward": bench(lambda: bplan.run(dy, x, w))}
                    row["triton"][key] = {"errors": errors, **times}
                except Exception as e:  # noqa: BLE001 - a probe: record and go on
                    row["triton"][key] = {"failed": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        save()
        report(row)


def report(row):
    ok = {k: v for k, v in row["triton"].items() if "failed" not in v}
    torch_t = row["torch_default"]
    parts = [row["label"]]
    for d in ("forward", "input_grad", "weight_grad", "backward"):
        if not ok:
            parts.append(f"{d}: all failed")
            continue
        best = min(ok, key=lambda key: ok[key][d])
        default = ok.get("layout-default", {}).get(d, float("nan"))
        parts.append(f"{d}: torch {torch_t[d] * 1e3:.1f} (bm {row['torch_benchmark'][d] * 1e3:.1f}) us, triton "
                     f"default {default * 1e3:.1f}, best {ok[best][d] * 1e3:.1f} [{best}] -> "
                     f"{torch_t[d] / ok[best][d]:.2f}x")
    worst = max((max(v["errors"]) for v in ok.values()), default=float("nan"))
    failed = [k for k, v in row["triton"].items() if "failed" in v]
    parts.append(f"worst error {worst:.1e}" + (f"; failed {failed}: {row['triton'][failed[0]]['failed']}" if failed else ""))
    print(" | ".join(parts), flush=True)


def pointwise_rows(batch, dtype, channels_last, tiles=POINTWISE_TILES):
    """1x1 convolution through cuDNN against the matmuls it is. Channels-last x: forward
    [NHW, C] @ [C, O]; input gradient [NHW, O] @ [O, C]; weight gradient [O, NHW] @ [NHW, C].
    Contiguous (NCHW) x: forward [O, C] @ [N, C, HW] (a batched matmul, the weight broadcast);
    input gradient [C, O] @ [N, O, HW]; weight gradient sum over n of [N, O, HW] @ [N, HW, C] (a
    batched matmul then a sum over the batch: what cuBLAS can do without copying x). And the registry's
    Triton 1x1 kernels over ``tiles``. Each matmul's and kernel's result is checked against the
    float64 convolution first."""
    rows = []
    layout = "cl" if channels_last else "nchw"
    for (cin, cout, size) in POINTWISE:
        x = torch.randn(batch, cin, size, size, device="cuda", dtype=dtype)
        w = torch.randn(cout, cin, 1, 1, device="cuda", dtype=dtype) * 0.05
        dy = torch.randn(batch, cout, size, size, device="cuda", dtype=dtype)
        if channels_last:
            x, dy = (t.to(memory_format=torch.channels_last) for t in (x, dy))
        wm = w.reshape(cout, cin)
        x64, w64, dy64 = x.double(), w.double(), dy.double()
        y_ref = F.conv2d(x64, w64)
        dx_ref, dw_ref, _ = torch.ops.aten.convolution_backward(
            dy64, x64, w64, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False])
        if channels_last:
            xm = x.permute(0, 2, 3, 1).reshape(-1, cin)
            dym = dy.permute(0, 2, 3, 1).reshape(-1, cout)
            mm_fns = {"forward": lambda: xm @ wm.t(), "input_grad": lambda: dym @ wm,
                      "weight_grad": lambda: dym.t() @ xm}
            as_nchw = {"forward": lambda r: r.view(batch, size, size, cout).permute(0, 3, 1, 2),
                       "input_grad": lambda r: r.view(batch, size, size, cin).permute(0, 3, 1, 2),
                       "weight_grad": lambda r: r}
        else:
            xb, dyb = x.view(batch, cin, -1), dy.view(batch, cout, -1)
            mm_fns = {"forward": lambda: wm @ xb, "input_grad": lambda: wm.t() @ dyb,
                      "weight_grad": lambda: torch.bmm(dyb, xb.transpose(1, 2)).sum(0)}
            as_nchw = {"forward": lambda r: r.view(batch, cout, size, size),
                       "input_grad": lambda r: r.view(batch, cin, size, size), "weight_grad": lambda r: r}
        refs = {"forward": y_ref, "input_grad": dx_ref, "weight_grad": dw_ref.reshape(cout, cin)}
        errors = {k: relative_error(as_nchw[k](fn()), refs[k]) for k, fn in mm_fns.items()}
        triton_rows = {}
        desc = dict(x_shape=x.shape, weight_shape=w.shape, dtype=dtype, device="cuda", channels_last=channels_last)
        with trainops.backend("triton"):
            for tile in tiles:
                key = "default" if tile is None else "/".join(map(str, tile))
                h = ConvHeuristics() if tile is None else ConvHeuristics(pointwise_tile=tile[:5],
                                                                         programs_per_sm=tile[5])
                try:
                    fplan = trainops.plan("conv2d", **desc, heuristics=h)
                    dxplan = trainops.plan("conv2d_backward", **desc, mask=(True, False, False), heuristics=h)
                    dwplan = trainops.plan("conv2d_backward", **desc, mask=(False, True, False), heuristics=h)
                    got = {"forward": fplan.run(x, w, None), "input_grad": dxplan.run(dy, x, w)[0],
                           "weight_grad": dwplan.run(dy, x, w)[1].reshape(cout, cin)}
                    entry = {"errors": {k: relative_error(v, refs[k]) for k, v in got.items()}}
                    if max(entry["errors"].values()) > 1e-2:
                        entry["failed"] = f"error {entry['errors']}"
                    else:
                        entry.update({"forward": bench(lambda: fplan.run(x, w, None)),
                                      "input_grad": bench(lambda: dxplan.run(dy, x, w)),
                                      "weight_grad": bench(lambda: dwplan.run(dy, x, w))})
                except Exception as e:  # noqa: BLE001 - a probe: record and go on
                    entry = {"failed": f"{type(e).__name__}: {e}"[:300]}
                triton_rows[key] = entry
        conv = {"forward": bench(lambda: F.conv2d(x, w)),
                "input_grad": bench(lambda: torch.ops.aten.convolution_backward(
                    dy, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, False, False])),
                "weight_grad": bench(lambda: torch.ops.aten.convolution_backward(
                    dy, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False]))}
        mm = {k: bench(fn) for k, fn in mm_fns.items()}
        flops = 2 * batch * size * size * cin * cout
        row = {"label": f"1x1 {batch}x{cin}x{size}x{size} -> {cout} {str(dtype)[6:]} {layout}", "conv_ms": conv,
               "matmul_ms": mm, "matmul_errors": errors, "tflops_conv": {k: flops / v / 1e9 for k, v in conv.items()},
               "tflops_matmul": {k: flops / v / 1e9 for k, v in mm.items()}, "triton": triton_rows}
        rows.append(row)
        ok = {k: v for k, v in triton_rows.items() if "failed" not in v}
        parts = []
        for d in conv:
            best = min(ok, key=lambda key: ok[key][d]) if ok else None
            parts.append(f"{d}: conv {conv[d] * 1e3:.1f}, matmul {mm[d] * 1e3:.1f}" + (
                f", triton default {ok['default'][d] * 1e3:.1f} ({conv[d] / ok['default'][d]:.2f}x)" if "default" in ok
                else "") + (f", best {ok[best][d] * 1e3:.1f} [{best}] ({conv[d] / ok[best][d]:.2f}x)" if best else ""))
        failed = [k for k, v in triton_rows.items() if "failed" in v]
        print(row["label"] + " | " + " | ".join(parts) + (f" | failed {failed}: {triton_rows[failed[0]]['failed']}"
                                                          if failed else ""), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", default="bf16-cl,bf16-nchw,fp32-cl",
                        help="comma-separated dtype-layout runs of the depthwise shapes (bf16 / fp32, cl / nchw)")
    parser.add_argument("--shapes", default=None, help="comma-separated indices into DEPTHWISE (default: all)")
    parser.add_argument("--tiles", default=None, help="comma-separated indices into TILES (default: all for bf16, "
                                                      "the first three for fp32)")
    parser.add_argument("--pointwise", default="bf16-cl,bf16-nchw",
                        help="comma-separated dtype-layout runs of ResNet-50's 1x1 convolutions ('' for none)")
    args = parser.parse_args(argv)
    shapes = DEPTHWISE[:3] if args.quick else DEPTHWISE
    if args.shapes:
        shapes = [DEPTHWISE[int(i)] for i in args.shapes.split(",")]
    tiles = TILES[:2] if args.quick else TILES
    if args.tiles:
        tiles = [TILES[int(i)] for i in args.tiles.split(",")]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cudnn": torch.backends.cudnn.version(), "depthwise": [], "pointwise": []}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for run in filter(None, args.runs.split(",")):
        name, layout = run.split("-")
        dtype = dtypes[name]
        depthwise_rows(32, dtype, layout == "cl", shapes, tiles if dtype == torch.bfloat16 or args.tiles else tiles[:3],
                       result["depthwise"], save)
    for run in filter(None, args.pointwise.split(",")):
        name, layout = run.split("-")
        result["pointwise"] += pointwise_rows(32, dtypes[name], layout == "cl")
        save()
    save()


if __name__ == "__main__":
    sys.exit(main())
