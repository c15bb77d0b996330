// The CPU attention's inner kernels (backend/cpu/attention_kernels.h) one by one, on every kernel
// set this machine runs (AVX-512, AVX2, portable): key packing with fp16 widening, scores and the
// weighted sum of values against double precision on fresh random inputs (fp16 and fp32 rows,
// several head sizes and row counts), and the property speculative decoding relies on: every path
// computes a score or an output element with the same chain of fused multiply-adds, so all three
// give the same bits, whatever the number of rows in the call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/attention_kernels.h"
#include "util/half.h"

namespace kvflow {
namespace {

constexpr int kChunk = cpu::kAttentionChunkKeys;
const char* const kIsas[] = {nullptr, "avx2", "portable"};

struct Inputs {
  int head_dim, rows, keys;
  std::vector<float> q, p;                  // queries [rows][D], weights [rows][kChunk]
  std::vector<uint16_t> k16, v16;           // keys and values as fp16, [keys][D]
  std::vector<float> k32, v32;              // the same values as fp32
  std::vector<const uint16_t*> krows16, vrows16;
  std::vector<const float*> krows32, vrows32;
  std::vector<uint16_t> zero16;
  std::vector<float> zero32;

  Inputs(int D, int r, int n, uint32_t seed) : head_dim(D), rows(r), keys(n), zero16(D, 0), zero32(D, 0.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    q.resize(static_cast<size_t>(r) * D);
    for (float& x : q) x = normal(rng);
    p.resize(static_cast<size_t>(r) * kChunk);
    for (float& x : p) x = std::abs(normal(rng));
    k16.resize(static_cast<size_t>(n) * D);
    v16.resize(k16.size());
    for (auto* pool : {&k16, &v16}) {
      for (uint16_t& x : *pool) x = FloatToHalfBits(normal(rng));
    }
    for (uint16_t x : k16) k32.push_back(HalfBitsToFloat(x));
    for (uint16_t x : v16) v32.push_back(HalfBitsToFloat(x));
    // Rows in a shuffled order, as a chunk's rows come from blocks anywhere in the pool; padded to
    // the chunk with the zero row.
    std::vector<int> order(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) order[static_cast<size_t>(j)] = j;
    std::shuffle(order.begin(), order.end(), rng);
    for (int j = 0; j < kChunk; ++j) {
      const bool real = j < n;
      const size_t at = real ? static_cast<size_t>(order[static_cast<size_t>(j)]) * D : 0;
      krows16.push_back(real ? &k16[at] : zero16.data());
      vrows16.push_back(real ? &v16[at] : zero16.data());
      krows32.push_back(real ? &k32[at] : zero32.data());
      vrows32.push_back(real ? &v32[at] : zero32.data());
    }
  }

