#include "backend/cpu/paged_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backend/cpu/attention_kernels.h"
#include "backend/cpu/kv_q4.h"
#include "util/half.h"
#include "util/thread_pool.h"

namespace kvflow::cpu {

const char* KvElementName(KvElement e) {
  switch (e) {
    case KvElement::kF32: return "fp32";
    case KvElement::kF16: return "fp16";
    case KvElement::kQ4: return "q4";
  }
  return "?";
}

size_t KvPoolBytes(KvElement e, size_t elements) {
  switch (e) {
    case KvElement::kF32: return elements * sizeof(float);
    case KvElement::kF16: return elements * sizeof(uint16_t);
    case KvElement::kQ4: return elements / kQ4GroupSize * sizeof(Q4Group);
  }
  return 0;
}

Status CheckKvElement(KvElement e, int head_dim) {
  if (e == KvElement::kQ4 && (head_dim <= 0 || head_dim % kQ4GroupSize != 0)) {
    return Status::InvalidArgument("a q4 KV cache quantizes head_dim in groups of 32; head_dim " +
                                   std::to_string(head_dim) + " is not a multiple of 32 (use f16 or f32)");
  }
  return Status::Ok();
}

namespace {

// fp32 -> fp16 rows, rounding to nearest even: F16C where the build targets it (Release builds
// x86-64-v3), else the bit-exact portable conversions (sanitizer and debug builds).
void ToHalf(const float* src, uint16_t* dst, int n) {
  int i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = FloatToHalfBits(src[i]);
}

template <typename T>
void WriteRows(std::span<const int64_t> slots, const KvCacheLayout& layout, const float* key, const float* value,
               int64_t row_stride, T* key_cache, T* value_cache) {
  const int D = layout.head_dim;
  const int KV = layout.num_kv_heads;
  const int bs = layout.block_size;
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    const int block = static_cast<int>(slots[t] / bs);
    const int offset = static_cast<int>(slots[t] % bs);
    for (int h = 0; h < KV; ++h) {
      const size_t dst = layout.offset(block, h, offset);
      const float* k = key + static_cast<int64_t>(t) * row_stride + h * D;
      const float* v = value + static_cast<int64_t>(t) * row_stride + h * D;
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(key_cache + dst, k, sizeof(float) * D);
        std::memcpy(value_cache + dst, v, sizeof(float) * D);
      } else if constexpr (std::is_same_v<T, Q4Group>) {
        QuantizeQ4(k, D, key_cache + dst / kQ4GroupSize);
        QuantizeQ4(v, D, value_cache + dst / kQ4GroupSize);
      } else {
        ToHalf(k, key_cache + dst, D);
        ToHalf(v, value_cache + dst, D);
      }
    }
  }
}

}  // namespace

void WriteKvCache(std::span<const int64_t> slots, const KvCacheLayout& layout, const float* key,
                  const float* value, int64_t row_stride, float* key_cache, float* value_cache) {
  WriteRows(slots, layout, key, value, row_stride, key_cache, value_cache);
}

void WriteKvCache(std::span<const int64_t> slots, const KvCacheLayout& layout, const float* key,
                  const float* value, int64_t row_stride, KvElement element, void* key_cache, void* value_cache) {
  if (element == KvElement::kF16) {
    WriteRows(slots, layout, key, value, row_stride, static_cast<uint16_t*>(key_cache),
              static_cast<uint16_t*>(value_cache));
  } else if (element == KvElement::kQ4) {
    WriteRows(slots, layout, key, value, row_stride, static_cast<Q4Group*>(key_cache),
              static_cast<Q4Group*>(value_cache));
  } else {
    WriteRows(slots, layout, key, value, row_stride, static_cast<float*>(key_cache), static_cast<float*>(value_cache));
  }
}

void WriteKvCache(const ForwardBatch& batch, const KvCacheLayout& layout, const float* key,
                  const float* value, float* key_cache, float* value_cache) {
  const std::vector<int64_t> slots = ResolveSlotMapping(batch, layout.block_size);
  WriteKvCache(slots, layout, key, value, static_cast<int64_t>(layout.num_kv_heads) * layout.head_dim, key_cache,
               value_cache);
}

