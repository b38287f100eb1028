// Row-major weights (float32, bf16, int8 with a scale per row) against M <= 8 input rows: the inner
// loops of the small-batch linear kernel and of the fused decode step.
#pragma once
#include "prelude.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// A weight format: how LANES weights meet LANES prepared inputs. Inputs are prepared once per call
// (padded to whole chunks, widened to float for float weights) so the inner loop only loads them.
struct F32 {
  using W = float; using X = float; using WV = vf; using XV = vf;
  static constexpr int LANES = 16;
  static WV load_w(const W* p) { vf v; std::memcpy(&v, p, 64); return v; }
  static XV load_x(const X* p) { vf v; std::memcpy(&v, p, 64); return v; }
  static void dot(vf& acc, WV w, XV x) { acc += w * x; }
};

struct I8 {
  using W = int8_t; using X = float; using WV = vf; using XV = vf;
  static constexpr int LANES = 16;
  static WV load_w(const W* p) {
#if defined(__AVX512F__)  // GCC's __builtin_convertvector does this one element at a time
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    float f[16];
    for (int i = 0; i < 16; ++i) f[i] = p[i];
    return load_x(f);
#endif
  }
  static XV load_x(const X* p) { vf v; std::memcpy(&v, p, 64); return v; }
  static void dot(vf& acc, WV w, XV x) { acc += w * x; }
};

struct BF16 {
  using W = uint16_t; using X = uint16_t;
  static constexpr int LANES = 32;
#if defined(__AVX512BF16__)
  using WV = __m512i; using XV = __m512i;
  static WV load_w(const W* p) { return _mm512_loadu_si512(p); }
  static XV load_x(const X* p) { return _mm512_loadu_si512(p); }
  static void dot(vf& acc, WV w, XV x) { acc = (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)w, (__m512bh)x); }
#else
  // Even and odd elements of both operands, widened by a shift and a mask (their dot product is the
  // sum of the two halves' products, so no shuffle is needed).
  struct WV { vf even, odd; };
  using XV = WV;
  static WV load_w(const W* p) { vu u; std::memcpy(&u, p, 64); return {(vf)(u << 16), (vf)(u & 0xffff0000u)}; }
  static XV load_x(const X* p) { return load_w(p); }
  static void dot(vf& acc, WV w, XV x) { acc += w.even * x.even; acc += w.odd * x.odd; }
#endif
};

#if defined(__AVX512BF16__)
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
using I8BF16 = I8;
#endif

// Bytes prefetched ahead in each row's stream: the hardware prefetcher alone falls behind, the more so
// the more multiply-adds each weight byte feeds (M > 1). docs/benchmarks.md has how the distance was chosen.
constexpr int AHEAD = 8192;

// R weight rows against M input rows. Every (row, input) pair has its own accumulator and the same
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
      const typename F::XV xv = F::load_x(x + m * kp + k);
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

// Weight rows per block for M inputs: enough independent accumulators to hide vdpbf16ps/FMA latency,
// few enough (R * M + R + 1) to stay in the 32 vector registers.
constexpr int ROWS[9] = {0, 8, 6, 4, 4, 3, 3, 3, 3};
