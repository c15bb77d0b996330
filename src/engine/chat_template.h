// Renders chat messages into a prompt for the template families kvflow knows. A model's Jinja
// template is recognised by its markers rather than executed.
#pragma once

#include <string>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

struct ChatMessage {
  std::string role;  // system, user, assistant
  std::string content;
};

enum class ChatTemplateFamily { kChatMl, kLlama3 };

// "chatml" / "llama3", or a Jinja template recognised by its markers; anything else: Unsupported.
Result<ChatTemplateFamily> DetectChatTemplate(const std::string& template_text);

// The prompt for `messages`, ending with the opening of the assistant's turn.
std::string RenderChat(ChatTemplateFamily family, const std::string& template_text,
                       const std::vector<ChatMessage>& messages);

}  // namespace kvflow
