// Paged decode attention over the KV pool; see cpu_attention.py for the design.
#include "prelude.h"

#include <algorithm>
#include <cmath>

// glibc declares libmvec's vector expf only under -ffast-math; declaring it here lets the softmax
// loop use it without fast-math's other licences (which would break the -inf start of the max).
extern "C" __attribute__((simd("notinbranch"))) float expf(float) noexcept;

constexpr int TILE = 32;           // positions scored before their values are summed
constexpr int AHEAD_BYTES = 3072;  // K+V bytes prefetched ahead: slot rows are scattered, so
                                   // the hardware prefetcher cannot see the next one coming
constexpr int MAXH = 128;          // heads per row
constexpr int MAXHD = 8192;        // heads * head_dim per row

// A row of D values as NV float vectors. bf16 pairs are split into even and odd elements (a shift
// and a mask per 32 values, no shuffles); queries, keys, values and outputs all share that order.
static inline void load_row(const float* p, vf* out, int nv) {
  for (int j = 0; j < nv; ++j) std::memcpy(&out[j], p + j * 16, 64);
}
static inline void load_row(const uint16_t* p, vf* out, int nv) {
  for (int j = 0; j < nv; j += 2) {
    vu u; std::memcpy(&u, p + j * 16, 64);
    out[j] = (vf)(u << 16);
    out[j + 1] = (vf)(u & 0xffff0000u);
  }
}
static inline int element(const float*, int j, int i) { return j * 16 + i; }
static inline int element(const uint16_t*, int j, int i) { return (j & ~1) * 16 + 2 * i + (j & 1); }

// One sequence, all heads: a slot's row holds every kv head side by side, so reading rows whole
// keeps the reads contiguous.
template <typename T, int NV>
static void attend(const T* q, const T* kc, const T* vc, const int64_t* slots, int64_t len, T* out,
                   int H, int KV, int64_t nslots, float scale, int* bad) {
  constexpr int D = NV * 16;
  const int G = H / KV;
  const int64_t row = int64_t(KV) * D;
  const int ahead = std::clamp(AHEAD_BYTES / int(2 * row * sizeof(T)), 1, TILE);
  vf qv[MAXHD / 16], acc[MAXHD / 16];
  alignas(64) float s[MAXH][TILE];
  float m[MAXH], l[MAXH], alpha[MAXH];
  for (int h = 0; h < H; ++h) {
    load_row(q + h * D, qv + h * NV, NV);
    for (int j = 0; j < NV; ++j) { qv[h * NV + j] *= scale; acc[h * NV + j] = vf{}; }
    m[h] = -INFINITY; l[h] = 0.f;
  }
  for (int64_t t0 = 0; t0 < len; t0 += TILE) {
    const int n = int(std::min<int64_t>(TILE, len - t0));
    int64_t off[TILE];
    for (int t = 0; t < n; ++t) {
      const int64_t sl = slots[t0 + t];
      if (sl < 0 || sl >= nslots) { *bad = 1; off[t] = 0; } else off[t] = sl * row;
    }
    for (int t = 0; t < n; ++t) {
      if (t0 + t + ahead < len) {
        const int64_t o = std::clamp<int64_t>(slots[t0 + t + ahead], 0, nslots - 1) * row;
        const char* kr = reinterpret_cast<const char*>(kc + o);
        const char* vr = reinterpret_cast<const char*>(vc + o);
        for (int64_t i = 0; i < row * int64_t(sizeof(T)); i += 64) {
          __builtin_prefetch(kr + i);
          __builtin_prefetch(vr + i);
        }
      }
      for (int kh = 0; kh < KV; ++kh) {
        vf k[NV];
        load_row(kc + off[t] + kh * D, k, NV);
        for (int h = kh * G; h < (kh + 1) * G; ++h) {
          vf d = qv[h * NV] * k[0];
          for (int j = 1; j < NV; ++j) d += qv[h * NV + j] * k[j];
          s[h][t] = hsum(d);
        }
      }
    }
    for (int h = 0; h < H; ++h) {  // online softmax: rescale what came before to the new max
      float mx = m[h], sum = 0.f;
#pragma omp simd reduction(max:mx)
      for (int t = 0; t < n; ++t) mx = std::max(mx, s[h][t]);
#pragma omp simd reduction(+:sum)
      for (int t = 0; t < n; ++t) { s[h][t] = expf(s[h][t] - mx); sum += s[h][t]; }
      alpha[h] = expf(m[h] - mx);
      l[h] = l[h] * alpha[h] + sum;
      m[h] = mx;
    }
    for (int h = 0; h < H; ++h) {  // head-outer keeps the accumulator in registers; the tile's
      vf a[NV];                    // value rows are in L1 after the first head reads them
      for (int j = 0; j < NV; ++j) a[j] = acc[h * NV + j] * alpha[h];
      for (int t = 0; t < n; ++t) {
        vf v[NV];
        load_row(vc + off[t] + (h / G) * D, v, NV);
        for (int j = 0; j < NV; ++j) a[j] += s[h][t] * v[j];
      }
      for (int j = 0; j < NV; ++j) acc[h * NV + j] = a[j];
    }
  }
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < NV; ++j) {
      const vf o = acc[h * NV + j] / l[h];
      for (int i = 0; i < 16; ++i) store(o[i], out + h * D + element(out, j, i));
    }
}

template <typename T, int NV>
static int run(const void* q, const void* kc, const void* vc, const int64_t* slots, const int64_t* lens,
               void* out, int64_t B, int64_t W, int H, int KV, int64_t nslots, float scale, int threads) {
  const int64_t stride = int64_t(H) * NV * 16;
  int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t b = 0; b < B; ++b) {
    if (lens[b] < 1 || lens[b] > W) { bad = 1; continue; }
    attend<T, NV>(static_cast<const T*>(q) + b * stride, static_cast<const T*>(kc), static_cast<const T*>(vc),
                  slots + b * W, lens[b], static_cast<T*>(out) + b * stride, H, KV, nslots, scale, &bad);
  }
  return bad;
}

// Returns 0 on success, 1 for a length or slot out of range, 2 for shapes it was not built for.
extern "C" int zhuzi_decode_attention(int bf16, const void* q, const void* kc, const void* vc,
    const int64_t* slots, const int64_t* lens, void* out, int64_t B, int64_t W, int H, int KV, int D,
    int64_t nslots, float scale, int threads) {
  if (KV < 1 || H % KV || H > MAXH || H * D > MAXHD) return 2;
  auto go = [&](auto run_f32, auto run_bf16) {
    return (bf16 ? run_bf16 : run_f32)(q, kc, vc, slots, lens, out, B, W, H, KV, nslots, scale, threads); };
  switch (D) {  // bf16 rows are read 32 values at a time: D must be a multiple of 32
    case 32: return go(run<float, 2>, run<uint16_t, 2>);
    case 64: return go(run<float, 4>, run<uint16_t, 4>);
    case 96: return go(run<float, 6>, run<uint16_t, 6>);
    case 128: return go(run<float, 8>, run<uint16_t, 8>);
    case 256: return go(run<float, 16>, run<uint16_t, 16>);
    default: return 2;
  }
}
