// GGUF block matrices (blocks.h) against a few q8 activation rows (decode): the same 16-row groups and results
// as block_prefill.h, without its decoded inputs. block_prefill.h pays a decode and interleave once for
// all its input rows, which at one to a few rows costs more than reading the weights; here each row's
// blocks are unpacked in registers, in input order, and meet the inputs in int8 dot products lane by lane.
// A reduction over 4 rows at a time (then a transpose of 128-bit blocks) turns every row's lanes into its
// exact int32 sum per 16 inputs, a vector over the row group's rows: block_prefill.h's accumulate() (32-blocks) or
// k_sub_block() and k_super() (K-quants) then do the rest exactly as there (block_dot.h), so an output is the same
// bits on either path (batch invariance). On AVX2 the K-quants take k_pass(): their scales applied in the lanes,
// one reduction per 256 inputs. On NEON and generic block_prefill.h serves every row count.
#pragma once
#include "block_prefill.h"

#if ZHUZI_AVX512
#include "arch/x86/avx512/block_decode.h"
#elif ZHUZI_AVX2
#include "arch/x86/avx2/block_decode.h"
#endif

namespace block_decode {

using namespace block_prefill;

#if ZHUZI_NEON || ZHUZI_GENERIC
template <class F>
static void row_group(const uint8_t* w, int64_t row_bytes, int rows, int64_t K, const q8::Rows& x, int64_t m0,
                      int64_t m1, float (*acc)[ROWS]) {
  block_prefill::row_group<F>(block_prefill::decoder<F>(w, row_bytes, rows), K, x, m0, m1, acc);
}
#else

constexpr int PASS = 4;  // input rows a pass: each unpacked unit serves all of them

static inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
static inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
// Bits of every byte moved left by s (right for s < 0); s is a constant once unrolled.
static inline __m256i shift(__m256i v, int s) { return s >= 0 ? _mm256_slli_epi16(v, s) : _mm256_srli_epi16(v, -s); }

// The codes of inputs [32u, 32u + 32) of block p, in input order (blocks.h's layouts).
template <class F>
static inline __m256i unit(const uint8_t* p, int u) {
  using namespace blocks;
  if constexpr (LUT<F>) {  // 16 bytes of indexes (IQ4_XS: sub-block u's, after its 8 bytes of scales), looked up
    const uint8_t* qs = p + (F::QK == 256 ? 8 + 16 * u : F::BYTES - 16);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(F::VALUES)));
    return _mm256_shuffle_epi8(table, low4(_mm256_set_m128i(_mm_srli_epi16(v, 4), v)));
  } else if constexpr (F::QK == 32) {
    if constexpr (std::is_same_v<F, Format<Q8_0>>) return load32(reinterpret_cast<const BQ8_0*>(p)->qs);
    const int qs = std::is_same_v<F, Format<Q4_0>> ? 2 : std::is_same_v<F, Format<Q4_1>> ? 4
                   : std::is_same_v<F, Format<Q5_0>> ? 6 : 8;  // offset of qs in the block
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + qs));
    const __m256i q = low4(_mm256_set_m128i(_mm_srli_epi16(v, 4), v));
    if constexpr (std::is_same_v<F, Format<Q5_0>> || std::is_same_v<F, Format<Q5_1>>)
      return _mm256_or_si256(q, fifth_bits(p + qs - 4));
    return q;
  } else if constexpr (std::is_same_v<F, Format<Q6_K>>) {
    const auto* b = reinterpret_cast<const BQ6_K*>(p);
    const int h = u / 4, t = u % 4;
    const __m256i ql = load32(b->ql + 64 * h + 32 * (t % 2)), qh = load32(b->qh + 32 * h);
    const __m256i lo = low4(t < 2 ? ql : _mm256_srli_epi16(ql, 4));
    return _mm256_or_si256(lo, _mm256_and_si256(shift(qh, 4 - 2 * t), _mm256_set1_epi8(0x30)));
  } else if constexpr (std::is_same_v<F, Format<Q3_K>> || std::is_same_v<F, Format<Q2_K>>) {
    constexpr bool Q3K = std::is_same_v<F, Format<Q3_K>>;
    const uint8_t* qs = p + (Q3K ? 32 : 16);  // after Q3_K's hmask, Q2_K's scales
    const __m256i q = _mm256_and_si256(shift(load32(qs + 32 * (u / 4)), -2 * (u % 4)), _mm256_set1_epi8(3));
    if constexpr (Q3K) return _mm256_or_si256(q, _mm256_and_si256(shift(load32(p), 2 - u), _mm256_set1_epi8(4)));
    return q;
  } else {  // Q4_K, Q5_K: qs and (Q5_K) qh end the block
    const uint8_t* qs = p + F::BYTES - 128;
    const __m256i v = load32(qs + 32 * (u / 2)), q = low4(u % 2 ? _mm256_srli_epi16(v, 4) : v);
    if constexpr (std::is_same_v<F, Format<Q5_K>>)
      return _mm256_or_si256(q, _mm256_and_si256(shift(load32(qs - 32), 4 - u), _mm256_set1_epi8(16)));
    return q;
  }
}

