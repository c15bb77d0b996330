#!/usr/bin/env python3
"""kvflow against llama.cpp (and transformers where it has the class) on a tiny random model of each
architecture kvflow runs, through HF safetensors and through GGUF.

For each family (llama, qwen2, qwen3, phi3, phi3 with LongRoPE, mixtral, qwen2moe, qwen3moe, olmoe,
gemma2, gemma3) one
tiny model with random weights is written twice: as an HF checkpoint (config.json +
model.safetensors) and as an fp32 GGUF laid out as llama.cpp's converter writes it (Q/K rows
permuted for llama, Gemma's norms stored as 1 + w). Then:
  - kvflow's logits through both files, transformers' (llama, qwen2, phi3, mixtral, qwen2moe, olmoe,
    gemma2; 4.46 has no Qwen3, Qwen3-MoE nor Gemma-3) and llama.cpp's through the GGUF (fp32 KV
    cache, no flash attention) agree within 1e-3 (5e-3 against llama.cpp for the Gemmas: ggml's CPU
    GELU goes through an fp16 table);
  - greedy continuations of kvflow and llama.cpp on that GGUF are identical;
  - llama.cpp's llama-quantize makes a Q4_K_M of it, and kvflow (keeping the K-quant blocks, as
    --dtype auto runs it) gives llama.cpp's logits on it within 3% of their scale (each quantizes
    the activations its own way, about 2% from the exact product each; more in a mixture of
    experts, where a token's routing can flip with it) and its greedy continuation, or one that
    parts from it only where llama.cpp's top two logits are within that 3%.

llama.cpp is the one bench/llama_cpp_compare.py builds in .cache/llama-cpp (or KVFLOW_LLAMA_CPP_DIR:
a folder with build-*/ and llama_cpp_python-*/); where it is absent the test is skipped (exit 77).
  llama_cpp_reference.py --dump-bin build/tests/kvflow_logits_dump --workdir D
"""
import argparse
import glob
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_llama_reference import SKIP, run_dump  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F32_TOL = 1e-3
Q4_REL_TOL = 3e-2
GREEDY = 24

