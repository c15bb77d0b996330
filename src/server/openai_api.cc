#include "server/openai_api.h"

#include <cstdio>

#include <cmath>
#include <functional>
#include <limits>
#include <map>

#include "model/utf8.h"
#include "util/json_nesting.h"

namespace kvflow::server {
namespace {

std::string TypeName(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "boolean";
    case Json::value_t::string: return "string";
    case Json::value_t::array: return "array";
    case Json::value_t::object: return "object";
    case Json::value_t::number_float: return "number";
    default: return "integer";
  }
}

ApiError WrongType(const std::string& field, const char* expected, const Json& got) {
  return InvalidRequest("'" + field + "' must be " + expected + ", not " + TypeName(got), field);
}


std::optional<ApiError> ParseObject(std::string_view body, Json* out) {
  if (!JsonNestingWithin(body, kMaxJsonDepth)) {
    return InvalidRequest("the JSON body is nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  }
  *out = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded()) return InvalidRequest("the body is not valid JSON");
  if (!out->is_object()) return InvalidRequest("the body must be a JSON object, not " + TypeName(*out));
  return std::nullopt;
}

// Field readers: null means "not given" and leaves the target alone.
using FieldReader = std::function<std::optional<ApiError>(const std::string& name, const Json& v)>;

FieldReader Integer(int* target, int64_t lo = std::numeric_limits<int>::min(),
                    int64_t hi = std::numeric_limits<int>::max(), bool* given = nullptr) {
  return [=](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    if (!v.is_number_integer()) return WrongType(name, "an integer", v);
    const bool is_unsigned = v.is_number_unsigned();
    const int64_t x = is_unsigned ? static_cast<int64_t>(std::min<uint64_t>(v.get<uint64_t>(), INT64_MAX))
                                  : v.get<int64_t>();
    if (x < lo || x > hi) {
      return InvalidRequest("'" + name + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                "], not " + std::to_string(x),
                            name);
    }
    *target = static_cast<int>(x);
    if (given) *given = true;
    return std::nullopt;
  };
}

FieldReader Number(float* target) {
  return [=](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    if (!v.is_number()) return WrongType(name, "a number", v);
    *target = v.get<float>();
    return std::nullopt;
  };
}

// An optional boolean: null or absent leaves it unset.
FieldReader OptionalBool(std::optional<bool>* target) {
  return [=](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    if (!v.is_boolean()) return WrongType(name, "a boolean", v);
    *target = v.get<bool>();
    return std::nullopt;
  };
}

FieldReader Bool(bool* target) {
  return [=](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    if (!v.is_boolean()) return WrongType(name, "a boolean", v);
    *target = v.get<bool>();
    return std::nullopt;
  };
}

FieldReader String(std::string* target) {
  return [=](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    if (!v.is_string()) return WrongType(name, "a string", v);
    *target = v.get<std::string>();
    return std::nullopt;
  };
}

// Accepted and not acted on (it changes nothing about the output).
FieldReader Ignored(const char* expected, bool (Json::*is_type)() const noexcept) {
  return [=](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null() || (v.*is_type)()) return std::nullopt;
    return WrongType(name, expected, v);
  };
}

// Known OpenAI fields kvflow does not implement: fine when absent or empty, a clear 400 otherwise.
FieldReader Unsupported(const char* what) {
  return [=](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null() || (v.is_array() && v.empty()) || (v.is_object() && v.empty())) return std::nullopt;
    return InvalidRequest(std::string("'") + name + "' is not supported: " + what, name);
  };
}

std::optional<ApiError> ReadFields(const Json& body, const std::map<std::string, FieldReader>& readers) {
  for (const auto& [name, value] : body.items()) {
    auto it = readers.find(name);
    if (it == readers.end()) return InvalidRequest("Unrecognized request argument supplied: " + name, name);
    if (auto error = it->second(name, value)) return error;
  }
  return std::nullopt;
}

std::optional<ApiError> ReadStop(const Json& v, SamplingParams* p) {
  if (v.is_null()) return std::nullopt;
  if (v.is_string()) {
    p->stop = {v.get<std::string>()};
    return std::nullopt;
  }
  if (!v.is_array()) return WrongType("stop", "a string or an array of strings", v);
  p->stop.clear();
  for (const Json& s : v) {
    if (!s.is_string()) return WrongType("stop", "a string or an array of strings", s);
    p->stop.push_back(s.get<std::string>());
  }
  return std::nullopt;
}

