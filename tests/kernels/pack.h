// quant.py's Q4 / Q8 units (kernels/quant_packed.h describes them), packed here for the kernels' tests, with the
// weights they stand for.
#pragma once
#include "check.h"

namespace pack {

constexpr int GROUP = 32, LANES = 16;

struct Packed {
  std::vector<uint8_t> bytes;  // [ceil(N / 16), K / 32, unit bytes]
  std::vector<double> w;       // [N, K]: the weights the units stand for
};

// format 0: Q4 (q d + m, q in 0..15), 1: Q8 (q d, q in -127..127); w [N, K], K a multiple of 32.
inline Packed quant(int format, const std::vector<float>& w, int64_t N, int64_t K) {
  const int64_t row_groups = (N + LANES - 1) / LANES, groups = K / GROUP, size = format == 0 ? 320 : 544;
  Packed t{std::vector<uint8_t>(row_groups * groups * size), std::vector<double>(N * K)};
  for (int64_t rg = 0; rg < row_groups; ++rg)
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* unit = &t.bytes[(rg * groups + g) * size];
      for (int r = 0; r < LANES; ++r) {
        const int64_t n = rg * LANES + r;
        float v[GROUP] = {};
        if (n < N) std::memcpy(v, &w[n * K + g * GROUP], sizeof v);
        float lo = v[0], hi = v[0], amax = 0;
        for (float x : v) lo = std::fmin(lo, x), hi = std::fmax(hi, x), amax = std::fmax(amax, std::fabs(x));
        const uint16_t d = check::half(format == 0 ? (hi - lo) / 15 : amax / 127), m = check::half(lo);
        const float df = check::from_half(d), mf = check::from_half(m);
        int q[GROUP];
        for (int i = 0; i < GROUP; ++i) {
          const float c = df > 0 ? std::nearbyint((v[i] - (format == 0 ? mf : 0.f)) / df) : 0.f;
          q[i] = int(format == 0 ? std::fmin(15.f, std::fmax(0.f, c)) : std::fmin(127.f, std::fmax(-127.f, c)));
          if (n < N) t.w[n * K + g * GROUP + i] = double(q[i]) * df + (format == 0 ? mf : 0.0);
        }
        if (format == 0) {
          for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 4; ++i) unit[64 * j + 4 * r + i] = uint8_t(q[8 * j + i] | (q[8 * j + 4 + i] << 4));
          std::memcpy(unit + 256 + 2 * r, &d, 2);
          std::memcpy(unit + 288 + 2 * r, &m, 2);
        } else {
          for (int j = 0; j < 8; ++j)
            for (int i = 0; i < 4; ++i) unit[64 * j + 4 * r + i] = uint8_t(int8_t(q[4 * j + i]));
          std::memcpy(unit + 512 + 2 * r, &d, 2);
        }
      }
    }
  return t;
}

}  // namespace pack
