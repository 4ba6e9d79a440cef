// Slices of a model's projections (model.hpp DenseWeights, LlamaModel::slice): what each rank of
// the serving engine's --dense split holds and multiplies with.
// - slice_rows: consecutive ranges that cover the rows in order, boundaries on multiples of 8,
//   as even as that allows, empty slices where there are fewer rows than ranks' groups.
// - check_row_slice: a matrix whose rows are not whole blocks of their own is refused, naming the
//   tensor and why; LlamaModel::slice names the projection and the slice as well.
// - A slice of more than one maps its rows of each matrix from the file on their own (the same
//   bytes, not the model's mapping), a slice of one views the model's; its bytes are its rows',
//   its rows8 copy is of its rows only, and a slice of a packed model views the model's copy;
//   its embedding rows are the head's vocabulary slice and give embed()'s bits.
// - The pieces of the forward pass, computed slice by slice and gathered, give the bits of the
//   whole-row calls (attention_inputs, attention_output_and_ffn, logits) at 1 to 4 slices, on
//   llama, qwen2 (biases) and gemma3 (q/k norms, post norms, GELU) files, exact, int8 and
//   int8-ffn, with and without rows8 copies.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "model/tiny_llama.hpp"
#include "treeattn/model.hpp"

namespace treeattn::model {
namespace {

using testing::ScratchDir;

TEST(DenseSlice, RowsCoverInOrderOnMultiplesOfEightAsEvenAsThatAllows) {
  for (const int64_t rows : {0, 1, 7, 8, 9, 16, 64, 70, 192, 576, 896, 4864, 8960, 151936}) {
    for (int count = 1; count <= 5; ++count) {
      int64_t at = 0, small = rows, big = 0;
      for (int i = 0; i < count; ++i) {
        const RowRange r = slice_rows(rows, i, count);
        EXPECT_EQ(r.begin, at) << rows << " rows, slice " << i << " of " << count;
        EXPECT_LE(r.begin, r.end);
        if (i + 1 < count) {
          EXPECT_EQ(r.end % kSliceRowAlign, 0);
        }
        small = std::min(small, r.size());
        big = std::max(big, r.size());
        at = r.end;
      }
      EXPECT_EQ(at, rows) << rows << " rows over " << count;
      // Boundaries are floor(i rows / count) rounded down to 8: sizes differ by under 16 rows
      // (the last slice takes the rest) and by at most 8 where every boundary is exact.
      EXPECT_LT(big - small, 2 * kSliceRowAlign) << rows << " rows over " << count;
    }
  }
  // Uneven: 576 rows over 3 = 192 each; 70 over 3 = [0, 16) [16, 40) [40, 70).
  EXPECT_EQ(slice_rows(576, 1, 3), (RowRange{192, 384}));
  EXPECT_EQ(slice_rows(70, 0, 3), (RowRange{0, 16}));
  EXPECT_EQ(slice_rows(70, 1, 3), (RowRange{16, 40}));
  EXPECT_EQ(slice_rows(70, 2, 3), (RowRange{40, 70}));
  // Fewer rows than groups: empty slices, the rows on the last.
  EXPECT_EQ(slice_rows(12, 0, 4).size(), 0);
  EXPECT_EQ(slice_rows(12, 3, 4), (RowRange{8, 12}));
}

TEST(DenseSlice, AMatrixWhoseRowsAreNotTheirOwnIsRefusedNamingIt) {
  std::vector<uint8_t> bytes(8 * 72, 0);
  WeightMatrix m;
  m.name = "blk.3.ffn_up.weight";
  m.type = static_cast<uint32_t>(gguf::TensorType::kQ4_0);  // 18 bytes a block of 32
  m.data = bytes.data();
  m.rows = 8;
  m.cols = 64;
  m.row_bytes = 36;
  EXPECT_TRUE(check_row_slice(m, {0, 8}).is_ok());
  EXPECT_TRUE(check_row_slice(m, {3, 3}).is_ok());
  const Status out = check_row_slice(m, {4, 9});
  EXPECT_EQ(out.code(), Code::kInvalidArgument);
  EXPECT_NE(out.message().find("blk.3.ffn_up.weight"), std::string::npos) << out.message();
  // Rows 72 bytes apart for 36 bytes of blocks: the format keeps something between rows (an
  // interleaved or row-group layout); no slice of it is read as a matrix.
  m.row_bytes = 72;
  const Status st = check_row_slice(m, {0, 4});
  EXPECT_EQ(st.code(), Code::kUnsupported);
  for (const char* want : {"blk.3.ffn_up.weight", "q4_0", "72 bytes apart", "not 36"})
    EXPECT_NE(st.message().find(want), std::string::npos) << want << " in: " << st.message();
  m.type = 31;  // a type id ggml does not define here (its repacked layouts)
  m.row_bytes = 36;
  EXPECT_EQ(check_row_slice(m, {0, 4}).code(), Code::kUnsupported);
}

class TinyFile {
 public:
  explicit TinyFile(const testing::TinyLlamaSpec& spec) {
    path_ = dir_.path("tiny.gguf");
    testing::GgufBuilder::write(path_, testing::build_tiny_llama(spec));
  }
  std::unique_ptr<LlamaModel> load() const {
    auto m = LlamaModel::load(path_);
    EXPECT_TRUE(m.is_ok()) << m.status().to_string();
    return m.is_ok() ? std::move(m).value() : nullptr;
  }

