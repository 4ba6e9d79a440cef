// LlamaModel: loading and checking a GGUF file of the Llama family (architecture.cpp), and the
// CPU forward pieces (embedding, RMSNorm, projections and biases, RoPE, SwiGLU, output head).
// See include/treeattn/model.hpp.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "model/activation.hpp"
#include "treeattn/model.hpp"
#include "treeattn/shape.hpp"

namespace treeattn::model {
namespace {

std::string dims_string(const std::vector<uint64_t>& d) {
  std::string s = "[";
  for (std::size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

}  // namespace

std::string LlamaConfig::to_string() const {
  std::ostringstream os;
  os << architecture << (name.empty() ? "" : " '" + name + "'") << ": " << n_layers
     << " layers, embd " << n_embd << ", ffn " << n_ff << ", " << n_head << " heads, " << n_head_kv
     << " KV heads, head dim " << head_dim << ", vocab " << n_vocab << ", rope base " << rope_base
     << " dims " << rope_dim;
  if (rope_freq_factors) os << " (freq factors)";
  if (rope_linear_factor != 1.0) os << " (linear x" << rope_linear_factor << ")";
  if (rope_form == RopeForm::kHalves) os << " (halves)";
  if (qkv_bias) os << ", qkv bias";
  if (sliding_window > 0) {
    int local = 0;
    for (const uint8_t v : local_layer) local += v;
    os << ", " << local << " sliding-window layers (window " << sliding_window << ", rope base "
       << rope_base_local << ")";
  }
  if (tied_output) os << ", tied output";
  return os.str();
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::load(const std::string& path) {
  auto f = gguf::File::open(path);
  if (!f.is_ok()) return f.status();
  std::unique_ptr<LlamaModel> m(new LlamaModel(std::move(f).value()));
  TREEATTN_RETURN_IF_ERROR(m->init());
  return m;
}

Status LlamaModel::init() {
  const gguf::File& f = file_;
  const std::string who = "model " + f.path() + ": ";
  auto arch = f.get_string("general.architecture");
  if (!arch.is_ok()) return arch.status();
  cfg_.architecture = std::string(*arch);
  const Architecture* spec = find_architecture(cfg_.architecture);
  if (spec == nullptr)
    return unsupported(who + "architecture '" + cfg_.architecture +
                       "' is not supported (general.architecture must be one of: " +
                       supported_architectures() + ")");
  cfg_.rope_form = spec->rope;
  cfg_.arch = spec;
  auto name = f.get_string_or("general.name", "");
  if (!name.is_ok()) return name.status();
  cfg_.name = std::string(*name);
  const std::string a = cfg_.architecture + ".";
  auto need_int = [&](const std::string& key, int64_t& out) -> Status {
    auto v = f.get_int(a + key);
    if (!v.is_ok()) return v.status();
    if (*v <= 0)
      return invalid_argument(who + a + key + " = " + std::to_string(*v) + " must be positive");
    out = *v;
    return Status::ok();
  };
  int64_t layers = 0;
  TREEATTN_RETURN_IF_ERROR(need_int("block_count", layers));
  if (layers > 100000) return invalid_argument(who + a + "block_count is absurd");
  cfg_.n_layers = static_cast<int>(layers);
  TREEATTN_RETURN_IF_ERROR(need_int("embedding_length", cfg_.n_embd));
  TREEATTN_RETURN_IF_ERROR(need_int("feed_forward_length", cfg_.n_ff));
  TREEATTN_RETURN_IF_ERROR(need_int("attention.head_count", cfg_.n_head));
  {
    auto v = f.get_int_or(a + "attention.head_count_kv", cfg_.n_head);
    if (!v.is_ok()) return v.status();
    cfg_.n_head_kv = *v;
    if (cfg_.n_head_kv <= 0 || cfg_.n_head % cfg_.n_head_kv != 0)
      return invalid_argument(who + a +
                              "attention.head_count_kv = " + std::to_string(cfg_.n_head_kv) +
                              " must divide head_count " + std::to_string(cfg_.n_head));
  }
  if (cfg_.n_embd % cfg_.n_head != 0)
    return invalid_argument(who + "embedding_length " + std::to_string(cfg_.n_embd) +
                            " is not a multiple of head_count " + std::to_string(cfg_.n_head));
  {
    auto k = f.get_int_or(a + "attention.key_length", cfg_.n_embd / cfg_.n_head);
    auto v = f.get_int_or(a + "attention.value_length", cfg_.n_embd / cfg_.n_head);
    if (!k.is_ok()) return k.status();
    if (!v.is_ok()) return v.status();
    if (*k != *v)
      return unsupported(who + "key_length " + std::to_string(*k) + " != value_length " +
                         std::to_string(*v));
    cfg_.head_dim = *k;
  }
  if (!head_dim_supported(cfg_.head_dim))
    return unsupported(who + "head dim " + std::to_string(cfg_.head_dim) +
                       " has no attention kernel (supported: " + supported_head_dims_string() +
                       ")");
  {
    auto v = f.get_float_or(a + "attention.layer_norm_rms_epsilon", 1e-5);
    if (!v.is_ok()) return v.status();
    cfg_.rms_eps = *v;
    auto b = f.get_float_or(a + "rope.freq_base", 10000.0);
    if (!b.is_ok()) return b.status();
    cfg_.rope_base = *b;
    if (!(cfg_.rope_base > 1.0))
      return invalid_argument(who + a + "rope.freq_base = " + std::to_string(*b) + " must be > 1");
    auto d = f.get_int_or(a + "rope.dimension_count", cfg_.head_dim);
    if (!d.is_ok()) return d.status();
    cfg_.rope_dim = *d;
    if (cfg_.rope_dim <= 0 || cfg_.rope_dim > cfg_.head_dim || cfg_.rope_dim % 2 != 0)
      return invalid_argument(who + a + "rope.dimension_count = " + std::to_string(*d) +
                              " must be even and in (0, head dim " + std::to_string(cfg_.head_dim) +
                              "]");
    auto ctx = f.get_int_or(a + "context_length", 0);
    if (!ctx.is_ok()) return ctx.status();
    cfg_.n_ctx_train = *ctx;
    auto st = f.get_string_or(a + "rope.scaling.type", "none");
    if (!st.is_ok()) return st.status();
    if (*st == "linear") {
      auto fac = f.get_float(a + "rope.scaling.factor");
      if (!fac.is_ok()) return fac.status();
      if (!(*fac > 0.0)) return invalid_argument(who + a + "rope.scaling.factor must be positive");
      cfg_.rope_linear_factor = *fac;
    } else if (*st != "none") {
      return unsupported(who + a + "rope.scaling.type = '" + std::string(*st) +
                         "' is not supported (none, linear, or Llama-3 freq factors in "
                         "rope_freqs.weight)");
    }
  }

  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping"}) {
    auto cap = f.get_float_or(a + key, 0.0);
    if (!cap.is_ok()) return cap.status();
    if (*cap != 0.0)
      return unsupported(who + a + key + " = " + std::to_string(*cap) +
                         ": logit soft-capping is not supported");
  }
  if (cfg_.architecture == "gemma3" && cfg_.n_layers == 62)
    return unsupported(who +
                       "Gemma 3 27B scales queries by 1/sqrt(n_embd / n_head), not "
                       "1/sqrt(head_dim) as the attention kernels do");
  if (spec->swa_pattern > 0) {
    auto w = f.get_int_or(a + "attention.sliding_window", 0);
    if (!w.is_ok()) return w.status();
    if (*w < 0) return invalid_argument(who + a + "attention.sliding_window must be >= 0");
    cfg_.sliding_window = *w;
    cfg_.local_layer.assign(static_cast<std::size_t>(cfg_.n_layers), 0);
    if (*w > 0) {
      auto pat = f.get_int_or(a + "attention.sliding_window_pattern", spec->swa_pattern);
      if (!pat.is_ok()) return pat.status();
      if (*pat < 1)
        return invalid_argument(who + a + "attention.sliding_window_pattern must be >= 1");
      for (int l = 0; l < cfg_.n_layers; ++l)
        cfg_.local_layer[static_cast<std::size_t>(l)] = (l % *pat) < (*pat - 1) ? 1 : 0;
      auto lb = f.get_float_or(a + "rope.freq_base_swa", spec->swa_rope_base);
      if (!lb.is_ok()) return lb.status();
      if (!(*lb > 1.0)) return invalid_argument(who + a + "rope.freq_base_swa must be > 1");
      cfg_.rope_base_local = *lb;
    }
  }

  // Tensors.
  auto matrix = [&](const std::string& tname, int64_t cols, int64_t rows,
                    WeightMatrix& out) -> Status {
    auto t = f.tensor(tname);
    if (!t.is_ok()) return Status(t.status().code(), who + t.status().message());
    const gguf::TensorInfo& ti = **t;
    const std::vector<uint64_t> want = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
    if (ti.dims != want)
      return invalid_argument(who + "tensor '" + tname + "' has dims " + dims_string(ti.dims) +
                              ", expected " + dims_string(want) + " (ggml order)");
    auto m = WeightMatrix::from_tensor(ti);
    if (!m.is_ok()) return Status(m.status().code(), who + m.status().message());
    out = std::move(m).value();
    return Status::ok();
  };
  auto vector = [&](const std::string& tname, int64_t n, std::vector<float>& out) -> Status {
    auto t = f.tensor(tname);
    if (!t.is_ok()) return Status(t.status().code(), who + t.status().message());
    const gguf::TensorInfo& ti = **t;
    if (ti.n_elements != static_cast<uint64_t>(n) || ti.dims.size() != 1)
      return invalid_argument(who + "tensor '" + tname + "' has dims " + dims_string(ti.dims) +
                              ", expected [" + std::to_string(n) + "]");
    out.assign(static_cast<std::size_t>(n), 0.0f);
    Status s = gguf::dequantize_row(ti.type, ti.data, out.data(), out.size());
    if (!s.is_ok()) return Status(s.code(), who + "tensor '" + tname + "': " + s.message());
    return Status::ok();
  };
  auto qkv_bias_name = [](std::string_view n) {
    return n.starts_with("blk.") && (n.ends_with(".attn_q.bias") || n.ends_with(".attn_k.bias") ||
                                     n.ends_with(".attn_v.bias"));
  };
  for (const auto& t : f.tensors())
    if (t.name.ends_with(".bias") && !(spec->qkv_bias && qkv_bias_name(t.name)))
      return unsupported(who + "tensor '" + std::string(t.name) +
                         "': bias tensors of this kind are not part of the " + cfg_.architecture +
                         " forward pass");

  const gguf::TensorInfo* emb = f.find_tensor("token_embd.weight");
  if (emb == nullptr) return invalid_argument(who + "tensor 'token_embd.weight' not found");
  if (emb->dims.size() != 2 || emb->dims[0] != static_cast<uint64_t>(cfg_.n_embd))
    return invalid_argument(who + "tensor 'token_embd.weight' has dims " + dims_string(emb->dims) +
                            ", expected [" + std::to_string(cfg_.n_embd) + ", n_vocab]");
  cfg_.n_vocab = static_cast<int64_t>(emb->dims[1]);
  {
    auto v = f.get_int_or(a + "vocab_size", cfg_.n_vocab);
    if (!v.is_ok()) return v.status();
    if (*v != cfg_.n_vocab)
      return invalid_argument(who + a + "vocab_size = " + std::to_string(*v) +
                              " but token_embd.weight has " + std::to_string(cfg_.n_vocab) +
                              " rows");
  }
  TREEATTN_RETURN_IF_ERROR(matrix("token_embd.weight", cfg_.n_embd, cfg_.n_vocab, tok_embd_));
  DenseWeights& dw = weights_;
  dw.embedding_ = tok_embd_;
  if (f.find_tensor("output.weight") != nullptr) {
    TREEATTN_RETURN_IF_ERROR(matrix("output.weight", cfg_.n_embd, cfg_.n_vocab, dw.head_));
  } else {
    cfg_.tied_output = true;
    dw.head_ = tok_embd_;
  }
  TREEATTN_RETURN_IF_ERROR(vector("output_norm.weight", cfg_.n_embd, output_norm_));
  const int64_t qd = cfg_.n_head * cfg_.head_dim, kvd = cfg_.n_head_kv * cfg_.head_dim;
  layers_.resize(static_cast<std::size_t>(cfg_.n_layers));
  dw.layers_.resize(static_cast<std::size_t>(cfg_.n_layers));
  dw.full_rows_ = {qd, kvd, kvd, cfg_.n_embd, cfg_.n_ff, cfg_.n_ff, cfg_.n_embd, cfg_.n_vocab};
  for (int l = 0; l < cfg_.n_layers; ++l) {
    Layer& L = layers_[static_cast<std::size_t>(l)];
    auto& M = dw.layers_[static_cast<std::size_t>(l)];
    const auto mat = [&M](Projection pr) -> WeightMatrix& {
      return M[static_cast<std::size_t>(pr)];
    };
    const std::string p = "blk." + std::to_string(l) + ".";
    TREEATTN_RETURN_IF_ERROR(vector(p + "attn_norm.weight", cfg_.n_embd, L.attn_norm));
    TREEATTN_RETURN_IF_ERROR(vector(p + "ffn_norm.weight", cfg_.n_embd, L.ffn_norm));
    if (spec->qk_norm) {
      TREEATTN_RETURN_IF_ERROR(vector(p + "attn_q_norm.weight", cfg_.head_dim, L.q_norm));
      TREEATTN_RETURN_IF_ERROR(vector(p + "attn_k_norm.weight", cfg_.head_dim, L.k_norm));
    }
    if (spec->post_norms) {
      TREEATTN_RETURN_IF_ERROR(
          vector(p + "post_attention_norm.weight", cfg_.n_embd, L.post_attn_norm));
      TREEATTN_RETURN_IF_ERROR(vector(p + "post_ffw_norm.weight", cfg_.n_embd, L.post_ffn_norm));
    }
    TREEATTN_RETURN_IF_ERROR(matrix(p + "attn_q.weight", cfg_.n_embd, qd, mat(Projection::kQ)));
    TREEATTN_RETURN_IF_ERROR(matrix(p + "attn_k.weight", cfg_.n_embd, kvd, mat(Projection::kK)));
    TREEATTN_RETURN_IF_ERROR(matrix(p + "attn_v.weight", cfg_.n_embd, kvd, mat(Projection::kV)));
    TREEATTN_RETURN_IF_ERROR(
        matrix(p + "attn_output.weight", qd, cfg_.n_embd, mat(Projection::kO)));
    TREEATTN_RETURN_IF_ERROR(
        matrix(p + "ffn_gate.weight", cfg_.n_embd, cfg_.n_ff, mat(Projection::kGate)));
    TREEATTN_RETURN_IF_ERROR(
        matrix(p + "ffn_up.weight", cfg_.n_embd, cfg_.n_ff, mat(Projection::kUp)));
    TREEATTN_RETURN_IF_ERROR(
        matrix(p + "ffn_down.weight", cfg_.n_ff, cfg_.n_embd, mat(Projection::kDown)));
    if (spec->qkv_bias) {
      const std::pair<const char*, std::pair<int64_t, std::vector<float>*>> biases[] = {
          {"attn_q.bias", {qd, &L.bq}},
          {"attn_k.bias", {kvd, &L.bk}},
          {"attn_v.bias", {kvd, &L.bv}}};
      for (const auto& [bname, want] : biases)
        if (f.find_tensor(p + bname) != nullptr) {
          TREEATTN_RETURN_IF_ERROR(vector(p + bname, want.first, *want.second));
          cfg_.qkv_bias = true;
        }
    }
  }

  // RoPE frequencies.
  const int64_t pairs = cfg_.rope_dim / 2;
  inv_freq_.resize(static_cast<std::size_t>(pairs));
  std::vector<float> factors;
  if (f.find_tensor("rope_freqs.weight") != nullptr) {
    TREEATTN_RETURN_IF_ERROR(vector("rope_freqs.weight", pairs, factors));
    cfg_.rope_freq_factors = true;
    for (std::size_t i = 0; i < factors.size(); ++i)
      if (!(factors[i] > 0.0f))
        return invalid_argument(who + "rope_freqs.weight[" + std::to_string(i) +
                                "] must be positive");
  }
  for (int64_t i = 0; i < pairs; ++i) {
    double w = std::pow(cfg_.rope_base,
                        -2.0 * static_cast<double>(i) / static_cast<double>(cfg_.rope_dim));
    if (!factors.empty()) w /= static_cast<double>(factors[static_cast<std::size_t>(i)]);
    inv_freq_[static_cast<std::size_t>(i)] = w / cfg_.rope_linear_factor;
  }
  // Local layers: their own base, no frequency factors or linear scaling (llama.cpp's
  // rope_freq_scale_train_swa = 1).
  if (cfg_.rope_base_local > 0.0) {
    inv_freq_local_.resize(static_cast<std::size_t>(pairs));
    for (int64_t i = 0; i < pairs; ++i)
      inv_freq_local_[static_cast<std::size_t>(i)] = std::pow(
          cfg_.rope_base_local, -2.0 * static_cast<double>(i) / static_cast<double>(cfg_.rope_dim));
  }
  return Status::ok();
}

std::size_t LlamaModel::weight_bytes_per_token() const {
  return weights_.bytes() + static_cast<std::size_t>(tok_embd_.row_bytes);
}

// ---- DenseWeights ----

std::string_view projection_name(Projection p) {
  static constexpr std::string_view kNames[kProjections] = {
      "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"};
  return kNames[static_cast<std::size_t>(p)];
}

const WeightMatrix& DenseWeights::matrix(int layer, Projection p) const {
  if (p == Projection::kHead) return head_;
  return layers_[static_cast<std::size_t>(layer)][static_cast<std::size_t>(p)];
}

std::size_t DenseWeights::bytes() const {
  std::size_t b = head_.bytes();
  for (const auto& L : layers_)
    for (const WeightMatrix& m : L) b += m.bytes();
  return b;
}

std::size_t DenseWeights::rows8_bytes() const {
  std::size_t b = 0;
  for (const auto& buf : rows8_) b += buf.size();
  return b;
}

void DenseWeights::pack_rows8(MatmulMode mode, int threads) {
  if (mode == MatmulMode::kExact) return;
  std::vector<WeightMatrix*> ms;
  for (auto& L : layers_)
    for (std::size_t i = 0; i < L.size(); ++i)
      if (mode == MatmulMode::kInt8 || i >= static_cast<std::size_t>(Projection::kGate))
        ms.push_back(&L[i]);
  ms.push_back(&head_);
  std::erase_if(ms, [](const WeightMatrix* m) { return m->rows8 != nullptr; });
  std::vector<std::size_t> at(ms.size() + 1, 0);
  for (std::size_t i = 0; i < ms.size(); ++i) at[i + 1] = at[i] + model::rows8_bytes(*ms[i]);
  if (at.back() == 0) return;
  std::vector<uint8_t>& buf = rows8_.emplace_back(at.back());
  const int n = static_cast<int>(ms.size());
#pragma omp parallel for schedule(dynamic) \
    num_threads(threads > 0 ? threads : omp_get_max_threads())
  for (int i = 0; i < n; ++i)
    if (at[i + 1] > at[i]) model::pack_rows8(*ms[i], buf.data() + at[i]);
  for (std::size_t i = 0; i < ms.size(); ++i)
    if (at[i + 1] > at[i]) ms[i]->rows8 = buf.data() + at[i];
}

Result<DenseWeights> LlamaModel::slice(int index, int count) const {
  if (count < 1 || index < 0 || index >= count)
    return invalid_argument("model " + path() + ": slice " + std::to_string(index) + " of " +
                            std::to_string(count) + " (expected 0 <= index < count)");
  DenseWeights s;
  s.index_ = index;
  s.count_ = count;
  s.full_rows_ = weights_.full_rows_;
  // Every slice of every matrix is checked, not only this one's, so that every rank reports
  // the same refusal.
  auto cut = [&](const WeightMatrix& m, std::string_view what, WeightMatrix& out) -> Status {
    for (int i = 0; i < count; ++i) {
      Status st = check_row_slice(m, slice_rows(m.rows, i, count));
      if (!st.is_ok())
        return Status(st.code(), "model " + path() + ": " + std::string(what) + " slice " +
                                     std::to_string(i) + " of " + std::to_string(count) + ": " +
                                     st.message());
    }
    out = row_slice(m, slice_rows(m.rows, index, count));
    if (count == 1) return Status::ok();  // the whole matrix: the model's mapping
    auto map = file_.map_again(out.data, out.bytes());
    if (!map.is_ok()) return map.status();
    out.data = map->data();
    s.maps_.push_back(std::move(map).value());
    return Status::ok();
  };
  s.layers_.resize(weights_.layers_.size());
  for (std::size_t l = 0; l < weights_.layers_.size(); ++l)
    for (std::size_t i = 0; i < s.layers_[l].size(); ++i)
      TREEATTN_RETURN_IF_ERROR(cut(weights_.layers_[l][i],
                                   projection_name(static_cast<Projection>(i)), s.layers_[l][i]));
  TREEATTN_RETURN_IF_ERROR(cut(weights_.head_, projection_name(Projection::kHead), s.head_));
  if (cfg_.tied_output) {
    s.embedding_ = s.head_;  // the same rows of the same tensor, mapped once
  } else {
    TREEATTN_RETURN_IF_ERROR(cut(tok_embd_, "token_embd", s.embedding_));
  }
  return s;
}

void LlamaModel::reserve_forward(const DenseWeights& w, int64_t tokens,
                                 const MatvecOptions& options) const {
  for (int l = 0; l < w.layers(); ++l) {
    const WeightMatrix* attn[] = {&w.matrix(l, Projection::kQ), &w.matrix(l, Projection::kK),
                                  &w.matrix(l, Projection::kV), &w.matrix(l, Projection::kO)};
    reserve_matmul(attn, tokens, for_role(options, MatrixRole::kAttention));
    const WeightMatrix* ffn[] = {&w.matrix(l, Projection::kGate), &w.matrix(l, Projection::kUp),
                                 &w.matrix(l, Projection::kDown)};
    reserve_matmul(ffn, tokens, for_role(options, MatrixRole::kFfn));
  }
}

std::string LlamaModel::weight_types() const {
  std::map<std::string, int> n;
  for (const auto& L : weights_.layers_)
    for (const WeightMatrix& m : L) ++n[gguf::tensor_type_name(m.type)];
  const WeightMatrix& head = weights_.head_;
  ++n[gguf::tensor_type_name(head.type) + (cfg_.tied_output ? " head (tied)" : " head")];
  std::string s;
  for (const auto& [k, v] : n) s += (s.empty() ? "" : ", ") + k + " x" + std::to_string(v);
  return s;
}

// x = row `row` of `table` (n_embd values), scaled where the architecture scales embeddings.
Status LlamaModel::embed_row(const WeightMatrix& table, int64_t row, float* x) const {
  TREEATTN_RETURN_IF_ERROR(gguf::dequantize_row(table.type, table.data + row * table.row_bytes, x,
                                                static_cast<std::size_t>(cfg_.n_embd)));
  if (cfg_.arch->embed_scale) {
    // In float, as llama.cpp scales (sqrt rounded once: float(sqrt(double)) == sqrtf).
    const auto sc = static_cast<float>(std::sqrt(static_cast<double>(cfg_.n_embd)));
    for (int64_t i = 0; i < cfg_.n_embd; ++i) x[i] *= sc;
  }
  return Status::ok();
}

Status LlamaModel::embed(std::span<const TokenId> tokens, float* x) const {
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const TokenId id = tokens[t];
    if (id < 0 || id >= cfg_.n_vocab)
      return invalid_argument("model " + path() + ": token id " + std::to_string(id) +
                              " at position " + std::to_string(t) + " is outside [0, " +
                              std::to_string(cfg_.n_vocab) + ")");
    TREEATTN_RETURN_IF_ERROR(embed_row(tok_embd_, id, x + static_cast<int64_t>(t) * cfg_.n_embd));
  }
  return Status::ok();
}

Status LlamaModel::embed(const DenseWeights& w, std::span<const TokenId> tokens, float* x) const {
  const RowRange r = w.rows(Projection::kHead);
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const TokenId id = tokens[t];
    if (id < r.begin || id >= r.end)
      return invalid_argument("model " + path() + ": token id " + std::to_string(id) +
                              " at position " + std::to_string(t) + " is outside slice " +
                              std::to_string(w.index()) + "'s vocabulary rows [" +
                              std::to_string(r.begin) + ", " + std::to_string(r.end) + ")");
    TREEATTN_RETURN_IF_ERROR(
        embed_row(w.embedding(), id - r.begin, x + static_cast<int64_t>(t) * cfg_.n_embd));
  }
  return Status::ok();
}

void LlamaModel::rmsnorm(const float* x, const std::vector<float>& w, int64_t tokens, float* out,
                         int threads) const {
  const auto n = static_cast<int64_t>(w.size());
  // Row by row (each row's bits are its own).
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* xt = x + t * n;
    // The squares (exact in double) in 8 running sums, added pairwise at the end: one chain of n
    // dependent double adds held Gemma-3's norms (6 a layer) to an element per add's latency.
    double part[8] = {};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(xt[i + j]) * xt[i + j];
    double ss =
        ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; i < n; ++i) ss += static_cast<double>(xt[i]) * xt[i];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(n) + cfg_.rms_eps);
    float* o = out + t * n;
    for (i = 0; i < n; ++i)
      o[i] = static_cast<float>(static_cast<double>(xt[i]) * r) * w[static_cast<std::size_t>(i)];
  }
}

