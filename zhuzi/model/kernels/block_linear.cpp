// Linear layers on GGUF blocks (block_prefill.h), or packed ones (packed_blocks.h), for any number of input
// rows; see cpu_blocks.py.
#include "arch/x86/amx/block_prefill.h"
#include "api.h"
#include "block_decode.h"
#include "packed_blocks.h"

#include <vector>

using namespace block_prefill;

// Input rows a work item takes: a row group's inputs are decoded once per work item, and at 64 rows decoding took
// a third of a Q6_K prefill; an item's q8 blocks of 256 rows (80 KiB) still stay in L2.
constexpr int64_t ITEM_ROWS = 256;
// Up to this many input rows, unpacking a row group's blocks per pass (block_decode.h) costs less than
// decoding it once (block_prefill.h); both give the same bits.
constexpr int64_t FEW_ROWS = 8;

template <typename T, typename Y>
static void linear(const Part* parts, int nparts, const T* x, Y* y, int64_t M, int64_t N, int64_t K, int threads) {
  q8::Rows xq[2];  // the activations per 32 inputs and per 256 (K-quants), as the parts need them
  bool need[2] = {};
  for (int p = 0; p < nparts; ++p) need[span(parts[p].type & ~packed::FLAG) == DECODE_K] = true;
  for (int s = 0; s < 2; ++s)
    if (need[s]) xq[s].set(x, M, K, K, threads, s ? DECODE_K : q8::BLOCK);
  struct Ref { const Part* part; int64_t row, n0; };  // a row group: its part, its first row there, and in y
  std::vector<Ref> groups;
  for (int64_t p = 0, n0 = 0; p < nparts; n0 += parts[p].rows, ++p)
    for (int64_t r = 0; r < parts[p].rows; r += ROWS) groups.push_back({&parts[p], r, n0 + r});
  const int64_t sets = (M + ITEM_ROWS - 1) / ITEM_ROWS, count = int64_t(groups.size());
#if ZHUZI_AVX512
  const bool amx = M > FEW_ROWS && amx_prefill::ready();
#endif
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
  for (int64_t s = 0; s < sets; ++s)
    for (int64_t i = 0; i < count; ++i) {
      const Ref& t = groups[i];
      const int64_t m0 = s * ITEM_ROWS, m1 = std::min(M, m0 + ITEM_ROWS);
      const int rows = int(std::min<int64_t>(ROWS, t.part->rows - t.row));
      alignas(64) float acc[ITEM_ROWS][ROWS];
      const uint8_t* w = t.part->w + t.row * t.part->row_bytes;
      const bool is_packed = t.part->type & packed::FLAG;
      blocks::with_format(t.part->type & ~packed::FLAG, [&](auto f) {
        using F = decltype(f);
        const q8::Rows& x8 = xq[F::QK == DECODE_K];
        auto batched = [&](auto decode) {
#if ZHUZI_AVX512
          if (amx) return amx_prefill::row_group<F>(decode, K, x8, m0, m1, acc);
#endif
          block_prefill::row_group<F>(decode, K, x8, m0, m1, acc);
        };
        if (is_packed) {
          if (m1 - m0 <= FEW_ROWS) packed::row_group<F>(w, K, x8, m0, m1, acc);
          else batched(packed::decoder<F>(w));
          return;
        }
        if (m1 - m0 <= FEW_ROWS) block_decode::row_group<F>(w, t.part->row_bytes, rows, K, x8, m0, m1, acc);
        else batched(block_prefill::decoder<F>(w, t.part->row_bytes, rows));
      });
      for (int64_t m = m0; m < m1; ++m)
        for (int r = 0; r < rows; ++r) store(acc[m - m0][r], y + m * N + t.n0 + r);
    }
}

// Returns 0, or 2 for parts this build does not serve (a type without a kernel, rows not of K inputs, or
// rows adding up to other than N).
extern "C" int zhuzi_block_linear(const void* parts, int nparts, const void* x, int x_bf16, void* y, int y_bf16,
                                  int64_t M, int64_t N, int64_t K, int threads) {
  const auto* p = static_cast<const Part*>(parts);
  int64_t rows = 0;
  for (int i = 0; i < nparts; ++i) {
    const bool packed_rows = packed::serves(p[i].type, K, p[i].row_bytes) && p[i].rows % packed::ROWS == 0;
    if (!packed_rows && !serves(p[i].type, K, p[i].row_bytes)) return 2;
    rows += p[i].rows;
  }
  if (rows != N || M < 1) return 2;
  auto go = [&](const auto* in) {
    if (y_bf16) linear(p, nparts, in, static_cast<uint16_t*>(y), M, N, K, threads);
    else linear(p, nparts, in, static_cast<float*>(y), M, N, K, threads);
  };
  if (x_bf16) go(static_cast<const uint16_t*>(x));
  else go(static_cast<const float*>(x));
  return 0;
}

// 1 where this build's calls of more than FEW_ROWS rows run through AMX tiles (Sapphire Rapids and later, where
// the OS grants the tile state), else 0.
extern "C" int zhuzi_block_linear_amx() {
#if ZHUZI_AVX512
  return amx_prefill::ready();
#else
  return 0;
#endif
}
