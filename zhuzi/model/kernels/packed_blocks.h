// GGUF block matrices repacked at load (cpu_blocks.pack_rows()) into the layout their dot products read: a
// group of 16 output rows stores each unit of inputs (a K-quant's 256-input super-block, a 32-block) as one
// run of bytes, the codes of the same 4 inputs of all 16 rows side by side (4 bytes a row), and the scales as
// arrays over the rows. One vector load then holds a lane per row: the rows' codes meet an input row's 4
// activation codes, broadcast, in one int8 dot product per lane, with no unpacking of 16 separate streams and
// no horizontal sum (llama.cpp's "x8" repacked layouts are the same idea over 8 rows). A group is one
// contiguous stream, every group after the last. The layout is the same for every variant (only the vector
// width differs), and a group holds 16 rows of exactly the bytes of the file, bar Q4_K's and Q5_K's scales,
// unpacked from 6 to 8 bits (148 and 180 bytes a row and super-block in place of 144 and 176).
//
// A packed unit of 16 rows (r: row, b < 4: byte of a lane), codes as blocks.h decodes them:
//   4- and 5-bit codes  codes[pairs][16][4]  pair p: low nibble = code of input 8p + b, high = input 8p + 4 + b
//   Q8_0                codes[8][16][4]      quad q: input 4q + b, as stored (signed)
//   Q5_0, Q5_1, Q5_K    top[groups][16][4]   per 32 inputs: bits 2p, 2p + 1 = the fifth bits of pair p's codes
//   Q6_K                top[16][16][4]       group g (16 inputs): bits 2i, 2i + 1 = top 2 bits of 16g + 4i + b
//   Q4_K  sc[8][16], mn[8][16] (uint8), d[16], dmin[16] (fp16)                              2,368 bytes
//   Q5_K  as Q4_K, after its top bits                                                      2,880 bytes
//   Q6_K  sc[16][16] (int8), d[16] (fp16)                                                    3,360 bytes
//   32-blocks  d[16] (fp16), and for Q4_1, Q5_1 m[16] (fp16)                   16 times the file's block
//
// The sums are block_dot.h's, bit for bit: exact int32 per group, then the float steps of block_tiles.h's
// accumulate() (32-blocks) or of block_dot::super() (K-quants, their scales as integers) in input order; an
// output is the same bits as on the file's layout, on every path.
#pragma once
#include "block_tiles.h"

