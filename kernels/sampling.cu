// Logits processing and sampling (kernels/sampling.h), token for token the CPU Sampler
// (src/sampling/sampler.cc) given the same uniform draw.
//
// One thread block of 1024 threads per row; the row stays in global memory (L2 for the later
// passes) and every step is a few coalesced passes over it, with no sort of the vocab:
//   - raw max/argmax, then sum exp(l - max) in double (the log-normalizer of the logprobs);
//   - top-N raw logits (logprobs) and the top-k set: radix select on an order-preserving key of the
//     logit (digits of 12, 12 and 8 bits, histograms in shared memory) finds the k-th largest key
//     exactly; ties at that key are broken by lower id with an ordered count over the row;
//   - suppression and penalties touch only the row's listed tokens (see ApplyPenalties);
//   - weights exp((l - max) / T) are recomputed from the logits in each pass that needs them, with
//     the same float operations (fused multiply-adds included) as the CPU's vectorized
//     ExpNonPositive in a Release build, so both backends see bit-identical weights; a pass that
//     only needs a band of weights skips the others from the logit alone (WeightSource);
//   - a top-k set of at most kListCap tokens moves to shared memory (sorted by id); larger ones
//     stay in the row with a membership test;
//   - top-p: a weighted radix select on the weight bits (exact integer sums per bin) finds the
//     lightest weight of the nucleus, ties resolved toward lower ids as the CPU's "heavier" order;
//   - the draw: per-segment sums of the kept weights in id order, a block scan over the segments,
//     then one warp walks the chosen segment: the first kept token whose inclusive prefix sum
//     exceeds uniform * kept_weight (if rounding leaves none, the last kept token).
// The only differences from the CPU are the association orders of double sums, which can flip a
// decision only when a threshold falls within ~1e-16 (relative) of a partial sum.
//
// Workspace: one int32 per token and row (penalty bookkeeping); it needs no clearing.
#include "device_utils.cuh"

#include <cfloat>
#include <climits>
#include <cmath>

#include "sampling.h"

namespace kvflow::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 4096;                          // 12-bit radix digits (the last one has 8)
constexpr int kSegment = 512;                        // items per warp-owned segment, in id order
constexpr int kStepsPerSegment = kSegment / 128;     // a warp covers 128 items (4 a lane) a step
constexpr int kMaxSegments = 2 * kThreads;           // the segment scan gives each thread two
constexpr int kMaxVocab = kSegment * kMaxSegments;   // 1M tokens
constexpr int kListCap = kThreads;                   // the rank sort gives each thread one item
constexpr int kAllTies = INT_MAX;                    // "every item at the boundary key is in"

// Penalty bookkeeping in the row's workspace (one int32 per token): INT_MIN + output count while
// counting, then the owner's sentinel, then the raw logit's order-preserving key as a signed int
// (every non-NaN float maps at or above the sentinel; see ApplyPenalties).
constexpr int kCountBase = INT_MIN;
constexpr int kOwnedSentinel = INT_MIN + 0x7fffff;

struct Smem {
  // Weighted histograms: 64-bit mantissa sums as two uint32 halves (lo | hi); the ordered passes
  // keep segment sums | segment prefixes here instead.
  double hist_w[kBins];
  int hist_c[kBins];  // count histograms
  int list_id[kListCap];  // collected items (top-N logprobs, top-k set), unordered
  float list_w[kListCap];
  int sorted_id[kListCap];  // the top-k set by ascending id
  float sorted_w[kListCap];
  double red[kWarps + 1];
  float red_f[kWarps];
  int red_i[kWarps];
  double sel_above;
  int flags[8];
};

// ---- arithmetic shared with the CPU Sampler -------------------------------------------------------

// The CPU Sampler's ExpNonPositive exactly as g++ -O3 -march=x86-64-v3 compiles it (kvflow_core's
// Release flags contract a * b + c into one fused multiply-add at these nine places, in the scalar
// and the vectorized loop alike), so that the weights match bit for bit. nvcc may not contract
// anything else here: every remaining product feeds an explicit fma or stands alone.
__device__ __forceinline__ float ExpNonPositive(float x) {
  constexpr float kRoundingShift = 12582912.0f;  // 1.5 * 2^23
  const float shifted = __fmaf_rn(x, 1.44269504088896341f, kRoundingShift);
  const float power_of_two = __fsub_rn(shifted, kRoundingShift);
  const uint32_t exponent = __float_as_uint(shifted) - __float_as_uint(kRoundingShift);
  const float r = __fmaf_rn(power_of_two, 2.12194440e-4f, __fmaf_rn(-power_of_two, 0.693359375f, x));
  float p = 1.9875691500e-4f;
  p = __fmaf_rn(p, r, 1.3981999507e-3f);
  p = __fmaf_rn(p, r, 8.3334519073e-3f);
  p = __fmaf_rn(p, r, 4.1665795894e-2f);
  p = __fmaf_rn(p, r, 1.6666665459e-1f);
  p = __fmaf_rn(p, r, 5.0000001201e-1f);
  p = __fadd_rn(__fmaf_rn(__fmul_rn(p, r), r, r), 1.0f);
  const float scaled = __fmul_rn(p, __uint_as_float((exponent + 127u) << 23));
  const uint32_t in_range = x >= -87.0f ? 0xffffffffu : 0u;
  return __uint_as_float(__float_as_uint(scaled) & in_range);
}

