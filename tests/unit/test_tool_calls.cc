// Tool calls' text side (src/tool_calls): each real template's own rendering of a tool call parses
// back to the same call; streaming gives what whole parsing gives for every split of the text;
// malformed and truncated output stays content; the constraints have xgrammar's shape.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <random>
#include <sstream>

#include "chat_template/chat_template.h"
#include "tool_calls/json_prefix.h"
#include "tool_calls/tool_call_constraint.h"
#include "tool_calls/tool_call_format.h"
#include "tool_calls/tool_call_parser.h"

namespace kvflow {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

#ifndef KVFLOW_SOURCE_DIR
#define KVFLOW_SOURCE_DIR "."
#endif
const std::string kTemplateDir = KVFLOW_SOURCE_DIR "/../shared/datasets/chat_templates";

std::string ReadTemplate(const std::string& file) {
  std::ifstream in(kTemplateDir + "/" + file);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const ordered_json kTools = ordered_json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
      "location": {"type": "string", "description": "City and country"},
      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
      "required": ["location"]}}},
  {"type": "function", "function": {"name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {
      "query": {"type": "string", "description": "What to look for"},
      "filters": {"type": "object", "description": "Restrictions",
                  "properties": {"year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}},
      "required": ["query"]}}}
])");
const ordered_json kCalls = ordered_json::parse(R"([
  {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}},
  {"name": "search", "arguments": {"query": "kvflow \"tool\" calls", "filters": {"year": 2024, "tags": ["a", "b"]}}}
])");

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \n\r\t"), e = s.find_last_not_of(" \n\r\t");
  return b == std::string::npos ? "" : s.substr(b, e + 1 - b);
}

// Deltas folded back into a message, checking the rules of the stream as it goes.
struct Collected {
  ParsedAssistant message;
  void Add(const std::vector<AssistantDelta>& deltas) {
    for (const auto& d : deltas) {
      switch (d.kind) {
        case AssistantDelta::Kind::kContent: message.content += d.text; break;
        case AssistantDelta::Kind::kReasoning: message.reasoning_content += d.text; break;
        case AssistantDelta::Kind::kToolCall:
          ASSERT_EQ(d.index, static_cast<int>(message.tool_calls.size()));
          message.tool_calls.push_back({d.text, "", d.id});
          break;
        case AssistantDelta::Kind::kArguments:
          ASSERT_GE(d.index, 0);
          ASSERT_LT(d.index, static_cast<int>(message.tool_calls.size()));
          message.tool_calls[d.index].arguments += d.text;
          break;
      }
    }
  }
};

void ExpectSame(const ParsedAssistant& a, const ParsedAssistant& b, const std::string& what) {
  EXPECT_EQ(a.content, b.content) << what;
  EXPECT_EQ(a.reasoning_content, b.reasoning_content) << what;
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size()) << what;
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name) << what;
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments) << what;
    EXPECT_EQ(a.tool_calls[i].id, b.tool_calls[i].id) << what;
  }
}

ParsedAssistant Stream(ToolCallFormat f, const ToolParseOptions& o, const std::vector<std::string_view>& pieces) {
  StreamingToolCallParser parser(f, o);
  Collected c;
  for (auto p : pieces) c.Add(parser.Push(p));
  c.Add(parser.Finish());
  return c.message;
}

// Streaming equals whole parsing: split at every point, byte by byte, and in random chunks.
void ExpectStreamingMatches(ToolCallFormat f, const std::string& text, const ToolParseOptions& o = {}) {
  const ParsedAssistant whole = ParseAssistantOutput(f, text, o);
  const std::string name = std::string(ToolCallFormatName(f)) + " on " + ordered_json(text).dump();
  for (size_t i = 0; i <= text.size(); ++i) {
    std::string_view t(text);
    ExpectSame(whole, Stream(f, o, {t.substr(0, i), t.substr(i)}), name + " split at " + std::to_string(i));
    if (::testing::Test::HasFailure()) return;
  }
  std::vector<std::string_view> bytes;
  for (size_t i = 0; i < text.size(); ++i) bytes.push_back(std::string_view(text).substr(i, 1));
  ExpectSame(whole, Stream(f, o, bytes), name + " byte by byte");
  std::mt19937 rng(7);
  for (int round = 0; round < 5; ++round) {
    std::vector<std::string_view> chunks;
    for (size_t i = 0; i < text.size();) {
      size_t n = 1 + rng() % 6;
      chunks.push_back(std::string_view(text).substr(i, n));
      i += n;
    }
    ExpectSame(whole, Stream(f, o, chunks), name + " in random chunks");
  }
}

void ExpectCalls(const ParsedAssistant& got, const ordered_json& calls, const std::string& what) {
  ASSERT_EQ(got.tool_calls.size(), calls.size()) << what << "\ncontent: " << got.content;
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(got.tool_calls[i].name, calls[i]["name"].get<std::string>()) << what;
    EXPECT_EQ(json::parse(got.tool_calls[i].arguments), json::parse(calls[i]["arguments"].dump())) << what;
  }
}

// ---- Round trip through the real templates ------------------------------------------------------

