#!/usr/bin/env python3
"""Plots kvflow_bench_cuda's results (bench/results/cuda_<gpu>.json, written by tools/gpu-session):

  left:  paged decode attention, achieved bandwidth against the KV bytes a step reads, one line per
         head layout and batch, with the copy bandwidth measured in the same run as the ceiling;
  right: end-to-end decode tokens/s against batch for each random-weight shape (CUDA graphs on),
         with each shape's bandwidth roofline (bytes a step must read / copy bandwidth) dashed.

Usage: bench/cuda_report.py bench/results/cuda_NVIDIA_H200.json [-o PNG]   (needs matplotlib)
Every number plotted is measured; the roofline is computed from the measured copy bandwidth.
"""
import argparse
import json
import sys
from collections import defaultdict


def decode_series(result):
    """{(q_heads, kv_heads, head_dim, batch): [(kv_mib, gbs), ...]} of the measured decode rows."""
    series = defaultdict(list)
    for r in result.get("decode_attention", []):
        if "achieved_gbs" not in r:
            continue
        key = (r.get("heads"), r.get("kv_heads"), r.get("head_dim"), r["batch"])
        series[key].append((r["kv_read_mib"], r["achieved_gbs"]))
    return {k: sorted(v) for k, v in series.items()}


def e2e_series(result, graphs=True):
    """{shape: [(batch, tokens_per_s, roofline_tokens_per_s), ...]} of the measured end-to-end rows."""
    series = defaultdict(list)
    for r in result.get("end_to_end", []):
        if "tokens_per_s" not in r or bool(r.get("cuda_graphs")) != graphs:
            continue
        roof = r["batch"] / (r["roofline_ms"] * 1e-3)
        series[r["shape"]].append((r["batch"], r["tokens_per_s"], roof))
    return {k: sorted(v) for k, v in series.items()}


def plot(result, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("cuda_report: matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    copy = result["copy_bandwidth_gbs"]
    layouts = sorted({k[:3] for k in decode_series(result)})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (key, points) in sorted(decode_series(result).items()):
        c = colors[layouts.index(key[:3]) % len(colors)]
        xs, ys = zip(*points)
        style = {1: ":", 16: "-.", 64: "--", 256: "-"}.get(key[3], "-")
        label = f"{key[0]}/{key[1]} heads, d{key[2]}, batch {key[3]}"
        left.plot(xs, ys, style, marker="o", ms=3, color=c, label=label)
    left.axhline(copy, color="black", lw=1)
    left.text(0.6, copy * 1.02, f"copy bandwidth {copy:.0f} GB/s", fontsize=8)
    left.set_xscale("log")
    left.set_xlabel("KV read per step (MiB)")
    left.set_ylabel("achieved GB/s")
    left.set_title("Paged decode attention (fp16, block 16)")
    left.legend(fontsize=6.5, ncol=2, loc="lower right")
    left.grid(alpha=0.3)
    for i, (shape, points) in enumerate(sorted(e2e_series(result).items())):
        c = colors[i % len(colors)]
        bs, tps, roof = zip(*points)
        right.plot(bs, tps, marker="o", color=c, label=f"{shape} measured")
        right.plot(bs, roof, "--", color=c, alpha=0.6, label=f"{shape} roofline")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("batch (context 1K)")
    right.set_ylabel("decode tokens/s")
    right.set_title("End-to-end decode, random fp16 weights, CUDA graphs")
    right.legend(fontsize=7)
    right.grid(alpha=0.3, which="both")
    fig.suptitle(f"kvflow on {result.get('device', '?')}: measured "
                 f"(copy {copy:.0f} GB/s, cuBLAS fp16 {result.get('cublas_fp16_gemm_tflops', 0):.0f} TFLOP/s)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"cuda_report: wrote {out}")
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="cuda_<gpu>.json from kvflow_bench_cuda")
    ap.add_argument("-o", "--out", help="PNG path (default: the JSON's path with .png)")
    args = ap.parse_args(argv)
    try:
        with open(args.json) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        print(f"cuda_report: cannot read {args.json}: {e}", file=sys.stderr)
        return 2
    if "copy_bandwidth_gbs" not in result:
        print(f"cuda_report: {args.json} is not kvflow_bench_cuda output (no copy_bandwidth_gbs)", file=sys.stderr)
        return 2
    out = args.out or args.json.rsplit(".", 1)[0] + ".png"
    return 0 if plot(result, out) else 77


if __name__ == "__main__":
    sys.exit(main())