// The sampling weight of a logit: exactly 1 for the largest, 0 for -inf.
__device__ __forceinline__ float Weight(float logit, float max_logit, float temperature) {
  return ExpNonPositive(__fdiv_rn(__fsub_rn(logit, max_logit), temperature));
}

// Order-preserving unsigned key of a float (-0 and +0 compare equal on the CPU, so share a key).
__device__ __forceinline__ uint32_t LogitKey(float f) {
  const uint32_t u = f == 0.0f ? 0u : __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float KeyLogit(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
// A raw logit saved in the int32 workspace: >= kOwnedSentinel for every value (NaN made positive).
__device__ __forceinline__ int EncodeRawLogit(float f) {
  if (f != f) f = __uint_as_float(0x7fc00000u);
  return static_cast<int>(LogitKey(f) ^ 0x80000000u);
}
__device__ __forceinline__ float DecodeRawLogit(int code) {
  return KeyLogit(static_cast<uint32_t>(code) ^ 0x80000000u);
}

// ---- warp and block collectives ---------------------------------------------------------------------

__device__ __forceinline__ double WarpSumD(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(dev::kFullMask, v, offset);
  return v;
}
__device__ __forceinline__ double WarpInclusiveScanD(double v, int lane) {
  for (int offset = 1; offset < 32; offset <<= 1) {
    const double other = __shfl_up_sync(dev::kFullMask, v, offset);
    if (lane >= offset) v += other;
  }
  return v;
}
__device__ __forceinline__ int WarpMinI(int v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(dev::kFullMask, v, offset));
  return v;
}
__device__ __forceinline__ int WarpMaxI(int v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(dev::kFullMask, v, offset));
  return v;
}

// Block sum; every thread gets the same bits (a butterfly adds the same pairs in every lane).
__device__ double BlockSumD(double v, Smem& sm) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = WarpSumD(v);
  __syncthreads();  // sm.red may still be read by a previous collective
  if (lane == 0) sm.red[warp] = v;
  __syncthreads();
  return WarpSumD(sm.red[lane]);
}

// Exclusive prefix sum over the threads in threadIdx order; *total gets the block's sum.
__device__ double BlockExclusiveScanD(double v, double* total, Smem& sm) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const double inclusive = WarpInclusiveScanD(v, lane);
  double lane_exclusive = __shfl_up_sync(dev::kFullMask, inclusive, 1);
  if (lane == 0) lane_exclusive = 0.0;
  __syncthreads();
  if (lane == 31) sm.red[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const double warp_total = sm.red[lane];
    const double warp_inclusive = WarpInclusiveScanD(warp_total, lane);
    double warp_exclusive = __shfl_up_sync(dev::kFullMask, warp_inclusive, 1);
    if (lane == 0) warp_exclusive = 0.0;
    sm.red[lane] = warp_exclusive;
    if (lane == 31) sm.red[kWarps] = warp_inclusive;
  }
  __syncthreads();
  *total = sm.red[kWarps];
  return sm.red[warp] + lane_exclusive;
}

// Largest value, lowest id among equals (as std::max_element); NaNs are never taken.
struct Best {
  float value;
  int id;
};
__device__ __forceinline__ bool Beats(float value, int id, const Best& b) {
  return value > b.value || (value == b.value && id < b.id);
}
__device__ Best BlockArgMax(Best b, Smem& sm) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float value = __shfl_xor_sync(dev::kFullMask, b.value, offset);
    const int id = __shfl_xor_sync(dev::kFullMask, b.id, offset);
    if (Beats(value, id, b)) b = {value, id};
  }
  __syncthreads();
  if (lane == 0) {
    sm.red_f[warp] = b.value;
    sm.red_i[warp] = b.id;
  }
  __syncthreads();
  b = {sm.red_f[lane], sm.red_i[lane]};
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float value = __shfl_xor_sync(dev::kFullMask, b.value, offset);
    const int id = __shfl_xor_sync(dev::kFullMask, b.id, offset);
    if (Beats(value, id, b)) b = {value, id};
  }
  return b;
}

// ---- item sources -------------------------------------------------------------------------------------

// One row of logits; out-of-range items read as -inf.
struct RowReader {
  const float* x;
  int n;
  bool vectorized;  // x is 16-byte aligned
  __device__ __forceinline__ void Load4(int base, float v[4]) const {
    if (vectorized && base + 4 <= n) {
      const float4 q = *reinterpret_cast<const float4*>(x + base);
      v[0] = q.x;
      v[1] = q.y;
      v[2] = q.z;
      v[3] = q.w;
    } else {
      for (int j = 0; j < 4; ++j) v[j] = base + j < n ? x[base + j] : -INFINITY;
    }
  }
};

