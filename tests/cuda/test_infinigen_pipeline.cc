// InfiniGen's kernels chained as one decode step of one layer will chain them, ending in the
// unchanged paged decode kernel (kernels/attention_decode.cu): the speculative query's partial
// columns (SkewPartialQueries), the partial key cache grown from the K pool (SkewPartialKeys), the
// speculated scores (ScorePartialKeys), the selection
// (SelectSpeculatedTokens), the gather of each kv head's tokens plus the step's own into scratch
// blocks (GatherSelectedKv), and PagedAttentionDecode over those blocks with one plain block table
// per sequence and the context lengths the gather wrote on the device. This is what shows that the
// gather's layout is one the decode kernel reads correctly with each kv head attending to its own
// selection.
//
// Reference: the CPU's selection on the device's scores (the scores themselves are checked against
// the CPU in test_infinigen_score.cc; near-equal scores may order differently after FMA rounding),
// which must give the same indices, and an fp64 softmax attention of each query head over its kv
// head's selected tokens and the step's own token, on the same 16-bit values. Tolerances are those
// of test_attention_decode.cc: fp16 2e-3, bf16 1.5e-2 absolute.
//
// This test links the whole emulated library (it uses two kernel families).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "attention_decode.h"
#include "gpu_test_util.h"
#include "infinigen/partial_keys.h"
#include "infinigen/speculation.h"
#include "infinigen_score.h"
#include "kv/kv_cache_layout.h"

