"""Building a model: a checkpoint loaded and its Decoder built as the engine's config asks, one way for the
target model and a speculative draft model alike."""
from __future__ import annotations

import json
from pathlib import Path

from zhuzi.config import EngineConfig
from zhuzi.model.decoder import Decoder, layer_format
from zhuzi.model.loader import Checkpoint, load_checkpoint
from zhuzi.model.parallel import TPRank
from zhuzi.tokenizer import Tokenizer


def build_model(config: EngineConfig, model: str | None, tp: TPRank | None = None,
                min_positions: int = 0) -> tuple[Checkpoint, Decoder]:
    """The checkpoint at model (None: the default one) and its Decoder (this rank's slice of it), with positions
    for max_model_len, min_positions and the checkpoint's own context, whichever is longest."""
    precision = config.precision
    ckpt = load_checkpoint(model, precision.weights)
    positions = max(config.max_model_len or 0, min_positions, ckpt.config.max_position_embeddings)
    quantization = layer_format(config.quantization, ckpt.is_gguf, tp is not None, precision.weights)
    calibration = calibration_ids(ckpt.path) if quantization == "int8" and tp is None else None
    decoder = Decoder(ckpt.config, ckpt.tensors, config.device, quantization, positions, tp,
                      fused_decode=config.fused_decode, calibration=calibration,
                      deterministic=config.deterministic, dtype=precision.compute,
                      placement=config.placement(ckpt.config))
    return ckpt, decoder


def calibration_ids(model_path: Path) -> list[int]:
    """A short fixed chat (prose, a list, code, a table, four languages) in the model's template: int8's
    smoothing factors are calibrated on it."""
    messages = json.loads((Path(__file__).parent / "calibration.json").read_text())
    return Tokenizer.load(model_path).encode_chat(messages)
