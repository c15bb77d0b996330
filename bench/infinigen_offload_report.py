#!/usr/bin/env python3
"""InfiniGen on the device over an offloaded KV pool (issue 29): one table from the kv_selection
bench runs the GPU session makes (tools/gpu-session, entries infinigen_resident, infinigen_offload,
infinigen_resident_b16, infinigen_offload_b16), each a JSON of kvflow_bench_kv_selection.

  python3 bench/infinigen_offload_report.py --json out.json --md out.md run1.json run2.json ...

Per (context, batch) it puts side by side, all MEASURED (median ms per decode step):
  full               the resident pool, full attention (the physical best: no bus at all)
  infinigen          the resident pool, InfiniGen's speculation on the device
  offload-full       the pool in pinned host memory, every layer fetching every cached token (FlexGen)
  offload-infinigen  the pool in pinned host memory, only the speculated rows gathered, on the copy
                     stream during the previous layer
and the bytes each step fetched over the bus (counted by the engine). DERIVED from those:
  link rate        offload-full's bytes per step / (offload-full - full): the rate at which the bus
                   delivered the full fetch, taking all of the difference as exposed transfer (a
                   lower bound on the link's rate if part of that fetch hid behind compute)
  bus time         offload-infinigen's bytes per step / link rate
  exposed          offload-infinigen - infinigen: the step time the selected fetch adds
  hidden share     1 - exposed / bus time, clipped to [0, 1]: the part of the selected fetch that the
                   previous layer's compute covered
A plot (--png, matplotlib when present) shows the four step times.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import provenance  # noqa: E402

MODES = ["full", "infinigen", "offload-full", "offload-infinigen"]


def load_rows(paths):
    rows = {}
    meta = {}
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        meta.setdefault("device", doc.get("device"))
        meta.setdefault("model", doc.get("model"))
        meta.setdefault("sources", []).append(os.path.basename(p))
        for r in doc.get("rows", []):
            key = (r["context"], r.get("batch", 1))
            entry = {
                "ms_per_step": r.get("ms_per_step") or (r.get("ms_per_token", 0.0) * key[1]),
                "decode_tokens_per_s": r.get("decode_tokens_per_s", 0.0),
                "bytes_fetched_per_token": r.get("offload", {}).get("bytes_fetched_per_token", 0.0),
                "selection_fraction": r.get("selection", {}).get("selection_fraction"),
                "bytes_read_fraction": r.get("selection", {}).get("bytes_read_fraction"),
                "error": r.get("error", ""),
            }
            entry["bytes_fetched_per_step"] = entry["bytes_fetched_per_token"] * key[1]
            rows.setdefault(key, {})[r["mode"]] = entry
    return rows, meta


def derive(modes):
    out = {}
    t = {m: modes[m]["ms_per_step"] for m in MODES if m in modes and modes[m]["ms_per_step"] > 0}
    if "offload-full" in t and "full" in t and t["offload-full"] > t["full"]:
        rate = modes["offload-full"]["bytes_fetched_per_step"] / ((t["offload-full"] - t["full"]) / 1e3)
        out["link_rate_GBps"] = rate / 1e9
        if "offload-infinigen" in t and "infinigen" in t and rate > 0:
            bus_ms = modes["offload-infinigen"]["bytes_fetched_per_step"] / rate * 1e3
            exposed = t["offload-infinigen"] - t["infinigen"]
            out["bus_ms"] = bus_ms
            out["exposed_ms"] = exposed
            out["hidden_share"] = min(1.0, max(0.0, 1.0 - exposed / bus_ms)) if bus_ms > 0 else None
    if "offload-infinigen" in t and "offload-full" in t:
        out["offload_infinigen_vs_offload_full"] = t["offload-full"] / t["offload-infinigen"]
    if "offload-infinigen" in t and "full" in t:
        out["offload_infinigen_vs_resident_full"] = t["full"] / t["offload-infinigen"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="kvflow_bench_kv_selection JSON files")
    ap.add_argument("--json", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--png", default="", help="plot of the step times (default: next to --md)")
    args = ap.parse_args()
    rows, meta = load_rows(args.runs)
    if not rows:
        sys.exit("no rows in " + ", ".join(args.runs))
    table = ["| context | batch | full ms/step | infinigen | offload-full | offload-infinigen | offload-infinigen "
             "vs offload-full | fetched / step: full, selected | link rate (derived) | selected fetch: bus ms, "
             "exposed ms, hidden |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    out_rows = []
    for (context, batch), modes in sorted(rows.items()):
        d = derive(modes)

        def ms(m):
            return f"{modes[m]['ms_per_step']:.2f}" if m in modes and modes[m]["ms_per_step"] > 0 else "-"

        def mib(m):
            return f"{modes[m]['bytes_fetched_per_step'] / 2**20:.1f} MiB" if m in modes else "-"

        hidden = (f"{d['bus_ms']:.2f}, {d['exposed_ms']:.2f}, "
                  f"{100 * d['hidden_share']:.0f}%" if d.get("hidden_share") is not None else "-")
        table.append(f"| {context} | {batch} | {ms('full')} | {ms('infinigen')} | {ms('offload-full')} | "
                     f"{ms('offload-infinigen')} | "
                     + (f"{d['offload_infinigen_vs_offload_full']:.2f}x" if "offload_infinigen_vs_offload_full" in d
                        else "-")
                     + f" | {mib('offload-full')}, {mib('offload-infinigen')} | "
                     + (f"{d['link_rate_GBps']:.1f} GB/s" if "link_rate_GBps" in d else "-")
                     + f" | {hidden} |")
        out_rows.append({"context": context, "batch": batch, "modes": modes, "derived": d})
    doc = {"benchmark": "infinigen_device_offload", "measured": "step times and bytes; derived: link rate, bus time, "
           "hidden share (see the script's docstring)", "device": meta.get("device"), "model": meta.get("model"),
           "sources": meta.get("sources"), "rows": out_rows, "provenance": provenance()}
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    header = (f"# InfiniGen on the device over an offloaded KV pool\n\n{meta.get('model')} on {meta.get('device')}. "
              "Step times measured (median ms per decode step of the batch); bytes counted by the engine; link rate, "
              "bus time and hidden share derived from them (bench/infinigen_offload_report.py says how).\n\n")
    with open(args.md, "w") as f:
        f.write(header + "\n".join(table) + "\n")
    print("\n".join(table))
    png = args.png or os.path.splitext(args.md)[0] + ".png"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = sorted(rows)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(keys), 3.6))
    width = 0.2
    for i, m in enumerate(MODES):
        xs = [k + (i - 1.5) * width for k in range(len(keys))]
        ys = [rows[key][m]["ms_per_step"] if m in rows[key] else 0 for key in keys]
        ax.bar(xs, ys, width, label=m)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{c // 1024}K x {b}" for c, b in keys])
    ax.set_ylabel("ms per decode step")
    ax.set_yscale("log")
    ax.set_title(f"InfiniGen on the device, {meta.get('model')} ({meta.get('device')})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