struct TemplateCase {
  const char* file;
  ToolCallFormat format;
  bool parallel;            // the template renders several calls in one message
  bool arguments_as_string; // the template concatenates arguments as text
  bool null_content;        // the template renders calls only for content null
  const char* kwargs;
};

const TemplateCase kTemplateCases[] = {
    {"Qwen-Qwen3-0.6B.jinja", ToolCallFormat::kHermes, true, false, false, "{}"},
    {"Qwen-Qwen2.5-7B-Instruct.jinja", ToolCallFormat::kHermes, true, false, false, "{}"},
    {"Qwen-QwQ-32B.jinja", ToolCallFormat::kHermes, true, false, false, "{}"},
    {"NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", ToolCallFormat::kHermes, true, false, false, "{}"},
    {"Qwen3-Coder.jinja", ToolCallFormat::kQwen3Coder, true, false, false, "{}"},
    {"meta-llama-Llama-3.1-8B-Instruct.jinja", ToolCallFormat::kLlama3Json, false, false, false, "{}"},
    {"meta-llama-Llama-3.2-3B-Instruct.jinja", ToolCallFormat::kLlama3Json, false, false, false, "{}"},
    {"mistralai-Mistral-Nemo-Instruct-2407.jinja", ToolCallFormat::kMistral, true, false, false, "{}"},
    {"unsloth-mistral-Devstral-Small-2507.jinja", ToolCallFormat::kMistralArgs, true, false, false, "{}"},
    {"meetkai-functionary-medium-v3.2.jinja", ToolCallFormat::kFunctionaryV32, true, true, false, "{}"},
    {"fireworks-ai-llama-3-firefunction-v2.jinja", ToolCallFormat::kFirefunctionV2, true, false, false,
     R"({"functions": "[]", "datetime": "2024-07-26"})"},
    {"CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", ToolCallFormat::kCommandR7b, true, false, false,
     R"({"enable_thinking": true})"},
    {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", ToolCallFormat::kDeepSeekR1, true, false, true, "{}"},
    {"deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", ToolCallFormat::kDeepSeekR1, true, true, true, "{}"},
    {"HuggingFaceTB-SmolLM3-3B.jinja", ToolCallFormat::kGeneric, true, false, false, "{}"},
    {"google-gemma-2-2b-it.jinja", ToolCallFormat::kGeneric, true, false, false, "{}"},
    {"microsoft-Phi-3.5-mini-instruct.jinja", ToolCallFormat::kGeneric, true, false, false, "{}"},
};

// What the model would have generated for the last assistant message: the conversation rendered
// with it, less the prompt rendered without it, up to the end of the turn.
std::string GeneratedText(const ChatTemplate& tmpl, const ordered_json& before, const ordered_json& message,
                          const ordered_json& tools, const ordered_json& kwargs) {
  ordered_json with = before;
  with.push_back(message);
  auto prompt = tmpl.Render({before, tools, true, kwargs});
  auto full = tmpl.Render({with, tools, false, kwargs});
  EXPECT_TRUE(prompt.ok()) << prompt.status().ToString();
  EXPECT_TRUE(full.ok()) << full.status().ToString();
  if (!prompt.ok() || !full.ok()) return "";
  size_t n = 0;
  while (n < prompt->size() && n < full->size() && (*prompt)[n] == (*full)[n]) ++n;
  // Where the prompt goes on differently (QwQ's "<think>\n"), the generated text starts at that tag.
  if (n < prompt->size() && n > 0) n = std::min(n, full->rfind('<', n - 1));
  std::string generated = full->substr(n);
  for (const char* end : {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>",
                          "</s>", "<end_of_turn>", "<|end|>"})
    if (size_t at = generated.find(end); at != std::string::npos) generated.resize(at);
  return generated;
}

TEST(ToolCallsTemplates, DetectsEachTemplatesFormat) {
  if (!std::filesystem::exists(kTemplateDir)) GTEST_SKIP() << "no " << kTemplateDir;
  for (const auto& c : kTemplateCases)
    EXPECT_EQ(ToolCallFormatName(DetectToolCallFormat(ReadTemplate(c.file))), std::string(ToolCallFormatName(c.format)))
        << c.file;
  EXPECT_EQ(DetectToolCallFormat(ReadTemplate("ibm-granite-granite-3.3-2B-Instruct.jinja")), ToolCallFormat::kGranite);
  EXPECT_EQ(DetectReasoningFormat(ReadTemplate("Qwen-Qwen3-0.6B.jinja")), ReasoningFormat::kQwen3);
  EXPECT_EQ(DetectReasoningFormat(ReadTemplate("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")),
            ReasoningFormat::kDeepSeekR1);
  EXPECT_EQ(DetectReasoningFormat(ReadTemplate("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja")),
            ReasoningFormat::kCommandR7b);
  EXPECT_EQ(DetectReasoningFormat(ReadTemplate("meta-llama-Llama-3.1-8B-Instruct.jinja")), ReasoningFormat::kNone);
  EXPECT_FALSE(TemplateReadsTools(ReadTemplate("google-gemma-2-2b-it.jinja")));
  EXPECT_TRUE(TemplateReadsTools(ReadTemplate("Qwen-Qwen3-0.6B.jinja")));
}

TEST(ToolCallsTemplates, RenderedCallsParseBack) {
  if (!std::filesystem::exists(kTemplateDir)) GTEST_SKIP() << "no " << kTemplateDir;
  for (const auto& c : kTemplateCases) {
    const std::string source = ReadTemplate(c.file);
    auto tmpl = ChatTemplate::Create(source, "<s>", "</s>");
    ASSERT_TRUE(tmpl.ok()) << c.file << ": " << tmpl.status().ToString();
    for (size_t n : {size_t{1}, size_t{2}}) {
      if (n == 2 && !c.parallel) continue;
      const std::string what = std::string(c.file) + " with " + std::to_string(n) + " call(s)";
      ordered_json calls = ordered_json::array();
      ordered_json tool_calls = ordered_json::array();
      for (size_t i = 0; i < n; ++i) {
        calls.push_back(kCalls[i]);
        ordered_json args = kCalls[i]["arguments"];
        tool_calls.push_back({{"id", "call" + std::to_string(10000 + i)},  // 9 characters, as Mistral wants
                              {"type", "function"},
                              {"function", {{"name", kCalls[i]["name"]}, {"arguments", c.arguments_as_string ? ordered_json(args.dump()) : args}}}});
      }
      ordered_json before = ordered_json::array({{{"role", "user"}, {"content", "What's the weather in Paris?"}}});
      ordered_json message = {{"role", "assistant"}, {"content", c.null_content ? ordered_json() : ordered_json("")},
                              {"tool_calls", tool_calls}};
      ordered_json tools = kTools;
      if (c.format == ToolCallFormat::kGeneric) {
        // The template knows no tools: the request goes through kvflow's system prompt and the calls
        // through the content, as the model is told to write them.
        ordered_json all = before;
        all.push_back(message);
        all = PrepareGenericToolMessages(all, kTools, true, TemplateAcceptsSystemRole(source));
        message = all.back();
        all.erase(all.size() - 1);
        before = all;
        tools = nullptr;
        EXPECT_NE(before.dump().find("Respond in JSON format"), std::string::npos) << what;
      }
      const std::string generated = GeneratedText(*tmpl, before, message, tools, ordered_json::parse(c.kwargs));
      ToolParseOptions options;
      options.reasoning = DetectReasoningFormat(source);
      options.tools = kTools;
      const ParsedAssistant parsed = ParseAssistantOutput(c.format, generated, options);
      ExpectCalls(parsed, calls, what + "\ngenerated: " + ordered_json(generated).dump());
      EXPECT_EQ(Trim(parsed.content), "") << what;
      if (c.format == ToolCallFormat::kMistral) {
        for (size_t i = 0; i < n; ++i) EXPECT_EQ(parsed.tool_calls[i].id, tool_calls[i]["id"]) << what;
      }
      if (generated.size() < 1200) ExpectStreamingMatches(c.format, generated, options);
    }
  }
}

// ---- Each format by hand ------------------------------------------------------------------------

struct Sample {
  ToolCallFormat format;
  std::string text;
  std::string content;  // expected content
  std::vector<std::pair<std::string, std::string>> calls;  // name, arguments (compact)
};

std::vector<Sample> Samples() {
  using F = ToolCallFormat;
  return {
      {F::kHermes, "Let me check.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>",
       "Let me check.", {{"f", R"({"a":1})"}, {"g", "{}"}}},
      {F::kHermes, "a < b <tool_ and <tool_call>{bad json}</tool_call> end", "a < b <tool_ and <tool_call>{bad json}</tool_call> end", {}},
      {F::kHermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 2}\"}", "", {{"f", R"({"a":2})"}}},
      {F::kQwen3Coder, "Sure.\n<tool_call>\n<function=f>\n<parameter=x>\nhello\nworld\n</parameter>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>",
       "Sure.", {{"f", R"({"x":"hello\nworld","n":5})"}}},
      {F::kLlama3Json, "{\"name\": \"f\", \"parameters\": {\"a\": [1, 2]}}", "", {{"f", R"({"a":[1,2]})"}}},
      {F::kLlama3Json, "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"parameters\": {\"b\": null}}", "",
       {{"f", "{}"}, {"g", R"({"b":null})"}}},
      {F::kLlama3Json, "The answer is {\"name\": \"f\"}", "The answer is {\"name\": \"f\"}", {}},
      {F::kLlama3Json, "{\"not\": \"a call\"} then text", "{\"not\": \"a call\"} then text", {}},
      {F::kMistral, "Calling.[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": \"]\"}, \"id\": \"abcdefghi\"}]", "Calling.",
       {{"f", R"({"a":"]"})"}}},
      {F::kMistralArgs, "ok[TOOL_CALLS]f[ARGS]{\"a\": 1}[TOOL_CALLS]g[CALL_ID]x12[ARGS]{}", "ok", {{"f", R"({"a":1})"}, {"g", "{}"}}},
      {F::kGranite, "<|tool_call|>[{\"name\": \"f\", \"arguments\": {\"q\": \"x\"}}]", "", {{"f", R"({"q":"x"})"}}},
      {F::kFunctionaryV32, "all\nI will look.>>>f\n{\"a\": 1}>>>g\n{}", "I will look.", {{"f", R"({"a":1})"}, {"g", "{}"}}},
      {F::kFunctionaryV32, "f\n{\"a\": 1}", "", {{"f", R"({"a":1})"}}},
      {F::kFunctionaryV32, "Hello there", "Hello there", {}},
      {F::kFirefunctionV2, "Sure functools[{\"name\": \"f\", \"arguments\": {\"a\": 1}}]", "Sure", {{"f", R"({"a":1})"}}},
      {F::kCommandR7b, "<|START_RESPONSE|>Hi there<|END_RESPONSE|>", "Hi there", {}},
      {F::kCommandR7b, "<|START_ACTION|>[\n {\"tool_call_id\": \"0\", \"tool_name\": \"f\", \"parameters\": {\"a\": 1}}\n]<|END_ACTION|>", "",
       {{"f", R"({"a":1})"}}},
      {F::kDeepSeekR1, "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       "x", {{"f", R"({"a":1})"}, {"g", "{}"}}},
      {F::kGeneric, "{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"a\": 1}, \"id\": \"c1\"}]}", "", {{"f", R"({"a":1})"}}},
      {F::kGeneric, "{\"tool_calls\": [{\"id\": \"c1\", \"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"id\": \"c2\", \"name\": \"g\", \"arguments\": {}}]}", "",
       {{"f", R"({"a":1})"}, {"g", "{}"}}},
      {F::kGeneric, "{\"response\": \"Hello, world\"}", "Hello, world", {}},
      {F::kGeneric, "plain text, no JSON", "plain text, no JSON", {}},
  };
}

