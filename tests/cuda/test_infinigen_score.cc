// InfiniGen's kernels (kernels/infinigen_score.cu) against the CPU reference on fresh random inputs
// (never zeros), GQA group 3, head_dim 64 with 20 partial columns and 128 with 39, several
// sequences of token counts that are no multiple of any block or tile size.
//
// Skews (of pool keys and of query heads) and scores: fp32 sums in the CPU's order on both sides
// (16-bit values widened exactly), so only FMA contraction differs; bound 1e-5 x max(1, |ref|).
// Selection: count and per-head indices identical to SelectSpeculatedTokens, on heavily tied scores
// (multiples of 0.25), all-equal rows, +0/-0 and a mean count of exactly x.5.
// Gather: bit-exact, and every scratch element it must not write keeps its poison, also when the
// selected rows and the appended token go in two launches.
// Prefetch: host-to-device copies on a copy stream, a later copy to the same bytes winning, and a
// compute stream that waits on the event and scores what arrived.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "infinigen/partial_keys.h"
#include "infinigen/speculation.h"
#include "infinigen_score.h"
#include "kv/kv_cache_layout.h"
#include "model/rope.h"

namespace kvflow {
namespace {

using cuda::DType;

struct Shape {
  int num_kv_heads, head_dim, num_cols, block_size;
};
constexpr int kGroup = 3;
const Shape kShapes[] = {{3, 64, 20, 16}, {4, 128, 39, 8}};

std::vector<int> SequenceLengths() {
  if (test::IsEmulator()) return {37, 1, 150, 203, 5};
  return {37, 1, 150, 2003, 5, 4099};
}

// Normal values kept away from zero, so an unread or zeroed element changes the result.
void FillAwayFromZero(std::vector<float>& v, std::mt19937& rng, float stddev = 1.0f) {
  test::FillNormal(v, rng, stddev);
  for (float& x : v) x = x >= 0.0f ? x + 0.05f : x - 0.05f;
}

// A paged K/V pool holding sequences of the given lengths, each with room for one more token (the
// step's own), in shuffled physical blocks.
struct PagedSequences {
  KvCacheLayout layout;
  std::vector<int> lengths;
  std::vector<std::vector<int32_t>> tables;
  std::vector<float> keys, values;  // one layer, rounded to the device's values
  std::vector<uint8_t> key_bytes, value_bytes;

