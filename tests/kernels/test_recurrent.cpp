// recurrent.cpp against float64 token recurrences: the short convolution and the gated delta rule, decode over
// several slots (others untouched) and prefill; widths that leave tails of every variant, GQA; a prefill gives
// each token the bits decode gives it (so any split of a prompt gives the same bits); slots out of range refused.
#include "check.h"
#include "prelude.h"

#include <array>

namespace {

std::vector<float> randoms(check::Rng& g, size_t n, double scale = 1) {
  std::vector<float> v(n);
  for (float& x : v) x = float(g.normal() * scale);
  return v;
}

double silu(double x) { return x / (1 + std::exp(-x)); }

// A short convolution: weight [C, K], bias [C], states [slots, C, K - 1], in float32 and a float64 copy.
struct Conv {
  int64_t C, slots;
  int K;
  std::vector<float> w, bias, state;
  std::vector<double> want_state;

  Conv(int64_t c, int k, int64_t n, uint64_t seed) : C(c), slots(n), K(k) {
    check::Rng g(seed);
    w = randoms(g, C * K), bias = randoms(g, C), state = randoms(g, slots * C * (K - 1));
    want_state.assign(state.begin(), state.end());
  }
  // Token x [C] after slot s's float64 history: the outputs, the history shifted.
  std::vector<double> reference(int64_t s, const float* x, bool silu_out) {
    std::vector<double> y(C);
    const int H = K - 1;
    for (int64_t c = 0; c < C; ++c) {
      double* h = &want_state[(s * C + c) * H];
      double acc = bias[c] + w[c * K + H] * double(x[c]);
      for (int j = 0; j < H; ++j) acc += w[c * K + j] * h[j];
      y[c] = silu_out ? silu(acc) : acc;
      for (int j = 0; j + 1 < H; ++j) h[j] = h[j + 1];
      if (H) h[H - 1] = x[c];
    }
    return y;
  }
};

// 1e-6 of the largest value: K <= 4 float32 products a convolution output (measured ~2e-7); the delta rule's
// state gathers a few ulps a token and never stretches them (measured ~2e-7 after 150 tokens).
constexpr double TOLERANCE = 1e-6, DELTA_TOLERANCE = 2e-6;

// The gated delta rule's problem: T tokens of q, k (unit rows, q scaled), v, g <= 0, beta in (0, 1); states
// [slots, HV, DK, DV] in float32 and float64.
struct Delta {
  int64_t T, HK, HV, DK, DV, slots;
  std::vector<float> q, k, v, g, beta, state;
  std::vector<double> want_state;

  Delta(int64_t t, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t n, uint64_t seed)
      : T(t), HK(hk), HV(hv), DK(dk), DV(dv), slots(n) {
    check::Rng r(seed);
    q = unit_rows(r, 1 / std::sqrt(double(DK))), k = unit_rows(r, 1), v = randoms(r, T * HV * DV);
    for (int64_t i = 0; i < T * HV; ++i) {
      g.push_back(float(-0.5 * std::log1p(std::exp(r.normal()))));
      beta.push_back(float(1 / (1 + std::exp(-r.normal()))));
    }
    state = randoms(r, slots * HV * DK * DV, 0.3);
    want_state.assign(state.begin(), state.end());
  }
  std::vector<float> unit_rows(check::Rng& r, double scale) const {
    std::vector<float> x = randoms(r, T * HK * DK);
    for (int64_t i = 0; i < T * HK; ++i) {
      double norm = 0;
      for (int64_t d = 0; d < DK; ++d) norm += double(x[i * DK + d]) * x[i * DK + d];
      for (int64_t d = 0; d < DK; ++d) x[i * DK + d] = float(x[i * DK + d] / std::sqrt(norm) * scale);
    }
    return x;
  }
  // Token t on slot s's float64 state: its outputs [HV, DV].
  std::vector<double> reference(int64_t s, int64_t t) {
    std::vector<double> o(HV * DV), kv(DV);
    for (int64_t h = 0; h < HV; ++h) {
      double* S = &want_state[(s * HV + h) * DK * DV];
      const float *kh = &k[(t * HK + h / (HV / HK)) * DK], *qh = &q[(t * HK + h / (HV / HK)) * DK];
      const double a = std::exp(double(g[t * HV + h])), b = beta[t * HV + h];
      std::fill(kv.begin(), kv.end(), 0.0);
      for (int64_t i = 0; i < DK; ++i)
        for (int64_t j = 0; j < DV; ++j) kv[j] += (S[i * DV + j] *= a) * kh[i];
      for (int64_t j = 0; j < DV; ++j) kv[j] = (v[(t * HV + h) * DV + j] - kv[j]) * b;  // delta
      for (int64_t i = 0; i < DK; ++i)
        for (int64_t j = 0; j < DV; ++j) o[h * DV + j] += (S[i * DV + j] += kh[i] * kv[j]) * qh[i];
    }
    return o;
  }
};

}  // namespace

