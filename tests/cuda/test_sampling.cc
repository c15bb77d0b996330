// Logits processing and sampling (kernels/sampling.cu) against the CPU Sampler
// (src/sampling/sampler.cc), row by row, given the same uniform draw: the Sampler draws
// UniformUnit = (mt19937_64(seed)() >> 11) * 2^-53 once per non-greedy Sample, so each row's
// uniform is the first draw of its seed's generator.
// Checked per row:
//   - the token: exactly equal (the kernel reproduces the CPU's weights bit for bit and walks the
//     kept tokens in ascending id order, as the Sampler does);
//   - its logprob on the raw logits and the top-N raw logprobs: atol 1e-4 (the log-normalizer is a
//     double sum of the same float weights in another order: ~1e-7 in practice), ids exactly;
//   - the logits left behind (suppression -> -inf, penalties): atol 1e-5 relative to max|logit|
//     (bit-exact in a Release build, which contracts freq * count + presence into an fma as the
//     kernel does).
// Tests: every kind of row in one launch (vocab 3000/1001/49152 on the emulator; up to 128256 on a
// GPU), random parameter combinations with and without tied logits, 200 uniforms on one row (the
// map from uniform to token), the ends of the inverse CDF, argument checks, and (GPU only) timings.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kvflow/request.h"
#include "kvflow/sampling.h"
#include "sampling.h"
#include "sampling/sampler.h"

