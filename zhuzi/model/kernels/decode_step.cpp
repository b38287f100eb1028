// A whole decode step in one call: every layer, the final norm and the LM head for M <= 8 decode rows,
// in one OpenMP parallel region; see fused.py for the design and for how its arithmetic differs from
// the per-layer path.
#include "api.h"
#include "attention.h"
#include "block_decode.h"
#include "decode_step.h"
#include "packed_blocks.h"
#include "rows.h"

#include <omp.h>

#include <vector>

namespace step {

// Where the team waits for its slowest thread: the end of each work-shared loop. With a clock (Args::barrier_s),
// each thread's wait is added to its entry.
struct Barrier {
  double* clock;
  void operator()() const {
    if (!clock) {
#pragma omp barrier
      return;
    }
    const double start = omp_get_wtime();
#pragma omp barrier
    clock[omp_get_thread_num()] += omp_get_wtime() - start;
  }
};

constexpr int GROUP = 16;  // output rows per work item: a row group

#if ZHUZI_AVX512
using Act = uint16_t;  // queries and attention outputs: bf16, as the matrices take them
using Dense = BF16;    // bf16 weights against bf16 inputs
#else
using Act = float;
using Dense = BF16F32;  // bf16 weights widened against float inputs
#endif

// 1 / RMS(x[0..n)) with RMSNorm's epsilon.
static inline float inv_rms(const float* x, int64_t n, float eps) {
  vf ss{};
  int64_t i = 0;
  for (; i + VL <= n; i += VL) { const vf v = load_vf(x + i); ss = fmadd(v, v, ss); }
  float tail = 0.f;
  for (; i < n; ++i) tail = fmadd(x[i], x[i], tail);
  return 1.f / std::sqrt((hsum(ss) + tail) / float(n) + eps);
}

// One matrix's input rows, as each thread prepares them for itself (no barrier needed): float rows (an
// RMSNorm's output, an activation), then the form each weight kind reads, made on first use: q8 blocks for
// GGUF blocks, and for bf16 weights the rows in bf16 (AVX-512) or in the weights' even / odd split (elsewhere).
struct Inputs {
  std::vector<float> f, split;
  std::vector<uint16_t> rounded;  // f in bf16 (AVX-512)
  q8::Rows q8[2];        // for GGUF blocks: per 32 inputs, per 256 (K-quants)
  const uint16_t* bf16 = nullptr;  // rows given as bf16 (use()), not in f
  int M = 0;
  int64_t K = 0;
  bool dense_ready = false, q8_ready[2] = {};

