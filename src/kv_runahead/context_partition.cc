#include "kv_runahead/context_partition.h"

#include <spdlog/fmt/fmt.h>
#include <spdlog/fmt/ranges.h>

#include <algorithm>
#include <cmath>

namespace kvflow::dist {

std::string PartitionToString(const ContextPartition& partition) {
  return fmt::format("[{}]", fmt::join(partition.bounds, ", "));
}

Status ValidatePartition(const ContextPartition& partition) {
  const auto& b = partition.bounds;
  if (b.size() < 2) {
    return Status::InvalidArgument(fmt::format("context partition {} needs at least 2 bounds (one chunk), has {}",
                                               PartitionToString(partition), b.size()));
  }
  if (b.front() != 0) {
    return Status::InvalidArgument(
        fmt::format("context partition {} must start at token 0, not {}", PartitionToString(partition), b.front()));
  }
  for (size_t i = 1; i < b.size(); ++i) {
    if (b[i] <= b[i - 1]) {
      return Status::InvalidArgument(fmt::format("context partition {}: chunk {} [{}, {}) is empty; every rank needs >= 1 token",
                                                 PartitionToString(partition), i - 1, b[i - 1], b[i]));
    }
  }
  return Status::Ok();
}

Status ValidatePartition(const ContextPartition& partition, int64_t context_len, int num_ranks) {
  KVFLOW_RETURN_IF_ERROR(ValidatePartition(partition));
  if (partition.num_ranks() != num_ranks) {
    return Status::InvalidArgument(fmt::format("context partition {} has {} chunks for {} ranks",
                                               PartitionToString(partition), partition.num_ranks(), num_ranks));
  }
  if (partition.context_len() != context_len) {
    return Status::InvalidArgument(fmt::format("context partition {} covers {} tokens, the prompt has {}",
                                               PartitionToString(partition), partition.context_len(), context_len));
  }
  return Status::Ok();
}

Result<ContextPartition> EvenPartition(int64_t context_len, int num_ranks) {
  if (num_ranks < 1) return Status::InvalidArgument(fmt::format("cannot partition a context over {} ranks", num_ranks));
  if (context_len < num_ranks) {
    return Status::InvalidArgument(
        fmt::format("a context of {} tokens cannot give each of {} ranks a token", context_len, num_ranks));
  }
  const int64_t base = context_len / num_ranks;
  const int64_t extra = context_len % num_ranks;
  ContextPartition p;
  p.bounds.reserve(static_cast<size_t>(num_ranks) + 1);
  p.bounds.push_back(0);
  for (int64_t i = 0; i < num_ranks; ++i) p.bounds.push_back(p.bounds.back() + base + (i < extra ? 1 : 0));
  return p;
}

std::vector<double> PartitionFractions(const ContextPartition& partition) {
  std::vector<double> f;
  const double total = static_cast<double>(partition.context_len());
  for (int i = 0; i < partition.num_ranks(); ++i) f.push_back(static_cast<double>(partition.chunk_size(i)) / total);
  return f;
}

Status ValidateFractions(std::span<const double> fractions, double tolerance) {
  if (fractions.empty()) return Status::InvalidArgument("a partition needs at least one fraction");
  double sum = 0;
  for (size_t i = 0; i < fractions.size(); ++i) {
    if (!std::isfinite(fractions[i]) || fractions[i] <= 0) {
      return Status::InvalidArgument(fmt::format("partition fraction {} is {}; every rank's share must be > 0", i, fractions[i]));
    }
    sum += fractions[i];
  }
  if (std::abs(sum - 1.0) > tolerance) {
    return Status::InvalidArgument(fmt::format("partition fractions [{}] sum to {}, not 1", fmt::join(fractions, ", "), sum));
  }
  return Status::Ok();
}

Result<ContextPartition> PartitionFromFractions(std::span<const double> fractions, int64_t context_len) {
  double total = 0;
  for (double f : fractions) {
    if (!std::isfinite(f) || f <= 0) {
      return Status::InvalidArgument(fmt::format("partition weights [{}] must all be finite and > 0", fmt::join(fractions, ", ")));
    }
    total += f;
  }
  const int p = static_cast<int>(fractions.size());
  if (p == 0) return Status::InvalidArgument("a partition needs at least one fraction");
  if (context_len < p) {
    return Status::InvalidArgument(fmt::format("a context of {} tokens cannot give each of {} ranks a token", context_len, p));
  }
  ContextPartition out;
  out.bounds.assign(static_cast<size_t>(p) + 1, 0);
  out.bounds.back() = context_len;
  double cumulative = 0;
  for (int i = 1; i < p; ++i) {
    cumulative += fractions[static_cast<size_t>(i) - 1];
    const auto exact = static_cast<int64_t>(std::llround(cumulative / total * static_cast<double>(context_len)));
    // Room for one token in this chunk and in each of the p-i chunks after it.
    out.bounds[static_cast<size_t>(i)] = std::clamp(exact, out.bounds[static_cast<size_t>(i) - 1] + 1, context_len - (p - i));
  }
  return out;
}

Result<ContextPartition> AlignPartition(const ContextPartition& partition, int64_t alignment) {
  KVFLOW_RETURN_IF_ERROR(ValidatePartition(partition));
  if (alignment < 1) return Status::InvalidArgument(fmt::format("partition alignment must be >= 1, not {}", alignment));
  const int p = partition.num_ranks();
  const int64_t c = partition.context_len();
  // Inner bounds are multiples m*alignment with 1 <= m <= last_multiple, strictly ascending.
  const int64_t last_multiple = (c - 1) / alignment;
  if (last_multiple < p - 1) {
    return Status::InvalidArgument(fmt::format("a context of {} tokens has {} inner positions aligned to {}, too few for {} ranks",
                                               c, last_multiple, alignment, p));
  }
  ContextPartition out = partition;
  int64_t previous_multiple = 0;
  for (int i = 1; i < p; ++i) {
    const double ratio = static_cast<double>(partition.bounds[static_cast<size_t>(i)]) / static_cast<double>(alignment);
    const int64_t m = std::clamp(static_cast<int64_t>(std::llround(ratio)), previous_multiple + 1, last_multiple - (p - 1 - i));
    out.bounds[static_cast<size_t>(i)] = m * alignment;
    previous_multiple = m;
  }
  return out;
}

}  // namespace kvflow::dist
