// Linear layers with tiled 4-bit / 8-bit weights (tiles.h) for any number of bf16 input rows; see
// cpu_linear.py for the design.
#include "api.h"
#include "tiles.h"

#include <algorithm>
#include <vector>

#if ZHUZI_TILES
using namespace tiles;

// Input rows per chunk: a chunk's rows stay in L2 while the blocks of the matrix pass over them.
constexpr int64_t CHUNK_ROWS = 128;

template <int F>
static void linear(const uint16_t* x, const uint8_t* w, uint16_t* y, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t groups = K / GROUP, blocks = (N + LANES - 1) / LANES, chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS;
  const int64_t block_bytes = groups * tile_bytes(F);
  std::vector<float> sums(F == Q4 ? M * groups : 1);
#pragma omp parallel num_threads(threads)
  {
    if constexpr (F == Q4) {
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) group_sums(x + m * K, groups, sums.data() + m * groups);
    }
#pragma omp for collapse(2) schedule(static)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n0 = b * LANES, rows = std::min<int64_t>(LANES, N - n0);
        for (int64_t m0 = c * CHUNK_ROWS; m0 < std::min(M, (c + 1) * CHUNK_ROWS); m0 += PASS) {
          const int pass = int(std::min<int64_t>(PASS, M - m0));
          alignas(64) float out[PASS * LANES];
          block_rows<F>(w + b * block_bytes, groups, x + m0 * K, K, F == Q4 ? sums.data() + m0 * groups : nullptr,
                        pass, out);
          for (int m = 0; m < pass; ++m)
            for (int r = 0; r < rows; ++r) store(out[m * LANES + r], y + (m0 + m) * N + n0 + r);
        }
      }
  }
}
#endif

// format: 0 Q4, 1 Q8; x: bf16 [M, K]; w: [ceil(N / 16), K / 32, tile bytes]; y: bf16 [M, N].
// Returns 0 on success, 2 when this build cannot serve it (no AVX512-BF16/VBMI, K not a multiple of 32).
extern "C" int zhuzi_tiled_linear(int format, const void* x, const void* w, void* y, int64_t M, int64_t N,
                                  int64_t K, int threads) {
#if ZHUZI_TILES
  if (K % GROUP || (format != Q4 && format != Q8)) return 2;
  auto go = [&](auto fn) {
    fn(static_cast<const uint16_t*>(x), static_cast<const uint8_t*>(w), static_cast<uint16_t*>(y), M, N, K, threads);
    return 0;
  };
  return format == Q4 ? go(linear<Q4>) : go(linear<Q8>);
#else
  return 2;
#endif
}
