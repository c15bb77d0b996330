#!/usr/bin/env python3
"""Decode speed of two kvflow builds, interleaved in one run: `kvflow bench` of build A, then of
build B, PAIRS times, each pair's ratio A/B per depth, the median and range reported. For checking
that a change to the engine did not slow the hot path (A: the change, B: the commit before it).

    bench/decode_ab.py --a build/kvflow --b /tmp/old/build/kvflow --out bench/results/decode_ab
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import provenance  # noqa: E402


def run(binary, args, path):
    subprocess.run([binary, "bench", *args, "--json", path], check=True, capture_output=True)
    with open(path) as f:
        return {r["depth"]: r["decode_tok_s"] for r in json.load(f)["results"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="kvflow binary A (the change)")
    ap.add_argument("--b", required=True, help="kvflow binary B (the baseline)")
    ap.add_argument("--label-a", default="A")
    ap.add_argument("--label-b", default="B")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--depths", default="0,1024")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--out", required=True, help="output prefix: writes PREFIX.json and PREFIX.md")
    o = ap.parse_args()
    args = ["-m", o.model, "-d", o.depths, "-n", str(o.decode_tokens), "-r", "3", "--threads", str(o.threads)]
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(o.pairs):
            a = run(o.a, args, os.path.join(tmp, f"a{i}.json"))
            b = run(o.b, args, os.path.join(tmp, f"b{i}.json"))
            pairs.append({"a": a, "b": b})
            print(f"pair {i + 1}/{o.pairs}: " + ", ".join(f"depth {d}: {a[d]:.1f} vs {b[d]:.1f}" for d in a), flush=True)
    rows = []
    for d in pairs[0]["a"]:
        ratios = [p["a"][d] / p["b"][d] for p in pairs]
        rows.append({"depth": d, "a_tok_s": statistics.median(p["a"][d] for p in pairs),
                     "b_tok_s": statistics.median(p["b"][d] for p in pairs), "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)})
    doc = {"what": "kvflow bench decode tok/s, two builds interleaved; ratio = A / B per pair",
           "a": o.label_a, "b": o.label_b, "model": o.model, "threads": o.threads, "rows": rows, "pairs": pairs,
           "measured": True, "provenance": provenance(per_run_figures="pairs")}
    with open(o.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(o.out + ".md", "w") as f:
        f.write(f"# Decode A/B: {o.label_a} vs {o.label_b}\n\n{o.model}, {o.threads} threads, {o.pairs} interleaved "
                f"pairs of `kvflow bench -n {o.decode_tokens} -r 3` (each the median of 3 runs); measured.\n\n"
                "| depth | A tok/s (median) | B tok/s (median) | A/B median | A/B range |\n|---:|---:|---:|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['depth']} | {r['a_tok_s']:.1f} | {r['b_tok_s']:.1f} | {r['ratio_median']:.3f} | "
                    f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f} |\n")
    print(open(o.out + ".md").read())


if __name__ == "__main__":
    main()
