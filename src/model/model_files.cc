// OpenModelFiles: decides what a path holds and assembles config, tensors and tokenizer.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "model/gguf.h"
#include "model/model_config.h"
#include "model/safetensors.h"
#include "model/tensor_source.h"
#include "model/tiny_random.h"

namespace kvflow {

namespace {

namespace fs = std::filesystem;

constexpr const char* kExpectedForms =
    "a .gguf file, a .safetensors file, a model.safetensors.index.json, or a directory holding "
    "config.json plus model.safetensors or model.safetensors.index.json";

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool Exists(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

uint64_t TotalTensorBytes(const TensorSource& source) {
  uint64_t total = 0;
  for (const std::string& name : source.Names()) total += source.Find(name)->nbytes;
  return total;
}

// The embedding is [vocab, hidden] in both formats once GGUF shapes are reversed.
Status CheckEmbeddingShape(const TensorSource& tensors, const std::string& name,
                           const ModelConfig& config) {
  const TensorInfo* embedding = tensors.Find(name);
  if (embedding == nullptr) return Status::Ok();  // the weight loader reports missing tensors
  if (embedding->shape.size() != 2 || embedding->shape[0] != config.vocab_size ||
      embedding->shape[1] != config.hidden_size) {
    return Status::CorruptFile(
        embedding->file + ": tensor '" + name + "' does not match vocab_size x hidden_size = " +
        std::to_string(config.vocab_size) + " x " + std::to_string(config.hidden_size));
  }
  return Status::Ok();
}

// A tokenizer kvflow cannot run is no reason to refuse the weights: callers may bring token ids.
Status KeepTokenizerOrWarn(Result<std::unique_ptr<Tokenizer>> tokenizer, ModelFiles* files) {
  if (tokenizer.ok()) {
    files->tokenizer = std::move(tokenizer).value();
    return Status::Ok();
  }
  const Status& st = tokenizer.status();
  if (st.code() != StatusCode::kUnsupported && st.code() != StatusCode::kNotFound) return st;
  spdlog::warn("no tokenizer: {}", st.message());
  return Status::Ok();
}

Result<ModelFiles> OpenGguf(const std::string& path) {
  KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> gguf, GgufFile::Open(path));
  ModelFiles files;
  KVFLOW_ASSIGN_OR_RETURN(files.config, ModelConfigFromGguf(*gguf));
  Result<TokenizerSpec> spec = TokenizerSpecFromGguf(*gguf);
  if (spec.ok()) {
    KVFLOW_RETURN_IF_ERROR(
        KeepTokenizerOrWarn(Tokenizer::FromSpec(std::move(spec).value()), &files));
  } else {
    KVFLOW_RETURN_IF_ERROR(KeepTokenizerOrWarn(spec.status(), &files));
  }
  KVFLOW_RETURN_IF_ERROR(CheckEmbeddingShape(*gguf, "token_embd.weight", files.config));
  // llama.cpp's converter permutes Q/K rows for llama and mistral (its RoPE pairs neighbours);
  // Qwen's keep HF's order (llama.cpp rotates them NEOX-style, HF's rotate_half).
  files.gguf_rope_permuted = files.config.architecture == "llama" || files.config.architecture == "mistral";
  files.tensors = std::move(gguf);
  return files;
}

// `weights` is a .safetensors file or an index; config.json and tokenizer.json sit beside it.
Result<ModelFiles> OpenHfCheckpoint(const fs::path& weights) {
  const fs::path dir = weights.parent_path().empty() ? fs::path(".") : weights.parent_path();
  const fs::path config_path = dir / "config.json";
  if (!Exists(config_path)) {
    return Status::NotFound(config_path.string() +
                            " not found; safetensors weights need the "
                            "config.json of their checkpoint beside them");
  }
  ModelFiles files;
  KVFLOW_ASSIGN_OR_RETURN(files.config, ModelConfigFromHfJson(config_path.string()));

  if (EndsWith(weights.string(), ".json")) {
    KVFLOW_ASSIGN_OR_RETURN(files.tensors, SafetensorsSource::OpenIndex(weights.string()));
  } else {
    KVFLOW_ASSIGN_OR_RETURN(files.tensors, SafetensorsSource::OpenFile(weights.string()));
  }
  KVFLOW_RETURN_IF_ERROR(
      CheckEmbeddingShape(*files.tensors, "model.embed_tokens.weight", files.config));
  if (!files.config.tie_word_embeddings && files.tensors->Find("lm_head.weight") == nullptr) {
    spdlog::warn("{}: no lm_head.weight; tying the output projection to the embeddings",
                 weights.string());
    files.config.tie_word_embeddings = true;
  }

  const fs::path tokenizer_path = dir / "tokenizer.json";
  if (Exists(tokenizer_path)) {
    KVFLOW_RETURN_IF_ERROR(
        KeepTokenizerOrWarn(Tokenizer::FromHfJson(tokenizer_path.string()), &files));
  } else {
    spdlog::warn("{} not found; the model has no tokenizer", tokenizer_path.string());
  }
  return files;
}

Result<ModelFiles> OpenByKind(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    for (const char* name : {"model.safetensors.index.json", "model.safetensors"}) {
      if (Exists(dir / name)) return OpenHfCheckpoint(dir / name);
    }
    return Status::NotFound(path +
                            " is a directory without model.safetensors or "
                            "model.safetensors.index.json; expected " +
                            kExpectedForms);
  }
  if (!Exists(path)) {
    return Status::NotFound("no model at " + path + "; expected " + kExpectedForms);
  }
  if (EndsWith(path, ".gguf")) return OpenGguf(path);
  if (EndsWith(path, ".safetensors") || EndsWith(path, ".index.json")) {
    return OpenHfCheckpoint(path);
  }
  return Status::Unsupported(path + " is not a recognized model file; expected " + kExpectedForms);
}

}  // namespace