# Hidden sizes that are multiples of 256, so that llama-quantize can make every matrix Q4_K / Q6_K.
SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=300)
FAMILIES = {
    "llama": dict(hf="LlamaForCausalLM", rope_theta=10000.0, qkv_bias=False, qk_norm=False),
    "qwen2": dict(hf="Qwen2ForCausalLM", rope_theta=1000000.0, qkv_bias=True, qk_norm=False),
    "qwen3": dict(hf="Qwen3ForCausalLM", rope_theta=1000000.0, qkv_bias=False, qk_norm=True),
    "phi3": dict(hf="Phi3ForCausalLM", rope_theta=10000.0, qkv_bias=False, qk_norm=False, fused=True),
    # llama.cpp writes Mixtral as a llama with merged expert tensors.
    "mixtral": dict(hf="MixtralForCausalLM", rope_theta=1000000.0, qkv_bias=False, qk_norm=False, experts=4,
                    experts_per_token=2, gguf_arch="llama"),
    # Qwen's mixtures: experts narrower than the dense width, no renormalization for Qwen2-MoE and a
    # sigmoid-gated shared expert; Qwen3-MoE renormalizes and norms q/k per head.
    "qwen2moe": dict(hf="Qwen2MoeForCausalLM", rope_theta=1000000.0, qkv_bias=True, qk_norm=False, experts=4,
                     experts_per_token=2, expert_ffn=256, shared_ffn=512, norm_topk=False),
    "qwen3moe": dict(hf="Qwen3MoeForCausalLM", rope_theta=1000000.0, qkv_bias=False, qk_norm=True, experts=4,
                     experts_per_token=2, expert_ffn=256, norm_topk=True),
    # OLMoE: one RMSNorm over all of q and one over all of k; experts of intermediate_size. Its real
    # models are MHA, and llama.cpp takes k_norm as wide as q_norm, so here too.
    "olmoe": dict(hf="OlmoeForCausalLM", rope_theta=10000.0, qkv_bias=False, qk_norm="full", experts=4,
                  experts_per_token=2, expert_ffn=512, norm_topk=False, kv_heads=4),
    # Gemma-2: GeGLU, scaled tied embeddings, (1 + w) norms before and after attention and MLP (the
    # GGUF stores 1 + w, as llama.cpp's converter writes it), scores soft-capped at 5 (the real 50
    # barely bites random weights), logits at 30, a window of 16 on the even layers. 3 layers: a
    # global one between two sliding ones. ggml's CPU GELU reads a table of fp16 inputs to fp16
    # outputs (GGML_GELU_FP16), so llama.cpp's fp32 logits sit about 2e-3 from transformers' (kvflow's
    # are within 2e-5 of those): against llama.cpp the tolerance is 5e-3 here.
    "gemma2": dict(hf="Gemma2ForCausalLM", rope_theta=10000.0, qkv_bias=False, qk_norm=False, gemma=True,
                   layers=3, attn_softcap=5.0, final_softcap=30.0, window=16, llama_cpp_tol=5e-3,
                   must_matter={"attn_logit_softcapping": None, "final_logit_softcapping": None,
                                "sliding_window": None, "query_pre_attn_scalar": 256}),
    # Gemma-3's text model (transformers 4.46 has none: llama.cpp is the reference): Gemma-2's
    # layout without soft-capping, (1 + w) q/k norms per head, a global layer every 6 (so 6 layers,
    # the last global), the global layers' RoPE base 1e6 with linear scaling 2, the sliding ones'
    # 10000 without scaling.
    "gemma3": dict(hf="Gemma3ForCausalLM", rope_theta=1000000.0, qkv_bias=False, qk_norm=True, gemma=True,
                   layers=6, window=16, local_rope_theta=10000.0, rope_linear=2.0, llama_cpp_tol=5e-3,
                   must_matter={"rope_local_base_freq": 1000000.0, "rope_scaling": None, "sliding_window": None,
                                "sliding_window_pattern": 1000}),
    # Phi-3 with LongRoPE around an original context of 64 (of 512): the GGUF carries the factor
    # lists as rope_factors_long/short tensors and the cos/sin scale as rope.scaling.attn_factor.
    # kvflow and llama.cpp both take the long factors for a context past 64; transformers picks per
    # call (test_llama_reference.py compares it there). Last, so that every family before it keeps
    # its seed (1000 + its index): the mixtures' Q4_K_M check depends on the draw (see check_family).
    "phi3_longrope": dict(hf="Phi3ForCausalLM", model_type="phi3", gguf_arch="phi3", rope_theta=10000.0,
                          qkv_bias=False, qk_norm=False, fused=True, longrope_original=64,
                          must_matter={"rope_scaling": None}),
}


def shape_of(family):
    """SHAPE with the family's own overrides."""
    return dict(SHAPE, **{k: v for k, v in FAMILIES[family].items() if k in SHAPE})


def find_llama_cpp():
    root = os.environ.get("KVFLOW_LLAMA_CPP_DIR", os.path.join(REPO, ".cache", "llama-cpp"))
    builds = sorted(glob.glob(os.path.join(root, "build-*")))
    sources = sorted(glob.glob(os.path.join(root, "llama_cpp_python-*", "vendor", "llama.cpp")))
    if not builds or not sources:
        return None
    build, source = builds[-1], sources[-1]
    libs = [os.path.join(build, p) for p in ("src/libllama.a", "ggml/src/libggml.a", "ggml/src/libggml-cpu.a",
                                             "ggml/src/libggml-base.a")]
    return (build, source, libs) if all(os.path.exists(lib) for lib in libs) else None


