// GGUF block matrices (blocks.h) in row groups of 16 output rows against q8 activation rows (q8.h), for many
// rows (prefill; block_decode.h takes a few on x86): the inner loops of the block linear kernel and of the fused
// decode step.
//
// A row group's inputs are decoded DECODE_K (256) at a time into a small buffer (Decoded): the 16 rows' codes
// interleaved 4 bytes at a time (codes[quad][row]: one vector holds the same 4 inputs of every row, a lane per row),
// and each sub-block's scale a and offset b as vectors over the rows. An input row meets the decoded inputs with one
// int8 dot product per 4 inputs, its 4 codes broadcast to every lane (vpdpbusd, maddubs + madd, sdot): no horizontal
// sums, and every input row of the call reuses the decoded inputs, so decoding is paid once per row group and
// DECODE_K inputs, not once per row.
//
// Per sub-block of SUB inputs and input row m, with s the sub-block's exact int32 sum of code products:
//   acc += s (a d) + b (d sum)     d: the activation block's scale, sum: its codes' sum (its half for SUB = 16)
// which is sum_i (a q_i + b) x_i, since x_i = d c_i; the K-quants apply their scales to s as integers and
// meet d once per 256 inputs (block_dot.h). An output's operations depend only on its own input row and
// come in a fixed order: results are batch-invariant.
#pragma once
#include "block_dot.h"
#include "blocks.h"
#include "int8.h"
#include "q8.h"

#include <algorithm>
#include <type_traits>

namespace block_prefill {

constexpr int ROWS = 16, DECODE_K = 256, QUADS = DECODE_K / 4;
constexpr int V = ROWS / i8::LANES;  // vectors a row group's quad spans
#if ZHUZI_AVX512
constexpr int MB = 8;  // input rows a pass: their int32 sums stay in registers
#else
constexpr int MB = 4;
#endif

// One matrix of blocks whose output rows follow the previous part's (cpu_blocks._Part).
struct Part {
  int32_t type;
  const uint8_t* w;
  int64_t rows, row_bytes;
};

// A K-quant super-block's integer scales (blocks.h's ints()) for each of a row group's rows.
struct KScales {
  alignas(64) int32_t sc[16][ROWS];
  alignas(64) int32_t mn[16][ROWS];  // per sub-block: 8 of Q4_K / Q5_K, 16 of Q2_K
  alignas(64) float d[ROWS];
  alignas(64) float dmin[ROWS];
};

// How many quads of int8 products (4 inputs each) can add up their maddubs pair sums in int16 (AVX2 without
// VNNI) before one could overflow: a word is at most 2 * CMAX * 127 for a K-quant's codes up to CMAX. A run ends
// with its sub-block at the latest (SUB / 4 quads).
template <class F>
constexpr int i16_run() {
  using namespace blocks;
  constexpr int CMAX = std::is_same_v<F, Format<Q6_K>> ? 63 : std::is_same_v<F, Format<Q5_K>> ? 31
                       : std::is_same_v<F, Format<Q3_K>> ? 7 : std::is_same_v<F, Format<Q2_K>> ? 3 : 15;
  constexpr int RUN = std::min(32767 / (2 * CMAX * 127), F::SUB / 4);
  static_assert(F::SUB / 4 % RUN == 0, "a sub-block is whole runs");
  return RUN;
}

struct Decoded {
  alignas(64) uint8_t codes[QUADS][ROWS][4];
  alignas(64) float a[DECODE_K / 16][ROWS];  // 32-blocks' scales and offsets
  alignas(64) float b[DECODE_K / 16][ROWS];
  KScales k;  // a K-quant's (DECODE_K inputs are one super-block)
};

static inline vi load_vi(const int32_t* p) { vi v; std::memcpy(&v, p, sizeof v); return v; }

static inline i8::B8 broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
#if ZHUZI_AVX512
  return _mm512_set1_epi32(v);
#elif ZHUZI_AVX2
  return _mm256_set1_epi32(v);
#elif ZHUZI_NEON
  return vreinterpretq_s8_s32(vdupq_n_s32(v));
#else
  return (i8::B8)(vi{} + v);
#endif
}

