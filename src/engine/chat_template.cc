#include "engine/chat_template.h"

namespace kvflow {
namespace {

// SmolLM2's template injects this system turn when the conversation has none.
constexpr const char* kSmolLmDefaultSystem = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

}  // namespace

Result<ChatTemplateFamily> DetectChatTemplate(const std::string& t) {
  if (t == "chatml" || t.find("<|im_start|>") != std::string::npos) return ChatTemplateFamily::kChatMl;
  if (t == "llama3" || t.find("<|start_header_id|>") != std::string::npos) return ChatTemplateFamily::kLlama3;
  if (t.empty()) return Status::NotFound("the model has no chat template; pass one explicitly (chatml, llama3)");
  return Status::Unsupported("unrecognised chat template (known: chatml, llama3): " + t.substr(0, 120));
}

std::string RenderChat(ChatTemplateFamily family, const std::string& template_text,
                       const std::vector<ChatMessage>& messages) {
  std::string out;
  if (family == ChatTemplateFamily::kChatMl) {
    const bool has_system = !messages.empty() && messages.front().role == "system";
    if (!has_system && template_text.find(kSmolLmDefaultSystem) != std::string::npos) {
      out += std::string("<|im_start|>system\n") + kSmolLmDefaultSystem + "<|im_end|>\n";
    }
    for (const ChatMessage& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    out += "<|im_start|>assistant\n";
    return out;
  }
  out += "<|begin_of_text|>";
  for (const ChatMessage& m : messages) {
    out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>";
  }
  out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

}  // namespace kvflow
