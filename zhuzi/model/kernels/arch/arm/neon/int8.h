// int8.h for armv8.2-a + dotprod: sdot does 4 signed byte products into each int32 lane (u8 operands are
// below 128, so they read the same as signed).
#pragma once

namespace i8 {

using I32 = int32x4_t;
using B8 = int8x16_t;
constexpr int LANES = 4;
constexpr bool EXACT_U8 = false;  // u8 operands read as signed: they must stay <= 127

static inline B8 load_b8(const void* p) { return vld1q_s8(static_cast<const int8_t*>(p)); }
static inline I32 zero() { return vdupq_n_s32(0); }
static inline vf to_float(I32 v) { return (vf)vcvtq_f32_s32(v); }
static inline I32 dot_u8s8(I32 acc, B8 u, B8 s) { return vdotq_s32(acc, u, s); }
static inline I32 dot_s8s8(I32 acc, B8 a, B8 b) { return vdotq_s32(acc, a, b); }
static inline I32 dot_u8s8_at(I32 acc, B8 u, const void* p) {
  int32_t s;
  std::memcpy(&s, p, 4);
  return vdotq_s32(acc, u, vreinterpretq_s8_s32(vdupq_n_s32(s)));
}

static inline B8 table16(const int8_t* t) { return vld1q_s8(t); }
static inline B8 look_up(B8 table, B8 idx) { return vqtbl1q_s8(table, vreinterpretq_u8_s8(idx)); }

}  // namespace i8
