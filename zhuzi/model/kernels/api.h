// Every kernel entry point, as Python (ctypes) and the C++ tests call it: each source includes this, so a
// definition that drifts from its declaration does not compile. Entry points returning int answer 0 on
// success, 1 for an index out of range, 2 for what this build (variant) does not serve.
#pragma once
#include <cstdint>

// The KV pool's formats (kv_rows.h), as the attention entry points take them.
enum KVType : int { KV_F32 = 0, KV_BF16 = 1, KV_Q8_0 = 2 };

extern "C" {
// small_m_linear.cpp: y[M, N] = x[M, K] w[N, K]^T, M <= 8; weight 0: float32, 1: bf16.
int zhuzi_small_m_linear(int weight, int x_bf16, const void* x, const void* w, void* y, int64_t M, int64_t N,
                         int64_t K, int threads);
// The same for any M, each row by the operations it gets alone (--deterministic).
int zhuzi_fixed_order_linear(int weight, int x_bf16, const void* x, const void* w, void* y, int64_t M, int64_t N,
                             int64_t K, int64_t MB, int threads);
// decode_attention.cpp: one query token per row over its paged history; q and out float32 or bf16 (q_bf16),
// the pools a KVType (bf16 queries take bf16 or q8_0 pools); window > 0: a sliding window's tokens; sinks: H
// float32 logits in each head's softmax denominator (attention sinks), or null.
int zhuzi_decode_attention(int q_bf16, int kv_type, const void* q, const void* kc, const void* vc,
                           const int64_t* slots, const int64_t* lens, void* out, int64_t B, int64_t W, int H, int KV,
                           int D, int64_t nslots, float scale, int64_t window, const float* sinks, int threads);
// prefill_attention.cpp: a prompt chunk's causal attention over its paged history; q and out float32 or
// bf16, pools bf16 or q8_0 (float32 pools are the reference: not served); window and sinks as decode's.
int zhuzi_prefill_attention(int q_bf16, int kv_type, const void* q, const void* kc, const void* vc,
                            const int64_t* slots, int64_t L, int64_t context, int H, int KV, int D, int64_t nslots,
                            float scale, int64_t window, const float* sinks, void* out, int threads);
// dequantize_blocks.cpp: rows ids[i] (all n rows when ids is null) of a GGUF block matrix (type: a GGUF type,
// or packed_layout.h's FLAG | type) -> their exact values, float32 or bf16 [n, K].
int zhuzi_dequantize_rows(int type, const void* src, int64_t rows, int64_t row_bytes, const int64_t* ids, int64_t n,
                          int64_t K, void* out, int out_bf16, int threads);
// The same file: a block matrix [rows, K] (rows a multiple of 16) -> packed_layout.h's layout at out.
int zhuzi_pack_blocks(int type, const void* src, int64_t rows, int64_t row_bytes, int64_t K, void* out, int release,
                      int threads);
// block_linear.cpp: y[M, N] = x[M, K] W^T for W the rows of GGUF block matrices one after another (parts:
// block_prefill.h's Part, of a GGUF type or a packed one); x and y each float32, or bf16 (x_bf16, y_bf16).
int zhuzi_block_linear(const void* parts, int nparts, const void* x, int x_bf16, void* y, int y_bf16, int64_t M,
                       int64_t N, int64_t K, int threads);
// stream.cpp: the fastest of `passes` reads of x[n] (float32), every thread its own slice: seconds, and the
// sum read (0 on success).
int zhuzi_stream_read(const float* x, int64_t n, int passes, int threads, double* seconds, float* sum);
// recurrent.cpp, float32 throughout (cpu_recurrent.py has the layouts). A causal depthwise convolution of width K
// over each of C channels, its state the last K - 1 inputs of every channel [nslots, C, K - 1]; weight [C, K],
// bias [C] or null; silu: SiLU on the outputs. Decode: a token x[B, C] per sequence, row b's state slots[b];
// prefill: x[L, C] of one sequence after its state slot's history, which it leaves holding the last inputs.
int zhuzi_conv_decode(const float* x, float* state, const int64_t* slots, const float* weight, const float* bias,
                      float* out, int64_t B, int64_t C, int K, int64_t nslots, int silu, int threads);
int zhuzi_conv_prefill(const float* x, float* state, int64_t slot, const float* weight, const float* bias, float* out,
                       int64_t L, int64_t C, int K, int64_t nslots, int silu, int threads);
// The gated delta rule over states [nslots, HV, DK, DV]: q, k [T, HK, DK] (value head h reads key head
// h / (HV / HK)), v and out [T, HV, DV], g (log decay) and beta [T, HV]; T = B decode rows (slots[b]) or the L
// tokens of one sequence (slot).
int zhuzi_delta_decode(const float* q, const float* k, const float* v, const float* g, const float* beta,
                       float* state, const int64_t* slots, float* out, int64_t B, int64_t HK, int64_t HV, int64_t DK,
                       int64_t DV, int64_t nslots, int threads);
int zhuzi_delta_prefill(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        float* state, int64_t slot, float* out, int64_t L, int64_t HK, int64_t HV, int64_t DK,
                        int64_t DV, int64_t nslots, int threads);
// decode_step.cpp: a whole decode step of M <= 8 rows (args: step::Args, see fused.py).
int zhuzi_decode_step(const void* args, int64_t M);
}
