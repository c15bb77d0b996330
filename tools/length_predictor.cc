// `kvflow-length-predictor`: labels prompts with the output lengths kvflow's engine generates, trains
// S3's output-length predictor (src/sched/length_predictor.h) and measures its accuracy.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "cli/engine_flags.h"
#include "chat_template/chat_template.h"
#include "kvflow/engine.h"
#include "model/tensor_source.h"
#include "model/tiny_random.h"
#include "backend/backend_factory.h"
#include "forward/llama_model.h"
#include "kvflow/models.h"
#include "s3/plugin.h"
#include "sched/length_predictor.h"
#include "sched/length_probe.h"
#include "util/alpaca.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
using kvflow::Result;
using kvflow::Status;

// Set by SIGINT/SIGTERM: `label` stops stepping, records its session and exits.
volatile std::sig_atomic_t g_stop_requested = 0;
extern "C" void RequestStop(int) { g_stop_requested = 1; }

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The split and the sample must be reproducible: the predictor's shuffle, seeded.
void FisherYates(std::vector<size_t>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  kvflow::ReproducibleShuffle(v, rng);
}

std::vector<size_t> Iota(size_t n) {
  std::vector<size_t> v(n);
  std::iota(v.begin(), v.end(), size_t{0});
  return v;
}

Status WriteText(const std::string& path, const std::string& text) {
  if (fs::path(path).has_parent_path()) {
    std::error_code ec;
    fs::create_directories(fs::path(path).parent_path(), ec);
  }
  std::ofstream out(path, std::ios::trunc);
  if (!out) return Status::IoError("cannot write " + path);
  out << text;
  out.close();
  if (!out) return Status::IoError("error writing " + path);
  return Status::Ok();
}

Result<Json> ReadJsonFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot open " + path);
  try {
    return Json::parse(in);
  } catch (const Json::exception& e) {
    return Status::CorruptFile(path + ": " + e.what());
  }
}

// ---- datasets ---------------------------------------------------------------------------------

struct Record {
  int64_t index = 0;       // position in the Alpaca list (a label JSONL keeps the Alpaca index)
  std::string prompt;      // the user's text: instruction + ("\n" + input if non-empty)
  std::string reference;   // Alpaca's reference output (empty for a label JSONL)
  std::optional<int64_t> output_len;  // a label JSONL's generated length
};

struct Dataset {
  std::string path;
  std::string format;  // "alpaca" or "labels"
  std::vector<Record> records;  // by index
};

Result<Dataset> LoadAlpaca(const std::string& path) {
  KVFLOW_ASSIGN_OR_RETURN(Json data, ReadJsonFile(path));
  if (!data.is_array() || data.empty()) return Status::CorruptFile(path + ": expected a non-empty JSON list");
  Dataset ds{path, "alpaca", {}};
  try {
    for (size_t i = 0; i < data.size(); ++i) {
      const Json& e = data[i];
      if (!e.is_object()) return Status::CorruptFile(path + ": entry " + std::to_string(i) + " is not an object");
      ds.records.push_back({static_cast<int64_t>(i), kvflow::AlpacaPrompt(e.value("instruction", ""), e.value("input", "")),
                            e.value("output", ""), std::nullopt});
    }
  } catch (const Json::exception& e) {
    return Status::CorruptFile(path + ": " + e.what());
  }
  return ds;
}

// A JSONL written by `label`; a killed run may leave a partial last line, which is skipped.
Result<Dataset> LoadLabels(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot open " + path);
  Dataset ds{path, "labels", {}};
  std::map<int64_t, int64_t> seen;  // index -> output_len
  std::string line;
  int64_t line_no = 0, bad = 0, repeated = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const Json j = Json::parse(line);
      Record r{j.at("index").get<int64_t>(), j.at("prompt").get<std::string>(), "", j.at("output_len").get<int64_t>()};
      // Two sessions that labelled the same prompt agree (greedy decoding): keep one. A conflict
      // means the file mixes runs of different settings.
      if (auto [it, inserted] = seen.emplace(r.index, *r.output_len); !inserted) {
        if (it->second != *r.output_len) {
          return Status::CorruptFile(path + ":" + std::to_string(line_no) + ": index " + std::to_string(r.index) +
                                     " labelled twice with different lengths");
        }
        ++repeated;
        continue;
      }
      ds.records.push_back(std::move(r));
    } catch (const Json::exception& e) {
      ++bad;
      spdlog::warn("{}:{}: skipped ({})", path, line_no, e.what());
    }
  }
  if (bad > 1) return Status::CorruptFile(path + ": " + std::to_string(bad) + " malformed lines");
  if (repeated > 0) spdlog::warn("{}: {} prompts labelled twice (identically); each kept once", path, repeated);
  if (ds.records.empty()) return Status::CorruptFile(path + ": no labelled records");
  // Completion order depends on batching: the split must not.
  std::sort(ds.records.begin(), ds.records.end(), [](const Record& a, const Record& b) { return a.index < b.index; });
  return ds;
}

Result<Dataset> LoadDataset(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot open the dataset " + path);
  char first = 0;
  while (in.get(first) && std::isspace(static_cast<unsigned char>(first))) {
  }
  return first == '[' ? LoadAlpaca(path) : LoadLabels(path);
}

// Just the tokenizer of a model (the weights are mapped, never read).
struct TokenizerHandle {
  kvflow::ModelFiles files;
  std::string name;
  std::string path;
  const kvflow::Tokenizer& tok() const { return *files.tokenizer; }
};

Result<TokenizerHandle> OpenTokenizer(const std::string& model) {
  KVFLOW_ASSIGN_OR_RETURN(std::string path, kvflow::ResolveModel(model));
  TokenizerHandle h;
  KVFLOW_ASSIGN_OR_RETURN(h.files,
                          path == kvflow::kTinyRandomName ? kvflow::MakeTinyRandomModel() : kvflow::OpenModelFiles(path));
  if (!h.files.tokenizer) return Status::NotFound("no tokenizer in " + path);
  h.name = model;
  h.path = path;
  return h;
}

// The prompt as the engine sees it: plain, or as one user message inside the chat template (as
// kvflow-server renders a chat request).
class PromptRenderer {
 public:
  static Result<PromptRenderer> Create(const kvflow::Tokenizer& tok, bool chat) {
    PromptRenderer r;
    r.chat_ = chat;
    if (chat) {
      // The model's own template, without a BOS text (Tokens adds the tokenizer's).
      auto chat_template = kvflow::ChatTemplate::Create(tok.chat_template(), "", "");
      if (!chat_template.ok()) return Status::Unsupported("--chat: " + chat_template.status().message());
      r.template_ = std::make_shared<kvflow::ChatTemplate>(std::move(chat_template.value()));
    }
    return r;
  }
  std::string Render(const std::string& prompt) const {
    if (!chat_) return prompt;
    auto rendered = template_->Render(kvflow::ChatTemplateInput::User(prompt));
    return rendered.ok() ? rendered.value() : prompt;
  }
  std::vector<int32_t> Tokens(const kvflow::Tokenizer& tok, const std::string& prompt) const {
    return tok.Encode(Render(prompt), tok.add_bos());
  }

 private:
  bool chat_ = false;
  std::shared_ptr<kvflow::ChatTemplate> template_;
};

struct Labelled {
  std::vector<int64_t> indices;
  std::vector<kvflow::LengthExample> examples;
};

// Alpaca: the label is the tokenized length of the reference output; a label JSONL: the engine's.
Labelled Tokenize(const Dataset& ds, const kvflow::Tokenizer& tok, const PromptRenderer& renderer) {
  Labelled out;
  for (const Record& r : ds.records) {
    kvflow::LengthExample e;
    e.prompt = renderer.Tokens(tok, r.prompt);
    e.output_len = r.output_len ? *r.output_len : static_cast<int64_t>(tok.Encode(r.reference, false).size());
    out.indices.push_back(r.index);
    out.examples.push_back(std::move(e));
  }
  return out;
}

Json LengthStats(const std::vector<kvflow::LengthExample>& examples) {
  std::vector<int64_t> lens;
  for (const auto& e : examples) lens.push_back(e.output_len);
  std::sort(lens.begin(), lens.end());
  if (lens.empty()) return Json::object();
  auto pct = [&](double q) { return lens[std::min(lens.size() - 1, static_cast<size_t>(q * lens.size()))]; };
  const double mean = std::accumulate(lens.begin(), lens.end(), 0.0) / static_cast<double>(lens.size());
  return Json{{"mean", mean}, {"p50", pct(0.5)}, {"p90", pct(0.9)}, {"p99", pct(0.99)}, {"max", lens.back()}};
}

// ---- evaluation output ------------------------------------------------------------------------

