#include "infinigen/plugin.h"

#include <limits>

#include <spdlog/spdlog.h>

#include "infinigen/infinigen_selector.h"
#include "infinigen/skew_file.h"

namespace kvflow {

namespace {

// Moves the speculation onto the backend's device where asked (or, with auto, where it can), the
// partial key cache sized for the pool's tokens plus a chunk of slack per sequence, at most
// max_num_seqs full contexts, halved while the device lacks the memory (down to one context).
Status PlaceSpeculation(const KvSelectorContext& ctx, InfiniGenSelector& selector) {
  const InfiniGenOptions& o = ctx.config.kv_selection.infinigen;
  KVFLOW_ASSIGN_OR_RETURN(const SpeculationDevice where, ParseSpeculationDevice(o.speculate_on));
  if (where == SpeculationDevice::kHost) {
    spdlog::info("InfiniGen: speculation on the host (infinigen_speculate_on host)");
    return Status::Ok();
  }
  auto* device = ctx.backend.As<DeviceKvSpeculation>();
  std::string why;
  if (device == nullptr) {
    why = ctx.backend.Describe() + " has no device speculation";
  } else if (o.host_kv_tokens > 0) {
    why = "the host KV pool cap (infinigen_host_kv_tokens) keeps its eviction state on the host";
  } else {
    why = HostOnlySettings(InfiniGenConfig::FromOptions(ctx.config.kv_selection));
  }
  if (!why.empty()) {
    if (where == SpeculationDevice::kDevice) return Status::Unsupported("infinigen_speculate_on device: " + why);
    if (device != nullptr) spdlog::info("InfiniGen: speculation on the host: {}", why);
    return Status::Ok();
  }
  const KvCacheLayout& layout = ctx.backend.kv_layout();
  const int64_t rows = device->partial_key_chunk_rows();
  const int64_t per_context = (ctx.config.max_model_len + rows - 1) / rows;
  const int64_t pool = (static_cast<int64_t>(layout.num_blocks) * layout.block_size + rows - 1) / rows;
  int64_t chunks = std::min(pool + ctx.config.max_num_seqs, per_context * ctx.config.max_num_seqs);
  chunks = std::max<int64_t>(std::min<int64_t>(chunks, std::numeric_limits<int32_t>::max() / 2), per_context);
  Status placed = Status::Ok();
  for (;;) {
    placed = selector.SpeculateOnDevice(static_cast<int>(chunks));
    if (placed.code() != StatusCode::kResourceExhausted || chunks / 2 < per_context) break;
    chunks /= 2;
  }
  if (placed.ok()) {
    spdlog::info("InfiniGen: speculation on the device, partial key cache of {} tokens ({:.2f} GiB)",
                 chunks * rows, chunks * device->partial_key_chunk_bytes(selector.partial_columns()) / double(1 << 30));
    return Status::Ok();
  }
  if (where == SpeculationDevice::kDevice) return placed;
  spdlog::warn("InfiniGen: speculation on the host, the device's failed: {}", placed.message());
  return Status::Ok();
}

}  // namespace

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
    KVFLOW_RETURN_IF_ERROR(ParseCountRule(c.kv_selection.infinigen.count_rule).status());
    KVFLOW_ASSIGN_OR_RETURN(const SpeculationDevice where, ParseSpeculationDevice(c.kv_selection.infinigen.speculate_on));
    if (where == SpeculationDevice::kDevice && c.kv_selection.infinigen.host_kv_tokens > 0) {
      return Status::InvalidArgument("infinigen_speculate_on device cannot keep a host KV pool cap "
                                     "(infinigen_host_kv_tokens): its eviction state lives on the host; use auto or host");
    }
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
    if (ctx.backend.model_config().qk_norm) {
      // The speculation multiplies partial rows of the layer's input by partial Q/K weights; a
      // q/k norm between projection and RoPE needs whole heads (or all of q), which it does not compute.
      return Status::Unsupported("kv_selection infinigen: the model normalizes q and k (" +
                                 ctx.backend.model_config().architecture +
                                 "), which InfiniGen's partial-weight speculation cannot reproduce");
    }
    const std::string skew_path = o.skew_file.empty() ? DefaultSkewPath(ctx.model_path) : o.skew_file;
    KVFLOW_ASSIGN_OR_RETURN(SkewTable skew, ReadSkewTable(skew_path, ctx.model));
    const std::string host_pool =
        o.host_kv_tokens > 0 ? fmt::format(", host KV pool capped at {} tokens per sequence and layer ({} eviction)",
                                           o.host_kv_tokens, o.eviction)
                             : std::string();
    const std::string forced =
        o.sink_tokens > 0 || o.recent_tokens > 0
            ? fmt::format(", {} sink and {} recent tokens always read", o.sink_tokens, o.recent_tokens)
            : std::string();
    spdlog::info("KV selection: InfiniGen, skewing file {} ({} of {} columns per head from {} tokens), speculated "
                 "{}, count {}, alpha {}, cap {:.0f}%, layers 0-{} dense{}{}",
                 skew_path, skew.num_partial_columns, skew.head_dim, skew.calibration_tokens, o.speculate_from,
                 o.count_rule, o.alpha, 100 * o.max_fraction, o.dense_layers - 1, forced, host_pool);
    auto selector = std::make_unique<InfiniGenSelector>(InfiniGenConfig::FromOptions(ctx.config.kv_selection),
                                                        std::move(skew), ctx.backend);
    KVFLOW_RETURN_IF_ERROR(PlaceSpeculation(ctx, *selector));
    return std::unique_ptr<KvSelector>(std::move(selector));
  };  return registry.Register(std::move(p));
}

}  // namespace kvflow
