// prefill_attention.cpp's work item in float32 on any variant (queries float32 or bf16, pools float32, bf16
// or q8_0): 3 VL queries of one head, one per lane of three vectors. A slab's key and value rows are widened to
// float once; a key's scores for all the queries are its values broadcast against the transposed queries,
// and each value likewise updates every query's output. Softmax is online per lane.
#pragma once
#include "kv_rows.h"

#include <algorithm>
#include <cmath>

namespace f32 {

// Three query vectors: the score and output loops then keep 4 x 3 sums in flight, where an FMA's latency times
// its two ports asks for 10 (two vectors' 8 leave the FMA ports idle part of the time).
constexpr int QV = 3, Q = QV * VL;  // query vectors, queries per item
constexpr int T = std::max(32, Q);  // keys per slab: each lane sees one of the first (below)

// Queries q0 .. q0 + n - 1 (n <= Q) of head h, at positions first + q0 .. ; keys at pool rows slots[0 ..]; sink:
// the head's logit in the softmax denominator, or null.
template <typename TQ, typename TKV, int D>
static void item(const TQ* q, const TKV* kc, const TKV* vc, const int64_t* slots, int64_t first, int64_t q0, int n,
                 int h, int H, int QPK, int64_t row, float scale, int64_t window, const float* sink, TQ* out) {
  alignas(64) float qt[D][Q], o[D][Q];  // queries (scaled) and outputs, transposed: [d][lane]
  alignas(64) float kt[T][D], vt[T][D], s[T][Q];
  alignas(64) float lane_pos[Q];
  for (int i = 0; i < Q; ++i) {
    const int64_t p = q0 + std::min(i, n - 1);
    lane_pos[i] = float(first + p);
    for (int d = 0; d < D; ++d) qt[d][i] = value(q[(p * H + h) * D + d]) * scale, o[d][i] = 0.f;
  }
  vf qpos[QV], qlow[QV], m[QV], l[QV];  // a lane sees keys qlow .. qpos
  for (int v = 0; v < QV; ++v) {
    qpos[v] = load_vf(lane_pos + v * VL), m[v] = splat(-INFINITY), l[v] = vf{};
    qlow[v] = window > 0 ? qpos[v] - float(window - 1) : splat(-INFINITY);
  }
  // keys [begin, end) are visible to some lane; each lane sees one in the first slab (Q <= T), so no max is -inf
  const int64_t end = first + q0 + n, kv_off = int64_t(h / QPK) * head_width<TKV>(D);
  const int64_t begin = window > 0 ? std::max<int64_t>(0, first + q0 - window + 1) : 0;
  for (int64_t t0 = begin; t0 < end; t0 += T) {
    const int nt = int(std::min<int64_t>(T, end - t0));
    for (int t = 0; t < nt; ++t) {  // whole contiguous rows: the widening runs in vectors
      const TKV* k = kc + slots[t0 + t] * row + kv_off;
      const TKV* v = vc + slots[t0 + t] * row + kv_off;
      widen_row(k, kt[t], D);
      widen_row(v, vt[t], D);
    }
    for (int t = nt; t < T; ++t)
      for (int d = 0; d < D; ++d) kt[t][d] = vt[t][d] = 0.f;
    for (int t = 0; t < nt; t += 4) {  // scores of 4 keys: 4 x QV accumulators
      vf acc[4][QV] = {};
      for (int d = 0; d < D; ++d) {
        vf qd[QV];
        for (int v = 0; v < QV; ++v) qd[v] = load_vf(&qt[d][v * VL]), in_register(qd[v]);
        for (int j = 0; j < 4; ++j) {
          const vf k = splat(kt[t + j][d]);
          for (int v = 0; v < QV; ++v) acc[j][v] = fmadd(qd[v], k, acc[j][v]);
        }
      }
      for (int j = 0; j < 4; ++j) {  // keys past a lane's own position or window, or past the slab, get -inf
        const vf pos = splat(t + j < nt ? float(t0 + t + j) : INFINITY);
        for (int v = 0; v < QV; ++v)
          store_vf((pos > qpos[v]) | (pos < qlow[v]) ? splat(-INFINITY) : acc[j][v], &s[t + j][v * VL]);
      }
    }
    const int keys = (nt + 3) / 4 * 4;
    for (int v = 0; v < QV; ++v) {  // online softmax, per lane
      vf mx = m[v];
      for (int t = 0; t < keys; ++t) {
        const vf x = load_vf(&s[t][v * VL]);
        mx = x > mx ? x : mx;
      }
      vf sum = vf{};
      for (int t = 0; t < keys; ++t) {
        const vf p = vexp(load_vf(&s[t][v * VL]) - mx);
        store_vf(p, &s[t][v * VL]);
        sum += p;
      }
      const vf alpha = vexp(m[v] - mx);
      l[v] = fmadd(l[v], alpha, sum);
      m[v] = mx;
      for (int d = 0; d < D; ++d) store_vf(load_vf(&o[d][v * VL]) * alpha, &o[d][v * VL]);
    }
    for (int d = 0; d < D; d += 4) {  // outputs of 4 dims: 4 x QV accumulators
      vf acc[4][QV];
      for (int k = 0; k < 4; ++k)
        for (int v = 0; v < QV; ++v) acc[k][v] = load_vf(&o[d + k][v * VL]);
      for (int t = 0; t < keys; ++t) {
        vf p[QV];
        for (int v = 0; v < QV; ++v) p[v] = load_vf(&s[t][v * VL]), in_register(p[v]);
        for (int k = 0; k < 4; ++k) {
          const vf x = splat(vt[t][d + k]);
          for (int v = 0; v < QV; ++v) acc[k][v] = fmadd(p[v], x, acc[k][v]);
        }
      }
      for (int k = 0; k < 4; ++k)
        for (int v = 0; v < QV; ++v) store_vf(acc[k][v], &o[d + k][v * VL]);
    }
  }
  alignas(64) float inv[Q];
  for (int v = 0; v < QV; ++v) store_vf(1.f / (sink ? l[v] + vexp(splat(*sink) - m[v]) : l[v]), inv + v * VL);
  for (int i = 0; i < n; ++i)
    for (int d = 0; d < D; ++d) store(o[d][i] * inv[i], out + ((q0 + i) * H + h) * D + d);
}

}  // namespace f32
