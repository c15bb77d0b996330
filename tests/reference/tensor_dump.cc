// Opens a GGUF file with kvflow's reader and writes every tensor, dequantized to fp32 by kvflow, to
// <out>/<tensor name>.f32 (raw little-endian floats, row-major), for the reference scripts to compare.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <vector>

#include "model/gguf.h"
#include "model/tensor_source.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " FILE.gguf OUT_DIR\n";
    return 2;
  }
  auto gguf = kvflow::GgufFile::Open(argv[1]);
  if (!gguf.ok()) {
    std::cerr << "error: " << gguf.status().ToString() << "\n";
    return 1;
  }
  const std::filesystem::path out_dir = argv[2];
  std::filesystem::create_directories(out_dir);
  std::vector<float> values;
  for (const std::string& name : (*gguf)->Names()) {
    const kvflow::TensorInfo* info = (*gguf)->Find(name);
    values.assign(static_cast<size_t>(info->numel()), 0.0f);
    if (kvflow::Status st = kvflow::DequantizeToF32(*info, values.data()); !st.ok()) {
      std::cerr << "error: " << st.ToString() << "\n";
      return 1;
    }
    std::ofstream out(out_dir / (name + ".f32"), std::ios::binary);
    out.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(float)));
    if (!out) {
      std::cerr << "error: cannot write " << (out_dir / (name + ".f32")).string() << "\n";
      return 1;
    }
  }
  return 0;
}
