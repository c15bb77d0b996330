// Structured output (src/structured_output): xgrammar's masks through the logits-processor seam,
// checked against the matcher token by token, and end to end on the tiny-random model (byte
// tokens) under every decoding strategy: greedy, sampled, n-gram speculation, parallel sampling,
// beam search, and batches that mix constrained and free requests. Skipped (with a message) in a
// kvflow built without xgrammar, where only the refusal is checked.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "engine/engine_core.h"
#include "engine/evaluation.h"
#include "engine/logits_processor.h"
#include "engine_test_util.h"
#include "kv_selection_test_util.h"
#include "model/llama_weights.h"
#include "sched/policy.h"
#include "speculative/plugin.h"
#include "structured_output/grammar_compiler.h"
#include "structured_output/structured_output_processor.h"

namespace kvflow {
namespace {

#define SKIP_WITHOUT_XGRAMMAR()                                                                        \
  if (!StructuredOutputAvailable()) {                                                                  \
    GTEST_SKIP() << "kvflow was built without xgrammar (run tools/install-deps, then reconfigure)"; \
  }

// Bounded so that even a random model finishes it: a short string, a bounded integer, a boolean.
// (The string takes a pattern, not maxLength: xgrammar 0.2.8 lets a maxLength string hold raw
// control characters, which is not JSON.)
constexpr const char* kPersonSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}
  },
  "required": ["name", "age", "ok"]
})";

StructuredOutput Json(const std::string& schema) {
  StructuredOutput so;
  so.kind = StructuredOutput::Kind::kJsonSchema;
  so.spec = schema;
  so.any_whitespace = false;
  return so;
}

StructuredOutput Of(StructuredOutput::Kind kind, const std::string& spec) {
  StructuredOutput so;
  so.kind = kind;
  so.spec = spec;
  return so;
}

SamplingParams Constrained(const StructuredOutput& so, int max_tokens = 96) {
  SamplingParams p = test::Greedy(max_tokens);
  p.ignore_eos = false;  // the grammar ends with EOS
  p.structured_output = so;
  return p;
}

std::string Hex(const std::string& s) {
  std::string out;
  char buf[4];
  for (unsigned char c : s) {
    std::snprintf(buf, sizeof(buf), "%02x ", c);
    out += buf;
  }
  return out;
}

void ExpectPerson(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    FAIL() << "not JSON: " << text << " (" << e.what() << "; bytes " << Hex(text) << ")";
  }
  ASSERT_TRUE(j.is_object()) << "not a JSON object: " << text;
  ASSERT_TRUE(j.contains("name") && j["name"].is_string()) << text;
  EXPECT_TRUE(std::regex_match(j["name"].get<std::string>(), std::regex("[A-Za-z ]{1,6}"))) << text;
  ASSERT_TRUE(j.contains("age") && j["age"].is_number_integer()) << text;
  EXPECT_GE(j["age"].get<int>(), 0) << text;
  EXPECT_LE(j["age"].get<int>(), 99) << text;
  ASSERT_TRUE(j.contains("ok") && j["ok"].is_boolean()) << text;
}

// The tiny-random model's tokenizer and vocabulary (256 byte tokens, <|endoftext|> = EOS, two
// more specials).
struct TinyVocab {
  ModelFiles files;
  std::vector<int32_t> eos;
};

TinyVocab OpenTiny() {
  auto files = OpenModelFiles("tiny-random");
  EXPECT_TRUE(files.ok()) << files.status().ToString();
  TinyVocab v{std::move(files).value(), {}};
  v.eos.assign(v.files.config.eos_token_ids.begin(), v.files.config.eos_token_ids.end());
  return v;
}

