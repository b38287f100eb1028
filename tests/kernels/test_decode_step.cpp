// decode_step.cpp, the whole fused decode step of a tiny random model (2 layers, grouped heads, QKV bias and
// q/k norms, an LM head that ends in a partial row group), against a float64 forward of the same weights:
// dense bf16, Q8_0 blocks, and Q4_1 blocks with a Q8_0 head (--quantization int8 and int4), and MXFP4 blocks
// with a Q8_0 head (gpt-oss's experts: a lookup-table type); and in dense bf16, Gemma 3's layers (sandwich norms
// of (1 + w), a GELU MLP, a query scale, a global layer's RoPE base, then a local layer's, whose window is
// shorter than two rows' histories), scaled embeddings and soft-capped logits; gpt-oss's (attention sinks, an O
// bias, a local layer's window) with RoPE over half of each head (Phi-3's). The kernel rounds
// matrix inputs (bf16 with AVX-512, q8 blocks for GGUF blocks) and the new K/V: its logits stay within 3 % of
// the largest (float32 math over bf16 weights, off AVX-512: 0.1 %). Each row's logits are the same bits alone
// or in a batch, on one thread or split by query heads over two, and the step writes only the new tokens' K/V.
#include "block_prefill.h"
#include "check.h"
#include "decode_step.h"
#include "pack.h"
#include "prelude.h"

namespace {

constexpr int64_t L = 2, E = 64, H = 2, KV = 1, D = 32, F = 96, V = 40, SLOTS = 64, POSITIONS = 64;
constexpr float EPS = 1e-5f;

// What a layer is: its norms' offset, sandwich norms, MLP activation, window, RoPE base, attention scale, the dims
// RoPE turns, attention sinks and an O bias.
struct Shape {
  float offset;
  bool sandwich;
  int32_t activation;
  int64_t window;
  double base, scale;
  int64_t rotary_dim = D;
  bool sinks = false;
};
// A model's layers, and what it does around them.
struct Family {
  const char* name;
  Shape layers[L];
  float embed_scale, softcap;
};
const Shape LLAMA_LAYER = {0, false, step::SILU, 0, 1e4, 1 / std::sqrt(double(D))};
const Family LLAMA = {"llama", {LLAMA_LAYER, LLAMA_LAYER}, 1, 0};
const Family GEMMA3 = {"gemma3", {{1, true, step::GELU_TANH, 0, 1e6, 0.1}, {1, true, step::GELU_TANH, 5, 1e4, 0.1}}, 2, 10};
const Family GPT_OSS = {"gpt-oss", {{0, false, step::SILU, 5, 1e4, 0.2, D / 2, true},
                                    {0, false, step::SILU, 0, 1e4, 0.2, D / 2, true}}, 1, 0};

struct Matrix {
  int64_t n, k;
  std::vector<double> w;  // [n, k]: the weights the kernel's storage stands for
  std::vector<uint16_t> bf16;
  std::vector<float> bias;
  pack::Rows blocks;
  std::vector<block_prefill::Part> parts;  // gate and up (parts > 1): a part each, as a GGUF's
  step::Mat mat{};

