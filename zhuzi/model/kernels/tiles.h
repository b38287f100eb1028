// Tiled 4-bit and 8-bit weights (the GGUF's Q4_1 and Q8_0 blocks, repacked at load by quant.py) against
// bf16 input rows: the inner loops of the tiled linear kernel and of the fused decode step.
//
// A tile is 16 output rows x 32 inputs. The 16 rows are interleaved one per 32-bit lane, so a group's
// scales apply as whole vectors and no horizontal sums are needed; a block of 16 rows stores its K/32
// tiles one after another, so it is read as one sequential stream.
//
// Q4 tile (Q4_1), 320 bytes: 4 chunks of 64 code bytes, 16 fp16 scales d, 16 fp16 minimums m; the weight
//   is q d + m for a code q in 0..15. In chunk j, byte 4r + i holds row r's input 8j + i in its low nibble
//   and input 8j + 4 + i in its high nibble. The codes are used centred, w = (q - 8) d + (m + 8 d), so a
//   group's dot product is d * sum (q - 8) x + (m + 8 d) * sum x, and q - 8 is exact in bf16.
// Q8 tile (Q8_0), 544 bytes: 16 pairs of 32 code bytes (in pair p, byte 2r + i holds row r's input
//   2p + i as an int8), then 16 fp16 scales d; the weight is q d.
//
// The inputs are bf16 and meet the weights as they are (no input quantization): codes become bf16, and
// vdpbf16ps accumulates pairs of products in float32. Every (output, input row) pair has its own
// accumulators and the same operations whatever the number of rows, the block or the thread, so results
// are batch-invariant.
#pragma once
#include "prelude.h"

#if ZHUZI_AVX512
#define ZHUZI_TILES 1

#include <type_traits>

namespace tiles {

enum Format : int32_t { Q4 = 0, Q8 = 1 };
constexpr int GROUP = 32, LANES = 16, Q4_BYTES = 320, Q8_BYTES = 544;
constexpr int PASS = 8;        // input rows per pass over a block's tiles (accumulators + codes fit the registers)
constexpr int AHEAD = 4096;    // bytes prefetched ahead in a block's stream

static inline int64_t tile_bytes(int format) { return format == Q4 ? Q4_BYTES : Q8_BYTES; }

// acc += w . (the bf16 pair at p, broadcast to every lane). GCC does not fold a broadcast into the
// instruction by itself, and a separate broadcast per product costs as many uops as the product.
static inline __m512 dot_pair(__m512 acc, __m512i w, const void* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*static_cast<const int32_t*>(p)));
  return acc;
}

// A group's 16 code vectors: c[p] holds, in lane r, row r's weights for inputs 2p and 2p + 1 (bf16).
struct Codes {
  __m512i c[16];
  __m512 d, shift;  // scale, and the constant term's factor (m + 8 d for Q4)
};

static inline void load_q4(const uint8_t* w, Codes& g) {
  // Regroup each chunk so that, widened to 16 bits, a lane pair holds one row's two consecutive inputs:
  // bytes 4r, 4r + 1 first (inputs 0, 1 low nibble; 4, 5 high), then 4r + 2, 4r + 3 (2, 3; 6, 7).
  alignas(64) static const uint8_t order[64] = {
      0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29, 32, 33, 36, 37, 40, 41, 44, 45, 48, 49, 52, 53,
      56, 57, 60, 61, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31, 34, 35, 38, 39, 42, 43, 46, 47,
      50, 51, 54, 55, 58, 59, 62, 63};
  // bf16 of (j & 15) - 8: vpermw reads 5 index bits, and bit 4 (the next nibble's low bit) must not matter.
  alignas(64) static const uint16_t table[32] = {
      0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080,
      0x40a0, 0x40c0, 0x40e0, 0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80, 0x0000, 0x3f80,
      0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0};
  const __m512i perm = _mm512_load_si512(order), lut = _mm512_load_si512(table);
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

static inline void load_q8(const uint8_t* w, Codes& g) {
  for (int p = 0; p < 16; ++p) {  // int8 codes are exact in bf16
    const __m128i* q = reinterpret_cast<const __m128i*>(w + 32 * p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    g.c[p] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
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
    for (int p = 0; p < 16; ++p) acc[p & 1] = dot_pair(acc[p & 1], g.c[p], pairs + p);
    dot[m] = _mm512_fmadd_ps(_mm512_add_ps(acc[0], acc[1]), g.d, dot[m]);
    if constexpr (F == Q4) dot[m] = _mm512_fmadd_ps(g.shift, _mm512_set1_ps(sums[m * ldsum]), dot[m]);
  }
}

// One block (16 output rows) against M <= PASS input rows: out[m] holds the 16 results of row m.
// x: bf16 rows of K = groups * 32 inputs, row m at x + m * ldx; sums: [M, groups] group sums (Q4).
template <int F, int M>
static void block(const uint8_t* w, int64_t groups, const uint16_t* x, int64_t ldx, const float* sums,
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

// The same for any M <= PASS chosen at run time; out[m * 16 + r].
template <int F>
static void block_rows(const uint8_t* w, int64_t groups, const uint16_t* x, int64_t ldx, const float* sums,
                       int M, float* out) {
  __m512 v[PASS];
  auto go = [&](auto m) {
    block<F, decltype(m)::value>(w, groups, x, ldx, sums, v);
    for (int i = 0; i < m; ++i) _mm512_storeu_ps(out + 16 * i, v[i]);
  };
  switch (M) {
    case 1: go(std::integral_constant<int, 1>{}); break;
    case 2: go(std::integral_constant<int, 2>{}); break;
    case 3: go(std::integral_constant<int, 3>{}); break;
    case 4: go(std::integral_constant<int, 4>{}); break;
    case 5: go(std::integral_constant<int, 5>{}); break;
    case 6: go(std::integral_constant<int, 6>{}); break;
    case 7: go(std::integral_constant<int, 7>{}); break;
    default: go(std::integral_constant<int, 8>{}); break;
  }
}

static inline void block_rows(int format, const uint8_t* w, int64_t groups, const uint16_t* x, int64_t ldx,
                              const float* sums, int M, float* out) {
  if (format == Q4) block_rows<Q4>(w, groups, x, ldx, sums, M, out);
  else block_rows<Q8>(w, groups, x, ldx, sums, M, out);
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

}  // namespace tiles
#endif