Json EvaluationJson(const kvflow::LengthEvaluation& ev, const kvflow::LengthBuckets& buckets) {
  const int k = buckets.num_buckets;
  int64_t within_one = 0;
  std::vector<int64_t> true_counts(k, 0), predicted_counts(k, 0);
  for (int t = 0; t < k; ++t) {
    for (int p = 0; p < k; ++p) {
      const int64_t c = ev.confusion[t][p];
      true_counts[t] += c;
      predicted_counts[p] += c;
      if (std::abs(t - p) <= 1) within_one += c;
    }
  }
  const double n = std::max<double>(1.0, static_cast<double>(ev.examples));
  const int majority_bucket =
      static_cast<int>(std::max_element(true_counts.begin(), true_counts.end()) - true_counts.begin());
  return Json{{"examples", ev.examples},
              {"accuracy", ev.accuracy},
              {"majority_accuracy", ev.majority_accuracy},
              {"majority_bucket", majority_bucket},
              {"within_one_bucket", static_cast<double>(within_one) / n},
              {"mean_miss_distance", ev.mean_miss_distance},
              {"under_predictions", ev.under_predictions},
              {"over_predictions", ev.over_predictions},
              // With the upper edge reserved, a request fits its reservation unless under-predicted.
              {"fits_reservation", 1.0 - static_cast<double>(ev.under_predictions) / n},
              {"mean_predict_us", ev.mean_predict_us},
              {"true_bucket_counts", true_counts},
              {"predicted_bucket_counts", predicted_counts},
              {"confusion", ev.confusion}};
}

void PrintEvaluationTable(const std::vector<std::pair<std::string, Json>>& rows) {
  std::printf("%-10s %7s %9s %9s %9s %9s %7s %7s %10s\n", "split", "n", "accuracy", "majority", "within1",
              "miss_dist", "under", "over", "predict_us");
  for (const auto& [name, j] : rows) {
    std::printf("%-10s %7lld %8.2f%% %8.2f%% %8.2f%% %9.3f %7lld %7lld %10.2f\n", name.c_str(),
                static_cast<long long>(j["examples"].get<int64_t>()), 100 * j["accuracy"].get<double>(),
                100 * j["majority_accuracy"].get<double>(), 100 * j["within_one_bucket"].get<double>(),
                j["mean_miss_distance"].get<double>(), static_cast<long long>(j["under_predictions"].get<int64_t>()),
                static_cast<long long>(j["over_predictions"].get<int64_t>()), j["mean_predict_us"].get<double>());
  }
}

// A float hyper-parameter as it was typed (0.1, not 0.10000000149011612).
double Decimal(float f) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.7g", static_cast<double>(f));
  return std::strtod(buf, nullptr);
}

Json ConfigJson(const kvflow::LengthPredictorConfig& c) {
  return Json{{"max_output_len", c.buckets.max_output_len},
              {"num_buckets", c.buckets.num_buckets},
              {"bucket_width", c.buckets.width()},
              {"hash_bits", c.hash_bits},
              {"reservation_point", kvflow::ReservationPointName(c.reservation_point)},
              {"seed", c.seed},
              {"epochs", c.epochs},
              {"learning_rate", Decimal(c.learning_rate)},
              {"l2", Decimal(c.l2)},
              {"online_learning_rate", Decimal(c.online_learning_rate)},
              {"online_weight_correct", Decimal(c.online_weight_correct)},
              {"online_weight_mispredicted", Decimal(c.online_weight_mispredicted)}};
}

std::string JoinArgs(int argc, char** argv) {
  std::string s;
  for (int i = 0; i < argc; ++i) s += (i ? " " : "") + std::string(argv[i]);
  return s;
}

// The label runs recorded beside a label JSONL (`label` appends one entry per session).
std::string RunsPath(const std::string& labels_path) { return labels_path + ".runs.json"; }

// ---- label ------------------------------------------------------------------------------------

struct LabelOptions {
  kvflow::EngineConfig engine;
  double swap_space_gib = 4.0;
  std::string dataset;
  std::string out;
  size_t num = 0;  // 0: all
  uint64_t seed = 0;
  bool chat = false;
  int max_tokens = 512;
  bool resume = false;
  bool dry_run = false;
  double progress_s = 10.0;
};

// Reads the indices already labelled; with `repair`, drops a partial last line a killed run left
// behind (otherwise it is only ignored).
Result<std::set<int64_t>> ReadDoneIndices(const std::string& path, bool repair) {
  std::set<int64_t> done;
  std::ifstream in(path, std::ios::binary);
  if (!in) return done;
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  const size_t keep = content.empty() || content.back() == '\n' ? content.size() : content.rfind('\n') + 1;
  if (keep != content.size() && repair) {
    spdlog::warn("{}: dropping a partial last line ({} bytes)", path, content.size() - keep);
    std::error_code ec;
    fs::resize_file(path, keep, ec);
    if (ec) return Status::IoError("cannot truncate " + path + ": " + ec.message());
  }
  std::istringstream lines(content.substr(0, keep));
  std::string line;
  int64_t line_no = 0;
  while (std::getline(lines, line)) {
    ++line_no;
    if (line.empty()) continue;
    try {
      done.insert(Json::parse(line).at("index").get<int64_t>());
    } catch (const Json::exception& e) {
      return Status::CorruptFile(path + ":" + std::to_string(line_no) + ": " + e.what());
    }
  }
  return done;
}

int RunLabel(const LabelOptions& opt, const std::string& command) {
  if (opt.max_tokens < 1) {
    spdlog::error("--max-tokens must be >= 1");
    return 1;
  }
  auto ds = LoadAlpaca(opt.dataset);
  if (!ds.ok()) {
    spdlog::error("{}", ds.status().ToString());
    return 1;
  }
  std::vector<size_t> order = Iota(ds->records.size());
  FisherYates(order, opt.seed);
  const size_t num = opt.num == 0 ? order.size() : std::min(opt.num, order.size());
  order.resize(num);

  std::set<int64_t> done;
  if (fs::exists(opt.out)) {
    if (!opt.resume && !opt.dry_run) {
      spdlog::error("{} exists: pass --resume to continue it, or remove it", opt.out);
      return 1;
    }
    auto read = ReadDoneIndices(opt.out, /*repair=*/!opt.dry_run);
    if (!read.ok()) {
      spdlog::error("{}", read.status().ToString());
      return 1;
    }
    done = std::move(read.value());
  }
  std::vector<size_t> todo;
  for (size_t i : order) {
    if (!done.count(ds->records[i].index)) todo.push_back(i);
  }
  spdlog::info("{} prompts sampled (seed {}), {} already labelled in {}, {} to go", num, opt.seed, num - todo.size(),
               opt.out, todo.size());
  if (opt.dry_run) {
    // The sample in its order: a run cut short can be trimmed to the longest fully labelled prefix.
    for (size_t pos = 0; pos < order.size(); ++pos) {
      const int64_t index = ds->records[order[pos]].index;
      std::printf("%zu %lld %s\n", pos, static_cast<long long>(index), done.count(index) ? "done" : "todo");
    }
    return 0;
  }
  if (todo.empty()) return 0;

  auto engine_or = kvflow::Engine::Create(opt.engine);
  if (!engine_or.ok()) {
    spdlog::error("{}", engine_or.status().ToString());
    return 1;
  }
  kvflow::Engine& engine = *engine_or.value();
  auto renderer = PromptRenderer::Create(engine.tokenizer(), opt.chat);
  if (!renderer.ok()) {
    spdlog::error("{}", renderer.status().ToString());
    return 1;
  }
  if (fs::path(opt.out).has_parent_path()) fs::create_directories(fs::path(opt.out).parent_path());
  std::ofstream out(opt.out, std::ios::app);
  if (!out) {
    spdlog::error("cannot write {}", opt.out);
    return 1;
  }

  kvflow::SamplingParams params;
  params.temperature = 0;
  params.max_tokens = opt.max_tokens;
  int64_t completed = 0, failed = 0, generated = 0, prompt_tokens = 0;
  const auto start = Clock::now();
  // Every request is queued at once; the engine batches them continuously. A line is written (and
  // flushed) as each finishes, so a killed run loses only the requests in flight.
  for (size_t i : todo) {
    const Record& rec = ds->records[i];
    std::vector<int32_t> tokens = renderer->Tokens(engine.tokenizer(), rec.prompt);
    const int64_t num_prompt_tokens = static_cast<int64_t>(tokens.size());
    auto counted = std::make_shared<int64_t>(0);
    auto on_event = [&, index = rec.index, prompt = rec.prompt, num_prompt_tokens, counted](const kvflow::StreamEvent& e) {
      *counted += static_cast<int64_t>(e.tokens.size());
      generated += static_cast<int64_t>(e.tokens.size());
      if (!e.request_finished) return;
      if (e.finish_reason == kvflow::FinishReason::kError) {
        ++failed;
        spdlog::warn("index {}: {}", index, e.error.ToString());
        return;
      }
      ++completed;
      prompt_tokens += num_prompt_tokens;
      out << Json{{"index", index},
                  {"prompt", prompt},
                  {"output_len", *counted},
                  {"finish_reason", kvflow::FinishReasonName(e.finish_reason)},
                  {"prompt_tokens", num_prompt_tokens}}
                 .dump()
          << '\n';
      out.flush();
    };
    auto id = engine.AddRequest(std::move(tokens), params, on_event);
    if (!id.ok()) {
      ++failed;
      spdlog::warn("index {}: not queued: {}", rec.index, id.status().ToString());
    }
  }

  auto last_report = Clock::now();
  const int64_t total = static_cast<int64_t>(todo.size());
  std::signal(SIGINT, RequestStop);
  std::signal(SIGTERM, RequestStop);
  bool interrupted = false;
  while (engine.HasUnfinishedRequests()) {
    if (g_stop_requested) {
      interrupted = true;
      spdlog::warn("interrupted: {} of {} done; --resume continues", completed + failed, total);
      break;
    }
    auto step = engine.Step();
    if (!step.ok()) {
      spdlog::error("step failed: {}", step.status().ToString());
      return 1;
    }
    if (SecondsSince(last_report) >= opt.progress_s) {
      last_report = Clock::now();
      const double elapsed = SecondsSince(start);
      const int64_t finished = completed + failed;
      const double eta = finished > 0 ? elapsed * static_cast<double>(total - finished) / finished : 0.0;
      spdlog::info("{}/{} done, {} tokens generated, {:.1f} tok/s, {:.0f} s elapsed, ETA {:.0f} s", finished, total,
                   generated, generated / elapsed, elapsed, eta);
    }
  }
  const double wall = SecondsSince(start);
  spdlog::info("labelled {} prompts ({} failed) in {:.1f} s: {} tokens generated, {:.2f} tok/s", completed, failed,
               wall, generated, wall > 0 ? generated / wall : 0.0);

  // One entry per session, so a resumed run's totals can be added up.
  Json runs = Json::array();
  if (fs::exists(RunsPath(opt.out))) {
    auto prev = ReadJsonFile(RunsPath(opt.out));
    if (prev.ok() && prev->is_array()) runs = prev.value();
  }
  const auto& ec = engine.config();
  runs.push_back(Json{{"command", command},
                      {"model", opt.engine.model},
                      {"chat", opt.chat},
                      {"max_tokens", opt.max_tokens},
                      {"temperature", 0},
                      {"sample_num", num},
                      {"sample_seed", opt.seed},
                      {"threads", ec.num_threads},
                      {"max_num_seqs", ec.max_num_seqs},
                      {"completed", completed},
                      {"failed", failed},
                      {"interrupted", interrupted},
                      {"prompt_tokens", prompt_tokens},
                      {"generated_tokens", generated},
                      {"wall_s", wall},
                      {"generated_tok_s", wall > 0 ? generated / wall : 0.0},
                      {"engine_steps", engine.stats().num_steps},
                      {"preemptions", engine.stats().num_preemptions}});
  if (Status st = WriteText(RunsPath(opt.out), runs.dump(2) + "\n"); !st.ok()) spdlog::warn("{}", st.ToString());
  if (interrupted) return 130;
  return failed > 0 ? 2 : 0;
}

