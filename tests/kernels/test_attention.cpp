// decode_attention.cpp and prefill_attention.cpp against a float64 softmax over the gathered rows: float32
// and bf16 queries and pools (float32 queries over a bf16 pool too), grouped heads, every length from 1,
// scattered slots, with and without attention sinks; unused slots hold NaN, so reading one shows.
#include "check.h"

namespace {

struct Pool {
  int64_t slots, KV, D;
  std::vector<float> k, v;  // the values, already rounded when the pool is bf16
  std::vector<uint16_t> k16, v16;

  Pool(int64_t n, int64_t kv, int64_t d, int64_t live, bool bf16, check::Rng& g) : slots(n), KV(kv), D(d) {
    for (int64_t i = 0; i < n * kv * d; ++i) {
      const bool dead = i / (kv * d) >= live;
      for (auto [vals, half] : {std::pair{&k, &k16}, std::pair{&v, &v16}}) {
        const float x = dead ? NAN : float(g.normal());
        half->push_back(check::bf16(x));
        vals->push_back(bf16 && !dead ? check::from_bf16(half->back()) : x);
      }
    }
  }
  const void* keys(bool bf16) const { return bf16 ? (const void*)k16.data() : k.data(); }
  const void* values(bool bf16) const { return bf16 ? (const void*)v16.data() : v.data(); }
};

// out[h][d] for query q [H][D] over the pool rows `rows`; sinks (or null): a logit per head in the denominator.
std::vector<double> reference(const float* q, const Pool& p, const std::vector<int64_t>& rows, int64_t H,
                              float scale, const float* sinks) {
  const int64_t D = p.D, QPK = H / p.KV;
  std::vector<double> out(H * D);
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> s;
    double top = -INFINITY, sum = 0;
    for (int64_t r : rows) {
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += double(q[h * D + d]) * p.k[(r * p.KV + h / QPK) * D + d];
      s.push_back(dot * scale), top = std::fmax(top, s.back());
    }
    if (sinks) top = std::fmax(top, sinks[h]), sum = std::exp(sinks[h] - top);
    for (double& x : s) x = std::exp(x - top), sum += x;
    for (size_t t = 0; t < rows.size(); ++t)
      for (int64_t d = 0; d < D; ++d) out[h * D + d] += s[t] / sum * p.v[(rows[t] * p.KV + h / QPK) * D + d];
  }
  return out;
}

struct Queries {
  std::vector<float> x;
  std::vector<uint16_t> x16;
  Queries(int64_t n, bool bf16, check::Rng& g) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = 3 * float(g.normal());  // peaked softmaxes too
      x16.push_back(check::bf16(v));
      x.push_back(bf16 ? check::from_bf16(x16.back()) : v);
    }
  }
  const void* data(bool bf16) const { return bf16 ? (const void*)x16.data() : x.data(); }
};

// (queries bf16, pool bf16): the pairs the kernels serve.
const bool DTYPES[][2] = {{false, false}, {true, true}, {false, true}};

// A logit per head of the size of the scores, or none.
std::vector<float> sink_logits(bool on, int H, check::Rng& g) {
  std::vector<float> sinks;
  for (int h = 0; on && h < H; ++h) sinks.push_back(2 * float(g.normal()));
  return sinks;
}

}  // namespace

// window > 0: a sliding window's last `window` tokens of each row (0: all of them). More threads than rows:
// each row's kv heads are items of their own.
TEST(decode_attention_matches_float64) {
  for (auto [q_bf16, kv_bf16] : DTYPES)
    for (int64_t window : {0, 7})
    for (int threads : {2, 8})
    for (bool with_sinks : {false, true})
    for (auto [H, KV, D] : {std::tuple<int, int, int>{4, 4, 32}, {9, 3, 64}, {8, 2, 128}, {2, 1, 96}}) {
      check::Rng g(H * D + q_bf16 + 2 * kv_bf16);
      const std::vector<float> sinks = sink_logits(with_sinks, H, g);
      const int64_t B = 5, W = 40, live = 3 * W;
      Pool pool(live + 8, KV, D, live, kv_bf16, g);
      Queries q(B * H * D, q_bf16, g);
      std::vector<int64_t> slots(B * W), lens = {1, W, 32, 33, 17};
      for (int64_t i = 0; i < B * W; ++i) slots[i] = i % W < lens[i / W] ? g.below(int(live)) : live + g.below(8);
      std::vector<float> out32(B * H * D);
      std::vector<uint16_t> out16(B * H * D);
      const float scale = 1.f / std::sqrt(float(D));
      const int status = zhuzi_decode_attention(q_bf16, kv_bf16, q.data(q_bf16), pool.keys(kv_bf16),
                                                pool.values(kv_bf16), slots.data(), lens.data(),
                                                q_bf16 ? (void*)out16.data() : out32.data(), B, W, H, KV, D,
                                                pool.slots, scale, window, with_sinks ? sinks.data() : nullptr,
                                                threads);
      CHECK(status == 0, "status %d", status);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
        const std::vector<int64_t> rows(slots.begin() + b * W + first, slots.begin() + b * W + lens[b]);
        const std::vector<double> want =
            reference(&q.x[b * H * D], pool, rows, H, scale, with_sinks ? sinks.data() : nullptr);
        for (int64_t i = 0; i < H * D; ++i) {
          const double got = q_bf16 ? check::from_bf16(out16[b * H * D + i]) : out32[b * H * D + i];
          const double bound = (q_bf16 ? 0x1p-8 : 1e-5) * std::fabs(want[i]) + 1e-5;
          if (!(std::fabs(got - want[i]) <= bound)) {
            CHECK(false, "q_bf16 %d kv_bf16 %d window %ld threads %d sinks %d H %d KV %d D %d row %ld: %g, want %g",
                  q_bf16, kv_bf16, (long)window, threads, with_sinks, H, KV, D, (long)b, got, want[i]);
            break;
          }
        }
      }
    }
}