std::vector<int32_t> Bytes(const std::string& s) {
  std::vector<int32_t> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

bool Bit(std::span<const uint32_t> mask, int32_t t) { return (mask[static_cast<size_t>(t) / 32] >> (t % 32)) & 1u; }

// ---- refusals ------------------------------------------------------------------------------------

TEST(StructuredOutput, InvalidSpecsAreRefusedWithTheirFault) {
  auto engine = test::MakeEngine();
  ASSERT_TRUE(engine);
  using K = StructuredOutput::Kind;
  if (!StructuredOutputAvailable()) {
    const auto st = engine->AddRequest("x", Constrained(Json(kPersonSchema))).status();
    EXPECT_EQ(st.code(), StatusCode::kUnsupported);
    EXPECT_NE(st.message().find("without"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("tools/install-deps"), std::string::npos) << st.message();
    GTEST_SKIP() << "kvflow was built without xgrammar: only the refusal was checked";
  }
  const std::pair<StructuredOutput, const char*> bad[] = {
      {Json("{not json"), "json_schema"},
      {Json(R"({"type": "no-such-type"})"), "json_schema"},
      {Json(R"({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})"), "json_schema"},
      {Of(K::kRegex, "(unclosed"), "regex"},
      {Of(K::kRegex, "[z-a]"), "regex"},
      {Of(K::kGrammar, "root ::= "), "grammar"},
      {Of(K::kGrammar, "root ::= undefined_rule"), "grammar"},
      {Of(K::kGrammar, "start ::= \"a\""), "grammar"},  // no root rule
      {Of(K::kChoice, R"("just a string")"), "choice"},
      {Of(K::kChoice, "[]"), "choice"},
      {Of(K::kChoice, R"(["a", 1])"), "choice"},
      {Of(K::kChoice, "[\"a\""), "choice"},
      {Of(K::kStructuralTag, "{\"type\": \"nonsense\"}"), "structural_tag"},
      {Of(K::kRegex, ""), "regex"},  // empty spec: SamplingParams::Validate
  };
  for (const auto& [so, kind] : bad) {
    const Status st = engine->AddRequest("x", Constrained(so)).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << kind << " " << so.spec << ": " << st.ToString();
    EXPECT_NE(st.message().find(kind), std::string::npos) << st.message();
  }
  EXPECT_FALSE(engine->HasUnfinishedRequests());
  // The engine still serves a valid one afterwards.
  auto out = engine->Generate("x", Constrained(Of(K::kChoice, R"(["yes", "no"])")));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_TRUE(out->outputs[0].text == "yes" || out->outputs[0].text == "no") << out->outputs[0].text;
}

TEST(StructuredOutput, AnEngineCoreWithoutTheProcessorRefusesIt) {
  EngineCoreConfig config;
  config.scheduler.max_model_len = 64;
  config.blocks.block_size = 16;
  config.blocks.num_device_blocks = 8;
  config.vocab_size = 256;
  EngineCore core(config, MakeSchedulingPolicy("paged").value(), nullptr, nullptr);
  const Status st = core.ValidateRequest({1, 2, 3}, Constrained(Of(StructuredOutput::Kind::kRegex, "a+")));
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("structured-output"), std::string::npos) << st.message();
}

TEST(StructuredOutput, ChoiceGrammarEscapesItsStrings) {
  auto g = ChoiceGrammar(R"(["a\"b", "c\\d", "line\nbreak", "é"])");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g.value(), "root ::= \"a\\\"b\" | \"c\\\\d\" | \"line\\u000abreak\" | \"é\"");
  EXPECT_FALSE(ChoiceGrammar("{}").ok());
}

// ---- masks ---------------------------------------------------------------------------------------

