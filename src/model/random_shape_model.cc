#include "model/random_shape_model.h"

#include "model/byte_level.h"
#include "model/model_shapes.h"

namespace kvflow {
namespace {

// No tensors: the weights are generated where they live (on the GPU).
class RandomWeightsSource final : public TensorSource {
 public:
  explicit RandomWeightsSource(std::string shape) : shape_(std::move(shape)) {}
  const TensorInfo* Find(const std::string&) const override { return nullptr; }
  std::vector<std::string> Names() const override { return {}; }
  std::string Describe() const override {
    return "random weights of the " + shape_ + " shape, generated on the GPU (speed only; outputs are meaningless)";
  }

 private:
  std::string shape_;
};

}  // namespace

Result<ModelFiles> MakeRandomShapeModel(const std::string& name, uint64_t seed) {
  if (!IsRandomShapeModel(name)) return Status::InvalidArgument("not a random:<shape> model name: " + name);
  const std::string shape = name.substr(std::char_traits<char>::length(kRandomShapePrefix));
  KVFLOW_ASSIGN_OR_RETURN(ModelConfig c, ModelShape(shape));
  c.name = name;
  // 256 bytes, then the specials, then reserved tokens up to the vocabulary: every id a random model
  // samples decodes (control tokens, to nothing), and any text encodes (one token a byte).
  constexpr int kByteTokens = 256;
  if (c.vocab_size < kByteTokens + 3) {
    return Status::InvalidArgument("shape " + shape + ": vocabulary " + std::to_string(c.vocab_size) +
                                   " is smaller than the byte-level tokenizer's 259 tokens");
  }
  TokenizerSpec spec;
  spec.pre = "gpt2";
  for (int b = 0; b < kByteTokens; ++b) spec.tokens.push_back(ByteLevelSpelling(static_cast<uint8_t>(b)));
  spec.token_types.assign(kByteTokens, 1);
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    spec.tokens.push_back(special);
    spec.token_types.push_back(3);
  }
  for (int id = static_cast<int>(spec.tokens.size()); id < c.vocab_size; ++id) {
    spec.tokens.push_back("<|reserved_" + std::to_string(id) + "|>");
    spec.token_types.push_back(3);
  }
  spec.bos_id = kByteTokens;
  spec.eos_id = kByteTokens;
  spec.add_bos = true;
  spec.chat_template = "chatml";
  c.bos_token_id = kByteTokens;
  c.eos_token_ids = {kByteTokens};

  ModelFiles files;
  files.config = c;
  files.tensors = std::make_unique<RandomWeightsSource>(shape);
  files.random_weights = true;
  files.random_seed = seed;
  KVFLOW_ASSIGN_OR_RETURN(files.tokenizer, Tokenizer::FromSpec(std::move(spec)));
  return files;
}

}  // namespace kvflow
