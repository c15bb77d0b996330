#include "chat_template/chat_template.h"

#include <fstream>
#include <sstream>

#include "chat_template/jinja.h"

namespace kvflow {
namespace {

using Json = nlohmann::ordered_json;

// The ChatML template (as Qwen and SmolLM ship it, without a default system turn).
constexpr const char* kChatMl =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

// Meta-Llama-3-8B-Instruct's template.
constexpr const char* kLlama3 =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

std::string Where(size_t i) { return "messages[" + std::to_string(i) + "]"; }

}  // namespace

const char* BuiltInChatTemplate(const std::string& name) {
  if (name == "chatml") return kChatMl;
  if (name == "llama3") return kLlama3;
  return nullptr;
}

ChatTemplate::ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

Result<ChatTemplate> ChatTemplate::Create(const std::string& source, std::string bos_token, std::string eos_token) {
  ChatTemplate t;
  const char* built_in = BuiltInChatTemplate(source);
  t.source_ = built_in ? built_in : source;
  if (t.source_.empty()) return Status::NotFound("the chat template is empty");
  auto parsed = jinja::Template::Parse(t.source_);
  if (!parsed.ok()) return parsed.status();
  t.template_ = std::make_unique<jinja::Template>(std::move(parsed.value()));
  t.bos_token_ = std::move(bos_token);
  t.eos_token_ = std::move(eos_token);
  return t;
}

Result<ChatTemplate> ChatTemplate::Create(const std::string& source, const Tokenizer& tokenizer) {
  auto text = [&](int32_t id) { return id >= 0 ? tokenizer.TokenBytes(id, /*skip_special=*/false) : std::string(); };
  return Create(source, text(tokenizer.bos_id()), text(tokenizer.eos_id()));
}

Result<std::string> ChatTemplate::ReadSource(const std::string& name_or_path) {
  if (BuiltInChatTemplate(name_or_path)) return name_or_path;
  std::ifstream file(name_or_path, std::ios::binary);
  if (!file) {
    return Status::NotFound("'" + name_or_path + "' is neither a built-in chat template (chatml, llama3) nor a readable file");
  }
  std::stringstream ss;
  ss << file.rdbuf();
  std::string text = ss.str();
  if (name_or_path.size() >= 5 && name_or_path.compare(name_or_path.size() - 5, 5, ".json") == 0) {
    Json config = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object()) return Status::InvalidArgument("'" + name_or_path + "' is not valid JSON");
    if (!config.contains("chat_template")) return Status::NotFound("'" + name_or_path + "' has no chat_template");
    const Json& tmpl = config["chat_template"];
    if (tmpl.is_string()) return tmpl.get<std::string>();
    if (tmpl.is_array()) {  // named templates: take "default"
      for (const Json& named : tmpl) {
        if (named.is_object() && named.value("name", "") == "default" && named.contains("template") &&
            named["template"].is_string()) {
          return named["template"].get<std::string>();
        }
      }
    }
    return Status::InvalidArgument("'" + name_or_path + "': chat_template is neither a string nor has a \"default\" entry");
  }
  return text;
}

Result<std::string> ChatTemplate::Render(const ChatTemplateInput& input) const {
  Json context = Json::object();
  if (input.kwargs.is_object()) {
    for (auto it = input.kwargs.begin(); it != input.kwargs.end(); ++it) {
      if (it.key() == "messages" || it.key() == "tools" || it.key() == "add_generation_prompt") {
        return Status::InvalidArgument("chat_template_kwargs cannot set '" + it.key() + "'");
      }
      context[it.key()] = it.value();
    }
  } else if (!input.kwargs.is_null()) {
    return Status::InvalidArgument("chat_template_kwargs must be an object");
  }
  context["messages"] = input.messages;
  context["tools"] = input.tools;
  context["add_generation_prompt"] = input.add_generation_prompt;
  if (!context.contains("bos_token")) context["bos_token"] = bos_token_;
  if (!context.contains("eos_token")) context["eos_token"] = eos_token_;
  return template_->Render(context);
}

