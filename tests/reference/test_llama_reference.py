#!/usr/bin/env python3
"""Compares kvflow's CPU forward pass with Hugging Face transformers' LlamaForCausalLM.

  tiny:    random Llamas written as safetensors here (GQA, tied and untied embeddings, odd
           sizes, a sharded checkpoint, Llama-3 rope scaling, attention and MLP biases): max
           |dlogit| <= 1e-3 over every position of several prompts.
  smollm2: SmolLM2-135M-Instruct from its Q4_1 GGUF, dequantized by transformers (gguf-py) on
           the reference side and by kvflow on ours: logits within tolerance and the first 32
           greedy tokens identical.

kvflow's side runs all prompts in one batch, in two prefill chunks, through a paged KV cache whose
blocks are shuffled, so the comparison also covers paging and chunked prefill.

--device cuda runs kvflow's CUDA backend (--dtype fp16, or bf16) and transformers in float32 on the
same GPU (TF32 off), and compares the CUDA logits with both transformers and kvflow's CPU backend:
  tiny:    the same random Llamas with head_dim 64 or 128 (what the CUDA attention kernels
           support) and KV block sizes 8, 16 and 32; logits, the first 32 greedy tokens of every
           prompt (a divergence passes only at a near tie) and beam search.
  smollm2: logits, and the first 32 greedy tokens identical on every prompt.
  The tolerances (GPU_TOLERANCES below) are relative to the largest |logit|. It skips (77) when
  kvflow finds no GPU, or when torch has no CUDA (unless --hf-cpu-fallback: transformers then
  runs in float32 on the CPU, the same reference).
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

# Where transformers runs: the CPU, or with --device cuda the GPU kvflow runs on.
DEVICE = torch.device("cpu")

# kvflow on the GPU (fp16 weights, activations and KV cache; fp32 accumulation, residual stream
# and logits) against float32 references: max |dlogit| <= tol * max|logit| of the reference.
# Calibrated by rounding transformers' weights and every activation to fp16 (bf16) on the CPU,
# which gives max |dlogit| / max|logit| of about 1e-3 on the tiny models (4e-3 to 1e-2 in bf16)
# and 2.4e-3 on SmolLM2-135M (its 30 layers; 1.3e-2 in bf16), with identical greedy tokens in
# fp16 (bf16 flips a few near ties on the tiny models). The tolerances leave 10x to 20x for
# rounding that emulation does not model (attention probabilities rounded to 16 bits for the
# tensor-core P.V product, exp2f, cuBLAS's summation order). A real bug (a wrong rotary
# position, a misplaced KV block, a wrong scale) moves logits by a good part of their scale.
# The CPU backend's tolerance is 1e-3 absolute (fp32 throughout).
GPU_TOLERANCES = {
    "fp16": {"tiny": 2e-2, "smollm2": 3e-2},
    "bf16": {"tiny": 1e-1, "smollm2": 1.5e-1},
}


class Skipped(Exception):
    pass


def run_dump(dump_bin, model, prompts, workdir, chunk=0, greedy=0, beam_width=0, device="cpu", dtype="fp16",
             block_size=0, keep_quantized=False, max_model_len=0):
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
    if block_size:
        cmd += ["--block-size", str(block_size)]
    if keep_quantized:
        cmd += ["--keep-quantized"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if device != "cpu":
        cmd += ["--device", device, "--dtype", dtype]
    proc = subprocess.run(cmd)
    if device != "cpu" and proc.returncode == SKIP:
        raise Skipped(f"kvflow finds no CUDA GPU ({os.path.basename(dump_bin)} --device {device} exited with {SKIP})")
    proc.check_returncode()
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


def ids(tokens):
    return torch.tensor([tokens], device=DEVICE)


def hf_logits(model, prompts):
    with torch.no_grad():
        return [model(ids(p), use_cache=False).logits[0].float().cpu().numpy() for p in prompts]


def hf_greedy(model, prompt, n):
    tokens = []
    if model.config.model_type == "gemma2":
        # Gemma-2 outside generate() sizes its HybridCache to the prompt: decode without a cache.
        with torch.no_grad():
            for _ in range(n):
                tokens.append(int(model(ids(prompt + tokens), use_cache=False).logits[0, -1].argmax()))
        return tokens
    with torch.no_grad():
        out = model(ids(prompt), use_cache=True)
        for _ in range(n):
            nxt = int(out.logits[0, -1].argmax())
            tokens.append(nxt)
            out = model(ids([nxt]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def greedy_agreement(model, prompt, ours, ref, tie_tol=None):
    """Compares kvflow's greedy tokens with transformers'. Returns (ok, description). With tie_tol,
    a divergence still passes when it starts at a near tie: where transformers' logit for its own
    token beats its logit for kvflow's token by at most tie_tol (rounding within the logit
    tolerance may pick either; the continuations differ from there on, so nothing after it is
    compared). Without tie_tol the tokens must be identical."""
    first = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), None)
    if first is None and len(ours) == len(ref):
        return True, f"greedy{len(ref)} identical"
    if first is None:
        return False, f"greedy: {len(ours)} tokens, expected {len(ref)}"
    with torch.no_grad():
        logits = model(ids(prompt + ref[:first]), use_cache=False).logits[0, -1].double()
    gap = float(logits[ref[first]] - logits[ours[first]])
    where = f"DIFFER at {first} (hf logit gap {gap:.3g} between hf's token {ref[first]} and kvflow's {ours[first]})"
    if tie_tol is not None and gap <= tie_tol:
        return True, f"greedy{len(ref)} {where}: near tie, ok"
    return False, f"greedy{len(ref)} {where}"


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
                logits = model(ids(prompt + out)).logits[0, -1].double()
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


def beam_scores(model, prompt, beams):
    """transformers' cumulative logprob of each beam's tokens after the prompt."""
    scores = []
    with torch.no_grad():
        for b in beams:
            logprobs = torch.log_softmax(model(ids(prompt + b)).logits[0].double(), dim=-1)
            scores.append(sum(float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(b)))
    return scores


def check_beam_search(args):
    """kvflow beam search (forks, copy-on-write, block frees) vs plain beam search on HF logits.
    On the GPU, beams that differ from the reference still pass when transformers scores them as
    high, rank by rank, within the logit tolerance (fp16 rounding reordering near-equal beams)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(max_position_embeddings=512, rms_norm_eps=1e-5, **tiny_config_kwargs("gqa_untied", args))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    randomize(model, seed=100)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (5, 20, 37)]
    width, tokens = 4, 10
    gpu = args.device == "cuda"
    with tempfile.TemporaryDirectory(dir=args.workdir) as d:
        model.save_pretrained(d, safe_serialization=True)
        write_byte_tokenizer(d, config.vocab_size)  # the engine wants one; prompts are ids
        if gpu:
            _, _, ours = run_dump(args.dump_bin, d, prompts, d, greedy=tokens, beam_width=width, device=args.device,
                                  dtype=args.dtype, block_size=GPU_TINY["gqa_untied"][1])
        else:
            _, _, ours = run_dump(args.dump_bin, d, prompts, d, greedy=tokens, beam_width=width)
    model.to(DEVICE)
    score_tol = None
    if gpu:
        scale = max(float(np.abs(b).max()) for b in hf_logits(model, prompts))
        score_tol = GPU_TOLERANCES[args.dtype]["tiny"] * scale
    ok = True
    for p, beams in zip(prompts, ours):
        ref = hf_beams(model, p, width, tokens)
        same = beams == ref
        verdict = "identical to the reference" if same else "DIFFERENT"
        if not same and score_tol is not None and len(beams) == len(ref):
            gap = max(abs(a - b) for a, b in zip(beam_scores(model, p, beams), beam_scores(model, p, ref)))
            same = gap <= score_tol
            verdict = (f"different beams, hf scores within {gap:.2e} of the reference's rank by rank "
                       f"(tolerance {score_tol:.2e}): {'ok' if same else 'FAIL'}")
        ok &= same
        print(f"beam search width {width}, prompt of {len(p):2d} tokens, {tokens} new: {verdict}")
        if beams != ref:
            print("  kvflow:", beams)
            print("  hf:    ", ref)
    return ok


