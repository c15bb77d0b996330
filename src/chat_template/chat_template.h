// A model's chat template: the Jinja text it ships (GGUF tokenizer.chat_template, HF
// tokenizer_config.json / chat_template.jinja, or --chat-template FILE), executed by the
// interpreter in jinja.h with the variables transformers' apply_chat_template passes: messages,
// tools, add_generation_prompt, the special tokens, and the request's chat_template_kwargs.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "kvflow/status.h"
#include "kvflow/tokenizer.h"

namespace kvflow {

namespace jinja {
class Template;
}

struct ChatTemplateInput {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();  // OpenAI message objects
  nlohmann::ordered_json tools;  // null, or an array of OpenAI tool objects
  bool add_generation_prompt = true;
  // Extra template variables (vLLM's chat_template_kwargs, e.g. enable_thinking); they cannot
  // replace messages, tools or add_generation_prompt.
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();

  // One user message, opening the assistant's turn (a prompt wrapped for a chat model).
  static ChatTemplateInput User(const std::string& text) {
    ChatTemplateInput input;
    input.messages = nlohmann::ordered_json::array({{{"role", "user"}, {"content", text}}});
    return input;
  }
};

class ChatTemplate {
 public:
  // `source` is Jinja text, or the name of a built-in template: "chatml" or "llama3".
  // `bos_token` / `eos_token` are the tokenizer's texts of those tokens ("" where it has none).
  static Result<ChatTemplate> Create(const std::string& source, std::string bos_token, std::string eos_token);
  // The same with `tokenizer`'s BOS and EOS texts (empty where it has none).
  static Result<ChatTemplate> Create(const std::string& source, const Tokenizer& tokenizer);
  // Reads `source` as a built-in name, or else as a file holding a Jinja template (a
  // chat_template.jinja, or a tokenizer_config.json whose chat_template is taken).
  static Result<std::string> ReadSource(const std::string& name_or_path);

  // The prompt; a raise_exception() in the template (e.g. "Conversation roles must alternate")
  // or a conversation the template cannot render is an InvalidArgument naming why.
  Result<std::string> Render(const ChatTemplateInput& input) const;

  const std::string& source() const { return source_; }
  const std::string& bos_token() const { return bos_token_; }

  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

 private:
  ChatTemplate();
  std::string source_;
  std::string bos_token_;
  std::string eos_token_;
  std::unique_ptr<jinja::Template> template_;
};

// The Jinja text of a built-in template name ("chatml", "llama3"), or null.
const char* BuiltInChatTemplate(const std::string& name);

// Checks one OpenAI `messages` array and brings it to the form chat templates expect, as vLLM
// does: content given as text parts joined into one string (an assistant's null or absent content:
// ""), "developer" read as "system", tool-call arguments given as a JSON string parsed into an
// object. An error names the message and field.
Status NormalizeChatMessages(nlohmann::ordered_json* messages);

}  // namespace kvflow
