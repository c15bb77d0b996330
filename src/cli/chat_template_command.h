// `kvflow chat-template`: prints the prompt a chat template renders for a conversation, as the
// server would tokenize it. A template file alone is enough; --model adds the model's own template
// and its BOS/EOS texts, read without loading the weights.
//
//   kvflow chat-template --model smollm2-135m --messages '[{"role": "user", "content": "Hi"}]'
//   kvflow chat-template --template qwen3.jinja --messages @chat.json --tools @tools.json
//       --kwargs '{"enable_thinking": false}' --no-generation-prompt
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace kvflow {

struct ChatTemplateCommandOptions {
  std::string model;          // empty: --template alone
  std::string template_path;  // chatml, llama3, a .jinja file or a tokenizer_config.json
  std::string messages;       // JSON, or @file
  std::string tools;          // JSON, or @file; empty: none
  std::string kwargs;         // JSON object, or @file
  std::string bos_token;      // with --template alone
  std::string eos_token;
  bool no_generation_prompt = false;
};

CLI::App* AddChatTemplateCommand(CLI::App& app, ChatTemplateCommandOptions* options);
int RunChatTemplateCommand(const ChatTemplateCommandOptions& options);

}  // namespace kvflow
