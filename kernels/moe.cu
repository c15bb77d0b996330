// Mixture-of-experts kernels (see moe.h): the layout is vLLM's fused_moe. The (token, slot) pairs
// are sorted by expert into runs padded to whole tiles, so every tile of the grouped GEMM belongs
// to one expert and reads that expert's weights once; the A rows are gathered from the token rows
// as they load (no permuted copy of the activations), and the outputs stay in pair order, so the
// combine needs no inverse permutation.
#include "device_utils.cuh"

#include <cmath>

#include "moe.h"

namespace kvflow::cuda {
namespace {

// ---- routing ---------------------------------------------------------------------------------------

constexpr int kRouteWarps = 4;
constexpr int kRoutePerLane = kMoeMaxExperts / 32;

// One warp per token; lane l holds experts l, l + 32, ... The softmax is cpu MoeMlp's: exp(x - max)
// / sum in fp32 (expf, not __expf); each of the k rounds is a warp argmax over (p, -expert).
__global__ void __launch_bounds__(kRouteWarps * 32)
    MoeRouteTopKKernel(const float* __restrict__ logits, int tokens, int num_experts, int k, bool renormalize,
                       int32_t* __restrict__ ids, float* __restrict__ weights) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + threadIdx.x / 32;
  if (t >= tokens) return;  // warp-uniform
  const float* row = logits + t * num_experts;
  const int per_lane = (num_experts + 31) / 32;
  float p[kRoutePerLane];
  float max_logit = -INFINITY;
  for (int j = 0; j < per_lane; ++j) {
    const int e = lane + 32 * j;
    p[j] = e < num_experts ? row[e] : -INFINITY;
    max_logit = fmaxf(max_logit, p[j]);
  }
  max_logit = dev::WarpMax(max_logit);
  float sum = 0.0f;
  for (int j = 0; j < per_lane; ++j) {
    p[j] = lane + 32 * j < num_experts ? expf(p[j] - max_logit) : 0.0f;
    sum += p[j];
  }
  sum = dev::WarpSum(sum);
  // -1 marks an expert already chosen or past num_experts (probabilities are >= 0).
  for (int j = 0; j < per_lane; ++j) p[j] = lane + 32 * j < num_experts ? p[j] / sum : -1.0f;
  float chosen_sum = 0.0f, my_weight = 0.0f;
  int my_id = 0;
  for (int r = 0; r < k; ++r) {
    float best = -2.0f;
    int best_id = kMoeMaxExperts;
    for (int j = 0; j < per_lane; ++j) {
      if (p[j] > best) {  // ascending j: ties keep the lower expert
        best = p[j];
        best_id = lane + 32 * j;
      }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(dev::kFullMask, best, offset);
      const int other_id = __shfl_xor_sync(dev::kFullMask, best_id, offset);
      if (other > best || (other == best && other_id < best_id)) {
        best = other;
        best_id = other_id;
      }
    }
    if (best_id % 32 == lane) p[best_id / 32] = -1.0f;
    chosen_sum += best;
    if (lane == r) {
      my_weight = best;
      my_id = best_id;
    }
  }
  if (lane < k) {
    ids[t * k + lane] = my_id;
    weights[t * k + lane] = renormalize ? my_weight / chosen_sum : my_weight;
  }
}

// ---- grouping --------------------------------------------------------------------------------------

constexpr int kGroupThreads = 1024;

// One block: count per expert, lay the padded runs out (thread 0; at most kMoeMaxExperts experts),
// pad, then scatter each pair to its expert's run through a per-expert cursor.
__global__ void __launch_bounds__(kGroupThreads)
    MoeGroupByExpertKernel(const int32_t* __restrict__ ids, int num_pairs, int num_experts, int tile_rows,
                           int32_t* __restrict__ sorted_pairs, int32_t* __restrict__ tile_expert,
                           int32_t* __restrict__ num_tiles) {
  __shared__ int count[kMoeMaxExperts];
  __shared__ int start[kMoeMaxExperts];
  const int tid = static_cast<int>(threadIdx.x);
  for (int e = tid; e < num_experts; e += kGroupThreads) count[e] = 0;
  __syncthreads();
  for (int p = tid; p < num_pairs; p += kGroupThreads) atomicAdd(&count[ids[p]], 1);
  __syncthreads();
  if (tid == 0) {
    int rows = 0;
    for (int e = 0; e < num_experts; ++e) {
      start[e] = rows;
      const int tiles = (count[e] + tile_rows - 1) / tile_rows;
      for (int i = 0; i < tiles; ++i) tile_expert[rows / tile_rows + i] = e;
      rows += tiles * tile_rows;
    }
    num_tiles[0] = rows / tile_rows;
  }
  __syncthreads();
  for (int e = tid; e < num_experts; e += kGroupThreads) {
    const int padded = (count[e] + tile_rows - 1) / tile_rows * tile_rows;
    for (int i = count[e]; i < padded; ++i) sorted_pairs[start[e] + i] = -1;
  }
  __syncthreads();
  for (int e = tid; e < num_experts; e += kGroupThreads) count[e] = 0;  // now each run's cursor
  __syncthreads();
  for (int p = tid; p < num_pairs; p += kGroupThreads) {
    const int e = ids[p];
    sorted_pairs[start[e] + atomicAdd(&count[e], 1)] = p;
  }
}

// ---- grouped GEMM ----------------------------------------------------------------------------------

// 4 warps over a BM x 64 output tile, K in steps of 32 through two shared-memory stages (cp.async);
// rows of 40 elements (80 bytes) keep ldmatrix's eight 16-byte rows on distinct banks.
constexpr int kGemmThreads = 128;
constexpr int kTileN = 64;
constexpr int kTileK = 32;
constexpr int kStride = kTileK + 8;

template <int BM>
constexpr size_t GemmSmemBytes() {
  return 2 * static_cast<size_t>(BM + kTileN) * kStride * 2;
}

// Issues the copies of stage `stage` (K columns k0 .. k0 + 31): BM gathered rows of `in` and 64
// rows of the expert's weights; rows and columns out of range are zero-filled.
template <typename T, int BM>
__device__ __forceinline__ void LoadStage(T* sa, T* sb, const int32_t* row_pair, const T* in, int in_row_divisor,
                                          const T* w, int n0, int N, int K, int k0) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int c = tid; c < BM * 4; c += kGemmThreads) {
    const int r = c / 4, kc = (c % 4) * 8;
    const int pair = row_pair[r];
    const bool valid = pair >= 0 && k0 + kc < K;
    const T* src = valid ? in + static_cast<int64_t>(pair / in_row_divisor) * K + k0 + kc : in;
    dev::CpAsync16(sa + r * kStride + kc, src, valid);
  }
  for (int c = tid; c < kTileN * 4; c += kGemmThreads) {
    const int r = c / 4, kc = (c % 4) * 8;
    const bool valid = n0 + r < N && k0 + kc < K;
    const T* src = valid ? w + static_cast<int64_t>(n0 + r) * K + k0 + kc : w;
    dev::CpAsync16(sb + r * kStride + kc, src, valid);
  }
  dev::CpAsyncCommit();
}

