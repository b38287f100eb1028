// Rows of GGUF Q4_1 or Q8_0 blocks made from float weights, as quant.py makes them at load (--quantization
// int4 / int8), for the kernels' tests, with the weights they stand for.
#pragma once
#include "blocks.h"
#include "check.h"

namespace pack {

constexpr int BLOCK = 32;  // inputs a block

struct Rows {
  std::vector<uint8_t> bytes;  // [N, K / 32 * block bytes]
  std::vector<double> w;       // [N, K]: the weights the blocks stand for
};

// type: blocks::Q4_1 (q d + m, q in 0..15) or blocks::Q8_0 (q d, q in -127..127); w [N, K], K a multiple of 32.
inline Rows quantize(int type, const std::vector<float>& w, int64_t N, int64_t K) {
  const bool q4 = type == blocks::Q4_1;
  const int64_t size = q4 ? 20 : 34, blocks_per_row = K / BLOCK;
  Rows t{std::vector<uint8_t>(N * blocks_per_row * size), std::vector<double>(N * K)};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < blocks_per_row; ++g) {
      uint8_t* block = &t.bytes[(n * blocks_per_row + g) * size];
      const float* v = &w[n * K + g * BLOCK];
      float lo = v[0], hi = v[0], amax = 0;
      for (int i = 0; i < BLOCK; ++i)
        lo = std::fmin(lo, v[i]), hi = std::fmax(hi, v[i]), amax = std::fmax(amax, std::fabs(v[i]));
      const uint16_t d = check::half(q4 ? (hi - lo) / 15 : amax / 127), m = check::half(lo);
      const float df = check::from_half(d), mf = check::from_half(m);
      int q[BLOCK];
      for (int i = 0; i < BLOCK; ++i) {
        const float c = df > 0 ? std::nearbyint((v[i] - (q4 ? mf : 0.f)) / df) : 0.f;
        q[i] = int(q4 ? std::fmin(15.f, std::fmax(0.f, c)) : std::fmin(127.f, std::fmax(-127.f, c)));
        t.w[n * K + g * BLOCK + i] = double(q[i]) * df + (q4 ? mf : 0.0);
      }
      std::memcpy(block, &d, 2);
      if (q4) {
        std::memcpy(block + 2, &m, 2);
        for (int j = 0; j < 16; ++j) block[4 + j] = uint8_t(q[j] | (q[j + 16] << 4));
      } else {
        for (int i = 0; i < BLOCK; ++i) block[2 + i] = uint8_t(int8_t(q[i]));
      }
    }
  return t;
}

}  // namespace pack
