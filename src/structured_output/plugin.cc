#include "structured_output/plugin.h"

#include <vector>

#include "structured_output/structured_output_processor.h"

namespace kvflow {

Status RegisterStructuredOutput(SystemRegistry& registry) {
  LogitsProcessorPlugin plugin;
  plugin.info.name = "structured_output";
  plugin.info.label = "structured output (xgrammar)";
  plugin.create = [](const LogitsProcessorContext& ctx) -> Result<std::unique_ptr<LogitsProcessor>> {
    return std::unique_ptr<LogitsProcessor>(std::make_unique<StructuredOutputProcessor>(
        ctx.tokenizer, ctx.model.vocab_size,
        std::vector<int32_t>(ctx.eos_token_ids.begin(), ctx.eos_token_ids.end())));
  };
  return registry.Register(std::move(plugin));
}

}  // namespace kvflow