TEST(ToolCallsParse, EachFormatWholeAndStreamed) {
  for (const auto& s : Samples()) {
    const std::string what = std::string(ToolCallFormatName(s.format)) + ": " + s.text;
    ParsedAssistant p = ParseAssistantOutput(s.format, s.text);
    EXPECT_EQ(p.content, s.content) << what;
    ASSERT_EQ(p.tool_calls.size(), s.calls.size()) << what;
    for (size_t i = 0; i < s.calls.size(); ++i) {
      EXPECT_EQ(p.tool_calls[i].name, s.calls[i].first) << what;
      EXPECT_EQ(p.tool_calls[i].arguments, s.calls[i].second) << what;
    }
    ExpectStreamingMatches(s.format, s.text);
  }
}

TEST(ToolCallsParse, IdsWhereTheFormatCarriesThem) {
  auto p = ParseAssistantOutput(ToolCallFormat::kCommandR7b,
                                R"(<|START_ACTION|>[{"tool_call_id": "3", "tool_name": "f", "parameters": {}}]<|END_ACTION|>)");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].id, "3");
  p = ParseAssistantOutput(ToolCallFormat::kMistralArgs, "[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{}");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].id, "a1b2c3d4e");
}

TEST(ToolCallsParse, TruncatedAndMalformedStreamAsTheyParse) {
  // Every prefix of every sample (a model stopped by max_tokens), and each with a byte changed: no
  // crash, and streaming still equals whole parsing.
  for (const auto& s : Samples()) {
    for (size_t n = 0; n < s.text.size(); n += 3) {
      const std::string prefix = s.text.substr(0, n);
      ParsedAssistant whole = ParseAssistantOutput(s.format, prefix);
      std::vector<std::string_view> bytes;
      for (size_t i = 0; i < prefix.size(); ++i) bytes.push_back(std::string_view(prefix).substr(i, 1));
      ExpectSame(whole, Stream(s.format, {}, bytes), std::string(ToolCallFormatName(s.format)) + " prefix " + prefix);
      std::string broken = s.text;
      broken[n] = "{}[]\"<>|\n"[n % 9];
      ExpectSame(ParseAssistantOutput(s.format, broken), Stream(s.format, {}, {broken.substr(0, n), broken.substr(n)}),
                 std::string(ToolCallFormatName(s.format)) + " broken " + broken);
    }
  }
  // A call cut off before its arguments opened is content, markers and all.
  auto p = ParseAssistantOutput(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\", \"argu");
  EXPECT_TRUE(p.tool_calls.empty());
  EXPECT_EQ(p.content, "<tool_call>{\"name\": \"f\", \"argu");
  p = ParseAssistantOutput(ToolCallFormat::kMistral, "[TOOL_CALLS][{\"name\": 5}]");
  EXPECT_TRUE(p.tool_calls.empty());
  EXPECT_EQ(p.content, "[TOOL_CALLS][{\"name\": 5}]");
}

