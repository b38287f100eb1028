// int8.h in portable C++: each lane's 4 byte products summed in plain int32 arithmetic, the reference the
// dot-product instructions of the other variants compute.
#pragma once

namespace i8 {

using I32 = vi;
typedef int8_t B8 __attribute__((vector_size(16)));
constexpr int LANES = 4;
constexpr bool EXACT_U8 = true;  // int32 sums of byte products are exact for any operands

static inline B8 load_b8(const void* p) { B8 v; std::memcpy(&v, p, sizeof v); return v; }
static inline I32 zero() { return I32{}; }
static inline vf to_float(I32 v) { return __builtin_convertvector(v, vf); }

// acc[l] += the 4 products of lane l's bytes, a read as unsigned where A_UNSIGNED. Out of line: inlined into
// the kernels' unrolled loops at every call, it doubled the variant's build time (the reference, not a fast path).
template <bool A_UNSIGNED>
__attribute__((noinline)) static I32 dot(I32 acc, B8 a, B8 b) {
  for (int l = 0; l < LANES; ++l)
    for (int i = 0; i < 4; ++i) acc[l] += (A_UNSIGNED ? int32_t(uint8_t(a[4 * l + i])) : a[4 * l + i]) * b[4 * l + i];
  return acc;
}
static inline I32 dot_u8s8(I32 acc, B8 u, B8 s) { return dot<true>(acc, u, s); }
static inline I32 dot_s8s8(I32 acc, B8 a, B8 b) { return dot<false>(acc, a, b); }
static inline B8 table16(const int8_t* t) { return load_b8(t); }
static inline B8 look_up(B8 table, B8 idx) {
  B8 v;
  for (int i = 0; i < 4 * LANES; ++i) v[i] = table[idx[i] & 15];
  return v;
}
static inline I32 dot_u8s8_at(I32 acc, B8 u, const void* p) {
  int32_t s;
  std::memcpy(&s, p, 4);
  return dot_u8s8(acc, u, (B8)(I32{} + s));
}

}  // namespace i8
