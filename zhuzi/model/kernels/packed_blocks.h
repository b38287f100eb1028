// The block kernels on packed GGUF matrices (packed_layout.h): decode rows, and the decode of a unit into
// block_prefill.h's decoded inputs for many input rows. The sums are block_dot.h's, bit for bit: exact int32 per
// sub-block, then the float steps of block_prefill.h's accumulate() (32-blocks) or of block_dot::super() (K-quants,
// their scales as integers) in input order; an output is the same bits as on the file's layout, on every path.
#pragma once
#include "block_prefill.h"
#include "packed_layout.h"

namespace packed {

static_assert(ROWS == block_prefill::ROWS, "a packed group is a row group's rows");
using block_prefill::V;

typedef uint8_t vb __attribute__((vector_size(4 * i8::LANES)));  // a lane's 4 bytes, for every lane

typedef uint16_t vw __attribute__((vector_size(4 * i8::LANES)));

static inline vb load_vb(const uint8_t* p) { vb v; std::memcpy(&v, p, sizeof v); return v; }
// Every byte's bits moved left by s (right for s < 0), those that cross into a neighbour byte left for the
// caller's mask: a 16-bit shift, where a byte shift costs x86 a mask more.
static inline vb shift(vb v, int s) { return (vb)(s >= 0 ? (vw)v << s : (vw)v >> -s); }
static inline void store_vi(vi v, int32_t* p) { std::memcpy(p, &v, sizeof v); }
// VL bytes, unsigned or signed, -> int32 lanes (GCC's convertvector goes through scalars here).
template <bool SIGNED>
static inline vi widen_lanes(const uint8_t* p) {
#if ZHUZI_AVX512
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vi)(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif ZHUZI_AVX2
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vi)(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  vi w;
  for (int l = 0; l < VL; ++l) w[l] = SIGNED ? int32_t(int8_t(p[l])) : int32_t(p[l]);
  return w;
#endif
}
static inline vf halves(const uint8_t* p) {  // VL IEEE halves -> floats, exactly
#if ZHUZI_AVX512
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif ZHUZI_AVX2
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif ZHUZI_NEON
  uint16_t h[4];
  std::memcpy(h, p, 8);
  return (vf)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
#else
  vf v;
  for (int l = 0; l < VL; ++l) v[l] = half_to_float(uint16_t(p[2 * l] | p[2 * l + 1] << 8));
  return v;
#endif
}

// The scales d of a packed unit p's rows of vector v: fp16, or MXFP4's E8M0 bytes.
template <class F>
static inline vf scale(const uint8_t* p, int v) {
  if constexpr (E8M0<F>) return blocks::e8m0_half((vu)widen_lanes<false>(p + Layout<F>::D + v * VL));
  return halves(p + Layout<F>::D + 2 * v * VL);
}

// A sub-block's codes, 8 inputs of every row a pair: pair j's first and second 4 inputs (nibbles, with Q5's fifth
// bits; Q6_K's whole codes; Q8_0's bytes as stored; Q3_K's and Q2_K's 2 bits, with Q3_K's third; the LUT formats'
// table values, looked up from the nibbles).
template <class F>
struct Codes {
  static constexpr int PAIRS = F::SUB / 8;
  static constexpr int STRIDE = (BYTE_CODES<F> ? 2 : 1) * ROWS * 4;  // bytes from a pair to the next
  // bytes of a sub-block's codes
  static constexpr int SUB_BYTES = Q6K<F> ? 3 * ROWS * 4 : TWO_BIT<F> ? ROWS * 4 : PAIRS * STRIDE;
  const uint8_t* lanes;  // the sub-block's first pair, at a vector's first row
  vb top;
  vb q6[4];  // Q6_K: the sub-block's 4 quads
  int first = 0;  // Q3_K: the sub-block's first quad in its 32 inputs' top bits
  Codes(const uint8_t* p, int g, int v) : lanes(p + Layout<F>::CODES + g * SUB_BYTES + v * i8::LANES * 4) {
    top = FIFTH<F> ? load_vb(p + Layout<F>::TOP + (g * ROWS + v * i8::LANES) * 4) : vb{};
    if constexpr (Q3K<F>) top = load_vb(p + Layout<F>::TOP + (g / 2 * ROWS + v * i8::LANES) * 4), first = 4 * (g % 2);
    if constexpr (Q6K<F>) {
      // Three vectors hold quads 0-2 in their low 6 bits and quad 3's code, 2 bits each, in their top 2: eleven
      // operations for 4 quads, where nibbles and a vector of top bits took seventeen.
      vb t[3];
      for (int k = 0; k < 3; ++k) t[k] = load_vb(lanes + k * ROWS * 4), q6[k] = t[k] & 63;
      q6[3] = (shift(t[0], -6) & 3) | (shift(t[1], -4) & 12) | (shift(t[2], -2) & 48);
    }
  }
  void pair(int j, i8::B8& lo, i8::B8& hi) const {
    if constexpr (Q6K<F>) {
      lo = (i8::B8)q6[2 * j], hi = (i8::B8)q6[2 * j + 1];
      return;
    }
    if constexpr (TWO_BIT<F>) {  // quads 2j and 2j + 1 at bits 4j and 4j + 2; Q3_K's third bits to bit 2
      const vb raw = load_vb(lanes);
      vb l = shift(raw, -4 * j) & 3, h = shift(raw, -4 * j - 2) & 3;
      if constexpr (Q3K<F>) l |= shift(top, 2 - first - 2 * j) & 4, h |= shift(top, 1 - first - 2 * j) & 4;
      lo = (i8::B8)l, hi = (i8::B8)h;
      return;
    }
    const vb raw = load_vb(lanes + j * STRIDE);
    if constexpr (BYTE_CODES<F>) {
      lo = (i8::B8)raw, hi = (i8::B8)load_vb(lanes + j * STRIDE + ROWS * 4);
      return;
    }
    vb l = raw & 15, h = shift(raw, -4) & 15;
    if constexpr (blocks::LUT<F>) {  // indexes -> the table's values
      const i8::B8 table = i8::table16(F::VALUES);
      lo = i8::look_up(table, (i8::B8)l), hi = i8::look_up(table, (i8::B8)h);
      return;
    }
    // Q5: a code's fifth bit sits at bit c of its byte of top (c: 0, 1 the low and high nibbles of pair 0,
    // then pair 1's...) and goes to bit 4: one shift, one mask each.
    if constexpr (FIFTH<F>) l |= shift(top, 4 - 2 * j) & 0x10, h |= shift(top, 3 - 2 * j) & 0x10;
    lo = (i8::B8)l, hi = (i8::B8)h;
  }
};

// s[m] += the products of a pair's codes with x[m] at input `at` of its q8 block. Q8_0's signed codes go in
// biased by 128 where dot_u8s8 is exact for any byte (the caller takes 128 times the inputs' sum off).
template <class F, int P>
static inline void dot_pair(i8::I32* s, i8::B8 lo, i8::B8 hi, const q8::Block* const* x, int at) {
  constexpr bool BIASED = F::SIGNED && i8::EXACT_U8;
  if constexpr (BIASED) lo = (i8::B8)((vu)lo ^ 0x80808080u), hi = (i8::B8)((vu)hi ^ 0x80808080u);
  for (int m = 0; m < P; ++m) {
    const int8_t* xq = x[m][at / 32].q + at % 32;
    if constexpr (F::SIGNED && !BIASED)
      s[m] = i8::dot_s8s8(i8::dot_s8s8(s[m], lo, block_prefill::broadcast4(xq)), hi, block_prefill::broadcast4(xq + 4));
    else s[m] = i8::dot_u8s8_at(i8::dot_u8s8_at(s[m], lo, xq), hi, xq + 4);
  }
}

// A K-quant sub-block g's scales (Q3_K: less 32) and minimums j for the rows of vector v of packed unit p, as int32
// lanes: blocks.h's ints() over the rows.
template <class F>
static inline vi scale_lanes(const uint8_t* p, int g, int v) {
  const uint8_t* s = p + Layout<F>::SC + v * VL;  // byte i of each row's scales at s + i * ROWS
  if constexpr (Q2K<F>) return widen_lanes<false>(s + g * ROWS) & 15;
  if constexpr (Q3K<F>)
    return (((widen_lanes<false>(s + g % 8 * ROWS) >> (4 * (g / 8))) & 15)
            | ((widen_lanes<false>(s + (8 + g % 4) * ROWS) >> (2 * (g / 4))) & 3) << 4) - 32;
  return widen_lanes<SIGNED_SCALES<F>>(s + g * ROWS);
}
template <class F>
static inline vi minimum_lanes(const uint8_t* p, int j, int v) {
  if constexpr (Q2K<F>) return widen_lanes<false>(p + Layout<F>::SC + j * ROWS + v * VL) >> 4;
  return widen_lanes<false>(p + Layout<F>::MN + j * ROWS + v * VL);
}

// How far ahead of the unit in use a row group's stream is fetched into L2: the hardware prefetchers alone
// leave a decode step well below the read bandwidth (docs/benchmarks.md). A prefetch past the matrix's end
// never faults.
constexpr int AHEAD = 48 << 10;

// Fetches slice g of the SUBS slices of the unit AHEAD bytes past p: a K-quant unit's lines spread over its
// sub-blocks, as they are read (one burst of prefetches a unit stalls a small core at each unit's first load). On
// AVX2, Q6_K's rows read faster with only a slice's first line fetched (its 256 bytes a sub-block; the L2's own
// prefetcher follows the rest), Q4_K's with every line.
template <class F>
static inline void fetch_ahead(const uint8_t* p, int g) {
  constexpr int UNIT = ROWS * Layout<F>::BYTES, SUBS = F::QK / F::SUB, SLICE = (UNIT / SUBS + 63) / 64 * 64;
#if ZHUZI_AVX2
  constexpr int STEP = Q6K<F> ? SLICE : 64;
#else
  constexpr int STEP = 64;
#endif
#pragma GCC unroll 8
  for (int o = g * SLICE; o < std::min(UNIT, (g + 1) * SLICE); o += STEP) __builtin_prefetch(p + AHEAD + o, 0, 2);
}

// A K-quant super-block's integer sums is[m][v] and, with minimums, im[m][v] (block_dot.h): exact, whatever
// the path.
template <class F, int P>
static inline void integer_sums(const uint8_t* p, const q8::Block* const* x, i8::I32 (*is)[V], i8::I32 (*im)[V]) {
#if ZHUZI_AVX2 && !ZHUZI_AVXVNNI
  if constexpr (P <= 2 && !F::SIGNED) {  // signed codes (IQ4_XS) go through dot_pair()'s sign transfer
    constexpr int RUN = block_prefill::i16_run<F>();
#pragma GCC unroll 16
    for (int g = 0; g < 256 / F::SUB; ++g) {
      fetch_ahead<F>(p, g);
      for (int v = 0; v < V; ++v) {
        const Codes<F> codes(p, g, v);
        const __m256i sc16 = block_prefill::runs::both_words(scale_lanes<F>(p, g, v));
        __m256i run[P];
        for (int j = 0; j < Codes<F>::PAIRS; ++j) {
          i8::B8 lo, hi;
          codes.pair(j, lo, hi);
          const int at = g * F::SUB + 8 * j;
          for (int m = 0; m < P; ++m) {
            const int8_t* xq = x[m][at / 32].q + at % 32;
            block_prefill::runs::quad<RUN>(run[m], is[m][v], lo, block_prefill::broadcast4(xq), sc16, 2 * j);
            block_prefill::runs::quad<RUN>(run[m], is[m][v], hi, block_prefill::broadcast4(xq + 4), sc16, 2 * j + 1);
          }
        }
      }
    }
    for (int v = 0; v < V; ++v) {
      const auto scale = [&](int g) { return scale_lanes<F>(p, g, v); };
      const auto minimum = [&](int j) { return minimum_lanes<F>(p, j, v); };
      for (int m = 0; m < P; ++m) {
        __m256i term = i8::zero();
        for (int b = 0; b < 8; ++b) term = block_prefill::runs::block_term<F>(term, scale, minimum, b, x[m][b]);
        block_prefill::runs::close<F>(is[m][v], im[m][v], term);
      }
    }
    return;
  }
#endif
#pragma GCC unroll 16
  for (int g = 0; g < 256 / F::SUB; ++g) {
    fetch_ahead<F>(p, g);
    for (int v = 0; v < V; ++v) {
      const Codes<F> codes(p, g, v);
      i8::I32 s[P];
      for (int m = 0; m < P; ++m) s[m] = i8::zero();
      for (int j = 0; j < Codes<F>::PAIRS; ++j) {
        i8::B8 lo, hi;
        codes.pair(j, lo, hi);
        dot_pair<F, P>(s, lo, hi, x, g * F::SUB + 8 * j);
      }
      const vi sc = scale_lanes<F>(p, g, v);
      for (int m = 0; m < P; ++m) {
        const int32_t xsum = block_dot::sub_block_sum<F>(x[m], g);
        const vi sv = F::SIGNED && i8::EXACT_U8 ? (vi)s[m] - 128 * xsum : (vi)s[m];  // dot_pair()'s bias taken off
        is[m][v] = (i8::I32)block_dot::sub_block<F>((vi)is[m][v], sv, sc, xsum);
      }
    }
  }
  if constexpr (F::MIN)
    for (int v = 0; v < V; ++v) {
      constexpr int SUBS = 256 / F::SUB;
      vi mn[SUBS];
      for (int j = 0; j < SUBS; ++j) mn[j] = minimum_lanes<F>(p, j, v);
      for (int m = 0; m < P; ++m) {
        vi t = {};
        for (int j = 0; j < SUBS; ++j) t += mn[j] * block_dot::sub_block_sum<F>(x[m], j);
        im[m][v] = (i8::I32)t;
      }
    }
}

// sums[m] += the products of packed unit p (16 rows) with input rows x[m] (q8 blocks of the unit: span 256 for
// the K-quants, 32 otherwise; ds[m] their scaled sums), m < P.
template <class F, int P>
static inline void apply(const uint8_t* p, const q8::Block* const* x, const q8::Sums* const* ds, vf (*sums)[V]) {
  using L = Layout<F>;
  if constexpr (F::QK == 32) {
    i8::I32 s[P][V];
    for (int v = 0; v < V; ++v) {
      const Codes<F> codes(p, 0, v);
      i8::I32 sv[P];
      for (int m = 0; m < P; ++m) sv[m] = i8::zero();
      for (int j = 0; j < 4; ++j) {
        i8::B8 lo, hi;
        codes.pair(j, lo, hi);
        dot_pair<F, P>(sv, lo, hi, x, 8 * j);
      }
      for (int m = 0; m < P; ++m)
        s[m][v] = F::SIGNED && i8::EXACT_U8 ? (i8::I32)((vi)sv[m] - 128 * (x[m]->sum[0] + x[m]->sum[1])) : sv[m];
    }
    alignas(64) float a[ROWS], b[ROWS];
    for (int v = 0; v < V; ++v) {
      store_vf(scale<F>(p, v), a + v * VL);
      if constexpr (F::MIN) store_vf(halves(p + L::DMIN + 2 * v * VL), b + v * VL);
    }
    for (int m = 0; m < P; ++m) block_prefill::accumulate<F>(sums[m], s[m], a, b, *x[m], *ds[m], 0);
    return;
  }
  i8::I32 is[P][V], im[P][V];
  for (int m = 0; m < P; ++m)
    for (int v = 0; v < V; ++v) is[m][v] = im[m][v] = i8::zero();
  integer_sums<F, P>(p, x, is, im);
  for (int v = 0; v < V; ++v) {
    const vf d = halves(p + L::D + 2 * v * VL);
    const vf dmin = F::MIN ? halves(p + L::DMIN + 2 * v * VL) : vf{};
    for (int m = 0; m < P; ++m) {
      const vf dx = splat(x[m][0].d);
      sums[m][v] = block_dot::super<F>(sums[m][v], (vi)is[m][v], (vi)im[m][v], d * dx, -(dmin * dx));
    }
  }
}

// P input rows x[m] (q8, from their first block; ds[m] the scaled sums) against the 16 rows of the packed
// group at w (K inputs): acc[m][r]. The sums stay in registers from the first unit to the last.
template <class F, int P>
static void rows(const uint8_t* w, int64_t K, const q8::Block* const* x, const q8::Sums* const* ds, float (*acc)[ROWS]) {
  constexpr int UNIT = ROWS * Layout<F>::BYTES, XB = F::QK / 32;
  vf sums[P][V] = {};
  for (int64_t u = 0; u < K / F::QK; ++u) {
    const uint8_t* p = w + u * UNIT;
    if constexpr (F::QK == 32)  // a K-quant's integer_sums() fetches its unit's lines sub-block by sub-block
      for (int o = 0; o < UNIT; o += 64) __builtin_prefetch(p + AHEAD + o, 0, 2);
    const q8::Block* xu[P];
    const q8::Sums* du[P];
    for (int m = 0; m < P; ++m) xu[m] = x[m] + u * XB, du[m] = ds[m] + u * XB;
    apply<F, P>(p, xu, du, sums);
  }
  for (int m = 0; m < P; ++m)
    for (int v = 0; v < V; ++v) store_vf(sums[m][v], acc[m] + v * VL);
}

// The 16 rows of the packed group at w (K inputs) against input rows [m0, m1) of x (q8 rows of the unit's
// span): acc[m - m0][r], MB input rows a pass. For decode rows; many rows take block_prefill::row_group() with
// decoder().
template <class F>
static void row_group(const uint8_t* w, int64_t K, const q8::Rows& x, int64_t m0, int64_t m1,
                      float (*acc)[ROWS]) {
  constexpr int MB = block_prefill::MB;
  for (int64_t m = m0; m < m1; m += MB) {
    const int count = int(std::min<int64_t>(MB, m1 - m));
    const q8::Block* xs[MB];
    const q8::Sums* ds[MB];
    for (int i = 0; i < count; ++i) xs[i] = x.row(m + i), ds[i] = x.sums(m + i);
    with_rows<MB>(count, [&](auto p) { rows<F, decltype(p)::value>(w, K, xs, ds, acc + (m - m0)); });
  }
}

// block_prefill::row_group()'s decode of a packed group at w (many input rows): a unit's codes are Decoded's codes
// as they lie, two nibbles a byte (with Q6_K's top or Q5's fifth bits), its scales widened; no transposes,
// unlike the file's blocks.
template <class F>
static auto decoder(const uint8_t* w) {
  return [=](int64_t k0, int n, block_prefill::Decoded& t) {
    using L = Layout<F>;
    constexpr int SUBS = F::QK / F::SUB;
    for (int u = 0; u < n / F::QK; ++u) {
      const uint8_t* p = w + (k0 / F::QK + u) * ROWS * L::BYTES;
      for (int g = 0; g < SUBS; ++g)
        for (int v = 0; v < V; ++v) {
          const Codes<F> codes(p, g, v);
          for (int j = 0; j < Codes<F>::PAIRS; ++j) {
            i8::B8 lo, hi;
            codes.pair(j, lo, hi);
            const int quad = u * F::QK / 4 + 2 * (g * Codes<F>::PAIRS + j);
            std::memcpy(t.codes[quad][v * i8::LANES], &lo, sizeof lo);
            std::memcpy(t.codes[quad + 1][v * i8::LANES], &hi, sizeof hi);
          }
          if constexpr (F::QK == 256) store_vi(scale_lanes<F>(p, g, v), t.k.sc[g] + v * VL);
        }
      for (int v = 0; v < V; ++v) {
        const vf d = scale<F>(p, v), m = F::MIN ? halves(p + L::DMIN + 2 * v * VL) : vf{};
        if constexpr (F::QK == 32) {
          store_vf(d, t.a[u] + v * VL);
          if constexpr (F::MIN) store_vf(m, t.b[u] + v * VL);
          continue;
        }
        store_vf(d, t.k.d + v * VL);
        if constexpr (F::MIN) {
          store_vf(m, t.k.dmin + v * VL);
          for (int j = 0; j < SUBS; ++j) store_vi(minimum_lanes<F>(p, j, v), t.k.mn[j] + v * VL);
        }
      }
    }
  };
}

}  // namespace packed