TEST(ToolCallsParse, ContentIsHeldOnlyWhileAMarkerMayBegin) {
  StreamingToolCallParser parser(ToolCallFormat::kHermes);
  auto d = parser.Push("Hello <tool");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].text, "Hello");
  d = parser.Push("box> more");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].text, " <toolbox> more");
  d = parser.Push(" <tool_call>{\"name\": \"f\", \"arguments\"");
  EXPECT_TRUE(d.empty());  // a call, but its arguments have not opened
  d = parser.Push(": {}}");
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].kind, AssistantDelta::Kind::kToolCall);
  EXPECT_EQ(d[0].text, "f");
  EXPECT_EQ(d[1].kind, AssistantDelta::Kind::kArguments);
  EXPECT_EQ(d[1].text, "{}");
  EXPECT_TRUE(parser.Push("</tool_call>").empty());
}

// Each format's call, fed byte by byte: the call is announced as soon as its arguments open, and
// its arguments arrive as they are written, not when the block closes.
TEST(ToolCallsParse, ArgumentsStreamAsTheyAreWritten) {
  using F = ToolCallFormat;
  struct Case {
    F format;
    std::string text;
    std::string begins_at;      // the call is announced once the text reaches this
    std::string args_at_paris;  // its arguments once the text reaches "Par"
  };
  const std::vector<Case> cases = {
      {F::kHermes, "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
       "\"arguments\": {", R"({"city":"Par)"},
      {F::kQwen3Coder, "<tool_call>\n<function=w>\n<parameter=n>\n1\n</parameter>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
       "<function=w>", R"({"n":1)"},
      {F::kLlama3Json, "{\"name\": \"w\", \"parameters\": {\"city\": \"Paris\"}}", "\"parameters\": {", R"({"city":"Par)"},
      {F::kMistralArgs, "[TOOL_CALLS]w[ARGS]{\"city\": \"Paris\"}", "[ARGS]{", R"({"city":"Par)"},
      {F::kGranite, "<|tool_call|>[{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}]", "\"arguments\": {", R"({"city":"Par)"},
      {F::kFunctionaryV32, ">>>w\n{\"city\": \"Paris\"}", "w\n{", R"({"city":"Par)"},
      {F::kFirefunctionV2, "functools[{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}]", "\"arguments\": {", R"({"city":"Par)"},
      {F::kCommandR7b, "<|START_ACTION|>[{\"tool_call_id\": \"0\", \"tool_name\": \"w\", \"parameters\": {\"city\": \"Paris\"}}]<|END_ACTION|>",
       "\"parameters\": {", R"({"city":"Par)"},
      {F::kDeepSeekR1, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>w\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
       "```json\n{", R"({"city":"Par)"},
      {F::kGeneric, "{\"tool_calls\": [{\"id\": \"c1\", \"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}]}", "\"arguments\": {",
       R"({"city":"Par)"},
  };
  for (const auto& c : cases) {
    const std::string what = std::string(ToolCallFormatName(c.format)) + ": " + c.text;
    StreamingToolCallParser parser(c.format);
    Collected got;
    const size_t begins = c.text.find(c.begins_at) + c.begins_at.size();
    const size_t paris = c.text.find("Par") + 3;
    for (size_t i = 0; i < c.text.size(); ++i) {
      got.Add(parser.Push(std::string_view(c.text).substr(i, 1)));
      EXPECT_EQ(got.message.tool_calls.size(), i + 1 >= begins ? 1u : 0u) << what << " after " << c.text.substr(0, i + 1);
      if (i + 1 == paris) {
        ASSERT_EQ(got.message.tool_calls.size(), 1u) << what;
        EXPECT_EQ(got.message.tool_calls[0].arguments, c.args_at_paris) << what;
      }
    }
    got.Add(parser.Finish());
    ASSERT_EQ(got.message.tool_calls.size(), 1u) << what;
    EXPECT_EQ(got.message.tool_calls[0].name, "w") << what;
    const json expected_args = c.format == F::kQwen3Coder ? json{{"n", 1}, {"city", "Paris"}} : json{{"city", "Paris"}};
    EXPECT_EQ(json::parse(got.message.tool_calls[0].arguments), expected_args) << what;
    EXPECT_EQ(got.message.tool_calls[0].id, c.format == F::kCommandR7b ? "0" : c.format == F::kGeneric ? "c1" : "")
        << what;
    ExpectStreamingMatches(c.format, c.text);
  }
}