namespace kvflow {
namespace {

constexpr double kLogprobAtol = 1e-4;

// What the Sampler's first draw from `seed` is.
double FirstUniform(uint64_t seed) {
  std::mt19937_64 rng(seed);
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

struct RowCase {
  std::string name;
  SamplingParams params;
  std::vector<int32_t> prompt, output, suppress;
  // The rest of the row's TokenConstraint (the logits-processor seam): an allowed-token mask
  // (empty: none) and biases.
  std::vector<uint32_t> mask;
  std::vector<TokenBias> bias;
  uint64_t seed = 1;
  std::vector<float> logits;  // filled by the test when empty
};

// Normal logits with standard deviation `scale`.
std::vector<float> NormalLogits(int vocab, float scale, std::mt19937& rng) {
  std::vector<float> logits(static_cast<size_t>(vocab));
  test::FillNormal(logits, rng, scale);
  return logits;
}

// Tokens drawn from a small pool, so that they repeat and overlap between prompt and output; a few
// ids outside the vocab, which the penalties must ignore.
std::vector<int32_t> History(int len, int vocab, const std::vector<int32_t>& pool, std::mt19937& rng) {
  std::vector<int32_t> tokens(static_cast<size_t>(len));
  std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
  std::uniform_int_distribution<int> odd(0, 40);
  for (int32_t& t : tokens) {
    const int r = odd(rng);
    t = r == 0 ? -1 : r == 1 ? vocab : r == 2 ? vocab + 7 : pool[pick(rng)];
  }
  return tokens;
}

// The ids of the `count` largest logits, best first.
std::vector<int32_t> Ranked(const std::vector<float>& logits, size_t count) {
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<long>(count), ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  ids.resize(count);
  return ids;
}

// Runs every row through the kernel in one launch and through its own CPU Sampler; compares.
void RunAndCompare(const std::string& label, int vocab, std::vector<RowCase> rows, int num_top) {
  const int num_rows = static_cast<int>(rows.size());
  std::vector<float> logits;
  std::vector<int32_t> history, suppress, bias_tokens;
  std::vector<uint32_t> masks;
  std::vector<float> bias_values;
  std::vector<cuda::SamplingRow> device_rows;
  for (const RowCase& r : rows) {
    EXPECT_EQ(r.logits.size(), static_cast<size_t>(vocab)) << r.name;
    logits.insert(logits.end(), r.logits.begin(), r.logits.end());
    cuda::SamplingRow d;
    d.temperature = r.params.temperature;
    d.top_k = r.params.top_k;
    d.top_p = r.params.top_p;
    d.min_p = r.params.min_p;
    d.repetition_penalty = r.params.repetition_penalty;
    d.frequency_penalty = r.params.frequency_penalty;
    d.presence_penalty = r.params.presence_penalty;
    d.history_offset = static_cast<int32_t>(history.size());
    d.prompt_len = static_cast<int32_t>(r.prompt.size());
    d.output_len = static_cast<int32_t>(r.output.size());
    history.insert(history.end(), r.prompt.begin(), r.prompt.end());
    history.insert(history.end(), r.output.begin(), r.output.end());
    d.suppress_offset = static_cast<int32_t>(suppress.size());
    d.suppress_len = static_cast<int32_t>(r.suppress.size());
    suppress.insert(suppress.end(), r.suppress.begin(), r.suppress.end());
    if (!r.mask.empty()) {
      d.mask_offset = static_cast<int32_t>(masks.size());
      masks.insert(masks.end(), r.mask.begin(), r.mask.end());
    }
    d.bias_offset = static_cast<int32_t>(bias_tokens.size());
    d.bias_len = static_cast<int32_t>(r.bias.size());
    for (const TokenBias& b : r.bias) {
      bias_tokens.push_back(b.token);
      bias_values.push_back(b.bias);
    }
    d.uniform = FirstUniform(r.seed);
    device_rows.push_back(d);
  }
  if (history.empty()) history.push_back(0);
  if (suppress.empty()) suppress.push_back(0);
  if (masks.empty()) masks.push_back(0);
  if (bias_tokens.empty()) {
    bias_tokens.push_back(0);
    bias_values.push_back(0.0f);
  }

  // CPU reference: one Sampler per row, seeded so that its one draw is the row's uniform.
  std::vector<SampledToken> want(rows.size());
  std::vector<float> want_logits = logits;
  for (size_t i = 0; i < rows.size(); ++i) {
    SamplingParams params = rows[i].params;
    params.logprobs = num_top;
    Sampler sampler(params, rows[i].seed);
    std::span<float> row(want_logits.data() + i * static_cast<size_t>(vocab), static_cast<size_t>(vocab));
    TokenConstraint constraint;
    constraint.Ban(rows[i].suppress);
    if (!rows[i].mask.empty()) constraint.AllowOnly(rows[i].mask);
    for (const TokenBias& b : rows[i].bias) constraint.AddBias(b.token, b.bias);
    want[i] = sampler.Sample(row, rows[i].prompt, rows[i].output, &constraint);
  }

  test::DeviceBuffer d_logits = test::DeviceBuffer::From(logits);
  test::DeviceBuffer d_rows = test::DeviceBuffer::From(device_rows);
  test::DeviceBuffer d_history = test::DeviceBuffer::From(history);
  test::DeviceBuffer d_suppress = test::DeviceBuffer::From(suppress);
  test::DeviceBuffer d_masks = test::DeviceBuffer::From(masks);
  test::DeviceBuffer d_bias_tokens = test::DeviceBuffer::From(bias_tokens);
  test::DeviceBuffer d_bias_values = test::DeviceBuffer::From(bias_values);
  test::DeviceBuffer d_bias_raw(bias_tokens.size() * sizeof(float));
  test::DeviceBuffer d_tokens(rows.size() * sizeof(int32_t)), d_logprobs(rows.size() * sizeof(float));
  const size_t top_count = rows.size() * static_cast<size_t>(std::max(num_top, 1));
  test::DeviceBuffer d_top_tokens(top_count * sizeof(int32_t)), d_top_logprobs(top_count * sizeof(float));
  const size_t ws_bytes = cuda::SampleWorkspaceBytes(num_rows, vocab);
  test::DeviceBuffer d_ws(ws_bytes);
  for (test::DeviceBuffer* b : {&d_tokens, &d_logprobs, &d_top_tokens, &d_top_logprobs, &d_ws}) b->Poison();

  cuda::SampleArgs args;
  args.logits = d_logits.get<float>();
  args.num_rows = num_rows;
  args.vocab_size = vocab;
  args.rows = d_rows.get<cuda::SamplingRow>();
  args.history = d_history.get<int32_t>();
  args.suppress = d_suppress.get<int32_t>();
  args.masks = d_masks.get<uint32_t>();
  args.bias_tokens = d_bias_tokens.get<int32_t>();
  args.bias_values = d_bias_values.get<float>();
  args.bias_raw = d_bias_raw.get<float>();
  args.num_top_logprobs = num_top;
  args.out_tokens = d_tokens.get<int32_t>();
  args.out_logprobs = d_logprobs.get<float>();
  args.out_top_tokens = d_top_tokens.get<int32_t>();
  args.out_top_logprobs = d_top_logprobs.get<float>();
  args.workspace = d_ws.get();
  args.workspace_bytes = ws_bytes;
  KVFLOW_CUDA_OK(cuda::SampleFromLogits(args, nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());

  const std::vector<int32_t> got_tokens = d_tokens.Download<int32_t>();
  const std::vector<float> got_logprobs = d_logprobs.Download<float>();
  const std::vector<int32_t> got_top_tokens = d_top_tokens.Download<int32_t>();
  const std::vector<float> got_top_logprobs = d_top_logprobs.Download<float>();
  const std::vector<float> got_logits = d_logits.Download<float>();

  std::vector<float> want_lp, got_lp, want_top_lp, got_top_lp;
  int token_mismatches = 0, top_id_mismatches = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!std::isfinite(want[i].logprob)) {  // everything masked: -inf on both sides
      EXPECT_EQ(got_tokens[i], want[i].token) << label << " row " << i << " (" << rows[i].name << ")";
      EXPECT_EQ(got_logprobs[i], want[i].logprob) << label << " row " << i << " (" << rows[i].name << ")";
      token_mismatches += got_tokens[i] != want[i].token;
      continue;
    }
    if (got_tokens[i] != want[i].token) {
      ++token_mismatches;
      ADD_FAILURE() << label << " row " << i << " (" << rows[i].name << "): token " << got_tokens[i]
                    << ", CPU " << want[i].token << " (uniform " << device_rows[i].uniform << ")";
      continue;  // a different token has a different logprob
    }
    want_lp.push_back(want[i].logprob);
    got_lp.push_back(got_logprobs[i]);
    EXPECT_EQ(want[i].top_logprobs.size(), static_cast<size_t>(num_top));
    for (int j = 0; j < num_top && j < static_cast<int>(want[i].top_logprobs.size()); ++j) {
      const size_t at = i * static_cast<size_t>(num_top) + static_cast<size_t>(j);
      if (got_top_tokens[at] != want[i].top_logprobs[j].token) {
        ++top_id_mismatches;
        ADD_FAILURE() << label << " row " << i << " (" << rows[i].name << "): top logprob " << j << " id "
                      << got_top_tokens[at] << ", CPU " << want[i].top_logprobs[j].token;
      }
      want_top_lp.push_back(want[i].top_logprobs[j].logprob);
      got_top_lp.push_back(got_top_logprobs[at]);
    }
  }
  std::printf("  %-60s %d/%d tokens equal, %d top-logprob ids differ\n", (label + " tokens").c_str(),
              num_rows - token_mismatches, num_rows, top_id_mismatches);
  test::ExpectClose(label + " chosen logprob", got_lp, want_lp, kLogprobAtol, 1.0);
  if (num_top > 0) test::ExpectClose(label + " top logprobs", got_top_lp, want_top_lp, kLogprobAtol, 1.0);
  // The processed logits: -inf where suppressed (compared as equal), penalized values elsewhere.
  std::vector<float> got_finite, want_finite;
  size_t inf_mismatch = 0;
  double scale = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isinf(want_logits[i]) || std::isinf(got_logits[i])) {
      inf_mismatch += want_logits[i] != got_logits[i];
      continue;
    }
    got_finite.push_back(got_logits[i]);
    want_finite.push_back(want_logits[i]);
    scale = std::max(scale, static_cast<double>(std::fabs(want_logits[i])));
  }
  EXPECT_EQ(inf_mismatch, 0u) << label << ": suppressed logits differ";
  test::ExpectClose(label + " processed logits", got_finite, want_finite, 1e-5 * scale, 1.0);
}