const std::vector<double>& LlamaModel::rope_freqs(int layer) const {
  const bool local = layer >= 0 && !inv_freq_local_.empty() &&
                     cfg_.local_layer[static_cast<std::size_t>(layer)] != 0;
  return local ? inv_freq_local_ : inv_freq_;
}

void LlamaModel::rope_angles(const std::vector<double>& freqs, int64_t pos, float* cs, float* sn) {
  for (std::size_t i = 0; i < freqs.size(); ++i) {
    const double th = static_cast<double>(pos) * freqs[i];
    cs[i] = static_cast<float>(std::cos(th));
    sn[i] = static_cast<float>(std::sin(th));
  }
}

void LlamaModel::rope_rotate(float* heads, int64_t n_heads, const float* cs,
                             const float* sn) const {
  // Pair i is (x[2i], x[2i+1]) on adjacent pairs, (x[i], x[i + pairs]) on halves.
  const std::size_t pairs = inv_freq_.size();
  const std::size_t second = cfg_.rope_form == RopeForm::kHalves ? pairs : 1;
  const std::size_t stride = cfg_.rope_form == RopeForm::kHalves ? 1 : 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* x = heads + h * cfg_.head_dim;
    for (std::size_t i = 0; i < pairs; ++i) {
      float* lo = x + i * stride;
      float* hi = lo + second;
      const float a = *lo, b = *hi;
      *lo = a * cs[i] - b * sn[i];
      *hi = a * sn[i] + b * cs[i];
    }
  }
}