// The codes of a vector's units from unit u on (of the step starting at block blk) of the row at w.
template <class F>
static inline i8::B8 codes(const uint8_t* w, int64_t blk, int u, bool tail) {
  constexpr int PER_BLOCK = F::QK / 32;
#if ZHUZI_AVX512
  // K-quants but IQ4_XS (its units as the 32-blocks'): u even, in one block
  if constexpr (PER_BLOCK == 8 && !blocks::LUT<F>) return pair<F>(w + blk * F::BYTES, u);
#endif
  __m256i units[UNITS];
  for (int j = 0; j < UNITS; ++j) {
    const int k = u + j;
    units[j] = tail && j ? _mm256_setzero_si256() : unit<F>(w + (blk + k / PER_BLOCK) * F::BYTES, k % PER_BLOCK);
  }
  return join(units);
}

// The scale a and (formats with a minimum) offset b of the 32-block at byte `at` of every row of a row group (row r
// at row[r], at row[0] + off[.][r]), vectors over the rows: blocks.h's scales(), the same operations on whole
// vectors of rows, so the same bits.
template <class F>
static inline void row_scales(const uint8_t* const* row, int64_t at, const vi* off, float (*a)[ROWS], float (*b)[ROWS]) {
  for (int v = 0; v < V; ++v) {
    const vu w = (vu)gather(row[0] + at, off[v]);  // fp16 d, then (MIN formats) fp16 m; MXFP4: E8M0 e
    store_vf(std::is_same_v<F, blocks::Format<blocks::MXFP4>> ? blocks::e8m0_half(w & 255) : halves(w), a[0] + v * VL);
    if constexpr (F::MIN) store_vf(halves(w >> 16), b[0] + v * VL);
  }
}

// row_ints() (below) for Q3_K and Q2_K.
template <class F>
static inline void two_bit_ints(const uint8_t* const* row, int64_t at, const vi* off, KScales& k) {
  constexpr bool Q3K = std::is_same_v<F, blocks::Format<blocks::Q3_K>>;
  for (int v = 0; v < V; ++v) {
    // Q3_K: the 16 bytes ending at its fp16 d, scales[12] in words 1-3; Q2_K: its scales[16], a word each 4.
    vu head[4];
    words16(row + v * VL, at + (Q3K ? 92 : 0), head);
    const auto byte = [&](int i) { return (head[i / 4 + Q3K] >> (8 * (i % 4))) & 255; };
    if constexpr (Q3K) {
      store_vf(halves((vu)gather(row[0] + at + 106, off[v]) >> 16), k.d + v * VL);
      for (int g = 0; g < 16; ++g) {
        const vi sc = (vi)(((byte(g % 8) >> (4 * (g / 8))) & 15) | ((byte(8 + g % 4) >> (2 * (g / 4))) & 3) << 4) - 32;
        std::memcpy(k.sc[g] + v * VL, &sc, sizeof sc);
      }
    } else {
      const vu w = (vu)gather(row[0] + at + 80, off[v]);  // fp16 d, dmin
      store_vf(halves(w), k.d + v * VL), store_vf(halves(w >> 16), k.dmin + v * VL);
      for (int g = 0; g < 16; ++g) {
        const vu sc = byte(g) & 15, mn = byte(g) >> 4;
        std::memcpy(k.sc[g] + v * VL, &sc, sizeof sc), std::memcpy(k.mn[g] + v * VL, &mn, sizeof mn);
      }
    }
  }
}

