#include "engine/drafter.h"

#include <algorithm>

#include <spdlog/spdlog.h>

namespace kvflow {

namespace {
void ClearDrafts(std::span<DraftJob* const> jobs) {
  for (DraftJob* job : jobs) {
    job->drafts.clear();
    job->probs.clear();
  }
}
}  // namespace

void ProposeInChunks(std::span<DraftJob* const> jobs, size_t chunk,
                     const std::function<Status(std::span<DraftJob* const>)>& propose, const char* who,
                     int64_t& failures) {
  ClearDrafts(jobs);
  chunk = std::max<size_t>(1, chunk);
  for (size_t begin = 0; begin < jobs.size(); begin += chunk) {
    const auto part = jobs.subspan(begin, std::min(jobs.size() - begin, chunk));
    if (Status st = propose(part); !st.ok()) {
      if (failures++ == 0) spdlog::error("{}: {} (these steps run without drafts)", who, st.ToString());
      ClearDrafts(part);
    }
  }
}

}  // namespace kvflow
