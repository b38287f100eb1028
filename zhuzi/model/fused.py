"""The fused decode step (model runner -> model, for steps that are all decodes): every layer, the final norm
and the LM head of up to 8 decode rows in one native call (kernels/decode_step.cpp), which leaves little
beside the weight reads. Its residual stream stays float32 for the whole step, so in bf16 its tokens can
differ from the per-layer path's (it is the closer of the two to float32); a row's logits never depend on the
other rows. Its layers may differ from each other as Gemma 3's, Gemma 4's and gpt-oss's do (window, RoPE table,
norms, activation, attention scale, head size, the K/V it attends: each a field of the layer's struct); it refuses a
model with a feature it lacks (refusal)."""
from __future__ import annotations

import ctypes

import torch

from zhuzi.model import native
from zhuzi.model.blocks import BlockWeight
from zhuzi.model.families import family
from zhuzi.model.kv_format import Q8_0
from zhuzi.model.linear import BlockLinear, Linear
from zhuzi.model.model_config import Mlp, ModelConfig

MAX_ROWS = 8
_DENSE, _BLOCKS = range(2)  # kernels/decode_step.h's Kind
_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # its Activation
HEAD_DIMS = (32, 64, 96, 128, 256)  # the head sizes its attention has code for (decode_step.cpp's serves())