// At several positions of a JSON output, the processor's mask allows a token iff a copy of the
// matcher accepts it; and the processor follows outputs that shrink (rejected drafts) or change.
TEST(StructuredOutput, MaskEqualsTheMatchersVerdictOnEveryToken) {
  SKIP_WITHOUT_XGRAMMAR();
  TinyVocab v = OpenTiny();
  const int64_t V = v.files.config.vocab_size;
  auto compiler = GrammarCompiler::Create(*v.files.tokenizer, V, v.eos);
  ASSERT_TRUE(compiler.ok()) << compiler.status().ToString();
  StructuredOutputProcessor processor(*v.files.tokenizer, V, v.eos);
  const SamplingParams params = Constrained(Json(kPersonSchema));
  ASSERT_TRUE(processor.Validate(params, V).ok());

  const std::string full = R"({"name": "Al", "age": 42, "ok": true})";
  const std::vector<int32_t> tokens = Bytes(full);
  int positions = 0;
  for (size_t len : {size_t{0}, size_t{1}, size_t{2}, size_t{9}, size_t{12}, size_t{21}, size_t{22}, size_t{31},
                     tokens.size() - 1, tokens.size()}) {
    // Walk a fresh matcher to `len` tokens.
    auto matcher = compiler.value()->NewMatcher(*params.structured_output);
    ASSERT_TRUE(matcher.ok());
    for (size_t i = 0; i < len; ++i) ASSERT_TRUE(matcher.value()->AcceptToken(tokens[i])) << full.substr(0, i + 1);
    // The processor's mask for that position (the same sequence key throughout: it moves on).
    TokenConstraint constraint;
    const std::span<const int32_t> output(tokens.data(), len);
    processor.Constrain({params, {}, output, V, 7}, constraint);
    ASSERT_FALSE(constraint.mask().empty()) << "position " << len << ": no mask";
    int allowed = 0;
    for (int32_t t = 0; t < V; ++t) {
      auto copy = matcher.value()->Fork();
      const bool accepts = copy->AcceptToken(t);
      EXPECT_EQ(Bit(constraint.mask(), t), accepts) << "position " << len << " token " << t;
      EXPECT_EQ(constraint.Allows(t), accepts);
      allowed += accepts;
    }
    EXPECT_GT(allowed, 0) << "position " << len;
    if (len == tokens.size()) {  // complete: only EOS
      EXPECT_EQ(allowed, 1);
      EXPECT_TRUE(Bit(constraint.mask(), v.eos[0]));
    }
    ++positions;
  }
  EXPECT_EQ(positions, 10);

  // Shrinking (a rejected draft) and changing outputs: the mask is a fresh walk's.
  auto fresh_mask = [&](const std::vector<int32_t>& out) {
    StructuredOutputProcessor fresh(*v.files.tokenizer, V, v.eos);
    TokenConstraint c;
    fresh.Constrain({params, {}, out, V, 1}, c);
    return std::vector<uint32_t>(c.mask().begin(), c.mask().end());
  };
  const std::vector<std::vector<int32_t>> walk = {
      Bytes(R"({"name": "Al", "a)"), Bytes(R"({"name": "A)"), Bytes(R"({"name": "Bob", "age": 1)"),
      Bytes(R"({"name")"), Bytes(R"({)"), Bytes(R"({"name": "Bob", "age": 1, "ok": false})"), {}};
  for (const auto& out : walk) {
    TokenConstraint c;
    processor.Constrain({params, {}, out, V, 7}, c);
    EXPECT_EQ(std::vector<uint32_t>(c.mask().begin(), c.mask().end()), fresh_mask(out))
        << std::string(out.begin(), out.end());
  }
  // A forked sequence carries its parent's state; forgetting drops it.
  processor.Fork(7, 8);
  EXPECT_EQ(processor.num_sequences(), 2u);
  processor.Forget(7);
  processor.Forget(8);
  EXPECT_EQ(processor.num_sequences(), 0u);
  // A request without structured output is not touched.
  TokenConstraint untouched;
  processor.Constrain({test::Greedy(4), {}, {}, V, 9}, untouched);
  EXPECT_TRUE(untouched.empty());
  EXPECT_EQ(processor.num_sequences(), 0u);
}

// ---- end to end ----------------------------------------------------------------------------------

TEST(StructuredOutput, GreedyAndSampledJsonFollowTheSchema) {
  SKIP_WITHOUT_XGRAMMAR();
  auto engine = test::MakeEngine();
  ASSERT_TRUE(engine);
  SamplingParams p = Constrained(Json(kPersonSchema), 128);
  for (const char* prompt : {"Describe a person as JSON:", "hello", "{\"name\":"}) {
    auto greedy = engine->Generate(prompt, p);
    ASSERT_TRUE(greedy.ok()) << greedy.status().ToString();
    EXPECT_EQ(greedy->outputs[0].finish_reason, FinishReason::kEos) << greedy->outputs[0].text;
    ExpectPerson(greedy->outputs[0].text);
  }
  SamplingParams sampled = p;
  sampled.temperature = 1.0f;
  for (uint64_t seed : {1u, 2u, 3u, 4u}) {
    sampled.seed = seed;
    auto out = engine->Generate("Describe a person as JSON:", sampled);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_EQ(out->outputs[0].finish_reason, FinishReason::kEos) << out->outputs[0].text;
    ExpectPerson(out->outputs[0].text);
  }
  // Any JSON object (json_object), compact.
  StructuredOutput object;
  object.kind = StructuredOutput::Kind::kJsonObject;
  object.any_whitespace = false;
  SamplingParams any = Constrained(object, 48);
  auto out = engine->Generate("JSON:", any);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_FALSE(out->outputs[0].text.empty());
  EXPECT_EQ(out->outputs[0].text[0], '{') << out->outputs[0].text;
  if (out->outputs[0].finish_reason == FinishReason::kEos) {
    EXPECT_TRUE(nlohmann::json::parse(out->outputs[0].text, nullptr, false).is_object()) << out->outputs[0].text;
  }
}

TEST(StructuredOutput, RegexChoiceAndGrammarHold) {
  SKIP_WITHOUT_XGRAMMAR();
  auto engine = test::MakeEngine();
  ASSERT_TRUE(engine);
  using K = StructuredOutput::Kind;
  const std::string regex = "[a-z]{3}-[0-9]{2,4}";
  const std::set<std::string> choices = {"red", "green", "blue", "dark \"blue\""};
  for (float temperature : {0.0f, 1.0f}) {
    for (const char* prompt : {"code:", "colour", "x"}) {
      SamplingParams p = Constrained(Of(K::kRegex, regex), 32);
      p.temperature = temperature;
      p.seed = 5;
      auto r = engine->Generate(prompt, p);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_TRUE(std::regex_match(r->outputs[0].text, std::regex(regex))) << r->outputs[0].text;
      EXPECT_EQ(r->outputs[0].finish_reason, FinishReason::kEos);

      p.structured_output = Of(K::kChoice, R"(["red", "green", "blue", "dark \"blue\""])");
      auto c = engine->Generate(prompt, p);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      EXPECT_EQ(choices.count(c->outputs[0].text), 1u) << c->outputs[0].text;

      p.structured_output = Of(K::kGrammar, "root ::= (\"yes\" | \"no\") (\", \" (\"yes\" | \"no\"))?");
      auto g = engine->Generate(prompt, p);
      ASSERT_TRUE(g.ok()) << g.status().ToString();
      EXPECT_TRUE(std::regex_match(g->outputs[0].text, std::regex("(yes|no)(, (yes|no))?"))) << g->outputs[0].text;
    }
  }
}

