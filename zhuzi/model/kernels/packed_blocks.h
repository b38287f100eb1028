// Q4_K and Q6_K matrices repacked at load (cpu_blocks.pack()) into the layout their dot products read: a
// group of 16 output rows stores each 256-input super-block as one run of bytes, the codes of the same 4
// inputs of all 16 rows side by side (4 bytes a row), and the scales as arrays over the rows. One vector load
// then holds a lane per row: the rows' codes meet an input row's 4 activation codes, broadcast, in one int8
// dot product per lane, with no unpacking of 16 separate streams and no horizontal sum (llama.cpp's "x8"
// repacked layouts are the same idea over 8 rows). A group is one contiguous stream, every group after the
// last: the hardware prefetchers follow it. The layout is the same for every variant (only the vector width
// differs), and a group holds 16 rows of exactly the bytes of the file, bar Q4_K's scales, unpacked from 6 to
// 8 bits (148 bytes a row and super-block in place of 144).
//
// A packed super-block of 16 rows (r: row, b < 4: byte of a lane), codes as blocks.h decodes them:
//   Q4_K  codes[32][16][4]  pair p: low nibble = code of input 8p + b, high nibble = input 8p + 4 + b
//         sc[8][16], mn[8][16] (uint8), d[16], dmin[16] (fp16)                             2,368 bytes
//   Q6_K  codes[32][16][4]  the codes' low 4 bits, as Q4_K's
//         top[16][16][4]    group g (16 inputs): bits 2i, 2i + 1 = the top 2 bits of input 16g + 4i + b
//         sc[16][16] (int8), d[16] (fp16)                                                   3,360 bytes
//
// The sums are block_dot.h's, bit for bit: exact int32 per group, the scales as integers, one float
// multiply-add per super-block (two with minimums), in input order; an output is the same bits as on the
// file's layout, on every path.
#pragma once
#include "block_tiles.h"