namespace {

// Tiled attention (flash-attention on the CPU). A tile is up to kTileRows query rows of one
// sequence and one KV head: consecutive new tokens x the query heads of the group, so each key and
// value row is read once for all of them. Keys are taken in chunks of kAttentionChunkKeys view
// entries, packed transposed (widened from fp16 on the way) and scored against the whole tile, and
// folded into a running softmax; value rows are read where they lie. Chunks are grouped into partitions of kPartitionKeys entries; each row's
// partitions are folded in order at the end. With few tiles (decode of one long sequence) the
// partitions of a tile run on different threads (flash-decoding), else one thread takes a tile's
// partitions in turn. Chunk and partition boundaries sit at fixed view positions and every kernel
// computes a row from its own inputs (attention_kernels.h), so a row's result is bit-identical
// however it is tiled, split or batched.
constexpr int32_t kPartitionKeys = 512;
constexpr int kTileRows = 96;
constexpr int kMaxHeadDim = 512;
constexpr int kChunk = kAttentionChunkKeys;
// Chunks requested ahead of the one being computed (1 to 3 measured alike at 8K; without any, 1.4x
// slower).
constexpr int kPrefetchChunks = 2;
static_assert(kPartitionKeys % kChunk == 0);

struct Tile {
  int32_t seq;            // slice index
  int32_t first_token;    // batch index of its first token
  int32_t tokens;
  int32_t first_visible;  // view entries its first token sees; each next token sees one more
  int32_t partitions;     // partitions its last token reaches
  int64_t first_state;    // split mode: index of its (kv_head 0, partition 0) state
  int32_t first_key = 0;  // sliding window: the first view entry any of its tokens sees
  int32_t first_partition = 0;  // the partition holding first_key
  int32_t last_visible() const { return first_visible + tokens - 1; }
};

// One work item: a tile's KV head, over one partition (split mode) or all of them (-1).
struct Unit {
  int32_t tile;
  int32_t kv_head;
  int32_t partition;
};

// Softmax state of a tile's rows over some keys: running max, sum of exponentials, unnormalized
// output (rows x head_dim).
struct RowStates {
  float* max;
  float* sum;
  float* out;
};

// Per-thread buffers, grown on demand: the tile's queries, a chunk's scores and packed keys, q4
// rows dequantized, and softmax states.
struct Scratch {
  std::vector<float> query, scores, packed_keys, keys, values, state, total;
  void Reserve(size_t rows, int D) {
    auto grow = [](std::vector<float>& v, size_t n) {
      if (v.size() < n) v.resize(n, 0.0f);
    };
    grow(query, rows * D);
    grow(scores, rows * kChunk);
    grow(packed_keys, static_cast<size_t>(kChunk) * D);
    grow(keys, static_cast<size_t>(kChunk) * D);
    grow(values, static_cast<size_t>(kChunk) * D);
    grow(state, rows * (D + 2));
    grow(total, rows * (D + 2));
  }
};

RowStates StatesAt(float* base, int rows, int D) { return {base, base + rows, base + 2 * rows}; }

// Folds one partition's state of a row into the row's total (in partition order): rescale both to
// the larger max. A partition the row saw nothing of (sum 0) is skipped.
void Fold(const RowStates& part, int r, const RowStates& total, int D) {
  const float m = part.max[r], l = part.sum[r];
  if (l == 0.0f) return;
  float* o = total.out + static_cast<size_t>(r) * D;
  const float* po = part.out + static_cast<size_t>(r) * D;
  if (total.sum[r] == 0.0f) {
    total.max[r] = m;
    total.sum[r] = l;
    std::memcpy(o, po, sizeof(float) * D);
    return;
  }
  const float new_max = std::max(total.max[r], m);
  const float a = std::exp(total.max[r] - new_max), b = std::exp(m - new_max);
  for (int d = 0; d < D; ++d) o[d] = o[d] * a + po[d] * b;
  total.sum[r] = total.sum[r] * a + l * b;
  total.max[r] = new_max;
}

template <typename T>
struct AttentionContext {
  const ForwardBatch& batch;
  std::span<const std::vector<int64_t>> view_slots;
  const KvCacheLayout& layout;
  int num_heads, group;
  const AttentionIo& io;
  const T* key_cache;
  const T* value_cache;
  float scale;
  const AttentionKernels& kernels;
  bool per_head_views;  // view_slots holds one list per (slice, KV head)
  int32_t window;       // AttentionIo::window
  float softcap;        // AttentionIo::softcap