TEST(StructuredOutput, MaxTokensInsideAValueFinishesWithLength) {
  SKIP_WITHOUT_XGRAMMAR();
  auto engine = test::MakeEngine();
  ASSERT_TRUE(engine);
  // 11 byte tokens: `{"name": "` and the first letter of the name.
  auto out = engine->Generate("Describe a person as JSON:", Constrained(Json(kPersonSchema), 11));
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  const CompletionOutput& c = out->outputs[0];
  EXPECT_EQ(c.finish_reason, FinishReason::kLength);
  EXPECT_EQ(c.tokens.size(), 11u);
  EXPECT_EQ(c.text.rfind(R"({"name": ")", 0), 0u) << c.text;
  EXPECT_TRUE(std::regex_match(c.text.substr(10), std::regex("[A-Za-z ]"))) << c.text;
  EXPECT_TRUE(nlohmann::json::parse(c.text, nullptr, false).is_discarded()) << c.text;
}

// min_tokens bans the EOS a complete grammar needs: no token is allowed then. Nothing breaks: the
// output leaves the grammar (plain decoding) or the beams end where they are (beam search).
TEST(StructuredOutput, MinTokensPastTheGrammarsEndDoesNotBreakTheEngine) {
  SKIP_WITHOUT_XGRAMMAR();
  auto engine = test::MakeEngine();
  ASSERT_TRUE(engine);
  SamplingParams p = Constrained(Of(StructuredOutput::Kind::kChoice, R"(["ok"])"), 8);
  p.min_tokens = 4;
  auto plain = engine->Generate("x", p);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->outputs[0].text.rfind("ok", 0), 0u) << plain->outputs[0].text;
  p.use_beam_search = true;
  p.best_of = 2;
  auto beams = engine->Generate("x", p);
  ASSERT_TRUE(beams.ok()) << beams.status().ToString();
  ASSERT_FALSE(beams->outputs.empty());
  EXPECT_EQ(beams->outputs[0].text, "ok");
  EXPECT_NE(beams->outputs[0].finish_reason, FinishReason::kNone);
  EXPECT_FALSE(engine->HasUnfinishedRequests());
}