SamplingParams Params(float temperature, int top_k = 0, float top_p = 1.0f, float min_p = 0.0f) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  return p;
}

// Rows with every kind of parameter, in one launch.
std::vector<RowCase> MixedRows(int vocab, std::mt19937& rng) {
  std::vector<RowCase> rows;
  rows.reserve(64);
  auto add = [&](std::string name, SamplingParams params) {
    RowCase r;
    r.name = std::move(name);
    r.params = params;
    r.seed = rng();
    r.logits = NormalLogits(vocab, 3.0f, rng);
    rows.push_back(std::move(r));
    return &rows.back();
  };
  add("greedy", Params(0.0f));
  add("temperature 1", Params(1.0f));
  add("temperature 0.7", Params(0.7f));
  add("temperature 0.05", Params(0.05f));
  add("temperature 2.5", Params(2.5f));
  add("top-k 1", Params(1.0f, 1));
  add("top-k 50", Params(0.8f, 50));
  add("top-k 1024 (shared-memory list, full)", Params(1.0f, 1024));
  add("top-k 1500 (in the row)", Params(1.3f, 1500));
  add("top-k vocab-1", Params(1.0f, vocab - 1));
  add("top-k vocab (off)", Params(1.0f, vocab));
  add("top-p 0.9", Params(1.0f, 0, 0.9f));
  add("top-p 0.5 T 0.6", Params(0.6f, 0, 0.5f));
  add("top-p 0.99 T 3", Params(3.0f, 0, 0.99f));
  add("top-p 1e-6 (top token)", Params(1.0f, 0, 1e-6f));
  add("min-p 0.05", Params(1.0f, 0, 1.0f, 0.05f));
  add("min-p 1 (top tokens)", Params(1.0f, 0, 1.0f, 1.0f));
  add("top-k 40 top-p 0.8 min-p 0.02", Params(1.2f, 40, 0.8f, 0.02f));
  add("top-k 2000 top-p 0.95", Params(1.0f, 2000, 0.95f));
  add("top-p 0.7 min-p 0.1", Params(0.9f, 0, 0.7f, 0.1f));
  const std::vector<int32_t> hot = Ranked(rows.back().logits, 5);

  // Penalties, on histories whose tokens repeat: a pool of likely tokens (so that penalizing them
  // changes the draw) and random ones.
  auto with_history = [&](RowCase* r, int prompt_len, int output_len) {
    std::vector<int32_t> pool = Ranked(r->logits, 30);
    std::uniform_int_distribution<int32_t> any(0, vocab - 1);
    for (int i = 0; i < 30; ++i) pool.push_back(any(rng));
    r->prompt = History(prompt_len, vocab, pool, rng);
    r->output = History(output_len, vocab, pool, rng);
  };
  SamplingParams all = Params(0.9f, 0, 0.9f);
  all.repetition_penalty = 1.3f;
  all.frequency_penalty = 0.5f;
  all.presence_penalty = 0.3f;
  with_history(add("all penalties, top-p", all), 300, 120);
  SamplingParams boost = Params(1.0f, 20);
  boost.repetition_penalty = 0.8f;
  with_history(add("repetition 0.8 (boost), prompt only, top-k", boost), 200, 0);
  SamplingParams freq = Params(1.0f);
  freq.frequency_penalty = -0.7f;
  freq.presence_penalty = -0.4f;
  with_history(add("negative frequency/presence", freq), 50, 90);
  SamplingParams greedy_penalized = Params(0.0f);
  greedy_penalized.repetition_penalty = 1.5f;
  greedy_penalized.frequency_penalty = 0.2f;
  with_history(add("greedy, penalties", greedy_penalized), 100, 60);

  // Suppression: the likeliest tokens (so the draw must avoid them) and ids outside the vocab.
  RowCase* s = add("suppressed, top-k 10", Params(1.0f, 10));
  s->suppress = Ranked(s->logits, 3);
  s->suppress.push_back(-3);
  s->suppress.push_back(vocab);
  s = add("suppressed, greedy", Params(0.0f));
  s->suppress = Ranked(s->logits, 2);
  SamplingParams penalized_suppressed = Params(0.8f, 100, 0.95f);
  penalized_suppressed.repetition_penalty = 1.2f;
  penalized_suppressed.presence_penalty = 0.5f;
  s = add("suppressed and penalized", penalized_suppressed);
  with_history(s, 80, 40);
  s->suppress = {s->prompt.empty() ? 0 : std::max(s->prompt[0], 0), hot[0]};

  // Ties: logits on a grid of 0.5 (many equal values, as bf16 logits have), so that the top-k and
  // nucleus boundaries fall inside runs of equal weights.
  for (auto [name, params] : {std::pair{"ties, top-k 100", Params(1.0f, 100)},
                              std::pair{"ties, top-k 1500", Params(1.0f, 1500)},
                              std::pair{"ties, top-p 0.6", Params(1.0f, 0, 0.6f)},
                              std::pair{"ties, top-k 300 top-p 0.5", Params(0.7f, 300, 0.5f)},
                              std::pair{"ties, greedy", Params(0.0f)}}) {
    RowCase* r = add(name, params);
    for (float& l : r->logits) l = std::round(l * 2.0f) / 2.0f;
  }
  RowCase* flat = add("all equal, top-p 0.5", Params(1.0f, 0, 0.5f));
  std::fill(flat->logits.begin(), flat->logits.end(), 1.5f);
  flat = add("all equal, top-k 7", Params(1.0f, 7));
  std::fill(flat->logits.begin(), flat->logits.end(), -0.25f);
  // Everything masked: the CPU answers as greedy would (token 0, logprob -inf).
  RowCase* masked = add("everything suppressed", Params(1.0f, 0, 0.9f));
  masked->suppress.resize(static_cast<size_t>(vocab));
  std::iota(masked->suppress.begin(), masked->suppress.end(), 0);
  masked = add("all suppressed but two", Params(0.7f, 5));
  masked->suppress.resize(static_cast<size_t>(vocab));
  std::iota(masked->suppress.begin(), masked->suppress.end(), 0);
  masked->suppress.erase(masked->suppress.begin() + vocab / 2);
  masked->suppress.erase(masked->suppress.begin() + vocab / 3);

  // The logits processors' constraint: an allowed-token mask (every third token, and a run that
  // holds the row's best), biases that promote unlikely tokens and push down the likeliest, a
  // token biased twice, a biased token that is also penalized, and all of it at once.
  const size_t words = (static_cast<size_t>(vocab) + 31) / 32;
  auto third_mask = [&](const std::vector<float>& logits) {
    std::vector<uint32_t> m(words, 0u);
    for (int t = 0; t < vocab; t += 3) m[static_cast<size_t>(t) / 32] |= 1u << (t % 32);
    const int32_t best = Ranked(logits, 1)[0];
    m[static_cast<size_t>(best) / 32] |= 1u << (best % 32);
    return m;
  };
  RowCase* c = add("mask every third token, top-k 40", Params(1.0f, 40));
  c->mask = third_mask(c->logits);
  c = add("mask, greedy", Params(0.0f));
  c->mask = third_mask(c->logits);
  c->mask[static_cast<size_t>(Ranked(c->logits, 1)[0]) / 32] = 0u;  // the best is masked out
  c = add("bias: promote the 50th, push down the best", Params(1.0f, 0, 0.9f));
  {
    const std::vector<int32_t> ranked = Ranked(c->logits, 50);
    c->bias = {{ranked[49], 6.0f}, {ranked[0], -4.0f}, {ranked[0], -1.5f}, {-2, 3.0f}, {vocab, 1.0f}};
  }
  c = add("bias forces a token, greedy", Params(0.0f));
  c->bias = {{vocab / 2, 100.0f}};
  SamplingParams penalized_biased = Params(0.9f, 200);
  penalized_biased.repetition_penalty = 1.3f;
  penalized_biased.frequency_penalty = 0.4f;
  c = add("bias on penalized tokens, mask, suppression", penalized_biased);
  with_history(c, 60, 30);
  c->mask = third_mask(c->logits);
  for (int32_t t : c->output) {
    if (t >= 0 && t < vocab && c->bias.size() < 8) c->bias.push_back({t, 2.0f});
  }
  c->suppress = Ranked(c->logits, 2);
  return rows;
}

