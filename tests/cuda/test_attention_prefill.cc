// Paged prefill attention (kernels/attention_prefill.cu) against the CPU reference
// cpu::PagedAttention on the same ForwardBatch: plain prefills, chunked prefills over a cached
// prefix, varlen batches, query rows inside wider (fused QKV) rows, a loose max_query_len, both CTA
// tile heights; fp16 and bf16, head_dim 64 and 128 (and 256 in bf16: Gemma), block_size 8/16/32, GQA
// group 1 and 3.
//
// Every case: random inputs rounded to the device dtype (the reference sees the same values),
// physical blocks shuffled, cache slots outside every context filled with NaN (a kernel reading
// past a context poisons its output), unused block-table entries pointing at a NaN block, output
// poisoned; rows and columns the kernel must not write are checked to still hold the poison.
//
// Tolerances (outputs are softmax-weighted averages of N(0,1) values, |out| <~ 3; P is rounded to
// the input type for the P V product, as in flash attention, and the output is rounded once more):
//   max |d|                                  fp16 3e-3, bf16 2e-2
//   max over (token, head) rows of |d_row|_2 / |ref_row|_2   fp16 4e-3, bf16 3e-2
// The element-wise max rel that ExpectClose prints (relative to max(|ref|, 1e-3 max|ref|)) only
// gets a loose bound (fp16 1, bf16 8): near-zero outputs of long contexts make it large without
// any real error. The row-relative L2 error is the relative check (a row is a convex combination
// of V rows, never near zero), and it is tight even where long contexts make outputs small.
//
// The log-sum-exp output (PagedAttentionArgs::lse) is checked against the reference's LSE (atol
// 5e-4: the kernel sums fp32 probabilities, so only exp2/log2 and summation order differ) in every
// case but those of block size 16 (which run lse = nullptr: the kernels without it are separate
// instantiations), and LSE entries of rows nobody owns against poison. LseMergeOfTwoHalvesEqualsWhole:
// attention over the first cached blocks of each context (every query sees them whole: one
// query_len-1 sequence per token) and over the rest (causal), merged by their LSEs with
// cpu::MergeAttentionStates, equals the whole, within the output tolerances.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attention_prefill.h"
#include "backend/cpu/paged_attention.h"
#include "gpu_test_util.h"

