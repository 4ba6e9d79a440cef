// Writes one tiny random-weight Llama GGUF (tiny_llama.hpp) for the CLI tests of
// `treeattn generate`: make_tiny_gguf OUT VARIANT, VARIANT one of
//   ok        a valid tiny model (no tokenizer: generate stops at the tokenizer)
//   gemma     general.architecture = gemma
//   q2k       every layer matrix of type q2_K (no kernel)
//   no-ffn-up blk.1.ffn_up.weight missing
#include <cstdio>
#include <string>

#include "model/tiny_llama.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: make_tiny_gguf OUT ok|gemma|q2k|no-ffn-up\n");
    return 2;
  }
  treeattn::testing::TinyLlamaSpec s;
  const std::string v = argv[2];
  if (v == "gemma") {
    s.architecture = "gemma";
  } else if (v == "q2k") {
    s.override_type = 10;
  } else if (v == "no-ffn-up") {
    s.drop_tensor = "blk.1.ffn_up.weight";
  } else if (v != "ok") {
    std::fprintf(stderr, "make_tiny_gguf: unknown variant %s\n", v.c_str());
    return 2;
  }
  treeattn::testing::GgufBuilder::write(argv[1], treeattn::testing::build_tiny_llama(s));
  return 0;
}