  // The first view entry a token that sees `visible` entries attends to.
  int32_t FirstKey(int32_t visible) const { return window > 0 ? std::max(0, visible - window) : 0; }

  const std::vector<int64_t>& Slots(int32_t seq, int kv_head) const {
    return view_slots[per_head_views ? static_cast<size_t>(seq) * layout.num_kv_heads + kv_head
                                     : static_cast<size_t>(seq)];
  }
};

// What the kernels read a pool's rows as: fp32 and fp16 rows in place, q4 rows dequantized first.
template <typename T>
using RowElement = std::conditional_t<std::is_same_v<T, Q4Group>, float, T>;

// A row of zeros for masked view entries (released from a sliding window) and a chunk's padding:
// its scores are masked, but its values must be finite.
template <typename E>
const E* ZeroRow() {
  alignas(64) static const E zeros[kMaxHeadDim] = {};
  return zeros;
}

// Row pointers of a chunk's K and V (view entries first .. first + n of one KV head), padded to
// kChunk with the zero row; q4 rows are dequantized into key_buffer / value_buffer (n x head_dim).
// Slots are resolved to blocks once per run of consecutive slots in a block (a division per run,
// not per key).
template <typename T>
void ChunkRows(const AttentionContext<T>& c, int kv_head, const int64_t* slots, int n, float* key_buffer,
               float* value_buffer, const RowElement<T>** key_rows, const RowElement<T>** value_rows) {
  const int D = c.layout.head_dim;
  const int bs = c.layout.block_size;
  const RowElement<T>* zero = ZeroRow<RowElement<T>>();
  int j = 0;
  while (j < n) {
    const int64_t slot = slots[j];
    if (slot < 0) {
      key_rows[j] = value_rows[j] = zero;
      ++j;
      continue;
    }
    const int offset = static_cast<int>(slot % bs);
    int run = 1;
    while (j + run < n && offset + run < bs && slots[j + run] == slot + run) ++run;
    const size_t element = c.layout.offset(static_cast<int>(slot / bs), kv_head, offset);
    for (int i = 0; i < run; ++i, ++j) {
      const size_t at = element + static_cast<size_t>(i) * D;
      if constexpr (std::is_same_v<T, Q4Group>) {
        DequantizeQ4(c.key_cache + at / kQ4GroupSize, D, key_buffer + static_cast<size_t>(j) * D);
        DequantizeQ4(c.value_cache + at / kQ4GroupSize, D, value_buffer + static_cast<size_t>(j) * D);
        key_rows[j] = key_buffer + static_cast<size_t>(j) * D;
        value_rows[j] = value_buffer + static_cast<size_t>(j) * D;
      } else {
        key_rows[j] = c.key_cache + at;
        value_rows[j] = c.value_cache + at;
      }
    }
  }
  for (; j < kChunk; ++j) key_rows[j] = value_rows[j] = zero;
}

// Bytes of `elements` consecutive elements of a pool of T.
template <typename T>
size_t PoolBytes(size_t elements) {
  return std::is_same_v<T, Q4Group> ? KvPoolBytes(KvElement::kQ4, elements) : elements * sizeof(T);
}

// Asks the memory system for a chunk's K or V rows ahead of their use, so that the reads of the
// chunks ahead overlap this one's arithmetic: without it a long context's decode is a series of
// stalls on blocks the hardware prefetcher has not guessed.
template <typename T>
void PrefetchRows(const AttentionContext<T>& c, const T* cache, int kv_head, const int64_t* slots, int n) {
  const int bs = c.layout.block_size;
  const size_t row_bytes = PoolBytes<T>(static_cast<size_t>(c.layout.head_dim));
  for (int j = 0; j < n;) {
    const int64_t slot = slots[j];
    if (slot < 0) {
      ++j;
      continue;
    }
    const int offset = static_cast<int>(slot % bs);
    int run = 1;
    while (j + run < n && offset + run < bs && slots[j + run] == slot + run) ++run;
    const char* begin = reinterpret_cast<const char*>(cache) +
                        PoolBytes<T>(c.layout.offset(static_cast<int>(slot / bs), kv_head, offset));
    const size_t bytes = row_bytes * static_cast<size_t>(run);
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(begin + b);
    j += run;
  }
}

// The tile's query rows (token-major, then the group's heads) into a dense buffer.
template <typename T>
void GatherQueries(const AttentionContext<T>& c, const Tile& tile, int kv_head, float* dst) {
  const int D = c.layout.head_dim;
  for (int i = 0; i < tile.tokens; ++i) {
    const float* src = c.io.query + static_cast<int64_t>(tile.first_token + i) * c.io.query_row_stride +
                       static_cast<int64_t>(kv_head) * c.group * D;
    std::memcpy(dst + static_cast<size_t>(i) * c.group * D, src, sizeof(float) * c.group * D);
  }
}

// Online softmax of the tile's rows over partition p's keys, into `state`.
template <typename T>
void AttendPartition(const AttentionContext<T>& c, const Tile& tile, int kv_head, int32_t p, Scratch& scratch,
                     const RowStates& state) {
  const int D = c.layout.head_dim;
  const int rows = tile.tokens * c.group;
  const int32_t begin = p * kPartitionKeys;
  const int32_t end = std::min(begin + kPartitionKeys, tile.last_visible());
  std::fill(state.max, state.max + rows, -INFINITY);
  std::fill(state.sum, state.sum + rows, 0.0f);
  std::fill(state.out, state.out + static_cast<size_t>(rows) * D, 0.0f);
  const int64_t* slots = c.Slots(tile.seq, kv_head).data();
  float* scores = scratch.scores.data();
  const RowElement<T>* key_rows[kChunk];
  const RowElement<T>* value_rows[kChunk];
  auto prefetch = [&](int32_t at) {  // the chunk starting at view entry `at`, if the partition has it
    if (at >= end) return;
    const int count = std::min(kChunk, end - at);
    PrefetchRows(c, c.key_cache, kv_head, slots + at, count);
    PrefetchRows(c, c.value_cache, kv_head, slots + at, count);
  };
  for (int ahead = 0; ahead < kPrefetchChunks; ++ahead) prefetch(begin + ahead * kChunk);
  for (int32_t start = begin; start < end; start += kChunk) {
    const int n = std::min(kChunk, end - start);
    prefetch(start + kPrefetchChunks * kChunk);
    if (start + n <= tile.first_key) continue;  // before every row's window
    ChunkRows(c, kv_head, slots + start, n, scratch.keys.data(), scratch.values.data(), key_rows, value_rows);
    if constexpr (std::is_same_v<RowElement<T>, uint16_t>) {
      c.kernels.pack_keys_f16(key_rows, D, scratch.packed_keys.data());
    } else {
      c.kernels.pack_keys_f32(key_rows, D, scratch.packed_keys.data());
    }
    c.kernels.scores(scratch.query.data(), rows, scratch.packed_keys.data(), D, c.scale, scores, kChunk);
    for (int r = 0; r < rows; ++r) {
      float* s = scores + static_cast<size_t>(r) * kChunk;
      // Causal in view order: the row's token sees first_visible + its index entries.
      const int32_t visible = tile.first_visible + r / c.group - start;
      const int32_t first = c.FirstKey(visible + start) - start;  // its sliding window's start
      if (visible <= 0 || first >= std::min<int32_t>(visible, n)) {
        std::fill(s, s + kChunk, 0.0f);  // sees nothing here: adds nothing
        continue;
      }
      if (c.softcap > 0.0f) {
        for (int j = 0; j < n; ++j) s[j] = c.softcap * std::tanh(s[j] / c.softcap);
      }
      if (first > 0) std::fill(s, s + first, -INFINITY);
      std::fill(s + std::min<int32_t>(visible, n), s + kChunk, -INFINITY);
      const float new_max = std::max(state.max[r], c.kernels.row_max(s, kChunk));
      const float sum = c.kernels.exp_and_sum(s, kChunk, new_max);
      if (state.sum[r] != 0.0f && new_max != state.max[r]) {
        const float alpha = std::exp(state.max[r] - new_max);
        state.sum[r] *= alpha;
        float* o = state.out + static_cast<size_t>(r) * D;
        for (int d = 0; d < D; ++d) o[d] *= alpha;
      }
      state.sum[r] += sum;
      state.max[r] = new_max;
    }
    if constexpr (std::is_same_v<RowElement<T>, uint16_t>) {
      c.kernels.accumulate_f16(scores, rows, kChunk, value_rows, n, D, state.out);
    } else {
      c.kernels.accumulate_f32(scores, rows, kChunk, value_rows, n, D, state.out);
    }
  }
}

// Normalized outputs (and log-sum-exp) of a tile's rows from their folded totals.
template <typename T>
void WriteOutputs(const AttentionContext<T>& c, const Tile& tile, int kv_head, const RowStates& total) {
  const int D = c.layout.head_dim;
  for (int r = 0; r < tile.tokens * c.group; ++r) {
    const int64_t token = tile.first_token + r / c.group;
    const int head = kv_head * c.group + r % c.group;
    float* o = c.io.out + token * c.io.out_row_stride + static_cast<int64_t>(head) * D;
    const float* src = total.out + static_cast<size_t>(r) * D;
    const float inv = 1.0f / total.sum[r];
    for (int d = 0; d < D; ++d) o[d] = src[d] * inv;
    if (c.io.lse) c.io.lse[token * c.num_heads + head] = total.max[r] + std::log(total.sum[r]);
  }
}

template <typename T>
void Attention(const ForwardBatch& batch, std::span<const std::vector<int64_t>> view_slots,
               const KvCacheLayout& layout, int num_heads, const AttentionIo& io, const T* key_cache,
               const T* value_cache, float scale) {
  const int D = layout.head_dim;
  const int KV = layout.num_kv_heads;
  const int group = num_heads / KV;
  if (group > kTileRows) throw std::invalid_argument("PagedAttention: more than 96 query heads per KV head");
  if (D > kMaxHeadDim) throw std::invalid_argument("PagedAttention: head_dim above 512");
  const bool per_head = view_slots.size() != batch.seqs.size();
  if (per_head && view_slots.size() != batch.seqs.size() * KV) {
    throw std::invalid_argument("PagedAttention: view lists are neither one per slice nor one per slice and KV head");
  }
  if (io.window < 0) throw std::invalid_argument("PagedAttention: a negative sliding window");
  const AttentionContext<T> c{batch,       view_slots, layout, num_heads, group, io, key_cache, value_cache, scale,
                              SelectAttentionKernels(D), per_head, io.window, io.softcap};
  if (per_head) {
    for (size_t s = 0; s < batch.seqs.size(); ++s) {
      for (int h = 1; h < KV; ++h) {
        if (c.Slots(static_cast<int32_t>(s), h).size() != c.Slots(static_cast<int32_t>(s), 0).size()) {
          throw std::invalid_argument("PagedAttention: a slice's per-head views differ in length");
        }
      }
    }
  }

  const int tile_tokens = kTileRows / group;
  std::vector<Tile> tiles;
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const SequenceSlice& slice = batch.seqs[s];
    const int32_t size = static_cast<int32_t>(c.Slots(static_cast<int32_t>(s), 0).size());
    // Latest tokens first: they see the most keys, so the long tiles start early.
    for (int32_t end = slice.num_tokens; end > 0; end -= tile_tokens) {
      const int32_t first = std::max(0, end - tile_tokens);
      Tile tile{static_cast<int32_t>(s), slice.token_offset + first, end - first, size - slice.num_tokens + first + 1, 0,
                0};
      tile.partitions = (tile.last_visible() + kPartitionKeys - 1) / kPartitionKeys;
      tile.first_key = c.FirstKey(tile.first_visible);
      tile.first_partition = tile.first_key / kPartitionKeys;
      tiles.push_back(tile);
    }
  }
  // Split the partitions across threads only when the tiles alone would leave threads idle.
  int64_t split_units = 0;
  for (const Tile& tile : tiles) split_units += static_cast<int64_t>(tile.partitions - tile.first_partition) * KV;
  const bool split = static_cast<int64_t>(tiles.size()) * KV < 4 * CurrentThreads() &&
                     split_units > static_cast<int64_t>(tiles.size()) * KV;
  std::vector<Unit> units;
  int64_t states = 0;
  for (size_t t = 0; t < tiles.size(); ++t) {
    Tile& tile = tiles[t];
    tile.first_state = states;
    for (int h = 0; h < KV; ++h) {
      if (!split) {
        units.push_back({static_cast<int32_t>(t), h, -1});
        continue;
      }
      for (int32_t p = tile.first_partition; p < tile.partitions; ++p) units.push_back({static_cast<int32_t>(t), h, p});
    }
    if (split) states += static_cast<int64_t>(tile.partitions) * KV;
  }
  // Split mode: one state block (rows x (D + 2)) per (tile, KV head, partition).
  const size_t state_floats = static_cast<size_t>(kTileRows) * (D + 2);
  std::vector<float> split_states(split ? static_cast<size_t>(states) * state_floats : 0);
  auto split_state = [&](const Tile& tile, int h, int32_t p) {
    return split_states.data() + static_cast<size_t>(tile.first_state + static_cast<int64_t>(h) * tile.partitions + p) *
                                     state_floats;
  };

