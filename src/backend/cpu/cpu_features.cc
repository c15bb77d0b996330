#include "backend/cpu/cpu_features.h"

#include <cpuid.h>

namespace kvflow::cpu {

namespace {

// CPUID.1:ECX.F16C, read directly: clang's __builtin_cpu_supports has no "f16c" (the GGUF fuzz
// target and clang builds compile the kernels). The AVX2 check covers the OS's ymm state.
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

// CPUID.(7,1):EAX bit 5, read directly for the same reason (older clang has no "avx512bf16").
bool HasAvx512Bf16Bit() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0 && (eax & (1u << 5)) != 0;
}

CpuFeatures Detect() {
  __builtin_cpu_init();
  CpuFeatures f;
  // libgcc's and compiler-rt's feature bits include the OS check (XCR0) that the vector state is
  // enabled.
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && HasF16c();
  f.avx512 = f.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  f.avx512_vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
  f.avx512_bf16 = f.avx512 && HasAvx512Bf16Bit();
  return f;
}

}  // namespace

const CpuFeatures& DetectedCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

}  // namespace kvflow::cpu
