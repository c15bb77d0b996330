#include "model/tensor_parallel_shard.h"

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

namespace kvflow {

Status CheckTensorParallelSplit(const ModelConfig& config, int size) {
  const std::string n = std::to_string(size);
  if (size < 1) return Status::InvalidArgument("tensor parallel size must be at least 1, got " + n);
  if (size == 1) return Status::Ok();
  if (config.num_experts > 0 && config.expert_intermediate_size % size != 0) {
    return Status::InvalidArgument("tensor parallel size " + n + " does not divide the experts' width " +
                                   std::to_string(config.expert_intermediate_size));
  }
  if (config.shared_expert_intermediate_size % size != 0) {
    return Status::InvalidArgument("tensor parallel size " + n + " does not divide the shared expert's width " +
                                   std::to_string(config.shared_expert_intermediate_size));
  }
  if (config.qk_norm && !config.qk_norm_per_head) {
    return Status::Unsupported("tensor parallelism with one norm over all of q and k (" + config.architecture +
                               "): the norm would need the other ranks' heads");
  }
  if (config.num_heads % size != 0) {
    return Status::InvalidArgument("tensor parallel size " + n + " does not divide the model's " +
                                   std::to_string(config.num_heads) + " attention heads");
  }
  if (config.num_kv_heads % size != 0 && size % config.num_kv_heads != 0) {
    return Status::InvalidArgument("tensor parallel size " + n + " neither divides the model's " +
                                   std::to_string(config.num_kv_heads) +
                                   " KV heads nor is a multiple of them (to replicate each)");
  }
  if (config.vocab_size < size) {
    return Status::InvalidArgument("tensor parallel size " + n + " exceeds the vocabulary of " +
                                   std::to_string(config.vocab_size) + " tokens (each rank holds some of its rows)");
  }
  if (config.num_experts == 0 && config.intermediate_size % size != 0) {
    return Status::InvalidArgument("tensor parallel size " + n + " does not divide the MLP's width " +
                                   std::to_string(config.intermediate_size));
  }
  return Status::Ok();
}

TensorShard ShardOf(const ModelConfig& config, int rank, int size) {
  TensorShard s;
  s.rank = rank;
  s.size = size;
  s.num_heads = config.num_heads / size;
  s.first_head = rank * s.num_heads;
  if (config.num_kv_heads >= size) {
    s.num_kv_heads = config.num_kv_heads / size;
    s.first_kv_head = rank * s.num_kv_heads;
  } else {
    // Every KV head serves size / kv_heads ranks: the ones holding its query group.
    s.num_kv_heads = 1;
    s.first_kv_head = rank / (size / config.num_kv_heads);
  }
  s.ffn_width = config.intermediate_size / size;
  s.first_ffn = rank * s.ffn_width;
  s.expert_ffn_width = config.expert_intermediate_size / size;
  s.first_expert_ffn = rank * s.expert_ffn_width;
  s.shared_ffn_width = config.shared_expert_intermediate_size / size;
  s.first_shared_ffn = rank * s.shared_ffn_width;
  std::tie(s.first_vocab, s.vocab_rows) = VocabShardRows(config.vocab_size, rank, size);
  return s;
}

std::pair<int, int> VocabShardRows(int vocab_size, int rank, int size) {
  auto start = [&](int r) { return static_cast<int>(int64_t{r} * vocab_size / size); };
  return {start(rank), start(rank + 1) - start(rank)};
}

ModelConfig ShardConfig(const ModelConfig& config, const TensorShard& shard) {
  ModelConfig c = config;
  c.num_heads = shard.num_heads;
  c.num_kv_heads = shard.num_kv_heads;
  c.intermediate_size = shard.ffn_width;
  c.expert_intermediate_size = shard.expert_ffn_width;
  c.shared_expert_intermediate_size = shard.shared_ffn_width;
  if (shard.size > 1) {
    c.vocab_shard_first = shard.first_vocab;
    c.vocab_shard_rows = shard.vocab_rows;
  }
  return c;
}

Status ShardVocabulary(LlamaWeights& weights, const ModelConfig& config, const TensorShard& shard) {
  if (shard.size == 1) return Status::Ok();
  const std::pair<int64_t, int64_t> rows[] = {{shard.first_vocab, shard.vocab_rows}};
  for (WeightMatrix* m : {&weights.embed, &weights.lm_head}) {
    if (m->empty()) continue;  // a stage that needs neither, or a head tied to the embedding
    if (m->rows != config.vocab_size) {
      return Status::InvalidArgument("the vocabulary split needs " + std::to_string(config.vocab_size) +
                                     " rows of embedding and head, the weights have " + std::to_string(m->rows));
    }
    *m = SliceRows(*m, rows);
  }
  return Status::Ok();
}

void PlaceVocabSlice(std::span<const float> slice, int64_t rows, std::pair<int, int> vocab_rows, int64_t vocab,
                     std::span<float> whole) {
  const auto [first, width] = vocab_rows;
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(slice.data() + r * width, width, whole.data() + r * vocab + first);
  }
}

