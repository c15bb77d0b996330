#include "backend/cpu/kv_block_select.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>

#include "backend/cpu/attention_kernels.h"
#include "backend/cpu/kv_q4.h"
#include "util/thread_pool.h"

namespace kvflow::cpu {

namespace {

// The mean of `count` keys of one (block, kv head), each head_dim long, in fp32. An fp16 run is
// widened first with the attention kernels' conversion, a q4 run dequantized as attention's gather
// does (`widened`: scratch of count * head_dim).
void MeanKey(const void* key_cache, KvElement element, size_t offset, int count, int head_dim, float* mean,
             std::vector<float>& widened) {
  const float* keys = static_cast<const float*>(key_cache) + offset;
  const size_t n = static_cast<size_t>(count) * head_dim;
  if (element == KvElement::kF16) {
    widened.resize(n);
    SelectAttentionKernels(head_dim).half_to_float(static_cast<const uint16_t*>(key_cache) + offset, widened.data(),
                                                   static_cast<int64_t>(n));
    keys = widened.data();
  } else if (element == KvElement::kQ4) {
    widened.resize(n);
    DequantizeQ4(static_cast<const Q4Group*>(key_cache) + offset / kQ4GroupSize, static_cast<int64_t>(n),
                 widened.data());
    keys = widened.data();
  }
  std::fill(mean, mean + head_dim, 0.0f);
  for (int t = 0; t < count; ++t) {
    for (int d = 0; d < head_dim; ++d) mean[d] += keys[static_cast<size_t>(t) * head_dim + d];
  }
  const float inv = 1.0f / static_cast<float>(count);
  for (int d = 0; d < head_dim; ++d) mean[d] *= inv;
}

}  // namespace

void ScoreKvBlocks(std::span<const KvBlockScoreJob> jobs, const KvCacheLayout& layout, int num_heads,
                   const float* query, int64_t query_row_stride, KvElement element, const void* key_cache,
                   std::span<float> scores) {
  const int D = layout.head_dim;
  const int bs = layout.block_size;
  const int group = num_heads / layout.num_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (const KvBlockScoreJob& job : jobs) {
    const int64_t n = static_cast<int64_t>(job.blocks.size());
    if (n == 0) continue;
    const int last_count = job.num_tokens - static_cast<int>((n - 1) * bs);
    // logits[h][b]: every query head's scaled score of every block.
    std::vector<float> logits(static_cast<size_t>(num_heads * n));
    ParallelFor(n, [&](int64_t begin, int64_t end) {
      std::vector<float> mean(static_cast<size_t>(D)), widened;
      for (int64_t b = begin; b < end; ++b) {
        const int count = b + 1 == n ? last_count : bs;
        for (int kvh = 0; kvh < layout.num_kv_heads; ++kvh) {
          MeanKey(key_cache, element, layout.offset(job.blocks[static_cast<size_t>(b)], kvh, 0), count, D, mean.data(), widened);
          for (int g = 0; g < group; ++g) {
            const int h = kvh * group + g;
            const float* q = query + job.row * query_row_stride + static_cast<int64_t>(h) * D;
            float dot = 0.0f;
            for (int d = 0; d < D; ++d) dot += q[d] * mean[static_cast<size_t>(d)];
            logits[static_cast<size_t>(h * n + b)] = dot * scale;
          }
        }
      }
    });
    float* out = scores.data() + job.score_offset;
    for (int h = 0; h < num_heads; ++h) {
      const float* row = &logits[static_cast<size_t>(h * n)];
      const float max = *std::max_element(row, row + n);
      double sum = 0.0;
      for (int64_t b = 0; b < n; ++b) sum += std::exp(static_cast<double>(row[b] - max));
      const double inv = 1.0 / sum;
      for (int64_t b = 0; b < n; ++b) out[b] += static_cast<float>(std::exp(static_cast<double>(row[b] - max)) * inv);
    }
  }
}

void SelectTopKvBlocks(std::span<const KvBlockSelectJob> jobs, std::span<const float> scores,
                       std::vector<int32_t>& chosen) {
  for (const KvBlockSelectJob& job : jobs) {
    const int32_t n = job.num_blocks;
    const int32_t k = std::min(job.k, n);
    const int32_t first = std::min(job.keep_first, k);
    const int32_t last = std::min(job.keep_last, k - first);
    const size_t out_begin = chosen.size();
    for (int32_t i = 0; i < first; ++i) chosen.push_back(i);
    // The middle range competes for what the forced blocks leave.
    std::vector<int32_t> middle;
    for (int32_t i = first; i < n - last; ++i) middle.push_back(i);
    const size_t want = static_cast<size_t>(k - first - last);
    const float* s = scores.data() + job.score_offset;
    auto better = [s](int32_t a, int32_t b) { return s[a] != s[b] ? s[a] > s[b] : a < b; };
    if (want < middle.size()) {
      std::nth_element(middle.begin(), middle.begin() + static_cast<std::ptrdiff_t>(want), middle.end(), better);
      middle.resize(want);
    }
    chosen.insert(chosen.end(), middle.begin(), middle.end());
    for (int32_t i = n - last; i < n; ++i) chosen.push_back(i);
    std::sort(chosen.begin() + static_cast<std::ptrdiff_t>(out_begin), chosen.end());
  }
}

Status ValidateKvBlockScoreJobs(std::span<const KvBlockScoreJob> jobs, const KvCacheLayout& layout,
                                int64_t num_rows, int64_t score_size) {
  for (const KvBlockScoreJob& job : jobs) {
    const int64_t n = static_cast<int64_t>(job.blocks.size());
    if (job.row < 0 || job.row >= num_rows) {
      return Status::InvalidArgument("chunk scoring: row " + std::to_string(job.row) + " outside the step's " +
                                     std::to_string(num_rows));
    }
    if (n > 0 && (job.num_tokens <= (n - 1) * layout.block_size || job.num_tokens > n * layout.block_size)) {
      return Status::InvalidArgument("chunk scoring: " + std::to_string(job.num_tokens) + " tokens do not fill " +
                                     std::to_string(n) + " blocks");
    }
    if (job.score_offset < 0 || job.score_offset + n > score_size) {
      return Status::InvalidArgument("chunk scoring: scores outside the buffer");
    }
    for (BlockId b : job.blocks) {
      if (b < 0 || b >= layout.num_blocks) return Status::InvalidArgument("chunk scoring: block out of range");
    }
  }
  return Status::Ok();
}

Status ValidateKvBlockSelectJobs(std::span<const KvBlockSelectJob> jobs, int64_t score_size) {
  for (const KvBlockSelectJob& job : jobs) {
    if (job.num_blocks < 0 || job.k < 0 || job.keep_first < 0 || job.keep_last < 0) {
      return Status::InvalidArgument("chunk selection: negative sizes");
    }
    if (job.score_offset < 0 || job.score_offset + job.num_blocks > score_size) {
      return Status::InvalidArgument("chunk selection: scores outside the buffer");
    }
  }
  return Status::Ok();
}

}  // namespace kvflow::cpu