// OpenAI's logit_bias: {"<token id>": bias, ...}; the ranges are SamplingParams::Validate's.
std::optional<ApiError> ReadLogitBias(const std::string& name, const Json& v, SamplingParams* p) {
  p->logit_bias.clear();
  if (v.is_null()) return std::nullopt;
  if (!v.is_object()) return WrongType(name, "an object mapping token ids to biases", v);
  for (const auto& [key, bias] : v.items()) {
    size_t used = 0;
    long long token = -1;
    try {
      token = std::stoll(key, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != key.size() || token < 0 || token > INT32_MAX) {
      return InvalidRequest("'" + name + "' keys must be token ids, not '" + key + "'", name);
    }
    if (!bias.is_number()) return WrongType(name, "an object mapping token ids to numbers", bias);
    p->logit_bias.emplace_back(static_cast<int32_t>(token), bias.get<float>());
  }
  return std::nullopt;
}

std::optional<ApiError> ReadTokenIds(const std::string& name, const Json& v, std::vector<int32_t>* out) {
  out->clear();
  for (const Json& t : v) {
    if (!t.is_number_integer()) return WrongType(name, "an array of integer token ids", t);
    if (t.is_number_unsigned() ? t.get<uint64_t>() > INT32_MAX
                               : (t.get<int64_t>() < INT32_MIN || t.get<int64_t>() > INT32_MAX)) {
      return InvalidRequest("'" + name + "' holds a token id out of range", name);
    }
    out->push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return std::nullopt;
}

std::optional<ApiError> ReadStreamOptions(const Json& v, GenerationRequest* r) {
  if (v.is_null()) return std::nullopt;
  if (!v.is_object()) return WrongType("stream_options", "an object", v);
  for (const auto& [key, value] : v.items()) {
    if (key == "include_usage") {
      if (!value.is_boolean()) return WrongType("stream_options.include_usage", "a boolean", value);
      r->include_usage = value.get<bool>();
    } else {
      return InvalidRequest("Unrecognized request argument supplied: stream_options." + key, "stream_options");
    }
  }
  return std::nullopt;
}

// Fields both endpoints read the same way.
std::map<std::string, FieldReader> CommonReaders(GenerationRequest* r, bool* stream_options_given) {
  SamplingParams* p = &r->sampling;
  auto seed = [p](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    if (!v.is_number_integer()) return WrongType(name, "an integer", v);
    p->seed = v.is_number_unsigned() ? v.get<uint64_t>() : static_cast<uint64_t>(v.get<int64_t>());
    return std::nullopt;
  };
  auto best_of = [p](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    int x = 0;
    if (auto e = Integer(&x, std::numeric_limits<int>::min(), std::numeric_limits<int>::max())(name, v)) return e;
    p->best_of = x;
    return std::nullopt;
  };
  auto top_k = [p](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (auto e = Integer(&p->top_k, -1, std::numeric_limits<int>::max())(name, v)) return e;
    if (p->top_k < 0) p->top_k = 0;  // vLLM spells "disabled" -1
    return std::nullopt;
  };
  auto prompt_logprobs = [r](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    int x = 0;
    if (auto e = Integer(&x, 0, 20)(name, v)) return e;
    r->prompt_logprobs = x;
    return std::nullopt;
  };
  auto stop_token_ids = [p](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    if (!v.is_array()) return WrongType(name, "an array of integers", v);
    return ReadTokenIds(name, v, &p->stop_token_ids);
  };
  return {
      {"model", String(&r->model)},
      {"max_tokens", Integer(&p->max_tokens, std::numeric_limits<int>::min(), std::numeric_limits<int>::max(),
                             &r->max_tokens_given)},
      {"temperature", Number(&p->temperature)},
      {"top_p", Number(&p->top_p)},
      {"n", Integer(&p->n, std::numeric_limits<int>::min(), std::numeric_limits<int>::max())},
      {"best_of", best_of},
      {"stop", [p](const std::string&, const Json& v) { return ReadStop(v, p); }},
      {"seed", seed},
      {"presence_penalty", Number(&p->presence_penalty)},
      {"frequency_penalty", Number(&p->frequency_penalty)},
      {"stream", Bool(&r->stream)},
      {"stream_options",
       [r, stream_options_given](const std::string&, const Json& v) {
         *stream_options_given = !v.is_null();
         return ReadStreamOptions(v, r);
       }},
      {"user", Ignored("a string", &Json::is_string)},
      {"logit_bias", [p](const std::string& name, const Json& v) { return ReadLogitBias(name, v, p); }},
      // vLLM's extra sampling parameters.
      {"top_k", top_k},
      {"min_p", Number(&p->min_p)},
      {"repetition_penalty", Number(&p->repetition_penalty)},
      {"ignore_eos", Bool(&p->ignore_eos)},
      {"skip_special_tokens", Bool(&p->skip_special_tokens)},
      {"min_tokens", Integer(&p->min_tokens)},
      {"stop_token_ids", stop_token_ids},
      {"use_beam_search", Bool(&p->use_beam_search)},
      {"length_penalty", Number(&p->length_penalty)},
      {"prompt_logprobs", prompt_logprobs},
      // kvflow: whether this request decodes speculatively when the server was started with a
      // --speculative-method (default true; false opts out, e.g. for a short prompt under triforce).
      {"speculative", Bool(&p->speculative)},
      // kvflow: with a server started with --kv-selection (infinigen, h2o), whether this request's
      // attention reads the selection (true) or the whole cache (false); absent: the server's
      // --kv-selection-default.
      {"kv_selection", OptionalBool(&p->kv_selection)},
  };
}

// The structured-output constraints, by the names each server's users send.
void StructuredOutputReaders(std::map<std::string, FieldReader>& readers, GenerationRequest* r) {
  using Kind = StructuredOutput::Kind;
  auto set = [r](const std::string& field, Kind kind, std::string spec, bool strict = true) {
    r->constraint_fields.push_back(field);
    StructuredOutput so;
    so.kind = kind;
    so.spec = std::move(spec);
    so.strict = strict;
    r->sampling.structured_output = std::move(so);
  };
  // A JSON schema given as an object, or as a string holding one (vLLM accepts both).
  auto schema_text = [](const std::string& name, const Json& v, std::string* out) -> std::optional<ApiError> {
    if (v.is_object() || v.is_boolean()) {
      *out = v.dump();
      return std::nullopt;
    }
    if (v.is_string()) {
      Json parsed = Json::parse(v.get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (parsed.is_discarded() || !(parsed.is_object() || parsed.is_boolean())) {
        return InvalidRequest("'" + name + "' is not a valid JSON Schema: not a JSON object", name);
      }
      *out = v.get<std::string>();
      return std::nullopt;
    }
    return WrongType(name, "a JSON Schema object", v);
  };
  auto choice_text = [](const std::string& name, const Json& v, std::string* out) -> std::optional<ApiError> {
    if (!v.is_array() || v.empty()) return WrongType(name, "a non-empty array of strings", v);
    for (const Json& c : v) {
      if (!c.is_string()) return WrongType(name, "a non-empty array of strings", v);
    }
    *out = v.dump();
    return std::nullopt;
  };
  auto string_field = [set](Kind kind) {
    return [set, kind](const std::string& name, const Json& v) -> std::optional<ApiError> {
      if (v.is_null()) return std::nullopt;
      if (!v.is_string() || v.get<std::string>().empty()) return WrongType(name, "a non-empty string", v);
      set(name, kind, v.get<std::string>());
      return std::nullopt;
    };
  };
  // OpenAI's response_format.
  readers["response_format"] = [set, schema_text](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    if (!v.is_object() || !v.contains("type") || !v["type"].is_string()) {
      return WrongType(name, "an object with a 'type'", v);
    }
    const std::string type = v["type"].get<std::string>();
    if (type == "text") return std::nullopt;
    if (type == "json_object") {
      set(name, Kind::kJsonObject, "");
      return std::nullopt;
    }
    if (type == "json_schema") {
      if (!v.contains("json_schema") || !v["json_schema"].is_object()) {
        return InvalidRequest("response_format json_schema needs a 'json_schema' object with a 'schema'", name);
      }
      const Json& js = v["json_schema"];
      if (js.contains("strict") && !js["strict"].is_boolean() && !js["strict"].is_null()) {
        return WrongType(name + ".json_schema.strict", "a boolean", js["strict"]);
      }
      std::string schema = "{}";  // OpenAI: no schema means any JSON object
      if (js.contains("schema") && !js["schema"].is_null()) {
        if (auto e = schema_text(name + ".json_schema.schema", js["schema"], &schema)) return e;
      }
      const bool strict = js.contains("strict") && js["strict"].is_boolean() && js["strict"].get<bool>();
      set(name, Kind::kJsonSchema, schema, strict);
      return std::nullopt;
    }
    if (type == "structural_tag") {
      set(name, Kind::kStructuralTag, v.dump());
      return std::nullopt;
    }
    return InvalidRequest("response_format type must be text, json_object, json_schema or structural_tag, not '" +
                              type + "'",
                          name);
  };
  // vLLM's guided_* fields (and their successor, structured_outputs).
  readers["guided_json"] = [set, schema_text](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    std::string schema;
    if (auto e = schema_text(name, v, &schema)) return e;
    set(name, Kind::kJsonSchema, schema, false);
    return std::nullopt;
  };
  readers["guided_regex"] = string_field(Kind::kRegex);
  readers["guided_grammar"] = string_field(Kind::kGrammar);
  readers["guided_choice"] = [set, choice_text](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    std::string choices;
    if (auto e = choice_text(name, v, &choices)) return e;
    set(name, Kind::kChoice, choices);
    return std::nullopt;
  };
  readers["guided_decoding_backend"] = [](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null() || v == "xgrammar" || v == "auto") return std::nullopt;
    return InvalidRequest("kvflow decodes structured output with xgrammar only, not " + v.dump(), name);
  };
  readers["guided_whitespace_pattern"] = Unsupported("kvflow's JSON grammars allow any whitespace; a pattern is not supported");
  readers["structured_outputs"] = [r, set, schema_text, choice_text](const std::string& name,
                                                                     const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    if (!v.is_object()) return WrongType(name, "an object", v);
    bool any_whitespace = true;
    int given = 0;
    for (auto it = v.begin(); it != v.end(); ++it) {
      const std::string key = it.key();
      const Json& x = it.value();
      const std::string field = name + "." + key;
      if (x.is_null() || key == "backend") continue;
      if (key == "disable_any_whitespace") {
        if (!x.is_boolean()) return WrongType(field, "a boolean", x);
        any_whitespace = !x.get<bool>();
        continue;
      }
      std::string spec;
      if (key == "json") {
        if (auto e = schema_text(field, x, &spec)) return e;
        set(name, Kind::kJsonSchema, spec, false);
      } else if (key == "json_object") {
        if (!x.is_boolean()) return WrongType(field, "a boolean", x);
        if (!x.get<bool>()) continue;
        set(name, Kind::kJsonObject, "");
      } else if (key == "choice") {
        if (auto e = choice_text(field, x, &spec)) return e;
        set(name, Kind::kChoice, spec);
      } else if (key == "regex" || key == "grammar" || key == "structural_tag") {
        if (!x.is_string() || x.get<std::string>().empty()) return WrongType(field, "a non-empty string", x);
        set(name, key == "regex" ? Kind::kRegex : key == "grammar" ? Kind::kGrammar : Kind::kStructuralTag,
            x.get<std::string>());
      } else {
        return InvalidRequest("Unrecognized request argument supplied: " + field, name);
      }
      ++given;
    }
    if (given > 1) return InvalidRequest("'" + name + "' takes one of json, regex, choice, grammar, json_object and "
                                         "structural_tag", name);
    if (given == 1) r->sampling.structured_output->any_whitespace = any_whitespace;
    return std::nullopt;
  };
  // llama.cpp's json_schema and grammar (GBNF, which xgrammar's EBNF reads).
  readers["json_schema"] = [set, schema_text](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    std::string schema;
    if (auto e = schema_text(name, v, &schema)) return e;
    set(name, Kind::kJsonSchema, schema, false);
    return std::nullopt;
  };
  readers["grammar"] = string_field(Kind::kGrammar);
}

// Checks that need every field: run once all were read. max_tokens 0 (only the prompt) is
// allowed when `zero_ok`; `zero_needs` names what it needs.
std::optional<ApiError> FinishCommon(GenerationRequest* r, bool stream_options_given, bool zero_ok,
                                     const char* zero_needs) {
  SamplingParams& p = r->sampling;
  if (r->constraint_fields.size() > 1) {
    return InvalidRequest("give one structured-output constraint, not both '" + r->constraint_fields[0] + "' and '" +
                              r->constraint_fields[1] + "'",
                          r->constraint_fields[1]);
  }
  if (r->prompt_logprobs) p.prompt_logprobs = std::max(p.prompt_logprobs.value_or(0), *r->prompt_logprobs);
  if (r->max_tokens_given && p.max_tokens < (zero_ok ? 0 : 1)) {
    std::string m = std::string("'max_tokens' must be at least ") + (zero_ok ? "0" : "1") + ", not " +
                    std::to_string(p.max_tokens);
    if (p.max_tokens == 0) m += std::string(" (0, for only the prompt, needs ") + zero_needs + ")";
    return InvalidRequest(m, "max_tokens");
  }
  if (r->max_tokens_given && p.max_tokens == 0) {
    if (p.num_candidates() > 1 || p.use_beam_search) {
      return InvalidRequest("'max_tokens' 0 (only the prompt) cannot be combined with n > 1, best_of or beam search",
                            "max_tokens");
    }
    // The engine finishes a request that generates nothing once its prompt is scored.
    if (!p.prompt_logprobs) p.prompt_logprobs = 0;
  }
  if (p.best_of && *p.best_of < p.n) {
    return InvalidRequest("'best_of' (" + std::to_string(*p.best_of) + ") must be >= 'n' (" + std::to_string(p.n) + ")",
                          "best_of");
  }
  if (stream_options_given && !r->stream) {
    return InvalidRequest("'stream_options' is only allowed when 'stream' is true", "stream_options");
  }
  if (r->stream && !p.streams()) {
    return InvalidRequest("streaming is not supported with best_of > n or beam search", "stream");
  }
  // max_tokens is checked against the context later; validate the rest with a placeholder.
  SamplingParams check = p;
  if (!r->max_tokens_given) check.max_tokens = std::max(1, check.min_tokens);
  if (Status s = check.Validate(); !s.ok()) {
    // Validate's messages start with the field they are about ("top_p must be in (0, 1], got 0").
    const std::string& m = s.message();
    const size_t end = m.find(" must be ");
    std::optional<std::string> param;
    if (end != std::string::npos && m.find_first_not_of("abcdefghijklmnopqrstuvwxyz_") == end) param = m.substr(0, end);
    return InvalidRequest(m, param);
  }
  return std::nullopt;
}

std::optional<ApiError> ReadPrompt(const Json& v, std::vector<PromptInput>* prompts) {
  prompts->clear();
  const char* expected = "a string, an array of strings, an array of token ids or an array of token-id arrays";
  if (v.is_string()) {
    prompts->push_back({false, v.get<std::string>(), {}});
  } else if (v.is_array() && !v.empty() && v.front().is_number()) {
    PromptInput in{true, {}, {}};
    if (auto e = ReadTokenIds("prompt", v, &in.tokens)) return e;
    prompts->push_back(std::move(in));
  } else if (v.is_array() && !v.empty()) {
    for (const Json& item : v) {
      if (item.is_string()) {
        prompts->push_back({false, item.get<std::string>(), {}});
      } else if (item.is_array()) {
        PromptInput in{true, {}, {}};
        if (auto e = ReadTokenIds("prompt", item, &in.tokens)) return e;
        prompts->push_back(std::move(in));
      } else {
        return WrongType("prompt", expected, item);
      }
    }
  } else if (v.is_array()) {
    return InvalidRequest("'prompt' must not be empty", "prompt");
  } else {
    return WrongType("prompt", expected, v);
  }
  for (const PromptInput& in : *prompts) {
    if (in.is_tokens ? in.tokens.empty() : in.text.empty()) return InvalidRequest("'prompt' must not be empty", "prompt");
  }
  return std::nullopt;
}

std::optional<ApiError> ReadMessages(const Json& v, Json* messages) {
  if (!v.is_array()) return WrongType("messages", "an array of message objects", v);
  *messages = v;
  Status s = NormalizeChatMessages(messages);
  if (!s.ok()) return InvalidRequest(s.message(), "messages");
  return std::nullopt;
}

// OpenAI's tools: [{"type": "function", "function": {"name", "description"?, "parameters"?,
// "strict"?}}].
std::optional<ApiError> ReadTools(const Json& v, Json* tools) {
  if (v.is_null()) {
    *tools = nullptr;
    return std::nullopt;
  }
  if (!v.is_array()) return WrongType("tools", "an array of tool objects", v);
  for (size_t i = 0; i < v.size(); ++i) {
    const Json& tool = v[i];
    const std::string where = "tools[" + std::to_string(i) + "]";
    if (!tool.is_object()) return WrongType(where, "an object", tool);
    if (tool.value("type", "") != "function") return InvalidRequest(where + ".type must be \"function\"", "tools");
    if (!tool.contains("function") || !tool["function"].is_object()) {
      return InvalidRequest(where + ".function must be an object", "tools");
    }
    const Json& f = tool["function"];
    if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty()) {
      return InvalidRequest(where + ".function.name must be a non-empty string", "tools");
    }
    if (f.contains("parameters") && !f["parameters"].is_object() && !f["parameters"].is_null()) {
      return InvalidRequest(where + ".function.parameters must be a JSON Schema object", "tools");
    }
    if (f.contains("description") && !f["description"].is_string() && !f["description"].is_null()) {
      return InvalidRequest(where + ".function.description must be a string", "tools");
    }
  }
  *tools = v;
  return std::nullopt;
}

// The fields that feed the chat template, shared by chat completions, /tokenize and
// /apply-template.
void ChatTemplateReaders(std::map<std::string, FieldReader>& readers, ChatTemplateInput* in, bool* has_messages) {
  readers["messages"] = [in, has_messages](const std::string&, const Json& v) {
    *has_messages = true;
    return ReadMessages(v, &in->messages);
  };
  readers["tools"] = [in](const std::string&, const Json& v) { return ReadTools(v, &in->tools); };
  readers["add_generation_prompt"] = Bool(&in->add_generation_prompt);
  readers["chat_template_kwargs"] = [in](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    if (!v.is_object()) return WrongType(name, "an object", v);
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (it.key() == "messages" || it.key() == "tools" || it.key() == "add_generation_prompt") {
        return InvalidRequest("chat_template_kwargs cannot set '" + it.key() + "'; give it as a field of the request", name);
      }
    }
    in->kwargs = v;
    return std::nullopt;
  };
}