 private:
  ScratchDir dir_;
  std::string path_;
};

TEST(DenseSlice, ASliceMapsOnlyItsRowsAndCopiesOnlyThoseRows) {
  testing::TinyLlamaSpec spec;
  spec.output_weight = true;
  spec.override_type = 8;  // q8_0 everywhere: every matrix has a rows8 layout
  TinyFile f(spec);
  const auto m = f.load();
  ASSERT_TRUE(m);
  const DenseWeights& whole = m->weights();
  EXPECT_TRUE(whole.whole());
  auto packed = f.load();
  packed->pack_rows8(MatmulMode::kInt8, 1);
  const std::size_t whole8 = packed->rows8_bytes();
  ASSERT_GT(whole8, 0u);
  for (int p = 1; p <= 4; ++p) {
    std::size_t bytes = 0, rows8 = 0;
    for (int i = 0; i < p; ++i) {
      auto s = m->slice(i, p);
      ASSERT_TRUE(s.is_ok()) << s.status().to_string();
      EXPECT_EQ(s->index(), i);
      EXPECT_EQ(s->count(), p);
      for (int l = 0; l < s->layers(); ++l)
        for (int pr = 0; pr < kProjections; ++pr) {
          const auto proj = static_cast<Projection>(pr);
          const WeightMatrix& a = whole.matrix(l, proj);
          const WeightMatrix& b = s->matrix(l, proj);
          const RowRange r = s->rows(proj);
          EXPECT_EQ(b.rows, r.size());
          if (p == 1) {
            EXPECT_EQ(b.data, a.data) << b.name;
          } else if (r.size() > 0) {
            EXPECT_NE(b.data, a.data + r.begin * a.row_bytes) << b.name << ": not its own mapping";
            EXPECT_EQ(0, std::memcmp(b.data, a.data + r.begin * a.row_bytes, b.bytes())) << b.name;
          }
          EXPECT_EQ(b.rows8, nullptr);
        }
      bytes += s->bytes();
      s->pack_rows8(MatmulMode::kInt8, 1);
      std::size_t mine = 0;  // the copies of this slice's rows, matrix by matrix
      for (int l = 0; l < s->layers(); ++l)
        for (int pr = 0; pr + 1 < kProjections; ++pr)
          mine += rows8_bytes(s->matrix(l, static_cast<Projection>(pr)));
      mine += rows8_bytes(s->matrix(0, Projection::kHead));
      EXPECT_EQ(s->rows8_bytes(), mine);
      s->pack_rows8(MatmulMode::kInt8, 1);  // a second call copies nothing more
      EXPECT_EQ(s->rows8_bytes(), mine);
      rows8 += mine;
    }
    EXPECT_EQ(bytes, whole.bytes()) << p << " slices";
    // The slices' copies together are the whole copy's groups (slices start on a group), less
    // a group wherever a slice's last rows do not fill one.
    EXPECT_LE(rows8, whole8) << p << " slices";
    EXPECT_GE(rows8, whole8 / 2) << p << " slices";
    if (p == 1) {
      EXPECT_EQ(rows8, whole8);
    }
  }
  EXPECT_EQ(m->slice(4, 4).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(m->slice(-1, 2).status().code(), Code::kInvalidArgument);
  // A packed model's slices view its copy (the bits are checked below).
  auto s = packed->slice(1, 2);
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(s->rows8_bytes(), 0u);
  const WeightMatrix& up = s->matrix(2, Projection::kUp);
  EXPECT_NE(up.rows8, nullptr);
  const WeightMatrix& wup = packed->weights().matrix(2, Projection::kUp);
  EXPECT_EQ(up.rows8, wup.rows8 + s->rows(Projection::kUp).begin / 8 *
                                      static_cast<int64_t>(rows8_bytes(wup)) / (wup.rows / 8));
}

// The whole-row calls against the pieces computed slice by slice, each slice's output rows put
// in their columns (as the engine's all-gathers do).
struct Pieces {
  std::vector<float> q, k, v, x, logits;
};

Pieces whole_rows(const LlamaModel& m, const DenseWeights& w, const std::vector<float>& x,
                  const std::vector<float>& a, const std::vector<int64_t>& pos,
                  const MatvecOptions& o) {
  const auto& c = m.config();
  const auto T = static_cast<int64_t>(pos.size());
  Pieces r{std::vector<float>(static_cast<std::size_t>(T * c.n_head * c.head_dim)),
           std::vector<float>(static_cast<std::size_t>(T * c.n_head_kv * c.head_dim)),
           std::vector<float>(static_cast<std::size_t>(T * c.n_head_kv * c.head_dim)), x,
           std::vector<float>(static_cast<std::size_t>(T * c.n_vocab))};
  ForwardScratch s;
  EXPECT_TRUE(
      m.attention_inputs(w, 1, x.data(), T, pos.data(), r.q.data(), r.k.data(), r.v.data(), s, o)
          .is_ok());
  EXPECT_TRUE(m.attention_output_and_ffn(w, 1, a.data(), T, r.x.data(), s, o).is_ok());
  EXPECT_TRUE(m.logits(w, x.data(), T, r.logits.data(), s, o).is_ok());
  return r;
}

// out[t][cols of projection p of slice i] = part[t][...] for every slice.
void put(const std::vector<DenseWeights>& ws, Projection p, int64_t T,
         const std::vector<std::vector<float>>& parts, std::vector<float>& out) {
  const int64_t n = ws[0].full_rows(p);
  out.assign(static_cast<std::size_t>(T * n), 0.0f);
  for (std::size_t i = 0; i < ws.size(); ++i) {
    const RowRange r = ws[i].rows(p);
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(out.data() + t * n + r.begin, parts[i].data() + t * r.size(),
                  static_cast<std::size_t>(r.size()) * 4);
  }
}

// Each slice computes projections ps over x; the gathered outputs, one vector per projection.
std::vector<std::vector<float>> gathered(const LlamaModel& m, const std::vector<DenseWeights>& ws,
                                         int layer, std::vector<Projection> ps, const float* x,
                                         int64_t T, int64_t stride, const MatvecOptions& o) {
  std::vector<std::vector<float>> out(ps.size());
  std::vector<std::vector<std::vector<float>>> parts(ps.size(),
                                                     std::vector<std::vector<float>>(ws.size()));
  for (std::size_t i = 0; i < ws.size(); ++i) {
    std::vector<float*> ys;
    for (std::size_t j = 0; j < ps.size(); ++j) {
      parts[j][i].assign(static_cast<std::size_t>(T * ws[i].rows(ps[j]).size()) + 1, 0.0f);
      ys.push_back(parts[j][i].data());
    }
    EXPECT_TRUE(m.project(ws[i], layer, ps, x, T, stride, ys, o).is_ok());
  }
  for (std::size_t j = 0; j < ps.size(); ++j) put(ws, ps[j], T, parts[j], out[j]);
  return out;
}

Pieces sliced_rows(const LlamaModel& m, const std::vector<DenseWeights>& ws,
                   const std::vector<float>& x, const std::vector<float>& a,
                   const std::vector<int64_t>& pos, const MatvecOptions& o) {
  const auto& c = m.config();
  const auto T = static_cast<int64_t>(pos.size());
  const int64_t E = c.n_embd, qd = c.n_head * c.head_dim;
  Pieces r;
  ForwardScratch s;
  std::vector<float> xn(static_cast<std::size_t>(T * E));
  m.attention_norm(1, x.data(), T, xn.data(), o);
  auto qkv =
      gathered(m, ws, 1, {Projection::kQ, Projection::kK, Projection::kV}, xn.data(), T, E, o);
  EXPECT_TRUE(
      m.finish_qkv(1, T, pos.data(), qkv[0].data(), qkv[1].data(), qkv[2].data(), s, o).is_ok());
  r.q = qkv[0];
  r.k = qkv[1];
  r.v = qkv[2];
  r.x = x;
  auto oproj = gathered(m, ws, 1, {Projection::kO}, a.data(), T, qd, o);
  m.add_attention_output(1, oproj[0].data(), T, r.x.data(), o);
  m.ffn_norm(1, r.x.data(), T, xn.data(), o);
  // gate and up per slice, the activation on the slice, then the activations gathered.
  std::vector<std::vector<float>> acts(ws.size());
  for (std::size_t i = 0; i < ws.size(); ++i) {
    const int64_t wf = ws[i].rows(Projection::kGate).size();
    std::vector<float> up(static_cast<std::size_t>(T * wf) + 1);
    acts[i].assign(static_cast<std::size_t>(T * wf) + 1, 0.0f);
    const Projection ps[] = {Projection::kGate, Projection::kUp};
    float* ys[] = {acts[i].data(), up.data()};
    EXPECT_TRUE(m.project(ws[i], 1, ps, xn.data(), T, E, ys, o).is_ok());
    m.ffn_activation(acts[i].data(), up.data(), T, wf, o);
  }
  std::vector<float> act;
  put(ws, Projection::kGate, T, acts, act);
  auto down = gathered(m, ws, 1, {Projection::kDown}, act.data(), T, c.n_ff, o);
  m.add_ffn_output(1, down[0].data(), T, r.x.data(), o);
  m.output_norm(x.data(), T, xn.data());
  r.logits = gathered(m, ws, -1, {Projection::kHead}, xn.data(), T, E, o)[0];
  return r;
}

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

TEST(DenseSlice, PiecesOfTheSlicesGiveTheWholeForwardPassBitForBit) {
  std::vector<testing::TinyLlamaSpec> specs(4);
  specs[0].n_vocab = 301;  // odd rows for the head: its last slice ends mid-group
  specs[1].architecture = "qwen2";
  specs[1].qkv_bias = true;
  specs[1].output_weight = true;
  specs[2].architecture = "gemma3";
  specs[2].sliding_window = 8;
  specs[3].override_type = 8;  // q8_0 everywhere: rows8 copies in every matrix
  specs[3].n_ff = 352;         // 11 blocks of 32: slices of 3 end mid-way (112, 232)
  specs[3].n_vocab = 330;
  for (const auto& spec : specs) {
    SCOPED_TRACE(spec.architecture + (spec.override_type ? " q8_0" : " cycled types"));
    TinyFile f(spec);
    const auto raw = f.load();
    ASSERT_TRUE(raw);
    const auto& c = raw->config();
    std::mt19937_64 rng(7);
    std::normal_distribution<float> nd;
    for (const int64_t T : {int64_t{1}, int64_t{9}}) {
      std::vector<float> x(static_cast<std::size_t>(T * c.n_embd)),
          a(static_cast<std::size_t>(T * c.n_head * c.head_dim));
      for (auto& v : x) v = nd(rng);
      for (auto& v : a) v = nd(rng);
      std::vector<int64_t> pos(static_cast<std::size_t>(T));
      for (int64_t t = 0; t < T; ++t) pos[static_cast<std::size_t>(t)] = 3 + 5 * t;
      for (const MatmulMode mode : {MatmulMode::kExact, MatmulMode::kInt8, MatmulMode::kInt8Ffn}) {
        MatvecOptions o;
        o.mode = mode;
        o.threads = 2;
        const auto packed = f.load();
        packed->pack_rows8(mode, 1);
        const Pieces want = whole_rows(*raw, raw->weights(), x, a, pos, o);
        const Pieces want8 = whole_rows(*packed, packed->weights(), x, a, pos, o);
        EXPECT_TRUE(same(want.logits, want8.logits) && same(want.x, want8.x));
        for (int p = 1; p <= 4; ++p) {
          SCOPED_TRACE(std::string(matmul_mode_name(mode)) + ", " + std::to_string(p) +
                       " slices, " + std::to_string(T) + " tokens");
          // Slices of the unpacked model with their own copies, and views of the packed one.
          for (const bool own : {true, false}) {
            std::vector<DenseWeights> ws;
            for (int i = 0; i < p; ++i) {
              auto s = (own ? *raw : *packed).slice(i, p);
              ASSERT_TRUE(s.is_ok()) << s.status().to_string();
              if (own) s->pack_rows8(mode, 1);
              ws.push_back(std::move(s).value());
            }
            const Pieces got = sliced_rows(own ? *raw : *packed, ws, x, a, pos, o);
            if (mode == MatmulMode::kExact && own) {  // each slice embeds its vocabulary rows
              for (const DenseWeights& w : ws) {
                const RowRange r = w.rows(Projection::kHead);
                std::vector<TokenId> ids;
                for (int64_t id = r.begin; id < r.end; id += 7) ids.push_back(static_cast<TokenId>(id));
                std::vector<float> e1(ids.size() * static_cast<std::size_t>(c.n_embd)), e2(e1);
                ASSERT_TRUE(raw->embed(ids, e1.data()).is_ok());
                ASSERT_TRUE(raw->embed(w, ids, e2.data()).is_ok());
                EXPECT_TRUE(same(e1, e2)) << "embedding rows of slice " << w.index();
                const TokenId out = static_cast<TokenId>(r.end < c.n_vocab ? r.end : r.begin - 1);
                if (p > 1) {
                  EXPECT_EQ(raw->embed(w, std::span<const TokenId>(&out, 1), e2.data()).code(),
                            Code::kInvalidArgument);
                }
              }
            }
            EXPECT_TRUE(same(got.q, want.q)) << "q";
            EXPECT_TRUE(same(got.k, want.k)) << "k";
            EXPECT_TRUE(same(got.v, want.v)) << "v";
            EXPECT_TRUE(same(got.x, want.x)) << "x after the attention output and FFN";
            EXPECT_TRUE(same(got.logits, want.logits)) << "logits";
          }
        }
      }
    }
  }
}

TEST(DenseSlice, TheWholeRowCallsRefuseASliceOfMore) {
  TinyFile f(testing::TinyLlamaSpec{});
  const auto m = f.load();
  ASSERT_TRUE(m);
  auto s = m->slice(0, 2);
  ASSERT_TRUE(s.is_ok());
  std::vector<float> x(static_cast<std::size_t>(m->config().n_embd), 0.5f),
      out(static_cast<std::size_t>(m->config().n_vocab));
  ForwardScratch scratch;
  const Status st = m->logits(*s, x.data(), 1, out.data(), scratch, {});
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("slice 0 of 2"), std::string::npos) << st.message();
  auto one = m->slice(0, 1);  // a slice of one is whole
  ASSERT_TRUE(one.is_ok());
  EXPECT_TRUE(m->logits(*one, x.data(), 1, out.data(), scratch, {}).is_ok());
}

}  // namespace
}  // namespace treeattn::model
