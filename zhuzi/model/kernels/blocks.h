// GGUF's block formats as llama.cpp stores them (a tensor row of K weights is K / QK blocks, one after
// another): every kernel on GGUF weights reads the blocks through this file. The numbers are ggml's type ids.
//
//   type  QK  bytes  layout                                           weight i of the block
//   Q4_0  32   18    fp16 d, qs[16]                                   d (q_i - 8)
//   Q4_1  32   20    fp16 d, fp16 m, qs[16]                           d q_i + m
//   Q5_0  32   22    fp16 d, qh[4], qs[16]                            d (q_i - 16)
//   Q5_1  32   24    fp16 d, fp16 m, qh[4], qs[16]                    d q_i + m
//   Q8_0  32   34    fp16 d, int8 qs[32]                              d qs_i
//   Q4_K 256  144    fp16 d, fp16 dmin, scales[12], qs[128]           (d sc_j) q_i - dmin mn_j    (j = i / 32)
//   Q5_K 256  176    fp16 d, fp16 dmin, scales[12], qh[32], qs[128]   as Q4_K, q_i of 5 bits
//   Q6_K 256  210    ql[128], qh[64], int8 scales[16], fp16 d         (d scales[i / 16]) (q_i - 32)
//   Q3_K 256  110    hmask[32], qs[64], scales[12], fp16 d            (d (sc_g - 32)) (q_i - 4)   (g = i / 16)
//   Q2_K 256   84    scales[16], qs[64], fp16 d, fp16 dmin            (d sc_g) q_i - dmin mn_g
//   IQ4_NL  32  18   fp16 d, qs[16]                                   d IQ4[q_i]
//   IQ4_XS 256 136   fp16 d, scales_h, scales_l[4], qs[128]           (d (sc_j - 32)) IQ4[q_i]    (j = i / 32)
//   MXFP4   32  17   E8M0 e, qs[16]                                   2^(e - 128) E2M1x2[q_i]
//
// 32-blocks: q_i's low 4 bits are the low nibble of qs[i] for i < 16, the high nibble of qs[i - 16]
// otherwise; Q5's fifth bit is bit i of qh (little-endian 32 bits).
// Q4_K / Q5_K: 64 weights share 32 bytes of qs: weight 64c + l (l < 32) takes the low nibble of qs[32c + l],
// weight 64c + 32 + l the high one; Q5_K's fifth bit of weight 32j + l is bit j of qh[l]. The 8 sub-block
// scales sc_j and mins mn_j are 6 bits, packed in 12 bytes: for j < 4, sc_j = scales[j] & 63 and mn_j =
// scales[j + 4] & 63; for j >= 4, sc_j = (scales[j + 4] & 15) | (scales[j - 4] >> 6) << 4 and
// mn_j = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4.
// Q6_K: two halves of 128; in half h, weight 128h + 32t + l takes its low 4 bits from ql[64h + l] (t = 0: low
// nibble, t = 2: high) or ql[64h + 32 + l] (t = 1: low, t = 3: high), and its top 2 bits from
// (qh[32h + l] >> 2t) & 3.
// Q3_K, Q2_K: 2-bit codes, 128 weights sharing 32 bytes of qs: weight 128h + 32t + l takes (qs[32h + l] >> 2t) & 3.
// Q3_K's third bit of weight 32k + l is bit k of hmask[l]. Its 16 scales are 6 bits, stored plus 32: the low 4
// bits of sc_g are the low nibble of scales[g] for g < 8, the high one of scales[g - 8] otherwise, its top 2
// bits are (scales[8 + g % 4] >> 2 (g / 4)) & 3. Q2_K's scales[g] holds sc_g in its low nibble, mn_g in its high.
// IQ4_NL, IQ4_XS, MXFP4 (the lookup-table formats, LUT): q_i is a 4-bit index into a table of 16 int8 values
// (VALUES: llama.cpp's kvalues_iq4nl, or MXFP4's E2M1 values doubled, its scale halved to match), laid out as in
// a 32-block (IQ4_XS: sub-block j's 32 at qs[16j]); IQ4_XS's 6-bit sc_j is nibble j % 2 of scales_l[j / 2] with
// bits 2j, 2j + 1 of scales_h (16 bits) on top.
//
// K-quants (QK = 256) also give their sub-block scales as integers (ints(): sc and mn per sub-block, the fp16
// d and dmin), which the dot products apply in the integer domain (block_dot.h).
//
// Each Format decodes a block into its codes q (one byte a weight; Q8_0's and the LUT formats' table values are
// signed), and per sub-block of SUB weights a scale a and, for the formats with a minimum, an offset b (scales():
// these alone): weight = a q + b ("MIN" formats), or a (q - OFF) (the others). The LUT formats' indexes() gives
// their indexes as stored, which the packed layout keeps. values() computes the weights as gguf's reference does,
// bit for bit (a q is rounded before b is added: no FMA); the kernels use the codes and scales.
#pragma once
#include "prelude.h"

