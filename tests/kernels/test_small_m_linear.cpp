// small_m_linear.cpp against float64 products: every weight format, M = 1..8, and widths that leave
// tails of every length; fixed_order_linear gives each row the bits it gets alone.
#include "check.h"
#include "prelude.h"

namespace {

enum Weight { F32 = 0, BF16 = 1 };

struct Problem {
  int64_t M, N, K;
  std::vector<float> x, w;  // the values the kernel sees (already rounded to their storage)
  std::vector<float> x32, w32;
  std::vector<uint16_t> x16, w16;

  Problem(int64_t m, int64_t n, int64_t k, Weight weight, bool x_bf16, uint64_t seed) : M(m), N(n), K(k) {
    check::Rng g(seed);
    for (int64_t i = 0; i < M * K; ++i) {
      const float v = float(g.normal());
      x16.push_back(check::bf16(v));
      x32.push_back(v);
      x.push_back(x_bf16 ? check::from_bf16(x16.back()) : v);
    }
    for (int64_t i = 0; i < N * K; ++i) {
      const float v = float(g.normal());
      w32.push_back(v);
      w16.push_back(check::bf16(v));
      w.push_back(weight == F32 ? v : check::from_bf16(w16.back()));
    }
  }
  const void* weights(Weight weight) const { return weight == F32 ? (const void*)w32.data() : w16.data(); }
  std::vector<double> reference() const {
    std::vector<double> y(M * N);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += double(x[m * K + k]) * w[n * K + k];
        y[m * N + n] = s;
      }
    return y;
  }
  // Per output: float32 sums (and one bf16 rounding) relative to the largest output.
  std::vector<double> bounds(const std::vector<double>& y, bool x_bf16) const {
    double top = 0;
    for (double v : y) top = std::fmax(top, std::fabs(v));
    return std::vector<double>(M * N, (x_bf16 ? 0x1p-8 : 1e-5) * top);
  }
};

// (weight, bf16 inputs) pairs the entry point takes.
const int FORMATS[][2] = {{F32, 0}, {BF16, 0}, {BF16, 1}};

template <typename Call>
void each_format(int64_t m, int64_t n, int64_t k, Call call) {
  for (const auto& f : FORMATS) {
    const Weight weight = Weight(f[0]);
    const bool x_bf16 = f[1];
    Problem p(m, n, k, weight, x_bf16, 7 * m + n + k);
    call(p, weight, x_bf16);
  }
}

std::vector<double> run_small_m(const Problem& p, Weight weight, bool x_bf16, int* status) {
  std::vector<float> y32(p.M * p.N);
  std::vector<uint16_t> y16(p.M * p.N);
  *status = zhuzi_small_m_linear(weight, x_bf16, x_bf16 ? (const void*)p.x16.data() : p.x32.data(),
                                 p.weights(weight), x_bf16 ? (void*)y16.data() : y32.data(), p.M, p.N, p.K, 2);
  std::vector<double> y;
  for (int64_t i = 0; i < p.M * p.N; ++i) y.push_back(x_bf16 ? check::from_bf16(y16[i]) : y32[i]);
  return y;
}

}  // namespace

TEST(small_m_linear_matches_float64) {
  for (int64_t m = 1; m <= 8; ++m)
    for (auto [n, k] : {std::pair<int64_t, int64_t>{37, 577}, {5, 15}, {19, 1}, {40, 1000}})
      each_format(m, n, k, [&](const Problem& p, Weight weight, bool x_bf16) {
        int status;
        const std::vector<double> y = run_small_m(p, weight, x_bf16, &status);
        CHECK(status == 0, "status %d", status);
        const std::vector<double> want = p.reference(), bound = p.bounds(want, x_bf16);
        for (int64_t i = 0; i < p.M * p.N; ++i)
          if (!(std::fabs(y[i] - want[i]) <= bound[i])) {
            CHECK(false, "weight %d x_bf16 %d M %ld N %ld K %ld: y[%ld] = %g, want %g +- %g", weight, x_bf16,
                  (long)m, (long)n, (long)k, (long)i, y[i], want[i], bound[i]);
            break;
          }
      });
}

TEST(small_m_linear_declines_more_than_8_rows) {
  Problem p(9, 4, 32, F32, false, 1);
  int status;
  run_small_m(p, F32, false, &status);
  CHECK(status == 2, "status %d", status);
}

TEST(fixed_order_rows_are_the_bits_of_a_row_alone) {
  each_format(29, 23, 203, [&](const Problem& p, Weight weight, bool x_bf16) {
    const size_t out = x_bf16 ? 2 : 4;
    std::vector<char> all(p.M * p.N * out), alone(p.N * out);
    const auto x = [&](int64_t m) {
      return x_bf16 ? (const void*)(p.x16.data() + m * p.K) : (const void*)(p.x32.data() + m * p.K);
    };
    const int status = zhuzi_fixed_order_linear(weight, x_bf16, x(0), p.weights(weight), all.data(), p.M, p.N,
                                                p.K, 7, 2);
    CHECK(status == 0, "status %d", status);
    for (int64_t m : {0, 8, 28}) {
      zhuzi_small_m_linear(weight, x_bf16, x(m), p.weights(weight), alone.data(), 1, p.N, p.K, 1);
      CHECK(!std::memcmp(alone.data(), all.data() + m * p.N * out, p.N * out), "row %ld, weight %d x_bf16 %d",
            (long)m, weight, x_bf16);
    }
  });
}