// The integer scales of the K-quant block at byte `at` of every row of a row group: blocks.h's ints(), vectors over
// the rows.
template <class F>
static inline void row_ints(const uint8_t* const* row, int64_t at, const vi* off, KScales& k) {
  constexpr bool Q6K = std::is_same_v<F, blocks::Format<blocks::Q6_K>>;
  if constexpr (std::is_same_v<F, blocks::Format<blocks::Q3_K>> || std::is_same_v<F, blocks::Format<blocks::Q2_K>>)
    return two_bit_ints<F>(row, at, off, k);
  for (int v = 0; v < V; ++v) {
    // The 16 bytes of scales (Q4_K, Q5_K: after fp16 d and dmin; Q6_K: its 16 int8 scales), a word of each row
    // per vector.
    vu head[4];
    words16(row + v * VL, at + (Q6K ? 192 : 0), head);
    if constexpr (std::is_same_v<F, blocks::Format<blocks::IQ4_XS>>) {  // fp16 d, scales_h, then scales_l[4]
      const vu w = head[0], low = head[1];
      store_vf(halves(w), k.d + v * VL);
      for (int j = 0; j < 8; ++j) {
        const vi sc = (vi)(((low >> 4 * j) & 15) | ((w >> (16 + 2 * j)) & 3) << 4) - 32;
        std::memcpy(k.sc[j] + v * VL, &sc, sizeof sc);
      }
    } else if constexpr (Q6K) {  // int8 scales[16] at 192, fp16 d at 208
      store_vf(halves((vu)gather(row[0] + at + 206, off[v]) >> 16), k.d + v * VL);
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 4; ++i) {
          const vi sc = (vi)head[q] << (24 - 8 * i) >> 24;  // byte i of each word, sign-extended
          std::memcpy(k.sc[4 * q + i] + v * VL, &sc, sizeof sc);
        }
    } else {  // Q4_K, Q5_K: fp16 d, dmin, then 6-bit scales and mins in 12 bytes (blocks.h)
      const vu w = head[0], s0 = head[1], s1 = head[2], s2 = head[3];
      store_vf(halves(w), k.d + v * VL), store_vf(halves(w >> 16), k.dmin + v * VL);
      for (int j = 0; j < 8; ++j) {
        const int at8 = 8 * (j % 4);
        const vu sc = j < 4 ? (s0 >> at8) & 63 : ((s2 >> at8) & 15) | ((s0 >> (at8 + 6)) & 3) << 4;
        const vu mn = j < 4 ? (s1 >> at8) & 63 : ((s2 >> (at8 + 4)) & 15) | ((s1 >> (at8 + 6)) & 3) << 4;
        std::memcpy(k.sc[j] + v * VL, &sc, sizeof sc), std::memcpy(k.mn[j] + v * VL, &mn, sizeof mn);
      }
    }
  }
}

// The row group's 16 row pointers (beyond rows: the last row again, its results unused) and their byte offsets
// from w, vectors over the rows.
static inline void rows_of(const uint8_t* w, int64_t row_bytes, int rows, const uint8_t** row, vi* off) {
  for (int r = 0; r < ROWS; ++r) {
    row[r] = w + std::min(r, rows - 1) * row_bytes;
    off[r / VL][r % VL] = int32_t(row[r] - w);
  }
}

// 16 rows are 16 streams, too many for the hardware prefetchers, and often short ones (1,536 Q4_K weights are
// 864 bytes): while a row group computes blocks [blk, blk + nblk), the next group's rows (the 16 after these,
// one contiguous run) are fetched into L2 in order, that step's share at a time (into L1 they would evict this
// group's rows). A prefetch past the matrix's end never faults.
template <class F>
static inline void prefetch_next(const uint8_t* w, int64_t row_bytes, int64_t blk, int nblk) {
  const uint8_t* next = w + ROWS * row_bytes + blk * ROWS * F::BYTES;
  for (int o = 0; o < ROWS * nblk * F::BYTES; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T1);
}

// A row's codes of READS vectors of units, vector k from unit u + k UNITS on: Q6_K's two of a half block
// (READS = 2) come from one read of its bytes (four_q6k()), where codes() would read them twice.
template <class F, int READS>
static inline void read(const uint8_t* w, int64_t blk, int u, bool tail, i8::B8* c) {
#if ZHUZI_AVX512
  if constexpr (READS == 2) {
    four_q6k(w + blk * F::BYTES, u / 4, c);
    return;
  }
#endif
  c[0] = codes<F>(w, blk, u, tail);
}