  ParallelFor(static_cast<int64_t>(units.size()), [&](int64_t first, int64_t last) {
    thread_local Scratch scratch;
    scratch.Reserve(kTileRows, D);
    for (int64_t u = first; u < last; ++u) {
      const Unit& unit = units[static_cast<size_t>(u)];
      const Tile& tile = tiles[static_cast<size_t>(unit.tile)];
      const int rows = tile.tokens * group;
      GatherQueries(c, tile, unit.kv_head, scratch.query.data());
      if (unit.partition >= 0) {
        AttendPartition(c, tile, unit.kv_head, unit.partition, scratch,
                        StatesAt(split_state(tile, unit.kv_head, unit.partition), rows, D));
        continue;
      }
      const RowStates state = StatesAt(scratch.state.data(), rows, D);
      const RowStates total = StatesAt(scratch.total.data(), rows, D);
      std::fill(total.sum, total.sum + rows, 0.0f);
      for (int32_t p = tile.first_partition; p < tile.partitions; ++p) {
        AttendPartition(c, tile, unit.kv_head, p, scratch, state);
        for (int r = 0; r < rows; ++r) Fold(state, r, total, D);
      }
      WriteOutputs(c, tile, unit.kv_head, total);
    }
  }, 1);

  if (!split) return;
  ParallelFor(static_cast<int64_t>(tiles.size()) * KV, [&](int64_t first, int64_t last) {
    thread_local std::vector<float> total_buffer;
    total_buffer.resize(state_floats);
    for (int64_t i = first; i < last; ++i) {
      const Tile& tile = tiles[static_cast<size_t>(i / KV)];
      const int h = static_cast<int>(i % KV);
      const int rows = tile.tokens * group;
      const RowStates total = StatesAt(total_buffer.data(), rows, D);
      std::fill(total.sum, total.sum + rows, 0.0f);
      for (int32_t p = tile.first_partition; p < tile.partitions; ++p) {
        const RowStates part = StatesAt(split_state(tile, h, p), rows, D);
        for (int r = 0; r < rows; ++r) Fold(part, r, total, D);
      }
      WriteOutputs(c, tile, h, total);
    }
  }, 1);
}

}  // namespace