namespace blocks {

enum Type : int32_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  Q2_K = 10, Q3_K = 11,
};

struct BQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct BQ8_0 { uint16_t d; int8_t qs[32]; };
struct BQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
static_assert(sizeof(BQ4_0) == 18 && sizeof(BQ4_1) == 20 && sizeof(BQ5_0) == 22 && sizeof(BQ5_1) == 24, "");
static_assert(sizeof(BQ8_0) == 34 && sizeof(BQ4_K) == 144 && sizeof(BQ5_K) == 176 && sizeof(BQ6_K) == 210, "");
struct BQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct BQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
static_assert(sizeof(BQ3_K) == 110 && sizeof(BQ2_K) == 84, "");

// A 32-block's 4-bit codes (and Q5's fifth bits), in vector registers of any width (GCC vectors).
typedef uint8_t v16b __attribute__((vector_size(16)));
static inline void nibbles(const uint8_t* qs, uint8_t* q) {
  v16b v;
  std::memcpy(&v, qs, 16);
  const v16b lo = v & 15, hi = v >> 4;
  std::memcpy(q, &lo, 16), std::memcpy(q + 16, &hi, 16);
}
static inline void fifth_bits(const uint8_t* qh, uint8_t* q) {
  // Byte i of a lane group takes the byte of qh holding bit i, then tests that bit.
  static const v16b bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  v16b h = {}, lo, hi;
  std::memcpy(&h, qh, 4);
  std::memcpy(&lo, q, 16), std::memcpy(&hi, q + 16, 16);
  lo |= (v16b)((__builtin_shufflevector(h, h, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1) & bit) != 0) & 16;
  hi |= (v16b)((__builtin_shufflevector(h, h, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3) & bit) != 0) & 16;
  std::memcpy(q, &lo, 16), std::memcpy(q + 16, &hi, 16);
}

// The 8 sub-block scales sc_j and minimums mn_j of a Q4_K / Q5_K block, as the integers they are.
static inline void k_ints(const uint8_t* s, int32_t* sc, int32_t* mn) {
  for (int j = 0; j < 8; ++j) {
    sc[j] = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
    mn[j] = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
  }
}
// The same, as each sub-block's scale (times d) and offset (-dmin mn).
static inline void k_scales(uint16_t d16, uint16_t dmin16, const uint8_t* s, float* a, float* b) {
  const float d = half_to_float(d16), dmin = half_to_float(dmin16);
  int32_t sc[8], mn[8];
  k_ints(s, sc, mn);
  for (int j = 0; j < 8; ++j) a[j] = d * float(sc[j]), b[j] = -(dmin * float(mn[j]));
}
static inline void k_nibbles(const uint8_t* qs, uint8_t* q) {
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) q[64 * c + l] = qs[32 * c + l] & 15, q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
}

