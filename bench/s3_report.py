#!/usr/bin/env python3
"""S3 evaluation tables and figures from kvflow_bench_serving results (bench/run_s3_eval writes them).

Table 2 of S3 (offline, every request at t = 0): average batch size, iterations and throughput per
model shape for Orca (max reservation), S3, S3's Oracle (true lengths), and the paged FCFS
scheduler; one sim JSON per model shape.

  python3 bench/s3_report.py table2 --out-prefix bench/results/s3_table2 \\
      bench/results/serving_alpaca_sim_s3-gpt-j-6b.json ... 

Robustness (injected mispredictions, untrained predictor), one sim JSON per variant:

  python3 bench/s3_report.py robustness --out-prefix bench/results/s3_robustness A.json B.json ...

Sim vs real (same trace, same policies, the sim calibrated on this CPU):

  python3 bench/s3_report.py agreement --out-prefix bench/results/s3_sim_vs_real SIM.json REAL.json

Needs matplotlib (apt-get install -y python3-matplotlib).
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ["orca-max", "orca-pow2", "s3", "s3-oracle", "orca-oracle", "paged"]
LABEL = {"orca-max": "Orca (max)", "orca-pow2": "Orca (pow2)", "s3": "S3", "s3-oracle": "S3 Oracle",
         "orca-oracle": "Orca (oracle)", "paged": "paged FCFS (vLLM)"}
COLOR = {"orca-max": "tab:blue", "orca-pow2": "tab:orange", "s3": "tab:purple", "s3-oracle": "tab:pink",
         "orca-oracle": "tab:green", "paged": "tab:red"}
# S3's Table 2 and Fig. 4a (batch size, iterations; throughput ratios), for side-by-side reading.
PAPER = {
    "gpt-j-6b": {"orca": (69.94, 7988), "s3": (530, 1054), "oracle": (564.88, 989)},
    "llama-13b": {"orca": (31.61, 17675), "s3": (274.66, 2034), "oracle": (527.04, 1060)},
    "gpt-neox-20b": {"orca": (16.89, 33069), "s3": (157.59, 3545), "oracle": (292.19, 1912)},
    "llama-33b": {"orca": (4, 139790), "s3": (42.47, 13155), "oracle": (77.35, 7223)},
}


def load(path):
    with open(path) as f:
        return json.load(f)


def runs_by_policy(report):
    return {r["policy"]: r for r in report["runs"]}


def shape_of(report):
    model = report["executor"].get("cost_model", {}).get("name", "")
    return model.split(":", 1)[1] if ":" in model else model


def fmt(v, digits=2):
    return "n/a" if v is None else f"{v:.{digits}f}"


def penalty_share(r):
    p = r.get("preemption_penalty", {})
    return p["modelled_s"] / r["duration_s"] if "modelled_s" in p and r["duration_s"] > 0 else None


def overhead_share(r):
    s = r.get("s3")
    if not s or r["duration_s"] <= 0:
        return None
    return (s["predict_s"] + s["update_s"]) / r["duration_s"]


def fine_cell(r):
    if not r:
        return "n/a"
    return f"{fmt(r['avg_batch_seqs'], 1)} / {r['num_steps']}, {fmt(r['throughput_req_s'])}"


def table2(paths, out_prefix, fine_paths=()):
    reports = [load(p) for p in paths]
    # S3 with a finer bucket grid (same supervisor), by model shape.
    fine = {shape_of(r): runs_by_policy(r).get("s3") for r in (load(p) for p in fine_paths)}
    first = reports[0]
    md = ["# S3 Table 2 on kvflow: offline throughput by model shape (sim executor)", ""]
    md.append(f"- executor: sim (the real Scheduler and BlockManager on a virtual clock); step times from analytic "
              f"A100-80GB cost models (not measured) of {', '.join(r['executor']['cost_model']['details']['model'] for r in reports)}")
    t = first["trace"]
    md.append(f"- trace: {t['source']}: {t['sampling']}; {t['num_requests']} requests, all at t = 0; tokenizer "
              f"{t['tokenizer']}; input mean {t['input_len']['mean']:.1f}, output mean {t['output_len']['mean']:.1f} "
              f"(max {t['output_len']['max']}) tokens")
    c = first["config"]
    md.append(f"- KV budget: 80 GB less the fp16 weights, per model; block {c['block_size']}, max_num_seqs "
              f"{c['max_num_seqs']}, max_num_batched_tokens {c['max_num_batched_tokens']}, max_model_len "
              f"{c['max_model_len']}, preemption {c['preemption_mode']}, swap blocks {c['num_host_blocks']}")
    md.append(f"- S3 predictor: {c['length_predictor']}; online updates {c['length_online_updates']}")
    md.append("- avg batch = sequences per iteration averaged over iterations; throughput in sequences/s "
              "(S3's Fig. 4a unit). Paper figures in brackets (S3 Table 2).")
    md.append("")
    md.append("| model | KV budget (tokens) | Orca batch / iters | S3 batch / iters | Oracle batch / iters | paged batch / iters "
              "| seq/s Orca / S3 / Oracle / paged | S3 / Orca | Oracle / S3 | paged / S3 | S3, 52-token buckets: batch / iters, seq/s |")
    md.append("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for rep in reports:
        shape = shape_of(rep)
        runs = runs_by_policy(rep)
        get = lambda p, k: runs[p][k] if p in runs else None  # noqa: E731
        paper = PAPER.get(shape, {})

        def cell(policy, key):
            b, it = get(policy, "avg_batch_seqs"), get(policy, "num_steps")
            ref = paper.get(key)
            return f"{fmt(b, 1)} / {it}" + (f" [{ref[0]} / {ref[1]}]" if ref else "")

        tp = {p: get(p, "throughput_req_s") for p in ORDER}
        ratio = lambda a, b: tp[a] / tp[b] if tp.get(a) and tp.get(b) else None  # noqa: E731
        budget = rep["executor"]["cost_model"].get("kv_budget_tokens")
        md.append(f"| {rep['executor']['cost_model']['details']['model']} | {budget} | {cell('orca-max', 'orca')} | "
                  f"{cell('s3', 's3')} | {cell('s3-oracle', 'oracle')} | {fmt(get('paged', 'avg_batch_seqs'), 1)} / "
                  f"{get('paged', 'num_steps')} | {fmt(tp['orca-max'])} / {fmt(tp['s3'])} / {fmt(tp['s3-oracle'])} / "
                  f"{fmt(tp['paged'])} | {fmt(ratio('s3', 'orca-max'))}x | {fmt(ratio('s3-oracle', 's3'))}x | "
                  f"{fmt(ratio('paged', 's3'))}x | {fine_cell(fine.get(shape))} |")
        rows.append((shape, rep, runs))
    md.append("")
    md.append("S3's headline: 1.13-6.49x Orca's throughput, within 9.34-40.52% of the Oracle (Oracle / S3 = "
              "1.10-1.68x). The last column is S3 with a predictor over 512 tokens (10 buckets of 52) instead of "
              "S3's 2048 (buckets of 205): same supervisor, same trace.")
    md.append("")
    md.append("## Overhead and mispredictions (S3 runs)")
    md.append("")
    md.append("| model | predictions | bucket accuracy | under / over | reservation preemptions | recomputed tokens "
              "| penalty share | predictor us (predict / update) | predictor share |")
    md.append("|---|---|---|---|---|---|---|---|---|")
    for shape, r in [(shape, runs.get("s3")) for shape, _, runs in rows] + \
            [(shape + " (52-token buckets)", r) for shape, r in fine.items()]:
        if not r:
            continue
        s, p = r["s3"], r["preemption_penalty"]
        md.append(f"| {shape} | {s['predictions']} | {fmt(100 * s['bucket_accuracy'], 1) if s['bucket_accuracy'] is not None else 'n/a'}% | "
                  f"{s['under_predicted']} / {s['over_predicted']} | {p['reservation_preemptions']} | "
                  f"{p['recomputed_tokens']} | {fmt(100 * penalty_share(r), 2)}% | "
                  f"{fmt(s['predict_us_per_request'], 1)} / {fmt(s['update_us_per_step'], 1)} | "
                  f"{fmt(100 * overhead_share(r), 3)}% |")
    md.append("")
    md.append("Penalty = modelled time of recomputing KV that had been computed once plus swap traffic; the "
              "predictor's time is measured on this CPU (one core) and compared with the modelled run time.")
    write(out_prefix, md)

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    policies = [p for p in ORDER if any(p in runs for _, _, runs in rows)]
    width = 0.8 / len(policies)
    for i, p in enumerate(policies):
        xs = [k + i * width for k in range(len(rows))]
        axes[0].bar(xs, [runs.get(p, {}).get("throughput_req_s", 0) for _, _, runs in rows], width, label=LABEL[p],
                    color=COLOR[p])
        axes[1].bar(xs, [runs.get(p, {}).get("avg_batch_seqs", 0) for _, _, runs in rows], width, label=LABEL[p],
                    color=COLOR[p])
    for ax, title in ((axes[0], "throughput (sequences/s)"), (axes[1], "average batch size")):
        ax.set_xticks([k + width * (len(policies) - 1) / 2 for k in range(len(rows))])
        ax.set_xticklabels([shape for shape, _, _ in rows])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("S3 vs Orca vs Oracle vs paged on kvflow's scheduler (sim, analytic A100-80GB; Alpaca held-out)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out_prefix + ".png", dpi=120)
    print(f"wrote {out_prefix}.md and .png")


def robustness(paths, out_prefix):
    md = ["# S3 robustness: injected mispredictions, untrained predictors, online retraining (sim executor)", ""]
    rep0 = load(paths[0])
    md.append(f"- executor: sim, {rep0['executor']['cost_model']['description']}")
    t = rep0["trace"]
    md.append(f"- trace: {t['num_requests']} Alpaca requests ({t['sampling']}), all at t = 0; KV budget "
              f"{rep0['config']['num_device_blocks']} blocks x {rep0['config']['block_size']}")
    md.append("- predictors: `2048` = 10 buckets of 205 tokens (S3's setup), `512` = 10 buckets of 52; `untrained` "
              "= zero weights (bucket 0 until online updates teach it); overrides distort every prediction "
              "(scale:F multiplies the reserved length, bucket:B always predicts bucket B)")
    md.append("- mispredicted: share of requests whose true bucket differs from the prediction, first tenth of the "
              "arrivals -> last tenth. Predictions are made at arrival, so with every request at t = 0 (rate inf) "
              "online retraining cannot change any of them; the rate-40 rows arrive over ~250 s and show whether "
              "it converges")
    md.append("")
    md.append("| variant | rate (req/s) | predictor | reservation | override | online | preemption | done / failed | seq/s "
              "| avg batch | iterations | bucket acc. | under / over | reservation preemptions | penalty | mispredicted: first -> last tenth |")
    md.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        rep = load(path)
        c = rep["config"]
        tag = path.rsplit("s3robust-", 1)[-1].rsplit(".json", 1)[0]
        pred = c["length_predictor"]
        pred = "untrained (2048)" if pred == "untrained" else pred.rsplit("/", 1)[-1].replace(".kvlp", "").replace(
            "alpaca_smollm2_", "")
        for r in rep["runs"]:
            if r["policy"] != "s3":
                continue
            s, p = r["s3"], r["preemption_penalty"]
            dec = s.get("misprediction_rate_by_arrival_decile", [])
            trend = f"{100 * dec[0]:.1f}% -> {100 * dec[-1]:.1f}%" if dec and None not in dec else "n/a"
            md.append(f"| {tag} | {r['rate_req_s']} | {pred} | {c.get('length_reservation_point', 'upper')} | "
                      f"{c['prediction_override'] or 'none'} | {'on' if c['length_online_updates'] else 'off'} | "
                      f"{c['preemption_mode']} | {r['completed']} / {r['failed']} | {fmt(r['throughput_req_s'])} | "
                      f"{fmt(r['avg_batch_seqs'], 1)} | {r['num_steps']} | "
                      f"{fmt(100 * s['bucket_accuracy'], 1) if s['bucket_accuracy'] is not None else 'n/a'}% | "
                      f"{s['under_predicted']} / {s['over_predicted']} | {p['reservation_preemptions']} | "
                      f"{fmt(100 * penalty_share(r), 2)}% | {trend} |")
    write(out_prefix, md)


def agreement(sim_path, real_path, out_prefix):
    sim, real = runs_by_policy(load(sim_path)), runs_by_policy(load(real_path))
    rs = load(real_path)
    md = ["# S3 and baselines: sim vs real engine on the same trace", ""]
    md.append(f"- real: {rs['executor']['description']}")
    md.append(f"- sim: {load(sim_path)['executor']['description']}")
    md.append(f"- trace: {rs['trace']['num_requests']} Alpaca requests, all at t = 0; KV budget "
              f"{rs['config']['num_device_blocks']} blocks x {rs['config']['block_size']}")
    md.append("")
    md.append("| policy | iterations real / sim | avg batch real / sim | seq/s real / sim | sim / real throughput | "
              "reservation preemptions real / sim |")
    md.append("|---|---|---|---|---|---|")
    for p in ORDER:
        if p not in sim or p not in real:
            continue
        a, b = real[p], sim[p]
        md.append(f"| {p} | {a['num_steps']} / {b['num_steps']} | {fmt(a['avg_batch_seqs'], 1)} / "
                  f"{fmt(b['avg_batch_seqs'], 1)} | {fmt(a['throughput_req_s'], 3)} / {fmt(b['throughput_req_s'], 3)} | "
                  f"{fmt(b['throughput_req_s'] / a['throughput_req_s'] if a['throughput_req_s'] else None)} | "
                  f"{a['preemption_penalty']['reservation_preemptions']} / {b['preemption_penalty']['reservation_preemptions']} |")
    write(out_prefix, md)


def write(out_prefix, lines):
    with open(out_prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["table2", "robustness", "agreement"])
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out-prefix", required=True)
    ap.add_argument("--fine", nargs="*", default=[], help="table2: s3 runs with a finer predictor, by shape")
    a = ap.parse_args()
    if a.kind == "table2":
        table2(a.inputs, a.out_prefix, a.fine)
    elif a.kind == "robustness":
        robustness(a.inputs, a.out_prefix)
    else:
        if len(a.inputs) != 2:
            sys.exit("agreement takes SIM.json REAL.json")
        agreement(a.inputs[0], a.inputs[1], a.out_prefix)


if __name__ == "__main__":
    main()