  int64_t Slot(size_t s, int pos) const {
    const int bs = layout.block_size;
    return static_cast<int64_t>(tables[s][static_cast<size_t>(pos / bs)]) * bs + pos % bs;
  }
  // Key of (sequence, kv head, position) as fp32.
  const float* Key(size_t s, int h, int pos) const {
    const int bs = layout.block_size;
    return keys.data() + layout.offset(tables[s][static_cast<size_t>(pos / bs)], h, pos % bs);
  }
};

PagedSequences MakeSequences(const Shape& shape, DType t, const std::vector<int>& lengths, std::mt19937& rng) {
  PagedSequences p;
  p.lengths = lengths;
  p.layout.num_layers = 1;
  p.layout.num_kv_heads = shape.num_kv_heads;
  p.layout.head_dim = shape.head_dim;
  p.layout.block_size = shape.block_size;
  int blocks = 3;  // a few no sequence owns
  for (int n : lengths) blocks += (n + 1 + shape.block_size - 1) / shape.block_size;
  p.layout.num_blocks = blocks;
  std::vector<int32_t> perm(static_cast<size_t>(blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  size_t next = 0;
  for (int n : lengths) {
    std::vector<int32_t> table;
    for (int b = 0; b < (n + 1 + shape.block_size - 1) / shape.block_size; ++b) table.push_back(perm[next++]);
    p.tables.push_back(table);
  }
  p.keys.resize(p.layout.layer_stride());
  p.values.resize(p.layout.layer_stride());
  FillAwayFromZero(p.keys, rng);
  FillAwayFromZero(p.values, rng);
  p.key_bytes = test::ToDeviceBytes(p.keys, t);
  p.value_bytes = test::ToDeviceBytes(p.values, t);
  return p;
}

// A kv head's skew: A ~ N(0, 1/head_dim) (skewed keys of the keys' magnitude), num_cols distinct
// columns, ascending.
SkewHead RandomSkewHead(int head_dim, int num_cols, std::mt19937& rng) {
  SkewHead head;
  head.matrix.resize(static_cast<size_t>(head_dim) * head_dim);
  FillAwayFromZero(head.matrix, rng, 1.0f / std::sqrt(static_cast<float>(head_dim)));
  std::vector<int32_t> all(static_cast<size_t>(head_dim));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  head.columns.assign(all.begin(), all.begin() + num_cols);
  std::sort(head.columns.begin(), head.columns.end());
  return head;
}

// A layer's kv heads' random skews, and their matrices and columns back to back as the kernels take
// them ([kv_head][head_dim][head_dim], [kv_head][num_cols]).
struct RandomSkew {
  std::vector<SkewHead> heads;
  std::vector<float> matrices;
  std::vector<int32_t> columns;
};
RandomSkew RandomSkews(int num_kv_heads, int head_dim, int num_cols, std::mt19937& rng) {
  RandomSkew r;
  for (int h = 0; h < num_kv_heads; ++h) {
    r.heads.push_back(RandomSkewHead(head_dim, num_cols, rng));
    r.matrices.insert(r.matrices.end(), r.heads.back().matrix.begin(), r.heads.back().matrix.end());
    r.columns.insert(r.columns.end(), r.heads.back().columns.begin(), r.heads.back().columns.end());
  }
  return r;
}

// max |got - ref| and max of that over max(1, |ref|); requires the latter <= bound and finite values.
struct Deviation {
  double max_abs = 0.0, max_rel = 0.0;
};
void Accumulate(Deviation& dev, float got, float ref) {
  const double d = std::isfinite(got) ? std::fabs(double(got) - ref) : INFINITY;
  dev.max_abs = std::max(dev.max_abs, d);
  dev.max_rel = std::max(dev.max_rel, d / std::max(1.0, std::fabs(double(ref))));
}

// Where (sequence, kv head)'s partial key rows go: a destination base and, for a paged cache, the
// sequence's chunk table (null: contiguous rows).
struct SkewTarget {
  float* dst = nullptr;
  const int32_t* chunks = nullptr;
};

// Skews every sequence's keys into its partial key cache in two launches, as decode steps extend it:
// positions [0, have[s]), then [have[s], n), the second writing from row have[s] on.
void SkewInTwoLaunches(DType t, const Shape& shape, const PagedSequences& seqs, const void* key_pool,
                       const float* matrices, const int32_t* columns, const std::vector<int>& have,
                       const std::function<SkewTarget(size_t s, int h)>& target, int chunk_rows) {
  const int KV = shape.num_kv_heads, D = shape.head_dim, P = shape.num_cols;
  for (int part = 0; part < 2; ++part) {
    std::vector<cuda::InfiniGenSkewJob> jobs;
    std::vector<int64_t> slots;
    int max_slots = 0;
    for (size_t s = 0; s < seqs.lengths.size(); ++s) {
      const int from = part == 0 ? 0 : have[s], to = part == 0 ? have[s] : seqs.lengths[s];
      for (int h = 0; h < KV; ++h) {
        const SkewTarget where = target(s, h);
        cuda::InfiniGenSkewJob job;
        job.matrix = matrices + static_cast<size_t>(h) * D * D;
        job.columns = columns + static_cast<size_t>(h) * P;
        job.dst = where.dst;
        job.chunks = where.chunks;
        job.dst_row = from;
        job.kv_head = h;
        job.first_slot = static_cast<int32_t>(slots.size());
        job.num_slots = to - from;
        for (int pos = from; pos < to; ++pos) slots.push_back(seqs.Slot(s, pos));
        max_slots = std::max(max_slots, to - from);
        jobs.push_back(job);
      }
    }
    test::DeviceBuffer djobs = test::DeviceBuffer::From(jobs);
    test::DeviceBuffer dslots = test::DeviceBuffer::From(slots);
    cuda::SkewPartialKeysArgs a;
    a.dtype = t;
    a.key_cache = key_pool;
    a.slots = dslots.get<int64_t>();
    a.jobs = djobs.get<cuda::InfiniGenSkewJob>();
    a.num_jobs = static_cast<int>(jobs.size());
    a.max_job_slots = max_slots;
    a.num_kv_heads = KV;
    a.head_dim = D;
    a.block_size = shape.block_size;
    a.num_partial_columns = P;
    a.chunk_rows = chunk_rows;
    KVFLOW_CUDA_OK(cuda::SkewPartialKeys(a, nullptr));
    KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  }
}

TEST(InfiniGenScore, SkewPartialKeysMatchesCpu) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1601);
  for (DType t : {DType::kF16, DType::kBF16}) {
    for (const Shape& shape : kShapes) {
      const int KV = shape.num_kv_heads, D = shape.head_dim, P = shape.num_cols;
      const PagedSequences seqs = MakeSequences(shape, t, SequenceLengths(), rng);
      auto [skew, matrices, columns] = RandomSkews(KV, D, P, rng);
      test::DeviceBuffer dpool = test::DeviceBuffer::From(seqs.key_bytes);
      test::DeviceBuffer dmatrices = test::DeviceBuffer::From(matrices);
      test::DeviceBuffer dcolumns = test::DeviceBuffer::From(columns);
      // The partial key caches of every (sequence, kv head), back to back, poisoned.
      std::vector<int64_t> cache_row;  // first row of (s, h)
      int64_t rows = 0;
      for (int n : seqs.lengths) {
        for (int h = 0; h < KV; ++h) {
          cache_row.push_back(rows);
          rows += n;
        }
      }
      test::DeviceBuffer dcache(static_cast<size_t>(rows) * P * sizeof(float));
      dcache.Poison();
      std::vector<int> have;
      for (int n : seqs.lengths) have.push_back(std::uniform_int_distribution<int>(0, n)(rng));
      SkewInTwoLaunches(t, shape, seqs, dpool.get(), dmatrices.get<float>(), dcolumns.get<int32_t>(), have,
                        [&](size_t s, int h) {
                          return SkewTarget{dcache.get<float>() + cache_row[s * KV + static_cast<size_t>(h)] * P};
                        }, 0);
      const std::vector<float> got = dcache.Download<float>();
      Deviation dev;
      for (size_t s = 0; s < seqs.lengths.size(); ++s) {
        const int n = seqs.lengths[s];
        for (int h = 0; h < KV; ++h) {
          std::vector<float> x(static_cast<size_t>(n) * D), ref(static_cast<size_t>(n) * P);
          for (int pos = 0; pos < n; ++pos) std::copy_n(seqs.Key(s, h, pos), D, x.data() + static_cast<size_t>(pos) * D);
          SkewPartialColumns(x.data(), n, D, skew[static_cast<size_t>(h)], D, ref.data());
          const float* g = got.data() + cache_row[s * KV + static_cast<size_t>(h)] * P;
          for (size_t i = 0; i < ref.size(); ++i) Accumulate(dev, g[i], ref[i]);
        }
      }
      std::printf("  skew %-4s kv %d d %3d p %2d rows %5lld: max|d| = %.3g  max rel = %.3g (bound 1e-5)%s\n",
                  DTypeName(t), KV, D, P, static_cast<long long>(rows), dev.max_abs, dev.max_rel,
                  test::IsEmulator() ? "  [emulator]" : "");
      EXPECT_LE(dev.max_rel, 1e-5) << DTypeName(t) << " d " << D;
    }
  }
}

TEST(InfiniGenScore, SkewPartialQueriesMatchesCpu) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1607);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const Shape& shape : kShapes) {
      const int KV = shape.num_kv_heads, H = KV * kGroup, D = shape.head_dim, P = shape.num_cols, rows = 5;
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      // Rows as the fused QKV buffer holds them: the Q heads, then K and V (never read).
      const int64_t stride = static_cast<int64_t>(H + 2 * KV) * D;
      std::vector<float> qkv(static_cast<size_t>(rows * stride));
      FillAwayFromZero(qkv, rng, 1.5f);
      const std::vector<uint8_t> qkv_bytes = test::ToDeviceBytes(qkv, t);
      auto [skew, matrices, columns] = RandomSkews(KV, D, P, rng);
      test::DeviceBuffer dqkv = test::DeviceBuffer::From(qkv_bytes);
      test::DeviceBuffer dmatrices = test::DeviceBuffer::From(matrices), dcolumns = test::DeviceBuffer::From(columns);
      test::DeviceBuffer dout(static_cast<size_t>(rows) * H * P * sizeof(float));
      dout.Poison();
      cuda::SkewPartialQueriesArgs a;
      a.dtype = t;
      a.rows = dqkv.get();
      a.row_stride = stride;
      a.num_rows = rows;
      a.num_heads = H;
      a.num_kv_heads = KV;
      a.head_dim = D;
      a.num_partial_columns = P;
      a.scale = scale;
      a.matrices = dmatrices.get<float>();
      a.columns = dcolumns.get<int32_t>();
      a.out = dout.get<float>();
      KVFLOW_CUDA_OK(cuda::SkewPartialQueries(a, nullptr));
      KVFLOW_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> got = dout.Download<float>();
      Deviation dev;
      for (int r = 0; r < rows; ++r) {
        for (int h = 0; h < H; ++h) {
          // The CPU path: q *= scale in fp32, then the skew of its kv head.
          std::vector<float> q(qkv.begin() + r * stride + static_cast<int64_t>(h) * D,
                               qkv.begin() + r * stride + static_cast<int64_t>(h + 1) * D);
          for (float& x : q) x *= scale;
          std::vector<float> ref(static_cast<size_t>(P));
          SkewPartialColumns(q.data(), 1, D, skew[static_cast<size_t>(h / kGroup)], D, ref.data());
          const float* g = got.data() + (static_cast<size_t>(r) * H + h) * P;
          for (int c = 0; c < P; ++c) Accumulate(dev, g[c], ref[static_cast<size_t>(c)]);
        }
      }
      std::printf("  query skew %-4s heads %2d/%d d %3d p %2d rows %d: max|d| = %.3g  max rel = %.3g (bound 1e-5)%s\n",
                  DTypeName(t), H, KV, D, P, rows, dev.max_abs, dev.max_rel, test::IsEmulator() ? "  [emulator]" : "");
      EXPECT_LE(dev.max_rel, 1e-5) << DTypeName(t) << " d " << D;
    }
  }
}