def randomize(model, seed):
    """HF's init (std 0.02, unit norms) gives near-constant logits; use weights that make every
    position and every layer matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # attention_bias / mlp_bias: random, non-zero, either sign
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
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
    # HF Llama's biases: attention_bias on q, k, v and o_proj (q/k before RoPE), mlp_bias on gate,
    # up and down_proj.
    "biases": dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=211, tie_word_embeddings=False, attention_bias=True,
                   mlp_bias=True),
    "attention_bias_only_mqa": dict(hidden_size=64, intermediate_size=120, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=1, head_dim=32, vocab_size=181, tie_word_embeddings=True,
                                    attention_bias=True),
    # Qwen2 (Qwen2ForCausalLM): q, k and v biases always, o_proj none; Qwen's rope_theta; a
    # sliding_window in the config that use_sliding_window leaves off.
    "qwen2_gqa": dict(family="qwen2", hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, vocab_size=223, tie_word_embeddings=False,
                      rope_theta=1000000.0, sliding_window=16, use_sliding_window=False),
    "qwen2_tied": dict(family="qwen2", hidden_size=64, intermediate_size=136, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=197, tie_word_embeddings=True),
    # Phi-3 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj; its sliding window beyond the context.
    "phi3_gqa": dict(family="phi3", hidden_size=96, intermediate_size=176, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2, vocab_size=229, tie_word_embeddings=False,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=2047),
    # Mistral (MistralForCausalLM) and Phi-3 with a real sliding window: each query sees the last 21
    # (19) positions, so the prompts of 33-129 tokens and 32 greedy tokens run far past it, with
    # blocks released behind it.
    "mistral_swa": dict(family="mistral", hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, vocab_size=227, tie_word_embeddings=False,
                        rope_theta=1000000.0, sliding_window=21),
    "phi3_swa": dict(family="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, vocab_size=233, tie_word_embeddings=False,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=19),
    # Phi-3 with LongRoPE: per-frequency short and long divisors around an original context of 64
    # (of 512), cos and sin scaled by sqrt(1 + ln 8 / ln 64). transformers picks the factors per
    # forward call, kvflow per max_model_len (as llama.cpp does): the prompts up to 64 tokens are
    # compared at max_model_len 64 (short factors), the longer ones at 512 (long factors).
    "phi3_longrope": dict(family="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=227, tie_word_embeddings=False,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=64,
                          rope_scaling=dict(type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                            long_factor=[1.0, 1.4, 2.2, 3.5, 5.5, 8.6, 13.0, 20.0])),
    # Gemma-2 (Gemma2ForCausalLM): GeGLU, sqrt(hidden)-scaled tied embeddings, (1 + w) norms before
    # and after attention and MLP, the softmax scale from query_pre_attn_scalar (not head_dim), a
    # window of 11 on the even layers, and soft-capping that bites (scores at 2: the real model's 50
    # barely touches random weights; logits at its 30).
    "gemma2": dict(family="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=241,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                   sliding_window=11, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    # Mixtral (MixtralForCausalLM): 2 of 4 SwiGLU experts per token, renormalized router weights.
    "mixtral_moe": dict(family="mixtral", hidden_size=96, intermediate_size=112, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, vocab_size=211, tie_word_embeddings=False,
                        num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0),
    # Qwen2-MoE (Qwen2MoeForCausalLM): 2 of 6 experts of 48 without renormalizing, a sigmoid-gated
    # shared expert, q/k/v biases.
    "qwen2moe": dict(family="qwen2moe", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=193, tie_word_embeddings=False,
                     num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                     shared_expert_intermediate_size=96, norm_topk_prob=False),
    # OLMoE (OlmoeForCausalLM): 2 of 4 experts, not renormalized, one RMSNorm over all of q and one
    # over all of k.
    "olmoe": dict(family="olmoe", hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=181, tie_word_embeddings=False, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=False, pad_token_id=0, eos_token_id=1),
}


def tiny_model(kw, seed):
    """The tiny HF model of a TINY_CONFIGS entry (its family's config and class), randomized."""
    from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config,
                              OlmoeConfig, OlmoeForCausalLM, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen2MoeConfig, Qwen2MoeForCausalLM)
    kw = dict(kw)
    family = kw.pop("family", "llama")
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "mistral": (MistralConfig, MistralForCausalLM),
                                 "gemma2": (Gemma2Config, Gemma2ForCausalLM),
                                 "phi3": (Phi3Config, Phi3ForCausalLM),
                                 "mixtral": (MixtralConfig, MixtralForCausalLM),
                                 "qwen2moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
                                 "olmoe": (OlmoeConfig, OlmoeForCausalLM)}[family]
    config = config_class(max_position_embeddings=512, rms_norm_eps=1e-5, **kw)
    if family == "gemma2":
        config._attn_implementation = "eager"  # HF's SDPA path drops Gemma-2's soft-capping
    torch.manual_seed(seed)
    model = model_class(config).eval()
    randomize(model, seed=100 + seed)
    return config, model