template <int T> struct Format;
template <> struct Format<Q4_0> {
  static constexpr int QK = 32, BYTES = 18, SUB = 32, OFF = 8;
  static constexpr bool MIN = false, SIGNED = false;
  static void decode(const void* p, uint8_t* q, float* a, float*) {
    nibbles(static_cast<const BQ4_0*>(p)->qs, q);
    scales(p, a, nullptr);
  }
  static void scales(const void* p, float* a, float*) { a[0] = half_to_float(static_cast<const BQ4_0*>(p)->d); }
};
template <> struct Format<Q4_1> {
  static constexpr int QK = 32, BYTES = 20, SUB = 32, OFF = 0;
  static constexpr bool MIN = true, SIGNED = false;
  static void decode(const void* p, uint8_t* q, float* a, float* off) {
    nibbles(static_cast<const BQ4_1*>(p)->qs, q);
    scales(p, a, off);
  }
  static void scales(const void* p, float* a, float* off) {
    const auto* b = static_cast<const BQ4_1*>(p);
    a[0] = half_to_float(b->d), off[0] = half_to_float(b->m);
  }
};
template <> struct Format<Q5_0> {
  static constexpr int QK = 32, BYTES = 22, SUB = 32, OFF = 16;
  static constexpr bool MIN = false, SIGNED = false;
  static void decode(const void* p, uint8_t* q, float* a, float*) {
    const auto* b = static_cast<const BQ5_0*>(p);
    nibbles(b->qs, q);
    fifth_bits(b->qh, q);
    scales(p, a, nullptr);
  }
  static void scales(const void* p, float* a, float*) { a[0] = half_to_float(static_cast<const BQ5_0*>(p)->d); }
};
template <> struct Format<Q5_1> {
  static constexpr int QK = 32, BYTES = 24, SUB = 32, OFF = 0;
  static constexpr bool MIN = true, SIGNED = false;
  static void decode(const void* p, uint8_t* q, float* a, float* off) {
    const auto* b = static_cast<const BQ5_1*>(p);
    nibbles(b->qs, q);
    fifth_bits(b->qh, q);
    scales(p, a, off);
  }
  static void scales(const void* p, float* a, float* off) {
    const auto* b = static_cast<const BQ5_1*>(p);
    a[0] = half_to_float(b->d), off[0] = half_to_float(b->m);
  }
};
template <> struct Format<Q8_0> {
  static constexpr int QK = 32, BYTES = 34, SUB = 32, OFF = 0;
  static constexpr bool MIN = false, SIGNED = true;
  static void decode(const void* p, uint8_t* q, float* a, float*) {
    std::memcpy(q, static_cast<const BQ8_0*>(p)->qs, 32);
    scales(p, a, nullptr);
  }
  static void scales(const void* p, float* a, float*) { a[0] = half_to_float(static_cast<const BQ8_0*>(p)->d); }
};
template <> struct Format<Q4_K> {
  static constexpr int QK = 256, BYTES = 144, SUB = 32, OFF = 0;
  static constexpr bool MIN = true, SIGNED = false;
  static void decode(const void* p, uint8_t* q, float* a, float* off) {
    k_nibbles(static_cast<const BQ4_K*>(p)->qs, q);
    scales(p, a, off);
  }
  static void scales(const void* p, float* a, float* off) {
    const auto* b = static_cast<const BQ4_K*>(p);
    k_scales(b->d, b->dmin, b->scales, a, off);
  }
  static void ints(const void* p, int32_t* sc, int32_t* mn, float& d, float& dmin) {
    const auto* b = static_cast<const BQ4_K*>(p);
    k_ints(b->scales, sc, mn), d = half_to_float(b->d), dmin = half_to_float(b->dmin);
  }
};
template <> struct Format<Q5_K> {
  static constexpr int QK = 256, BYTES = 176, SUB = 32, OFF = 0;
  static constexpr bool MIN = true, SIGNED = false;
  static void decode(const void* p, uint8_t* q, float* a, float* off) {
    const auto* b = static_cast<const BQ5_K*>(p);
    k_nibbles(b->qs, q);
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) q[32 * j + l] |= ((b->qh[l] >> j) & 1) << 4;
    scales(p, a, off);
  }
  static void scales(const void* p, float* a, float* off) {
    const auto* b = static_cast<const BQ5_K*>(p);
    k_scales(b->d, b->dmin, b->scales, a, off);
  }
  static void ints(const void* p, int32_t* sc, int32_t* mn, float& d, float& dmin) {
    const auto* b = static_cast<const BQ5_K*>(p);
    k_ints(b->scales, sc, mn), d = half_to_float(b->d), dmin = half_to_float(b->dmin);
  }
};
template <> struct Format<Q6_K> {
  static constexpr int QK = 256, BYTES = 210, SUB = 16, OFF = 32;
  static constexpr bool MIN = false, SIGNED = false;
  static void decode(const void* p, uint8_t* q, float* a, float*) {
    const auto* b = static_cast<const BQ6_K*>(p);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo = b->ql[64 * h + l], hi = b->ql[64 * h + 32 + l], top = b->qh[32 * h + l];
        uint8_t* o = q + 128 * h + l;
        o[0] = (lo & 15) | (top & 3) << 4, o[32] = (hi & 15) | ((top >> 2) & 3) << 4;
        o[64] = (lo >> 4) | ((top >> 4) & 3) << 4, o[96] = (hi >> 4) | ((top >> 6) & 3) << 4;
      }
    scales(p, a, nullptr);
  }
  static void scales(const void* p, float* a, float*) {
    const auto* b = static_cast<const BQ6_K*>(p);
    const float d = half_to_float(b->d);
    for (int g = 0; g < 16; ++g) a[g] = d * float(b->scales[g]);
  }
  static void ints(const void* p, int32_t* sc, int32_t*, float& d, float& dmin) {
    const auto* b = static_cast<const BQ6_K*>(p);
    for (int g = 0; g < 16; ++g) sc[g] = b->scales[g];
    d = half_to_float(b->d), dmin = 0.f;
  }
};