namespace packed {

using block_tiles::ROWS;
using block_tiles::V;
using blocks::Format;

constexpr int32_t FLAG = 0x100;  // a Part's type: FLAG | the GGUF type its blocks were packed from

// Byte offsets in a packed unit (0: the format has no such field); BYTES: a row's share of a unit.
template <class F> struct Layout;
template <> struct Layout<Format<blocks::Q4_K>> { static constexpr int BYTES = 148, TOP = 0, SC = 2048, MN = 2176, D = 2304, DMIN = 2336; };
template <> struct Layout<Format<blocks::Q5_K>> { static constexpr int BYTES = 180, TOP = 2048, SC = 2560, MN = 2688, D = 2816, DMIN = 2848; };
template <> struct Layout<Format<blocks::Q6_K>> { static constexpr int BYTES = 210, TOP = 2048, SC = 3072, MN = 0, D = 3328, DMIN = 0; };
template <> struct Layout<Format<blocks::Q4_0>> { static constexpr int BYTES = 18, TOP = 0, SC = 0, MN = 0, D = 256, DMIN = 0; };
template <> struct Layout<Format<blocks::Q4_1>> { static constexpr int BYTES = 20, TOP = 0, SC = 0, MN = 0, D = 256, DMIN = 288; };
template <> struct Layout<Format<blocks::Q5_0>> { static constexpr int BYTES = 22, TOP = 256, SC = 0, MN = 0, D = 320, DMIN = 0; };
template <> struct Layout<Format<blocks::Q5_1>> { static constexpr int BYTES = 24, TOP = 256, SC = 0, MN = 0, D = 320, DMIN = 352; };
template <> struct Layout<Format<blocks::Q8_0>> { static constexpr int BYTES = 34, TOP = 0, SC = 0, MN = 0, D = 512, DMIN = 0; };

// Calls fn(Format<T>{}) for a packed type (FLAG | T); false for any other.
template <typename Fn>
static bool with_format(int type, Fn fn) {
  using namespace blocks;
  switch (type) {
    case FLAG | Q4_0: fn(Format<Q4_0>{}); return true;
    case FLAG | Q4_1: fn(Format<Q4_1>{}); return true;
    case FLAG | Q5_0: fn(Format<Q5_0>{}); return true;
    case FLAG | Q5_1: fn(Format<Q5_1>{}); return true;
    case FLAG | Q8_0: fn(Format<Q8_0>{}); return true;
    case FLAG | Q4_K: fn(Format<Q4_K>{}); return true;
    case FLAG | Q5_K: fn(Format<Q5_K>{}); return true;
    case FLAG | Q6_K: fn(Format<Q6_K>{}); return true;
    default: return false;
  }
}

// Whether a packed matrix of `type` with rows of row_bytes bytes holds K inputs a row.
static inline bool serves(int type, int64_t K, int64_t row_bytes) {
  bool ok = false;
  with_format(type, [&](auto f) {
    using F = decltype(f);
    ok = K % F::QK == 0 && row_bytes == K / F::QK * Layout<F>::BYTES;
  });
  return ok;
}

// Unit u of the packed group holding row `row`, in a packed matrix w of row_bytes a row.
template <class F, typename T>
static inline T* block(T* w, int64_t row_bytes, int64_t row, int64_t u) {
  return w + row / ROWS * ROWS * row_bytes + u * ROWS * Layout<F>::BYTES;
}

template <class F> constexpr bool BYTE_CODES = std::is_same_v<F, Format<blocks::Q8_0>>;
template <class F> constexpr bool Q6K = std::is_same_v<F, Format<blocks::Q6_K>>;
template <class F>
constexpr bool FIFTH = std::is_same_v<F, Format<blocks::Q5_0>> || std::is_same_v<F, Format<blocks::Q5_1>>
                       || std::is_same_v<F, Format<blocks::Q5_K>>;

// 16 rows of unit blocks (row r's at src + r * row_bytes) -> one packed unit at out.
template <class F>
static void pack(const uint8_t* src, int64_t row_bytes, uint8_t* out) {
  using L = Layout<F>;
  for (int r = 0; r < ROWS; ++r) {
    const uint8_t* b = src + r * row_bytes;
    uint8_t q[F::QK];
    float a[F::QK / F::G], off[F::QK / F::G];
    F::decode(b, q, a, off);
    if constexpr (FIFTH<F>)
      for (int g = 0; g < F::QK / 32; ++g) std::memset(out + L::TOP + (g * ROWS + r) * 4, 0, 4);
    for (int p = 0; p < F::QK / 8; ++p)
      for (int i = 0; i < 4; ++i) {
        const uint8_t lo = q[8 * p + i], hi = q[8 * p + 4 + i];
        if constexpr (BYTE_CODES<F>) out[(2 * p * ROWS + r) * 4 + i] = lo, out[((2 * p + 1) * ROWS + r) * 4 + i] = hi;
        else out[(p * ROWS + r) * 4 + i] = uint8_t((lo & 15) | (hi & 15) << 4);
        if constexpr (FIFTH<F>)  // pair p is pair p % 4 of group p / 4 (32 inputs)
          out[L::TOP + (p / 4 * ROWS + r) * 4 + i] |= uint8_t((lo >> 4) << (2 * (p % 4)) | (hi >> 4) << (2 * (p % 4) + 1));
      }
    if constexpr (F::QK == 256) {
      int32_t sc[16], mn[8];
      float d, dmin;
      F::ints(b, sc, mn, d, dmin);
      for (int g = 0; g < 256 / F::G; ++g) out[L::SC + g * ROWS + r] = uint8_t(sc[g]);
      if constexpr (Q6K<F>) {
        for (int g = 0; g < 16; ++g)
          for (int i = 0; i < 4; ++i) {
            uint8_t top = 0;
            for (int t = 0; t < 4; ++t) top |= uint8_t((q[16 * g + 4 * t + i] >> 4) << (2 * t));
            out[L::TOP + (g * ROWS + r) * 4 + i] = top;
          }
        std::memcpy(out + L::D + 2 * r, b + 208, 2);
        continue;
      }
      for (int j = 0; j < 8; ++j) out[L::MN + j * ROWS + r] = uint8_t(mn[j]);
    }
    std::memcpy(out + L::D + 2 * r, b, 2);  // d, then dmin (K-quants) or m (Q4_1, Q5_1)
    if constexpr (F::MIN) std::memcpy(out + L::DMIN + 2 * r, b + 2, 2);
  }
}

// Row r of a packed unit p, as F::decode() gives it from the file's block: codes q, scales a, offsets b.
template <class F>
static void decode(const uint8_t* p, int r, uint8_t* q, float* a, float* b) {
  using L = Layout<F>;
  for (int j = 0; j < F::QK / 8; ++j)
    for (int i = 0; i < 4; ++i) {
      if constexpr (BYTE_CODES<F>) {
        q[8 * j + i] = p[(2 * j * ROWS + r) * 4 + i], q[8 * j + 4 + i] = p[((2 * j + 1) * ROWS + r) * 4 + i];
        continue;
      }
      const uint8_t c = p[(j * ROWS + r) * 4 + i];
      q[8 * j + i] = c & 15, q[8 * j + 4 + i] = c >> 4;
      if constexpr (FIFTH<F>) {
        const uint8_t top = p[L::TOP + (j / 4 * ROWS + r) * 4 + i];
        q[8 * j + i] |= ((top >> (2 * (j % 4))) & 1) << 4, q[8 * j + 4 + i] |= ((top >> (2 * (j % 4) + 1)) & 1) << 4;
      }
    }
  uint16_t h[2];
  std::memcpy(h, p + L::D + 2 * r, 2);
  const float d = half_to_float(h[0]);
  float dmin = 0.f;
  if constexpr (F::MIN) std::memcpy(h + 1, p + L::DMIN + 2 * r, 2), dmin = half_to_float(h[1]);
  if constexpr (F::QK == 32) {
    a[0] = d, b[0] = dmin;
  } else if constexpr (Q6K<F>) {
    for (int g = 0; g < 16; ++g) {
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 4; ++t) q[16 * g + 4 * t + i] |= ((p[L::TOP + (g * ROWS + r) * 4 + i] >> (2 * t)) & 3) << 4;
      a[g] = d * float(int8_t(p[L::SC + g * ROWS + r]));
    }
  } else {
    for (int j = 0; j < 8; ++j) a[j] = d * float(p[L::SC + j * ROWS + r]), b[j] = -(dmin * float(p[L::MN + j * ROWS + r]));
  }
}

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

