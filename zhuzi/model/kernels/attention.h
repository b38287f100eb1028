// Paged attention of one query token over its history, online softmax over slabs of positions: the
// inner loop of the decode attention kernel and of the fused decode step (see cpu_attention.py).
#pragma once
#include "kv_rows.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

constexpr int SLAB = 32;           // positions scored before their values are summed
constexpr int AHEAD_BYTES = 3072;  // K+V bytes prefetched ahead: slot rows are scattered, so
                                   // the hardware prefetcher cannot see the next one coming
constexpr int MAXH = 128;          // heads per row
constexpr int MAXHD = 8192;        // heads * head_dim per row

// A row of D values as NV float vectors. bf16 pairs are split into even and odd elements (a shift
// and a mask per 2 VL values, no shuffles); queries, keys, values and outputs all share that order.
static inline void load_row(const float* p, vf* out, int nv) {
  for (int j = 0; j < nv; ++j) out[j] = load_vf(p + j * VL);
}
static inline void load_row(const uint16_t* p, vf* out, int nv) {
  for (int j = 0; j < nv; j += 2) {
    vu u; std::memcpy(&u, p + j * VL, sizeof u);
    out[j] = (vf)(u << 16);
    out[j + 1] = (vf)(u & 0xffff0000u);
  }
}
static inline int element(const float*, int j, int i) { return j * VL + i; }
static inline int element(const uint16_t*, int j, int i) { return (j & ~1) * VL + 2 * i + (j & 1); }
static inline int element(const uint8_t*, int j, int i) { return j * VL + i; }

// A query row in the element order of the keys it meets (bf16 keys split, float and q8_0 keys in order).
template <typename TKV, typename TQ>
static inline void load_row_as(const TQ* p, vf* out, int nv) {
  if constexpr (std::is_same_v<TKV, TQ>) {
    load_row(p, out, nv);
  } else {
    for (int j = 0; j < nv; ++j)
      for (int i = 0; i < VL; ++i) out[j][i] = value(p[element((const TKV*)nullptr, j, i)]);
  }
}

// The largest divisor of n up to most.
constexpr int largest_divisor(int n, int most) {
  while (n % most) --most;
  return most;
}