// Device jobs scoring the partial keys of every (sequence, kv head); scores of job j start at
// score_offset[j], with a gap of 3 floats after each job that must keep its poison.
struct ScoreSetup {
  std::vector<float> queries, keys;  // [s][h][group][P], per job [n][P] back to back
  std::vector<int64_t> key_offset, score_offset, query_offset;
  std::vector<int> job_tokens;
  int64_t num_scores = 0;
  int max_tokens = 0;
};
ScoreSetup MakeScoreSetup(const std::vector<int>& lengths, int KV, int P, std::mt19937& rng) {
  ScoreSetup st;
  for (int n : lengths) {
    for (int h = 0; h < KV; ++h) {
      st.query_offset.push_back(static_cast<int64_t>(st.queries.size()));
      st.queries.resize(st.queries.size() + static_cast<size_t>(kGroup) * P);
      st.key_offset.push_back(static_cast<int64_t>(st.keys.size()));
      st.keys.resize(st.keys.size() + static_cast<size_t>(n) * P);
      st.score_offset.push_back(st.num_scores);
      st.num_scores += n + 3;
      st.job_tokens.push_back(n);
      st.max_tokens = std::max(st.max_tokens, n);
    }
  }
  FillAwayFromZero(st.queries, rng);
  FillAwayFromZero(st.keys, rng);
  return st;
}
std::vector<cuda::PartialKeyScoreJob> ScoreJobs(const ScoreSetup& st, const float* dqueries, const float* dkeys,
                                                float* dscores) {
  std::vector<cuda::PartialKeyScoreJob> jobs;
  for (size_t j = 0; j < st.job_tokens.size(); ++j) {
    cuda::PartialKeyScoreJob job;
    job.queries = dqueries + st.query_offset[j];
    job.keys = dkeys + st.key_offset[j];
    job.scores = dscores + st.score_offset[j];
    job.num_tokens = st.job_tokens[j];
    jobs.push_back(job);
  }
  return jobs;
}
// Compares the device scores with the CPU's; returns the largest relative deviation.
double CheckScores(const ScoreSetup& st, int P, const std::vector<float>& got, Deviation& dev) {
  for (size_t j = 0; j < st.job_tokens.size(); ++j) {
    const int n = st.job_tokens[j];
    std::vector<float> ref(static_cast<size_t>(n));
    ScorePartialKeys(st.queries.data() + st.query_offset[j], kGroup, st.keys.data() + st.key_offset[j], n, P,
                     ref.data());
    const float* g = got.data() + st.score_offset[j];
    for (int t = 0; t < n; ++t) Accumulate(dev, g[t], ref[static_cast<size_t>(t)]);
    for (int gap = 0; gap < 3; ++gap) {
      uint32_t bits;
      std::memcpy(&bits, g + n + gap, 4);
      EXPECT_EQ(bits, 0xFFFFFFFFu) << "score past job " << j << "'s tokens was written";
    }
  }
  return dev.max_rel;
}

TEST(InfiniGenScore, ScorePartialKeysMatchesCpu) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1602);
  for (const Shape& shape : kShapes) {
    const int KV = shape.num_kv_heads, P = shape.num_cols;
    const ScoreSetup st = MakeScoreSetup(SequenceLengths(), KV, P, rng);
    test::DeviceBuffer dqueries = test::DeviceBuffer::From(st.queries);
    test::DeviceBuffer dkeys = test::DeviceBuffer::From(st.keys);
    std::vector<std::vector<float>> runs;
    for (int run = 0; run < 2; ++run) {
      test::DeviceBuffer dscores(static_cast<size_t>(st.num_scores) * sizeof(float));
      dscores.Poison();
      const std::vector<cuda::PartialKeyScoreJob> jobs =
          ScoreJobs(st, dqueries.get<float>(), dkeys.get<float>(), dscores.get<float>());
      test::DeviceBuffer djobs = test::DeviceBuffer::From(jobs);
      KVFLOW_CUDA_OK(cuda::ScorePartialKeys(djobs.get<cuda::PartialKeyScoreJob>(), static_cast<int>(jobs.size()),
                                            st.max_tokens, kGroup, P, nullptr));
      KVFLOW_CUDA_OK(cudaDeviceSynchronize());
      runs.push_back(dscores.Download<float>());
    }
    ASSERT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(float)))
        << "scores not reproducible";
    Deviation dev;
    CheckScores(st, P, runs[0], dev);
    std::printf("  score kv %d group %d p %2d jobs %2zu max n %4d: max|d| = %.3g  max rel = %.3g (bound 1e-5)%s\n", KV,
                kGroup, P, st.job_tokens.size(), st.max_tokens, dev.max_abs, dev.max_rel,
                test::IsEmulator() ? "  [emulator]" : "");
    EXPECT_LE(dev.max_rel, 1e-5) << "p " << P;
  }
}