TEST(conv_decode_matches_float64) {
  for (int K : {1, 2, 4})
    for (int64_t C : {int64_t(1), int64_t(37), int64_t(64)})
      for (bool silu_out : {false, true}) {
        Conv p(C, K, 5, 10 * K + C);
        const int64_t slots[] = {4, 0, 2};
        check::Rng g(K);
        for (int step = 0; step < K + 1; ++step) {
          const std::vector<float> x = randoms(g, 3 * C);
          std::vector<float> y(3 * C);
          const int status = zhuzi_conv_decode(x.data(), p.state.data(), slots, p.w.data(), p.bias.data(), y.data(),
                                               3, C, K, 5, silu_out, 2);
          CHECK(status == 0, "status %d", status);
          for (int b = 0; b < 3; ++b) {
            const std::vector<double> want = p.reference(slots[b], &x[b * C], silu_out);
            CHECK_CLOSE(check::compare(&y[b * C], want.data(), C, check::of_float), TOLERANCE, "K %d C %ld row %d",
                        K, (long)C, b);
          }
        }
        CHECK_CLOSE(check::compare(p.state.data(), p.want_state.data(), int64_t(p.state.size()), check::of_float),
                    TOLERANCE, "K %d C %ld: the states", K, (long)C);
      }
}

TEST(conv_prefill_matches_float64_and_gives_decode_bits) {
  for (int K : {2, 3, 4})
    for (int64_t L : {int64_t(1), int64_t(2), int64_t(41)}) {
      const int64_t C = 37;
      Conv p(C, K, 3, 100 + 10 * K + L);
      std::vector<float> decoded = p.state;
      check::Rng g(L);
      const std::vector<float> x = randoms(g, L * C);
      std::vector<float> y(L * C), step(C);
      CHECK(zhuzi_conv_prefill(x.data(), p.state.data(), 1, p.w.data(), nullptr, y.data(), L, C, K, 3, 1, 2) == 0,
            "K %d L %ld", K, (long)L);
      p.bias.assign(C, 0.f);  // the reference's bias: none
      const int64_t slot = 1;
      for (int64_t t = 0; t < L; ++t) {
        const std::vector<double> want = p.reference(1, &x[t * C], true);
        CHECK_CLOSE(check::compare(&y[t * C], want.data(), C, check::of_float), TOLERANCE, "K %d L %ld token %ld", K,
                    (long)L, (long)t);
        zhuzi_conv_decode(&x[t * C], decoded.data(), &slot, p.w.data(), nullptr, step.data(), 1, C, K, 3, 1, 1);
        CHECK(!std::memcmp(step.data(), &y[t * C], C * 4), "K %d L %ld token %ld: decode's bits", K, (long)L, (long)t);
      }
      CHECK_CLOSE(check::compare(p.state.data(), p.want_state.data(), int64_t(p.state.size()), check::of_float),
                  TOLERANCE, "K %d L %ld: the states", K, (long)L);
      CHECK(decoded == p.state, "K %d L %ld: decode's states", K, (long)L);
    }
}