// The items of the sampling distribution and their weights: every token of the row (weights from
// the logits on the fly, 0 outside the top-k set), or the top-k set in shared memory by ascending
// id. Either way an item's index orders like its token id.
//
// Computing a weight (a division and the exp polynomial) costs far more than loading its logit, so
// most passes only care about a band of weights [w_lo, w_hi] and skip, from the logit alone, the
// items that are surely outside it: they read as weight 0. (l - max) * (1 / T) is within a few ulp
// of the quotient the weight uses, and the weight within ~1e-7 of its exp, so a margin of 1e-3 in
// the exponent keeps every item of the band. The band is only a filter: each pass still tests its
// own condition on the exact weight.
struct WeightSource {
  RowReader row;
  float max_logit;
  float temperature;
  float inv_temperature;
  float x_lo, x_hi;  // the band in exponent units: items with (l - max) / T outside it read 0
  bool top_k;
  uint32_t top_k_key;  // the top-k set: key > top_k_key, or == top_k_key and id <= top_k_last
  int top_k_last;
  const float* list_w;  // non-null: the items are the shared-memory list
  int list_n;

  __device__ __forceinline__ int size() const { return list_w != nullptr ? list_n : row.n; }
  __device__ __forceinline__ void SetBand(float w_lo, float w_hi) {
    constexpr float kMargin = 1e-3f;
    x_lo = w_lo > 0.0f ? logf(w_lo) - kMargin : -INFINITY;
    x_hi = w_hi < 1.0f ? logf(w_hi) + kMargin : INFINITY;
  }
  __device__ __forceinline__ void Load4(int base, float w[4]) const {
    if (list_w != nullptr) {
      for (int j = 0; j < 4; ++j) w[j] = base + j < list_n ? list_w[base + j] : 0.0f;
      return;
    }
    float l[4];
    row.Load4(base, l);
    for (int j = 0; j < 4; ++j) {
      w[j] = 0.0f;
      if (top_k) {
        const uint32_t key = LogitKey(l[j]);
        if (key < top_k_key || (key == top_k_key && base + j > top_k_last)) continue;
      }
      const float x = (l[j] - max_logit) * inv_temperature;
      if (x < x_lo || x > x_hi) continue;  // NaN (T so small that 1 / T overflows) goes on
      w[j] = Weight(l[j], max_logit, temperature);
    }
  }
};

// f(i, v) for every item i < n, four consecutive items a thread, block-strided (coalesced).
template <typename Load, typename F>
__device__ __forceinline__ void ForEachItem(int n, const Load& load, const F& f) {
  for (int base = threadIdx.x * 4; base < n; base += kThreads * 4) {
    float v[4];
    load(base, v);
    for (int j = 0; j < 4; ++j) {
      if (base + j < n) f(base + j, v[j]);
    }
  }
}

// ---- ordered search -------------------------------------------------------------------------------------
//
// Items are cut into segments of kSegment in index order; warp w owns segments w, w + 32, ...

// Sums value(i, v) >= 0 per segment (into sm.hist_w[s]) and their exclusive prefixes (into
// sm.hist_w[kMaxSegments + s]); returns the total. FindAbove needs these.
template <typename Load, typename Value>
__device__ double SegmentSums(int n, const Load& load, const Value& value, Smem& sm) {
  double* seg_sum = sm.hist_w;
  double* seg_prefix = sm.hist_w + kMaxSegments;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int num_segments = (n + kSegment - 1) / kSegment;
  __syncthreads();  // sm.hist_w may still be read by a previous step
  for (int s = warp; s < num_segments; s += kWarps) {
    double sum = 0.0;
    for (int step = 0; step < kStepsPerSegment; ++step) {
      const int base = s * kSegment + step * 128 + lane * 4;
      if (base < n) {
        float v[4];
        load(base, v);
        for (int j = 0; j < 4; ++j) {
          if (base + j < n) sum += value(base + j, v[j]);
        }
      }
    }
    sum = WarpSumD(sum);
    if (lane == 0) seg_sum[s] = sum;
  }
  __syncthreads();
  const int s0 = 2 * threadIdx.x;
  const double a = s0 < num_segments ? seg_sum[s0] : 0.0;
  const double b = s0 + 1 < num_segments ? seg_sum[s0 + 1] : 0.0;
  double total;
  const double prefix = BlockExclusiveScanD(a + b, &total, sm);
  if (s0 < num_segments) seg_prefix[s0] = prefix;
  if (s0 + 1 < num_segments) seg_prefix[s0 + 1] = prefix + a;
  __syncthreads();
  return total;
}

