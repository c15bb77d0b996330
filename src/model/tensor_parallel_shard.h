// Megatron-style tensor parallelism's split of one model into `size` shards: rank r keeps its share
// of the attention heads and of the MLP's width. Column-parallel q/k/v and gate/up (their output
// rows), row-parallel o and down (their input columns), whose partial products the ranks sum after
// each (forward/llama_model.h's DeltaReducer). KV heads split with the query heads that read them;
// with fewer KV heads than ranks each is replicated on the ranks its query groups landed on, as vLLM
// does. The embedding and LM head stay whole on every rank (replicated, not vocab-parallel yet).
#pragma once

#include <string>

#include "kvflow/config.h"
#include "kvflow/status.h"
#include "model/llama_weights.h"

namespace kvflow {

// What one rank holds of the heads and the MLP.
struct TensorShard {
  int rank = 0;
  int size = 1;
  int first_head = 0, num_heads = 0;        // query heads
  int first_kv_head = 0, num_kv_heads = 0;  // KV heads (replicated when the model has fewer than ranks)
  int first_ffn = 0, ffn_width = 0;         // columns of the MLP's intermediate width
};

// Checks that `config` splits `size` ways (query heads, KV heads or their replication, the MLP's
// width) and that tensor parallelism supports its features: InvalidArgument / Unsupported naming
// what does not (mixtures of experts, a norm over all of q).
Status CheckTensorParallelSplit(const ModelConfig& config, int size);
// Rank `rank`'s share; needs CheckTensorParallelSplit.
TensorShard ShardOf(const ModelConfig& config, int rank, int size);
// The config rank `shard` computes with: its head counts and MLP width (head_dim kept).
ModelConfig ShardConfig(const ModelConfig& config, const TensorShard& shard);
// One layer's share of the whole model's layer `layer_weights` (`layer`: its index, for errors):
// rows of wqkv / w_gate_up (and their biases), columns of wo / w_down; the o and down biases on
// rank 0 only (zeros elsewhere: added once to the sum). Quantized matrices split along whole
// blocks (InvalidArgument naming the format otherwise). A loader applies it to each layer as it
// reads it (WeightSelection::per_layer), so only the share stays in memory.
Result<LlamaLayerWeights> ShardLayer(const LlamaLayerWeights& layer_weights, const ModelConfig& config,
                                     const TensorShard& shard, int layer);

}  // namespace kvflow
