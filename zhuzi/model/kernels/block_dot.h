// The dot product of a GGUF block row (blocks.h) with a q8 activation row (q8.h): the numerics every block
// kernel (block_decode.h, block_prefill.h, arch/x86/amx/block_prefill.h; every variant) reproduces bit for bit,
// and row(), the plain scalar reference the kernels' C++ tests hold them to.
//
// Every path first computes exact int32 sums s of code products per sub-block of SUB inputs; how it gets them (dot
// lanes, reductions, AMX tiles) cannot change a bit. What follows is fixed here:
//
// - 32-blocks (activations quantized per 32): per sub-block, acc += s (a d) + b (d sum), block_prefill::accumulate().
// - K-quants (activations quantized per 256, q8.h's span, as llama.cpp's q8_K): the sub-block scales are
//   applied as integers, is = sum_g sc_g s_g, Q6_K taking its -32 off through the activations' code sums
//   (s_g - 32 sum_g; Q3_K its -4 alike), and the minimums meet those sums too, im = sum_j mn_j sum_j (per 32
//   inputs for Q4_K / Q5_K, per 16 for Q2_K). A super-block of 256 inputs
//   then costs one float multiply-add, two with minimums: super(). |is| < 2^29 for any codes: no overflow.
#pragma once
#include "blocks.h"
#include "q8.h"

namespace block_dot {

static inline float to_f(int32_t v) { return float(v); }
static inline vf to_f(vi v) { return __builtin_convertvector(v, vf); }

// Sub-block g's exact sum s into its super-block's integer sum is: sc s, less OFF sc times the activation codes'
// sum over the sub-block (xsum). On int32 or on vectors of them (a lane per weight row).
template <class F, class I>
static inline I sub_block(I is, I s, I sc, int32_t xsum) {
  if constexpr (F::OFF) s = s - F::OFF * xsum;
  return is + sc * s;
}

// The activation codes' sum over sub-block g of a super-block whose q8 blocks start at x.
template <class F>
static inline int32_t sub_block_sum(const q8::Block* x, int g) {
  const q8::Block& b = x[g * F::SUB / 32];
  return F::SUB == 16 ? b.sum[g % 2] : b.sum[0] + b.sum[1];
}

// The super-block's float part: acc + is (d dx) - im (dmin dx), with dx the activations' scale; wd = d dx and
// wm = -(dmin dx) as the caller rounded them.
template <class F, class T, class I>
static inline T super(T acc, I is, I im, T wd, T wm) {
  acc = fmadd(to_f(is), wd, acc);
  if constexpr (F::MIN) acc = fmadd(to_f(im), wm, acc);
  return acc;
}

// A row of K inputs (blocks at w) against a q8 row (x, with its q8::Rows::sums() ds): the reference, one
// input at a time. x must be quantized per 256 inputs for K-quants (q8::Rows span 256).
template <class F>
static float row(const uint8_t* w, const q8::Block* x, const q8::Sums* ds, int64_t K) {
  constexpr int SUBS = F::QK / F::SUB;
  float acc = 0.f;
  for (int64_t blk = 0; blk < K / F::QK; ++blk) {
    const uint8_t* p = w + blk * F::BYTES;
    const q8::Block* xb = x + blk * (F::QK / 32);
    uint8_t q[F::QK];
    float a[SUBS], b[SUBS];
    F::decode(p, q, a, b);
    int32_t s[SUBS] = {};
    for (int i = 0; i < F::QK; ++i)
      s[i / F::SUB] += (F::SIGNED ? int32_t(int8_t(q[i])) : int32_t(q[i])) * xb[i / 32].q[i % 32];
    if constexpr (F::QK == 256) {
      int32_t sc[16], mn[16], is = 0, im = 0;
      float d, dmin;
      F::ints(p, sc, mn, d, dmin);
      for (int g = 0; g < SUBS; ++g) is = sub_block<F>(is, s[g], sc[g], sub_block_sum<F>(xb, g));
      if constexpr (F::MIN)
        for (int j = 0; j < SUBS; ++j) im += mn[j] * sub_block_sum<F>(xb, j);
      acc = super<F>(acc, is, im, d * xb[0].d, -(dmin * xb[0].d));
    } else {  // block_prefill::accumulate(), one lane
      const float d = xb[0].d, dsum = ds[blk][2];
      if constexpr (F::MIN) acc = acc + fmadd(float(s[0]), a[0] * d, b[0] * dsum);
      else if constexpr (F::OFF) acc = acc + fmadd(float(s[0]), a[0] * d, a[0] * (-float(F::OFF) * dsum));
      else acc = fmadd(float(s[0]), a[0] * d, acc);
    }
  }
  return acc;
}

}  // namespace block_dot
