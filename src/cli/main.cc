// `kvflow` command line: generate text, inspect a model.
#include <chrono>
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "cli/engine_flags.h"
#include "engine/chat_template.h"
#include "kvflow/engine.h"
#include "model/tensor_source.h"
#include "model/tiny_random.h"

namespace {

using Clock = std::chrono::steady_clock;

struct GenerateOptions {
  kvflow::EngineConfig engine;
  kvflow::SamplingParams sampling;
  std::string prompt;
  bool chat = false;
  std::string chat_template;
  bool show_logprobs = false;
};

int RunGenerate(GenerateOptions& opt) {
  auto engine_or = kvflow::Engine::Create(opt.engine);
  if (!engine_or.ok()) {
    spdlog::error("{}", engine_or.status().ToString());
    return 1;
  }
  auto& engine = *engine_or.value();
  std::string prompt = opt.prompt;
  if (opt.chat) {
    const std::string& tmpl = opt.chat_template.empty() ? engine.tokenizer().chat_template() : opt.chat_template;
    auto family = kvflow::DetectChatTemplate(tmpl);
    if (!family.ok()) {
      spdlog::error("--chat: {}", family.status().ToString());
      return 1;
    }
    prompt = kvflow::RenderChat(family.value(), tmpl, {{"user", opt.prompt}});
  }

  const auto start = Clock::now();
  Clock::time_point first_token;
  int64_t generated = 0;
  auto on_event = [&](const kvflow::StreamEvent& e) {
    if (!e.tokens.empty() && generated == 0) first_token = Clock::now();
    generated += static_cast<int64_t>(e.tokens.size());
    std::fwrite(e.text_delta.data(), 1, e.text_delta.size(), stdout);  // the text may hold NUL bytes
    std::fflush(stdout);
    if (opt.show_logprobs) {
      for (const auto& t : e.tokens) {
        std::fprintf(stderr, "\n[token %d logprob %.4f; top:", t.token, t.logprob);
        for (const auto& alt : t.top_logprobs) std::fprintf(stderr, " %d:%.3f", alt.token, alt.logprob);
        std::fputs("]", stderr);
      }
    }
  };
  auto out = engine.Generate(prompt, opt.sampling, on_event);
  if (!out.ok()) {
    spdlog::error("{}", out.status().ToString());
    return 1;
  }
  const auto end = Clock::now();
  std::fputs("\n", stdout);
  const double prefill_s = std::chrono::duration<double>((generated ? first_token : end) - start).count();
  const double decode_s = std::chrono::duration<double>(end - (generated ? first_token : end)).count();
  const size_t prompt_tokens = out->prompt_tokens.size();
  std::fprintf(stderr, "\n--- finish: %s | prompt: %zu tokens, %.1f tok/s | decode: %lld tokens, %.1f tok/s\n",
               kvflow::FinishReasonName(out->first().finish_reason), prompt_tokens,
               prefill_s > 0 ? prompt_tokens / prefill_s : 0.0, static_cast<long long>(generated),
               decode_s > 0 && generated > 1 ? (generated - 1) / decode_s : 0.0);
  return 0;
}

int RunInfo(const std::string& model) {
  auto path = kvflow::ResolveModel(model);
  if (!path.ok()) {
    spdlog::error("{}", path.status().ToString());
    return 1;
  }
  auto files = path.value() == kvflow::kTinyRandomName ? kvflow::MakeTinyRandomModel()
                                                       : kvflow::OpenModelFiles(path.value());
  if (!files.ok()) {
    spdlog::error("{}", files.status().ToString());
    return 1;
  }
  std::printf("path: %s\nweights: %s\n%s", path.value().c_str(), files->tensors->Describe().c_str(),
              files->config.Describe().c_str());
  if (files->tokenizer) {
    const kvflow::Tokenizer& tok = *files->tokenizer;
    std::printf("tokenizer: byte-level BPE, %d tokens, bos %d, eos %d, add_bos %s\n", tok.vocab_size(), tok.bos_id(),
                tok.eos_id(), tok.add_bos() ? "yes" : "no");
    auto family = kvflow::DetectChatTemplate(tok.chat_template());
    std::printf("chat template: %s\n",
                family.ok() ? (family.value() == kvflow::ChatTemplateFamily::kChatMl ? "chatml" : "llama3")
                            : family.status().message().c_str());
  } else {
    std::printf("tokenizer: none found\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvflow: LLM inference with a paged KV cache.\n\n"
      "  kvflow generate --model smollm2-135m --prompt \"Tell me about cats\" --chat\n"
      "  kvflow info --model smollm2-135m\n\n"
      "Models: a .gguf file, a .safetensors file or HF directory, or a short name: tiny-random\n"
      "(built in, random weights) or smollm2-135m (run tools/fetch-model first)."};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Debug logging");

  GenerateOptions gen;
  gen.sampling.max_tokens = 128;
  CLI::App* generate = app.add_subcommand("generate", "Generate text from a prompt, streaming it to stdout");
  generate->add_option("-p,--prompt", gen.prompt, "Prompt text")->required();
  generate->add_flag("--chat", gen.chat, "Wrap the prompt as a user message in the model's chat template");
  generate->add_option("--chat-template", gen.chat_template, "Override the chat template: chatml or llama3");
  generate->add_option("-n,--max-tokens", gen.sampling.max_tokens, "Tokens to generate at most")->default_val(128);
  generate->add_option("--min-tokens", gen.sampling.min_tokens, "Tokens to generate before EOS/stop may end it");
  generate->add_option("-t,--temperature", gen.sampling.temperature, "0 = greedy")->default_val(0.7);
  generate->add_option("--top-k", gen.sampling.top_k, "Keep the k most likely tokens (0 = off)")->default_val(0);
  generate->add_option("--top-p", gen.sampling.top_p, "Nucleus sampling mass (1 = off)")->default_val(0.95);
  generate->add_option("--min-p", gen.sampling.min_p, "Drop tokens below min_p * max prob (0 = off)");
  generate->add_option("--repetition-penalty", gen.sampling.repetition_penalty, "CTRL-style penalty (1 = off)");
  generate->add_option("--frequency-penalty", gen.sampling.frequency_penalty, "OpenAI frequency penalty");
  generate->add_option("--presence-penalty", gen.sampling.presence_penalty, "OpenAI presence penalty");
  generate->add_option("--seed", gen.sampling.seed, "Seed: same seed, same output");
  generate->add_option("--stop", gen.sampling.stop, "Stop string (repeatable)");
  generate->add_option("--stop-token-id", gen.sampling.stop_token_ids, "Stop token id (repeatable)");
  generate->add_flag("--ignore-eos", gen.sampling.ignore_eos, "Keep generating past EOS");
  generate->add_option("--logprobs", gen.sampling.logprobs, "Print this many top logprobs per token to stderr");
  double swap_space_gib = 4.0;
  kvflow::AddEngineFlags(generate, &gen.engine, &swap_space_gib);

  std::string info_model = "smollm2-135m";
  CLI::App* info = app.add_subcommand("info", "Print a model's configuration and tokenizer");
  info->add_option("-m,--model", info_model, "Model path or short name")->default_val("smollm2-135m");

  CLI11_PARSE(app, argc, argv);
  spdlog::set_default_logger(spdlog::stderr_color_mt("kvflow"));
  spdlog::set_level(verbose ? spdlog::level::debug : spdlog::level::info);

  if (*generate) {
    kvflow::ApplySwapSpace(&gen.engine, swap_space_gib);
    gen.show_logprobs = gen.sampling.logprobs > 0;
    return RunGenerate(gen);
  }
  return RunInfo(info_model);
}
