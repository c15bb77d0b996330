// Finds stop strings in streamed text, holding back any tail that could still become one.
#pragma once

#include <string>
#include <vector>

namespace kvflow {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  // Appends `text`; returns the part that is now safe to emit. Sets stopped() when a stop string
  // appeared, in which case the returned text ends right before it.
  std::string Push(const std::string& text);
  // Everything still held back (call when the sequence ends for another reason).
  std::string Flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace kvflow
