// quant_packed.h for armv8.2-a + dotprod: q8 activations (q8.h) meet the codes through sdot by lane (a lane
// selects four input bytes for all four rows of a vector). A row group's 16 rows are four quarters of 4, one
// row per 32-bit lane. With i8mm, two input rows at a time go through smmla instead (2 weight rows x 8
// inputs against 2 input rows: twice sdot's products an instruction); its int32 sums are the same, so a
// row's result does not depend on whether it ran paired. Per group and row, the int32 dot product becomes
// float once: Q4 adds d dx sum(q qx) + m dx sum(qx), Q8 d dx sum(q qx).
#pragma once
#include "q8.h"

#include <vector>

namespace quant_packed {

constexpr int PASS = 4;
constexpr int AHEAD = 4096;


// sum over a group of code vectors c[j] (inputs 4j .. 4j + 3 of the quarter's rows) times q8 inputs x.
static inline int32x4_t dot8(const int8x16_t c[8], const int8_t* x) {
  const int8x16_t lo = vld1q_s8(x), hi = vld1q_s8(x + 16);
  int32x4_t a = vdupq_n_s32(0), b = vdupq_n_s32(0);
  a = vdotq_laneq_s32(a, c[0], lo, 0);
  b = vdotq_laneq_s32(b, c[1], lo, 1);
  a = vdotq_laneq_s32(a, c[2], lo, 2);
  b = vdotq_laneq_s32(b, c[3], lo, 3);
  a = vdotq_laneq_s32(a, c[4], hi, 0);
  b = vdotq_laneq_s32(b, c[5], hi, 1);
  a = vdotq_laneq_s32(a, c[6], hi, 2);
  b = vdotq_laneq_s32(b, c[7], hi, 3);
  return vaddq_s32(a, b);
}

#if ZHUZI_I8MM
// The codes as smmla takes them: z[2i] = rows 0, 1 and z[2i + 1] = rows 2, 3, each with inputs 8i .. 8i + 7.
static inline void pair_rows(const int8x16_t c[8], int8x16_t z[8]) {
  for (int i = 0; i < 4; ++i) {
    const int32x4_t a = vreinterpretq_s32_s8(c[2 * i]), b = vreinterpretq_s32_s8(c[2 * i + 1]);
    z[2 * i] = vreinterpretq_s8_s32(vzip1q_s32(a, b));
    z[2 * i + 1] = vreinterpretq_s8_s32(vzip2q_s32(a, b));
  }
}

// dot8 for two input rows xa, xb at once: sa, sb get the quarter's four rows' sums.
static inline void dot8_pair(const int8x16_t z[8], const int8_t* xa, const int8_t* xb, int32x4_t& sa,
                             int32x4_t& sb) {
  int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);  // [row 0 . a, row 0 . b, row 1 . a, row 1 . b], rows 2, 3
  for (int i = 0; i < 4; ++i) {
    const int8x16_t x = vcombine_s8(vld1_s8(xa + 8 * i), vld1_s8(xb + 8 * i));
    lo = vmmlaq_s32(lo, z[2 * i], x);
    hi = vmmlaq_s32(hi, z[2 * i + 1], x);
  }
  sa = vuzp1q_s32(lo, hi);
  sb = vuzp2q_s32(lo, hi);
}
#endif

static inline float32x4_t halves(const uint8_t* p) {  // 4 fp16 values
  return vcvt_f32_f16(vld1_f16(reinterpret_cast<const __fp16*>(p)));
}

template <int F, int M>
static void row_group(const uint8_t* w, int64_t groups, const Input& in, int64_t m0, float out[M][LANES]) {
  constexpr int BYTES = F == Q4 ? Q4_BYTES : Q8_BYTES;
  float32x4_t acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < 4; ++q) acc[m][q] = vdupq_n_f32(0.f);
  const q8::Block* x[M];
  for (int m = 0; m < M; ++m) x[m] = in.rows.row(m0 + m);
  for (int64_t g = 0; g < groups; ++g, w += BYTES) {
    for (int i = 0; i < BYTES; i += 64) __builtin_prefetch(w + AHEAD + i);
    for (int q = 0; q < 4; ++q) {  // rows 4q .. 4q + 3: bytes 16q .. 16q + 15 of every 64
      int8x16_t c[8];  // c[k]: inputs 4k .. 4k + 3 of the quarter's rows
      if constexpr (F == Q4) {  // chunk j: low nibbles are inputs 8j .. 8j + 3, high ones 8j + 4 .. 8j + 7
        for (int j = 0; j < 4; ++j) {
          const uint8x16_t v = vld1q_u8(w + 64 * j + 16 * q);
          c[2 * j] = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0f)));
          c[2 * j + 1] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        }
      } else {
        for (int j = 0; j < 8; ++j) c[j] = vld1q_s8(reinterpret_cast<const int8_t*>(w + 64 * j + 16 * q));
      }
      const float32x4_t d = halves(w + (F == Q4 ? 256 : 512) + 8 * q);
      int32x4_t dots[M];
      int m = 0;
#if ZHUZI_I8MM
      int8x16_t z[8];
      if (M > 1) pair_rows(c, z);
      for (; m + 1 < M; m += 2) dot8_pair(z, x[m][g].q, x[m + 1][g].q, dots[m], dots[m + 1]);
#endif
      for (; m < M; ++m) dots[m] = dot8(c, x[m][g].q);
      for (m = 0; m < M; ++m) {
        const q8::Block& b = x[m][g];
        acc[m][q] = vfmaq_f32(acc[m][q], vcvtq_f32_s32(dots[m]), vmulq_n_f32(d, b.d));
        if constexpr (F == Q4)
          acc[m][q] = vfmaq_n_f32(acc[m][q], halves(w + 288 + 8 * q), b.d * float(b.sum[0] + b.sum[1]));
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < 4; ++q) vst1q_f32(out[m] + 4 * q, acc[m][q]);
}

}  // namespace quant_packed