// After SegmentSums with the same arguments: the first item whose inclusive prefix sum of value
// exceeds `threshold`; if none does, the last item of positive value; -1 if there is none.
template <typename Load, typename Value>
__device__ int FindAbove(int n, const Load& load, const Value& value, double threshold, Smem& sm) {
  const double* seg_sum = sm.hist_w;
  const double* seg_prefix = sm.hist_w + kMaxSegments;
  const int num_segments = (n + kSegment - 1) / kSegment;
  if (threadIdx.x == 0) {
    sm.flags[3] = INT_MIN;  // max of -segment: the first segment that crosses the threshold
    sm.flags[4] = -1;       // the last segment of positive weight
  }
  __syncthreads();
  for (int s = threadIdx.x; s < num_segments; s += kThreads) {
    if (seg_sum[s] > 0.0) {
      if (threshold < seg_prefix[s] + seg_sum[s]) atomicMax(&sm.flags[3], -s);
      atomicMax(&sm.flags[4], s);
    }
  }
  __syncthreads();
  const bool crossed = sm.flags[3] != INT_MIN;
  const int segment = crossed ? -sm.flags[3] : sm.flags[4];
  if (segment < 0) return -1;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    double running = seg_prefix[segment];
    int found = INT_MAX, last = -1;
    for (int step = 0; step < kStepsPerSegment; ++step) {
      const int base = segment * kSegment + step * 128 + lane * 4;
      double w[4] = {0.0, 0.0, 0.0, 0.0};
      if (base < n) {
        float v[4];
        load(base, v);
        for (int j = 0; j < 4; ++j) {
          if (base + j < n) w[j] = value(base + j, v[j]);
        }
      }
      const double lane_sum = (w[0] + w[1]) + (w[2] + w[3]);
      const double inclusive = WarpInclusiveScanD(lane_sum, lane);
      double cumulative = __shfl_up_sync(dev::kFullMask, inclusive, 1);
      cumulative = running + (lane == 0 ? 0.0 : cumulative);
      for (int j = 0; j < 4; ++j) {
        if (w[j] > 0.0) {
          cumulative += w[j];
          last = base + j;
          if (crossed && found == INT_MAX && threshold < cumulative) found = base + j;
        }
      }
      found = WarpMinI(found);
      last = WarpMaxI(last);
      if (found != INT_MAX) break;
      running += __shfl_sync(dev::kFullMask, inclusive, 31);
    }
    if (lane == 0) sm.flags[5] = found != INT_MAX ? found : last;
  }
  __syncthreads();
  return sm.flags[5];
}

// ---- radix select -----------------------------------------------------------------------------------------

// The boundary of the heaviest-first prefix that reaches a target: the key K such that the items
// with a larger key weigh less than the target and those with key >= K reach it.
struct Selection {
  uint32_t key;
  double above;   // weight (count) of the items with a larger key
  double target;  // the target, fraction * total when one was given
  double total;   // weight (count) of all items
  int equal;      // items with key K
  bool found;     // false: all items together stay below the target
};

// The weight of one bin of a weighted histogram. Every item of a bin shares the float exponent
// (the first digit holds the exponent and 3 mantissa bits), so the bin holds the exact integer sum
// of the 24-bit mantissas (< 2^44 for 1M items) and its weight is that sum times one power of two:
// exact, and the same whatever order the atomics ran in.
__device__ __forceinline__ double BinWeight(const uint32_t* lo, const uint32_t* hi, int bin, uint32_t exponent) {
  const double mantissas = static_cast<double>(hi[bin]) * 4294967296.0 + static_cast<double>(lo[bin]);
  return ldexp(mantissas, max(static_cast<int>(exponent), 1) - 150);
}
__device__ __forceinline__ uint32_t Mantissa(uint32_t bits) {
  return (bits & 0x7fffffu) | ((bits >> 23) != 0 ? 0x800000u : 0u);
}