  // Rows of float32 values, optionally RMS-normalised with weight (offset + w).
  void set(const float* src, int rows, int64_t width, const uint16_t* w = nullptr, float eps = 0.f,
           float offset = 0.f) {
    M = rows, K = width, dense_ready = q8_ready[0] = q8_ready[1] = false, bf16 = nullptr;
    at_least(f, M * K);
    for (int m = 0; m < M; ++m) {
      const float* s = src + m * K;
      const float r = w ? inv_rms(s, K, eps) : 1.f;
      for (int64_t i = 0; i < K; ++i) f[m * K + i] = w ? s[i] * r * (offset + widen(w[i])) : s[i];
    }
  }
#if ZHUZI_AVX512
  void use(const uint16_t* rows, int count, int64_t width) {  // bf16 rows as they are
    M = count, K = width, dense_ready = q8_ready[0] = q8_ready[1] = false, bf16 = rows;
  }
  const uint16_t* dense() {  // the rows in bf16: as given (use()), or f rounded once
    if (bf16) return bf16;
    if (!dense_ready) {
      at_least(rounded, M * K);
      for (int64_t i = 0; i < M * K; ++i) store(f[i], &rounded[i]);
    }
    dense_ready = true;
    return rounded.data();
  }
#else
  void use(const float* rows, int count, int64_t width) { set(rows, count, width); }
#endif
  const q8::Rows& blocks(int span) {  // span: the weights' block length, the inputs an activation scale covers
    const int s = span == block_prefill::DECODE_K;
    if (!q8_ready[s]) {
      if (bf16) q8[s].set(bf16, M, K, K, 1, span);
      else q8[s].set(f.data(), M, K, K, 1, span);
    }
    q8_ready[s] = true;
    return q8[s];
  }
#if !ZHUZI_AVX512
  const float* dense() {
    if (!dense_ready) {
      at_least(split, M * K);
      for (int m = 0; m < M; ++m) BF16F32::prepare(f.data() + m * K, K, K, split.data() + m * K);
    }
    dense_ready = true;
    return split.data();
  }
#endif
};

// Rows [n0, n0 + count) of a row-major matrix against M inputs: out[m][r].
// Weight rows per stripe that divide a row group: a remainder would stream its rows one at a time, with a single
// accumulator chain each, below memory speed.
constexpr int stripe_rows(int r) { return r >= 8 ? 8 : r >= 4 ? 4 : r >= 2 ? 2 : 1; }

template <class F, int M>
static void dense_rows(const typename F::W* w, int64_t K, const typename F::X* x, int64_t kp, int64_t n0, int count,
                       float out[M][GROUP]) {
  constexpr int R = stripe_rows(ROWS[M]);
  int r = 0;
  for (; r + R <= count; r += R) {
    float o[R][M];
    rows<F, M, R>(w + (n0 + r) * K, K, x, kp, o);
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) out[m][r + i] = o[i][m];
  }
  for (; r < count; ++r) {
    float o[1][M];
    rows<F, M, 1>(w + (n0 + r) * K, K, x, kp, o);
    for (int m = 0; m < M; ++m) out[m][r] = o[0][m];
  }
}

// Output rows [n0, n0 + count) of matrix a (count <= 16, n0 a multiple of 16): out[m][r].
template <int M>
static void group_outputs(const Mat& a, Inputs& in, int64_t n0, int count, float out[M][GROUP]) {
  const int64_t K = a.k;
  switch (a.kind) {
    case DENSE:
      dense_rows<Dense, M>(static_cast<const uint16_t*>(a.w), K, in.dense(), K, n0, count, out);
      break;
    case BLOCKS: {
      const auto* part = static_cast<const block_prefill::Part*>(a.w);
      int64_t row = n0;
      for (; row >= part->rows; ++part) row -= part->rows;
      float acc[M][block_prefill::ROWS];
      const uint8_t* w = part->w + row * part->row_bytes;
      blocks::with_format(part->type & ~packed::FLAG, [&](auto f) {
        using F = decltype(f);
        if (part->type & packed::FLAG) packed::row_group<F>(w, K, in.blocks(F::QK), 0, M, acc);
        else block_decode::row_group<F>(w, part->row_bytes, count, K, in.blocks(F::QK), 0, M, acc);
      });
      for (int m = 0; m < M; ++m) std::memcpy(out[m], acc[m], count * 4);
      break;
    }
  }
  if (a.bias)
    for (int r = 0; r < count; ++r)
      for (int m = 0; m < M; ++m) out[m][r] += a.bias[n0 + r];
}

// Work items a thread takes at a time from the team's counter: about four turns a thread, as llama.cpp
// splits its rows. A static split left the faster thread waiting at every barrier whenever the other's core
// was slower for a while (a shared host's usual state); each turn is still one contiguous run of rows,
// which the packed kernels' prefetch follows. Results do not depend on the split: a row is one thread's.
static inline int64_t turn(int64_t items) { return std::max<int64_t>(1, items / (4 * omp_get_num_threads())); }

