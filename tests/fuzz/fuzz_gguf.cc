// libFuzzer target: every input is opened as a GGUF file by kvflow's reader and, when it opens,
// every tensor is dequantized to fp32 (all block formats, the K-quants included), read as a weight
// matrix kept in its blocks (the CPU backend's default load path) and, when that is accepted, run
// through the quantized matmul kernels; and every metadata value is read with each getter. Any
// crash, sanitizer report or hang is a bug; a refused file is fine.
// tools/fuzz-gguf builds and runs it; the seeds in tests/fuzz/corpus_gguf hold K-quant tensors.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cpu/quant_gemm.h"
#include "kvflow/tokenizer.h"
#include "model/gguf.h"
#include "model/tensor_source.h"
#include "model/weight_matrix.h"

namespace {

// GgufFile::Open maps a path: the input goes into one in-memory file, reused for every input.
const std::string& InputPath() {
  static const std::string path = [] {
    const int fd = memfd_create("kvflow_fuzz_gguf", 0);
    if (fd < 0) std::abort();
    return "/proc/self/fd/" + std::to_string(fd);
  }();
  return path;
}

int InputFd() { return std::stoi(InputPath().substr(std::string("/proc/self/fd/").size())); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = InputFd();
  if (ftruncate(fd, 0) != 0 || (size > 0 && pwrite(fd, data, size, 0) != static_cast<ssize_t>(size))) std::abort();

  auto gguf = kvflow::GgufFile::Open(InputPath());
  if (!gguf.ok()) return 0;
  std::vector<float> out;
  for (const std::string& name : (*gguf)->Names()) {
    const kvflow::TensorInfo* info = (*gguf)->Find(name);
    out.assign(static_cast<size_t>(info->numel()), 0.0f);
    // A file that opened is self-consistent: its tensors must dequantize.
    if (!kvflow::DequantizeToF32(*info, out.data()).ok()) std::abort();
    // The blocks kept as they are: a part the reader accepts must hold every row's blocks, which
    // the kernels then read in full (ASan checks) and DequantizeRow agrees with.
    auto part = kvflow::ReadWeightPart(*info, true);
    if (!part.ok() || part->dtype == kvflow::DType::kF32 || info->shape.empty()) continue;
    const int64_t cols = info->shape.back();
    if (part->blocks.size() != static_cast<size_t>(part->rows) * part->row_bytes(cols)) std::abort();
    if (cols == 0 || part->rows == 0) continue;
    std::vector<float> x(static_cast<size_t>(cols), 0.5f), y(static_cast<size_t>(part->rows));
    kvflow::cpu::QuantizedActivations qx;
    kvflow::cpu::QuantizeActivations(x.data(), 1, cols, part->dtype, qx);
    kvflow::cpu::QuantizedMatmul(qx, part->blocks.data(), part->rows, y.data(), part->rows, false);
    (void)kvflow::cpu::QuantizedDot(part->dtype, part->blocks.data(), qx.row(0), cols);
  }
  for (const std::string& key : (*gguf)->Keys()) {
    (void)(*gguf)->GetString(key);
    (void)(*gguf)->GetU64(key);
    (void)(*gguf)->GetF32(key);
    (void)(*gguf)->GetStringArray(key);
    (void)(*gguf)->GetIntArray(key);
  }
  auto spec = kvflow::TokenizerSpecFromGguf(**gguf);
  if (spec.ok()) {
    auto tok = kvflow::Tokenizer::FromSpec(std::move(spec).value());
    if (tok.ok()) (void)(*tok)->Decode((*tok)->Encode("Hello <s> w\u00f6rld 123", true, true), false);
  }
  return 0;
}