// Radix select over digits of 12, 12 and 8 bits, from the top. visit(prefix, mask, f) calls
// f(key, weight) for every item (weight > 0: its float bits are the key; counts ignore it) and may
// skip items whose key cannot match `prefix` under `mask`. With fraction > 0 the target is
// fraction * (total weight), known after the first digit.
template <bool kWeighted, typename Visit>
__device__ Selection RadixSelect(const Visit& visit, double target, float fraction, Smem& sm) {
  uint32_t* hist_lo = reinterpret_cast<uint32_t*>(sm.hist_w);
  uint32_t* hist_hi = hist_lo + kBins;
  uint32_t prefix = 0, prefix_mask = 0;
  double above = 0.0, all = 0.0;
  int equal = 0;
#pragma unroll 1
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 20 : level == 1 ? 8 : 0;
    const uint32_t digit_mask = level == 2 ? 0xffu : 0xfffu;
    __syncthreads();  // the histograms may still be read by a previous step
    for (int i = threadIdx.x; i < kBins; i += kThreads) {
      if (kWeighted) {
        hist_lo[i] = 0u;
        hist_hi[i] = 0u;
      } else {
        sm.hist_c[i] = 0;
      }
    }
    if (threadIdx.x == 0) {
      sm.flags[0] = -1;       // the boundary bin
      sm.flags[1] = INT_MIN;  // max of -bin over non-empty bins: the lowest non-empty bin
    }
    __syncthreads();
    // Each thread adds up a run of items that fall into the same bin before it touches shared
    // memory: rows of equal logits (ties, masked vocab) would otherwise serialize on one bin.
    int run_bin = -1;
    uint64_t run = 0;
    const auto flush = [&] {
      if (run_bin < 0) return;
      if constexpr (kWeighted) {
        const uint32_t low = static_cast<uint32_t>(run);
        const uint32_t old = atomicAdd(&hist_lo[run_bin], low);
        const uint32_t high = static_cast<uint32_t>(run >> 32) + (old + low < old ? 1u : 0u);  // carry
        if (high != 0u) atomicAdd(&hist_hi[run_bin], high);
      } else {
        atomicAdd(&sm.hist_c[run_bin], static_cast<int>(run));
      }
    };
    visit(prefix, prefix_mask, [&](uint32_t key, float) {
      if ((key & prefix_mask) != prefix) return;
      const int bin = static_cast<int>((key >> shift) & digit_mask);
      if (bin != run_bin) {
        flush();
        run_bin = bin;
        run = 0;
      }
      run += kWeighted ? Mantissa(key) : 1u;
    });
    flush();
    __syncthreads();
    // Thread t owns bins top, top - 1, top - 2, top - 3: the scan in thread order runs from the
    // heaviest bin down.
    const int top = kBins - 1 - 4 * static_cast<int>(threadIdx.x);
    double h[4];
    double local = 0.0;
    for (int j = 0; j < 4; ++j) {
      if constexpr (kWeighted) {
        h[j] = BinWeight(hist_lo, hist_hi, top - j, level == 0 ? static_cast<uint32_t>(top - j) >> 3 : prefix >> 23);
      } else {
        h[j] = static_cast<double>(sm.hist_c[top - j]);
      }
      local += h[j];
    }
    double total;
    const double exclusive = BlockExclusiveScanD(local, &total, sm);
    if (level == 0) {
      all = total;
      if (fraction > 0.0f) target = static_cast<double>(fraction) * total;
    }
    double acc = above + exclusive;
    for (int j = 0; j < 4; ++j) {
      if (h[j] > 0.0) {
        if (acc < target && target <= acc + h[j]) atomicMax(&sm.flags[0], top - j);
        atomicMax(&sm.flags[1], -(top - j));
      }
      acc += h[j];
    }
    __syncthreads();
    int bin = sm.flags[0];
    if (bin < 0) {
      // At the first digit: everything together stays below the target. Below it, the sub-bins of
      // the boundary bin, added in another order, fell short by a rounding: all of them are needed.
      if (level == 0) return Selection{0u, 0.0, target, all, 0, false};
      bin = -sm.flags[1];
    }
    if (top >= bin && bin > top - 4) {
      acc = above + exclusive;
      int j = 0;
      for (; top - j > bin; ++j) acc += h[j];
      sm.sel_above = acc;
      if constexpr (kWeighted) {
        // At the last digit every item of the bin has the same key: count = sum / mantissa.
        const uint32_t key = prefix | static_cast<uint32_t>(bin);
        sm.flags[2] = level == 2 ? static_cast<int>(h[j] / ldexp(static_cast<double>(Mantissa(key)),
                                                                 max(static_cast<int>(key >> 23), 1) - 150))
                                 : 0;
      } else {
        sm.flags[2] = sm.hist_c[bin];
      }
    }
    __syncthreads();
    above = sm.sel_above;
    equal = sm.flags[2];
    prefix |= static_cast<uint32_t>(bin) << shift;
    prefix_mask |= digit_mask << shift;
  }
  return Selection{prefix, above, target, all, equal, true};
}

// The `count` largest logits of the row (ties: lower id first): their boundary key and the last id
// taken at that key (kAllTies: all of them).
struct TopSet {
  uint32_t key;
  int last;
  __device__ __forceinline__ bool Contains(int id, uint32_t k) const {
    return k > key || (k == key && id <= last);
  }
};
__device__ TopSet SelectLargest(const RowReader& row, int count, Smem& sm) {
  const auto load = [&](int base, float v[4]) { row.Load4(base, v); };
  const auto visit = [&](uint32_t, uint32_t, const auto& f) {
    ForEachItem(row.n, load, [&](int, float l) { f(LogitKey(l), 1.0f); });
  };
  const Selection sel = RadixSelect<false>(visit, static_cast<double>(count), 0.0f, sm);
  const int need = count - static_cast<int>(sel.above);  // 1 <= need <= sel.equal
  if (need >= sel.equal) return TopSet{sel.key, kAllTies};
  const auto is_tie = [&](int, float l) { return LogitKey(l) == sel.key ? 1.0 : 0.0; };
  SegmentSums(row.n, load, is_tie, sm);
  return TopSet{sel.key, FindAbove(row.n, load, is_tie, need - 1, sm)};
}

// ---- the steps of a row -----------------------------------------------------------------------------------

// The num_top largest raw logits, best first, as logprobs.
__device__ void WriteTopLogprobs(const RowReader& row, int num_top, double log_normalizer,
                                 int32_t* out_tokens, float* out_logprobs, Smem& sm) {
  const TopSet top = SelectLargest(row, num_top, sm);
  if (threadIdx.x == 0) sm.flags[6] = 0;
  __syncthreads();
  ForEachItem(row.n, [&](int base, float v[4]) { row.Load4(base, v); }, [&](int i, float l) {
    if (top.Contains(i, LogitKey(l))) {
      const int slot = atomicAdd(&sm.flags[6], 1);
      sm.list_id[slot] = i;
      sm.list_w[slot] = l;
    }
  });
  __syncthreads();
  if (threadIdx.x == 0) {
    // Insertion sort of at most kMaxTopLogprobs entries: larger logit first, then lower id.
    for (int i = 1; i < num_top; ++i) {
      const int id = sm.list_id[i];
      const float l = sm.list_w[i];
      int j = i;
      for (; j > 0 && (l > sm.list_w[j - 1] || (l == sm.list_w[j - 1] && id < sm.list_id[j - 1])); --j) {
        sm.list_id[j] = sm.list_id[j - 1];
        sm.list_w[j] = sm.list_w[j - 1];
      }
      sm.list_id[j] = id;
      sm.list_w[j] = l;
    }
    for (int i = 0; i < num_top; ++i) {
      out_tokens[i] = sm.list_id[i];
      out_logprobs[i] = static_cast<float>(static_cast<double>(sm.list_w[i]) - log_normalizer);
    }
  }
  __syncthreads();
}

