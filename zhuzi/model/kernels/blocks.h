// GGUF's block formats as llama.cpp stores them (a tensor row of K weights is K / QK blocks, one after
// another), and each block's exact values. Every kernel on GGUF weights reads the blocks through this
// file; the numbers are ggml's type ids.
//
//   type  QK  bytes  layout                                      weight i of the block
//   Q4_0  32   18    fp16 d, qs[16]                              d (q_i - 8)
//   Q4_1  32   20    fp16 d, fp16 m, qs[16]                      d q_i + m
//   Q5_0  32   22    fp16 d, qh[4], qs[16]                       d (q_i - 16)
//   Q5_1  32   24    fp16 d, fp16 m, qh[4], qs[16]               d q_i + m
//   Q8_0  32   34    fp16 d, int8 qs[32]                         d qs[i]
//   Q4_K 256  144    fp16 d, fp16 dmin, scales[12], qs[128]      d sc_j q_i - dmin mn_j     (j = i / 32)
//   Q5_K 256  176    fp16 d, fp16 dmin, scales[12], qh[32], qs[128]   as Q4_K with 5-bit q
//   Q6_K 256  210    ql[128], qh[64], int8 scales[16], fp16 d    d scales[i / 16] (q_i - 32)
//
// 32-blocks: q_i's low 4 bits are the low nibble of qs[i] for i < 16, the high nibble of qs[i - 16]
// otherwise; Q5's fifth bit is bit i of qh (little-endian 32 bits).
// Q4_K / Q5_K: 64 weights share 32 bytes of qs: weights 64c + l (l < 32) take the low nibble of
// qs[32c + l], weights 64c + 32 + l the high one; Q5_K's fifth bit of weight 32j + l is bit j of qh[l].
// The 8 sub-block scales sc_j and mins mn_j are 6 bits, packed in 12 bytes: for j < 4, sc_j =
// scales[j] & 63 and mn_j = scales[j + 4] & 63; for j >= 4, sc_j = (scales[j + 4] & 15) | (scales[j - 4]
// >> 6) << 4 and mn_j = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4.
// Q6_K: two halves of 128; in half h, weight 128h + 32t + l takes its low 4 bits from ql[64h + l]
// (t = 0: low nibble, t = 2: high) or ql[64h + 32 + l] (t = 1: low, t = 3: high), and its top 2 bits
// from (qh[32h + l] >> 2t) & 3.
#pragma once
#include <cstdint>
#include <cstring>

namespace blocks {

enum Type : int32_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

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

static inline float half(uint16_t h) {  // IEEE fp16 -> float, exact
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t u;
  if (exp == 31) u = sign | 0x7f800000u | man << 13;
  else if (exp) u = sign | (exp + 112) << 23 | man << 13;
  else if (!man) u = sign;
  else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while (!(m & 1024));
    u = sign | uint32_t(112 - e) << 23 | (m & 1023) << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Sub-block j's 6-bit scale and min of a Q4_K / Q5_K block.
static inline void scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63, mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
    mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
  }
}

// Low 4 bits of weight i of a 32-block's qs.
static inline int nibble(const uint8_t* qs, int i) { return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4; }
static inline int bit(const uint8_t* qh, int i) { return (qh[i / 8] >> (i % 8)) & 1; }

