"""Qwen3.5's multi-token-prediction layer (model/mtp.py) against a float64 reference made of transformers' own
Qwen3.5 layers: from the target's final hidden states and the next tokens' embeddings, the layer's output at a
prompt's last position (its attention reading every position before) and the guess it makes there."""
from __future__ import annotations

import copy

import tiny
import torch
from safetensors.torch import load_file

from zhuzi.config import EngineConfig
from zhuzi.engine.core.kv.page_manager import PageManager
from zhuzi.engine.core.scheduler import scheduled
from zhuzi.engine.sequence import Sequence
from zhuzi.engine.worker.model_builder import build_model
from zhuzi.engine.worker.model_runner import ModelRunner
from zhuzi.model.mtp import MTP
from zhuzi.sampling_params import SamplingParams


def reference(hf, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The layer's output (after its final norm) at each position but the last, in float64."""
    model = copy.deepcopy(hf).double().model
    layer, norms = copy.deepcopy(model.layers[3]), {n: copy.deepcopy(model.norm) for n in ("e", "h", "out")}
    layer.load_state_dict({name.removeprefix("mtp.layers.0."): w.double() for name, w in weights.items()
                           if name.startswith("mtp.layers.0.")})
    for key, name in (("e", "pre_fc_norm_embedding"), ("h", "pre_fc_norm_hidden"), ("out", "norm")):
        norms[key].weight.data = weights[f"mtp.{name}.weight"].double()
    with torch.no_grad():
        tokens = torch.tensor([ids])
        hidden = model(tokens).last_hidden_state[:, :-1]
        x = torch.cat([norms["e"](model.embed_tokens(tokens[:, 1:])), norms["h"](hidden)], -1) @ \
            weights["mtp.fc.weight"].double().T
        positions = torch.arange(len(ids) - 1)[None]
        out = layer(x, position_embeddings=model.rotary_emb(x, positions), attention_mask=None,
                    position_ids=positions)
        return norms["out"](out[0] if isinstance(out, tuple) else out)[0], hidden[0]


def test_the_mtp_layer_computes_what_transformers_layers_do(tmp_path):
    hf = tiny.build("qwen3_5", tmp_path)
    tiny.add_mtp(tmp_path, load_file(tmp_path / "model.safetensors"), fc_scale=1.0, noise=0.1)
    weights = load_file(tmp_path / "model.safetensors")
    ids = [5, 17, 300, 42, 9, 811, 64, 2, 77, 530, 31, 8]
    expected, hidden = reference(hf, weights, ids)
    config = EngineConfig(str(tmp_path), dtype="float32", page_size=4)
    ckpt, target = build_model(config, config.model)
    runner = ModelRunner(MTP.load(ckpt.path, target, 4096), config, 8, [2])
    seq = Sequence(0, "r", 0, ids[1:], SamplingParams())
    assert PageManager(8, 4, enable_prefix_caching=False).allocate_slots(seq, len(ids) - 1)
    got = runner.last_hidden([scheduled(seq, len(ids) - 1)], [hidden.float()])[0]
    torch.testing.assert_close(got.double(), expected[-1], atol=1e-4, rtol=1e-4)
    logits = hf.lm_head.double()(expected[-1])
    assert int(runner.model.logits(got[None]).argmax()) == int(logits.argmax())
