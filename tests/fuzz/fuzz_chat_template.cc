// libFuzzer target: the chat-template interpreter. An input is a template, optionally followed by a
// NUL byte and a JSON context (messages, tools, kwargs); it is parsed and rendered under small
// limits. Syntax errors, unsupported constructs and render errors must come back as a Status; any
// crash, sanitizer report, hang or runaway memory is a bug. tools/fuzz-server builds and runs it,
// seeded with the 18 real templates of ../shared/datasets/chat_templates where present.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "chat_template/jinja.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find('\0');
  const std::string source(input.substr(0, split));
  nlohmann::ordered_json context = {
      {"messages", {{{"role", "system"}, {"content", "Be brief."}},
                    {{"role", "user"}, {"content", "Hi ✓"}},
                    {{"role", "assistant"}, {"content", ""}, {"tool_calls", {{{"id", "abcdefghi"}, {"type", "function"},
                        {"function", {{"name", "f"}, {"arguments", {{"x", 1.5}, {"y", {1, "two", nullptr}}}}}}}}}},
                    {{"role", "tool"}, {"tool_call_id", "abcdefghi"}, {"content", "42"}}}},
      {"tools", {{{"type", "function"}, {"function", {{"name", "f"}, {"description", "d"},
                  {"parameters", {{"type", "object"}, {"properties", {{"x", {{"type", "number"}}}}}}}}}}}},
      {"add_generation_prompt", true},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"}};
  if (split != std::string_view::npos) {
    auto extra = nlohmann::ordered_json::parse(input.substr(split + 1), nullptr, /*allow_exceptions=*/false);
    if (!extra.is_discarded() && extra.is_object()) {
      for (auto it = extra.begin(); it != extra.end(); ++it) context[it.key()] = it.value();
    }
  }
  auto parsed = kvflow::jinja::Template::Parse(source);
  if (!parsed.ok()) return 0;
  kvflow::jinja::RenderLimits limits;
  limits.max_output_bytes = 1 << 20;
  limits.max_call_depth = 64;
  limits.max_steps = 200'000;
  (void)parsed->Render(context, limits);
  return 0;
}
