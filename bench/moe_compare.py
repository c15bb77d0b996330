#!/usr/bin/env python3
"""kvflow's CPU mixture of experts against llama.cpp on the same random-weight Mixtral GGUF, in one run.

The model is a Mixtral shape with random weights, large enough that the experts dominate what a
decode step reads: 8 layers of hidden 1024, 16 heads (4 KV heads of 64), 8 SwiGLU experts of 2816
per layer, 2 routed per token, a vocabulary of 8192 (--hidden, --experts, ... change it). It is
written once as fp16 GGUF (laid out as llama.cpp's converter writes Mixtral: a llama with merged
expert tensors) and quantized to Q4_K_M by llama.cpp's llama-quantize, into .cache/moe-bench/.
Random weights make meaningless text and arbitrary routing, which is what a speed test needs:
every token still routes to exactly 2 of 8 experts in each layer.

Both engines then run with the same threads, back to back:
  decode    one sequence, 64 tokens after depth 0 and 512: kvflow bench -d D -n 64; llama-bench -p 0 -n 64 -d D
  prefill   a 512-token prompt: kvflow bench -d 512 -n 0; llama-bench -p 512 -n 0
Decode tok/s is put against the memory roofline of the bytes a decode token must read: the
attention and output matrices, the router, the 2 routed experts' matrices of each layer (not the
6 others), and the KV cache at that depth; bandwidth measured as bench/llama_cpp_compare.py does.

  .venv/bin/python bench/moe_compare.py                      # ~10 min on 2 cores (first run: + model)
Writes OUT.json and OUT.md (OUT: --out-prefix, default bench/results/moe_compare). Needs the
llama.cpp build of bench/llama_cpp_compare.py (run that once) and gguf-py. Not part of CI.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_cpp_compare import (DEFAULT_LLAMA_CPP_PYTHON, GGML_TYPES, REPO, BenchError, device_info,  # noqa: E402
                               ensure_llama_cpp, kvflow_bench, llama_bench, log, measure_bandwidth, median_ts,
                               read_gguf, rel, roofline, run)
from provenance import provenance  # noqa: E402


def write_model(path, shape, seed=0):
    """An fp16 Mixtral-shaped GGUF with random weights (scaled so activations stay O(1)); with
    shape["experts"] == 0 a dense Llama of that shape (one SwiGLU MLP of width ffn per layer)."""
    import gguf
    H, F, L, E = shape["hidden"], shape["ffn"], shape["layers"], shape["experts"]
    NH, KV, D, V = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["vocab"]
    rng = np.random.default_rng(seed)
    mat = lambda *s: (rng.standard_normal(s, dtype=np.float32) / np.sqrt(s[-1])).astype(np.float16)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("random Mixtral shape" if E else "random Llama shape")
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_block_count(L)
    w.add_head_count(NH)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if E:
        w.add_expert_count(E)
        w.add_expert_used_count(shape["experts_used"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode  # GPT-2's byte spelling
    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)] + ["\u0120\u0120"] + [f"<extra_{i}>" for i in range(V - 257)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * (V - 257))
    w.add_token_merges(["\u0120 \u0120"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_tensor("token_embd.weight", rng.standard_normal((V, H), dtype=np.float32).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    w.add_tensor("output.weight", mat(V, H))
    for i in range(L):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(b + "attn_q.weight", mat(NH * D, H))
        w.add_tensor(b + "attn_k.weight", mat(KV * D, H))
        w.add_tensor(b + "attn_v.weight", mat(KV * D, H))
        w.add_tensor(b + "attn_output.weight", mat(H, NH * D))
        if not E:
            w.add_tensor(b + "ffn_gate.weight", mat(F, H))
            w.add_tensor(b + "ffn_up.weight", mat(F, H))
            w.add_tensor(b + "ffn_down.weight", mat(H, F))
            continue
        w.add_tensor(b + "ffn_gate_inp.weight", mat(E, H).astype(np.float32))
        w.add_tensor(b + "ffn_gate_exps.weight", mat(E, F, H))
        w.add_tensor(b + "ffn_up_exps.weight", mat(E, F, H))
        w.add_tensor(b + "ffn_down_exps.weight", mat(E, H, F))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def decode_bytes(path, experts, experts_used):
    """Bytes of the GGUF's matrices one decode token reads: every 2-D matrix whole (the embedding:
    one row), and of each merged expert tensor only the routed experts' share."""
    _, tensors = read_gguf(path)
    total, routed, per_type = 0, 0, {}
    for name, ttype, dims in tensors:
        if len(dims) < 2:
            continue
        tname, block, block_bytes = GGML_TYPES[ttype]
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * block_bytes
        if name == "token_embd.weight":
            nbytes //= dims[1]
        elif name.endswith("_exps.weight"):
            nbytes = nbytes * experts_used // experts
            routed += nbytes
        total += nbytes
        per_type[tname] = per_type.get(tname, 0) + 1
    return total, routed, per_type


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--depths", default="0,512")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816, help="each expert's intermediate size")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--experts-used", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--out-prefix", default="bench/results/moe_compare")
    ap.add_argument("--llama-cpp-python", default=DEFAULT_LLAMA_CPP_PYTHON)
    args = ap.parse_args()
    os.chdir(REPO)
    shape = dict(hidden=args.hidden, ffn=args.ffn, layers=args.layers, experts=args.experts,
                 experts_used=args.experts_used, heads=args.hidden // 64, kv_heads=max(1, args.hidden // 256),
                 head_dim=64, vocab=args.vocab)
    llama = ensure_llama_cpp(args.llama_cpp_python, skip_build=True)
    quantize = os.path.join(llama["bin"], "llama-quantize")
    if not os.access(quantize, os.X_OK):
        run(["cmake", "--build", os.path.dirname(llama["bin"]), "--target", "llama-quantize", "-j2"],
            what="build llama-quantize")
    tag = "mixtral_h{hidden}_f{ffn}_l{layers}_e{experts}x{experts_used}_v{vocab}".format(**shape)
    cache = os.path.join(REPO, ".cache", "moe-bench")
    os.makedirs(cache, exist_ok=True)
    f16, model = os.path.join(cache, tag + ".f16.gguf"), os.path.join(cache, tag + ".Q4_K_M.gguf")
    if not os.path.exists(model):
        log(f"writing {rel(f16)} (random weights)")
        write_model(f16, shape)
        run([quantize, f16, model, "Q4_K_M"], what="llama-quantize Q4_K_M")
        os.unlink(f16)
    weight_bytes, routed_bytes, types = decode_bytes(model, shape["experts"], shape["experts_used"])
    kv_per_token_f16 = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 2
    log(f"model {rel(model)}: {weight_bytes / 1e6:.1f} MB read per decode token, {routed_bytes / 1e6:.1f} MB of it "
        f"the routed experts ({os.path.getsize(model) / 1e6:.0f} MB file)")
    bw = measure_bandwidth(args.threads)
    log(f"bandwidth {bw['gbps']:.1f} GB/s on {args.threads} threads")
    cli = os.path.join(args.build_dir, "kvflow")
    depths = [int(d) for d in args.depths.split(",")]
    n, r = args.decode_tokens, args.repeats

    log(f"decode: kvflow bench -d {args.depths} -n {n}")
    kv = kvflow_bench(cli, model, args.threads, depths, n, r)
    log(f"decode: llama-bench -p 0 -n {n} -d {args.depths}")
    lrows = llama_bench(llama["bin"], model, args.threads, ["-p", "0", "-n", str(n), "-d", args.depths, "-r", str(r)],
                        what="llama-bench (decode)")
    decode = []
    for res in kv["results"]:
        d = res["depth"]
        lr = next((x for x in lrows if x.get("n_depth", 0) == d), None)
        bytes_per_token = weight_bytes + kv_per_token_f16 * (d + n / 2)
        row = {"depth": d, "kvflow_tok_s": res["decode_tok_s"], "kvflow_runs": res["runs"],
               "llama_tok_s": median_ts(lr) if lr else None, "llama_samples_ts": lr.get("samples_ts") if lr else None,
               "kvflow_roofline": roofline(res["decode_tok_s"], bytes_per_token, bw["gbps"])}
        if lr:
            row["llama_roofline"] = roofline(row["llama_tok_s"], bytes_per_token, bw["gbps"])
            row["ratio"] = row["kvflow_tok_s"] / row["llama_tok_s"]
        decode.append(row)
        log(f"  depth {d}: kvflow {row['kvflow_tok_s']:.1f} tok/s, llama.cpp {row['llama_tok_s'] or 0:.1f} tok/s")

    log(f"prefill: {args.prefill} tokens")
    kp = kvflow_bench(cli, model, args.threads, [args.prefill], 0, r)["results"][0]
    lp = llama_bench(llama["bin"], model, args.threads, ["-p", str(args.prefill), "-n", "0", "-r", str(r)],
                     what="llama-bench (prefill)")[0]
    prefill = {"tokens": args.prefill, "kvflow_tok_s": kp["prefill_tok_s"], "kvflow_runs": kp.get("runs"),
               "llama_tok_s": median_ts(lp), "llama_samples_ts": lp.get("samples_ts")}
    prefill["ratio"] = prefill["kvflow_tok_s"] / prefill["llama_tok_s"]
    log(f"  kvflow {prefill['kvflow_tok_s']:.1f} tok/s, llama.cpp {prefill['llama_tok_s']:.1f} tok/s")

    res = {"provenance": provenance(per_run_figures="decode[].kvflow_runs, llama_samples_ts; prefill likewise"),
           "device": device_info(), "bandwidth": bw, "shape": shape, "model": rel(model), "tensor_types": types,
           "decode_weight_bytes": weight_bytes, "routed_expert_bytes": routed_bytes,
           "kv_bytes_per_token_f16": kv_per_token_f16, "threads": args.threads, "decode": decode, "prefill": prefill,
           "kvflow_engine": kv.get("engine"), "load_avg_end": os.getloadavg(),
           "llama_cpp": {"version": llama["version"], "commit": llama["commit"]}}
    with open(args.out_prefix + ".json", "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(args.out_prefix + ".md", res)
    log(f"wrote {args.out_prefix}.json and .md")


def write_markdown(path, res):
    s, dev = res["shape"], res["device"]
    lines = [
        f"# kvflow vs llama.cpp on a mixture of experts (CPU, {res['threads']} threads)", "",
        f"- Device: {dev.get('cpu', '?')}, {dev.get('cores', '?')} cores, {dev.get('memory', '?')} "
        f"({dev.get('simd', '')}); load average at start {dev['load_avg_start'][0]:.2f}, at end "
        f"{res['load_avg_end'][0]:.2f}",
        f"- llama.cpp: llama-cpp-python {res['llama_cpp']['version']} (vendored llama.cpp {res['llama_cpp']['commit']})",
        f"- kvflow: commit {res['provenance']['commit']}; {res['kvflow_engine']}",
        f"- Model: random-weight Mixtral shape, Q4_K_M by llama-quantize ({res['model']}, tensors {res['tensor_types']}): "
        f"{s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads ({s['kv_heads']} KV) of {s['head_dim']}, "
        f"{s['experts']} experts of {s['ffn']} with {s['experts_used']} routed per token, vocabulary {s['vocab']}",
        f"- Bytes per decode token (modeled from the file's tensors): {res['decode_weight_bytes'] / 1e6:.1f} MB of "
        f"matrices, of which {res['routed_expert_bytes'] / 1e6:.1f} MB are the {s['experts_used']} routed experts' "
        f"(the other {s['experts'] - s['experts_used']} of each layer are not read), + "
        f"{res['kv_bytes_per_token_f16']} B/token of fp16 KV at the mean depth",
        f"- Memory read bandwidth (measured): {res['bandwidth']['gbps']:.1f} GB/s on {res['threads']} threads", "",
        f"## Decode, batch 1 ({res['decode'][0]['kvflow_roofline']['bytes_per_token'] / 1e6:.1f} MB per token at depth 0; "
        "median of the runs)", "",
        "| depth | kvflow tok/s | llama.cpp tok/s | kvflow / llama.cpp | kvflow % of roofline | llama.cpp % of roofline |",
        "|---:|---:|---:|---:|---:|---:|"]
    for row in res["decode"]:
        lrf = row.get("llama_roofline", {}).get("pct_of_roofline")
        lines.append(f"| {row['depth']} | {row['kvflow_tok_s']:.1f} | {row['llama_tok_s'] or 0:.1f} | "
                     f"{row.get('ratio', 0):.2f}x | {row['kvflow_roofline']['pct_of_roofline']:.0f}% | "
                     f"{lrf or 0:.0f}% |")
    p = res["prefill"]
    lines += ["", f"## Prefill, one {p['tokens']}-token prompt", "",
              "| tokens | kvflow tok/s | llama.cpp tok/s | kvflow / llama.cpp |", "|---:|---:|---:|---:|",
              f"| {p['tokens']} | {p['kvflow_tok_s']:.1f} | {p['llama_tok_s']:.1f} | {p['ratio']:.2f}x |", "",
              "## Measured and modeled", "",
              "- Measured: every tok/s and the bandwidth.",
              "- Modeled: the bytes per decode token (the file's matrices, the routed experts' share of the merged "
              "expert tensors, the KV cache at the mean depth) and so the rooflines.",
              "- Random weights route arbitrarily but always to exactly the configured number of experts per token.",
              f"- Command: `{res['provenance']['command']}`", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        print(f"moe_compare: {e}", file=sys.stderr)
        sys.exit(1)
