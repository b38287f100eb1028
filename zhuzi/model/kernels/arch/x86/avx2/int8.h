// int8.h for x86-64-v3: maddubs (pairs of u8 x s8 into int16) and madd (pairs into int32), or AVX-VNNI's
// vpdpbusd, which does both into int32 without the 16-bit step.
#pragma once

namespace i8 {

using I32 = __m256i;
using B8 = __m256i;
constexpr int LANES = 8;
#if ZHUZI_AVXVNNI
constexpr bool EXACT_U8 = true;  // vpdpbusd sums into int32 directly: any u8 operand is exact
#else
constexpr bool EXACT_U8 = false;  // maddubs's int16 pair sums: u8 operands must stay <= 127
#endif

static inline B8 load_b8(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
static inline I32 zero() { return _mm256_setzero_si256(); }
static inline vf to_float(I32 v) { return (vf)_mm256_cvtepi32_ps(v); }

static inline I32 dot_u8s8(I32 acc, B8 u, B8 s) {
#if ZHUZI_AVXVNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline I32 dot_u8s8_at(I32 acc, B8 u, const void* p) {
  int32_t s;
  std::memcpy(&s, p, 4);
  return dot_u8s8(acc, u, _mm256_set1_epi32(s));
}

static inline B8 table16(const int8_t* t) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
}
static inline B8 look_up(B8 table, B8 idx) { return _mm256_shuffle_epi8(table, idx); }

// a b = |a| (sign(a) b): the unsigned operand maddubs needs.
static inline I32 dot_s8s8(I32 acc, B8 a, B8 b) { return dot_u8s8(acc, _mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)); }

}  // namespace i8