TEST(delta_decode_matches_float64) {
  // (HK, HV, DK, DV): tails of every variant's column blocks, GQA, a head of the size models use
  for (auto [HK, HV, DK, DV] : {std::array<int64_t, 4>{2, 4, 40, 36}, {1, 3, 7, 5}, {1, 1, 128, 128}}) {
    const int64_t B = 3, steps = 3;
    Delta p(B * steps, HK, HV, DK, DV, 4, DK + DV);
    const int64_t slots[] = {3, 1, 0};
    for (int64_t s = 0; s < steps; ++s) {
      std::vector<float> out(B * HV * DV);
      const int64_t t = s * B;  // this step's rows: tokens t .. t + B
      const int status = zhuzi_delta_decode(&p.q[t * HK * DK], &p.k[t * HK * DK], &p.v[t * HV * DV], &p.g[t * HV],
                                            &p.beta[t * HV], p.state.data(), slots, out.data(), B, HK, HV, DK, DV, 4,
                                            2);
      CHECK(status == 0, "status %d", status);
      for (int64_t b = 0; b < B; ++b) {
        const std::vector<double> want = p.reference(slots[b], t + b);
        CHECK_CLOSE(check::compare(&out[b * HV * DV], want.data(), HV * DV, check::of_float), DELTA_TOLERANCE,
                    "DK %ld DV %ld row %ld", (long)DK, (long)DV, (long)b);
      }
    }
    CHECK_CLOSE(check::compare(p.state.data(), p.want_state.data(), int64_t(p.state.size()), check::of_float),
                DELTA_TOLERANCE, "DK %ld DV %ld: the states", (long)DK, (long)DV);
  }
}

TEST(delta_prefill_matches_float64_and_gives_decode_bits) {
  for (auto [HK, HV, DK, DV] : {std::array<int64_t, 4>{2, 4, 40, 36}, {1, 2, 128, 128}}) {
    const int64_t L = 70, slot = 1;
    Delta p(L, HK, HV, DK, DV, 3, L + DK);
    std::vector<float> decoded = p.state, out(L * HV * DV), step(HV * DV);
    CHECK(zhuzi_delta_prefill(p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(), p.state.data(), slot,
                              out.data(), L, HK, HV, DK, DV, 3, 2) == 0, "DK %ld", (long)DK);
    for (int64_t t = 0; t < L; ++t) {
      const std::vector<double> want = p.reference(slot, t);
      CHECK_CLOSE(check::compare(&out[t * HV * DV], want.data(), HV * DV, check::of_float), DELTA_TOLERANCE,
                  "DK %ld token %ld", (long)DK, (long)t);
      zhuzi_delta_decode(&p.q[t * HK * DK], &p.k[t * HK * DK], &p.v[t * HV * DV], &p.g[t * HV], &p.beta[t * HV],
                         decoded.data(), &slot, step.data(), 1, HK, HV, DK, DV, 3, 1);
      CHECK(!std::memcmp(step.data(), &out[t * HV * DV], HV * DV * 4), "DK %ld token %ld: decode's bits", (long)DK,
            (long)t);
    }
    CHECK_CLOSE(check::compare(p.state.data(), p.want_state.data(), int64_t(p.state.size()), check::of_float),
                DELTA_TOLERANCE, "DK %ld: the states", (long)DK);
    CHECK(decoded == p.state, "DK %ld: decode's states", (long)DK);
  }
}

