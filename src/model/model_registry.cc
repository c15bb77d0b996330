#include <cstdlib>
#include <filesystem>
#include <map>

#include "kvflow/models.h"
#include "model/tiny_random.h"

#ifndef KVFLOW_DEFAULT_MODEL_DIR
#define KVFLOW_DEFAULT_MODEL_DIR ""
#endif

namespace kvflow {
namespace fs = std::filesystem;

namespace {

// Short names users can type instead of a path, and the file each resolves to.
const std::map<std::string, std::string>& KnownModels() {
  static const std::map<std::string, std::string> kModels = {
      {"smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"},
      {"smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"},
      {"smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"},
  };
  return kModels;
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

std::vector<std::string> ModelSearchDirs() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("KVFLOW_MODEL_DIR"); env != nullptr && *env != '\0') dirs.emplace_back(env);
  dirs.emplace_back("models");
  if (std::string(KVFLOW_DEFAULT_MODEL_DIR).size() > 0) dirs.emplace_back(KVFLOW_DEFAULT_MODEL_DIR);
  return dirs;
}

Result<std::string> ResolveModel(const std::string& path_or_name) {
  if (IsBuiltInModel(path_or_name)) return path_or_name;
  std::error_code ec;
  if (fs::exists(path_or_name, ec)) return path_or_name;
  const auto& known = KnownModels();
  auto it = known.find(Lower(path_or_name));
  const std::string file = it != known.end() ? it->second : path_or_name;
  std::string looked;
  for (const std::string& dir : ModelSearchDirs()) {
    const fs::path candidate = fs::path(dir) / file;
    if (fs::exists(candidate, ec)) return candidate.string();
    looked += "\n  " + candidate.string();
  }
  std::string names;
  for (const auto& [name, _] : known) names += name + ", ";
  return Status::NotFound("model '" + path_or_name + "' is neither a path nor found in the model directories:" +
                          looked + "\nknown short names: " + names + "tiny-random, tiny-random-draft (built in), random:<shape> (GPU only)" +
                          "\nrun tools/fetch-model to download SmolLM2-135M-Instruct");
}

}  // namespace kvflow
