// quant_packed.h for AVX-512 BF16 + VBMI: the codes become bf16 in registers and meet bf16 inputs as they are
// (no input quantization) through vdpbf16ps, which accumulates pairs of products in float32. A Q4 group's dot
// product uses the codes centred, w = (q - 8) d + (m + 8 d): d * sum (q - 8) x + (m + 8 d) * sum x, and
// q - 8 is exact in bf16.
#pragma once
#include <vector>

namespace quant_packed {

constexpr int PASS = 8;      // input rows per pass over a row group (accumulators + codes fit the registers)
constexpr int AHEAD = 4096;  // bytes prefetched ahead in a row group's stream

// A group's 16 code vectors: c[p] holds, in lane r, row r's weights for inputs 2p and 2p + 1 (bf16).
struct Codes {
  __m512i c[16];
  __m512 d, shift;  // scale, and the constant term's factor (m + 8 d for Q4)
};

alignas(64) static const uint8_t PAIRS_FIRST[64] = {
    0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29, 32, 33, 36, 37, 40, 41, 44, 45, 48, 49, 52, 53,
    56, 57, 60, 61, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31, 34, 35, 38, 39, 42, 43, 46, 47,
    50, 51, 54, 55, 58, 59, 62, 63};

static inline void load_q4(const uint8_t* w, Codes& g) {
  // Regroup each chunk so that, widened to 16 bits, a lane pair holds one row's two consecutive inputs:
  // bytes 4r, 4r + 1 first (inputs 0, 1 low nibble; 4, 5 high), then 4r + 2, 4r + 3 (2, 3; 6, 7).
  // bf16 of (j & 15) - 8: vpermw reads 5 index bits, and bit 4 (the next nibble's low bit) must not matter.
  alignas(64) static const uint16_t table[32] = {
      0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080,
      0x40a0, 0x40c0, 0x40e0, 0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80, 0x0000, 0x3f80,
      0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0};
  const __m512i perm = _mm512_load_si512(PAIRS_FIRST), lut = _mm512_load_si512(table);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(w + 64 * j));
    const __m512i a = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v));
    const __m512i b = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1));
    g.c[4 * j] = _mm512_permutexvar_epi16(a, lut);                            // inputs 8j + 0, 1
    g.c[4 * j + 1] = _mm512_permutexvar_epi16(b, lut);                        // 8j + 2, 3
    g.c[4 * j + 2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(a, 4), lut);  // 8j + 4, 5
    g.c[4 * j + 3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut);  // 8j + 6, 7
  }
  const __m512i dm = _mm512_loadu_si512(w + 256);
  g.d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
  g.shift = _mm512_fmadd_ps(g.d, _mm512_set1_ps(8.f), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1)));
}

// Bytes 4r, 4r + 1 of each row first, then 4r + 2, 4r + 3: a Q4 chunk's nibble pairs, a Q8 quad's two pairs.
static inline void load_q8(const uint8_t* w, Codes& g) {
  const __m512i perm = _mm512_load_si512(PAIRS_FIRST);
  auto pair = [](__m128i lo, __m128i hi) {  // int8 codes are exact in bf16
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
  };
  for (int j = 0; j < 8; ++j) {  // quad j: inputs 4j .. 4j + 3 -> the pairs (4j, 4j + 1), (4j + 2, 4j + 3)
    const __m512i v = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(w + 64 * j));
    g.c[2 * j] = pair(_mm512_castsi512_si128(v), _mm512_extracti32x4_epi32(v, 1));
    g.c[2 * j + 1] = pair(_mm512_extracti32x4_epi32(v, 2), _mm512_extracti32x4_epi32(v, 3));
  }
  g.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 512)));
}

// dot[m] += this group's products for M input rows; x: row m's bf16 pairs for the group at x + m * ldx,
// sums: row m's sum of the group's inputs at sums[m * ldsum] (Q4 only).
template <int F, int M>
static inline void apply(const Codes& g, const uint16_t* x, int64_t ldx, const float* sums, int64_t ldsum,
                         __m512 dot[M]) {
  for (int m = 0; m < M; ++m) {
    const int32_t* pairs = reinterpret_cast<const int32_t*>(x + m * ldx);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // two chains hide the latency at M = 1
    for (int p = 0; p < 16; ++p) acc[p & 1] = dot_bf16_pair(acc[p & 1], g.c[p], pairs + p);
    dot[m] = _mm512_fmadd_ps(_mm512_add_ps(acc[0], acc[1]), g.d, dot[m]);
    if constexpr (F == Q4) dot[m] = _mm512_fmadd_ps(g.shift, _mm512_set1_ps(sums[m * ldsum]), dot[m]);
  }
}

// One row group (16 output rows) against M <= PASS input rows: out[m] holds the 16 results of row m.
// x: bf16 rows of K = groups * 32 inputs, row m at x + m * ldx; sums: [M, groups] group sums (Q4).
template <int F, int M>
static void row_group(const uint8_t* w, int64_t groups, const uint16_t* x, int64_t ldx, const float* sums,
                      __m512 out[M]) {
  constexpr int BYTES = F == Q4 ? Q4_BYTES : Q8_BYTES;
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  Codes g;
  for (int64_t k = 0; k < groups; ++k, w += BYTES) {
    for (int i = 0; i < BYTES; i += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + AHEAD + i, _MM_HINT_T0);
    if constexpr (F == Q4) load_q4(w, g);
    else load_q8(w, g);
    apply<F, M>(g, x + k * GROUP, ldx, sums + k, groups, out);
  }
}

// Each group's sum of a bf16 row's inputs, in a fixed order (the Q4 constant term meets these).
static inline void group_sums(const uint16_t* x, int64_t groups, float* sums) {
  for (int64_t k = 0; k < groups; ++k) {
    const __m512i v = _mm512_loadu_si512(x + k * GROUP);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
    sums[k] = hsum((vf)_mm512_add_ps(lo, hi));
  }
}

// Input rows as the units take them: bf16 (used in place, or float rounded once) and each group's sum.
struct Input {
  std::vector<uint16_t> own;
  std::vector<float> sums;
  const uint16_t* x = nullptr;
  int64_t ld = 0, groups = 0;

  void set(const uint16_t* rows, int64_t M, int64_t K, int64_t ldx, int threads = 1) {
    x = rows, ld = ldx, groups = K / GROUP;
    sums.resize(M * groups);
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 8)
    for (int64_t m = 0; m < M; ++m) group_sums(x + m * ld, groups, sums.data() + m * groups);
  }
  void set(const float* rows, int64_t M, int64_t K, int64_t ldx, int threads = 1) {
    own.resize(M * K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) store(rows[m * ldx + k], &own[m * K + k]);
    set(own.data(), M, K, K, threads);
  }
};

// One row group (16 rows) against input rows m0 .. m0 + M - 1 (M <= PASS): out[m][r].
template <int F, int M>
static void row_group(const uint8_t* w, int64_t groups, const Input& in, int64_t m0, float out[M][LANES]) {
  __m512 v[M];
  row_group<F, M>(w, groups, in.x + m0 * in.ld, in.ld, F == Q4 ? in.sums.data() + m0 * in.groups : nullptr, v);
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out[m], v[m]);
}

}  // namespace quant_packed
