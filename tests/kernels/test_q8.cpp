// q8.h's activation blocks and int8.h's dot products: the rounding they promise, exactly.
#include "check.h"
#include "int8.h"
#include "q8.h"

TEST(q8_blocks_round_each_input_by_at_most_half_a_step) {
  check::Rng g(3);
  for (int span : {32, 256})  // the K-quants' activations: one scale per 256 inputs
    for (int64_t K : {1, 31, 32, 33, 100, 300}) {
      std::vector<float> x(K);
      for (int64_t k = 0; k < K; ++k) x[k] = k >= 32 && k < 64 ? 0.f : float(g.normal()) * (k == 5 ? 50.f : 1.f);
      const int64_t n = q8::blocks(K);
      std::vector<q8::Block> b(n);
      q8::quantize_row(x.data(), K, n * 32, b.data(), span);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t s0 = 32 * j / span * span;
        float amax = 0;
        for (int64_t k = s0; k < std::min<int64_t>(K, s0 + span); ++k) amax = std::fmax(amax, std::fabs(x[k]));
        CHECK(b[j].d == amax / 127, "span %d K %ld block %ld: d %g, amax %g", span, (long)K, (long)j, b[j].d, amax);
        int sums[2] = {0, 0};
        for (int i = 0; i < 32; ++i) {
          const int64_t k = 32 * j + i;
          const double v = k < K ? x[k] : 0.0;
          CHECK(std::abs(b[j].q[i]) <= 127 && std::fabs(v - double(b[j].d) * b[j].q[i]) <= b[j].d * 0.5000001,
                "span %d K %ld input %ld: %g as %d x %g", span, (long)K, (long)k, v, b[j].q[i], b[j].d);
          sums[i / 16] += b[j].q[i];
        }
        CHECK(b[j].sum[0] == sums[0] && b[j].sum[1] == sums[1], "span %d K %ld block %ld sums", span, (long)K, (long)j);
      }
      for (int64_t s0 = 0; s0 < n * 32; s0 += span) {  // the span's largest input takes code +-127
        int top = 0;
        for (int64_t k = s0; k < std::min<int64_t>(n * 32, s0 + span); ++k)
          top = std::max(top, std::abs(int(b[k / 32].q[k % 32])));
        CHECK(b[s0 / 32].d == 0 ? top == 0 : top == 127, "span %d K %ld at %ld: largest code %d", span, (long)K,
              (long)s0, top);
      }
    }
}

TEST(int8_dot_products_are_exact_at_the_extremes) {
  check::Rng g(4);
  constexpr int BYTES = 4 * i8::LANES;
  int8_t a[BYTES], b[BYTES], u[BYTES];
  for (int round = 0; round < 50; ++round) {
    for (int i = 0; i < BYTES; ++i) {
      a[i] = int8_t(round < 2 ? (round ? -127 : 127) : g.below(255) - 127);
      b[i] = int8_t(round < 2 ? 127 : g.below(255) - 127);
      u[i] = int8_t(round < 2 ? 127 : g.below(128));
    }
    alignas(64) int32_t s[i8::LANES], t[i8::LANES];
    const i8::I32 start = i8::zero();
    const i8::I32 ss = i8::dot_s8s8(start, i8::load_b8(a), i8::load_b8(b));
    const i8::I32 us = i8::dot_u8s8(start, i8::load_b8(u), i8::load_b8(b));
    std::memcpy(s, &ss, sizeof s);
    std::memcpy(t, &us, sizeof t);
    for (int l = 0; l < i8::LANES; ++l) {
      int want_s = 0, want_u = 0;
      for (int i = 4 * l; i < 4 * l + 4; ++i) want_s += a[i] * b[i], want_u += u[i] * b[i];
      CHECK(s[l] == want_s && t[l] == want_u, "round %d lane %d: %d %d, want %d %d", round, l, s[l], t[l], want_s,
            want_u);
    }
  }
}