void LlamaModel::apply_rope(float* heads, int64_t n_heads, int64_t pos, int layer) const {
  float cs[256], sn[256];  // rope_dim / 2 <= head_dim / 2 <= 128
  rope_angles(rope_freqs(layer), pos, cs, sn);
  rope_rotate(heads, n_heads, cs, sn);
}

namespace {
// The threads of the forward pass's element-wise steps for `tokens` tokens: the matmul's
// (MatvecOptions::threads, 0 = OpenMP's default) in a prefill of 8 or more tokens, else 1 (a
// decode step is too small to split). Each step splits rows or elements whose results are their
// own, so the bits do not depend on the count.
int step_threads(const MatvecOptions& options, int64_t tokens) {
  if (tokens < 8) return 1;
  return options.threads > 0 ? options.threads : omp_get_max_threads();
}
}  // namespace

// ---- the dense layers in pieces (model.hpp: the whole-row calls are composed of them) ----

void LlamaModel::attention_norm(int layer, const float* x, int64_t tokens, float* xn,
                                const MatvecOptions& options) const {
  rmsnorm(x, layer_of(layer).attn_norm, tokens, xn, step_threads(options, tokens));
}

Status LlamaModel::project(const DenseWeights& w, int layer, std::span<const Projection> ps,
                           const float* x, int64_t tokens, int64_t x_stride,
                           std::span<float* const> ys, const MatvecOptions& options) const {
  if (ps.size() != ys.size() || ps.empty() || ps.size() > 4)
    return invalid_argument("project: " + std::to_string(ps.size()) + " projections and " +
                            std::to_string(ys.size()) + " outputs");
  if (w.layers() != cfg_.n_layers ||
      (ps[0] != Projection::kHead && (layer < 0 || layer >= cfg_.n_layers)))
    return invalid_argument("project: layer " + std::to_string(layer) + " of weights with " +
                            std::to_string(w.layers()) + " layers (the model has " +
                            std::to_string(cfg_.n_layers) + ")");
  const WeightMatrix* mats[4];
  float* outs[4];
  std::size_t n = 0;
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const WeightMatrix& m = w.matrix(layer, ps[i]);
    if (m.rows == 0) continue;  // an empty slice
    mats[n] = &m;
    outs[n++] = ys[i];
  }
  if (n == 0) return Status::ok();
  const MatrixRole role = ps[0] == Projection::kHead ? MatrixRole::kHead
                          : static_cast<int>(ps[0]) >= static_cast<int>(Projection::kGate)
                              ? MatrixRole::kFfn
                              : MatrixRole::kAttention;
  return matmul(std::span<const WeightMatrix* const>(mats, n), x, tokens, x_stride,
                std::span<float* const>(outs, n), for_role(options, role));
}

