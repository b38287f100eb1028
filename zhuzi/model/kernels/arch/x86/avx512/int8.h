// int8.h for AVX-512 VNNI: vpdpbusd does 4 u8 x s8 products into each int32 lane.
#pragma once

namespace i8 {

using I32 = __m512i;
using B8 = __m512i;
constexpr int LANES = 16;
constexpr bool EXACT_U8 = true;  // dot_u8s8 sums into int32 directly: any u8 operand is exact

static inline B8 load_b8(const void* p) { return _mm512_loadu_si512(p); }
static inline I32 zero() { return _mm512_setzero_si512(); }
static inline vf to_float(I32 v) { return (vf)_mm512_cvtepi32_ps(v); }
static inline I32 dot_u8s8(I32 acc, B8 u, B8 s) { return _mm512_dpbusd_epi32(acc, u, s); }
// The broadcast folded into the instruction: GCC keeps it a separate one, an instruction as costly as the product
// (emulated builds, as dot_bf16_pair() in prelude.h, take the intrinsics).
static inline I32 dot_u8s8_at(I32 acc, B8 u, const void* p) {
#if ZHUZI_EMULATED
  int32_t s;
  std::memcpy(&s, p, 4);
  return dot_u8s8(acc, u, _mm512_set1_epi32(s));
#else
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*static_cast<const int32_t*>(p)));
  return acc;
#endif
}

static inline B8 table16(const int8_t* t) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
}
static inline B8 look_up(B8 table, B8 idx) { return _mm512_shuffle_epi8(table, idx); }

// a b = |a| (sign(a) b); AVX-512 has no vpsignb, so the sign moves through a mask.
static inline I32 dot_s8s8(I32 acc, B8 a, B8 b) {
  const __mmask64 negative = _mm512_movepi8_mask(a);
  return dot_u8s8(acc, _mm512_abs_epi8(a), _mm512_mask_sub_epi8(b, negative, _mm512_setzero_si512(), b));
}

}  // namespace i8