  // kind: DENSE, or a GGUF block type (Q4_1, Q8_0, MXFP4) for BLOCKS in `count` parts of equal rows.
  Matrix(int64_t rows, int64_t cols, int kind, bool with_bias, check::Rng& g, int count = 1)
      : n(rows), k(cols), w(rows * cols) {
    std::vector<float> f(n * k);
    for (float& x : f) x = float(g.normal() / std::sqrt(double(k)));
    if (with_bias)
      for (int64_t i = 0; i < n; ++i) bias.push_back(float(g.normal()) * 0.1f);
    const float* b = bias.empty() ? nullptr : bias.data();
    if (kind == step::DENSE) {
      for (int64_t i = 0; i < n * k; ++i) bf16.push_back(check::bf16(f[i])), w[i] = check::from_bf16(bf16[i]);
      mat = {step::DENSE, bf16.data(), b, n, k};
      return;
    }
    blocks = pack::quantize(kind, f, n, k);
    w = blocks.w;
    const int64_t part_rows = n / count, row_bytes = int64_t(blocks.bytes.size()) / n;
    for (int i = 0; i < count; ++i)
      parts.push_back({kind, blocks.bytes.data() + i * part_rows * row_bytes, part_rows, row_bytes});
    mat = {step::BLOCKS, parts.data(), b, n, k};
  }
  std::vector<double> apply(const std::vector<double>& x) const {
    std::vector<double> y(n);
    for (int64_t r = 0; r < n; ++r) {
      double s = bias.empty() ? 0 : bias[r];
      for (int64_t c = 0; c < k; ++c) s += w[r * k + c] * x[c];
      y[r] = s;
    }
    return y;
  }
};

std::vector<uint16_t> bf16_vector(int64_t n, double mean, check::Rng& g) {
  std::vector<uint16_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(check::bf16(float(mean + 0.2 * g.normal())));
  return v;
}

// RMSNorm of x[at, at + n) (n = 0: all of x) with weight (w_offset + w).
void rms_norm(std::vector<double>& x, const uint16_t* w, double w_offset, size_t at = 0, size_t n = 0) {
  n = n ? n : x.size();
  double ss = 0;
  for (size_t i = 0; i < n; ++i) ss += x[at + i] * x[at + i];
  const double r = 1 / std::sqrt(ss / double(n) + EPS);
  for (size_t i = 0; i < n; ++i) x[at + i] *= r * (w_offset + check::from_bf16(w[i]));
}

struct Model {
  std::vector<Matrix> mats;  // per layer: qkv, o, gate_up, down; then the LM head
  std::vector<std::vector<uint16_t>> norms;  // per layer: input, post, q, k, attention out, MLP out; then the final
  std::vector<uint16_t> embed;
  std::vector<float> cos[L], sin[L], sinks[L];
  std::vector<step::Layer> layers;

  const Family& family;

  Model(int layer_kind, int head_kind, const Family& f, check::Rng& g) : embed(bf16_vector(V * E, 0, g)), family(f) {
    for (int64_t l = 0; l < L; ++l) {
      mats.emplace_back((H + 2 * KV) * D, E, layer_kind, true, g);
      const Shape& shape = family.layers[l];
      mats.emplace_back(E, H * D, layer_kind, shape.sinks, g);  // gpt-oss's O bias beside its sinks
      mats.emplace_back(2 * F, E, layer_kind, false, g, 2);
      mats.emplace_back(E, F, layer_kind, false, g);
      for (int64_t size : {E, E, D, D, E, E}) norms.push_back(bf16_vector(size, 1 - shape.offset, g));
      const int64_t R = shape.rotary_dim;
      for (int64_t p = 0; p < POSITIONS; ++p)
        for (int64_t i = 0; i < R / 2; ++i) {
          const double angle = p * std::pow(shape.base, -2.0 * double(i) / double(R));
          cos[l].push_back(float(std::cos(angle))), sin[l].push_back(float(std::sin(angle)));
        }
      for (int64_t h = 0; h < H && shape.sinks; ++h) sinks[l].push_back(float(g.normal()));
    }
    mats.emplace_back(V, E, head_kind, false, g);
    norms.push_back(bf16_vector(E, 1, g));
    for (int64_t l = 0; l < L; ++l) {
      const auto* n = &norms[6 * l];
      const Shape& shape = family.layers[l];
      step::Layer x{};
      x.input_norm = n[0].data(), x.qkv = mats[4 * l].mat, x.q_norm = n[2].data(), x.k_norm = n[3].data();
      x.o = mats[4 * l + 1].mat, x.attn_out_norm = shape.sandwich ? n[4].data() : nullptr, x.post_norm = n[1].data();
      x.gate_up = mats[4 * l + 2].mat, x.down = mats[4 * l + 3].mat;
      x.mlp_out_norm = shape.sandwich ? n[5].data() : nullptr, x.cos = cos[l].data(), x.sin = sin[l].data();
      x.sinks = shape.sinks ? sinks[l].data() : nullptr, x.norm_offset = shape.offset, x.scale = float(shape.scale);
      x.output_scale = 1, x.head_dim = D, x.kv_heads = KV, x.ffn = F, x.rotary_dim = shape.rotary_dim;
      x.window = shape.window, x.pool = 0, x.entry = l, x.writes = 1, x.activation = shape.activation;
      layers.push_back(x);
    }
  }

