// An x86 variant's intrinsics emulated on a CPU without them, for the kernels' unit tests only
// (test_native.py force-includes this header into an x86-64-v3 build with -DZHUZI_EMULATE_AVX512 or
// -DZHUZI_EMULATE_AVXVNNI; -DZHUZI_EMULATE_AMX with the first adds AMX's tiles, for its prefill path). SIMDe
// (libsimde-dev) implements the AVX-512 and VNNI intrinsics from AVX2 ones under their own names; this
// header adds the few it lacks, then defines the feature macros the variant's compiler flags would, so
// prelude.h selects the variant as on a CPU that has it. What this checks is the kernels' logic (every
// result against the scalar reference), not their speed or their code generation.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#if defined(ZHUZI_EMULATE_AVX512)
#include <simde/x86/avx512.h>

namespace emulate {

static inline simde__m512i join(__m256i lo, __m256i hi) {
  return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(lo), hi, 1);
}
static inline simde__m512 join(__m256 lo, __m256 hi) {
  return simde_mm512_castsi512_ps(join(_mm256_castps_si256(lo), _mm256_castps_si256(hi)));
}
static inline __m256i half(simde__m512i v, int h) {
  return h ? simde_mm512_extracti64x4_epi64(v, 1) : simde_mm512_extracti64x4_epi64(v, 0);
}
static inline __m256 half(simde__m512 v, int h) { return _mm256_castsi256_ps(half(simde_mm512_castps_si512(v), h)); }
static inline __m128i high(__m256i v) { return _mm256_extracti128_si256(v, 1); }

