// The KV pool's row formats: float32, bf16 and q8_0 (zhuzi/model/kv_format.py stores the same bytes from
// torch). A q8_0 head is its head_dim int8 values, then one fp16 scale per 32 of them (llama.cpp's q8_0
// blocks with the scales gathered after the values, so the values of a head are one contiguous load):
// value = q * scale, scale = max |x| / 127 of its block.
#pragma once
#include "prelude.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

// A head's width in pool elements (q8_0: bytes, values and scales).
template <typename TKV>
constexpr int64_t head_width(int64_t D) {
  if constexpr (std::is_same_v<TKV, uint8_t>) return D + D / 16;
  else return D;
}

static inline float value(float x) { return x; }
static inline float value(uint16_t x) { return widen(x); }

// Vector j of a q8_0 head of D values (D a multiple of 32), widened to float.
static inline vf q8_vector(const uint8_t* p, int D, int j) {
  typedef int8_t vb __attribute__((vector_size(VL)));
  vb b; std::memcpy(&b, p + j * VL, VL);
  uint16_t h; std::memcpy(&h, p + D + 2 * (j * VL / 32), 2);
  return __builtin_convertvector(b, vf) * splat(half_to_float(h));
}
static inline void load_row(const uint8_t* p, vf* out, int nv) {
  for (int j = 0; j < nv; ++j) out[j] = q8_vector(p, nv * VL, j);
}

// A head's D values widened to float, in order.
static inline void widen_row(const float* p, float* out, int D) { std::memcpy(out, p, D * 4); }
static inline void widen_row(const uint16_t* p, float* out, int D) {
  for (int d = 0; d < D; ++d) out[d] = widen(p[d]);
}
static inline void widen_row(const uint8_t* p, float* out, int D) {
  for (int j = 0; j < D / VL; ++j) store_vf(q8_vector(p, D, j), out + j * VL);
}

static inline uint16_t float_to_half(float x) {  // round to nearest even
#if ZHUZI_NEON
  __fp16 v = __fp16(x); uint16_t h; std::memcpy(&h, &v, 2); return h;
#elif ZHUZI_GENERIC
  // The float's mantissa rounded where a half's ends, by adding a power of two that leaves just the
  // half's bits below it (Maratyszcza's FP16 library): the addition rounds ties to even, subnormals
  // and overflow to infinity included. A NaN stays a NaN.
  const uint32_t w = to_bits(x), twice = w + w, sign = (w & 0x80000000u) >> 16;
  const uint32_t bias = std::max(twice & 0xff000000u, 0x71000000u);
  const float rounded = from_bits((bias >> 1) + 0x07800000u) + std::fabs(x) * 0x1p112f * 0x1p-110f;
  const uint32_t r = to_bits(rounded);
  return uint16_t(sign | (twice > 0xff000000u ? 0x7e00u : ((r >> 13) & 0x7c00u) + (r & 0x0fffu)));
#else
  return _cvtss_sh(x, 0);
#endif
}

// D float values into a q8_0 head: the same bytes as kv_format.quantize_q8_0 (ties to even, the scale's
// reciprocal in float32 before the scale is rounded to fp16).
static inline void quantize_row(const float* x, uint8_t* p, int64_t D) {
  for (int64_t b = 0; b < D / 32; ++b) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[b * 32 + i]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    for (int i = 0; i < 32; ++i) p[b * 32 + i] = uint8_t(int8_t(std::nearbyint(x[b * 32 + i] * inv)));
    const uint16_t h = float_to_half(d);
    std::memcpy(p + D + 2 * b, &h, 2);
  }
}
static inline void quantize_row(const float* x, uint16_t* p, int64_t D) {
  for (int64_t d = 0; d < D; ++d) store(x[d], p + d);
}