// Every row group (16 output rows) of a, split over the team; emit(n0, count, out) takes each group's results.
template <int M, typename Emit>
static void matmul(const Mat& a, Inputs& in, const Barrier& sync, Emit emit) {
  const int64_t groups = (a.n + GROUP - 1) / GROUP;
#pragma omp for schedule(dynamic, turn(groups)) nowait
  for (int64_t c = 0; c < groups; ++c) {
    float out[M][GROUP];
    const int count = int(std::min<int64_t>(GROUP, a.n - c * GROUP));
    group_outputs<M>(a, in, c * GROUP, count, out);
    emit(c * GROUP, count, out);
  }
  sync();
}

// RMSNorm of n values in place, with weight (offset + w), or none (w null).
static void norm_in_place(float* x, const uint16_t* w, int64_t n, float eps, float offset) {
  const float r = inv_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) x[i] = w ? x[i] * r * (offset + widen(w[i])) : x[i] * r;
}

// RoPE over a head's first D dims: frequency i turns dims (i, i + D/2) (the Hugging Face layout), or (2i, 2i + 1)
// when interleaved.
static void rope(float* x, const float* cos, const float* sin, int64_t D, bool interleaved) {
  const int64_t half = D / 2, at = interleaved ? 2 : 1, other = interleaved ? 1 : half;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i * at], b = x[i * at + other];
    x[i * at] = fmadd(a, cos[i], -(b * sin[i]));
    x[i * at + other] = fmadd(b, cos[i], a * sin[i]);
  }
}

// Row `id` of a table, as float, times its scale.
static void lookup(const Table& t, int64_t id, float* out) {
  const auto* row = static_cast<const uint8_t*>(t.rows) + id * t.row_bytes;
  if (!t.type) {
    for (int64_t i = 0; i < t.width; ++i) out[i] = widen(reinterpret_cast<const uint16_t*>(row)[i]);
  } else {
    blocks::with_format(t.type, [&](auto f) {
      using F = decltype(f);
      for (int64_t b = 0; b < t.width / F::QK; ++b) blocks::values<F>(row + b * F::BYTES, out + b * F::QK);
    });
  }
  if (t.scale != 1.f)
    for (int64_t i = 0; i < t.width; ++i) out[i] *= t.scale;
}

// The MLP's gate applied to its up value.
static inline float gated(float g, float u, int32_t activation) {
  if (activation == GELU_TANH)  // 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
    return 0.5f * g * (1.f + std::tanh(0.7978845608f * fmadd(0.044715f * g * g, g, g))) * u;
  return g / (1.f + expf(-g)) * u;
}

// A sublayer's output (attention's O, the MLP's down, the per-layer input's projection) into the residual stream
// h, which is then scaled by `scale` (1 but at a Gemma 4 layer's end): added as its row groups come, or, where the
// layer norms it first (sandwich norms), gathered in sub and normed as whole rows once all are in.
template <int M>
static void to_residual(const Mat& a, Inputs& in, const Barrier& sync, const uint16_t* norm, const Args& args,
                        float offset, float scale, float* h, float* sub) {
  const int64_t E = args.hidden;
  matmul<M>(a, in, sync, [&](int64_t n0, int count, float out[M][GROUP]) {
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < count; ++r) {
        float* x = (norm ? sub : h) + m * E + n0 + r;
        *x = norm ? out[m][r] : (*x + out[m][r]) * scale;
      }
  });
  if (!norm) return;
#pragma omp for schedule(static) nowait
  for (int m = 0; m < M; ++m) {
    norm_in_place(sub + m * E, norm, E, args.eps, offset);
    for (int64_t i = 0; i < E; ++i) h[m * E + i] = (h[m * E + i] + sub[m * E + i]) * scale;
  }
  sync();
}

