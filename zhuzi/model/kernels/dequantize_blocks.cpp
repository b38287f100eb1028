// Rows of GGUF blocks -> their values, float32 or bf16: the embedding's rows of a step, and whole tensors
// that run dense (float32, the reference; int8 / int4 re-quantized; types without a kernel). The values equal
// gguf's reference dequantization bit for bit (blocks::values()), from the file's layout or the packed one
// (packed_layout.h). And the file's layout -> the packed one, once at load.
#include "api.h"
#include "packed_layout.h"

#include <sys/mman.h>

// Rows ids[i] (or i) -> out[i * K ...]; decode(id, b, q, a, off) decodes block b of row id.
template <class F, typename Decode>
static void dequantize(const int64_t* ids, int64_t n, int64_t K, void* out, int out_bf16, int threads, Decode decode) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n * K > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids ? ids[i] : i;
    float values[F::QK];
    for (int64_t b = 0; b < K / F::QK; ++b) {
      blocks::values<F>(values, [&](uint8_t* q, float* a, float* off) { decode(id, b, q, a, off); });
      for (int j = 0; j < F::QK; ++j) {
        const int64_t at = i * K + b * F::QK + j;
        if (out_bf16) store(values[j], static_cast<uint16_t*>(out) + at);
        else static_cast<float*>(out)[at] = values[j];
      }
    }
  }
}

// Row ids[i] (or row i when ids is null) of a tensor of `rows` rows of K weights, each row_bytes long,
// into out[i * K ...]. Returns 0, 1 for an id out of range, 2 for a type or K this file does not serve.
extern "C" int zhuzi_dequantize_rows(int type, const void* src, int64_t rows, int64_t row_bytes, const int64_t* ids,
                                     int64_t n, int64_t K, void* out, int out_bf16, int threads) {
  for (int64_t i = 0; ids && i < n; ++i)
    if (ids[i] < 0 || ids[i] >= rows) return 1;
  const auto* w = static_cast<const uint8_t*>(src);
  int status = 2;
  if (type & packed::FLAG) {
    if (!packed::serves(type, K, row_bytes) || rows % packed::ROWS) return 2;
    packed::with_format(type, [&](auto f) {
      using F = decltype(f);
      dequantize<F>(ids, n, K, out, out_bf16, threads, [&](int64_t id, int64_t b, uint8_t* q, float* a, float* off) {
        packed::decode<F>(packed::block<F>(w, row_bytes, id, b), int(id % packed::ROWS), q, a, off);
      });
    });
    return 0;
  }
  blocks::with_format(type, [&](auto f) {
    using F = decltype(f);
    if (K % F::QK || row_bytes != K / F::QK * F::BYTES) return;
    status = 0;
    dequantize<F>(ids, n, K, out, out_bf16, threads, [&](int64_t id, int64_t b, uint8_t* q, float* a, float* off) {
      F::decode(w + id * row_bytes + b * F::BYTES, q, a, off);
    });
  });
  return status;
}

// A matrix of `rows` rows (a multiple of 16) of K weights in a type packed_layout.h packs -> its layout at
// out (rows * K / QK * Layout::BYTES bytes), on huge pages where the kernel grants them. With release, src is
// a view of a file's private mapping that nothing has written: its pages then leave this process
// (MADV_DONTNEED; a later read faults them in again from the page cache), so the packed copy replaces them in
// its resident set. Returns 0, or 2 for a type, K or row count this file does not serve.
extern "C" int zhuzi_pack_blocks(int type, const void* src, int64_t rows, int64_t row_bytes, int64_t K, void* out,
                                 int release, int threads) {
  int status = 2;
  packed::with_format(packed::FLAG | type, [&](auto f) {
    using F = decltype(f);
    if (rows % packed::ROWS || K % F::QK || row_bytes != K / F::QK * F::BYTES) return;
    status = 0;
    const int64_t packed_row_bytes = K / F::QK * packed::Layout<F>::BYTES;
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = 2 << 20, at = reinterpret_cast<uintptr_t>(out);
    const uintptr_t begin = (at + huge - 1) / huge * huge, end = (at + rows * packed_row_bytes) / huge * huge;
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < rows / packed::ROWS; ++g)
      for (int64_t sb = 0; sb < K / F::QK; ++sb)
        packed::pack<F>(static_cast<const uint8_t*>(src) + g * packed::ROWS * row_bytes + sb * F::BYTES, row_bytes,
                        packed::block<F>(static_cast<uint8_t*>(out), packed_row_bytes, g * packed::ROWS, sb));
  });
  const uintptr_t page = 4096, at = reinterpret_cast<uintptr_t>(src);
  const uintptr_t begin = (at + page - 1) / page * page, end = (at + rows * row_bytes) / page * page;
  if (release && status == 0 && end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  return status;
}