// A partial key cache paged in chunks (a sequence's rows in shuffled chunks of a shared pool, through
// its chunk table, as CudaBackend keeps it) holds, and scores to, the same bits as contiguous rows.
TEST(InfiniGenScore, PagedPartialKeyCacheMatchesContiguousRows) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1611);
  constexpr int kChunkRows = 16;
  const DType t = DType::kBF16;
  for (const Shape& shape : kShapes) {
    const int KV = shape.num_kv_heads, D = shape.head_dim, P = shape.num_cols;
    const PagedSequences seqs = MakeSequences(shape, t, SequenceLengths(), rng);
    const RandomSkew skew = RandomSkews(KV, D, P, rng);
    const std::vector<float>& matrices = skew.matrices;
    const std::vector<int32_t>& columns = skew.columns;
    test::DeviceBuffer dpool = test::DeviceBuffer::From(seqs.key_bytes);
    test::DeviceBuffer dmatrices = test::DeviceBuffer::From(matrices);
    test::DeviceBuffer dcolumns = test::DeviceBuffer::From(columns);
    // Contiguous: (s, h) at cache_row[s * KV + h]. Paged: one pool per kv head of shuffled chunks,
    // each sequence's chunk table shared by its heads.
    std::vector<int64_t> cache_row;
    int64_t rows = 0;
    int num_chunks = 2;  // a couple no sequence owns
    for (int n : seqs.lengths) {
      for (int h = 0; h < KV; ++h) {
        cache_row.push_back(rows);
        rows += n;
      }
      num_chunks += (n + kChunkRows - 1) / kChunkRows;
    }
    std::vector<int32_t> perm(static_cast<size_t>(num_chunks));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int32_t> chunk_ids;
    std::vector<int64_t> chunk_first;  // per sequence, into chunk_ids
    size_t next = 0;
    for (int n : seqs.lengths) {
      chunk_first.push_back(static_cast<int64_t>(chunk_ids.size()));
      for (int c = 0; c < (n + kChunkRows - 1) / kChunkRows; ++c) chunk_ids.push_back(perm[next++]);
    }
    const int64_t head_pool = static_cast<int64_t>(num_chunks) * kChunkRows * P;
    test::DeviceBuffer dchunks = test::DeviceBuffer::From(chunk_ids);
    test::DeviceBuffer dflat(static_cast<size_t>(rows) * P * sizeof(float));
    test::DeviceBuffer dpaged(static_cast<size_t>(head_pool) * KV * sizeof(float));
    dflat.Poison();
    dpaged.Poison();
    std::vector<int> have;
    for (int n : seqs.lengths) have.push_back(std::uniform_int_distribution<int>(0, n)(rng));
    for (int paged = 0; paged < 2; ++paged) {
      SkewInTwoLaunches(t, shape, seqs, dpool.get(), dmatrices.get<float>(), dcolumns.get<int32_t>(), have,
                        [&](size_t s, int h) {
                          if (paged) return SkewTarget{dpaged.get<float>() + h * head_pool, dchunks.get<int32_t>() + chunk_first[s]};
                          return SkewTarget{dflat.get<float>() + cache_row[s * KV + static_cast<size_t>(h)] * P};
                        }, paged ? kChunkRows : 0);
    }
    const std::vector<float> flat = dflat.Download<float>(), pool = dpaged.Download<float>();
    for (size_t s = 0; s < seqs.lengths.size(); ++s) {
      for (int h = 0; h < KV; ++h) {
        for (int r = 0; r < seqs.lengths[s]; ++r) {
          const int64_t chunk = chunk_ids[static_cast<size_t>(chunk_first[s] + r / kChunkRows)];
          const float* g = pool.data() + h * head_pool + (chunk * kChunkRows + r % kChunkRows) * P;
          const float* want = flat.data() + (cache_row[s * KV + static_cast<size_t>(h)] + r) * P;
          ASSERT_EQ(0, std::memcmp(g, want, P * sizeof(float))) << "sequence " << s << " head " << h << " row " << r;
        }
      }
    }
    // Scores of a group of random queries over both layouts: the same bits.
    std::vector<float> queries(seqs.lengths.size() * KV * kGroup * P);
    FillAwayFromZero(queries, rng);
    test::DeviceBuffer dqueries = test::DeviceBuffer::From(queries);
    std::vector<std::vector<float>> scores;
    int max_tokens = 0;
    for (int n : seqs.lengths) max_tokens = std::max(max_tokens, n);
    for (int paged = 0; paged < 2; ++paged) {
      test::DeviceBuffer dscores(static_cast<size_t>(rows) * sizeof(float));
      dscores.Poison();
      std::vector<cuda::PartialKeyScoreJob> jobs;
      for (size_t s = 0; s < seqs.lengths.size(); ++s) {
        for (int h = 0; h < KV; ++h) {
          const size_t j = s * KV + static_cast<size_t>(h);
          cuda::PartialKeyScoreJob job;
          job.queries = dqueries.get<float>() + j * kGroup * P;
          job.keys = paged ? dpaged.get<float>() + h * head_pool : dflat.get<float>() + cache_row[j] * P;
          job.chunks = paged ? dchunks.get<int32_t>() + chunk_first[s] : nullptr;
          job.scores = dscores.get<float>() + cache_row[j];
          job.num_tokens = seqs.lengths[s];
          jobs.push_back(job);
        }
      }
      test::DeviceBuffer djobs = test::DeviceBuffer::From(jobs);
      KVFLOW_CUDA_OK(cuda::ScorePartialKeys(djobs.get<cuda::PartialKeyScoreJob>(), static_cast<int>(jobs.size()),
                                            max_tokens, kGroup, P, nullptr, paged ? kChunkRows : 0));
      KVFLOW_CUDA_OK(cudaDeviceSynchronize());
      scores.push_back(dscores.Download<float>());
    }
    ASSERT_EQ(0, std::memcmp(scores[0].data(), scores[1].data(), scores[0].size() * sizeof(float)))
        << "paged scores differ from contiguous ones";
    std::printf("  paged partial keys kv %d p %2d chunks %d x %d rows: rows and scores bit-identical%s\n", KV, P,
                num_chunks, kChunkRows, test::IsEmulator() ? "  [emulator]" : "");
  }
}

// The speculative query of a decode token, rotated in the kernel (positions and row indices given):
// ApplyRope's fp32 rotation, the scale, then the skew, as InfiniGenSelector computes it on the host.
TEST(InfiniGenScore, SkewPartialQueriesRotatesAsApplyRope) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1612);
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (const Shape& shape : kShapes) {
      const int KV = shape.num_kv_heads, H = KV * kGroup, D = shape.head_dim, P = shape.num_cols;
      const int source_rows = 9;
      const std::vector<int32_t> picked = {7, 0, 4};  // rows of the step that speculate, out of order
      const int rows = static_cast<int>(picked.size());
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      const int64_t stride = static_cast<int64_t>(H + 2 * KV) * D;
      std::vector<float> qkv(static_cast<size_t>(source_rows * stride));
      FillAwayFromZero(qkv, rng, 1.5f);
      const std::vector<uint8_t> qkv_bytes = test::ToDeviceBytes(qkv, t);
      const std::vector<float> widened = test::FromDeviceBytes(qkv_bytes, t);
      std::vector<int32_t> positions(static_cast<size_t>(source_rows));
      for (int32_t& p : positions) p = std::uniform_int_distribution<int>(0, 40000)(rng);
      RopeFrequencies rope;
      for (int i = 0; i < D / 2; ++i) rope.inv_freq.push_back(std::pow(500000.0f, -2.0f * i / D));
      rope.attention_scale = 1.0f;
      auto [skew, matrices, columns] = RandomSkews(KV, D, P, rng);
      test::DeviceBuffer dqkv = test::DeviceBuffer::From(qkv_bytes);
      test::DeviceBuffer dpicked = test::DeviceBuffer::From(picked), dpositions = test::DeviceBuffer::From(positions);
      test::DeviceBuffer dfreq = test::DeviceBuffer::From(rope.inv_freq);
      test::DeviceBuffer dmatrices = test::DeviceBuffer::From(matrices), dcolumns = test::DeviceBuffer::From(columns);
      test::DeviceBuffer dout(static_cast<size_t>(rows) * H * P * sizeof(float));
      dout.Poison();
      cuda::SkewPartialQueriesArgs a;
      a.dtype = t;
      a.rows = dqkv.get();
      a.row_stride = stride;
      a.num_rows = rows;
      a.row_indices = dpicked.get<int32_t>();
      a.positions = dpositions.get<int32_t>();
      a.inv_freq = dfreq.get<float>();
      a.attention_scale = rope.attention_scale;
      a.num_heads = H;
      a.num_kv_heads = KV;
      a.head_dim = D;
      a.num_partial_columns = P;
      a.scale = scale;
      a.matrices = dmatrices.get<float>();
      a.columns = dcolumns.get<int32_t>();
      a.out = dout.get<float>();
      KVFLOW_CUDA_OK(cuda::SkewPartialQueries(a, nullptr));
      KVFLOW_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> got = dout.Download<float>();
      Deviation dev;
      for (int r = 0; r < rows; ++r) {
        const int src = picked[static_cast<size_t>(r)];
        for (int h = 0; h < H; ++h) {
          std::vector<float> q(widened.begin() + src * stride + static_cast<int64_t>(h) * D,
                               widened.begin() + src * stride + static_cast<int64_t>(h + 1) * D);
          ApplyRope(q.data(), D, positions[static_cast<size_t>(src)], rope);
          for (float& x : q) x *= scale;
          std::vector<float> ref(static_cast<size_t>(P));
          SkewPartialColumns(q.data(), 1, D, skew[static_cast<size_t>(h / kGroup)], D, ref.data());
          const float* g = got.data() + (static_cast<size_t>(r) * H + h) * P;
          for (int c = 0; c < P; ++c) Accumulate(dev, g[c], ref[static_cast<size_t>(c)]);
        }
      }
      // cosf/sinf of angles up to 4e4 rad: the device's differ from libm's by an ulp or two.
      std::printf("  rotated query skew %-4s heads %2d/%d d %3d p %2d: max|d| = %.3g  max rel = %.3g (bound 1e-4)%s\n",
                  DTypeName(t), H, KV, D, P, dev.max_abs, dev.max_rel, test::IsEmulator() ? "  [emulator]" : "");
      EXPECT_LE(dev.max_rel, 1e-4) << DTypeName(t) << " d " << D;
    }
  }
}