// Ids the next turn's template checks are kept: where a format writes them after the arguments
// (Mistral), the call waits for its object to close; generic's only count ahead of them.
TEST(ToolCallsParse, IdsAfterTheArguments) {
  const std::string mistral = "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}, \"id\": \"abcdefghi\"}]";
  StreamingToolCallParser parser(ToolCallFormat::kMistral);
  Collected got;
  got.Add(parser.Push(mistral.substr(0, mistral.size() - 3)));
  EXPECT_TRUE(got.message.tool_calls.empty());
  got.Add(parser.Push(mistral.substr(mistral.size() - 3)));
  ASSERT_EQ(got.message.tool_calls.size(), 1u);
  EXPECT_EQ(got.message.tool_calls[0].id, "abcdefghi");
  EXPECT_EQ(got.message.tool_calls[0].arguments, R"({"a":1})");
  auto p = ParseAssistantOutput(ToolCallFormat::kGeneric,
                                R"({"tool_calls": [{"name": "f", "arguments": {"a": 1}, "id": "late1"}]})");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].id, "");  // the server gives it one
}

// A call that began is reported whatever follows: cut off, with the arguments written so far; broken,
// up to the break, the rest being content.
TEST(ToolCallsParse, BegunCallsSurviveTruncationAndBreakage) {
  auto p = ParseAssistantOutput(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\", \"arguments\": {\"q\": \"par");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments, R"({"q":"par)");
  EXPECT_EQ(p.content, "");
  p = ParseAssistantOutput(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\", \"arguments\": {\"q\": 1,}} oops</tool_call>");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments, R"({"q":1,)");
  EXPECT_EQ(p.content, "}} oops</tool_call>");
  p = ParseAssistantOutput(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"f\", \"arguments\": {}} and more");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments, "{}");
  EXPECT_EQ(p.content, "and more");
  // A second call that fails before it begins ends the list there.
  p = ParseAssistantOutput(ToolCallFormat::kMistral,
                           "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}, {\"name\": 5}]");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.content, "{\"name\": 5}]");
  for (const std::string text :
       {"<tool_call>{\"name\": \"f\", \"arguments\": {\"q\": 1,}} oops</tool_call>",
        "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}, {\"name\": 5}]"}) {
    ExpectStreamingMatches(text[0] == '<' ? ToolCallFormat::kHermes : ToolCallFormat::kMistral, text);
  }
}

