// The real executor: a trace replayed against the in-process kvflow::Engine in wall-clock time.
#pragma once

#include <string>

#include "serving/common.h"
#include "serving/trace.h"
#include "serving/run_record.h"

namespace kvflow::bench::serving {

// ---- real executor --------------------------------------------------------------------------

// User + system CPU time of this process (all threads).
double ProcessCpuSeconds();

// CPU seconds all processes on the machine have used (/proc/stat: everything but idle and iowait),
// to tell how much of a run's time other work took on shared cores.
double MachineBusyCpuSeconds();

// The rest of the machine's load over a run, in cores: busy CPU beyond `own_cpu_s`, per second.
Json OtherLoadCores(double machine_busy_s, double own_cpu_s, double wall_s);

// Replays the trace against the Engine in wall-clock time: each request is added once its arrival
// time has passed, the engine steps while it has work and sleeps until the next arrival when idle.
Result<RunRecord> RunEngine(const Trace& trace, double rate, const std::string& policy, const ServingConfig& cfg,
                            const ModelChoice& model, int num_threads);

}  // namespace kvflow::bench::serving