// A group's codes, 8 inputs of every row a pair: pair j's first and second 4 inputs (nibbles, with Q6_K's
// top bits or Q5's fifth bits; Q8_0's bytes as stored).
template <class F>
struct Codes {
  static constexpr int PAIRS = F::G / 8;
  static constexpr int STRIDE = (BYTE_CODES<F> ? 2 : 1) * ROWS * 4;  // bytes from a pair to the next
  const uint8_t* lanes;  // the group's first pair, at a vector's first row
  vb top;
  Codes(const uint8_t* p, int g, int v) : lanes(p + g * PAIRS * STRIDE + v * i8::LANES * 4) {
    top = Q6K<F> || FIFTH<F> ? load_vb(p + Layout<F>::TOP + (g * ROWS + v * i8::LANES) * 4) : vb{};
  }
  void pair(int j, i8::B8& lo, i8::B8& hi) const {
    const vb raw = load_vb(lanes + j * STRIDE);
    if constexpr (BYTE_CODES<F>) {
      lo = (i8::B8)raw, hi = (i8::B8)load_vb(lanes + j * STRIDE + ROWS * 4);
      return;
    }
    vb l = raw & 15, h = shift(raw, -4) & 15;
    // Q6_K: code c's top bits sit at bit 2c of its byte of top (c: 0, 1 the low and high nibbles of pair 0,
    // then pair 1's) and go to bits 4, 5; Q5: its fifth bit at bit c goes to bit 4. One shift, one mask each.
    if constexpr (Q6K<F>) l |= shift(top, 4 - 4 * j) & 0x30, h |= shift(top, 2 - 4 * j) & 0x30;
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
      s[m] = i8::dot_s8s8(i8::dot_s8s8(s[m], lo, block_tiles::broadcast4(xq)), hi, block_tiles::broadcast4(xq + 4));
    else s[m] = i8::dot_u8s8_at(i8::dot_u8s8_at(s[m], lo, xq), hi, xq + 4);
  }
}