TEST(recurrent_kernels_refuse_slots_out_of_range_and_odd_heads) {
  Conv c(8, 4, 2, 1);
  std::vector<float> x(16), y(16);
  const int64_t bad[] = {0, 2};
  CHECK(zhuzi_conv_decode(x.data(), c.state.data(), bad, c.w.data(), nullptr, y.data(), 2, 8, 4, 2, 0, 1) == 1,
        "conv decode");
  CHECK(zhuzi_conv_prefill(x.data(), c.state.data(), -1, c.w.data(), nullptr, y.data(), 2, 8, 4, 2, 0, 1) == 1,
        "conv prefill");
  CHECK(c.state == std::vector<float>(c.want_state.begin(), c.want_state.end()), "a refused call wrote a state");
  Delta d(2, 2, 3, 4, 4, 2, 2);
  std::vector<float> out(2 * 3 * 4);
  CHECK(zhuzi_delta_decode(d.q.data(), d.k.data(), d.v.data(), d.g.data(), d.beta.data(), d.state.data(), bad,
                           out.data(), 2, 2, 3, 4, 4, 2, 1) == 2, "3 value heads over 2 key heads");
  CHECK(zhuzi_delta_prefill(d.q.data(), d.k.data(), d.v.data(), d.g.data(), d.beta.data(), d.state.data(), 2,
                            out.data(), 2, 1, 2, 4, 4, 2, 1) == 1, "delta prefill");
}

// The scalar code (a channel or value column past the last whole vector) is the reference the vectors are held
// to bit for bit: one channel or column alone, all scalar, gets the bits it gets among others, in vectors.
TEST(recurrent_vectors_give_the_scalar_codes_bits) {
  const int64_t C = 37, L = 9;
  const int K = 4;
  Conv all(C, K, 1, 7);
  check::Rng g(8);
  const std::vector<float> x = randoms(g, L * C);
  std::vector<float> y(L * C);
  zhuzi_conv_prefill(x.data(), all.state.data(), 0, all.w.data(), all.bias.data(), y.data(), L, C, K, 1, 1, 2);
  for (int64_t c : {0, 16, 36}) {
    Conv one(1, K, 1, 7);
    one.w.assign(&all.w[c * K], &all.w[c * K + K]), one.bias = {all.bias[c]};
    one.state.assign(&all.want_state[c * (K - 1)], &all.want_state[c * (K - 1) + K - 1]);
    std::vector<float> xc(L), yc(L);
    for (int64_t t = 0; t < L; ++t) xc[t] = x[t * C + c];
    zhuzi_conv_prefill(xc.data(), one.state.data(), 0, one.w.data(), one.bias.data(), yc.data(), L, 1, K, 1, 1, 1);
    for (int64_t t = 0; t < L; ++t) CHECK(yc[t] == y[t * C + c], "channel %ld token %ld", (long)c, (long)t);
    CHECK(!std::memcmp(one.state.data(), &all.state[c * (K - 1)], (K - 1) * 4), "channel %ld: its history", (long)c);
  }
  const int64_t HV = 2, DK = 20, DV = 40;
  Delta d(L, 1, HV, DK, DV, 1, 9);
  std::vector<float> out(L * HV * DV);
  zhuzi_delta_prefill(d.q.data(), d.k.data(), d.v.data(), d.g.data(), d.beta.data(), d.state.data(), 0, out.data(), L,
                      1, HV, DK, DV, 1, 2);
  for (int64_t j : {0, 17, 39}) {
    std::vector<float> v(L * HV), S(HV * DK), o(L * HV);
    for (int64_t i = 0; i < L * HV; ++i) v[i] = d.v[i * DV + j];
    for (int64_t i = 0; i < HV * DK; ++i) S[i] = float(d.want_state[i * DV + j]);
    zhuzi_delta_prefill(d.q.data(), d.k.data(), v.data(), d.g.data(), d.beta.data(), S.data(), 0, o.data(), L, 1, HV,
                        DK, 1, 1, 1);
    for (int64_t i = 0; i < L * HV; ++i) CHECK(o[i] == out[i * DV + j], "column %ld output %ld", (long)j, (long)i);
    for (int64_t i = 0; i < HV * DK; ++i) CHECK(S[i] == d.state[i * DV + j], "column %ld state %ld", (long)j, (long)i);
  }
}
