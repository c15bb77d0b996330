#!/usr/bin/env python3
"""InfiniGen (issue 16): a MODELED -- not measured -- latency of offloaded-KV decoding.

  .venv/bin/python bench/infinigen_offload_model.py --fractions FILE [--sweep-fractions]
  .venv/bin/python bench/infinigen_offload_model.py --fraction 0.1 [--partial-ratio 0.3] [--h2o-budget 0.2]

Nothing here runs a model or touches a GPU. Every latency below is arithmetic over the constants at
the top of this file. What comes from OUR measurements is only what --fractions (or --fraction)
supplies: InfiniGen's mean selection fraction per layer, its partial-key ratio and the H2O budget.
Everything else -- GPU and PCIe speeds, efficiencies, the UVM model, the INT4 dequantization cost, the
pipelining -- is an assumption, listed with its source in ASSUMPTIONS and written into the .json/.md.

Setting (InfiniGen paper, Lee et al., OSDI 2024, sec. 5.1 and 5.3): one NVIDIA RTX A6000 (48 GB),
Xeon Gold 6136 with 96 GB DDR4-2666, PCIe 3.0 x16; OPT-13B (and Llama-2-7B, for which the paper
gives accuracy only, no latency), 1920 input + 128 output tokens, batch 20. The paper's FlexGen
baseline puts ALL of the KV cache in CPU memory and keeps "as many model parameters in GPU memory as
possible, the rest in CPU memory"; OPT-13B (12.85e9 params, 25.7 GB fp16) and Llama-2-7B (13.5 GB)
fit whole in 48 GB, so the weights are modeled as GPU-resident (the paper offloads 30% of the
weights only for OPT-30B). A model whose weights do not fit gets the overflow fraction of every
layer's weights moved over PCIe each step (the same rule). PCIe 4.0 is our extrapolation: the paper
has no PCIe 4.0 numbers.

Schemes (per decode step, batch B, context n tokens, L layers):
  flexgen     full offload: every step moves every layer's whole fp16 KV host->GPU.
  infinigen   moves the selected fraction f of each layer's KV (layer 0: all of it; the paper does not
              speculate layer 0); the partial key cache (ratio r of head_dim of every key, fp16)
              lives on the GPU; speculation for layer i runs at the start of layer i-1 (a GEMV with
              the partial query weights, a partial-key GEMV, threshold/top-k), then layer i's fetch
              overlaps the rest of layer i-1. The selected rows are gathered in host memory first
              (HOST_GATHER_BW, serial with the copy).
  h2o         the paper's setup ("H2O (20% KV budget) implemented on FlexGen", sec. 5.3; Fig. 18
              shows its time is 91.8% data transfer): the kept h*n tokens live in CPU memory and are
              moved every step -- fewer bytes, fixed fraction.
  h2o_gpu     H2O with its kept tokens resident in GPU memory: no transfer at all. This is what the
              paper's "UVM + H2O" decode becomes once the data has migrated (sec. 5.3); it fits
              whenever weights + h*KV fit. Faster than InfiniGen whenever it fits: H2O's cost is
              accuracy (evicted tokens are gone), which this model does not see.
  int4        FlexGen + 4-bit group-wise asymmetric quantization: full offload of 0.5 B/elem plus an
              fp16 scale and min per group of 64, plus GPU dequantization (INT4_DEQUANT_PASSES).
  uvm         CUDA unified memory, page-fault driven: when weights + KV exceed GPU memory every
              step re-migrates the whole cyclic working set (LRU on a cyclic scan larger than the
              cache misses everywhere) at UVM_BW_FRACTION of the PCIe rate, not overlapped with
              compute. Crude; the paper gives no bandwidth, so the .md also states the bandwidth
              that would reproduce the paper's 2007.4 s.
  uvm_h2o     UVM + H2O: prefill pays the first-touch weight migration, decode as h2o_gpu.

Per-layer time in a pipeline: T = x[0] + sum_{i>=1} (spec[i] + max(c[i-1], x[i])) + c[L-1] + head,
x = host->GPU transfer, c = GPU compute, spec = InfiniGen's speculation for layer i (0 elsewhere).
GPU compute of a kernel = max(bytes / (BW * MEM_EFF), flops / (PEAK * FLOP_EFF)) + launch overhead:
at batch 20 decode is memory bound (weights + attended KV); prefill is compute bound.
End to end = prefill (the first output token) + (gen - 1) decode steps, context growing by one.

--fractions FILE schema (JSON object; written by our measured accuracy runs):
  {"selection_fraction": float in (0, 1]  -- REQUIRED: mean fraction of KV tokens InfiniGen fetched
                                             per layer, layer 0 excluded,
   "partial_ratio": float in (0, 1]       -- optional, default 0.3 (paper): fraction of head_dim kept
                                             in the partial key cache,
   "h2o_budget_fraction": float in (0, 1] -- optional, default 0.2 (paper sec. 5.3),
   "source": str                          -- optional: where the numbers come from,
   "overlap": "layer" | "mlp"             -- optional, default "layer": what InfiniGen's fetch of layer i
                                             hides behind: all of layer i-1 (the paper's speculation at
                                             layer i-1's input) or only its MLP (kvflow's default
                                             speculation point, after layer i-1's attention)}
Other keys are kept verbatim under inputs.fractions_file_raw.

Outputs: PREFIX.json (inputs, assumptions, results; every modeled number sits in an object with
"modeled": true; the paper's numbers are under "paper" with "modeled": false), PREFIX.md (tables),
PREFIX.png (speed-up vs sequence length and vs selection fraction; needs matplotlib, skipped with a
message without it). The table is printed to stdout too. Exit status 2 with a one-line message on
bad input.
"""

import argparse
import json
import math
import os
import sys

GB = 1e9

# ----------------------------------------------------------------------------------------------
# Constants. Every one is an assumption unless marked "paper"; none is measured by us.

