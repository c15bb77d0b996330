// Generates from the built-in tiny-random model through the installed public API only.
#include <kvflow/engine.h>

#include <cstdio>

int main() {
  auto engine = kvflow::Engine::Create({.model = "tiny-random"});
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  kvflow::SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 8;
  p.ignore_eos = true;
  auto out = engine.value()->Generate("hello", p);
  if (!out.ok() || out->first().tokens.size() != 8) {
    std::fprintf(stderr, "generation failed\n");
    return 1;
  }
  std::printf("consumer: generated %zu tokens through kvflow::kvflow\n", out->first().tokens.size());
  return 0;
}