struct VocabCase {
  int vocab;
  int num_top;
};

TEST(Sampling, MixedRowsMatchCpuSampler) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(2024);
  // 49152: SmolLM2; 128256: Llama 3; 1001 rows are not 16-byte aligned (the scalar path).
  std::vector<VocabCase> cases = {{3000, 5}, {1001, 0}};
  if (test::IsEmulator()) {
    cases.push_back({49152, 0});
  } else {
    cases = {{1000, 0}, {1000, 5}, {1001, 20}, {3000, 5}, {49152, 0}, {49152, 5}, {128256, 0}, {128256, 20}};
  }
  for (const VocabCase& c : cases) {
    std::vector<RowCase> rows = MixedRows(c.vocab, rng);
    RunAndCompare("vocab " + std::to_string(c.vocab) + " logprobs " + std::to_string(c.num_top), c.vocab,
                  std::move(rows), c.num_top);
  }
}

// Random combinations of every parameter, on logits with and without ties.
TEST(Sampling, RandomParametersMatchCpuSampler) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(31337);
  const int vocab = test::IsEmulator() ? 2000 : 32000;
  const int launches = test::IsEmulator() ? 3 : 10;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  auto chance = [&](float p) { return unit(rng) < p; };
  for (int launch = 0; launch < launches; ++launch) {
    std::vector<RowCase> rows(60);
    for (size_t i = 0; i < rows.size(); ++i) {
      RowCase& r = rows[i];
      r.name = "random " + std::to_string(i);
      r.seed = rng();
      r.logits = NormalLogits(vocab, 1.0f + 4.0f * unit(rng), rng);
      if (chance(0.3f)) {  // ties: a grid of 1/2, 1/4 or 1/8
        const float step = 1.0f / static_cast<float>(2 << (rng() % 3));
        for (float& l : r.logits) l = std::round(l / step) * step;
      }
      SamplingParams& p = r.params;
      p.temperature = chance(0.15f) ? 0.0f : 0.1f + 2.0f * unit(rng);
      if (chance(0.5f)) p.top_k = chance(0.7f) ? 1 + static_cast<int>(rng() % 200) : 1000 + static_cast<int>(rng() % 1500);
      if (chance(0.5f)) p.top_p = 0.05f + 0.94f * unit(rng);
      if (chance(0.3f)) p.min_p = 0.3f * unit(rng);
      if (chance(0.3f)) p.repetition_penalty = 0.7f + 0.8f * unit(rng);
      if (chance(0.3f)) p.frequency_penalty = 2.0f * unit(rng) - 1.0f;
      if (chance(0.3f)) p.presence_penalty = 2.0f * unit(rng) - 1.0f;
      if (chance(0.6f)) {
        std::vector<int32_t> pool = Ranked(r.logits, 20);
        for (int j = 0; j < 20; ++j) pool.push_back(static_cast<int32_t>(rng() % vocab));
        r.prompt = History(static_cast<int>(rng() % 300), vocab, pool, rng);
        r.output = History(static_cast<int>(rng() % 100), vocab, pool, rng);
      }
      if (chance(0.2f)) r.suppress = Ranked(r.logits, 1 + rng() % 3);
      if (chance(0.2f)) {  // a random allowed-token mask keeping about half the vocab
        r.mask.assign((static_cast<size_t>(vocab) + 31) / 32, 0u);
        for (uint32_t& w : r.mask) w = static_cast<uint32_t>(rng());
      }
      if (chance(0.25f)) {
        const std::vector<int32_t> ranked = Ranked(r.logits, 30);
        for (int j = 0; j < 1 + static_cast<int>(rng() % 4); ++j) {
          r.bias.push_back({ranked[rng() % ranked.size()], 10.0f * unit(rng) - 5.0f});
        }
      }
    }
    RunAndCompare("random launch " + std::to_string(launch), vocab, std::move(rows), launch % 2 == 0 ? 0 : 3);
  }
}