// grid = (max_tiles, ceil(N / 64)). BM 64: warps 2 x 2 of 32 x 32; BM 16: warps 1 x 4 of 16 x 16.
template <typename T, int BM>
__global__ void __launch_bounds__(kGemmThreads)
    MoeGroupedGemmKernel(const T* __restrict__ in, int in_row_divisor, const T* __restrict__ weights,
                         T* __restrict__ out, int N, int K, const int32_t* __restrict__ sorted_pairs,
                         const int32_t* __restrict__ tile_expert, const int32_t* __restrict__ num_tiles) {
  const int tile = static_cast<int>(blockIdx.x);
  if (tile >= num_tiles[0]) return;  // the whole block, before any barrier
  constexpr int kWarpsM = BM == kMoeLargeTile ? 2 : 1, kWarpsN = 4 / kWarpsM;
  constexpr int WM = BM / kWarpsM, WN = kTileN / kWarpsN;
  constexpr int MT = WM / 16, NT = WN / 8;
  KVFLOW_DYNAMIC_SMEM(T, smem);
  T* const sa = smem;                           // [2][BM][kStride]
  T* const sb = smem + 2 * BM * kStride;        // [2][kTileN][kStride]
  __shared__ int32_t row_pair[kMoeLargeTile];
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int n0 = static_cast<int>(blockIdx.y) * kTileN;
  const T* w = weights + static_cast<int64_t>(tile_expert[tile]) * N * K;
  for (int r = tid; r < BM; r += kGemmThreads) row_pair[r] = sorted_pairs[static_cast<int64_t>(tile) * BM + r];
  __syncthreads();

  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
  }
  const int k_tiles = (K + kTileK - 1) / kTileK;
  LoadStage<T, BM>(sa, sb, row_pair, in, in_row_divisor, w, n0, N, K, 0);
  for (int kt = 0; kt < k_tiles; ++kt) {
    if (kt + 1 < k_tiles) {
      const int s = (kt + 1) & 1;
      LoadStage<T, BM>(sa + s * BM * kStride, sb + s * kTileN * kStride, row_pair, in, in_row_divisor, w, n0, N, K,
                       (kt + 1) * kTileK);
      dev::CpAsyncWait<1>();
    } else {
      dev::CpAsyncWait<0>();
    }
    __syncthreads();
    const T* A = sa + (kt & 1) * BM * kStride;
    const T* B = sb + (kt & 1) * kTileN * kStride;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        dev::LdMatrixX4(a[mt], A + (warp_m * WM + mt * 16 + lane % 16) * kStride + kk + (lane / 16) * 8);
      }
      uint32_t b[NT][2];
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        // Matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
        uint32_t r[4];
        dev::LdMatrixX4(r, B + (warp_n * WN + np * 16 + (lane / 16) * 8 + lane % 8) * kStride + kk + ((lane / 8) % 2) * 8);
        b[2 * np][0] = r[0];
        b[2 * np][1] = r[1];
        b[2 * np + 1][0] = r[2];
        b[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) dev::MmaM16N8K16<T>(acc[mt][nt], a[mt], b[nt]);
      }
    }
    __syncthreads();  // the stage is overwritten by the next iteration's loads
  }

  const int g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int pair = row_pair[warp_m * WM + mt * 16 + g + half * 8];
      if (pair < 0) continue;
      T* orow = out + static_cast<int64_t>(pair) * N;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int n = n0 + warp_n * WN + nt * 8 + 2 * t4;
        if (n >= N) continue;  // N % 8 == 0: n + 1 < N too
        dev::Vec<T, 2> v;
        v.v[0] = dev::FromFloat<T>(acc[mt][nt][half * 2]);
        v.v[1] = dev::FromFloat<T>(acc[mt][nt][half * 2 + 1]);
        *reinterpret_cast<dev::Vec<T, 2>*>(orow + n) = v;
      }
    }
  }
}

