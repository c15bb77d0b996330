#include "offload/plugin.h"

#include "offload/kv_prefetch.h"

namespace kvflow {

Status RegisterKvOffload(SystemRegistry& registry) {
  KvTierPlugin p;
  p.info.name = kKvOffloadTier;
  p.info.label = "kv_offload";
  // The tier fetches what the target's own passes read. N-gram speculation runs no passes of its
  // own (its verification is a target step of several tokens), so it composes.
  p.info.excludes = {
      {"drafter:triforce", "TriForce's middle passes read the KV cache through lanes the offload tier does not fetch"},
      {"draft model", "the draft model keeps a KV pool of its own on the device"},
      {"swap preemption", "kv_offload keeps the KV pool in host memory already: preemption_mode swap has nowhere to "
                          "swap to; use recompute or auto"},
  };
  // An offloaded pool fetches each layer's reads during the layer before.
  p.create_hooks = [] { return std::unique_ptr<WrappingHooks>(std::make_unique<KvPrefetchHooks>()); };
  return registry.Register(std::move(p));
}

}  // namespace kvflow
