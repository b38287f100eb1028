"""The model's own description (shape, architecture, RoPE, norms): what the loader reads from a checkpoint
(loader.py) and the decoder is built to; the KV pool's arithmetic (config.py's KVPlan) reads it too."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """The shape of a decoder-only checkpoint, independent of its file format."""

    architecture: str  # llama, qwen2 or qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's rope_scaling dict (e.g. Llama-3 "llama3")
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    rope_interleaved: bool = False  # RoPE rotates pairs (0, 1), (2, 3), ...: a llama GGUF's Q/K row order
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pooling: str | None = None  # an embedding checkpoint's own pooling, "mean" or "last" (None: it names none)

    @property
    def num_parameters(self) -> int:
        h, i, n = self.hidden_size, self.intermediate_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n * per_layer + embed + h

    def decode_weight_bytes(self, bytes_per_weight: float, head_bytes_per_weight: float | None = None) -> int:
        """Weight bytes one decode step reads: every matrix once, but only one embedding row."""
        head = self.vocab_size * self.hidden_size
        unread_embedding = (self.vocab_size - 1) * self.hidden_size if not self.tie_word_embeddings else 0
        body = self.num_parameters - unread_embedding - head
        return int(body * bytes_per_weight + head * (head_bytes_per_weight or bytes_per_weight))
