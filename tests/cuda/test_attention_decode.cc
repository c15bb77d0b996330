// Paged decode attention (kernels/attention_decode.cu) against the CPU reference
// cpu::PagedAttention on a ForwardBatch of one-token slices: fp16 and bf16, head_dim 64 and 128,
// block_size 8/16/32, GQA group 1, 4, 8 and 12 (two head slices per kv head), contexts from 1 token
// to several partitions in one batch, max_context_len above every context (the CUDA-graph case),
// query rows permuted and inside wider fused-QKV rows, output rows wider than the heads.
//
// Which path a case takes follows from the partition heuristic in attention_decode.cu: contexts
// of at most 256 tokens are never split; above that the partition shrinks from 512 towards 64
// tokens until the grid has >= 512 CTAs. So the small-batch cases with max_context_len > 256 run
// 64-token partitions (a 200-token context: 4 partitions plus the reduce kernel; a <= 64-token one
// in the same batch: written directly), and LargeBatchFullPartitions runs 512-token partitions.
//
// Every case: random N(0,1) inputs rounded to the device dtype (the reference sees the same
// values), physical blocks shuffled, cache slots outside every context and unused block-table
// entries' block filled with NaN (a kernel reading past a context poisons its output), output and
// workspace poisoned; output rows and columns the kernel must not write are checked to still hold
// the poison.
//
// The log-sum-exp output (PagedAttentionArgs::lse) is checked against the reference's LSE in every
// case but LargeBatchFullPartitions and the odd rounds of RandomBatches (which run lse = nullptr),
// its unowned rows against poison; and attentions over the
// two halves of each context, merged by their LSEs (cpu::MergeAttentionStates), must equal the
// whole. LSE tolerance: fp16 1e-3, bf16 6e-3 absolute (see LseTolerance).
//
// Tolerances (outputs are softmax-weighted averages of N(0,1) values clamped to +-3.5, so
// |out| < 4; P is rounded to the input type for the P V product and the output is rounded to it
// once more), as the prefill suite's:
//   max |d|                                                fp16 2e-3, bf16 1.5e-2
//   max over (sequence, head) rows of |d_row|_2 / |ref_row|_2   fp16 4e-3, bf16 3e-2
// The row-relative L2 error is the relative check for every case and dtype: a row is a convex
// combination of V rows, so it holds its scale however long the context (at 32K tokens the
// elements are ~0.01 and atol alone would not check V at all). fp16 also keeps max rel 0.15 per
// element (relative to max(|ref|, 1e-3 max|ref|)); bf16 its norm over the whole output, 1e-2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attention_decode.h"
#include "backend/cpu/paged_attention.h"
#include "gpu_test_util.h"

namespace kvflow {
namespace cuda::detail {
// Test hook in kernels/attention_decode.cu: the workspace one launch needs (0: no split).
size_t PagedDecodeWorkspaceNeeded(int num_seqs, int num_heads, int num_kv_heads, int head_dim, int max_context_len);
}  // namespace cuda::detail

namespace {

using cuda::DType;

constexpr uint16_t kPoisonBits = 0xFFFF;  // DeviceBuffer::Poison: NaN in fp16 and bf16

struct Shape {
  DType dtype = DType::kF16;
  int head_dim = 128;
  int block_size = 16;
  int num_kv_heads = 2;
  int group = 1;
  std::vector<int> contexts;
  int max_context_len = 0;  // 0: the largest context
  bool fused_rows = true;   // query rows of (H + 2 KV) * D elements, output rows of H * D + 8, permuted
  float q_std = 1.0f;       // larger: peakier softmax
  bool lse = true;          // also check the LSE output (false: lse = nullptr)
  // > 0: sliding-window attention; table entries of blocks wholly before a sequence's window are
  // -1 (released) and the blocks themselves NaN.
  int window = 0;
  // > 0: Gemma-2's soft cap on the scaled scores (AttentionIo::softcap).
  float softcap = 0.0f;
  uint32_t seed = 1;
};

int MaxContext(const Shape& s) {
  int m = 0;
  for (int c : s.contexts) m = std::max(m, c);
  return std::max(m, s.max_context_len);
}

std::string Describe(const Shape& s) {
  std::ostringstream os;
  os << cuda::DTypeName(s.dtype) << " d" << s.head_dim << " bs" << s.block_size << " kv" << s.num_kv_heads << "x"
     << s.group << " ctx";
  for (size_t i = 0; i < s.contexts.size() && i < 6; ++i) os << (i ? "," : " ") << s.contexts[i];
  if (s.contexts.size() > 6) os << ",..(" << s.contexts.size() << ")";
  os << " max" << MaxContext(s);
  if (!s.fused_rows) os << " dense";
  if (s.q_std != 1.0f) os << " qstd" << s.q_std;
  if (!s.lse) os << " no-lse";
  if (s.window > 0) os << " window" << s.window;
  if (s.softcap > 0) os << " softcap" << s.softcap;
  return os.str();
}

// One batch's inputs (host copies rounded to the device dtype, and their device copies) and the
// CPU reference's output and LSE over each sequence's whole context.
struct Problem {
  explicit Problem(const Shape& shape);