// ---- selection ------------------------------------------------------------------------------------

enum class ScoreKind { kTied, kDistinct, kEqual, kSignedZeros, kWide };

std::vector<float> MakeScores(size_t count, ScoreKind kind, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_int_distribution<int> level(-8, 8);
  std::vector<float> s(count);
  for (float& x : s) {
    switch (kind) {
      case ScoreKind::kTied: x = 0.25f * static_cast<float>(level(rng)) + 0.125f; break;  // never 0
      case ScoreKind::kDistinct: x = normal(rng); break;
      case ScoreKind::kEqual: x = -1.75f; break;
      case ScoreKind::kSignedZeros: x = level(rng) % 2 ? 0.0f : -0.0f; break;
      case ScoreKind::kWide: x = std::ldexp(normal(rng), level(rng) * 4); break;  // magnitudes 2^-32 .. 2^32
    }
  }
  return s;
}

// A launch of selection jobs: per job one sequence's scores [kv][n], its cap and CPU result.
struct SelectCase {
  std::vector<int> tokens;
  std::vector<double> max_fraction;
  std::vector<float> scores;  // jobs back to back, each [kv][n]
  std::vector<int64_t> score_offset;
};

// Runs the device selection; returns per job the count and the indices [kv][cap] (poison -1 kept).
struct DeviceSelection {
  std::vector<int32_t> counts;
  std::vector<std::vector<int32_t>> indices;
  std::vector<int32_t> caps;
};
DeviceSelection RunSelection(const SelectCase& c, int KV, float alpha, test::DeviceBuffer& dscores,
                             test::DeviceBuffer& dindices, test::DeviceBuffer& dcounts,
                             std::vector<int64_t>& index_offset) {
  DeviceSelection out;
  std::vector<cuda::SpeculationSelectJob> jobs;
  int64_t total_indices = 0;
  index_offset.clear();
  for (size_t j = 0; j < c.tokens.size(); ++j) {
    out.caps.push_back(cuda::SpeculatedTokenCap(c.tokens[j], c.max_fraction[j]));
    index_offset.push_back(total_indices);
    total_indices += static_cast<int64_t>(KV) * out.caps.back() + 2;  // 2 guard entries after each job
  }
  dscores = test::DeviceBuffer::From(c.scores);
  dindices = test::DeviceBuffer(static_cast<size_t>(total_indices) * sizeof(int32_t));
  dindices.Poison();
  dcounts = test::DeviceBuffer(c.tokens.size() * sizeof(int32_t));
  dcounts.Poison();
  for (size_t j = 0; j < c.tokens.size(); ++j) {
    cuda::SpeculationSelectJob job;
    job.scores = dscores.get<float>() + c.score_offset[j];
    job.score_head_stride = c.tokens[j];
    job.num_tokens = c.tokens[j];
    job.cap = out.caps[j];
    job.indices = dindices.get<int32_t>() + index_offset[j];
    job.count = dcounts.get<int32_t>() + j;
    jobs.push_back(job);
  }
  test::DeviceBuffer djobs = test::DeviceBuffer::From(jobs);
  test::DeviceBuffer dhead_counts(c.tokens.size() * KV * sizeof(int32_t));
  cuda::SelectSpeculatedTokensArgs a;
  a.jobs = djobs.get<cuda::SpeculationSelectJob>();
  a.num_jobs = static_cast<int>(jobs.size());
  a.num_kv_heads = KV;
  a.alpha = alpha;
  a.head_counts = dhead_counts.get<int32_t>();
  EXPECT_EQ(cuda::SelectSpeculatedTokens(a, nullptr), 0);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out.counts = dcounts.Download<int32_t>();
  const std::vector<int32_t> all = dindices.Download<int32_t>();
  for (size_t j = 0; j < c.tokens.size(); ++j) {
    const auto first = all.begin() + index_offset[j];
    out.indices.emplace_back(first, first + static_cast<int64_t>(KV) * out.caps[j] + 2);
  }
  return out;
}

// Requires the device's selection of every job to be the CPU's; returns the jobs checked.
int ExpectSameSelection(const SelectCase& c, int KV, float alpha, const std::string& what) {
  test::DeviceBuffer dscores, dindices, dcounts;
  std::vector<int64_t> index_offset;
  const DeviceSelection got = RunSelection(c, KV, alpha, dscores, dindices, dcounts, index_offset);
  for (size_t j = 0; j < c.tokens.size(); ++j) {
    const int n = c.tokens[j];
    const std::span<const float> scores(c.scores.data() + c.score_offset[j], static_cast<size_t>(KV) * n);
    const SpeculatedTokens want = SelectSpeculatedTokens(scores, KV, n, alpha, c.max_fraction[j]);
    const std::string job = what + " job " + std::to_string(j) + " (n " + std::to_string(n) + ", max_fraction " +
                            std::to_string(c.max_fraction[j]) + ")";
    EXPECT_EQ(got.counts[j], want.count) << job;
    if (got.counts[j] != want.count) continue;
    const int cap = got.caps[j];
    for (int h = 0; h < KV; ++h) {
      const auto row = got.indices[j].begin() + static_cast<int64_t>(h) * cap;
      const std::vector<int32_t> head(row, row + want.count);
      // A job without tokens: the CPU returns no heads at all, and nothing may be written.
      const std::vector<int32_t> want_head = want.per_head.empty() ? std::vector<int32_t>{} : want.per_head[static_cast<size_t>(h)];
      EXPECT_EQ(head, want_head) << job << " head " << h;
      for (int i = want.count; i < cap; ++i) EXPECT_EQ(row[i], -1) << job << " head " << h << ": index past count";
    }
    EXPECT_EQ(got.indices[j][static_cast<size_t>(KV) * cap], -1) << job << ": guard written";
    EXPECT_EQ(got.indices[j][static_cast<size_t>(KV) * cap + 1], -1) << job << ": guard written";
  }
  return static_cast<int>(c.tokens.size());
}

