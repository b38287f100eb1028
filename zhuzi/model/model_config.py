"""The model's own description: what a family's config mapping (families/) makes of a checkpoint's config,
and the decoder is built to: the shape, and per layer a LayerSpec. The KV pool's arithmetic (config.py) reads it."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Mixer(Enum):
    """What mixes a layer's tokens (its value is the layer's ModelConfig.layer_types entry). A mixer that keeps
    a recurrent state instead of KV (linear attention, a short convolution, a state-space layer) is one more
    kind here, its state's size in ModelConfig.state_floats and its class in recurrent.MIXERS."""

    ATTENTION = "full_attention"
    SLIDING_ATTENTION = "sliding_attention"  # each token attends its last `window` tokens
    LINEAR_ATTENTION = "linear_attention"  # gated DeltaNet: a state matrix per head instead of KV (recurrent.py)
    SHORT_CONV = "conv"  # LFM2's gated short convolution: its last inputs instead of KV (recurrent.py)
    MAMBA2 = "mamba2"  # a Mamba2 state-space layer: a convolution tail and an SSM state per head (recurrent.py)

    @property
    def keeps_kv(self) -> bool:
        """Its tokens' keys and values go to the KV pool (a recurrent mixer keeps a state slot instead)."""
        return self in (Mixer.ATTENTION, Mixer.SLIDING_ATTENTION)


class Mlp(Enum):
    DENSE = "dense"  # gated: down(act(gate x) * up x)
    MOE = "moe"  # routed experts, top-k per token
    MOE_SHARED = "moe_shared"  # routed experts plus a gated shared expert every token runs
    MOE_SHARED_UNGATED = "moe_shared_ungated"  # routed experts plus a shared expert added as it is (Granite)
    DENSE_AND_MOE = "dense_and_moe"  # the dense MLP and routed experts side by side, each normed (Gemma 4)


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: dict | None  # HF's rope_scaling dict (llama3, linear, longrope, ...; a GGUF's frequency_factors)
    rotary_dim: int | None  # the first dims of a head that turn; None: all
    interleaved: bool  # pairs (0, 1), (2, 3), ...: a llama GGUF's Q/K row order
    head_dim: int  # the head size it turns


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as the decoder builds it."""

    mixer: Mixer
    window: int | None  # tokens a sliding layer sees, its own included
    rope: Rope | None  # None: attention without position embeddings (NoPE)
    mlp: Mlp
    qkv_bias: bool
    qk_norm: bool  # RMSNorm of each head's q and k
    sandwich_norms: bool  # norms on attention's and the MLP's outputs too
    norm_offset: float | None  # RMSNorm scales by (offset + w) in float32; None: by w, in the activations' dtype
    activation: str  # the MLP's gate: silu, gelu_pytorch_tanh, or swiglu_clamped (gpt-oss's experts)
    query_scalar: float  # attention scores scale by its -1/2 power
    head_dim: int
    kv_heads: int
    output_gate: bool = False  # attention's output times sigmoid of a gate q_proj also makes (Qwen3.5)
    o_bias: bool = False  # a bias on attention's output projection too
    sinks: bool = False  # attention sinks: a learned logit per head in each softmax denominator
    kv_source: int | None = None  # the earlier layer whose K/V it attends, writing none (Gemma 4); None: its own
    values_are_keys: bool = False  # V is K's projection (Gemma 4's attention_k_eq_v): no V weights
    value_norm: bool = False  # RMSNorm without a scale of each head's v (Gemma 4)


@dataclass(frozen=True)
class LinearAttentionShape:
    """A gated DeltaNet layer's heads: q and k heads (key_heads, key_dim each), v heads (value_heads,
    value_dim), and the width of the causal convolution over q, k and v."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    tiled: bool  # value heads in a GGUF's order, by key head tiled (k0, k1, ..., k0, k1), not grouped
    merged_qkvz: bool = False  # q, k, v and z stored as one matrix, rows interleaved per key head (Qwen3-Next)

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba2 layer's heads: `heads` of head_dim channels each, whose B and C come from `groups` groups of
    state_size (each group serves heads / groups heads), and the width of the causal convolution over x, B, C."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_kernel: int

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.state_size