  Shape s;
  int D, bs, KV, H, num_seqs, max_ctx;
  float scale;
  KvCacheLayout layout;
  std::vector<float> key, value;
  ForwardBatch batch;
  int bt_stride = 0;
  int32_t nan_block = 0;
  std::vector<int32_t> block_tables;  // [num_seqs][bt_stride], unused entries: the NaN block
  int num_rows = 0;
  int64_t q_stride = 0, o_stride = 0;
  std::vector<int32_t> query_rows;  // sequence i owns row query_rows[i]
  std::vector<float> query;         // [seq][H * D] for the reference
  std::vector<float> ref, ref_lse;  // [seq][H * D], [seq][H]
  test::DeviceBuffer d_key, d_value, d_query, d_rows;
};

Problem::Problem(const Shape& shape) : s(shape) {
  D = s.head_dim, bs = s.block_size, KV = s.num_kv_heads, H = KV * s.group;
  num_seqs = static_cast<int>(s.contexts.size());
  max_ctx = MaxContext(s);
  scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::mt19937 rng(s.seed * 7919u + static_cast<uint32_t>(D + bs + H));

  // Physical blocks from a shuffled pool; one spare block (all NaN) fills unused table entries.
  int total_blocks = 0;
  for (int c : s.contexts) total_blocks += (c + bs - 1) / bs;
  const int num_blocks = total_blocks + 2;
  std::vector<int32_t> pool(static_cast<size_t>(num_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  nan_block = pool.back();
  bt_stride = (max_ctx + bs - 1) / bs + 1;
  block_tables.assign(static_cast<size_t>(num_seqs) * bt_stride, nan_block);

  layout = KvCacheLayout{1, num_blocks, KV, bs, D};
  key.resize(layout.layer_stride());
  value.resize(layout.layer_stride());
  test::FillNormal(key, rng);
  test::FillNormal(value, rng);
  // |v| <= 3.5, so |out| < 4 and rounding the output itself costs at most half an ulp of [2, 4):
  // fp16 9.8e-4, bf16 7.8e-3, well inside the tolerances.
  for (float& v : value) v = std::clamp(v, -3.5f, 3.5f);

  // One-token slices: the token at position context - 1, its K/V already in the cache.
  std::vector<bool> slot_used(static_cast<size_t>(num_blocks) * bs, false);
  int next_block = 0;
  for (int i = 0; i < num_seqs; ++i) {
    const int ctx = s.contexts[static_cast<size_t>(i)];
    SequenceSlice slice;
    slice.token_offset = i;
    slice.num_tokens = 1;
    slice.context_len = ctx;
    const int nb = (ctx + bs - 1) / bs;
    slice.block_table.assign(pool.begin() + next_block, pool.begin() + next_block + nb);
    next_block += nb;
    const int released = s.window > 0 ? std::max(0, ctx - s.window) / bs : 0;
    for (int t = released * bs; t < ctx; ++t) slot_used[static_cast<size_t>(slice.block_table[t / bs]) * bs + t % bs] = true;
    std::fill_n(slice.block_table.begin(), released, kReleasedBlock);
    std::copy(slice.block_table.begin(), slice.block_table.end(), block_tables.begin() + static_cast<long>(i) * bt_stride);
    batch.tokens.push_back(0);
    batch.positions.push_back(ctx - 1);
    batch.seqs.push_back(std::move(slice));
  }
  for (int b = 0; b < num_blocks; ++b) {
    for (int slot = 0; slot < bs; ++slot) {
      if (slot_used[static_cast<size_t>(b) * bs + slot]) continue;
      for (int h = 0; h < KV; ++h) {
        const size_t off = layout.offset(b, h, slot);
        std::fill(key.begin() + static_cast<long>(off), key.begin() + static_cast<long>(off) + D, NAN);
        std::fill(value.begin() + static_cast<long>(off), value.begin() + static_cast<long>(off) + D, NAN);
      }
    }
  }
  const std::vector<uint8_t> key_bytes = test::ToDeviceBytes(key, s.dtype);
  const std::vector<uint8_t> value_bytes = test::ToDeviceBytes(value, s.dtype);

  // Query rows: one spare row that no sequence owns; sequence i owns row query_rows[i].
  num_rows = num_seqs + 1;
  q_stride = s.fused_rows ? static_cast<int64_t>(H + 2 * KV) * D : static_cast<int64_t>(H) * D;
  o_stride = s.fused_rows ? static_cast<int64_t>(H) * D + 8 : static_cast<int64_t>(H) * D;
  query_rows.resize(static_cast<size_t>(num_rows));
  std::iota(query_rows.begin(), query_rows.end(), 0);
  if (s.fused_rows) std::shuffle(query_rows.begin(), query_rows.end(), rng);
  query_rows.resize(static_cast<size_t>(num_seqs));
  std::vector<float> q_rows(static_cast<size_t>(num_rows * q_stride));
  test::FillNormal(q_rows, rng, s.q_std);
  const std::vector<uint8_t> q_bytes = test::ToDeviceBytes(q_rows, s.dtype);
  query.resize(static_cast<size_t>(num_seqs) * H * D);
  for (int i = 0; i < num_seqs; ++i) {
    const float* src = q_rows.data() + query_rows[static_cast<size_t>(i)] * q_stride;
    std::copy(src, src + static_cast<long>(H) * D, query.begin() + static_cast<long>(i) * H * D);
  }

  ref.resize(query.size());
  ref_lse.resize(static_cast<size_t>(num_seqs) * H);
  std::vector<std::vector<int64_t>> views(batch.seqs.size());
  for (size_t i = 0; i < views.size(); ++i) ViewSlots(batch.seqs[i], bs, views[i]);
  cpu::AttentionIo io;
  io.query = query.data();
  io.query_row_stride = static_cast<int64_t>(H) * D;
  io.out = ref.data();
  io.out_row_stride = io.query_row_stride;
  io.lse = ref_lse.data();
  io.window = s.window;
  io.softcap = s.softcap;
  cpu::PagedAttention(batch, views, layout, H, io, key.data(), value.data(), scale);

  d_key = test::DeviceBuffer::From(key_bytes);
  d_value = test::DeviceBuffer::From(value_bytes);
  d_query = test::DeviceBuffer::From(q_bytes);
  d_rows = test::DeviceBuffer::From(query_rows);
}

// What one launch produced, in the reference's order.
struct LaunchResult {
  std::vector<float> out;  // [seq][H * D]
  std::vector<float> lse;  // [seq][H]; empty without LSE
  size_t clobbered = 0;    // output elements written outside the sequences' rows
  size_t lse_clobbered = 0;
  bool split = false;
};

// One launch over `tables` ([num_seqs][bt_stride]) and `contexts`, with a grid for max_context_len
// (P.max_ctx by default); output and workspace poisoned.
LaunchResult Launch(const Problem& P, const std::vector<int32_t>& tables, const std::vector<int32_t>& contexts, bool with_lse,
              int max_context_len = 0) {
  if (max_context_len == 0) max_context_len = P.max_ctx;
  const int H = P.H, D = P.D, num_seqs = P.num_seqs;
  test::DeviceBuffer d_tables = test::DeviceBuffer::From(tables);
  test::DeviceBuffer d_ctx = test::DeviceBuffer::From(contexts);
  test::DeviceBuffer d_out(static_cast<size_t>(P.num_rows * P.o_stride) * 2);
  d_out.Poison();
  test::DeviceBuffer d_lse(with_lse ? static_cast<size_t>(P.num_rows) * H * sizeof(float) : 0);
  d_lse.Poison();
  const size_t ws_bytes = cuda::PagedDecodeWorkspaceBytes(num_seqs, H, D, max_context_len);
  test::DeviceBuffer d_ws(ws_bytes);
  d_ws.Poison();

  cuda::PagedDecodeArgs args;
  args.dtype = P.s.dtype;
  args.out = d_out.get();
  args.out_row_stride = P.o_stride;
  args.query = P.d_query.get();
  args.query_row_stride = P.q_stride;
  args.key_cache = P.d_key.get();
  args.value_cache = P.d_value.get();
  args.block_tables = d_tables.get<int32_t>();
  args.block_table_stride = P.bt_stride;
  args.context_lens = d_ctx.get<int32_t>();
  args.query_rows = P.d_rows.get<int32_t>();
  args.num_seqs = num_seqs;
  args.num_heads = H;
  args.num_kv_heads = P.KV;
  args.head_dim = D;
  args.block_size = P.bs;
  args.max_context_len = max_context_len;
  args.scale = P.scale;
  args.workspace = d_ws.get();
  args.workspace_bytes = ws_bytes;
  args.lse = with_lse ? d_lse.get<float>() : nullptr;
  args.window = P.s.window;
  args.softcap = P.s.softcap;
  LaunchResult r;
  r.split = cuda::detail::PagedDecodeWorkspaceNeeded(num_seqs, H, P.KV, D, max_context_len) > 0;
  const int rc = cuda::PagedAttentionDecode(args, nullptr);
  EXPECT_EQ(rc, 0) << cudaGetErrorString(static_cast<cudaError_t>(rc));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const std::vector<uint16_t> out_bits = d_out.Download<uint16_t>();
  r.out.resize(static_cast<size_t>(num_seqs) * H * D);
  std::vector<bool> written(out_bits.size(), false);
  for (int i = 0; i < num_seqs; ++i) {
    const int64_t base = P.query_rows[static_cast<size_t>(i)] * P.o_stride;
    for (int j = 0; j < H * D; ++j) {
      r.out[static_cast<size_t>(i) * H * D + j] = test::BitsToFloat(out_bits[static_cast<size_t>(base + j)], P.s.dtype);
      written[static_cast<size_t>(base + j)] = true;
    }
  }
  for (size_t i = 0; i < out_bits.size(); ++i) r.clobbered += !written[i] && out_bits[i] != kPoisonBits;
  if (with_lse) {
    const std::vector<uint32_t> lse_bits = d_lse.Download<uint32_t>();
    std::vector<bool> lse_written(lse_bits.size(), false);
    r.lse.resize(static_cast<size_t>(num_seqs) * H);
    for (int i = 0; i < num_seqs; ++i) {
      for (int h = 0; h < H; ++h) {
        const size_t at = static_cast<size_t>(P.query_rows[static_cast<size_t>(i)]) * H + h;
        std::memcpy(&r.lse[static_cast<size_t>(i) * H + h], &lse_bits[at], 4);
        lse_written[at] = true;
      }
    }
    for (size_t i = 0; i < lse_bits.size(); ++i) r.lse_clobbered += !lse_written[i] && lse_bits[i] != 0xFFFFFFFFu;
  }
  return r;
}

std::vector<int32_t> ContextLens(const Shape& s) { return std::vector<int32_t>(s.contexts.begin(), s.contexts.end()); }

// LSE tolerance: the logits match the reference to fp32 rounding; the kernel's denominator sums
// the probabilities rounded to the input dtype (relative error <= 2^-11 fp16, 2^-8 bf16 per term,
// the largest term exactly 1), which bounds |d lse| by that relative error.
double LseTolerance(DType t) { return t == DType::kF16 ? 1e-3 : 6e-3; }
double OutTolerance(DType t) { return t == DType::kF16 ? 2e-3 : 1.5e-2; }

double RowTolerance(DType t) { return t == DType::kF16 ? 4e-3 : 3e-2; }

// Every row within RowTolerance of its reference row; fp16 also per element (rtol 0.15), bf16
// norm-wise over the output (1e-2: its per-element ratio is meaningless near zero).
void ExpectOutClose(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref, DType t,
                    int head_dim) {
  if (t == DType::kF16) {
    test::ExpectClose(what, got, ref, OutTolerance(t), 0.15);
  } else {
    test::ExpectCloseNormwise(what, got, ref, OutTolerance(t), 1e-2);
  }
  test::ExpectRowsClose("", got, ref, static_cast<size_t>(head_dim), RowTolerance(t));
}

void RunCase(const Shape& s) {
  SCOPED_TRACE(Describe(s));
  const Problem P(s);
  const LaunchResult r = Launch(P, P.block_tables, ContextLens(s), s.lse);
  EXPECT_EQ(r.clobbered, 0u) << "elements written outside the sequences' output rows";
  const std::string what = Describe(s) + (r.split ? " [split]" : "");
  ExpectOutClose(what, r.out, P.ref, s.dtype, P.D);
  if (s.lse) {
    EXPECT_EQ(r.lse_clobbered, 0u) << "LSE written outside the sequences' rows";
    test::ExpectClose(what + " LSE", r.lse, P.ref_lse, LseTolerance(s.dtype), 1.0);
  }
}

// Attention over the first half of each context's blocks and over the rest (two block tables),
// merged by cpu::MergeAttentionStates with the kernel's LSEs, equals attention over the whole
// context (the reference), in output and LSE. Contexts must span at least two blocks.
void RunMergeCase(const Shape& s) {
  SCOPED_TRACE(Describe(s) + " halves");
  const Problem P(s);
  const int bs = P.bs, H = P.H, D = P.D;
  std::vector<int32_t> tables_a(P.block_tables.size(), P.nan_block), tables_b = tables_a;
  std::vector<int32_t> ctx_a, ctx_b;
  for (int i = 0; i < P.num_seqs; ++i) {
    const int ctx = s.contexts[static_cast<size_t>(i)];
    const int nb = (ctx + bs - 1) / bs;
    ASSERT_GE(nb, 2) << "context " << ctx << " has no two halves";
    const int na = nb / 2;
    const auto row = P.block_tables.begin() + static_cast<long>(i) * P.bt_stride;
    std::copy(row, row + na, tables_a.begin() + static_cast<long>(i) * P.bt_stride);
    std::copy(row + na, row + nb, tables_b.begin() + static_cast<long>(i) * P.bt_stride);
    ctx_a.push_back(na * bs);
    ctx_b.push_back(ctx - na * bs);
  }
  const LaunchResult a = Launch(P, tables_a, ctx_a, true);
  const LaunchResult b = Launch(P, tables_b, ctx_b, true);
  std::vector<float> merged(P.ref.size()), merged_lse(P.ref_lse.size());
  cpu::MergeAttentionStates(a.out.data(), a.lse.data(), b.out.data(), b.lse.data(),
                            static_cast<int64_t>(P.num_seqs) * H, D, merged.data(), merged_lse.data());
  const std::string what = Describe(s) + (a.split || b.split ? " [split]" : "") + " halves merged";
  ExpectOutClose(what, merged, P.ref, s.dtype, P.D);
  test::ExpectClose(what + " LSE", merged_lse, P.ref_lse, LseTolerance(s.dtype), 1.0);
}

// Contexts of one batch: single tokens, partial tiles, exact tiles, several tiles and (with
// max_context_len 300) a context split into 64-token partitions next to ones written directly.
TEST(PagedAttentionDecode, ShapesMatchCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  uint32_t seed = 1;
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    for (int head_dim : {64, 128, 256}) {  // 256: Gemma
      for (int block_size : {8, 16, 32}) {
        for (int group : {1, 4}) {
          Shape s;
          s.dtype = dtype;
          s.head_dim = head_dim;
          s.block_size = block_size;
          s.num_kv_heads = group == 1 ? 3 : 2;
          s.group = group;
          s.contexts = {1, 7, 16, 33, 200, 17};
          // bs 16: max_context_len = the largest context (<= 256: never split, one CTA per head);
          // otherwise 300 (64-token partitions; the grid covers contexts nobody has).
          s.max_context_len = block_size == 16 ? 0 : 300;
          s.seed = seed++;
          RunCase(s);
        }
      }
    }
  }
}

// Long contexts over many 64-token partitions (the reduce kernel merging up to 18 of them), with
// short ones in the same batch; peaky softmax; the full group of 8 query heads per kv head.
TEST(PagedAttentionDecode, LongContextsSplitMatchCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  Shape a;
  a.dtype = DType::kF16;
  a.head_dim = 128;
  a.block_size = 16;
  a.num_kv_heads = 2;
  a.group = 4;
  a.contexts = {1100, 37, 1};
  a.max_context_len = 1152;
  a.q_std = 2.5f;
  a.seed = 101;
  RunCase(a);

  Shape b;
  b.dtype = DType::kBF16;
  b.head_dim = 64;
  b.block_size = 32;
  b.num_kv_heads = 1;
  b.group = 8;
  b.contexts = {1025, 300, 64, 65};
  b.seed = 102;
  RunCase(b);

  Shape c;
  c.dtype = DType::kF16;
  c.head_dim = 128;
  c.block_size = 8;
  c.num_kv_heads = 2;
  c.group = 8;
  c.contexts = {513, 129, 2};
  c.max_context_len = 700;
  c.fused_rows = false;
  c.seed = 103;
  RunCase(c);
}

// Sliding-window attention (the query at p sees p - window + 1 .. p) with the blocks before each
// window released (-1 in the table, NaN in the pool): partitions before the window skipped, a
// window inside one partition or across two (one written directly, one through the reduce), a
// window of one token, windows longer than the context.
TEST(PagedAttentionDecode, SlidingWindowMatchesCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  Shape a;
  a.dtype = DType::kF16;
  a.group = 4;
  a.contexts = {1100, 37, 1, 300};
  a.max_context_len = 1152;
  a.window = 200;
  a.seed = 111;
  RunCase(a);

  Shape b;
  b.dtype = DType::kBF16;
  b.head_dim = 64;
  b.block_size = 32;
  b.num_kv_heads = 1;
  b.group = 8;
  b.contexts = {1025, 64, 65};
  b.window = 64;
  b.seed = 112;
  RunCase(b);

  Shape c;
  c.block_size = 8;
  c.group = 8;
  c.contexts = {513, 129, 2};
  c.max_context_len = 700;
  c.window = 1;
  c.fused_rows = false;
  c.seed = 113;
  RunCase(c);

  Shape d;
  d.head_dim = 64;
  d.num_kv_heads = 8;
  d.contexts = std::vector<int>(32, 600);
  d.contexts[0] = 4000;
  d.contexts[1] = 1030;
  d.window = 513;
  d.seed = 114;
  RunCase(d);
}

// Gemma-2's soft cap on peaked scores (capped at 2 after scaling: the cap changes every weight),
// a context split over partitions (through the reduce), and with a sliding window.
TEST(PagedAttentionDecode, SoftCapMatchesCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF16, DType::kBF16}) {
    Shape a;
    a.dtype = t;
    a.group = 4;
    a.contexts = {1100, 37, 1};
    a.q_std = 4.0f;
    a.softcap = 2.0f;
    a.seed = 121;
    RunCase(a);
    a.window = 100;
    a.seed = 122;
    RunCase(a);
  }
}

// 32 sequences x 8 kv heads x 2 partitions reach the 512-CTA target with 512-token partitions:
// two long contexts are split in two (one exactly 2 x 512), the short ones are written directly.
TEST(PagedAttentionDecode, LargeBatchFullPartitions) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> short_len(1, 48);
  Shape s;
  s.dtype = DType::kBF16;
  s.head_dim = 64;
  s.block_size = 16;
  s.num_kv_heads = 8;
  s.group = 1;
  for (int i = 0; i < 32; ++i) s.contexts.push_back(short_len(rng));
  s.contexts[5] = 700;
  s.contexts[20] = 1024;
  s.max_context_len = 1024;
  s.lse = false;  // the lse == nullptr path of a split batch
  s.seed = 201;
  ASSERT_GT(cuda::PagedDecodeWorkspaceBytes(32, 8, 64, 1024), 0u);
  RunCase(s);
}

