// The mixture-of-experts kernels (kernels/moe.cu) against plain host references on fresh random
// inputs:
//   - routing: the same experts as a sort of the fp32 softmax (ties to the lower expert), weights
//     within 1e-6 relative (the sums run in another order);
//   - grouping: every pair exactly once, in its expert's run, runs in expert order and padded to
//     whole tiles with -1, the tile count exact;
//   - the grouped GEMM: against a double-precision product of the same rounded inputs, fp16 within
//     2e-3 and bf16 within 1e-2 of the output scale (one rounding of the output), for both tile
//     heights, gathered (in_row_divisor = k) and direct rows, N and K off the tile sizes;
//   - the combine, with and without Qwen2-MoE's gated shared expert.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "moe.h"

namespace kvflow {
namespace {

using cuda::DType;

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routed ReferenceRoute(const std::vector<float>& logits, int tokens, int E, int k, bool renormalize) {
  Routed r;
  for (int t = 0; t < tokens; ++t) {
    const float* row = &logits[static_cast<size_t>(t) * E];
    const float m = *std::max_element(row, row + E);
    std::vector<double> p(static_cast<size_t>(E));
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += p[e] = std::exp(static_cast<double>(row[e]) - m);
    std::vector<int> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
    double chosen = 0.0;
    for (int j = 0; j < k; ++j) chosen += p[order[j]] / sum;
    for (int j = 0; j < k; ++j) {
      r.ids.push_back(order[j]);
      r.weights.push_back(static_cast<float>(renormalize ? p[order[j]] / sum / chosen : p[order[j]] / sum));
    }
  }
  return r;
}

void RunRoute(int tokens, int E, int k, bool renormalize, std::mt19937& rng) {
  std::vector<float> logits(static_cast<size_t>(tokens) * E);
  test::FillNormal(logits, rng, 2.0f);
  const Routed ref = ReferenceRoute(logits, tokens, E, k, renormalize);
  test::DeviceBuffer dl = test::DeviceBuffer::From(logits);
  test::DeviceBuffer dids(ref.ids.size() * 4), dw(ref.weights.size() * 4);
  dids.Poison();
  dw.Poison();
  KVFLOW_CUDA_OK(cuda::MoeRouteTopK(dl.get<float>(), tokens, E, k, renormalize, dids.get<int32_t>(), dw.get<float>(),
                                    nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const std::string what = "route T" + std::to_string(tokens) + " E" + std::to_string(E) + " k" + std::to_string(k) +
                           (renormalize ? " renormalized" : "");
  EXPECT_EQ(dids.Download<int32_t>(), ref.ids) << what;
  test::ExpectClose(what, dw.Download<float>(), ref.weights, 1e-6, 1e-5);
}

TEST(Moe, RouteTopKMatchesSortedSoftmax) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(71);
  // Mixtral (8, top 2), Qwen2-MoE (60, top 4), OLMoE (64, top 8), Qwen3-MoE (128, top 8), and the
  // limits (1000 experts, top 32; a single expert).
  RunRoute(37, 8, 2, true, rng);
  RunRoute(19, 60, 4, false, rng);
  RunRoute(33, 64, 8, false, rng);
  RunRoute(9, 128, 8, true, rng);
  RunRoute(3, 1000, 32, true, rng);
  RunRoute(5, 1, 1, true, rng);
}

TEST(Moe, RouteTopKBreaksTiesToTheLowerExpert) {
  KVFLOW_SKIP_WITHOUT_GPU();
  // Experts 3, 40 and 77 tie for the top (across lanes and within lane 8 for 40 = 8 + 32), 5 and 69
  // tie next (the same lane): the order is 3, 40, 77, 5, 69.
  const int E = 96, k = 5;
  std::vector<float> logits(E, -1.0f);
  logits[77] = logits[40] = logits[3] = 2.0f;
  logits[69] = logits[5] = 1.5f;
  test::DeviceBuffer dl = test::DeviceBuffer::From(logits), dids(k * 4), dw(k * 4);
  KVFLOW_CUDA_OK(cuda::MoeRouteTopK(dl.get<float>(), 1, E, k, false, dids.get<int32_t>(), dw.get<float>(), nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(dids.Download<int32_t>(), (std::vector<int32_t>{3, 40, 77, 5, 69}));
  const std::vector<float> w = dw.Download<float>();
  EXPECT_EQ(w[0], w[1]);
  EXPECT_EQ(w[1], w[2]);
  EXPECT_EQ(w[3], w[4]);
  EXPECT_GT(w[2], w[3]);
}

TEST(Moe, RouteTopKRefusesImpossibleArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer d(64);
  EXPECT_NE(cuda::MoeRouteTopK(d.get<float>(), 1, 8, 9, true, d.get<int32_t>(), d.get<float>(), nullptr), 0);
  EXPECT_NE(cuda::MoeRouteTopK(d.get<float>(), 1, cuda::kMoeMaxExperts + 1, 2, true, d.get<int32_t>(), d.get<float>(),
                               nullptr),
            0);
  EXPECT_NE(cuda::MoeRouteTopK(d.get<float>(), 1, 64, 33, true, d.get<int32_t>(), d.get<float>(), nullptr), 0);
  EXPECT_EQ(cuda::MoeRouteTopK(d.get<float>(), 0, 8, 2, true, d.get<int32_t>(), d.get<float>(), nullptr), 0);
}

// The grouping of `ids` (num_pairs entries) as the device made it, checked against its contract.
struct Grouping {
  std::vector<int32_t> sorted, tile_expert;
  int num_tiles = 0;
};

Grouping RunGroup(const std::vector<int32_t>& ids, int E, int tile_rows) {
  const int pairs = static_cast<int>(ids.size());
  const int64_t capacity = cuda::MoeSortedCapacity(pairs, E, tile_rows);
  test::DeviceBuffer dids = test::DeviceBuffer::From(ids), dsorted(static_cast<size_t>(capacity) * 4),
                     dtiles(static_cast<size_t>(cuda::MoeMaxTiles(pairs, E, tile_rows)) * 4), dcount(4);
  dsorted.Poison();
  dtiles.Poison();
  dcount.Poison();
  EXPECT_EQ(cuda::MoeGroupByExpert(dids.get<int32_t>(), pairs, E, tile_rows, dsorted.get<int32_t>(),
                                   dtiles.get<int32_t>(), dcount.get<int32_t>(), nullptr),
            0);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Grouping g;
  g.sorted = dsorted.Download<int32_t>();
  g.tile_expert = dtiles.Download<int32_t>();
  g.num_tiles = dcount.Download<int32_t>()[0];
  return g;
}

void CheckGrouping(const std::vector<int32_t>& ids, int E, int tile_rows, const Grouping& g) {
  std::vector<int> count(static_cast<size_t>(E), 0);
  for (int32_t e : ids) ++count[e];
  int want_tiles = 0;
  for (int c : count) want_tiles += (c + tile_rows - 1) / tile_rows;
  ASSERT_EQ(g.num_tiles, want_tiles);
  std::vector<int> seen(ids.size(), 0);
  int previous_expert = -1;
  for (int i = 0; i < g.num_tiles; ++i) {
    const int e = g.tile_expert[i];
    ASSERT_TRUE(e >= 0 && e < E) << "tile " << i;
    EXPECT_GE(e, previous_expert) << "runs in expert order";
    previous_expert = e;
    bool padding = false;
    for (int r = 0; r < tile_rows; ++r) {
      const int32_t p = g.sorted[static_cast<size_t>(i) * tile_rows + r];
      if (p < 0) {
        EXPECT_EQ(p, -1);
        padding = true;
        continue;
      }
      EXPECT_FALSE(padding) << "tile " << i << ": a pair after padding";
      ASSERT_LT(p, static_cast<int32_t>(ids.size()));
      EXPECT_EQ(ids[p], e) << "pair " << p << " in expert " << e << "'s run";
      ++seen[p];
    }
  }
  for (size_t p = 0; p < ids.size(); ++p) EXPECT_EQ(seen[p], 1) << "pair " << p;
}

TEST(Moe, GroupByExpertSortsEveryPairIntoPaddedRuns) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(72);
  struct Case {
    int pairs, experts;
  };
  // Decode-sized (fewer pairs than experts), prefill-sized, skewed, more than the block's threads.
  for (const Case c : {Case{8, 64}, Case{300, 8}, Case{1000, 60}, Case{5000, 128}, Case{3, 1000}}) {
    for (int tile : {cuda::kMoeSmallTile, cuda::kMoeLargeTile}) {
      std::vector<int32_t> ids(static_cast<size_t>(c.pairs));
      std::uniform_int_distribution<int> any(0, c.experts - 1);
      for (auto& e : ids) e = any(rng) % (rng() % 3 == 0 ? std::min(c.experts, 3) : c.experts);  // skewed
      SCOPED_TRACE("pairs " + std::to_string(c.pairs) + " experts " + std::to_string(c.experts) + " tile " +
                   std::to_string(tile));
      CheckGrouping(ids, c.experts, tile, RunGroup(ids, c.experts, tile));
    }
  }
  // No pairs at all: no tiles.
  EXPECT_EQ(RunGroup({}, 16, cuda::kMoeSmallTile).num_tiles, 0);
}

void RunGroupedGemm(DType t, int tokens, int k, int E, int N, int K, bool gathered, int tile, std::mt19937& rng) {
  const int pairs = tokens * k;
  const int in_rows = gathered ? tokens : pairs;
  std::vector<float> in(static_cast<size_t>(in_rows) * K), w(static_cast<size_t>(E) * N * K);
  test::FillNormal(in, rng, 1.0f);
  test::FillNormal(w, rng, 1.0f / std::sqrt(static_cast<float>(K)));
  const std::vector<uint8_t> in_bytes = test::ToDeviceBytes(in, t), w_bytes = test::ToDeviceBytes(w, t);
  std::vector<int32_t> ids(static_cast<size_t>(pairs));
  std::uniform_int_distribution<int> any(0, E - 1);
  for (auto& e : ids) e = any(rng);
  const Grouping g = RunGroup(ids, E, tile);
  ASSERT_GT(g.num_tiles, 0);

  std::vector<float> ref(static_cast<size_t>(pairs) * N);
  for (int p = 0; p < pairs; ++p) {
    const float* x = &in[static_cast<size_t>(gathered ? p / k : p) * K];
    for (int n = 0; n < N; ++n) {
      const float* row = &w[(static_cast<size_t>(ids[p]) * N + n) * K];
      double s = 0.0;
      for (int j = 0; j < K; ++j) s += static_cast<double>(x[j]) * row[j];
      ref[static_cast<size_t>(p) * N + n] = static_cast<float>(s);
    }
  }
  const int max_tiles = static_cast<int>(cuda::MoeMaxTiles(pairs, E, tile));
  test::DeviceBuffer din = test::DeviceBuffer::From(in_bytes), dw = test::DeviceBuffer::From(w_bytes),
                     dout(ref.size() * 2), dsorted = test::DeviceBuffer::From(g.sorted),
                     dtiles = test::DeviceBuffer::From(g.tile_expert),
                     dcount = test::DeviceBuffer::From(std::vector<int32_t>{g.num_tiles});
  dout.Poison();
  KVFLOW_CUDA_OK(cuda::MoeGroupedGemm(t, din.get(), gathered ? k : 1, dw.get(), dout.get(), N, K,
                                      dsorted.get<int32_t>(), dtiles.get<int32_t>(), dcount.get<int32_t>(), max_tiles,
                                      tile, nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  double scale = 0.0;
  for (float r : ref) scale = std::max(scale, static_cast<double>(std::fabs(r)));
  const double rtol = t == DType::kF16 ? 2e-3 : 1e-2;
  test::ExpectCloseNormwise(std::string("grouped gemm ") + cuda::DTypeName(t) + " T" + std::to_string(tokens) + " k" +
                                std::to_string(k) + " E" + std::to_string(E) + " N" + std::to_string(N) + " K" +
                                std::to_string(K) + (gathered ? " gathered" : "") + " tile" + std::to_string(tile),
                            test::FromDeviceBytes(dout.Download<uint8_t>(), t), ref, rtol * scale, rtol);
}

TEST(Moe, GroupedGemmMatchesHostProduct) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(73);
  for (DType t : {DType::kF16, DType::kBF16}) {
    // Decode (a few tokens over many experts), the gate|up of a tiny model, N and K off the tiles.
    RunGroupedGemm(t, 3, 2, 8, 64, 32, true, cuda::kMoeSmallTile, rng);
    RunGroupedGemm(t, 5, 4, 16, 200, 136, true, cuda::kMoeSmallTile, rng);
    RunGroupedGemm(t, 40, 2, 4, 136, 96, false, cuda::kMoeLargeTile, rng);
    RunGroupedGemm(t, test::IsEmulator() ? 70 : 700, 8, 64, 256, 128, true, cuda::kMoeLargeTile, rng);
  }
  if (!test::IsEmulator()) {
    // Qwen3-30B-A3B's gate|up (2 x 768 of 2048) and down, a prefill batch.
    RunGroupedGemm(DType::kBF16, 512, 8, 128, 1536, 2048, true, cuda::kMoeLargeTile, rng);
    RunGroupedGemm(DType::kBF16, 512, 8, 128, 2048, 768, false, cuda::kMoeLargeTile, rng);
  }
}

TEST(Moe, GroupedGemmRefusesImpossibleArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer d(1024);
  auto call = [&](DType t, int N, int K, int tile) {
    return cuda::MoeGroupedGemm(t, d.get(), 1, d.get(), d.get(), N, K, d.get<int32_t>(), d.get<int32_t>(),
                                d.get<int32_t>(), 1, tile, nullptr);
  };
  EXPECT_NE(call(DType::kF16, 60, 64, cuda::kMoeSmallTile), 0);  // N % 8
  EXPECT_NE(call(DType::kF16, 64, 12, cuda::kMoeSmallTile), 0);  // K % 8
  EXPECT_NE(call(DType::kF16, 64, 64, 32), 0);                   // no such tile
  EXPECT_NE(call(DType::kF32, 64, 64, cuda::kMoeSmallTile), 0);  // tensor cores: 16-bit only
}

void RunCombine(DType t, int tokens, int k, int H, bool shared, std::mt19937& rng) {
  std::vector<float> eo(static_cast<size_t>(tokens) * k * H), so(static_cast<size_t>(tokens) * H),
      weights(static_cast<size_t>(tokens) * k), gate(static_cast<size_t>(tokens));
  test::FillNormal(eo, rng, 1.0f);
  test::FillNormal(so, rng, 1.0f);
  test::FillNormal(gate, rng, 2.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (float& w : weights) w = u(rng);
  const std::vector<uint8_t> eo_bytes = test::ToDeviceBytes(eo, t), so_bytes = test::ToDeviceBytes(so, t);
  std::vector<float> ref(static_cast<size_t>(tokens) * H);
  for (int tk = 0; tk < tokens; ++tk) {
    const double g = 1.0 / (1.0 + std::exp(-static_cast<double>(gate[tk])));
    for (int h = 0; h < H; ++h) {
      double s = 0.0;
      for (int j = 0; j < k; ++j) s += static_cast<double>(weights[tk * k + j]) * eo[(static_cast<size_t>(tk) * k + j) * H + h];
      if (shared) s += g * so[static_cast<size_t>(tk) * H + h];
      ref[static_cast<size_t>(tk) * H + h] = static_cast<float>(s);
    }
  }
  test::DeviceBuffer deo = test::DeviceBuffer::From(eo_bytes), dso = test::DeviceBuffer::From(so_bytes),
                     dw = test::DeviceBuffer::From(weights), dg = test::DeviceBuffer::From(gate),
                     dout(ref.size() * cuda::DTypeSize(t));
  dout.Poison();
  KVFLOW_CUDA_OK(cuda::MoeCombine(t, deo.get(), dw.get<float>(), tokens, k, H, shared ? dso.get() : nullptr,
                                  shared ? dg.get<float>() : nullptr, dout.get(), nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const double rtol = t == DType::kF32 ? 1e-5 : t == DType::kF16 ? 2e-3 : 1e-2;
  double scale = 0.0;
  for (float r : ref) scale = std::max(scale, static_cast<double>(std::fabs(r)));
  test::ExpectCloseNormwise(std::string("combine ") + cuda::DTypeName(t) + " T" + std::to_string(tokens) + " k" +
                                std::to_string(k) + " H" + std::to_string(H) + (shared ? " shared" : ""),
                            test::FromDeviceBytes(dout.Download<uint8_t>(), t), ref, rtol * scale, rtol);
}

TEST(Moe, CombineMatchesWeightedSum) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(74);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    RunCombine(t, 7, 2, 96, false, rng);
    RunCombine(t, 5, 4, 300, true, rng);
    RunCombine(t, 1, 8, 2048, false, rng);
  }
}

}  // namespace
}  // namespace kvflow
