// The kernels' own unit tests: a test is a function registered with TEST; CHECK reports a failure with
// its values and goes on; main() runs every test (or those whose name contains argv[1]) and exits 1 if
// any check failed. Helpers: a seeded generator, bf16 rounding, and the float64 references' error bound.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "api.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace check {

struct Test { const char* name; std::function<void()> fn; };
inline std::vector<Test>& tests() { static std::vector<Test> all; return all; }
inline int& failures() { static int n = 0; return n; }
inline const char*& current() { static const char* name = ""; return name; }

struct Register { Register(const char* name, std::function<void()> fn) { tests().push_back({name, fn}); } };

inline void fail(const char* file, int line, const char* fmt, ...) {
  if (++failures() > 50) return;  // the first ones say enough
  std::fprintf(stderr, "FAIL %s (%s:%d): ", current(), file, line);
  va_list args;
  va_start(args, fmt);
  std::vfprintf(stderr, fmt, args);
  va_end(args);
  std::fputc('\n', stderr);
}

// A fixed stream of numbers (xorshift64*): the same problem on every machine and variant.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 2654435761u + 1) {}
  uint64_t next() { s ^= s >> 12; s ^= s << 25; s ^= s >> 27; return s * 2685821657736338717ull; }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {  // Box-Muller
    const double u = uniform() + 1e-300, v = uniform();
    return std::sqrt(-2 * std::log(u)) * std::cos(6.283185307179586 * v);
  }
  int below(int n) { return int(next() % uint64_t(n)); }
};

inline uint16_t bf16(float x) {  // round to nearest even
  uint32_t u; std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float from_bf16(uint16_t b) { uint32_t u = uint32_t(b) << 16; float x; std::memcpy(&x, &u, 4); return x; }

// The largest |a - b| over n values, and the largest |b|: kernels are held to a bound relative to the
// largest output, which float32 sums over K products and one output rounding stay within.
struct Error { double worst = 0, scale = 0; int at = -1; };
template <typename A>
inline Error compare(const A* got, const double* want, int64_t n, double (*value)(A)) {
  Error e;
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::fabs(value(got[i]) - want[i]);
    if (!(d <= e.worst)) { e.worst = d; e.at = int(i); }  // NaN counts as the worst
    e.scale = std::fmax(e.scale, std::fabs(want[i]));
  }
  return e;
}
inline double of_float(float x) { return x; }
inline double of_bf16(uint16_t x) { return from_bf16(x); }

// IEEE half <-> float, round to nearest even (the blocks' scales).
inline uint16_t half(float x) {
#if defined(__aarch64__)
  __fp16 h = __fp16(x); uint16_t u; std::memcpy(&u, &h, 2); return u;
#elif defined(__F16C__)
  return _cvtss_sh(x, 0);
#else  // the generic build: from the definition, in double (finite values)
  const double a = std::fabs(double(x));
  const int step = std::max(std::ilogb(a), -14) - 10;  // a half's spacing at a: 2^step
  const double m = std::ldexp(std::nearbyint(std::ldexp(a, -step)), step);  // a rounded to it, ties to even
  const int e = std::ilogb(m);
  const uint16_t bits = m > 65504.0 ? 0x7c00                             // beyond the largest half: infinity
                        : m < 0x1p-14 ? uint16_t(m * 0x1p24)             // subnormal: a count of 2^-24
                        : uint16_t((e + 15) << 10 | (int(std::ldexp(m, 10 - e)) & 0x3ff));
  return uint16_t(bits | (std::signbit(x) ? 0x8000 : 0));
#endif
}
inline float from_half(uint16_t u) {
#if defined(__aarch64__)
  __fp16 h; std::memcpy(&h, &u, 2); return float(h);
#elif defined(__F16C__)
  return _cvtsh_ss(u);
#else  // the generic build: from the definition (finite values)
  const int e = (u >> 10) & 31, m = u & 0x3ff;
  const double a = e ? std::ldexp(1024 + m, e - 25) : std::ldexp(m, -24);
  return float(u & 0x8000 ? -a : a);
#endif
}

// How far a dot product of w[0..K) with x[0..K) moves when x is rounded to q8 codes (kernels/q8.h), one scale
// per `span` inputs (32, or 256 for the K-quants): half a step (amax / 254) per span, times the span's |w|.
inline double q8_bound(const float* x, const double* w, int64_t K, int64_t span = 32) {
  double bound = 0;
  for (int64_t k0 = 0; k0 < K; k0 += span) {
    double amax = 0, wsum = 0;
    for (int64_t k = k0; k < std::min<int64_t>(K, k0 + span); ++k)
      amax = std::fmax(amax, std::fabs(x[k])), wsum += std::fabs(w[k]);
    bound += amax / 254 * wsum;
  }
  return bound * (1 + 1e-6);
}

}  // namespace check

#define CHECK_CAT(a, b) a##b
#define CHECK_NAME(a, b) CHECK_CAT(a, b)
#define TEST(name) \
  static void name(); \
  static check::Register CHECK_NAME(register_, name)(#name, name); \
  static void name()
#define CHECK(cond, ...) \
  do { if (!(cond)) check::fail(__FILE__, __LINE__, __VA_ARGS__); } while (0)
// got within bound * (largest |want|) of want, elementwise.
#define CHECK_CLOSE(err, bound, ...) \
  CHECK((err).worst <= (bound) * (err).scale, "error %.3g > %.3g x %.3g at %d: " __VA_ARGS__, (err).worst, \
        double(bound), (err).scale, (err).at)