def has_biases(config):
    return (config.model_type in ("qwen2", "qwen2_moe") or getattr(config, "attention_bias", False)
            or getattr(config, "mlp_bias", False))


# The CUDA attention kernels take head_dim 64, 128 or 256 and KV blocks of 8, 16 or 32 tokens: on the
# GPU the tiny models get such head sizes (projections wider than hidden_size / heads, as in
# linear_rope_headdim) and each a block size, so every kernel variant runs. name: (head_dim, block)
GPU_TINY = {"gqa_untied": (64, 16), "mha_tied": (128, 8), "mqa_llama3_rope_sharded": (64, 32),
            "linear_rope_headdim": (128, 16), "biases": (64, 16),
            "attention_bias_only_mqa": (128, 32), "qwen2_gqa": (64, 16), "qwen2_tied": (128, 8),
            "phi3_gqa": (64, 32), "mistral_swa": (64, 8), "phi3_swa": (128, 16), "mixtral_moe": (64, 16),
            "qwen2moe": (64, 16), "olmoe": (64, 16), "gemma2": (256, 16)}


# What the CUDA backend refuses (and says so) rather than runs.
GPU_REFUSED = {"phi3_longrope": "LongRoPE is compared on the CPU (per-context factors against HF's per-call ones)"}


HF_HEAD_DIM_FROM_HIDDEN = ("qwen2", "phi3", "mixtral", "qwen2moe", "olmoe")