// One row's logits, 200 uniforms: the map from uniform to token is the same on both sides only if
// both walk the kept tokens in the same (ascending id) order.
TEST(Sampling, DrawWalksKeptTokensInAscendingIdOrder) {
  KVFLOW_SKIP_WITHOUT_GPU();
  constexpr int kVocab = 300;
  constexpr int kDraws = 200;
  std::mt19937 rng(77);
  const std::vector<float> logits = NormalLogits(kVocab, 2.0f, rng);
  for (const auto& [name, params] : {std::pair{"top-p 0.9", Params(1.0f, 0, 0.9f)},
                                     std::pair{"top-k 60", Params(1.0f, 60)},
                                     std::pair{"top-k 80 top-p 0.8", Params(1.5f, 80, 0.8f)},
                                     std::pair{"top-p 0.95 min-p 0.02", Params(1.0f, 0, 0.95f, 0.02f)}}) {
    std::vector<RowCase> rows(kDraws);
    for (int i = 0; i < kDraws; ++i) {
      rows[i].name = name;
      rows[i].params = params;
      rows[i].seed = 1000 + static_cast<uint64_t>(i);
      rows[i].logits = logits;
    }
    RunAndCompare(std::string("200 draws, ") + name, kVocab, std::move(rows), 0);
  }
}

