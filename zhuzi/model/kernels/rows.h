// Row-major weights (float32, bf16) against M <= 8 input rows: the inner
// loops of the small-batch linear kernel and of the fused decode step.
#pragma once
#include "prelude.h"
#include "q8.h"

#include <type_traits>

// A weight format: how LANES weights meet LANES prepared inputs. Inputs are prepared once per call by
// F::prepare (a row padded to kp inputs, whole chunks of LANES: widened, reordered or quantized as the
// format reads them, XPER inputs per X element) so the inner loop only loads them.
template <typename X, typename T>
static inline X convert(T v) {
  if constexpr (std::is_same_v<X, T>) return v;
  else {
    static_assert(std::is_same_v<X, float>, "inputs are widened, never narrowed");
    return q8::value(v);
  }
}

template <typename W_, typename X_>
struct Plain {
  using W = W_; using X = X_;
  static constexpr int XPER = 1;
  template <typename T>
  static void prepare(const T* x, int64_t K, int64_t kp, X* out) {
    for (int64_t k = 0; k < K; ++k) out[k] = convert<X>(x[k]);
    for (int64_t k = K; k < kp; ++k) out[k] = {};
  }
};

struct F32 : Plain<float, float> {
  using WV = vf; using XV = vf;
  static constexpr int LANES = VL;
  static WV load_w(const W* p) { return load_vf(p); }
  static XV load_x(const X* p) { return load_vf(p); }
  static void dot(vf& acc, WV w, XV x) { acc = fmadd(w, x, acc); }
};

// bf16 pairs split into even and odd elements (a shift and a mask, no shuffle): a dot product is the sum
// of the two halves' products, so weights and inputs only need the same split.
struct Halves { vf even, odd; };
static inline Halves split(const uint16_t* p) {
  vu u; std::memcpy(&u, p, sizeof u);
  return {(vf)(u << 16), (vf)(u & 0xffff0000u)};
}

struct BF16 : Plain<uint16_t, uint16_t> {
  static constexpr int LANES = 2 * VL;
#if ZHUZI_AVX512
  using WV = __m512i; using XV = __m512i;
  static WV load_w(const W* p) { return _mm512_loadu_si512(p); }
  static XV load_x(const X* p) { return _mm512_loadu_si512(p); }
  static void dot(vf& acc, WV w, XV x) { acc = (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)w, (__m512bh)x); }
#else
  using WV = Halves; using XV = Halves;
  static WV load_w(const W* p) { return split(p); }
  static XV load_x(const X* p) { return split(p); }
  static void dot(vf& acc, WV w, XV x) { acc = fmadd(w.odd, x.odd, fmadd(w.even, x.even, acc)); }
#endif
};

// bf16 weights against float inputs (float32 math over bf16 weights): the inputs are prepared in the
// weights' even / odd split, each chunk of 2 VL as VL even elements, then VL odd ones.
struct BF16F32 {
  using W = uint16_t; using X = float; using WV = Halves; using XV = Halves;
  static constexpr int LANES = 2 * VL, XPER = 1;
  template <typename T>
  static void prepare(const T* x, int64_t K, int64_t kp, X* out) {
    for (int64_t k = 0; k < kp; ++k) {
      const int64_t c = k / LANES * LANES, i = k % LANES;
      out[c + (i % 2) * VL + i / 2] = k < K ? convert<float>(x[k]) : 0.f;
    }
  }
  static WV load_w(const W* p) { return split(p); }
  static XV load_x(const X* p) { return {load_vf(p), load_vf(p + VL)}; }
  static void dot(vf& acc, WV w, XV x) { acc = fmadd(w.odd, x.odd, fmadd(w.even, x.even, acc)); }
};

// Bytes prefetched ahead in each row's stream: the hardware prefetcher alone falls behind, the more so
// the more multiply-adds each weight byte feeds (M > 1). docs/benchmarks.md has how the distance was chosen.
constexpr int AHEAD = 8192;

// R weight rows against M input rows, prepared with row stride kp (in X elements). Every (row, input) pair has its own accumulator and the same
// sequence of operations whatever R and M are, which is what keeps results batch-invariant.
template <class F, int M, int R>
static void rows(const typename F::W* w, int64_t K, const typename F::X* x, int64_t kp, float out[R][M]) {
  constexpr int L = F::LANES;
  const int64_t full = K / L, rest = K % L;
  vf acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vf{};
  auto step = [&](const typename F::WV* wv, int64_t k) {
    for (int m = 0; m < M; ++m) {
      const typename F::XV xv = F::load_x(x + m * kp + k / F::XPER);
      for (int r = 0; r < R; ++r) F::dot(acc[r][m], wv[r], xv);
    }
  };
  typename F::WV wv[R];
  for (int64_t c = 0; c < full; ++c) {
    for (int r = 0; r < R; ++r) __builtin_prefetch(reinterpret_cast<const char*>(w + r * K + c * L) + AHEAD);
    for (int r = 0; r < R; ++r) wv[r] = F::load_w(w + r * K + c * L);
    step(wv, c * L);
  }
  if (rest) {  // the row's tail, zero-padded like the prepared inputs
    for (int r = 0; r < R; ++r) {
      typename F::W tail[L] = {};
      std::memcpy(tail, w + r * K + full * L, rest * sizeof(typename F::W));
      wv[r] = F::load_w(tail);
    }
    step(wv, full * L);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[r][m] = hsum(acc[r][m]);
}

// Weight rows per stripe (small_m_linear.cpp) for M inputs: enough independent accumulators to hide vdpbf16ps/FMA latency,
// few enough (R * M + R + 1) to stay in the vector registers (32; AVX2 has 16).
#if ZHUZI_AVX2
constexpr int ROWS[9] = {0, 6, 4, 3, 3, 2, 2, 1, 1};
#else
constexpr int ROWS[9] = {0, 8, 6, 4, 4, 3, 3, 3, 3};
#endif
