// block_decode.h for AVX-512: a vector holds two 32-input units; the int32 dot lanes of 16 rows become their
// 16-input sums, a vector over the rows per 128-bit block.
#pragma once

namespace block_decode {

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

static inline __m512i shift512(__m512i v, int s) { return s >= 0 ? _mm512_slli_epi16(v, s) : _mm512_srli_epi16(v, -s); }
static inline __m512i twice(const uint8_t* p) {  // 32 bytes in both halves
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The codes of inputs [128h, 128h + 128) of a Q6_K block p, units 4h and 4h + 1 in c[0], 4h + 2 and 4h + 3 in
// c[1]: the low, then the high nibbles of ql[64h ..+ 64], with their top bits from qh[32h ..+ 32], both vectors
// from one load of each.
static inline void four_q6k(const uint8_t* p, int h, __m512i* c) {
  constexpr __mmask32 HIGH = 0xffff0000u;
  const auto* b = reinterpret_cast<const blocks::BQ6_K*>(p);
  const __m512i low4 = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  const __m512i ql = _mm512_loadu_si512(b->ql + 64 * h), qh = twice(b->qh + 32 * h), up2 = _mm512_slli_epi16(qh, 2);
  const __m512i hi01 = _mm512_mask_slli_epi16(up2, ~HIGH, up2, 2), hi23 = _mm512_mask_srli_epi16(qh, HIGH, qh, 2);
  c[0] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(hi01, top));
  c[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_and_si512(hi23, top));
}

// The codes of inputs [32u, 32u + 64) of a K-quant block p (u even): both units come from the same bytes
// (32 of qs, or 64 of Q6_K's ql), read once into a vector and shifted per half, as block_decode.h's unit() does
// for each.
template <class F>
static inline __m512i pair(const uint8_t* p, int u) {
  using namespace blocks;
  constexpr __mmask32 HIGH = 0xffff0000u;  // the upper half's 16-bit words
  const __m512i low4 = _mm512_set1_epi8(15);
  if constexpr (std::is_same_v<F, Format<Q6_K>>) {
    __m512i c[2];
    four_q6k(p, u / 4, c);
    return u % 4 ? c[1] : c[0];
  } else if constexpr (std::is_same_v<F, Format<Q3_K>> || std::is_same_v<F, Format<Q2_K>>) {
    // 2-bit codes u and u + 1 of qs[32 (u / 4) ..+ 32]; Q3_K's third bits u and u + 1 of hmask[l], moved to bit 2
    constexpr bool Q3K = std::is_same_v<F, Format<Q3_K>>;
    const __m512i v = twice(p + (Q3K ? 32 : 16) + 32 * (u / 4)), up = _mm512_mask_srli_epi16(v, HIGH, v, 2);
    const __m512i q = _mm512_and_si512(_mm512_srli_epi16(up, 2 * (u % 4)), _mm512_set1_epi8(3));
    if constexpr (Q3K) {
      const __m512i hm = twice(p);
      const __m512i at2 = _mm512_mask_slli_epi16(shift512(hm, 2 - u), HIGH, shift512(hm, 1 - u), 0);
      return _mm512_or_si512(q, _mm512_and_si512(at2, _mm512_set1_epi8(4)));
    }
    return q;
  } else {  // Q4_K, Q5_K: the low, then the high nibbles of qs[32 (u / 2) ..+ 32]
    const uint8_t* qs = p + F::BYTES - 128;
    const __m512i v = twice(qs + 32 * (u / 2)), q = _mm512_and_si512(_mm512_mask_srli_epi16(v, HIGH, v, 4), low4);
    if constexpr (std::is_same_v<F, Format<Q5_K>>) {  // fifth bits u and u + 1 of qh[l], moved to bit 4
      const __m512i qh = twice(qs - 32);
      const __m512i at4 = _mm512_mask_slli_epi16(shift512(qh, 4 - u), HIGH, shift512(qh, 3 - u), 0);
      return _mm512_or_si512(q, _mm512_and_si512(at4, _mm512_set1_epi8(16)));
    }
    return q;
  }
}

// Words k < 4 of the 16 bytes at row[r] + at, for the 16 rows: w[k][r]. Four rows a vector, one per 128-bit
// block (row 4i + j in block i of vector j), then a 4 x 4 transpose of words within each block; in place of
// four gathers, which Zen 4 runs as 16 loads each.
static inline void words16(const uint8_t* const* row, int64_t at, vu* w) {
  auto load = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[r] + at)); };
  __m512i x[4];
  for (int j = 0; j < 4; ++j) {
    x[j] = _mm512_castsi128_si512(load(j));
    for (int i = 1; i < 4; ++i) x[j] = _mm512_inserti32x4(x[j], load(4 * i + j), i);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(x[0], x[1]), t1 = _mm512_unpackhi_epi32(x[0], x[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(x[2], x[3]), t3 = _mm512_unpackhi_epi32(x[2], x[3]);
  w[0] = (vu)_mm512_unpacklo_epi64(t0, t2), w[1] = (vu)_mm512_unpackhi_epi64(t0, t2);
  w[2] = (vu)_mm512_unpacklo_epi64(t1, t3), w[3] = (vu)_mm512_unpackhi_epi64(t1, t3);
}

// Row r's 32-bit word at p + off[r], for the 16 rows of a vector.
static inline vi gather(const uint8_t* p, vi off) { return (vi)_mm512_i32gather_epi32((__m512i)off, p, 1); }

// The IEEE halves in the low 16 bits of each lane, as floats.
static inline vf halves(vu w) { return (vf)_mm512_cvtph_ps(_mm512_cvtepi32_epi16((__m512i)w)); }

}  // namespace block_decode
