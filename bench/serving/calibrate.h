// The calibrate subcommand: times Engine::Step() on prefill and decode batches and fits the sim's cost model.
#pragma once

#include <string>
#include <vector>

#include "serving/common.h"

namespace kvflow::bench::serving {

// ---- calibrate ------------------------------------------------------------------------------

struct CalibrationOptions {
  std::string model = kDefaultModel;
  std::vector<int> prefill_lens{16, 32, 64, 128, 256, 512};
  std::vector<int> decode_batches{1, 2, 4, 8, 16, 32};
  std::vector<int> decode_contexts{64, 128, 256, 512};
  int reps = 7;
  int num_threads = 0;
  std::string out_dir = kResultsDir;
};

int RunCalibrate(const CalibrationOptions& opt, bool model_explicit, const std::vector<std::string>& argv);

}  // namespace kvflow::bench::serving