// The ends of the inverse CDF, checked without the CPU Sampler: uniform 0 takes the lowest kept
// id, the largest uniform below 1 the highest.
TEST(Sampling, ExtremeUniformsTakeTheFirstAndLastKeptToken) {
  KVFLOW_SKIP_WITHOUT_GPU();
  constexpr int kVocab = 1000;
  std::mt19937 rng(5);
  struct Case {
    cuda::SamplingRow row;
    int32_t want;
  };
  std::vector<float> logits;
  std::vector<Case> cases;
  for (int k : {1, 5, 64}) {
    const std::vector<float> row_logits = NormalLogits(kVocab, 3.0f, rng);
    const std::vector<int32_t> top = Ranked(row_logits, static_cast<size_t>(k));
    for (double uniform : {0.0, 1.0 - 0x1.0p-53}) {
      cuda::SamplingRow row;
      row.top_k = k;
      row.uniform = uniform;
      logits.insert(logits.end(), row_logits.begin(), row_logits.end());
      cases.push_back({row, uniform == 0.0 ? *std::min_element(top.begin(), top.end())
                                           : *std::max_element(top.begin(), top.end())});
    }
  }
  test::DeviceBuffer d_logits = test::DeviceBuffer::From(logits);
  std::vector<cuda::SamplingRow> rows;
  for (const Case& c : cases) rows.push_back(c.row);
  test::DeviceBuffer d_rows = test::DeviceBuffer::From(rows);
  test::DeviceBuffer d_tokens(rows.size() * 4), d_logprobs(rows.size() * 4);
  test::DeviceBuffer d_ws(cuda::SampleWorkspaceBytes(static_cast<int>(rows.size()), kVocab));
  d_tokens.Poison();
  cuda::SampleArgs args;
  args.logits = d_logits.get<float>();
  args.num_rows = static_cast<int>(rows.size());
  args.vocab_size = kVocab;
  args.rows = d_rows.get<cuda::SamplingRow>();
  args.out_tokens = d_tokens.get<int32_t>();
  args.out_logprobs = d_logprobs.get<float>();
  args.workspace = d_ws.get();
  args.workspace_bytes = d_ws.bytes();
  KVFLOW_CUDA_OK(cuda::SampleFromLogits(args, nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> got = d_tokens.Download<int32_t>();
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(got[i], cases[i].want) << "top-k " << cases[i].row.top_k << " uniform " << cases[i].row.uniform;
  }
}

// Launch time on a real GPU for the common parameter sets (printed, not checked).
TEST(Sampling, TimingOnGpu) {
  KVFLOW_SKIP_WITHOUT_GPU();
  if (test::IsEmulator()) GTEST_SKIP() << "timing is only meaningful on a GPU";
  std::mt19937 rng(9);
  for (int vocab : {49152, 128256}) {
    constexpr int kMaxRows = 256;
    std::vector<float> logits(static_cast<size_t>(kMaxRows) * vocab);
    test::FillNormal(logits, rng, 3.0f);
    std::vector<int32_t> history(1000);
    std::uniform_int_distribution<int32_t> any(0, vocab - 1);
    for (int32_t& t : history) t = any(rng) % 2000;
    test::DeviceBuffer d_logits = test::DeviceBuffer::From(logits), d_history = test::DeviceBuffer::From(history);
    test::DeviceBuffer d_tokens(kMaxRows * 4), d_logprobs(kMaxRows * 4);
    test::DeviceBuffer d_ws(cuda::SampleWorkspaceBytes(kMaxRows, vocab));
    struct Config {
      const char* name;
      SamplingParams params;
      bool history;
    };
    SamplingParams penalized = Params(0.7f, 0, 0.9f);
    penalized.repetition_penalty = 1.1f;
    penalized.frequency_penalty = 0.2f;
    const Config configs[] = {{"greedy", Params(0.0f), false},
                              {"temperature 1", Params(1.0f), false},
                              {"T 0.7 top-p 0.9", Params(0.7f, 0, 0.9f), false},
                              {"T 0.7 top-k 50 top-p 0.9", Params(0.7f, 50, 0.9f), false},
                              {"T 0.7 top-p 0.9 penalties (1000 tokens)", penalized, true}};
    for (int num_rows : {8, 64, 256}) {
      for (const Config& c : configs) {
        std::vector<cuda::SamplingRow> rows(static_cast<size_t>(num_rows));
        for (int i = 0; i < num_rows; ++i) {
          cuda::SamplingRow& r = rows[static_cast<size_t>(i)];
          r.temperature = c.params.temperature;
          r.top_k = c.params.top_k;
          r.top_p = c.params.top_p;
          r.repetition_penalty = c.params.repetition_penalty;
          r.frequency_penalty = c.params.frequency_penalty;
          r.prompt_len = c.history ? 800 : 0;
          r.output_len = c.history ? 200 : 0;
          r.uniform = FirstUniform(static_cast<uint64_t>(i));
        }
        test::DeviceBuffer d_rows = test::DeviceBuffer::From(rows);
        cuda::SampleArgs args;
        args.logits = d_logits.get<float>();
        args.num_rows = num_rows;
        args.vocab_size = vocab;
        args.rows = d_rows.get<cuda::SamplingRow>();
        args.history = d_history.get<int32_t>();
        args.out_tokens = d_tokens.get<int32_t>();
        args.out_logprobs = d_logprobs.get<float>();
        args.workspace = d_ws.get();
        args.workspace_bytes = d_ws.bytes();
        constexpr int kIters = 20;
        cudaEvent_t start, stop;
        cudaEventCreate(&start);
        cudaEventCreate(&stop);
        KVFLOW_CUDA_OK(cuda::SampleFromLogits(args, nullptr));  // warm-up
        cudaEventRecord(start, nullptr);
        for (int it = 0; it < kIters; ++it) KVFLOW_CUDA_OK(cuda::SampleFromLogits(args, nullptr));
        cudaEventRecord(stop, nullptr);
        KVFLOW_CUDA_OK(cudaEventSynchronize(stop));
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, start, stop);
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
        const double us = 1000.0 * ms / kIters;
        std::printf("  sampling vocab %6d rows %3d %-42s %8.1f us  (%.0f GB/s of logits)\n", vocab, num_rows, c.name,
                    us, 4.0 * num_rows * vocab / (us * 1e3));
      }
    }
  }
}

