"""The forward pass: embedding -> N x (norm, mixer, norm, MLP) -> norm -> LM head. Each layer is built from
its LayerSpec (model_config.py): attention over paged KV (its whole context or a window), a dense or
Mixture-of-Experts MLP, its norms, biases and RoPE. Q/K/V and gate/up are merged into one matmul each. Under
tensor parallelism (a TPRank), the decoder holds this rank's slice of each layer (parallel.py)."""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from zhuzi.model import cpu_attention, cpu_blocks, cpu_linear, native
from zhuzi.model.attention import AttentionMetadata, paged_attention, select
from zhuzi.model.blocks import BlockWeight
from zhuzi.model.families import family
from zhuzi.model.fused import FusedDecode
from zhuzi.model.kv_pool import KVPool, KVShape
from zhuzi.model.layers import Rotary, offset_rms_norm, rms_norm, rms_norm_unscaled
from zhuzi.model.linear import QUANTIZATIONS, BlockLinear, Linear, blocks_serve
from zhuzi.model.model_config import LayerSpec, Mlp, ModelConfig, Rope
from zhuzi.model.moe import GLUS, ClampedSwiGLU, Expert, Glu, MoE, gated_mlp
from zhuzi.model.parallel import Shard, TPRank, head_rows, split
from zhuzi.model.placement import Placement, same_device
from zhuzi.model.quant import FORMATS, Q, quantize
from zhuzi.model.recurrent import MIXERS, RecurrentMixer, ready
from zhuzi.model.smooth import smooth

log = logging.getLogger(__name__)
Weight = torch.Tensor | BlockWeight


def layer_format(requested: str | None, gguf: bool, tensor_parallel: bool, weights: torch.dtype) -> str | None:
    """What the layers run on (EngineConfig.quantization -> Decoder's quantization): as asked ("none":
    dense); by default a GGUF's own blocks, except where they run dense as a Hugging Face checkpoint's do:
    in float32 (the reference: the blocks' exact values, as transformers computes them) and under tensor
    parallelism (a rank's slice of O and down cuts their rows across blocks). Asked for, gguf keeps the
    blocks in float32 too (float32 activations, quantized to int8 rows by the kernels)."""
    if requested is None:
        return "gguf" if gguf and not tensor_parallel and weights != torch.float32 else None
    if requested == "gguf" and not gguf:
        raise ValueError("quantization gguf keeps a GGUF file's blocks: the model is not a .gguf file")
    return None if requested == "none" else requested


def _distinct(items: Iterable[Rope]) -> list[Rope]:
    """Each item once, in order (a Rope's scaling dict makes it unhashable)."""
    seen: list[Rope] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen


def _columns(w: Weight, columns: range) -> Weight:
    """A row-parallel layer's input columns on this rank: all of them without tensor parallelism."""
    return w if (columns.start, columns.stop) == (0, w.shape[1]) else w[:, columns.start:columns.stop]


@dataclass
class LayerTap:
    """Rows of a batch whose residual stream the forward pass keeps after every layer (the logit lens)."""

    rows: torch.Tensor  # [n] row indexes into the batch's tokens
    residuals: list[torch.Tensor] = field(default_factory=list)  # per layer: [n, hidden], filled by forward


@dataclass
class StepInputs:
    """What every layer of a step reads beside its hidden state: the RoPE tables, the attention metadata, the
    per-layer inputs (Gemma 4); copied once a step to each other device a layer split puts layers on."""

    tables: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    per_layer: torch.Tensor | None
    copies: dict[torch.device, StepInputs] = field(default_factory=dict)

    def on(self, device: torch.device) -> StepInputs:
        if same_device(device, self.meta.slot_mapping.device):
            return self
        if device not in self.copies:
            self.copies[device] = StepInputs([(cos.to(device), sin.to(device)) for cos, sin in self.tables],
                                             self.meta.to(device),
                                             None if self.per_layer is None else self.per_layer.to(device))
        return self.copies[device]


@dataclass
class ExpertNorms:
    """A layer's norms where it runs routed experts beside its dense MLP (Gemma 4): of the experts' input, and of
    the dense MLP's and the experts' outputs before they are added."""

    experts_in: torch.Tensor
    dense_out: torch.Tensor
    experts_out: torch.Tensor


