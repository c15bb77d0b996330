#!/usr/bin/env python3
"""InfiniGen's accuracy under three protocols (measured), each choice of the selection rule measured
alone, against the oracle (each layer's own query against its whole keys: the ceiling of any
speculation at the same budget), H2O at the same budget and a 4-bit KV cache, all on WikiText-2
through `kvflow perplexity`:

  serving  a dense prompt, then decoding: each window's first --prompt tokens are prefilled (every
           layer reads everything), the rest run one per step as decode steps and only they are
           scored (`--decode-from`; the paper's serving runs: 1920 in, 128 out).
  paper    the published accuracy code's: token by token over each window, a cap of 20% of the
           window (409 of 2048 tokens) whatever the context so far, the first 409 positions dense,
           layers 0-1 dense; the paper reports "KV size" 1 - sqrt(1 - density), shown beside the
           density.
  strict   kvflow's first protocol: token by token, every position a decode step, the cap 20% of
           the context so far, layer 0 dense.

    bench/infinigen_accuracy.py                      # all three, default sizes
    bench/infinigen_accuracy.py --protocols serving --serving-windows 32

Writes bench/results/infinigen_accuracy.{json,md,png}. Runs are cached under
.cache/infinigen_accuracy/ (a rerun skips what is done; --fresh starts over).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

from provenance import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_model_args(p):
    """The binary, model and texts every InfiniGen accuracy script runs (checked by check_inputs)."""
    p.add_argument("--kvflow", default=os.path.join(ROOT, "build", "kvflow"), help="the kvflow CLI")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--test", default=os.path.join(ROOT, "..", "shared", "datasets", "wikitext-2", "test.txt"))
    p.add_argument("--valid", default=os.path.join(ROOT, "..", "shared", "datasets", "wikitext-2", "valid.txt"),
                   help="sample text for the skewing files (kept apart from the scored text)")


def check_inputs(args):
    for f in (args.kvflow, args.test, args.valid):
        if not os.path.exists(f):
            fail(f"{f} not found")


def write_report(args, doc, text, plot):
    """The JSON, the markdown (also printed) and, unless --no-plot, the plot under --out-prefix."""
    with open(args.out_prefix + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(args.out_prefix + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    if not args.no_plot:
        plot(args, doc)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--protocols", default="serving,paper,strict")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=1920, help="serving: prompt tokens per window (the rest decoded)")
    p.add_argument("--serving-windows", type=int, default=24)
    p.add_argument("--token-windows", type=int, default=2, help="paper and strict: windows run token by token")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--alpha", type=float, default=5.0)
    p.add_argument("--cap", type=float, default=0.2)
    p.add_argument("--matched", default="chosen",
                   help="the InfiniGen run H2O's matched budget copies (its bytes over all layers)")
    p.add_argument("--runs", default="", help="only these run names (comma-separated; default: all under serving, "
                                              "--token-runs under paper and strict)")
    p.add_argument("--token-runs", default="oracle_qheads,before,qheads,qheads_r05,chosen,chosen_cap,h2o,int4",
                   help="the runs of the token-by-token protocols (each costs 4-10x a serving run)")
    p.add_argument("--out-prefix", default=os.path.join(ROOT, "bench", "results", "infinigen_accuracy"))
    p.add_argument("--cache", default=os.path.join(ROOT, ".cache", "infinigen_accuracy"))
    p.add_argument("--fresh", action="store_true", help="ignore cached runs")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args()


def fail(msg):
    print(f"infinigen_accuracy: {msg}", file=sys.stderr)
    sys.exit(2)


def skew_file(args, ratio, rule):
    path = os.path.join(args.cache, f"skew_r{ratio:g}_{rule}.infinigen")
    if not os.path.exists(path) or args.fresh:
        cmd = [args.kvflow, "skew", "--model", args.model, "--file", args.valid, "--partial-ratio", f"{ratio:g}",
               "--partial-rule", rule, "--threads", str(args.threads), "-o", path]
        print("$ " + " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return path


# The InfiniGen settings each run changes from the paper's rule as kvflow first built it ("before":
# KV-head max counting, layer 0 dense, partial columns by |Q|+|K| sums at ratio 0.3).
BEFORE = {"count": "kv-head-max", "dense": 1, "ratio": 0.3, "rule": "abs-sum", "sinks": 0, "recent": 0,
          "point": "after-attention", "alpha": None}  # alpha None: --alpha


def infinigen_runs():
    """(name, label, group, settings changed from BEFORE)."""
    return [
        ("oracle_kvmax", "oracle (true query, whole keys), KV-head max", "oracle", {"point": "oracle"}),
        ("oracle_qheads", "oracle, per query head", "oracle", {"point": "oracle", "count": "query-heads"}),
        ("oracle_qheads_d2", "oracle, per query head, layers 0-1 dense", "oracle",
         {"point": "oracle", "count": "query-heads", "dense": 2}),
        ("before", "InfiniGen as first built", "infinigen", {}),
        ("qheads", "+ count per query head, union per KV head", "alone", {"count": "query-heads"}),
        ("dense2", "+ layers 0-1 dense", "alone", {"dense": 2}),
        ("product", "+ columns by mean abs(q) x mean abs(k)", "alone", {"rule": "product"}),
        ("ratio05", "+ 50% of the columns", "alone", {"ratio": 0.5}),
        ("sinks", "+ 4 sinks and 16 recent tokens", "alone", {"sinks": 4, "recent": 16}),
        ("combined", "all of the above", "infinigen",
         {"count": "query-heads", "dense": 2, "rule": "product", "ratio": 0.5, "sinks": 4, "recent": 16}),
        ("combined_r03", "all, 30% of the columns", "infinigen",
         {"count": "query-heads", "dense": 2, "rule": "product", "sinks": 4, "recent": 16}),
        # What helped alone, together, then reading more of the budget.
        ("qheads_r05", "the new defaults: per query head, 50% of the columns", "infinigen",
         {"count": "query-heads", "ratio": 0.5}),
        ("chosen", "the new defaults + 4 sinks and 16 recent tokens", "infinigen",
         {"count": "query-heads", "ratio": 0.5, "sinks": 4, "recent": 16}),
        ("chosen_cap", "the new defaults + sinks and recent, every layer at its cap", "infinigen",
         {"count": "query-heads", "ratio": 0.5, "sinks": 4, "recent": 16, "alpha": 1e9}),
    ]


def protocol_flags(args, protocol):
    """Perplexity flags of a protocol, and the InfiniGen/H2O flags it imposes."""
    if protocol == "serving":
        return (["--max-windows", str(args.serving_windows), "--decode-from", str(args.prompt)], [])
    cap_tokens = math.floor(args.cap * args.ctx)
    if protocol == "paper":
        return (["--max-windows", str(args.token_windows), "--token-by-token",
                 "--kv-selection-min-context", str(cap_tokens + 1)], ["--infinigen-max-tokens", str(cap_tokens)])
    return (["--max-windows", str(args.token_windows), "--token-by-token"], [])


def run(args, protocol, name, extra):
    out = os.path.join(args.cache, f"{protocol}_{name}.json")
    base, _ = protocol_flags(args, protocol)
    cmd = [args.kvflow, "perplexity", "--model", args.model, "--file", args.test, "--ctx", str(args.ctx),
           "--threads", str(args.threads), "--json", out] + base + extra
    if os.path.exists(out) and not args.fresh:
        with open(out) as f:
            r = json.load(f)
        if r.get("command") == cmd:
            return r
    print(f"[{time.strftime('%H:%M:%S')}] {protocol}/{name}: $ {' '.join(cmd)}", file=sys.stderr)
    start = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        fail(f"{protocol}/{name} failed:\n{proc.stderr[-2000:]}")
    with open(out) as f:
        r = json.load(f)
    r.update(command=cmd, name=name, wall_s=time.time() - start)
    with open(out, "w") as f:
        json.dump(r, f, indent=1)
    sel = r.get("kv_selection", {})
    print(f"    perplexity {r['perplexity']:.4f}, read {100 * sel.get('selection_fraction', 1.0):.1f}% "
          f"({r['wall_s']:.0f} s)", file=sys.stderr)
    return r


def infinigen_flags(args, protocol, settings):
    s = dict(BEFORE, **settings)
    _, imposed = protocol_flags(args, protocol)
    dense = max(s["dense"], 2) if protocol == "paper" else s["dense"]
    return ["--kv-selection", "infinigen", "--infinigen-skew-file", skew_file(args, s["ratio"], s["rule"]),
            "--infinigen-alpha", f"{s['alpha'] if s['alpha'] is not None else args.alpha:g}",
            "--infinigen-max-fraction", f"{args.cap:g}",
            "--infinigen-speculate-from", s["point"], "--infinigen-count-rule", s["count"],
            "--infinigen-dense-layers", str(dense), "--infinigen-sink-tokens", str(s["sinks"]),
            "--infinigen-recent-tokens", str(s["recent"])] + imposed


def row(r, full, label, group, extra=None):
    sel = r.get("kv_selection")
    bytes_frac = sel["bytes_read"] / sel["bytes_full"] if sel and sel["bytes_full"] else 1.0
    d = {"name": r["name"], "label": label, "group": group, "perplexity": r["perplexity"],
         "delta_vs_full": r["perplexity"] / full["perplexity"] - 1.0, "scored_tokens": r["scored_tokens"],
         "selection_fraction": sel["selection_fraction"] if sel else 1.0, "bytes_read_fraction": bytes_frac,
         "paper_kv_size": 1.0 - math.sqrt(max(0.0, 1.0 - (sel["selection_fraction"] if sel else 1.0))),
         "seconds": r["seconds"], "command": r["command"]}
    if extra:
        d.update(extra)
    return d


def evaluate(args, protocol, wanted):
    rows = []
    full = run(args, protocol, "full", [])
    rows.append(row(full, full, "full cache", "baseline"))
    by_name = {}
    for name, label, group, settings in infinigen_runs():
        if wanted and name not in wanted:
            continue
        if protocol == "paper" and settings.get("dense") == 2:
            continue  # the paper's protocol keeps layers 0-1 dense in every run
        r = run(args, protocol, name, infinigen_flags(args, protocol, settings))
        by_name[name] = r
        rows.append(row(r, full, label, group, {"settings": dict(BEFORE, **settings)}))
    # H2O at the budget an InfiniGen run read (--matched), and at the cap. Its budget is a share
    # of the context at every layer; matched on bytes over all layers.
    best = by_name.get(args.matched)
    budgets = [(args.cap, f"{100 * args.cap:g}%")]
    if best:
        matched = round(best["kv_selection"]["bytes_read"] / best["kv_selection"]["bytes_full"], 4)
        budgets.insert(0, (matched, f"matched to InfiniGen, {args.matched}"))
    if not wanted or "h2o" in wanted:
        for budget, tag in budgets:
            # Under the paper's protocol its dense prefix applies to H2O too (protocol_flags).
            extra = ["--kv-selection", "h2o", "--h2o-budget", f"{budget:g}"]
            r = run(args, protocol, f"h2o_b{budget:g}", extra)
            rows.append(row(r, full, f"H2O, budget {100 * budget:.1f}% ({tag})", "h2o", {"h2o_budget": budget}))
    # INT4 selects nothing: the paper's dense prefix and cap change nothing of it (see strict).
    if (not wanted or "int4" in wanted) and protocol != "paper":
        r = run(args, protocol, "int4", ["--kv-cache-dtype", "q4"])
        rows.append(row(r, full, "INT4 KV (group 32)", "baseline",
                        {"bytes_read_fraction": 20 / 64,
                         "bytes_read_fraction_source": "constant 20/64 by construction (not measured)"}))
    return {"protocol": protocol, "full_perplexity": full["perplexity"], "scored_tokens": full["scored_tokens"],
            "windows": full["windows"], "rows": rows}


PROTOCOL_TEXT = {
    "serving": "each window's first {prompt} tokens prefilled densely, the next {decoded} decoded one per step and "
               "scored; {windows} windows of {ctx} tokens ({scored} tokens scored per run)",
    "paper": "the published accuracy code's: token by token, cap {cap_tokens} tokens (20% of the {ctx}-token window) "
             "whatever the context so far, positions below {cap_tokens} dense, layers 0-1 dense; {windows} windows "
             "({scored} tokens scored per run); \"paper KV size\" = 1 - sqrt(1 - density), as the paper reports it",
    "strict": "token by token, every position a decode step, cap 20% of the context so far, layer 0 dense (unless "
              "the run says otherwise); {windows} windows of {ctx} tokens ({scored} tokens scored per run)",
}


def markdown(args, results):
    lines = ["# InfiniGen accuracy under three protocols (measured)", "",
             f"{args.model} (SmolLM2-135M-Instruct, Q4_1 weights, fp16 KV), WikiText-2 test, alpha {args.alpha:g}, "
             f"cap {100 * args.cap:g}%. \"KV read\": the share of cached tokens attention read at the layers that "
             "select (per KV head); \"bytes\": K/V bytes the decode steps read over all layers against the full "
             "cache (dense layers included; INT4: 20 of fp16's 64 bytes per 32 values, a constant of the format). "
             "Every run's command is in the JSON.", ""]
    for res in results:
        p = res["protocol"]
        lines += [f"## {p}", "", PROTOCOL_TEXT[p].format(prompt=args.prompt, decoded=args.ctx - args.prompt,
                                                         windows=res["windows"], ctx=args.ctx,
                                                         scored=res["scored_tokens"],
                                                         cap_tokens=math.floor(args.cap * args.ctx)) + ".", ""]
        paper = p == "paper"
        lines += ["| run | perplexity | vs full | KV read | " + ("paper KV size | " if paper else "") + "bytes |",
                  "|---|---:|---:|---:|" + ("---:|" if paper else "") + "---:|"]
        for d in res["rows"]:
            lines.append(f"| {d['label']} | {d['perplexity']:.3f} | {100 * d['delta_vs_full']:+.2f}% | "
                         f"{100 * d['selection_fraction']:.1f}% | "
                         + (f"{100 * d['paper_kv_size']:.1f}% | " if paper else "")
                         + f"{100 * d['bytes_read_fraction']:.1f}%"
                         + (" (constant)" if "bytes_read_fraction_source" in d else "") + " |")
        lines.append("")
    return "\n".join(lines)


def plot(args, doc):
    results = doc["results"]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.8), squeeze=False)
    colors = {"oracle": "tab:green", "infinigen": "tab:blue", "alone": "tab:cyan", "h2o": "tab:red",
              "baseline": "tab:gray"}
    for ax, res in zip(axes[0], results):
        for d in res["rows"]:
            if d["name"] == "full":
                continue
            ax.barh(d["label"], 100 * d["delta_vs_full"], color=colors.get(d["group"], "tab:gray"))
            ax.annotate(f"{100 * d['bytes_read_fraction']:.0f}% bytes", (max(0.0, 100 * d["delta_vs_full"]), d["label"]),
                        fontsize=7, xytext=(3, -3), textcoords="offset points")
        ax.axvline(2 if res["protocol"] == "serving" else 4, color="black", linestyle=":", linewidth=1)
        ax.set_xscale("symlog", linthresh=5)
        ax.invert_yaxis()
        ax.set_title(f"{res['protocol']}: full cache {res['full_perplexity']:.2f}")
        ax.set_xlabel("perplexity vs the full cache, %")
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{args.model}: InfiniGen against its oracle, H2O and INT4 (dotted: the goal)")
    fig.tight_layout()
    fig.savefig(args.out_prefix + ".png", dpi=110)
    print(f"wrote {args.out_prefix}.png", file=sys.stderr)


def main():
    args = parse_args()
    check_inputs(args)
    protocols = [p for p in args.protocols.split(",") if p]
    for p in protocols:
        if p not in PROTOCOL_TEXT:
            fail(f"unknown protocol {p} (serving, paper, strict)")
    if not 0 < args.prompt < args.ctx:
        fail(f"--prompt must be in (0, --ctx), not {args.prompt}")
    wanted = {n for n in args.runs.split(",") if n}
    os.makedirs(args.cache, exist_ok=True)
    token_runs = {n for n in args.token_runs.split(",") if n}
    results = [evaluate(args, p, wanted or (token_runs if p != "serving" else set())) for p in protocols]
    doc = {"benchmark": "infinigen_accuracy", "measured": True, "model": args.model, "ctx": args.ctx,
           "alpha": args.alpha, "cap": args.cap, "prompt": args.prompt, "results": results,
           "provenance": provenance(per_run_figures="results[].rows[] (one kvflow perplexity run each, command "
                                                    "in rows[].command)")}
    write_report(args, doc, markdown(args, results), plot)


if __name__ == "__main__":
    main()