namespace {

template <typename T>
std::vector<T> Gather(const std::vector<T>& v, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  std::vector<T> out;
  if (v.empty()) return out;
  for (auto [first, count] : ranges) out.insert(out.end(), v.begin() + first, v.begin() + first + count);
  return out;
}

}  // namespace

Result<LlamaLayerWeights> ShardLayer(const LlamaLayerWeights& in, const ModelConfig& config, const TensorShard& shard,
                                     int layer) {
  if (shard.size == 1) {
    return Status::InvalidArgument("ShardLayer with one rank: use the whole layer");
  }
  const int64_t d = config.head_dim, q_rows = int64_t{config.num_heads} * d, kv_rows = int64_t{config.num_kv_heads} * d;
  const int64_t F = config.intermediate_size;
  const std::vector<std::pair<int64_t, int64_t>> qkv = {
      {shard.first_head * d, shard.num_heads * d},
      {q_rows + shard.first_kv_head * d, shard.num_kv_heads * d},
      {q_rows + kv_rows + shard.first_kv_head * d, shard.num_kv_heads * d}};
  const std::vector<std::pair<int64_t, int64_t>> gate_up = {{shard.first_ffn, shard.ffn_width},
                                                            {F + shard.first_ffn, shard.ffn_width}};
  LlamaLayerWeights l;
  l.attn_norm = in.attn_norm;
  l.ffn_norm = in.ffn_norm;
  l.post_attn_norm = in.post_attn_norm;
  l.post_ffn_norm = in.post_ffn_norm;
  l.q_norm = in.q_norm;
  l.k_norm = in.k_norm;
  l.wqkv = SliceRows(in.wqkv, qkv);
  l.bqkv = Gather(in.bqkv, qkv);
  const std::string where = "layer " + std::to_string(layer) + ": ";
  auto wo = SliceColumns(in.wo, shard.first_head * d, shard.num_heads * d);
  if (!wo.ok()) return Status::InvalidArgument(where + "o_proj: " + wo.status().message());
  l.wo = std::move(wo).value();
  // A SwiGLU MLP of width `width` ([gate; up] rows, down columns) cut to [first, first + count).
  auto split_mlp = [&](const WeightMatrix& gate_up_in, const WeightMatrix& down_in, int64_t width, int64_t first,
                       int64_t count, const std::string& what, WeightMatrix& gate_up_out,
                       WeightMatrix& down_out) -> Status {
    const std::pair<int64_t, int64_t> rows[] = {{first, count}, {width + first, count}};
    gate_up_out = SliceRows(gate_up_in, rows);
    auto down = SliceColumns(down_in, first, count);
    if (!down.ok()) return Status::InvalidArgument(where + what + ": " + down.status().message());
    down_out = std::move(down).value();
    return Status::Ok();
  };
  if (config.num_experts == 0) {
    l.b_gate_up = Gather(in.b_gate_up, gate_up);
    KVFLOW_RETURN_IF_ERROR(
        split_mlp(in.w_gate_up, in.w_down, F, shard.first_ffn, shard.ffn_width, "down_proj", l.w_gate_up, l.w_down));
  } else {
    l.router = in.router;
    l.expert_gate_up.resize(in.expert_gate_up.size());
    l.expert_down.resize(in.expert_down.size());
    for (size_t e = 0; e < in.expert_gate_up.size() && e < in.expert_down.size(); ++e) {
      KVFLOW_RETURN_IF_ERROR(split_mlp(in.expert_gate_up[e], in.expert_down[e], config.expert_intermediate_size,
                                       shard.first_expert_ffn, shard.expert_ffn_width,
                                       "expert " + std::to_string(e) + " down_proj", l.expert_gate_up[e],
                                       l.expert_down[e]));
    }
    if (!in.shared_gate_up.empty()) {
      KVFLOW_RETURN_IF_ERROR(split_mlp(in.shared_gate_up, in.shared_down, config.shared_expert_intermediate_size,
                                       shard.first_shared_ffn, shard.shared_ffn_width, "shared expert down_proj",
                                       l.shared_gate_up, l.shared_down));
      l.shared_gate = in.shared_gate;
    }
  }
  // The row-parallel biases join the sum once.
  l.bo = in.bo;
  l.b_down = in.b_down;
  if (shard.rank != 0) {
    std::fill(l.bo.begin(), l.bo.end(), 0.0f);
    std::fill(l.b_down.begin(), l.b_down.end(), 0.0f);
  }
  return l;
}

}  // namespace kvflow