namespace packed {

using block_tiles::ROWS;
using block_tiles::V;
using blocks::Format;

constexpr int32_t FLAG = 0x100;  // a Part's type: FLAG | the GGUF type its blocks were packed from

template <class F> struct Layout;
template <> struct Layout<Format<blocks::Q4_K>> {
  static constexpr int BYTES = 148;  // a row's share of a packed super-block
  static constexpr int SC = 2048, MN = 2176, D = 2304, DMIN = 2336, TOP = 0;
};
template <> struct Layout<Format<blocks::Q6_K>> {
  static constexpr int BYTES = 210;
  static constexpr int TOP = 2048, SC = 3072, D = 3328, MN = 0, DMIN = 0;
};

template <class F>
constexpr bool PACKS = std::is_same_v<F, Format<blocks::Q4_K>> || std::is_same_v<F, Format<blocks::Q6_K>>;

// Calls fn(Format<T>{}) for a packed type (FLAG | T); false for any other.
template <typename Fn>
static bool with_format(int type, Fn fn) {
  switch (type) {
    case FLAG | blocks::Q4_K: fn(Format<blocks::Q4_K>{}); return true;
    case FLAG | blocks::Q6_K: fn(Format<blocks::Q6_K>{}); return true;
    default: return false;
  }
}

// Whether a packed matrix of `type` with rows of row_bytes bytes holds K inputs a row.
static inline bool serves(int type, int64_t K, int64_t row_bytes) {
  bool ok = false;
  with_format(type, [&](auto f) { ok = K % 256 == 0 && row_bytes == K / 256 * Layout<decltype(f)>::BYTES; });
  return ok;
}

// Super-block sb of the packed group holding row `row`, in a packed matrix w of row_bytes a row.
template <class F, typename T>
static inline T* block(T* w, int64_t row_bytes, int64_t row, int64_t sb) {
  return w + row / ROWS * ROWS * row_bytes + sb * ROWS * Layout<F>::BYTES;
}

// 16 rows of super-block blocks (row r's at src + r * row_bytes) -> one packed super-block at out.
template <class F>
static void pack(const uint8_t* src, int64_t row_bytes, uint8_t* out) {
  using L = Layout<F>;
  constexpr bool Q6K = std::is_same_v<F, Format<blocks::Q6_K>>;
  for (int r = 0; r < ROWS; ++r) {
    const uint8_t* b = src + r * row_bytes;
    uint8_t q[256];
    float a[16], off[16], d, dmin;
    int32_t sc[16], mn[8];
    F::decode(b, q, a, off);
    F::ints(b, sc, mn, d, dmin);
    for (int p = 0; p < 32; ++p)
      for (int i = 0; i < 4; ++i) out[(p * ROWS + r) * 4 + i] = uint8_t((q[8 * p + i] & 15) | (q[8 * p + 4 + i] & 15) << 4);
    for (int g = 0; g < 256 / F::G; ++g) out[L::SC + g * ROWS + r] = uint8_t(sc[g]);
    if constexpr (Q6K) {
      for (int g = 0; g < 16; ++g)
        for (int i = 0; i < 4; ++i) {
          uint8_t top = 0;
          for (int t = 0; t < 4; ++t) top |= uint8_t((q[16 * g + 4 * t + i] >> 4) << (2 * t));
          out[L::TOP + (g * ROWS + r) * 4 + i] = top;
        }
      std::memcpy(out + L::D + 2 * r, b + 208, 2);
    } else {
      for (int j = 0; j < 8; ++j) out[L::MN + j * ROWS + r] = uint8_t(mn[j]);
      std::memcpy(out + L::D + 2 * r, b, 2), std::memcpy(out + L::DMIN + 2 * r, b + 2, 2);
    }
  }
}

// Row r of a packed super-block p, as F::decode() gives it from the file's block: codes q, scales a, offsets b.
template <class F>
static void decode(const uint8_t* p, int r, uint8_t* q, float* a, float* b) {
  using L = Layout<F>;
  uint16_t h[2];
  std::memcpy(h, p + L::D + 2 * r, 2);
  const float d = half_to_float(h[0]);
  for (int p8 = 0; p8 < 32; ++p8)
    for (int i = 0; i < 4; ++i) {
      const uint8_t c = p[(p8 * ROWS + r) * 4 + i];
      q[8 * p8 + i] = c & 15, q[8 * p8 + 4 + i] = c >> 4;
    }
  if constexpr (std::is_same_v<F, Format<blocks::Q6_K>>) {
    for (int g = 0; g < 16; ++g) {
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 4; ++t) q[16 * g + 4 * t + i] |= ((p[L::TOP + (g * ROWS + r) * 4 + i] >> (2 * t)) & 3) << 4;
      a[g] = d * float(int8_t(p[L::SC + g * ROWS + r]));
    }
  } else {
    std::memcpy(h + 1, p + L::DMIN + 2 * r, 2);
    const float dmin = half_to_float(h[1]);
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
  int32_t w[4];
  for (int l = 0; l < 4; ++l) w[l] = SIGNED ? int32_t(int8_t(p[l])) : int32_t(p[l]);
  return (vi)vld1q_s32(w);
#endif
}
static inline vf halves(const uint8_t* p) {  // VL IEEE halves -> floats, exactly
#if ZHUZI_AVX512
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif ZHUZI_AVX2
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  uint16_t h[4];
  std::memcpy(h, p, 8);
  return (vf)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
#endif
}

// A group's codes, 8 inputs of every row a pair: pair j's low and high nibbles (Q6_K: with their top bits).
template <class F>
struct Codes {
  static constexpr bool Q6K = std::is_same_v<F, Format<blocks::Q6_K>>;
  static constexpr int PAIRS = F::G / 8;
  const uint8_t* lanes;  // the group's first pair, at a vector's first row
  vb top;
  Codes(const uint8_t* p, int g, int v) : lanes(p + (g * PAIRS * ROWS + v * i8::LANES) * 4) {
    top = Q6K ? load_vb(p + Layout<F>::TOP + (g * ROWS + v * i8::LANES) * 4) : vb{};
  }
  void pair(int j, i8::B8& lo, i8::B8& hi) const {
    const vb raw = load_vb(lanes + j * ROWS * 4);
    vb l = raw & 15, h = shift(raw, -4) & 15;
    // Code c's top bits sit at bit 2c of its byte of top (c: 0, 1 the low and high nibbles of pair 0, then
    // pair 1's), and go to bits 4, 5: one shift and one mask each.
    if constexpr (Q6K) l |= shift(top, 4 - 4 * j) & 0x30, h |= shift(top, 2 - 4 * j) & 0x30;
    lo = (i8::B8)l, hi = (i8::B8)h;
  }
};

// The super-block's integer sums is[m][v] (block_dot.h): exact, whatever the path.
template <class F, int P>
static inline void integer_sums(const uint8_t* p, const q8::Block* const* x, i8::I32 (*is)[V]) {
  constexpr bool Q6K = Codes<F>::Q6K;
#if ZHUZI_AVX2 && !ZHUZI_AVXVNNI
  if constexpr (P <= 2) {
    // maddubs's int16 pair sums add up in int16 over a run of pairs (Q4_K: a group's 8 products, at most
    // 8 * 2 * 15 * 127 = 30,480; Q6_K: a pair's 2, at most 2 * 2 * 63 * 127 = 32,004) and meet the rows'
    // scales in one madd, where dot_u8s8() widens each to int32 and the group is scaled after: the same
    // exact integers, in a third fewer instructions.
    constexpr int RUN = Q6K ? 1 : Codes<F>::PAIRS;
#pragma GCC unroll 16
    for (int g = 0; g < 256 / F::G; ++g)
      for (int v = 0; v < V; ++v) {
        const Codes<F> codes(p, g, v);
        const vi sc = widen_lanes<Q6K>(p + Layout<F>::SC + g * ROWS + v * VL);
        const __m256i sc16 = (__m256i)((sc & 0xffff) | (sc << 16));  // each lane's scale in both words
        __m256i run[P];
        for (int j = 0; j < Codes<F>::PAIRS; ++j) {
          i8::B8 lo, hi;
          codes.pair(j, lo, hi);
          const int at = g * F::G + 8 * j;
          for (int m = 0; m < P; ++m) {
            const int8_t* xq = x[m][at / 32].q + at % 32;
            int32_t x0, x1;
            std::memcpy(&x0, xq, 4), std::memcpy(&x1, xq + 4, 4);
            const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
            run[m] = j % RUN ? _mm256_add_epi16(run[m], t) : t;
            if ((j + 1) % RUN == 0) is[m][v] = _mm256_add_epi32(is[m][v], _mm256_madd_epi16(run[m], sc16));
          }
        }
        if constexpr (F::OFF)
          for (int m = 0; m < P; ++m)
            is[m][v] = (i8::I32)((vi)is[m][v] - sc * (F::OFF * block_dot::group_sum<F>(x[m], g)));
      }
    return;
  }
#endif
#pragma GCC unroll 16
  for (int g = 0; g < 256 / F::G; ++g)
    for (int v = 0; v < V; ++v) {
      const Codes<F> codes(p, g, v);
      i8::I32 s[P];
      for (int m = 0; m < P; ++m) s[m] = i8::zero();
      for (int j = 0; j < Codes<F>::PAIRS; ++j) {
        i8::B8 lo, hi;
        codes.pair(j, lo, hi);
        const int at = g * F::G + 8 * j;  // the pair's first input in the super-block
        for (int m = 0; m < P; ++m) {
          const int8_t* xq = x[m][at / 32].q + at % 32;
          s[m] = i8::dot_u8s8_at(i8::dot_u8s8_at(s[m], lo, xq), hi, xq + 4);
        }
      }
      const vi sc = widen_lanes<Q6K>(p + Layout<F>::SC + g * ROWS + v * VL);
      for (int m = 0; m < P; ++m)
        is[m][v] = (i8::I32)block_dot::group<F>((vi)is[m][v], (vi)s[m], sc, block_dot::group_sum<F>(x[m], g));
    }
}

// acc[m][r] += the products of packed super-block p (16 rows) with input rows x[m] (q8 blocks of the
// super-block, span 256), m < P.
template <class F, int P>
static void apply(const uint8_t* p, const q8::Block* const* x, float (*acc)[ROWS]) {
  using L = Layout<F>;
  i8::I32 is[P][V];
  for (int m = 0; m < P; ++m)
    for (int v = 0; v < V; ++v) is[m][v] = i8::zero();
  integer_sums<F, P>(p, x, is);
  for (int v = 0; v < V; ++v) {
    const vf d = halves(p + L::D + 2 * v * VL);
    const vf dmin = F::MIN ? halves(p + L::DMIN + 2 * v * VL) : vf{};
    vi mn[8];
    if constexpr (F::MIN)
      for (int j = 0; j < 8; ++j) mn[j] = widen_lanes<false>(p + L::MN + j * ROWS + v * VL);
    for (int m = 0; m < P; ++m) {
      vi im = {};
      if constexpr (F::MIN)
        for (int j = 0; j < 8; ++j) im += mn[j] * block_dot::group_sum<F>(x[m], j);
      const vf dx = splat(x[m][0].d);
      store_vf(block_dot::super<F>(load_vf(acc[m] + v * VL), (vi)is[m][v], im, d * dx, -(dmin * dx)), acc[m] + v * VL);
    }
  }
}

// The 16 rows of the packed group at w (K inputs) against input rows [m0, m1) of x (q8, span 256):
// acc[m - m0][r], MB input rows a pass, a super-block at a time (it stays in L1 for every pass).
// How far ahead of the super-block in use its stream is fetched into L2: the hardware prefetchers alone kept
// a decode step at two thirds of the read bandwidth (a 1.5B's Q6_K LM head: 17 GB/s without, 27-34 with
// 32-64 KiB ahead, on a 2-core Zen 4). A prefetch past the matrix's end never faults.
constexpr int AHEAD = 48 << 10;

template <class F>
static void tile(const uint8_t* w, int64_t K, const q8::Rows& x, int64_t m0, int64_t m1, float (*acc)[ROWS]) {
  constexpr int MB = block_tiles::MB;
  std::memset(acc, 0, sizeof(float) * ROWS * (m1 - m0));
  constexpr int SB = ROWS * Layout<F>::BYTES;
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* p = w + sb * SB;
    for (int o = 0; o < SB; o += 64) __builtin_prefetch(p + AHEAD + o, 0, 2);
    for (int64_t m = m0; m < m1; m += MB) {
      const int count = int(std::min<int64_t>(MB, m1 - m));
      const q8::Block* xs[MB];
      for (int i = 0; i < count; ++i) xs[i] = x.row(m + i) + sb * 8;
      float(*out)[ROWS] = acc + (m - m0);
      auto go = [&](auto n) { apply<F, decltype(n)::value>(p, xs, out); };
      switch (count) {
        case 1: go(std::integral_constant<int, 1>{}); break;
        case 2: go(std::integral_constant<int, 2>{}); break;
        case 3: go(std::integral_constant<int, 3>{}); break;
#if ZHUZI_AVX512
        case 4: go(std::integral_constant<int, 4>{}); break;
        case 5: go(std::integral_constant<int, 5>{}); break;
        case 6: go(std::integral_constant<int, 6>{}); break;
        case 7: go(std::integral_constant<int, 7>{}); break;
#endif
        default: go(std::integral_constant<int, MB>{}); break;
      }
    }
  }
}