Status LlamaModel::finish_qkv(int layer, int64_t tokens, const int64_t* pos, float* q, float* k,
                              float* v, ForwardScratch& s, const MatvecOptions& options) const {
  if (layer < 0 || layer >= cfg_.n_layers)
    return invalid_argument("finish_qkv: layer " + std::to_string(layer) + " of " +
                            std::to_string(cfg_.n_layers));
  const Layer& L = layer_of(layer);
  const int threads = step_threads(options, tokens);
  const int64_t qd = cfg_.n_head * cfg_.head_dim, kvd = cfg_.n_head_kv * cfg_.head_dim;
  auto add_bias = [tokens](float* y, const std::vector<float>& b) {
    const auto n = static_cast<int64_t>(b.size());
    for (int64_t t = 0; t < tokens && n > 0; ++t)
      for (int64_t i = 0; i < n; ++i) y[t * n + i] += b[static_cast<std::size_t>(i)];
  };
  add_bias(q, L.bq);
  add_bias(k, L.bk);
  add_bias(v, L.bv);
  if (!L.q_norm.empty()) {  // every head of every token (in place)
    rmsnorm(q, L.q_norm, tokens * cfg_.n_head, q, threads);
    rmsnorm(k, L.k_norm, tokens * cfg_.n_head_kv, k, threads);
  }
  // The angles of these positions, computed by the first layer of their kind and reused by the
  // others (the same doubles rounded the same way: apply_rope's bits).
  const std::vector<double>& freqs = rope_freqs(layer);
  const std::size_t kind = &freqs == &inv_freq_ ? 0 : 1;
  const auto pairs = static_cast<int64_t>(freqs.size());
  std::vector<int64_t>& have = s.rope_pos[kind];
  std::vector<float>& cs = s.rope_cos[kind];
  std::vector<float>& sn = s.rope_sin[kind];
  if (static_cast<int64_t>(have.size()) != tokens || !std::equal(have.begin(), have.end(), pos) ||
      s.rope_freqs[kind] != freqs) {
    have.assign(pos, pos + tokens);
    s.rope_freqs[kind] = freqs;
    cs.resize(static_cast<std::size_t>(tokens * pairs));
    sn.resize(static_cast<std::size_t>(tokens * pairs));
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < tokens; ++t)
      rope_angles(freqs, pos[t], cs.data() + t * pairs, sn.data() + t * pairs);
  }
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    rope_rotate(q + t * qd, cfg_.n_head, cs.data() + t * pairs, sn.data() + t * pairs);
    rope_rotate(k + t * kvd, cfg_.n_head_kv, cs.data() + t * pairs, sn.data() + t * pairs);
  }
  return Status::ok();
}

