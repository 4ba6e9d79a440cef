// The gated activation's vector loops, written once and compiled per target: included by
// activation_avx2.cpp and activation_avx512.cpp inside their anonymous namespace after their
// `struct Ops` (V, kW floats a vector; load, store, set1, mul, add, div, neg and exp, the last
// expf_glibc lane by lane). The operations and their order are gated_one's (activation.hpp), so
// every target gives its bits; the tail runs gated_one itself.

inline void gated_body(FfnActivation act, float* gate, const float* up, int64_t n) {
  using V = Ops::V;
  const V one = Ops::set1(1.0f);
  int64_t i = 0;
  if (act == FfnActivation::kGeluTanh) {
    const V s = Ops::set1(kGeluS), a = Ops::set1(kGeluA), m2 = Ops::set1(-2.0f);
    for (; i + Ops::kW <= n; i += Ops::kW) {
      const V g = Ops::load(gate + i);
      const V y = Ops::mul(Ops::mul(s, g), Ops::add(one, Ops::mul(Ops::mul(a, g), g)));
      const V e = Ops::exp(Ops::mul(m2, y));
      Ops::store(gate + i, Ops::mul(Ops::div(g, Ops::add(one, e)), Ops::load(up + i)));
    }
  } else {
    for (; i + Ops::kW <= n; i += Ops::kW) {
      const V g = Ops::load(gate + i);
      const V e = Ops::exp(Ops::neg(g));
      Ops::store(gate + i, Ops::mul(Ops::div(g, Ops::add(one, e)), Ops::load(up + i)));
    }
  }
  for (; i < n; ++i) gate[i] = gated_one(act, gate[i], up[i]);
}

inline void exp_body(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + Ops::kW <= n; i += Ops::kW) Ops::store(y + i, Ops::exp(Ops::load(x + i)));
  for (; i < n; ++i) y[i] = expf_glibc(x[i]);
}