// The JSON prefix scanner that streamed arguments rest on, against nlohmann's parser: on documents
// of random values with random whitespace, and on each with one byte changed, every prefix is valid
// exactly as far as the whole text is (validity only grows as text is appended, which keeps streamed
// arguments a prefix of the final ones), a complete value parses, and a text that parses is
// complete where the parser says.
TEST(ToolCallsJsonPrefix, AgreesWithTheParserAndOnlyGrows) {
  std::mt19937 rng(11);
  const std::vector<std::string> atoms = {"0", "-0.5e+3", "12", "1E9", "true", "false", "null", "\"\"",
                                          "\"a\\\"b\\\\c\\u00e9\\ud83d\\ude00\"", "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\""};
  std::function<std::string(int)> value = [&](int depth) -> std::string {
    const auto ws = [&] { return std::string(rng() % 3 == 0 ? " \n" : ""); };
    const int kind = depth == 0 ? static_cast<int>(rng() % 2) : static_cast<int>(rng() % 4);
    if (kind >= 2 || depth > 3) return atoms[rng() % atoms.size()];
    std::string out = kind == 0 ? "{" : "[";
    const int n = static_cast<int>(rng() % 4);
    for (int i = 0; i < n; ++i) {
      out += (i ? "," : "") + ws();
      if (kind == 0) out += "\"k" + std::to_string(i) + "\"" + ws() + ":" + ws();
      out += value(depth + 1) + ws();
    }
    return out + (kind == 0 ? "}" : "]");
  };
  const std::string noise = "{}[]\",:0123456789.eE+-tfn\\u \x01\xc3\xa9\xff";
  int checked = 0, complete = 0;
  for (int round = 0; round < 400; ++round) {
    std::string text = value(0);
    if (round % 2 == 1) text[rng() % text.size()] = noise[rng() % noise.size()];
    const tool_calls::JsonPrefixScan whole = tool_calls::ScanJsonPrefix(text);
    for (size_t k = 0; k <= text.size(); ++k) {
      const tool_calls::JsonPrefixScan part = tool_calls::ScanJsonPrefix(std::string_view(text).substr(0, k));
      ASSERT_EQ(part.valid, std::min(k, whole.valid)) << text << " at " << k;
    }
    nlohmann::ordered_json parsed;
    const bool parses = tool_calls::ParseJsonText(text, &parsed) && (parsed.is_object() || parsed.is_array());
    if (whole.end > 0) {
      EXPECT_TRUE(tool_calls::ParseJsonText(std::string_view(text).substr(0, whole.end), &parsed)) << text;
      ++complete;
    }
    if (parses) EXPECT_EQ(whole.end, text.size()) << text;
    if (round % 2 == 0) EXPECT_TRUE(parses) << text;
    ++checked;
  }
  EXPECT_GT(complete, checked / 2);
}

TEST(ToolCallsParse, QwenXmlValuesFollowTheSchema) {
  ToolParseOptions o;
  o.tools = kTools;
  auto p = ParseAssistantOutput(ToolCallFormat::kQwen3Coder,
                                "<tool_call>\n<function=search>\n<parameter=query>\n123\n</parameter>\n"
                                "<parameter=filters>\n{\"year\": 2024}\n</parameter>\n</function>\n</tool_call>",
                                o);
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments, R"({"query":"123","filters":{"year":2024}})");
}

// ---- Reasoning ------------------------------------------------------------------------------------

