// Rows of GGUF Q4_1 or Q8_0 blocks made from float weights, as quant.py makes them at load (--quantization
// int4 / int8), or MXFP4 blocks (gpt-oss's experts), for the kernels' tests, with the weights they stand for.
#pragma once
#include "blocks.h"
#include "check.h"

namespace pack {

constexpr int BLOCK = 32;  // inputs a block

struct Rows {
  std::vector<uint8_t> bytes;  // [N, K / 32 * block bytes]
  std::vector<double> w;       // [N, K]: the weights the blocks stand for
};

// An MXFP4 block at `block`: the E8M0 exponent gguf's quantizer picks, each weight the nearest of the scaled
// table values; those values into w.
inline void quantize_mxfp4(const float* v, uint8_t* block, double* w) {
  float amax = 0;
  for (int i = 0; i < BLOCK; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  block[0] = uint8_t(amax > 0 ? std::floor(std::log2(amax)) - 2 + 127 : 0);
  const float d = blocks::e8m0_half(block[0]);
  const int8_t* values = blocks::MXFP4_VALUES;
  std::memset(block + 1, 0, 16);
  for (int i = 0; i < BLOCK; ++i) {
    int best = 0;
    for (int j = 1; j < 16; ++j)
      if (std::fabs(d * values[j] - v[i]) < std::fabs(d * values[best] - v[i])) best = j;
    block[1 + i % 16] |= uint8_t(best << (i < 16 ? 0 : 4));
    w[i] = double(d * values[best]);
  }
}

// type: blocks::Q4_1 (q d + m, q in 0..15), blocks::Q8_0 (q d, q in -127..127) or blocks::MXFP4; w [N, K], K a
// multiple of 32.
inline Rows quantize(int type, const std::vector<float>& w, int64_t N, int64_t K) {
  const bool q4 = type == blocks::Q4_1, mx = type == blocks::MXFP4;
  const int64_t size = q4 ? 20 : mx ? 17 : 34, blocks_per_row = K / BLOCK;
  Rows t{std::vector<uint8_t>(N * blocks_per_row * size), std::vector<double>(N * K)};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < blocks_per_row; ++g) {
      uint8_t* block = &t.bytes[(n * blocks_per_row + g) * size];
      const float* v = &w[n * K + g * BLOCK];
      if (mx) {
        quantize_mxfp4(v, block, &t.w[n * K + g * BLOCK]);
        continue;
      }
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
