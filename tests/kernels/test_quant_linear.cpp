// quant_linear.cpp against float64 products of the weights the Q4 / Q8 units stand for: float32 and bf16
// inputs, every pass size and a partial last row group. AVX-512 meets bf16 inputs as they are (float32 ones
// rounded to bf16 once); the other variants meet q8 blocks, held to the bound of that rounding.
#include "check.h"
#include "pack.h"
#include "prelude.h"

namespace {

struct Case {
  int64_t M, N, K;
  std::vector<float> x;  // what the kernel reads, already rounded when bf16
  std::vector<uint16_t> x16;
  pack::Packed t;
};

Case make(int format, int64_t M, int64_t N, int64_t K, bool x_bf16, uint64_t seed) {
  check::Rng g(seed);
  Case c{M, N, K, {}, {}, {}};
  for (int64_t i = 0; i < M * K; ++i) {
    float v = float(g.normal()) * (i % K == 7 ? 20.f : 1.f);  // an outlier channel, as real activations have
    c.x16.push_back(check::bf16(v));
    c.x.push_back(x_bf16 ? check::from_bf16(c.x16.back()) : v);
  }
  std::vector<float> w(N * K);
  for (float& v : w) v = float(g.normal()) * 0.05f;
  c.t = pack::quant(format, w, N, K);
  return c;
}

std::vector<double> run(int format, const Case& c, bool x_bf16, int64_t rows, int64_t m0, int threads) {
  std::vector<float> y32(rows * c.N);
  std::vector<uint16_t> y16(rows * c.N);
  const int status = zhuzi_quant_linear(format, x_bf16, x_bf16 ? (const void*)(c.x16.data() + m0 * c.K)
                                                             : (const void*)(c.x.data() + m0 * c.K),
                                        c.t.bytes.data(), x_bf16 ? (void*)y16.data() : y32.data(), rows, c.N, c.K,
                                        threads);
  CHECK(status == 0, "status %d", status);
  std::vector<double> y;
  for (int64_t i = 0; i < rows * c.N; ++i) y.push_back(x_bf16 ? check::from_bf16(y16[i]) : y32[i]);
  return y;
}

}  // namespace

TEST(quant_linear_matches_float64) {
  for (int format : {0, 1})
    for (auto [N, K] : {std::pair<int64_t, int64_t>{5, 32}, {37, 576}, {64, 96}})
      for (bool x_bf16 : {false, true})
        for (int64_t M : {1, 3, 5, 8, 9, 17}) {
          const Case c = make(format, M, N, K, x_bf16, 100 * M + N + format);
          const std::vector<double> y = run(format, c, x_bf16, M, 0, 2);
          std::vector<double> want(M * N), bound(M * N);
          double top = 0;
          for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) {
              double s = 0, mag = 0;
              for (int64_t k = 0; k < K; ++k)
                s += c.x[m * K + k] * c.t.w[n * K + k], mag += std::fabs(c.x[m * K + k] * c.t.w[n * K + k]);
              want[m * N + n] = s, top = std::fmax(top, std::fabs(s));
#if ZHUZI_AVX512
              bound[m * N + n] = x_bf16 ? 0 : 0x1p-9 * mag;  // float32 inputs are rounded to bf16 once
#else
              bound[m * N + n] = check::q8_bound(&c.x[m * K], &c.t.w[n * K], K);
#endif
            }
          for (int64_t i = 0; i < M * N; ++i) {
            const double b = bound[i] + 0x1p-8 * top;  // float32 sums, one output rounding to bf16
            if (!(std::fabs(y[i] - want[i]) <= b)) {
              CHECK(false, "format %d x_bf16 %d M %ld N %ld K %ld: y[%ld] = %g, want %g +- %g", format, x_bf16,
                    (long)M, (long)N, (long)K, (long)i, y[i], want[i], b);
              break;
            }
          }
        }
}

TEST(quant_rows_are_the_bits_they_get_alone) {
  for (int format : {0, 1}) {
    const Case c = make(format, 40, 203 / 32 * 32 + 11, 576, false, 9 + format);
    const std::vector<double> all = run(format, c, false, c.M, 0, 2);
    for (int64_t m : {0, 9, 39}) {
      const std::vector<double> alone = run(format, c, false, 1, m, 1);
      CHECK(std::equal(alone.begin(), alone.end(), all.begin() + m * c.N), "format %d row %ld", format, (long)m);
    }
  }
}

TEST(quant_linear_declines_a_width_not_a_multiple_of_32) {
  const Case c = make(0, 1, 16, 32, false, 1);
  float y[16];
  CHECK(zhuzi_quant_linear(0, 0, c.x.data(), c.t.bytes.data(), y, 1, 16, 31, 1) == 2, "served K = 31");
}
