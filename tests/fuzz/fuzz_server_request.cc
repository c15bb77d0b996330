// libFuzzer target: every input goes through the HTTP request-head parser and body framing, and
// through the OpenAI request parsers, /tokenize's, /detokenize's and /apply-template's (with their
// validation); errors are serialised as the server would send them, and a parsed conversation is
// rendered by a chat template that reads tools, tool calls and kwargs. Any crash, sanitizer report
// or hang is a bug. tools/fuzz-server builds and runs it.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "server/http_server.h"
#include "server/openai_api.h"

using namespace kvflow::server;

namespace {

// A template that touches what requests carry: tools, tool calls and their arguments, tool
// results, reasoning, kwargs.
constexpr const char* kToolTemplate =
    "{%- if tools %}{{ '<tools>' }}{% for t in tools %}{{ t | tojson }}{% endfor %}{{ '</tools>' }}{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content | trim }}{% endif %}"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson(indent=2) }}"
    "{%- if c.function.arguments is mapping %}{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }}{% endfor %}"
    "{%- endif %}</call>{% endfor %}{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is false %}<think></think>"
    "{%- endif %}{% endif %}";

void Render(const kvflow::ChatTemplateInput& input) {
  static const auto chatml = kvflow::ChatTemplate::Create("chatml", "<s>", "</s>");
  static const auto tools = kvflow::ChatTemplate::Create(kToolTemplate, "<s>", "</s>");
  (void)chatml->Render(input);
  (void)tools->Render(input);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);

  // The head parser expects the bytes up to and including the blank line.
  const size_t head_end = input.find("\r\n\r\n");
  if (head_end != std::string_view::npos) {
    HttpRequest req;
    if (!ParseRequestHead(input.substr(0, head_end + 4), &req)) {
      BodyFraming framing;
      (void)DecideBodyFraming(req, 1 << 20, &framing);
      (void)req.KeepAlive();
    }
  }
  HttpRequest req;
  (void)ParseRequestHead(input, &req);

  // The body of a request, as the handlers see it.
  CompletionRequest completion;
  if (auto error = ParseCompletionRequest(input, &completion)) {
    (void)error->ToJson();
  } else {
    (void)DumpJson(Json{{"prompts", completion.prompts.size()}, {"stop", completion.sampling.stop}});
  }
  ChatRequest chat;
  if (auto error = ParseChatRequest(input, &chat)) {
    (void)error->ToJson();
  } else {
    Render(chat.chat);
  }
  TokenizeRequest tokenize;
  if (auto error = ParseTokenizeRequest(input, &tokenize)) {
    (void)error->ToJson();
  } else if (tokenize.chat) {
    Render(tokenize.chat_input);
  }
  kvflow::ChatTemplateInput apply;
  if (auto error = ParseApplyTemplateRequest(input, &apply)) (void)error->ToJson();
  DetokenizeRequest detokenize;
  if (auto error = ParseDetokenizeRequest(input, &detokenize)) (void)error->ToJson();
  return 0;
}
