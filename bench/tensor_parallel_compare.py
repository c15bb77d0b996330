#!/usr/bin/env python3
"""Tensor and pipeline parallelism's overhead on this machine, in one run: one rank of 2 threads
against tensor_parallel_size 2 and against pipeline_parallel_size 2 (mpirun -np 2, 1 thread each),
same model, same cores. Pipeline parallelism runs three ways: 2 batches in flight across steps (the
default, vLLM V1's batch queue), and one step at a time cut into 2 or 4 micro-batches.

The model is a random-weight Llama shape (8 layers of hidden 1024, 16 heads with 4 KV heads of 64,
an MLP of 2816, vocabulary 8192; fp16 GGUF in .cache/tp-bench/, written once by moe_compare.py's
writer), large enough that the matrices dominate a step and small enough for 2 cores. Each
configuration runs `kvflow bench` (medians of --repeats timed runs) at batch 1 and batch 32:
  decode tok/s   tokens decoded per second over the batch, after a prompt of --depth tokens
  TTFT           batch 1's prefill time of the --depth-token prompt (its first token)
  comm share     rank 0's seconds in all-reduces, in sending steps and (PP) in sending the residual
                 stream on, over the bench's wall time
  logits wait    PP: rank 0's seconds waiting for the last stage's logits after its own layers
                 (the second stage's time it did not overlap); TP: for the other rank's columns of
                 the logits (the LM head is vocab-parallel); over the bench's wall time
The configurations alternate (single, tp, pp, single, tp, pp ...) for --rounds rounds; the table quotes the
median round. On two cores two ranks cannot beat one rank of two threads (the same cores do the
same arithmetic, plus the sums): what this measures is the overhead, and where it comes from.

  .venv/bin/python bench/tensor_parallel_compare.py     # ~5 min on 2 cores
Writes OUT.json and OUT.md (OUT: --out-prefix, default bench/results/tensor_parallel_cpu). Not CI.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_cpp_compare import REPO, BenchError, device_info, log, rel, run  # noqa: E402
from moe_compare import write_model  # noqa: E402
from provenance import provenance  # noqa: E402

SHAPE = {"hidden": 1024, "ffn": 2816, "layers": 8, "experts": 0, "experts_used": 0, "heads": 16, "kv_heads": 4,
         "head_dim": 64, "vocab": 8192}
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_hwloc_base_binding_policy": "none",
           "OMPI_MCA_btl": "self,vader", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}


def bench(cli, model, tp, pp, microbatches, in_flight, threads, batch, depth, n, repeats, extra=()):
    ranks = tp * pp
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [cli, "bench", "-m", model, "--threads", str(threads), "-d", str(depth), "-n", str(n), "-b", str(batch),
           "-r", str(repeats), "--json", path]
    if ranks > 1:
        cmd = ["mpirun", "-np", str(ranks), "--oversubscribe"] + cmd + ["--tensor-parallel-size", str(tp),
                                                                         "--pipeline-parallel-size", str(pp),
                                                                         "--pipeline-microbatches", str(microbatches),
                                                                         "--pipeline-batches-in-flight", str(in_flight),
                                                                         *extra]
    try:
        run(cmd, what=f"kvflow bench ({ranks} rank(s), batch {batch})", env={**os.environ, **MPI_ENV}, timeout=1800)
        row = json.load(open(path))["results"][0]
    finally:
        os.unlink(path)
    runs = row["runs"]
    ttft = statistics.median(r["prefill_s"] for r in runs)
    mp = row["model_parallel"]
    return {"decode_tok_s": row["decode_tok_s"], "prefill_tok_s": row["prefill_tok_s"], "ttft_s": ttft,
            "comm_share": mp["comm_share"], "logits_wait_share": mp["logits_wait_share"],
            "all_reduce_seconds": mp["all_reduce_seconds"], "send_seconds": mp["send_seconds"],
            "residual_send_seconds": mp["residual_send_seconds"], "logits_wait_seconds": mp["logits_wait_seconds"],
            "microbatches": mp["microbatches"], "steps": mp["steps"], "overlapped_steps": mp.get("overlapped_steps", 0),
            "seconds": row["seconds"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cli", default=os.path.join(REPO, "build", "kvflow"))
    ap.add_argument("--depth", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--out-prefix", default=os.path.join(REPO, "bench", "results", "tensor_parallel_cpu"))
    args = ap.parse_args()
    model = os.path.join(REPO, ".cache", "tp-bench", "random-llama-1024x8.f16.gguf")
    if not os.path.exists(model):
        os.makedirs(os.path.dirname(model), exist_ok=True)
        log(f"writing the random-weight model to {rel(model)}")
        write_model(model, SHAPE)
    # (name, tp, pp, micro-batches a step (0: auto), batches in flight (0: pp), threads a rank)
    configs = [("1 rank x 2 threads", 1, 1, 0, 0, 2), ("TP=2 x 1 thread", 2, 1, 0, 0, 1),
               ("PP=2 x 1 thread, 2 batches in flight", 1, 2, 0, 0, 1),
               ("PP=2 x 1 thread, a step at a time, 2 micro-batches", 1, 2, 2, 1, 1),
               ("PP=2 x 1 thread, a step at a time, 4 micro-batches", 1, 2, 4, 1, 1)]
    batches = [int(b) for b in args.batches.split(",")]
    results = {name: {b: [] for b in batches} for name, *_ in configs}
    for r in range(args.rounds):
        for batch in batches:
            for name, tp, pp, mbs, in_flight, threads in configs:
                if batch == 1 and in_flight == 1:
                    continue  # a batch of one sequence is never cut nor split across steps
                log(f"round {r + 1}: {name}, batch {batch}")
                results[name][batch].append(bench(args.cli, model, tp, pp, mbs, in_flight, threads, batch, args.depth,
                                                  args.decode_tokens, args.repeats))
    rows = []
    for batch in batches:
        for name, tp, pp, mbs, in_flight, threads in configs:
            rounds = results[name][batch]
            if not rounds:
                continue
            depth = 1 if pp == 1 else in_flight or pp
            rows.append({"config": name, "ranks": tp * pp, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                         "pipeline_batches_in_flight": depth,
                         "pipeline_microbatches": mbs or (1 if depth > 1 else pp),
                         "overlapped_steps_share": statistics.median(x["overlapped_steps"] / max(1, x["steps"])
                                                                     for x in rounds),
                         "threads_per_rank": threads, "batch": batch,
                         "decode_tok_s": statistics.median(x["decode_tok_s"] for x in rounds),
                         "ttft_s": statistics.median(x["ttft_s"] for x in rounds),
                         "comm_share": statistics.median(x["comm_share"] for x in rounds),
                         "logits_wait_share": statistics.median(x["logits_wait_share"] for x in rounds),
                         "rounds": rounds})
    for batch in batches:
        single = next(r for r in rows if r["batch"] == batch and r["ranks"] == 1)
        for r in rows:
            if r["batch"] == batch:
                r["decode_vs_single"] = r["decode_tok_s"] / single["decode_tok_s"]
                r["ttft_vs_single"] = r["ttft_s"] / single["ttft_s"]
    doc = {"what": "tensor and pipeline parallelism's overhead: 1 rank x 2 threads vs TP=2 and PP=2 (2 batches in "
                   "flight across steps; a step at a time in 2 and 4 micro-batches) x 1 thread (mpirun), measured",
           "model": {"path": rel(model), "shape": SHAPE, "weights": "random, fp16 GGUF"},
           "depth": args.depth, "decode_tokens": args.decode_tokens, "repeats": args.repeats, "rounds": args.rounds,
           "device": device_info(), "rows": rows, "provenance": provenance(per_run_figures="rows[].rounds")}
    with open(args.out_prefix + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    write_markdown(doc, args.out_prefix + ".md")
    log(f"wrote {rel(args.out_prefix)}.json and .md")


def write_markdown(doc, path):
    rows, device = doc["rows"], doc["device"]
    machine = f"{device.get('cpu')}, {device.get('cores')} cores, {device.get('memory')}, {device.get('simd')}"
    with open(path, "w") as f:
        f.write("# Tensor and pipeline parallelism on this CPU: the overhead, measured\n\n")
        f.write(f"Random-weight Llama shape ({SHAPE['layers']} layers, hidden {SHAPE['hidden']}, {SHAPE['heads']} heads / "
                f"{SHAPE['kv_heads']} KV heads, MLP {SHAPE['ffn']}, fp16), prompt {doc['depth']} tokens, "
                f"{doc['decode_tokens']} decode tokens; medians of {doc['rounds']} alternating rounds of "
                f"`kvflow bench -r {doc['repeats']}`, measured on {machine}.\n\n")
        f.write("| config | batch | decode tok/s | vs 1 rank | TTFT (s) | vs 1 rank | rank 0 in communication "
                "| rank 0 waiting for logits | steps overlapped |\n")
        f.write("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            wait = r.get("logits_wait_share", 0.0)
            overlapped = f"{100 * r['overlapped_steps_share']:.0f}%" if r.get("pipeline_parallel_size", 1) > 1 else ""
            f.write(f"| {r['config']} | {r['batch']} | {r['decode_tok_s']:.1f} | {r['decode_vs_single']:.2f}x | "
                    f"{r['ttft_s']:.3f} | {r['ttft_vs_single']:.2f}x | {100 * r['comm_share']:.1f}% | "
                    f"{100 * wait:.1f}% | {overlapped} |\n")
        f.write("\nTTFT is batch 1's prefill; at batch 32 it is the whole batch's prefill time. Communication is rank 0's "
                "time in the layers' all-reduces (which includes waiting for the slower rank) and in sending each "
                "step's batch (and, under PP, the residual stream to the second stage). Under PP rank 0 also waits for "
                "the last stage's logits: the second stage's time its own layers did not overlap; under TP, for the other "
                "rank's columns of the logits (each rank computes half of the LM head's vocabulary rows). With 2 "
                "batches in flight rank 0 starts the next step (the other half of the sequences) while the second "
                "stage runs the one before, so neither stage waits for sampling (at best 1.0x of one rank, less the "
                "LM head that only the last stage runs); 'steps overlapped' is the share of steps rank 0 started "
                "while another was in flight. One step at a time in M micro-batches over 2 stages, each stage is "
                "busy M of the M + 1 slots of a step (GPipe's bubble: at best 0.67x at M = 2, 0.8x at M = 4). A "
                "batch of 1 can be neither cut nor split across steps, so nothing overlaps (0.5x at best). Two ranks on two cores do the same "
                "arithmetic as one rank of two threads, plus the communication: the ratio is the overhead, not a "
                "speed-up.\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--markdown-from":  # redraw the table from a saved JSON
        doc = json.load(open(sys.argv[2]))
        write_markdown(doc, sys.argv[2][:-len(".json")] + ".md")
        sys.exit(0)
    try:
        main()
    except BenchError as e:
        sys.exit(f"tensor_parallel_compare: {e}")
