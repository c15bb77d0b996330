// Gated activations of the fused gate_up projection, in fp32:
//   SiLU (SwiGLU): out[r, i] = silu(gate[r, i]) * up[r, i], cpu::SiluMul's g / (1 + expf(-g)) * u
//     (precise expf and division, so fp32 agrees with the CPU to an ulp or two; large |g| gives -0
//     or g, never NaN);
//   tanh GELU (GeGLU, Gemma): cpu::GeluTanhMul's 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) u.
#include "device_utils.cuh"

#include <cmath>

#include "activation.h"

namespace kvflow::cuda {
namespace {

using dev::Vec;

// grid = (rows, chunks of kThreads * V elements of a row): rows on x (no 65535 limit), so each
// thread handles exactly one V-group of one row and there is no integer division per element.
// V = 16 / sizeof(T) (16-byte loads of gate and up, one 16-byte store) when n allows, else 1.
constexpr int kThreads = 256;

enum class Gate { kSilu, kGeluTanh };

template <Gate G>
__device__ __forceinline__ float Activate(float x) {
  if constexpr (G == Gate::kSilu) {
    return x / (1.0f + expf(-x));
  } else {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
  }
}

template <typename T, int V, Gate G>
__global__ void __launch_bounds__(kThreads)
    GatedActivationKernel(const T* __restrict__ gate_up, T* __restrict__ out, int n) {
  const int64_t row = blockIdx.x;
  const int i = (static_cast<int>(blockIdx.y) * kThreads + static_cast<int>(threadIdx.x)) * V;
  if (i >= n) return;  // n % V == 0, so a group is wholly in range
  const T* g = gate_up + row * 2 * n + i;
  const Vec<T, V> gv = *reinterpret_cast<const Vec<T, V>*>(g);
  const Vec<T, V> uv = *reinterpret_cast<const Vec<T, V>*>(g + n);
  Vec<T, V> o;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const float x = dev::ToFloat(gv.v[k]);
    const float u = dev::ToFloat(uv.v[k]);
    o.v[k] = dev::FromFloat<T>(Activate<G>(x) * u);
  }
  *reinterpret_cast<Vec<T, V>*>(out + row * n + i) = o;
}

template <typename T, int V, Gate G>
int LaunchGated(const T* gate_up, T* out, int rows, int n, void* stream) {
  const int64_t chunks = (static_cast<int64_t>(n) / V + kThreads - 1) / kThreads;
  if (chunks > 65535) return kInvalidValue;
  return LaunchKernel(GatedActivationKernel<T, V, G>, dim3(static_cast<unsigned>(rows), static_cast<unsigned>(chunks)),
                      dim3(kThreads), 0, stream, gate_up, out, n);
}

template <Gate G>
int GatedActivation(DType dtype, const void* gate_up, void* out, int rows, int n, void* stream) {
  if (rows < 0 || n <= 0) return kInvalidValue;
  if (rows == 0) return 0;
  if (!gate_up || !out) return kInvalidValue;
  KVFLOW_DISPATCH_DTYPE(dtype, T, {
    constexpr int V = 16 / static_cast<int>(sizeof(T));
    const T* in = static_cast<const T*>(gate_up);
    T* o = static_cast<T*>(out);
    if (n % V == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(o) % 16 == 0) {
      return LaunchGated<T, V, G>(in, o, rows, n, stream);
    }
    return LaunchGated<T, 1, G>(in, o, rows, n, stream);
  });
  return kInvalidValue;
}

}  // namespace

int SiluAndMul(DType dtype, const void* gate_up, void* out, int rows, int n, void* stream) {
  return GatedActivation<Gate::kSilu>(dtype, gate_up, out, rows, n, stream);
}

int GeluTanhAndMul(DType dtype, const void* gate_up, void* out, int rows, int n, void* stream) {
  return GatedActivation<Gate::kGeluTanh>(dtype, gate_up, out, rows, n, stream);
}

}  // namespace kvflow::cuda
