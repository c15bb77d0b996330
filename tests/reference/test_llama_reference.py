#!/usr/bin/env python3
"""Compares kvflow's CPU forward pass with Hugging Face transformers' LlamaForCausalLM.

  tiny:    random Llamas written as safetensors here (GQA, tied and untied embeddings, odd
           sizes, a sharded checkpoint, Llama-3 rope scaling): max |dlogit| <= 1e-3 over every
           position of several prompts.
  smollm2: SmolLM2-135M-Instruct from its Q4_1 GGUF, dequantized by transformers (gguf-py) on
           the reference side and by kvflow on ours: logits within tolerance and the first 32
           greedy tokens identical.

kvflow's side runs all prompts in one batch, in two prefill chunks, through a paged KV cache whose
blocks are shuffled, so the comparison also covers paging and chunked prefill.
Exit codes: 0 pass, 1 fail, 77 skipped (printed with the reason).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

SKIP = 77


def run_dump(dump_bin, model, prompts, workdir, chunk=0, greedy=0, beam_width=0):
    prompts_path = os.path.join(workdir, "prompts.json")
    logits_path = os.path.join(workdir, "logits.bin")
    greedy_path = os.path.join(workdir, "greedy.json")
    beams_path = os.path.join(workdir, "beams.json")
    with open(prompts_path, "w") as f:
        json.dump(prompts, f)
    cmd = [dump_bin, "--model", model, "--prompts", prompts_path, "--out-logits", logits_path]
    if chunk:
        cmd += ["--chunk", str(chunk)]
    if greedy:
        cmd += ["--greedy-tokens", str(greedy), "--out-greedy", greedy_path]
    if beam_width:
        cmd += ["--beam-width", str(beam_width), "--out-beams", beams_path]
    subprocess.run(cmd, check=True)
    flat = np.fromfile(logits_path, dtype=np.float32)
    out, offset = [], 0
    vocab = flat.size // sum(len(p) for p in prompts)
    for p in prompts:
        out.append(flat[offset:offset + len(p) * vocab].reshape(len(p), vocab))
        offset += len(p) * vocab
    greedy_tokens = json.load(open(greedy_path)) if greedy else None
    if beam_width:
        return out, greedy_tokens, json.load(open(beams_path))
    return out, greedy_tokens


def hf_logits(model, prompts):
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float().numpy() for p in prompts]


def hf_greedy(model, prompt, n):
    tokens = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            nxt = int(out.logits[0, -1].argmax())
            tokens.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def hf_beams(model, prompt, width, n):
    """Beam search written out plainly over transformers logits (full recompute, no cache, no
    paging): each step every beam offers its 2*width best next tokens, the width best by
    cumulative logprob continue; no EOS, so all lengths are equal and the best come first.
    (transformers' own generate() cannot be imported with Debian's torch 1.13 on Python 3.11.)"""
    beams = [(0.0, [])]
    with torch.no_grad():
        for _ in range(n):
            candidates = []
            for score, out in beams:
                logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
                logprobs = torch.log_softmax(logits, dim=-1)
                top = torch.topk(logprobs, 2 * width)
                for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                    candidates.append((score + lp, out + [tok]))
            candidates.sort(key=lambda c: -c[0])
            beams = candidates[:width]
    return [out for _, out in beams]


def write_byte_tokenizer(directory, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([f"<extra_{i}>" for i in range(vocab_size - len(alphabet))])
    tok.save(os.path.join(directory, "tokenizer.json"))


def check_beam_search(args):
    """kvflow beam search (forks, copy-on-write, block frees) vs plain beam search on HF logits."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(max_position_embeddings=512, rms_norm_eps=1e-5, **TINY_CONFIGS["gqa_untied"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    randomize(model, seed=100)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (5, 20, 37)]
    width, tokens = 4, 10
    with tempfile.TemporaryDirectory(dir=args.workdir) as d:
        model.save_pretrained(d, safe_serialization=True)
        write_byte_tokenizer(d, config.vocab_size)  # the engine wants one; prompts are ids
        _, _, ours = run_dump(args.dump_bin, d, prompts, d, greedy=tokens, beam_width=width)
    ok = True
    for p, beams in zip(prompts, ours):
        ref = hf_beams(model, p, width, tokens)
        same = beams == ref
        ok &= same
        print(f"beam search width {width}, prompt of {len(p):2d} tokens, {tokens} new: "
              f"{'identical to the reference' if same else 'DIFFERENT'}")
        if not same:
            print("  kvflow:", beams)
            print("  hf:    ", ref)
    return ok