def build_tools(build, source, libs, workdir):
    dumper = os.path.join(workdir, "llama_cpp_logits")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_logits.cc")
    if not os.path.exists(dumper) or os.path.getmtime(dumper) < os.path.getmtime(src):
        subprocess.run(["g++", "-O2", "-std=c++17", src, f"-I{source}/include", f"-I{source}/ggml/include", *libs,
                        "-fopenmp", "-lpthread", "-ldl", "-lm", "-o", dumper], check=True)
    quantize = os.path.join(build, "bin", "llama-quantize")
    if not os.path.exists(quantize):
        print("building llama-quantize in", build)
        subprocess.run(["cmake", "--build", build, "--target", "llama-quantize", "-j2"], check=True,
                       stdout=subprocess.DEVNULL)
    return dumper, quantize


def random_weights(family, seed):
    """HF-named fp32 weights, scaled so every layer and position matters (as test_llama_reference)."""
    s, f = shape_of(family), FAMILIES[family]
    rng = np.random.default_rng(seed)
    H, F, D, V = s["hidden"], s["intermediate"], s["head_dim"], s["vocab"]
    q, kv = s["heads"] * D, s["kv_heads"] * D
    mat = lambda rows, cols: (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    norm = lambda n, spread=0.1: (1.0 + spread * rng.standard_normal(n)).astype(np.float32)
    w = {"model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
         "model.norm.weight": norm(H), "lm_head.weight": mat(V, H)}
    if f.get("gemma"):  # tied embeddings, norms stored as w of (1 + w)
        del w["lm_head.weight"]
        w["model.norm.weight"] -= 1.0
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "self_attn.o_proj.weight": mat(H, q), p + "mlp.down_proj.weight": mat(H, F)})
        if f.get("experts") and "expert_ffn" in f:  # Qwen-MoE: mlp.gate, mlp.experts.E.*_proj, shared expert
            Fe = f["expert_ffn"]
            w[p + "mlp.gate.weight"] = mat(f["experts"], H)
            for e in range(f["experts"]):
                ex = p + f"mlp.experts.{e}."
                w.update({ex + "gate_proj.weight": mat(Fe, H), ex + "up_proj.weight": mat(Fe, H),
                          ex + "down_proj.weight": mat(H, Fe)})
            if f.get("shared_ffn"):
                Fs, sh = f["shared_ffn"], p + "mlp.shared_expert."
                w.update({sh + "gate_proj.weight": mat(Fs, H), sh + "up_proj.weight": mat(Fs, H),
                          sh + "down_proj.weight": mat(H, Fs), p + "mlp.shared_expert_gate.weight": mat(1, H)})
            w.update({p + "self_attn.q_proj.weight": mat(q, H), p + "self_attn.k_proj.weight": mat(kv, H),
                      p + "self_attn.v_proj.weight": mat(kv, H)})
            del w[p + "mlp.down_proj.weight"]
        elif f.get("experts"):  # Mixtral: a router and SwiGLU experts w1 (gate), w3 (up), w2 (down)
            w[p + "block_sparse_moe.gate.weight"] = mat(f["experts"], H)
            for e in range(f["experts"]):
                ex = p + f"block_sparse_moe.experts.{e}."
                w.update({ex + "w1.weight": mat(F, H), ex + "w3.weight": mat(F, H), ex + "w2.weight": mat(H, F)})
            w.update({p + "self_attn.q_proj.weight": mat(q, H), p + "self_attn.k_proj.weight": mat(kv, H),
                      p + "self_attn.v_proj.weight": mat(kv, H)})
            del w[p + "mlp.down_proj.weight"]
        elif f.get("fused"):  # Phi-3: q|k|v and gate|up as one matrix each
            w[p + "self_attn.qkv_proj.weight"] = mat(q + 2 * kv, H)
            w[p + "mlp.gate_up_proj.weight"] = mat(2 * F, H)
        else:
            w.update({p + "self_attn.q_proj.weight": mat(q, H), p + "self_attn.k_proj.weight": mat(kv, H),
                      p + "self_attn.v_proj.weight": mat(kv, H), p + "mlp.gate_proj.weight": mat(F, H),
                      p + "mlp.up_proj.weight": mat(F, H)})
        if f.get("gemma"):
            for name in ("input_layernorm", "post_attention_layernorm"):
                w[p + name + ".weight"] -= 1.0
            w[p + "pre_feedforward_layernorm.weight"] = norm(H) - 1.0
            w[p + "post_feedforward_layernorm.weight"] = norm(H) - 1.0
        if f["qkv_bias"]:
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{name}_proj.bias"] = (0.5 * rng.standard_normal(n)).astype(np.float32)
        if f["qk_norm"] == "full":  # OLMoE
            w[p + "self_attn.q_norm.weight"] = norm(q, 0.3)
            w[p + "self_attn.k_norm.weight"] = norm(kv, 0.3)
        elif f["qk_norm"]:
            w[p + "self_attn.q_norm.weight"] = norm(D, 0.3) - (1.0 if f.get("gemma") else 0.0)
            w[p + "self_attn.k_norm.weight"] = norm(D, 0.3) - (1.0 if f.get("gemma") else 0.0)
    return w


