#!/usr/bin/env python3
"""Figures for the serving benchmark (bench/serving_bench.cc).

One result: normalized latency and average batch size vs request rate, one line per policy.

  python3 bench/serving_report.py bench/results/serving_sharegpt_sim.json
      -> bench/results/serving_sharegpt_sim.png

Sim vs real on the same trace slice: one Markdown table and one figure with both.

  python3 bench/serving_report.py --compare bench/results/serving_alpaca_real_cpu.json \\
      bench/results/serving_alpaca_sim_cpu.json --out-prefix bench/results/serving_alpaca_sim_vs_real
      -> serving_alpaca_sim_vs_real.{md,png}

HTTP server vs library (the compare executor): throughput and latency percentiles per rate.

  python3 bench/serving_report.py --http-vs-library bench/results/serving_alpaca_http_vs_library_tiny-random.json
      -> serving_alpaca_http_vs_library_tiny-random.png

Rates are numbers, or "inf" (every request at t = 0); line plots over rates leave "inf" out.
Every figure names the executor and the cost model that produced it. Needs matplotlib
(apt-get install -y python3-matplotlib).
"""
import argparse
import json
import os
import statistics
import sys
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

POLICY_STYLE = {
    "paged": ("tab:red", "o"),
    "orca-oracle": ("tab:green", "^"),
    "orca-pow2": ("tab:orange", "s"),
    "orca-max": ("tab:blue", "v"),
}


def load(path):
    with open(path) as f:
        return json.load(f)


def rate_value(rate):
    """A report's rate as a float ("inf" -> infinity)."""
    return float("inf") if rate == "inf" else float(rate)


def rate_label(rate):
    return "inf" if rate == "inf" else f"{rate:g}"


def series(report, policy, key):
    """(rates, values) of one policy, skipping runs where the metric is undefined and rate inf."""
    points = [(r["rate_req_s"], r[key]) for r in report["runs"]
              if r["policy"] == policy and r[key] is not None and r["rate_req_s"] != "inf"]
    points.sort()
    return [p[0] for p in points], [p[1] for p in points]


def provenance(report):
    """Which executor and cost model produced the numbers, for figure captions."""
    executor = report["executor"]
    if executor["name"] == "sim":
        return "sim executor, " + executor["cost_model"]["description"]
    return f"{executor['name']} executor: " + executor["description"]


def trace_line(report):
    t = report["trace"]
    c = report["config"]
    return (f"{t['name']} trace, {t['num_requests']} requests (input mean {t['input_len']['mean']:.0f}, "
            f"output mean {t['output_len']['mean']:.0f} tokens; tokenizer {t['tokenizer']}); "
            f"KV {c['num_device_blocks']} blocks x {c['block_size']}, max_model_len {c['max_model_len']}")


def caption(*lines, width=130):
    """Figure titles wrapped to the figure's width."""
    return "\n".join(textwrap.fill(line, width) for line in lines)


