#!/usr/bin/python3
"""Report of S3's hidden-state length probe against the n-gram predictor and the majority bucket.

  /usr/bin/python3 bench/length_probe_report.py bench/results/length_probe_smollm2.json

Reads the JSON `kvflow-length-predictor train-probe --report` writes and writes beside it a
markdown table (.md) and a plot (.png): held-out accuracy and mean bucket distance of the three,
and the probe's and the n-gram predictor's confusion matrices. Adds the provenance object
(bench/provenance.py) to a report that has none. Only the standard library and
matplotlib.
"""

import json
import os
import sys

import shlex

import matplotlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NAMES = [("probe", "hidden-state probe"), ("probe_median", "probe, median bucket"),
         ("probe_online", "probe, learning online"), ("ngram", "n-gram predictor"),
         ("ngram_online", "n-gram, learning online"), ("majority", "majority bucket")]
# Rows whose predict-time column means something else (or nothing).
COST_NOTE = {"probe_median": "as the probe", "ngram_online": "-", "majority": "-"}


def markdown(r):
    t, cost, b = r["test"], r["cost_per_request_us"], r["buckets"]
    p = r["probe"]
    lines = [
        f"# S3 length probe on {r['hidden']['model']} ({r['tag']})",
        "",
        f"Held-out split: {r['split']['test_size']} of {r['split']['test_size'] + r['split']['train_size']} labelled "
        f"Alpaca prompts (seeded shuffle, split seed {r['split']['split_seed']}; the same split as "
        "`kvflow-length-predictor train`), labels = the model's own greedy output length (chat template, "
        f"max {b['max_output_len']} tokens), {b['num_buckets']} buckets of {b['bucket_width']} tokens.",
        "",
        f"Probe: {p['kind']} ({p['hidden_units']} hidden units, L2 {p['l2']}, {p['epochs']} epochs, Adam lr "
        f"{p['learning_rate']}, seed {p['seed']}; {p['parameters']} parameters) over the standardized "
        f"{r['hidden']['hidden_size']}-wide final-norm hidden state of the prompt's last token; chosen on a "
        f"validation part ({r['split']['validation_size']} prompts) of the training split only.",
        "",
        "| predictor | accuracy | within 1 bucket | mean bucket distance (all prompts) | mean miss distance (misses) "
        "| under | over | predict us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, name in NAMES:
        if key not in t:
            continue
        e = t[key]
        lines.append(
            f"| {name} | {100 * e['accuracy']:.2f}% | {100 * e['within_one_bucket']:.2f}% | "
            f"{e['mean_bucket_distance']:.3f} | {e['mean_miss_distance']:.3f} | {e['under_predictions']} | "
            f"{e['over_predictions']} | {COST_NOTE.get(key, format(e['mean_predict_us'], '.2f'))} |")
    margin = 100 * (t["probe"]["accuracy"] - t["majority"]["accuracy"])
    lines += [
        "",
        f"Probe over majority: +{margin:.1f} points; over the n-gram predictor: "
        f"+{100 * (t['probe']['accuracy'] - t['ngram']['accuracy']):.1f} points. The probe predicts the mode of its "
        "distribution (what the engine reserves); \"median bucket\" is the same probe deciding by the median, which "
        "minimizes the expected bucket distance.",
        "",
    ]
    if "probe_online" in t:
        tuning, ng = r.get("online_tuning", []), r["ngram"]["config"]
        grid = ", ".join(f"{o['online_learning_rate']}: {100 * o['validation_accuracy']:.2f}%" for o in tuning)
        lines += [
            "\"Learning online\" rows: the held-out prompts in order, each predicted and then learnt from in one "
            f"SGD step, a misprediction weighing {ng['online_weight_mispredicted']} and a hit "
            f"{ng['online_weight_correct']}, as S3's supervisor does in the engine (the probe's cost column there "
            f"is the prediction plus the update). The probe's step size ({p['online_learning_rate']}) was chosen "
            f"the same way on the validation part (step: accuracy; {grid}); the n-gram predictor learns at its "
            f"default step ({ng['online_learning_rate']}).",
            "",
        ]
    lines += [
        f"Cost per request: probe {cost['probe_predict']:.2f} us + reading the hidden row {cost['hidden_read']:.2f} us "
        f"= {cost['probe_total']:.2f} us (n-gram {cost['ngram_predict']:.2f} us), against a prefill of "
        f"{cost['prefill_ms_for_context']:.1f} ms per prompt on this CPU ({r['hidden']['threads']} threads).",
        "",
        "Command:",
        "",
        "```",
        r["hidden"]["command"],
        r["command"],
        "```",
        "",
    ]
    return "\n".join(lines)


def plot(r, path):
    t = r["test"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    names = [(k, n) for k, n in NAMES if k in t]
    xs = range(len(names))
    acc = [100 * t[k]["accuracy"] for k, _ in names]
    dist = [t[k]["mean_bucket_distance"] for k, _ in names]
    bars = ax.bar([x - 0.2 for x in xs], acc, 0.4, label="accuracy (%)", color="tab:blue")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([n for _, n in names], fontsize=7)
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax2 = ax.twinx()
    bars2 = ax2.bar([x + 0.2 for x in xs], dist, 0.4, label="mean bucket distance", color="tab:orange")
    ax2.set_ylabel("mean |predicted - true| bucket")
    ax2.bar_label(bars2, fmt="%.2f", fontsize=8)
    ax.set_title(f"{r['split']['test_size']} held-out prompts, {r['buckets']['num_buckets']} buckets")
    for ax, key in zip(axes[1:], ["probe", "ngram"]):
        m = t[key]["confusion"]
        ax.imshow(m, cmap="Blues")
        for i, row in enumerate(m):
            for j, c in enumerate(row):
                if c:
                    ax.text(j, i, str(c), ha="center", va="center", fontsize=7)
        ax.set_xlabel("predicted bucket")
        ax.set_ylabel("true bucket")
        ax.set_title(f"{dict(NAMES)[key]}: {100 * t[key]['accuracy']:.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    for path in sys.argv[1:]:
        with open(path) as f:
            r = json.load(f)
        if "provenance" not in r:
            # The tool's run, recorded right after it (same tree, same machine).
            r["provenance"] = provenance.provenance(
                shlex.split(r["command"]), source="added by bench/length_probe_report.py from the report's command")
            with open(path, "w") as f:
                json.dump(r, f, indent=2)
                f.write("\n")
        stem = os.path.splitext(path)[0]
        with open(stem + ".md", "w") as f:
            f.write(markdown(r))
        plot(r, stem + ".png")
        print("wrote", stem + ".md", stem + ".png")


if __name__ == "__main__":
    main()
