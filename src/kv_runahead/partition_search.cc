#include "kv_runahead/partition_search.h"

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <map>
#include <optional>
#include <vector>

namespace kvflow::dist {

namespace {

// The measurement behind a cache: each distinct partition runs once; remembers the best seen.
class CachedMeasurement {
 public:
  explicit CachedMeasurement(const TtftMeasurement& measure) : measure_(measure) {}

  Result<double> operator()(const ContextPartition& partition) {
    auto it = ttft_.find(partition.bounds);
    if (it != ttft_.end()) return it->second;
    KVFLOW_ASSIGN_OR_RETURN(double ttft, measure_(partition));
    if (!std::isfinite(ttft) || ttft < 0) {
      return Status::InvalidArgument(
          fmt::format("TTFT measurement of partition {} returned {} s", PartitionToString(partition), ttft));
    }
    spdlog::debug("partition search: {} -> {:.6f} s", PartitionToString(partition), ttft);
    ttft_.emplace(partition.bounds, ttft);
    if (!best_ || ttft < best_ttft_) {
      best_ = partition;
      best_ttft_ = ttft;
    }
    return ttft;
  }

  int64_t measurements() const { return static_cast<int64_t>(ttft_.size()); }
  const ContextPartition& best() const { return *best_; }
  double best_ttft() const { return best_ttft_; }

