// Megatron-style tensor parallelism's split of one model into `size` shards: rank r keeps its share
// of the attention heads and of the MLP's width. Column-parallel q/k/v and gate/up (their output
// rows), row-parallel o and down (their input columns), whose partial products the ranks sum after
// each (forward/llama_model.h's DeltaReducer). KV heads split with the query heads that read them;
// with fewer KV heads than ranks each is replicated on the ranks its query groups landed on, as vLLM
// does. The embedding and LM head split by vocabulary rows (vocab-parallel): a rank embeds the
// tokens of its rows (zeros for the others, then the ranks sum) and computes its columns of the
// logits, which one rank assembles (PlaceVocabSlice).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>

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
  // Mixtures of experts: every expert's width split as a dense MLP's (each rank holds a slice of
  // every expert; the router whole), and the shared expert's.
  int first_expert_ffn = 0, expert_ffn_width = 0;
  int first_shared_ffn = 0, shared_ffn_width = 0;
  int first_vocab = 0, vocab_rows = 0;      // rows of the embedding and the LM head
};

// Checks that `config` splits `size` ways (query heads, KV heads or their replication, the MLP's
// or the experts' width) and that tensor parallelism supports its features: InvalidArgument /
// Unsupported naming what does not (a norm over all of q).
Status CheckTensorParallelSplit(const ModelConfig& config, int size);
// Rank `rank`'s share; needs CheckTensorParallelSplit.
TensorShard ShardOf(const ModelConfig& config, int rank, int size);
// The config rank `shard` computes with: its head counts, MLP width and vocabulary rows (head_dim
// and vocab_size kept).
ModelConfig ShardConfig(const ModelConfig& config, const TensorShard& shard);
// Cuts `weights`' embedding and LM head (a tied head is the embedding) to the shard's vocabulary
// rows; the loader's whole matrices are dropped. InvalidArgument when they are not vocab_size rows.
Status ShardVocabulary(LlamaWeights& weights, const ModelConfig& config, const TensorShard& shard);
// Rank `rank` of `size`'s rows of a vocabulary of `vocab_size` tokens, {first, count}: consecutive
// runs whose lengths differ by at most one (none empty while vocab_size >= size).
std::pair<int, int> VocabShardRows(int vocab_size, int rank, int size);
// Copies a rank's logits (rows x count, its rows {first, count} of the vocabulary) into its columns
// of `whole` (rows x vocab).
void PlaceVocabSlice(std::span<const float> slice, int64_t rows, std::pair<int, int> vocab_rows, int64_t vocab,
                     std::span<float> whole);
// One layer's share of the whole model's layer `layer_weights` (`layer`: its index, for errors):
// rows of wqkv / w_gate_up (and their biases), columns of wo / w_down; the o and down biases on
// rank 0 only (zeros elsewhere: added once to the sum). A mixture of experts: each expert's and the
// shared expert's gate/up rows and down columns likewise; the router and the shared expert's gate
// whole (every rank routes every token alike). Quantized matrices split along whole
// blocks (InvalidArgument naming the format otherwise). A loader applies it to each layer as it
// reads it (WeightSelection::per_layer), so only the share stays in memory.
Result<LlamaLayerWeights> ShardLayer(const LlamaLayerWeights& layer_weights, const ModelConfig& config,
                                     const TensorShard& shard, int layer);

}  // namespace kvflow
