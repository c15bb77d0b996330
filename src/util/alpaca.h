// Alpaca's prompt as the length predictor is trained on it and the serving benchmark replays it:
// both must build it the same way, or the predictions are for prompts the predictor never saw.
#pragma once

#include <string>

namespace kvflow {

// The instruction, then its input (when there is one) on a new line.
inline std::string AlpacaPrompt(const std::string& instruction, const std::string& input) {
  return input.empty() ? instruction : instruction + "\n" + input;
}

}  // namespace kvflow