// One sequence, query heads h0 .. h1 - 1 of H (q and out point at the sequence's head 0). A slot's row
// holds every kv head side by side; the kv heads of the range are read together, which keeps the reads
// contiguous when the range is all heads. A head's arithmetic does not depend on the range.
// Queries and outputs are TQ (float or bf16), keys and values TKV (float, bf16 or q8_0).
//
// A slab's K and V rows of a kv head are widened to float once for all of its query heads. A head scores
// KEYS keys at a time, each key's dot product its own chain of FMAs: one chain at a time waited out an FMA's
// latency per vector, where KEYS chains keep both FMA ports busy. Each key's sum is the same chain as alone,
// so the bits do not depend on how many keys a slab holds.
//
// sinks (null for none): a learned logit per query head (gpt-oss's attention sinks) that joins each head's
// softmax denominator and adds no value: the head may give its keys less than all of its attention.
template <typename TQ, typename TKV, int D>
static void attend(const TQ* q, const TKV* kc, const TKV* vc, const int64_t* slots, int64_t len, TQ* out,
                   int h0, int h1, int H, int KV, int64_t nslots, float scale, const float* sinks, int* bad) {
  // SUMS: output vectors summed in registers at once; 16 of them and a broadcast overflowed AVX2's 16, and the
  // two spilled sums' store and reload went into every key's chain.
  constexpr int NV = D / VL, KEYS = 8, SUMS = largest_divisor(NV, VREGS / 2);
  static_assert(D % (2 * VL) == 0, "bf16 rows are read 2 VL values at a time");
  static_assert(SLAB % KEYS == 0, "a slab's keys are scored KEYS at a time");
  const int QPK = H / KV, kv0 = h0 / QPK, kv1 = (h1 - 1) / QPK + 1;
  constexpr int64_t W = head_width<TKV>(D);
  const int64_t row = int64_t(KV) * W, span = int64_t(kv1 - kv0) * W * sizeof(TKV);
  const int ahead = std::clamp(AHEAD_BYTES / int(2 * span), 1, SLAB);
  vf qv[MAXHD / VL], acc[MAXHD / VL];
  alignas(64) float s[MAXH][SLAB];
  alignas(64) vf kw[SLAB][NV], vw[SLAB][NV];  // a slab's rows of one kv head, widened
  float m[MAXH], l[MAXH], alpha[MAXH];
  for (int h = h0; h < h1; ++h) {
    load_row_as<TKV>(q + h * D, qv + h * NV, NV);
    for (int j = 0; j < NV; ++j) { qv[h * NV + j] *= scale; acc[h * NV + j] = vf{}; }
    m[h] = -INFINITY; l[h] = 0.f;
  }
  for (int64_t t0 = 0; t0 < len; t0 += SLAB) {
    const int n = int(std::min<int64_t>(SLAB, len - t0)), keys = (n + KEYS - 1) / KEYS * KEYS;
    int64_t off[SLAB];
    for (int t = 0; t < n; ++t) {
      const int64_t sl = slots[t0 + t];
      if (sl < 0 || sl >= nslots) { *bad = 1; off[t] = 0; } else off[t] = sl * row;
      if (t0 + t + ahead < len) {
        const int64_t o = std::clamp<int64_t>(slots[t0 + t + ahead], 0, nslots - 1) * row;
        const char* kr = reinterpret_cast<const char*>(kc + o + kv0 * W);
        const char* vr = reinterpret_cast<const char*>(vc + o + kv0 * W);
        for (int64_t i = 0; i < span; i += 64) {
          __builtin_prefetch(kr + i);
          __builtin_prefetch(vr + i);
        }
      }
    }
    for (int kh = kv0; kh < kv1; ++kh) {
      for (int t = 0; t < n; ++t) {
        load_row(kc + off[t] + kh * W, kw[t], NV);
        load_row(vc + off[t] + kh * W, vw[t], NV);
      }
      for (int t = n; t < keys; ++t)  // scored with the others, never read
        for (int j = 0; j < NV; ++j) kw[t][j] = vf{};
      for (int h = std::max(kh * QPK, h0); h < std::min((kh + 1) * QPK, h1); ++h) {
        for (int t = 0; t < keys; t += KEYS) {
          vf d[KEYS];
          for (int i = 0; i < KEYS; ++i) d[i] = qv[h * NV] * kw[t + i][0];
          for (int j = 1; j < NV; ++j) {
            vf qj = qv[h * NV + j];
            in_register(qj);
            for (int i = 0; i < KEYS; ++i) d[i] = fmadd(qj, kw[t + i][j], d[i]);
          }
          for (int i = 0; i < KEYS; ++i) s[h][t + i] = hsum(d[i]);
        }
        // online softmax: rescale what came before to the new max
        float mx = m[h];
        for (int t = 0; t < n; ++t) mx = std::max(mx, s[h][t]);
        for (int t = n; t < (n + VL - 1) / VL * VL; ++t) s[h][t] = -INFINITY;
        vf sum = vf{};
        for (int t = 0; t < n; t += VL) {
          const vf p = vexp(load_vf(&s[h][t]) - mx);
          store_vf(p, &s[h][t]);
          sum += p;
        }
        alpha[h] = scalar_exp(m[h] - mx);
        l[h] = fmadd(l[h], alpha[h], hsum(sum));
        m[h] = mx;
        for (int j0 = 0; j0 < NV; j0 += SUMS) {  // SUMS of the head's output vectors at a time, in registers
          vf a[SUMS];
          for (int j = 0; j < SUMS; ++j) a[j] = acc[h * NV + j0 + j] * alpha[h];
          for (int t = 0; t < n; ++t)
            for (int j = 0; j < SUMS; ++j) a[j] = fmadd(splat(s[h][t]), vw[t][j0 + j], a[j]);
          for (int j = 0; j < SUMS; ++j) acc[h * NV + j0 + j] = a[j];
        }
      }
    }
  }
  for (int h = h0; h < h1; ++h) {
    const float denominator = sinks ? l[h] + scalar_exp(sinks[h] - m[h]) : l[h];
    for (int j = 0; j < NV; ++j) {
      const vf o = acc[h * NV + j] / denominator;
      for (int i = 0; i < VL; ++i) store(o[i], out + h * D + element(kc, j, i));
    }
  }
}