  // One row's logits: token id at position pos, attending the pool rows `rows` (the last is its own).
  std::vector<double> forward(int64_t id, int64_t pos, const std::vector<int64_t>& rows,
                              const std::vector<uint16_t>& kv) const {
    std::vector<double> h(E);
    for (int64_t i = 0; i < E; ++i) h[i] = family.embed_scale * check::from_bf16(embed[id * E + i]);
    for (int64_t l = 0; l < L; ++l) {
      const Shape& shape = family.layers[l];
      const auto* n = &norms[6 * l];
      std::vector<double> x = h;
      rms_norm(x, n[0].data(), shape.offset);
      std::vector<double> qkv = mats[4 * l].apply(x);
      for (int64_t j = 0; j < H + KV; ++j) {  // q/k norms and RoPE per head; the new K/V rounded as stored
        rms_norm(qkv, n[j < H ? 2 : 3].data(), shape.offset, j * D, D);
        const int64_t R = shape.rotary_dim;
        for (int64_t i = 0; i < R / 2; ++i) {
          const double a = qkv[j * D + i], b = qkv[j * D + i + R / 2], c = cos[l][pos * R / 2 + i],
                       s = sin[l][pos * R / 2 + i];
          qkv[j * D + i] = a * c - b * s, qkv[j * D + i + R / 2] = b * c + a * s;
        }
      }
      for (int64_t i = H * D; i < (H + 2 * KV) * D; ++i) qkv[i] = check::from_bf16(check::bf16(float(qkv[i])));
      std::vector<double> attn(H * D);
      for (int64_t hh = 0; hh < H; ++hh) {
        std::vector<double> s;
        double top = -INFINITY, sum = 0;
        auto key = [&](size_t t, int64_t d, int which) {  // the new row's from qkv, the rest from the pool
          if (t + 1 == rows.size()) return qkv[(H + which * KV + hh * KV / H) * D + d];
          return double(check::from_bf16(kv[(((l * 2 + which) * SLOTS + rows[t]) * KV + hh * KV / H) * D + d]));
        };
        const size_t first = shape.window ? std::max<int64_t>(0, int64_t(rows.size()) - shape.window) : 0;
        for (size_t t = first; t < rows.size(); ++t) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qkv[hh * D + d] * key(t, d, 0);
          s.push_back(dot * shape.scale), top = std::fmax(top, s.back());
        }
        for (double& v : s) v = std::exp(v - top), sum += v;
        if (shape.sinks) sum += std::exp(sinks[l][hh] - top);  // a sink's share of the attention goes nowhere
        for (size_t t = first; t < rows.size(); ++t)
          for (int64_t d = 0; d < D; ++d) attn[hh * D + d] += s[t - first] / sum * key(t, d, 1);
      }
      std::vector<double> o = mats[4 * l + 1].apply(attn);
      if (shape.sandwich) rms_norm(o, n[4].data(), shape.offset);
      for (int64_t i = 0; i < E; ++i) h[i] += o[i];
      x = h;
      rms_norm(x, n[1].data(), shape.offset);
      const std::vector<double> gu = mats[4 * l + 2].apply(x);
      std::vector<double> act(F);
      for (int64_t i = 0; i < F; ++i) {
        const double g = gu[i];
        act[i] = (shape.activation == step::GELU_TANH
                      ? 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g)))
                      : g / (1 + std::exp(-g))) * gu[F + i];
      }
      std::vector<double> down = mats[4 * l + 3].apply(act);
      if (shape.sandwich) rms_norm(down, n[5].data(), shape.offset);
      for (int64_t i = 0; i < E; ++i) h[i] += down[i];
    }
    rms_norm(h, norms.back().data(), 0);
    std::vector<double> logits = mats.back().apply(h);
    if (family.softcap)
      for (double& z : logits) z = std::tanh(z / family.softcap) * family.softcap;
    return logits;
  }
};

struct Step {
  std::vector<int64_t> ids, positions, slots, lens;
  int64_t width;
};

