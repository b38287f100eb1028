// What every kernel includes: which variant this build is (native.py compiles each source once per
// variant, with that variant's flags), float vectors of its native width, fused multiply-adds, a horizontal
// sum, bf16 and fp16 <-> float.
//
//   ZHUZI_AVX512  x86-64-v4 + AVX512-BF16/VNNI/VBMI   VL = 16 floats a vector
//   ZHUZI_AVX2    x86-64-v3 (AVX2, FMA, F16C)          VL = 8   (ZHUZI_AVXVNNI: + AVX-VNNI)
//   ZHUZI_NEON    armv8.2-a + dotprod                  VL = 4   (ZHUZI_I8MM: + i8mm)
//   ZHUZI_GENERIC portable C++ (any CPU)              VL = 4   GCC vectors and scalar loops, no intrinsics:
//                                                              the plain reference, not a fast path
//
// A source picks its code with these macros; an entry point returns 2 for what its build does not serve.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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
#define ZHUZI_GENERIC 1
#define ZHUZI_VARIANT "generic"
#include <cmath>
constexpr int VEC_BYTES = 16;
#endif

constexpr int VL = VEC_BYTES / 4;  // floats a vector
#if ZHUZI_AVX512 || ZHUZI_NEON
constexpr int VREGS = 32;  // vector registers: how many sums a loop can keep without spilling
#else
constexpr int VREGS = 16;
#endif
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
#elif ZHUZI_NEON
  return (vf)vdupq_n_f32(x);
#else
  return vf{x, x, x, x};
#endif
}

// v stays in a register from here on: GCC otherwise folds a value that a loop reuses into every instruction
// that reads it, one load per use, and the loads then bound the loop.
template <class T>
static inline void in_register(T& v) {
#if ZHUZI_EMULATED || !(defined(__x86_64__) || defined(__aarch64__))
  (void)v;  // an emulated 512-bit vector is no register
#elif defined(__AVX512F__)
  __asm__("" : "+v"(v));
#elif defined(__x86_64__)
  __asm__("" : "+x"(v));
#else
  __asm__("" : "+w"(v));
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
#elif ZHUZI_NEON
  return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
  for (int l = 0; l < VL; ++l) c[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return c;
#endif
}
static inline float fmadd(float a, float b, float c) { return __builtin_fmaf(a, b, c); }  // one instruction

#if ZHUZI_AVX512
// acc += w . (the bf16 pair at p, broadcast to every lane): vdpbf16ps with the broadcast folded into the
// instruction, which GCC does not do by itself (a separate broadcast per product costs as many uops as the
// product). An emulated build (tests/kernels/emulate.h) has no 512-bit registers for asm operands.
static inline __m512 dot_bf16_pair(__m512 acc, __m512i w, const void* p) {
#if ZHUZI_EMULATED
  int32_t pair;
  std::memcpy(&pair, p, 4);
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
#else
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*static_cast<const int32_t*>(p)));
  return acc;
#endif
}
#endif

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
#else  // NEON, generic: VL = 4
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

// v made at least n long, never shorter: buffers refilled on every call (a decode step's inputs, whose width
// changes from matrix to matrix) keep their memory, and growing back is not zero-filling again.
template <typename T>
static inline void at_least(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// fn(std::integral_constant<int, N>{}) for a run-time count of rows 1 <= n <= MAX (N = MAX from there on): the
// kernels unroll their loops over a pass's rows at compile time.
template <int MAX, typename Fn>
static inline auto with_rows(int64_t n, Fn fn) {
  if constexpr (MAX > 1)
    if (n < MAX) return with_rows<MAX - 1>(n, fn);
  return fn(std::integral_constant<int, MAX>{});
}

static inline uint32_t to_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
static inline float from_bits(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// IEEE half -> float (the quant units' scales), exact for every value.
static inline float half_to_float(uint16_t h) {
#if ZHUZI_NEON
  __fp16 v; std::memcpy(&v, &h, 2); return float(v);
#elif ZHUZI_GENERIC
  // Exponent and mantissa moved into a float's fields and scaled by 2^(127 - 15): exact, subnormals included
  // (they become normal floats); an all-ones exponent (infinity, NaN) stays all ones.
  const uint32_t magnitude = uint32_t(h & 0x7fffu) << 13, sign = uint32_t(h & 0x8000u) << 16;
  const float x = (h & 0x7c00u) == 0x7c00u ? from_bits(0x7f800000u | magnitude) : from_bits(magnitude) * 0x1p112f;
  return from_bits(to_bits(x) | sign);
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
#elif ZHUZI_NEON
  return (vi)vcvtnq_s32_f32((float32x4_t)x);
#else
  vi n;
  for (int l = 0; l < VL; ++l) n[l] = int32_t(std::nearbyint(x[l]));
  return n;
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
