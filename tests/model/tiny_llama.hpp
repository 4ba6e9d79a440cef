// Tiny random-weight Llama GGUF files for the model tests, written with GgufBuilder: a few
// layers whose matrices cycle through every type the kernels read (Q4_1, Q4_0, Q8_0, F16, BF16,
// F32), random codes and scales sized so that activations stay O(1), and knobs for the variants
// the loader must handle or reject (an output.weight or a tied head, rope_freqs.weight, another
// architecture, a tensor of an unsupported type, a missing tensor). Also the helpers that run
// the independent float64 reference (llama_reference.py) and a scratch directory.
#pragma once

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "model/gguf_builder.hpp"
#include "treeattn/dtype.hpp"
#include "treeattn/gguf.hpp"

namespace treeattn::testing {

class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "treeattn_model_XXXXXX").string();
    dir_ = mkdtemp(tmpl.data());
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  std::string dir_;
};

struct TinyLlamaSpec {
  std::string architecture = "llama";
  int layers = 3;
  int64_t n_embd = 256;
  int64_t n_head = 4;
  int64_t n_kv = 2;
  int64_t n_ff = 512;
  int64_t n_vocab = 320;
  double rope_base = 10000.0;
  bool output_weight = false;             // else tied to token_embd
  bool rope_freqs = false;                // Llama-3-style frequency factors
  uint32_t embd_type = 8;                 // q8_0
  std::optional<uint32_t> override_type;  // every layer matrix of this type instead
  std::string drop_tensor;                // leave this tensor out
  bool qkv_bias = false;                  // blk.N.attn_{q,k,v}.bias (F32; qwen2 reads them)
  int64_t sliding_window = 0;             // gemma3: {arch}.attention.sliding_window
  uint64_t seed = 1;
};

// The ggml type ids cycled over the layer matrices.
inline const std::vector<uint32_t>& tiny_cycle() {
  static const std::vector<uint32_t> c = {3, 2, 8, 1, 30, 0};  // q4_1 q4_0 q8_0 f16 bf16 f32
  return c;
}

// Random rows of `rows x cols` values of a ggml type, values of about `scale` in magnitude.
inline std::vector<uint8_t> random_matrix(uint32_t type, int64_t rows, int64_t cols, float scale,
                                          std::mt19937_64& rng) {
  std::vector<uint8_t> out;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> byte(0, 255);
  auto put16 = [&](uint16_t v) {
    out.push_back(static_cast<uint8_t>(v & 0xff));
    out.push_back(static_cast<uint8_t>(v >> 8));
  };
  for (int64_t r = 0; r < rows; ++r) {
    switch (type) {
      case 0:
        for (int64_t c = 0; c < cols; ++c) {
          const float v = scale * u(rng);
          uint8_t b[4];
          std::memcpy(b, &v, 4);
          out.insert(out.end(), b, b + 4);
        }
        break;
      case 1:
        for (int64_t c = 0; c < cols; ++c) put16(float_to_f16(scale * u(rng)));
        break;
      case 30:
        for (int64_t c = 0; c < cols; ++c) put16(float_to_bf16(scale * u(rng)));
        break;
      case 8:  // q8_0: d * q, q in [-127, 127]
        for (int64_t b = 0; b < cols / 32; ++b) {
          put16(float_to_f16(scale / 127.0f * (0.5f + 0.5f * std::fabs(u(rng)))));
          for (int j = 0; j < 32; ++j)
            out.push_back(static_cast<uint8_t>(static_cast<int8_t>(std::lround(127 * u(rng)))));
        }
        break;
      case 2:  // q4_0: d * (q - 8)
        for (int64_t b = 0; b < cols / 32; ++b) {
          put16(float_to_f16(scale / 8.0f * (0.5f + 0.5f * std::fabs(u(rng)))));
          for (int j = 0; j < 16; ++j) out.push_back(static_cast<uint8_t>(byte(rng)));
        }
        break;
      case 3:  // q4_1: d * q + m
        for (int64_t b = 0; b < cols / 32; ++b) {
          const float d = scale / 8.0f * (0.5f + 0.5f * std::fabs(u(rng)));
          put16(float_to_f16(d));
          put16(float_to_f16(-8.0f * d + 0.1f * scale * u(rng)));
          for (int j = 0; j < 16; ++j) out.push_back(static_cast<uint8_t>(byte(rng)));
        }
        break;
      default:  // any other type: bytes of the right size (the loader must reject it)
        for (int64_t i = 0; i < cols / 256 * 210; ++i)
          out.push_back(static_cast<uint8_t>(byte(rng)));
        break;
    }
  }
  return out;
}

