// Where tests find the real model (SmolLM2-135M-Instruct Q4_1 GGUF) and the fixtures written by
// make_tokenizer_fixture.py. $TREEATTN_MODEL wins over the path tools/model-path.sh found when
// CMake configured; an empty result means "skip".
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace treeattn::testing {

inline std::string real_model_path() {
  if (const char* env = std::getenv("TREEATTN_MODEL"); env != nullptr && *env != '\0')
    return std::filesystem::is_regular_file(env) ? env : "";
  const std::string configured = TREEATTN_TEST_MODEL;
  return !configured.empty() && std::filesystem::is_regular_file(configured) ? configured : "";
}

inline std::string read_test_data(const std::string& name) {
  std::ifstream f(std::string(TREEATTN_MODEL_TEST_DATA) + "/" + name, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace treeattn::testing

// Skips the current test when the real model is not available.
#define TREEATTN_REQUIRE_REAL_MODEL(path_var)                                                 \
  const std::string path_var = ::treeattn::testing::real_model_path();                        \
  if (path_var.empty())                                                                       \
  GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not found: run tools/deps.sh (fetches it " \
                  "into models/) or set TREEATTN_MODEL"