// More query heads per kv head than one CTA computes (12 -> two slices of 6), and MHA with many
// heads.
TEST(PagedAttentionDecode, WideGroupsAndMha) {
  KVFLOW_SKIP_WITHOUT_GPU();
  Shape a;
  a.dtype = DType::kBF16;
  a.head_dim = 64;
  a.block_size = 16;
  a.num_kv_heads = 1;
  a.group = 12;
  a.contexts = {5, 90, 300};
  a.max_context_len = 400;
  a.seed = 301;
  RunCase(a);

  Shape b;
  b.dtype = DType::kF16;
  b.head_dim = 64;
  b.block_size = 8;
  b.num_kv_heads = 16;
  b.group = 1;
  b.contexts = {3, 41};
  b.seed = 302;
  RunCase(b);
}

// A context over 129 partitions of 64 tokens (the reduce kernel's loop over many partitions).
TEST(PagedAttentionDecode, VeryLongContexts) {
  KVFLOW_SKIP_WITHOUT_GPU();
  Shape a;
  a.dtype = DType::kF16;
  a.head_dim = 128;
  a.block_size = 32;
  a.num_kv_heads = 2;
  a.group = 4;
  a.contexts = {8200, 3};
  a.q_std = 2.0f;
  a.seed = 501;
  RunCase(a);
}

