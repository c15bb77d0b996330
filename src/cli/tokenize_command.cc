#include "cli/tokenize_command.h"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <spdlog/spdlog.h>

#include "kvflow/models.h"
#include "model/tensor_source.h"
#include "model/utf8.h"

namespace kvflow {
namespace {

// "1 2 3", "1,2,3" or "[1, 2, 3]".
Result<std::vector<int32_t>> ParseIds(const std::string& text, int32_t vocab_size) {
  std::vector<int32_t> ids;
  std::string cleaned = text;
  for (char& c : cleaned) {
    if (c == ',' || c == '[' || c == ']') c = ' ';
  }
  std::istringstream in(cleaned);
  std::string word;
  while (in >> word) {
    size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != word.size()) return Status::InvalidArgument("--ids: '" + word + "' is not a token id");
    if (id < 0 || id >= vocab_size) {
      return Status::InvalidArgument("--ids: " + word + " is outside the vocabulary of " +
                                     std::to_string(vocab_size));
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

}  // namespace

CLI::App* AddTokenizeCommand(CLI::App& app, TokenizeCommandOptions* o) {
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "Print the token ids of a text (or the text of ids) as llama-tokenize does; no weights loaded");
  cmd->add_option("-m,--model", o->model,
                  "A .gguf (a vocabulary-only one is enough), a tokenizer.json, a model directory or a short name")
      ->required();
  auto* text = cmd->add_option("-p,--text", o->text, "The text to tokenize");
  auto* file = cmd->add_option("-f,--file", o->file, "Tokenize this file's content");
  auto* in = cmd->add_flag("--stdin", o->from_stdin, "Tokenize standard input");
  auto* ids = cmd->add_option("--ids", o->ids, "Decode these ids instead (\"1 2 3\", \"1,2,3\" or \"[1, 2, 3]\")");
  text->excludes(file)->excludes(in)->excludes(ids);
  file->excludes(in)->excludes(ids);
  in->excludes(ids);
  cmd->add_flag("--list", o->list, "Print the ids as one [list] (llama-tokenize's --ids)");
  cmd->add_flag("--no-bos", o->no_bos, "Do not add BOS even where the model adds it");
  cmd->add_flag("--parse-special", o->parse_special,
                "Special tokens written in the text (e.g. <|im_start|>) become their ids");
  cmd->add_flag("--show-count", o->show_count, "Print the number of tokens at the end");
  return cmd;
}

int RunTokenizeCommand(const TokenizeCommandOptions& o) {
  auto fail = [](const Status& s) {
    spdlog::error("{}", s.ToString());
    return 1;
  };
  auto path = ResolveModel(o.model);
  if (!path.ok()) return fail(path.status());
  auto opened = OpenTokenizer(path.value());
  if (!opened.ok()) return fail(opened.status());
  const Tokenizer& tok = *opened.value();

  if (!o.ids.empty()) {
    auto ids = ParseIds(o.ids, tok.vocab_size());
    if (!ids.ok()) return fail(ids.status());
    const std::string text = tok.DecodeBytes(ids.value(), /*skip_special=*/false);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);
    return 0;
  }
  std::string text = o.text;
  if (!o.file.empty() || o.from_stdin) {
    std::ifstream file;
    if (!o.file.empty()) {
      file.open(o.file, std::ios::binary);
      if (!file) return fail(Status::NotFound("--file: cannot read '" + o.file + "'"));
    }
    std::stringstream content;
    content << (o.from_stdin ? std::cin.rdbuf() : file.rdbuf());
    text = content.str();
  } else if (o.text.empty()) {
    return fail(Status::InvalidArgument("give --text, --file, --stdin or --ids"));
  }
  const std::vector<int32_t> ids = tok.Encode(text, tok.add_bos() && !o.no_bos, o.parse_special);
  if (o.list) {
    std::printf("[");
    for (size_t i = 0; i < ids.size(); ++i) std::printf(i ? ", %d" : "%d", ids[i]);
    std::printf("]\n");
  } else {
    for (int32_t id : ids) {
      const std::string piece = tok.TokenBytes(id, /*skip_special=*/false);
      std::printf("%6d -> '", id);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::printf(IsValidUtf8(piece) ? "'\n" : "' (utf-8 decode failure)\n");
    }
  }
  if (o.show_count) std::printf("Total number of tokens: %zu\n", ids.size());
  return 0;
}

}  // namespace kvflow