std::string TokenBytes(const Tokenizer& tokenizer, int32_t token) {
  return tokenizer.TokenBytes(token, /*skip_special=*/false);
}

// A token's text for logprobs: its UTF-8 when it is whole characters, else "bytes:\xNN..." as
// OpenAI and vLLM write a token that ends inside a character (so that such tokens stay distinct).
std::string TokenLabel(const std::string& bytes) {
  bool valid = true;
  for (size_t pos = 0; pos < bytes.size() && valid;) {
    const Utf8Step step = DecodeUtf8(bytes, pos);
    valid = step.valid;
    pos += step.len;
  }
  if (valid) return bytes;
  std::string label = "bytes:";
  char hex[8];
  for (unsigned char c : bytes) {
    std::snprintf(hex, sizeof(hex), "\\x%02x", c);
    label += hex;
  }
  return label;
}

}  // namespace

std::string ApiError::ToJson() const {
  Json error{{"message", message},
             {"type", type},
             {"param", param ? Json(*param) : Json(nullptr)},
             {"code", code ? Json(*code) : Json(nullptr)}};
  return DumpJson(Json{{"error", std::move(error)}});
}

ApiError InvalidRequest(std::string message, std::optional<std::string> param) {
  ApiError e;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

std::optional<ApiError> ParseCompletionRequest(std::string_view body, CompletionRequest* out) {
  *out = CompletionRequest{};
  Json json;
  if (auto e = ParseObject(body, &json)) return e;
  bool stream_options_given = false;
  bool has_prompt = false;
  auto readers = CommonReaders(out, &stream_options_given);
  StructuredOutputReaders(readers, out);
  readers["prompt"] = [&](const std::string&, const Json& v) {
    has_prompt = true;
    return ReadPrompt(v, &out->prompts);
  };
  readers["echo"] = Bool(&out->echo);
  readers["logprobs"] = Integer(&out->sampling.logprobs, 0, 20, &out->logprobs_given);
  readers["suffix"] = Unsupported("kvflow does not insert text");
  if (auto e = ReadFields(json, readers)) return e;
  if (!has_prompt) return InvalidRequest("'prompt' is required", "prompt");
  if (!out->max_tokens_given) out->sampling.max_tokens = 16;  // OpenAI's default for completions
  // Echo with logprobs covers the prompt tokens too: the engine scores the prompt.
  if (out->echo && out->logprobs_given) out->sampling.prompt_logprobs = out->sampling.logprobs;
  return FinishCommon(out, stream_options_given, out->echo || out->prompt_logprobs, "'echo' or 'prompt_logprobs'");
}

std::optional<ApiError> ParseTokenizeRequest(std::string_view body, TokenizeRequest* out) {
  *out = TokenizeRequest{};
  Json json;
  if (auto e = ParseObject(body, &json)) return e;
  bool has_text = false, has_messages = false, add_special_given = false;
  std::map<std::string, FieldReader> readers;
  ChatTemplateReaders(readers, &out->chat_input, &has_messages);
  readers["model"] = String(&out->model);
  auto text = [&](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (has_text) return InvalidRequest("give one of 'prompt' and 'content'", name);
    if (!v.is_string()) return WrongType(name, "a string", v);
    has_text = true;
    out->text = v.get<std::string>();
    return std::nullopt;
  };
  readers["prompt"] = text;   // vLLM
  readers["content"] = text;  // llama.cpp
  auto special = [&](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (!v.is_boolean()) return WrongType(name, "a boolean", v);
    out->add_special = v.get<bool>();
    add_special_given = true;
    return std::nullopt;
  };
  readers["add_special_tokens"] = special;  // vLLM
  readers["add_special"] = special;         // llama.cpp
  readers["with_pieces"] = Bool(&out->with_pieces);
  if (auto e = ReadFields(json, readers)) return e;
  if (has_text == has_messages) {
    return InvalidRequest("give the text to tokenize as 'prompt' (or 'content'), or chat 'messages'", "prompt");
  }
  out->chat = has_messages;
  if (!out->chat && (json.contains("tools") || json.contains("chat_template_kwargs"))) {
    return InvalidRequest("'tools' and 'chat_template_kwargs' go with chat 'messages'", "messages");
  }
  // Each server's default: vLLM adds special tokens to a prompt (not to rendered chat, whose
  // template has them); llama.cpp adds none unless asked.
  if (!add_special_given) out->add_special = !out->chat && json.contains("prompt");
  return std::nullopt;
}

std::optional<ApiError> ParseApplyTemplateRequest(std::string_view body, ChatTemplateInput* out) {
  *out = ChatTemplateInput{};
  Json json;
  if (auto e = ParseObject(body, &json)) return e;
  bool has_messages = false;
  std::string model;
  std::map<std::string, FieldReader> readers;
  readers["model"] = String(&model);
  ChatTemplateReaders(readers, out, &has_messages);
  if (auto e = ReadFields(json, readers)) return e;
  if (!has_messages) return InvalidRequest("'messages' is required", "messages");
  return std::nullopt;
}

std::optional<ApiError> ParseDetokenizeRequest(std::string_view body, DetokenizeRequest* out) {
  *out = DetokenizeRequest{};
  Json json;
  if (auto e = ParseObject(body, &json)) return e;
  bool has_tokens = false;
  std::map<std::string, FieldReader> readers;
  readers["model"] = String(&out->model);
  readers["tokens"] = [&](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (!v.is_array()) return WrongType(name, "an array of integer token ids", v);
    has_tokens = true;
    return ReadTokenIds(name, v, &out->tokens);
  };
  if (auto e = ReadFields(json, readers)) return e;
  if (!has_tokens) return InvalidRequest("'tokens' is required", "tokens");
  return std::nullopt;
}

std::optional<ApiError> ParseChatRequest(std::string_view body, ChatRequest* out) {
  *out = ChatRequest{};
  Json json;
  if (auto e = ParseObject(body, &json)) return e;
  bool stream_options_given = false;
  bool has_messages = false;
  bool top_logprobs_given = false;
  bool max_completion_tokens_given = false;
  int max_completion_tokens = 0;
  auto readers = CommonReaders(out, &stream_options_given);
  ChatTemplateReaders(readers, &out->chat, &has_messages);
  StructuredOutputReaders(readers, out);
  readers["logprobs"] = Bool(&out->logprobs);
  readers["top_logprobs"] = Integer(&out->sampling.logprobs, 0, 20, &top_logprobs_given);
  readers["max_completion_tokens"] =
      Integer(&max_completion_tokens, std::numeric_limits<int>::min(), std::numeric_limits<int>::max(),
              &max_completion_tokens_given);
  readers["functions"] = Unsupported("the deprecated 'functions' field is not supported; use 'tools'");
  readers["tool_choice"] = [out](const std::string& name, const Json& v) -> std::optional<ApiError> {
    if (v.is_null()) return std::nullopt;
    auto choice = ParseToolChoice(v);
    if (!choice.ok()) return InvalidRequest(choice.status().message(), name);
    out->tool_choice = choice.value();
    return std::nullopt;
  };
  readers["function_call"] = Unsupported("the deprecated 'function_call' field is not supported; use 'tool_choice'");
  readers["parallel_tool_calls"] = Bool(&out->parallel_tool_calls);
  readers["store"] = Ignored("a boolean", &Json::is_boolean);
  readers["metadata"] = Ignored("an object", &Json::is_object);
  readers["service_tier"] = Ignored("a string", &Json::is_string);
  if (auto e = ReadFields(json, readers)) return e;
  if (!has_messages) return InvalidRequest("'messages' is required", "messages");
  const bool has_tools = out->chat.tools.is_array() && !out->chat.tools.empty();
  if (out->tool_choice && out->tool_choice->mode != ToolChoice::Mode::kNone &&
      out->tool_choice->mode != ToolChoice::Mode::kAuto && !has_tools) {
    return InvalidRequest("'tool_choice' " + std::string(out->tool_choice->mode == ToolChoice::Mode::kRequired
                                                             ? "\"required\""
                                                             : "naming a function") +
                              " needs 'tools'",
                          "tool_choice");
  }
  if (out->tool_choice && out->tool_choice->mode == ToolChoice::Mode::kNamed) {
    bool known = false;
    for (const Json& t : out->chat.tools) known |= t["function"]["name"] == out->tool_choice->name;
    if (!known) {
      return InvalidRequest("'tool_choice' names the function '" + out->tool_choice->name + "', which is not in 'tools'",
                            "tool_choice");
    }
  }
  if (max_completion_tokens_given) {
    out->sampling.max_tokens = max_completion_tokens;
    out->max_tokens_given = true;
  }
  if (top_logprobs_given && out->sampling.logprobs > 0 && !out->logprobs) {
    return InvalidRequest("'top_logprobs' needs 'logprobs' to be true", "top_logprobs");
  }
  return FinishCommon(out, stream_options_given, out->prompt_logprobs.has_value(), "'prompt_logprobs'");
}

const char* OpenAiFinishReason(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop:
    case FinishReason::kEos: return "stop";
    case FinishReason::kCancelled: return "abort";
    case FinishReason::kError: return "error";
    case FinishReason::kNone: break;
  }
  return "stop";
}

