"""The model builder: the target model and a draft model are built one way, so one checkpoint built as either
is the same model, int8's smoothing included."""
import pytest
import tiny
import torch

from zhuzi.config import EngineConfig
from zhuzi.engine.worker.model_builder import build_model


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_checkpoint_built_as_a_draft_is_the_target_model(tmp_path, quantization):
    """A draft asks for the target's context (min_positions) beside its own: the layers, their format and
    numbers are the target's (int8 smoothed on the same calibration chat), so are the logits."""
    tiny.build("llama", tmp_path, vocab_size=49152)  # the tokenizer's: calibration reads a real chat
    config = EngineConfig(str(tmp_path), quantization=quantization)
    _, target = build_model(config, config.model)
    _, draft = build_model(config, config.model, min_positions=8192)
    assert draft.quantization == target.quantization == (None if quantization == "none" else quantization)
    hidden = torch.randn(3, target.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(target.dtype)
    assert torch.equal(draft.logits(draft.final_norm(hidden)), target.logits(target.final_norm(hidden)))
