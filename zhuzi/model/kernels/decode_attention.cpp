// Paged decode attention over the KV pool; see cpu_attention.py for the design.
#include "api.h"
#include "attention.h"

template <typename T, int D>
static int run(const void* q, const void* kc, const void* vc, const int64_t* slots, const int64_t* lens,
               void* out, int64_t B, int64_t W, int H, int KV, int64_t nslots, float scale, int threads) {
  const int64_t stride = int64_t(H) * D;
  int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t b = 0; b < B; ++b) {
    if (lens[b] < 1 || lens[b] > W) { bad = 1; continue; }
    attend<T, D>(static_cast<const T*>(q) + b * stride, static_cast<const T*>(kc), static_cast<const T*>(vc),
                  slots + b * W, lens[b], static_cast<T*>(out) + b * stride, 0, H, H, KV, nslots, scale, &bad);
  }
  return bad;
}

// Returns 0 on success, 1 for a length or slot out of range, 2 for shapes it was not built for.
extern "C" int zhuzi_decode_attention(int bf16, const void* q, const void* kc, const void* vc,
    const int64_t* slots, const int64_t* lens, void* out, int64_t B, int64_t W, int H, int KV, int D,
    int64_t nslots, float scale, int threads) {
  if (KV < 1 || H % KV || H > MAXH || H * D > MAXHD) return 2;
  auto go = [&](auto run_f32, auto run_bf16) {
    return (bf16 ? run_bf16 : run_f32)(q, kc, vc, slots, lens, out, B, W, H, KV, nslots, scale, threads); };
  switch (D) {
    case 32: return go(run<float, 32>, run<uint16_t, 32>);
    case 64: return go(run<float, 64>, run<uint16_t, 64>);
    case 96: return go(run<float, 96>, run<uint16_t, 96>);
    case 128: return go(run<float, 128>, run<uint16_t, 128>);
    case 256: return go(run<float, 256>, run<uint16_t, 256>);
    default: return 2;
  }
}
