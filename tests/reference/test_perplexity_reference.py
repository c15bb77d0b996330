#!/usr/bin/env python3
"""`kvflow perplexity` against Hugging Face transformers on a WikiText-2 slice.

kvflow computes perplexity from the engine's prompt logprobs (paged KV, chunked prefill); this
script runs LlamaForCausalLM in float32 on exactly the token ids kvflow scored (--dump-tokens) and
computes the same windows:
  sliding-window: Hugging Face's "Perplexity of fixed-length models" guide (windows of ctx tokens
                  every stride tokens, each scoring only the tokens the previous window did not);
  second-half:    llama.cpp's llama-perplexity (chunks of ctx, score tokens ctx/2+1 .. ctx-1).
The reference sums each scored token's -log p from log_softmax directly (the guide's
loss * (num_valid - 1) rescaling miscounts windows after the first by one token).

  tiny:    a random Llama (GQA, untied) written as safetensors with a byte-level tokenizer.
  smollm2: SmolLM2-135M-Instruct from its Q4_1 GGUF, dequantized by transformers on the reference
           side and by kvflow on ours.
Pass: |ppl_kvflow / ppl_hf - 1| <= 0.1% for every method. Exit codes: 0 pass, 1 fail, 77 skipped.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch

SKIP = 77
TOLERANCE = 1e-3


def run_kvflow(cli, model, text_path, workdir, ctx, stride, method, max_windows=0):
    out = os.path.join(workdir, f"ppl_{method}_{ctx}_{stride}.json")
    cmd = [cli, "perplexity", "--model", model, "--file", text_path, "--ctx", str(ctx), "--stride", str(stride),
           "--method", method, "--json", out, "--dump-tokens", "--threads", "2",
           # transformers dequantizes the GGUF to fp32 weights: compare with kvflow's exact mode.
           "--dtype", "f32"]
    if max_windows:
        cmd += ["--max-windows", str(max_windows)]
    subprocess.run(cmd, check=True)
    with open(out) as f:
        return json.load(f)


def windows(n, ctx, stride, method, max_windows):
    w = []
    if method == "second-half":
        for begin in range(0, n - ctx + 1, ctx):
            w.append((begin, begin + ctx, begin + ctx // 2 + 1))
    else:
        prev_end = 0
        for begin in range(0, n, stride):
            end = min(begin + ctx, n)
            start = max(prev_end, begin + 1)
            if start < end:
                w.append((begin, end, start))
            prev_end = end
            if end == n:
                break
    return w[:max_windows] if max_windows else w


@torch.no_grad()
def hf_perplexity(model, ids, ctx, stride, method, bos, max_windows):
    nll, count = 0.0, 0
    for begin, end, start in windows(len(ids), ctx, stride, method, max_windows):
        window = list(ids[begin:end])
        if method == "second-half" and bos is not None:
            window[0] = bos
        logits = model(torch.tensor([window])).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        for pos in range(start, end):
            nll -= float(logp[pos - begin - 1, window[pos - begin]])
            count += 1
    return math.exp(nll / count), count


def compare(name, model, kv_model, args, text_path, runs):
    ok = True
    for ctx, stride, method, max_windows in runs:
        ours = run_kvflow(args.cli, kv_model, text_path, args.workdir, ctx, stride, method, max_windows)
        # llama-perplexity starts every chunk with BOS when the tokenizer adds one; kvflow says
        # which id it used, and the reference does the same.
        bos = ours.get("first_token_bos")
        ref, count = hf_perplexity(model, ours["tokens"], ctx, stride, method, bos, max_windows)
        rel = abs(ours["perplexity"] / ref - 1.0)
        good = rel <= TOLERANCE and count == ours["scored_tokens"]
        ok &= good
        print(f"{name} {method:14s} ctx={ctx:4d} stride={stride:4d} tokens={count:5d} "
              f"kvflow={ours['perplexity']:.4f} hf={ref:.4f} rel={rel:.1e}  {'ok' if good else 'FAIL'}")
    return ok


def wikitext_slice(args, chars):
    if not os.path.exists(args.wikitext):
        raise FileNotFoundError(args.wikitext)
    with open(args.wikitext, encoding="utf-8") as f:
        text = f.read(chars)
    path = os.path.join(args.workdir, f"wikitext_{chars}.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def check_tiny(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, os.path.dirname(__file__))
    from test_llama_reference import randomize, write_byte_tokenizer
    config = LlamaConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                         num_key_value_heads=2, vocab_size=301, tie_word_embeddings=False,
                         max_position_embeddings=512, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    randomize(model, seed=42)
    d = tempfile.mkdtemp(dir=args.workdir)
    model.save_pretrained(d, safe_serialization=True)
    write_byte_tokenizer(d, config.vocab_size)
    text = wikitext_slice(args, 3000)
    runs = [(256, 256, "sliding-window", 0), (256, 100, "sliding-window", 0), (128, 128, "second-half", 0)]
    return compare("tiny", model, d, args, text, runs)


def check_smollm2(args):
    if not args.gguf or not os.path.exists(args.gguf):
        print(f"SKIP: SmolLM2 GGUF not found at {args.gguf!r}; run tools/fetch-model")
        return None
    from transformers import AutoModelForCausalLM
    d, f = os.path.split(os.path.abspath(args.gguf))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).eval()
    model.lm_head.weight = model.model.embed_tokens.weight  # transformers 4.46 drops the tie (see test_llama_reference)
    text = wikitext_slice(args, 12000)
    # Windows of 256 tokens (3 overlapping, 2 second halves): every rule of both methods, at about
    # a third of CI's time for 512-token windows (the reference's fp32 forward passes dominate).
    runs = [(256, 128, "sliding-window", 3), (256, 256, "second-half", 2)]
    return compare("smollm2", model, args.gguf, args, text, runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=["tiny", "smollm2"])
    ap.add_argument("--cli", required=True, help="the kvflow binary")
    ap.add_argument("--gguf")
    ap.add_argument("--wikitext", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    if not os.path.exists(args.wikitext):
        print(f"SKIP: no WikiText-2 at {args.wikitext}")
        return SKIP
    torch.set_num_threads(2)
    ok = check_tiny(args) if args.which == "tiny" else check_smollm2(args)
    if ok is None:
        return SKIP
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
