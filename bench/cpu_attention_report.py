#!/usr/bin/env python3
"""The CPU paged attention alone (kvflow_bench_attention), against the machine's read bandwidth and,
optionally, against a baseline build of the same benchmark, in one run.

    bench/cpu_attention_report.py                                   # this build only
    bench/cpu_attention_report.py --baseline /tmp/old/build/bench/kvflow_bench_attention

Cases: decode of one token over 1K/4K/8K cached tokens (1 and 2 threads), verification of a token
and 4 or 8 drafts at 8K (speculative decoding's full-cache pass), 512-token prefill chunks; the KV
pools rotate through 128 MiB so decode reads them from memory, as a model's layers do. The read
bandwidth is the benchmark's BM_ReadBandwidth (every thread sums its share of 256 MiB). Builds are
run in alternating rounds (the machine's noise falls on both alike); each case's figure is the
median over rounds of each round's median.

Writes JSON, Markdown and (with matplotlib) a PNG under --out-prefix.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import provenance  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILTER = "BM_Decode|BM_Verify|BM_Prefill/(0|3584)/2"
KV_BYTES_PER_TOKEN = 2 * 3 * 64 * 2  # K and V, 3 KV heads x 64, fp16: one layer of SmolLM2-135M


def run_bench(exe, bench_filter, min_time, repetitions, env=None):
    cmd = [exe, f"--benchmark_filter={bench_filter}", f"--benchmark_min_time={min_time}",
           f"--benchmark_repetitions={repetitions}", "--benchmark_report_aggregates_only=true",
           "--benchmark_format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, check=True)
    rows = {}
    for b in json.loads(out.stdout)["benchmarks"]:
        if b.get("aggregate_name") != "median" and "read_GB/s" not in b:
            continue
        name = b["run_name"]
        rows[name] = {"us": b["real_time"] * {"us": 1, "ms": 1e3, "ns": 1e-3}[b["time_unit"]],
                      "gflops": b.get("GFLOP/s"), "kv_gbps": b.get("KV_GB/s"), "read_gbps": b.get("read_GB/s"),
                      "isa": b.get("label")}
    return rows, " ".join(cmd)


def describe(name):
    parts = name.split("/")
    kind = parts[0][3:]
    if kind == "Decode":
        return f"decode, context {parts[1]}", int(parts[2])
    if kind == "Verify":
        return f"verify {parts[3]} tokens, context {parts[1]}", int(parts[2])
    if kind == "Prefill":
        return f"prefill 512 after {parts[1]}", int(parts[2])
    return name, 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exe", default=os.path.join(REPO, "build", "bench", "kvflow_bench_attention"))
    ap.add_argument("--baseline", help="the same benchmark from another build (e.g. the previous commit's)")
    ap.add_argument("--baseline-label", default="baseline")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of every build")
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--out-prefix", default=os.path.join(REPO, "bench", "results", "cpu_attention"))
    args = ap.parse_args()

    builds = [("kvflow", args.exe)] + ([(args.baseline_label, args.baseline)] if args.baseline else [])
    per_round = {label: [] for label, _ in builds}
    commands = {}
    for r in range(args.rounds):
        for label, exe in builds:
            print(f"[round {r + 1}/{args.rounds}] {label}: {exe}", file=sys.stderr, flush=True)
            rows, cmd = run_bench(exe, FILTER, args.min_time, args.repetitions)
            per_round[label].append(rows)
            commands[label] = cmd
    bw_rows, bw_cmd = run_bench(args.exe, "BM_ReadBandwidth", 0.01, 1)
    bandwidth = {int(k.split("/")[1]): v["read_gbps"] for k, v in bw_rows.items() if v.get("read_gbps")}

    cases = []
    for name in per_round["kvflow"][0]:
        what, threads = describe(name)
        case = {"name": name, "case": what, "threads": threads, "isa": per_round["kvflow"][0][name]["isa"]}
        for label, _ in builds:
            runs = [rows[name] for rows in per_round[label] if name in rows]
            if not runs:
                continue
            us = statistics.median(r["us"] for r in runs)
            gflops = statistics.median(r["gflops"] for r in runs)
            kv = statistics.median(r["kv_gbps"] for r in runs)
            case[label] = {"us": us, "us_per_round": [r["us"] for r in runs], "gflops": gflops, "kv_gbps": kv}
        if args.baseline and args.baseline_label in case:
            case["speedup"] = case[args.baseline_label]["us"] / case["kvflow"]["us"]
        if what.startswith("decode") and threads in bandwidth:
            case["roofline_share"] = case["kvflow"]["kv_gbps"] / bandwidth[threads]
        cases.append(case)
    by_name = {c["name"]: c for c in cases}
    verify_cost = {}
    for n in (5, 9):
        one, many = by_name.get("BM_Verify/8192/2/1"), by_name.get(f"BM_Verify/8192/2/{n}")
        if one and many:
            verify_cost[n] = {label: many[label]["us"] / one[label]["us"] for label, _ in builds if label in many}

    doc = {"provenance": provenance(per_run_figures="cases[].<build>.us_per_round"),
           "commands": {**commands, "bandwidth": bw_cmd}, "read_bandwidth_gbps": bandwidth,
           "kv_bytes_per_token_per_layer": KV_BYTES_PER_TOKEN, "rounds": args.rounds, "cases": cases,
           "verify_cost_vs_one_token": verify_cost,
           "measured": "every time, GFLOP/s, KV GB/s and the read bandwidth",
           "modeled": "nothing"}
    with open(args.out_prefix + ".json", "w") as f:
        json.dump(doc, f, indent=1)

    labels = [label for label, _ in builds]
    L = ["# CPU paged attention alone (`kvflow_bench_attention`), SmolLM2-135M head layout\n",
         "One layer: 9 query heads, 3 KV heads, head_dim 64, 16-token blocks in shuffled order, fp16 KV rotating "
         "through 128 MiB (read from memory, as a model's layers are). "
         f"Kernel set `{cases[0]['isa']}`; {args.rounds} alternating rounds of every build, each the median of "
         f"{args.repetitions} repetitions; the figure is the median over rounds. "
         f"Machine: {doc['provenance']['machine'].get('cpu', 'CPU')}, measured {doc['provenance']['date']} "
         f"(commit {doc['provenance']['commit']}).\n",
         "Read bandwidth (measured, BM_ReadBandwidth): " +
         ", ".join(f"{v:.1f} GB/s on {k} thread{'s' if k > 1 else ''}" for k, v in sorted(bandwidth.items())) +
         ". KV GB/s = the K and V bytes a step reads per second; for decode that is the roofline measure.\n"]
    head = "| case | threads | " + " | ".join(f"{lb} µs" for lb in labels)
    head += " | speed-up | GFLOP/s | KV GB/s | % of read bandwidth |" if args.baseline else \
        " | GFLOP/s | KV GB/s | % of read bandwidth |"
    L.append(head)
    L.append("|" + "---|" * (head.count("|") - 1))
    for c in cases:
        row = f"| {c['case']} | {c['threads']} | " + " | ".join(
            f"{c[lb]['us']:.0f}" if lb in c else "-" for lb in labels)
        if args.baseline:
            row += f" | {c.get('speedup', float('nan')):.2f}x"
        share = f"{100 * c['roofline_share']:.0f}%" if "roofline_share" in c else "-"
        row += f" | {c['kvflow']['gflops']:.1f} | {c['kvflow']['kv_gbps']:.2f} | {share} |"
        L.append(row)
    if verify_cost:
        L.append("")
        L.append("Verification at 8K on 2 threads, cost against one token's attention: " + "; ".join(
            f"{n} tokens " + ", ".join(f"{lb} {v:.2f}x" for lb, v in costs.items()) for n, costs in verify_cost.items())
            + ".")
    L.append("\nReproduce: `" + " ".join(os.path.relpath(a, REPO) if os.path.isabs(a) else a for a in sys.argv) + "`; "
             "one build's own command: `" + commands["kvflow"].replace(REPO + "/", "") + "`.")
    with open(args.out_prefix + ".md", "w") as f:
        f.write("\n".join(L) + "\n")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot skipped: {e}", file=sys.stderr)
    else:
        shown = [c for c in cases if c["threads"] == 2 and not c["case"].startswith("prefill")]
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(labels)
        for i, lb in enumerate(labels):
            ax.bar([x + i * width for x in range(len(shown))], [c[lb]["us"] if lb in c else 0 for c in shown],
                   width, label=lb)
        ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(shown))])
        ax.set_xticklabels([c["case"].replace(", context", "\n@") for c in shown], fontsize=8)
        ax.set_ylabel("µs per layer (2 threads)")
        ax.set_title("CPU attention, one SmolLM2-135M layer, fp16 KV from memory")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out_prefix + ".png", dpi=120)
    print("\n".join(L))


if __name__ == "__main__":
    main()