// Rows [0, rows) of the row group at w against P input rows x[p] (q8 blocks from the row's first; ds[p] their
// scaled sums): acc[p][r] (for r >= rows, not results).
template <class F, int P>
static void pass(const uint8_t* w, int64_t row_bytes, int rows, int64_t K, const q8::Block* const* x,
                 const q8::Sums* const* ds, float (*acc)[ROWS]) {
  constexpr int SUBS = F::QK / F::SUB, PER_BLOCK = F::QK / 32;
  constexpr bool KQ = F::QK == 256;  // a step is one K-quant super-block
  constexpr int STEP = PER_BLOCK >= UNITS ? 1 : UNITS;  // blocks a step: a whole vector of units
  constexpr int NU = STEP * PER_BLOCK, NS = STEP * SUBS;
  // Signed codes (Q8_0) go in as unsigned ones biased by 128 where the int8 dot product keeps every sum
  // exact: s = sum (c + 128) x - 128 sum x, one subtraction per sub-block for all the rows in place of a sign
  // transfer per row; the same exact int32 sums.
  constexpr bool BIASED = F::SIGNED && i8::EXACT_U8;
#if ZHUZI_AVX512
  // Code vectors a read of a row's bytes: two for Q6_K at one input row; with more, their sums outgrow the registers.
  constexpr int READS = std::is_same_v<F, blocks::Format<blocks::Q6_K>> && P == 1 ? 2 : 1;
#else
  constexpr int READS = 1;
#endif
  const uint8_t* row[ROWS];
  vi off[V];
  rows_of(w, row_bytes, rows, row, off);
  vf sums[P][V] = {};
  const int64_t nb = K / F::QK;
  for (int64_t blk = 0; blk < nb; blk += STEP) {
    const int nblk = int(std::min<int64_t>(STEP, nb - blk));
    prefetch_next<F>(w, row_bytes, blk, nblk);
    alignas(64) float a[NS][ROWS], b[NS][ROWS];
    KScales k;
    if constexpr (KQ) row_ints<F>(row, blk * F::BYTES, off, k);
    else
      for (int i = 0; i < nblk; ++i) row_scales<F>(row, (blk + i) * F::BYTES, off, a + i, b + i);
    const q8::Block* xb[P];
    for (int p = 0; p < P; ++p) xb[p] = x[p] + blk * PER_BLOCK;
    i8::I32 s[P][2 * NU][V];  // per input row, per 16 inputs of the step: sums over the rows
    // Unrolled, every unit index is a constant in codes() and the sub-blocks' offsets, which the AVX2 rows need most.
#pragma GCC unroll 8
    for (int u = 0; u < NU; u += READS * UNITS) {
      const bool tail = u + UNITS > nblk * PER_BLOCK;  // AVX-512, an odd count of 32-blocks: half a vector
      i8::B8 xv[READS][P];
      for (int k = 0; k < READS; ++k)
        for (int p = 0; p < P; ++p) {
          __m256i units[UNITS];
          for (int j = 0; j < UNITS; ++j)
            units[j] = tail && j ? _mm256_setzero_si256() : load32(xb[p][u + k * UNITS + j].q);
          xv[k][p] = join(units);
        }
      i8::I32 f[READS][P][ROWS / 4];
      for (int r4 = 0; r4 < ROWS; r4 += 4) {
        i8::I32 d[READS][P][4];
        for (int r = 0; r < 4; ++r) {
          i8::B8 raw[READS];
          read<F, READS>(row[r4 + r], blk, u, tail, raw);
          for (int k = 0; k < READS; ++k) {
            const i8::B8 c = BIASED ? (i8::B8)((vu)raw[k] ^ 0x80808080u) : raw[k];
            for (int p = 0; p < P; ++p)
              d[k][p][r] = F::SIGNED && !BIASED ? i8::dot_s8s8(i8::zero(), c, xv[k][p])
                                                : i8::dot_u8s8(i8::zero(), c, xv[k][p]);
          }
        }
        for (int k = 0; k < READS; ++k)
          for (int p = 0; p < P; ++p) f[k][p][r4 / 4] = quad(d[k][p]);
      }
      for (int k = 0; k < READS; ++k)
        for (int p = 0; p < P; ++p) {
          const int uk = u + k * UNITS;
          transpose(f[k][p], s[p] + 2 * uk);
          if constexpr (BIASED)
            for (int h = 0; h < (tail ? 2 : 2 * UNITS); ++h)  // per 16 inputs
              for (int v = 0; v < V; ++v)
                s[p][2 * uk + h][v] = (i8::I32)((vi)s[p][2 * uk + h][v] - 128 * xb[p][uk + h / 2].sum[h % 2]);
        }
    }
    i8::I32 is[P][V] = {};
    for (int g = 0; g < nblk * SUBS; ++g)
      for (int p = 0; p < P; ++p) {
        i8::I32 gs[V];
        for (int v = 0; v < V; ++v)
          gs[v] = F::SUB == 16 ? s[p][g][v] : i8::I32((vi)s[p][2 * g][v] + (vi)s[p][2 * g + 1][v]);
        if constexpr (KQ) k_sub_block<F>(is[p], gs, k, g, xb[p]);
        else accumulate<F>(sums[p], gs, a[g], b[g], xb[p][g * F::SUB / 32],
                           ds[p][blk * PER_BLOCK + g * F::SUB / 32], g);
      }
    if constexpr (KQ)
      for (int p = 0; p < P; ++p) k_super<F>(sums[p], is[p], k, xb[p]);
  }
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < V; ++v) store_vf(sums[p][v], acc[p] + v * VL);
}