  // Key j of the chunk in double (zero for padding).
  double Key(int j, int d) const { return j < keys ? krows32[static_cast<size_t>(j)][d] : 0.0; }
  double Value(int j, int d) const { return vrows32[static_cast<size_t>(j)][d]; }
};

struct Results {
  std::vector<float> scores16, scores32, out16, out32;
};

Results RunKernels(const Inputs& in, const cpu::AttentionKernels& k, float scale) {
  const int D = in.head_dim;
  Results r;
  std::vector<float> kt(static_cast<size_t>(kChunk) * D, NAN);
  r.scores16.assign(static_cast<size_t>(in.rows) * kChunk, NAN);
  k.pack_keys_f16(in.krows16.data(), D, kt.data());
  k.scores(in.q.data(), in.rows, kt.data(), D, scale, r.scores16.data(), kChunk);
  std::fill(kt.begin(), kt.end(), NAN);
  r.scores32.assign(r.scores16.size(), NAN);
  k.pack_keys_f32(in.krows32.data(), D, kt.data());
  k.scores(in.q.data(), in.rows, kt.data(), D, scale, r.scores32.data(), kChunk);
  // Outputs start from a nonzero state, as a running softmax's do after its first chunk.
  r.out16.resize(static_cast<size_t>(in.rows) * D);
  for (size_t i = 0; i < r.out16.size(); ++i) r.out16[i] = std::sin(static_cast<float>(i));
  r.out32 = r.out16;
  k.accumulate_f16(in.p.data(), in.rows, kChunk, in.vrows16.data(), in.keys, D, r.out16.data());
  k.accumulate_f32(in.p.data(), in.rows, kChunk, in.vrows32.data(), in.keys, D, r.out32.data());
  return r;
}

// head_dim, rows, keys: the 16-lane path's sizes, an 8-lane-only one (40), and row counts on
// either side of the kernels' register blocks (6 and 4 rows), a decode tile (3) and a full one (96).
struct Shape {
  int head_dim, rows, keys;
};
const Shape kShapes[] = {{64, 3, 64}, {64, 27, 64}, {64, 96, 37}, {128, 7, 64}, {40, 5, 50}, {64, 1, 1}, {80, 13, 64}};

TEST(AttentionKernels, EveryPathMatchesDoublePrecision) {
  uint32_t seed = 100;
  for (const char* isa : kIsas) {
    const char* previous = cpu::LimitAttentionIsa(isa);
    for (const Shape& shape : kShapes) {
      const cpu::AttentionKernels& k = cpu::SelectAttentionKernels(shape.head_dim);
      const Inputs in(shape.head_dim, shape.rows, shape.keys, ++seed);
      const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
      const Results got = RunKernels(in, k, scale);
      const int D = shape.head_dim;
      double score_err = 0.0, out_err = 0.0;
      for (int r = 0; r < shape.rows; ++r) {
        for (int j = 0; j < kChunk; ++j) {
          double dot = 0.0;
          for (int d = 0; d < D; ++d) dot += static_cast<double>(in.q[static_cast<size_t>(r) * D + d]) * in.Key(j, d);
          const double ref = dot * scale;
          for (const auto* s : {&got.scores16, &got.scores32}) {
            const float v = (*s)[static_cast<size_t>(r) * kChunk + j];
            ASSERT_TRUE(std::isfinite(v)) << k.isa << " left score " << r << "," << j << " unwritten";
            score_err = std::max(score_err, std::abs(v - ref));
          }
        }
        for (int d = 0; d < D; ++d) {
          double ref = std::sin(static_cast<float>(static_cast<size_t>(r) * D + d));
          for (int j = 0; j < shape.keys; ++j) ref += static_cast<double>(in.p[static_cast<size_t>(r) * kChunk + j]) * in.Value(j, d);
          for (const auto* o : {&got.out16, &got.out32}) {
            out_err = std::max(out_err, std::abs((*o)[static_cast<size_t>(r) * D + d] - ref) / (1.0 + std::abs(ref)));
          }
        }
      }
      std::printf("  %-8s head_dim %3d rows %2d keys %2d: score max |err| %.2e, output max rel err %.2e\n", k.isa, D,
                  shape.rows, shape.keys, score_err, out_err);
      EXPECT_LT(score_err, 1e-5) << k.isa << " head_dim " << D;
      EXPECT_LT(out_err, 1e-5) << k.isa << " head_dim " << D;
      // fp16 rows widened in the kernel give exactly what fp32 rows of the same values give.
      EXPECT_EQ(0, std::memcmp(got.scores16.data(), got.scores32.data(), got.scores16.size() * sizeof(float))) << k.isa;
      EXPECT_EQ(0, std::memcmp(got.out16.data(), got.out32.data(), got.out16.size() * sizeof(float))) << k.isa;
    }
    cpu::LimitAttentionIsa(previous);
  }
}

// One fused multiply-add chain per score and per output element on every path: the AVX-512, AVX2
// and portable kernels agree bit for bit, and a row's numbers do not depend on the rows beside it.
TEST(AttentionKernels, PathsAndRowCountsGiveTheSameBits) {
  for (const Shape& shape : kShapes) {
    const Inputs in(shape.head_dim, shape.rows, shape.keys, 7 + shape.rows);
    std::vector<Results> per_path;
    std::vector<const char*> names;
    for (const char* isa : kIsas) {
      const char* previous = cpu::LimitAttentionIsa(isa);
      const cpu::AttentionKernels& k = cpu::SelectAttentionKernels(shape.head_dim);
      names.push_back(k.isa);
      per_path.push_back(RunKernels(in, k, 0.125f));
      cpu::LimitAttentionIsa(previous);
    }
    for (size_t i = 1; i < per_path.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(per_path[0].scores16.data(), per_path[i].scores16.data(),
                               per_path[0].scores16.size() * sizeof(float)))
          << names[0] << " vs " << names[i] << " scores, head_dim " << shape.head_dim;
      EXPECT_EQ(0, std::memcmp(per_path[0].out16.data(), per_path[i].out16.data(), per_path[0].out16.size() * sizeof(float)))
          << names[0] << " vs " << names[i] << " outputs, head_dim " << shape.head_dim;
    }
    // Each row alone against the same row among all of them (the best path this CPU has).
    const cpu::AttentionKernels& k = cpu::SelectAttentionKernels(shape.head_dim);
    const int D = shape.head_dim;
    std::vector<float> kt(static_cast<size_t>(kChunk) * D);
    k.pack_keys_f16(in.krows16.data(), D, kt.data());
    for (int r = 0; r < shape.rows; ++r) {
      std::vector<float> s(kChunk), o(per_path[0].out16.begin(), per_path[0].out16.end());
      k.scores(in.q.data() + static_cast<size_t>(r) * D, 1, kt.data(), D, 0.125f, s.data(), kChunk);
      ASSERT_EQ(0, std::memcmp(s.data(), per_path[0].scores16.data() + static_cast<size_t>(r) * kChunk, sizeof(float) * kChunk))
          << k.isa << " row " << r << " of " << shape.rows;
      std::vector<float> alone(static_cast<size_t>(D));
      for (int d = 0; d < D; ++d) alone[static_cast<size_t>(d)] = std::sin(static_cast<float>(static_cast<size_t>(r) * D + d));
      k.accumulate_f16(in.p.data() + static_cast<size_t>(r) * kChunk, 1, kChunk, in.vrows16.data(), in.keys, D, alone.data());
      ASSERT_EQ(0, std::memcmp(alone.data(), per_path[0].out16.data() + static_cast<size_t>(r) * D, sizeof(float) * D))
          << k.isa << " output row " << r << " of " << shape.rows;
    }
  }
}

}  // namespace
}  // namespace kvflow