void LlamaModel::add_attention_output(int layer, float* o, int64_t tokens, float* x,
                                      const MatvecOptions& options) const {
  const Layer& L = layer_of(layer);
  const int threads = step_threads(options, tokens);
  const auto tn = static_cast<std::size_t>(tokens * cfg_.n_embd);
  if (!L.post_attn_norm.empty()) rmsnorm(o, L.post_attn_norm, tokens, o, threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (std::size_t i = 0; i < tn; ++i) x[i] += o[i];
}

void LlamaModel::ffn_norm(int layer, const float* x, int64_t tokens, float* xn,
                          const MatvecOptions& options) const {
  rmsnorm(x, layer_of(layer).ffn_norm, tokens, xn, step_threads(options, tokens));
}

// The gated activation, element by element (so its bits do not depend on the threads that
// share it, on the target or on where an element sits: activation.hpp). GELU (Gemma) is ggml's
// tanh form, 0.5 g (1 + tanh(y)) with y = sqrt(2/pi) g (1 + 0.044715 g^2), written as
// g / (1 + exp(-2 y)): the same function, one expf instead of a tanhf (glibc's tanhf took 12% of
// Gemma-3's 512-token prefill, expm1f inside it), and no cancellation in 1 + tanh(y) where y is
// negative. g = +-inf and NaN give what the tanh form gives (inf, NaN, NaN).
void LlamaModel::ffn_activation(float* gate, const float* up, int64_t tokens, int64_t width,
                                const MatvecOptions& options) const {
  gated_activation(cfg_.arch->ffn, gate, up, tokens * width, options.isa,
                   step_threads(options, tokens));
}

void LlamaModel::add_ffn_output(int layer, float* d, int64_t tokens, float* x,
                                const MatvecOptions& options) const {
  const Layer& L = layer_of(layer);
  const int threads = step_threads(options, tokens);
  const auto tn = static_cast<std::size_t>(tokens * cfg_.n_embd);
  if (!L.post_ffn_norm.empty()) rmsnorm(d, L.post_ffn_norm, tokens, d, threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (std::size_t i = 0; i < tn; ++i) x[i] += d[i];
}

void LlamaModel::output_norm(const float* x, int64_t tokens, float* xn) const {
  rmsnorm(x, output_norm_, tokens, xn);
}

// ---- the whole-row calls ----

Status LlamaModel::check_whole(const DenseWeights& w, const char* fn) const {
  if (!w.whole())
    return invalid_argument(std::string(fn) + ": slice " + std::to_string(w.index()) + " of " +
                            std::to_string(w.count()) +
                            " holds some rows of each matrix; this call needs them all");
  if (w.layers() != cfg_.n_layers)
    return invalid_argument(std::string(fn) + ": weights of " + std::to_string(w.layers()) +
                            " layers for a model of " + std::to_string(cfg_.n_layers));
  return Status::ok();
}

Status LlamaModel::attention_inputs(int layer, const float* x, int64_t tokens, const int64_t* pos,
                                    float* q, float* k, float* v, ForwardScratch& s,
                                    const MatvecOptions& options) const {
  return attention_inputs(weights_, layer, x, tokens, pos, q, k, v, s, options);
}

Status LlamaModel::attention_inputs(const DenseWeights& w, int layer, const float* x,
                                    int64_t tokens, const int64_t* pos, float* q, float* k,
                                    float* v, ForwardScratch& s,
                                    const MatvecOptions& options) const {
  if (layer < 0 || layer >= cfg_.n_layers)
    return invalid_argument("attention_inputs: layer " + std::to_string(layer) + " of " +
                            std::to_string(cfg_.n_layers));
  TREEATTN_RETURN_IF_ERROR(check_whole(w, "attention_inputs"));
  s.xn.resize(static_cast<std::size_t>(tokens * cfg_.n_embd));
  attention_norm(layer, x, tokens, s.xn.data(), options);
  const Projection ps[] = {Projection::kQ, Projection::kK, Projection::kV};
  float* ys[] = {q, k, v};
  TREEATTN_RETURN_IF_ERROR(project(w, layer, ps, s.xn.data(), tokens, cfg_.n_embd, ys, options));
  return finish_qkv(layer, tokens, pos, q, k, v, s, options);
}

Status LlamaModel::attention_output_and_ffn(int layer, const float* a, int64_t tokens, float* x,
                                            ForwardScratch& s, const MatvecOptions& options) const {
  return attention_output_and_ffn(weights_, layer, a, tokens, x, s, options);
}

Status LlamaModel::attention_output_and_ffn(const DenseWeights& w, int layer, const float* a,
                                            int64_t tokens, float* x, ForwardScratch& s,
                                            const MatvecOptions& options) const {
  if (layer < 0 || layer >= cfg_.n_layers)
    return invalid_argument("attention_output_and_ffn: layer " + std::to_string(layer));
  TREEATTN_RETURN_IF_ERROR(check_whole(w, "attention_output_and_ffn"));
  const int64_t n = cfg_.n_embd, nff = cfg_.n_ff;
  s.tmp.resize(static_cast<std::size_t>(tokens * n));
  {
    const Projection ps[] = {Projection::kO};
    float* ys[] = {s.tmp.data()};
    TREEATTN_RETURN_IF_ERROR(
        project(w, layer, ps, a, tokens, cfg_.n_head * cfg_.head_dim, ys, options));
  }
  add_attention_output(layer, s.tmp.data(), tokens, x, options);
  s.xn.resize(static_cast<std::size_t>(tokens * n));
  ffn_norm(layer, x, tokens, s.xn.data(), options);
  s.gate.resize(static_cast<std::size_t>(tokens * nff));
  s.up.resize(static_cast<std::size_t>(tokens * nff));
  {
    const Projection ps[] = {Projection::kGate, Projection::kUp};
    float* ys[] = {s.gate.data(), s.up.data()};
    TREEATTN_RETURN_IF_ERROR(project(w, layer, ps, s.xn.data(), tokens, n, ys, options));
  }
  ffn_activation(s.gate.data(), s.up.data(), tokens, nff, options);
  {
    const Projection ps[] = {Projection::kDown};
    float* ys[] = {s.tmp.data()};
    TREEATTN_RETURN_IF_ERROR(project(w, layer, ps, s.gate.data(), tokens, nff, ys, options));
  }
  add_ffn_output(layer, s.tmp.data(), tokens, x, options);
  return Status::ok();
}

Status LlamaModel::logits(const float* x, float* out, ForwardScratch& s,
                          const MatvecOptions& options) const {
  return logits(weights_, x, 1, out, s, options);
}

Status LlamaModel::logits(const float* x, int64_t tokens, float* out, ForwardScratch& s,
                          const MatvecOptions& options) const {
  return logits(weights_, x, tokens, out, s, options);
}

Status LlamaModel::logits(const DenseWeights& w, const float* x, int64_t tokens, float* out,
                          ForwardScratch& s, const MatvecOptions& options) const {
  if (tokens < 0) return invalid_argument("logits: negative token count");
  TREEATTN_RETURN_IF_ERROR(check_whole(w, "logits"));
  if (tokens == 0) return Status::ok();
  s.xn.resize(static_cast<std::size_t>(tokens * cfg_.n_embd));
  output_norm(x, tokens, s.xn.data());
  const Projection ps[] = {Projection::kHead};
  float* ys[] = {out};
  return project(w, -1, ps, s.xn.data(), tokens, cfg_.n_embd, ys, options);
}

}  // namespace treeattn::model