#if ZHUZI_AVX2
// pass() for the K-quants on AVX2: the int16 pair sums of maddubs meet each row's sub-block scales in madd (in
// place of the ones of dot_u8s8()), so a row's lanes add up sc_g s_g over the whole super-block and 16 rows are
// reduced once per 256 inputs, not once per 32; the same exact integers as pass(), so the same bits. Every
// pair sum stays exact: codes <= 63, |x| <= 127, |sc| <= 128.
template <class F, int P>
static void k_pass(const uint8_t* w, int64_t row_bytes, int rows, int64_t K, const q8::Block* const* x,
                   float (*acc)[ROWS]) {
  constexpr bool SUB16 = F::SUB == 16;  // Q6_K, Q3_K, Q2_K: two sub-blocks a unit
  const uint8_t* row[ROWS];
  vi off[V];
  rows_of(w, row_bytes, rows, row, off);
  vf sums[P][V] = {};
  for (int64_t blk = 0; blk < K / F::QK; ++blk) {
    prefetch_next<F>(w, row_bytes, blk, 1);
    KScales k;
    row_ints<F>(row, blk * F::BYTES, off, k);
    const q8::Block* xb[P];
    for (int p = 0; p < P; ++p) xb[p] = x[p] + blk * 8;
    i8::I32 f[P][ROWS / 4];
    for (int r4 = 0; r4 < ROWS; r4 += 4) {
      i8::I32 d[P][4];
      for (int r = 0; r < 4; ++r) {
        const uint8_t* b = row[r4 + r] + blk * F::BYTES;
        const int at = r4 + r;
        for (int p = 0; p < P; ++p) d[p][r] = i8::zero();
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) {
          const __m256i c = unit<F>(b, u);
          // The unit's scales as int16 words: sub-blocks 2u and 2u + 1 of 16 inputs in its two 128-bit halves.
          const __m256i sc = SUB16 ? _mm256_set_m128i(_mm_set1_epi16(int16_t(k.sc[2 * u + 1][at])),
                                                    _mm_set1_epi16(int16_t(k.sc[2 * u][at])))
                                 : _mm256_set1_epi16(int16_t(k.sc[u][at]));
          for (int p = 0; p < P; ++p)
            d[p][r] = _mm256_add_epi32(d[p][r], _mm256_madd_epi16(_mm256_maddubs_epi16(c, load32(xb[p][u].q)), sc));
        }
      }
      for (int p = 0; p < P; ++p) f[p][r4 / 4] = quad(d[p]);
    }
    for (int p = 0; p < P; ++p) {
      i8::I32 t[2][V], is[V];
      transpose(f[p], t);
      for (int v = 0; v < V; ++v) {
        vi offset = {};  // Q6_K, Q3_K: sum_g sc_g sum_g, which times -OFF takes their codes' offset off
        if constexpr (F::OFF != 0)
          for (int g = 0; g < 16; ++g) offset += load_vi(k.sc[g] + v * VL) * block_dot::sub_block_sum<F>(xb[p], g);
        is[v] = (i8::I32)((vi)t[0][v] + (vi)t[1][v] - F::OFF * offset);
      }
      k_super<F>(sums[p], is, k, xb[p]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int v = 0; v < V; ++v) store_vf(sums[p][v], acc[p] + v * VL);
}
#endif

// block_prefill::row_group()'s results, for input rows [m0, m1) of x: PASS rows at a time.
template <class F>
static void row_group(const uint8_t* w, int64_t row_bytes, int rows, int64_t K, const q8::Rows& x, int64_t m0,
                      int64_t m1, float (*acc)[ROWS]) {
  for (int64_t m = m0; m < m1; m += PASS) {
    const int count = int(std::min<int64_t>(PASS, m1 - m));
    const q8::Block* xs[PASS];
    const q8::Sums* ds[PASS];
    for (int i = 0; i < count; ++i) xs[i] = x.row(m + i), ds[i] = x.sums(m + i);
    float(*out)[ROWS] = acc + (m - m0);
    with_rows<PASS>(count, [&](auto p) {
      constexpr int P = decltype(p)::value;
#if ZHUZI_AVX2
      if constexpr (F::QK == 256 && !F::SIGNED) return k_pass<F, P>(w, row_bytes, rows, K, xs, out);
#endif
      pass<F, P>(w, row_bytes, rows, K, xs, ds, out);
    });
  }
}
#endif

}  // namespace block_decode
