// llama.cpp's logits and greedy tokens for token-id prompts: the reference for the architectures
// transformers 4.46 lacks (Qwen3) and for kvflow's GGUF paths. Built by llama_cpp_reference.py
// against the llama.cpp static libraries the benchmark script builds (.cache/llama-cpp).
//   llama_cpp_logits MODEL.gguf PROMPTS.json GREEDY_TOKENS OUT_LOGITS.bin OUT_GREEDY.json
// PROMPTS.json: [[id, ...], ...]. OUT_LOGITS.bin: float32, every position of every prompt, in order.
// The KV cache is fp32 and flash attention off, so an fp32 model computes in fp32 throughout.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

std::vector<std::vector<llama_token>> ReadPrompts(const char* path) {
  std::ifstream in(path);
  std::stringstream all;
  all << in.rdbuf();
  std::vector<std::vector<llama_token>> prompts;
  std::vector<llama_token> cur;
  int depth = 0;
  std::string number;
  for (char c : all.str()) {
    if (c >= '0' && c <= '9') {
      number += c;
      continue;
    }
    if (!number.empty()) {
      cur.push_back(std::stoi(number));
      number.clear();
    }
    if (c == '[' && ++depth == 2) cur.clear();
    if (c == ']' && depth-- == 2) prompts.push_back(cur);
  }
  return prompts;
}

void Quiet(ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// Evaluates `tokens` from position `first`; every row's logits when `all_logits`, else the last.
bool Decode(llama_context* ctx, const std::vector<llama_token>& tokens, int first, bool all_logits) {
  llama_batch batch = llama_batch_init(static_cast<int32_t>(tokens.size()), 0, 1);
  for (size_t i = 0; i < tokens.size(); ++i) {
    batch.token[i] = tokens[i];
    batch.pos[i] = first + static_cast<int>(i);
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = all_logits || i + 1 == tokens.size();
  }
  batch.n_tokens = static_cast<int32_t>(tokens.size());
  const bool ok = llama_decode(ctx, batch) == 0;
  llama_batch_free(batch);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: llama_cpp_logits MODEL.gguf PROMPTS.json GREEDY_TOKENS OUT_LOGITS.bin OUT_GREEDY.json\n");
    return 2;
  }
  llama_log_set(Quiet, nullptr);
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (model == nullptr) {
    std::fprintf(stderr, "llama_cpp_logits: cannot load %s\n", argv[1]);
    return 1;
  }
  const auto prompts = ReadPrompts(argv[2]);
  const int greedy = std::stoi(argv[3]);
  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(longest + greedy + 16);
  cp.n_batch = cp.n_ubatch = static_cast<uint32_t>(longest + 1);
  cp.n_threads = cp.n_threads_batch = 2;
  cp.type_k = cp.type_v = GGML_TYPE_F32;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "llama_cpp_logits: cannot create a context\n");
    return 1;
  }
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::FILE* logits_out = std::fopen(argv[4], "wb");
  std::FILE* greedy_out = std::fopen(argv[5], "w");
  if (logits_out == nullptr || greedy_out == nullptr) return 1;
  std::fputs("[", greedy_out);
  for (size_t p = 0; p < prompts.size(); ++p) {
    const auto& prompt = prompts[p];
    llama_memory_clear(llama_get_memory(ctx), true);
    if (!Decode(ctx, prompt, 0, /*all_logits=*/true)) return 1;
    for (size_t i = 0; i < prompt.size(); ++i) {
      std::fwrite(llama_get_logits_ith(ctx, static_cast<int32_t>(i)), sizeof(float), vocab, logits_out);
    }
    std::fputs(p ? ", [" : "[", greedy_out);
    int pos = static_cast<int>(prompt.size());
    for (int g = 0; g < greedy; ++g) {
      const float* last = llama_get_logits_ith(ctx, -1);
      llama_token best = 0;
      for (int v = 1; v < vocab; ++v) best = last[v] > last[best] ? v : best;
      std::fprintf(greedy_out, g ? ", %d" : "%d", best);
      if (g + 1 < greedy && !Decode(ctx, {best}, pos++, false)) return 1;
    }
    std::fputs("]", greedy_out);
  }
  std::fputs("]\n", greedy_out);
  std::fclose(logits_out);
  std::fclose(greedy_out);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
