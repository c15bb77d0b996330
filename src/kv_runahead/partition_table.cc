#include "kv_runahead/partition_table.h"

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "util/checksummed_file.h"

namespace kvflow::dist {

namespace {

using nlohmann::json;

constexpr const char* kFormatName = "kvflow-partition-table";

// Fractions written to a file are rounded to decimals, so a loaded table sums to 1 only this
// closely.
constexpr double kFileFractionTolerance = 1e-4;

Status ValidateEntry(const PartitionTableEntry& e, double tolerance) {
  if (e.num_ranks < 1) return Status::InvalidArgument(fmt::format("num_ranks {} must be >= 1", e.num_ranks));
  if (e.context_len < e.num_ranks) {
    return Status::InvalidArgument(fmt::format("context_len {} is shorter than its {} ranks", e.context_len, e.num_ranks));
  }
  if (static_cast<int>(e.fractions.size()) != e.num_ranks) {
    return Status::InvalidArgument(
        fmt::format("{} fractions for {} ranks (context_len {})", e.fractions.size(), e.num_ranks, e.context_len));
  }
  KVFLOW_RETURN_IF_ERROR(ValidateFractions(e.fractions, tolerance));
  for (const auto& t : {e.ttft_s, e.even_ttft_s}) {
    if (t && (!std::isfinite(*t) || *t < 0)) return Status::InvalidArgument(fmt::format("TTFT {} must be >= 0", *t));
  }
  if (e.measurements < 0) return Status::InvalidArgument(fmt::format("measurements {} must be >= 0", e.measurements));
  return Status::Ok();
}

std::vector<double> Normalised(std::vector<double> f) {
  double sum = 0;
  for (double x : f) sum += x;
  for (double& x : f) x /= sum;
  return f;
}

// Typed reads of one JSON object; every complaint names the file and the object.
class FieldReader {
 public:
  FieldReader(const json& object, std::string where) : object_(object), where_(std::move(where)) {}

  Status String(const char* key, std::string* out) const {
    const json* v = Find(key);
    if (v == nullptr) return Missing(key);
    if (!v->is_string()) return Wrong(key, "a string");
    *out = v->get<std::string>();
    return Status::Ok();
  }
  Status Integer(const char* key, int64_t* out, bool required) const {
    const json* v = Find(key);
    if (v == nullptr) return required ? Missing(key) : Status::Ok();
    if (!v->is_number_integer()) return Wrong(key, "an integer");
    *out = v->get<int64_t>();
    return Status::Ok();
  }
  Status OptionalNumber(const char* key, std::optional<double>* out) const {
    const json* v = Find(key);
    if (v == nullptr || v->is_null()) return Status::Ok();
    if (!v->is_number()) return Wrong(key, "a number");
    *out = v->get<double>();
    return Status::Ok();
  }
  Status Numbers(const char* key, std::vector<double>* out) const {
    const json* v = Find(key);
    if (v == nullptr) return Missing(key);
    if (!v->is_array()) return Wrong(key, "an array of numbers");
    out->clear();
    for (const json& x : *v) {
      if (!x.is_number()) return Wrong(key, "an array of numbers");
      out->push_back(x.get<double>());
    }
    return Status::Ok();
  }

 private:
  const json* Find(const char* key) const {
    auto it = object_.find(key);
    return it == object_.end() ? nullptr : &*it;
  }
  Status Missing(const char* key) const { return Status::CorruptFile(fmt::format("{}: no \"{}\"", where_, key)); }
  Status Wrong(const char* key, const char* what) const {
    return Status::CorruptFile(fmt::format("{}: \"{}\" must be {}", where_, key, what));
  }