inline std::vector<uint8_t> f32_vector(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

inline std::vector<uint8_t> build_tiny_llama(const TinyLlamaSpec& s) {
  std::mt19937_64 rng(s.seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  GgufBuilder g;
  const std::string a = s.architecture + ".";
  g.str("general.architecture", s.architecture);
  g.str("general.name", "tiny-random-llama");
  g.u32(a + "block_count", static_cast<uint32_t>(s.layers));
  g.u32(a + "embedding_length", static_cast<uint32_t>(s.n_embd));
  g.u32(a + "feed_forward_length", static_cast<uint32_t>(s.n_ff));
  g.u32(a + "attention.head_count", static_cast<uint32_t>(s.n_head));
  g.u32(a + "attention.head_count_kv", static_cast<uint32_t>(s.n_kv));
  g.f32(a + "attention.layer_norm_rms_epsilon", 1e-5f);
  g.f32(a + "rope.freq_base", static_cast<float>(s.rope_base));
  g.u32(a + "rope.dimension_count", static_cast<uint32_t>(s.n_embd / s.n_head));
  g.u32(a + "context_length", 4096);
  if (s.sliding_window > 0) g.u32(a + "attention.sliding_window", static_cast<uint32_t>(s.sliding_window));
  const bool gemma = s.architecture == "gemma3";
  const int64_t hd = s.n_embd / s.n_head;
  auto add = [&](const std::string& name, std::vector<uint64_t> dims, uint32_t type,
                 std::vector<uint8_t> data) {
    if (name == s.drop_tensor) return;
    g.tensor(name, std::move(dims), type, std::move(data));
  };
  auto norm = [&](int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = 1.0f + 0.2f * u(rng);
    return f32_vector(v);
  };
  auto mat = [&](const std::string& name, int64_t cols, int64_t rows, uint32_t type) {
    const uint32_t t = s.override_type.value_or(type);
    add(name, {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)}, t,
        random_matrix(t, rows, cols, 1.7f / std::sqrt(static_cast<float>(cols)), rng));
  };
  // Embeddings of magnitude ~1 so that the first norm sees O(1) values.
  add("token_embd.weight", {static_cast<uint64_t>(s.n_embd), static_cast<uint64_t>(s.n_vocab)},
      s.embd_type, random_matrix(s.embd_type, s.n_vocab, s.n_embd, 1.0f, rng));
  if (s.output_weight) mat("output.weight", s.n_embd, s.n_vocab, 1);
  add("output_norm.weight", {static_cast<uint64_t>(s.n_embd)}, 0, norm(s.n_embd));
  if (s.rope_freqs) {
    std::vector<float> f(static_cast<std::size_t>(hd / 2));
    for (std::size_t i = 0; i < f.size(); ++i)
      f[i] = i < f.size() / 2 ? 1.0f : 1.0f + 3.0f * std::fabs(u(rng));
    add("rope_freqs.weight", {static_cast<uint64_t>(hd / 2)}, 0, f32_vector(f));
  }
  const auto& cyc = tiny_cycle();
  std::size_t k = 0;
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", {static_cast<uint64_t>(s.n_embd)}, 0, norm(s.n_embd));
    add(p + "ffn_norm.weight", {static_cast<uint64_t>(s.n_embd)}, 0, norm(s.n_embd));
    if (gemma) {  // per-head q/k norms and the post norms
      add(p + "attn_q_norm.weight", {static_cast<uint64_t>(hd)}, 0, norm(hd));
      add(p + "attn_k_norm.weight", {static_cast<uint64_t>(hd)}, 0, norm(hd));
      add(p + "post_attention_norm.weight", {static_cast<uint64_t>(s.n_embd)}, 0, norm(s.n_embd));
      add(p + "post_ffw_norm.weight", {static_cast<uint64_t>(s.n_embd)}, 0, norm(s.n_embd));
    }
    mat(p + "attn_q.weight", s.n_embd, s.n_head * hd, cyc[k++ % cyc.size()]);
    mat(p + "attn_k.weight", s.n_embd, s.n_kv * hd, cyc[k++ % cyc.size()]);
    mat(p + "attn_v.weight", s.n_embd, s.n_kv * hd, cyc[k++ % cyc.size()]);
    if (s.qkv_bias)
      for (const auto& [bname, n] : {std::pair<const char*, int64_t>{"attn_q.bias", s.n_head * hd},
                                     {"attn_k.bias", s.n_kv * hd},
                                     {"attn_v.bias", s.n_kv * hd}}) {
        std::vector<float> b(static_cast<std::size_t>(n));
        for (auto& x : b) x = 0.5f * u(rng);
        add(p + bname, {static_cast<uint64_t>(n)}, 0, f32_vector(b));
      }
    mat(p + "attn_output.weight", s.n_head * hd, s.n_embd, cyc[k++ % cyc.size()]);
    mat(p + "ffn_gate.weight", s.n_embd, s.n_ff, cyc[k++ % cyc.size()]);
    mat(p + "ffn_up.weight", s.n_embd, s.n_ff, cyc[k++ % cyc.size()]);
    mat(p + "ffn_down.weight", s.n_ff, s.n_embd, cyc[k++ % cyc.size()]);
  }
  return g.build();
}

