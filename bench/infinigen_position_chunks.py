#!/usr/bin/env python3
"""InfiniGen along a sequence (the paper's Fig. 12, measured): perplexity of each 256-token span of
decoding positions over long windows, for the full cache, InfiniGen at its defaults, H2O at the
same KV bytes and at 20%, and a 4-bit KV cache, on WikiText-2 through `kvflow perplexity`.

Each window of --ctx tokens prefills its first --prompt tokens densely, then runs every later token
as a decode step (teacher-forced: `--decode-from`), scoring them in spans of --chunk positions
(`--position-chunk`). A selection that drifts as the context grows shows as a gap that widens
along the sequence.

    bench/infinigen_position_chunks.py                         # 4096-token windows from 1024
    bench/infinigen_position_chunks.py --windows 2 --prompt 2048

Writes bench/results/infinigen_position_chunks.{json,md,png}; runs are cached under
.cache/infinigen_position_chunks/ (a rerun skips what is done; --fresh starts over). The InfiniGen
and H2O flags are bench/infinigen_accuracy.py's.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import infinigen_accuracy as accuracy  # noqa: E402
from provenance import provenance  # noqa: E402

ROOT = accuracy.ROOT


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    accuracy.add_model_args(p)
    p.add_argument("--ctx", type=int, default=4096, help="tokens per window")
    p.add_argument("--prompt", type=int, default=1024, help="dense prompt tokens per window (the rest decoded)")
    p.add_argument("--chunk", type=int, default=256, help="positions per reported span")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--alpha", type=float, default=5.0)
    p.add_argument("--cap", type=float, default=0.2)
    p.add_argument("--out-prefix", default=os.path.join(ROOT, "bench", "results", "infinigen_position_chunks"))
    p.add_argument("--cache", default=os.path.join(ROOT, ".cache", "infinigen_position_chunks"))
    p.add_argument("--fresh", action="store_true", help="ignore cached runs")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args()
    # What bench/infinigen_accuracy.py's serving protocol reads.
    args.serving_windows = args.windows
    return args


# InfiniGen's defaults (bench/results/infinigen_accuracy.md: count per query head, 50% of the columns).
DEFAULTS = {"count": "query-heads", "ratio": 0.5}


def run(args, name, extra):
    return accuracy.run(args, "serving", name, extra + ["--position-chunk", str(args.chunk)])


def series(r, full, label, group, extra=None):
    chunks = r["position_chunks"]
    full_chunks = {c["from"]: c for c in full["position_chunks"]}
    sel = r.get("kv_selection")
    d = {"name": r["name"], "label": label, "group": group, "perplexity": r["perplexity"],
         "delta_vs_full": r["perplexity"] / full["perplexity"] - 1.0,
         "selection_fraction": sel["selection_fraction"] if sel else 1.0,
         "bytes_read_fraction": sel["bytes_read"] / sel["bytes_full"] if sel and sel["bytes_full"] else 1.0,
         "chunks": [{"from": c["from"], "to": c["to"], "scored_tokens": c["scored_tokens"],
                     "perplexity": c["perplexity"],
                     "delta_vs_full": c["perplexity"] / full_chunks[c["from"]]["perplexity"] - 1.0}
                    for c in chunks],
         "seconds": r["seconds"], "command": r["command"]}
    if extra:
        d.update(extra)
    return d


def markdown(args, doc):
    rows = doc["rows"]
    spans = [c["from"] for c in rows[0]["chunks"]]
    lines = ["# InfiniGen along a sequence (measured; the paper's Fig. 12)", "",
             f"{args.model} (SmolLM2-135M-Instruct, Q4_1 weights, fp16 KV), WikiText-2 test: {doc['windows']} windows "
             f"of {args.ctx} tokens, each prefilling its first {args.prompt} tokens densely and decoding the rest one "
             f"per step (teacher-forced), scored in spans of {args.chunk} positions ({doc['scored_tokens']} tokens "
             f"per run). InfiniGen alpha {args.alpha:g}, cap {100 * args.cap:g}% of the context so far, its defaults "
             "(count per query head, 50% of the columns). Each cell: the span's perplexity change against the full "
             "cache's over the same tokens; the last row gives the full cache's own perplexity per span.", "",
             "| run | all | bytes | " + " | ".join(f"{s}-{s + args.chunk}" for s in spans) + " |",
             "|---|---:|---:|" + "---:|" * len(spans)]
    for d in rows:
        if d["name"] == "full":
            continue
        lines.append(f"| {d['label']} | {100 * d['delta_vs_full']:+.2f}% | {100 * d['bytes_read_fraction']:.1f}%"
                     + (" (constant)" if "bytes_read_fraction_source" in d else "") + " | "
                     + " | ".join(f"{100 * c['delta_vs_full']:+.1f}%" for c in d["chunks"]) + " |")
    full = next(d for d in rows if d["name"] == "full")
    lines.append(f"| full cache (perplexity) | {full['perplexity']:.2f} | 100% | "
                 + " | ".join(f"{c['perplexity']:.2f}" for c in full["chunks"]) + " |")
    lines.append("")
    return "\n".join(lines)


def plot(args, doc):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    colors = {"baseline": "black", "infinigen": "tab:blue", "h2o": "tab:red", "int4": "tab:gray"}
    styles = {"h2o_b0.2": "--"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for d in doc["rows"]:
        xs = [(c["from"] + c["to"]) / 2 for c in d["chunks"]]
        color, style = colors.get(d["group"], "tab:gray"), styles.get(d["name"], "-")
        axes[0].plot(xs, [c["perplexity"] for c in d["chunks"]], style, marker="o", markersize=3, color=color,
                     label=d["label"])
        if d["name"] != "full":
            axes[1].plot(xs, [100 * c["delta_vs_full"] for c in d["chunks"]], style, marker="o", markersize=3,
                         color=color, label=d["label"])
    axes[0].set_ylabel(f"perplexity of each {args.chunk}-token span")
    axes[1].set_ylabel("vs the full cache, %")
    axes[1].set_yscale("symlog", linthresh=5)
    axes[1].axhline(0, color="black", linewidth=0.8)
    for ax in axes:
        ax.set_xlabel("position in the window (tokens)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{args.model}: decoding from {args.prompt} to {args.ctx} tokens ({doc['windows']} windows of "
                 "WikiText-2 test)")
    fig.tight_layout()
    fig.savefig(args.out_prefix + ".png", dpi=110)
    print(f"wrote {args.out_prefix}.png", file=sys.stderr)


def main():
    args = parse_args()
    accuracy.check_inputs(args)
    if not 0 < args.prompt < args.ctx:
        accuracy.fail(f"--prompt must be in (0, --ctx), not {args.prompt}")
    if args.chunk < 1:
        accuracy.fail(f"--chunk must be positive, not {args.chunk}")
    os.makedirs(args.cache, exist_ok=True)
    full = run(args, "full", [])
    rows = [series(full, full, "full cache", "baseline")]
    ig = run(args, "infinigen", accuracy.infinigen_flags(args, "serving", DEFAULTS))
    rows.append(series(ig, full, "InfiniGen (defaults)", "infinigen", {"settings": dict(accuracy.BEFORE, **DEFAULTS)}))
    matched = round(ig["kv_selection"]["bytes_read"] / ig["kv_selection"]["bytes_full"], 4)
    for budget, tag in [(matched, "matched to InfiniGen's bytes"), (args.cap, f"{100 * args.cap:g}%")]:
        r = run(args, f"h2o_b{budget:g}", ["--kv-selection", "h2o", "--h2o-budget", f"{budget:g}"])
        rows.append(series(r, full, f"H2O, budget {100 * budget:.1f}% ({tag})", "h2o", {"h2o_budget": budget}))
    r = run(args, "int4", ["--kv-cache-dtype", "q4"])
    rows.append(series(r, full, "INT4 KV (group 32)", "int4",
                       {"bytes_read_fraction": 20 / 64,
                        "bytes_read_fraction_source": "constant 20/64 by construction (not measured)"}))
    doc = {"benchmark": "infinigen_position_chunks", "measured": True, "model": args.model, "ctx": args.ctx,
           "prompt": args.prompt, "chunk": args.chunk, "alpha": args.alpha, "cap": args.cap,
           "windows": full["windows"], "scored_tokens": full["scored_tokens"], "rows": rows,
           "provenance": provenance(per_run_figures="rows[] (one kvflow perplexity run each, command in "
                                                    "rows[].command)")}
    accuracy.write_report(args, doc, markdown(args, doc), plot)


if __name__ == "__main__":
    main()
