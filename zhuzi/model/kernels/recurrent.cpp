// The recurrent mixers' kernels (cpu_recurrent.py has the layouts): a causal depthwise short convolution
// (LFM2's, Mamba2's and gated DeltaNet's conv1d) and the gated delta rule (Qwen3-Next / Qwen3.5's linear
// attention), each for decode (a token per sequence, its state slot updated in place) and for prefill (one
// sequence's tokens). Prefill runs each token through the very operations decode gives it, so a token's
// outputs and the state it leaves are the same bits decoded, prefilled, or prefilled in chunks of any size.
// Plain C++ on prelude.h's vectors: the compiler vectorizes it for each variant.
#include "api.h"
#include "prelude.h"

#include <omp.h>

#include <algorithm>

namespace {

inline float silu(float x) { return x / (1.f + scalar_exp(-x)); }  // the vector lanes' bits: scalar_exp is vexp
inline vf silu(vf x) { return x / (1.f + vexp(-x)); }

// y[0..n) = silu(y), vectors then a scalar tail of the same bits.
void silu_row(float* y, int64_t n) {
  int64_t c = 0;
  for (; c + VL <= n; c += VL) store_vf(silu(load_vf(y + c)), y + c);
  for (; c < n; ++c) y[c] = silu(y[c]);
}

bool in_range(const int64_t* slots, int64_t n, int64_t nslots) {
  return std::all_of(slots, slots + n, [&](int64_t s) { return s >= 0 && s < nslots; });
}

// ---- the short convolution: out = bias + sum_j w[c, j] * in[t - (K-1) + j], the taps in order j = 0..K-1,
// each a fused multiply-add (the same sequence for a channel in a vector lane and in the scalar tail).

// Tokens t0..t1 of a prefill whose taps all lie in x, VL channels at a time, weights given tap-major wt[K, C].
void conv_rows(const float* x, const float* wt, const float* bias, float* out, int64_t t0, int64_t t1, int64_t C,
               int K) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* in = x + (t - (K - 1)) * C;  // the first tap's row
    int64_t c = 0;
    for (; c + VL <= C; c += VL) {
      vf acc = bias ? load_vf(bias + c) : vf{};
      for (int j = 0; j < K; ++j) acc = fmadd(load_vf(wt + j * C + c), load_vf(in + j * C + c), acc);
      store_vf(acc, out + t * C + c);
    }
    for (; c < C; ++c) {
      float acc = bias ? bias[c] : 0.f;
      for (int j = 0; j < K; ++j) acc = fmadd(wt[j * C + c], in[j * C + c], acc);
      out[t * C + c] = acc;
    }
  }
}

// ---- the gated delta rule, per value head on its state S [DK, DV] for a token with keys k, query q, values v:
// S = a S (a = exp(g)), kv = S^T k, delta = beta (v - kv), S += k delta^T, o = S^T q. A column of S (a value
// dimension) meets only its own v, kv, delta and o: the columns go in blocks of N vectors (a block's DK rows
// stay in L1 through both passes), each with its own arithmetic, so a column's bits do not depend on the block
// it is in. kv is summed as a (S^T k), the decay applied once to the sum; the rows' products go into two
// partial sums (even and odd rows), added at the end, so a sum's additions are not one serial chain.

template <typename V>
V load(const float* p) {
  if constexpr (std::is_same_v<V, float>) return *p; else return load_vf(p);
}
inline void put(float v, float* p) { *p = v; }
inline void put(vf v, float* p) { store_vf(v, p); }
template <typename V>
V broadcast(float x) {
  if constexpr (std::is_same_v<V, float>) return x; else return splat(x);
}