 private:
  const TtftMeasurement& measure_;
  std::map<std::vector<int64_t>, double> ttft_;
  std::optional<ContextPartition> best_;
  double best_ttft_ = 0;
};

// The step split points move by: the granularity, or single tokens when the context is too short
// to give every rank a multiple of it.
int64_t EffectiveGranularity(int64_t context_len, int num_ranks, int64_t granularity) {
  return (context_len - 1) / granularity >= num_ranks - 1 ? granularity : 1;
}

Status ValidateSearch(int64_t context_len, int num_ranks, const PartitionSearchOptions& options) {
  if (num_ranks < 2) return Status::InvalidArgument(fmt::format("a partition search needs >= 2 ranks, not {}", num_ranks));
  if (context_len < num_ranks) {
    return Status::InvalidArgument(fmt::format("a context of {} tokens cannot give each of {} ranks a token", context_len, num_ranks));
  }
  if (options.granularity < 1) return Status::InvalidArgument(fmt::format("search granularity {} must be >= 1", options.granularity));
  if (options.points_per_side < 1) {
    return Status::InvalidArgument(fmt::format("grid search points_per_side {} must be >= 1", options.points_per_side));
  }
  return Status::Ok();
}

Result<PartitionSearchResult> Finish(CachedMeasurement& cache, const ContextPartition& even, const char* method) {
  KVFLOW_ASSIGN_OR_RETURN(double even_ttft, cache(even));
  PartitionSearchResult r{cache.best(), cache.best_ttft(), even, even_ttft, cache.measurements()};
  spdlog::info("partition search ({}): best {} {:.6f} s, even {:.6f} s ({:.3f}x), {} measurements", method,
               PartitionToString(r.best), r.best_ttft_s, r.even_ttft_s, r.even_ttft_s / r.best_ttft_s, r.measurements);
  return r;
}

}  // namespace

Result<PartitionSearchResult> SearchPartitionBinary(int64_t context_len, const TtftMeasurement& measure,
                                                    const PartitionSearchOptions& options) {
  KVFLOW_RETURN_IF_ERROR(ValidateSearch(context_len, 2, options));
  KVFLOW_ASSIGN_OR_RETURN(ContextPartition even, EvenPartition(context_len, 2));
  CachedMeasurement cache(measure);
  KVFLOW_RETURN_IF_ERROR(cache(even).status());

  // Split points k * g for k in [1, (C-1)/g]. Golden-section search: the two probes sit at fixed
  // fractions of the bracket, so early steps compare splits far apart, whose TTFTs differ by more
  // than run-to-run noise (probing the slope between neighbours, as a plain binary search does, is
  // decided by noise of a few percent and can leave the optimum behind at the first step).
  const int64_t g = EffectiveGranularity(context_len, 2, options.granularity);
  auto at = [&](int64_t k) { return cache(ContextPartition{{0, k * g, context_len}}); };
  constexpr double kInverseGolden = 0.6180339887498949;
  int64_t lo = 1, hi = (context_len - 1) / g;
  while (hi - lo > 2) {
    const int64_t span = static_cast<int64_t>(std::lround(kInverseGolden * static_cast<double>(hi - lo)));
    const int64_t left = std::min(hi - span, lo + span - 1), right = std::max(lo + span, left + 1);
    KVFLOW_ASSIGN_OR_RETURN(double at_left, at(left));
    KVFLOW_ASSIGN_OR_RETURN(double at_right, at(right));
    if (at_left <= at_right) {
      hi = right;
    } else {
      lo = left;
    }
  }
  for (int64_t k = lo; k < hi; ++k) KVFLOW_RETURN_IF_ERROR(at(k).status());
  KVFLOW_RETURN_IF_ERROR(at(hi).status());
  return Finish(cache, even, "binary");
}

Result<PartitionSearchResult> SearchPartitionGrid(int64_t context_len, int num_ranks, const TtftMeasurement& measure,
                                                  const PartitionSearchOptions& options) {
  KVFLOW_RETURN_IF_ERROR(ValidateSearch(context_len, num_ranks, options));
  KVFLOW_ASSIGN_OR_RETURN(ContextPartition even, EvenPartition(context_len, num_ranks));
  CachedMeasurement cache(measure);
  KVFLOW_RETURN_IF_ERROR(cache(even).status());

  const int64_t g = EffectiveGranularity(context_len, num_ranks, options.granularity);
  const int k = options.points_per_side;
  // Coarsest step: the first grid reaches half a chunk either way, and the halving levels after it
  // as far again, so a bound can travel up to about one even chunk from where it starts.
  int64_t step = g;
  while (k * step * 2 * num_ranks < context_len) step *= 2;

  const int free_bounds = num_ranks - 1;
  for (int level = 0;; ++level) {
    const ContextPartition centre = cache.best();
    const int64_t before = cache.measurements();
    // Odometer over the (2k+1)^(p-1) offsets of the inner bounds.
    std::vector<int> offset(static_cast<size_t>(free_bounds), -k);
    for (bool more = true; more;) {
      ContextPartition candidate = centre;
      for (int i = 0; i < free_bounds; ++i) candidate.bounds[static_cast<size_t>(i) + 1] += offset[static_cast<size_t>(i)] * step;
      if (ValidatePartition(candidate).ok()) {
        KVFLOW_RETURN_IF_ERROR(cache(candidate).status());
      }
      more = false;
      for (int i = 0; i < free_bounds && !more; ++i) {
        int& o = offset[static_cast<size_t>(i)];
        if (o < k) {
          ++o;
          more = true;
        } else {
          o = -k;
        }
      }
    }
    spdlog::info("partition search (grid, {} ranks, {} tokens): level {} step {}: {} new measurements, best {} {:.6f} s",
                 num_ranks, context_len, level, step, cache.measurements() - before, PartitionToString(cache.best()),
                 cache.best_ttft());
    if (step <= g) break;
    step = std::max(g, step / 2);
  }
  return Finish(cache, even, "grid");
}

Result<PartitionSearchResult> SearchPartition(int64_t context_len, int num_ranks, const TtftMeasurement& measure,
                                              const PartitionSearchOptions& options) {
  if (num_ranks == 1) {
    KVFLOW_ASSIGN_OR_RETURN(ContextPartition whole, EvenPartition(context_len, 1));
    CachedMeasurement cache(measure);
    return Finish(cache, whole, "single rank");
  }
  if (num_ranks == 2) return SearchPartitionBinary(context_len, measure, options);
  return SearchPartitionGrid(context_len, num_ranks, measure, options);
}

}  // namespace kvflow::dist