def write_hf(directory, family, weights):
    from safetensors.numpy import save_file
    s, f = shape_of(family), FAMILIES[family]
    model_type = f.get("model_type", {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(family, family))
    config = {"architectures": [f["hf"]], "model_type": model_type, "hidden_size": s["hidden"],
              "intermediate_size": s["intermediate"], "num_hidden_layers": s["layers"],
              "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
              "vocab_size": s["vocab"], "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
              "rope_theta": f["rope_theta"], "tie_word_embeddings": False, "hidden_act": "silu",
              "torch_dtype": "float32"}
    if family == "qwen3":
        config["attention_bias"] = False
    if f.get("gemma"):
        del config["hidden_act"]
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=s["head_dim"],
                      attn_logit_softcapping=f.get("attn_softcap"), final_logit_softcapping=f.get("final_softcap"),
                      sliding_window=f["window"], tie_word_embeddings=True, attention_bias=False,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if family == "gemma3":
        config.update(model_type="gemma3_text", rope_local_base_freq=f["local_rope_theta"], sliding_window_pattern=6,
                      rope_scaling={"rope_type": "linear", "factor": f["rope_linear"]})
    if f["hf"] == "Phi3ForCausalLM":
        config.update(pad_token_id=0, sliding_window=2047, original_max_position_embeddings=512)
    if f.get("longrope_original"):
        short, long = longrope_factors(s["head_dim"])
        config.update(original_max_position_embeddings=f["longrope_original"],
                      rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long})
    if family == "olmoe":  # its experts are intermediate_size wide
        config.update(num_experts=f["experts"], num_experts_per_tok=f["experts_per_token"],
                      intermediate_size=f["expert_ffn"], norm_topk_prob=f["norm_topk"], pad_token_id=0)
    elif f.get("experts") and "expert_ffn" in f:
        config.update(num_experts=f["experts"], num_experts_per_tok=f["experts_per_token"],
                      moe_intermediate_size=f["expert_ffn"], norm_topk_prob=f["norm_topk"],
                      shared_expert_intermediate_size=f.get("shared_ffn", 0), decoder_sparse_step=1,
                      mlp_only_layers=[])
    elif f.get("experts"):
        config.update(num_local_experts=f["experts"], num_experts_per_tok=f["experts_per_token"])
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as out:
        json.dump(config, out, indent=1)
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def longrope_factors(head_dim):
    """Short and long LongRoPE divisors, head_dim / 2 each, growing with the frequency index."""
    half = head_dim // 2
    return [1.0 + 0.02 * i for i in range(half)], [1.0 + 0.6 * i for i in range(half)]


def longrope_attn_factor(original, context=512):
    """The cos/sin scale llama.cpp's converter writes for Phi-3's LongRoPE."""
    import math
    scale = context / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


