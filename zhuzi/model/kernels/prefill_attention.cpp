// Prefill attention over the paged KV pool in slabs; see cpu_attention.py for the design.
//
// A work item is a few consecutive query positions of one query head, held one per vector lane. It walks
// the keys from position 0 in slabs of 32 (only as far as its last query may look), so every K/V row a slab
// reads serves all of the item's queries at once, with an online softmax per lane in float32. Two items:
// bf16 throughout with vdpbf16ps (arch/x86/avx512/prefill_attention.h), and float32 math over float32 or bf16
// queries and bf16 or q8_0 pools on every variant (prefill_attention_f32.h). With a sliding window (window > 0)
// an item starts at its first query's oldest visible key and each lane masks the keys older than its own
// window: the slots before that are never read (their pages may be back in the pool). sinks (or null): a logit
// per head in its softmax denominator, added at the end.
#include "api.h"
#include "prefill_attention_f32.h"
#if ZHUZI_AVX512
#include "arch/x86/avx512/prefill_attention.h"
#endif

#include <tuple>

// Every item of the chunk, the last spans of Q queries (longest histories) first. Item(q, kc, vc, slots, first, q0,
// n, h, H, QPK, row, scale, window, sink, out) serves queries q0 .. q0 + n - 1 (n <= Q) of head h (sink: its
// logit, or null).
template <int Q, typename TQ, typename TKV, typename Item>
static int run(Item item, const void* q, const void* kc, const void* vc, const int64_t* slots, int64_t L,
               int64_t context, int H, int KV, int D, int64_t nslots, float scale, int64_t window,
               const float* sinks, void* out, int threads) {
  for (int64_t t = window > 0 ? std::max<int64_t>(0, context - L - window + 1) : 0; t < context; ++t)
    if (slots[t] < 0 || slots[t] >= nslots) return 1;
  const int64_t spans = (L + Q - 1) / Q, items = spans * H, first = context - L;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t s = spans - 1 - i / H;
    item(static_cast<const TQ*>(q), static_cast<const TKV*>(kc), static_cast<const TKV*>(vc), slots, first, s * Q,
         int(std::min<int64_t>(Q, L - s * Q)), int(i % H), H, H / KV, KV * head_width<TKV>(D), scale, window,
         sinks ? sinks + i % H : nullptr, static_cast<TQ*>(out));
  }
  return 0;
}

template <typename TQ, typename TKV>
static int float_items(int D, const void* q, const void* kc, const void* vc, const int64_t* slots, int64_t L,
                       int64_t context, int H, int KV, int64_t nslots, float scale, int64_t window,
                       const float* sinks, void* out, int threads) {
  auto go = [&](auto item) {
    return run<f32::Q, TQ, TKV>(item, q, kc, vc, slots, L, context, H, KV, D, nslots, scale, window, sinks, out,
                                threads);
  };
  switch (D) {
    case 32: return go(f32::item<TQ, TKV, 32>);
    case 64: return go(f32::item<TQ, TKV, 64>);
    case 96: return go(f32::item<TQ, TKV, 96>);
    case 128: return go(f32::item<TQ, TKV, 128>);
    case 256: return go(f32::item<TQ, TKV, 256>);
    default: return 2;
  }
}

#if ZHUZI_AVX512
static int bf16_items(int D, const void* q, const void* kc, const void* vc, const int64_t* slots, int64_t L,
                      int64_t context, int H, int KV, int64_t nslots, float scale, int64_t window,
                      const float* sinks, void* out, int threads) {
  auto go = [&](auto item) {
    return run<bf16::Q, uint16_t, uint16_t>(item, q, kc, vc, slots, L, context, H, KV, D, nslots, scale, window,
                                            sinks, out, threads);
  };
  switch (D) {
    case 32: return go(bf16::item<32>);
    case 64: return go(bf16::item<64>);
    case 96: return go(bf16::item<96>);
    case 128: return go(bf16::item<128>);
    default: return 2;
  }
}
#else
static constexpr auto bf16_items = float_items<uint16_t, uint16_t>;
#endif

extern "C" int zhuzi_prefill_attention(int q_bf16, int kv_type, const void* q, const void* kc, const void* vc,
                                       const int64_t* slots, int64_t L, int64_t context, int H, int KV, int D,
                                       int64_t nslots, float scale, int64_t window, const float* sinks, void* out,
                                       int threads) {
  if (KV < 1 || H % KV || L < 1 || L > context) return 2;
  const auto args =
      std::make_tuple(D, q, kc, vc, slots, L, context, H, KV, nslots, scale, window, sinks, out, threads);
  if (kv_type == KV_BF16) return std::apply(q_bf16 ? bf16_items : float_items<float, uint16_t>, args);
  if (kv_type == KV_Q8_0)
    return std::apply(q_bf16 ? float_items<uint16_t, uint8_t> : float_items<float, uint8_t>, args);
  return 2;  // float32 pools: the reference path, each query through the decode kernel
}
