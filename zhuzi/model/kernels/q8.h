// Activations quantized to int8 blocks of 32 (llama.cpp's Q8_0 / Q8_1 activations): the inputs of the
// int8 and 4-bit weight kernels on the variants without native bf16 (and of the GGUF block kernels).
//
// A row of K values, zero-padded to a multiple of 32, becomes one Block per 32: codes q with x ~ d q,
// d = amax / 127, q = round(x / d) (to nearest, ties to even), and the sum of each 16 codes. |q| <= 127, so
// x86's maddubs sign trick and every int16 pair sum stay exact. The sums serve weights with an offset or
// a minimum: sum_i (a c_i + b) x_i = d (a sum_i c_i q_i + b sum_i q_i). The arithmetic is the same on every
// variant, so a row's blocks are the same bits everywhere.
//
// amax is taken over a span of 32 inputs, or of 256 for the K-quants (llama.cpp's q8_K): the 8 blocks of a
// span then share one d, so a 256-input super-block's integer sums meet the activations' scale once.
#pragma once
#include "prelude.h"

#include <algorithm>
#include <array>
#include <vector>

namespace q8 {

constexpr int BLOCK = 32;

struct Block {
  int8_t q[BLOCK];
  float d;
  int16_t sum[2];  // of q[0..16) and q[16..32)
};

static inline int64_t blocks(int64_t K) { return (K + BLOCK - 1) / BLOCK; }

static inline float value(float x) { return x; }
static inline float value(uint16_t x) { return widen(x); }

// x[0..K) -> out[0 .. kp / 32), kp a multiple of 32 at least K (the rest of the row is zeros); one d per
// `span` inputs (32 or 256).
template <typename T>
static void quantize_row(const T* x, int64_t K, int64_t kp, Block* out, int span = BLOCK) {
  alignas(64) float v[256];
  for (int64_t k0 = 0; k0 < kp; k0 += span) {
    const int n = int(std::min<int64_t>(span, kp - k0));
    for (int i = 0; i < n; ++i) v[i] = k0 + i < K ? value(x[k0 + i]) : 0.f;
    vf top = vf{};
    for (int i = 0; i < n; i += VL) {
      const vf a = (vf)((vu)load_vf(v + i) & 0x7fffffffu);
      top = a > top ? a : top;
    }
    float amax = 0.f;
    for (int l = 0; l < VL; ++l) amax = std::max(amax, top[l]);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int b = 0; b < n / BLOCK; ++b) {
      Block& o = out[k0 / BLOCK + b];
      o.d = amax / 127.f;
      alignas(64) int32_t c[BLOCK];
      vi sums[2] = {};
      for (int i = 0; i < BLOCK; i += VL) {
        const vi r = round_to_int(load_vf(v + BLOCK * b + i) * inv);
        std::memcpy(c + i, &r, sizeof r);
        sums[i / 16] += r;
      }
      for (int i = 0; i < BLOCK; ++i) o.q[i] = int8_t(c[i]);
      for (int h = 0; h < 2; ++h) {
        int32_t sum = 0;
        for (int l = 0; l < VL; ++l) sum += sums[h][l];
        o.sum[h] = int16_t(sum);
      }
    }
  }
}

// A block's scale times its code sums, for weights with an offset or a minimum: half h's (h < 2) and the
// whole block's (h = 2), each rounded once as every kernel rounds it.
static inline float scaled_sum(const Block& b, int h) {
  return b.d * float(h < 2 ? b.sum[h] : b.sum[0] + b.sum[1]);
}

using Sums = std::array<float, 3>;  // a block's scaled_sum()s, h = 0, 1, 2

// M rows of K values; row m's blocks at row(m), and their scaled_sum()s at sums(m), made once here because every
// 16-row group of a matrix meets every block. The storage runs on to the next multiple of 16 rows and 256 inputs
// (block_prefill.h's DECODE_K) past it (never written): AMX's tile loads (arch/x86/amx/block_prefill.h) read 16 rows,
// 256 inputs.
struct Rows {
  int64_t n = 0;  // blocks a row
  int span = BLOCK;  // inputs that share a d
  std::vector<Block> data;
  std::vector<Sums> scaled;

  template <typename T>
  void set(const T* x, int64_t M, int64_t K, int64_t ldx, int threads = 1, int span_ = BLOCK) {
    n = blocks(K), span = span_;
    at_least(data, (M + 15) / 16 * 16 * n + 8);
    at_least(scaled, M * n);
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 8)
    for (int64_t m = 0; m < M; ++m) {
      quantize_row(x + m * ldx, K, n * BLOCK, &data[m * n], span);
      for (int64_t j = 0; j < n; ++j)
        for (int h = 0; h < 3; ++h) scaled[m * n + j][h] = scaled_sum(data[m * n + j], h);
    }
  }
  const Block* row(int64_t m) const { return data.data() + m * n; }
  const Sums* sums(int64_t m) const { return scaled.data() + m * n; }
};

}  // namespace q8
