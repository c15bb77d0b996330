// `kvflow prefill-bench`: time-to-first-token of one long prompt prefilled across the ranks of an
// mpirun job (KV-Runahead's chain or the TSP baseline; one rank: a plain prefill), and KV-Runahead's
// offline partition search, which writes the partition lookup table the server reads.
//
//   mpirun -np 1 kvflow prefill-bench --threads 2 --contexts 2048,4096,8192 --json one.json
//   mpirun -np 2 kvflow prefill-bench --threads 1 --methods kv-runahead,tsp --search --table t.json
//
// Every rank runs the same loop; each measurement starts at a barrier and is the last rank's wall
// time to its first-token logits, shared with every rank so that they all take the same decisions.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "cli/decode_bench.h"
#include "kv_runahead/chain_prefill.h"
#include "kv_runahead/partition_search.h"
#include "kv_runahead/partition_table.h"
#include "kv_runahead/prompt_prefill_service.h"
#include "distributed/world.h"
#include "kvflow/engine.h"

namespace kvflow {

struct PrefillBenchOptions {
  EngineConfig engine;
  std::vector<int64_t> contexts = {2048, 4096, 8192};
  std::vector<std::string> methods = {"kv-runahead", "tsp"};
  int repeats = 3;
  int search_repeats = 1;         // timed runs per partition the search tries
  bool search = false;            // KVR-S: search each context's partition, write --table
  std::string table;              // the lookup table to write (--search) or to read (KVR-P rows)
  std::vector<int64_t> predict;   // contexts to run with the table's interpolated partition (KVR-P)
  int64_t granularity = 64;       // the search's finest step, in tokens
  double timeout_s = 300;
  std::string json_out;
};

namespace prefill_bench {

struct Row {
  int64_t context = 0;
  std::string method;     // "single", "kv-runahead" or "tsp"
  std::string partition;  // "even", "searched", "predicted", "one rank"
  std::vector<int64_t> bounds;
  std::vector<double> ttft_s;  // every timed run
  double median_s = 0;
  int64_t bytes_sent_last_rank = 0;
  double wait_s_last_rank = 0;
};

// One rank's model, pool and block table, sized for the longest context.
struct RankState {
  std::unique_ptr<Backend> backend;
  std::vector<BlockId> table;
  std::vector<int32_t> prompt;
};

inline Result<RankState> OpenRank(const PrefillBenchOptions& opt) {
  RankState state;
  const int64_t longest = *std::max_element(opt.contexts.begin(), opt.contexts.end());
  KVFLOW_ASSIGN_OR_RETURN(state.backend, dist::CreatePrefillRankBackend(opt.engine, longest));
  for (int b = 0; b < state.backend->kv_layout().num_blocks; ++b) state.table.push_back(b);
  state.prompt = SyntheticPrompt(static_cast<int>(longest), state.backend->model_config().vocab_size, 17);
  return state;
}

// One timed prefill of the first `context` prompt tokens at `bounds`; every rank returns the last
// rank's figures.
inline Result<Row> TimeOnce(dist::Communicator& comm, RankState& state, const PrefillBenchOptions& opt,
                            dist::PrefillMethod method, const std::vector<int64_t>& bounds, int tag_base) {
  dist::DistributedPrefillOptions options;
  options.method = method;
  options.timeout_s = opt.timeout_s;
  options.tag_base = tag_base;
  const int r = comm.rank();
  std::span<const int32_t> chunk(state.prompt.data() + bounds[r], static_cast<size_t>(bounds[r + 1] - bounds[r]));
  std::vector<float> logits;
  dist::DistributedPrefillStats stats;
  KVFLOW_RETURN_IF_ERROR(comm.Barrier(opt.timeout_s));
  KVFLOW_RETURN_IF_ERROR(dist::RunDistributedPrefill(comm, *state.backend, chunk, bounds, state.table, options, logits, &stats));
  // The last rank's clock is the TTFT; everyone needs it to take the same next step.
  double mine[3] = {stats.total_seconds, static_cast<double>(stats.bytes_sent), stats.wait_seconds};
  std::vector<double> all(3 * static_cast<size_t>(comm.size()));
  KVFLOW_RETURN_IF_ERROR(comm.AllGather(std::as_bytes(std::span<const double>(mine)),
                                        std::as_writable_bytes(std::span<double>(all)), opt.timeout_s));
  const size_t last = 3 * static_cast<size_t>(comm.size() - 1);
  Row row;
  row.bounds = bounds;
  row.ttft_s = {all[last]};
  // What the last rank received is what its predecessor sent.
  row.bytes_sent_last_rank = comm.size() > 1 ? static_cast<int64_t>(all[last - 3 + 1]) : 0;
  row.wait_s_last_rank = all[last + 2];
  return row;
}

inline Result<Row> TimeRepeated(dist::Communicator& comm, RankState& state, const PrefillBenchOptions& opt,
                                dist::PrefillMethod method, const std::vector<int64_t>& bounds, int& tag_base,
                                int repeats = 0) {
  Row row;
  for (int i = 0; i < (repeats > 0 ? repeats : opt.repeats); ++i) {
    KVFLOW_ASSIGN_OR_RETURN(Row once, TimeOnce(comm, state, opt, method, bounds, tag_base));
    tag_base += state.backend->kv_layout().num_layers;
    row.bounds = once.bounds;
    row.ttft_s.push_back(once.ttft_s.front());
    row.bytes_sent_last_rank = once.bytes_sent_last_rank;
    row.wait_s_last_rank = once.wait_s_last_rank;
  }
  row.median_s = Median(row.ttft_s);
  row.context = bounds.back();
  row.method = comm.size() == 1 ? "single" : dist::PrefillMethodName(method);
  return row;
}

inline std::vector<int64_t> EvenBounds(int64_t context, int p) { return dist::EvenPartition(context, p).value().bounds; }


}  // namespace prefill_bench

inline int RunPrefillBench(PrefillBenchOptions opt) {
  using namespace prefill_bench;
  auto comm_or = dist::OpenWorldCommunicator();
  if (!comm_or.ok()) {
    std::fprintf(stderr, "error: %s\n", comm_or.status().ToString().c_str());
    return 1;
  }
  dist::Communicator& comm = *comm_or.value();
  const int p = comm.size();
  const bool lead = comm.rank() == p - 1;  // the last rank reports
  if (!lead) spdlog::set_level(spdlog::level::warn);
  const bool contexts_ok = !opt.contexts.empty() && std::all_of(opt.contexts.begin(), opt.contexts.end(),
                                                                   [p](int64_t c) { return c >= std::max(p, 256); });
  if (!contexts_ok || opt.repeats < 1 || opt.search_repeats < 1 || opt.granularity < 1) {
    std::fprintf(stderr, "error: prefill-bench needs contexts of at least 256 tokens, repeats >= 1 and granularity >= 1\n");
    return 2;
  }
  std::vector<dist::PrefillMethod> methods;
  for (const std::string& name : opt.methods) {
    auto m = dist::ParsePrefillMethod(name);
    if (!m.ok()) {
      std::fprintf(stderr, "error: %s\n", m.status().ToString().c_str());
      return 2;
    }
    methods.push_back(m.value());
  }
  if (p == 1) methods = {dist::PrefillMethod::kKvRunahead};  // one rank: a plain prefill
  auto state_or = OpenRank(opt);
  if (!state_or.ok()) {
    std::fprintf(stderr, "error: rank %d: %s\n", comm.rank(), state_or.status().ToString().c_str());
    return 1;
  }
  RankState& state = state_or.value();
  if (lead) {
    spdlog::info("prefill-bench: {} rank(s) over {}, {} on {}, contexts {}", p, comm.Describe(),
                 state.backend->Describe(), opt.engine.model, fmt::join(opt.contexts, ", "));
  }
  std::vector<Row> rows;
  int tag_base = 0;
  auto fail = [&](const Status& st) {
    std::fprintf(stderr, "error: rank %d: %s\n", comm.rank(), st.ToString().c_str());
    return 1;
  };
  // Warm-up: page in the weights, start the threads.
  {
    auto warm = TimeOnce(comm, state, opt, methods.front(), EvenBounds(std::min<int64_t>(256, opt.contexts.front()), p),
                         tag_base);
    if (!warm.ok()) return fail(warm.status());
    tag_base += state.backend->kv_layout().num_layers;
  }
  std::optional<dist::PartitionTable> table;
  if (opt.search) {
    table.emplace(opt.engine.model, comm.Describe() + ", " + state.backend->Describe(), "kvflow prefill-bench --search");
  } else if (!opt.table.empty()) {
    table = dist::LoadPartitionTableOrWarn(opt.table);
  }
  for (int64_t context : opt.contexts) {
    for (dist::PrefillMethod method : methods) {
      auto even = TimeRepeated(comm, state, opt, method, EvenBounds(context, p), tag_base);
      if (!even.ok()) return fail(even.status());
      even->partition = p == 1 ? "one rank" : "even";
      if (lead) spdlog::info("  C={} {} {} {}: {:.3f} s", context, even->method, even->partition, dist::PartitionToString({even->bounds}), even->median_s);
      rows.push_back(*even);
      if (!opt.search || p == 1 || method != dist::PrefillMethod::kKvRunahead) continue;
      dist::PartitionSearchOptions search;
      search.granularity = opt.granularity;
      auto measure = [&](const dist::ContextPartition& partition) -> Result<double> {
        KVFLOW_ASSIGN_OR_RETURN(Row r, TimeRepeated(comm, state, opt, method, partition.bounds, tag_base,
                                                    opt.search_repeats));
        if (lead) spdlog::info("    search {}: {:.3f} s", dist::PartitionToString(partition), r.median_s);
        return r.median_s;
      };
      auto found = dist::SearchPartition(context, p, measure, search);
      if (!found.ok()) return fail(found.status());
      auto best = TimeRepeated(comm, state, opt, method, found->best.bounds, tag_base);
      if (!best.ok()) return fail(best.status());
      best->partition = "searched";
      rows.push_back(*best);
      if (lead) spdlog::info("  C={} kv-runahead searched {}: {:.3f} s ({} measurements)", context,
                             dist::PartitionToString({best->bounds}), best->median_s, found->measurements);
      dist::PartitionTableEntry entry;
      entry.num_ranks = p;
      entry.context_len = context;
      entry.fractions = dist::PartitionFractions(found->best);
      entry.ttft_s = found->best_ttft_s;
      entry.even_ttft_s = found->even_ttft_s;
      entry.measurements = found->measurements;
      if (Status st = table->Add(entry); !st.ok()) return fail(st);
    }
  }
  if (opt.search && lead && !opt.table.empty()) {
    if (Status st = table->Save(opt.table); !st.ok()) return fail(st);
    spdlog::info("prefill-bench: wrote the partition table {}", opt.table);
  }
  // KVR-P: the table's partition for contexts it may not hold (interpolated).
  for (int64_t context : opt.predict) {
    if (p == 1) break;
    auto choice = dist::ChoosePartition(table ? &*table : nullptr, context, p);
    if (!choice.ok()) return fail(choice.status());
    auto row = TimeRepeated(comm, state, opt, dist::PrefillMethod::kKvRunahead, choice->partition.bounds, tag_base);
    if (!row.ok()) return fail(row.status());
    row->partition = std::string("predicted (") + dist::PartitionSourceName(choice->source) + ")";
    if (lead) spdlog::info("  C={} kv-runahead {} {}: {:.3f} s", context, row->partition, dist::PartitionToString({row->bounds}), row->median_s);
    rows.push_back(*row);
  }
  if (!lead) return 0;
  std::printf("| context | method | partition | bounds | TTFT median (s) | runs |\n|---:|---|---|---|---:|---|\n");
  nlohmann::json out = {{"ranks", p},
                        {"communicator", comm.Describe()},
                        {"backend", state.backend->Describe()},
                        {"model", opt.engine.model},
                        {"threads_per_rank", opt.engine.num_threads},
                        {"repeats", opt.repeats},
                        {"rows", nlohmann::json::array()}};
  for (const Row& r : rows) {
    std::string runs;
    for (double t : r.ttft_s) runs += (runs.empty() ? "" : " ") + fmt::format("{:.3f}", t);
    std::printf("| %lld | %s | %s | %s | %.3f | %s |\n", static_cast<long long>(r.context), r.method.c_str(),
                r.partition.c_str(), dist::PartitionToString({r.bounds}).c_str(), r.median_s, runs.c_str());
    out["rows"].push_back({{"context", r.context}, {"method", r.method}, {"partition", r.partition},
                           {"bounds", r.bounds}, {"ttft_s", r.ttft_s}, {"median_s", r.median_s},
                           {"bytes_received_last_rank", r.bytes_sent_last_rank},
                           {"wait_s_last_rank", r.wait_s_last_rank}});
  }
  if (!opt.json_out.empty()) {
    std::ofstream f(opt.json_out);
    f << out.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "error: cannot write %s\n", opt.json_out.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace kvflow