TEST(prefill_attention_matches_the_float64_causal_reference) {
  for (bool q_bf16 : {true, false})
    for (int64_t window : {0, 9})
    for (bool with_sinks : {false, true})
    for (auto [L, context] : {std::pair<int64_t, int64_t>{1, 1}, {1, 40}, {17, 50}, {45, 130}})
      for (auto [H, KV, D] : {std::tuple<int, int, int>{9, 3, 64}, {4, 4, 32}, {2, 1, 96}}) {
        check::Rng g(L * context + H + q_bf16);
        const std::vector<float> sinks = sink_logits(with_sinks, H, g);
        const float* sink = with_sinks ? sinks.data() : nullptr;
        Pool pool(2 * context + 8, KV, D, 2 * context, true, g);
        std::vector<int64_t> slots(context);
        for (int64_t t = 0; t < context; ++t) slots[t] = 2 * t + g.below(2);  // scattered, each once
        Queries q(L * H * D, q_bf16, g);
        std::vector<float> out32(L * H * D);
        std::vector<uint16_t> out16(L * H * D);
        const float scale = 1.f / std::sqrt(float(D));
        const int status = zhuzi_prefill_attention(q_bf16, 1, q.data(q_bf16), pool.keys(true), pool.values(true),
                                                   slots.data(), L, context, H, KV, D, pool.slots, scale, window,
                                                   sink, q_bf16 ? (void*)out16.data() : out32.data(), 2);
        CHECK(status == 0, "status %d", status);
        double vmax = 0;
        for (float v : pool.v) vmax = std::isnan(v) ? vmax : std::fmax(vmax, std::fabs(v));
        for (int64_t l = 0; l < L; ++l) {
          const int64_t end = context - L + l + 1, first = window > 0 ? std::max<int64_t>(0, end - window) : 0;
          const std::vector<int64_t> rows(slots.begin() + first, slots.begin() + end);
          const std::vector<double> want = reference(&q.x[l * H * D], pool, rows, H, scale, sink);
          for (int64_t i = 0; i < H * D; ++i) {
            const double got = q_bf16 ? check::from_bf16(out16[l * H * D + i]) : out32[l * H * D + i];
            // bf16: probabilities may meet V as bf16 (2^-9 of each) and the output is rounded once
            const double bound = q_bf16 ? 0x1p-9 * vmax + 0x1p-8 * std::fabs(want[i]) + 1e-5
                                        : 1e-5 * (1 + std::fabs(want[i]));
            if (!(std::fabs(got - want[i]) <= bound)) {
              CHECK(false, "q_bf16 %d window %ld sinks %d L %ld context %ld H %d D %d query %ld: %g, want %g",
                    q_bf16, (long)window, with_sinks, (long)L, (long)context, H, D, (long)l, got, want[i]);
              break;
            }
          }
        }
      }
}

TEST(attention_rejects_slots_outside_the_pool) {
  check::Rng g(1);
  Pool pool(8, 1, 32, 8, true, g);
  Queries q(32, true, g);
  std::vector<int64_t> slots = {0, 8}, lens = {2};
  uint16_t out[32];
  CHECK(zhuzi_decode_attention(1, 1, q.data(true), pool.keys(true), pool.values(true), slots.data(), lens.data(),
                               out, 1, 2, 1, 1, 32, 8, 1.f, 0, nullptr, 1) == 1, "decode took slot 8 of 8");
  CHECK(zhuzi_prefill_attention(1, 1, q.data(true), pool.keys(true), pool.values(true), slots.data(), 1, 2, 1, 1, 32,
                                8, 1.f, 0, nullptr, out, 1) == 1, "prefill took slot 8 of 8");
}
