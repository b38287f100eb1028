// Weight-streaming linear for M <= 8 rows; see cpu_linear.py for the design.
#include "api.h"
#include "rows.h"

#include <algorithm>
#include <vector>

// Inputs a row of K takes in F's prepared form (whole chunks of LANES).
template <class F>
static int64_t stride(int64_t K) { return (K + F::LANES - 1) / F::LANES * F::LANES / F::XPER; }

// Weight rows n0..n1 (a stripe of R, or the matrix's last few one by one) against M prepared input rows.
template <class F, int M, int R, typename T>
static void stripe(const typename F::W* w, int64_t n0, int64_t n1, int64_t K, const typename F::X* xp, int64_t kp,
                   T* y, int64_t N) {
  auto emit = [&](int64_t n, const float* dots) {
    for (int m = 0; m < M; ++m) store(dots[m], y + m * N + n);
  };
  if (n1 - n0 == R) {
    float out[R][M];
    rows<F, M, R>(w + n0 * K, K, xp, kp, out);
    for (int r = 0; r < R; ++r) emit(n0 + r, out[r]);
  } else {
    for (int64_t n = n0; n < n1; ++n) {
      float out[1][M];
      rows<F, M, 1>(w + n * K, K, xp, kp, out);
      emit(n, out[0]);
    }
  }
}

// The inputs in F's prepared form (rows of kp X elements), so the inner loop only loads them.
template <class F, typename T>
static std::vector<typename F::X> prepared(const T* x, int64_t M, int64_t K, int64_t kp, int threads) {
  std::vector<typename F::X> xp(M * kp);
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 8)
  for (int64_t m = 0; m < M; ++m) F::prepare(x + m * K, K, kp * F::XPER, &xp[m * kp]);
  return xp;
}

template <class F, int M, typename T>
static void linear(const T* x, const typename F::W* w, T* y, int64_t N, int64_t K, int threads) {
  constexpr int R = ROWS[M];
  const int64_t kp = stride<F>(K);
  const std::vector<typename F::X> xp = prepared<F>(x, M, K, kp, threads);
  const int64_t stripes = (N + R - 1) / R;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < stripes; ++b)
    stripe<F, M, R>(w, b * R, std::min(N, b * R + R), K, xp.data(), kp, y, N);
}

template <class F, typename T>
static int dispatch(int64_t M, const void* x, const void* w, void* y, int64_t N, int64_t K, int threads) {
  auto go = [&](auto fn) {
    fn(static_cast<const T*>(x), static_cast<const typename F::W*>(w), static_cast<T*>(y), N, K, threads);
    return 0;
  };
  switch (M) {
    case 1: return go(linear<F, 1, T>);
    case 2: return go(linear<F, 2, T>);
    case 3: return go(linear<F, 3, T>);
    case 4: return go(linear<F, 4, T>);
    case 5: return go(linear<F, 5, T>);
    case 6: return go(linear<F, 6, T>);
    case 7: return go(linear<F, 7, T>);
    case 8: return go(linear<F, 8, T>);
    default: return 2;
  }
}

// --deterministic: any number of rows, each output value computed by the very operations the M <= 8 path
// uses (rows<> gives every (row, input) pair its own accumulator and sequence), so a token gets the same
// bits in a decode of one row, a batch of 30 or a prefill chunk of 512. Inputs go in sets of up to 8
// rows; a set meets a band of weight stripes (~24 KiB) while both sit in L1, and the MB input rows of
// one pass over the weights stay in L2.
template <class F, typename T>
static void fixed_order(const T* x, const typename F::W* w, T* y, int64_t M, int64_t N, int64_t K, int64_t MB,
                        int threads) {
  constexpr int R = ROWS[8];  // one stripe height for every set size: R does not change any output's bits
  const int64_t kp = stride<F>(K);
  const std::vector<typename F::X> xp = prepared<F>(x, M, K, kp, threads);
  const int64_t stripes = (N + R - 1) / R;
  const int64_t band = std::max<int64_t>(1, (24 << 10) / (int64_t(R) * K * int64_t(sizeof(typename F::W))));
  const int64_t bands = (stripes + band - 1) / band;
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t m1 = std::min(M, m0 + MB);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < bands; ++i)
      for (int64_t m = m0; m < m1; m += 8) {
        const typename F::X* xt = xp.data() + m * kp;
        T* yt = y + m * N;
        for (int64_t b = i * band; b < std::min(stripes, (i + 1) * band); ++b) {
          const int64_t n0 = b * R, n1 = std::min(N, n0 + R);
          switch (std::min<int64_t>(8, m1 - m)) {
            case 1: stripe<F, 1, R>(w, n0, n1, K, xt, kp, yt, N); break;
            case 2: stripe<F, 2, R>(w, n0, n1, K, xt, kp, yt, N); break;
            case 3: stripe<F, 3, R>(w, n0, n1, K, xt, kp, yt, N); break;
            case 4: stripe<F, 4, R>(w, n0, n1, K, xt, kp, yt, N); break;
            case 5: stripe<F, 5, R>(w, n0, n1, K, xt, kp, yt, N); break;
            case 6: stripe<F, 6, R>(w, n0, n1, K, xt, kp, yt, N); break;
            case 7: stripe<F, 7, R>(w, n0, n1, K, xt, kp, yt, N); break;
            default: stripe<F, 8, R>(w, n0, n1, K, xt, kp, yt, N); break;
          }
        }
      }
  }
}

// weight: 0 float32, 1 bf16; x float32 or bf16 (bf16 weights with either, float32 weights with float32).
// Returns 0 on success, 2 for a case it was not built for.
extern "C" int zhuzi_small_m_linear(int weight, int x_bf16, const void* x, const void* w, void* y, int64_t M,
                                    int64_t N, int64_t K, int threads) {
  switch (weight * 2 + x_bf16) {
    case 0: return dispatch<F32, float>(M, x, w, y, N, K, threads);
    case 2: return dispatch<BF16F32, float>(M, x, w, y, N, K, threads);
    case 3: return dispatch<BF16, uint16_t>(M, x, w, y, N, K, threads);
    default: return 2;
  }
}

// The same formats as zhuzi_small_m_linear, for any M >= 1 (see fixed_order); MB input rows per pass.
extern "C" int zhuzi_fixed_order_linear(int weight, int x_bf16, const void* x, const void* w, void* y, int64_t M,
                                        int64_t N, int64_t K, int64_t MB, int threads) {
  switch (weight * 2 + x_bf16) {
    case 0: fixed_order<F32>((const float*)x, (const float*)w, (float*)y, M, N, K, MB, threads); return 0;
    case 2: fixed_order<BF16F32>((const float*)x, (const uint16_t*)w, (float*)y, M, N, K, MB, threads); return 0;
    case 3: fixed_order<BF16>((const uint16_t*)x, (const uint16_t*)w, (uint16_t*)y, M, N, K, MB, threads); return 0;
    default: return 2;
  }
}