// A registry with n-gram speculation and a structured-output processor the test can see (to check
// that every sequence's matcher is forgotten).
struct Observed {
  SystemRegistry registry;
  const StructuredOutputProcessor* processor = nullptr;
};

std::unique_ptr<Observed> ObservedRegistry() {
  auto o = std::make_unique<Observed>();
  EXPECT_TRUE(RegisterSpeculativeDrafters(o->registry).ok());
  SchedulingPolicyPlugin paged;
  paged.info.name = "paged";
  paged.create = [](const SchedulingContext&) -> Result<SchedulingParts> {
    SchedulingParts parts;
    KVFLOW_ASSIGN_OR_RETURN(parts.policy, MakeSchedulingPolicy("paged"));
    return parts;
  };
  EXPECT_TRUE(o->registry.Register(std::move(paged)).ok());
  LogitsProcessorPlugin so;
  so.info.name = "structured_output";
  so.create = [raw = o.get()](const LogitsProcessorContext& ctx) -> Result<std::unique_ptr<LogitsProcessor>> {
    auto p = std::make_unique<StructuredOutputProcessor>(
        ctx.tokenizer, ctx.model.vocab_size, std::vector<int32_t>(ctx.eos_token_ids.begin(), ctx.eos_token_ids.end()));
    raw->processor = p.get();
    return std::unique_ptr<LogitsProcessor>(std::move(p));
  };
  EXPECT_TRUE(o->registry.Register(std::move(so)).ok());
  return o;
}

std::unique_ptr<Engine> ObservedEngine(Observed& o, EngineConfig c = {}) {
  c.model = "tiny-random";
  c.num_threads = 2;
  auto e = CreateEngineWithSystems(c, o.registry, {});
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::unique_ptr<Engine>(std::move(e).value()) : nullptr;
}

// Speculative verification asks about every drafted position with the drafts kept so far: greedy
// constrained outputs are plain constrained decoding's, whatever was drafted and rejected.
TEST(StructuredOutput, NgramSpeculationKeepsGreedyOutputs) {
  SKIP_WITHOUT_XGRAMMAR();
  auto plain = test::MakeEngine();
  auto observed = ObservedRegistry();
  EngineConfig spec_config;
  spec_config.speculative.method = "ngram";
  auto spec = ObservedEngine(*observed, spec_config);
  ASSERT_TRUE(plain && spec);
  // Prompts that repeat JSON, so the n-gram drafter finds continuations to propose.
  const std::string example = R"({"name": "Al", "age": 42, "ok": true} )";
  const std::vector<std::string> prompts = {example + example + example, "JSON " + example + example, "hi"};
  using K = StructuredOutput::Kind;
  const StructuredOutput constraints[] = {
      Json(kPersonSchema), Of(K::kRegex, "(ab|abc|a)+x"),
      Of(K::kGrammar, "root ::= \"{\\\"name\\\": \\\"\" [A-Za-z]* \"\\\", \\\"age\\\": \" [0-9]+ \"}\"")};
  for (const StructuredOutput& so : constraints) {
    const SamplingParams p = Constrained(so, 48);
    for (const std::string& prompt : prompts) {
      auto want = plain->Generate(prompt, p);
      auto got = spec->Generate(prompt, p);
      ASSERT_TRUE(want.ok() && got.ok());
      EXPECT_EQ(got->outputs[0].tokens, want->outputs[0].tokens) << so.spec << " / " << prompt;
      EXPECT_EQ(got->outputs[0].finish_reason, want->outputs[0].finish_reason);
    }
  }
  EXPECT_GT(spec->stats().spec.num_draft_tokens, 0) << "nothing was drafted: verification not exercised";
  EXPECT_GT(spec->stats().spec.num_accepted_tokens, 0) << "no draft was accepted";
  ASSERT_NE(observed->processor, nullptr);
  EXPECT_EQ(observed->processor->num_sequences(), 0u) << "a finished sequence's matcher was kept";
}

