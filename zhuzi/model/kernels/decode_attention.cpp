// Paged decode attention over the KV pool; see cpu_attention.py for the design.
#include "attention.h"

template <typename T, int NV>
static int run(const void* q, const void* kc, const void* vc, const int64_t* slots, const int64_t* lens,
               void* out, int64_t B, int64_t W, int H, int KV, int64_t nslots, float scale, int threads) {
  const int64_t stride = int64_t(H) * NV * 16;
  int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t b = 0; b < B; ++b) {
    if (lens[b] < 1 || lens[b] > W) { bad = 1; continue; }
    attend<T, NV>(static_cast<const T*>(q) + b * stride, static_cast<const T*>(kc), static_cast<const T*>(vc),
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
  switch (D) {  // bf16 rows are read 32 values at a time: D must be a multiple of 32
    case 32: return go(run<float, 2>, run<uint16_t, 2>);
    case 64: return go(run<float, 4>, run<uint16_t, 4>);
    case 96: return go(run<float, 6>, run<uint16_t, 6>);
    case 128: return go(run<float, 8>, run<uint16_t, 8>);
    case 256: return go(run<float, 16>, run<uint16_t, 16>);
    default: return 2;
  }
}
