// Paged decode attention over the KV pool; see cpu_attention.py for the design. With a sliding window
// (window > 0) a row reads only its last `window` positions: its slot list from there on. sinks: H logits that
// join each head's softmax denominator (gpt-oss), or null.
#include "api.h"
#include "attention.h"

#include <tuple>

template <typename TQ, typename TKV, int D>
static int run(const void* q, const void* kc, const void* vc, const int64_t* slots, const int64_t* lens,
               void* out, int64_t B, int64_t W, int H, int KV, int64_t nslots, float scale, int64_t window,
               const float* sinks, int threads) {
  const int64_t stride = int64_t(H) * D;
  int bad = 0;
  // Fewer rows than threads: a row's kv heads are items of their own, so that one sequence takes every thread.
  const int parts = B < threads ? KV : 1, heads = H / parts;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < B * parts; ++i) {
    const int64_t b = i / parts;
    const int h0 = int(i % parts) * heads;
    if (lens[b] < 1 || lens[b] > W) { bad = 1; continue; }
    const int64_t begin = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    attend<TQ, TKV, D>(static_cast<const TQ*>(q) + b * stride, static_cast<const TKV*>(kc),
                       static_cast<const TKV*>(vc), slots + b * W + begin, lens[b] - begin,
                       static_cast<TQ*>(out) + b * stride, h0, h0 + heads, H, KV, nslots, scale, sinks, &bad);
  }
  return bad;
}

template <typename TQ, typename TKV>
static int dispatch(int D, const void* q, const void* kc, const void* vc, const int64_t* slots, const int64_t* lens,
                    void* out, int64_t B, int64_t W, int H, int KV, int64_t nslots, float scale, int64_t window,
                    const float* sinks, int threads) {
  auto go = [&](auto fn) {
    return fn(q, kc, vc, slots, lens, out, B, W, H, KV, nslots, scale, window, sinks, threads);
  };
  switch (D) {
    case 32: return go(run<TQ, TKV, 32>);
    case 64: return go(run<TQ, TKV, 64>);
    case 96: return go(run<TQ, TKV, 96>);
    case 128: return go(run<TQ, TKV, 128>);
    case 256: return go(run<TQ, TKV, 256>);
    default: return 2;
  }
}

extern "C" int zhuzi_decode_attention(int q_bf16, int kv_type, const void* q, const void* kc, const void* vc,
                                      const int64_t* slots, const int64_t* lens, void* out, int64_t B, int64_t W,
                                      int H, int KV, int D, int64_t nslots, float scale, int64_t window,
                                      const float* sinks, int threads) {
  if (KV < 1 || H % KV || H > MAXH || H * D > MAXHD) return 2;
  const auto args =
      std::make_tuple(D, q, kc, vc, slots, lens, out, B, W, H, KV, nslots, scale, window, sinks, threads);
  if (kv_type == KV_BF16) return std::apply(q_bf16 ? dispatch<uint16_t, uint16_t> : dispatch<float, uint16_t>, args);
  if (kv_type == KV_Q8_0) return std::apply(q_bf16 ? dispatch<uint16_t, uint8_t> : dispatch<float, uint8_t>, args);
  if (kv_type == KV_F32 && !q_bf16) return std::apply(dispatch<float, float>, args);
  return 2;
}
