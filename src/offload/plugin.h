// Registers the host-memory KV tier "kv_offload" as a KV connector (the backends implement the pool; offload/
// kv_prefetch.h schedules its fetches).
#pragma once

#include "engine/system_registry.h"

namespace kvflow {

Status RegisterKvOffload(SystemRegistry& registry);

}  // namespace kvflow