@dataclass
class Layer:
    spec: LayerSpec
    rope: int | None  # its RoPE's index in Decoder.rotaries (None: its attention has no position embeddings)
    input_norm: torch.Tensor
    qkv: Linear | None  # attention's (None where the mixer is recurrent)
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear | None
    post_norm: torch.Tensor
    gate_up: Linear | None  # None in a sparse layer whose MLP is moe alone
    down: Linear | None
    attn_out_norm: torch.Tensor | None = None  # sandwich norms: on attention's and the MLP's outputs
    mlp_out_norm: torch.Tensor | None = None
    moe: MoE | None = None
    expert_norms: ExpertNorms | None = None  # where moe runs beside the dense MLP
    # Gemma 4's per-layer input: out + norm(proj(act(gate out) * input)); then the output scaled by scalar
    input_gate: Linear | None = None
    input_proj: Linear | None = None
    input_norm_after: torch.Tensor | None = None
    scalar: torch.Tensor | None = None
    recurrent: RecurrentMixer | None = None  # a mixer that keeps a state instead of KV
    state: int | None = None  # a recurrent layer's entry in the state pool
    sinks: torch.Tensor | None = None  # [this rank's heads] float32 sink logits (attention sinks)

    @property
    def matrices(self) -> list[tuple[object, str]]:
        """(holder, attribute) of each of the layer's matrices: its mixer's, then its MLP's and every expert's,
        then its per-layer input's."""
        mlps = ([self] if self.gate_up is not None else []) + (self.moe.mlps if self.moe is not None else [])
        mixer = self.recurrent.matrices if self.recurrent else [(self, "qkv"), (self, "o")]
        per_layer = [(self, "input_gate"), (self, "input_proj")] if self.input_gate is not None else []
        return mixer + [(mlp, part) for mlp in mlps for part in ("gate_up", "down")] + per_layer


@dataclass
class PerLayerInputs:
    """Gemma 4's per-layer embeddings: each token a vector per layer, of its own embedding table and a
    projection of its embedding, which the layer's gate mixes into its output."""

    embed: Weight  # [per-layer vocabulary, layers * width]
    projection: Linear  # hidden -> layers * width
    norm: torch.Tensor  # [width]


