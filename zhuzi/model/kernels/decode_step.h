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

// Rows looked up by token id (an embedding): bf16 values, or GGUF blocks; each row times scale.
struct Table {
  const void* rows;
  int32_t type;          // 0: bf16; else a GGUF block type
  int64_t row_bytes;
  int64_t width;         // values a row
  float scale;
};

// One decoder layer; a layer's fields may differ from the next one's (Gemma 3's local and global layers, Gemma 4's
// head sizes, gpt-oss's windows).
struct Layer {
  const uint16_t* input_norm;
  Mat qkv;                 // q rows of every head, then (where the layer writes K/V) k rows, then v rows (but
                           // where values_are_keys)
  const uint16_t* q_norm;  // [head_dim] (Qwen3), or null
  const uint16_t* k_norm;
  Mat o;
  const uint16_t* attn_out_norm;  // sandwich norms: on attention's output before the residual add, or null
  const uint16_t* post_norm;
  Mat gate_up;  // gate rows, then up rows
  Mat down;
  const uint16_t* mlp_out_norm;   // sandwich norms: on the MLP's output, or null
  Mat input_gate, input_proj;     // the per-layer input (Args::per_layer): gate [width, hidden], projection back
  const uint16_t* input_out_norm; // on the projection's output
  const float* cos;               // the layer's RoPE table [positions, rotary_dim / 2]
  const float* sin;
  const float* sinks;             // [heads]: a logit per query head in its softmax's denominator, or null
  float norm_offset;              // every norm of the layer scales by (norm_offset + w): 0, or 1 (Gemma 3)
  float scale;                    // attention scale
  float output_scale;             // the residual stream is multiplied by it at the layer's end (Gemma 4), or 1
  int64_t head_dim, kv_heads, ffn;
  int64_t rotary_dim;             // the first dims of a head that RoPE turns
  int64_t window;                 // a sliding window's tokens (its own included), or 0: the whole context
  int64_t pool, entry;            // its K/V: entry `entry` of Args::pools[pool]
  int32_t writes;                 // 1: it writes its new K/V there; 0: an earlier layer of this step has
  int32_t values_are_keys;        // V is k's projection (before k's norm and RoPE)
  int32_t value_norm;             // V RMS-normed without a weight
  int32_t activation;
};

struct Args {
  const Layer* layers;
  int64_t num_layers;
  const uint16_t* norm;
  Mat lm_head;
  int64_t heads, hidden;
  float eps;                  // RMSNorm epsilon
  float norm_offset;          // the final norm (and the per-layer projection's) scales by (norm_offset + w)
  float softcap;              // logits -> tanh(logits / softcap) * softcap, or 0: none
  Table embed;                // [vocab, hidden], times the embedding scale (Gemma: sqrt(hidden))
  // Per-layer inputs (Gemma 4), per_layer_width 0: none. Layer l's is (norm(projection(h)[l] * projection_scale)
  // + per_layer[id][l]) / sqrt(2), h the scaled embedding; the layer mixes it into its output (Layer::input_gate).
  Table per_layer;            // [vocab, layers * per_layer_width]
  Mat per_layer_projection;   // [layers * per_layer_width, hidden]
  const uint16_t* per_layer_norm;
  float per_layer_projection_scale;
  int64_t per_layer_width;
  const int64_t* ids;         // [M]
  const int64_t* positions;   // [M]
  void* const* pools;         // per KV shape: [its layers, 2, slots, kv_heads, head_dim] bf16, or of q8_0 heads
  int64_t num_slots;
  const int64_t* slots;       // [M, width]: the last of row m's lens[m] slots is its new token's
  const int64_t* lens;        // [M]
  int64_t width;
  float* logits;              // [M, lm_head.n]
  int32_t threads;
  int32_t rope_interleaved;   // RoPE on pairs (2i, 2i + 1) (a llama GGUF's Q/K order), not (i, i + D/2)
  int32_t kv_q8;              // the pools hold q8_0 heads (kv_rows.h), not bf16
  double* barrier_s;          // [threads]: each thread's seconds of waiting at the step's barriers are added
                              // to its entry (zhuzi bench decode); null: not timed
};

}  // namespace step