Json CompletionLogprobs(const Tokenizer& tokenizer, const std::vector<SampledToken>& tokens, size_t text_offset_start) {
  Json strings = Json::array(), logprobs = Json::array(), tops = Json::array(), offsets = Json::array();
  size_t offset = text_offset_start;
  for (const SampledToken& t : tokens) {
    const std::string bytes = TokenBytes(tokenizer, t.token);
    strings.push_back(TokenLabel(bytes));
    logprobs.push_back(t.logprob);
    offsets.push_back(offset);
    offset += bytes.size();
    Json top = Json::object();
    // Most likely first; a label seen already keeps its (higher) logprob.
    for (const TokenLogprob& alt : t.top_logprobs) top.emplace(TokenLabel(TokenBytes(tokenizer, alt.token)), alt.logprob);
    tops.push_back(std::move(top));
  }
  return Json{{"tokens", std::move(strings)},
              {"token_logprobs", std::move(logprobs)},
              {"top_logprobs", std::move(tops)},
              {"text_offset", std::move(offsets)}};
}

Json ChatLogprobs(const Tokenizer& tokenizer, const std::vector<SampledToken>& tokens) {
  auto entry = [&](int32_t token, float logprob) {
    const std::string text = TokenBytes(tokenizer, token);
    Json bytes = Json::array();
    for (unsigned char c : text) bytes.push_back(static_cast<int>(c));
    return Json{{"token", TokenLabel(text)}, {"logprob", logprob}, {"bytes", std::move(bytes)}};
  };
  Json content = Json::array();
  for (const SampledToken& t : tokens) {
    Json e = entry(t.token, t.logprob);
    Json top = Json::array();
    for (const TokenLogprob& alt : t.top_logprobs) top.push_back(entry(alt.token, alt.logprob));
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return Json{{"content", std::move(content)}};
}

Json EchoLogprobs(const Tokenizer& tokenizer, const std::vector<int32_t>& prompt,
                  const std::vector<SampledToken>& logprobs, int top, const std::string& echo_text) {
  Json strings = Json::array(), token_logprobs = Json::array(), tops = Json::array(), offsets = Json::array();
  size_t offset = 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    const std::string bytes = TokenBytes(tokenizer, prompt[i]);
    strings.push_back(TokenLabel(bytes));
    offsets.push_back(offset);
    if (echo_text.compare(offset, bytes.size(), bytes) == 0 || !tokenizer.is_special(prompt[i])) {
      offset = std::min(offset + bytes.size(), echo_text.size());
    }
    if (i == 0 || i > logprobs.size()) {  // the first token has nothing before it
      token_logprobs.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    const SampledToken& t = logprobs[i - 1];
    token_logprobs.push_back(t.logprob);
    Json alternatives = Json::object();
    const size_t n = std::min(t.top_logprobs.size(), static_cast<size_t>(std::max(top, 0)));
    for (size_t j = 0; j < n; ++j) {  // as CompletionLogprobs: a label seen already keeps its logprob
      alternatives.emplace(TokenLabel(TokenBytes(tokenizer, t.top_logprobs[j].token)), t.top_logprobs[j].logprob);
    }
    tops.push_back(std::move(alternatives));
  }
  return Json{{"tokens", std::move(strings)},
              {"token_logprobs", std::move(token_logprobs)},
              {"top_logprobs", std::move(tops)},
              {"text_offset", std::move(offsets)}};
}

void AppendCompletionLogprobs(Json* to, const Json& more) {
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
    Json& array = (*to)[key];
    for (const Json& v : more.at(key)) array.push_back(v);
  }
}

Json PromptLogprobs(const Tokenizer& tokenizer, const std::vector<SampledToken>& logprobs, int top) {
  auto entry = [&](int32_t token, float logprob) {
    return Json{{"logprob", logprob}, {"decoded_token", tokenizer.DecodePieces({token}, /*skip_special=*/false)}};
  };
  Json out = Json::array({nullptr});
  for (const SampledToken& t : logprobs) {
    Json e = Json::object();
    e.emplace(std::to_string(t.token), entry(t.token, t.logprob));
    const size_t n = std::min(t.top_logprobs.size(), static_cast<size_t>(std::max(top, 0)));
    for (size_t j = 0; j < n; ++j) {
      const TokenLogprob& alt = t.top_logprobs[j];
      e.emplace(std::to_string(alt.token), entry(alt.token, alt.logprob));
    }
    out.push_back(std::move(e));
  }
  return out;
}

std::string DumpJson(const Json& json) { return json.dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace kvflow::server