// A free request batched with constrained ones comes out as it does alone; so do the constrained
// ones; parallel samples and beams each follow the grammar; nothing is left behind.
TEST(StructuredOutput, MixedBatchesParallelSamplesAndBeams) {
  SKIP_WITHOUT_XGRAMMAR();
  auto observed = ObservedRegistry();
  auto engine = ObservedEngine(*observed);
  ASSERT_TRUE(engine);
  const auto prompts = test::ThreePrompts();
  const SamplingParams free_params = test::Greedy(24);
  const SamplingParams json = Constrained(Json(kPersonSchema), 96);
  const auto free_alone = test::GenerateAll(*engine, {prompts[0]}, free_params, false)[0];
  const auto json_alone = test::GenerateAll(*engine, {prompts[1]}, json, false)[0];

  std::vector<std::vector<int32_t>> out(3);
  const SamplingParams params[] = {free_params, json, json};
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(engine->AddRequest(prompts[i], params[i], [&out, i](const StreamEvent& e) {
                        for (const auto& t : e.tokens) out[i].push_back(t.token);
                      }).ok());
  }
  while (engine->HasUnfinishedRequests()) ASSERT_TRUE(engine->Step().ok());
  EXPECT_EQ(out[0], free_alone);
  EXPECT_EQ(out[1], json_alone);
  for (size_t i = 1; i < 3; ++i) {
    std::string text = engine->tokenizer().Decode(out[i]);
    ExpectPerson(text);
  }

  // n = 2: two samples, each its own walk through the grammar.
  SamplingParams two = json;
  two.n = 2;
  two.temperature = 1.0f;
  two.seed = 11;
  auto parallel = engine->Generate("two people:", two);
  ASSERT_TRUE(parallel.ok()) << parallel.status().ToString();
  ASSERT_EQ(parallel->outputs.size(), 2u);
  for (const CompletionOutput& c : parallel->outputs) ExpectPerson(c.text);
  EXPECT_NE(parallel->outputs[0].tokens, parallel->outputs[1].tokens) << "the samples share one walk?";

  // Beam search: every beam keeps to the choices.
  SamplingParams beams = Constrained(Of(StructuredOutput::Kind::kChoice, R"(["alpha", "beta", "gamma delta"])"), 16);
  beams.use_beam_search = true;
  beams.best_of = 3;
  beams.n = 2;
  auto beam = engine->Generate("pick:", beams);
  ASSERT_TRUE(beam.ok()) << beam.status().ToString();
  for (const CompletionOutput& c : beam->outputs) {
    EXPECT_TRUE(c.text == "alpha" || c.text == "beta" || c.text == "gamma delta") << c.text;
  }

  // A cancelled request's matchers go too.
  auto id = engine->AddRequest(prompts[2], json, {});
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(engine->Step().ok());
  ASSERT_TRUE(engine->Step().ok());
  ASSERT_TRUE(engine->Cancel(id.value()).ok());
  while (engine->HasUnfinishedRequests()) ASSERT_TRUE(engine->Step().ok());
  ASSERT_NE(observed->processor, nullptr);
  EXPECT_EQ(observed->processor->num_sequences(), 0u) << "a finished sequence's matcher was kept";
}

}  // namespace
}  // namespace kvflow
