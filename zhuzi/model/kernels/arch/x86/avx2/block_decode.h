// block_decode.h for x86-64-v3: a vector holds one 32-input unit; the int32 dot lanes of 16 rows become their
// 16-input sums, two vectors of 8 rows per 128-bit half.
#pragma once

namespace block_decode {

constexpr int UNITS = 1;  // 32-input units a vector

static inline __m256i join(const __m256i* u) { return u[0]; }

// Four rows' lanes -> per 128-bit half, the 4 rows' sums of its 4 lanes.
static inline __m256i quad(const __m256i* d) {
  const __m256i e0 = _mm256_add_epi32(_mm256_unpacklo_epi32(d[0], d[1]), _mm256_unpackhi_epi32(d[0], d[1]));
  const __m256i e1 = _mm256_add_epi32(_mm256_unpacklo_epi32(d[2], d[3]), _mm256_unpackhi_epi32(d[2], d[3]));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(e0, e1), _mm256_unpackhi_epi64(e0, e1));
}

// f[q]: quad() of rows 4q .. 4q + 3 -> out[k][v]: half k's sums over rows 8v .. 8v + 7.
static inline void transpose(const __m256i* f, __m256i (*out)[2]) {
  for (int v = 0; v < 2; ++v) {
    out[0][v] = _mm256_permute2x128_si256(f[2 * v], f[2 * v + 1], 0x20);
    out[1][v] = _mm256_permute2x128_si256(f[2 * v], f[2 * v + 1], 0x31);
  }
}

// Byte i: 16 where bit i of the 32 bits at qh is set (Q5's fifth bits): byte i takes the byte of qh holding
// bit i, sets every other bit, and compares with all ones.
static inline __m256i fifth_bits(const uint8_t* qh) {
  int32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i pick = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(h), pick),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi8(-1)), _mm256_set1_epi8(16));
}

// Words k < 4 of the 16 bytes at row[r] + at, for 8 rows: w[k][r]. Four rows a vector, one per 128-bit
// half (row 4i + j in half i of vector j), then a 4 x 4 transpose of words within each half; in place of
// four gathers.
static inline void words16(const uint8_t* const* row, int64_t at, vu* w) {
  auto load = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[r] + at)); };
  __m256i x[4];
  for (int j = 0; j < 4; ++j) x[j] = _mm256_set_m128i(load(4 + j), load(j));
  const __m256i t0 = _mm256_unpacklo_epi32(x[0], x[1]), t1 = _mm256_unpackhi_epi32(x[0], x[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(x[2], x[3]), t3 = _mm256_unpackhi_epi32(x[2], x[3]);
  w[0] = (vu)_mm256_unpacklo_epi64(t0, t2), w[1] = (vu)_mm256_unpackhi_epi64(t0, t2);
  w[2] = (vu)_mm256_unpacklo_epi64(t1, t3), w[3] = (vu)_mm256_unpackhi_epi64(t1, t3);
}

// Row r's 32-bit word at p + off[r], for the 8 rows of a vector.
static inline vi gather(const uint8_t* p, vi off) {
  return (vi)_mm256_i32gather_epi32(reinterpret_cast<const int*>(p), (__m256i)off, 1);
}

// The IEEE halves in the low 16 bits of each lane, as floats: each 128-bit half's four halves packed into
// its low 8 bytes, those two quarters joined.
static inline vf halves(vu w) {
  const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8((__m256i)w, pick), 0x08);
  return (vf)_mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

}  // namespace block_decode
