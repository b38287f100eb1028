// Rows of GGUF blocks -> their values, float32 or bf16: the embedding's rows of a step, and whole tensors
// that run dense (float32, the reference; int8 / int4 re-quantized; types without a kernel). The values equal
// gguf's reference dequantization bit for bit (blocks::values()).
#include "api.h"
#include "blocks.h"

// Row ids[i] (or row i when ids is null) of a tensor of `rows` rows of K weights, each row_bytes long,
// into out[i * K ...]. Returns 0, 1 for an id out of range, 2 for a type or K this file does not serve.
extern "C" int zhuzi_dequantize_rows(int type, const void* src, int64_t rows, int64_t row_bytes, const int64_t* ids,
                                     int64_t n, int64_t K, void* out, int out_bf16, int threads) {
  for (int64_t i = 0; ids && i < n; ++i)
    if (ids[i] < 0 || ids[i] >= rows) return 1;
  int status = 2;
  blocks::with_format(type, [&](auto f) {
    using F = decltype(f);
    if (K % F::QK || row_bytes != K / F::QK * F::BYTES) return;
    status = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * K > (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
      const auto* row = static_cast<const uint8_t*>(src) + (ids ? ids[i] : i) * row_bytes;
      float values[F::QK];
      for (int64_t b = 0; b < K / F::QK; ++b) {
        blocks::values<F>(row + b * F::BYTES, values);
        for (int j = 0; j < F::QK; ++j) {
          const int64_t at = i * K + b * F::QK + j;
          if (out_bf16) store(values[j], static_cast<uint16_t*>(out) + at);
          else static_cast<float*>(out)[at] = values[j];
        }
      }
    }
  });
  return status;
}