// Repetition penalty over prompt + output tokens (once per distinct token), frequency and presence
// over output tokens, as Sampler::ApplyPenalties. The row's workspace slot of a listed token goes
// INT_MIN -> INT_MIN + output count (atomic adds) -> the first position to atomicMax it to the
// sentinel owns the token: it penalizes the logit and leaves the raw logit's code in the slot
// (atomicMax again, every code being >= the sentinel, so later positions see "taken"). Slots of
// unlisted tokens are never read, so the workspace needs no clearing.
__device__ void ApplyPenalties(const SamplingRow& p, const int32_t* history, float* x, int* ws, int n,
                               int first, int end) {
  for (int i = first + static_cast<int>(threadIdx.x); i < end; i += kThreads) {
    const int32_t t = history[i];
    if (t >= 0 && t < n) ws[t] = kCountBase;
  }
  __syncthreads();
  for (int i = p.prompt_len + static_cast<int>(threadIdx.x); i < end; i += kThreads) {
    const int32_t t = history[i];
    if (t >= 0 && t < n) atomicAdd(&ws[t], 1);
  }
  __syncthreads();
  const bool repetition = p.repetition_penalty != 1.0f;
  for (int i = first + static_cast<int>(threadIdx.x); i < end; i += kThreads) {
    const int32_t t = history[i];
    if (t < 0 || t >= n) continue;
    const int old = atomicMax(&ws[t], kOwnedSentinel);
    if (old >= kOwnedSentinel) continue;  // another position owns the token
    const int output_count = old - kCountBase;
    const float raw = x[t];
    float logit = raw;
    if (repetition) {
      logit = logit > 0.0f ? __fdiv_rn(logit, p.repetition_penalty) : __fmul_rn(logit, p.repetition_penalty);
    }
    if (output_count > 0) {
      // One fused multiply-add, as the CPU's Release build computes freq * count + presence.
      logit = __fsub_rn(logit, __fmaf_rn(p.frequency_penalty, static_cast<float>(output_count),
                                         p.presence_penalty));
    }
    x[t] = logit;
    atomicMax(&ws[t], EncodeRawLogit(raw));
  }
  __syncthreads();
}