# GPU: NVIDIA RTX A6000 (paper sec. 5.1). Datasheet: 48 GB GDDR6, 768 GB/s, 154.8 TFLOP/s dense
# fp16 tensor (309.7 with sparsity).
GPU_NAME = "NVIDIA RTX A6000 (paper sec. 5.1)"
GPU_MEM_BYTES = 48 * GB
GPU_MEM_USABLE_FRACTION = 0.95  # assumption: CUDA context, allocator slack, activations
GPU_BW = 768 * GB  # datasheet
GPU_MEM_EFF = 0.80  # assumption: achievable fraction of peak bandwidth for streaming GEMV/attention
GPU_FP16_FLOPS = 154.8e12  # datasheet, dense fp16 tensor
GPU_FLOP_EFF = 0.60  # assumption: achievable fraction of tensor peak for large GEMMs
KERNEL_OVERHEAD_S = 10e-6  # assumption: launch + sync per kernel
KERNELS_PER_LAYER = 10  # assumption: QKV, attention (2), out proj, 2-3 FFN, 2 norms, residuals

# Host: Xeon Gold 6136, 96 GB DDR4-2666 (paper sec. 5.1): 6 channels x 21.3 GB/s = 128 GB/s peak.
HOST_MEM_BYTES = 96 * GB
HOST_GATHER_BW = 50 * GB  # assumption: multi-threaded gather of scattered 256-B KV rows into a
#                           pinned staging buffer, ~40% of the 128 GB/s peak (read + write)

# PCIe, pinned-memory cudaMemcpy effective rates (assumption: typical measured), theoretical in
# brackets (x16, 128b/130b). 12 GB/s for 3.0 also reproduces the paper's Fig. 18: FlexGen's
# per-block time for OPT-13B, seq 2048, batch 8 is 28.0 ms, and that block's KV is
# 2 x 5120 x 2 B x 2048 x 8 = 335.5 MB -> 335.5 MB / 12 GB/s = 28.0 ms.
PCIE = {
    "pcie3": {"name": "PCIe 3.0 x16", "effective_bw": 12 * GB, "theoretical_bw": 15.75 * GB,
              "in_paper": True},
    "pcie4": {"name": "PCIe 4.0 x16", "effective_bw": 25 * GB, "theoretical_bw": 31.5 * GB,
              "in_paper": False},
}

# UVM: the paper reports UVM's latency (Fig. 14: 2007.4 s) but no migration bandwidth. NVIDIA's
# "Improving GPU Memory Oversubscription Performance" (developer blog, 2021) shows fault-driven
# migration under oversubscription far below the link's copy rate and varying up to 100x with the
# access pattern. Assumption: 30% of the effective PCIe rate, no overlap with compute.
UVM_BW_FRACTION = 0.30

# INT4 (paper: "group-wise asymmetric quantization" from FlexGen): 4 bits + fp16 scale + fp16 min
# per group of 64 -> 0.5 + 4/64 = 0.5625 B/elem.
INT4_GROUP = 64
INT4_BYTES_PER_ELEM = 0.5 + 2 * 2 / INT4_GROUP
# assumption: FlexGen's dequantization is unfused torch code; modeled as one pass reading int4 and
# writing fp16 plus INT4_DEQUANT_PASSES - 1 elementwise fp16 read+write passes (the paper, Fig. 18:
# for INT4 "attention computation also takes a large portion ... due to (de)quantization").
INT4_DEQUANT_PASSES = 4

# InfiniGen's speculation: scores of B x H x n are written once (fp16) and read SELECT_PASSES times
# (max, threshold count, top-k). Assumption.
SELECT_PASSES = 3

FP16 = 2

MODELS = {
    # OPT-13B: decoder with ReLU FFN (2 matrices), MHA, learned positions, tied embeddings.
    "opt-13b": {"name": "OPT-13B", "layers": 40, "hidden": 5120, "heads": 40, "kv_heads": 40,
                "head_dim": 128, "ffn": 20480, "ffn_mats": 2, "vocab": 50272, "extra_params": 2050 * 5120,
                "rope": False, "in_paper_latency": True},
    # Llama-2-7B: SwiGLU FFN (3 matrices), MHA, RoPE (InfiniGen's skew then runs after RoPE at run
    # time: one head_dim x head_dim matmul per head for the query and the key), untied head.
    "llama-2-7b": {"name": "Llama-2-7B", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 32,
                   "head_dim": 128, "ffn": 11008, "ffn_mats": 3, "vocab": 32000, "extra_params": 32000 * 4096,
                   "rope": True, "in_paper_latency": False},
}

SCHEMES = ["infinigen", "flexgen", "h2o", "h2o_gpu", "int4", "uvm", "uvm_h2o"]
SCHEME_LABEL = {
    "infinigen": "InfiniGen",
    "flexgen": "FlexGen (full offload)",
    "h2o": "FlexGen + H2O (kept KV on host, paper's setup)",
    "h2o_gpu": "H2O, kept KV on GPU (no transfer)",
    "int4": "FlexGen + INT4",
    "uvm": "UVM",
    "uvm_h2o": "UVM + H2O",
}

# Paper defaults (sec. 5.1, 5.3).
PAPER_PARTIAL_RATIO = 0.3
PAPER_H2O_BUDGET = 0.2
DEFAULT_BATCH, DEFAULT_PROMPT, DEFAULT_GEN = 20, 1920, 128
SEQ_SWEEP = [512, 1024, 2048, 4096, 8192]
SEQ_SWEEP_BATCH = 8  # the paper's Fig. 16(a) uses batch 8
FRACTION_SWEEP = [0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0]

