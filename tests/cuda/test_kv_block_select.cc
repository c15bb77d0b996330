// TriForce's chunk scoring and selection kernels (kernels/kv_block_select.cu) against the CPU
// reference (cpu::ScoreKvBlocks / cpu::SelectTopKvBlocks) on fresh random inputs.
//
// Scoring: fp16 and bf16 K pools and queries (random normal, never zero); the CPU reference reads
// the same 16-bit values widened to fp32, so only the order of the fp32 sums differs (the dot
// products' head_dim terms, the softmax denominators; the CPU sums exps in double). The mean keys
// are computed in the same order on both sides. Scores are sums of up to num_heads probabilities;
// bound: 1e-5 x max(1, |score|). The score buffer starts non-zero (the kernels add into it) and
// entries between jobs must stay untouched.
// Selection: the chosen indices must be identical, ties (equal scores, +0 and -0) and the clamping
// of keep_first / keep_last / k included.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kv_block_select.h"
#include "gpu_test_util.h"
#include "kv_block_select.h"

namespace kvflow {
namespace {

using cuda::DType;

struct ScoreCase {
  int num_heads, num_kv_heads, head_dim, block_size, pool_blocks;
  std::vector<int> job_blocks;   // blocks per job (0 allowed)
  std::vector<int> last_tokens;  // valid tokens of each job's last block (1..block_size)
};

// Uploads the scoring jobs the way CudaBackend does: one flattened block list, each entry naming
// its job, each job its first entry.
struct DeviceScoreJobs {
  test::DeviceBuffer jobs, block_ids, block_jobs;
  int total_blocks = 0;
};
DeviceScoreJobs UploadScoreJobs(const std::vector<KvBlockScoreJob>& jobs) {
  std::vector<cuda::KvBlockScoreJobDesc> desc;
  std::vector<int32_t> ids, owners;
  for (size_t j = 0; j < jobs.size(); ++j) {
    cuda::KvBlockScoreJobDesc d;
    d.score_offset = jobs[j].score_offset;
    d.row = jobs[j].row;
    d.num_blocks = static_cast<int32_t>(jobs[j].blocks.size());
    d.num_tokens = jobs[j].num_tokens;
    d.first_block = static_cast<int32_t>(ids.size());
    desc.push_back(d);
    for (BlockId b : jobs[j].blocks) {
      ids.push_back(b);
      owners.push_back(static_cast<int32_t>(j));
    }
  }
  DeviceScoreJobs out;
  out.jobs = test::DeviceBuffer::From(desc);
  out.block_ids = test::DeviceBuffer::From(ids);
  out.block_jobs = test::DeviceBuffer::From(owners);
  out.total_blocks = static_cast<int>(ids.size());
  return out;
}

void RunScore(DType t, const ScoreCase& c, std::mt19937& rng) {
  KvCacheLayout layout;
  layout.num_layers = 1;
  layout.num_blocks = c.pool_blocks;
  layout.num_kv_heads = c.num_kv_heads;
  layout.head_dim = c.head_dim;
  layout.block_size = c.block_size;
  // K pool: normal values kept away from zero, so an unread or zeroed block changes the result.
  std::vector<float> pool(layout.layer_stride());
  test::FillNormal(pool, rng);
  for (float& x : pool) x = x >= 0.0f ? x + 0.05f : x - 0.05f;
  const std::vector<uint8_t> pool_bytes = test::ToDeviceBytes(pool, t);  // rounds `pool` to the device's values

  // Query rows as in kQkv: the Q heads first, K/V heads after, so the row stride exceeds the Q width.
  const int rows = static_cast<int>(c.job_blocks.size()) + 2;
  const int64_t stride = static_cast<int64_t>(c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  std::vector<float> query(static_cast<size_t>(rows * stride));
  test::FillNormal(query, rng, 1.5f);
  const std::vector<uint8_t> query_bytes = test::ToDeviceBytes(query, t);

  // Jobs: distinct blocks of the pool in shuffled order, rows shuffled, a gap of untouched scores
  // between consecutive jobs' ranges.
  std::vector<BlockId> perm(static_cast<size_t>(c.pool_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int> job_rows(static_cast<size_t>(rows));
  std::iota(job_rows.begin(), job_rows.end(), 0);
  std::shuffle(job_rows.begin(), job_rows.end(), rng);
  std::vector<KvBlockScoreJob> jobs;
  size_t next = 0;
  int64_t offset = 3;
  for (size_t j = 0; j < c.job_blocks.size(); ++j) {
    KvBlockScoreJob job;
    job.row = job_rows[j];
    const int n = c.job_blocks[j];
    for (int b = 0; b < n; ++b) job.blocks.push_back(perm[next++ % perm.size()]);
    job.num_tokens = n == 0 ? 0 : (n - 1) * c.block_size + c.last_tokens[j];
    job.score_offset = offset;
    offset += n + 5;
    jobs.push_back(job);
  }
  std::vector<float> initial(static_cast<size_t>(offset));
  test::FillNormal(initial, rng, 0.5f);
  ASSERT_TRUE(cpu::ValidateKvBlockScoreJobs(jobs, layout, rows, offset).ok());

  // Two layers' worth of scoring into the same buffer (the second over the same K pool and query:
  // what matters is that it adds).
  std::vector<float> ref = initial;
  for (int layer = 0; layer < 2; ++layer) {
    cpu::ScoreKvBlocks(jobs, layout, c.num_heads, query.data(), stride, cpu::KvElement::kF32, pool.data(), ref);
  }

  test::DeviceBuffer dpool = test::DeviceBuffer::From(pool_bytes);
  test::DeviceBuffer dquery = test::DeviceBuffer::From(query_bytes);
  DeviceScoreJobs djobs = UploadScoreJobs(jobs);
  test::DeviceBuffer dlogits(static_cast<size_t>(c.num_heads) * std::max(djobs.total_blocks, 1) * sizeof(float));
  dlogits.Poison();  // scratch: every read entry must have been written by the first kernel
  std::vector<std::vector<float>> runs;
  for (int run = 0; run < 2; ++run) {
    test::DeviceBuffer dscores = test::DeviceBuffer::From(initial);
    cuda::KvBlockScoreArgs a;
    a.dtype = t;
    a.query = dquery.get();
    a.query_row_stride = stride;
    a.key_cache = dpool.get();
    a.jobs = djobs.jobs.get<cuda::KvBlockScoreJobDesc>();
    a.num_jobs = static_cast<int>(jobs.size());
    a.block_ids = djobs.block_ids.get<int32_t>();
    a.block_jobs = djobs.block_jobs.get<int32_t>();
    a.total_blocks = djobs.total_blocks;
    a.num_heads = c.num_heads;
    a.num_kv_heads = c.num_kv_heads;
    a.head_dim = c.head_dim;
    a.block_size = c.block_size;
    a.logits = dlogits.get<float>();
    a.scores = dscores.get<float>();
    for (int layer = 0; layer < 2; ++layer) KVFLOW_CUDA_OK(cuda::ScoreKvBlocks(a, nullptr));
    KVFLOW_CUDA_OK(cudaDeviceSynchronize());
    runs.push_back(dscores.Download<float>());
  }
  const std::vector<float>& got = runs[0];
  // Deterministic: no atomics, so a rerun gives the same bits.
  ASSERT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), got.size() * sizeof(float))) << "scores not reproducible";

  std::vector<bool> covered(got.size(), false);
  for (const KvBlockScoreJob& job : jobs) {
    for (size_t b = 0; b < job.blocks.size(); ++b) covered[static_cast<size_t>(job.score_offset) + b] = true;
  }
  double max_abs = 0.0, max_rel = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!covered[i]) {
      ASSERT_EQ(got[i], initial[i]) << "score " << i << " outside every job was changed";
      continue;
    }
    const double d = std::fabs(double(got[i]) - ref[i]);
    const double rel = d / std::max(1.0, std::fabs(double(ref[i])));
    max_abs = std::max(max_abs, d);
    max_rel = std::max(max_rel, rel);
    ASSERT_LE(rel, 1e-5) << DTypeName(t) << " heads " << c.num_heads << "/" << c.num_kv_heads << " d " << c.head_dim
                         << " score " << i << ": got " << got[i] << " want " << ref[i];
  }
  // The scores moved: every job with blocks added num_heads of probability mass per layer.
  for (const KvBlockScoreJob& job : jobs) {
    double added = 0.0;
    for (size_t b = 0; b < job.blocks.size(); ++b) {
      const size_t i = static_cast<size_t>(job.score_offset) + b;
      added += double(got[i]) - initial[i];
    }
    EXPECT_NEAR(added, job.blocks.empty() ? 0.0 : 2.0 * c.num_heads, 1e-3);
  }
  std::printf("  score %-4s heads %2d/%d d %3d bs %2d blocks %4d: max|d| = %.3g  max rel = %.3g (bound 1e-5)%s\n",
              DTypeName(t), c.num_heads, c.num_kv_heads, c.head_dim, c.block_size, djobs.total_blocks, max_abs,
              max_rel, test::IsEmulator() ? "  [emulator]" : "");
}

