// Weight-streaming linear for M <= 8 rows; see cpu_linear.py for the design.
#include "rows.h"

#include <vector>

static float input(const float* p) { return *p; }
static float input(const uint16_t* p) { return widen(*p); }
static void prepare(const float* x, float* p) { *p = *x; }
static void prepare(const uint16_t* x, float* p) { *p = widen(*x); }
static void prepare(const uint16_t* x, uint16_t* p) { *p = *x; }

template <class F, int M, typename T>
static void linear(const T* x, const typename F::W* w, const void* scale, int scale_bf16, T* y,
                   int64_t N, int64_t K, int threads) {
  constexpr int L = F::LANES, R = ROWS[M];
  const int64_t kp = (K + L - 1) / L * L;
  std::vector<typename F::X> xp(M * kp);
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) prepare(x + m * K + k, &xp[m * kp + k]);
  auto emit = [&](int64_t n, const float* dots) {
    const float s = !scale ? 1.f : scale_bf16 ? input(static_cast<const uint16_t*>(scale) + n)
                                              : input(static_cast<const float*>(scale) + n);
    for (int m = 0; m < M; ++m) store(scale ? dots[m] * s : dots[m], y + m * N + n);
  };
  const int64_t blocks = (N + R - 1) / R;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * R;
    if (n0 + R <= N) {
      float out[R][M];
      rows<F, M, R>(w + n0 * K, K, xp.data(), kp, out);
      for (int r = 0; r < R; ++r) emit(n0 + r, out[r]);
    } else {
      for (int64_t n = n0; n < N; ++n) {
        float out[1][M];
        rows<F, M, 1>(w + n * K, K, xp.data(), kp, out);
        emit(n, out[0]);
      }
    }
  }
}

template <class F, typename T>
static int dispatch(int64_t M, const void* x, const void* w, const void* scale, int scale_bf16, void* y,
                    int64_t N, int64_t K, int threads) {
  auto go = [&](auto fn) {
    fn(static_cast<const T*>(x), static_cast<const typename F::W*>(w), scale, scale_bf16, static_cast<T*>(y),
       N, K, threads);
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

// weight: 0 float32, 1 bf16 (x has the weight's dtype), 2 int8 (x float32 or bf16, scale per row).
// Returns 0 on success, 2 for a case it was not built for.
extern "C" int zhuzi_small_m_linear(int weight, int x_bf16, const void* x, const void* w, const void* scale,
                                    int scale_bf16, void* y, int64_t M, int64_t N, int64_t K, int threads) {
  switch (weight * 2 + x_bf16) {
    case 0: return dispatch<F32, float>(M, x, w, nullptr, 0, y, N, K, threads);
    case 3: return dispatch<BF16, uint16_t>(M, x, w, nullptr, 0, y, N, K, threads);
    case 4: return dispatch<I8, float>(M, x, w, scale, scale_bf16, y, N, K, threads);
    case 5: return dispatch<I8BF16, uint16_t>(M, x, w, scale, scale_bf16, y, N, K, threads);
    default: return 2;
  }
}