// One token on the columns [0, N * W) of S (rows of stride DV; W: V's lanes), in place; their outputs to o.
template <typename V, int N>
void delta_step(float* S, int64_t DK, int64_t DV, const float* k, const float* q, const float* v, float a, float beta,
                float* o) {
  constexpr int W = sizeof(V) / sizeof(float);
  auto row = [&](int64_t i, int n) { return S + i * DV + n * W; };
  V sum[2][N] = {};
  auto to_kv = [&](int64_t i, V* acc) {
    const V ki = broadcast<V>(k[i]);
    for (int n = 0; n < N; ++n) acc[n] = fmadd(ki, load<V>(row(i, n)), acc[n]);
  };
  int64_t i = 0;
  for (; i + 1 < DK; i += 2) to_kv(i, sum[0]), to_kv(i + 1, sum[1]);
  if (i < DK) to_kv(i, sum[0]);
  V delta[N];
  for (int n = 0; n < N; ++n) delta[n] = (load<V>(v + n * W) - (sum[0][n] + sum[1][n]) * a) * beta;
  V out[2][N] = {};
  auto update = [&](int64_t i, V* acc) {
    const V ki = broadcast<V>(k[i]), qi = broadcast<V>(q[i]);
    for (int n = 0; n < N; ++n) {
      const V s = fmadd(ki, delta[n], load<V>(row(i, n)) * a);
      put(s, row(i, n));
      acc[n] = fmadd(qi, s, acc[n]);
    }
  };
  for (i = 0; i + 1 < DK; i += 2) update(i, out[0]), update(i + 1, out[1]);
  if (i < DK) update(i, out[0]);
  for (int n = 0; n < N; ++n) put(out[0][n] + out[1][n], o + n * W);
}

// The column blocks of a head: BLOCK vectors (32 columns: 16 KiB of S at DK = 128), then single vectors,
// then single columns.
constexpr int BLOCK = std::max(1, 32 / VL);
int64_t column_blocks(int64_t DV) { return (DV + BLOCK * VL - 1) / (BLOCK * VL); }

// Token on block b of a head's columns.
void delta_block(float* S, int64_t b, int64_t DK, int64_t DV, const float* k, const float* q, const float* v,
                 float a, float beta, float* o) {
  int64_t j = b * BLOCK * VL;
  const int64_t end = std::min(DV, j + BLOCK * VL);
  if (end - j == BLOCK * VL) return delta_step<vf, BLOCK>(S + j, DK, DV, k, q, v + j, a, beta, o + j);
  for (; j + VL <= end; j += VL) delta_step<vf, 1>(S + j, DK, DV, k, q, v + j, a, beta, o + j);
  for (; j < end; ++j) delta_step<float, 1>(S + j, DK, DV, k, q, v + j, a, beta, o + j);
}

struct Delta {  // a call's shapes: q, k [T, HK, DK]; v, out [T, HV, DV]; g, beta [T, HV]; a state [HV, DK, DV]
  const float *q, *k, *v, *g, *beta;
  float* out;
  int64_t HK, HV, DK, DV;

  // Token t of value head h on block b of the head's state S.
  void token(float* S, int64_t t, int64_t h, int64_t b) const {
    const int64_t kh = t * HK + h / (HV / HK), vh = t * HV + h;
    delta_block(S, b, DK, DV, k + kh * DK, q + kh * DK, v + vh * DV, scalar_exp(g[vh]), beta[vh], out + vh * DV);
  }
  int64_t state_floats() const { return HV * DK * DV; }
};

}  // namespace

extern "C" int zhuzi_delta_decode(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                  float* state, const int64_t* slots, float* out, int64_t B, int64_t HK, int64_t HV,
                                  int64_t DK, int64_t DV, int64_t nslots, int threads) {
  if (HK < 1 || HV % HK || DK < 1 || DV < 1 || B < 0) return 2;
  if (!in_range(slots, B, nslots)) return 1;
  const Delta d{q, k, v, g, beta, out, HK, HV, DK, DV};
  const int64_t blocks = column_blocks(DV), items = B * HV * blocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (items > 1)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t row = i / (HV * blocks), h = i / blocks % HV;
    d.token(state + slots[row] * d.state_floats() + h * DK * DV, row, h, i % blocks);
  }
  return 0;
}

