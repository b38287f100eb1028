// quant_packed.h in portable C++: each row's codes read one at a time from the unit's layout (quant_packed.h)
// and summed against the q8 inputs in int32, then per group and row the same float steps as
// arch/arm/neon/quant_packed.h and arch/x86/avx2/quant_packed.h: Q4 adds d dx sum(q qx) + m dx sum(qx), Q8
// d dx sum(q qx).
#pragma once

namespace quant_packed {

constexpr int PASS = 4;

// Row r's code for input i of a group's unit at w.
template <int F>
static inline int32_t code(const uint8_t* w, int r, int i) {
  if constexpr (F == Q4) {
    const uint8_t b = w[64 * (i / 8) + 4 * r + i % 4];
    return i % 8 < 4 ? b & 15 : b >> 4;
  } else {
    return int8_t(w[64 * (i / 4) + 4 * r + i % 4]);
  }
}

static inline float half_at(const uint8_t* p, int r) {
  uint16_t h;
  std::memcpy(&h, p + 2 * r, 2);
  return half_to_float(h);
}

template <int F, int M>
static void row_group(const uint8_t* w, int64_t groups, const Input& in, int64_t m0, float out[M][LANES]) {
  constexpr int BYTES = F == Q4 ? Q4_BYTES : Q8_BYTES;
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < LANES; ++r) out[m][r] = 0.f;
  for (int64_t g = 0; g < groups; ++g, w += BYTES)
    for (int r = 0; r < LANES; ++r) {
      const float d = half_at(w + (F == Q4 ? 256 : 512), r);
      for (int m = 0; m < M; ++m) {
        const q8::Block& b = in.rows.row(m0 + m)[g];
        int32_t s = 0;
        for (int i = 0; i < GROUP; ++i) s += code<F>(w, r, i) * b.q[i];
        out[m][r] = fmadd(float(s), d * b.d, out[m][r]);
        if constexpr (F == Q4) out[m][r] = fmadd(half_at(w + 288, r), in.dsum_row(m0 + m)[g], out[m][r]);
      }
    }
}

}  // namespace quant_packed
