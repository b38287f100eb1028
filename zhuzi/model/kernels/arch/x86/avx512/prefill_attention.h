// prefill_attention.cpp's work item for AVX-512 BF16 (bf16 queries and pools): 16 queries, one per lane;
// a key's scores for all of them come from broadcasting its bf16 pairs against the queries' pairs
// (vdpbf16ps), and the probabilities meet V as bf16 pairs.
#pragma once
#include "prelude.h"

#include <algorithm>
#include <cmath>

namespace bf16 {

constexpr int Q = 16;          // query positions per item (vector lanes)
constexpr int T = 32;          // keys per slab

// Queries q0 .. q0 + n - 1 (n <= 16) of head h, at positions first + q0 .. ; keys at pool rows slots[0 ..]; sink:
// the head's logit in the softmax denominator, or null.
template <int D>
static void item(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* slots, int64_t first,
                 int64_t q0, int n, int h, int H, int QPK, int64_t row, float scale, int64_t window,
                 const float* sink, uint16_t* out) {
  constexpr int P = D / 2;  // bf16 pairs a row
  alignas(64) int32_t qt[P][Q];          // qt[p][lane]: query lane's pair p
  alignas(64) float s[T][Q];             // scores, then probabilities, of a slab: key-major
  alignas(64) int32_t vt[T / 2][D];      // vt[t / 2][d]: (V[t][d], V[t + 1][d]) as a bf16 pair
  alignas(64) int32_t pt[T / 2][Q];      // pt[t / 2][lane]: (p[t][lane], p[t + 1][lane])
  __m512 o[D];                           // o[d]: output d of every lane
  for (int i = 0; i < Q; ++i) {
    const int32_t* src = reinterpret_cast<const int32_t*>(q + ((q0 + std::min(i, n - 1)) * H + h) * D);
    for (int p = 0; p < P; ++p) qt[p][i] = src[p];
  }
  for (int d = 0; d < D; ++d) o[d] = _mm512_setzero_ps();
  __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
  alignas(64) float lane_pos[Q];
  for (int i = 0; i < Q; ++i) lane_pos[i] = float(first + q0 + std::min(i, n - 1));
  const __m512 qpos = _mm512_load_ps(lane_pos);  // a lane sees keys qlow .. qpos
  const __m512 qlow = _mm512_sub_ps(qpos, _mm512_set1_ps(window > 0 ? float(window - 1) : INFINITY));
  // keys [begin, end) are visible to some lane; each lane sees one in the first slab (Q <= T), so no max is -inf
  const int64_t end = first + q0 + n, begin = window > 0 ? std::max<int64_t>(0, first + q0 - window + 1) : 0;
  const int64_t kv_off = int64_t(h / QPK) * D;
  for (int64_t t0 = begin; t0 < end; t0 += T) {
    const int nt = int(std::min<int64_t>(T, end - t0));
    const uint16_t* krow[T];
    const uint16_t* vrow[T];
    for (int t = 0; t < T; ++t) {  // past the last key: its rows again, masked below
      krow[t] = kc + slots[t0 + std::min(t, nt - 1)] * row + kv_off;
      vrow[t] = vc + slots[t0 + std::min(t, nt - 1)] * row + kv_off;
    }
    if (t0 + T < end)
      for (int t = 0; t < std::min<int64_t>(T, end - t0 - T); ++t) {
        _mm_prefetch(reinterpret_cast<const char*>(kc + slots[t0 + T + t] * row + kv_off), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vc + slots[t0 + T + t] * row + kv_off), _MM_HINT_T0);
      }
    // scores: 8 keys at a time, each against the 16 lanes
    for (int t = 0; t < nt; t += 8) {
      __m512 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
      for (int p = 0; p < P; ++p) {
        const __m512i qv = _mm512_load_si512(qt[p]);
        for (int j = 0; j < 8; ++j) acc[j] = dot_bf16_pair(acc[j], qv, krow[t + j] + 2 * p);
      }
      for (int j = 0; j < 8; ++j) {  // keys past a lane's own position or window, or past the slab, get -inf
        const float pos = t + j < nt ? float(t0 + t + j) : INFINITY;
        const __mmask16 late = _mm512_cmp_ps_mask(_mm512_set1_ps(pos), qpos, _CMP_GT_OQ)
                               | _mm512_cmp_ps_mask(_mm512_set1_ps(pos), qlow, _CMP_LT_OQ);
        _mm512_store_ps(s[t + j], _mm512_mask_blend_ps(late, _mm512_mul_ps(acc[j], _mm512_set1_ps(scale)),
                                                       _mm512_set1_ps(-INFINITY)));
      }
    }
    for (int t = (nt + 7) / 8 * 8; t < T; ++t) _mm512_store_ps(s[t], _mm512_set1_ps(-INFINITY));
    // online softmax, per lane
    __m512 mx = m;
    for (int t = 0; t < nt; ++t) mx = _mm512_max_ps(mx, _mm512_load_ps(s[t]));
    for (int t = 0; t < T; ++t) _mm512_store_ps(s[t], (__m512)vexp((vf)_mm512_sub_ps(_mm512_load_ps(s[t]), mx)));
    const __m512 a = (__m512)vexp((vf)_mm512_sub_ps(m, mx));
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < T; ++t) sum = _mm512_add_ps(sum, _mm512_load_ps(s[t]));
    l = _mm512_fmadd_ps(l, a, sum);
    m = mx;
    // probabilities and values as bf16 pairs of consecutive keys
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int t = 0; t < T; t += 2) {
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(s[t + 1]), _mm512_load_ps(s[t]));
      _mm512_store_si512(pt[t / 2], _mm512_permutexvar_epi16(interleave, both));
      for (int d = 0; d < D; d += 16) {
        const __m512i lo = t < nt ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[t] + d)))
                                  : _mm512_setzero_si512();
        const __m512i hi = t + 1 < nt ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[t + 1] + d)))
                                      : _mm512_setzero_si512();
        _mm512_store_si512(&vt[t / 2][d], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_mul_ps(o[d0 + j], a);  // rescaled to the new maxima
      for (int t = 0; t < (nt + 1) / 2; ++t) {
        const __m512i pv = _mm512_load_si512(pt[t]);
        for (int j = 0; j < 16; ++j) acc[j] = dot_bf16_pair(acc[j], pv, &vt[t][d0 + j]);
      }
      for (int j = 0; j < 16; ++j) o[d0 + j] = acc[j];
    }
  }
  if (sink) l = _mm512_add_ps(l, (__m512)vexp((vf)_mm512_sub_ps(_mm512_set1_ps(*sink), m)));
  alignas(64) float inv[Q], col[Q];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
  for (int d = 0; d < D; ++d) {
    _mm512_store_ps(col, o[d]);
    for (int i = 0; i < n; ++i) store(col[i] * inv[i], out + ((q0 + i) * H + h) * D + d);
  }
}

}  // namespace bf16
