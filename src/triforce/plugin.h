// Registers TriForce as the drafter "triforce".
#pragma once

#include "engine/system_registry.h"

namespace kvflow {

Status RegisterTriForce(SystemRegistry& registry);

}  // namespace kvflow
