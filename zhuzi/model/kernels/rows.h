// Row-major weights (float32, bf16, int8 with a scale per row) against M <= 8 input rows: the inner
// loops of the small-batch linear kernel and of the fused decode step.
#pragma once
#include "int8.h"
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

// int8 weights widened to float (the float32 models of the AVX-512 variant).
struct I8 : Plain<int8_t, float> {
  using WV = vf; using XV = vf;
  static constexpr int LANES = VL;
  static WV load_w(const W* p) {  // GCC's __builtin_convertvector does this one element at a time
#if ZHUZI_AVX512
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif ZHUZI_AVX2
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif ZHUZI_NEON
    int32_t v; std::memcpy(&v, p, 4);
    return (vf)vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(v))))));
#else
    typedef int8_t v4b __attribute__((vector_size(VL)));
    v4b v; std::memcpy(&v, p, VL);
    return __builtin_convertvector(v, vf);
#endif
  }
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

#if ZHUZI_AVX512
// int8 weights are exact in bf16 (8 significant bits), so with bf16 inputs they can use vdpbf16ps too:
// it does 32 multiply-adds where a float FMA does 16, and an int8 row streams twice as fast as bf16.
struct I8BF16 : BF16 {
  using W = int8_t;
  static WV load_w(const W* p) {
    const __m128i* q = reinterpret_cast<const __m128i*>(p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
};
#else
// int8 weights against q8 activations (q8.h): a block's 32 products in int8 dot products, then its scale
// (the row's scale is applied by the caller).
struct I8Q8 {
  using W = int8_t; using X = q8::Block; using XV = const q8::Block*;
  static constexpr int LANES = q8::BLOCK, XPER = q8::BLOCK, PARTS = q8::BLOCK / (4 * i8::LANES);
  struct WV { i8::B8 part[PARTS]; };
  template <typename T>
  static void prepare(const T* x, int64_t K, int64_t kp, X* out) { q8::quantize_row(x, K, kp, out); }
  static WV load_w(const W* p) {
    WV v;
    for (int i = 0; i < PARTS; ++i) v.part[i] = i8::load_b8(p + i * 4 * i8::LANES);
    return v;
  }
  static XV load_x(const X* p) { return p; }
  static void dot(vf& acc, const WV& w, XV x) {
    i8::I32 s = i8::zero();
    for (int i = 0; i < PARTS; ++i) s = i8::dot_s8s8(s, w.part[i], i8::load_b8(x->q + i * 4 * i8::LANES));
    acc = fmadd(i8::to_float(s), splat(x->d), acc);
  }
};
#endif

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