// One block's QK weights, computed as gguf's reference does (products first, then the offset).
template <int T> struct Format;
template <> struct Format<Q4_0> {
  static constexpr int QK = 32, BYTES = 18;
  static void values(const void* p, float* y) {
    const auto* b = static_cast<const BQ4_0*>(p);
    const float d = half(b->d);
    for (int i = 0; i < 32; ++i) y[i] = d * float(nibble(b->qs, i) - 8);
  }
};
template <> struct Format<Q4_1> {
  static constexpr int QK = 32, BYTES = 20;
  static void values(const void* p, float* y) {
    const auto* b = static_cast<const BQ4_1*>(p);
    const float d = half(b->d), m = half(b->m);
    for (int i = 0; i < 32; ++i) y[i] = d * float(nibble(b->qs, i)) + m;
  }
};
template <> struct Format<Q5_0> {
  static constexpr int QK = 32, BYTES = 22;
  static void values(const void* p, float* y) {
    const auto* b = static_cast<const BQ5_0*>(p);
    const float d = half(b->d);
    for (int i = 0; i < 32; ++i) y[i] = d * float((nibble(b->qs, i) | bit(b->qh, i) << 4) - 16);
  }
};
template <> struct Format<Q5_1> {
  static constexpr int QK = 32, BYTES = 24;
  static void values(const void* p, float* y) {
    const auto* b = static_cast<const BQ5_1*>(p);
    const float d = half(b->d), m = half(b->m);
    for (int i = 0; i < 32; ++i) y[i] = d * float(nibble(b->qs, i) | bit(b->qh, i) << 4) + m;
  }
};
template <> struct Format<Q8_0> {
  static constexpr int QK = 32, BYTES = 34;
  static void values(const void* p, float* y) {
    const auto* b = static_cast<const BQ8_0*>(p);
    const float d = half(b->d);
    for (int i = 0; i < 32; ++i) y[i] = d * float(b->qs[i]);
  }
};
// Q4_K and Q5_K differ only in q's fifth bit.
template <class B, bool FIVE>
static void k_values(const B* b, const uint8_t* qh, float* y) {
  const float d = half(b->d), dmin = half(b->dmin);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min(b->scales, j, sc, mn);
    const float scale = d * float(sc), offset = dmin * float(mn);
    const uint8_t* qs = b->qs + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) {
      const int q = (j % 2 ? qs[l] >> 4 : qs[l] & 15) | (FIVE ? ((qh[l] >> j) & 1) << 4 : 0);
      y[32 * j + l] = scale * float(q) - offset;
    }
  }
}
template <> struct Format<Q4_K> {
  static constexpr int QK = 256, BYTES = 144;
  static void values(const void* p, float* y) { k_values<BQ4_K, false>(static_cast<const BQ4_K*>(p), nullptr, y); }
};
template <> struct Format<Q5_K> {
  static constexpr int QK = 256, BYTES = 176;
  static void values(const void* p, float* y) {
    const auto* b = static_cast<const BQ5_K*>(p);
    k_values<BQ5_K, true>(b, b->qh, y);
  }
};
template <> struct Format<Q6_K> {
  static constexpr int QK = 256, BYTES = 210;
  static void values(const void* p, float* y) {
    const auto* b = static_cast<const BQ6_K*>(p);
    const float d = half(b->d);
    for (int i = 0; i < 256; ++i) {
      const int h = i / 128, t = (i % 128) / 32, l = i % 32;
      const uint8_t low = b->ql[64 * h + 32 * (t % 2) + l];
      const int q = ((t < 2 ? low & 15 : low >> 4) | ((b->qh[32 * h + l] >> (2 * t)) & 3) << 4) - 32;
      y[i] = d * float(b->scales[i / 16]) * float(q);
    }
  }
};

// Calls fn(Format<T>{}) for a run-time type id; returns false for a type this file does not know.
template <typename Fn>
static bool with_format(int type, Fn fn) {
  switch (type) {
    case Q4_0: fn(Format<Q4_0>{}); return true;
    case Q4_1: fn(Format<Q4_1>{}); return true;
    case Q5_0: fn(Format<Q5_0>{}); return true;
    case Q5_1: fn(Format<Q5_1>{}); return true;
    case Q8_0: fn(Format<Q8_0>{}); return true;
    case Q4_K: fn(Format<Q4_K>{}); return true;
    case Q5_K: fn(Format<Q5_K>{}); return true;
    case Q6_K: fn(Format<Q6_K>{}); return true;
    default: return false;
  }
}

}  // namespace blocks
