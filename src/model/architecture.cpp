// The architectures the forward pass runs, and what differs between them (model.hpp).
#include <array>
#include <string>

#include "treeattn/model.hpp"

namespace treeattn::model {
namespace {

// llama.cpp's llm_arch_rope_type: LLM_ARCH_LLAMA uses LLAMA_ROPE_TYPE_NORM (its converter permutes
// Wq and Wk so that adjacent pairs rotate), LLM_ARCH_QWEN2 LLAMA_ROPE_TYPE_NEOX (no permutation,
// halves rotate). Qwen2's attention projections carry biases; its MLP and output do not.
constexpr std::array<Architecture, 2> kArchitectures = {{
    {"llama", RopeForm::kAdjacentPairs, false},
    {"qwen2", RopeForm::kHalves, true},
}};

}  // namespace

const Architecture* find_architecture(std::string_view name) {
  for (const Architecture& a : kArchitectures)
    if (a.name == name) return &a;
  return nullptr;
}

std::string supported_architectures() {
  std::string s;
  for (const Architecture& a : kArchitectures) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

}  // namespace treeattn::model