TEST(KvBlockSelect, ScoresMatchCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(2027);
  const bool emu = test::IsEmulator();
  const int big = emu ? 150 : 2000;
  const std::vector<ScoreCase> cases = {
      // GQA 9 query heads over 3 KV heads, head_dim 64: partial, full and single-token last blocks,
      // a job of one block, a job of none.
      {9, 3, 64, 16, 96, {7, 1, 0, 12, 5}, {3, 16, 1, 1, 9}},
      // head_dim 40 (threads past head_dim idle), MHA, block size 8.
      {4, 4, 40, 8, 64, {10, 2, 6}, {8, 5, 1}},
      // head_dim 128, 8-way groups, one long job (many blocks per softmax), block size 32.
      {16, 2, 128, 32, big + 20, {big, 3}, {17, 32}},
      // head_dim 256 (two elements of d per thread), one query head.
      {1, 1, 256, 16, 20, {4, 9}, {16, 2}},
  };
  for (DType t : {DType::kF16, DType::kBF16}) {
    for (const ScoreCase& c : cases) {
      RunScore(t, c, rng);
      if (HasFatalFailure()) return;
    }
  }
}

// Runs both selections on the same scores and requires the same indices.
void ExpectSameSelection(const std::vector<KvBlockSelectJob>& jobs, const std::vector<float>& scores,
                         const std::string& what) {
  ASSERT_TRUE(cpu::ValidateKvBlockSelectJobs(jobs, static_cast<int64_t>(scores.size())).ok()) << what;
  std::vector<int32_t> want;
  cpu::SelectTopKvBlocks(jobs, scores, want);

  std::vector<cuda::KvBlockSelectJobDesc> desc;
  int32_t total = 0;
  for (const KvBlockSelectJob& j : jobs) {
    cuda::KvBlockSelectJobDesc d;
    d.score_offset = j.score_offset;
    d.num_blocks = j.num_blocks;
    d.keep_first = j.keep_first;
    d.keep_last = j.keep_last;
    d.k = j.k;
    d.out_offset = total;
    total += std::min(j.k, j.num_blocks);
    desc.push_back(d);
  }
  ASSERT_EQ(static_cast<size_t>(total), want.size()) << what;
  test::DeviceBuffer dscores = test::DeviceBuffer::From(scores);
  test::DeviceBuffer djobs = test::DeviceBuffer::From(desc);
  test::DeviceBuffer dout((static_cast<size_t>(total) + 1) * sizeof(int32_t));
  dout.Poison();  // -1 everywhere: an index the kernel skips shows up
  KVFLOW_CUDA_OK(cuda::SelectTopKvBlocks(dscores.get<float>(), djobs.get<cuda::KvBlockSelectJobDesc>(),
                                         static_cast<int>(jobs.size()), dout.get<int32_t>(), nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  std::vector<int32_t> got = dout.Download<int32_t>();
  got.resize(static_cast<size_t>(total));
  ASSERT_EQ(got, want) << what;
}

TEST(KvBlockSelect, SelectionEqualsCpuIncludingTiesAndEdgeCases) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(77);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> level(0, 3);
  const int big = test::IsEmulator() ? 700 : 6000;

  // Scores of one job: distinct, heavily tied (four levels), all equal, or +0/-0 mixed.
  enum Kind { kDistinct, kTied, kEqual, kSignedZeros };
  auto make_scores = [&](int n, Kind kind) {
    std::vector<float> s(static_cast<size_t>(n));
    for (float& x : s) {
      switch (kind) {
        case kDistinct: x = normal(rng); break;
        case kTied: x = 0.25f * static_cast<float>(level(rng)); break;
        case kEqual: x = 1.5f; break;
        case kSignedZeros: x = level(rng) % 2 ? 0.0f : -0.0f; break;
      }
    }
    return s;
  };

  // Every clamping edge of (num_blocks, k, keep_first, keep_last), each on every kind of scores,
  // several jobs per launch at scattered offsets.
  struct Edge {
    int n, k, first, last;
  };
  const std::vector<Edge> edges = {
      {0, 5, 1, 1},    {0, 0, 0, 0},   {1, 1, 1, 1},    {1, 0, 0, 0},   {6, 10, 1, 2},  {6, 6, 0, 0},
      {10, 4, 2, 2},   {10, 4, 3, 3},  {10, 4, 9, 9},   {10, 4, 0, 9},  {10, 3, 0, 0},  {10, 1, 0, 1},
      {33, 7, 1, 1},   {40, 39, 0, 0}, {300, 17, 2, 3}, {300, 299, 1, 1}, {257, 256, 0, 0}, {513, 300, 4, 0},
      {big, 64, 1, 4}, {big, big / 2, 16, 16},
  };
  for (Kind kind : {kDistinct, kTied, kEqual, kSignedZeros}) {
    std::vector<float> scores(5, 9.0f);  // leading entries no job reads (a high score to catch a stray read)
    std::vector<KvBlockSelectJob> jobs;
    for (const Edge& e : edges) {
      KvBlockSelectJob j;
      j.score_offset = static_cast<int64_t>(scores.size());
      j.num_blocks = e.n;
      j.k = e.k;
      j.keep_first = e.first;
      j.keep_last = e.last;
      jobs.push_back(j);
      const std::vector<float> s = make_scores(e.n, kind);
      scores.insert(scores.end(), s.begin(), s.end());
      scores.insert(scores.end(), 3, 100.0f);  // gap between jobs
    }
    ExpectSameSelection(jobs, scores, "scores kind " + std::to_string(kind));
    if (HasFatalFailure()) return;
  }
  // Random jobs: random sizes and parameters, tied scores.
  std::uniform_int_distribution<int> size(0, 200);
  for (int trial = 0; trial < 5; ++trial) {
    std::vector<float> scores;
    std::vector<KvBlockSelectJob> jobs;
    for (int j = 0; j < 12; ++j) {
      KvBlockSelectJob job;
      job.score_offset = static_cast<int64_t>(scores.size());
      job.num_blocks = size(rng);
      job.k = std::uniform_int_distribution<int>(0, job.num_blocks + 3)(rng);
      job.keep_first = std::uniform_int_distribution<int>(0, 4)(rng);
      job.keep_last = std::uniform_int_distribution<int>(0, 4)(rng);
      jobs.push_back(job);
      const std::vector<float> s = make_scores(job.num_blocks, trial % 2 ? kTied : kDistinct);
      scores.insert(scores.end(), s.begin(), s.end());
    }
    ExpectSameSelection(jobs, scores, "random trial " + std::to_string(trial));
    if (HasFatalFailure()) return;
  }
  // Overlapping jobs read the same scores (selection only reads them).
  std::vector<float> shared = make_scores(50, kTied);
  std::vector<KvBlockSelectJob> overlapping = {{0, 50, 1, 1, 10}, {10, 40, 0, 2, 5}, {0, 50, 0, 0, 50}};
  ExpectSameSelection(overlapping, shared, "overlapping jobs");
}

TEST(KvBlockSelect, RejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer buf(4096);
  cuda::KvBlockScoreArgs a;
  a.dtype = DType::kF16;
  a.query = a.key_cache = buf.get();
  a.jobs = buf.get<cuda::KvBlockScoreJobDesc>();
  a.block_ids = a.block_jobs = buf.get<int32_t>();
  a.logits = a.scores = buf.get<float>();
  a.num_jobs = 1;
  a.total_blocks = 1;
  a.num_heads = 4;
  a.num_kv_heads = 2;
  a.head_dim = 64;
  a.block_size = 16;
  a.query_row_stride = 4 * 64;
  cuda::KvBlockScoreArgs b = a;
  b.num_heads = 3;  // not a multiple of the kv heads
  EXPECT_EQ(cuda::ScoreKvBlocks(b, nullptr), cuda::kInvalidValue);
  b = a;
  b.head_dim = 512;  // beyond the kernel's two elements per thread
  EXPECT_EQ(cuda::ScoreKvBlocks(b, nullptr), cuda::kInvalidValue);
  b = a;
  b.query_row_stride = 100;  // shorter than the Q heads
  EXPECT_EQ(cuda::ScoreKvBlocks(b, nullptr), cuda::kInvalidValue);
  b = a;
  b.scores = nullptr;
  EXPECT_EQ(cuda::ScoreKvBlocks(b, nullptr), cuda::kInvalidValue);
  b = a;
  b.dtype = static_cast<DType>(3);
  EXPECT_EQ(cuda::ScoreKvBlocks(b, nullptr), cuda::kInvalidValue);
  b = a;
  b.total_blocks = 0;  // nothing to score
  EXPECT_EQ(cuda::ScoreKvBlocks(b, nullptr), 0);
  EXPECT_EQ(cuda::SelectTopKvBlocks(nullptr, nullptr, 0, nullptr, nullptr), 0);
  EXPECT_EQ(cuda::SelectTopKvBlocks(buf.get<float>(), nullptr, 1, buf.get<int32_t>(), nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::SelectTopKvBlocks(buf.get<float>(), nullptr, -1, buf.get<int32_t>(), nullptr),
            cuda::kInvalidValue);
}

}  // namespace
}  // namespace kvflow