// Q3_K and Q2_K: 2-bit codes, and Q3_K's third bits and 6-bit scales (sub-blocks of 16 weights).
static inline void two_bit_codes(const uint8_t* qs, uint8_t* q) {
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < 32; ++l) q[128 * h + 32 * t + l] = (qs[32 * h + l] >> (2 * t)) & 3;
}
static inline int32_t q3k_scale(const uint8_t* s, int g) {
  return int32_t(((s[g % 8] >> (4 * (g / 8))) & 15) | ((s[8 + g % 4] >> (2 * (g / 4))) & 3) << 4) - 32;
}
template <> struct Format<Q3_K> {
  static constexpr int QK = 256, BYTES = 110, SUB = 16, OFF = 4;
  static constexpr bool MIN = false, SIGNED = false;
  static void decode(const void* p, uint8_t* q, float* a, float*) {
    const auto* b = static_cast<const BQ3_K*>(p);
    two_bit_codes(b->qs, q);
    for (int k = 0; k < 8; ++k)
      for (int l = 0; l < 32; ++l) q[32 * k + l] |= ((b->hmask[l] >> k) & 1) << 2;
    scales(p, a, nullptr);
  }
  static void scales(const void* p, float* a, float*) {
    const auto* b = static_cast<const BQ3_K*>(p);
    const float d = half_to_float(b->d);
    for (int g = 0; g < 16; ++g) a[g] = d * float(q3k_scale(b->scales, g));
  }
  static void ints(const void* p, int32_t* sc, int32_t*, float& d, float& dmin) {
    const auto* b = static_cast<const BQ3_K*>(p);
    for (int g = 0; g < 16; ++g) sc[g] = q3k_scale(b->scales, g);
    d = half_to_float(b->d), dmin = 0.f;
  }
};
template <> struct Format<Q2_K> {
  static constexpr int QK = 256, BYTES = 84, SUB = 16, OFF = 0;
  static constexpr bool MIN = true, SIGNED = false;
  static void decode(const void* p, uint8_t* q, float* a, float* off) {
    two_bit_codes(static_cast<const BQ2_K*>(p)->qs, q);
    scales(p, a, off);
  }
  static void scales(const void* p, float* a, float* off) {
    const auto* b = static_cast<const BQ2_K*>(p);
    const float d = half_to_float(b->d), dmin = half_to_float(b->dmin);
    for (int g = 0; g < 16; ++g) a[g] = d * float(b->scales[g] & 15), off[g] = -(dmin * float(b->scales[g] >> 4));
  }
  static void ints(const void* p, int32_t* sc, int32_t* mn, float& d, float& dmin) {
    const auto* b = static_cast<const BQ2_K*>(p);
    for (int g = 0; g < 16; ++g) sc[g] = b->scales[g] & 15, mn[g] = b->scales[g] >> 4;
    d = half_to_float(b->d), dmin = half_to_float(b->dmin);
  }
};

