// Computes the KV of a long prompt's leading blocks elsewhere (KV-Runahead prefills it across the
// ranks of an mpirun job: kv_runahead/prompt_prefill_service.h). Its KV enters the engine through a
// KV connector (engine/prompt_prefill_connector.h): at admission the prompt's fresh blocks for those
// tokens are handed to Prefill before the step's forward pass, and the engine's steps compute only
// the tail and sample the first token as usual.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "kv/block_manager.h"
#include "kvflow/status.h"

namespace kvflow {

class PromptPrefiller {
 public:
  virtual ~PromptPrefiller() = default;
  // Leading tokens of `prompt` to prefill here: a multiple of `block_size` below the prompt's
  // length (its last token is left to the engine, which needs its logits), or 0 to leave the whole
  // prompt to the engine's steps.
  virtual int64_t TokensToPrefill(std::span<const int32_t> prompt, int block_size) const = 0;
  // Writes the K/V of prompt[0, num_tokens) into the engine's pool at `block_table`.
  virtual Status Prefill(std::span<const int32_t> prompt, int64_t num_tokens, std::span<const BlockId> block_table) = 0;
  // One line for the engine's log.
  virtual std::string Describe() const = 0;
};

}  // namespace kvflow
