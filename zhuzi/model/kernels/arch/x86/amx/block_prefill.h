// block_prefill.h's batched rows through AMX (Sapphire Rapids and later Xeons), the same bits: a row group's
// decoded inputs are already AMX's B layout (codes[quad][row][4]: 4 inputs of each of 16 rows a 64-byte row), and q8
// activation rows are A rows as they lie (32 codes a block). One tdpbsud (tdpbssd for Q8_0) gives every sub-block's
// exact int32 sums for 16 input rows x 16 output rows at once, where VNNI takes 8 dot products per input row;
// block_prefill.h's accumulate() (or k_sub_block() and k_super()) then does the rest as on every other path. Only
// the avx512 build has it, and it runs where the CPU has AMX-INT8 and the kernel grants the tile state (ready()).
#pragma once
#include "../../../block_prefill.h"  // kernels/block_prefill.h: a quoted name finds this file first

#if ZHUZI_AVX512
#include <sys/syscall.h>
#include <unistd.h>

namespace amx_prefill {

using namespace block_prefill;

// Whether this process may run AMX-INT8: the CPU has it and Linux granted the tile data state (once).
static inline bool ready() {
#if ZHUZI_EMULATED_AMX  // tests/kernels/emulate.h: tiles in memory
  return true;
#else
  static const bool ok = __builtin_cpu_supports("amx-int8")
                         && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
#endif
}

// ldtilecfg's 64 bytes: tiles 0-3 hold int32 sums [16 input rows][16 output rows], tiles 4-5 a sub-block's
// activations [16 input rows][SUB codes], tiles 6-7 its weight codes [SUB / 4 quads][16 rows x 4].
struct Config {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

template <class F>
__attribute__((target("amx-tile"))) static inline void configure() {
  Config c;
  for (int i = 0; i < 4; ++i) c.colsb[i] = 64, c.rows[i] = 16;
  for (int i = 4; i < 6; ++i) c.colsb[i] = F::SUB, c.rows[i] = 16;
  for (int i = 6; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = F::SUB / 4;
  _tile_loadconfig(&c);
}

// Sub-blocks g .. g + 3 of the decoded inputs: sums[i][m][r] for input rows at x (A rows `stride` bytes apart).
template <class F>
__attribute__((target("amx-tile,amx-int8"))) static inline void four_sub_blocks(const Decoded& t, const int8_t* x,
                                                                                  int64_t stride, int g,
                                                                                  int32_t (*sums)[16][ROWS]) {
  constexpr int QSUB = F::SUB / 4;
  auto a = [&](int i) { return x + (g + i) / (32 / F::SUB) * sizeof(q8::Block) + (g + i) % (32 / F::SUB) * F::SUB; };
  auto b = [&](int i) { return &t.codes[(g + i) * QSUB][0][0]; };
  // Tile numbers are immediates: the four sub-blocks written out.
#define ZHUZI_AMX_SUB_BLOCK(i, A, B)                                       \
  _tile_zero(i);                                                           \
  _tile_loadd(A, a(i), stride);                                            \
  _tile_loadd(B, b(i), 64);                                                \
  if constexpr (F::SIGNED) _tile_dpbssd(i, A, B); else _tile_dpbsud(i, A, B);
  ZHUZI_AMX_SUB_BLOCK(0, 4, 6)
  ZHUZI_AMX_SUB_BLOCK(1, 5, 7)
  ZHUZI_AMX_SUB_BLOCK(2, 4, 6)
  ZHUZI_AMX_SUB_BLOCK(3, 5, 7)
#undef ZHUZI_AMX_SUB_BLOCK
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
}

// block_prefill::row_group()'s results. x's rows must be readable up to the next multiple of 16 after m1
// (q8::Rows pads them): an A tile always loads 16.
template <class F, typename Decode>
__attribute__((target("amx-tile,amx-int8"))) static void row_group(Decode decode, int64_t K, const q8::Rows& x,
                                                                    int64_t m0, int64_t m1, float (*acc)[ROWS]) {
  static_assert(V == 1, "a row group's 16 rows are one vector");
  Decoded t;
  alignas(64) int32_t s[4][16][ROWS];
  const int64_t stride = x.n * int64_t(sizeof(q8::Block));
  configure<F>();
  std::memset(acc, 0, sizeof(float) * ROWS * (m1 - m0));
  for (int64_t k0 = 0; k0 < K; k0 += DECODE_K) {
    const int n = int(std::min<int64_t>(DECODE_K, K - k0)), subs = n / F::SUB;
    decode(k0, n, t);
    for (int64_t m = m0; m < m1; m += 16) {
      const int count = int(std::min<int64_t>(16, m1 - m));
      const q8::Block* xb[16];
      const q8::Sums* ds[16];  // the rows' scaled sums from the decoded inputs' first block
      vf sums[16];
      i8::I32 is[16];  // K-quants: each input row's integer sums over the super-block (the decoded inputs)
      for (int i = 0; i < 16; ++i) {
        is[i] = i8::zero();
        const int64_t row = m + std::min(i, count - 1);
        xb[i] = x.row(row) + k0 / 32;
        ds[i] = x.sums(row) + k0 / 32;
        sums[i] = load_vf(acc[row - m0]);
      }
      for (int g = 0; g < subs; g += 4) {
        four_sub_blocks<F>(t, xb[0]->q, stride, g, s);
        for (int i = 0; i < 4 && g + i < subs; ++i) {
          const int blk = (g + i) * F::SUB / 32;
          for (int r = 0; r < 16; ++r) {
            const i8::I32 gs = _mm512_load_si512(s[i][r]);
            if constexpr (F::QK == DECODE_K) k_sub_block<F>(&is[r], &gs, t.k, g + i, xb[r]);
            else accumulate<F>(&sums[r], &gs, t.a[g + i], t.b[g + i], xb[r][blk], ds[r][blk], g + i);
          }
        }
      }
      if constexpr (F::QK == DECODE_K)
        for (int r = 0; r < 16; ++r) k_super<F>(&sums[r], &is[r], t.k, xb[r]);
      for (int i = 0; i < count; ++i) store_vf(sums[i], acc[m - m0 + i]);
    }
  }
  _tile_release();
}

}  // namespace amx_prefill
#endif
