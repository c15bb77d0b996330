// Registers InfiniGen as the KV selector "infinigen".
#pragma once

#include "engine/system_registry.h"

namespace kvflow {

Status RegisterInfiniGen(SystemRegistry& registry);

}  // namespace kvflow