# The paper's numbers (OPT-13B, RTX A6000, PCIe 3.0). Throughput (tokens/s) = batch x 128 / latency:
# 20 x 128 / 41.99 = 60.97 s = 2007.4 / 32.93, so the two statements agree.
PAPER = {
    "fig14_batch20": {
        "setting": "OPT-13B, 1920 in + 128 out, batch 20, PCIe 3.0 (Fig. 14, Fig. 15, sec. 5.3)",
        "e2e_s": {"infinigen": 20 * 128 / 41.99, "h2o": 20 * 128 / 25.70, "int4": 20 * 128 / 14.02,
                  "uvm": 2007.4},
        "e2e_source": {"infinigen": "20*128 tok / 41.99 tok/s (sec. 5.3)",
                       "h2o": "20*128 tok / 25.70 tok/s (sec. 5.3)",
                       "int4": "20*128 tok / 14.02 tok/s (sec. 5.3)",
                       "uvm": "bar label 2007.4 s (Fig. 14)"},
        "speedup_range": [1.63, 32.93],
        "note": "InfiniGen is 1.63x-32.93x faster than the baselines; the derived e2e values give "
                "1.63x over FlexGen+H2O, 2.99x over INT4 (the 'up to 3.00x over prior KV "
                "management'), 32.93x over UVM. FlexGen and UVM+H2O are bars only (no number in text).",
    },
    "fig16a_batch8": {
        "setting": "OPT-13B, 128 out, total 512..2048, batch 8, PCIe 3.0, speed-up over FlexGen (Fig. 16a)",
        "speedup_over_flexgen_at_2048": {"infinigen": 5.28, "h2o": 3.40, "int4": 1.92},
        "note": "'up to' values; InfiniGen grows with length, INT4 and H2O saturate",
    },
    "fig18_block_batch8": {
        "setting": "one OPT-13B block, seq 2048, batch 8 (Fig. 18)",
        "flexgen_block_ms": 28.0,
        "infinigen_vs_ideal": 1.52, "others_vs_ideal": [3.90, 18.55],
        "transfer_share": {"flexgen": 0.969, "h2o": 0.918},
    },
}

ASSUMPTIONS = [
    ("GPU", f"{GPU_NAME}: {GPU_MEM_BYTES / GB:.0f} GB, {GPU_BW / GB:.0f} GB/s, "
            f"{GPU_FP16_FLOPS / 1e12:.1f} TFLOP/s fp16", "paper sec. 5.1 + NVIDIA datasheet"),
    ("GPU efficiency", f"{GPU_MEM_EFF:.0%} of bandwidth, {GPU_FLOP_EFF:.0%} of tensor peak, "
                       f"{KERNELS_PER_LAYER} kernels x {KERNEL_OVERHEAD_S * 1e6:.0f} us per layer", "assumption"),
    ("GPU usable memory", f"{GPU_MEM_USABLE_FRACTION:.0%} of 48 GB", "assumption"),
    ("Weights", "fp16, all on the GPU (OPT-13B 25.7 GB, Llama-2-7B 13.5 GB fit); overflow would move "
                "every step", "paper sec. 5.1 (params on GPU as far as they fit; OPT-30B 30% offloaded)"),
    ("KV cache", "fp16, all in host memory (InfiniGen, FlexGen, H2O, INT4)", "paper sec. 5.1"),
    ("PCIe 3.0 x16", "12 GB/s effective (15.75 theoretical)", "typical pinned cudaMemcpy; matches "
                     "paper Fig. 18 (335.5 MB in 28.0 ms)"),
    ("PCIe 4.0 x16", "25 GB/s effective (31.5 theoretical)", "typical pinned cudaMemcpy; not in paper"),
    ("Host gather (InfiniGen)", f"{HOST_GATHER_BW / GB:.0f} GB/s, serial with the copy", "assumption"),
    ("Pipelining", "layer i's fetch overlaps layer i-1's compute (after InfiniGen's speculation)",
     "paper sec. 4.3 (prefetch overlapped); same for all explicit-offload schemes"),
    ("Layer 0", "InfiniGen fetches all of layer 0's KV", "paper sec. 4.3"),
    ("H2O", "budget x current context tokens per layer (20% -> 409 of 2048); 'h2o' keeps them on the "
            "host and moves them every step (paper's FlexGen+H2O), 'h2o_gpu' keeps them on the GPU",
     "paper sec. 5.3"),
    ("INT4", f"{INT4_BYTES_PER_ELEM} B/elem (4 bit + fp16 scale/min per {INT4_GROUP}); dequant = "
             f"{INT4_DEQUANT_PASSES} memory passes", "FlexGen group quantization; pass count assumed"),
    ("UVM", f"cyclic working set > GPU memory -> all of it re-migrates every step at "
            f"{UVM_BW_FRACTION:.0%} of PCIe, no overlap; prefill pays first-touch weight migration",
     "assumption (paper gives no bandwidth)"),
    ("Prefill", "compute bound GEMMs, attention scores materialized (FlexGen's attention), KV "
                "written to host overlapped with the next layer", "assumption"),
    ("Decode steps", "gen - 1 (the prefill yields the first token); context grows by one per step",
     "assumption"),
    ("Selection fraction f", "constant over context length and layers (the paper's important-token "
                             "count grows sub-linearly: 37/60/66/73 tokens at 512/1024/1536/2048, "
                             "so a constant f is pessimistic for InfiniGen at long contexts)",
     "OUR measurement (--fractions) or placeholder"),
]


class InputError(Exception):
    pass


# ----------------------------------------------------------------------------------------------
# Model shapes


def layer_params(m):
    d, h, kv, hd = m["hidden"], m["heads"], m["kv_heads"], m["head_dim"]
    attn = d * h * hd + 2 * d * kv * hd + h * hd * d
    return attn + m["ffn_mats"] * d * m["ffn"]


def total_params(m):
    return m["layers"] * layer_params(m) + m["vocab"] * m["hidden"] + m["extra_params"]


def kv_bytes_per_token_layer(m):
    return 2 * m["kv_heads"] * m["head_dim"] * FP16


def kv_bytes_total(m, batch, n):
    return m["layers"] * kv_bytes_per_token_layer(m) * batch * n


def gpu_time(nbytes, flops, kernels=1):
    return (max(nbytes / (GPU_BW * GPU_MEM_EFF), flops / (GPU_FP16_FLOPS * GPU_FLOP_EFF))
            + kernels * KERNEL_OVERHEAD_S)


def gpu_usable():
    return GPU_MEM_BYTES * GPU_MEM_USABLE_FRACTION


# ----------------------------------------------------------------------------------------------
# GPU residency