static inline uint16_t to_bf16(float f) {  // round to nearest even, NaNs kept quiet (as vcvtne2ps2bf16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline simde__m512i cvtepu8_epi16(__m256i a) {
  return join(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepu8_epi16(high(a)));
}
static inline simde__m512i cvtepu16_epi32(__m256i a) {
  return join(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(high(a)));
}
static inline simde__m512i cvtepi8_epi32(__m128i a) {
  return join(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
static inline simde__m512i cvtepu8_epi32(__m128i a) {
  return join(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
}
static inline simde__m512 cvtph_ps(__m256i a) {
  return join(_mm256_cvtph_ps(_mm256_castsi256_si128(a)), _mm256_cvtph_ps(high(a)));
}
static inline simde__m512i cvtps_epi32(simde__m512 a) {
  return join(_mm256_cvtps_epi32(half(a, 0)), _mm256_cvtps_epi32(half(a, 1)));
}
static inline simde__m512 cvtepi32_ps(simde__m512i a) {
  return join(_mm256_cvtepi32_ps(half(a, 0)), _mm256_cvtepi32_ps(half(a, 1)));
}
static inline __m256i cvtepi32_epi16(simde__m512i a) {  // truncating, as vpmovdw
  int32_t in[16];
  int16_t out[16];
  std::memcpy(in, &a, 64);
  for (int l = 0; l < 16; ++l) out[l] = int16_t(in[l]);
  __m256i v;
  std::memcpy(&v, out, 32);
  return v;
}
static inline simde__m512i i32gather_epi32(simde__m512i index, const void* base, int scale) {
  int32_t at[16], out[16];
  std::memcpy(at, &index, 64);
  for (int l = 0; l < 16; ++l) std::memcpy(out + l, static_cast<const char*>(base) + int64_t(at[l]) * scale, 4);
  simde__m512i v;
  std::memcpy(&v, out, 64);
  return v;
}
static inline simde__m512i cvtne2ps_pbh(simde__m512 a, simde__m512 b) {  // b's 16 in the low half, a's above
  float in[32];
  uint16_t out[32];
  std::memcpy(in, &b, 64), std::memcpy(in + 16, &a, 64);
  for (int l = 0; l < 32; ++l) out[l] = to_bf16(in[l]);
  simde__m512i v;
  std::memcpy(&v, out, 64);
  return v;
}

}  // namespace emulate

#define _mm512_cvtepu8_epi16 emulate::cvtepu8_epi16
#define _mm512_cvtepu16_epi32 emulate::cvtepu16_epi32
#define _mm512_cvtepi8_epi32 emulate::cvtepi8_epi32
#define _mm512_cvtepu8_epi32 emulate::cvtepu8_epi32
#define _mm512_cvtph_ps emulate::cvtph_ps
#define _mm512_cvtps_epi32 emulate::cvtps_epi32
#define _mm512_cvtepi32_ps emulate::cvtepi32_ps
#define _mm512_cvtepi32_epi16 emulate::cvtepi32_epi16
#define _mm512_cvtne2ps_pbh emulate::cvtne2ps_pbh
// Macros in GCC's own headers at -O0: replaced, not redefined.
#undef _mm512_i32gather_epi32
#undef _mm512_mask_srli_epi16
#undef _mm512_mask_slli_epi16
#define _mm512_i32gather_epi32 emulate::i32gather_epi32
#define _mm512_mask_srli_epi16(w, k, a, s) simde_mm512_mask_mov_epi16((w), (k), simde_mm512_srli_epi16((a), (s)))
#define _mm512_mask_slli_epi16(w, k, a, s) simde_mm512_mask_mov_epi16((w), (k), simde_mm512_slli_epi16((a), (s)))

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512BF16__ 1
#define __AVX512VNNI__ 1
#define __AVX512VBMI__ 1
#define ZHUZI_EMULATED 1

#if defined(ZHUZI_EMULATE_AMX)
// AMX's tiles as memory, for the avx512 build's prefill path (arch/x86/amx/block_prefill.h): eight tiles of up
// to 16 rows x 64 bytes, shaped by ldtilecfg's palette 1 (bytes a row at 16 + 2 t, rows at 48 + t).
namespace emulate::amx {

struct Tile {
  int rows = 0, colsb = 0;
  alignas(64) uint8_t data[16][64] = {};
};
inline thread_local Tile tiles[8];  // a core's own, as the hardware's

static inline void loadconfig(const void* config) {
  const auto* c = static_cast<const uint8_t*>(config);
  for (int t = 0; t < 8; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * t, 2);
    tiles[t].colsb = colsb, tiles[t].rows = c[48 + t];
  }
}
static inline void zero(int t) { std::memset(tiles[t].data, 0, sizeof tiles[t].data); }
static inline void load(int t, const void* base, int64_t stride) {
  for (int r = 0; r < tiles[t].rows; ++r) std::memcpy(tiles[t].data[r], static_cast<const char*>(base) + r * stride, tiles[t].colsb);
}
static inline void store(int t, void* base, int64_t stride) {
  for (int r = 0; r < tiles[t].rows; ++r) std::memcpy(static_cast<char*>(base) + r * stride, tiles[t].data[r], tiles[t].colsb);
}
// c[m][n] (int32) += sum over k of a[m][4k + i] b[k][4n + i], i < 4: a's bytes signed, b's signed or not.
template <bool B_SIGNED>
static inline void dot(int c, int a, int b) {
  for (int m = 0; m < tiles[c].rows; ++m)
    for (int n = 0; n < tiles[c].colsb / 4; ++n) {
      int32_t sum;
      std::memcpy(&sum, tiles[c].data[m] + 4 * n, 4);
      for (int k = 0; k < tiles[a].colsb / 4; ++k)
        for (int i = 0; i < 4; ++i) {
          const uint8_t w = tiles[b].data[k][4 * n + i];
          sum += int8_t(tiles[a].data[m][4 * k + i]) * (B_SIGNED ? int32_t(int8_t(w)) : int32_t(w));
        }
      std::memcpy(tiles[c].data[m] + 4 * n, &sum, 4);
    }
}

}  // namespace emulate::amx

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbsud
#undef _tile_dpbssd
#undef _tile_release
#define _tile_loadconfig emulate::amx::loadconfig
#define _tile_loadd emulate::amx::load
#define _tile_stored emulate::amx::store
#define _tile_zero emulate::amx::zero
#define _tile_dpbsud emulate::amx::dot<false>
#define _tile_dpbssd emulate::amx::dot<true>
#define _tile_release()
#define ZHUZI_EMULATED_AMX 1
#endif
#elif defined(ZHUZI_EMULATE_AVXVNNI)
#include <simde/x86/avx512/dpbusd.h>
#define _mm256_dpbusd_avx_epi32 simde_mm256_dpbusd_epi32
#define __AVXVNNI__ 1
#define ZHUZI_EMULATED 1
#endif
