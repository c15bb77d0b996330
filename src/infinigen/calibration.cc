#include "infinigen/calibration.h"

#include <cmath>

#include "infinigen/skewing.h"
#include "infinigen/speculation.h"
#include "forward/llama_model.h"

namespace kvflow {
namespace {

// Copies every layer's rotated Q and K rows (kQkv at BeforeAttention) into per-(layer, KV head)
// sample matrices: queries of a group stacked ([tokens * group][head_dim]), keys [tokens][head_dim].
class SampleCollector final : public LayerHooks {
 public:
  SampleCollector(const ModelConfig& c, int64_t tokens)
      : config_(c), queries_(static_cast<size_t>(c.num_layers) * c.num_kv_heads),
        keys_(queries_.size()) {
    const int group = c.num_heads / c.num_kv_heads;
    for (auto& q : queries_) q.reserve(static_cast<size_t>(tokens * group * c.head_dim));
    for (auto& k : keys_) k.reserve(static_cast<size_t>(tokens * c.head_dim));
  }

  Status BeforeAttention(const LayerContext& ctx) override {
    const ModelConfig& c = config_;
    const int64_t rows = static_cast<int64_t>(ctx.batch.tokens.size());
    const int64_t width = ActivationWidth(c, Activation::kQkv);
    row_.resize(static_cast<size_t>(rows * width));
    KVFLOW_RETURN_IF_ERROR(ctx.backend.ReadActivationRows(Activation::kQkv, 0, rows, row_));
    const int D = c.head_dim, group = c.num_heads / c.num_kv_heads;
    for (int g = 0; g < c.num_kv_heads; ++g) {
      std::vector<float>& q = queries_[static_cast<size_t>(ctx.layer) * c.num_kv_heads + g];
      std::vector<float>& k = keys_[static_cast<size_t>(ctx.layer) * c.num_kv_heads + g];
      for (int64_t t = 0; t < rows; ++t) {
        const float* r = row_.data() + t * width;
        q.insert(q.end(), r + static_cast<int64_t>(g) * group * D, r + static_cast<int64_t>(g + 1) * group * D);
        const float* key = r + (static_cast<int64_t>(c.num_heads) + g) * D;
        k.insert(k.end(), key, key + D);
      }
    }
    return Status::Ok();
  }

  std::vector<float>& queries(int layer, int g) { return queries_[static_cast<size_t>(layer) * config_.num_kv_heads + g]; }
  std::vector<float>& keys(int layer, int g) { return keys_[static_cast<size_t>(layer) * config_.num_kv_heads + g]; }

 private:
  const ModelConfig& config_;
  std::vector<std::vector<float>> queries_, keys_;
  std::vector<float> row_;
};

std::vector<float> AbsColumnSums(const std::vector<float>& rows, int dim) {
  std::vector<float> sums(static_cast<size_t>(dim), 0.0f);
  for (size_t i = 0; i < rows.size(); ++i) sums[i % dim] += std::abs(rows[i]);
  return sums;
}

}  // namespace

Result<PartialColumnRule> ParsePartialColumnRule(const std::string& name) {
  if (name == "abs-sum") return PartialColumnRule::kAbsSum;
  if (name == "product") return PartialColumnRule::kProduct;
  return Status::InvalidArgument("the partial column rule must be abs-sum or product, not '" + name + "'");
}

Result<SkewTable> CalibrateSkew(Backend& backend, std::span<const int32_t> tokens, const SkewCalibrationOptions& o) {
  const ModelConfig& c = backend.model_config();
  const KvCacheLayout& layout = backend.kv_layout();
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n < 16) return Status::InvalidArgument("skew calibration needs at least 16 tokens of sample text, got " + std::to_string(n));
  if (!(o.partial_ratio > 0.0 && o.partial_ratio <= 1.0)) return Status::InvalidArgument("partial ratio must be in (0, 1]");
  if (o.chunk_tokens < 1) return Status::InvalidArgument("chunk_tokens must be >= 1");
  if (n > static_cast<int64_t>(layout.num_blocks) * layout.block_size || n > c.max_position_embeddings) {
    return Status::InvalidArgument("skew calibration: " + std::to_string(n) + " tokens exceed the KV pool or the model's context");
  }
  SampleCollector collector(c, n);
  LlamaModel model(backend, &collector);
  std::vector<BlockId> table(static_cast<size_t>((n + layout.block_size - 1) / layout.block_size));
  for (size_t b = 0; b < table.size(); ++b) table[b] = static_cast<BlockId>(b);
  std::vector<float> logits;
  for (int64_t done = 0; done < n;) {
    const int64_t chunk = std::min<int64_t>(o.chunk_tokens, n - done);
    ForwardBatch batch;
    batch.tokens.assign(tokens.begin() + done, tokens.begin() + done + chunk);
    for (int64_t t = 0; t < chunk; ++t) batch.positions.push_back(static_cast<int32_t>(done + t));
    SequenceSlice slice;
    slice.num_tokens = static_cast<int32_t>(chunk);
    slice.context_len = static_cast<int32_t>(done + chunk);
    slice.block_table = table;
    slice.logits = LogitsMode::kNone;
    batch.seqs.push_back(std::move(slice));
    KVFLOW_RETURN_IF_ERROR(model.Forward(batch, logits));
    done += chunk;
    if (o.on_tokens) o.on_tokens(done, n);
  }

  SkewTable t;
  t.num_layers = c.num_layers;
  t.num_heads = c.num_heads;
  t.num_kv_heads = c.num_kv_heads;
  t.head_dim = c.head_dim;
  t.calibration_tokens = n;
  t.partial_ratio = o.partial_ratio;
  t.model_name = c.name;
  const int D = c.head_dim, group = c.num_heads / c.num_kv_heads;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    for (int g = 0; g < c.num_kv_heads; ++g) {
      std::vector<float>& q = collector.queries(layer, g);
      std::vector<float>& k = collector.keys(layer, g);
      SkewHead head;
      head.matrix = SkewingMatrix(q, n * group, D);
      ApplySkew(q, n * group, D, head.matrix);
      ApplySkew(k, n, D, head.matrix);
      std::vector<float> q_sums = AbsColumnSums(q, D);
      const std::vector<float> k_sums = AbsColumnSums(k, D);
      if (o.rule == PartialColumnRule::kProduct) {
        // PartialColumns ranks q_sums + k_sums: give it the product (per token sample counts cancel).
        for (int d = 0; d < D; ++d) q_sums[static_cast<size_t>(d)] *= k_sums[static_cast<size_t>(d)];
        head.columns = PartialColumns(q_sums, std::vector<float>(static_cast<size_t>(D), 0.0f), o.partial_ratio);
      } else {
        head.columns = PartialColumns(q_sums, k_sums, o.partial_ratio);
      }
      t.heads.push_back(std::move(head));
      std::vector<float>().swap(q);  // the samples are done with: give the memory back
      std::vector<float>().swap(k);
    }
    if (o.on_layers) o.on_layers(layer + 1, c.num_layers);
  }
  t.num_partial_columns = static_cast<int>(t.heads.front().columns.size());
  return t;
}

}  // namespace kvflow
