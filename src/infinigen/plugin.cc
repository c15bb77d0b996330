#include "infinigen/plugin.h"

#include <spdlog/spdlog.h>

#include "infinigen/infinigen_selector.h"
#include "infinigen/skew_file.h"

namespace kvflow {

Status RegisterInfiniGen(SystemRegistry& registry) {
  KvSelectorPlugin p;
  p.info.name = "infinigen";
  p.info.label = "kv_selection infinigen";
  p.info.excludes = {
      {"drafter", "verification steps read the whole cache, and the partial-key cache and host pool would follow "
                  "tokens the verification rejects"}};
  p.info.validate = [](const EngineConfig& c) -> Status {
    KVFLOW_RETURN_IF_ERROR(ParseSpeculationPoint(c.kv_selection.infinigen.speculate_from).status());
    KVFLOW_RETURN_IF_ERROR(ParseHostEvictionPolicy(c.kv_selection.infinigen.eviction).status());
    return InfiniGenConfig::FromOptions(c.kv_selection).Validate();
  };
  p.info.validate_when_off = [](const EngineConfig& c) -> Status {
    if (c.kv_selection.infinigen.host_kv_tokens != 0) {
      return Status::InvalidArgument("infinigen_host_kv_tokens caps InfiniGen's host KV pool: it needs kv_selection "
                                     "infinigen, not '" + c.kv_selection.method + "'");
    }
    // Bad InfiniGen settings are a mistake under another selector too.
    if (c.kv_selection.method.empty()) return Status::Ok();
    return InfiniGenConfig::FromOptions(c.kv_selection).Validate();
  };
  p.create = [](const KvSelectorContext& ctx) -> Result<std::unique_ptr<KvSelector>> {
    const InfiniGenOptions& o = ctx.config.kv_selection.infinigen;
    const std::string skew_path = o.skew_file.empty() ? DefaultSkewPath(ctx.model_path) : o.skew_file;
    KVFLOW_ASSIGN_OR_RETURN(SkewTable skew, ReadSkewTable(skew_path, ctx.model));
    const std::string host_pool =
        o.host_kv_tokens > 0 ? fmt::format(", host KV pool capped at {} tokens per sequence and layer ({} eviction)",
                                           o.host_kv_tokens, o.eviction)
                             : std::string();
    spdlog::info("KV selection: InfiniGen, skewing file {} ({} of {} columns per head from {} tokens), alpha {}, cap "
                 "{:.0f}%{}",
                 skew_path, skew.num_partial_columns, skew.head_dim, skew.calibration_tokens, o.alpha,
                 100 * o.max_fraction, host_pool);
    return std::unique_ptr<KvSelector>(std::make_unique<InfiniGenSelector>(
        InfiniGenConfig::FromOptions(ctx.config.kv_selection), std::move(skew), ctx.backend));
  };
  return registry.Register(std::move(p));
}

}  // namespace kvflow
