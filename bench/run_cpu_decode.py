#!/usr/bin/env python3
"""CPU decode benchmark: kvflow vs Hugging Face transformers (PyTorch fp32) on the same model and
machine in one run, both next to the measured memory read bandwidth (the decode roofline).

  .venv/bin/python bench/run_cpu_decode.py --bench build/bench/kvflow_bench_cpu_decode \
      --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf

Writes bench/results/cpu_decode.json and bench/results/cpu_decode.md.
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import tempfile
import time

import torch


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def hf_decode_tokens_per_s(gguf, batch, context=128, steps=24):
    from transformers import AutoModelForCausalLM
    d, f = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).eval()
    model.lm_head.weight = model.model.embed_tokens.weight
    prompt = torch.tensor([[100 + 37 * i % 5000 for i in range(context)]] * batch)
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        past = out.past_key_values
        for _ in range(2):  # warm-up
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        elapsed = time.perf_counter() - start
    return batch * steps / elapsed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        env = dict(os.environ, KVFLOW_BENCH_MODEL=args.gguf)
        subprocess.run([args.bench, f"--benchmark_out={tmp.name}", "--benchmark_out_format=json"], check=True, env=env)
        gb = json.load(open(tmp.name))
    by_name = {b["name"]: b for b in gb["benchmarks"]}
    bandwidth = None
    for name, b in by_name.items():
        if name.startswith("BM_MemoryReadBandwidth"):
            bandwidth = b["GBps"]  # Google Benchmark already reports rates per second
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    for batch in (1, 8):
        b = next(v for k, v in by_name.items() if k.startswith(f"BM_Decode/{batch}/"))
        kv_tps = b["tokens_per_s"]
        weight_gbps = b["weight_GBps"]
        hf_tps = hf_decode_tokens_per_s(args.gguf, batch)
        # Roofline: one pass over the fp32 weights per step at the measured read bandwidth.
        roofline_tps = batch * bandwidth / (weight_gbps / (kv_tps / batch))
        rows.append(dict(batch=batch, kvflow_tokens_per_s=kv_tps, hf_transformers_tokens_per_s=hf_tps,
                         speedup_vs_hf=kv_tps / hf_tps, weight_stream_GBps=weight_gbps,
                         roofline_tokens_per_s=roofline_tps, fraction_of_roofline=kv_tps / roofline_tps))
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(benchmark="cpu_decode", date=datetime.datetime.utcnow().isoformat() + "Z", commit=git,
                  device=f"CPU: {cpu_name()}, {os.cpu_count()} threads", model=os.path.basename(args.gguf),
                  compute="fp32 (weights dequantized at load)", context_tokens=128,
                  memory_read_GBps=bandwidth, torch=torch.__version__, rows=rows)
    with open(os.path.join(args.out_dir, "cpu_decode.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# CPU decode — {result['model']} ({result['compute']}), context 128",
             f"Device: {result['device']}; measured streaming read bandwidth (sgemv over 1 GiB) {bandwidth:.1f} GB/s; commit {git}; {result['date']}",
             "", "| batch | kvflow tok/s | HF transformers tok/s | kvflow / HF | weight stream GB/s | roofline tok/s | % of roofline |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['kvflow_tokens_per_s']:.1f} | {r['hf_transformers_tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_hf']:.2f}x | {r['weight_stream_GBps']:.1f} | {r['roofline_tokens_per_s']:.1f} | "
                     f"{100 * r['fraction_of_roofline']:.0f}% |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out_dir, "cpu_decode.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