// 32K tokens in 64 partitions of 512 (8 tiles per warp: online-softmax rescaling), bf16, where the
// outputs are ~0.01 and only the row-relative check sees V.
TEST(PagedAttentionDecode, Context32K) {
  KVFLOW_SKIP_WITHOUT_GPU();
  if (test::IsEmulator()) GTEST_SKIP() << "37K tokens x 8 KV heads take minutes on the emulator; runs on a GPU";
  Shape b;
  b.dtype = DType::kBF16;
  b.head_dim = 128;
  b.block_size = 16;
  b.num_kv_heads = 8;
  b.group = 4;
  b.contexts = {32768, 5000};
  b.seed = 502;
  RunCase(b);
}

// Larger batches with random contexts; on the emulator only a small one.
TEST(PagedAttentionDecode, RandomBatches) {
  KVFLOW_SKIP_WITHOUT_GPU();
  const bool emu = test::IsEmulator();
  std::mt19937 rng(11);
  const int rounds = emu ? 1 : 6;
  for (int r = 0; r < rounds; ++r) {
    Shape s;
    s.dtype = r % 2 ? DType::kBF16 : DType::kF16;
    s.head_dim = r % 3 == 2 ? 64 : 128;
    s.block_size = 8 << (r % 3);
    s.num_kv_heads = emu ? 2 : 8;
    s.group = (r % 4 == 3) ? 1 : 4;
    const int num_seqs = emu ? 5 : 16 + 12 * r;
    const int max_len = emu ? 160 : 4096;
    std::uniform_int_distribution<int> len(1, max_len);
    for (int i = 0; i < num_seqs; ++i) s.contexts.push_back(len(rng));
    s.max_context_len = max_len + 100;
    s.lse = r % 2 == 0;
    s.seed = 400 + static_cast<uint32_t>(r);
    RunCase(s);
  }
}