// ---- train / eval -----------------------------------------------------------------------------

struct TrainOptions {
  std::string dataset;
  std::string model = "smollm2-135m";
  bool chat = false;
  kvflow::LengthPredictorConfig config;
  std::string reservation_point = "upper";
  double test_fraction = 0.2;
  uint64_t split_seed = 0;
  double validation_fraction = 0;
  std::optional<uint64_t> validation_seed;
  std::string out;
  std::string report;
  std::string tag;
  bool require_better_than_majority = false;  // exit 3 unless held-out accuracy beats the majority bucket
};

template <typename T>
std::vector<T> Pick(const std::vector<T>& v, const std::vector<size_t>& positions) {
  std::vector<T> out;
  out.reserve(positions.size());
  for (size_t p : positions) out.push_back(v[p]);
  return out;
}

Json DatasetJson(const Dataset& ds, const TokenizerHandle& tok, bool chat, const std::string& fingerprint) {
  Json j{{"path", ds.path},
         {"format", ds.format},
         {"entries", ds.records.size()},
         {"labels", ds.format == "alpaca" ? "tokenized length of the reference output" : "engine-generated length"},
         {"prompt", std::string("instruction + (\"\\n\" + input if non-empty)") +
                        (chat ? ", as one user message in the chat template" : ", plain")},
         {"tokenizer", tok.name},
         {"tokenizer_path", tok.path},
         {"tokenizer_fingerprint", fingerprint}};
  if (ds.format == "labels" && fs::exists(RunsPath(ds.path))) {
    auto runs = ReadJsonFile(RunsPath(ds.path));
    if (runs.ok()) j["label_runs"] = runs.value();
  }
  return j;
}

int RunTrain(TrainOptions& opt, const std::string& command) {
  auto point = kvflow::ParseReservationPoint(opt.reservation_point);
  if (!point.ok()) {
    spdlog::error("{}", point.status().ToString());
    return 1;
  }
  opt.config.reservation_point = point.value();
  if (Status st = opt.config.Validate(); !st.ok()) {
    spdlog::error("{}", st.ToString());
    return 1;
  }
  if (!(opt.test_fraction >= 0 && opt.test_fraction < 1) ||
      !(opt.validation_fraction >= 0 && opt.validation_fraction < 1)) {
    spdlog::error("--test-fraction and --validation-fraction must be in [0, 1)");
    return 1;
  }
  auto ds = LoadDataset(opt.dataset);
  auto tok = ds.ok() ? OpenTokenizer(opt.model) : Result<TokenizerHandle>(ds.status());
  if (!tok.ok()) {
    spdlog::error("{}", tok.status().ToString());
    return 1;
  }
  auto renderer = PromptRenderer::Create(tok->tok(), opt.chat);
  if (!renderer.ok()) {
    spdlog::error("{}", renderer.status().ToString());
    return 1;
  }
  const auto tokenize_start = Clock::now();
  const Labelled data = Tokenize(ds.value(), tok->tok(), renderer.value());
  const double tokenize_s = SecondsSince(tokenize_start);
  const size_t n = data.examples.size();

  // A fixed held-out split: a seeded shuffle of the dataset's positions, the first part tested.
  std::vector<size_t> shuffled = Iota(n);
  FisherYates(shuffled, opt.split_seed);
  const size_t num_test = static_cast<size_t>(std::llround(opt.test_fraction * static_cast<double>(n)));
  std::vector<size_t> test_pos(shuffled.begin(), shuffled.begin() + static_cast<std::ptrdiff_t>(num_test));
  std::vector<size_t> train_pos(shuffled.begin() + static_cast<std::ptrdiff_t>(num_test), shuffled.end());
  // Tuning only ever looks at a validation part carved out of the training split.
  std::vector<size_t> valid_pos;
  if (opt.validation_fraction > 0) {
    std::sort(train_pos.begin(), train_pos.end());
    FisherYates(train_pos, opt.validation_seed.value_or(opt.split_seed + 1));
    const size_t num_valid =
        static_cast<size_t>(std::llround(opt.validation_fraction * static_cast<double>(train_pos.size())));
    valid_pos.assign(train_pos.begin(), train_pos.begin() + static_cast<std::ptrdiff_t>(num_valid));
    train_pos.erase(train_pos.begin(), train_pos.begin() + static_cast<std::ptrdiff_t>(num_valid));
  }
  for (auto* v : {&test_pos, &train_pos, &valid_pos}) std::sort(v->begin(), v->end());
  if (train_pos.empty()) {
    spdlog::error("no training examples left after the split");
    return 1;
  }
  const auto train_set = Pick(data.examples, train_pos);
  const auto valid_set = Pick(data.examples, valid_pos);
  const auto test_set = Pick(data.examples, test_pos);

  kvflow::LengthPredictor predictor(opt.config);
  const std::string fingerprint = kvflow::TokenizerFingerprint(tok->tok());
  predictor.set_tokenizer_fingerprint(fingerprint);
  spdlog::info("{} examples ({} train, {} validation, {} test), {} buckets of {} tokens, 2^{} hash slots", n,
               train_set.size(), valid_set.size(), test_set.size(), opt.config.buckets.num_buckets,
               opt.config.buckets.width(), opt.config.hash_bits);
  const kvflow::TrainReport tr = predictor.Train(train_set);
  spdlog::info("trained {} epochs in {:.2f} s, final loss {:.4f}", tr.epochs, tr.seconds,
               tr.epoch_loss.empty() ? 0.0 : tr.epoch_loss.back());

  const auto& buckets = opt.config.buckets;
  std::vector<std::pair<std::string, Json>> evals;
  evals.emplace_back("train", EvaluationJson(kvflow::Evaluate(predictor, train_set), buckets));
  if (!valid_set.empty()) evals.emplace_back("validation", EvaluationJson(kvflow::Evaluate(predictor, valid_set), buckets));
  // A tuning run (with a validation part) leaves the test split unseen.
  const bool tuning = !valid_set.empty();
  if (!test_set.empty() && !tuning) {
    evals.emplace_back("test", EvaluationJson(kvflow::Evaluate(predictor, test_set), buckets));
    // The same prompts as S3's supervisor meets them in the engine: predicted, then learnt from
    // (at --online-lr), one after another.
    kvflow::LengthPredictor learner = predictor;
    evals.emplace_back("test_online", EvaluationJson(kvflow::EvaluateOnline(learner, test_set), buckets));
  }
  PrintEvaluationTable(evals);

  Json report;
  report["tool"] = "kvflow-length-predictor train";
  report["tag"] = opt.tag;
  report["command"] = command;
  report["dataset"] = DatasetJson(ds.value(), tok.value(), opt.chat, fingerprint);
  report["dataset"]["output_len"] = LengthStats(data.examples);
  report["dataset"]["tokenize_s"] = tokenize_s;
  report["chat"] = opt.chat;
  report["model"] = {{"kind", "multinomial logistic regression"},
                     {"features", "hashed token unigrams + bigrams (SplitMix64, L2-normalised counts) + one-hot "
                                  "log2 prompt-length bin"},
                     {"parameters", predictor.weights().size() + predictor.bias().size()},
                     {"optimizer", "AdaGrad, seeded Fisher-Yates shuffle per epoch, lazy L2"}};
  report["config"] = ConfigJson(predictor.config());
  Json split{{"split_seed", opt.split_seed},
             {"test_fraction", opt.test_fraction},
             {"validation_fraction", opt.validation_fraction},
             {"validation_seed", opt.validation_seed.value_or(opt.split_seed + 1)},
             {"test_evaluated", !tuning},
             {"train_size", train_set.size()},
             {"validation_size", valid_set.size()},
             {"test_size", test_set.size()}};
  auto indices_of = [&](const std::vector<size_t>& pos) {
    std::vector<int64_t> idx;
    for (size_t p : pos) idx.push_back(data.indices[p]);
    return idx;
  };
  split["test_indices"] = indices_of(test_pos);
  if (!valid_pos.empty()) split["validation_indices"] = indices_of(valid_pos);
  report["split"] = split;
  report["training"] = {{"epochs", tr.epochs}, {"examples", tr.examples}, {"seconds", tr.seconds},
                        {"epoch_loss", tr.epoch_loss}};
  for (const auto& [name, j] : evals) report[name] = j;

  if (!opt.out.empty()) {
    std::ostringstream desc;
    desc << "trained on " << train_set.size() << " examples of " << ds->path << " (" << ds->format
         << (opt.chat ? ", chat" : ", plain") << " prompts, split seed " << opt.split_seed << ", test fraction "
         << opt.test_fraction << ")";
    if (!test_set.empty() && !tuning) desc << "; held-out accuracy " << report.at("test").at("accuracy").get<double>();
    predictor.set_description(desc.str());
    if (Status st = predictor.Save(opt.out); !st.ok()) {
      spdlog::error("{}", st.ToString());
      return 1;
    }
    report["predictor_path"] = opt.out;
    report["predictor_bytes"] = fs::file_size(opt.out);
    spdlog::info("wrote {}", opt.out);
  }
  if (!opt.report.empty()) {
    if (Status st = WriteText(opt.report, report.dump(2) + "\n"); !st.ok()) {
      spdlog::error("{}", st.ToString());
      return 1;
    }
    spdlog::info("wrote {}", opt.report);
  }
  if (opt.require_better_than_majority) {
    // The held-out figures: validation while tuning, else the test split (the training set without one).
    const Json& last = report.at(tuning ? "validation" : report.contains("test") ? "test" : "train");
    const double acc = last["accuracy"].get<double>(), majority = last["majority_accuracy"].get<double>();
    if (!(acc > majority)) {
      spdlog::error("held-out accuracy {:.2f}% does not beat the majority bucket's {:.2f}%", 100 * acc, 100 * majority);
      return 3;
    }
  }
  return 0;
}