class Decoder:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], device: str = "cpu",
                 quantization: str | None = None, max_positions: int | None = None, tp: TPRank | None = None,
                 fused_decode: bool = True, calibration: list[int] | None = None, deterministic: bool = False,
                 dtype: torch.dtype | None = None, placement: Placement | None = None):
        """The tensors' dtype is the weights' and the KV cache's; dtype, the activations' (default the same:
        float32 over bf16 tensors is dtype auto without native bf16). calibration: token ids of a short real
        text; with int8, smoothing factors are calibrated on it (smooth.py). tp: this rank holds its slice of
        every layer; the fused step and the smoothing, both whole-model, are then off. deterministic: see
        _make_deterministic. placement: which layers are on device and which on the CPU (default: all on
        device); GGUF blocks bound for a device other than the CPU are dequantized there at load (the block
        kernels are the CPU's)."""
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r} (supported: {', '.join(QUANTIZATIONS)})")
        if tp and quantization in ("int4", "gguf"):  # 32-wide blocks do not follow a rank's column split
            raise ValueError(f"quantization {quantization} does not split across tensor-parallel ranks: "
                             "use int8 or none")
        self.config, self.quantization, self.tp, self.device = config, quantization, tp, device
        self.placement = placement or Placement.of(device, -1, config.num_layers)
        if self.placement.split and tp:
            raise ValueError("--n-gpu-layers splits the layers of one process: use --tensor-parallel-size 1")
        if quantization in FORMATS and self.placement.gpu_layers and self.placement.accelerator.type != "cpu":
            raise ValueError(f"quantization {quantization} runs on the CPU's block kernels: on "
                             f"{self.placement.accelerator} use --quantization none (or --n-gpu-layers 0)")
        self.prefill_kernel = not deterministic  # calibration (smooth) runs forward before the end of __init__
        self.shard = Shard.of(config, tp.rank, tp.world_size) if tp else Shard.of(config)
        self.kv_dtype = tensors["model.norm.weight"].dtype  # the loader's: weights' (dense ones) and KV cache's
        self.dtype = dtype or self.kv_dtype
        self.dequantized: Counter[str] = Counter()  # GGUF types run dense for want of a kernel: matrices
        t = {k: self._place(k, v) for k, v in tensors.items()}
        self.embed = self._embedding(t["model.embed_tokens.weight"])
        self.norm = t["model.norm.weight"]
        vocab = self.shard.vocab
        # Logits in float32 where the kernel makes them (as the fused step's): bf16 ties near-equal candidates.
        self.lm_head = self._linear([head_rows(t.get("lm_head.weight", t["model.embed_tokens.weight"]), vocab, 1)],
                                    out_dtype=torch.float32)
        specs = family(config.architecture).layers(config)
        if tp and len({spec.kv_heads for spec in specs}) > 1:
            raise ValueError("tensor parallelism splits KV heads alike in every layer: this model's layers differ "
                             "in KV heads")
        # RoPE tables computed once a step for the layers sharing one (a layer without RoPE has none)
        ropes = _distinct(spec.rope for spec in specs if spec.rope)
        self.layers = [self._layer(t, f"model.layers.{i}", spec, ropes.index(spec.rope) if spec.rope else None)
                       for i, spec in enumerate(specs)]
        for n, layer in enumerate(x for x in self.layers if not x.spec.mixer.keeps_kv):  # in layer order
            layer.state = n
        self.per_layer_inputs = PerLayerInputs(
            self._embedding(t["model.embed_tokens_per_layer.weight"]),
            self._linear([t["model.per_layer_model_projection.weight"]]),
            t["model.per_layer_projection_norm.weight"]) if config.per_layer_input_size else None
        for name, count in self.dequantized.items():
            log.warning("GGUF type %s has no kernel here: %d matrices run dense in %s (dequantized at load)",
                        name, count, str(self.dtype).removeprefix("torch."))
        positions = max_positions or config.max_position_embeddings
        self.rotaries = [Rotary(r.head_dim, r.theta, r.scaling, positions, r.interleaved, r.rotary_dim,
                                self.placement.ends) for r in ropes]
        self.num_heads, self.num_kv_heads = len(self.shard.q_heads), len(self.shard.kv_heads)
        self.kv_shape = KVShape.of(specs).with_kv_heads(self.num_kv_heads) if tp else KVShape.of(specs, self.placement)
        # Smoothing folds V's factors into O: not where V is normed, K's, or an earlier layer's.
        v_apart = any(s.value_norm or s.values_are_keys or s.kv_source is not None for s in specs)
        if quantization == "int8" and calibration and not tp and not config.num_experts and not config.state_layers \
                and not v_apart:
            smooth(self, calibration)
        if quantization in FORMATS:
            self._quantize(*FORMATS[quantization])
        whole = not tp and not self.placement.split  # the fused step runs the whole model on the CPU
        self.fused = FusedDecode.build(self) if fused_decode and whole and not deterministic else None
        if deterministic:
            self._make_deterministic(device)

    def _make_deterministic(self, device: str) -> None:
        """Every linear through the fixed-order kernel and attention through the CPU decode kernel, whose
        per-row arithmetic never depends on the rows around it (batch, chunk, cached prefix); no fused step.
        Prompt chunks too take the decode kernel (prefill_kernel off): a prompt whose pages are cached but
        its last token is computed as a decode row, and the prefill kernel's bits differ from the decode's."""
        if torch.device(device).type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"deterministic mode runs on CPU in bfloat16 or float32, not {self.dtype} on {device}")
        if self.tp is not None:
            raise ValueError("deterministic mode runs without tensor parallelism (an all-reduce sums in an order of "
                             "its own)")
        if not cpu_linear.available() or cpu_attention._kernel() is None:
            raise ValueError("deterministic mode needs zhuzi's CPU kernels, which could not be built here "
                             "(is a C++ compiler installed? see the log)")
        routers = [m for layer in self.layers if layer.moe for m in (layer.moe.router, layer.moe.shared_gate) if m]
        per_layer = [self.per_layer_inputs.projection] if self.per_layer_inputs else []
        for linear in [self.lm_head] + routers + per_layer + \
                [getattr(h, p) for layer in self.layers for h, p in layer.matrices]:
            linear.fixed_order = True  # block layers are fixed-order by design

    def _place(self, name: str, w: Weight) -> Weight:
        """A checkpoint tensor on its layer's device; GGUF blocks stay blocks only on the CPU, for its kernels."""
        device = self.placement.of_tensor(name)
        if isinstance(w, torch.Tensor):
            return w.to(device)
        return w if self.quantization == "gguf" and device.type == "cpu" else w.dequantize(self.kv_dtype).to(device)

    def _dense(self, w: Weight) -> torch.Tensor:
        """Blocks no kernel serves, dequantized (they are the CPU's: _place dequantized the others')."""
        return w.dequantize(self.kv_dtype) if isinstance(w, BlockWeight) else w

    def _embedding(self, w: Weight) -> Weight:
        """The token embedding: a GGUF's blocks stay blocks (a step's rows dequantized) where a kernel serves."""
        return w if isinstance(w, BlockWeight) and cpu_blocks.dequantize_serves(w.qtype) else self._dense(w)

    def _bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        return bias.to(self.dtype) if bias is not None else None

    def _linear(self, parts: list[Weight], bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> Linear:
        """One layer whose output rows are the parts' rows, one after another (q, k, v or gate, up). With
        quantization gguf, blocks stay blocks where a kernel serves every part's type."""
        blocks = [w for w in parts if isinstance(w, BlockWeight)]
        if blocks and len(blocks) == len(parts) and blocks_serve(blocks, "cpu"):  # blocks are on the CPU (_place)
            return BlockLinear(blocks, self._bias(bias), out_dtype)
        if blocks:
            self.dequantized.update(w.qtype.name for w in blocks)
        return Linear(torch.cat([self._dense(w) for w in parts], 0), self._bias(bias))

    def _layer(self, t: dict[str, Weight], p: str, spec: LayerSpec, rope: int | None) -> Layer:
        t = family(self.config.architecture).split_merged(t, self.config, p)
        attn, mlp, s, d = f"{p}.self_attn", f"{p}.mlp", self.shard, spec.head_dim
        sparse, dense = spec.mlp is not Mlp.DENSE, spec.mlp in (Mlp.DENSE, Mlp.DENSE_AND_MOE)
        width = self._width(t[f"{mlp}.gate_proj.weight"].shape[0]) if dense else s.mlp
        gate_up = [head_rows(t[f"{mlp}.{n}_proj.weight"], width, 1) for n in ("gate", "up")] if dense else []
        down = t.get(f"{mlp}.down_proj.weight")
        per_layer = self.config.per_layer_input_size
        mixer: dict = dict(recurrent=self._recurrent(t, p, spec)) if not spec.mixer.keeps_kv else {}
        if spec.mixer.keeps_kv:
            q_rows = 2 * d if spec.output_gate else d  # each head's query, then its gate
            rows = {"q": q_rows, "k": d, "v": d}
            kv_heads = s.kv_heads if self.tp else range(spec.kv_heads)  # (tensor parallelism: alike in every layer)
            heads = {"q": s.q_heads, "k": kv_heads, "v": kv_heads}
            # A layer attending an earlier layer's K/V projects only q; one whose V is K's, q and k.
            projections = "q" if spec.kv_source is not None else "qk" if spec.values_are_keys else "qkv"
            qkv = [head_rows(t[f"{attn}.{n}_proj.weight"], heads[n], rows[n]) for n in projections]
            bias = [head_rows(t[f"{attn}.{n}_proj.bias"], heads[n], rows[n]) for n in projections
                    if f"{attn}.{n}_proj.bias" in t]
            o = t[f"{attn}.o_proj.weight"]
            mixer = dict(qkv=self._linear(qkv, torch.cat(bias) if bias else None),
                         q_norm=t.get(f"{attn}.q_norm.weight") if spec.qk_norm else None,
                         k_norm=t.get(f"{attn}.k_norm.weight") if spec.qk_norm else None,
                         o=self._linear([_columns(o, range(s.q_heads.start * d, s.q_heads.stop * d))],
                                        self._row_parallel_bias(t.get(f"{attn}.o_proj.bias"))),
                         sinks=t[f"{attn}.sinks.weight"].float()[s.q_heads.start:s.q_heads.stop].contiguous()
                         if spec.sinks else None)
        return Layer(
            spec=spec,
            rope=rope,
            input_norm=t[f"{p}.input_layernorm.weight"],
            **{"qkv": None, "q_norm": None, "k_norm": None, "o": None} | mixer,
            post_norm=t[f"{p}.pre_feedforward_layernorm.weight" if spec.sandwich_norms
                        else f"{p}.post_attention_layernorm.weight"],
            gate_up=self._linear(gate_up) if dense else None,
            down=self._linear([_columns(down, width)]) if dense else None,
            moe=self._moe(t, mlp, spec.mlp, self._glu(spec.activation)) if sparse else None,
            expert_norms=ExpertNorms(*(t[f"{p}.{n}.weight"] for n in ("pre_feedforward_layernorm_2",
                                                                       "post_feedforward_layernorm_1",
                                                                       "post_feedforward_layernorm_2")))
            if spec.mlp is Mlp.DENSE_AND_MOE else None,
            attn_out_norm=t[f"{p}.post_attention_layernorm.weight"] if spec.sandwich_norms else None,
            mlp_out_norm=t.get(f"{p}.post_feedforward_layernorm.weight") if spec.sandwich_norms else None,
            input_gate=self._linear([t[f"{p}.per_layer_input_gate.weight"]]) if per_layer else None,
            input_proj=self._linear([t[f"{p}.per_layer_projection.weight"]]) if per_layer else None,
            input_norm_after=t[f"{p}.post_per_layer_input_norm.weight"] if per_layer else None,
            scalar=t[f"{p}.layer_scalar"].to(self.dtype) if self.config.layer_scalar else None,
        )

    def _recurrent(self, t: dict[str, Weight], p: str, spec: LayerSpec) -> RecurrentMixer:
        """Layer p's mixer that keeps a state, from its tensors (this rank's heads of it)."""
        mixer = MIXERS[spec.mixer]
        return mixer.build(t, f"{p}.{mixer.prefix}", self.config, self._linear, self.shard, self._sum)

    def state_shapes(self) -> list[list[tuple[int, ...]]]:
        """Per recurrent layer (in state pool order), the shape of each of its states for one sequence."""
        return [layer.recurrent.state_shapes() for layer in self.layers if layer.recurrent is not None]

    def state_devices(self) -> list[torch.device]:
        """Per recurrent layer (in state pool order), the device its states live on: its own."""
        return [self.placement.layer(i) for i, layer in enumerate(self.layers) if layer.recurrent is not None]

    def _glu(self, activation: str) -> Glu:
        c = self.config
        return ClampedSwiGLU(c.swiglu_alpha, c.swiglu_limit) if activation == "swiglu_clamped" else GLUS[activation]

    def _row_parallel_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """A row-parallel layer's bias (O, down) on one rank only: the ranks' partial sums are added up."""
        return bias if self.tp is None or self.tp.leads else None

    def _width(self, rows: int) -> range:
        """This rank's slice of an MLP of `rows` (Gemma 4's shared-KV layers may be twice as wide as the rest)."""
        return split(rows, self.tp.world_size, self.tp.rank) if self.tp else range(rows)

    def _moe(self, t: dict[str, Weight], mlp: str, kind: Mlp, glu: Glu) -> MoE:
        """A sparse layer's router and experts. An expert is its rows of the stacked matrices (a view, of a GGUF
        file's blocks too; its gate and up the halves of its gate_up rows where they are stored so), with its rows
        of the stacked biases where the layer has them; with tensor parallelism, this rank's slice of each
        expert's width."""
        c, s = self.config, self.shard

        def mlp_of(gate: Weight, up: Weight, down: Weight, width: range,
                   biases: tuple[torch.Tensor, ...] | None = None) -> Expert:
            gate_up_bias = torch.cat([head_rows(b, width, 1) for b in biases[:2]]) if biases else None
            return Expert(self._linear([head_rows(gate, width, 1), head_rows(up, width, 1)], gate_up_bias),
                          self._linear([_columns(down, width)], self._row_parallel_bias(biases and biases[2])), glu)

        def expert(name: str, e: int, rows: int) -> Weight:
            return t[f"{mlp}.experts.{name}_proj.weight"][e * rows:(e + 1) * rows]

        def gate_up(e: int) -> tuple[Weight, Weight]:
            if not c.experts_gate_up:
                return expert("gate", e, m), expert("up", e, m)
            both = expert("gate_up", e, 2 * m)
            return both[:m], both[m:]

        def biases(e: int) -> tuple[torch.Tensor, ...] | None:
            return tuple(t[f"{mlp}.experts.{n}_proj.bias"][e] for n in ("gate", "up", "down")) if c.expert_bias \
                else None

        m, h = c.moe_intermediate_size, c.hidden_size
        experts = [mlp_of(*gate_up(e), expert("down", e, h), s.expert, biases(e)) for e in range(c.num_experts)]
        shared: tuple[Expert | None, Linear | None] = (None, None)
        if kind in (Mlp.MOE_SHARED, Mlp.MOE_SHARED_UNGATED):
            parts = (t[f"{mlp}.shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down"))
            gate = self._linear([t[f"{mlp}.shared_expert_gate.weight"]]) if kind is Mlp.MOE_SHARED else None
            shared = mlp_of(*parts, s.shared_expert), gate
        selection = t[f"{mlp}.expert_bias"].float() if c.selection_bias else None
        return MoE(self._linear([t[f"{mlp}.gate.weight"]], t.get(f"{mlp}.gate.bias")), experts,
                   c.num_experts_per_tok, c.norm_topk_prob, c.expert_gating, *shared, selection_bias=selection,
                   router_scale=t[f"{mlp}.gate.scale"].to(self.dtype) if c.router_input_norm else None,
                   expert_scale=t[f"{mlp}.expert_scale"].float() if c.expert_scale else None, eps=c.rms_norm_eps)

    def _quantize(self, layer_type: Q, head_type: Q) -> None:
        """Every matrix into GGUF blocks (quant.py), from there run as a GGUF file's are; in float32 (the
        reference) their exact values run dense. Gate and up stay parts of their own, as a GGUF's."""
        def blocks(linear: Linear, qtype: Q, parts: int = 1, out_dtype: torch.dtype | None = None) -> Linear:
            quantized = [quantize(w, qtype) for w in linear.weight.chunk(parts)]
            if self.kv_dtype == torch.float32:
                return Linear(torch.cat([w.dequantize(self.kv_dtype) for w in quantized]).to(self.device),
                              linear.bias)
            return self._linear(quantized, linear.bias, out_dtype)

        for layer in self.layers:
            for holder, part in layer.matrices:
                setattr(holder, part, blocks(getattr(holder, part), layer_type, 2 if part == "gate_up" else 1))
        self.lm_head = blocks(self.lm_head, head_type, out_dtype=torch.float32)

    def kernel_paths(self) -> dict[str, str]:
        """Which build serves each operation of this model, as chosen at load: the CPU variant's kernels, or
        torch (README has the paths of prefill matmuls)."""
        v = native.current()
        if self.norm.device.type != "cpu" or v == "torch":
            return {"variant": v}
        c = self.config
        layer = getattr(*self.layers[0].matrices[-2])  # the first layer's last MLP's (or expert's) gate/up
        attention = select("cpu", self.dtype, self.kv_dtype, self.num_heads, self.num_kv_heads, c.head_dim,
                           self.prefill_kernel, v)
        on = {"kernel": v, "decode kernel": f"{v} (as decode rows)", "torch": "torch"}
        paths = {"variant": v, "decode_matmul": v if layer.backend != "torch" else "torch",
                 "fused_decode_step": v if self.fused is not None else "torch",
                 "decode_attention": on[attention.decode], "prefill_attention": on[attention.prefill]}
        if layer.backend == "blocks":  # a GGUF's prompt rows, maybe on AMX tiles
            paths["prefill_matmul"] = v + ("+amx" if cpu_blocks.prefill_on_amx() else "")
        if (why := FusedDecode.refusal(c)) is not None:
            paths["fused_decode_step"] = f"off ({why})"
        return paths

    @property
    def weight_bytes_per_decode_step(self) -> int:
        """Bytes of weights one decode step of one sequence reads: every matrix and norm (of a sparse layer,
        the router, top-k experts and the shared expert: the active parameters), one embedding row."""
        return self._dense_bytes + sum(layer.moe.active_bytes for layer in self.layers if layer.moe)

    @property
    def step_weight_bytes(self) -> int:
        """Bytes of weights the last forward pass read, counting only the experts its rows ran (and one
        embedding row): a decode step of one sequence reads weight_bytes_per_decode_step."""
        return self._dense_bytes + sum(layer.moe.bytes_read for layer in self.layers if layer.moe)

    @property
    def _dense_bytes(self) -> int:
        """Every matrix and norm but the experts (a sparse layer's MLP), one embedding row."""
        row = self.embed.nbytes // self.embed.shape[0]
        norms = self.norm.nbytes + sum(n.nbytes for layer in self.layers for n in (
            layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, layer.attn_out_norm, layer.mlp_out_norm)
            if n is not None)
        mats = sum(getattr(holder, part).nbytes for layer in self.layers for holder, part in layer.matrices
                   if not isinstance(holder, Expert))
        return row + norms + mats + self.lm_head.nbytes

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVPool, tap: LayerTap | None = None, states: list[list[torch.Tensor]] | None = None,
                embedded: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [tokens]; kv: the KV pool (kv_pool.py); states: per recurrent layer its state
        tensors, [slots, ...] each (meta.state_runs says whose rows use which slot); embedded: the first layer's
        input where the caller makes it (the multi-token-prediction layer's, mtp.py). Returns hidden states.

        With a tap, the residual stream of its rows after each layer is appended to tap.residuals."""
        h = self._embed(self.embed, input_ids, self.config.embedding_scale) if embedded is None else embedded
        step = StepInputs([rotary.tables(positions, self.dtype) for rotary in self.rotaries], meta,
                          self._per_layer_inputs(input_ids, h) if self.per_layer_inputs else None)
        for i, layer in enumerate(self.layers):
            spec, here = layer.spec, step.on(self.placement.layer(i))
            h, meta, per_layer = h.to(here.meta.slot_mapping.device), here.meta, here.per_layer  # a split's crossing
            x = self._norm(h, layer.input_norm, spec.norm_offset)
            if layer.recurrent is not None:
                assert states is not None and layer.state is not None
                ready(states[layer.state], meta.state_runs)
                mixed = layer.recurrent(x, states[layer.state], meta.state_runs)
            else:
                table = here.tables[layer.rope] if layer.rope is not None else None
                mixed = self._attention(layer, x, table, meta, kv.layer(i))
            h = h + self._residual(self._out_norm(self._sum(mixed), layer.attn_out_norm, spec))
            x = self._norm(h, layer.post_norm, spec.norm_offset)
            h = h + self._residual(self._out_norm(self._mlp(layer, x, h), layer.mlp_out_norm, spec))
            if per_layer is not None:
                gated = self._glu(spec.activation)(layer.input_gate(h), per_layer[:, i])
                h = h + self._norm(layer.input_proj(gated), layer.input_norm_after, spec.norm_offset)
            if layer.scalar is not None:
                h = h * layer.scalar
            if tap is not None:
                tap.residuals.append(h[tap.rows.to(h.device)].to(tap.rows.device))
        return self.final_norm(h.to(self.placement.ends))

    def _mlp(self, layer: Layer, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """A layer's MLP of its normed input x, every rank's partial sums added up: the dense MLP, the routed
        experts, or both side by side, each normed before they are added (the experts' router reads the residual
        stream h, the experts a norm of their own of it; one all-reduce sums both)."""
        spec, norms, glu = layer.spec, layer.expert_norms, self._glu(layer.spec.activation)
        if layer.moe is None:
            return self._sum(gated_mlp(layer.gate_up, layer.down, x, glu))
        if norms is None:
            return self._sum(layer.moe(x))
        dense = gated_mlp(layer.gate_up, layer.down, x, glu)
        experts = layer.moe(self._norm(h, norms.experts_in, spec.norm_offset), h)
        if self.tp:
            dense, experts = self._sum(torch.cat([dense, experts], -1)).chunk(2, -1)
        return self._norm(dense, norms.dense_out, spec.norm_offset) + \
            self._norm(experts, norms.experts_out, spec.norm_offset)

    def _embed(self, table: Weight, ids: torch.Tensor, scale: float) -> torch.Tensor:
        h = table.take(ids, self.dtype) if isinstance(table, BlockWeight) else table[ids].to(self.dtype)
        # the scale rounded to the activations' dtype, as transformers does
        return h * torch.tensor(scale, dtype=self.dtype) if scale != 1.0 else h

    def _per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[tokens, layers, width]: each layer's input of Gemma 4's per-layer embeddings, as transformers
        computes it: (norm(projection(h) / sqrt(hidden)) + embedding * sqrt(width)) / sqrt(2)."""
        c, p = self.config, self.per_layer_inputs
        width = c.per_layer_input_size
        embedded = self._embed(p.embed, ids, width ** 0.5).view(-1, c.num_layers, width)
        projected = (p.projection(h) * c.hidden_size ** -0.5).view(-1, c.num_layers, width)
        return (self._norm(projected, p.norm, c.norm_weight_offset) + embedded) * 2 ** -0.5

    def _attention(self, layer: Layer, x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor] | None,
                   meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        """A layer's attention over its K/V in the pool (which it writes first unless it attends an earlier
        layer's), before O's all-reduce; q and k turned by the RoPE table, where the layer has one."""
        spec, d = layer.spec, layer.spec.head_dim
        kv_heads = self.num_kv_heads if self.tp else spec.kv_heads
        q_rows = 2 * d if spec.output_gate else d  # each head's query, then its gate
        q_size, kv_size = self.num_heads * q_rows, kv_heads * d
        projected = layer.qkv(x)
        q = projected[:, :q_size].view(-1, self.num_heads, q_rows)
        gate = None
        if spec.output_gate:
            q, gate = q.split(d, -1)
        k = v = None
        if spec.kv_source is None:
            k = projected[:, q_size:q_size + kv_size].view(-1, kv_heads, d)
            v = k if spec.values_are_keys else projected[:, q_size + kv_size:].view(-1, kv_heads, d)
        if layer.q_norm is not None:
            q = self._norm(q, layer.q_norm, spec.norm_offset)
        if k is not None:
            k = self._norm(k, layer.k_norm, spec.norm_offset) if layer.k_norm is not None else k
            v = rms_norm_unscaled(v, self.config.rms_norm_eps) if spec.value_norm else v
        if table is not None:
            rotary, (cos, sin) = self.rotaries[layer.rope], table
            q = rotary.apply(q, cos, sin)
            k = rotary.apply(k, cos, sin) if k is not None else None
        if spec.query_scalar != d:
            q = q * (d / spec.query_scalar) ** 0.5  # attention scales by head_dim ** -0.5
        attn = paged_attention(q, k, v, cache[0], cache[1], meta, self.prefill_kernel, spec.window, layer.sinks)
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        return layer.o(attn.reshape(-1, self.num_heads * d))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The norm before the LM head (the logit lens reads any layer's residual stream through it)."""
        return self._norm(h, self.norm, self.config.norm_weight_offset)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, offset: float | None) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        return offset_rms_norm(x, weight, eps, offset) if offset is not None else rms_norm(x, weight, eps)

    def _out_norm(self, x: torch.Tensor, weight: torch.Tensor | None, spec: LayerSpec) -> torch.Tensor:
        """A sublayer's output, normed where the layer has a norm there (sandwich norms), before the residual add."""
        return x if weight is None else self._norm(x, weight, spec.norm_offset)

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream: scaled where the model scales it (Granite)."""
        scale = self.config.residual_scale
        return x if scale == 1.0 else x * scale

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output: every rank's partial sum added up."""
        return self.tp.all_reduce(partial) if self.tp else partial

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    kv: KVPool) -> torch.Tensor | None:
        """The logits of a step of decodes only, in one fused call (fused.py); None where that path does
        not serve the step (then forward + logits run)."""
        if self.fused is None or meta.prefills or meta.num_decode_tokens != len(input_ids):
            return None
        return self.fused(input_ids, positions, meta.decode_slots, meta.decode_lengths, kv.tensors)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 (with tensor parallelism every rank's vocabulary slice, gathered)."""
        logits = self.lm_head(hidden).float()
        logits = self.tp.gather_vocab(logits, self.config.vocab_size) if self.tp else logits
        if cap := self.config.final_logit_softcapping:
            logits = torch.tanh(logits / cap) * cap
        if self.config.logit_scale != 1.0:
            logits = logits / self.config.logit_scale
        return logits