void ReadKvRows(std::span<const int64_t> slots, const KvCacheLayout& layout, KvElement element, const void* cache,
                float* out) {
  const int D = layout.head_dim;
  const int bs = layout.block_size;
  for (size_t t = 0; t < slots.size(); ++t) {
    const int block = static_cast<int>(slots[t] / bs);
    const int offset = static_cast<int>(slots[t] % bs);
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      float* dst = out + (t * layout.num_kv_heads + h) * D;
      const size_t at = layout.offset(block, h, offset);
      if (element == KvElement::kQ4) {
        DequantizeQ4(reinterpret_cast<const Q4Group*>(static_cast<const uint8_t*>(cache) + KvPoolBytes(element, at)), D, dst);
      } else if (element == KvElement::kF16) {
        const uint16_t* src = static_cast<const uint16_t*>(cache) + at;
        for (int d = 0; d < D; ++d) dst[d] = HalfBitsToFloat(src[d]);
      } else {
        std::memcpy(dst, static_cast<const float*>(cache) + at, sizeof(float) * D);
      }
    }
  }
}

void PagedAttention(const ForwardBatch& batch, std::span<const std::vector<int64_t>> view_slots,
                    const KvCacheLayout& layout, int num_heads, const AttentionIo& io, const float* key_cache,
                    const float* value_cache, float scale) {
  Attention(batch, view_slots, layout, num_heads, io, key_cache, value_cache, scale);
}