// LSE merge: attention over two disjoint halves of each context (two block tables), merged with
// cpu::MergeAttentionStates by the kernel's LSEs, equals attention over the whole context. Both
// dtypes and head dims, GQA, halves split into partitions (max_context_len > 256) and not.
TEST(PagedAttentionDecode, LseMergeOfTwoHalvesEqualsWhole) {
  KVFLOW_SKIP_WITHOUT_GPU();
  uint32_t seed = 600;
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    for (int head_dim : {64, 128}) {
      Shape s;
      s.dtype = dtype;
      s.head_dim = head_dim;
      s.block_size = head_dim == 64 ? 16 : 32;
      s.num_kv_heads = 2;
      s.group = head_dim == 64 ? 4 : 1;
      s.contexts = {33, 200, 65, 1100};  // the 1100-token halves split into 64-token partitions
      s.max_context_len = 1152;
      s.q_std = 2.0f;
      s.seed = seed++;
      RunMergeCase(s);
      s.contexts = {40, 250, 70};  // max_context_len <= 256: no half is split
      s.max_context_len = 0;
      s.seed = seed++;
      RunMergeCase(s);
    }
  }
}

// The backend sizes the workspace once, with PagedDecodeWorkspaceBytes(max_num_seqs, .., max_model_len);
// every launch with fewer sequences, a shorter max_context_len and any kv head count must fit.
TEST(PagedAttentionDecode, WorkspaceBoundCoversEveryLaunch) {
  const int H = 32, D = 128;
  for (int max_seqs : {1, 2, 7, 31, 32, 33, 64, 256}) {
    for (int max_len : {64, 256, 257, 300, 1000, 4096, 8192, 32768, 131072}) {
      const size_t bound = cuda::PagedDecodeWorkspaceBytes(max_seqs, H, D, max_len);
      size_t worst = 0;
      for (int n = 1; n <= max_seqs; n += std::max(1, max_seqs / 16)) {
        for (int m = 1; m <= max_len; m += std::max(1, max_len / 97)) {
          for (int kv : {1, 2, 4, 8, 32}) {
            const size_t need = cuda::detail::PagedDecodeWorkspaceNeeded(n, H, kv, D, m);
            worst = std::max(worst, need);
            ASSERT_LE(need, bound) << "seqs " << n << "/" << max_seqs << " len " << m << "/" << max_len << " kv " << kv;
          }
        }
      }
      const size_t need_full = cuda::detail::PagedDecodeWorkspaceNeeded(max_seqs, H, 8, D, max_len);
      ASSERT_LE(need_full, bound);
      // Not grossly oversized: within 2 x kTargetCtas (sequence, partition) pairs of the worst case.
      EXPECT_LE(bound, std::max(worst, need_full) + size_t{1024} * H * (D + 2) * 4) << max_seqs << " " << max_len;
    }
  }
}