def plot_report(report, out_png):
    fig, (ax_lat, ax_batch) = plt.subplots(1, 2, figsize=(12, 4.8))
    bound = report["latency_bound"]["bound_s_per_token"]
    for policy in report["policies"]:
        color, marker = POLICY_STYLE.get(policy, (None, "x"))
        rates, lat = series(report, policy, "normalized_latency_s_per_token")
        sustainable = report["sustainable_rate_req_s"].get(policy)
        label = policy + (f" (sustains {rate_label(sustainable)} req/s)" if sustainable else " (sustains none tested)")
        ax_lat.plot(rates, lat, marker=marker, color=color, label=label)
        rates, batch = series(report, policy, "avg_batch_seqs")
        ax_batch.plot(rates, batch, marker=marker, color=color, label=policy)
    ax_lat.axhline(bound, color="gray", linestyle="--", linewidth=1, label=f"bound {bound:.3g} s/token")
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("request rate (req/s)")
    ax_lat.set_ylabel("normalized latency (s/token)")
    ax_lat.set_title("normalized latency")
    ax_lat.legend(fontsize=8)
    ax_lat.grid(True, which="both", alpha=0.3)
    ax_batch.set_xlabel("request rate (req/s)")
    ax_batch.set_ylabel("sequences per step (mean)")
    ax_batch.set_title("average batch size")
    ax_batch.legend(fontsize=8)
    ax_batch.grid(True, alpha=0.3)
    fig.suptitle(caption(f"kvflow serving: {provenance(report)}", trace_line(report)), fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def check_comparable(real, sim):
    """The two runs must replay the same requests under the same budget."""
    problems = []
    for key in ("num_requests", "tokenizer", "input_len", "output_len"):
        if real["trace"].get(key) != sim["trace"].get(key):
            problems.append(f"trace {key}: real {real['trace'].get(key)} vs sim {sim['trace'].get(key)}")
    if real["config"] != sim["config"]:
        problems.append(f"config: real {real['config']} vs sim {sim['config']}")
    if real["arrival_seed"] != sim["arrival_seed"]:
        problems.append("arrival seeds differ")
    return problems


def fmt(v, spec=".3g"):
    return "n/a" if v is None else format(v, spec)


def fmt_rate(v):
    return "n/a" if v is None else rate_label(v)


def ratio(sim_value, real_value):
    if sim_value is None or real_value in (None, 0):
        return None
    return sim_value / real_value


def compare(real, sim, out_prefix):
    runs_sim = {(r["policy"], r["rate_req_s"]): r for r in sim["runs"]}
    rows, lat_ratios, tput_ratios = [], [], []
    for r in real["runs"]:
        s = runs_sim.get((r["policy"], r["rate_req_s"]))
        if s is None:
            continue
        lat = ratio(s["normalized_latency_s_per_token"], r["normalized_latency_s_per_token"])
        tput = ratio(s["throughput_output_tok_s"], r["throughput_output_tok_s"])
        if lat is not None:
            lat_ratios.append(lat)
        if tput is not None:
            tput_ratios.append(tput)
        rows.append(
            f"| {r['policy']} | {rate_label(r['rate_req_s'])} | {fmt(r['normalized_latency_s_per_token'])} | "
            f"{fmt(s['normalized_latency_s_per_token'])} | {fmt(lat, '.2f')} | "
            f"{r['throughput_output_tok_s']:.0f} | {s['throughput_output_tok_s']:.0f} | "
            f"{fmt(r['ttft_s']['p50'])} | {fmt(s['ttft_s']['p50'])} | {fmt(r['tpot_s']['p50'])} | "
            f"{fmt(s['tpot_s']['p50'])} | {fmt(r['avg_batch_seqs'], '.1f')} | {fmt(s['avg_batch_seqs'], '.1f')} | "
            f"{r['preemptions']['recompute'] + r['preemptions']['swap']} | "
            f"{s['preemptions']['recompute'] + s['preemptions']['swap']} | {r['failed']} / {s['failed']} |")
    md = [f"# Serving benchmark: sim vs real, {real['trace']['name']} trace", "",
          f"- real: {provenance(real)}", f"- sim: {provenance(sim)}", f"- {trace_line(real)}", ""]
    problems = check_comparable(real, sim)
    md += [f"- WARNING, not the same setup: {p}" for p in problems]
    md += ["| policy | rate (req/s) | norm. latency real (s/tok) | sim | sim / real | output tok/s real | sim | "
           "TTFT p50 real (s) | sim | TPOT p50 real (s) | sim | avg batch real | sim | preemptions real | sim | "
           "failed real / sim |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"] + rows
    if lat_ratios:
        md += ["", f"Median sim / real: normalized latency {statistics.median(lat_ratios):.2f} "
                   f"(range {min(lat_ratios):.2f}-{max(lat_ratios):.2f}), output throughput "
                   f"{statistics.median(tput_ratios):.2f} (range {min(tput_ratios):.2f}-{max(tput_ratios):.2f}) "
                   f"over {len(lat_ratios)} (policy, rate) points."]
    md += ["", "| policy | sustainable rate real (req/s) | sim |", "|---|---|---|"]
    for policy in real["policies"]:
        md.append(f"| {policy} | {fmt_rate(real['sustainable_rate_req_s'].get(policy))} | "
                  f"{fmt_rate(sim['sustainable_rate_req_s'].get(policy))} |")
    md.append("")
    text = "\n".join(md)
    with open(out_prefix + ".md", "w") as f:
        f.write(text)
    print(text)

    fig, ax = plt.subplots(figsize=(8, 5))
    for policy in real["policies"]:
        color, marker = POLICY_STYLE.get(policy, (None, "x"))
        ax.plot(*series(real, policy, "normalized_latency_s_per_token"), marker=marker, color=color,
                label=f"{policy} real")
        ax.plot(*series(sim, policy, "normalized_latency_s_per_token"), marker=marker, color=color, linestyle="--",
                markerfacecolor="none", label=f"{policy} sim")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(caption("kvflow serving, sim vs real", f"solid: {provenance(real)}", f"dashed: {provenance(sim)}",
                         trace_line(real), width=115), fontsize=8)
    fig.tight_layout()
    fig.savefig(out_prefix + ".png", dpi=120)
    plt.close(fig)
    return 1 if problems else 0


def http_vs_library(report, out_png):
    """Library (solid) vs server (dashed) per rate: throughput, TTFT, TPOT, e2e latency."""
    runs = sorted(report["runs"], key=lambda r: rate_value(r["rate_req_s"]))
    labels = [rate_label(r["rate_req_s"]) for r in runs]
    x = list(range(len(runs)))
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.6))
    sides = (("library", "tab:blue", "-"), ("server", "tab:red", "--"))
    ax = axes[0]
    for side, color, style in sides:
        ax.plot(x, [r[side]["throughput_output_tok_s"] for r in runs], marker="o", color=color, linestyle=style,
                label=side)
    for i, r in enumerate(runs):
        overhead = r["comparison"]["http_overhead"]
        if overhead is not None:
            label = f"{round(100 * overhead, 1) + 0.0:.1f}%"  # + 0.0: no "-0.0%"
            ax.annotate(label, (i, r["server"]["throughput_output_tok_s"]), fontsize=7, textcoords="offset points",
                        xytext=(0, 6), ha="center", color="tab:red")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput (label: HTTP overhead)")
    for ax, key, title in ((axes[1], "ttft_s", "TTFT"), (axes[2], "tpot_s", "TPOT"), (axes[3], "e2e_s", "e2e latency")):
        for side, color, style in sides:
            for q, marker, alpha in (("p50", "o", 1.0), ("p99", "^", 0.5)):
                points = [(i, r[side][key][q]) for i, r in enumerate(runs) if r[side][key][q] is not None]
                if points:
                    ax.plot(*zip(*points), marker=marker, color=color, linestyle=style, alpha=alpha,
                            label=f"{side} {q}")
        ax.set_yscale("log")
        ax.set_ylabel("seconds")
        ax.set_title(title)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    t, c = report["trace"], report["config"]
    fig.suptitle(caption(
        f"kvflow-server over HTTP (dashed) vs the library in-process (solid): {report['model']}, "
        f"{report['machine']['cpu']}, engine threads {report['machine']['engine_threads']}",
        f"{t['name']} trace, {t['num_requests']} requests (input mean {t['input_len']['mean']:.0f}, output mean "
        f"{t['output_len']['mean']:.0f} tokens); KV {c['num_device_blocks']} blocks x {c['block_size']}, "
        f"max_model_len {c['max_model_len']}; rate inf = all requests at t = 0", width=170), fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="*", help="serving_<trace>_<executor>.json files to plot (PNG beside each)")
    ap.add_argument("--compare", nargs=2, metavar=("REAL_JSON", "SIM_JSON"),
                    help="a real and a sim result of the same trace slice: one table and one figure")
    ap.add_argument("--out-prefix", help="output path without extension for --compare")
    ap.add_argument("--http-vs-library", nargs="+", default=[], metavar="JSON",
                    help="serving_<trace>_http_vs_library*.json from the compare executor (PNG beside each)")
    args = ap.parse_args()
    if not args.results and not args.compare and not args.http_vs_library:
        ap.error("give result JSON files, --compare REAL_JSON SIM_JSON and/or --http-vs-library JSON")
    for path in args.http_vs_library:
        out_png = os.path.splitext(path)[0] + ".png"
        http_vs_library(load(path), out_png)
        print(f"wrote {out_png}", file=sys.stderr)
    for path in args.results:
        out_png = os.path.splitext(path)[0] + ".png"
        plot_report(load(path), out_png)
        print(f"wrote {out_png}", file=sys.stderr)
    if args.compare:
        if not args.out_prefix:
            ap.error("--compare needs --out-prefix")
        status = compare(load(args.compare[0]), load(args.compare[1]), args.out_prefix)
        print(f"wrote {args.out_prefix}.md and .png", file=sys.stderr)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
