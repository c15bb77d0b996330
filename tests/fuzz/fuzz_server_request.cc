// libFuzzer target: every input goes through the HTTP request-head parser and body framing, and
// through the OpenAI request parsers and /tokenize's and /detokenize's (with their validation); errors are serialised as the
// server would send them. Any crash, sanitizer report or hang is a bug. tools/fuzz-server builds
// and runs it.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "server/http_server.h"
#include "server/openai_api.h"

using namespace kvflow::server;

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
    for (auto family : {kvflow::ChatTemplateFamily::kChatMl, kvflow::ChatTemplateFamily::kLlama3}) {
      (void)kvflow::RenderChat(family, "", chat.messages);
    }
  }
  TokenizeRequest tokenize;
  if (auto error = ParseTokenizeRequest(input, &tokenize)) (void)error->ToJson();
  DetokenizeRequest detokenize;
  if (auto error = ParseDetokenizeRequest(input, &detokenize)) (void)error->ToJson();
  return 0;
}
