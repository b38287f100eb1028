// Helpers every kernel uses: 16-float vectors, a horizontal sum, bf16 <-> float.
#pragma once
#include <cstdint>
#include <cstring>

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));

static inline float hsum(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  typedef float v2 __attribute__((vector_size(8)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
       + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  v2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

static inline float widen(uint16_t b) { uint32_t u = uint32_t(b) << 16; float x; std::memcpy(&x, &u, 4); return x; }
static inline void store(float x, float* p) { *p = x; }
static inline void store(float x, uint16_t* p) {  // round to nearest even; a NaN stays a NaN
  uint32_t u; std::memcpy(&u, &x, 4);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  *p = nan ? uint16_t((u >> 16) | 0x40) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