void PagedAttention(const ForwardBatch& batch, std::span<const std::vector<int64_t>> view_slots,
                    const KvCacheLayout& layout, int num_heads, const AttentionIo& io, KvElement element,
                    const void* key_cache, const void* value_cache, float scale) {
  if (element == KvElement::kF16) {
    Attention(batch, view_slots, layout, num_heads, io, static_cast<const uint16_t*>(key_cache),
              static_cast<const uint16_t*>(value_cache), scale);
  } else if (element == KvElement::kQ4) {
    if (layout.head_dim % kQ4GroupSize != 0) throw std::invalid_argument("PagedAttention: q4 needs head_dim % 32 == 0");
    Attention(batch, view_slots, layout, num_heads, io, static_cast<const Q4Group*>(key_cache),
              static_cast<const Q4Group*>(value_cache), scale);
  } else {
    Attention(batch, view_slots, layout, num_heads, io, static_cast<const float*>(key_cache),
              static_cast<const float*>(value_cache), scale);
  }
}

void PagedAttention(const ForwardBatch& batch, const KvCacheLayout& layout, int num_heads,
                    const float* query, const float* key_cache, const float* value_cache, float scale,
                    float* out) {
  std::vector<std::vector<int64_t>> views(batch.seqs.size());
  for (size_t s = 0; s < batch.seqs.size(); ++s) ViewSlots(batch.seqs[s], layout.block_size, views[s]);
  AttentionIo io;
  io.query = query;
  io.query_row_stride = static_cast<int64_t>(num_heads) * layout.head_dim;
  io.out = out;
  io.out_row_stride = io.query_row_stride;
  PagedAttention(batch, views, layout, num_heads, io, key_cache, value_cache, scale);
}

void MergeAttentionStates(const float* out_a, const float* lse_a, const float* out_b, const float* lse_b,
                          int64_t rows, int head_dim, float* out, float* lse_out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float a = lse_a[r], b = lse_b[r];
    const float m = std::max(a, b);
    // An empty side has lse -inf and weight 0.
    const float wa = std::isinf(a) && a < 0 ? 0.0f : std::exp(a - m);
    const float wb = std::isinf(b) && b < 0 ? 0.0f : std::exp(b - m);
    const float inv = 1.0f / (wa + wb);
    for (int d = 0; d < head_dim; ++d) {
      out[r * head_dim + d] = (wa * out_a[r * head_dim + d] + wb * out_b[r * head_dim + d]) * inv;
    }
    lse_out[r] = m + std::log(wa + wb);
  }
}

}  // namespace kvflow::cpu