@dataclass
class ModelConfig:
    """A decoder-only checkpoint, independent of its file format: its shape and the features its layers have
    (the family's config mapping sets them; its layers() makes each layer's LayerSpec of them)."""

    architecture: str  # the family's name (families/)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's rope_scaling dict (e.g. Llama-3 "llama3"), a GGUF's as layers.py reads it
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections
    attention_out_bias: bool = False  # bias on the output projection too (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head joins each softmax denominator (gpt-oss)
    qk_norm: bool = False  # RMSNorm on q and k per head
    rope_interleaved: bool = False  # RoPE rotates pairs (0, 1), (2, 3), ...: a llama GGUF's Q/K row order
    rotary_dim: int | None = None  # the first dims of a head that RoPE turns (Phi-3's partial_rotary_factor); None: all
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None  # tokens a sliding layer sees, the current one included (transformers')
    layer_types: list[str] | None = None  # per layer "sliding_attention" / "full_attention"; None: all slide
    embedding_scale: float = 1.0  # the token embedding is multiplied by it (Gemma: sqrt(hidden))
    # RMSNorm scales by (offset + w) in float32 (Gemma 3: 1, Gemma 4: 0); None: by w in the activations' dtype
    norm_weight_offset: float | None = None
    sandwich_norms: bool = False  # a norm on attention's and the MLP's outputs too (Gemma 2/3)
    hidden_act: str = "silu"  # the MLP's gate activation: silu, gelu_pytorch_tanh or swiglu_clamped (gpt-oss)
    swiglu_alpha: float = 1.702  # swiglu_clamped: up and gate -> (up + 1) * gate * sigmoid(alpha * gate), ...
    swiglu_limit: float = 7.0  # ... the gate clamped from above, up on both sides, at the limit (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scores scale by its -1/2 power; None: head_dim's
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # the RoPE base of sliding layers, where theirs is not rope_theta
    # Gemma 4: full-attention layers' own head size and KV heads; the last layers attend earlier layers' K/V; a
    # per-layer embedding added to each layer's output through a gate; K/V normed (V without a scale)
    global_head_dim: int | None = None
    num_global_kv_heads: int | None = None
    global_values_are_keys: bool = False  # full-attention layers' V is K's projection
    num_kv_shared_layers: int = 0
    per_layer_input_size: int = 0  # the per-layer embedding's width per layer (0: none)
    per_layer_vocab_size: int = 0
    value_norm: bool = False
    layer_scalar: bool = False  # each layer's output is scaled by a weight of its own
    # Mixture-of-Experts; num_experts 0 is a dense model
    num_experts: int = 0  # routed experts of a sparse layer
    num_experts_per_tok: int = 0  # top-k: the experts each token runs
    moe_intermediate_size: int = 0  # an expert's SwiGLU width
    shared_expert_intermediate_size: int = 0  # a shared expert every token runs (0: none)
    shared_expert_gate: bool = True  # a sigmoid gate scales the shared expert's output (Granite's has none)
    norm_topk_prob: bool = False  # the top-k gate weights renormalized to sum to 1
    expert_gating: str = "softmax"  # router logits -> gate weights: "softmax", "sigmoid" or "top_k_softmax"
    expert_bias: bool = False  # a bias on the router and on each expert's matrices (gpt-oss)
    moe_layers: list[int] | None = None  # the sparse layers (others run a dense MLP); None: every layer
    selection_bias: bool = False  # a bias per expert on the scores that pick the top-k, not on their weights (LFM2)
    # Gemma 4: a sparse layer runs its dense MLP too, the experts beside it
    dense_beside_experts: bool = False
    router_input_norm: bool = False  # the router reads its input RMS-normed, times a scale, hidden ** -1/2 (Gemma 4)
    expert_scale: bool = False  # each expert's gate weight times a factor of its own (Gemma 4)
    experts_gate_up: bool = False  # experts stored as gate_up (each one's gate rows, then its up rows) and down
    pooling: str | None = None  # an embedding checkpoint's own pooling, "mean" or "last" (None: it names none)
    # Linear attention (gated DeltaNet) layers: layer_types names them "linear_attention"
    linear: LinearAttentionShape | None = None
    attention_output_gate: bool = False  # full attention's output gated (Qwen3.5's q_proj makes the gate too)
    short_conv_kernel: int = 0  # a short-convolution layer's width (LFM2's L_cache): layer_types names them "conv"
    # Mamba2 layers: layer_types names them "mamba2"
    mamba: Mamba2Shape | None = None
    use_rope: bool = True  # attention turns q and k by RoPE (False: no position embeddings, Granite 4's hybrids)
    residual_scale: float = 1.0  # each sublayer's output is multiplied by it before the residual add (Granite)
    logit_scale: float = 1.0  # the logits are divided by it (Granite's logits_scaling)

    def window(self, layer: int) -> int | None:
        """The tokens layer `layer` attends (its own included), or None for the whole context."""
        if self.sliding_window is None:
            return None
        return self.sliding_window if self.layer_types is None or self.layer_types[layer] == "sliding_attention" \
            else None

    @property
    def kv_layers(self) -> int:
        """The layers whose tokens' keys and values the KV pool keeps (a recurrent layer keeps a state)."""
        return self.num_layers - self.state_layers

    @property
    def state_layers(self) -> int:
        """The layers that keep a recurrent state per sequence instead of KV."""
        return sum(1 for kind in self.layer_types or [] if not Mixer(kind).keeps_kv)

    def state_floats(self, mixer: Mixer) -> int:
        """The float32 values of state one sequence holds in a layer of this kind."""
        if mixer is Mixer.LINEAR_ATTENTION:
            assert self.linear is not None
            s = self.linear  # the convolution's last inputs, and a state matrix per value head
            return s.conv_channels * (s.conv_kernel - 1) + s.value_heads * s.key_dim * s.value_dim
        if mixer is Mixer.SHORT_CONV:  # the convolution's last inputs
            return self.hidden_size * (self.short_conv_kernel - 1)
        if mixer is Mixer.MAMBA2:
            assert self.mamba is not None
            m = self.mamba  # the convolution's last inputs, and a head_dim x state_size state per head
            return m.conv_channels * (m.conv_kernel - 1) + m.heads * m.head_dim * m.state_size
        return 0

    @property
    def state_bytes(self) -> int:
        """Bytes of recurrent state one sequence holds (float32), over every layer that keeps one."""
        return 4 * sum(self.state_floats(Mixer(kind)) for kind in self.layer_types or [])

    @property
    def kv_window(self) -> int | None:
        """The window of every layer when all of them slide: a sequence's KV older than it can be freed."""
        windows = {self.window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    def is_local(self, layer: int) -> bool:
        """A sliding layer with a RoPE base of its own (Gemma 3's local layers)."""
        local = self.layer_types is not None and self.layer_types[layer] == "sliding_attention"
        return local and self.rope_local_theta is not None

    def is_global(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "full_attention"

    def layer_head_dim(self, layer: int) -> int:
        return self.global_head_dim if self.global_head_dim and self.is_global(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_global_kv_heads if self.num_global_kv_heads and self.is_global(layer) else self.num_kv_heads

    def kv_source(self, layer: int) -> int | None:
        """The layer whose K/V layer `layer` attends, where it shares an earlier one's (the last of its own kind
        before the shared layers, as transformers' Gemma 4); None: its own."""
        first_shared = self.num_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return None
        kind = self.layer_types[layer] if self.layer_types else None
        return next(i for i in reversed(range(first_shared))
                    if (self.layer_types[i] if self.layer_types else None) == kind)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    def _mlp_parameters(self, layer: int, experts: int) -> int:
        """A layer's MLP parameters, counting `experts` of its routed experts (and the router, shared expert)."""
        h, dense = self.hidden_size, 3 * self.hidden_size * self.intermediate_size
        if not self.is_moe_layer(layer):
            return dense
        width, gate = self.shared_expert_intermediate_size, h if self.shared_expert_gate else 0
        shared = 3 * h * width + gate if width else 0
        router = self.num_experts * h + (h if self.router_input_norm else 0) + \
            (self.num_experts if self.expert_scale else 0)
        beside = dense if self.dense_beside_experts else 0
        return router + experts * 3 * h * self.moe_intermediate_size + shared + beside

    def _mixer_parameters(self, layer: int) -> int:
        """A layer's attention (or recurrent mixer) parameters, and its two norms: its own head size and KV
        heads, no K and V where it attends another layer's, no V where V is K's."""
        h = self.hidden_size
        if self.layer_types and self.layer_types[layer] == Mixer.LINEAR_ATTENTION.value:
            assert self.linear is not None
            s, values = self.linear, self.linear.value_heads * self.linear.value_dim
            projections = h * (s.conv_channels + values + 2 * s.value_heads) + values * h
            return projections + s.conv_channels * s.conv_kernel + 2 * s.value_heads + s.value_dim + 2 * h
        if self.layer_types and self.layer_types[layer] == Mixer.SHORT_CONV.value:  # in_proj (B, C, x), out_proj
            return 4 * h * h + h * self.short_conv_kernel + 2 * h
        if self.layer_types and self.layer_types[layer] == Mixer.MAMBA2.value:
            assert self.mamba is not None
            m = self.mamba  # in_proj, out_proj, the convolution and its bias, dt_bias, A_log, D, the gated norm
            projections = h * (m.inner + m.conv_channels + m.heads) + m.inner * h
            return projections + m.conv_channels * (m.conv_kernel + 1) + 3 * m.heads + m.inner + 2 * h
        d = self.layer_head_dim(layer)
        q, kv = self.num_heads * d, self.layer_kv_heads(layer) * d
        kv_projections = 0 if self.kv_source(layer) is not None else \
            1 if self.global_values_are_keys and self.is_global(layer) else 2
        attention = h * (q * (2 if self.attention_output_gate else 1) + kv_projections * kv) + q * h
        return attention + 2 * h  # the layer's two norms; q/k norms apart

    @property
    def _per_layer_input_parameters(self) -> tuple[int, int]:
        """(the table, the rest) of Gemma 4's per-layer embeddings: its table, the projection of the embedding
        and its norm, each layer's gate, projection and norm."""
        h, n, width = self.hidden_size, self.num_layers, self.per_layer_input_size
        if not width:
            return 0, 0
        return self.per_layer_vocab_size * n * width, h * n * width + width + n * (2 * h * width + h)

    @property
    def num_parameters(self) -> int:
        h, n = self.hidden_size, self.num_layers
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        layers = sum(self.layer_parameters(layer) for layer in range(n))
        return embed + h + sum(self._per_layer_input_parameters) + layers

    def layer_parameters(self, layer: int) -> int:
        """A decoder layer's parameters: its mixer's, its MLP's (every expert's), its norms."""
        return self._mixer_parameters(layer) + self._mlp_parameters(layer, self.num_experts)

    @property
    def active_parameters(self) -> int:
        """The parameters one token runs: a sparse layer's top-k experts, not all of them (all for a dense model)."""
        unused = self.num_experts - self.num_experts_per_tok
        return self.num_parameters - sum(self._mlp_parameters(layer, unused) - self._mlp_parameters(layer, 0)
                                         for layer in range(self.num_layers))

    def decode_weight_bytes(self, bytes_per_weight: float, head_bytes_per_weight: float | None = None) -> int:
        """Weight bytes one decode step of one sequence reads: every matrix once (of a sparse layer's experts, the
        top-k), but only one embedding row (and one of a per-layer embedding's table)."""
        head = self.vocab_size * self.hidden_size
        unread_embedding = (self.vocab_size - 1) * self.hidden_size if not self.tie_word_embeddings else 0
        table = self._per_layer_input_parameters[0]
        unread_embedding += table - table // max(self.per_layer_vocab_size, 1)
        body = self.active_parameters - unread_embedding - head
        return int(body * bytes_per_weight + head * (head_bytes_per_weight or bytes_per_weight))