void AddJob(SelectCase& c, int KV, int n, double max_fraction, const std::vector<float>& scores) {
  c.tokens.push_back(n);
  c.max_fraction.push_back(max_fraction);
  c.score_offset.push_back(static_cast<int64_t>(c.scores.size()));
  c.scores.insert(c.scores.end(), scores.begin(), scores.end());
  c.scores.insert(c.scores.end(), 2, 1e30f);  // between jobs: a score no job may read
}

TEST(InfiniGenScore, SelectionEqualsCpuIncludingTies) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1603);
  const int big = test::IsEmulator() ? 1500 : 20000;
  const std::vector<int> sizes = {1, 2, 5, 17, 100, 257, 600, big};
  const std::vector<double> fractions = {0.2, 0.5, 1.0, 0.01, 3.0};
  int jobs_checked = 0;
  for (int KV : {2, 3, 4}) {
    for (ScoreKind kind :
         {ScoreKind::kTied, ScoreKind::kDistinct, ScoreKind::kEqual, ScoreKind::kSignedZeros, ScoreKind::kWide}) {
      for (float alpha : {0.0f, 0.25f, 1.0f, 5.0f}) {
        SelectCase c;
        for (size_t i = 0; i < sizes.size(); ++i) {
          const int n = sizes[i];
          AddJob(c, KV, n, fractions[(i + static_cast<size_t>(KV)) % fractions.size()],
                 MakeScores(static_cast<size_t>(KV) * n, kind, rng));
        }
        jobs_checked += ExpectSameSelection(c, KV, alpha,
                                            "kv " + std::to_string(KV) + " kind " + std::to_string(int(kind)) +
                                                " alpha " + std::to_string(alpha));
        if (HasFailure()) return;
      }
    }
  }
  // Mean counts of exactly 2.5 (heads counting 3 and 2, or 1 and 4) round up, as std::lround does;
  // a job without tokens selects nothing.
  SelectCase c;
  std::vector<float> s = {9, 9, 9, 0, 0, 0, 0, 0, /* head 1 */ 0, 9, 0, 9, 0, 0, 0, 0};
  AddJob(c, 2, 8, 1.0, s);
  s = {9, 0, 0, 0, /* head 1 */ 1, 1, 1, 1};  // counts 1 and 4: mean 2.5
  AddJob(c, 2, 4, 1.0, s);
  AddJob(c, 2, 0, 1.0, {});
  jobs_checked += ExpectSameSelection(c, 2, 1.0f, "half-way means");
  std::printf("  selection: %d jobs over 2, 3 and 4 kv heads identical to the CPU (counts and indices)%s\n",
              jobs_checked, test::IsEmulator() ? "  [emulator]" : "");
}

// ---- gather ---------------------------------------------------------------------------------------

TEST(InfiniGenScore, GatherSelectedKvIsBitExact) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1604);
  const float alpha = 0.5f;
  for (DType t : {DType::kF16, DType::kBF16}) {
    for (const Shape& shape : kShapes) {
      const int KV = shape.num_kv_heads, D = shape.head_dim, bs = shape.block_size;
      const PagedSequences seqs = MakeSequences(shape, t, SequenceLengths(), rng);
      // Scores -> device selection -> gather, as a decode step chains them.
      SelectCase c;
      for (int n : seqs.lengths) AddJob(c, KV, n, 0.3, MakeScores(static_cast<size_t>(KV) * n, ScoreKind::kTied, rng));
      test::DeviceBuffer dscores, dindices, dcounts;
      std::vector<int64_t> index_offset;
      const DeviceSelection sel = RunSelection(c, KV, alpha, dscores, dindices, dcounts, index_offset);
      if (HasFailure()) return;

      std::vector<int32_t> tables;
      std::vector<int64_t> table_offset;
      for (const auto& table : seqs.tables) {
        table_offset.push_back(static_cast<int64_t>(tables.size()));
        tables.insert(tables.end(), table.begin(), table.end());
      }
      test::DeviceBuffer dtables = test::DeviceBuffer::From(tables);
      test::DeviceBuffer dkey_pool = test::DeviceBuffer::From(seqs.key_bytes);
      test::DeviceBuffer dvalue_pool = test::DeviceBuffer::From(seqs.value_bytes);
      test::DeviceBuffer dcontext(seqs.lengths.size() * sizeof(int32_t));
      dcontext.Poison();
      // Every other sequence appends its step's own token (position n, whose slot the table holds).
      std::vector<cuda::SelectedKvGatherJob> jobs;
      int blocks = 0;
      for (size_t s = 0; s < seqs.lengths.size(); ++s) {
        cuda::SelectedKvGatherJob job;
        job.block_table = dtables.get<int32_t>() + table_offset[s];
        job.positions = dindices.get<int32_t>() + index_offset[s];
        job.position_head_stride = sel.caps[s];
        job.count = dcounts.get<int32_t>() + s;
        job.append_position = s % 2 == 0 ? seqs.lengths[s] : -1;
        job.first_block = blocks;
        job.num_blocks = (sel.caps[s] + 1 + bs - 1) / bs;
        job.context_len = dcontext.get<int32_t>() + s;
        blocks += job.num_blocks + 1;  // a block between jobs that nothing writes
        jobs.push_back(job);
      }
      KvCacheLayout scratch = seqs.layout;
      scratch.num_blocks = blocks;
      const size_t es = cuda::DTypeSize(t);
      test::DeviceBuffer dkey_scratch(scratch.layer_stride() * es), dvalue_scratch(scratch.layer_stride() * es);
      dkey_scratch.Poison();
      dvalue_scratch.Poison();
      // Every fourth sequence in two launches, as an offloaded pool's prefetch and attention make
      // them: the selected rows first (no context out), then only the appended token.
      std::vector<cuda::SelectedKvGatherJob> first_pass = jobs, appended;
      for (size_t s = 0; s < jobs.size(); s += 4) {
        first_pass[s].append_position = -1;
        first_pass[s].context_len = nullptr;
        appended.push_back(jobs[s]);
        appended.back().only_appended = true;
      }
      test::DeviceBuffer djobs = test::DeviceBuffer::From(first_pass);
      test::DeviceBuffer dappended = test::DeviceBuffer::From(appended);
      KVFLOW_CUDA_OK(cuda::GatherSelectedKv(t, dkey_pool.get(), dvalue_pool.get(),
                                            djobs.get<cuda::SelectedKvGatherJob>(), static_cast<int>(jobs.size()),
                                            dkey_scratch.get(), dvalue_scratch.get(), KV, D, bs, nullptr));
      KVFLOW_CUDA_OK(cuda::GatherSelectedKv(t, dkey_pool.get(), dvalue_pool.get(),
                                            dappended.get<cuda::SelectedKvGatherJob>(),
                                            static_cast<int>(appended.size()), dkey_scratch.get(),
                                            dvalue_scratch.get(), KV, D, bs, nullptr));
      KVFLOW_CUDA_OK(cudaDeviceSynchronize());

      // Expected scratch: the selected rows of each head in order, the appended token last, poison
      // elsewhere.
      std::vector<uint8_t> want_key(scratch.layer_stride() * es, 0xFF), want_value(want_key);
      const std::vector<int32_t> context = dcontext.Download<int32_t>();
      for (size_t s = 0; s < seqs.lengths.size(); ++s) {
        const int n = seqs.lengths[s];
        const SpeculatedTokens cpu = SelectSpeculatedTokens(
            std::span<const float>(c.scores.data() + c.score_offset[s], static_cast<size_t>(KV) * n), KV, n, alpha,
            0.3);
        const bool append = jobs[s].append_position >= 0;
        EXPECT_EQ(context[s], cpu.count + (append ? 1 : 0)) << "sequence " << s;
        for (int h = 0; h < KV; ++h) {
          std::vector<int32_t> positions = cpu.per_head[static_cast<size_t>(h)];
          if (append) positions.push_back(n);
          for (size_t i = 0; i < positions.size(); ++i) {
            const int pos = positions[i];
            const size_t src =
                seqs.layout.offset(seqs.tables[s][static_cast<size_t>(pos / bs)], h, pos % bs) * es;
            const size_t dst =
                scratch.offset(jobs[s].first_block + static_cast<int>(i) / bs, h, static_cast<int>(i) % bs) * es;
            std::memcpy(&want_key[dst], &seqs.key_bytes[src], D * es);
            std::memcpy(&want_value[dst], &seqs.value_bytes[src], D * es);
          }
        }
      }
      const std::vector<uint8_t> got_key = dkey_scratch.Download<uint8_t>();
      const std::vector<uint8_t> got_value = dvalue_scratch.Download<uint8_t>();
      size_t bad = 0, written = 0;
      for (size_t i = 0; i < want_key.size(); i += es) {
        bad += std::memcmp(&got_key[i], &want_key[i], es) != 0;
        bad += std::memcmp(&got_value[i], &want_value[i], es) != 0;
        written += !(want_key[i] == 0xFF && want_key[i + 1] == 0xFF);
      }
      std::printf("  gather %-4s kv %d d %3d bs %2d: %zu of %zu K+V elements differ (bit-exact; %zu gathered)%s\n",
                  DTypeName(t), KV, D, bs, bad, 2 * want_key.size() / es, 2 * written,
                  test::IsEmulator() ? "  [emulator]" : "");
      EXPECT_EQ(bad, 0u) << DTypeName(t) << " d " << D;
    }
  }
}