Result<ModelFiles> OpenModelFiles(const std::string& path) {
  if (IsBuiltInModel(path)) return MakeBuiltInModel(path);
  KVFLOW_ASSIGN_OR_RETURN(ModelFiles files, OpenByKind(path));
  KVFLOW_RETURN_IF_ERROR(files.config.Validate());
  const uint64_t bytes = TotalTensorBytes(*files.tensors);
  spdlog::info("opened {} ({:.1f} MB of weights): {}, {} layers, hidden {}, vocab {}{}",
               files.tensors->Describe(), bytes / 1e6, files.config.name, files.config.num_layers,
               files.config.hidden_size, files.config.vocab_size,
               files.tokenizer ? "" : ", no tokenizer");
  return files;
}

Result<std::unique_ptr<Tokenizer>> OpenTokenizer(const std::string& path) {
  if (IsBuiltInModel(path)) {
    KVFLOW_ASSIGN_OR_RETURN(ModelFiles files, MakeBuiltInModel(path));
    if (!files.tokenizer) return Status::NotFound(path + " has no tokenizer");
    return std::move(files.tokenizer);
  }
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path json = fs::path(path) / "tokenizer.json";
    if (!Exists(json)) return Status::NotFound(path + " is a directory without tokenizer.json");
    return Tokenizer::FromHfJson(json.string());
  }
  if (!Exists(path)) return Status::NotFound("no tokenizer at " + path);
  if (EndsWith(path, ".json")) return Tokenizer::FromHfJson(path);
  if (EndsWith(path, ".gguf")) {
    KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> gguf, GgufFile::Open(path));
    KVFLOW_ASSIGN_OR_RETURN(TokenizerSpec spec, TokenizerSpecFromGguf(*gguf));
    return Tokenizer::FromSpec(std::move(spec));
  }
  if (EndsWith(path, ".safetensors")) {
    const fs::path dir = fs::path(path).parent_path();  // tokenizer.json sits beside the weights
    return OpenTokenizer(dir.empty() ? "." : dir.string());
  }
  return Status::Unsupported(path + " holds no tokenizer kvflow reads; expected a .gguf file (a "
                             "vocabulary-only one is enough), a tokenizer.json, or a directory with one");
}

LoadProgress::LoadProgress(std::string what, uint64_t total_bytes)
    : what_(std::move(what)), total_bytes_(total_bytes) {}

void LoadProgress::Advance(uint64_t bytes) {
  done_bytes_ += bytes;
  if (total_bytes_ < kLogThresholdBytes) return;
  const int decile = static_cast<int>(std::min<uint64_t>(10, done_bytes_ * 10 / total_bytes_));
  if (decile <= last_logged_decile_) return;
  last_logged_decile_ = decile;
  spdlog::info("{}: {}% ({:.0f} / {:.0f} MB)", what_, decile * 10, done_bytes_ / 1e6,
               total_bytes_ / 1e6);
}

}  // namespace kvflow