def gpu_resident_bytes(m, scheme, batch, n, p):
    """GPU bytes a scheme needs at context n (weights are accounted separately)."""
    layer_kv = kv_bytes_per_token_layer(m) * batch * n
    buffers = 2 * layer_kv  # double-buffered fetch of one layer
    if scheme == "infinigen":
        partial_k = m["layers"] * batch * n * m["kv_heads"] * round(p["partial_ratio"] * m["head_dim"]) * FP16
        partial_w = m["layers"] * m["hidden"] * m["heads"] * round(p["partial_ratio"] * m["head_dim"]) * FP16
        return partial_k + partial_w + buffers
    if scheme in ("h2o_gpu", "uvm_h2o"):
        return p["h2o_budget"] * kv_bytes_total(m, batch, n) + layer_kv
    if scheme == "uvm":
        return kv_bytes_total(m, batch, n)
    if scheme == "int4":
        return buffers * (1 + INT4_BYTES_PER_ELEM / FP16)
    if scheme == "h2o":
        return p["h2o_budget"] * buffers
    return buffers


def weight_offload_fraction(m, scheme, batch, n, p):
    """Fraction of every layer's weights that does not fit and moves each step (paper's rule)."""
    if scheme in ("uvm", "uvm_h2o"):
        return 0.0  # UVM handles overflow by faulting, modeled separately
    w = total_params(m) * FP16
    room = gpu_usable() - gpu_resident_bytes(m, scheme, batch, n, p)
    if w <= room:
        return 0.0
    return min(1.0, (w - max(room, 0.0)) / w)


# ----------------------------------------------------------------------------------------------
# Decode


def decode_step(m, scheme, batch, n, link_bw, p):
    """One decode step (batch tokens) at context n (the new token included). Returns seconds and
    host->GPU bytes."""
    L, d, H, kvh, hd = m["layers"], m["hidden"], m["heads"], m["kv_heads"], m["head_dim"]
    lp = layer_params(m)
    w_bytes, w_flops = lp * FP16, 2 * batch * lp
    layer_kv = kv_bytes_per_token_layer(m) * batch * n  # one layer, all n tokens, fp16
    kv_elems = layer_kv / FP16

    def attn(n_att):
        nb = kv_bytes_per_token_layer(m) * batch * n_att
        return gpu_time(nb, 4 * batch * H * hd * n_att, kernels=2)

    linear = gpu_time(w_bytes + 4 * batch * d * FP16, w_flops, kernels=KERNELS_PER_LAYER - 2)
    # The MLP's share of a layer's weights (and so of its memory-bound linear time): the window a
    # fetch hides behind when it is issued after the layer's attention (overlap "mlp").
    mlp_linear = linear * (m["ffn_mats"] * d * m["ffn"]) / lp
    woff = weight_offload_fraction(m, scheme, batch, n, p)
    x_weights = woff * w_bytes / link_bw

    compute = [0.0] * L
    xfer = [0.0] * L
    spec = [0.0] * L
    h2d = [woff * w_bytes] * L

    if scheme == "flexgen":
        for i in range(L):
            compute[i] = linear + attn(n)
            xfer[i] = layer_kv / link_bw + x_weights
            h2d[i] += layer_kv
    elif scheme == "infinigen":
        f, r = p["selection_fraction"], p["partial_ratio"]
        rk = max(1, round(r * hd))
        n_sel = f * n
        for i in range(L):
            if i == 0:
                compute[i] = linear + attn(n)
                nb = layer_kv
                xfer[i] = nb / link_bw + x_weights  # plain copy, no gather
            else:
                compute[i] = linear + attn(n_sel)
                nb = f * layer_kv
                xfer[i] = nb / HOST_GATHER_BW + nb / link_bw + x_weights
                # speculation for layer i, run at the start of layer i-1
                q_bytes = d * H * rk * FP16 + batch * d * FP16
                q = gpu_time(q_bytes, 2 * batch * d * H * rk)
                k = gpu_time(batch * n * kvh * rk * FP16, 2 * batch * H * rk * n)
                sel = gpu_time(batch * H * n * FP16 * (1 + SELECT_PASSES), batch * H * n * SELECT_PASSES,
                               kernels=SELECT_PASSES)
                spec[i] = q + k + sel
            if m["rope"]:  # run-time skew of the new query and key after RoPE
                compute[i] += gpu_time(2 * batch * d * FP16 + H * hd * hd * FP16, 2 * 2 * batch * H * hd * hd)
            h2d[i] += nb
    elif scheme in ("h2o", "h2o_gpu", "uvm_h2o"):
        b = p["h2o_budget"] * n
        # attention over the kept tokens + accumulated-score update and eviction (B x H x b)
        acc = gpu_time(batch * H * b * 4 * 3, batch * H * b * 2, kernels=2)
        for i in range(L):
            compute[i] = linear + attn(b) + acc
            if scheme == "h2o":
                nb = p["h2o_budget"] * layer_kv
                xfer[i] = nb / link_bw + x_weights
                h2d[i] += nb
    elif scheme == "int4":
        q_bytes = kv_elems * INT4_BYTES_PER_ELEM
        deq = gpu_time(kv_elems * (INT4_BYTES_PER_ELEM + FP16) + (INT4_DEQUANT_PASSES - 1) * kv_elems * 2 * FP16,
                       kv_elems * 4, kernels=INT4_DEQUANT_PASSES)
        for i in range(L):
            compute[i] = linear + attn(n) + deq
            xfer[i] = q_bytes / link_bw + x_weights
            h2d[i] += q_bytes
    elif scheme in ("uvm", "ideal"):  # ideal: everything on the GPU, nothing moves (paper Fig. 18)
        for i in range(L):
            compute[i] = linear + attn(n)
    else:
        raise ValueError(scheme)

    head = gpu_time(m["vocab"] * d * FP16, 2 * batch * m["vocab"] * d, kernels=2)
    t = xfer[0]
    for i in range(1, L):
        window = mlp_linear if scheme == "infinigen" and p.get("overlap") == "mlp" else compute[i - 1]
        t += spec[i] + (compute[i - 1] - window) + max(window, xfer[i])
    t += compute[L - 1] + head
    uvm_bytes = 0.0
    if scheme == "uvm":
        ws = total_params(m) * FP16 + kv_bytes_total(m, batch, n)
        if ws > gpu_usable():
            uvm_bytes = ws  # LRU on a cyclic scan larger than memory: every page faults
            t += uvm_bytes / (link_bw * UVM_BW_FRACTION)
    return {"time_s": t, "h2d_bytes": sum(h2d) + uvm_bytes, "kv_h2d_bytes": sum(h2d) - L * woff * w_bytes,
            "compute_s": sum(compute) + sum(spec) + head, "transfer_s": sum(xfer),
            "weight_offload_fraction": woff}