// Temperature, top-k, top-p, min-p and the draw; returns the token, or -1 if nothing is left
// (possible only with min_p > 1). *all_weight gets the sum of every token's weight when a pass
// computed it on the way (no top-k; top-p, or no min-p), else NaN.
__device__ int DrawToken(const SamplingRow& p, const RowReader& row, float max_logit, double* all_weight,
                         Smem& sm) {
  *all_weight = NAN;
  const int vocab = row.n;
  WeightSource src{row, max_logit, p.temperature, 1.0f / p.temperature, -INFINITY, INFINITY,
                   false, 0u, kAllTies, nullptr, 0};
  if (p.top_k > 0 && p.top_k < vocab) {
    const int k = p.top_k;
    const TopSet top = SelectLargest(row, k, sm);
    src.top_k = true;
    src.top_k_key = top.key;
    src.top_k_last = top.last;
    if (k <= kListCap) {
      // Collect the k tokens, then place each at its rank by id.
      if (threadIdx.x == 0) sm.flags[6] = 0;
      __syncthreads();
      ForEachItem(vocab, [&](int base, float v[4]) { row.Load4(base, v); }, [&](int i, float l) {
        if (top.Contains(i, LogitKey(l))) {
          const int slot = atomicAdd(&sm.flags[6], 1);
          sm.list_id[slot] = i;
          sm.list_w[slot] = Weight(l, max_logit, p.temperature);
        }
      });
      __syncthreads();
      if (static_cast<int>(threadIdx.x) < k) {
        const int id = sm.list_id[threadIdx.x];
        int rank = 0;
        for (int j = 0; j < k; ++j) rank += sm.list_id[j] < id;
        sm.sorted_id[rank] = id;
        sm.sorted_w[rank] = sm.list_w[threadIdx.x];
      }
      __syncthreads();
      src.list_w = sm.sorted_w;
      src.list_n = k;
    }
  }
  const int n = src.size();
  const auto load = [&](int base, float w[4]) { src.Load4(base, w); };

  // Top-p: the lightest weight in the nucleus and, among items of exactly that weight, the last
  // one taken (heavier first, then lower id).
  bool nucleus = p.top_p < 1.0f;
  uint32_t nucleus_key = 0;
  int nucleus_last = kAllTies;
  if (nucleus) {
    const auto visit = [&](uint32_t prefix, uint32_t mask, const auto& f) {
      // Below the first digit only the weights of the boundary bin matter.
      if (mask != 0u) src.SetBand(__uint_as_float(prefix), __uint_as_float(prefix | (~mask & 0x7fffffffu)));
      ForEachItem(n, load, [&](int, float w) {
        if (w > 0.0f) f(__float_as_uint(w), w);
      });
    };
    const Selection sel = RadixSelect<true>(visit, 0.0, p.top_p, sm);
    if (!src.top_k) *all_weight = sel.total;
    src.SetBand(0.0f, 1.0f);
    if (!sel.found) {
      nucleus = false;  // rounding: the whole set is the nucleus
    } else {
      nucleus_key = sel.key;
      // The smallest m >= 1 with above + m * w >= target, as the CPU adds tied weights one by one.
      const double w = static_cast<double>(__uint_as_float(sel.key));
      double m = ceil((sel.target - sel.above) / w);
      m = fmin(fmax(m, 1.0), static_cast<double>(sel.equal));
      while (m > 1.0 && sel.above + (m - 1.0) * w >= sel.target) m -= 1.0;
      while (m < sel.equal && sel.above + m * w < sel.target) m += 1.0;
      if (m < sel.equal) {
        src.SetBand(__uint_as_float(nucleus_key), __uint_as_float(nucleus_key));
        const auto is_tie = [&](int, float wi) { return wi > 0.0f && __float_as_uint(wi) == nucleus_key ? 1.0 : 0.0; };
        SegmentSums(n, load, is_tie, sm);
        nucleus_last = FindAbove(n, load, is_tie, m - 1.0, sm);
      }
    }
  }

  const float min_p = p.min_p;
  // Only weights >= min_p and, with a nucleus, >= its lightest weight can be kept.
  src.SetBand(fmaxf(min_p, nucleus ? __uint_as_float(nucleus_key) : 0.0f), 1.0f);
  const auto kept = [&](int i, float w) -> double {
    if (!(w > 0.0f && w >= min_p)) return 0.0;
    if (nucleus) {
      const uint32_t key = __float_as_uint(w);
      if (key < nucleus_key || (key == nucleus_key && i > nucleus_last)) return 0.0;
    }
    return static_cast<double>(w);
  };
  const double kept_weight = SegmentSums(n, load, kept, sm);
  if (!src.top_k && !nucleus && p.top_p >= 1.0f && !(min_p > 0.0f)) *all_weight = kept_weight;
  if (!(kept_weight > 0.0)) return -1;
  const int item = FindAbove(n, load, kept, p.uniform * kept_weight, sm);
  if (item < 0) return -1;
  return src.list_w != nullptr ? sm.sorted_id[item] : item;
}

