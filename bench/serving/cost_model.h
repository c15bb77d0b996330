// The serving simulator's cost model: step time from a step's shape (analytic A100 models or coefficients fitted on this machine).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "serving/common.h"

namespace kvflow::bench::serving {

// ---- cost model -----------------------------------------------------------------------------

struct StepShape {
  int64_t batched_tokens = 0;
  int64_t context_tokens = 0;  // over scheduled sequences: num_computed + num_tokens
  int64_t num_seqs = 0;
  // Query-key pairs of attention: over the new tokens, each one's context (num_computed + i + 1).
  // Equal to context_tokens for decode; grows with the square of a prefill.
  int64_t attention_pairs = 0;
  int64_t swapped_blocks = 0;  // swap-out + swap-in

  void AddSequence(int64_t num_computed, int64_t num_tokens) {
    ++num_seqs;
    batched_tokens += num_tokens;
    context_tokens += num_computed + num_tokens;
    attention_pairs += num_tokens * num_computed + num_tokens * (num_tokens + 1) / 2;
  }
};

// t = c0 + c_token * batched_tokens + c_context * context_tokens + c_seq * num_seqs
//     + c_attention_pair * attention_pairs (+ c_swap_token * swapped tokens)
// The pair term is beyond the four-term model: on the CPU every prefill query reads its whole
// prefix, so prefill time grows with the square of its length.
struct CostModel {
  std::string name;
  std::string description;  // one line for tables and figures
  double c0_s = 0, c_token_s = 0, c_context_s = 0, c_seq_s = 0, c_attention_pair_s = 0;
  double c_swap_token_s = 0;  // 0 where swapping is not modelled
  std::optional<int64_t> kv_budget_tokens;  // what the modelled device leaves for KV, when known
  Json details;

  double StepSeconds(const StepShape& s, int block_size) const {
    return (s.num_seqs > 0 ? c0_s : 0.0) + c_token_s * static_cast<double>(s.batched_tokens) +
           c_context_s * static_cast<double>(s.context_tokens) + c_seq_s * static_cast<double>(s.num_seqs) +
           c_attention_pair_s * static_cast<double>(s.attention_pairs) + c_swap_token_s * static_cast<double>(s.swapped_blocks * block_size);
  }
  Json ToJson() const {
    Json j{{"name", name},
           {"description", description},
           {"coefficients",
            {{"c0_s", c0_s}, {"c_token_s", c_token_s}, {"c_context_s", c_context_s}, {"c_seq_s", c_seq_s},
             {"c_attention_pair_s", c_attention_pair_s}, {"c_swap_token_s", c_swap_token_s}}}};
    if (kv_budget_tokens) j["kv_budget_tokens"] = *kv_budget_tokens;
    j["details"] = details;
    return j;
  }
};

Result<CostModel> MakeCostModel(const std::string& spec);

}  // namespace kvflow::bench::serving