// How far ahead of the unit in use a row group's stream is fetched into L2: the hardware prefetchers alone
// kept a decode step at two thirds of the read bandwidth (a 1.5B's Q6_K LM head: 17 GB/s without, 27-34 with
// 32-64 KiB ahead, on a 2-core Zen 4). A prefetch past the matrix's end never faults.
constexpr int AHEAD = 96 << 10;

// Fetches slice g of GROUPS of the unit AHEAD bytes past p: a K-quant unit's lines spread over its groups, as
// they are read, where one burst of 37-53 prefetches a unit left a 2-core Zen 2 stalled at each unit's first
// load (a third of its time on the 1.5B's Q6_K LM head).
template <class F>
static inline void fetch_ahead(const uint8_t* p, int g) {
  constexpr int UNIT = ROWS * Layout<F>::BYTES, GROUPS = F::QK / F::G, SLICE = (UNIT / GROUPS + 63) / 64 * 64;
#pragma GCC unroll 8
  for (int o = g * SLICE; o < std::min(UNIT, (g + 1) * SLICE); o += 64) __builtin_prefetch(p + AHEAD + o, 0, 2);
}

// A K-quant super-block's integer sums is[m][v] and, with minimums, im[m][v] (block_dot.h): exact, whatever
// the path.
template <class F, int P>
static inline void integer_sums(const uint8_t* p, const q8::Block* const* x, i8::I32 (*is)[V], i8::I32 (*im)[V]) {
  using L = Layout<F>;
#if ZHUZI_AVX2 && !ZHUZI_AVXVNNI
  if constexpr (P <= 2) {
    constexpr int RUN = block_tiles::i16_run<F>();
#pragma GCC unroll 16
    for (int g = 0; g < 256 / F::G; ++g) {
      fetch_ahead<F>(p, g);
      for (int v = 0; v < V; ++v) {
        const Codes<F> codes(p, g, v);
        const __m256i sc16 = block_tiles::runs::both_words(widen_lanes<Q6K<F>>(p + L::SC + g * ROWS + v * VL));
        __m256i run[P];
        for (int j = 0; j < Codes<F>::PAIRS; ++j) {
          i8::B8 lo, hi;
          codes.pair(j, lo, hi);
          const int at = g * F::G + 8 * j;
          for (int m = 0; m < P; ++m) {
            const int8_t* xq = x[m][at / 32].q + at % 32;
            block_tiles::runs::quad<RUN>(run[m], is[m][v], lo, block_tiles::broadcast4(xq), sc16, 2 * j);
            block_tiles::runs::quad<RUN>(run[m], is[m][v], hi, block_tiles::broadcast4(xq + 4), sc16, 2 * j + 1);
          }
        }
      }
    }
    for (int v = 0; v < V; ++v) {
      const auto scale = [&](int g) { return widen_lanes<true>(p + L::SC + g * ROWS + v * VL); };
      const auto minimum = [&](int j) { return widen_lanes<false>(p + L::MN + j * ROWS + v * VL); };
      for (int m = 0; m < P; ++m) {
        __m256i term = i8::zero();
        for (int b = 0; b < 8; ++b) term = block_tiles::runs::block_term<F>(term, scale, minimum, b, x[m][b]);
        block_tiles::runs::close<F>(is[m][v], im[m][v], term);
      }
    }
    return;
  }
#endif
#pragma GCC unroll 16
  for (int g = 0; g < 256 / F::G; ++g) {
    fetch_ahead<F>(p, g);
    for (int v = 0; v < V; ++v) {
      const Codes<F> codes(p, g, v);
      i8::I32 s[P];
      for (int m = 0; m < P; ++m) s[m] = i8::zero();
      for (int j = 0; j < Codes<F>::PAIRS; ++j) {
        i8::B8 lo, hi;
        codes.pair(j, lo, hi);
        dot_pair<F, P>(s, lo, hi, x, g * F::G + 8 * j);
      }
      const vi sc = widen_lanes<Q6K<F>>(p + L::SC + g * ROWS + v * VL);
      for (int m = 0; m < P; ++m)
        is[m][v] = (i8::I32)block_dot::group<F>((vi)is[m][v], (vi)s[m], sc, block_dot::group_sum<F>(x[m], g));
    }
  }
  if constexpr (F::MIN)
    for (int v = 0; v < V; ++v) {
      vi mn[8];
      for (int j = 0; j < 8; ++j) mn[j] = widen_lanes<false>(p + L::MN + j * ROWS + v * VL);
      for (int m = 0; m < P; ++m) {
        vi t = {};
        for (int j = 0; j < 8; ++j) t += mn[j] * block_dot::group_sum<F>(x[m], j);
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
      store_vf(halves(p + L::D + 2 * v * VL), a + v * VL);
      if constexpr (F::MIN) store_vf(halves(p + L::DMIN + 2 * v * VL), b + v * VL);
    }
    for (int m = 0; m < P; ++m) block_tiles::accumulate<F>(sums[m], s[m], a, b, *x[m], *ds[m], 0);
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
    if constexpr (F::QK == 32)  // a K-quant's integer_sums() fetches its unit's lines group by group
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
// span): acc[m - m0][r], MB input rows a pass. For decode rows; many rows take block_tiles::tile() with
// decoder().
template <class F>
static void tile(const uint8_t* w, int64_t K, const q8::Rows& x, int64_t m0, int64_t m1, float (*acc)[ROWS]) {
  constexpr int MB = block_tiles::MB;
  for (int64_t m = m0; m < m1; m += MB) {
    const int count = int(std::min<int64_t>(MB, m1 - m));
    const q8::Block* xs[MB];
    const q8::Sums* ds[MB];
    for (int i = 0; i < count; ++i) xs[i] = x.row(m + i), ds[i] = x.sums(m + i);
    block_tiles::with_rows(count, [&](auto p) { rows<F, decltype(p)::value>(w, K, xs, ds, acc + (m - m0)); });
  }
}

// block_tiles::tile()'s decode of a packed group at w (many input rows): a unit's codes are the Tile's as
// they lie, two nibbles a byte (with Q6_K's top or Q5's fifth bits), its scales widened; no transposes,
// unlike the file's blocks.
template <class F>
static auto decoder(const uint8_t* w) {
  return [=](int64_t k0, int n, block_tiles::Tile& t) {
    using L = Layout<F>;
    constexpr int GROUPS = F::QK / F::G;
    for (int u = 0; u < n / F::QK; ++u) {
      const uint8_t* p = w + (k0 / F::QK + u) * ROWS * L::BYTES;
      for (int g = 0; g < GROUPS; ++g)
        for (int v = 0; v < V; ++v) {
          const Codes<F> codes(p, g, v);
          for (int j = 0; j < Codes<F>::PAIRS; ++j) {
            i8::B8 lo, hi;
            codes.pair(j, lo, hi);
            const int quad = u * F::QK / 4 + 2 * (g * Codes<F>::PAIRS + j);
            std::memcpy(t.codes[quad][v * i8::LANES], &lo, sizeof lo);
            std::memcpy(t.codes[quad + 1][v * i8::LANES], &hi, sizeof hi);
          }
          if constexpr (F::QK == 256) store_vi(widen_lanes<Q6K<F>>(p + L::SC + g * ROWS + v * VL), t.k.sc[g] + v * VL);
        }
      for (int v = 0; v < V; ++v) {
        const vf d = halves(p + L::D + 2 * v * VL), m = F::MIN ? halves(p + L::DMIN + 2 * v * VL) : vf{};
        if constexpr (F::QK == 32) {
          store_vf(d, t.a[u] + v * VL);
          if constexpr (F::MIN) store_vf(m, t.b[u] + v * VL);
          continue;
        }
        store_vf(d, t.k.d + v * VL);
        if constexpr (F::MIN) {
          store_vf(m, t.k.dmin + v * VL);
          for (int j = 0; j < 8; ++j) store_vi(widen_lanes<false>(p + L::MN + j * ROWS + v * VL), t.k.mn[j] + v * VL);
        }
      }
    }
  };
}

}  // namespace packed