# ----------------------------------------------------------------------------------------------
# Prefill


def prefill(m, scheme, batch, s, link_bw, p):
    L, d, H, hd = m["layers"], m["hidden"], m["heads"], m["head_dim"]
    lp = layer_params(m)
    tok = batch * s
    act = tok * d * FP16
    linear = gpu_time(lp * FP16 + 2 * act * (2 + m["ffn_mats"]), 2 * tok * lp, kernels=KERNELS_PER_LAYER - 2)
    scores = batch * H * s * s * FP16  # materialized attention scores (FlexGen's attention)
    attn = gpu_time(3 * scores + 4 * act, 4 * batch * H * hd * s * s / 2, kernels=3)
    c = linear + attn
    layer_kv = kv_bytes_per_token_layer(m) * tok
    d2h = layer_kv
    if scheme == "infinigen":
        rk = round(p["partial_ratio"] * hd)
        # partial weight index (|Q~|+|K~| column sums) and the partial key cache
        c += gpu_time(2 * act + batch * s * H * rk * FP16, 2 * tok * d, kernels=3)
        if m["rope"]:
            c += gpu_time(4 * act, 2 * 2 * tok * H * hd * hd, kernels=2)
    elif scheme in ("h2o", "h2o_gpu", "uvm_h2o"):
        c += gpu_time(scores, batch * H * s * s, kernels=1)  # column sums of the attention probs
        d2h = p["h2o_budget"] * layer_kv
    elif scheme == "int4":
        c += gpu_time(layer_kv + layer_kv * INT4_BYTES_PER_ELEM / FP16 + layer_kv, layer_kv / FP16 * 4, kernels=3)
        d2h = layer_kv * INT4_BYTES_PER_ELEM / FP16
    if scheme in ("h2o_gpu", "uvm", "uvm_h2o"):
        d2h = 0.0  # stays on the GPU
    x = d2h / link_bw
    t = 0.0
    for i in range(L):
        t += max(c, x) if i < L - 1 else c + x  # the last layer's write is not hidden
    t += gpu_time(m["vocab"] * d * FP16, 2 * batch * m["vocab"] * d, kernels=2)
    if scheme in ("uvm", "uvm_h2o"):
        w = total_params(m) * FP16
        kv = kv_bytes_total(m, batch, s) * (p["h2o_budget"] if scheme == "uvm_h2o" else 1.0)
        migrated = w + max(0.0, w + kv - gpu_usable())  # first touch + eviction of the overflow
        t += migrated / (link_bw * UVM_BW_FRACTION)
    return t


def end_to_end(m, scheme, batch, prompt, gen, link_bw, p):
    pre = prefill(m, scheme, batch, prompt, link_bw, p)
    steps = [decode_step(m, scheme, batch, prompt + j + 1, link_bw, p) for j in range(1, gen)]
    dec = sum(st["time_s"] for st in steps)
    nmax = prompt + gen
    mem = gpu_resident_bytes(m, scheme, batch, nmax, p) + (
        0 if scheme in ("uvm",) else total_params(m) * FP16 * (1 - steps[-1]["weight_offload_fraction"]))
    full_ws = total_params(m) * FP16 + kv_bytes_total(m, batch, nmax)
    return {
        "modeled": True,
        "prefill_s": pre,
        "decode_s": dec,
        "e2e_s": pre + dec,
        "decode_ms_per_step_mean": 1e3 * dec / max(1, len(steps)),
        "decode_ms_per_step_last": 1e3 * steps[-1]["time_s"],
        "h2d_gb_per_step_last": steps[-1]["h2d_bytes"] / GB,
        "kv_h2d_gb_per_step_last": steps[-1]["kv_h2d_bytes"] / GB,
        "transfer_ms_per_step_last": 1e3 * steps[-1]["transfer_s"],
        "compute_ms_per_step_last": 1e3 * steps[-1]["compute_s"],
        "weight_offload_fraction": steps[-1]["weight_offload_fraction"],
        "gpu_bytes_needed_gb": mem / GB,
        "fits_gpu": scheme == "uvm" or mem <= gpu_usable(),
        # weights + the whole fp16 KV exceed the GPU: offloading is a necessity, not a choice (UVM
        # then faults every step)
        "offload_needed": full_ws > gpu_usable(),
        "host_kv_gb": kv_bytes_total(m, batch, nmax) / GB,
        "fits_host": kv_bytes_total(m, batch, nmax) <= HOST_MEM_BYTES,
    }


def evaluate(m, batch, prompt, gen, link_bw, p, schemes=SCHEMES):
    res = {s: end_to_end(m, s, batch, prompt, gen, link_bw, p) for s in schemes}
    ig = res["infinigen"]["e2e_s"]
    for s in schemes:
        res[s]["infinigen_speedup_e2e"] = res[s]["e2e_s"] / ig
        res[s]["infinigen_speedup_decode"] = (res[s]["decode_ms_per_step_mean"]
                                              / res["infinigen"]["decode_ms_per_step_mean"])
        res[s]["speedup_over_flexgen_e2e"] = res["flexgen"]["e2e_s"] / res[s]["e2e_s"] if "flexgen" in res else None
    return res


def uvm_bw_to_match(m, batch, prompt, gen, link_bw, p, target_s):
    """The UVM fraction of PCIe at which the model gives the paper's UVM latency (bisection)."""
    global UVM_BW_FRACTION
    saved = UVM_BW_FRACTION
    lo, hi = 1e-3, 1.0
    try:
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            UVM_BW_FRACTION = mid
            t = end_to_end(m, "uvm", batch, prompt, gen, link_bw, p)["e2e_s"]
            if t > target_s:
                lo = mid
            else:
                hi = mid
    finally:
        UVM_BW_FRACTION = saved
    return math.sqrt(lo * hi)


