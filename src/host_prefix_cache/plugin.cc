#include "host_prefix_cache/plugin.h"

#include <spdlog/spdlog.h>

#include "host_prefix_cache/host_prefix_index.h"

namespace kvflow {
namespace {

class HostPrefixCacheConnector final : public KvConnector {
 public:
  HostPrefixCacheConnector(int block_size, int first_host_block, int num_blocks, int64_t block_bytes)
      : index_(block_size, first_host_block, num_blocks, block_bytes), block_bytes_(block_bytes) {}

  std::string name() const override { return "host_prefix_cache"; }
  std::string Describe() const override {
    return "host prefix cache of " + std::to_string(index_.num_blocks()) + " blocks (" +
           std::to_string(index_.num_blocks() * block_bytes_ >> 20) + " MiB)";
  }
  KvConnectorScheduler* scheduler_side() override { return &index_; }
  Status Save(const SchedulerOutput&, const KvConnectorMoves* moves, Backend& backend) override {
    return moves == nullptr ? Status::Ok() : backend.CopyBlocks(moves->save, BlockCopyKind::kDeviceToHost);
  }
  Status Load(const SchedulerOutput&, const KvConnectorMoves* moves, Backend& backend) override {
    return moves == nullptr ? Status::Ok() : backend.CopyBlocks(moves->load, BlockCopyKind::kHostToDevice);
  }
  void AddStats(EngineStats& stats) const override { stats.host_prefix_cache = index_.stats(); }

 private:
  HostPrefixIndex index_;
  int64_t block_bytes_;
};

}  // namespace

Status RegisterHostPrefixCache(SystemRegistry& registry) {
  KvConnectorPlugin p;
  p.info.name = "host_prefix_cache";
  p.info.label = "the host prefix cache";
  p.info.excludes = {
      {"kv_connector:kv_offload", "an offloaded KV pool is in host memory already"},
  };
  p.info.validate = [](const EngineConfig& c) {
    if (c.host_prefix_cache.bytes < 0 || c.host_prefix_cache.num_blocks < -1) {
      return Status::InvalidArgument("host_prefix_cache (--host-prefix-cache) must be >= 0");
    }
    if (!c.enable_prefix_caching) {
      return Status::InvalidArgument("the host prefix cache keeps blocks the device prefix cache evicts: it needs "
                                     "prefix caching (--enable-prefix-caching)");
    }
    return Status::Ok();
  };
  p.info.validate_when_off = [](const EngineConfig& c) {
    if (c.host_prefix_cache.bytes < 0 || c.host_prefix_cache.num_blocks < -1) {
      return Status::InvalidArgument("host_prefix_cache (--host-prefix-cache) must be >= 0");
    }
    return Status::Ok();
  };
  p.enabled = [](const EngineConfig& c) { return c.host_prefix_cache.enabled(); };
  p.host_blocks = [](const EngineConfig& c) { return std::max(0, c.host_prefix_cache.num_blocks); };
  p.create = [](const KvConnectorContext& ctx) -> Result<std::unique_ptr<KvConnector>> {
    const KvCacheLayout& layout = ctx.backend.kv_layout();
    const int64_t block_bytes = ctx.backend.kv_token_bytes() * layout.block_size * layout.num_layers;
    if (ctx.num_host_blocks <= 0) {
      return Status::InvalidArgument("the host prefix cache got no host blocks (host_prefix_cache smaller than one "
                                     "KV block of " + std::to_string(block_bytes) + " bytes?)");
    }
    return std::unique_ptr<KvConnector>(std::make_unique<HostPrefixCacheConnector>(
        layout.block_size, ctx.host_block_begin, ctx.num_host_blocks, block_bytes));
  };
  p.info.metrics = [](const EngineStats& s, std::vector<SystemMetric>& out) {
    // The host tier of the prefix cache (--host-prefix-cache); zero when it is off.
    const HostPrefixCacheStats& hp = s.host_prefix_cache;
    AddGauge(out, "kvflow:host_prefix_cache_blocks_total", "Blocks the host prefix cache holds at most.",
               static_cast<double>(hp.capacity_blocks));
    AddGauge(out, "kvflow:host_prefix_cache_blocks_used", "Blocks held in the host prefix cache.",
               static_cast<double>(hp.used_blocks));
    AddCounter(out, "kvflow:host_prefix_cache_queried_blocks_total",
               "Prompt blocks looked up in host memory past the device's hits.", static_cast<double>(hp.queried_blocks));
    AddCounter(out, "kvflow:host_prefix_cache_hit_blocks_total",
               "Of those, found in host memory and loaded instead of computed.", static_cast<double>(hp.hit_blocks));
    AddCounter(out, "kvflow:host_prefix_cache_saved_blocks_total",
               "Blocks the device prefix cache evicted that were saved to host memory.", static_cast<double>(hp.saved_blocks));
    AddCounter(out, "kvflow:host_prefix_cache_evicted_blocks_total",
               "Host blocks dropped to make room (least recently used first).", static_cast<double>(hp.evicted_blocks));
    AddCounter(out, "kvflow:host_prefix_cache_bytes_saved_total", "K/V bytes copied device -> host.",
               static_cast<double>(hp.bytes_saved));
    AddCounter(out, "kvflow:host_prefix_cache_bytes_loaded_total", "K/V bytes copied host -> device.",
               static_cast<double>(hp.bytes_loaded));
  };
  return registry.Register(std::move(p));
}

}  // namespace kvflow