  const json& object_;
  std::string where_;
};

// Fallback reasons already warned about, so a server logs each once rather than per request.
bool FirstTimeFor(const std::string& reason) {
  static std::mutex mu;
  static std::set<std::string> warned;
  std::lock_guard lock(mu);
  return warned.insert(reason).second;
}

Result<PartitionChoice> EvenFallback(int64_t context_len, int num_ranks, const std::string& reason) {
  KVFLOW_ASSIGN_OR_RETURN(ContextPartition even, EvenPartition(context_len, num_ranks));
  if (FirstTimeFor(reason)) spdlog::warn("KV-Runahead: {}; using the even context partition", reason);
  return PartitionChoice{std::move(even), PartitionSource::kEvenFallback};
}

}  // namespace

PartitionTable::PartitionTable(std::string model, std::string hardware, std::string description)
    : model_(std::move(model)), hardware_(std::move(hardware)), description_(std::move(description)) {}

Status PartitionTable::Add(PartitionTableEntry entry) {
  KVFLOW_RETURN_IF_ERROR(ValidateEntry(entry, 1e-6));
  const auto key = std::make_pair(entry.num_ranks, entry.context_len);
  entries_[key] = std::move(entry);
  return Status::Ok();
}

bool PartitionTable::HasRanks(int num_ranks) const { return ContextRange(num_ranks).has_value(); }

bool PartitionTable::HasEntry(int num_ranks, int64_t context_len) const {
  return entries_.contains({num_ranks, context_len});
}

std::optional<std::pair<int64_t, int64_t>> PartitionTable::ContextRange(int num_ranks) const {
  auto first = entries_.lower_bound({num_ranks, 0});
  if (first == entries_.end() || first->first.first != num_ranks) return std::nullopt;
  auto last = std::prev(entries_.lower_bound({num_ranks + 1, 0}));
  return std::make_pair(first->first.second, last->first.second);
}

std::vector<PartitionTableEntry> PartitionTable::entries() const {
  std::vector<PartitionTableEntry> out;
  for (const auto& [key, e] : entries_) out.push_back(e);
  return out;
}

Result<std::vector<double>> PartitionTable::LookupFractions(int num_ranks, int64_t context_len) const {
  if (context_len < num_ranks || num_ranks < 1) {
    return Status::InvalidArgument(fmt::format("no partition of {} tokens over {} ranks", context_len, num_ranks));
  }
  if (!HasRanks(num_ranks)) {
    return Status::NotFound(fmt::format("partition table for {} has no entry for {} ranks", model_, num_ranks));
  }
  // First entry for num_ranks with context >= context_len.
  auto hi = entries_.lower_bound({num_ranks, context_len});
  if (hi != entries_.end() && hi->first == std::make_pair(num_ranks, context_len)) return Normalised(hi->second.fractions);
  if (hi == entries_.end() || hi->first.first != num_ranks) return Normalised(std::prev(hi)->second.fractions);
  if (hi == entries_.begin() || std::prev(hi)->first.first != num_ranks) return Normalised(hi->second.fractions);
  const PartitionTableEntry& a = std::prev(hi)->second;
  const PartitionTableEntry& b = hi->second;
  const double w = static_cast<double>(context_len - a.context_len) / static_cast<double>(b.context_len - a.context_len);
  std::vector<double> f(static_cast<size_t>(num_ranks));
  for (size_t i = 0; i < f.size(); ++i) f[i] = (1 - w) * a.fractions[i] + w * b.fractions[i];
  return Normalised(std::move(f));
}

Result<ContextPartition> PartitionTable::Lookup(int num_ranks, int64_t context_len) const {
  KVFLOW_ASSIGN_OR_RETURN(std::vector<double> fractions, LookupFractions(num_ranks, context_len));
  return PartitionFromFractions(fractions, context_len);
}

Result<PartitionTable> PartitionTable::Load(const std::filesystem::path& path) {
  const std::string name = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return std::filesystem::exists(path) ? Status::IoError("cannot open partition table " + name)
                                         : Status::NotFound("no partition table " + name);
  }
  std::stringstream text;
  text << in.rdbuf();
  const json root = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Status::CorruptFile(name + ": not valid JSON");
  if (!root.is_object()) return Status::CorruptFile(name + ": a partition table is a JSON object");

  FieldReader top(root, name);
  std::string format;
  KVFLOW_RETURN_IF_ERROR(top.String("format", &format));
  if (format != kFormatName) {
    return Status::CorruptFile(fmt::format("{}: format \"{}\", expected \"{}\"", name, format, kFormatName));
  }
  int64_t version = 0;
  KVFLOW_RETURN_IF_ERROR(top.Integer("version", &version, /*required=*/true));
  if (version != kFormatVersion) {
    return Status::CorruptFile(fmt::format("{}: version {}, this build reads {}", name, version, kFormatVersion));
  }
  std::string model, hardware, description;
  KVFLOW_RETURN_IF_ERROR(top.String("model", &model));
  KVFLOW_RETURN_IF_ERROR(top.String("hardware", &hardware));
  KVFLOW_RETURN_IF_ERROR(top.String("description", &description));
  PartitionTable table(std::move(model), std::move(hardware), std::move(description));

