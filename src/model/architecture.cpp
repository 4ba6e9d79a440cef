// The architectures the forward pass runs, and what differs between them (model.hpp).
#include <array>
#include <string>

#include "treeattn/model.hpp"

namespace treeattn::model {
namespace {

// llama.cpp's llm_arch_rope_type: LLM_ARCH_LLAMA uses LLAMA_ROPE_TYPE_NORM (its converter permutes
// Wq and Wk so that adjacent pairs rotate), LLM_ARCH_QWEN2 LLAMA_ROPE_TYPE_NEOX (no permutation,
// halves rotate). Qwen2's attention projections carry biases; its MLP and output do not.
// Gemma 3 (llama.cpp's models/gemma3.cpp): LLAMA_ROPE_TYPE_NEOX, swa pattern 6, local rope base
// 10000 unless rope.freq_base_swa says otherwise.
constexpr std::array<Architecture, 3> kArchitectures = {{
    {"llama", RopeForm::kAdjacentPairs, false, false, false, false, FfnActivation::kSilu, 0, 0.0},
    {"qwen2", RopeForm::kHalves, true, false, false, false, FfnActivation::kSilu, 0, 0.0},
    {"gemma3", RopeForm::kHalves, false, true, true, true, FfnActivation::kGeluTanh, 6, 10000.0},
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
