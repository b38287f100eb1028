// block_rows.h for AVX-512: a vector holds two 32-input units; the int32 dot lanes of 16 rows become their
// 16-input sums, a vector over the rows per 128-bit block.
#pragma once

namespace block_rows {

constexpr int UNITS = 2;  // 32-input units a vector

static inline __m512i join(const __m256i* u) { return _mm512_inserti64x4(_mm512_castsi256_si512(u[0]), u[1], 1); }

// Four rows' lanes -> per 128-bit block, the 4 rows' sums of its 4 lanes.
static inline __m512i quad(const __m512i* d) {
  const __m512i e0 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
  const __m512i e1 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(e0, e1), _mm512_unpackhi_epi64(e0, e1));
}

// f[q]: quad() of rows 4q .. 4q + 3 -> out[k][0]: block k's sums over the 16 rows (a 4 x 4 block transpose).
static inline void transpose(const __m512i* f, __m512i (*out)[1]) {
  const __m512i g0 = _mm512_shuffle_i32x4(f[0], f[1], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i h0 = _mm512_shuffle_i32x4(f[0], f[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i g1 = _mm512_shuffle_i32x4(f[2], f[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i h1 = _mm512_shuffle_i32x4(f[2], f[3], _MM_SHUFFLE(3, 2, 3, 2));
  out[0][0] = _mm512_shuffle_i32x4(g0, g1, _MM_SHUFFLE(2, 0, 2, 0));
  out[1][0] = _mm512_shuffle_i32x4(g0, g1, _MM_SHUFFLE(3, 1, 3, 1));
  out[2][0] = _mm512_shuffle_i32x4(h0, h1, _MM_SHUFFLE(2, 0, 2, 0));
  out[3][0] = _mm512_shuffle_i32x4(h0, h1, _MM_SHUFFLE(3, 1, 3, 1));
}

// Byte i: 16 where bit i of the 32 bits at qh is set (Q5's fifth bits).
static inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  return _mm256_maskz_mov_epi8(h, _mm256_set1_epi8(16));
}

// Row r's 32-bit word at p + off[r], for the 16 rows of a vector.
static inline vi gather(const uint8_t* p, vi off) { return (vi)_mm512_i32gather_epi32((__m512i)off, p, 1); }

// The IEEE halves in the low 16 bits of each lane, as floats.
static inline vf halves(vu w) { return (vf)_mm512_cvtph_ps(_mm512_cvtepi32_epi16((__m512i)w)); }

}  // namespace block_rows
