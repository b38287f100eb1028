// Per-row int8 activations around the int8 GEMM (torch._int_mm) of prefill and big decode batches:
// quantize the input rows, then scale the exact int32 products back; see cpu_linear.py.
#include "api.h"
#include "prelude.h"

#include <algorithm>
#include <cmath>

static inline float value(float x) { return x; }
static inline float value(uint16_t x) { return widen(x); }

// Asymmetric per row: the row's range [lo, hi] (widened to hold 0) maps onto -128 .. 127, x = s (q - z).
template <typename T>
static void quantize(const T* x, int8_t* q, float* s, int32_t* z, int64_t M, int64_t K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * K;
    float lo = 0.f, hi = 0.f;
#pragma omp simd reduction(min:lo) reduction(max:hi)
    for (int64_t k = 0; k < K; ++k) {
      lo = std::min(lo, value(row[k]));
      hi = std::max(hi, value(row[k]));
    }
    const float inv = hi > lo ? 255.f / (hi - lo) : 0.f;
    const float zero = std::nearbyint(-lo * inv) - 128.f;
    s[m] = (hi - lo) / 255.f;
    z[m] = int32_t(zero);
#pragma omp simd
    for (int64_t k = 0; k < K; ++k)
      q[m * K + k] = int8_t(std::clamp(std::nearbyint(value(row[k]) * inv) + zero, -128.f, 127.f));
  }
}

// y = (acc - z[m] wsum[n]) s[m] sw[n] (+ bias[n]), rounded once to y's type; wsum[n] = sum of row n's codes.
template <typename T>
static void scale(const int32_t* acc, const float* s, const int32_t* z, const int32_t* wsum, const float* sw,
                  const T* bias, T* y, int64_t M, int64_t N, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const float v = float(int64_t(acc[m * N + n]) - int64_t(z[m]) * wsum[n]) * s[m];
      store(bias ? fmadd(v, sw[n], value(bias[n])) : v * sw[n], y + m * N + n);
    }
}

extern "C" void zhuzi_quantize_rows(int bf16, const void* x, int8_t* q, float* s, int32_t* z, int64_t M, int64_t K,
                                    int threads) {
  if (bf16) quantize(static_cast<const uint16_t*>(x), q, s, z, M, K, threads);
  else quantize(static_cast<const float*>(x), q, s, z, M, K, threads);
}

extern "C" void zhuzi_scale_rows(int bf16, const int32_t* acc, const float* s, const int32_t* z, const int32_t* wsum,
                                 const float* sw, const void* bias, void* y, int64_t M, int64_t N, int threads) {
  if (bf16) scale(acc, s, z, wsum, sw, static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), M, N, threads);
  else scale(acc, s, z, wsum, sw, static_cast<const float*>(bias), static_cast<float*>(y), M, N, threads);
}
