#!/usr/bin/env python3
"""MODELED, not measured: tensor- and pipeline-parallel decode of Llama-3.1-8B and -70B shapes on 1-8 H100 SXM GPUs
over NVLink, from counted bytes and FLOPs, as kvflow splits them (Megatron-style: heads and MLP width
across the ranks, KV heads replicated when fewer than ranks; vocab-parallel embedding and LM head)
with two all-reduces of the hidden state per layer.

Per decode step of batch B at context C, on each of T ranks:
  weights  = 2 bytes x (layer matrices + LM head) / T read (bf16; the embedding: rows only)
  kv       = B x C x layers x 2 x max(1, kv_heads / T) x head_dim x 2 bytes
  flops    = 2 x B x (parameters / T) + attention's 4 x B x C x layers x heads / T x head_dim
  compute  = max(bytes / (HBM x eff_bw), flops / (peak x eff_flops))
  comm     = 2 x layers x (latency + 2 (T-1)/T x B x hidden x 2 bytes / NVLink bus bandwidth)  (ring)
  step     = compute + comm (no overlap assumed: NCCL's all-reduce sits between the projections)
Pipeline parallelism over P GPUs (a stage of layers / P each; the first also holds the embedding,
the last the LM head), as kvflow runs it: each step's batch cut into M = min(P, B) micro-batches that
follow each other through the stages, so
  stage(b) = the formulas above for layers / P layers at batch b, T = 1 (a micro-batch reads the
             stage's weights again: decode is bound by weight reads, so micro-batches cost)
  step     = (P - 1) x stage(B / M) + M x last(B / M) + (P - 1) x (latency + B / M x hidden x 2 bytes / NVLink)
             (last: the last stage's time, the LM head's included; it sets the pace)
and, beside it, P batches in flight across steps (vLLM V1's batch queue, kvflow's default under
pipeline parallelism): every stage works on one batch while the next stage works on the one before,
so the last stage finishes a batch every last(b) + one hop:
  B split into P batches of B / P (what kvflow does with B sequences running): B / P / (last(B / P) + hop)
  P batches of B each (P x B sequences running, P times the KV):              B / (last(B) + hop)
Constants (stated, not fitted): HBM 3.35 TB/s at 75% (kvflow's measured decode on an H200 reaches
73-74% of its roofline), 989 TFLOP/s bf16 dense at 60%, NVLink 4 at 450 GB/s per direction with
NCCL's ring reaching ~80% of it on large messages, 8 us per all-reduce on small ones (NCCL's latency
floor inside one NVSwitch node). A configuration whose weights and KV do not fit 80 GB is marked.

  python3 bench/tensor_parallel_model.py        # writes bench/results/tensor_parallel_model.{json,md}
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import REPO, provenance  # noqa: E402

SHAPES = {
    "Llama-3.1-8B": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "ffn": 14336,
                     "vocab": 128256},
    "Llama-3.1-70B": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "head_dim": 128, "ffn": 28672,
                      "vocab": 128256},
}
GPU = {"name": "H100 SXM 80 GB", "hbm_bytes_s": 3.35e12, "bw_eff": 0.75, "flops": 989e12, "flops_eff": 0.60,
       "nvlink_bytes_s": 450e9, "ring_eff": 0.80, "allreduce_latency_s": 8e-6, "memory_bytes": 80e9}


def layer_params(s):
    q = s["heads"] * s["head_dim"]
    kv = s["kv_heads"] * s["head_dim"]
    return s["hidden"] * (q + 2 * kv) + q * s["hidden"] + 3 * s["hidden"] * s["ffn"]


def step(shape, T, B, C):
    s = shape
    params = s["layers"] * layer_params(s) + 2 * s["vocab"] * s["hidden"]
    weights = 2 * (s["layers"] * layer_params(s) + 2 * s["vocab"] * s["hidden"]) / T  # in memory
    read = 2 * (s["layers"] * layer_params(s) + s["vocab"] * s["hidden"]) / T  # a step reads embedding rows only
    kv_heads = max(1, s["kv_heads"] // T) if T <= s["kv_heads"] else 1
    kv = B * C * s["layers"] * 2 * kv_heads * s["head_dim"] * 2
    flops = 2 * B * params / T + 4 * B * C * s["layers"] * (s["heads"] / T) * s["head_dim"]
    compute = max((read + kv) / (GPU["hbm_bytes_s"] * GPU["bw_eff"]), flops / (GPU["flops"] * GPU["flops_eff"]))
    msg = B * s["hidden"] * 2
    comm = 0.0 if T == 1 else 2 * s["layers"] * (
        GPU["allreduce_latency_s"] + 2 * (T - 1) / T * msg / (GPU["nvlink_bytes_s"] * GPU["ring_eff"]))
    fits = weights + kv < 0.9 * GPU["memory_bytes"]
    return {"tp": T, "batch": B, "context": C, "weight_gb_per_gpu": weights / 1e9, "kv_gb_per_gpu": kv / 1e9,
            "compute_ms": compute * 1e3, "comm_ms": comm * 1e3, "step_ms": (compute + comm) * 1e3,
            "tok_s": B / (compute + comm), "comm_share": comm / (compute + comm), "fits": fits}


def stage_time(shape, P, b, C, head):
    """Seconds one stage of P spends on a micro-batch of b sequences; `head`: the last stage, which
    also runs the LM head."""
    s = shape
    layers = s["layers"] / P
    head_params = s["vocab"] * s["hidden"] if head else 0
    read = 2 * (layers * layer_params(s) + head_params)
    kv = b * C * layers * 2 * s["kv_heads"] * s["head_dim"] * 2
    flops = 2 * b * (layers * layer_params(s) + head_params) + 4 * b * C * layers * s["heads"] * s["head_dim"]
    return max((read + kv) / (GPU["hbm_bytes_s"] * GPU["bw_eff"]), flops / (GPU["flops"] * GPU["flops_eff"]))


def step_pp(shape, P, B, C):
    s = shape
    M = min(P, B)
    hop = GPU["allreduce_latency_s"] + (B / M) * s["hidden"] * 2 / (GPU["nvlink_bytes_s"] * GPU["ring_eff"])
    inner, last = stage_time(shape, P, B / M, C, False), stage_time(shape, P, B / M, C, True)
    # The first micro-batch crosses every stage; each later one leaves the last stage one of its
    # (the busiest) stage times after the one before.
    step = (P - 1) * inner + last + (M - 1) * last + (P - 1) * hop
    # The first stage holds the embedding, the last the LM head (Llama-3.1 does not tie them).
    weights = 2 * (s["layers"] / P * layer_params(s) + s["vocab"] * s["hidden"])
    kv = B * C * s["layers"] / P * 2 * s["kv_heads"] * s["head_dim"] * 2
    in_flight_tok_s = B / (stage_time(shape, P, B, C, True) + hop)  # P batches of B at once
    # The same B sequences split into P batches in flight (one when B < P: nothing to overlap).
    share = max(1.0, B / P)
    split_hop = GPU["allreduce_latency_s"] + share * s["hidden"] * 2 / (GPU["nvlink_bytes_s"] * GPU["ring_eff"])
    split_tok_s = (share / (stage_time(shape, P, share, C, True) + split_hop) if B >= P
                   else B / step)  # a batch smaller than P cannot be split: one step at a time
    # P batches of B in flight hold P times the KV of one on every stage.
    fits_in_flight = weights + P * kv < 0.9 * GPU["memory_bytes"]
    return {"pp": P, "microbatches": M, "batch": B, "context": C, "weight_gb_per_gpu": weights / 1e9,
            "kv_gb_per_gpu": kv / 1e9, "stage_ms": last * 1e3, "step_ms": step * 1e3, "tok_s": B / step,
            "bubble_share": 1 - M * last / step, "fits": weights + kv < 0.9 * GPU["memory_bytes"],
            "in_flight_tok_s": in_flight_tok_s if fits_in_flight else None,
            "split_in_flight_tok_s": split_tok_s}


def main():
    rows = []
    for name, shape in SHAPES.items():
        for B in (1, 64):
            base = None
            for T in (1, 2, 4, 8):
                r = step(shape, T, B, 4096)
                r["model"] = name
                if base is None and r["fits"]:
                    base = r
                r["speedup_vs_smallest_fit"] = r["tok_s"] / base["tok_s"] if base else None
                rows.append(r)
    pp_rows = []
    for name, shape in SHAPES.items():
        for B in (1, 64):
            for P in (2, 4, 8):
                r = step_pp(shape, P, B, 4096)
                r["model"] = name
                tp = next(t for t in rows if t["model"] == name and t["batch"] == B and t["tp"] == P)
                r["tp_tok_s_same_gpus"] = tp["tok_s"] if tp["fits"] else None
                pp_rows.append(r)
    doc = {"what": "MODELED tensor- and pipeline-parallel decode on H100s over NVLink (not measured)", "gpu": GPU,
           "shapes": SHAPES, "rows": rows, "pipeline_rows": pp_rows, "provenance": provenance()}
    out = os.path.join(REPO, "bench", "results", "tensor_parallel_model")
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write("# Tensor-parallel decode on H100s: MODELED from counted bytes and FLOPs (not measured)\n\n")
        f.write("bf16 weights and KV, context 4096, NVLink ring all-reduce, no compute/communication overlap; "
                "constants and formulas in bench/tensor_parallel_model.py. Speed-up is against the fewest GPUs "
                "the model fits on.\n\n")
        f.write("| model | batch | TP | weights / GPU (GB) | KV / GPU (GB) | step (ms) | of which all-reduce | tok/s | speed-up |\n")
        f.write("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            sp = f"{r['speedup_vs_smallest_fit']:.2f}x" if r["speedup_vs_smallest_fit"] else "-"
            tok = f"{r['tok_s']:.0f}" if r["fits"] else "does not fit"
            f.write(f"| {r['model']} | {r['batch']} | {r['tp']} | {r['weight_gb_per_gpu']:.1f} | {r['kv_gb_per_gpu']:.1f} | "
                    f"{r['step_ms']:.2f} | {100 * r['comm_share']:.0f}% | {tok} | {sp if r['fits'] else '-'} |\n")
        f.write("\nNot yet beside vLLM's published TP figures: the public numbers found for these shapes were "
                "serving-benchmark throughputs (ShareGPT mixes, other batch sizes), not comparable step times. "
                "kvflow's own multi-GPU path (NCCL) is not built yet; these rows are what it should reach.\n")
        f.write("\n## Pipeline parallelism on the same GPUs\n\n")
        f.write("P stages of layers / P (the last also runs the LM head), each step's batch in M = min(P, B) "
                "micro-batches, one hop of the residual stream per stage boundary; bubble = the share of the step "
                "the last stage waits (while the pipeline fills): kvflow with --pipeline-batches-in-flight 1. "
                "The last two columns keep P batches in flight across steps (vLLM V1's batch queue, kvflow's "
                "default): the batch's B sequences split into P batches of B / P (what kvflow does with B "
                "sequences running; B < P cannot be split), and P batches of B each (P x B sequences running, P "
                "times the KV).\n\n")
        f.write("| model | batch | PP | micro-batches | weights / GPU (GB) | KV / GPU (GB) | step (ms) | bubble | tok/s "
                "| TP on as many GPUs, tok/s | B split into P batches in flight, tok/s | P batches of B in flight, tok/s |\n")
        f.write("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in pp_rows:
            tok = f"{r['tok_s']:.0f}" if r["fits"] else "does not fit"
            tp = f"{r['tp_tok_s_same_gpus']:.0f}" if r["tp_tok_s_same_gpus"] else "does not fit"
            fl = f"{r['in_flight_tok_s']:.0f}" if r["in_flight_tok_s"] and r["fits"] else "does not fit"
            split = f"{r['split_in_flight_tok_s']:.0f}"
            f.write(f"| {r['model']} | {r['batch']} | {r['pp']} | {r['microbatches']} | {r['weight_gb_per_gpu']:.1f} | "
                    f"{r['kv_gb_per_gpu']:.1f} | {r['step_ms']:.2f} | {100 * r['bubble_share']:.0f}% | {tok} | {tp} | "
                    f"{split if r['fits'] else 'does not fit'} | {fl} |\n")
        f.write("\nWithin one step, pipeline parallelism never beats tensor parallelism on decode: every stage "
                "waits for the one before, and each micro-batch reads the stage's weights again. Batches in flight "
                "keep every stage busy, but at a fixed number of running sequences each batch is 1/P of them and "
                "still reads its stage's weights, so decode (bound by weight reads) gains 1.5-1.6x over "
                "micro-batches here (at most (2P - 1) / P), not P; P batches of B reach TP's figures only with P times the sequences and their "
                "KV. Pipeline parallelism's use is capacity (a stage needs no all-reduce, so it spans slow links "
                "between machines) and throughput at high concurrency.\n")
    print(open(out + ".md").read())


if __name__ == "__main__":
    main()