#ifdef TREEATTN_LLAMA_REFERENCE
// The python interpreter the reference runs with ($TREEATTN_PYTHON, else python3).
inline std::string reference_python() {
  const char* p = std::getenv("TREEATTN_PYTHON");
  return p != nullptr && *p != '\0' ? p : "python3";
}

// Runs llama_reference.py. Returns the float64 logits [positions][n_vocab], or nullopt with
// `why` set when the reference cannot run here (no python, numpy or gguf: the caller skips).
inline std::optional<std::vector<double>> run_reference(
    const std::string& model, const std::vector<int32_t>& tokens, bool all_positions,
    const std::string& kv_round, const std::string& out_path, std::string* why) {
  std::string toks;
  for (const int32_t t : tokens) toks += (toks.empty() ? "" : ",") + std::to_string(t);
  const std::string cmd = reference_python() + " " + TREEATTN_LLAMA_REFERENCE + " '" + model +
                          "' --tokens " + toks + " --out '" + out_path + "' --positions " +
                          (all_positions ? "all" : "last") + " --kv-round " + kv_round + " > '" +
                          out_path + ".json' 2> '" + out_path + ".err'";
  const int rc = std::system(cmd.c_str());
  const int code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  if (code != 0) {
    std::ifstream e(out_path + ".err");
    std::string msg((std::istreambuf_iterator<char>(e)), std::istreambuf_iterator<char>());
    *why = "the float64 reference (" + cmd + ") exited " + std::to_string(code) + ": " + msg;
    if (code == 77 || code == 127 || msg.find("No module named") != std::string::npos)
      return std::nullopt;
    return std::vector<double>{};  // a real failure: empty result, the caller fails
  }
  std::ifstream f(out_path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<double> v(bytes.size() / 8);
  std::memcpy(v.data(), bytes.data(), v.size() * 8);
  return v;
}
#endif  // TREEATTN_LLAMA_REFERENCE

}  // namespace treeattn::testing