// block_tiles::tile()'s decode of a packed group at w (many input rows): a super-block's codes are the Tile's
// as they lie, two nibbles a byte (and Q6_K's top bits), its scales widened; no transposes, unlike the
// file's blocks.
template <class F>
static auto decoder(const uint8_t* w) {
  return [=](int64_t k0, int, block_tiles::Tile& t) {
    using L = Layout<F>;
    const uint8_t* p = w + k0 / 256 * ROWS * L::BYTES;
    for (int g = 0; g < 256 / F::G; ++g)
      for (int v = 0; v < V; ++v) {
        const Codes<F> codes(p, g, v);
        for (int j = 0; j < Codes<F>::PAIRS; ++j) {
          i8::B8 lo, hi;
          codes.pair(j, lo, hi);
          const int quad = 2 * (g * Codes<F>::PAIRS + j);
          std::memcpy(t.codes[quad][v * i8::LANES], &lo, sizeof lo);
          std::memcpy(t.codes[quad + 1][v * i8::LANES], &hi, sizeof hi);
        }
        store_vi(widen_lanes<Codes<F>::Q6K>(p + L::SC + g * ROWS + v * VL), t.k.sc[g] + v * VL);
      }
    for (int v = 0; v < V; ++v) {
      store_vf(halves(p + L::D + 2 * v * VL), t.k.d + v * VL);
      if constexpr (F::MIN) {
        store_vf(halves(p + L::DMIN + 2 * v * VL), t.k.dmin + v * VL);
        for (int j = 0; j < 8; ++j) store_vi(widen_lanes<false>(p + L::MN + j * ROWS + v * VL), t.k.mn[j] + v * VL);
      }
    }
  };
}

}  // namespace packed