int run(const Model& m, const Step& s, int64_t first, int64_t M, std::vector<uint16_t>& kv, float* logits,
        int threads) {
  void* pools[] = {kv.data()};
  step::Args a{};
  a.layers = m.layers.data(), a.num_layers = L, a.norm = m.norms.back().data(), a.lm_head = m.mats.back().mat;
  a.heads = H, a.hidden = E, a.eps = EPS, a.softcap = m.family.softcap;
  a.embed = {m.embed.data(), 0, E * 2, E, m.family.embed_scale};
  a.ids = s.ids.data() + first, a.positions = s.positions.data() + first, a.pools = pools, a.num_slots = SLOTS;
  a.slots = s.slots.data() + first * s.width, a.lens = s.lens.data() + first, a.width = s.width, a.logits = logits;
  a.threads = threads;
  return zhuzi_decode_step(&a, M);
}

}  // namespace

TEST(decode_step_matches_a_float64_forward) {
  struct Case {
    int layer_kind, head_kind;
    const Family& family;
  };
  for (const auto& [layer_kind, head_kind, family] :
       {Case{step::DENSE, step::DENSE, LLAMA}, {blocks::Q8_0, blocks::Q8_0, LLAMA}, {blocks::Q4_1, blocks::Q8_0, LLAMA},
        {blocks::MXFP4, blocks::Q8_0, LLAMA}, {step::DENSE, step::DENSE, GEMMA3},
        {step::DENSE, step::DENSE, GPT_OSS}}) {
    check::Rng g(layer_kind + 1);
    const Model model(layer_kind, head_kind, family, g);
    std::vector<uint16_t> kv = bf16_vector(L * 2 * SLOTS * KV * D, 0, g);
    // three rows: histories of 1, 9 and 21 positions at scattered slots of their own, the new token's last
    Step s{{3, 17, 39}, {0, 8, 20}, {}, {1, 9, 21}, 21};
    for (int64_t m = 0; m < 3; ++m)
      for (int64_t t = 0; t < s.width; ++t) s.slots.push_back(t < s.lens[m] ? (m * 21 + t) * 5 % SLOTS : 0);
    const std::vector<uint16_t> before = kv;
    std::vector<float> logits(3 * V);
    CHECK(run(model, s, 0, 3, kv, logits.data(), 2) == 0, "status");
    for (int64_t m = 0; m < 3; ++m) {
      const std::vector<int64_t> rows(s.slots.begin() + m * s.width, s.slots.begin() + m * s.width + s.lens[m]);
      const std::vector<double> want = model.forward(s.ids[m], s.positions[m], rows, before);
      double top = 0, worst = 0;
      for (int64_t i = 0; i < V; ++i) top = std::fmax(top, std::fabs(want[i]));
      for (int64_t i = 0; i < V; ++i) worst = std::fmax(worst, std::fabs(logits[m * V + i] - want[i]));
#if ZHUZI_AVX512
      const double bound = 0.03;
#else
      const double bound = layer_kind == step::DENSE ? 1e-3 : 0.03;
#endif
      CHECK(worst <= bound * top, "%s kinds %d/%d row %ld: logits off by %g of %g", family.name, layer_kind,
            head_kind, (long)m, worst, top);
    }
    int changed = 0;  // only the new tokens' K and V: 2 per layer and row
    for (size_t i = 0; i < kv.size(); i += D) changed += std::memcmp(&kv[i], &before[i], D * 2) != 0;
    CHECK(changed == 2 * L * 3, "%s kinds %d/%d: %d pool rows changed", family.name, layer_kind, head_kind,
          changed);
    // each row alone: on one thread, and on two, which split its kv head's two query heads: the same bits
    for (int64_t m = 0; m < 3; ++m)
      for (int threads : {1, 2}) {
        std::vector<uint16_t> alone_kv = before;
        float alone[V];
        run(model, s, m, 1, alone_kv, alone, threads);
        CHECK(!std::memcmp(alone, &logits[m * V], sizeof alone), "%s kinds %d/%d row %ld alone on %d threads",
              family.name, layer_kind, head_kind, (long)m, threads);
      }
  }
}

TEST(decode_step_rejects_a_slot_outside_the_pool) {
  check::Rng g(5);
  const Model model(step::DENSE, step::DENSE, LLAMA, g);
  std::vector<uint16_t> kv = bf16_vector(L * 2 * SLOTS * KV * D, 0, g);
  const Step s{{1}, {1}, {0, SLOTS}, {2}, 2};
  float logits[V];
  CHECK(run(model, s, 0, 1, kv, logits, 1) == 1, "took slot %ld of %ld", (long)SLOTS, (long)SLOTS);
}
