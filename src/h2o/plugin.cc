#include "h2o/plugin.h"

#include <spdlog/spdlog.h>

#include "h2o/h2o_selector.h"

namespace kvflow {

Status RegisterH2O(SystemRegistry& registry) {
  KvSelectorPlugin p;
  p.info.name = "h2o";
  p.info.label = "kv_selection h2o";
  p.info.excludes = {{"drafter", "verification steps read the whole cache, and the accumulated scores and evictions "
                                 "would count tokens the verification rejects"}};
  p.info.validate = [](const EngineConfig& c) { return H2OConfig::FromOptions(c.kv_selection).Validate(); };
  // Bad H2O settings are a mistake under another selector too.
  p.info.validate_when_off = [](const EngineConfig& c) -> Status {
    if (c.kv_selection.method.empty()) return Status::Ok();
    return H2OConfig::FromOptions(c.kv_selection).Validate();
  };
  p.create = [](const KvSelectorContext& ctx) -> Result<std::unique_ptr<KvSelector>> {
    const H2OOptions& o = ctx.config.kv_selection.h2o;
    spdlog::info("KV selection: H2O, keeping {:.0f}% of the context ({:.0f}% of it recent)", 100 * o.budget,
                 100 * o.recent_share);
    return std::unique_ptr<KvSelector>(
        std::make_unique<H2OSelector>(H2OConfig::FromOptions(ctx.config.kv_selection), ctx.backend));
  };
  return registry.Register(std::move(p));
}

}  // namespace kvflow
