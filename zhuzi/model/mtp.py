"""Qwen3.5 / 3.6's multi-token-prediction layer, speculative decoding's "mtp" proposer: from the target's final
hidden state at position p and the embedding of token p + 1, fc(cat(norm(embedding), norm(hidden))) runs through a
full-attention decoder layer of the target's shape (its own KV), a final norm and the target's LM head: a guess at
token p + 2. Its output hidden state stands in for the target's at the next guess."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from zhuzi.model.attention import AttentionMetadata
from zhuzi.model.decoder import Decoder, LayerTap
from zhuzi.model.kv_pool import KVPool, KVShape
from zhuzi.model.linear import Linear
from zhuzi.model.loader import load_mtp
from zhuzi.model.placement import Placement


@dataclass
class MTP:
    layers: Decoder  # the mtp.layers (and mtp.norm) as a decoder, whose embedding and LM head are the target's
    fc: Linear  # [hidden, 2 * hidden]: the normed embedding's columns, then the normed hidden state's
    embedding_norm: torch.Tensor
    hidden_norm: torch.Tensor
    tp = None  # the layer runs whole on rank 0

    @classmethod
    def load(cls, path: Path, target: Decoder, max_positions: int) -> MTP:
        """path's mtp.* tensors (loader.load_mtp), in the target's dtype, beside the target's embedding and LM
        head (on the CPU where the target's layers are split)."""
        config, t = load_mtp(path, target.config, target.kv_dtype)
        t |= {"model.embed_tokens.weight": torch.empty(0, config.hidden_size, dtype=target.kv_dtype)}
        device = target.placement.ends
        layers = Decoder(config, t, str(device), max_positions=max_positions, fused_decode=False, dtype=target.dtype)
        layers.embed, layers.lm_head = target.embed, target.lm_head  # shared, not copied
        return cls(layers, Linear(t["mtp.fc.weight"].to(device)), t["mtp.pre_fc_norm_embedding.weight"].to(device),
                   t["mtp.pre_fc_norm_hidden.weight"].to(device))

    @property
    def kv_shape(self) -> KVShape:
        return self.layers.kv_shape

    @property
    def placement(self) -> Placement:
        return self.layers.placement

    def state_shapes(self) -> list[list[tuple[int, ...]]]:
        return []

    def state_devices(self) -> list[torch.device]:
        return []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
                tap: LayerTap | None = None, states: list[list[torch.Tensor]] | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: the tokens after the positions whose hidden states [tokens, hidden] come in; returns the
        layer's hidden states, normed as the target's final ones are."""
        d = self.layers
        offset = d.config.norm_weight_offset
        embedded = d._norm(d._embed(d.embed, input_ids, d.config.embedding_scale), self.embedding_norm, offset)
        joined = torch.cat([embedded, d._norm(hidden.to(d.dtype), self.hidden_norm, offset)], -1)
        return d.forward(input_ids, positions, meta, kv, tap, states, self.fc(joined))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layers.logits(hidden)
