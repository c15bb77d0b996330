// Model shapes (model/model_shapes.h) and the built-in random:<shape> models
// (model/random_shape_model.h): the shapes' sizes against the published parameter counts, the padded
// byte-level tokenizer, and the clear refusals where random weights cannot be used (CPU backend,
// weight loading). Their engine runs on the CUDA backend are in tests/cuda/test_cuda_backend.cc.
#include <gtest/gtest.h>

#include "backend/backend_factory.h"
#include "kvflow/engine.h"
#include "model/model_shapes.h"
#include "model/random_shape_model.h"
#include "model/tiny_random.h"

namespace kvflow {
namespace {

// Parameters stored: embeddings, LM head unless tied, per layer Q/K/V/O, gate/up/down and two norms,
// the final norm.
int64_t Params(const ModelConfig& c) {
  const int64_t H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size, D = c.head_dim;
  const int64_t layer = H * c.num_heads * D + 2 * H * c.num_kv_heads * D + c.num_heads * D * H + 3 * H * F + 2 * H;
  return V * H * (c.tie_word_embeddings ? 1 : 2) + c.num_layers * layer + H;
}

TEST(ModelShapes, MatchThePublishedModels) {
  EXPECT_EQ(ModelShapeNames(), (std::vector<std::string>{"smollm2-135m", "llama-3.1-8b", "llama-2-7b", "tiny"}));
  const ModelConfig llama3 = ModelShape("llama-3.1-8b").value();
  EXPECT_EQ(llama3.name, "llama-3.1-8b-shape");
  EXPECT_EQ(Params(llama3), 8030261248);  // "8.03B" on the model card
  EXPECT_EQ(llama3.num_kv_heads, 8);
  EXPECT_EQ(llama3.rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(Params(ModelShape("llama-2-7b").value()), 6738415616);  // "6.74B"
  EXPECT_EQ(Params(ModelShape("smollm2-135m").value()), 134515008);  // 134.5M, tied embeddings
  for (const std::string& name : ModelShapeNames()) EXPECT_TRUE(ModelShape(name).value().Validate().ok()) << name;
}

TEST(ModelShapes, UnknownNamesListTheKnownOnes) {
  const auto r = ModelShape("llama-9-1t");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("llama-3.1-8b"), std::string::npos) << r.status().ToString();
}

TEST(RandomShapeModel, HasTheShapeNoWeightsAndATokenizerCoveringTheVocabulary) {
  ASSERT_TRUE(IsBuiltInModel("random:llama-3.1-8b"));
  ModelFiles files = MakeBuiltInModel("random:llama-3.1-8b").value();
  EXPECT_TRUE(files.random_weights);
  EXPECT_EQ(files.config.name, "random:llama-3.1-8b");
  EXPECT_EQ(files.config.vocab_size, 128256);
  EXPECT_EQ(files.tensors->Find("model.embed_tokens.weight"), nullptr);
  EXPECT_NE(files.tensors->Describe().find("random weights"), std::string::npos);
  const Tokenizer& tok = *files.tokenizer;
  EXPECT_EQ(tok.vocab_size(), 128256);
  const std::vector<int32_t> ids = tok.Encode("héllo", /*add_bos=*/false);
  EXPECT_EQ(ids.size(), 6u);  // one token a byte
  EXPECT_EQ(tok.Decode(ids), "héllo");
  // Every id a random model can sample decodes: the reserved ones to nothing.
  EXPECT_EQ(tok.Decode({128255, 300, 104}), "h");
  EXPECT_EQ(files.config.bos_token_id, tok.bos_id());
}

TEST(RandomShapeModel, UnknownShapeFailsClearly) {
  const auto r = MakeBuiltInModel("random:gpt-5");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("known shapes"), std::string::npos) << r.status().ToString();
}

TEST(RandomShapeModel, CpuAndWeightLoadingAreRefused) {
  ModelFiles files = MakeBuiltInModel("random:tiny").value();
  EngineConfig config;
  config.model = "random:tiny";
  config.device = "cpu";
  const auto weights = LoadWeightsFor(files, config);
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), StatusCode::kUnsupported);
  const auto engine = Engine::Create(config);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(engine.status().message().find("--device cuda"), std::string::npos) << engine.status().ToString();
}

}  // namespace
}  // namespace kvflow