// Query heads h0 .. h1 - 1, all of one kv head's (attend() reads each K/V row once for all of them).
template <typename TKV>
static void attend_heads(int64_t D, const Act* q, const void* kc, const void* vc, const int64_t* slots,
                         int64_t len, Act* out, int h0, int h1, int H, int KV, int64_t nslots, float scale,
                         const float* sinks, int* bad) {
  const auto* k = static_cast<const TKV*>(kc);
  const auto* v = static_cast<const TKV*>(vc);
  auto go = [&](auto fn) { fn(q, k, v, slots, len, out, h0, h1, H, KV, nslots, scale, sinks, bad); };
  switch (D) {
    case 32: go(attend<Act, TKV, 32>); break;
    case 64: go(attend<Act, TKV, 64>); break;
    case 96: go(attend<Act, TKV, 96>); break;
    case 128: go(attend<Act, TKV, 128>); break;
    default: go(attend<Act, TKV, 256>); break;
  }
}

// A new token's K or V head into the pool.
static void write_head(const float* x, void* pool, int64_t at, int64_t D, bool q8) {
  if (q8) quantize_row(x, static_cast<uint8_t*>(pool) + at * head_width<uint8_t>(D), D);
  else quantize_row(x, static_cast<uint16_t*>(pool) + at * D, D);
}

// The parts a kv head's query heads are split into for attention: the fewest that give every thread an item
// (Gemma 3 270M decodes one row of one kv head). A head's arithmetic does not depend on its part.
static int64_t head_parts(int64_t items, int64_t qpk) {
  for (int64_t p = 1; p < qpk; ++p)
    if (qpk % p == 0 && items * p >= omp_get_num_threads()) return p;
  return qpk;
}

// A row's K and V of kv head kh from its projections into the pool: V (k's projection where values_are_keys),
// normed where the layer norms it; K normed and turned.
static void write_kv(const Layer& L, const Args& a, float* k, const float* v, const float* cos, const float* sin,
                     char* kc, char* vc, int64_t at) {
  const int64_t D = L.head_dim;
  float value[256];  // D <= 256 (zhuzi_decode_step)
  std::memcpy(value, v, D * 4);
  if (L.value_norm) norm_in_place(value, nullptr, D, a.eps, 0.f);
  if (L.k_norm) norm_in_place(k, L.k_norm, D, a.eps, L.norm_offset);
  rope(k, cos, sin, L.rotary_dim, a.rope_interleaved);
  write_head(k, kc, at, D, a.kv_q8);
  write_head(value, vc, at, D, a.kv_q8);
}

// The per-layer inputs of M rows (Args::per_layer): the table's rows looked up before, in pl; the projection of
// the embeddings (in in) added, both kept in pl.
template <int M>
static void per_layer_inputs(const Args& a, Inputs& in, const Barrier& sync, float* pl, float* projected) {
  const int64_t P = a.per_layer_width, LP = a.num_layers * P;
  matmul<M>(a.per_layer_projection, in, sync, [&](int64_t n0, int count, float out[M][GROUP]) {
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < count; ++r) projected[m * LP + n0 + r] = out[m][r] * a.per_layer_projection_scale;
  });
#pragma omp for schedule(static) nowait
  for (int64_t i = 0; i < M * a.num_layers; ++i) {
    float* x = projected + i * P;
    norm_in_place(x, a.per_layer_norm, P, a.eps, a.norm_offset);
    for (int64_t d = 0; d < P; ++d) pl[i * P + d] = (x[d] + pl[i * P + d]) * 0.70710678f;  // / sqrt(2)
  }
  sync();
}