__global__ void __launch_bounds__(kThreads) SampleKernel(SampleArgs args) {
  KVFLOW_DYNAMIC_SMEM(Smem, smem);
  Smem& sm = *smem;
  const int row_index = blockIdx.x;
  const int vocab = args.vocab_size;
  const SamplingRow p = args.rows[row_index];
  float* x = args.logits + static_cast<size_t>(row_index) * vocab;
  int* ws = static_cast<int*>(args.workspace) + static_cast<size_t>(row_index) * vocab;
  const RowReader row{x, vocab, (reinterpret_cast<uintptr_t>(x) & 15) == 0};
  const auto load_row = [&](int base, float v[4]) { row.Load4(base, v); };

  // 1. The raw logits: max (argmax), then the log-normalizer and the top-N. With temperature 1 and
  // nothing that changes the logits, the draw's weights are the raw ones: their sum comes out of a
  // pass the draw makes anyway, which saves a pass over the row.
  Best best{-INFINITY, INT_MAX};
  ForEachItem(vocab, load_row, [&](int i, float l) {
    if (Beats(l, i, best)) best = {l, i};
  });
  const Best raw_best = BlockArgMax(best, sm);
  const bool penalize = args.history != nullptr &&
                        (p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f);
  const bool suppressing = p.suppress_len > 0 && args.suppress != nullptr;
  const bool masking = p.mask_offset >= 0 && args.masks != nullptr;
  const bool biasing = p.bias_len > 0 && args.bias_tokens != nullptr && args.bias_values != nullptr && args.bias_raw != nullptr;
  const bool constrained = suppressing || masking || biasing;
  const bool defer_raw = !penalize && !constrained && p.temperature == 1.0f && !(p.top_k > 0 && p.top_k < vocab);
  double log_normalizer = 0.0;
  const auto raw_logprobs = [&](double all_weight) {
    if (!(all_weight >= 0.0)) {  // NaN: not known yet
      double sum = 0.0;
      ForEachItem(vocab, load_row, [&](int, float l) { sum += ExpNonPositive(__fsub_rn(l, raw_best.value)); });
      all_weight = BlockSumD(sum, sm);
    }
    log_normalizer = static_cast<double>(raw_best.value) + log(all_weight);
    if (args.num_top_logprobs > 0) {
      WriteTopLogprobs(row, args.num_top_logprobs, log_normalizer,
                       args.out_top_tokens + static_cast<size_t>(row_index) * args.num_top_logprobs,
                       args.out_top_logprobs + static_cast<size_t>(row_index) * args.num_top_logprobs, sm);
    }
  };
  if (!defer_raw) raw_logprobs(NAN);

  // 2. Suppression, then the penalties.
  if (suppressing) {
    const int32_t* suppress = args.suppress + p.suppress_offset;
    for (int i = threadIdx.x; i < p.suppress_len; i += kThreads) {
      const int32_t t = suppress[i];
      if (t >= 0 && t < vocab) x[t] = -INFINITY;
    }
    __syncthreads();
  }
  if (masking) {
    const uint32_t* mask = args.masks + p.mask_offset;
    for (int t = threadIdx.x; t < vocab; t += kThreads) {
      if (((mask[t >> 5] >> (t & 31)) & 1u) == 0u) x[t] = -INFINITY;
    }
    __syncthreads();
  }
  if (biasing) {
    // One thread, in list order: a token listed twice gains both biases, and its raw logit is
    // the one before the first (as TokenConstraint::ApplyTo).
    if (threadIdx.x == 0) {
      for (int i = 0; i < p.bias_len; ++i) {
        const int32_t t = args.bias_tokens[p.bias_offset + i];
        args.bias_raw[p.bias_offset + i] = (t >= 0 && t < vocab) ? x[t] : NAN;
        if (t >= 0 && t < vocab) x[t] = __fadd_rn(x[t], args.bias_values[p.bias_offset + i]);
      }
    }
    __syncthreads();
  }
  const int32_t* history = args.history + (penalize ? p.history_offset : 0);
  const int prompt_len = max(p.prompt_len, 0);
  const int history_first = p.repetition_penalty != 1.0f ? 0 : prompt_len;
  const int history_end = prompt_len + max(p.output_len, 0);
  if (penalize && history_first < history_end) {
    SamplingRow q = p;
    q.prompt_len = prompt_len;
    ApplyPenalties(q, history, x, ws, vocab, history_first, history_end);
  }

  // 3. The token: argmax when greedy (or when everything is masked), else one draw.
  Best top = raw_best;
  if (constrained || penalize) {
    best = Best{-INFINITY, INT_MAX};
    ForEachItem(vocab, load_row, [&](int i, float l) {
      if (Beats(l, i, best)) best = {l, i};
    });
    top = BlockArgMax(best, sm);
  }
  int token = top.id;
  double all_weight = NAN;
  if (p.temperature > 0.0f && top.value != -INFINITY) {
    const int drawn = DrawToken(p, row, top.value, &all_weight, sm);
    if (drawn >= 0) token = drawn;
  }
  if (token == INT_MAX) token = 0;  // every logit NaN
  if (defer_raw) raw_logprobs(all_weight);

  // 4. Its logprob on the raw logits: a penalized token's raw logit is in its workspace slot.
  if (threadIdx.x == 0) sm.flags[7] = 0;
  __syncthreads();
  if (penalize) {
    for (int i = history_first + static_cast<int>(threadIdx.x); i < history_end; i += kThreads) {
      if (history[i] == token) sm.flags[7] = 1;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // An atomic read: the slot was last written by atomics, which bypass this SM's L1.
    float raw = sm.flags[7] ? DecodeRawLogit(atomicAdd(&ws[token], 0)) : x[token];
    if (biasing) {  // a biased token's raw logit is the one before its bias
      for (int i = 0; i < p.bias_len; ++i) {
        if (args.bias_tokens[p.bias_offset + i] == token) {
          raw = args.bias_raw[p.bias_offset + i];
          break;
        }
      }
    }
    args.out_tokens[row_index] = token;
    args.out_logprobs[row_index] = static_cast<float>(static_cast<double>(raw) - log_normalizer);
  }
}

}  // namespace

size_t SampleWorkspaceBytes(int num_rows, int vocab_size) {
  if (num_rows <= 0 || vocab_size <= 0) return 0;
  return static_cast<size_t>(num_rows) * static_cast<size_t>(vocab_size) * sizeof(int32_t);
}

int SampleFromLogits(const SampleArgs& args, void* stream) {
  if (args.num_rows < 0) return kInvalidValue;
  if (args.num_rows == 0) return 0;
  if (args.vocab_size <= 0 || args.vocab_size > kMaxVocab) return kInvalidValue;
  if (args.num_top_logprobs < 0 || args.num_top_logprobs > kMaxTopLogprobs ||
      args.num_top_logprobs > args.vocab_size) {
    return kInvalidValue;
  }
  if (args.logits == nullptr || args.rows == nullptr || args.out_tokens == nullptr ||
      args.out_logprobs == nullptr) {
    return kInvalidValue;
  }
  if (args.num_top_logprobs > 0 && (args.out_top_tokens == nullptr || args.out_top_logprobs == nullptr)) {
    return kInvalidValue;
  }
  if (args.workspace == nullptr || args.workspace_bytes < SampleWorkspaceBytes(args.num_rows, args.vocab_size)) {
    return kInvalidValue;
  }
  return LaunchKernel(SampleKernel, dim3(static_cast<unsigned>(args.num_rows)), dim3(kThreads), sizeof(Smem),
                      stream, args);
}

}  // namespace kvflow::cuda