// ---- The lookup-table formats: IQ4_NL, IQ4_XS, MXFP4

enum LutType : int32_t { IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39 };

struct BIQ4_NL { uint16_t d; uint8_t qs[16]; };
struct BIQ4_XS { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };
struct BMXFP4 { uint8_t e; uint8_t qs[16]; };
static_assert(sizeof(BIQ4_NL) == 18 && sizeof(BIQ4_XS) == 136 && sizeof(BMXFP4) == 17, "");

constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// E2M1's values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) doubled into integers, so that the int8 dot
// products take them as they take IQ4_VALUES; the block's scale is halved in their place.
constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml's E8M0 scale halved, 2^(e - 128), as its bits (exact for every byte: e < 2 gives a subnormal).
static inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The same for a vector of exponents, one a lane.
static inline vf e8m0_half(vu e) {
  const vu subnormal = vu{} + 0x00200000u;
  return (vf)(e < 2 ? subnormal << e : (e - 1) << 23);
}

// Indexes -> the table's values, as the signed codes the kernels take.
static inline void look_up(const int8_t* values, uint8_t* q, int n) {
  for (int i = 0; i < n; ++i) q[i] = uint8_t(values[q[i]]);
}

// IQ4_XS's sub-block scales sc_j - 32 (-32..31).
static inline void iq4_xs_ints(const BIQ4_XS* b, int32_t* sc) {
  for (int j = 0; j < 8; ++j)
    sc[j] = (((b->scales_l[j / 2] >> 4 * (j % 2)) & 15) | ((b->scales_h >> 2 * j) & 3) << 4) - 32;
}

