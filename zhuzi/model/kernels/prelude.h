// What every kernel includes: which variant this build is (native.py compiles each source once per
// variant, with that variant's flags), float vectors of its native width, fused multiply-adds, a horizontal
// sum, bf16 and fp16 <-> float.
//
//   ZHUZI_AVX512  x86-64-v4 + AVX512-BF16/VNNI/VBMI   VL = 16 floats a vector
//   ZHUZI_AVX2    x86-64-v3 (AVX2, FMA, F16C)          VL = 8   (ZHUZI_AVXVNNI: + AVX-VNNI)
//   ZHUZI_NEON    armv8.2-a + dotprod                  VL = 4   (ZHUZI_I8MM: + i8mm)
//
// A source picks its code with these macros; an entry point returns 2 for what its build does not serve.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) \
    && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define ZHUZI_AVX512 1
#define ZHUZI_VARIANT "avx512"
#include <immintrin.h>
constexpr int VEC_BYTES = 64;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ZHUZI_AVX2 1
#include <immintrin.h>
#if defined(__AVXVNNI__)
#define ZHUZI_AVXVNNI 1
#define ZHUZI_VARIANT "avx2-vnni"
#else
#define ZHUZI_VARIANT "avx2"
#endif
constexpr int VEC_BYTES = 32;
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define ZHUZI_NEON 1
#include <arm_neon.h>
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define ZHUZI_I8MM 1
#define ZHUZI_VARIANT "neon-i8mm"
#else
#define ZHUZI_VARIANT "neon"
#endif
constexpr int VEC_BYTES = 16;
#else
#error "zhuzi's kernels are built per variant with native.py's flags (avx512, avx2, avx2-vnni, neon, neon-i8mm)"
#endif

constexpr int VL = VEC_BYTES / 4;  // floats a vector
typedef float vf __attribute__((vector_size(VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(VEC_BYTES)));

static inline vf load_vf(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store_vf(vf v, float* p) { std::memcpy(p, &v, sizeof v); }
static inline vf splat(float x) {  // a broadcast: vf{} + x costs an add of 0 (kept: it turns -0 into +0) too
#if ZHUZI_AVX512
  return (vf)_mm512_set1_ps(x);
#elif ZHUZI_AVX2
  return (vf)_mm256_set1_ps(x);
#else
  return (vf)vdupq_n_f32(x);
#endif
}

// a * b + c rounded once: every multiply-add of the kernels goes through these. native.py builds with
// -ffp-contract=off, so the compiler never fuses a multiply and an add by itself: left to it, whether a
// statement became an FMA depended on its tuning and on the function it was inlined into, and the same
// row could get other bits alone than in a batch.
static inline vf fmadd(vf a, vf b, vf c) {
#if ZHUZI_AVX512
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif ZHUZI_AVX2
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#endif
}
static inline float fmadd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }  // one instruction

// Pairwise halving: the same order of additions on every call.
static inline float hsum(vf v) {
  typedef float v4 __attribute__((vector_size(16)));
  v4 q;
#if ZHUZI_AVX512
  typedef float v8 __attribute__((vector_size(32)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  q = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif ZHUZI_AVX2
  q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
  q = v;
#endif
  return (q[0] + q[2]) + (q[1] + q[3]);
}

static inline float widen(uint16_t b) { uint32_t u = uint32_t(b) << 16; float x; std::memcpy(&x, &u, 4); return x; }
static inline void store(float x, float* p) { *p = x; }
static inline void store(float x, uint16_t* p) {  // round to nearest even; a NaN stays a NaN
  uint32_t u; std::memcpy(&u, &x, 4);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  *p = nan ? uint16_t((u >> 16) | 0x40) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// IEEE half -> float (the tiles' scales), exact for every value.
static inline float half_to_float(uint16_t h) {
#if ZHUZI_NEON
  __fp16 v; std::memcpy(&v, &h, 2); return float(v);
#else
  return _cvtsh_ss(h);
#endif
}

// The lanes rounded to the nearest integer, ties to even: std::nearbyint in the default rounding mode.
static inline vi round_to_int(vf x) {
#if ZHUZI_AVX512
  return (vi)_mm512_cvtps_epi32((__m512)x);
#elif ZHUZI_AVX2
  return (vi)_mm256_cvtps_epi32((__m256)x);
#else
  return (vi)vcvtnq_s32_f32((float32x4_t)x);
#endif
}

// e^x for softmax, in vectors (glibc's vector expf is not on every target, aarch64 Debian 12 has none):
// x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' polynomial (about 1 ulp), 2^n into the exponent.
// Below -87.3 (and -inf) it is 0, as a masked score needs.
static inline vf vexp(vf x) {
  const vf lo = splat(-87.33f), hi = splat(88.37f);
  const vf c = x < lo ? lo : x > hi ? hi : x;
  const vf halfway = c < 0 ? splat(-0.5f) : splat(0.5f);
  const vi n = __builtin_convertvector(fmadd(c, splat(1.44269504088896341f), halfway), vi);  // rounded
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = fmadd(nf, splat(2.12194440e-4f), fmadd(nf, splat(-0.693359375f), c));
  vf p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  const vf e = fmadd(p * r, r, r) + 1.f;
  const vf scaled = (vf)((vi)e + (n << 23));
  return x < lo ? vf{} : scaled;
}
static inline float scalar_exp(float x) { return vexp(splat(x))[0]; }