Status NormalizeChatMessages(Json* messages) {
  if (!messages->is_array()) return Status::InvalidArgument("'messages' must be an array of message objects");
  if (messages->empty()) return Status::InvalidArgument("'messages' must not be empty");
  for (size_t i = 0; i < messages->size(); ++i) {
    Json& m = (*messages)[i];
    const std::string where = Where(i);
    if (!m.is_object()) return Status::InvalidArgument(where + " must be an object");
    if (!m.contains("role") || !m["role"].is_string()) return Status::InvalidArgument(where + ".role must be a string");
    std::string role = m["role"].get<std::string>();
    if (role == "developer") role = "system";  // OpenAI's newer name for the system role
    if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
      return Status::InvalidArgument(where + ".role must be system, developer, user, assistant or tool, not '" + role + "'");
    }
    m["role"] = role;
    for (auto it = m.begin(); it != m.end(); ++it) {
      const std::string& key = it.key();
      if (key != "role" && key != "content" && key != "name" && key != "tool_calls" && key != "tool_call_id" &&
          key != "reasoning_content" && key != "reasoning") {
        return Status::InvalidArgument("Unrecognized request argument supplied: " + where + "." + key);
      }
    }
    if (m.contains("content") && !m["content"].is_null()) {
      Json& content = m["content"];
      if (content.is_array()) {
        std::string text;
        for (size_t k = 0; k < content.size(); ++k) {
          const Json& part = content[k];
          if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string()) {
            return Status::InvalidArgument(where + ".content[" + std::to_string(k) +
                                           "]: only text parts ({\"type\": \"text\", \"text\": ...}) are supported");
          }
          if (k) text += "\n";
          text += part["text"].get<std::string>();
        }
        content = text;
      } else if (!content.is_string()) {
        return Status::InvalidArgument(where + ".content must be a string or an array of text parts");
      }
    } else if (role != "assistant") {
      return Status::InvalidArgument(where + ".content is required");
    } else {
      m["content"] = "";  // an assistant's null content (tool calls only) reaches templates as "", as in vLLM
    }
    for (const char* key : {"name", "tool_call_id", "reasoning_content", "reasoning"}) {
      if (m.contains(key) && !m[key].is_string() && !m[key].is_null()) {
        return Status::InvalidArgument(where + "." + key + " must be a string");
      }
    }
    if (m.contains("tool_call_id") && role != "tool") {
      return Status::InvalidArgument(where + ".tool_call_id belongs to a tool message");
    }
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      if (role != "assistant") return Status::InvalidArgument(where + ".tool_calls belongs to an assistant message");
      Json& calls = m["tool_calls"];
      if (!calls.is_array()) return Status::InvalidArgument(where + ".tool_calls must be an array");
      for (size_t k = 0; k < calls.size(); ++k) {
        Json& call = calls[k];
        const std::string at = where + ".tool_calls[" + std::to_string(k) + "]";
        if (!call.is_object()) return Status::InvalidArgument(at + " must be an object");
        if (call.contains("type") && call["type"] != "function") {
          return Status::InvalidArgument(at + ".type must be \"function\"");
        }
        if (call.contains("id") && !call["id"].is_string()) return Status::InvalidArgument(at + ".id must be a string");
        if (!call.contains("function") || !call["function"].is_object()) {
          return Status::InvalidArgument(at + ".function must be an object with name and arguments");
        }
        Json& function = call["function"];
        if (!function.contains("name") || !function["name"].is_string()) {
          return Status::InvalidArgument(at + ".function.name must be a string");
        }
        if (function.contains("arguments") && function["arguments"].is_string()) {
          // Templates expect the arguments as an object (vLLM converts them the same way).
          Json args = Json::parse(function["arguments"].get<std::string>(), nullptr, /*allow_exceptions=*/false);
          if (args.is_discarded()) return Status::InvalidArgument(at + ".function.arguments is not valid JSON");
          function["arguments"] = std::move(args);
        } else if (function.contains("arguments") && !function["arguments"].is_object()) {
          return Status::InvalidArgument(at + ".function.arguments must be a JSON string or an object");
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace kvflow
