// The GGUF block kernels (block_linear.cpp: block_decode.h for up to 8 input rows, block_prefill.h beyond; the
// packed layouts of packed_blocks.h) against block_dot.h's scalar reference, bit for bit, for every block
// type; and the reference against float64 products of blocks.h's values within the bound of the activations'
// q8 rounding.
#include "block_dot.h"
#include "check.h"
#include "packed_blocks.h"

namespace {

// Rows of random blocks: random bytes, with the fp16 scales finite and of a realistic size (as
// tests/gguf_blocks.py makes them): d at `at`, and for the formats with a minimum, dmin or m right after it;
// MXFP4's E8M0 exponent in place of d.
template <class F>
std::vector<uint8_t> random_rows(int64_t rows, int64_t K, check::Rng& g) {
  std::vector<uint8_t> w(rows * K / F::QK * F::BYTES);
  for (auto& b : w) b = uint8_t(g.below(256));
  using blocks::Format;
  const int at = std::is_same_v<F, Format<blocks::Q6_K>>   ? 208
                 : std::is_same_v<F, Format<blocks::Q3_K>> ? 108
                 : std::is_same_v<F, Format<blocks::Q2_K>> ? 80 : 0;
  double scale = 0.02 / (F::QK / 32) / (F::QK == 256 ? 4 : 1);  // K-quants: sub-block scales ~32
  if (blocks::LUT<F> && !std::is_same_v<F, Format<blocks::MXFP4>>) scale /= 16;  // IQ4 codes up to 127
  for (size_t b = 0; b < w.size(); b += F::BYTES) {
    const uint16_t d = check::half(float((0.2 + 0.8 * g.uniform()) * scale));
    const uint16_t m = check::half(float((2 * g.uniform() - 1) * scale * 8));
    std::memcpy(&w[b + at], &d, 2);
    if (F::MIN) std::memcpy(&w[b + at + 2], &m, 2);
    if (std::is_same_v<F, blocks::Format<blocks::MXFP4>>) w[b] = uint8_t(115 + g.below(7));  // 2^(e - 128) d
  }
  return w;
}

template <int T>
void check_format(const char* name) {
  using F = blocks::Format<T>;
  constexpr int64_t N = 40, K = F::QK == 256 ? 512 : 288;  // a partial row group; 32-blocks: DECODE_K inputs and a tail
  constexpr int64_t row_bytes = K / F::QK * F::BYTES;
  check::Rng g(F::BYTES);
  const std::vector<uint8_t> w = random_rows<F>(N, K, g);
  std::vector<double> values(N * K);
  for (int64_t b = 0; b < N * K / F::QK; ++b) {
    float v[F::QK];
    blocks::values<F>(&w[b * F::BYTES], v);
    std::copy(v, v + F::QK, &values[b * F::QK]);
  }
  const block_prefill::Part part = {T, w.data(), N, row_bytes};
  for (int64_t M : {1, 3, 8, 20}) {  // decode rows, over passes of 4, all 8, and the batched row groups
    std::vector<float> x(M * K), y(M * N);
    for (auto& v : x) v = float(g.normal());
    CHECK(zhuzi_block_linear(&part, 1, x.data(), 0, y.data(), 0, M, N, K, 2) == 0, "%s: not served", name);
    q8::Rows xq;
    xq.set(x.data(), M, K, K, 1, F::QK);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const float want = block_dot::row<F>(&w[n * row_bytes], xq.row(m), xq.sums(m), K);
        CHECK(std::memcmp(&want, &y[m * N + n], 4) == 0, "%s M %ld: row %ld output %ld %.9g, reference %.9g", name,
              (long)M, (long)m, (long)n, y[m * N + n], want);
        double exact = 0, size = 0;
        for (int64_t k = 0; k < K; ++k)
          exact += double(x[m * K + k]) * values[n * K + k], size += std::fabs(x[m * K + k] * values[n * K + k]);
        const double bound = check::q8_bound(&x[m * K], &values[n * K], K, F::QK == 256 ? 256 : 32) + 1e-5 * size;
        CHECK(std::fabs(want - exact) <= bound, "%s M %ld: reference %.9g, float64 %.9g, bound %.3g", name, (long)M,
              want, exact, bound);
      }
  }
}

