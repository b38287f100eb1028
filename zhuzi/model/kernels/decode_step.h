// The fused decode step's arguments (decode_step.cpp; fused.py builds the same structs with ctypes): the
// decoder's weights in place and one step's rows.
#pragma once
#include <cstdint>

namespace step {

// DENSE: bf16 rows; BLOCKS: GGUF block matrices (block_prefill.h's Parts)
enum Kind : int32_t { DENSE = 0, BLOCKS = 1 };

struct Mat {
  int32_t kind;
  const void* w;         // bf16 rows [n, k], or Parts whose rows add up to n, each but the last a multiple of 16
  const float* bias;     // [n], or null
  int64_t n, k;
};

struct Layer {
  const uint16_t* input_norm;
  Mat qkv;
  const uint16_t* q_norm;  // [head_dim] (Qwen3), or null
  const uint16_t* k_norm;
  Mat o;
  const uint16_t* post_norm;
  Mat gate_up;  // gate rows, then up rows
  Mat down;
};

struct Args {
  const Layer* layers;
  int64_t num_layers;
  const uint16_t* norm;
  Mat lm_head;
  int64_t heads, kv_heads, head_dim, hidden, ffn;
  float eps, scale;           // RMSNorm epsilon, attention scale
  const uint16_t* embed;      // [vocab, hidden]
  const int64_t* ids;         // [M]
  const int64_t* positions;   // [M]
  const float* cos;           // [positions, head_dim / 2]
  const float* sin;
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
