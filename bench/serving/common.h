// What every piece of the serving benchmark shares: aliases, exit codes, result paths, number formatting, the machine description and the model choice.
#pragma once

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvflow/status.h"
#include "model/tensor_source.h"

#ifndef KVFLOW_SOURCE_DIR
#define KVFLOW_SOURCE_DIR "."
#endif

namespace kvflow::bench::serving {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
using kvflow::Result;
using kvflow::Status;

// ctest's "skipped" exit code: the trace's dataset is not on this machine.
constexpr int kExitSkipped = 77;
constexpr const char* kDefaultModel = "smollm2-135m";
inline const std::string kResultsDir = KVFLOW_SOURCE_DIR "/bench/results";
inline const std::string kDefaultAlpacaPath = KVFLOW_SOURCE_DIR "/../shared/datasets/alpaca/alpaca_5000.json";

double SecondsSince(Clock::time_point start);

std::string Join(const std::vector<std::string>& parts, const std::string& sep);

std::string Fixed(double v, int decimals);

// Three significant digits for values spanning orders of magnitude (latencies in seconds).
std::string Sig3(double v);

std::string CpuName();

Json MachineJson(int num_threads);

// Busy-waiting OpenMP threads steal the cores other processes share with the timed engine.
void WarnIfOmpSpins();

// ---- models ---------------------------------------------------------------------------------

// The model (or tokenizer) a run uses, named as file names and reports name it.
struct ModelChoice {
  std::string name;  // short name, file stem, or "tiny-random"
  std::string path;  // resolved file, or "tiny-random"
};

// Resolves `requested`. The default model falls back to the built-in tiny-random model (whose
// tokenizer is byte-level) when its file is absent; an explicitly requested one must exist.
Result<ModelChoice> ChooseModel(const std::string& requested, bool explicitly_requested);

Result<kvflow::ModelFiles> OpenModel(const ModelChoice& model);

}  // namespace kvflow::bench::serving
