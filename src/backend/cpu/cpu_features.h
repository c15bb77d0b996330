// What this CPU's vector units can run, read once. The CPU kernels build every instruction set's
// path with target attributes and choose among them at run time from these flags, so one binary
// never executes an instruction its CPU lacks.
#pragma once

namespace kvflow::cpu {

struct CpuFeatures {
  bool avx2 = false;         // AVX2 + FMA + F16C (x86-64-v3's vector part), with the OS saving ymm state
  bool avx512 = false;       // AVX-512 F + BW + VL, with the OS saving zmm state
  bool avx512_vnni = false;  // and VNNI (vpdpbusd, vpdpwssd)
  bool avx512_bf16 = false;  // and BF16 (vdpbf16ps)
};

const CpuFeatures& DetectedCpuFeatures();

}  // namespace kvflow::cpu
