// The fused decode step's arguments (decode_step.cpp; fused.py builds the same structs with ctypes): the
// decoder's weights in place and one step's rows.
#pragma once
#include <cstdint>

namespace step {

// DENSE: bf16 rows; BLOCKS: GGUF block matrices (block_prefill.h's Parts)
enum Kind : int32_t { DENSE = 0, BLOCKS = 1 };
// The MLP's gate: SiLU(gate) * up, or GELU(gate) * up with GELU's tanh approximation (Gemma)
enum Activation : int32_t { SILU = 0, GELU_TANH = 1 };

struct Mat {
  int32_t kind;
  const void* w;         // bf16 rows [n, k], or Parts whose rows add up to n, each but the last a multiple of 16
  const float* bias;     // [n], or null
  int64_t n, k;
};

// One decoder layer; a layer's fields may differ from the next one's (Gemma 3's local and global layers).
struct Layer {
  const uint16_t* input_norm;
  Mat qkv;
  const uint16_t* q_norm;  // [head_dim] (Qwen3), or null
  const uint16_t* k_norm;
  Mat o;
  const uint16_t* attn_out_norm;  // sandwich norms: on attention's output before the residual add, or null
  const uint16_t* post_norm;
  Mat gate_up;  // gate rows, then up rows
  Mat down;
  const uint16_t* mlp_out_norm;   // sandwich norms: on the MLP's output, or null
  const float* cos;               // the layer's RoPE table [positions, head_dim / 2]
  const float* sin;
  float norm_offset;              // every norm of the layer scales by (norm_offset + w): 0, or 1 (Gemma)
  float scale;                    // attention scale
  int64_t window;                 // a sliding window's tokens (its own included), or 0: the whole context
  int32_t activation;
};

struct Args {
  const Layer* layers;
  int64_t num_layers;
  const uint16_t* norm;
  Mat lm_head;
  int64_t heads, kv_heads, head_dim, hidden, ffn;
  float eps;                  // RMSNorm epsilon
  float norm_offset;          // the final norm scales by (norm_offset + w)
  float embed_scale;          // embedding rows are multiplied by it (Gemma: sqrt(hidden))
  float softcap;              // logits -> tanh(logits / softcap) * softcap, or 0: none
  const uint16_t* embed;      // [vocab, hidden]
  const int64_t* ids;         // [M]
  const int64_t* positions;   // [M]
  void* kv;                   // [layers, 2, slots, kv_heads, head_dim] bf16, or of q8_0 heads (kv_q8)
  int64_t num_slots;
  const int64_t* slots;       // [M, width]: the last of row m's lens[m] slots is its new token's
  const int64_t* lens;        // [M]
  int64_t width;
  float* logits;              // [M, lm_head.n]
  int32_t threads;
  int32_t embed_type;         // 0: embed is bf16; else a GGUF block type, rows of embed_row_bytes
  int64_t embed_row_bytes;
  int32_t rope_interleaved;   // RoPE on pairs (2i, 2i + 1) (a llama GGUF's Q/K order), not (i, i + D/2)
  int32_t kv_q8;              // the pool holds q8_0 heads (kv_rows.h), not bf16
  double* barrier_s;          // [threads]: each thread's seconds of waiting at the step's barriers are added
                              // to its entry (zhuzi bench decode); null: not timed
};

}  // namespace step