template <typename T, int BM>
int LaunchGroupedGemm(const T* in, int in_row_divisor, const T* weights, T* out, int N, int K,
                      const int32_t* sorted_pairs, const int32_t* tile_expert, const int32_t* num_tiles, int max_tiles,
                      void* stream) {
  const int n_tiles = (N + kTileN - 1) / kTileN;
  if (n_tiles > 65535) return kInvalidValue;
  return LaunchKernel(MoeGroupedGemmKernel<T, BM>, dim3(static_cast<unsigned>(max_tiles), static_cast<unsigned>(n_tiles)),
                      dim3(kGemmThreads), GemmSmemBytes<BM>(), stream, in, in_row_divisor, weights, out, N, K,
                      sorted_pairs, tile_expert, num_tiles);
}

// ---- combine ---------------------------------------------------------------------------------------

constexpr int kCombineThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    MoeCombineKernel(const T* __restrict__ expert_out, const float* __restrict__ weights, int k, int hidden,
                     const T* __restrict__ shared_out, const float* __restrict__ shared_gate_logit, T* __restrict__ delta) {
  const int64_t t = blockIdx.x;
  const float gate = shared_out ? 1.0f / (1.0f + expf(-shared_gate_logit[t])) : 0.0f;
  for (int h = static_cast<int>(threadIdx.x); h < hidden; h += kCombineThreads) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) acc += weights[t * k + j] * dev::ToFloat(expert_out[(t * k + j) * hidden + h]);
    if (shared_out) acc += gate * dev::ToFloat(shared_out[t * hidden + h]);
    delta[t * hidden + h] = dev::FromFloat<T>(acc);
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int MoeRouteTopK(const float* router_logits, int tokens, int num_experts, int k, bool renormalize, int32_t* ids,
                 float* weights, void* stream) {
  if (tokens < 0 || num_experts < 1 || num_experts > kMoeMaxExperts || k < 1 || k > 32 || k > num_experts) {
    return kInvalidValue;
  }
  if (tokens == 0) return 0;
  if (!router_logits || !ids || !weights) return kInvalidValue;
  const int blocks = (tokens + kRouteWarps - 1) / kRouteWarps;
  return LaunchKernel(MoeRouteTopKKernel, dim3(static_cast<unsigned>(blocks)), dim3(kRouteWarps * 32), 0, stream,
                      router_logits, tokens, num_experts, k, renormalize, ids, weights);
}