struct EvalOptions {
  std::string predictor;
  std::string dataset;
  std::string model = "smollm2-135m";
  bool chat = false;
  std::string indices_from;
  std::string report;
};

int RunEval(const EvalOptions& opt, const std::string& command) {
  auto predictor = kvflow::LengthPredictor::Load(opt.predictor);
  auto ds = predictor.ok() ? LoadDataset(opt.dataset) : Result<Dataset>(predictor.status());
  auto tok = ds.ok() ? OpenTokenizer(opt.model) : Result<TokenizerHandle>(ds.status());
  if (!tok.ok()) {
    spdlog::error("{}", tok.status().ToString());
    return 1;
  }
  const std::string fingerprint = kvflow::TokenizerFingerprint(tok->tok());
  if (!predictor->tokenizer_fingerprint().empty() && predictor->tokenizer_fingerprint() != fingerprint) {
    spdlog::error("{} was trained for tokenizer {}, but {} has {}", opt.predictor, predictor->tokenizer_fingerprint(),
                  opt.model, fingerprint);
    return 1;
  }
  auto renderer = PromptRenderer::Create(tok->tok(), opt.chat);
  if (!renderer.ok()) {
    spdlog::error("{}", renderer.status().ToString());
    return 1;
  }
  Labelled data = Tokenize(ds.value(), tok->tok(), renderer.value());

  std::string subset = "all";
  if (!opt.indices_from.empty()) {
    auto from = ReadJsonFile(opt.indices_from);
    if (!from.ok()) {
      spdlog::error("{}", from.status().ToString());
      return 1;
    }
    std::set<int64_t> wanted;
    try {
      for (const Json& i : from->at("split").at("test_indices")) wanted.insert(i.get<int64_t>());
    } catch (const Json::exception& e) {
      spdlog::error("{}: no split.test_indices ({})", opt.indices_from, e.what());
      return 1;
    }
    Labelled kept;
    for (size_t i = 0; i < data.examples.size(); ++i) {
      if (wanted.count(data.indices[i])) {
        kept.indices.push_back(data.indices[i]);
        kept.examples.push_back(std::move(data.examples[i]));
      }
    }
    if (kept.examples.size() != wanted.size()) {
      spdlog::warn("{} of the {} test indices of {} are in {}", kept.examples.size(), wanted.size(), opt.indices_from,
                   opt.dataset);
    }
    data = std::move(kept);
    subset = "test indices of " + opt.indices_from;
  }
  if (data.examples.empty()) {
    spdlog::error("nothing to evaluate");
    return 1;
  }
  const Json ev = EvaluationJson(kvflow::Evaluate(predictor.value(), data.examples), predictor->config().buckets);
  PrintEvaluationTable({{"eval", ev}});
  if (!opt.report.empty()) {
    Json report;
    report["tool"] = "kvflow-length-predictor eval";
    report["command"] = command;
    report["predictor"] = {{"path", opt.predictor}, {"description", predictor->description()},
                           {"config", ConfigJson(predictor->config())}};
    report["dataset"] = DatasetJson(ds.value(), tok.value(), opt.chat, fingerprint);
    report["dataset"]["output_len"] = LengthStats(data.examples);
    report["chat"] = opt.chat;
    report["subset"] = subset;
    report["eval"] = ev;
    if (Status st = WriteText(opt.report, report.dump(2) + "\n"); !st.ok()) {
      spdlog::error("{}", st.ToString());
      return 1;
    }
    spdlog::info("wrote {}", opt.report);
  }
  return 0;
}

// ---- hidden states and the probe --------------------------------------------------------------

// Last-token hidden states of labelled prompts, as `hidden` writes them: "KVFLOWHS", u64 header
// length, a JSON header (model, fingerprint, hidden size, and per prompt its index, output length
// and prompt tokens, in the label file's index order), then float32 [prompts][hidden].
constexpr char kHiddenMagic[8] = {'K', 'V', 'F', 'L', 'O', 'W', 'H', 'S'};

struct HiddenDump {
  Json header;
  int64_t hidden_size = 0;
  std::vector<int64_t> indices;
  std::vector<int64_t> output_lens;
  std::vector<float> rows;  // [indices.size()][hidden_size]
  std::span<const float> Row(size_t i) const {
    return {rows.data() + i * static_cast<size_t>(hidden_size), static_cast<size_t>(hidden_size)};
  }
};

Status WriteHiddenDump(const std::string& path, const Json& header, const std::vector<float>& rows) {
  const std::string text = header.dump();
  std::string bytes(kHiddenMagic, sizeof(kHiddenMagic));
  const uint64_t len = text.size();
  bytes.append(reinterpret_cast<const char*>(&len), sizeof(len));
  bytes += text;
  bytes.append(reinterpret_cast<const char*>(rows.data()), rows.size() * sizeof(float));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::IoError("cannot write " + path);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  return out ? Status::Ok() : Status::IoError("error writing " + path);
}