  auto entries = root.find("entries");
  if (entries == root.end() || !entries->is_array()) return Status::CorruptFile(name + ": \"entries\" must be an array");
  for (size_t i = 0; i < entries->size(); ++i) {
    const json& item = (*entries)[i];
    const std::string where = fmt::format("{}: entries[{}]", name, i);
    if (!item.is_object()) return Status::CorruptFile(where + ": not an object");
    FieldReader fields(item, where);
    PartitionTableEntry e;
    int64_t num_ranks = 0;
    KVFLOW_RETURN_IF_ERROR(fields.Integer("num_ranks", &num_ranks, /*required=*/true));
    KVFLOW_RETURN_IF_ERROR(fields.Integer("context_len", &e.context_len, /*required=*/true));
    KVFLOW_RETURN_IF_ERROR(fields.Numbers("fractions", &e.fractions));
    KVFLOW_RETURN_IF_ERROR(fields.OptionalNumber("ttft_s", &e.ttft_s));
    KVFLOW_RETURN_IF_ERROR(fields.OptionalNumber("even_ttft_s", &e.even_ttft_s));
    KVFLOW_RETURN_IF_ERROR(fields.Integer("measurements", &e.measurements, /*required=*/false));
    if (num_ranks < 1 || num_ranks > 1 << 20) return Status::CorruptFile(fmt::format("{}: num_ranks {}", where, num_ranks));
    e.num_ranks = static_cast<int>(num_ranks);
    if (Status st = ValidateEntry(e, kFileFractionTolerance); !st.ok()) return Status::CorruptFile(where + ": " + st.message());
    if (table.entries_.contains({e.num_ranks, e.context_len})) {
      return Status::CorruptFile(
          fmt::format("{}: a second entry for {} ranks at context_len {}", where, e.num_ranks, e.context_len));
    }
    table.entries_[{e.num_ranks, e.context_len}] = std::move(e);
  }
  return table;
}

Status PartitionTable::Save(const std::filesystem::path& path) const {
  json entries = json::array();
  for (const auto& [key, e] : entries_) {
    json item = {{"num_ranks", e.num_ranks}, {"context_len", e.context_len}, {"fractions", e.fractions}};
    if (e.ttft_s) item["ttft_s"] = *e.ttft_s;
    if (e.even_ttft_s) item["even_ttft_s"] = *e.even_ttft_s;
    item["measurements"] = e.measurements;
    entries.push_back(std::move(item));
  }
  const json root = {{"format", kFormatName}, {"version", kFormatVersion}, {"model", model_},
                     {"description", description_}, {"hardware", hardware_}, {"entries", std::move(entries)}};
  // Renamed over the target, so a server never reads half a table.
  return WriteFileAtomically(path.string(), root.dump(2) + "\n");
}

const char* PartitionSourceName(PartitionSource source) {
  switch (source) {
    case PartitionSource::kTableExact: return "table";
    case PartitionSource::kTableInterpolated: return "interpolated";
    case PartitionSource::kTableClamped: return "nearest-entry";
    case PartitionSource::kEvenFallback: return "even";
  }
  return "?";
}

Result<PartitionChoice> ChoosePartition(const PartitionTable* table_or_null, int64_t context_len, int num_ranks,
                                        int64_t alignment) {
  if (table_or_null == nullptr) return EvenFallback(context_len, num_ranks, "no partition table");
  const PartitionTable& table = *table_or_null;
  if (!table.HasRanks(num_ranks)) {
    return EvenFallback(context_len, num_ranks,
                        fmt::format("the partition table for {} has no entry for {} ranks", table.model(), num_ranks));
  }
  KVFLOW_ASSIGN_OR_RETURN(ContextPartition partition, table.Lookup(num_ranks, context_len));
  // A context too short to align over every rank runs unaligned rather than not at all.
  if (alignment > 1 && (context_len - 1) / alignment >= num_ranks - 1) {
    KVFLOW_ASSIGN_OR_RETURN(partition, AlignPartition(partition, alignment));
  }
  const auto [lowest, highest] = *table.ContextRange(num_ranks);
  PartitionSource source = PartitionSource::kTableInterpolated;
  if (table.HasEntry(num_ranks, context_len)) source = PartitionSource::kTableExact;
  if (context_len < lowest || context_len > highest) source = PartitionSource::kTableClamped;
  return PartitionChoice{std::move(partition), source};
}

std::optional<PartitionTable> LoadPartitionTableOrWarn(const std::filesystem::path& path) {
  Result<PartitionTable> table = PartitionTable::Load(path);
  if (!table.ok()) {
    spdlog::warn("KV-Runahead: cannot use partition table ({}); prompts will use the even context partition",
                 table.status().ToString());
    return std::nullopt;
  }
  spdlog::info("KV-Runahead: partition table {} for {} measured on {}", path.string(), table->model(), table->hardware());
  return std::move(table).value();
}

}  // namespace kvflow::dist