TEST(PagedAttentionDecode, UnsupportedShapesAreRejected) {
  KVFLOW_SKIP_WITHOUT_GPU();
  EXPECT_TRUE(cuda::PagedDecodeSupports(64, 8));
  EXPECT_TRUE(cuda::PagedDecodeSupports(128, 32));
  EXPECT_FALSE(cuda::PagedDecodeSupports(96, 16));
  EXPECT_TRUE(cuda::PagedDecodeSupports(256, 16));  // Gemma
  EXPECT_FALSE(cuda::PagedDecodeSupports(512, 16));
  EXPECT_FALSE(cuda::PagedDecodeSupports(128, 64));
  EXPECT_FALSE(cuda::PagedDecodeSupports(128, 4));

  // Valid arguments (contexts <= 256: no workspace needed), then one thing wrong at a time.
  const int H = 4, KV = 2, D = 128, bs = 16;
  test::DeviceBuffer out(static_cast<size_t>(H) * 256 * 2), query(static_cast<size_t>(H) * 256 * 2);
  test::DeviceBuffer cache(static_cast<size_t>(KV) * bs * 256 * 2);
  test::DeviceBuffer tables = test::DeviceBuffer::From(std::vector<int32_t>{0});
  test::DeviceBuffer ctx = test::DeviceBuffer::From(std::vector<int32_t>{5});
  test::DeviceBuffer rows = test::DeviceBuffer::From(std::vector<int32_t>{0});
  out.Poison();
  cuda::PagedDecodeArgs good;
  good.dtype = DType::kF16;
  good.out = out.get();
  good.out_row_stride = H * D;
  good.query = query.get();
  good.query_row_stride = H * D;
  good.key_cache = cache.get();
  good.value_cache = cache.get();
  good.block_tables = tables.get<int32_t>();
  good.block_table_stride = 1;
  good.context_lens = ctx.get<int32_t>();
  good.query_rows = rows.get<int32_t>();
  good.num_seqs = 1;
  good.num_heads = H;
  good.num_kv_heads = KV;
  good.head_dim = D;
  good.block_size = bs;
  good.max_context_len = 16;
  EXPECT_EQ(cuda::PagedDecodeWorkspaceBytes(1, H, D, 16), 0u);

  auto rejected = [&](const char* what, auto mutate) {
    cuda::PagedDecodeArgs a = good;
    mutate(a);
    EXPECT_NE(cuda::PagedAttentionDecode(a, nullptr), 0) << what;
  };
  rejected("head_dim 96", [](cuda::PagedDecodeArgs& a) { a.head_dim = 96; });
  rejected("head_dim 512", [](cuda::PagedDecodeArgs& a) { a.head_dim = 512; });
  rejected("block_size 64", [](cuda::PagedDecodeArgs& a) { a.block_size = 64; });
  rejected("fp32", [](cuda::PagedDecodeArgs& a) { a.dtype = DType::kF32; });
  rejected("heads % kv heads", [](cuda::PagedDecodeArgs& a) { a.num_heads = 3; });
  rejected("unaligned query stride", [](cuda::PagedDecodeArgs& a) { a.query_row_stride = H * D + 4; });
  rejected("max_context_len 0", [](cuda::PagedDecodeArgs& a) { a.max_context_len = 0; });
  rejected("split without workspace", [](cuda::PagedDecodeArgs& a) { a.max_context_len = 4096; });

  cuda::PagedDecodeArgs none = good;
  none.num_seqs = 0;
  EXPECT_EQ(cuda::PagedAttentionDecode(none, nullptr), 0);
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  for (uint16_t b : out.Download<uint16_t>()) ASSERT_EQ(b, kPoisonBits) << "a rejected launch wrote output";
}

}  // namespace
}  // namespace kvflow