def tiny_config_kwargs(name, args):
    kw = dict(TINY_CONFIGS[name])
    if args.device == "cuda":
        kw["head_dim"] = GPU_TINY[name][0]
        if kw.get("family") in HF_HEAD_DIM_FROM_HIDDEN:
            # transformers 4.46 sizes these families' heads as hidden_size / heads and ignores
            # head_dim, so the GPU's head size comes from a wider hidden size instead.
            kw["hidden_size"] = kw["num_attention_heads"] * kw.pop("head_dim")
    return kw


MOE_FAMILIES = ("mixtral", "qwen2moe", "olmoe")


def position_errors(ours, ref, tol, allowed):
    """The largest |dlogit| over positions, leaving out the `allowed` worst positions that exceed
    `tol` (routing flips), and how many positions exceed it."""
    per_position = np.concatenate([np.abs(a - b).max(axis=-1) for a, b in zip(ours, ref)])
    over = int((per_position > tol).sum())
    kept = np.sort(per_position)[:len(per_position) - min(over, allowed)]
    return float(kept.max()), over


def check_tiny_gpu(args):
    """kvflow's CUDA backend on the tiny models: logits vs transformers (fp32, same GPU) and vs
    kvflow's CPU backend, the first 32 greedy tokens of every prompt, beam search."""
    rel_tol = GPU_TOLERANCES[args.dtype]["tiny"]
    print(f"kvflow CUDA ({args.dtype}) vs float32 references: tolerance max|dlogit| <= {rel_tol:g} * max|logit|, "
          f"greedy tokens identical but for near ties within that tolerance")
    rng = np.random.default_rng(7)
    worst = 0.0
    ok = True
    for i, name in enumerate(TINY_CONFIGS):
        if name in GPU_REFUSED:
            print(f"tiny {name:24s} skipped: {GPU_REFUSED[name]}")
            continue
        head_dim, block_size = GPU_TINY[name]
        config, model = tiny_model(tiny_config_kwargs(name, args), i)
        with tempfile.TemporaryDirectory(dir=args.workdir) as d:
            shard = "20KB" if "sharded" in name else "10GB"
            model.save_pretrained(d, safe_serialization=True, max_shard_size=shard)
            write_byte_tokenizer(d, config.vocab_size)  # the engine (greedy) wants one; prompts are ids
            prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (1, 7, 33, 50, 129)]
            ours, greedy = run_dump(args.dump_bin, d, prompts, d, greedy=32, device=args.device, dtype=args.dtype,
                                    block_size=block_size)
            cpu, _ = run_dump(args.dump_bin, d, prompts, d, block_size=block_size)
        model.to(DEVICE)
        ref = hf_logits(model, prompts)
        scale = max(float(np.abs(b).max()) for b in ref)
        tol = rel_tol * scale
        positions = sum(map(len, prompts))
        # A mixture of experts in 16 bits routes a near-tied token to another expert than fp32 does:
        # that position's logits move by far more than rounding, the others do not. Such positions
        # are counted and allowed up to 2% (a kernel error would move every position).
        flips_allowed = max(1, positions // 50) if TINY_CONFIGS[name].get("family") in MOE_FAMILIES else 0
        err_hf, over_hf = position_errors(ours, ref, tol, flips_allowed)
        err_cpu, over_cpu = position_errors(ours, cpu, tol, flips_allowed)
        worst = max(worst, err_hf / scale)
        verdicts = [greedy_agreement(model, p, g, hf_greedy(model, p, 32), tie_tol=tol) for p, g in zip(prompts, greedy)]
        identical = sum(v[1].endswith("identical") for v in verdicts)
        passed = (err_hf <= tol and err_cpu <= tol and over_hf <= flips_allowed and over_cpu <= flips_allowed
                  and all(v[0] for v in verdicts))
        ok &= passed
        flips = (f" positions over tol (routing flips, <= {flips_allowed} allowed): {over_hf} vs hf, {over_cpu} vs cpu"
                 if flips_allowed else "")
        print(f"tiny {name:24s} head_dim={head_dim:3d} block={block_size:2d} positions={positions:4d} "
              f"max|dlogit| vs hf {err_hf:.2e} (rel {err_hf / scale:.1e}) vs cpu {err_cpu:.2e} "
              f"(max|logit| {scale:.1f}, tol {tol:.2e}) greedy32 identical {identical}/{len(prompts)}{flips}  "
              f"{'ok' if passed else 'FAIL'}")
        for p, (g_ok, desc) in zip(prompts, verdicts):
            if not desc.endswith("identical"):
                print(f"  prompt of {len(p)} tokens: {desc}")
    print(f"tiny-random models on the GPU ({args.dtype}): worst max|dlogit| / max|logit| = {worst:.1e} "
          f"(tolerance {rel_tol:g})")
    ok &= check_beam_search(args)
    return 0 if ok else 1


def max_logit_move(model, prompts, ref):
    """How far transformers' logits now are from `ref` (after a feature of the model was turned off)."""
    return max(float(np.abs(a - b).max()) for a, b in zip(hf_logits(model, prompts), ref))


def set_sliding_window(model, window):
    """The window HF's attention masks with (None: none). Gemma-2's layers keep their own copy."""
    model.config.sliding_window = window
    for layer in model.model.layers:
        if hasattr(layer, "is_sliding"):
            layer.sliding_window = window if window is not None else 10 ** 9


def check_tiny(args):
    rng = np.random.default_rng(7)
    worst = 0.0
    ok = True
    for i, (name, kw) in enumerate(TINY_CONFIGS.items()):
        config, model = tiny_model(kw, i)
        with tempfile.TemporaryDirectory(dir=args.workdir) as d:
            shard = "20KB" if "sharded" in name else "10GB"
            model.save_pretrained(d, safe_serialization=True, max_shard_size=shard)
            sharded = os.path.exists(os.path.join(d, "model.safetensors.index.json"))
            prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in (1, 7, 33, 50, 129)]
            window = getattr(config, "sliding_window", None)
            windowed = bool(window) and window < config.max_position_embeddings
            # A sliding window also runs the engine's greedy decoding, which releases the blocks
            # behind the window as it goes.
            if windowed:
                write_byte_tokenizer(d, config.vocab_size)  # the engine wants one; prompts are ids
            longrope = (getattr(config, "rope_scaling", None) or {}).get("type") == "longrope"
            if longrope:
                original = config.original_max_position_embeddings
                short = [p for p in prompts if len(p) <= original]
                prompts = short + [p for p in prompts if len(p) > original]
                ours = run_dump(args.dump_bin, d, short, d, max_model_len=original)[0]
                ours += run_dump(args.dump_bin, d, prompts[len(short):], d)[0]
                # The factors must matter: the long prompts with the short factors are far off.
                wrong = run_dump(args.dump_bin, d, prompts[len(short):], d, max_model_len=original)[0]
                greedy = None
            else:
                ours, greedy = run_dump(args.dump_bin, d, prompts, d, greedy=32 if windowed else 0)
            ref = hf_logits(model, prompts)
        err = max(float(np.abs(a - b).max()) for a, b in zip(ours, ref))
        scale = max(float(np.abs(b).max()) for b in ref)
        worst = max(worst, err)
        status = "ok" if err <= 1e-3 else "FAIL"
        ok &= err <= 1e-3
        biases = ""
        if windowed:
            # The window must matter far beyond the tolerance, or the comparison proves nothing.
            set_sliding_window(model, None)
            moved = max_logit_move(model, prompts, ref)
            set_sliding_window(model, window)
            verdicts = [greedy_agreement(model, p, g, hf_greedy(model, p, 32), tie_tol=1e-3)
                        for p, g in zip(prompts, greedy)]
            identical = sum(v[1].endswith("identical") for v in verdicts)
            biases = (f" (window {window}: without it hf's logits move by {moved:.2f}; "
                      f"greedy32 identical {identical}/{len(prompts)})")
            if moved < 100 * 1e-3 or not all(v[0] for v in verdicts):
                status, ok = "FAIL (the window barely matters or greedy parts)", False
        if longrope:
            moved = max(float(np.abs(a - b).max()) for a, b in zip(wrong, ours[len(short):]))
            biases += f" (short factors on the {len(prompts) - len(short)} longer prompts move logits by {moved:.2f})"
            if moved < 100 * 1e-3:
                status, ok = "FAIL (the long factors barely matter)", False
        if config.model_type == "gemma2":
            # So must each soft cap.
            for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
                value = getattr(model.config, cap)
                setattr(model.config, cap, None)
                moved = max_logit_move(model, prompts, ref)
                setattr(model.config, cap, value)
                biases += f" (without {cap} {moved:.2f})"
                if moved < 100 * 1e-3:
                    status, ok = f"FAIL ({cap} barely matters)", False
        if has_biases(config):
            # The biases must matter far beyond the tolerance, or the comparison proves nothing.
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if pname.endswith(".bias"):
                        p.zero_()
            moved = max_logit_move(model, prompts, ref)
            biases = f" (without its biases hf's logits move by {moved:.2f})"
            if moved < 100 * 1e-3:
                status, ok = "FAIL (the biases barely matter)", False
        print(f"tiny {name:28s} sharded={sharded!s:5s} positions={sum(map(len, prompts)):4d} "
              f"max|dlogit|={err:.2e} (max|logit| {scale:.1f}){biases}  {status}")
    print(f"tiny-random models: worst max|dlogit| = {worst:.2e} (tolerance 1e-3)")
    ok &= check_beam_search(args)
    return 0 if ok else 1


