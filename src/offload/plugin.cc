#include "offload/plugin.h"

#include "offload/kv_prefetch.h"

namespace kvflow {
namespace {

// The offloaded pool as a KV connector: no block moves of its own (the pool is in host memory and
// the backend writes new tokens there); its loads follow the layers, each layer's reads fetched
// into the device's staging buffer during the layer before (KvPrefetchHooks).
class KvOffloadConnector final : public KvConnector {
 public:
  explicit KvOffloadConnector(const Backend& backend) : backend_(backend) {}
  std::string name() const override { return kKvOffloadConnector; }
  std::string Describe() const override { return "KV pool offloaded to host memory"; }
  WrappingHooks* layer_hooks() override { return &prefetch_; }
  void AddStats(EngineStats& stats) const override {
    if (const OffloadedKvPool* pool = backend_.As<OffloadedKvPool>()) stats.kv_offload = pool->kv_offload_stats();
  }

 private:
  const Backend& backend_;
  KvPrefetchHooks prefetch_;
};

}  // namespace

Status RegisterKvOffload(SystemRegistry& registry) {
  KvConnectorPlugin p;
  p.info.name = kKvOffloadConnector;
  p.info.label = "kv_offload";
  // The tier fetches what the target's own steps read; a verification is a target step of several
  // tokens. A draft model keeps its (small) pool on the device, and TriForce's middle level reads
  // copies it keeps resident (OffloadedKvPool::KeepResident), so speculation of every kind composes.
  p.info.excludes = {
      {"swap preemption", "kv_offload keeps the KV pool in host memory already: preemption_mode swap has nowhere to "
                          "swap to; use recompute or auto"},
  };
  p.enabled = [](const EngineConfig& c) { return c.kv_offload.enabled; };
  p.create = [](const KvConnectorContext& ctx) -> Result<std::unique_ptr<KvConnector>> {
    if (ctx.backend.As<OffloadedKvPool>() == nullptr) {
      return Status::Internal("kv_offload is on but " + ctx.backend.Describe() + " keeps its KV pool on the device");
    }
    return std::unique_ptr<KvConnector>(std::make_unique<KvOffloadConnector>(ctx.backend));
  };
  p.info.metrics = [](const EngineStats& s, std::vector<SystemMetric>& out) {
    const KvOffloadStats& o = s.kv_offload;
    AddCounter(out, "kvflow:kv_offload_prefetches_total",
               "Layer fetches from the host KV pool issued during the layer before (--kv-offload).",
               static_cast<double>(o.prefetches));
    AddCounter(out, "kvflow:kv_offload_on_demand_fetches_total",
               "Layer fetches attention issued itself (layer 0; selections known only at their layer).",
               static_cast<double>(o.on_demand_fetches));
    AddCounter(out, "kvflow:kv_offload_bytes_fetched_total", "K/V bytes fetched from the host KV pool.",
               static_cast<double>(o.bytes_fetched));
    AddCounter(out, "kvflow:kv_offload_bytes_written_total", "K/V bytes of new tokens written to the host KV pool.",
               static_cast<double>(o.bytes_written));
    AddCounter(out, "kvflow:kv_offload_fetch_seconds_total", "Time spent fetching from the host KV pool.",
               o.fetch_seconds);
  };
  return registry.Register(std::move(p));
}

}  // namespace kvflow