namespace kvflow {
namespace cuda::detail {
// Test hook in kernels/attention_prefill.cu: the launcher with the CTA tile height forced.
int PagedAttentionPrefillTiled(const PagedPrefillArgs& args, int block_m, void* stream);
}  // namespace cuda::detail

namespace {

using cuda::DType;

struct SeqShape {
  int query_len;
  int context_len;
};

struct Shape {
  DType dtype = DType::kF16;
  int head_dim = 64;
  int block_size = 16;
  int num_kv_heads = 2;
  int group = 1;
  std::vector<SeqShape> seqs;
  int query_row_extra = 0;  // elements after the query heads in a row (K and V of a fused QKV row)
  int out_row_extra = 0;    // elements after the output heads in a row
  int row_gap = 0;          // unused rows between consecutive sequences' rows
  int max_query_len_extra = 0;
  float q_std = 1.0f;  // larger: peakier softmax
  // Tile heights to run (same inputs, same reference): 0 lets the launcher pick, 64 or 128 forces.
  std::vector<int> block_ms = {0};
  bool lse = true;            // also check the LSE output (false: lse = nullptr)
  bool merge_halves = false;  // also check that two halves of each context merge to the whole
  // > 0: sliding-window attention; table entries of blocks wholly before a chunk's first query's
  // window are -1 (released) and the blocks NaN.
  int window = 0;
  // > 0: Gemma-2's soft cap on the scaled scores (AttentionIo::softcap).
  float softcap = 0.0f;
  uint32_t seed = 1;
};

std::string Describe(const Shape& s, int block_m) {
  std::ostringstream os;
  os << cuda::DTypeName(s.dtype) << " d" << s.head_dim << " bs" << s.block_size << " kv" << s.num_kv_heads << "x"
     << s.group << " bm" << block_m << " seqs";
  for (size_t i = 0; i < s.seqs.size() && i < 4; ++i) os << (i ? "," : " ") << s.seqs[i].query_len << "/" << s.seqs[i].context_len;
  if (s.seqs.size() > 4) os << ",..(" << s.seqs.size() << ")";
  if (s.query_row_extra || s.out_row_extra || s.row_gap) os << " strided";
  if (s.max_query_len_extra) os << " maxq+" << s.max_query_len_extra;
  if (s.q_std != 1.0f) os << " qstd" << s.q_std;
  if (!s.lse) os << " no-lse";
  if (s.window > 0) os << " window" << s.window;
  if (s.softcap > 0) os << " softcap" << s.softcap;
  return os.str();
}

void RunCase(const Shape& s) {
  const int D = s.head_dim, bs = s.block_size, KV = s.num_kv_heads, H = KV * s.group;
  const int num_seqs = static_cast<int>(s.seqs.size());
  std::mt19937 rng(s.seed * 7919u + static_cast<uint32_t>(D + bs + H));

  // Physical blocks: every sequence gets its own, from a shuffled pool; one spare block (all NaN)
  // fills the unused block-table entries.
  int total_blocks = 0, max_blocks = 0, max_query_len = 0;
  for (const SeqShape& q : s.seqs) {
    const int nb = (q.context_len + bs - 1) / bs;
    total_blocks += nb;
    max_blocks = std::max(max_blocks, nb);
    max_query_len = std::max(max_query_len, q.query_len);
  }
  const int num_blocks = total_blocks + 2;
  std::vector<int32_t> pool(static_cast<size_t>(num_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  const int32_t nan_block = pool.back();
  const int bt_stride = max_blocks + 3;
  std::vector<int32_t> block_tables(static_cast<size_t>(num_seqs) * bt_stride, nan_block);

  ForwardBatch batch;
  std::vector<int32_t> query_starts, query_lens, context_lens;
  int next_block = 0, row = 0;
  for (int i = 0; i < num_seqs; ++i) {
    const SeqShape& q = s.seqs[static_cast<size_t>(i)];
    SequenceSlice slice;
    slice.token_offset = static_cast<int32_t>(batch.tokens.size());
    slice.num_tokens = q.query_len;
    slice.context_len = q.context_len;
    const int nb = (q.context_len + bs - 1) / bs;
    slice.block_table.assign(pool.begin() + next_block, pool.begin() + next_block + nb);
    const int first_key = s.window > 0 ? std::max(0, q.context_len - q.query_len - s.window + 1) : 0;
    std::fill_n(slice.block_table.begin(), first_key / bs, kReleasedBlock);
    std::copy(slice.block_table.begin(), slice.block_table.end(), block_tables.begin() + static_cast<long>(i) * bt_stride);
    next_block += nb;
    for (int j = 0; j < q.query_len; ++j) {
      batch.tokens.push_back(0);
      batch.positions.push_back(q.context_len - q.query_len + j);
    }
    batch.seqs.push_back(std::move(slice));
    query_starts.push_back(row);
    query_lens.push_back(q.query_len);
    context_lens.push_back(q.context_len);
    row += q.query_len + s.row_gap;
  }
  const int total_rows = row;
  const int T = static_cast<int>(batch.tokens.size());

  // Cache: N(0,1) in every slot some context covers, NaN everywhere else.
  const KvCacheLayout layout{1, num_blocks, KV, bs, D};
  std::vector<float> k_cache(layout.layer_stride()), v_cache(layout.layer_stride());
  test::FillNormal(k_cache, rng);
  test::FillNormal(v_cache, rng);
  std::vector<char> used(static_cast<size_t>(num_blocks) * bs, 0);
  for (const SequenceSlice& slice : batch.seqs) {
    for (int t = 0; t < slice.context_len; ++t) {
      const int32_t b = slice.block_table[t / bs];
      if (b != kReleasedBlock) used[static_cast<size_t>(b) * bs + t % bs] = 1;
    }
  }
  for (int b = 0; b < num_blocks; ++b) {
    for (int slot = 0; slot < bs; ++slot) {
      if (used[static_cast<size_t>(b) * bs + slot]) continue;
      for (int h = 0; h < KV; ++h) {
        std::fill_n(k_cache.begin() + static_cast<long>(layout.offset(b, h, slot)), D, NAN);
        std::fill_n(v_cache.begin() + static_cast<long>(layout.offset(b, h, slot)), D, NAN);
      }
    }
  }
  const std::vector<uint8_t> k_bytes = test::ToDeviceBytes(k_cache, s.dtype);
  const std::vector<uint8_t> v_bytes = test::ToDeviceBytes(v_cache, s.dtype);

  // Query rows of query_row_stride elements: the heads first, then other values (as in a fused
  // QKV row); the gap rows hold values too.
  const int64_t q_stride = static_cast<int64_t>(H) * D + s.query_row_extra;
  const int64_t o_stride = static_cast<int64_t>(H) * D + s.out_row_extra;
  std::vector<float> q_rows(static_cast<size_t>(total_rows * q_stride));
  test::FillNormal(q_rows, rng, s.q_std);
  const std::vector<uint8_t> q_bytes = test::ToDeviceBytes(q_rows, s.dtype);
  std::vector<float> q_ref(static_cast<size_t>(T) * H * D);  // [token][head][dim] for the reference
  for (int i = 0; i < num_seqs; ++i) {
    for (int j = 0; j < query_lens[static_cast<size_t>(i)]; ++j) {
      const int t = batch.seqs[static_cast<size_t>(i)].token_offset + j;
      std::copy_n(q_rows.begin() + (query_starts[static_cast<size_t>(i)] + j) * q_stride, H * D,
                  q_ref.begin() + static_cast<long>(t) * H * D);
    }
  }

  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> ref(q_ref.size()), ref_lse(static_cast<size_t>(T) * H);
  {
    std::vector<std::vector<int64_t>> views(batch.seqs.size());
    for (size_t i = 0; i < views.size(); ++i) ViewSlots(batch.seqs[i], bs, views[i]);
    cpu::AttentionIo io;
    io.query = q_ref.data();
    io.query_row_stride = static_cast<int64_t>(H) * D;
    io.out = ref.data();
    io.out_row_stride = io.query_row_stride;
    io.lse = ref_lse.data();
    io.window = s.window;
    io.softcap = s.softcap;
    cpu::PagedAttention(batch, views, layout, H, io, k_cache.data(), v_cache.data(), scale);
  }

  test::DeviceBuffer d_q = test::DeviceBuffer::From(q_bytes);
  test::DeviceBuffer d_k = test::DeviceBuffer::From(k_bytes);
  test::DeviceBuffer d_v = test::DeviceBuffer::From(v_bytes);
  test::DeviceBuffer d_out(static_cast<size_t>(total_rows * o_stride) * 2);
  test::DeviceBuffer d_lse(static_cast<size_t>(total_rows) * H * sizeof(float));
  // Token t of the batch sits in device row row_of[t].
  std::vector<int> row_of(static_cast<size_t>(T));
  for (int i = 0; i < num_seqs; ++i) {
    for (int j = 0; j < query_lens[static_cast<size_t>(i)]; ++j) {
      row_of[static_cast<size_t>(batch.seqs[static_cast<size_t>(i)].token_offset + j)] = query_starts[static_cast<size_t>(i)] + j;
    }
  }

  // One launch over the given sequences (tables of bt_stride entries); out and lse poisoned first.
  // Returns false when the launch failed.
  auto launch = [&](const std::vector<int32_t>& tables, const std::vector<int32_t>& starts,
                    const std::vector<int32_t>& qlens, const std::vector<int32_t>& ctxs, int max_qlen, int block_m,
                    bool with_lse) {
    test::DeviceBuffer d_bt = test::DeviceBuffer::From(tables);
    test::DeviceBuffer d_starts = test::DeviceBuffer::From(starts);
    test::DeviceBuffer d_qlens = test::DeviceBuffer::From(qlens);
    test::DeviceBuffer d_ctx = test::DeviceBuffer::From(ctxs);
    d_out.Poison();
    d_lse.Poison();
    cuda::PagedPrefillArgs args;
    args.dtype = s.dtype;
    args.out = d_out.get();
    args.out_row_stride = o_stride;
    args.query = d_q.get();
    args.query_row_stride = q_stride;
    args.key_cache = d_k.get();
    args.value_cache = d_v.get();
    args.block_tables = d_bt.get<int32_t>();
    args.block_table_stride = bt_stride;
    args.query_starts = d_starts.get<int32_t>();
    args.query_lens = d_qlens.get<int32_t>();
    args.context_lens = d_ctx.get<int32_t>();
    args.num_seqs = static_cast<int>(starts.size());
    args.num_heads = H;
    args.num_kv_heads = KV;
    args.head_dim = D;
    args.block_size = bs;
    args.max_query_len = max_qlen;
    args.scale = scale;
    args.lse = with_lse ? d_lse.get<float>() : nullptr;
    args.window = s.window;
    args.softcap = s.softcap;
    const int rc = cuda::detail::PagedAttentionPrefillTiled(args, block_m, nullptr);
    EXPECT_EQ(rc, 0);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return rc == 0;
  };
  // The launch's output and LSE of every token, in the reference's order.
  auto outputs = [&](std::vector<float>& got, std::vector<float>& got_lse) {
    const std::vector<uint16_t> out_bits = d_out.Download<uint16_t>();
    const std::vector<float> lse_all = d_lse.Download<float>();
    got.resize(ref.size());
    got_lse.resize(ref_lse.size());
    for (int t = 0; t < T; ++t) {
      const int64_t base = row_of[static_cast<size_t>(t)] * o_stride;
      for (int e = 0; e < H * D; ++e) {
        got[static_cast<size_t>(t) * H * D + e] = test::BitsToFloat(out_bits[static_cast<size_t>(base + e)], s.dtype);
      }
      for (int h = 0; h < H; ++h) {
        got_lse[static_cast<size_t>(t) * H + h] = lse_all[static_cast<size_t>(row_of[static_cast<size_t>(t)]) * H + h];
      }
    }
  };
  const bool fp16 = s.dtype == DType::kF16;
  const double lse_tol = 5e-4;

  for (const int block_m : s.block_ms) {
    const std::string what = Describe(s, block_m);
    SCOPED_TRACE(what);
    if (!launch(block_tables, query_starts, query_lens, context_lens, max_query_len + s.max_query_len_extra, block_m,
                s.lse)) {
      return;
    }
    std::vector<float> got, got_lse;
    outputs(got, got_lse);
    test::ExpectClose(what, got, ref, fp16 ? 3e-3 : 2e-2, fp16 ? 1.0 : 8.0);
    test::ExpectRowsClose("", got, ref, static_cast<size_t>(D), fp16 ? 4e-3 : 3e-2);
    if (s.lse) test::ExpectClose(what + " LSE", got_lse, ref_lse, lse_tol, 1.0);

    // Nothing written outside the query rows' heads (and their LSE entries).
    const std::vector<uint8_t> out_bytes = d_out.Download<uint8_t>();
    std::vector<char> written(static_cast<size_t>(total_rows * o_stride), 0);
    std::vector<char> lse_written(static_cast<size_t>(total_rows) * H, 0);
    for (int t = 0; t < T; ++t) {
      std::fill_n(written.begin() + row_of[static_cast<size_t>(t)] * o_stride, H * D, 1);
      std::fill_n(lse_written.begin() + static_cast<long>(row_of[static_cast<size_t>(t)]) * H, H, 1);
    }
    size_t stray = 0;
    for (size_t e = 0; e < written.size(); ++e) {
      if (!written[e] && (out_bytes[2 * e] != 0xFF || out_bytes[2 * e + 1] != 0xFF)) ++stray;
    }
    EXPECT_EQ(stray, 0u) << "elements written outside the query rows' heads";
    const std::vector<uint32_t> lse_bits = d_lse.Download<uint32_t>();
    size_t lse_stray = 0;
    for (size_t e = 0; e < lse_bits.size(); ++e) lse_stray += (!s.lse || !lse_written[e]) && lse_bits[e] != 0xFFFFFFFFu;
    EXPECT_EQ(lse_stray, 0u) << "LSE entries written outside the query rows (or without an lse)";
  }
  if (!s.merge_halves) return;

  // Two disjoint halves of every context: A = the first blocks of its cached prefix, which every
  // query token sees whole (so A runs as one query_len-1 sequence per token), and B = the rest,
  // causal as usual; merged by their LSEs they must equal the whole.
  const std::string what = Describe(s, s.block_ms[0]) + " halves merged";
  SCOPED_TRACE(what);
  std::vector<int32_t> tables_a, starts_a, qlens_a, ctx_a;
  std::vector<int32_t> tables_b(block_tables.size(), nan_block), ctx_b;
  for (int i = 0; i < num_seqs; ++i) {
    const SequenceSlice& slice = batch.seqs[static_cast<size_t>(i)];
    const int prefix_blocks = (slice.context_len - slice.num_tokens) / bs;
    ASSERT_GE(prefix_blocks, 1) << "sequence " << i << " has no cached block to split off";
    const int na = (prefix_blocks + 1) / 2, nb = (slice.context_len + bs - 1) / bs;
    for (int j = 0; j < slice.num_tokens; ++j) {
      const size_t row0 = tables_a.size();
      tables_a.resize(row0 + static_cast<size_t>(bt_stride), nan_block);
      std::copy_n(slice.block_table.begin(), na, tables_a.begin() + static_cast<long>(row0));
      starts_a.push_back(query_starts[static_cast<size_t>(i)] + j);
      qlens_a.push_back(1);
      ctx_a.push_back(na * bs);
    }
    std::copy(slice.block_table.begin() + na, slice.block_table.begin() + nb,
              tables_b.begin() + static_cast<long>(i) * bt_stride);
    ctx_b.push_back(slice.context_len - na * bs);
  }
  std::vector<float> out_a, lse_a, out_b, lse_b;
  if (!launch(tables_a, starts_a, qlens_a, ctx_a, 1, s.block_ms[0], true)) return;
  outputs(out_a, lse_a);
  if (!launch(tables_b, query_starts, query_lens, ctx_b, max_query_len, s.block_ms[0], true)) return;
  outputs(out_b, lse_b);
  std::vector<float> merged(ref.size()), merged_lse(ref_lse.size());
  cpu::MergeAttentionStates(out_a.data(), lse_a.data(), out_b.data(), lse_b.data(), static_cast<int64_t>(T) * H, D,
                            merged.data(), merged_lse.data());
  test::ExpectClose(what, merged, ref, fp16 ? 3e-3 : 2e-2, fp16 ? 1.0 : 8.0);
  test::ExpectClose(what + " LSE", merged_lse, ref_lse, lse_tol, 1.0);
}

// ---- cases ------------------------------------------------------------------------------------------

struct Combo {
  DType dtype;
  int head_dim;
};

class PagedPrefill : public ::testing::TestWithParam<Combo> {
 protected:
  void SetUp() override { KVFLOW_SKIP_WITHOUT_GPU(); }

  // Runs `base` for every block size and GQA group. The emulator alternates the two tile heights
  // (each shape family still sees both); a GPU runs both plus the launcher's own choice. Block size
  // 16 runs without an LSE (the kernels without it are separate instantiations), unless the base
  // merges halves (which needs the LSE).
  void ForEachLayout(Shape base) {
    int variant = 0;
    for (int bs : {8, 16, 32}) {
      for (int group : {1, 3}) {
        Shape s = base;
        s.dtype = GetParam().dtype;
        s.head_dim = GetParam().head_dim;
        s.block_size = bs;
        s.group = group;
        s.block_ms = test::IsEmulator() ? std::vector<int>{variant % 2 ? 128 : 64} : std::vector<int>{0, 64, 128};
        s.lse = base.merge_halves || bs != 16;
        s.seed = base.seed + static_cast<uint32_t>(variant);
        RunCase(s);
        ++variant;
      }
    }
  }
};

TEST_P(PagedPrefill, PlainPrefill) {
  std::vector<int> lens = {1, 15, 64, 100, 257};
  if (!test::IsEmulator()) lens.insert(lens.end(), {1000, 2049});
  for (int len : lens) {
    Shape s;
    s.seqs = {{len, len}};
    s.seed = static_cast<uint32_t>(len);
    ForEachLayout(s);
  }
}

TEST_P(PagedPrefill, ChunkedPrefillOverCachedPrefix) {
  std::vector<SeqShape> chunks = {{37, 187}, {1, 200}, {64, 128}, {100, 103}};
  if (!test::IsEmulator()) chunks.insert(chunks.end(), {{512, 3000}, {1, 4097}});
  for (const SeqShape& c : chunks) {
    Shape s;
    s.seqs = {c};
    s.seed = static_cast<uint32_t>(c.query_len * 31 + c.context_len);
    ForEachLayout(s);
  }
}

TEST_P(PagedPrefill, VarlenBatch) {
  Shape s;
  // Mixed: a decode-like row, whole prompts, chunks over cached prefixes, odd lengths.
  s.seqs = {{1, 40}, {15, 15}, {37, 187}, {64, 130}, {3, 3}, {100, 100}, {1, 1}};
  if (!test::IsEmulator()) s.seqs.insert(s.seqs.end(), {{700, 2100}, {1300, 1300}, {1, 3333}});
  s.seed = 77;
  ForEachLayout(s);
}

TEST_P(PagedPrefill, RowsInsideWiderRows) {
  Shape s;
  // Query inside a fused QKV row (K and V of 2 kv heads follow), output rows padded, gap rows
  // between sequences, and a max_query_len far above every query_len.
  s.seqs = {{29, 29}, {50, 90}, {1, 17}};
  s.query_row_extra = 2 * 2 * 128;
  s.out_row_extra = 24;
  s.row_gap = 3;
  s.max_query_len_extra = 150;
  s.seed = 5;
  ForEachLayout(s);
}

// Sliding-window attention with the blocks before each chunk's window released (-1 in the table,
// NaN in the pool): whole prompts longer than the window, chunks over a cached prefix, windows
// shorter than a key tile, spanning several, of one token, and longer than the context.
TEST_P(PagedPrefill, SlidingWindow) {
  for (int window : {1, 40, 100}) {
    Shape s;
    s.seqs = {{150, 150}, {37, 187}, {1, 200}, {20, 20}, {64, 130}};
    if (!test::IsEmulator()) s.seqs.insert(s.seqs.end(), {{700, 2100}, {1, 3333}});
    s.window = window;
    s.seed = 300 + static_cast<uint32_t>(window);
    ForEachLayout(s);
  }
}

// Gemma-2's soft cap on peaked scores (std ~4, capped at 2 after scaling: the cap changes every
// weight), alone and with a sliding window, the mask after the cap.
TEST_P(PagedPrefill, SoftCap) {
  Shape s;
  s.seqs = {{150, 150}, {37, 187}, {1, 60}};
  s.q_std = 4.0f;
  s.softcap = 2.0f;
  s.seed = 400;
  ForEachLayout(s);
  s.window = 40;
  s.seed = 401;
  ForEachLayout(s);
}

TEST_P(PagedPrefill, PeakedSoftmax) {
  // Scores of std ~4: the running max moves a lot between tiles, stressing the rescaling.
  Shape s;
  s.seqs = {{150, 150}, {20, 170}};
  s.q_std = 4.0f;
  s.seed = 9;
  ForEachLayout(s);
}

TEST_P(PagedPrefill, LseMergeOfTwoHalvesEqualsWhole) {
  // Chunks over cached prefixes (a decode-like row among them), peaky softmax: each context's first
  // prefix blocks and the rest, merged by their LSEs, equal the whole context.
  Shape s;
  s.seqs = {{37, 187}, {1, 200}, {64, 128}, {20, 170}};
  s.q_std = 2.0f;
  s.merge_halves = true;
  s.seed = 21;
  ForEachLayout(s);
}

TEST_P(PagedPrefill, ManyHeadsLauncherChoice) {
  // Enough CTAs for the launcher to pick 128-row tiles on its own (>= 264 of them).
  Shape s;
  s.dtype = GetParam().dtype;
  s.head_dim = GetParam().head_dim;
  s.block_size = 16;
  s.num_kv_heads = 66;
  s.group = 1;
  s.seqs = {{130, 130}, {129, 200}};
  s.block_ms = {0};
  s.seed = 3;
  RunCase(s);
}

std::string ComboName(const ::testing::TestParamInfo<Combo>& info) {
  return std::string(cuda::DTypeName(info.param.dtype)) + "_d" + std::to_string(info.param.head_dim);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PagedPrefill,
                         ::testing::Values(Combo{DType::kF16, 64}, Combo{DType::kF16, 128}, Combo{DType::kBF16, 64},
                                           Combo{DType::kBF16, 128}, Combo{DType::kBF16, 256}),
                         ComboName);

// Argument checks need no GPU: the launcher refuses before touching the device.
TEST(PagedPrefillArgs, SupportsAndRejects) {
  EXPECT_TRUE(cuda::PagedPrefillSupports(64, 16));
  EXPECT_TRUE(cuda::PagedPrefillSupports(128, 8));
  EXPECT_TRUE(cuda::PagedPrefillSupports(128, 32));
  EXPECT_FALSE(cuda::PagedPrefillSupports(96, 16));
  EXPECT_TRUE(cuda::PagedPrefillSupports(256, 16));  // Gemma
  EXPECT_FALSE(cuda::PagedPrefillSupports(512, 16));
  EXPECT_FALSE(cuda::PagedPrefillSupports(128, 12));
  EXPECT_FALSE(cuda::PagedPrefillSupports(64, 0));

  alignas(16) static uint16_t dummy[64];
  static int32_t ints[4] = {0, 1, 1, 0};
  cuda::PagedPrefillArgs good;
  good.dtype = DType::kF16;
  good.out = dummy;
  good.out_row_stride = 128;
  good.query = dummy;
  good.query_row_stride = 128;
  good.key_cache = dummy;
  good.value_cache = dummy;
  good.block_tables = ints;
  good.block_table_stride = 1;
  good.query_starts = ints;
  good.query_lens = ints + 1;
  good.context_lens = ints + 2;
  good.num_seqs = 0;  // nothing to do: returns before any launch
  good.num_heads = 2;
  good.num_kv_heads = 1;
  good.head_dim = 64;
  good.block_size = 16;
  good.max_query_len = 1;
  good.scale = 0.125f;
  EXPECT_EQ(cuda::PagedAttentionPrefill(good, nullptr), 0);

  auto rejects = [&](auto mutate, const char* what) {
    cuda::PagedPrefillArgs a = good;
    a.num_seqs = 1;
    mutate(a);
    EXPECT_EQ(cuda::PagedAttentionPrefill(a, nullptr), cuda::kInvalidValue) << what;
  };
  rejects([](auto& a) { a.dtype = DType::kF32; }, "fp32");
  rejects([](auto& a) { a.head_dim = 96; }, "head_dim 96");
  rejects([](auto& a) { a.block_size = 12; }, "block_size 12");
  rejects([](auto& a) { a.num_kv_heads = 3; }, "heads not a multiple of kv heads");
  rejects([](auto& a) { a.query_row_stride = 100; }, "query row shorter than the heads");
  rejects([](auto& a) { a.query_row_stride = 132; }, "query rows not 16-byte aligned");
  rejects([](auto& a) { a.out_row_stride = 127; }, "out row stride");
  rejects([](auto& a) { a.query = reinterpret_cast<const uint8_t*>(dummy) + 2; }, "misaligned query");
  rejects([](auto& a) { a.max_query_len = 0; }, "max_query_len 0");
  rejects([](auto& a) { a.block_tables = nullptr; }, "no block tables");
  rejects([](auto& a) { a.scale = 0.0f; }, "scale 0");
  EXPECT_EQ(cuda::detail::PagedAttentionPrefillTiled(good, 96, nullptr), cuda::kInvalidValue) << "tile 96";
}

}  // namespace
}  // namespace kvflow
