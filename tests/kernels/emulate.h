// An x86 variant's intrinsics emulated on a CPU without them, for the kernels' unit tests only
// (test_native.py force-includes this header into an x86-64-v3 build with -DZHUZI_EMULATE_AVX512 or
// -DZHUZI_EMULATE_AVXVNNI). SIMDe (libsimde-dev) implements the AVX-512 and VNNI intrinsics from AVX2 ones
// under their own names; this header adds the few it lacks, then defines the feature macros the variant's
// compiler flags would, so prelude.h selects the variant as on a CPU that has it. What this checks is the
// kernels' logic (every result against the scalar reference), not their speed or their code generation.
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
#define _mm512_i32gather_epi32 emulate::i32gather_epi32
#define _mm512_cvtne2ps_pbh emulate::cvtne2ps_pbh
#define _mm512_mask_srli_epi16(w, k, a, s) simde_mm512_mask_mov_epi16((w), (k), simde_mm512_srli_epi16((a), (s)))
#define _mm512_mask_slli_epi16(w, k, a, s) simde_mm512_mask_mov_epi16((w), (k), simde_mm512_slli_epi16((a), (s)))

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512BF16__ 1
#define __AVX512VNNI__ 1
#define __AVX512VBMI__ 1
#define ZHUZI_EMULATED 1
#elif defined(ZHUZI_EMULATE_AVXVNNI)
#include <simde/x86/avx512/dpbusd.h>
#define _mm256_dpbusd_avx_epi32 simde_mm256_dpbusd_epi32
#define __AVXVNNI__ 1
#define ZHUZI_EMULATED 1
#endif