template <> struct Format<IQ4_NL> {
  static constexpr int QK = 32, BYTES = 18, SUB = 32, OFF = 0;
  static constexpr bool MIN = false, SIGNED = true;
  static constexpr const int8_t* VALUES = IQ4_VALUES;
  static void indexes(const void* p, uint8_t* q) { nibbles(static_cast<const BIQ4_NL*>(p)->qs, q); }
  static void decode(const void* p, uint8_t* q, float* a, float*) {
    indexes(p, q), look_up(VALUES, q, QK);
    scales(p, a, nullptr);
  }
  static void scales(const void* p, float* a, float*) { a[0] = half_to_float(static_cast<const BIQ4_NL*>(p)->d); }
};
template <> struct Format<IQ4_XS> {
  static constexpr int QK = 256, BYTES = 136, SUB = 32, OFF = 0;
  static constexpr bool MIN = false, SIGNED = true;
  static constexpr const int8_t* VALUES = IQ4_VALUES;
  static void indexes(const void* p, uint8_t* q) {
    for (int j = 0; j < 8; ++j) nibbles(static_cast<const BIQ4_XS*>(p)->qs + 16 * j, q + 32 * j);
  }
  static void decode(const void* p, uint8_t* q, float* a, float*) {
    indexes(p, q), look_up(VALUES, q, QK);
    scales(p, a, nullptr);
  }
  static void scales(const void* p, float* a, float*) {
    const auto* b = static_cast<const BIQ4_XS*>(p);
    const float d = half_to_float(b->d);
    int32_t sc[8];
    iq4_xs_ints(b, sc);
    for (int j = 0; j < 8; ++j) a[j] = d * float(sc[j]);
  }
  static void ints(const void* p, int32_t* sc, int32_t*, float& d, float& dmin) {
    const auto* b = static_cast<const BIQ4_XS*>(p);
    iq4_xs_ints(b, sc), d = half_to_float(b->d), dmin = 0.f;
  }
};
template <> struct Format<MXFP4> {
  static constexpr int QK = 32, BYTES = 17, SUB = 32, OFF = 0;
  static constexpr bool MIN = false, SIGNED = true;
  static constexpr const int8_t* VALUES = MXFP4_VALUES;
  static void indexes(const void* p, uint8_t* q) { nibbles(static_cast<const BMXFP4*>(p)->qs, q); }
  static void decode(const void* p, uint8_t* q, float* a, float*) {
    indexes(p, q), look_up(VALUES, q, QK);
    scales(p, a, nullptr);
  }
  static void scales(const void* p, float* a, float*) { a[0] = e8m0_half(static_cast<const BMXFP4*>(p)->e); }
};

template <class F> constexpr bool LUT = false;  // whether F's codes are table values (indexes() gives the indexes)
template <> constexpr bool LUT<Format<IQ4_NL>> = true;
template <> constexpr bool LUT<Format<IQ4_XS>> = true;
template <> constexpr bool LUT<Format<MXFP4>> = true;

// The QK weights of one block, as gguf computes them, from what decode(q, a, b) gives (F::decode()'s outputs).
template <class F, typename Decode>
static inline void values(float* y, Decode decode) {
  uint8_t q[F::QK];
  float a[F::QK / F::SUB], b[F::QK / F::SUB];
  decode(q, a, b);
  for (int i = 0; i < F::QK; ++i) {
    const int g = i / F::SUB;
    if constexpr (F::MIN) y[i] = a[g] * float(q[i]) + b[g];  // not fmadd(): gguf rounds the product
    else y[i] = a[g] * float((F::SIGNED ? int(int8_t(q[i])) : int(q[i])) - F::OFF);
  }
}
template <class F>
static inline void values(const void* p, float* y) {
  values<F>(y, [&](uint8_t* q, float* a, float* b) { F::decode(p, q, a, b); });
}

// Calls fn(Format<T>{}) for a run-time type id; false for a type this file does not know.
template <typename Fn>
static bool with_format(int type, Fn fn) {
  switch (type) {
    case IQ4_NL: fn(Format<IQ4_NL>{}); return true;
    case IQ4_XS: fn(Format<IQ4_XS>{}); return true;
    case MXFP4: fn(Format<MXFP4>{}); return true;
    case Q4_0: fn(Format<Q4_0>{}); return true;
    case Q4_1: fn(Format<Q4_1>{}); return true;
    case Q5_0: fn(Format<Q5_0>{}); return true;
    case Q5_1: fn(Format<Q5_1>{}); return true;
    case Q8_0: fn(Format<Q8_0>{}); return true;
    case Q4_K: fn(Format<Q4_K>{}); return true;
    case Q5_K: fn(Format<Q5_K>{}); return true;
    case Q6_K: fn(Format<Q6_K>{}); return true;
    case Q3_K: fn(Format<Q3_K>{}); return true;
    case Q2_K: fn(Format<Q2_K>{}); return true;
    default: return false;
  }
}

}  // namespace blocks
