// Linear layers with zhuzi's own 4-bit / 8-bit weights (quant_packed.h) for any number of input rows; see
// cpu_linear.py for the design.
#include "api.h"
#include "quant_packed.h"

#include <algorithm>

using namespace quant_packed;

// Input rows per chunk: a chunk's rows stay in L2 while the row groups of the matrix pass over them.
constexpr int64_t CHUNK_ROWS = 128;

template <typename T>
static void linear(int format, const T* x, const uint8_t* w, T* y, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t groups = K / GROUP, row_groups = (N + LANES - 1) / LANES, chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS;
  const int64_t row_group_bytes = groups * unit_bytes(format);
  Input in;
  in.set(x, M, K, K, threads);
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t rg = 0; rg < row_groups; ++rg) {
      const int64_t n0 = rg * LANES, rows = std::min<int64_t>(LANES, N - n0);
      for (int64_t m0 = c * CHUNK_ROWS; m0 < std::min(M, (c + 1) * CHUNK_ROWS); m0 += PASS) {
        const int pass = int(std::min<int64_t>(PASS, M - m0));
        float out[PASS][LANES];
        row_group(format, w + rg * row_group_bytes, groups, in, m0, pass, out);
        for (int m = 0; m < pass; ++m)
          for (int r = 0; r < rows; ++r) store(out[m][r], y + (m0 + m) * N + n0 + r);
      }
    }
}

extern "C" int zhuzi_quant_linear(int format, int x_bf16, const void* x, const void* w, void* y, int64_t M,
                                  int64_t N, int64_t K, int threads) {
  if (K % GROUP || (format != Q4 && format != Q8)) return 2;
  const auto* packed = static_cast<const uint8_t*>(w);
  if (x_bf16) linear(format, static_cast<const uint16_t*>(x), packed, static_cast<uint16_t*>(y), M, N, K, threads);
  else linear(format, static_cast<const float*>(x), packed, static_cast<float*>(y), M, N, K, threads);
  return 0;
}