// 16 rows' 16 quads (at rows[r * DECODE_K + 4 j]) -> out[j][r]: a 16 x 16 transpose of 4-byte words, in four
// rounds that swap ever smaller blocks across the diagonal (GCC vectors: a two-source permute a row each).
typedef uint32_t v16w __attribute__((vector_size(64)));
static inline void interleave(const uint8_t* rows, uint8_t* out) {
  v16w r[ROWS];
  for (int i = 0; i < ROWS; ++i) std::memcpy(&r[i], rows + i * DECODE_K, 64);
  auto round = [&](int b, const v16w& keep, const v16w& swap) {
    for (int i = 0; i < ROWS; ++i)
      if (!(i & b)) {
        const v16w lo = __builtin_shuffle(r[i], r[i + b], keep), hi = __builtin_shuffle(r[i], r[i + b], swap);
        r[i] = lo, r[i + b] = hi;
      }
  };
  // Round b: row i (bit b clear) keeps its words k without bit b and takes row i + b's words k - b; row i + b
  // takes row i's words k + b and keeps its own with bit b set (indexes >= 16 select the second row).
  round(8, v16w{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
        v16w{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  round(4, v16w{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
        v16w{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  round(2, v16w{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
        v16w{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  round(1, v16w{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
        v16w{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
  for (int j = 0; j < ROWS; ++j) std::memcpy(out + j * ROWS * 4, &r[j], 64);
}

// The float part of sub-block g (of the decoded inputs or a step aligned to 256 inputs) for one input row, from its q8
// block's scale d and q8::scaled_sum(): sums[v] += s (a d) + b (d sum), vectors over the row group's rows. Every path
// (here, block_decode.h, arch/x86/amx/block_prefill.h) calls it with the exact int32 sub-block sums s, so an output's
// bits do not depend on the path. Formats without an offset (Q8_0) have no b term; for those whose offset is b = -OFF
// a (OFF a power of two), b (d sum) is computed as a (-OFF d sum), the same number: scaling by a power of two
// commutes with rounding. So their b is never stored.
template <class F>
static inline void accumulate(vf* sums, const i8::I32* s, const float* a, const float* b, float d, float dsum) {
  static_assert((F::OFF & (F::OFF - 1)) == 0, "an offset that is not a power of two would round differently");
  const vf scale = splat(d);
  for (int v = 0; v < V; ++v) {
    const vf av = load_vf(a + v * VL);
    if constexpr (F::MIN) sums[v] += fmadd(i8::to_float(s[v]), av * scale, load_vf(b + v * VL) * splat(dsum));
    else if constexpr (F::OFF) sums[v] += fmadd(i8::to_float(s[v]), av * scale, av * splat(-float(F::OFF) * dsum));
    else sums[v] = fmadd(i8::to_float(s[v]), av * scale, sums[v]);
  }
}
// The same, for sub-block g of the q8 block xb and its scaled sums ds (q8::Rows::sums()).
template <class F>
static inline void accumulate(vf* sums, const i8::I32* s, const float* a, const float* b, const q8::Block& xb,
                              const q8::Sums& ds, int g) {
  accumulate<F>(sums, s, a, b, xb.d, F::MIN || F::OFF ? ds[F::SUB == 16 ? g % 2 : 2] : 0.f);
}

// block_dot::sub_block() for a K-quant's sub-block g, vectors over a row group's rows: is[v] += sc s.
template <class F>
static inline void k_sub_block(i8::I32* is, const i8::I32* s, const KScales& k, int g, const q8::Block* xb) {
  const int32_t xsum = block_dot::sub_block_sum<F>(xb, g);
  for (int v = 0; v < V; ++v)
    is[v] = (i8::I32)block_dot::sub_block<F>((vi)is[v], (vi)s[v], load_vi(k.sc[g] + v * VL), xsum);
}

// block_dot::super() for a super-block of the row group's rows whose integer sums are is, one input row (q8 blocks
// from the super-block's first, xb).
template <class F>
static inline void k_super(vf* sums, const i8::I32* is, const KScales& k, const q8::Block* xb) {
  const vf dx = splat(xb[0].d);
  for (int v = 0; v < V; ++v) {
    vi im = {};
    if constexpr (F::MIN)
      for (int j = 0; j < DECODE_K / F::SUB; ++j) im += load_vi(k.mn[j] + v * VL) * block_dot::sub_block_sum<F>(xb, j);
    sums[v] = block_dot::super<F>(sums[v], (vi)is[v], im, load_vf(k.d + v * VL) * dx, -(load_vf(k.dmin + v * VL) * dx));
  }
}

#if ZHUZI_AVX2 && !ZHUZI_AVXVNNI
// A K-quant's sums on AVX2 without VNNI, the same integers as block_dot.h in 16-bit steps, where the multiplier
// (one port on Zen 2) is what a step waits on. Runs of maddubs pair sums add up in int16 (i16_run()) and meet
// the rows' sub-block scales in one madd. The per-32 terms, the minimums' im = sum_j mn_j sum_j and Q6_K's
// offset sum_g sc_g sum_g (its -32 taken off once per super-block, as llama.cpp does), are int16 pair dots
// too: a block's coefficient pair meets its two 16-input code sums (q8::Block::sum, one word each) in one
// madd, in place of a 32-bit multiply (two uops) per sub-block or minimum. Q3_K's -4 goes as Q6_K's -32, Q2_K's
// minimums per 16 inputs as a pair of coefficients.
namespace runs {

// Each lane's int32 value (within int16) in both of its words, or lo's in the low word and hi's in the high.
static inline __m256i both_words(vi v) { return (__m256i)((v & 0xffff) | (v << 16)); }
static inline __m256i pair_words(vi lo, vi hi) {
  return _mm256_blend_epi16((__m256i)lo, _mm256_slli_epi32((__m256i)hi, 16), 0xAA);
}

// The maddubs pair sums of quad j (codes against 4 broadcast activation codes) into a sub-block's run, which
// meets the scales sc16 (both_words()) in is every RUN quads.
template <int RUN>
static inline void quad(__m256i& run, __m256i& is, __m256i codes, __m256i x4, __m256i sc16, int j) {
  const __m256i pairs = _mm256_maddubs_epi16(codes, x4);
  run = j % RUN ? _mm256_add_epi16(run, pairs) : pairs;
  // Opaque to GCC, which otherwise reassociates a run's chain of adds into a tree: every product of a sub-block
  // live at once, spilled to the stack, twice the instructions.
  __asm__("" : "+x"(run));
  if ((j + 1) % RUN == 0) is = _mm256_add_epi32(is, _mm256_madd_epi16(run, sc16));
}

// term += block b's coefficient pair (scale(g), minimum(j): int32 lanes over the rows, of the sub-blocks in the
// block) times the activation block's two code sums.
template <class F, class Scale, class Minimum>
static inline __m256i block_term(__m256i term, Scale scale, Minimum minimum, int b, const q8::Block& xb) {
  int32_t sums;
  std::memcpy(&sums, xb.sum, 4);
  const auto coefficient = [&](int g) { return F::MIN ? minimum(g) : scale(g); };
  const __m256i c = F::SUB == 32 ? both_words(coefficient(b)) : pair_words(coefficient(2 * b), coefficient(2 * b + 1));
  return _mm256_add_epi32(term, _mm256_madd_epi16(c, _mm256_set1_epi32(sums)));
}

// The super-block's is (Q6_K: less its offsets) and im from the sums without offsets and the block terms.
template <class F>
static inline void close(i8::I32& is, i8::I32& im, __m256i term) {
  if constexpr (F::MIN) im = term;
  else if constexpr (F::OFF) is = (i8::I32)((vi)is - F::OFF * (vi)term);
}

}  // namespace runs

// apply() for a K-quant super-block: a half of the row group's rows (one vector) at a time, so that a pass's runs
// and sums fit the 16 registers.
template <class F, int P>
static void apply_runs(const Decoded& t, const q8::Block* const* x, float (*acc)[ROWS]) {
  constexpr int QSUB = F::SUB / 4, RUN = i16_run<F>();
  for (int v = 0; v < V; ++v) {
    __m256i is[P], run[P];
    for (int m = 0; m < P; ++m) is[m] = i8::zero();
    for (int g = 0; g < DECODE_K / F::SUB; ++g) {
      const __m256i sc16 = runs::both_words(load_vi(t.k.sc[g] + v * VL));
#pragma GCC unroll 8
      for (int j = 0; j < QSUB; ++j) {
        const __m256i codes = i8::load_b8(t.codes[g * QSUB + j][v * i8::LANES]);
        for (int m = 0; m < P; ++m)
          runs::quad<RUN>(run[m], is[m], codes, broadcast4(x[m][g * F::SUB / 32].q + g * F::SUB % 32 + 4 * j), sc16, j);
      }
    }
    const auto scale = [&](int g) { return load_vi(t.k.sc[g] + v * VL); };
    const auto minimum = [&](int j) { return load_vi(t.k.mn[j] + v * VL); };
    const vf d = load_vf(t.k.d + v * VL), dmin = load_vf(t.k.dmin + v * VL);
    for (int m = 0; m < P; ++m) {
      __m256i term = i8::zero();
      for (int b = 0; b < DECODE_K / 32; ++b) term = runs::block_term<F>(term, scale, minimum, b, x[m][b]);
      i8::I32 im = i8::zero();
      runs::close<F>(is[m], im, term);
      const vf dx = splat(x[m][0].d);
      store_vf(block_dot::super<F>(load_vf(acc[m] + v * VL), (vi)is[m], (vi)im, d * dx, -(dmin * dx)), acc[m] + v * VL);
    }
  }
}
#endif

// Rows [0, rows) (the rest zeros) of a row group whose first row's blocks start at w, inputs [k0, k0 + n): n a
// multiple of F::QK, at most DECODE_K.
template <class F>
static void decode(const uint8_t* w, int64_t row_bytes, int rows, int64_t k0, int n, Decoded& t) {
  constexpr int SUBS = F::QK / F::SUB;
  alignas(64) uint8_t q[ROWS][DECODE_K];
  for (int r = 0; r < ROWS; ++r) {
    if (r >= rows) {
      std::memset(q[r], 0, n);
      for (int g = 0; g < DECODE_K / 16; ++g) t.a[g][r] = t.b[g][r] = 0.f, t.k.sc[g][r] = 0;
      for (int j = 0; j < 16; ++j) t.k.mn[j][r] = 0;
      t.k.d[r] = t.k.dmin[r] = 0.f;
      continue;
    }
    const uint8_t* src = w + r * row_bytes + k0 / F::QK * F::BYTES;
    for (int blk = 0; blk < n / F::QK; ++blk) {
      float a[SUBS], b[SUBS];
      F::decode(src + blk * F::BYTES, q[r] + blk * F::QK, a, b);
      if constexpr (F::QK == DECODE_K) {
        int32_t sc[16], mn[16];
        F::ints(src, sc, mn, t.k.d[r], t.k.dmin[r]);
        for (int g = 0; g < SUBS; ++g) t.k.sc[g][r] = sc[g];
        if constexpr (F::MIN)
          for (int j = 0; j < SUBS; ++j) t.k.mn[j][r] = mn[j];
        continue;
      }
      for (int g = 0; g < SUBS; ++g) t.a[blk * SUBS + g][r] = a[g];
      if constexpr (F::MIN)
        for (int g = 0; g < SUBS; ++g) t.b[blk * SUBS + g][r] = b[g];
    }
  }
  for (int quad = 0; quad < n / 4; quad += 16) interleave(&q[0][4 * quad], &t.codes[quad][0][0]);
}

// acc[m][r] += the decoded inputs' products for P <= MB input rows; x[m]: row m's q8 blocks from their first,
// ds[m] their scaled sums.
template <class F, int P>
static void apply(const Decoded& t, int n, const q8::Block* const* x, const q8::Sums* const* ds, float (*acc)[ROWS]) {
  constexpr int QSUB = F::SUB / 4;  // quads a sub-block
  constexpr bool KQ = F::QK == DECODE_K;  // the decoded inputs are one K-quant super-block
#if ZHUZI_AVX2 && !ZHUZI_AVXVNNI
  if constexpr (KQ && !F::SIGNED) return apply_runs<F, P>(t, x, acc);  // signed codes (IQ4_XS): dot_s8s8()
#endif
  vf sums[P][V];
  i8::I32 is[P][V];
  for (int m = 0; m < P; ++m)
    for (int v = 0; v < V; ++v) sums[m][v] = load_vf(acc[m] + v * VL), is[m][v] = i8::zero();
  for (int g = 0; g < n / F::SUB; ++g) {
    // The sub-block's codes in each input row: the quads below sit at fixed offsets from them, so that every
    // dot product takes its broadcast operand straight from memory (one instruction, no address arithmetic).
    const int8_t* xg[P];
    for (int m = 0; m < P; ++m) xg[m] = x[m][g * F::SUB / 32].q + g * F::SUB % 32;
    i8::I32 s[P][V];
    for (int m = 0; m < P; ++m)
      for (int v = 0; v < V; ++v) s[m][v] = i8::zero();
#pragma GCC unroll 8
    for (int j = 0; j < QSUB; ++j) {
      i8::B8 w[V];
      for (int v = 0; v < V; ++v) w[v] = i8::load_b8(t.codes[g * QSUB + j][v * i8::LANES]);
      for (int m = 0; m < P; ++m)
        for (int v = 0; v < V; ++v)
          s[m][v] = F::SIGNED ? i8::dot_s8s8(s[m][v], w[v], broadcast4(xg[m] + 4 * j))
                              : i8::dot_u8s8_at(s[m][v], w[v], xg[m] + 4 * j);
    }
    const int blk = g * F::SUB / 32;
    for (int m = 0; m < P; ++m)
      if constexpr (KQ) k_sub_block<F>(is[m], s[m], t.k, g, x[m]);
      else accumulate<F>(sums[m], s[m], t.a[g], t.b[g], x[m][blk], ds[m][blk], g);
  }
  if constexpr (KQ)
    for (int m = 0; m < P; ++m) k_super<F>(sums[m], is[m], t.k, x[m]);
  for (int m = 0; m < P; ++m)
    for (int v = 0; v < V; ++v) store_vf(sums[m][v], acc[m] + v * VL);
}

// A 16-row group of a matrix (K inputs a row) against input rows [m0, m1) of x (q8 rows of K inputs): acc[m -
// m0][r] = the sum of products (acc holds m1 - m0 rows). decode(k0, n, t) fills t with the row group's inputs
// [k0, k0 + n): decoder() from the file's blocks, or from packed ones (packed_blocks.h).
template <class F, typename Decode>
static void row_group(Decode decode, int64_t K, const q8::Rows& x, int64_t m0, int64_t m1, float (*acc)[ROWS]) {
  Decoded t;
  std::memset(acc, 0, sizeof(float) * ROWS * (m1 - m0));
  for (int64_t k0 = 0; k0 < K; k0 += DECODE_K) {
    const int n = int(std::min<int64_t>(DECODE_K, K - k0));
    decode(k0, n, t);
    for (int64_t m = m0; m < m1; m += MB) {
      const int count = int(std::min<int64_t>(MB, m1 - m));
      const q8::Block* rows_x[MB];
      const q8::Sums* rows_ds[MB];
      for (int i = 0; i < count; ++i) rows_x[i] = x.row(m + i) + k0 / 32, rows_ds[i] = x.sums(m + i) + k0 / 32;
      with_rows<MB>(count, [&](auto p) { apply<F, decltype(p)::value>(t, n, rows_x, rows_ds, acc + (m - m0)); });
    }
  }
}

// row_group()'s decode for rows [0, rows) of the file's blocks from w.
template <class F>
static auto decoder(const uint8_t* w, int64_t row_bytes, int rows) {
  return [=](int64_t k0, int n, Decoded& t) { decode<F>(w, row_bytes, rows, k0, n, t); };
}

// The inputs that share an activation scale (q8::Rows' span) for weights of `type`: their block's length,
// 32, or 256 for the K-quants (block_dot.h).
static inline int span(int type) {
  int n = q8::BLOCK;
  blocks::with_format(type, [&](auto f) { n = decltype(f)::QK; });
  return n;
}

// Whether a matrix of `type` blocks with rows of row_bytes bytes holds K inputs a row.
static inline bool serves(int type, int64_t K, int64_t row_bytes) {
  bool ok = false;
  blocks::with_format(type, [&](auto f) {
    using F = decltype(f);
    ok = K % F::QK == 0 && row_bytes == K / F::QK * F::BYTES;
  });
  return ok;
}

}  // namespace block_prefill