template <int M>
static int run(const Args& a) {
  const int64_t H = a.heads, E = a.hidden, V = a.lm_head.n, P = a.per_layer_width, LP = a.num_layers * P;
  int64_t QKV = 0, HD = 0, F = P;  // the widest layer's
  for (int64_t l = 0; l < a.num_layers; ++l) {
    const Layer& L = a.layers[l];
    QKV = std::max(QKV, L.qkv.n), HD = std::max(HD, H * L.head_dim), F = std::max(F, L.ffn);
  }
  std::vector<float> h(M * E), sub(M * E), qkv(M * QKV), act(M * F), pl(M * LP), projected(M * LP);
  std::vector<Act> q(M * HD), attn(M * HD);
  for (int m = 0; m < M; ++m) {
    lookup(a.embed, a.ids[m], &h[m * E]);
    if (P) lookup(a.per_layer, a.ids[m], &pl[m * LP]);
  }
  int bad = 0;
  for (int m = 0; m < M; ++m) bad |= a.lens[m] < 1 || a.lens[m] > a.width;
  if (bad) return 1;
#pragma omp parallel num_threads(a.threads)
  {
    static thread_local Inputs in;
    const Barrier sync{a.barrier_s};
    if (P) {
      in.set(h.data(), M, E);
      per_layer_inputs<M>(a, in, sync, pl.data(), projected.data());
    }
    for (int64_t l = 0; l < a.num_layers; ++l) {
      const Layer& L = a.layers[l];
      const int64_t D = L.head_dim, KV = L.kv_heads, QPK = H / KV, N = L.qkv.n;
      const int64_t pool = a.num_slots * KV * (a.kv_q8 ? head_width<uint8_t>(D) : 2 * D);  // bytes of its K
      char* kc = static_cast<char*>(a.pools[L.pool]) + 2 * L.entry * pool;
      char* vc = kc + pool;
      in.set(h.data(), M, E, L.input_norm, a.eps, L.norm_offset);
      matmul<M>(L.qkv, in, sync, [&](int64_t n0, int count, float out[M][GROUP]) {
        for (int m = 0; m < M; ++m) std::memcpy(&qkv[m * N + n0], out[m], count * 4);
      });
      // A row's kv head: its query heads' norms and RoPE, and where the layer writes K/V, its key's and value's
      // into the pool; the layer's attention reads them after the barrier.
#pragma omp for schedule(static) nowait
      for (int64_t i = 0; i < M * KV; ++i) {
        const int64_t m = i / KV, kh = i % KV;
        const float* cos = L.cos + a.positions[m] * (L.rotary_dim / 2);
        const float* sin = L.sin + a.positions[m] * (L.rotary_dim / 2);
        for (int64_t j = kh * QPK; j < (kh + 1) * QPK; ++j) {
          float* x = &qkv[m * N + j * D];
          if (L.q_norm) norm_in_place(x, L.q_norm, D, a.eps, L.norm_offset);
          rope(x, cos, sin, L.rotary_dim, a.rope_interleaved);
          for (int64_t d = 0; d < D; ++d) store(x[d], &q[(m * H + j) * D + d]);
        }
        if (!L.writes) continue;
        const int64_t slot = a.slots[m * a.width + a.lens[m] - 1];
        if (slot < 0 || slot >= a.num_slots) { bad = 1; continue; }
        float* k = &qkv[m * N + (H + kh) * D];
        write_kv(L, a, k, L.values_are_keys ? k : k + KV * D, cos, sin, kc, vc, slot * KV + kh);
      }
      sync();
      // A work item is a part of a row's kv head's query heads (head_parts).
      const int64_t parts = head_parts(M * KV, QPK), per = QPK / parts;
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t i = 0; i < M * KV * parts; ++i) {
        const int64_t m = i / (KV * parts), h0 = i % (KV * parts) * per;
        const int64_t begin = L.window > 0 ? std::max<int64_t>(0, a.lens[m] - L.window) : 0;  // the window's first
        (a.kv_q8 ? attend_heads<uint8_t> : attend_heads<uint16_t>)(
            D, &q[m * H * D], kc, vc, a.slots + m * a.width + begin, a.lens[m] - begin, &attn[m * H * D], int(h0),
            int(h0 + per), int(H), int(KV), a.num_slots, L.scale, L.sinks, &bad);
      }
      sync();
      in.use(attn.data(), M, H * D);
      to_residual<M>(L.o, in, sync, L.attn_out_norm, a, L.norm_offset, 1.f, h.data(), sub.data());
      in.set(h.data(), M, E, L.post_norm, a.eps, L.norm_offset);
      // A work item computes 16 gate rows and the 16 matching up rows, and applies the activation itself.
      const int64_t FL = L.ffn;
      const Mat gate = {L.gate_up.kind, L.gate_up.w, L.gate_up.bias, FL, E};
      Mat up = gate;
      if (gate.kind == DENSE) up.w = static_cast<const uint16_t*>(gate.w) + FL * E;
      else up.w = static_cast<const block_prefill::Part*>(gate.w) + 1;
#pragma omp for schedule(dynamic, turn(FL / GROUP)) nowait
      for (int64_t c = 0; c < FL / GROUP; ++c) {
        float g[M][GROUP], u[M][GROUP];
        group_outputs<M>(gate, in, c * GROUP, GROUP, g);
        group_outputs<M>(up, in, c * GROUP, GROUP, u);
        for (int m = 0; m < M; ++m)
          for (int r = 0; r < GROUP; ++r) act[m * FL + c * GROUP + r] = gated(g[m][r], u[m][r], L.activation);
      }
      sync();
      in.set(act.data(), M, FL);
      const float scale = P ? 1.f : L.output_scale;  // with a per-layer input, after it
      to_residual<M>(L.down, in, sync, L.mlp_out_norm, a, L.norm_offset, scale, h.data(), sub.data());
      if (!P) continue;
      // The per-layer input: its gate of the residual stream, times the layer's input; projected, normed, added.
      in.set(h.data(), M, E);
      matmul<M>(L.input_gate, in, sync, [&](int64_t n0, int count, float out[M][GROUP]) {
        for (int m = 0; m < M; ++m)
          for (int r = 0; r < count; ++r)
            act[m * P + n0 + r] = gated(out[m][r], pl[m * LP + l * P + n0 + r], L.activation);
      });
      in.set(act.data(), M, P);
      to_residual<M>(L.input_proj, in, sync, L.input_out_norm, a, L.norm_offset, L.output_scale, h.data(),
                     sub.data());
    }
    in.set(h.data(), M, E, a.norm, a.eps, a.norm_offset);
    matmul<M>(a.lm_head, in, sync, [&](int64_t n0, int count, float out[M][GROUP]) {
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < count; ++r)
          a.logits[m * V + n0 + r] = a.softcap > 0.f ? std::tanh(out[m][r] / a.softcap) * a.softcap : out[m][r];
    });
  }
  return bad;
}