SMOLLM_PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, Neil Armstrong became the first person to",
]


def check_smollm2_gpu(args, model, prompts):
    """kvflow's CUDA backend on SmolLM2: logits vs transformers (fp32, same GPU) and vs kvflow's CPU
    backend; the first 32 greedy tokens identical to transformers' on every prompt (in bf16, but
    for near ties within the logit tolerance)."""
    rel_tol = GPU_TOLERANCES[args.dtype]["smollm2"]
    strict = args.dtype == "fp16"
    print(f"kvflow CUDA ({args.dtype}) vs float32 references: tolerance max|dlogit| <= {rel_tol:g} * max|logit| "
          f"of each prompt; greedy32 {'identical' if strict else 'identical but for near ties'}")
    model.to(DEVICE)
    model.lm_head.weight = model.model.embed_tokens.weight
    ours, greedy = run_dump(args.dump_bin, args.gguf, prompts, args.workdir, greedy=32, device=args.device,
                            dtype=args.dtype)
    cpu, _ = run_dump(args.dump_bin, args.gguf, prompts, args.workdir)
    ref = hf_logits(model, prompts)
    ok = True
    worst = 0.0
    for text, p, a, b, c, g in zip(SMOLLM_PROMPTS, prompts, ours, ref, cpu, greedy):
        scale = float(np.abs(b).max())
        tol = rel_tol * scale
        err_hf = float(np.abs(a - b).max())
        err_cpu = float(np.abs(a - c).max())
        worst = max(worst, err_hf / scale)
        g_ok, desc = greedy_agreement(model, p, g, hf_greedy(model, p, 32), tie_tol=None if strict else tol)
        passed = g_ok and err_hf <= tol and err_cpu <= tol
        ok &= passed
        print(f"smollm2 prompt {text[:30]!r:34s} positions={len(a):3d} max|dlogit| vs hf {err_hf:.2e} "
              f"(rel {err_hf / scale:.1e}) vs cpu {err_cpu:.2e} (max|logit| {scale:.1f}, tol {tol:.2e}) {desc}  "
              f"{'ok' if passed else 'FAIL'}")
    print(f"SmolLM2-135M Q4_1 on the GPU ({args.dtype}): worst max|dlogit| / max|logit| = {worst:.1e} "
          f"(tolerance {rel_tol:g})")
    return 0 if ok else 1


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
    if args.device == "cuda":
        return check_smollm2_gpu(args, model, prompts)
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
    ap.add_argument("--smollm-tol", type=float, default=1e-3, help="CPU backend: max |dlogit| on SmolLM2")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="kvflow backend; cuda also runs transformers on the GPU")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16", help="kvflow's CUDA dtype")
    ap.add_argument("--hf-cpu-fallback", action="store_true",
                    help="with --device cuda and a torch without CUDA: run transformers (float32) on the CPU "
                         "instead of skipping")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.device == "cuda":
        if torch.cuda.is_available():
            global DEVICE
            DEVICE = torch.device("cuda")
            # A float32 reference: no TF32 in matmuls (cuDNN is not used by these models).
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            print(f"transformers on {torch.cuda.get_device_name(0)} (torch {torch.__version__}, float32)")
        elif args.hf_cpu_fallback:
            print(f"transformers on the CPU (torch {torch.__version__} has no CUDA; --hf-cpu-fallback), float32")
        else:
            print(f"SKIP: --device cuda but torch {torch.__version__} has no CUDA device "
                  f"(torch.cuda.is_available() is False); the GPU reference needs torch with CUDA "
                  f"(or --hf-cpu-fallback to run transformers on the CPU)")
            return SKIP
    try:
        if args.device == "cuda":
            return check_tiny_gpu(args) if args.mode == "tiny" else check_smollm2(args)
        return check_tiny(args) if args.mode == "tiny" else check_smollm2(args)
    except Skipped as e:
        print(f"SKIP: {e}")
        return SKIP


if __name__ == "__main__":
    sys.exit(main())