def permute(w, heads):
    """llama.cpp's converter (LlamaModel.permute): RoPE pairs of each head's rows interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, family, weights):
    import gguf
    s, f = shape_of(family), FAMILIES[family]
    arch = f.get("gguf_arch", family)
    w = gguf.GGUFWriter(path, arch)
    # Not "phi3": llama.cpp would then set attributes on Phi-3's special tokens, absent here.
    w.add_name("kvflow tiny random")
    w.add_context_length(512)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["intermediate"])
    w.add_block_count(s["layers"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(f["rope_theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if f.get("experts"):
        w.add_expert_count(f["experts"])
        w.add_expert_used_count(f["experts_per_token"])
    if "expert_ffn" in f:
        w.add_expert_feed_forward_length(f["expert_ffn"])
    if f.get("attn_softcap"):
        w.add_attn_logit_softcapping(f["attn_softcap"])
    if f.get("final_softcap"):
        w.add_final_logit_softcapping(f["final_softcap"])
    if f.get("gemma"):
        w.add_sliding_window(f["window"])
    if f.get("rope_linear"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(f["rope_linear"])
    if f.get("longrope_original"):
        w.add_rope_scaling_orig_ctx_len(f["longrope_original"])
        w.add_rope_scaling_attn_factors(longrope_attn_factor(f["longrope_original"]))
        short, long = longrope_factors(s["head_dim"])
        w.add_tensor("rope_factors_long.weight", np.array(long, dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(short, dtype=np.float32))
    if f.get("shared_ffn"):
        w.add_expert_shared_feed_forward_length(f["shared_ffn"])
    # A byte-level vocabulary: the 256 byte tokens, one merge, control tokens to the model's size.
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode  # GPT-2's byte spelling
    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)] + ["\u0120\u0120"]
    tokens += [f"<extra_{i}>" for i in range(s["vocab"] - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's spelling
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * (len(tokens) - 257))
    w.add_token_merges(["\u0120 \u0120"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_add_bos_token(False)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv",
             "mlp.gate_up_proj": "ffn_up"}
    if f.get("gemma"):
        names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    # Gemma's converter stores its (1 + w) norms as 1 + w.
    norm_offset = 1.0 if f.get("gemma") else 0.0
    w.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", weights["model.norm.weight"] + norm_offset)
    if "lm_head.weight" in weights:
        w.add_tensor("output.weight", weights["lm_head.weight"])
    qwen_moe = "expert_ffn" in f
    for i in range(s["layers"]) if f.get("experts") else []:  # the experts as llama.cpp merges them
        moe = f"model.layers.{i}." + ("mlp." if qwen_moe else "block_sparse_moe.")
        ex = [moe + f"experts.{e}." for e in range(f["experts"])]
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", weights[moe + "gate.weight"])
        kinds = (("gate_proj", "up_proj", "down_proj") if qwen_moe else ("w1", "w3", "w2"))
        for kind, gguf_kind in zip(kinds, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            w.add_tensor(f"blk.{i}.{gguf_kind}.weight", np.stack([weights[x + kind + ".weight"] for x in ex]))
        if f.get("shared_ffn"):
            for kind in ("gate", "up", "down"):
                w.add_tensor(f"blk.{i}.ffn_{kind}_shexp.weight", weights[moe + f"shared_expert.{kind}_proj.weight"])
            w.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", weights[moe + "shared_expert_gate.weight"][0])
    for name, value in weights.items():
        if not name.startswith("model.layers.") or "block_sparse_moe" in name or ".mlp.gate." in name \
                or ".mlp.experts." in name or ".mlp.shared_expert" in name:
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            value = permute(value, s["heads"] if module == "self_attn.q_proj" else s["kv_heads"])
        if module.endswith("layernorm") or module in ("self_attn.q_norm", "self_attn.k_norm"):
            value = value + norm_offset
        w.add_tensor(f"blk.{layer}.{names[module]}.{kind}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp(dumper, model, prompts, workdir):
    prompts_path, logits_path, greedy_path = (os.path.join(workdir, n) for n in
                                              ("lc_prompts.json", "lc_logits.bin", "lc_greedy.json"))
    with open(prompts_path, "w") as out:
        json.dump(prompts, out)
    subprocess.run([dumper, model, prompts_path, str(GREEDY), logits_path, greedy_path], check=True)
    flat = np.fromfile(logits_path, dtype=np.float32).reshape(-1, SHAPE["vocab"])
    out, at = [], 0
    for p in prompts:
        out.append(flat[at:at + len(p)])
        at += len(p)
    return out, json.load(open(greedy_path))


def transformers_logits(directory, prompts):
    try:
        import torch
        from transformers import AutoModelForCausalLM
        # Eager attention: HF's SDPA path drops Gemma-2's soft-capping.
        model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    except (ImportError, ValueError, KeyError) as e:  # the pinned transformers lacks the class
        return None, str(e).splitlines()[0][:80]
    with torch.no_grad():
        return [model(torch.tensor([p]), use_cache=False).logits[0].numpy() for p in prompts], None


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def check_family(family, seed, tools, args):
    dumper, quantize = tools
    workdir = os.path.join(args.workdir, family)
    os.makedirs(workdir, exist_ok=True)
    weights = random_weights(family, seed)
    hf_dir, gguf_path, q4_path = (os.path.join(workdir, n) for n in ("hf", "f32.gguf", "q4_k_m.gguf"))
    write_hf(hf_dir, family, weights)
    write_gguf(gguf_path, family, weights)
    subprocess.run([quantize, gguf_path, q4_path, "Q4_K_M"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, SHAPE["vocab"], size=n).tolist() for n in (1, 9, 40, 97)]
    ok = True

    ours_hf, _ = run_dump(args.dump_bin, hf_dir, prompts, workdir)
    ours_gguf, ours_greedy = run_dump(args.dump_bin, gguf_path, prompts, workdir, greedy=GREEDY)
    ref_lc, lc_greedy = llama_cpp(dumper, gguf_path, prompts, workdir)
    if FAMILIES[family].get("longrope_original"):
        ref_hf, why_not = None, "it picks LongRoPE's factors per call; test_llama_reference.py compares it"
    else:
        ref_hf, why_not = transformers_logits(hf_dir, prompts)
    scale = max(float(np.abs(x).max()) for x in ref_lc)
    pairs = [("kvflow gguf vs llama.cpp", ours_gguf, ref_lc), ("kvflow hf vs llama.cpp", ours_hf, ref_lc),
             ("kvflow gguf vs kvflow hf", ours_gguf, ours_hf)]
    if ref_hf is not None:
        pairs.append(("kvflow hf vs transformers", ours_hf, ref_hf))
    for label, a, b in pairs:
        d = max_diff(a, b)
        tol = FAMILIES[family].get("llama_cpp_tol", F32_TOL) if "llama.cpp" in label else F32_TOL
        ok &= d <= tol
        print(f"{family:6s} fp32  {label:27s} max|dlogit| {d:.2e} (max|logit| {scale:.1f})  "
              f"(tolerance {tol:g})  {'ok' if d <= tol else 'FAIL'}")
    if ref_hf is None:
        print(f"{family:6s} fp32  transformers: no reference ({why_not})")
    # Each config feature the family adds must move kvflow's logits far beyond the tolerance, or
    # agreeing with the reference proves nothing about it.
    for key, value in FAMILIES[family].get("must_matter", {}).items():
        mutated = os.path.join(workdir, "hf_without_" + key)
        os.makedirs(mutated, exist_ok=True)
        config = json.load(open(os.path.join(hf_dir, "config.json")))
        config[key] = value
        with open(os.path.join(mutated, "config.json"), "w") as out:
            json.dump(config, out)
        weights_link = os.path.join(mutated, "model.safetensors")
        if not os.path.exists(weights_link):
            os.symlink(os.path.join(hf_dir, "model.safetensors"), weights_link)
        moved = max_diff(run_dump(args.dump_bin, mutated, prompts, workdir)[0], ours_hf)
        matters = moved > 100 * FAMILIES[family].get("llama_cpp_tol", F32_TOL)
        ok &= matters
        print(f"{family:6s} fp32  {key} = {json.dumps(value)} moves kvflow's logits by {moved:.2f}  "
              f"{'ok' if matters else 'FAIL (it barely matters)'}")
    same = ours_greedy == lc_greedy
    ok &= same
    print(f"{family:6s} fp32  greedy {GREEDY} tokens of {len(prompts)} prompts: "
          f"{'identical to llama.cpp' if same else 'DIFFERENT from llama.cpp'}")

    q4_ours, q4_greedy = run_dump(args.dump_bin, q4_path, prompts, workdir, greedy=GREEDY, keep_quantized=True)
    q4_exact, _ = run_dump(args.dump_bin, q4_path, prompts, workdir)  # the same weights dequantized, fp32
    q4_ref, q4_lc_greedy = llama_cpp(dumper, q4_path, prompts, workdir)
    q4_scale = max(float(np.abs(x).max()) for x in q4_ref)
    rel = max_diff(q4_ours, q4_ref) / q4_scale
    print(f"{family:6s} Q4_K_M vs fp32 on the dequantized weights (activation quantization): kvflow "
          f"{max_diff(q4_ours, q4_exact) / q4_scale:.1e}, llama.cpp {max_diff(q4_ref, q4_exact) / q4_scale:.1e}")
    # Both engines quantize the activations (Q8_K blocks) before each K-quant product, each its own
    # way: a continuation may part where llama.cpp's top two logits are within that noise. Where
    # they part, llama.cpp's logit for its own token must beat its logit for kvflow's by at most
    # the logit tolerance (decode steps quantize one row at a time, so their differences can exceed
    # the prompts'); from there on the continuations are not compared.
    tie_tol = Q4_REL_TOL * q4_scale
    verdicts = []
    for p, ours, ref in zip(prompts, q4_greedy, q4_lc_greedy):
        first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if first is None:
            verdicts.append((True, "identical"))
            continue
        last, _ = llama_cpp(dumper, q4_path, [p + ref[:first]], workdir)
        gap = float(last[0][-1][ref[first]] - last[0][-1][ours[first]])
        verdicts.append((gap <= tie_tol, f"parts at {first} where llama.cpp's logits are {gap:.3f} apart "
                                         f"({'a near tie' if gap <= tie_tol else 'NOT a near tie'})"))
    q4_ok = rel <= Q4_REL_TOL and all(v[0] for v in verdicts)
    ok &= q4_ok
    identical = sum(v[1] == "identical" for v in verdicts)
    print(f"{family:6s} Q4_K_M kvflow vs llama.cpp max|dlogit|/max|logit| {rel:.1e} (tolerance {Q4_REL_TOL:g}), "
          f"greedy {GREEDY}: {identical}/{len(prompts)} identical  {'ok' if q4_ok else 'FAIL'}")
    for v in verdicts:
        if v[1] != "identical":
            print(f"  {v[1]}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump-bin", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    found = find_llama_cpp()
    if found is None:
        print("SKIP: no llama.cpp build in .cache/llama-cpp (bench/llama_cpp_compare.py builds it)")
        return SKIP
    try:
        import gguf  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError as e:
        print(f"SKIP: Python package missing: {e}")
        return SKIP
    os.makedirs(args.workdir, exist_ok=True)
    tools = build_tools(*found, args.workdir)
    ok = True
    for i, family in enumerate(args.families.split(",")):
        ok &= check_family(family, 1000 + i, tools, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
