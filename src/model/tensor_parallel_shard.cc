#include "model/tensor_parallel_shard.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace kvflow {

Status CheckTensorParallelSplit(const ModelConfig& config, int size) {
  const std::string n = std::to_string(size);
  if (size < 1) return Status::InvalidArgument("tensor parallel size must be at least 1, got " + n);
  if (size == 1) return Status::Ok();
  if (config.num_experts > 0) {
    return Status::Unsupported("tensor parallelism over a mixture of experts (" + config.architecture +
                               ") is not implemented yet");
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
  if (config.intermediate_size % size != 0) {
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
  return s;
}

ModelConfig ShardConfig(const ModelConfig& config, const TensorShard& shard) {
  ModelConfig c = config;
  c.num_heads = shard.num_heads;
  c.num_kv_heads = shard.num_kv_heads;
  c.intermediate_size = shard.ffn_width;
  return c;
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
  l.w_gate_up = SliceRows(in.w_gate_up, gate_up);
  l.b_gate_up = Gather(in.b_gate_up, gate_up);
  const std::string where = "layer " + std::to_string(layer) + ": ";
  auto wo = SliceColumns(in.wo, shard.first_head * d, shard.num_heads * d);
  if (!wo.ok()) return Status::InvalidArgument(where + "o_proj: " + wo.status().message());
  l.wo = std::move(wo).value();
  auto down = SliceColumns(in.w_down, shard.first_ffn, shard.ffn_width);
  if (!down.ok()) return Status::InvalidArgument(where + "down_proj: " + down.status().message());
  l.w_down = std::move(down).value();
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
