// Helpers for the kernel and CUDA-backend tests in tests/cuda. Every test here builds twice:
//   kvflow_gpu_tests: kernels compiled by nvcc, run on a real GPU (ctest label `gpu`; each test
//                     skips with a message when there is no GPU);
//   kvflow_emu_tests: the same kernel sources compiled as C++ against the CPU emulator in
//                     tests/cuda_emu (label `emu`; runs in CI on machines without a GPU).
// So tests use the CUDA runtime API only through what the emulator implements (cuda_emu.h).
#pragma once

#include <gtest/gtest.h>

#ifdef KVFLOW_CUDA_EMU
#include "cuda_emu.h"
#else
#include <cuda_runtime.h>
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_device.h"
#include "kernel_common.h"

#define KVFLOW_SKIP_WITHOUT_GPU()                                                                  \
  do {                                                                                             \
    if (::kvflow::cuda::DeviceCount() == 0)                                                        \
      GTEST_SKIP() << "no CUDA GPU (" << ::kvflow::cuda::DeviceDescription(0)                      \
                   << "); run on a GPU with: ctest --test-dir build -L gpu";                        \
  } while (0)

#define KVFLOW_CUDA_OK(expr) ASSERT_EQ(static_cast<int>(expr), 0) << #expr << ": " << cudaGetErrorString(static_cast<cudaError_t>(expr))