// A matrix packed at load gives the file's values and, for every row count, the reference's bits on the file's
// blocks.
template <int T>
void check_packed(const char* name) {
  using F = blocks::Format<T>;
  constexpr int64_t N = 48, K = F::QK == 256 ? 768 : 288, row_bytes = K / F::QK * F::BYTES;
  constexpr int64_t packed_bytes = K / F::QK * packed::Layout<F>::BYTES;
  check::Rng g(F::BYTES + 1);
  const std::vector<uint8_t> w = random_rows<F>(N, K, g);
  std::vector<uint8_t> p(N * packed_bytes);
  CHECK(zhuzi_pack_blocks(T, w.data(), N, row_bytes, K, p.data(), 0, 2) == 0, "%s: not packed", name);
  CHECK(zhuzi_pack_blocks(T, w.data(), N - 8, row_bytes, K, p.data(), 0, 2) == 2, "%s: 40 rows packed", name);
  std::vector<float> file(N * K), unpacked(N * K);
  CHECK(zhuzi_dequantize_rows(T, w.data(), N, row_bytes, nullptr, N, K, file.data(), 0, 1) == 0, "%s", name);
  CHECK(zhuzi_dequantize_rows(packed::FLAG | T, p.data(), N, packed_bytes, nullptr, N, K, unpacked.data(), 0, 1) == 0,
        "%s: packed rows not dequantized", name);
  CHECK(std::memcmp(file.data(), unpacked.data(), file.size() * 4) == 0, "%s: packed values differ", name);
  const block_prefill::Part part = {packed::FLAG | T, p.data(), N, packed_bytes};
  for (int64_t M : {1, 2, 5, 8, 20}) {
    std::vector<float> x(M * K), y(M * N);
    for (auto& v : x) v = float(g.normal());
    CHECK(zhuzi_block_linear(&part, 1, x.data(), 0, y.data(), 0, M, N, K, 2) == 0, "%s packed: not served", name);
    q8::Rows xq;
    xq.set(x.data(), M, K, K, 1, F::QK);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const float want = block_dot::row<F>(&w[n * row_bytes], xq.row(m), xq.sums(m), K);
        CHECK(std::memcmp(&want, &y[m * N + n], 4) == 0, "%s packed M %ld: row %ld output %ld %.9g, reference %.9g",
              name, (long)M, (long)m, (long)n, y[m * N + n], want);
      }
  }
}

}  // namespace

TEST(packed_blocks_give_the_file_values_and_the_reference_bits) {
  using namespace blocks;
  check_packed<Q4_0>("Q4_0");
  check_packed<Q4_1>("Q4_1");
  check_packed<Q5_0>("Q5_0");
  check_packed<Q5_1>("Q5_1");
  check_packed<Q8_0>("Q8_0");
  check_packed<Q4_K>("Q4_K");
  check_packed<Q5_K>("Q5_K");
  check_packed<Q6_K>("Q6_K");
  check_packed<Q3_K>("Q3_K");
  check_packed<Q2_K>("Q2_K");
  check_packed<IQ4_NL>("IQ4_NL");
  check_packed<IQ4_XS>("IQ4_XS");
  check_packed<MXFP4>("MXFP4");
}

TEST(block_kernels_give_the_reference_bits_for_every_block_type) {
  using namespace blocks;
  check_format<Q4_0>("Q4_0");
  check_format<Q4_1>("Q4_1");
  check_format<Q5_0>("Q5_0");
  check_format<Q5_1>("Q5_1");
  check_format<Q8_0>("Q8_0");
  check_format<Q4_K>("Q4_K");
  check_format<Q5_K>("Q5_K");
  check_format<Q6_K>("Q6_K");
  check_format<Q3_K>("Q3_K");
  check_format<Q2_K>("Q2_K");
  check_format<IQ4_NL>("IQ4_NL");
  check_format<IQ4_XS>("IQ4_XS");
  check_format<MXFP4>("MXFP4");
}
