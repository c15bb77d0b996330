// Prints the ids of one encoding of a whole file, space-separated on one line, for comparison
// with HF `tokenizers` (see tokenizer_reference.py).
//   tokenizer_dump (--tokenizer-json PATH | --gguf PATH) --input FILE
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "kvflow/tokenizer.h"
#include "model/gguf.h"
#include "model/tensor_source.h"

namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "tokenizer_dump: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // stdout carries the ids; logs go to stderr.
  spdlog::set_default_logger(spdlog::stderr_color_mt("kvflow"));
  std::string json_path, gguf_path, input_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return Fail("missing value after " + arg);
    if (arg == "--tokenizer-json") {
      json_path = argv[++i];
    } else if (arg == "--gguf") {
      gguf_path = argv[++i];
    } else if (arg == "--input") {
      input_path = argv[++i];
    } else {
      return Fail("unknown argument " + arg);
    }
  }
  if (input_path.empty() || json_path.empty() == gguf_path.empty()) {
    return Fail("usage: tokenizer_dump (--tokenizer-json PATH | --gguf PATH) --input FILE");
  }

  std::unique_ptr<kvflow::Tokenizer> tokenizer;
  if (!json_path.empty()) {
    auto tok = kvflow::Tokenizer::FromHfJson(json_path);
    if (!tok.ok()) return Fail(tok.status().ToString());
    tokenizer = std::move(tok).value();
  } else {
    // The tokenizer alone, so that a vocabulary-only GGUF does.
    auto gguf = kvflow::GgufFile::Open(gguf_path);
    if (!gguf.ok()) return Fail(gguf.status().ToString());
    auto spec = kvflow::TokenizerSpecFromGguf(*gguf.value());
    if (!spec.ok()) return Fail(spec.status().ToString());
    auto tok = kvflow::Tokenizer::FromSpec(std::move(spec).value());
    if (!tok.ok()) return Fail(tok.status().ToString());
    tokenizer = std::move(tok).value();
  }

  std::ifstream in(input_path, std::ios::binary);
  if (!in) return Fail("cannot open " + input_path);
  std::stringstream content;
  content << in.rdbuf();
  const std::string text = content.str();

  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tokenizer->Encode(text, /*add_bos=*/false);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::string line;
  line.reserve(ids.size() * 6);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) line += ' ';
    line += std::to_string(ids[i]);
  }
  std::cout << line << '\n';
  std::fprintf(stderr, "tokenizer_dump: %zu bytes -> %zu tokens in %.3f s\n", text.size(),
               ids.size(), seconds);
  return 0;
}
