// zhuzi's own 4-bit and 8-bit weights (the GGUF's Q4_1 and Q8_0 blocks, repacked at load by quant.py): the
// inner loops of the quant linear kernel and of the fused decode step, one implementation per variant.
//
// A row group of 16 output rows is stored as units of 32 inputs (packed_layout.h's words for its GGUF groups).
// The 16 rows are interleaved one per 32-bit lane, four consecutive inputs of a row in a lane (what
// vpdpbusd / sdot multiply), so a unit's scales apply as whole vectors and no horizontal sums are needed; a
// row group stores its K/32 units one after another, so it is read as one sequential stream.
//
// Q4 unit (Q4_1), 320 bytes: 4 chunks of 64 code bytes, 16 fp16 scales d, 16 fp16 minimums m; the weight
//   is q d + m for a code q in 0..15. In chunk j, byte 4r + i holds row r's input 8j + i in its low nibble
//   and input 8j + 4 + i in its high nibble.
// Q8 unit (Q8_0), 544 bytes: 8 quads of 64 code bytes (in quad j, byte 4r + i holds row r's input 4j + i
//   as an int8 in -127..127), then 16 fp16 scales d; the weight is q d.
//
// arch/x86/avx512/quant_packed.h turns the codes into bf16 and meets bf16 inputs as they are; the avx2, neon
// and generic quant_packed.h meet q8 activations (q8.h, quant_packed::Input here) with int8 dot products. Each
// provides Input (the prepared input rows: set(x, M, K, ldx, threads) from float or bf16 rows), PASS (input
// rows per pass over a row group) and row_group<F, M>(w, groups, in, m0, out): a row group's 16 rows against
// input rows m0 .. m0 + M - 1 (row_group<M>(format, ...) below picks F at run time). Every (output, input row)
// pair has its own accumulators and the same operations whatever the number of rows, the row group or the
// thread, so results are batch-invariant.
#pragma once
#include "prelude.h"

#include <type_traits>

namespace quant_packed {

enum Format : int32_t { Q4 = 0, Q8 = 1 };
constexpr int GROUP = 32, LANES = 16, Q4_BYTES = 320, Q8_BYTES = 544;

static inline int64_t unit_bytes(int format) { return format == Q4 ? Q4_BYTES : Q8_BYTES; }

}  // namespace quant_packed

#if !ZHUZI_AVX512
#include "q8.h"

#include <vector>

namespace quant_packed {

struct Input {  // q8 blocks of every row, and per block d times the sum of its codes (what Q4's minimums meet)
  q8::Rows rows;
  std::vector<float> dsum;

  template <typename T>
  void set(const T* x, int64_t M, int64_t K, int64_t ldx, int threads = 1) {
    rows.set(x, M, K, ldx, threads);
    at_least(dsum, M * rows.n);
    for (int64_t i = 0; i < M * rows.n; ++i) {
      const q8::Block& b = rows.data[i];
      dsum[i] = b.d * float(b.sum[0] + b.sum[1]);
    }
  }
  const float* dsum_row(int64_t m) const { return dsum.data() + m * rows.n; }
};

}  // namespace quant_packed
#endif

#if ZHUZI_AVX512
#include "arch/x86/avx512/quant_packed.h"
#elif ZHUZI_AVX2
#include "arch/x86/avx2/quant_packed.h"
#elif ZHUZI_NEON
#include "arch/arm/neon/quant_packed.h"
#else
#include "arch/generic/quant_packed.h"
#endif

namespace quant_packed {

template <int M>
static void row_group(int format, const uint8_t* w, int64_t groups, const Input& in, int64_t m0,
                      float out[M][LANES]) {
  if (format == Q4) row_group<Q4, M>(w, groups, in, m0, out);
  else row_group<Q8, M>(w, groups, in, m0, out);
}

// row_group<M> for any M <= PASS chosen at run time.
static inline void row_group(int format, const uint8_t* w, int64_t groups, const Input& in, int64_t m0, int M,
                             float out[][LANES]) {
  with_rows<PASS>(M, [&](auto m) { row_group<decltype(m)::value>(format, w, groups, in, m0, out); });
}

}  // namespace quant_packed