namespace kvflow::test {

inline bool IsEmulator() {
#ifdef KVFLOW_CUDA_EMU
  return true;
#else
  return false;
#endif
}

// A device allocation that frees itself. Poison() fills it with NaN bytes (0xFF) so that a kernel
// that forgets to write an element is caught.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0 && cudaMalloc(&ptr_, bytes) != cudaSuccess) {
      ptr_ = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << bytes << " bytes failed";
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (ptr_) cudaFree(ptr_);
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  template <typename T>
  static DeviceBuffer From(const std::vector<T>& host) {
    DeviceBuffer b(host.size() * sizeof(T));
    if (b.ptr_ && !host.empty()) cudaMemcpy(b.ptr_, host.data(), b.bytes_, cudaMemcpyHostToDevice);
    return b;
  }
  void Poison() {
    if (ptr_) cudaMemset(ptr_, 0xFF, bytes_);
  }
  template <typename T>
  std::vector<T> Download() const {
    std::vector<T> host(bytes_ / sizeof(T));
    if (ptr_ && !host.empty()) cudaMemcpy(host.data(), ptr_, host.size() * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

inline void FillNormal(std::vector<float>& v, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> normal(0.0f, stddev);
  for (float& x : v) x = normal(rng);
}

// Host-side element conversion, as the kernels round (round to nearest even).
inline uint16_t FloatToBits(float x, cuda::DType t) {
  uint16_t bits = 0;
  if (t == cuda::DType::kF16) {
    const __half h = __float2half_rn(x);
    std::memcpy(&bits, &h, 2);
  } else {
    const __nv_bfloat16 b = __float2bfloat16_rn(x);
    std::memcpy(&bits, &b, 2);
  }
  return bits;
}
inline float BitsToFloat(uint16_t bits, cuda::DType t) {
  if (t == cuda::DType::kF16) {
    __half h;
    std::memcpy(&h, &bits, 2);
    return __half2float(h);
  }
  __nv_bfloat16 b;
  std::memcpy(&b, &bits, 2);
  return __bfloat162float(b);
}

// Bytes of `values` in dtype `t` (fp32: the floats themselves). Rounds `values` in place to what the
// device will see, so that the CPU reference computes on exactly the same inputs.
inline std::vector<uint8_t> ToDeviceBytes(std::vector<float>& values, cuda::DType t) {
  std::vector<uint8_t> bytes(values.size() * cuda::DTypeSize(t));
  if (t == cuda::DType::kF32) {
    std::memcpy(bytes.data(), values.data(), bytes.size());
    return bytes;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t b = FloatToBits(values[i], t);
    std::memcpy(&bytes[2 * i], &b, 2);
    values[i] = BitsToFloat(b, t);
  }
  return bytes;
}
inline std::vector<float> FromDeviceBytes(const std::vector<uint8_t>& bytes, cuda::DType t) {
  std::vector<float> values(bytes.size() / cuda::DTypeSize(t));
  if (t == cuda::DType::kF32) {
    std::memcpy(values.data(), bytes.data(), bytes.size());
    return values;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, &bytes[2 * i], 2);
    values[i] = BitsToFloat(b, t);
  }
  return values;
}

struct ErrorStats {
  double max_abs = 0.0;
  double max_rel = 0.0;  // |got - ref| / max(|ref|, 1e-3 * max|ref|)
  double norm_rel = 0.0;  // ||got - ref||_2 / ||ref||_2 over the finite outputs
  size_t worst_index = 0;
  size_t non_finite = 0;
};

inline ErrorStats CompareArrays(const std::vector<float>& got, const std::vector<float>& ref) {
  ErrorStats s;
  double ref_scale = 0.0;
  for (float r : ref) ref_scale = std::max(ref_scale, static_cast<double>(std::fabs(r)));
  const double floor = std::max(1e-3 * ref_scale, 1e-12);
  double diff_sq = 0.0, ref_sq = 0.0;
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    if (!std::isfinite(got[i])) {
      ++s.non_finite;
      continue;
    }
    const double d = std::fabs(static_cast<double>(got[i]) - ref[i]);
    diff_sq += d * d;
    ref_sq += static_cast<double>(ref[i]) * ref[i];
    if (d > s.max_abs) {
      s.max_abs = d;
      s.worst_index = i;
    }
    s.max_rel = std::max(s.max_rel, d / std::max(std::fabs(static_cast<double>(ref[i])), floor));
  }
  if (got.size() != ref.size()) s.non_finite += std::max(got.size(), ref.size()) - std::min(got.size(), ref.size());
  s.norm_rel = ref_sq > 0 ? std::sqrt(diff_sq / ref_sq) : std::sqrt(diff_sq);
  return s;
}

// Every output finite and present, and within `atol` of the reference (the worst one named).
inline void ExpectFiniteWithinAtol(const std::string& what, const ErrorStats& s, const std::vector<float>& got,
                                   const std::vector<float>& ref, double atol) {
  EXPECT_EQ(s.non_finite, 0u) << what << ": non-finite or missing outputs";
  EXPECT_LE(s.max_abs, atol) << what << ": worst at index " << s.worst_index << " got "
                             << (s.worst_index < got.size() ? got[s.worst_index] : NAN) << " want "
                             << (s.worst_index < ref.size() ? ref[s.worst_index] : NAN);
}

// Prints "<what>: max |d| = ..., max rel = ..." (the figures the issue asks every test to report)
// and checks them against the tolerances.
inline void ExpectClose(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref,
                        double atol, double rtol) {
  const ErrorStats s = CompareArrays(got, ref);
  std::printf("  %-60s max|d| = %.3g  max rel = %.3g  (atol %.3g, rtol %.3g)%s\n", what.c_str(), s.max_abs,
              s.max_rel, atol, rtol, IsEmulator() ? "  [emulator]" : "");
  ExpectFiniteWithinAtol(what, s, got, ref, atol);
  EXPECT_LE(s.max_rel, rtol) << what;
}

// Like ExpectClose, but the relative check is norm-wise (||d|| / ||ref||) instead of per element:
// for bf16 products whose rounding error scales with the row's magnitude, not each element's, a
// near-zero output makes the per-element ratio meaningless (seen on an H200: 2.8e-3 absolute error,
// well within atol, is 112% of a 2.5e-3 output).
inline void ExpectCloseNormwise(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref,
                                double atol, double norm_rtol) {
  const ErrorStats s = CompareArrays(got, ref);
  std::printf("  %-60s max|d| = %.3g  ||d||/||ref|| = %.3g  (atol %.3g, norm rtol %.3g; max rel %.3g)%s\n",
              what.c_str(), s.max_abs, s.norm_rel, atol, norm_rtol, s.max_rel, IsEmulator() ? "  [emulator]" : "");
  ExpectFiniteWithinAtol(what, s, got, ref, atol);
  EXPECT_LE(s.norm_rel, norm_rtol) << what;
}

// The largest ||got_row - ref_row||_2 / ||ref_row||_2 over consecutive rows of `row_len` values: the
// relative check for attention outputs (a row is a convex combination of V rows, never near zero,
// however long the context and however small its elements).
inline double MaxRowRelativeL2(const std::vector<float>& got, const std::vector<float>& ref, size_t row_len) {
  double worst = 0.0;
  for (size_t r = 0; r + row_len <= std::min(got.size(), ref.size()); r += row_len) {
    double d2 = 0.0, r2 = 0.0;
    for (size_t e = r; e < r + row_len; ++e) {
      d2 += (static_cast<double>(got[e]) - ref[e]) * (static_cast<double>(got[e]) - ref[e]);
      r2 += static_cast<double>(ref[e]) * ref[e];
    }
    worst = std::max(worst, std::isfinite(d2) ? std::sqrt(d2 / std::max(r2, 1e-30)) : INFINITY);
  }
  return worst;
}

inline void ExpectRowsClose(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref,
                            size_t row_len, double tol) {
  const double worst = MaxRowRelativeL2(got, ref, row_len);
  std::printf("  %-60s max row |d|_2/|ref|_2 = %.3g  (tol %.3g)\n", what.c_str(), worst, tol);
  EXPECT_LE(worst, tol) << what << ": row-relative L2 error";
}

}  // namespace kvflow::test