int MoeGroupByExpert(const int32_t* ids, int num_pairs, int num_experts, int tile_rows, int32_t* sorted_pairs,
                     int32_t* tile_expert, int32_t* num_tiles, void* stream) {
  if (num_pairs < 0 || num_experts < 1 || num_experts > kMoeMaxExperts || tile_rows < 1) return kInvalidValue;
  if ((num_pairs > 0 && !ids) || !sorted_pairs || !tile_expert || !num_tiles) return kInvalidValue;
  return LaunchKernel(MoeGroupByExpertKernel, dim3(1), dim3(kGroupThreads), 0, stream, ids, num_pairs, num_experts,
                      tile_rows, sorted_pairs, tile_expert, num_tiles);
}

int MoeGroupedGemm(DType dtype, const void* in, int in_row_divisor, const void* weights, void* out, int N, int K,
                   const int32_t* sorted_pairs, const int32_t* tile_expert, const int32_t* num_tiles, int max_tiles,
                   int tile_rows, void* stream) {
  if (N <= 0 || K <= 0 || N % 8 != 0 || K % 8 != 0 || in_row_divisor < 1 || max_tiles < 0) return kInvalidValue;
  if (tile_rows != kMoeSmallTile && tile_rows != kMoeLargeTile) return kInvalidValue;
  if (max_tiles == 0) return 0;
  if (!in || !weights || !out || !sorted_pairs || !tile_expert || !num_tiles) return kInvalidValue;
  if (!Aligned16(in) || !Aligned16(weights) || !Aligned16(out)) return kInvalidValue;
  KVFLOW_DISPATCH_HALF_DTYPE(dtype, T, {
    const T* a = static_cast<const T*>(in);
    const T* w = static_cast<const T*>(weights);
    T* o = static_cast<T*>(out);
    if (tile_rows == kMoeSmallTile) {
      return LaunchGroupedGemm<T, kMoeSmallTile>(a, in_row_divisor, w, o, N, K, sorted_pairs, tile_expert, num_tiles,
                                                 max_tiles, stream);
    }
    return LaunchGroupedGemm<T, kMoeLargeTile>(a, in_row_divisor, w, o, N, K, sorted_pairs, tile_expert, num_tiles,
                                               max_tiles, stream);
  });
  return kInvalidValue;
}

int MoeCombine(DType dtype, const void* expert_out, const float* weights, int tokens, int k, int hidden,
               const void* shared_out, const float* shared_gate_logit, void* delta, void* stream) {
  if (tokens < 0 || k < 1 || hidden < 1 || (shared_out != nullptr) != (shared_gate_logit != nullptr)) {
    return kInvalidValue;
  }
  if (tokens == 0) return 0;
  if (!expert_out || !weights || !delta) return kInvalidValue;
  KVFLOW_DISPATCH_DTYPE(dtype, T, {
    return LaunchKernel(MoeCombineKernel<T>, dim3(static_cast<unsigned>(tokens)), dim3(kCombineThreads), 0, stream,
                        static_cast<const T*>(expert_out), weights, k, hidden, static_cast<const T*>(shared_out),
                        shared_gate_logit, static_cast<T*>(delta));
  });
  return kInvalidValue;
}

}  // namespace kvflow::cuda