TEST(Sampling, RejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  constexpr int kVocab = 64;
  test::DeviceBuffer logits(kVocab * sizeof(float)), rows(sizeof(cuda::SamplingRow)), tokens(4), logprobs(4),
      top_tokens(4 * 20), top_logprobs(4 * 20), ws(cuda::SampleWorkspaceBytes(1, kVocab));
  cuda::SampleArgs good;
  good.logits = logits.get<float>();
  good.num_rows = 1;
  good.vocab_size = kVocab;
  good.rows = rows.get<cuda::SamplingRow>();
  good.out_tokens = tokens.get<int32_t>();
  good.out_logprobs = logprobs.get<float>();
  good.out_top_tokens = top_tokens.get<int32_t>();
  good.out_top_logprobs = top_logprobs.get<float>();
  good.workspace = ws.get();
  good.workspace_bytes = ws.bytes();
  auto expect_invalid = [&](const char* what, auto spoil) {
    cuda::SampleArgs a = good;
    spoil(a);
    EXPECT_EQ(cuda::SampleFromLogits(a, nullptr), cuda::kInvalidValue) << what;
  };
  expect_invalid("negative rows", [](cuda::SampleArgs& a) { a.num_rows = -1; });
  expect_invalid("zero vocab", [](cuda::SampleArgs& a) { a.vocab_size = 0; });
  expect_invalid("vocab over 1M", [](cuda::SampleArgs& a) { a.vocab_size = (1 << 20) + 1; });
  expect_invalid("21 top logprobs", [](cuda::SampleArgs& a) { a.num_top_logprobs = cuda::kMaxTopLogprobs + 1; });
  expect_invalid("top logprobs beyond the vocab", [](cuda::SampleArgs& a) {
    a.vocab_size = 3;
    a.num_top_logprobs = 4;
  });
  expect_invalid("no top outputs", [](cuda::SampleArgs& a) {
    a.num_top_logprobs = 2;
    a.out_top_tokens = nullptr;
  });
  expect_invalid("small workspace", [](cuda::SampleArgs& a) { a.workspace_bytes -= 1; });
  expect_invalid("no logits", [](cuda::SampleArgs& a) { a.logits = nullptr; });
  cuda::SampleArgs none = good;
  none.num_rows = 0;
  EXPECT_EQ(cuda::SampleFromLogits(none, nullptr), 0);
}

}  // namespace
}  // namespace kvflow
