#!/usr/bin/env python3
"""Re-renders the decode tok/s and "vs full" columns of a kvflow_bench_kv_selection report from the
per-run figures its JSON keeps, the way the benchmark now prints them: median (min-max) over the
runs, the speed-up's min-max over the ratios of runs made back to back in one repeat, and "within
spread" when a mode's runs overlap full's. Measures nothing.

  bench/kv_selection_spread.py bench/results/kv_offload_speed.json     # rewrites kv_offload_speed.md
"""
import json
import os
import re
import sys

NOTE = ("Decode tok/s: median (min-max) over the runs; \"vs full\": median over full's median, (min-max) of the "
        "ratios of runs made back to back in one repeat, \"within spread\" when the mode's runs and full's overlap "
        "(the difference is inside the run-to-run spread; columns re-rendered from the JSON's per-run figures by "
        "bench/kv_selection_spread.py, nothing re-measured).")


def cells(row, full_runs):
    runs = row["decode_tokens_per_s_runs"]
    med = row["decode_tokens_per_s"]
    tps = f"{med:.1f} ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else f"{med:.1f}"
    vs = f"{row['speedup_vs_full']:.2f}x"
    if row["mode"] != "full" and full_runs:
        ratios = [a / b for a, b in zip(runs, full_runs) if b > 0]
        if len(ratios) > 1:
            vs += f" ({min(ratios):.2f}-{max(ratios):.2f})"
        if min(runs) <= max(full_runs) and min(full_runs) <= max(runs):
            vs += ", within spread"
    return tps, vs


def main(path):
    doc = json.load(open(path))
    md_path = os.path.splitext(path)[0] + ".md"
    lines = open(md_path).read().split("\n")
    full = {r["context"]: r["decode_tokens_per_s_runs"] for r in doc["rows"] if r["mode"] == "full"}
    rows = {(r["context"], r["mode"]): r for r in doc["rows"]}
    out = []
    for line in lines:
        m = re.match(r"\| (\d+) \| ([\w-]+) \| [^|]+ \| ([^|]+) \| [^|]+ \|(.*)$", line)
        if m and (int(m.group(1)), m.group(2)) in rows:
            tps, vs = cells(rows[(int(m.group(1)), m.group(2))], full.get(int(m.group(1))))
            line = f"| {m.group(1)} | {m.group(2)} | {tps} | {m.group(3).strip()} | {vs} |{m.group(4)}"
        elif line.startswith("| context | mode |") and NOTE not in lines:
            out += [NOTE, ""]
        out.append(line)
    open(md_path, "w").write("\n".join(out))
    print("\n".join(out))


if __name__ == "__main__":
    for p in sys.argv[1:]:
        main(p)