def randomize(model, seed):
    """HF's init (std 0.02, unit norms) gives near-constant logits; use weights that make every
    position and every layer matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[1] ** 0.5))


TINY_CONFIGS = {
    "gqa_untied": dict(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
                       num_key_value_heads=2, vocab_size=301, tie_word_embeddings=False),
    "mha_tied": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=257, tie_word_embeddings=True, rope_theta=500000.0),
    "mqa_llama3_rope_sharded": dict(hidden_size=80, intermediate_size=136, num_hidden_layers=2,
                                    num_attention_heads=5, num_key_value_heads=1, vocab_size=263,
                                    tie_word_embeddings=False,
                                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                      high_freq_factor=4.0, original_max_position_embeddings=64)),
    "linear_rope_headdim": dict(hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, vocab_size=199, tie_word_embeddings=False,
                                rope_scaling=dict(rope_type="linear", factor=2.0)),
}


def check_tiny(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    rng = np.random.default_rng(7)
    worst = 0.0
    ok = True
    for i, (name, kw) in enumerate(TINY_CONFIGS.items()):
        config = LlamaConfig(max_position_embeddings=512, rms_norm_eps=1e-5, **kw)
        torch.manual_seed(i)
        model = LlamaForCausalLM(config).eval()
        randomize(model, seed=100 + i)
        with tempfile.TemporaryDirectory(dir=args.workdir) as d:
            shard = "20KB" if "sharded" in name else "10GB"
            model.save_pretrained(d, safe_serialization=True, max_shard_size=shard)
            sharded = os.path.exists(os.path.join(d, "model.safetensors.index.json"))
            prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (1, 7, 33, 50, 129)]
            ours, _ = run_dump(args.dump_bin, d, prompts, d)
            ref = hf_logits(model, prompts)
        err = max(float(np.abs(a - b).max()) for a, b in zip(ours, ref))
        scale = max(float(np.abs(b).max()) for b in ref)
        worst = max(worst, err)
        status = "ok" if err <= 1e-3 else "FAIL"
        ok &= err <= 1e-3
        print(f"tiny {name:28s} sharded={sharded!s:5s} positions={sum(map(len, prompts)):4d} "
              f"max|dlogit|={err:.2e} (max|logit| {scale:.1f})  {status}")
    print(f"tiny-random models: worst max|dlogit| = {worst:.2e} (tolerance 1e-3)")
    ok &= check_beam_search(args)
    return 0 if ok else 1


SMOLLM_PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, Neil Armstrong became the first person to",
]


def check_smollm2(args):
    if not args.gguf or not os.path.exists(args.gguf):
        print(f"SKIP: SmolLM2 GGUF not found at {args.gguf!r}; run tools/fetch-model")
        return SKIP
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.split(os.path.abspath(args.gguf))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).eval()
    # transformers 4.46 loses the tie when converting this GGUF (it has no output.weight) and
    # initialises lm_head randomly; tie it back as the file means.
    model.lm_head.weight = model.model.embed_tokens.weight
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    prompts = [tok.encode(p, add_special_tokens=False) for p in SMOLLM_PROMPTS]
    ours, greedy = run_dump(args.dump_bin, args.gguf, prompts, args.workdir, greedy=32)
    ref = hf_logits(model, prompts)
    ok = True
    worst_abs = 0.0
    for p, a, b, g in zip(SMOLLM_PROMPTS, ours, ref, greedy):
        err = float(np.abs(a - b).max())
        rel = err / float(np.abs(b).max())
        worst_abs = max(worst_abs, err)
        hf_tokens = hf_greedy(model, tok.encode(p, add_special_tokens=False), 32)
        same = g == hf_tokens
        first_diff = next((i for i, (x, y) in enumerate(zip(g, hf_tokens)) if x != y), None)
        ok &= same and err <= args.smollm_tol
        print(f"smollm2 prompt {p[:30]!r:34s} positions={len(a):3d} max|dlogit|={err:.2e} rel={rel:.1e} "
              f"greedy32 {'identical' if same else f'DIFFER at {first_diff}'}")
        if not same:
            print("  kvflow:", g)
            print("  hf:    ", hf_tokens)
    print(f"SmolLM2-135M Q4_1: worst max|dlogit| = {worst_abs:.2e} (tolerance {args.smollm_tol})")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["tiny", "smollm2"])
    ap.add_argument("--dump-bin", required=True)
    ap.add_argument("--gguf")
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--smollm-tol", type=float, default=1e-3)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    return check_tiny(args) if args.mode == "tiny" else check_smollm2(args)


if __name__ == "__main__":
    sys.exit(main())