TEST(ToolCallsReasoning, ThinkBlocks) {
  ToolParseOptions o;
  o.reasoning = ReasoningFormat::kQwen3;
  const std::string text = "<think>\nLet me see.\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
  auto p = ParseAssistantOutput(ToolCallFormat::kHermes, text, o);
  EXPECT_EQ(p.reasoning_content, "\nLet me see.\n");
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  ExpectStreamingMatches(ToolCallFormat::kHermes, text, o);

  p = ParseAssistantOutput(ToolCallFormat::kHermes, "No thinking. <think>x</think>", o);
  EXPECT_EQ(p.reasoning_content, "");
  EXPECT_EQ(p.content, "No thinking. <think>x</think>");

  // The prompt opened <think>: the output starts inside it, and may be cut off there.
  o.reasoning = ReasoningFormat::kDeepSeekR1;
  o.starts_in_reasoning = true;
  p = ParseAssistantOutput(ToolCallFormat::kDeepSeekR1, "Hmm </thin", o);
  EXPECT_EQ(p.reasoning_content, "Hmm </thin");
  EXPECT_EQ(p.content, "");
  p = ParseAssistantOutput(ToolCallFormat::kDeepSeekR1, "Hmm.</think>\n\nThe answer is 4.", o);
  EXPECT_EQ(p.reasoning_content, "Hmm.");
  EXPECT_EQ(p.content, "The answer is 4.");
  ExpectStreamingMatches(ToolCallFormat::kDeepSeekR1, "Hmm.</think>\n\nThe answer is 4.", o);
  EXPECT_TRUE(PromptOpensReasoning(ReasoningFormat::kDeepSeekR1, "<｜Assistant｜><think>\n"));
  EXPECT_FALSE(PromptOpensReasoning(ReasoningFormat::kDeepSeekR1, "<｜Assistant｜><think>\n</think>"));
}

TEST(ToolCallsReasoning, CommandR7bThinking) {
  ToolParseOptions o;
  o.reasoning = ReasoningFormat::kCommandR7b;
  const std::string text =
      "<|START_THINKING|>I should look it up.<|END_THINKING|><|START_ACTION|>[{\"tool_call_id\": \"0\", "
      "\"tool_name\": \"f\", \"parameters\": {\"q\": 1}}]<|END_ACTION|>";
  auto p = ParseAssistantOutput(ToolCallFormat::kCommandR7b, text, o);
  EXPECT_EQ(p.reasoning_content, "I should look it up.");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments, R"({"q":1})");
  ExpectStreamingMatches(ToolCallFormat::kCommandR7b, text, o);
}

// ---- Names ----------------------------------------------------------------------------------------

TEST(ToolCallsFormat, NamesRoundTrip) {
  for (auto f : {ToolCallFormat::kGeneric, ToolCallFormat::kHermes, ToolCallFormat::kQwen3Coder,
                 ToolCallFormat::kLlama3Json, ToolCallFormat::kMistral, ToolCallFormat::kMistralArgs,
                 ToolCallFormat::kGranite, ToolCallFormat::kFunctionaryV32, ToolCallFormat::kFirefunctionV2,
                 ToolCallFormat::kCommandR7b, ToolCallFormat::kDeepSeekR1}) {
    auto back = ToolCallFormatFromName(ToolCallFormatName(f));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, f);
  }
  EXPECT_FALSE(ToolCallFormatFromName("nope").ok());
  EXPECT_EQ(ReasoningFormatFromName("qwen3").value(), ReasoningFormat::kQwen3);
}

TEST(ToolCallsFormat, GenericMessages) {
  ordered_json messages = ordered_json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"location\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "20C"}])");
  ordered_json out = PrepareGenericToolMessages(messages, kTools, false, true);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(out[0]["content"].get<std::string>().rfind("Be brief.\n\n", 0), 0u);
  EXPECT_EQ(json::parse(out[2]["content"].get<std::string>())["tool_calls"][0]["arguments"]["location"], "Paris");
  EXPECT_EQ(out[3]["role"], "user");
  out = PrepareGenericToolMessages(messages, kTools, false, false);  // no system role: into the user's text
  EXPECT_EQ(out[0]["role"], "user");
  EXPECT_EQ(out[0]["content"].get<std::string>().rfind("Be brief.", 0), 0u);
}

// ---- Constraints ----------------------------------------------------------------------------------

// Every "format" object in a structural tag has a type xgrammar knows and the fields it reads.
void ExpectWellFormed(const ordered_json& f, const std::string& what) {
  ASSERT_TRUE(f.is_object()) << what;
  const std::string type = f.value("type", "");
  if (type == "const_string") EXPECT_TRUE(f["value"].is_string()) << what;
  else if (type == "json_schema" || type == "qwen_xml_parameter") EXPECT_TRUE(f["json_schema"].is_object()) << what;
  else if (type == "any_text") {
  } else if (type == "sequence" || type == "or") {
    ASSERT_TRUE(f["elements"].is_array() && !f["elements"].empty()) << what;
    for (const auto& e : f["elements"]) ExpectWellFormed(e, what);
  } else if (type == "tag") {
    EXPECT_TRUE(f["begin"].is_string() && f["end"].is_string()) << what;
    ExpectWellFormed(f["content"], what);
  } else if (type == "optional") {
    ExpectWellFormed(f["content"], what);
  } else if (type == "triggered_tags" || type == "tags_with_separator") {
    ASSERT_TRUE(f["tags"].is_array() && !f["tags"].empty()) << what;
    for (const auto& t : f["tags"]) {
      EXPECT_EQ(t["type"], "tag") << what;
      ExpectWellFormed(t, what);
      if (type == "triggered_tags") {
        bool triggered = false;
        for (const auto& trig : f["triggers"]) {
          triggered |= t["begin"].get<std::string>().rfind(trig.get<std::string>(), 0) == 0;
        }
        EXPECT_TRUE(triggered) << what << ": a tag that no trigger starts";
      }
    }
    if (type == "tags_with_separator") {
      EXPECT_TRUE(f["separator"].is_string()) << what;
    }
    EXPECT_TRUE(f["at_least_one"].is_boolean() && f["stop_after_first"].is_boolean()) << what;
  } else {
    ADD_FAILURE() << what << ": unknown format type " << type;
  }
}

