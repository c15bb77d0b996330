#include "kv_runahead/plugin.h"

#include <spdlog/spdlog.h>

#include "kv_runahead/prompt_prefill_service.h"

namespace kvflow {

Status RegisterKvRunahead(SystemRegistry& registry) {
  for (const char* name : {"kv-runahead", "tsp"}) {
    PrefillerPlugin p;
    p.info.name = name;
    p.info.label = std::string("prefill_parallel ") + name;
    // The ranks fill only the target's pool through the pool's own format.
    p.info.excludes = {
        {"kv_connector:kv_offload", "an offloaded pool is filled by its own path"},
        {"kv_selector", "InfiniGen's partial keys or H2O's scores would miss the prefilled tokens"},
        {"draft model", "the draft model's KV cache would miss the prefilled tokens"},
        {"drafter:triforce", "TriForce's retrieval cache is built from passes the prefill skips (n-gram speculation works)"},
    };
    p.info.complete = [](EngineConfig& c) {
      if (!c.enable_prefix_caching) {
        spdlog::info("prefill_parallel: turning prefix caching on (a prompt sent again maps the blocks the ranks "
                     "prefilled instead of prefilling it again)");
        c.enable_prefix_caching = true;
      }
    };
    p.info.validate = [](const EngineConfig& c) -> Status {
      if (c.prefill_parallel.min_tokens < 2) return Status::InvalidArgument("prefill_parallel_min_tokens must be >= 2");
      return Status::Ok();
    };
    p.create = [](const PrefillerContext& ctx) {
      return dist::CreatePromptPrefiller(ctx.config, ctx.backend, ctx.communicator);
    };
    KVFLOW_RETURN_IF_ERROR(registry.Register(std::move(p)));
  }
  return Status::Ok();
}

}  // namespace kvflow
