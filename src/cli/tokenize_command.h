// `kvflow tokenize`: the token ids of a text, printed as llama.cpp's llama-tokenize prints them
// ("    id -> 'piece'" per token, or a [list] with --list), or the text of given ids (--ids). Only
// the tokenizer is read, so a vocabulary-only GGUF or a tokenizer.json is enough.
//
//   kvflow tokenize --model smollm2-135m --text "Hello world"
//   kvflow tokenize --model ggml-vocab-llama-spm.gguf --file prompt.txt --list --show-count
//   kvflow tokenize --model tokenizer.json --ids "9906, 1917"
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace kvflow {

struct TokenizeCommandOptions {
  std::string model;
  std::string text;
  std::string file;
  bool from_stdin = false;
  std::string ids;  // decode these instead
  bool list = false;
  bool no_bos = false;
  bool parse_special = false;
  bool show_count = false;
};

CLI::App* AddTokenizeCommand(CLI::App& app, TokenizeCommandOptions* options);
int RunTokenizeCommand(const TokenizeCommandOptions& options);

}  // namespace kvflow
