// Registers the host prefix cache "host_prefix_cache" as a KV connector (host_prefix_index.h plans
// its saves and loads; the backend's CopyBlocks carries them out).
#pragma once

#include "engine/system_registry.h"

namespace kvflow {

Status RegisterHostPrefixCache(SystemRegistry& registry);

}  // namespace kvflow
