// Per-request sampling parameters (vLLM / OpenAI semantics).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

// Structured output (grammar-constrained decoding, through xgrammar): at every position only the
// tokens that keep the output a prefix of the constraint's language may be sampled, and once the
// output is complete only EOS. A kvflow built without xgrammar refuses such a request
// (tools/install-deps fetches it). An invalid spec is refused when the request is added.
struct StructuredOutput {
  enum class Kind {
    kJsonObject,     // any JSON object or array (OpenAI's json_object); `spec` is ignored
    kJsonSchema,     // `spec`: a JSON Schema (OpenAI's json_schema.schema)
    kRegex,          // `spec`: a regular expression the whole output matches
    kChoice,         // `spec`: a JSON array of strings; the output is exactly one of them
    kGrammar,        // `spec`: an EBNF grammar in xgrammar's (GBNF-like) dialect, root rule `root`
    kStructuralTag,  // `spec`: an xgrammar structural tag (JSON), e.g. for tool calls
  };
  Kind kind = Kind::kJsonObject;
  std::string spec;
  // kJsonSchema: objects take no properties and arrays no items beyond those the schema names
  // unless it allows them (OpenAI's strict); false: JSON Schema's defaults (anything extra allowed).
  bool strict = true;
  // JSON kinds: any whitespace between JSON tokens (true); false: compact JSON (", " and ": "
  // separators, no newlines), which keeps a weak model from emitting whitespace forever.
  bool any_whitespace = true;
};

// "json_object", "json_schema", "regex", "choice", "grammar", "structural_tag".
const char* StructuredOutputKindName(StructuredOutput::Kind kind);

struct SamplingParams {
  // 0 means greedy (argmax); otherwise logits are divided by it before top-k/top-p/min-p.
  float temperature = 1.0f;
  int top_k = 0;          // <= 0: disabled
  float top_p = 1.0f;     // (0, 1]; 1: disabled
  float min_p = 0.0f;     // [0, 1]; 0: disabled
  // CTRL-style: logits of tokens seen in prompt or output are divided (if > 0) or multiplied by it.
  float repetition_penalty = 1.0f;
  // OpenAI-style, applied to tokens of the output only: logit -= freq * count + presence * (count > 0).
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  // Same seed and same prompt => same output. Unset: the engine draws one.
  std::optional<uint64_t> seed;
  int max_tokens = 16;  // 0: only score the prompt (needs prompt_logprobs)
  int min_tokens = 0;  // EOS and stop tokens are suppressed until this many were generated
  std::vector<int32_t> stop_token_ids;
  // OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs; the bias is added to the token's
  // logit before the penalties and the sampling (logprobs stay those of the raw logits). -100
  // bans the token in practice, +100 all but forces it.
  std::vector<std::pair<int32_t, float>> logit_bias;
  std::vector<std::string> stop;  // stop strings; the matched text is not included in the output
  // vLLM's: special tokens are left out of the output text (true) or written (false; tool-call
  // markers such as Mistral's [TOOL_CALLS] are special tokens, and their parsers need them).
  bool skip_special_tokens = true;
  bool ignore_eos = false;
  int logprobs = 0;  // return this many top alternatives per token (0: only the chosen token's)
  // vLLM's prompt_logprobs: when set, the logprob of every prompt token after the first (given the
  // tokens before it) with this many top alternatives. Scoring needs every prompt token computed,
  // so such a request does not take prefix-cache hits. With max_tokens 0 nothing is generated.
  std::optional<int> prompt_logprobs;
  // Prompt tokens from this position on run one per step, as decode steps (0: the whole prompt is
  // prefilled in chunks). With prompt_logprobs this is teacher-forced decoding: a decode-time
  // feature (a KV selection) acts on each of those tokens as while generating, and their logprobs
  // say what it costs (kvflow perplexity --decode-from). Slow: one step per token.
  int prompt_decode_from = 0;
  // With an engine that decodes speculatively (EngineConfig::speculative_method), whether this
  // request does; false: plain decoding.
  bool speculative = true;
  // With an engine that selects KV (EngineConfig::kv_selection: InfiniGen, H2O), whether this
  // request's attention reads the selection (true) or the whole cache (false); unset: the
  // engine's kv_selection_default.
  std::optional<bool> kv_selection;
  // Completions returned. With best_of > n, best_of are generated and the n with the highest
  // cumulative logprob are returned (at the end, not streamed). All share the prompt's KV blocks.
  int n = 1;
  std::optional<int> best_of;
  // Beam search over best_of (or n) beams, returning the n best finished beams. Deterministic:
  // needs temperature 0; scores are cumulative logprob / length^length_penalty (vLLM/HF).
  bool use_beam_search = false;
  float length_penalty = 1.0f;
  // Constrains the output to a JSON schema, regex, choice or grammar (StructuredOutput); unset:
  // free text.
  std::optional<StructuredOutput> structured_output;

  bool greedy() const { return temperature <= 0.0f; }
  int num_candidates() const { return best_of.value_or(n); }
  // Tokens reach the stream callback as they are generated (not for beam search or best_of > n).
  bool streams() const { return !use_beam_search && num_candidates() == n; }
  // Rejects impossible values (negative temperature, top_p outside (0,1], ...).
  Status Validate() const;
};

}  // namespace kvflow