# ----------------------------------------------------------------------------------------------
# Inputs


def check_fraction(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 1:
        raise InputError(f"{name} must be a number in (0, 1], got {v!r}")
    return float(v)


def load_inputs(args):
    if args.fractions and args.fraction is not None:
        raise InputError("give either --fractions FILE or --fraction, not both")
    raw = None
    if args.fractions:
        if not os.path.isfile(args.fractions):
            raise InputError(f"--fractions: no such file: {args.fractions}")
        try:
            with open(args.fractions) as fh:
                raw = json.load(fh)
        except (OSError, ValueError) as e:
            raise InputError(f"--fractions: cannot read JSON from {args.fractions}: {e}")
        if not isinstance(raw, dict):
            raise InputError(f"--fractions: {args.fractions} must hold a JSON object")
        if "selection_fraction" not in raw:
            raise InputError(f"--fractions: {args.fractions} has no \"selection_fraction\"")
        f = raw["selection_fraction"]
        r = raw.get("partial_ratio", PAPER_PARTIAL_RATIO)
        h = raw.get("h2o_budget_fraction", PAPER_H2O_BUDGET)
        src = raw.get("source", args.fractions)
        overlap = raw.get("overlap", "layer")
        if not isinstance(src, str):
            raise InputError("--fractions: \"source\" must be a string")
        origin = "measured (--fractions)"
    elif args.fraction is not None:
        f, r, h = args.fraction, args.partial_ratio, args.h2o_budget
        src, origin = "command line (placeholder, not a measurement)", "command line"
        overlap = args.overlap
    else:
        raise InputError("give --fractions FILE (measured) or --fraction F (placeholder)")
    if args.fractions and (args.partial_ratio is not None or args.h2o_budget is not None):
        raise InputError("--partial-ratio/--h2o-budget go with --fraction; the --fractions file holds them")
    r = PAPER_PARTIAL_RATIO if r is None else r
    h = PAPER_H2O_BUDGET if h is None else h
    p = {"selection_fraction": check_fraction("selection_fraction", f),
         "partial_ratio": check_fraction("partial_ratio", r),
         "h2o_budget": check_fraction("h2o_budget_fraction", h),
         "source": src, "origin": origin, "overlap": overlap}
    if overlap not in ("layer", "mlp"):
        raise InputError(f"overlap must be layer or mlp, got {overlap!r}")
    for name, lo in (("batch", 1), ("prompt", 1), ("gen", 2)):
        if getattr(args, name) < lo:
            raise InputError(f"--{name} must be >= {lo}")
    return p, raw


# ----------------------------------------------------------------------------------------------
# Output


def fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def build_tables(doc):
    lines = []
    inp = doc["inputs"]
    lines.append("# InfiniGen offloaded decoding: MODELED latency (not measured)\n")
    lines.append(f"Generated by `bench/infinigen_offload_model.py`. Selection fraction f = "
                 f"{inp['selection_fraction']}, partial ratio r = {inp['partial_ratio']}, H2O budget = "
                 f"{inp['h2o_budget_fraction']} -- source: {inp['source']}. Everything else is an "
                 f"assumption (table below). Batch {inp['batch']}, {inp['prompt']} input + {inp['gen']} "
                 f"output tokens. Speed-up = scheme's end-to-end latency / InfiniGen's. "
                 f"Columns marked **paper** are the InfiniGen paper's numbers (OPT-13B, PCIe 3.0 only).\n")
    lines.append("| model | link | scheme | decode ms/step (mean) | end-to-end s | InfiniGen speed-up "
                 "| paper e2e s | paper speed-up | fits GPU |")
    lines.append("|---|---|---|---:|---:|---:|---:|---:|:---:|")
    pap = PAPER["fig14_batch20"]
    paper_cell = (inp["batch"], inp["prompt"], inp["gen"]) == (20, 1920, 128)
    for row in doc["results"]:
        for s in SCHEMES:
            r = row["schemes"][s]
            pe = ps = None
            fit = "yes" if r["fits_gpu"] else "NO"
            if s == "uvm":
                fit = "oversubscribed" if r["offload_needed"] else "fits (no faults)"
            if paper_cell and row["model"] == "opt-13b" and row["link"] == "pcie3" and s in pap["e2e_s"]:
                pe = pap["e2e_s"][s]
                ps = pe / pap["e2e_s"]["infinigen"]
            lines.append(f"| {MODELS[row['model']]['name']} | {PCIE[row['link']]['name']} | {SCHEME_LABEL[s]} "
                         f"| {r['decode_ms_per_step_mean']:.1f} | {r['e2e_s']:.1f} "
                         f"| {'—' if s == 'infinigen' else fmt(r['infinigen_speedup_e2e'])} "
                         f"| {fmt(pe, 1)} | {fmt(ps) if s != 'infinigen' and ps else '-'} "
                         f"| {fit} |")
    lines.append("")
    no_need = sorted({MODELS[row["model"]]["name"] for row in doc["results"]
                      if not row["schemes"]["flexgen"]["offload_needed"]})
    if no_need:
        lines.append(f"Note: for {', '.join(no_need)} the weights and the whole fp16 KV fit in the GPU at this "
                     f"batch and length, so offloading is a choice there, not a necessity (UVM then "
                     f"never faults and runs at the all-on-GPU speed).\n")
    lines.append(f"**paper** (Fig. 14/15, sec. 5.3): {pap['note']} Sources: "
                 + "; ".join(f"{k}: {v}" for k, v in pap["e2e_source"].items()) + ".\n")
    if "uvm_bw_fraction_matching_paper" in doc:
        lines.append(f"UVM is the crudest row: at {UVM_BW_FRACTION:.0%} of PCIe it is an assumption; "
                     f"the fraction that reproduces the paper's 2007.4 s in this model is "
                     f"{doc['uvm_bw_fraction_matching_paper']:.3f} "
                     f"({doc['uvm_bw_fraction_matching_paper'] * PCIE['pcie3']['effective_bw'] / GB:.2f} GB/s).\n")
    b8 = doc.get("paper_fig16a_check")
    if b8:
        lines.append(f"Speed-up over FlexGen, OPT-13B, PCIe 3.0, batch {SEQ_SWEEP_BATCH}, 1920 + 128 "
                     f"(paper Fig. 16a):\n")
        lines.append("| scheme | modeled | **paper** |")
        lines.append("|---|---:|---:|")
        for s, v in PAPER["fig16a_batch8"]["speedup_over_flexgen_at_2048"].items():
            lines.append(f"| {SCHEME_LABEL[s]} | {b8[s]:.2f} | {v:.2f} |")
        lines.append("")
    f18 = doc.get("paper_fig18_check")
    if f18:
        pf = PAPER["fig18_block_batch8"]
        lines.append(f"One OPT-13B block (decode step time / layers), seq 2048, batch {SEQ_SWEEP_BATCH}, "
                     f"PCIe 3.0 (paper Fig. 18: FlexGen {pf['flexgen_block_ms']} ms; InfiniGen "
                     f"{pf['infinigen_vs_ideal']}x Ideal; the others {pf['others_vs_ideal'][0]}x-"
                     f"{pf['others_vs_ideal'][1]}x Ideal):\n")
        lines.append("| scheme | modeled ms | modeled x Ideal |")
        lines.append("|---|---:|---:|")
        for s_, v in f18["block_ms"].items():
            lines.append(f"| {SCHEME_LABEL.get(s_, 'Ideal (all on GPU)')} | {v:.2f} | {f18['vs_ideal'][s_]:.2f} |")
        lines.append("")
    if doc.get("seq_sweep"):
        lines.append(f"Speed-up over FlexGen vs total sequence length (OPT-13B, batch {SEQ_SWEEP_BATCH}, "
                     f"128 output tokens, f held constant):\n")
        lines.append("| link | seq | InfiniGen | FlexGen+H2O | H2O on GPU | INT4 |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for e in doc["seq_sweep"]:
            lines.append(f"| {PCIE[e['link']]['name']} | {e['seq']} | {e['infinigen']:.2f} | {e['h2o']:.2f} "
                         f"| {e['h2o_gpu']:.2f}{'' if e['h2o_gpu_fits'] else ' (no fit)'} | {e['int4']:.2f} |")
        lines.append("")
    if doc.get("fraction_sweep"):
        lines.append(f"InfiniGen speed-up (end to end) vs selection fraction f (OPT-13B, batch "
                     f"{inp['batch']}, {inp['prompt']} + {inp['gen']}):\n")
        lines.append("| link | f | over FlexGen | over FlexGen+H2O | over INT4 | over H2O on GPU |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for e in doc["fraction_sweep"]:
            lines.append(f"| {PCIE[e['link']]['name']} | {e['f']} | {e['flexgen']:.2f} | {e['h2o']:.2f} "
                         f"| {e['int4']:.2f} | {e['h2o_gpu']:.2f} |")
        lines.append("")
    lines.append("Assumptions:\n")
    lines.append("| quantity | value | source |")
    lines.append("|---|---|---|")
    for a in doc["assumptions"]:
        lines.append(f"| {a['quantity']} | {a['value']} | {a['source']} |")
    lines.append("")
    return "\n".join(lines)


def plot(doc, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot", file=sys.stderr)
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for link, ls in (("pcie4", "-"), ("pcie3", "--")):
        pts = [e for e in doc["seq_sweep"] if e["link"] == link]
        xs = [e["seq"] for e in pts]
        for s, col in (("infinigen", "C0"), ("h2o", "C1"), ("int4", "C2")):
            a1.plot(xs, [e[s] for e in pts], ls, color=col, marker="o",
                    label=f"{SCHEME_LABEL[s]}, {PCIE[link]['name']}")
    for s, col in (("infinigen", "C0"), ("h2o", "C1"), ("int4", "C2")):
        a1.scatter([2048], [PAPER["fig16a_batch8"]["speedup_over_flexgen_at_2048"][s]], marker="*", s=150,
                   color=col, edgecolor="k", zorder=5)
    a1.scatter([], [], marker="*", s=150, color="w", edgecolor="k", label="paper Fig. 16a (PCIe 3.0)")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("total sequence length (128 output tokens)")
    a1.set_ylabel("speed-up over FlexGen (end to end)")
    a1.set_title(f"MODELED: OPT-13B, batch {SEQ_SWEEP_BATCH}, f={doc['inputs']['selection_fraction']}")
    a1.legend(fontsize=7)
    a1.grid(alpha=0.3)
    for link, ls in (("pcie4", "-"), ("pcie3", "--")):
        pts = [e for e in doc["fraction_sweep"] if e["link"] == link]
        xs = [e["f"] for e in pts]
        for s, col in (("flexgen", "C3"), ("h2o", "C1"), ("int4", "C2"), ("h2o_gpu", "C4")):
            a2.plot(xs, [e[s] for e in pts], ls, color=col, marker=".",
                    label=f"over {SCHEME_LABEL[s]}, {PCIE[link]['name']}")
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set_xscale("log")
    a2.set_xlabel("InfiniGen selection fraction f")
    a2.set_ylabel("InfiniGen speed-up (end to end)")
    a2.set_title(f"MODELED: OPT-13B, batch {doc['inputs']['batch']}, "
                 f"{doc['inputs']['prompt']}+{doc['inputs']['gen']}")
    a2.legend(fontsize=6)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(args):
    p, raw = load_inputs(args)
    B, P, G = args.batch, args.prompt, args.gen
    doc = {
        "modeled": True,
        "note": "A model, not a measurement. Only selection_fraction, partial_ratio and "
                "h2o_budget_fraction come from the input; every other number is an assumption below.",
        "inputs": {"selection_fraction": p["selection_fraction"], "partial_ratio": p["partial_ratio"],
                   "h2o_budget_fraction": p["h2o_budget"], "source": p["source"], "origin": p["origin"], "overlap": p["overlap"],
                   "fractions_file": args.fractions, "fractions_file_raw": raw,
                   "batch": B, "prompt": P, "gen": G},
        "assumptions": [{"quantity": q, "value": v, "source": s} for q, v, s in ASSUMPTIONS],
        "constants": {
            "gpu": {"name": GPU_NAME, "mem_bytes": GPU_MEM_BYTES, "usable_fraction": GPU_MEM_USABLE_FRACTION,
                    "bw": GPU_BW, "mem_eff": GPU_MEM_EFF, "fp16_flops": GPU_FP16_FLOPS, "flop_eff": GPU_FLOP_EFF,
                    "kernel_overhead_s": KERNEL_OVERHEAD_S, "kernels_per_layer": KERNELS_PER_LAYER},
            "host": {"mem_bytes": HOST_MEM_BYTES, "gather_bw": HOST_GATHER_BW},
            "pcie": PCIE, "uvm_bw_fraction": UVM_BW_FRACTION,
            "int4": {"group": INT4_GROUP, "bytes_per_elem": INT4_BYTES_PER_ELEM,
                     "dequant_passes": INT4_DEQUANT_PASSES},
            "select_passes": SELECT_PASSES,
            "models": {k: dict(v, params=total_params(v), kv_bytes_per_token=v["layers"] * kv_bytes_per_token_layer(v))
                       for k, v in MODELS.items()},
        },
        "paper": dict(PAPER, modeled=False),
        "results": [],
    }
    for mk in MODELS:
        for lk, link in PCIE.items():
            res = evaluate(MODELS[mk], B, P, G, link["effective_bw"], p)
            doc["results"].append({"modeled": True, "model": mk, "link": lk, "batch": B, "prompt": P, "gen": G,
                                   "schemes": res})
    om = MODELS["opt-13b"]
    bw3 = PCIE["pcie3"]["effective_bw"]
    if (B, P, G) == (20, 1920, 128):
        doc["uvm_bw_fraction_matching_paper"] = uvm_bw_to_match(om, B, P, G, bw3, p, PAPER["fig14_batch20"]["e2e_s"]["uvm"])
    r8 = evaluate(om, SEQ_SWEEP_BATCH, 1920, 128, bw3, p, schemes=["infinigen", "flexgen", "h2o", "int4"])
    doc["paper_fig16a_check"] = dict({s: r8[s]["speedup_over_flexgen_e2e"] for s in r8}, modeled=True)
    blk = {s: 1e3 * decode_step(om, s, SEQ_SWEEP_BATCH, 2048, bw3, p)["time_s"] / om["layers"]
           for s in ("flexgen", "h2o", "int4", "infinigen", "ideal")}
    doc["paper_fig18_check"] = {"modeled": True, "block_ms": blk,
                                "vs_ideal": {s: blk[s] / blk["ideal"] for s in blk}}
    doc["seq_sweep"] = []
    for lk in ("pcie4", "pcie3"):
        for seq in SEQ_SWEEP:
            r = evaluate(om, SEQ_SWEEP_BATCH, seq - 128, 128, PCIE[lk]["effective_bw"], p,
                         schemes=["infinigen", "flexgen", "h2o", "h2o_gpu", "int4"])
            doc["seq_sweep"].append({"modeled": True, "link": lk, "seq": seq, "batch": SEQ_SWEEP_BATCH,
                                     "h2o_gpu_fits": r["h2o_gpu"]["fits_gpu"],
                                     "infinigen_fits": r["infinigen"]["fits_gpu"],
                                     "fits_host": r["flexgen"]["fits_host"],
                                     **{s: r[s]["speedup_over_flexgen_e2e"] for s in r}})
    doc["fraction_sweep"] = []
    fr = FRACTION_SWEEP if args.sweep_fractions else sorted(set(FRACTION_SWEEP + [p["selection_fraction"]]))
    for lk in ("pcie3", "pcie4"):
        for f in fr:
            q = dict(p, selection_fraction=f)
            r = evaluate(om, B, P, G, PCIE[lk]["effective_bw"], q, schemes=["infinigen", "flexgen", "h2o", "h2o_gpu", "int4"])
            doc["fraction_sweep"].append({"modeled": True, "link": lk, "f": f,
                                          **{s: r[s]["infinigen_speedup_e2e"] for s in r if s != "infinigen"}})
    md = build_tables(doc)
    if not args.sweep_fractions:
        # keep the .md short without --sweep-fractions; the .json has the sweep anyway
        md = md.replace(md[md.find("InfiniGen speed-up (end to end) vs selection"):md.find("Assumptions:")], "")
    outdir = os.path.dirname(args.out_prefix)
    if outdir:
        os.makedirs(outdir, exist_ok=True)
    with open(args.out_prefix + ".json", "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(args.out_prefix + ".md", "w") as fh:
        fh.write(md)
    png = None if args.no_plot else plot(doc, args.out_prefix + ".png")
    print(md)
    print(f"wrote {args.out_prefix}.json, {args.out_prefix}.md" + (f", {png}" if png else ""), file=sys.stderr)
    return doc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the --fractions schema and the model.")
    ap.add_argument("--fractions", metavar="FILE", help="JSON from our measured accuracy runs (schema above)")
    ap.add_argument("--fraction", type=float, help="InfiniGen selection fraction (placeholder without --fractions)")
    ap.add_argument("--partial-ratio", type=float, help=f"with --fraction; default {PAPER_PARTIAL_RATIO} (paper)")
    ap.add_argument("--h2o-budget", type=float, help=f"with --fraction; default {PAPER_H2O_BUDGET} (paper)")
    ap.add_argument("--overlap", choices=("layer", "mlp"), default="layer",
                    help="with --fraction: InfiniGen's fetch hides behind all of layer i-1 (the paper) or its MLP only")
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--prompt", type=int, default=DEFAULT_PROMPT)
    ap.add_argument("--gen", type=int, default=DEFAULT_GEN)
    ap.add_argument("--sweep-fractions", action="store_true", help="print the speed-up vs fraction table too")
    ap.add_argument("--out-prefix", default="bench/results/infinigen_offload_model")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    try:
        run(args)
    except InputError as e:
        print(f"infinigen_offload_model.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