// Whether this build serves the layer: a head size attention has a kernel for, whole heads' RoPE pairs, MLP and
// per-layer input widths of whole 32s.
static bool serves(const Layer& L, const Args& a) {
  const int64_t D = L.head_dim, H = a.heads;
  const bool head = D == 32 || D == 64 || D == 96 || D == 128 || D == 256;
  return head && L.kv_heads > 0 && H % L.kv_heads == 0 && H * D <= MAXHD && L.ffn % 32 == 0
         && L.rotary_dim > 0 && L.rotary_dim <= D && L.rotary_dim % 2 == 0;
}

static bool serves(const Table& t) {
  return !t.type || block_prefill::serves(t.type, t.width, t.row_bytes);
}

}  // namespace step

// Returns 0 on success, 1 for a length or slot out of range, 2 for what this build does not serve
// (M outside 1..8, a shape it lacks a kernel for, serves()).
extern "C" int zhuzi_decode_step(const void* args, int64_t M) {
  const auto& a = *static_cast<const step::Args*>(args);
  bool ok = a.heads <= MAXH && a.hidden % 32 == 0 && a.per_layer_width % 32 == 0 && step::serves(a.embed)
            && (!a.per_layer_width || step::serves(a.per_layer));
  for (int64_t l = 0; l < a.num_layers; ++l) ok = ok && step::serves(a.layers[l], a);
  if (!ok || M < 1 || M > 8) return 2;
  return with_rows<8>(M, [&](auto m) { return step::run<decltype(m)::value>(a); });
}