extern "C" int zhuzi_delta_prefill(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                   float* state, int64_t slot, float* out, int64_t L, int64_t HK, int64_t HV,
                                   int64_t DK, int64_t DV, int64_t nslots, int threads) {
  if (HK < 1 || HV % HK || DK < 1 || DV < 1 || L < 0) return 2;
  if (slot < 0 || slot >= nslots) return 1;
  const Delta d{q, k, v, g, beta, out, HK, HV, DK, DV};
  const int64_t blocks = column_blocks(DV);
  // A block of a head's state goes through every token while it sits in L1.
#pragma omp parallel for schedule(static) num_threads(threads) if (HV * blocks > 1)
  for (int64_t i = 0; i < HV * blocks; ++i)
    for (int64_t t = 0; t < L; ++t) d.token(state + slot * d.state_floats() + i / blocks * DK * DV, t, i / blocks,
                                            i % blocks);
  return 0;
}

extern "C" int zhuzi_conv_decode(const float* x, float* state, const int64_t* slots, const float* weight,
                                 const float* bias, float* out, int64_t B, int64_t C, int K, int64_t nslots, int silu_out,
                                 int threads) {
  if (K < 1 || C < 1 || B < 0) return 2;
  if (!in_range(slots, B, nslots)) return 1;
  const int H = K - 1;  // history kept per channel
#pragma omp parallel for schedule(static) num_threads(threads) if (B * C * K > 1 << 15)
  for (int64_t b = 0; b < B; ++b) {
    float* y = out + b * C;
    for (int64_t c = 0; c < C; ++c) {
      float* s = state + (slots[b] * C + c) * H;
      const float* w = weight + c * K;
      const float xc = x[b * C + c];
      float acc = bias ? bias[c] : 0.f;
      for (int j = 0; j < H; ++j) acc = fmadd(w[j], s[j], acc);
      y[c] = fmadd(w[H], xc, acc);
      for (int j = 0; j + 1 < H; ++j) s[j] = s[j + 1];
      if (H) s[H - 1] = xc;
    }
    if (silu_out) silu_row(y, C);
  }
  return 0;
}

extern "C" int zhuzi_conv_prefill(const float* x, float* state, int64_t slot, const float* weight, const float* bias,
                                  float* out, int64_t L, int64_t C, int K, int64_t nslots, int silu_out, int threads) {
  if (K < 1 || C < 1 || L < 0) return 2;
  if (slot < 0 || slot >= nslots) return 1;
  const int H = K - 1;
  float* s = state + slot * C * H;
  std::vector<float> wt(size_t(K) * C);  // tap-major: a tap's weights of VL channels are one load
  for (int64_t c = 0; c < C; ++c)
    for (int j = 0; j < K; ++j) wt[j * C + c] = weight[c * K + j];
  // The first tokens reach back into the history: channel by channel, the taps in the same order.
  const int64_t head = std::min<int64_t>(L, H);
  for (int64_t t = 0; t < head; ++t)
    for (int64_t c = 0; c < C; ++c) {
      float acc = bias ? bias[c] : 0.f;
      for (int j = 0; j < K; ++j) {
        const int64_t at = t + j - H;  // the tap's token; before 0: the history's
        acc = fmadd(wt[j * C + c], at < 0 ? s[c * H + H + at] : x[at * C + c], acc);
      }
      out[t * C + c] = acc;
    }
#pragma omp parallel num_threads(threads) if ((L - head) * C * K > 1 << 15)
  {
    const int64_t n = L - head, T = omp_get_num_threads(), i = omp_get_thread_num();
    conv_rows(x, wt.data(), bias, out, head + n * i / T, head + n * (i + 1) / T, C, K);
  }
  // The history left: the last H inputs of history ++ x, shifted down in place (a read is never behind a write).
  for (int64_t c = 0; c < C; ++c)
    for (int j = 0; j < H; ++j) {
      const int64_t at = L - H + j;
      s[c * H + j] = at < 0 ? s[c * H + H + at] : x[at * C + c];
    }
  if (silu_out)
#pragma omp parallel for schedule(static) num_threads(threads) if (L * C > 1 << 15)
    for (int64_t t = 0; t < L; ++t) silu_row(out + t * C, C);
  return 0;
}