class _Mat(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("qkv", _Mat), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("o", _Mat), ("attn_out_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("gate_up", _Mat), ("down", _Mat), ("mlp_out_norm", ctypes.c_void_p),
                ("input_gate", _Mat), ("input_proj", _Mat), ("input_out_norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("sinks", ctypes.c_void_p),
                ("norm_offset", ctypes.c_float), ("scale", ctypes.c_float), ("output_scale", ctypes.c_float),
                ("head_dim", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("ffn", ctypes.c_int64),
                ("rotary_dim", ctypes.c_int64), ("window", ctypes.c_int64), ("pool", ctypes.c_int64),
                ("entry", ctypes.c_int64), ("writes", ctypes.c_int32), ("values_are_keys", ctypes.c_int32),
                ("value_norm", ctypes.c_int32), ("activation", ctypes.c_int32)]


class _Table(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_void_p), ("type", ctypes.c_int32), ("row_bytes", ctypes.c_int64),
                ("width", ctypes.c_int64), ("scale", ctypes.c_float)]


class _Args(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_void_p), ("num_layers", ctypes.c_int64), ("norm", ctypes.c_void_p),
                ("lm_head", _Mat), ("heads", ctypes.c_int64), ("hidden", ctypes.c_int64), ("eps", ctypes.c_float),
                ("norm_offset", ctypes.c_float), ("softcap", ctypes.c_float), ("embed", _Table),
                ("per_layer", _Table), ("per_layer_projection", _Mat), ("per_layer_norm", ctypes.c_void_p),
                ("per_layer_projection_scale", ctypes.c_float), ("per_layer_width", ctypes.c_int64),
                ("ids", ctypes.c_void_p), ("positions", ctypes.c_void_p), ("pools", ctypes.c_void_p),
                ("num_slots", ctypes.c_int64), ("slots", ctypes.c_void_p), ("lens", ctypes.c_void_p),
                ("width", ctypes.c_int64), ("logits", ctypes.c_void_p), ("threads", ctypes.c_int32),
                ("rope_interleaved", ctypes.c_int32), ("kv_q8", ctypes.c_int32), ("barrier_s", ctypes.c_void_p)]


def _kernel():
    return native.entry("decode_step", "zhuzi_decode_step", [ctypes.c_void_p, ctypes.c_int64])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _mat(layer: Linear | None, keep: list[torch.Tensor]) -> _Mat:
    """The kernel's view of a matrix (its bias as float32, kept alive in keep; None: an empty one); ValueError for
    a kind it does not serve."""
    if layer is None:
        return _Mat()
    bias = None
    if layer.bias is not None:
        keep.append(layer.bias.float().contiguous())
        bias = keep[-1].data_ptr()
    if isinstance(layer, BlockLinear):  # a row group must not straddle two parts
        if any(p.shape[0] % 16 for p in layer.parts[:-1]):
            raise ValueError("the fused decode step takes GGUF parts of whole 16-row groups (bar the last)")
        return _Mat(_BLOCKS, ctypes.addressof(layer.table), bias, layer.out_features, layer.parts[0].shape[1])
    w = layer.weight
    if w.dtype != torch.bfloat16:
        raise ValueError(f"the fused decode step takes bf16 weights, not {w.dtype}")
    return _Mat(_DENSE, w.data_ptr(), bias, *w.shape)


def _table(table: torch.Tensor | BlockWeight, width: int, scale: float) -> _Table:
    """The kernel's view of an embedding table whose rows hold width values."""
    if isinstance(table, BlockWeight):
        return _Table(table.data.data_ptr(), int(table.qtype), table.data.stride(0), width, scale)
    return _Table(table.data_ptr(), 0, table.stride(0) * table.element_size(), width, scale)


def _rounded(x: float, dtype: torch.dtype) -> float:
    """A scale rounded to the activations' dtype, as the per-layer path (and transformers) takes it."""
    return torch.tensor(x, dtype=dtype).item()


class FusedDecode:
    """One decode step of a Decoder in one call; build() returns None where the kernel cannot serve it."""

    def __init__(self, decoder, fn):
        self.barrier_s: torch.Tensor | None = None  # time_barriers()
        self.steps = 0
        c = decoder.config
        self.fn, self.decoder = fn, decoder  # the decoder owns every tensor the structs point at, but the biases
        self.biases: list[torch.Tensor] = []
        self.tables = [(r.cos.contiguous(), r.sin.contiguous()) for r in decoder.rotaries]  # kept alive here
        self.layers = (_Layer * c.num_layers)(*[self._layer(i, layer) for i, layer in enumerate(decoder.layers)])
        self.pools = None  # the KV pool's tensors of the last call
        per_layer, width = decoder.per_layer_inputs, c.per_layer_input_size
        self.args = _Args(ctypes.addressof(self.layers), c.num_layers, _ptr(decoder.norm),
                          _mat(decoder.lm_head, self.biases), c.num_heads, c.hidden_size, c.rms_norm_eps,
                          c.norm_weight_offset or 0.0, c.final_logit_softcapping or 0.0,
                          _table(decoder.embed, c.hidden_size, _rounded(c.embedding_scale, decoder.dtype)),
                          rope_interleaved=c.rope_interleaved)
        if per_layer is not None:
            a = self.args
            a.per_layer = _table(per_layer.embed, c.num_layers * width, _rounded(width ** 0.5, decoder.dtype))
            a.per_layer_projection, a.per_layer_norm = _mat(per_layer.projection, self.biases), _ptr(per_layer.norm)
            a.per_layer_projection_scale, a.per_layer_width = c.hidden_size ** -0.5, width
        self.vocab = decoder.lm_head.out_features if isinstance(decoder.lm_head, BlockLinear) \
            else decoder.lm_head.weight.shape[0]

    def _layer(self, i: int, layer) -> _Layer:
        """The kernel's view of decoder layer i (refusal() has checked that it computes it)."""
        spec, decoder = layer.spec, self.decoder
        qkv, o, gate_up, down, gate, proj = (_mat(getattr(layer, part), self.biases) for part in
                                             ("qkv", "o", "gate_up", "down", "input_gate", "input_proj"))
        cos, sin = self.tables[layer.rope]
        pool, entry = decoder.kv_shape.entries[i]
        scalar = 1.0 if layer.scalar is None else layer.scalar.float().item()
        return _Layer(_ptr(layer.input_norm), qkv, _ptr(layer.q_norm), _ptr(layer.k_norm), o,
                      _ptr(layer.attn_out_norm), _ptr(layer.post_norm), gate_up, down, _ptr(layer.mlp_out_norm),
                      gate, proj, _ptr(layer.input_norm_after), _ptr(cos), _ptr(sin), _ptr(layer.sinks),
                      spec.norm_offset or 0.0, spec.query_scalar ** -0.5, scalar, spec.head_dim, spec.kv_heads,
                      gate_up.n // 2, decoder.rotaries[layer.rope].dim, spec.window or 0, pool, entry,
                      spec.kv_source is None, spec.values_are_keys, spec.value_norm, _ACTIVATIONS[spec.activation])

    @staticmethod
    def refusal(config: ModelConfig) -> str | None:
        """The first feature of the model the kernel lacks, or None. It computes, per layer: attention over the
        whole context or a sliding window, with its own head size and KV heads, an optional QKV and O bias, q/k
        norms, V normed or K's projection, attention sinks, its K/V or an earlier layer's; RoPE over a head or its
        first dims (a table per layer); a query scale of its own; RMSNorms of w or (offset + w) before attention
        and the MLP and optionally on their outputs (sandwich norms); a dense SiLU or GELU(tanh) MLP; a per-layer
        input and an output scale (Gemma 4). Around them: scaled embeddings and soft-capped logits."""
        specs = family(config.architecture).layers(config)
        lacks = {
            "a recurrent mixer": any(not s.mixer.keeps_kv for s in specs),
            "a gated attention output": any(s.output_gate for s in specs),
            "experts": any(s.mlp is not Mlp.DENSE for s in specs),
            "an MLP activation other than SiLU or GELU(tanh)": any(s.activation not in _ACTIVATIONS for s in specs),
            "attention without RoPE": any(s.rope is None for s in specs),
            "scaled residuals or logits": config.residual_scale != 1.0 or config.logit_scale != 1.0,
            f"heads of a size other than {', '.join(map(str, HEAD_DIMS))}": any(s.head_dim not in HEAD_DIMS
                                                                             for s in specs),
        }
        return next((feature for feature, present in lacks.items() if present), None)

    def time_barriers(self) -> None:
        """From now on, add each thread's seconds of waiting at the step's barriers to barrier_s[thread], and
        count the steps in steps (from zero)."""
        self.barrier_s, self.steps = torch.zeros(torch.get_num_threads(), dtype=torch.float64), 0
        self.args.barrier_s = self.barrier_s.data_ptr()

    @property
    def barrier_wait_per_step(self) -> float:
        """Mean seconds a thread waited at barriers a step, since time_barriers()."""
        return float(self.barrier_s.mean()) / max(1, self.steps)

    @classmethod
    def build(cls, decoder) -> FusedDecode | None:
        if cls.refusal(decoder.config):
            return None
        per_layer = decoder.per_layer_inputs
        tensors = [decoder.norm] + [t for layer in decoder.layers for t in
                                    (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                                     layer.attn_out_norm, layer.mlp_out_norm, layer.input_norm_after) if t is not None]
        tensors += [t for t in (decoder.embed, per_layer and per_layer.embed, per_layer and per_layer.norm)
                    if isinstance(t, torch.Tensor)]
        if not all(t.is_cpu and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors):
            return None
        fn = _kernel()
        try:
            return cls(decoder, fn) if fn is not None else None
        except ValueError:
            return None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, pools: list[torch.Tensor]) -> torch.Tensor | None:
        """Logits [M, vocab] float32 of M <= 8 decode rows; row m attends its first lengths[m] slots, the
        last of which receives its new K/V; pools: the KV pool's tensors (KVPool.tensors). None when the kernel
        does not serve the call."""
        m, dtype = input_ids.shape[0], pools[0].dtype
        if not (1 <= m <= MAX_ROWS and dtype in (torch.bfloat16, Q8_0)
                and all(t.dtype == dtype and t.is_contiguous() for t in pools)):
            return None
        ids, positions = input_ids.contiguous(), positions.contiguous()
        slots, lengths = slots.contiguous(), lengths.contiguous()
        logits = torch.empty(m, self.vocab, dtype=torch.float32)
        a = self.args
        a.ids, a.positions, a.slots, a.lens, a.width = (ids.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                                                        lengths.data_ptr(), slots.shape[1])
        self.pools = (ctypes.c_void_p * len(pools))(*[t.data_ptr() for t in pools])
        a.pools, a.num_slots, a.logits, a.threads = ctypes.addressof(self.pools), pools[0].shape[2], \
            logits.data_ptr(), torch.get_num_threads()
        a.kv_q8 = dtype == Q8_0
        if self.barrier_s is not None and a.threads > len(self.barrier_s):
            raise RuntimeError(f"fused decode step: barriers timed for {len(self.barrier_s)} threads, not "
                               f"{a.threads}")
        status = self.fn(ctypes.addressof(a), m)
        self.steps += status == 0
        if status == 1:
            raise IndexError("fused decode step: a length is outside 1..W or a slot is outside the pool")
        return logits if status == 0 else None