Result<HiddenDump> ReadHiddenDump(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("cannot open " + path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto corrupt = [&](const std::string& why) { return Status::CorruptFile(path + ": " + why); };
  if (bytes.size() < sizeof(kHiddenMagic) + 8 || std::memcmp(bytes.data(), kHiddenMagic, sizeof(kHiddenMagic)) != 0) {
    return corrupt("not a hidden-state dump");
  }
  uint64_t len = 0;
  std::memcpy(&len, bytes.data() + sizeof(kHiddenMagic), sizeof(len));
  const size_t begin = sizeof(kHiddenMagic) + sizeof(len);
  if (len > bytes.size() - begin) return corrupt("header runs past the end");
  HiddenDump d;
  try {
    d.header = Json::parse(bytes.begin() + static_cast<std::ptrdiff_t>(begin),
                           bytes.begin() + static_cast<std::ptrdiff_t>(begin + len));
    d.hidden_size = d.header.at("hidden_size").get<int64_t>();
    d.indices = d.header.at("indices").get<std::vector<int64_t>>();
    d.output_lens = d.header.at("output_len").get<std::vector<int64_t>>();
  } catch (const Json::exception& e) {
    return corrupt(e.what());
  }
  const size_t n = d.indices.size();
  if (d.hidden_size <= 0 || d.output_lens.size() != n ||
      bytes.size() - begin - len != n * static_cast<size_t>(d.hidden_size) * sizeof(float)) {
    return corrupt("sizes do not match the header");
  }
  d.rows.resize(n * static_cast<size_t>(d.hidden_size));
  std::memcpy(d.rows.data(), bytes.data() + begin + len, d.rows.size() * sizeof(float));
  return d;
}

struct HiddenOptions {
  std::string dataset;
  std::string model = "smollm2-135m";
  bool chat = false;
  std::string out;
  int threads = 2;
  int batch_tokens = 2048;
};

// Runs the prefill of every labelled prompt (several per pass, each with its own blocks) and keeps
// the final-norm hidden state of its last token, the row the LM head reads for the first output.
int RunHidden(const HiddenOptions& opt, const std::string& command) {
  auto fail = [](const Status& st) {
    spdlog::error("{}", st.ToString());
    return 1;
  };
  auto ds = LoadLabels(opt.dataset);
  if (!ds.ok()) return fail(ds.status());
  auto path = kvflow::ResolveModel(opt.model);
  if (!path.ok()) return fail(path.status());
  auto files = kvflow::OpenModelFiles(path.value());
  if (!files.ok()) return fail(files.status());
  if (!files->tokenizer) return fail(Status::NotFound("no tokenizer in " + path.value()));
  const kvflow::ModelConfig model_config = files->config;
  const std::string fingerprint = kvflow::LengthProbeModelFingerprint(model_config, *files->tokenizer);
  auto renderer = PromptRenderer::Create(*files->tokenizer, opt.chat);
  if (!renderer.ok()) return fail(renderer.status());
  std::vector<std::vector<int32_t>> prompts;
  int64_t longest = 0;
  for (const Record& r : ds->records) {
    prompts.push_back(renderer->Tokens(*files->tokenizer, r.prompt));
    longest = std::max<int64_t>(longest, static_cast<int64_t>(prompts.back().size()));
  }
  const int64_t batch_tokens = std::max<int64_t>(opt.batch_tokens, longest);

  kvflow::EngineConfig c;
  c.model = path.value();
  c.num_threads = opt.threads;
  c.max_model_len = static_cast<int>(std::min<int64_t>(longest, model_config.max_position_embeddings));
  // Every prompt of a pass in its own blocks: at most one partial block per prompt beyond the tokens.
  c.num_kv_blocks = static_cast<int>(batch_tokens / c.block_size + 256);
  c.num_host_kv_blocks = 0;
  auto backend = kvflow::CreateBackendForModel(c, true, files.value());
  if (!backend.ok()) return fail(backend.status());
  kvflow::LlamaModel model(*backend.value());
  const int block_size = backend.value()->kv_layout().block_size;
  const int num_blocks = backend.value()->kv_layout().num_blocks;
  const int64_t H = model_config.hidden_size;

  std::vector<float> rows(prompts.size() * static_cast<size_t>(H));
  std::vector<float> logits;
  double forward_s = 0, read_s = 0;
  int64_t prompt_tokens = 0;
  const auto start = Clock::now();
  auto last_report = Clock::now();
  for (size_t first = 0; first < prompts.size();) {
    kvflow::ForwardBatch batch;
    int next_block = 0;
    size_t last = first;
    while (last < prompts.size()) {
      const auto& p = prompts[last];
      const int blocks = static_cast<int>((p.size() + block_size - 1) / block_size);
      if (last > first && (static_cast<int64_t>(batch.tokens.size() + p.size()) > batch_tokens ||
                           next_block + blocks > num_blocks)) {
        break;
      }
      kvflow::SequenceSlice s;
      s.token_offset = static_cast<int32_t>(batch.tokens.size());
      s.num_tokens = static_cast<int32_t>(p.size());
      s.context_len = s.num_tokens;
      s.logits = kvflow::LogitsMode::kLast;
      for (int b = 0; b < blocks; ++b) s.block_table.push_back(next_block++);
      for (size_t i = 0; i < p.size(); ++i) {
        batch.tokens.push_back(p[i]);
        batch.positions.push_back(static_cast<int32_t>(i));
      }
      batch.seqs.push_back(std::move(s));
      ++last;
    }
    auto t0 = Clock::now();
    if (Status st = model.Forward(batch, logits); !st.ok()) return fail(st);
    auto t1 = Clock::now();
    const int64_t n = static_cast<int64_t>(last - first);
    if (Status st = backend.value()->ReadFinalHidden(
            0, n, std::span<float>(rows.data() + first * static_cast<size_t>(H), static_cast<size_t>(n * H)));
        !st.ok()) {
      return fail(st);
    }
    forward_s += std::chrono::duration<double>(t1 - t0).count();
    read_s += SecondsSince(t1);
    prompt_tokens += static_cast<int64_t>(batch.tokens.size());
    first = last;
    if (SecondsSince(last_report) >= 10) {
      last_report = Clock::now();
      spdlog::info("{}/{} prompts, {:.0f} s", first, prompts.size(), SecondsSince(start));
    }
  }
  Json header{{"tool", "kvflow-length-predictor hidden"},
              {"command", command},
              {"dataset", opt.dataset},
              {"chat", opt.chat},
              {"model", opt.model},
              {"model_path", path.value()},
              {"model_fingerprint", fingerprint},
              {"hidden_size", H},
              {"vector", "final-norm output of the last prompt token (the LM head's input)"},
              {"prompts", prompts.size()},
              {"prompt_tokens", prompt_tokens},
              {"threads", opt.threads},
              {"forward_s", forward_s},
              {"read_hidden_s", read_s},
              {"read_hidden_us_per_prompt", read_s * 1e6 / static_cast<double>(prompts.size())},
              {"prefill_ms_per_prompt", forward_s * 1e3 / static_cast<double>(prompts.size())}};
  std::vector<int64_t> indices, lens, ntok;
  for (size_t i = 0; i < prompts.size(); ++i) {
    indices.push_back(ds->records[i].index);
    lens.push_back(*ds->records[i].output_len);
    ntok.push_back(static_cast<int64_t>(prompts[i].size()));
  }
  header["indices"] = indices;
  header["output_len"] = lens;
  header["prompt_len"] = ntok;
  if (Status st = WriteHiddenDump(opt.out, header, rows); !st.ok()) return fail(st);
  spdlog::info("wrote {}: {} prompts ({} tokens) x {} floats; prefill {:.1f} s ({:.1f} ms per prompt), hidden reads "
               "{:.2f} us per prompt",
               opt.out, prompts.size(), prompt_tokens, H, forward_s, forward_s * 1e3 / prompts.size(),
               read_s * 1e6 / prompts.size());
  return 0;
}

struct ProbeOptions {
  std::string dataset;
  std::string hidden;
  std::string model = "smollm2-135m";
  bool chat = false;
  int64_t max_output_len = 512;
  int num_buckets = 10;
  double test_fraction = 0.2;
  uint64_t split_seed = 0;
  double validation_fraction = 0.2;
  uint64_t seed = 0;
  std::vector<int> units = {0, 32, 128};
  std::vector<float> l2s = {1e-3f, 1e-2f, 1e-1f};
  std::vector<int> epochs = {20, 60};
  float lr = 1e-3f;
  int batch_size = 32;
  // Candidate online step sizes (0: never learns), chosen prequentially on the validation part.
  std::vector<float> online_lrs = {0.0f, 1e-4f, 3e-4f, 1e-3f, 3e-3f, 1e-2f};
  // The n-gram predictor's settings, as in length_predictor_alpaca_smollm2_512.
  int ngram_epochs = 10;
  float ngram_lr = 1.0f;
  float ngram_l2 = 0.0f;
  std::string out;
  std::string report;
  std::string tag = "smollm2";
};

// Mean |predicted - true| bucket over every example (a hit counts 0).
double MeanBucketDistance(const kvflow::LengthEvaluation& ev) {
  double sum = 0;
  for (size_t t = 0; t < ev.confusion.size(); ++t) {
    for (size_t p = 0; p < ev.confusion[t].size(); ++p) {
      sum += static_cast<double>(ev.confusion[t][p]) * std::abs(static_cast<double>(t) - static_cast<double>(p));
    }
  }
  return ev.examples > 0 ? sum / static_cast<double>(ev.examples) : 0.0;
}

Json ProbeEvaluationJson(const kvflow::LengthEvaluation& ev, const kvflow::LengthBuckets& buckets) {
  Json j = EvaluationJson(ev, buckets);
  j["mean_bucket_distance"] = MeanBucketDistance(ev);
  return j;
}

// The same held-out split as `train`: positions of the label file's records (sorted by index),
// shuffled by the split seed, the first test_fraction tested; the validation part is carved from
// the rest as `train` does.
struct Split {
  std::vector<size_t> train, valid, test;
};
Split MakeSplit(size_t n, double test_fraction, uint64_t split_seed, double validation_fraction) {
  std::vector<size_t> shuffled = Iota(n);
  FisherYates(shuffled, split_seed);
  const size_t num_test = static_cast<size_t>(std::llround(test_fraction * static_cast<double>(n)));
  Split s;
  s.test.assign(shuffled.begin(), shuffled.begin() + static_cast<std::ptrdiff_t>(num_test));
  s.train.assign(shuffled.begin() + static_cast<std::ptrdiff_t>(num_test), shuffled.end());
  if (validation_fraction > 0) {
    std::vector<size_t> rest = s.train;
    std::sort(rest.begin(), rest.end());
    FisherYates(rest, split_seed + 1);
    const size_t num_valid = static_cast<size_t>(std::llround(validation_fraction * static_cast<double>(rest.size())));
    s.valid.assign(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(num_valid));
  }
  for (auto* v : {&s.test, &s.train, &s.valid}) std::sort(v->begin(), v->end());
  return s;
}

std::vector<size_t> Without(const std::vector<size_t>& all, const std::vector<size_t>& remove) {
  std::vector<size_t> out;
  std::set_difference(all.begin(), all.end(), remove.begin(), remove.end(), std::back_inserter(out));
  return out;
}

int RunTrainProbe(const ProbeOptions& opt, const std::string& command) {
  auto fail = [](const Status& st) {
    spdlog::error("{}", st.ToString());
    return 1;
  };
  auto dump = ReadHiddenDump(opt.hidden);
  if (!dump.ok()) return fail(dump.status());
  auto ds = LoadLabels(opt.dataset);
  if (!ds.ok()) return fail(ds.status());
  auto tok = OpenTokenizer(opt.model);
  if (!tok.ok()) return fail(tok.status());
  auto renderer = PromptRenderer::Create(tok->tok(), opt.chat);
  if (!renderer.ok()) return fail(renderer.status());
  const Labelled data = Tokenize(ds.value(), tok->tok(), renderer.value());
  const size_t n = data.examples.size();
  if (dump->indices != data.indices) {
    return fail(Status::InvalidArgument(opt.hidden + " holds other prompts than " + opt.dataset +
                                        " (run `hidden` on this label file)"));
  }
  std::vector<kvflow::ProbeExample> probe_examples(n);
  for (size_t i = 0; i < n; ++i) {
    const auto row = dump->Row(i);
    probe_examples[i].hidden.assign(row.begin(), row.end());
    probe_examples[i].output_len = data.examples[i].output_len;
  }
  const kvflow::LengthBuckets buckets{opt.max_output_len, opt.num_buckets};
  const Split split = MakeSplit(n, opt.test_fraction, opt.split_seed, opt.validation_fraction);
  const std::vector<size_t> fit_pos = Without(split.train, split.valid);

  kvflow::LengthProbeConfig base;
  base.buckets = buckets;
  base.hidden_size = dump->hidden_size;
  base.seed = opt.seed;
  base.learning_rate = opt.lr;
  base.batch_size = opt.batch_size;
  if (Status st = base.Validate(); !st.ok()) return fail(st);

  // Model selection on the validation part of the training split only.
  Json tuning = Json::array();
  kvflow::LengthProbeConfig best = base;
  double best_acc = -1, best_dist = 0;
  const auto fit_set = Pick(probe_examples, fit_pos);
  const auto valid_set = Pick(probe_examples, split.valid);
  if (!valid_set.empty()) {
    std::printf("%-7s %-8s %-7s %9s %10s %8s\n", "units", "l2", "epochs", "val_acc", "val_dist", "train_s");
    for (int units : opt.units) {
      for (float l2 : opt.l2s) {
        for (int epochs : opt.epochs) {
          kvflow::LengthProbeConfig c = base;
          c.hidden_units = units;
          c.l2 = l2;
          c.epochs = epochs;
          if (Status st = c.Validate(); !st.ok()) return fail(st);
          kvflow::LengthProbe probe(c);
          const kvflow::TrainReport tr = probe.Train(fit_set);
          const kvflow::LengthEvaluation ev = kvflow::EvaluateProbe(probe, valid_set);
          const double dist = MeanBucketDistance(ev);
          std::printf("%-7d %-8g %-7d %8.2f%% %10.3f %8.2f\n", units, static_cast<double>(l2), epochs,
                      100 * ev.accuracy, dist, tr.seconds);
          tuning.push_back(Json{{"hidden_units", units}, {"l2", Decimal(l2)}, {"epochs", epochs},
                                {"validation_accuracy", ev.accuracy}, {"validation_mean_bucket_distance", dist},
                                {"train_s", tr.seconds}});
          if (ev.accuracy > best_acc + 1e-12 || (std::abs(ev.accuracy - best_acc) <= 1e-12 && dist < best_dist)) {
            best_acc = ev.accuracy;
            best_dist = dist;
            best = c;
          }
        }
      }
    }
  }
  spdlog::info("chosen on validation: {} hidden units, l2 {}, {} epochs", best.hidden_units, best.l2, best.epochs);

  // The online step size, chosen the way the supervisor learns: the chosen probe fitted without the
  // validation part, then each validation prompt predicted and learnt from in turn.
  const kvflow::LengthPredictorConfig supervisor_weights;  // the supervisor's default weights
  Json online_tuning = Json::array();
  if (!valid_set.empty() && !opt.online_lrs.empty()) {
    kvflow::LengthProbe fitted(best);
    fitted.Train(fit_set);
    double best_online = -1;
    std::printf("%-10s %9s %10s\n", "online_lr", "val_acc", "val_dist");
    for (float lr : opt.online_lrs) {
      kvflow::LengthProbe learner = fitted;
      learner.mutable_config().online_learning_rate = lr;
      if (Status st = learner.config().Validate(); !st.ok()) return fail(st);
      const kvflow::LengthEvaluation ev = kvflow::EvaluateProbeOnline(
          learner, valid_set, supervisor_weights.online_weight_correct, supervisor_weights.online_weight_mispredicted);
      std::printf("%-10g %8.2f%% %10.3f\n", static_cast<double>(lr), 100 * ev.accuracy, MeanBucketDistance(ev));
      online_tuning.push_back(Json{{"online_learning_rate", Decimal(lr)},
                                   {"validation_accuracy", ev.accuracy},
                                   {"validation_mean_bucket_distance", MeanBucketDistance(ev)}});
      if (ev.accuracy > best_online + 1e-12) {
        best_online = ev.accuracy;
        best.online_learning_rate = lr;
      }
    }
    spdlog::info("online step size chosen on validation: {}", best.online_learning_rate);
  }

  // The chosen probe and the n-gram predictor, both trained on the whole training split, tested on
  // the held-out prompts.
  const auto train_probe = Pick(probe_examples, split.train);
  const auto test_probe = Pick(probe_examples, split.test);
  kvflow::LengthProbe probe(best);
  probe.set_model_fingerprint(dump->header.value("model_fingerprint", ""));
  const kvflow::TrainReport probe_tr = probe.Train(train_probe);
  // Timed on repeated passes so the per-request figure is not one pass's noise.
  kvflow::LengthEvaluation probe_ev = kvflow::EvaluateProbe(probe, test_probe);
  double probe_us = probe_ev.mean_predict_us;
  for (int r = 0; r < 4; ++r) probe_us = std::min(probe_us, kvflow::EvaluateProbe(probe, test_probe).mean_predict_us);
  probe_ev.mean_predict_us = probe_us;

  kvflow::LengthPredictorConfig ngram_config;
  ngram_config.buckets = buckets;
  ngram_config.seed = opt.seed;
  ngram_config.epochs = opt.ngram_epochs;
  ngram_config.learning_rate = opt.ngram_lr;
  ngram_config.l2 = opt.ngram_l2;
  kvflow::LengthPredictor ngram(ngram_config);
  const kvflow::TrainReport ngram_tr = ngram.Train(Pick(data.examples, split.train));
  const auto test_ngram = Pick(data.examples, split.test);
  kvflow::LengthEvaluation ngram_ev = kvflow::Evaluate(ngram, test_ngram);
  double ngram_us = ngram_ev.mean_predict_us;
  for (int r = 0; r < 4; ++r) ngram_us = std::min(ngram_us, kvflow::Evaluate(ngram, test_ngram).mean_predict_us);
  ngram_ev.mean_predict_us = ngram_us;

  // The majority baseline: the training split's most common bucket, predicted for every test prompt.
  std::vector<int64_t> train_counts(buckets.num_buckets, 0);
  for (size_t p : split.train) ++train_counts[buckets.BucketOf(data.examples[p].output_len)];
  const int majority = static_cast<int>(std::max_element(train_counts.begin(), train_counts.end()) - train_counts.begin());
  std::vector<int64_t> test_lens;
  for (size_t p : split.test) test_lens.push_back(data.examples[p].output_len);
  const kvflow::LengthEvaluation majority_ev =
      kvflow::ScoreBucketPredictions(buckets, std::vector<int>(split.test.size(), majority), test_lens);

  // The same probe deciding by the median of its distribution instead of the mode: the choice that
  // minimizes the expected bucket distance (accuracy is the mode's to win).
  std::vector<int> medians;
  for (const kvflow::ProbeExample& e : test_probe) {
    const std::vector<float> probs = probe.Probabilities(e.hidden);
    int median = 0;
    for (float cum = 0; median < buckets.num_buckets - 1; ++median) {
      if ((cum += probs[median]) >= 0.5f) break;
    }
    medians.push_back(median);
  }
  const kvflow::LengthEvaluation median_ev = kvflow::ScoreBucketPredictions(buckets, medians, test_lens);

  // Both predictors learning online from the held-out prompts as they complete, in order (the
  // supervisor's rule; the n-gram predictor at its own online step size).
  kvflow::LengthProbe probe_learner = probe;
  const kvflow::LengthEvaluation probe_online_ev =
      kvflow::EvaluateProbeOnline(probe_learner, test_probe, supervisor_weights.online_weight_correct,
                                  supervisor_weights.online_weight_mispredicted);
  kvflow::LengthPredictor ngram_learner = ngram;
  const kvflow::LengthEvaluation ngram_online_ev = kvflow::EvaluateOnline(ngram_learner, test_ngram);

  std::vector<std::pair<std::string, Json>> rows = {{"probe", ProbeEvaluationJson(probe_ev, buckets)},
                                                    {"probe_median", ProbeEvaluationJson(median_ev, buckets)},
                                                    {"probe_online", ProbeEvaluationJson(probe_online_ev, buckets)},
                                                    {"ngram", ProbeEvaluationJson(ngram_ev, buckets)},
                                                    {"ngram_online", ProbeEvaluationJson(ngram_online_ev, buckets)},
                                                    {"majority", ProbeEvaluationJson(majority_ev, buckets)}};
  PrintEvaluationTable(rows);
  for (const auto& [name, j] : rows) {
    std::printf("%-10s mean |predicted - true| bucket over all prompts: %.3f\n", name.c_str(),
                j["mean_bucket_distance"].get<double>());
  }

  Json report;
  report["tool"] = "kvflow-length-predictor train-probe";
  report["tag"] = opt.tag;
  report["command"] = command;
  report["dataset"] = DatasetJson(ds.value(), tok.value(), opt.chat, kvflow::TokenizerFingerprint(tok->tok()));
  report["dataset"]["output_len"] = LengthStats(data.examples);
  report["hidden"] = dump->header;
  report["hidden"].erase("indices");
  report["hidden"].erase("output_len");
  report["hidden"].erase("prompt_len");
  report["hidden"]["path"] = opt.hidden;
  report["buckets"] = {{"max_output_len", buckets.max_output_len}, {"num_buckets", buckets.num_buckets},
                       {"bucket_width", buckets.width()}};
  report["split"] = {{"split_seed", opt.split_seed},
                     {"test_fraction", opt.test_fraction},
                     {"validation_fraction", opt.validation_fraction},
                     {"validation_seed", opt.split_seed + 1},
                     {"train_size", split.train.size()},
                     {"validation_size", split.valid.size()},
                     {"test_size", split.test.size()},
                     {"same_split_as", "kvflow-length-predictor train --split-seed/--test-fraction"}};
  auto indices_of = [&](const std::vector<size_t>& pos) {
    std::vector<int64_t> idx;
    for (size_t p : pos) idx.push_back(data.indices[p]);
    return idx;
  };
  report["split"]["test_indices"] = indices_of(split.test);
  report["tuning"] = tuning;
  report["online_tuning"] = online_tuning;
  report["probe"] = {{"kind", best.hidden_units == 0 ? "multinomial logistic regression"
                                                     : "one ReLU hidden layer + softmax"},
                     {"hidden_units", best.hidden_units},
                     {"l2", Decimal(best.l2)},
                     {"epochs", best.epochs},
                     {"learning_rate", Decimal(best.learning_rate)},
                     {"batch_size", best.batch_size},
                     {"seed", best.seed},
                     {"online_learning_rate", Decimal(best.online_learning_rate)},
                     {"parameters", probe.num_parameters()},
                     {"train_s", probe_tr.seconds},
                     {"final_loss", probe_tr.epoch_loss.empty() ? 0.0 : probe_tr.epoch_loss.back()}};
  report["ngram"] = {{"config", ConfigJson(ngram.config())}, {"train_s", ngram_tr.seconds}};
  report["majority_bucket"] = majority;
  for (const auto& [name, j] : rows) report["test"][name] = j;
  const double read_us = dump->header.value("read_hidden_us_per_prompt", 0.0);
  report["cost_per_request_us"] = {{"probe_predict", probe_us},
                                   {"hidden_read", read_us},
                                   {"probe_total", probe_us + read_us},
                                   {"ngram_predict", ngram_us},
                                   {"prefill_ms_for_context", dump->header.value("prefill_ms_per_prompt", 0.0)}};
  if (!opt.out.empty()) {
    std::ostringstream desc;
    desc << "trained on " << split.train.size() << " prompts of " << opt.dataset << " (split seed " << opt.split_seed
         << ", test fraction " << opt.test_fraction << "); held-out accuracy " << probe_ev.accuracy;
    probe.set_description(desc.str());
    if (Status st = probe.Save(opt.out); !st.ok()) return fail(st);
    report["probe_path"] = opt.out;
    report["probe_bytes"] = fs::file_size(opt.out);
    spdlog::info("wrote {}", opt.out);
  }
  if (!opt.report.empty()) {
    if (Status st = WriteText(opt.report, report.dump(2) + "\n"); !st.ok()) return fail(st);
    spdlog::info("wrote {}", opt.report);
  }
  return 0;
}

struct EvalProbeOptions {
  std::string probe;
  std::string hidden;
  std::string indices_from;
};

int RunEvalProbe(const EvalProbeOptions& opt) {
  auto fail = [](const Status& st) {
    spdlog::error("{}", st.ToString());
    return 1;
  };
  auto probe = kvflow::LengthProbe::Load(opt.probe);
  if (!probe.ok()) return fail(probe.status());
  auto dump = ReadHiddenDump(opt.hidden);
  if (!dump.ok()) return fail(dump.status());
  if (Status st = probe->CheckModel(dump->header.value("model_fingerprint", ""), dump->hidden_size); !st.ok()) {
    return fail(st);
  }
  std::set<int64_t> wanted;
  if (!opt.indices_from.empty()) {
    auto from = ReadJsonFile(opt.indices_from);
    if (!from.ok()) return fail(from.status());
    try {
      for (const Json& i : from->at("split").at("test_indices")) wanted.insert(i.get<int64_t>());
    } catch (const Json::exception& e) {
      return fail(Status::CorruptFile(opt.indices_from + ": no split.test_indices"));
    }
  }
  std::vector<kvflow::ProbeExample> examples;
  for (size_t i = 0; i < dump->indices.size(); ++i) {
    if (!wanted.empty() && !wanted.count(dump->indices[i])) continue;
    const auto row = dump->Row(i);
    examples.push_back({std::vector<float>(row.begin(), row.end()), dump->output_lens[i], 1.0f});
  }
  if (examples.empty()) return fail(Status::InvalidArgument("nothing to evaluate"));
  const kvflow::LengthEvaluation ev = kvflow::EvaluateProbe(probe.value(), examples);
  PrintEvaluationTable({{"eval", ProbeEvaluationJson(ev, probe->config().buckets)}});
  std::printf("mean |predicted - true| bucket over all prompts: %.3f\n", MeanBucketDistance(ev));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvflow-length-predictor: S3's output-length predictor (10 buckets of max_output_len / 10).\n\n"
      "  # label Alpaca prompts with SmolLM2's own greedy output lengths (resumable)\n"
      "  kvflow-length-predictor label --model smollm2-135m --chat --max-tokens 512 --num 600 --seed 0 \\\n"
      "      --dataset ../shared/datasets/alpaca/alpaca_5000.json --out labels.jsonl --resume --threads 1\n"
      "  # train on reference-output lengths, hold out 20% (seeded), write predictor + report\n"
      "  kvflow-length-predictor train --dataset ../shared/datasets/alpaca/alpaca_5000.json \\\n"
      "      --model smollm2-135m --max-output-len 2048 --out alpaca.lp --report report.json\n"
      "  # train on a label JSONL with chat prompts\n"
      "  kvflow-length-predictor train --dataset labels.jsonl --chat --max-output-len 512 --out s.lp\n"
      "  # evaluate on the held-out prompts of a train report\n"
      "  kvflow-length-predictor eval --predictor alpaca.lp --dataset alpaca_5000.json \\\n"
      "      --indices-from report.json --report eval.json"};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Debug logging");

  LabelOptions label;
  CLI::App* label_cmd = app.add_subcommand("label", "Generate greedily with the engine and record output lengths (JSONL)");
  label_cmd->add_option("--dataset", label.dataset, "Alpaca JSON list")->required();
  label_cmd->add_option("-o,--out", label.out, "Output JSONL (index, prompt, output_len, finish_reason)")->required();
  label_cmd->add_option("--num", label.num, "Label a seeded sample of this many prompts (0 = all)")->default_val(0);
  label_cmd->add_option("--seed", label.seed, "Seed of the sample")->default_val(0);
  label_cmd->add_flag("--chat", label.chat, "Send each prompt as one user message in the model's chat template");
  label_cmd->add_option("-n,--max-tokens", label.max_tokens, "Output tokens at most")->default_val(512);
  label_cmd->add_flag("--resume", label.resume, "Append to an existing output, skipping indices already in it");
  label_cmd->add_flag("--dry-run", label.dry_run,
                      "Print the sample (position, index, done/todo) and exit without loading the model");
  label_cmd->add_option("--progress-s", label.progress_s, "Seconds between progress lines")->default_val(10.0);
  kvflow::AddEngineFlags(label_cmd, &label.engine, &label.swap_space_gib);

  TrainOptions train;
  CLI::App* train_cmd = app.add_subcommand("train", "Train a predictor on a held-out split and report its accuracy");
  train_cmd->add_option("--dataset", train.dataset, "Alpaca JSON (reference-output labels) or a label JSONL")
      ->required();
  train_cmd->add_option("-m,--model", train.model, "Model whose tokenizer the predictor uses")
      ->default_val("smollm2-135m");
  train_cmd->add_flag("--chat", train.chat, "Tokenize prompts inside the chat template (as chat requests arrive)");
  train_cmd->add_option("--max-output-len", train.config.buckets.max_output_len, "Output length the buckets span")
      ->default_val(2048);
  train_cmd->add_option("--num-buckets", train.config.buckets.num_buckets, "Buckets")->default_val(10);
  train_cmd->add_option("--reservation-point", train.reservation_point, "upper or middle of the predicted bucket")
      ->default_val("upper");
  train_cmd->add_option("--test-fraction", train.test_fraction, "Held-out share")->default_val(0.2);
  train_cmd->add_option("--split-seed", train.split_seed, "Seed of the held-out split")->default_val(0);
  train_cmd->add_option("--validation-fraction", train.validation_fraction,
                        "Share of the training split held out for tuning (0 = none); the test split is then "
                        "not evaluated")->default_val(0.0);
  train_cmd->add_option("--validation-seed", train.validation_seed,
                        "Seed of the validation part (default: split seed + 1)");
  train_cmd->add_option("--seed", train.config.seed, "Training shuffle seed")->default_val(0);
  train_cmd->add_option("--epochs", train.config.epochs, "Passes over the training split")->default_val(20);
  train_cmd->add_option("--lr", train.config.learning_rate, "AdaGrad learning rate")->default_val(0.5);
  train_cmd->add_option("--l2", train.config.l2, "L2 regularisation")->default_val(1e-6);
  train_cmd->add_option("--hash-bits", train.config.hash_bits, "log2 of the hashed feature slots")->default_val(16);
  train_cmd->add_option("--online-lr", train.config.online_learning_rate, "Online SGD step")->default_val(0.1);
  train_cmd->add_option("-o,--out", train.out, "Predictor file to write");
  train_cmd->add_option("--report", train.report, "JSON report to write");
  train_cmd->add_option("--tag", train.tag, "Name of the run in the report");
  train_cmd->add_flag("--require-better-than-majority", train.require_better_than_majority,
                      "Exit with code 3 unless the held-out accuracy beats always predicting the majority bucket");

  EvalOptions eval;
  CLI::App* eval_cmd = app.add_subcommand("eval", "Evaluate a predictor on a dataset");
  eval_cmd->add_option("--predictor", eval.predictor, "Predictor file")->required();
  eval_cmd->add_option("--dataset", eval.dataset, "Alpaca JSON or a label JSONL")->required();
  eval_cmd->add_option("-m,--model", eval.model, "Model whose tokenizer the predictor uses")->default_val("smollm2-135m");
  eval_cmd->add_flag("--chat", eval.chat, "Tokenize prompts inside the chat template");
  eval_cmd->add_option("--indices-from", eval.indices_from, "Only the split.test_indices of this train report");
  eval_cmd->add_option("--report", eval.report, "JSON report to write");

  HiddenOptions hidden;
  CLI::App* hidden_cmd = app.add_subcommand(
      "hidden", "Prefill every prompt of a label JSONL and dump its last token's final-norm hidden state");
  hidden_cmd->add_option("--dataset", hidden.dataset, "Label JSONL (from `label`)")->required();
  hidden_cmd->add_option("-m,--model", hidden.model, "Model (the one that generated the labels)")
      ->default_val("smollm2-135m");
  hidden_cmd->add_flag("--chat", hidden.chat, "Prompts inside the chat template (as labelled)");
  hidden_cmd->add_option("-o,--out", hidden.out, "Dump to write")->required();
  hidden_cmd->add_option("--num-threads", hidden.threads, "CPU threads")->default_val(2);
  hidden_cmd->add_option("--batch-tokens", hidden.batch_tokens, "Prompt tokens per forward pass")->default_val(2048);

  ProbeOptions probe;
  CLI::App* probe_cmd = app.add_subcommand(
      "train-probe", "Train the hidden-state probe (model chosen on a validation part), compare it with the n-gram "
                     "predictor and the majority bucket on the held-out split");
  probe_cmd->add_option("--dataset", probe.dataset, "Label JSONL")->required();
  probe_cmd->add_option("--hidden", probe.hidden, "Dump written by `hidden` for the same label JSONL")->required();
  probe_cmd->add_option("-m,--model", probe.model, "Model whose tokenizer the n-gram predictor uses")
      ->default_val("smollm2-135m");
  probe_cmd->add_flag("--chat", probe.chat, "Prompts inside the chat template (for the n-gram predictor)");
  probe_cmd->add_option("--max-output-len", probe.max_output_len, "Output length the buckets span")->default_val(512);
  probe_cmd->add_option("--num-buckets", probe.num_buckets, "Buckets")->default_val(10);
  probe_cmd->add_option("--test-fraction", probe.test_fraction, "Held-out share")->default_val(0.2);
  probe_cmd->add_option("--split-seed", probe.split_seed, "Seed of the held-out split")->default_val(0);
  probe_cmd->add_option("--validation-fraction", probe.validation_fraction,
                        "Share of the training split used to choose the probe (0: take the first candidate)")
      ->default_val(0.2);
  probe_cmd->add_option("--seed", probe.seed, "Training seed (shuffles, initial weights)")->default_val(0);
  probe_cmd->add_option("--units", probe.units, "Candidate hidden-layer widths (0: linear)");
  probe_cmd->add_option("--l2", probe.l2s, "Candidate L2 strengths");
  probe_cmd->add_option("--epochs", probe.epochs, "Candidate epoch counts");
  probe_cmd->add_option("--lr", probe.lr, "Adam learning rate")->default_val(1e-3);
  probe_cmd->add_option("--batch-size", probe.batch_size, "Minibatch")->default_val(32);
  probe_cmd->add_option("--online-lr", probe.online_lrs,
                        "Candidate online SGD step sizes (0: no online learning), chosen on the validation part "
                        "by predicting then learning from each prompt in turn, as the supervisor does");
  probe_cmd->add_option("-o,--out", probe.out, "Probe file to write");
  probe_cmd->add_option("--report", probe.report, "JSON report to write");
  probe_cmd->add_option("--tag", probe.tag, "Name of the run in the report");

  EvalProbeOptions eval_probe;
  CLI::App* eval_probe_cmd = app.add_subcommand("eval-probe", "Evaluate a probe on a hidden-state dump");
  eval_probe_cmd->add_option("--probe", eval_probe.probe, "Probe file")->required();
  eval_probe_cmd->add_option("--hidden", eval_probe.hidden, "Dump written by `hidden`")->required();
  eval_probe_cmd->add_option("--indices-from", eval_probe.indices_from,
                             "Only the split.test_indices of this train-probe report");

  CLI11_PARSE(app, argc, argv);
  spdlog::set_default_logger(spdlog::stderr_color_mt("kvflow-lp"));
  spdlog::set_level(verbose ? spdlog::level::debug : spdlog::level::info);
  const std::string command = JoinArgs(argc, argv);

  if (*label_cmd) {
    kvflow::ApplySwapSpace(&label.engine, label.swap_space_gib);
    return RunLabel(label, command);
  }
  if (*train_cmd) return RunTrain(train, command);
  if (*hidden_cmd) return RunHidden(hidden, command);
  if (*probe_cmd) return RunTrainProbe(probe, command);
  if (*eval_probe_cmd) return RunEvalProbe(eval_probe);
  return RunEval(eval, command);
}
