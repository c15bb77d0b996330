#include "infinigen/skew_file.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

namespace kvflow {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'F', 'S', 'K', 'E', 'W', '1'};
constexpr uint32_t kVersion = 1;
// A stored matrix further than this from orthogonal (max |A^T A - I|) is corrupt: fp32 storage of
// an orthogonal matrix stays within ~1e-6.
constexpr double kOrthogonalityTolerance = 1e-3;

uint64_t Fnv1a(const uint8_t* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= data[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

class Writer {
 public:
  template <typename T>
  void Put(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  void PutBytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  }
  std::vector<uint8_t> bytes;
};

class Reader {
 public:
  Reader(const std::vector<uint8_t>& bytes, size_t end) : bytes_(bytes), end_(end) {}
  template <typename T>
  bool Get(T& v) {
    if (at_ + sizeof(T) > end_) return false;
    std::memcpy(&v, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  bool GetBytes(void* p, size_t n) {
    if (n > end_ - at_) return false;
    std::memcpy(p, bytes_.data() + at_, n);
    at_ += n;
    return true;
  }
  size_t at() const { return at_; }

 private:
  const std::vector<uint8_t>& bytes_;
  size_t end_;
  size_t at_ = 0;
};

double OrthogonalityError(const std::vector<float>& a, int n) {
  double worst = 0.0;
  for (int i = 0; i < n; ++i) {
    for (int j = i; j < n; ++j) {
      double dot = 0.0;
      for (int k = 0; k < n; ++k) dot += static_cast<double>(a[static_cast<size_t>(k) * n + i]) * a[static_cast<size_t>(k) * n + j];
      worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return worst;
}

}  // namespace

std::string DefaultSkewPath(const std::string& model_path) { return model_path + ".infinigen"; }

Status WriteSkewTable(const SkewTable& t, const std::string& path) {
  const size_t D = static_cast<size_t>(t.head_dim);
  if (t.heads.size() != static_cast<size_t>(t.num_layers) * t.num_kv_heads) {
    return Status::InvalidArgument("skewing table: " + std::to_string(t.heads.size()) + " heads for " +
                                   std::to_string(t.num_layers) + " layers of " + std::to_string(t.num_kv_heads));
  }
  Writer w;
  w.PutBytes(kMagic, sizeof(kMagic));
  w.Put(kVersion);
  for (int v : {t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim, t.num_partial_columns}) w.Put(static_cast<uint32_t>(v));
  w.Put(static_cast<uint32_t>(t.calibration_tokens));
  w.Put(t.partial_ratio);
  w.Put(static_cast<uint32_t>(t.model_name.size()));
  w.PutBytes(t.model_name.data(), t.model_name.size());
  for (const SkewHead& h : t.heads) {
    if (h.matrix.size() != D * D || h.columns.size() != static_cast<size_t>(t.num_partial_columns)) {
      return Status::InvalidArgument("skewing table: a head's matrix or columns have the wrong size");
    }
    w.PutBytes(h.matrix.data(), sizeof(float) * h.matrix.size());
    w.PutBytes(h.columns.data(), sizeof(int32_t) * h.columns.size());
  }
  w.Put(Fnv1a(w.bytes.data(), w.bytes.size()));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::IoError("cannot write the skewing file " + path);
  out.write(reinterpret_cast<const char*>(w.bytes.data()), static_cast<std::streamsize>(w.bytes.size()));
  if (!out) return Status::IoError("writing the skewing file " + path + " failed");
  return Status::Ok();
}

Result<SkewTable> ReadSkewTable(const std::string& path, const ModelConfig& model) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::NotFound("InfiniGen skewing file " + path + " not found; create it once per model with "
                            "`kvflow skew --model <model> --file <sample text>`");
  }
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string bad = "InfiniGen skewing file " + path + ": ";
  if (bytes.size() < sizeof(kMagic) + sizeof(uint64_t) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return Status::CorruptFile(bad + "not a skewing file (bad magic)");
  }
  const size_t body = bytes.size() - sizeof(uint64_t);
  uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + body, sizeof(stored));
  if (stored != Fnv1a(bytes.data(), body)) return Status::CorruptFile(bad + "checksum mismatch (truncated or corrupt)");

  Reader r(bytes, body);
  char magic[8];
  uint32_t version = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, partial = 0, tokens = 0, name_len = 0;
  SkewTable t;
  if (!r.GetBytes(magic, sizeof(magic)) || !r.Get(version)) return Status::CorruptFile(bad + "truncated header");
  if (version != kVersion) {
    return Status::InvalidArgument(bad + "version " + std::to_string(version) + ", this build reads " +
                                   std::to_string(kVersion) + "; recreate it with `kvflow skew`");
  }
  if (!r.Get(layers) || !r.Get(heads) || !r.Get(kv_heads) || !r.Get(head_dim) || !r.Get(partial) || !r.Get(tokens) ||
      !r.Get(t.partial_ratio) || !r.Get(name_len) || name_len > 4096) {
    return Status::CorruptFile(bad + "truncated header");
  }
  t.model_name.resize(name_len);
  if (!r.GetBytes(t.model_name.data(), name_len)) return Status::CorruptFile(bad + "truncated header");
  if (static_cast<int>(layers) != model.num_layers || static_cast<int>(heads) != model.num_heads ||
      static_cast<int>(kv_heads) != model.num_kv_heads || static_cast<int>(head_dim) != model.head_dim) {
    return Status::InvalidArgument(
        bad + "written for " + (t.model_name.empty() ? std::string("another model") : "'" + t.model_name + "'") + " (" +
        std::to_string(layers) + " layers, " + std::to_string(heads) + "/" + std::to_string(kv_heads) + " heads, head_dim " +
        std::to_string(head_dim) + "), not this one (" + std::to_string(model.num_layers) + " layers, " +
        std::to_string(model.num_heads) + "/" + std::to_string(model.num_kv_heads) + " heads, head_dim " +
        std::to_string(model.head_dim) + ")");
  }
  if (partial < 1 || partial > head_dim) return Status::CorruptFile(bad + "partial column count out of range");
  t.num_layers = static_cast<int>(layers);
  t.num_heads = static_cast<int>(heads);
  t.num_kv_heads = static_cast<int>(kv_heads);
  t.head_dim = static_cast<int>(head_dim);
  t.num_partial_columns = static_cast<int>(partial);
  t.calibration_tokens = tokens;
  const size_t D = head_dim;
  t.heads.resize(static_cast<size_t>(layers) * kv_heads);
  for (size_t i = 0; i < t.heads.size(); ++i) {
    SkewHead& h = t.heads[i];
    h.matrix.resize(D * D);
    h.columns.resize(partial);
    if (!r.GetBytes(h.matrix.data(), sizeof(float) * D * D) || !r.GetBytes(h.columns.data(), sizeof(int32_t) * partial)) {
      return Status::CorruptFile(bad + "truncated body");
    }
    const std::string where = "layer " + std::to_string(i / kv_heads) + " KV head " + std::to_string(i % kv_heads);
    for (size_t c = 0; c < h.columns.size(); ++c) {
      if (h.columns[c] < 0 || h.columns[c] >= static_cast<int32_t>(D) || (c > 0 && h.columns[c] <= h.columns[c - 1])) {
        return Status::CorruptFile(bad + where + ": partial columns not ascending inside head_dim");
      }
    }
    for (float v : h.matrix) {
      if (!std::isfinite(v)) return Status::CorruptFile(bad + where + ": non-finite matrix entry");
    }
    if (OrthogonalityError(h.matrix, static_cast<int>(D)) > kOrthogonalityTolerance) {
      return Status::CorruptFile(bad + where + ": the skewing matrix is not orthogonal");
    }
  }
  if (r.at() != body) return Status::CorruptFile(bad + "trailing bytes after the last head");
  return t;
}

}  // namespace kvflow
