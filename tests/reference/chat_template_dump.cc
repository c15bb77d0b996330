// Renders many conversations in one process, for chat_template_reference.py (one `kvflow
// chat-template` per case would spend most of the test starting processes). Reads JSON lines from
// stdin, one case each:
//   {"template": PATH, "messages": [...], "tools": [...] | null, "kwargs": {...},
//    "add_generation_prompt": bool, "bos_token": "...", "eos_token": "..."}
// and writes one JSON line per case: {"ok": true, "text": "..."} or {"ok": false, "error": "..."}.
// The steps are `kvflow chat-template`'s: ReadSource, Create, NormalizeChatMessages, Render (the test
// also runs the CLI on some cases and checks that both agree).
#include <cstdio>
#include <iostream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "chat_template/chat_template.h"

namespace {

using Json = nlohmann::ordered_json;

kvflow::Result<std::string> RenderCase(const Json& c, std::map<std::string, std::string>* sources) {
  using kvflow::Status;
  if (!c.is_object() || !c.contains("template")) return Status::InvalidArgument("a case needs \"template\"");
  const std::string path = c["template"].get<std::string>();
  auto found = sources->find(path);
  if (found == sources->end()) {
    auto read = kvflow::ChatTemplate::ReadSource(path);
    if (!read.ok()) return read.status();
    found = sources->emplace(path, read.value()).first;
  }
  auto chat_template = kvflow::ChatTemplate::Create(found->second, c.value("bos_token", std::string()),
                                                    c.value("eos_token", std::string()));
  if (!chat_template.ok()) return chat_template.status();
  kvflow::ChatTemplateInput input;
  input.messages = c.value("messages", Json::array());
  if (Status s = kvflow::NormalizeChatMessages(&input.messages); !s.ok()) return s;
  if (c.contains("tools") && !c["tools"].is_null()) input.tools = c["tools"];
  if (c.contains("kwargs")) input.kwargs = c["kwargs"];
  input.add_generation_prompt = c.value("add_generation_prompt", true);
  return chat_template->Render(input);
}

}  // namespace

int main() {
  spdlog::set_level(spdlog::level::warn);
  std::map<std::string, std::string> sources;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    Json out;
    const Json c = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    auto rendered = c.is_discarded() ? kvflow::Result<std::string>(kvflow::Status::InvalidArgument("not JSON"))
                                     : RenderCase(c, &sources);
    if (rendered.ok()) {
      out = {{"ok", true}, {"text", rendered.value()}};
    } else {
      out = {{"ok", false}, {"error", rendered.status().ToString()}};
    }
    std::cout << out.dump(-1, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace) << "\n";
  }
  return 0;
}
