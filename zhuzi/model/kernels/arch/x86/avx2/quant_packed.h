// quant_packed.h for x86-64-v3: q8 activations (q8.h) meet the codes in int8 dot products, maddubs + madd
// (AVX-VNNI: vpdpbusd). A row group's 16 rows are two halves of 8, one row per 32-bit lane; a group's four
// input bytes at a time are broadcast to every lane. Per group and row, the int32 dot product becomes
// float once: Q4 adds d dx sum(q qx) + m dx sum(qx), Q8 d dx sum(q qx).
#pragma once
#include "int8.h"
#include "q8.h"

#include <vector>

namespace quant_packed {

constexpr int PASS = 4;      // input rows per pass: 8 code vectors + 4 accumulators fit the 16 registers
constexpr int AHEAD = 4096;  // bytes prefetched ahead in a row group's stream


static inline __m256i broadcast4(const int8_t* p) {  // a load, not a trip through a general register
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// sum over a group of 4-bit codes times q8 inputs, per lane: c[2j], c[2j + 1] hold the low and high nibbles of
// chunk j (inputs 8j .. 8j + 3 and 8j + 4 .. 8j + 7).
static inline __m256i q4_dot(const __m256i c[8], const int8_t* x) {
#if ZHUZI_AVXVNNI
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    a = _mm256_dpbusd_avx_epi32(a, c[2 * j], broadcast4(x + 8 * j));
    b = _mm256_dpbusd_avx_epi32(b, c[2 * j + 1], broadcast4(x + 8 * j + 4));
  }
  return _mm256_add_epi32(a, b);
#else
  // Each 16-bit pair sum is at most 2 x 15 x 127, so all 8 add up in 16 bits (30480 < 2^15) before madd.
  __m256i p[8];
  for (int j = 0; j < 4; ++j) {
    p[2 * j] = _mm256_maddubs_epi16(c[2 * j], broadcast4(x + 8 * j));
    p[2 * j + 1] = _mm256_maddubs_epi16(c[2 * j + 1], broadcast4(x + 8 * j + 4));
  }
  const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                     _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
  return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

// The same for 8-bit codes: a[j] = |quad j's codes|, w + 64 j their signed bytes (the sign moves to x).
static inline __m256i q8_dot(const __m256i a[8], const uint8_t* w, const int8_t* x) {
  __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int j = 0; j < 8; ++j) {
    const __m256i s = _mm256_sign_epi8(broadcast4(x + 4 * j), _mm256_loadu_si256((const __m256i*)(w + 64 * j)));
    acc[j & 1] = i8::dot_u8s8(acc[j & 1], a[j], s);
  }
  return _mm256_add_epi32(acc[0], acc[1]);
}

static inline __m256 halves(const uint8_t* p) {  // 8 fp16 values
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A half (8 rows) at a time over the whole row group, so its M accumulators and 8 code vectors stay in the
// 16 registers; the second half reads the row group's bytes from L1, where the first half brought them.
template <int F, int M>
static void row_group(const uint8_t* w, int64_t groups, const Input& in, int64_t m0, float out[M][LANES]) {
  constexpr int BYTES = F == Q4 ? Q4_BYTES : Q8_BYTES;
  const q8::Block* x[M];
  const float* dsum[M];
  for (int m = 0; m < M; ++m) x[m] = in.rows.row(m0 + m), dsum[m] = in.dsum_row(m0 + m);
  for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7: bytes 32h .. 32h + 31 of every 64
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    const uint8_t* t = w;
    for (int64_t g = 0; g < groups; ++g, t += BYTES) {
      if (h == 0)
        for (int i = 0; i < BYTES; i += 64) _mm_prefetch(reinterpret_cast<const char*>(t) + AHEAD + i, _MM_HINT_T0);
      __m256i c[8];
      if constexpr (F == Q4) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * j + 32 * h));
          c[2 * j] = _mm256_and_si256(v, low);
          c[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
      } else {
        for (int j = 0; j < 8; ++j)
          c[j] = _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * j + 32 * h)));
      }
      const __m256 d = halves(t + (F == Q4 ? 256 : 512) + 16 * h);
      for (int m = 0; m < M; ++m) {
        const q8::Block& b = x[m][g];
        const __m256i dot = F == Q4 ? q4_dot(c, b.q) : q8_dot(c, t + 32 * h, b.q);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_broadcast_ss(&b.d)), acc[m]);
        if constexpr (F == Q4)
          acc[m] = _mm256_fmadd_ps(halves(t + 288 + 16 * h), _mm256_broadcast_ss(dsum[m] + g), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(out[m] + 8 * h, acc[m]);
  }
}

}  // namespace quant_packed