namespace kvflow {
namespace {

using cuda::DType;

struct PipelineCase {
  DType dtype;
  int num_kv_heads, group, head_dim, num_cols, block_size;
  float alpha;
  double max_fraction;
};

void FillAwayFromZero(std::vector<float>& v, std::mt19937& rng, float stddev = 1.0f) {
  test::FillNormal(v, rng, stddev);
  for (float& x : v) x = x >= 0.0f ? x + 0.05f : x - 0.05f;
}

void RunPipeline(const PipelineCase& c, std::mt19937& rng) {
  const DType t = c.dtype;
  const int KV = c.num_kv_heads, G = c.group, H = KV * G, D = c.head_dim, P = c.num_cols, bs = c.block_size;
  const std::vector<int> lengths =
      test::IsEmulator() ? std::vector<int>{37, 150, 203, 5, 1} : std::vector<int>{37, 150, 2003, 5, 1, 3001};
  const int S = static_cast<int>(lengths.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  // The layer's K/V pool: every sequence's cached tokens and its step's own token (position n,
  // already written by reshape_and_cache), in shuffled blocks.
  KvCacheLayout pool;
  pool.num_layers = 1;
  pool.num_kv_heads = KV;
  pool.head_dim = D;
  pool.block_size = bs;
  pool.num_blocks = 2;
  for (int n : lengths) pool.num_blocks += (n + 1 + bs - 1) / bs;
  std::vector<int32_t> perm(static_cast<size_t>(pool.num_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const int max_table = (*std::max_element(lengths.begin(), lengths.end()) + 1 + bs - 1) / bs;
  std::vector<int32_t> tables(static_cast<size_t>(S) * max_table, 0);
  size_t next = 0;
  for (int s = 0; s < S; ++s) {
    for (int b = 0; b < (lengths[static_cast<size_t>(s)] + 1 + bs - 1) / bs; ++b) {
      tables[static_cast<size_t>(s) * max_table + b] = perm[next++];
    }
  }
  auto slot = [&](int s, int pos) {
    return static_cast<int64_t>(tables[static_cast<size_t>(s) * max_table + pos / bs]) * bs + pos % bs;
  };
  std::vector<float> keys(pool.layer_stride()), values(pool.layer_stride());
  FillAwayFromZero(keys, rng);
  FillAwayFromZero(values, rng);
  const std::vector<uint8_t> key_bytes = test::ToDeviceBytes(keys, t), value_bytes = test::ToDeviceBytes(values, t);
  auto key_at = [&](int s, int h, int pos) {
    return keys.data() + pool.offset(tables[static_cast<size_t>(s) * max_table + pos / bs], h, pos % bs);
  };
  auto value_at = [&](int s, int h, int pos) {
    return values.data() + pool.offset(tables[static_cast<size_t>(s) * max_table + pos / bs], h, pos % bs);
  };

  // Skews and the step's queries (the decode kernel's input). The speculation scores with the
  // query itself (SkewPartialQueries), so the selection is the one a perfect speculation would make.
  std::vector<SkewHead> skew(static_cast<size_t>(KV));
  std::vector<float> matrices;
  std::vector<int32_t> columns;
  for (SkewHead& head : skew) {
    head.matrix.resize(static_cast<size_t>(D) * D);
    FillAwayFromZero(head.matrix, rng, 1.0f / std::sqrt(static_cast<float>(D)));
    std::vector<int32_t> all(static_cast<size_t>(D));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    head.columns.assign(all.begin(), all.begin() + P);
    std::sort(head.columns.begin(), head.columns.end());
    matrices.insert(matrices.end(), head.matrix.begin(), head.matrix.end());
    columns.insert(columns.end(), head.columns.begin(), head.columns.end());
  }
  std::vector<float> query(static_cast<size_t>(S) * H * D);
  FillAwayFromZero(query, rng, 1.5f);
  const std::vector<uint8_t> query_bytes = test::ToDeviceBytes(query, t);
  test::DeviceBuffer dkey = test::DeviceBuffer::From(key_bytes), dvalue = test::DeviceBuffer::From(value_bytes);
  test::DeviceBuffer dmatrices = test::DeviceBuffer::From(matrices), dcolumns = test::DeviceBuffer::From(columns);
  test::DeviceBuffer dtables = test::DeviceBuffer::From(tables);
  test::DeviceBuffer dquery = test::DeviceBuffer::From(query_bytes);
  // 0. The speculative query: the step's query heads scaled and skewed on the device.
  test::DeviceBuffer dspec(static_cast<size_t>(S) * H * P * sizeof(float));
  cuda::SkewPartialQueriesArgs qa;
  qa.dtype = t;
  qa.rows = dquery.get();
  qa.row_stride = static_cast<int64_t>(H) * D;
  qa.num_rows = S;
  qa.num_heads = H;
  qa.num_kv_heads = KV;
  qa.head_dim = D;
  qa.num_partial_columns = P;
  qa.scale = scale;
  qa.matrices = dmatrices.get<float>();
  qa.columns = dcolumns.get<int32_t>();
  qa.out = dspec.get<float>();
  KVFLOW_CUDA_OK(cuda::SkewPartialQueries(qa, nullptr));

  // Per (sequence, kv head): partial key cache rows and score rows, back to back.
  std::vector<int64_t> row_offset;
  int64_t rows = 0;
  int max_n = 0;
  for (int n : lengths) {
    for (int h = 0; h < KV; ++h) {
      row_offset.push_back(rows);
      rows += n;
    }
    max_n = std::max(max_n, n);
  }
  test::DeviceBuffer dpartial(static_cast<size_t>(rows) * P * sizeof(float));
  test::DeviceBuffer dscores(static_cast<size_t>(rows) * sizeof(float));
  dpartial.Poison();
  dscores.Poison();

  // 1. The partial key cache, from the pool.
  std::vector<cuda::InfiniGenSkewJob> skew_jobs;
  std::vector<int64_t> slots;
  std::vector<cuda::PartialKeyScoreJob> score_jobs;
  for (int s = 0; s < S; ++s) {
    const int n = lengths[static_cast<size_t>(s)];
    for (int h = 0; h < KV; ++h) {
      const int64_t row = row_offset[static_cast<size_t>(s) * KV + h];
      cuda::InfiniGenSkewJob job;
      job.matrix = dmatrices.get<float>() + static_cast<size_t>(h) * D * D;
      job.columns = dcolumns.get<int32_t>() + static_cast<size_t>(h) * P;
      job.dst = dpartial.get<float>() + row * P;
      job.kv_head = h;
      job.first_slot = static_cast<int32_t>(slots.size());
      job.num_slots = n;
      for (int pos = 0; pos < n; ++pos) slots.push_back(slot(s, pos));
      skew_jobs.push_back(job);
      cuda::PartialKeyScoreJob score;
      score.queries = dspec.get<float>() + (static_cast<size_t>(s) * H + static_cast<size_t>(h) * G) * P;
      score.keys = dpartial.get<float>() + row * P;
      score.scores = dscores.get<float>() + row;
      score.num_tokens = n;
      score_jobs.push_back(score);
    }
  }
  test::DeviceBuffer dskew_jobs = test::DeviceBuffer::From(skew_jobs), dslots = test::DeviceBuffer::From(slots);
  cuda::SkewPartialKeysArgs skew_args;
  skew_args.dtype = t;
  skew_args.key_cache = dkey.get();
  skew_args.slots = dslots.get<int64_t>();
  skew_args.jobs = dskew_jobs.get<cuda::InfiniGenSkewJob>();
  skew_args.num_jobs = static_cast<int>(skew_jobs.size());
  skew_args.max_job_slots = max_n;
  skew_args.num_kv_heads = KV;
  skew_args.head_dim = D;
  skew_args.block_size = bs;
  skew_args.num_partial_columns = P;
  KVFLOW_CUDA_OK(cuda::SkewPartialKeys(skew_args, nullptr));

  // 2. Scores.
  test::DeviceBuffer dscore_jobs = test::DeviceBuffer::From(score_jobs);
  KVFLOW_CUDA_OK(cuda::ScorePartialKeys(dscore_jobs.get<cuda::PartialKeyScoreJob>(),
                                        static_cast<int>(score_jobs.size()), max_n, G, P, nullptr));

  // 3. Selection, 4. gather (the step's own token last), 5. decode attention over the scratch.
  std::vector<cuda::SpeculationSelectJob> select_jobs;
  std::vector<int64_t> index_offset;
  std::vector<int> caps;
  int64_t total_indices = 0;
  for (int n : lengths) {
    caps.push_back(cuda::SpeculatedTokenCap(n, c.max_fraction));
    index_offset.push_back(total_indices);
    total_indices += static_cast<int64_t>(KV) * caps.back();
  }
  test::DeviceBuffer dindices(static_cast<size_t>(total_indices) * sizeof(int32_t));
  test::DeviceBuffer dcounts(static_cast<size_t>(S) * sizeof(int32_t)), dhead_counts(static_cast<size_t>(S) * KV * 4);
  test::DeviceBuffer dcontext(static_cast<size_t>(S) * sizeof(int32_t));
  dindices.Poison();
  dcontext.Poison();
  std::vector<cuda::SelectedKvGatherJob> gather_jobs;
  int scratch_blocks = 0, max_blocks = 0, max_context = 0;
  for (int s = 0; s < S; ++s) {
    const int64_t row = row_offset[static_cast<size_t>(s) * KV];
    cuda::SpeculationSelectJob sel;
    sel.scores = dscores.get<float>() + row;
    sel.score_head_stride = lengths[static_cast<size_t>(s)];
    sel.num_tokens = lengths[static_cast<size_t>(s)];
    sel.cap = caps[static_cast<size_t>(s)];
    sel.indices = dindices.get<int32_t>() + index_offset[static_cast<size_t>(s)];
    sel.count = dcounts.get<int32_t>() + s;
    select_jobs.push_back(sel);
    cuda::SelectedKvGatherJob g;
    g.block_table = dtables.get<int32_t>() + static_cast<size_t>(s) * max_table;
    g.positions = sel.indices;
    g.position_head_stride = sel.cap;
    g.count = sel.count;
    g.append_position = lengths[static_cast<size_t>(s)];
    g.first_block = scratch_blocks;
    g.num_blocks = (sel.cap + 1 + bs - 1) / bs;
    g.context_len = dcontext.get<int32_t>() + s;
    scratch_blocks += g.num_blocks;
    max_blocks = std::max(max_blocks, g.num_blocks);
    max_context = std::max(max_context, sel.cap + 1);
    gather_jobs.push_back(g);
  }
  test::DeviceBuffer dselect_jobs = test::DeviceBuffer::From(select_jobs);
  cuda::SelectSpeculatedTokensArgs select_args;
  select_args.jobs = dselect_jobs.get<cuda::SpeculationSelectJob>();
  select_args.num_jobs = S;
  select_args.num_kv_heads = KV;
  select_args.alpha = c.alpha;
  select_args.head_counts = dhead_counts.get<int32_t>();
  KVFLOW_CUDA_OK(cuda::SelectSpeculatedTokens(select_args, nullptr));

  KvCacheLayout scratch = pool;
  scratch.num_blocks = scratch_blocks;
  const size_t es = cuda::DTypeSize(t);
  test::DeviceBuffer dkey_scratch(scratch.layer_stride() * es), dvalue_scratch(scratch.layer_stride() * es);
  dkey_scratch.Poison();  // a slot the decode kernel reads without the gather writing it shows as NaN
  dvalue_scratch.Poison();
  test::DeviceBuffer dgather_jobs = test::DeviceBuffer::From(gather_jobs);
  KVFLOW_CUDA_OK(cuda::GatherSelectedKv(t, dkey.get(), dvalue.get(), dgather_jobs.get<cuda::SelectedKvGatherJob>(),
                                        S, dkey_scratch.get(), dvalue_scratch.get(), KV, D, bs, nullptr));

  // The scratch's block tables: each sequence's consecutive blocks; its context is what the gather wrote.
  std::vector<int32_t> scratch_tables(static_cast<size_t>(S) * max_blocks, 0);
  for (int s = 0; s < S; ++s) {
    for (int b = 0; b < gather_jobs[static_cast<size_t>(s)].num_blocks; ++b) {
      scratch_tables[static_cast<size_t>(s) * max_blocks + b] = gather_jobs[static_cast<size_t>(s)].first_block + b;
    }
  }
  std::vector<int32_t> query_rows(static_cast<size_t>(S));
  std::iota(query_rows.begin(), query_rows.end(), 0);
  test::DeviceBuffer dscratch_tables = test::DeviceBuffer::From(scratch_tables);
  test::DeviceBuffer drows = test::DeviceBuffer::From(query_rows);
  test::DeviceBuffer dout(static_cast<size_t>(S) * H * D * es);
  dout.Poison();
  const size_t ws_bytes = cuda::PagedDecodeWorkspaceBytes(S, H, D, max_context);
  test::DeviceBuffer dws(ws_bytes);
  cuda::PagedDecodeArgs a;
  a.dtype = t;
  a.out = dout.get();
  a.out_row_stride = static_cast<int64_t>(H) * D;
  a.query = dquery.get();
  a.query_row_stride = static_cast<int64_t>(H) * D;
  a.key_cache = dkey_scratch.get();
  a.value_cache = dvalue_scratch.get();
  a.block_tables = dscratch_tables.get<int32_t>();
  a.block_table_stride = max_blocks;
  a.context_lens = dcontext.get<int32_t>();
  a.num_seqs = S;
  a.num_heads = H;
  a.num_kv_heads = KV;
  a.head_dim = D;
  a.block_size = bs;
  a.scale = scale;
  a.query_rows = drows.get<int32_t>();
  a.max_context_len = max_context;
  a.workspace = dws.get();
  a.workspace_bytes = ws_bytes;
  KVFLOW_CUDA_OK(cuda::PagedAttentionDecode(a, nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());

  // Reference: the CPU's selection on the device's scores, then attention per query head.
  const std::vector<float> scores = dscores.Download<float>();
  const std::vector<int32_t> counts = dcounts.Download<int32_t>(), context = dcontext.Download<int32_t>();
  const std::vector<int32_t> indices = dindices.Download<int32_t>();
  std::vector<float> ref(static_cast<size_t>(S) * H * D);
  int selected_total = 0, tokens_total = 0;
  for (int s = 0; s < S; ++s) {
    const int n = lengths[static_cast<size_t>(s)];
    const int64_t row = row_offset[static_cast<size_t>(s) * KV];
    const SpeculatedTokens want = SelectSpeculatedTokens(
        std::span<const float>(scores.data() + row, static_cast<size_t>(KV) * n), KV, n, c.alpha, c.max_fraction);
    ASSERT_EQ(counts[static_cast<size_t>(s)], want.count) << "sequence " << s;
    ASSERT_EQ(context[static_cast<size_t>(s)], want.count + 1) << "sequence " << s;
    selected_total += want.count;
    tokens_total += n;
    for (int h = 0; h < KV; ++h) {
      const int32_t* got = indices.data() + index_offset[static_cast<size_t>(s)] + static_cast<int64_t>(h) * caps[static_cast<size_t>(s)];
      ASSERT_EQ(std::vector<int32_t>(got, got + want.count), want.per_head[static_cast<size_t>(h)])
          << "sequence " << s << " kv head " << h;
    }
    for (int qh = 0; qh < H; ++qh) {
      const int g = qh / G;
      std::vector<int32_t> positions = want.per_head[static_cast<size_t>(g)];
      positions.push_back(n);
      const float* q = query.data() + (static_cast<size_t>(s) * H + qh) * D;
      std::vector<double> logits;
      double max_logit = -INFINITY;
      for (int pos : positions) {
        const float* k = key_at(s, g, pos);
        double dot = 0.0;
        for (int d = 0; d < D; ++d) dot += double(q[d]) * k[d];
        logits.push_back(dot * scale);
        max_logit = std::max(max_logit, logits.back());
      }
      double sum = 0.0;
      std::vector<double> acc(static_cast<size_t>(D), 0.0);
      for (size_t i = 0; i < positions.size(); ++i) {
        const double p = std::exp(logits[i] - max_logit);
        sum += p;
        const float* v = value_at(s, g, positions[i]);
        for (int d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += p * v[d];
      }
      for (int d = 0; d < D; ++d) ref[(static_cast<size_t>(s) * H + qh) * D + d] = static_cast<float>(acc[static_cast<size_t>(d)] / sum);
    }
  }
  const std::vector<float> out = test::FromDeviceBytes(dout.Download<uint8_t>(), t);
  const bool fp16 = t == DType::kF16;
  char what[160];
  std::snprintf(what, sizeof(what), "pipeline %s kv %d group %d d %d p %d bs %d: %d of %d tokens selected", DTypeName(t),
                KV, G, D, P, bs, selected_total, tokens_total);
  test::ExpectClose(what, out, ref, fp16 ? 2e-3 : 1.5e-2, fp16 ? 0.15 : 1.0);
}

TEST(InfiniGenPipeline, SelectedKvThroughThePagedDecodeKernel) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1606);
  const std::vector<PipelineCase> cases = {
      {DType::kF16, 3, 3, 64, 20, 16, 3.0f, 0.2},
      {DType::kBF16, 2, 3, 128, 39, 8, 5.0f, 0.5},
      {DType::kF16, 4, 3, 128, 39, 32, 4.0f, 0.3},
  };
  for (const PipelineCase& c : cases) {
    RunPipeline(c, rng);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace kvflow