// ---- prefetch -------------------------------------------------------------------------------------

// Pinned host memory that frees itself.
struct PinnedBuffer {
  void* ptr = nullptr;
  explicit PinnedBuffer(size_t bytes) {
    if (cudaMallocHost(&ptr, bytes) != cudaSuccess) ptr = nullptr;
  }
  ~PinnedBuffer() {
    if (ptr) cudaFreeHost(ptr);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  float* f() const { return static_cast<float*>(ptr); }
};

// Stale keys, then the right rows (some merged into one copy, some in reverse order) prefetched on
// a copy stream; the compute stream waits on the prefetch's event and scores them.
void RunPrefetchThenScore() {
  std::mt19937 rng(1605);
  const int P = 39, KV = 3;
  const ScoreSetup st = MakeScoreSetup(SequenceLengths(), KV, P, rng);
  const size_t key_bytes = st.keys.size() * sizeof(float);
  // The partial keys live on the host (pinned), with a stale copy of different values beside them.
  PinnedBuffer host(key_bytes), stale(key_bytes);
  ASSERT_TRUE(host.ptr && stale.ptr);
  std::memcpy(host.ptr, st.keys.data(), key_bytes);
  for (size_t i = 0; i < st.keys.size(); ++i) stale.f()[i] = -st.keys[i] + 0.5f;
  test::DeviceBuffer dkeys(key_bytes);
  dkeys.Poison();
  test::DeviceBuffer dqueries = test::DeviceBuffer::From(st.queries);
  test::DeviceBuffer dscores(static_cast<size_t>(st.num_scores) * sizeof(float));
  dscores.Poison();
  const std::vector<cuda::PartialKeyScoreJob> jobs =
      ScoreJobs(st, dqueries.get<float>(), dkeys.get<float>(), dscores.get<float>());
  test::DeviceBuffer djobs = test::DeviceBuffer::From(jobs);

  // Ranges in order: all of the stale keys, then the right ones row by row (contiguous rows merge
  // into one copy) but every third job's rows in reverse order (no merging there). The later
  // copies must win.
  std::vector<cuda::HostToDeviceRange> ranges;
  ranges.push_back({stale.ptr, dkeys.get(), key_bytes});
  size_t copies_of_rows = 0;
  for (size_t j = 0; j < st.job_tokens.size(); ++j) {
    const int n = st.job_tokens[j];
    std::vector<int> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    if (j % 3 == 2) std::reverse(order.begin(), order.end());
    for (int row : order) {
      const size_t at = (static_cast<size_t>(st.key_offset[j]) + static_cast<size_t>(row) * P) * sizeof(float);
      ranges.push_back({static_cast<const char*>(host.ptr) + at, dkeys.get<char>() + at, P * sizeof(float)});
      ++copies_of_rows;
    }
  }
  ranges.push_back({host.ptr, dkeys.get(), 0});  // empty: skipped

  cudaStream_t copy_stream = nullptr, compute_stream = nullptr;
  cudaEvent_t done = nullptr;
  KVFLOW_CUDA_OK(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  KVFLOW_CUDA_OK(cudaStreamCreateWithFlags(&compute_stream, cudaStreamNonBlocking));
  KVFLOW_CUDA_OK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  KVFLOW_CUDA_OK(cuda::PrefetchToDevice(ranges.data(), static_cast<int>(ranges.size()), copy_stream, done));
  KVFLOW_CUDA_OK(cuda::WaitForPrefetch(compute_stream, done));
  KVFLOW_CUDA_OK(cuda::ScorePartialKeys(djobs.get<cuda::PartialKeyScoreJob>(), static_cast<int>(jobs.size()),
                                        st.max_tokens, kGroup, P, compute_stream));
  KVFLOW_CUDA_OK(cudaStreamSynchronize(compute_stream));  // the test's own wait, to read the result
  EXPECT_EQ(cudaEventQuery(done), cudaSuccess) << "the compute stream ran before the prefetch completed";

  Deviation dev;
  CheckScores(st, P, dscores.Download<float>(), dev);
  const std::vector<float> arrived = dkeys.Download<float>();
  EXPECT_EQ(0, std::memcmp(arrived.data(), st.keys.data(), key_bytes)) << "a stale or missing range on the device";
  std::printf("  prefetch: %zu row ranges + 1 stale range on a copy stream, compute stream waits on the event: "
              "scores max|d| = %.3g  max rel = %.3g%s\n",
              copies_of_rows, dev.max_abs, dev.max_rel, test::IsEmulator() ? "  [emulator]" : "");
  EXPECT_LE(dev.max_rel, 1e-5);
  cudaEventDestroy(done);
  cudaStreamDestroy(compute_stream);
  cudaStreamDestroy(copy_stream);
}

// The later copies win, contiguous rows merge, empty ranges are skipped, and the scores read the
// keys that arrived (meaningful on the emulator too).
TEST(InfiniGenScore, PrefetchedRangesLandInOrder) {
  KVFLOW_SKIP_WITHOUT_GPU();
  RunPrefetchThenScore();
}

// The compute stream does not read before the copies on the other stream complete. GPU only: the
// emulator completes every copy at once, so there it could not fail.
TEST(InfiniGenScore, PrefetchArrivesBeforeTheComputeStreamReads) {
  KVFLOW_SKIP_WITHOUT_GPU();
  if (test::IsEmulator()) GTEST_SKIP() << "GPU only: the emulator's copies complete at once, so no race can show";
  RunPrefetchThenScore();
}

TEST(InfiniGenScore, RejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer buf(4096);
  cuda::SkewPartialKeysArgs a;
  a.dtype = DType::kF16;
  a.key_cache = buf.get();
  a.slots = buf.get<int64_t>();
  a.jobs = buf.get<cuda::InfiniGenSkewJob>();
  a.num_jobs = 1;
  a.max_job_slots = 1;
  a.num_kv_heads = 2;
  a.head_dim = 128;
  a.block_size = 16;
  a.num_partial_columns = 39;
  cuda::SkewPartialKeysArgs b = a;
  b.head_dim = 512;
  EXPECT_EQ(cuda::SkewPartialKeys(b, nullptr), cuda::kInvalidValue);
  b = a;
  b.num_partial_columns = 129;  // more columns than the head has
  EXPECT_EQ(cuda::SkewPartialKeys(b, nullptr), cuda::kInvalidValue);
  b = a;
  b.head_dim = 256;
  b.num_partial_columns = 256;  // A's columns do not fit in shared memory
  EXPECT_EQ(cuda::SkewPartialKeys(b, nullptr), cuda::kInvalidValue);
  b = a;
  b.slots = nullptr;
  EXPECT_EQ(cuda::SkewPartialKeys(b, nullptr), cuda::kInvalidValue);
  b = a;
  b.dtype = static_cast<DType>(3);
  EXPECT_EQ(cuda::SkewPartialKeys(b, nullptr), cuda::kInvalidValue);
  b = a;
  b.max_job_slots = 0;  // nothing to skew
  EXPECT_EQ(cuda::SkewPartialKeys(b, nullptr), 0);

  cuda::SkewPartialQueriesArgs q;
  q.dtype = DType::kBF16;
  q.rows = buf.get();
  q.row_stride = 6 * 64;
  q.num_rows = 1;
  q.num_heads = 6;
  q.num_kv_heads = 4;  // does not divide the heads
  q.head_dim = 64;
  q.num_partial_columns = 20;
  q.matrices = buf.get<float>();
  q.columns = buf.get<int32_t>();
  q.out = buf.get<float>();
  EXPECT_EQ(cuda::SkewPartialQueries(q, nullptr), cuda::kInvalidValue);
  q.num_kv_heads = 2;
  q.row_stride = 100;  // shorter than the heads
  EXPECT_EQ(cuda::SkewPartialQueries(q, nullptr), cuda::kInvalidValue);
  q.row_stride = 6 * 64;
  q.out = nullptr;
  EXPECT_EQ(cuda::SkewPartialQueries(q, nullptr), cuda::kInvalidValue);
  q.num_rows = 0;  // nothing to skew
  EXPECT_EQ(cuda::SkewPartialQueries(q, nullptr), 0);

  const auto* jobs = buf.get<cuda::PartialKeyScoreJob>();
  EXPECT_EQ(cuda::ScorePartialKeys(jobs, 1, 10, 0, 39, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::ScorePartialKeys(jobs, 1, 10, 3, 1024, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::ScorePartialKeys(nullptr, 1, 10, 3, 39, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::ScorePartialKeys(nullptr, 0, 10, 3, 39, nullptr), 0);

  cuda::SelectSpeculatedTokensArgs s;
  s.jobs = buf.get<cuda::SpeculationSelectJob>();
  s.num_jobs = 1;
  s.num_kv_heads = 0;
  s.head_counts = buf.get<int32_t>();
  EXPECT_EQ(cuda::SelectSpeculatedTokens(s, nullptr), cuda::kInvalidValue);
  s.num_kv_heads = 2;
  s.head_counts = nullptr;
  EXPECT_EQ(cuda::SelectSpeculatedTokens(s, nullptr), cuda::kInvalidValue);
  s.num_jobs = 0;
  EXPECT_EQ(cuda::SelectSpeculatedTokens(s, nullptr), 0);

  const auto* gather = buf.get<cuda::SelectedKvGatherJob>();
  EXPECT_EQ(cuda::GatherSelectedKv(DType::kF16, buf.get(), buf.get(), gather, 1, buf.get(), nullptr, 2, 64, 16,
                                   nullptr),
            cuda::kInvalidValue);
  EXPECT_EQ(cuda::GatherSelectedKv(DType::kF16, buf.get(), buf.get(), gather, 1, buf.get(), buf.get(), 0, 64, 16,
                                   nullptr),
            cuda::kInvalidValue);

  cuda::HostToDeviceRange r{nullptr, buf.get(), 16};
  cudaEvent_t e = nullptr;
  KVFLOW_CUDA_OK(cudaEventCreate(&e));
  EXPECT_EQ(cuda::PrefetchToDevice(&r, 1, nullptr, e), cuda::kInvalidValue);  // no host source
  EXPECT_EQ(cuda::PrefetchToDevice(&r, 1, nullptr, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::PrefetchToDevice(nullptr, 0, nullptr, e), 0);  // nothing to copy: only the event
  EXPECT_EQ(cuda::WaitForPrefetch(nullptr, e), 0);
  EXPECT_EQ(cuda::WaitForPrefetch(nullptr, nullptr), cuda::kInvalidValue);
  cudaEventDestroy(e);
}

}  // namespace
}  // namespace kvflow