TEST(ToolCallsConstraint, StructuralTagsForEveryFormat) {
  for (auto f : {ToolCallFormat::kHermes, ToolCallFormat::kQwen3Coder, ToolCallFormat::kLlama3Json, ToolCallFormat::kMistral,
                 ToolCallFormat::kMistralArgs, ToolCallFormat::kGranite, ToolCallFormat::kFunctionaryV32,
                 ToolCallFormat::kFirefunctionV2, ToolCallFormat::kCommandR7b, ToolCallFormat::kDeepSeekR1}) {
    for (ToolChoice::Mode mode : {ToolChoice::Mode::kRequired, ToolChoice::Mode::kNamed, ToolChoice::Mode::kAuto})
      for (bool parallel : {false, true}) {
        const std::string what = std::string(ToolCallFormatName(f)) + " mode " + std::to_string(int(mode)) +
                                 (parallel ? " parallel" : "");
        auto r = ToolCallConstraint(f, kTools, {mode, "search"}, parallel);
        if (mode == ToolChoice::Mode::kAuto && (f == ToolCallFormat::kLlama3Json || f == ToolCallFormat::kFunctionaryV32)) {
          EXPECT_EQ(r.status().code(), StatusCode::kUnsupported) << what;
          continue;
        }
        ASSERT_TRUE(r.ok()) << what << ": " << r.status().ToString();
        EXPECT_EQ(r->kind, ToolCallGrammar::Kind::kStructuralTag);
        ordered_json tag = ordered_json::parse(r->spec);
        EXPECT_EQ(tag["type"], "structural_tag") << what;
        ExpectWellFormed(tag["format"], what);
        const bool has_weather = r->spec.find("get_weather") != std::string::npos;
        EXPECT_EQ(has_weather, mode != ToolChoice::Mode::kNamed) << what;
        EXPECT_NE(r->spec.find("\"year\""), std::string::npos) << what << ": the arguments' schema";
      }
  }
  ordered_json hermes = ordered_json::parse(ToolCallConstraint(ToolCallFormat::kHermes, kTools, {ToolChoice::Mode::kRequired, ""}, false)->spec);
  EXPECT_EQ(hermes["format"]["type"], "or");  // exactly one call
  EXPECT_EQ(hermes["format"]["elements"][0]["begin"], "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ");
  ToolConstraintOptions thinking{ReasoningFormat::kQwen3, true};
  auto r = ToolCallConstraint(ToolCallFormat::kHermes, kTools, {ToolChoice::Mode::kRequired, ""}, true, thinking);
  ASSERT_TRUE(r.ok());
  ordered_json t = ordered_json::parse(r->spec);
  EXPECT_EQ(t["format"]["type"], "sequence");
  ExpectWellFormed(t["format"], "with reasoning");
}

TEST(ToolCallsConstraint, GenericSchemaAndRefusals) {
  auto r = ToolCallConstraint(ToolCallFormat::kGeneric, kTools, {ToolChoice::Mode::kAuto, ""}, true);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->kind, ToolCallGrammar::Kind::kJsonSchema);
  ordered_json schema = ordered_json::parse(r->spec);
  ASSERT_EQ(schema["anyOf"].size(), 2u);
  EXPECT_EQ(schema["anyOf"][1]["required"][0], "response");
  r = ToolCallConstraint(ToolCallFormat::kGeneric, kTools, {ToolChoice::Mode::kNamed, "get_weather"}, true);
  ASSERT_TRUE(r.ok());
  schema = ordered_json::parse(r->spec);
  EXPECT_EQ(schema["properties"]["tool_calls"]["maxItems"], 1);
  EXPECT_EQ(schema["properties"]["tool_calls"]["items"]["properties"]["name"]["const"], "get_weather");

  EXPECT_EQ(ToolCallConstraint(ToolCallFormat::kHermes, kTools, {ToolChoice::Mode::kNamed, "nope"}, true).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_FALSE(ToolCallConstraint(ToolCallFormat::kHermes, ordered_json::array(), {ToolChoice::Mode::kRequired, ""}, true).ok());
  EXPECT_FALSE(ToolCallConstraint(ToolCallFormat::kHermes, kTools, {ToolChoice::Mode::kNone, ""}, true).ok());

  EXPECT_EQ(ParseToolChoice("required")->mode, ToolChoice::Mode::kRequired);
  auto named = ParseToolChoice(ordered_json::parse(R"({"type": "function", "function": {"name": "f"}})"));
  ASSERT_TRUE(named.ok());
  EXPECT_EQ(named->name, "f");
  EXPECT_FALSE(ParseToolChoice("sometimes").ok());
}

}  // namespace
}  // namespace kvflow
