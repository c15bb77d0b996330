#!/usr/bin/env python3
"""KV-Runahead's measured TTFT on this machine (issue 17): one long prompt of SmolLM2-135M
prefilled by one rank with 2 threads, and by 2 MPI ranks with 1 thread each (the same 2 cores),
KV-Runahead's chain (even split KVR-E, searched KVR-S, interpolated KVR-P) against TSP.

  .venv/bin/python bench/kv_runahead_ttft.py            # runs everything (about 25 min on 2 cores)
  .venv/bin/python bench/kv_runahead_ttft.py --from DIR # tabulates runs already in DIR

The runs (each a `kvflow prefill-bench` under mpirun, which times from a barrier to the last rank's
first-token logits, median of 3):
  one.json     mpirun -np 1, --threads 2: contexts 2K, 4K, 8K
  two.json     mpirun -np 2, --threads 1: KVR-E and TSP at 2K, 4K, 8K; KVR-S searched at each
               (binary search, 128-token steps; writes partitions.json); KVR-P at 6K from that table
  two_6k.json  mpirun -np 2: KVR-S searched at 6K itself, to compare KVR-P against
Writes bench/results/kv_runahead_ttft.{json,md,png}, the partition table
bench/results/kv_runahead_partitions_smollm2.json, and the simulator's calibration file
bench/results/kv_runahead_calibration_cpu.json (bench/kv_runahead_sim.py --calibration).
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from provenance import provenance

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
# Open MPI's defaults otherwise: shared memory with its single-copy mechanism (CMA), with which a
# receiver pulls a large message itself instead of waiting for the busy sender's next MPI call.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl": "self,vader",
           "OMPI_MCA_hwloc_base_binding_policy": "none", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
# SmolLM2-135M's shape, for the simulator's calibration (fp16 KV on the wire).
SMOLLM2 = {"name": "SmolLM2-135M", "layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64,
           "intermediate": 1536, "vocab": 49152, "bytes_per_element": 2}


def run(cli, out, args):
    cmd = ["mpirun", "--oversubscribe", *args[:2], str(cli), "prefill-bench", "-m", "smollm2-135m", *args[2:]]
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, **MPI_ENV)
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def measure(cli, d):
    d.mkdir(parents=True, exist_ok=True)
    run(cli, d / "one.json", ["-np", "1", "--threads", "2", "--contexts", "2048,4096,8192", "-r", "3",
                              "--json", str(d / "one.json")])
    run(cli, d / "two.json", ["-np", "2", "--threads", "1", "--contexts", "2048,4096,8192", "-r", "3",
                              "--methods", "kv-runahead,tsp", "--search", "--granularity", "128",
                              "--table", str(d / "partitions.json"), "--predict", "6144",
                              "--json", str(d / "two.json")])
    run(cli, d / "two_6k.json", ["-np", "2", "--threads", "1", "--contexts", "6144", "-r", "3",
                                 "--methods", "kv-runahead", "--search", "--granularity", "128",
                                 "--table", str(d / "partitions_6k.json"), "--json", str(d / "two_6k.json")])


def rows_of(path):
    return json.loads(Path(path).read_text())["rows"]


# One rank and two ranks cannot share an mpirun job (prefill-bench runs every rank in the chain), so
# this ratio divides medians of two invocations; the TSP / KVR ratios come from one (two.json).
CROSS_INVOCATION = ("across invocations: the 1-rank median (one.json, mpirun -np 1) over the KVR-S median "
                    "(two.json, mpirun -np 2), measured minutes apart; compare with the runs' spread")


def tabulate(d):
    one, two, six = rows_of(d / "one.json"), rows_of(d / "two.json"), rows_of(d / "two_6k.json")
    meta = json.loads((d / "two.json").read_text())
    single = {r["context"]: r for r in one}
    table = []
    for c in sorted({r["context"] for r in two if r["partition"] != "predicted (interpolated)"}):
        def pick(method, partition):
            for r in two:
                if r["context"] == c and r["method"] == method and r["partition"] == partition:
                    return r
            return None
        kvr_e, kvr_s, tsp = pick("kv-runahead", "even"), pick("kv-runahead", "searched"), pick("tsp", "even")
        t1 = single[c]["median_s"]
        table.append({"context": c, "single_2_threads_s": t1, "tsp_s": tsp["median_s"], "kvr_e_s": kvr_e["median_s"],
                      "kvr_s_s": kvr_s["median_s"], "kvr_s_bounds": kvr_s["bounds"],
                      "tsp_over_kvr_s": tsp["median_s"] / kvr_s["median_s"],
                      "tsp_over_kvr_e": tsp["median_s"] / kvr_e["median_s"],
                      "single_over_kvr_s": t1 / kvr_s["median_s"],
                      "single_over_kvr_s_source": CROSS_INVOCATION,
                      # the paper's bound with 2 ranks, from the single rank's TTFT: TTFT(1)/2 (1/p + 1/p^2)
                      "lower_bound_s": t1 / 2 * (1 / 2 + 1 / 4),
                      "single_runs": single[c].get("ttft_s"),
                      "tsp_runs": tsp["ttft_s"], "kvr_s_runs": kvr_s["ttft_s"], "kvr_e_runs": kvr_e["ttft_s"]})
    predicted = [r for r in two if r["partition"].startswith("predicted")]
    searched_6k = [r for r in six if r["partition"] == "searched"]
    even_6k = [r for r in six if r["partition"] == "even"]
    kvr_p = None
    if predicted and searched_6k:
        kvr_p = {"context": 6144, "kvr_p_s": predicted[0]["median_s"], "kvr_p_bounds": predicted[0]["bounds"],
                 "kvr_s_s": searched_6k[0]["median_s"], "kvr_s_bounds": searched_6k[0]["bounds"],
                 "kvr_e_s": even_6k[0]["median_s"] if even_6k else None,
                 "kvr_p_over_kvr_s": predicted[0]["median_s"] / searched_6k[0]["median_s"]}
    return meta, table, kvr_p


def write(meta, table, kvr_p, d):
    RESULTS.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {"provenance": provenance(per_run_figures="rows[].single_runs, tsp_runs, kvr_e_runs, kvr_s_runs",
                                    runs_from=str(d)),
           "measured": True, "commit": commit, "cpu": cpu, "cores": os.cpu_count(),
           "model": "SmolLM2-135M-Instruct Q4_1 (fp16 KV)", "backend": meta["backend"],
           "communicator": meta["communicator"], "repeats": meta["repeats"], "rows": table, "kvr_p": kvr_p}
    (RESULTS / "kv_runahead_ttft.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        "# KV-Runahead TTFT on this machine (measured)",
        "",
        f"{cpu}, {os.cpu_count()} cores, commit {commit}. SmolLM2-135M-Instruct Q4_1, fp16 KV, one prompt of "
        "synthetic tokens, `kvflow prefill-bench`: time from a barrier to the last rank's first-token logits, "
        f"median of {meta['repeats']}. One rank runs 2 threads; two MPI ranks (Open MPI, shared memory) run 1 "
        "thread each, on the same 2 cores. TSP here attends causally (it skips the masked triangle the paper's "
        "TSP computes), so it is a stronger baseline than the paper's. TSP / KVR ratios divide figures of one "
        "invocation (mpirun -np 2); 1 rank / KVR-S divides medians of two (mpirun -np 1, then -np 2): read it "
        "against the runs' spread below.",
        "",
        "| context | 1 rank, 2 threads | TSP, 2 ranks | KVR-E | KVR-S | KVR-S split | TSP / KVR-S | TSP / KVR-E "
        "| 1 rank / KVR-S (across invocations) | bound TTFT(1)/2·(1/p+1/p²) |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(f"| {r['context']} | {r['single_2_threads_s']:.2f} s | {r['tsp_s']:.2f} s | {r['kvr_e_s']:.2f} s "
                     f"| {r['kvr_s_s']:.2f} s | {r['kvr_s_bounds'][1]} | {r['tsp_over_kvr_s']:.2f}× "
                     f"| {r['tsp_over_kvr_e']:.2f}× | {r['single_over_kvr_s']:.2f}× | {r['lower_bound_s']:.2f} s |")
    if kvr_p:
        lines += ["", f"KVR-P at 6144 tokens (split interpolated between the 4K and 8K searched entries): "
                      f"{kvr_p['kvr_p_s']:.2f} s at split {kvr_p['kvr_p_bounds'][1]}, against KVR-S searched at 6144: "
                      f"{kvr_p['kvr_s_s']:.2f} s at split {kvr_p['kvr_s_bounds'][1]} "
                      f"({100 * (kvr_p['kvr_p_over_kvr_s'] - 1):+.1f}%)"
                      + (f"; KVR-E {kvr_p['kvr_e_s']:.2f} s." if kvr_p.get("kvr_e_s") else ".")]
    lines += ["", "Runs (s): " + "; ".join(f"{r['context']}: 1 rank {r.get('single_runs')}, TSP {r['tsp_runs']}, "
                                           f"KVR-E {r['kvr_e_runs']}, KVR-S {r['kvr_s_runs']}" for r in table), ""]
    (RESULTS / "kv_runahead_ttft.md").write_text("\n".join(lines))
    print("\n".join(lines))
    shutil.copy(d / "partitions.json", RESULTS / "kv_runahead_partitions_smollm2.json")
    calibration = {"format": "kvflow-kvr-calibration", "version": 1,
                   "device": f"{cpu}, 2 cores, kvflow CPU backend (Q4_1 weights, fp16 KV)", "model": SMOLLM2,
                   # shared memory between two processes on one machine: a copy, not a network link
                   "link": {"bandwidth_bytes_per_s": 5e9, "latency_s": 5e-6},
                   "single_rank": [{"context_len": r["context"], "ttft_s": r["single_2_threads_s"]} for r in table],
                   "chain": [{"num_ranks": 2, "context_len": r["context"], "bounds": r["kvr_s_bounds"],
                              "ttft_s": r["kvr_s_s"], "compute_share": 0.5} for r in table]}
    (RESULTS / "kv_runahead_calibration_cpu.json").write_text(json.dumps(calibration, indent=2) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot")
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = [r["context"] for r in table]
    for key, label, style in (("single_2_threads_s", "1 rank, 2 threads", "k-"), ("tsp_s", "TSP, 2 ranks", "r-o"),
                              ("kvr_e_s", "KVR-E, 2 ranks", "b--s"), ("kvr_s_s", "KVR-S, 2 ranks", "b-^"),
                              ("lower_bound_s", "bound TTFT(1)·3/8", "g:")):
        ax.plot(xs, [r[key] for r in table], style, label=label)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("SmolLM2-135M prefill on 2 CPU cores (measured)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "kv_runahead_ttft.png", dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src", help="a directory holding one.json, two.json, two_6k.json, partitions.json")
    ap.add_argument("--cli", default=str(REPO / "build" / "kvflow"))
    args = ap.parse_args()
    d = Path(args.src) if args.src else REPO / "build" / "kv_runahead_ttft"
    if not args.src:
        if shutil.which("mpirun") is None:
            sys.exit("mpirun not found: tools/install-deps installs Open MPI")
        measure(Path(args.cli), d)
    write(*tabulate(d), d)


if __name__ == "__main__":
    main()
