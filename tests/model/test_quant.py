"""Quantization at load into GGUF blocks: int4 of a Q4_1 GGUF is its own weights, bit for bit (and the LM head's
Q8_0 likewise); elsewhere each weight moves by at most half a quantization step; the blocks are the gguf
package's format (its reference dequantizer reads them); a matrix is quantized once, then mapped from the cache."""
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from zhuzi.model.quant import quantize, quantize_q4_1, quantize_q8_0

Q = gguf.GGMLQuantizationType


def gguf_tensor(path, name: str, qtype) -> torch.Tensor:
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    assert tensor.tensor_type == qtype
    shape = tuple(int(s) for s in reversed(tensor.shape))
    return torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(shape))


def values(rows: torch.Tensor, qtype) -> torch.Tensor:
    """What the gguf package reads from rows of blocks."""
    return torch.from_numpy(gguf.quants.dequantize(rows.numpy(), qtype))


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_up.weight"])
def test_smollm2_q4_1_blocks_are_kept_exactly(smollm2_path, name):
    w = gguf_tensor(smollm2_path, name, Q.Q4_1)
    assert torch.equal(values(quantize_q4_1(w), Q.Q4_1), w)
    assert torch.equal(values(quantize_q4_1(w.bfloat16()), Q.Q4_1), w)  # from the loader's bf16 tensors too


def test_smollm2_q8_0_embedding_is_kept_exactly(smollm2_path):
    w = gguf_tensor(smollm2_path, "token_embd.weight", Q.Q8_0)[:4096]
    assert torch.equal(values(quantize_q8_0(w), Q.Q8_0), w)


@pytest.mark.parametrize("n", [16, 37, 100])
def test_q4_1_and_q8_0_errors_are_within_half_a_step(n):
    w = torch.randn(n, 96, generator=torch.Generator().manual_seed(n)) * 0.05
    groups = w.view(n, 3, 32)
    q4_step = (groups.amax(-1) - groups.amin(-1)) / 15
    q8_step = groups.abs().amax(-1) / 127
    fp16 = 1e-3 * w.abs().max()  # scales and minimums are stored in fp16
    assert ((values(quantize_q4_1(w), Q.Q4_1) - w).abs().view(n, 3, 32) <= q4_step[..., None] / 2 + fp16).all()
    assert ((values(quantize_q8_0(w), Q.Q8_0) - w).abs().view(n, 3, 32) <= q8_step[..., None] / 2 + fp16).all()


def test_a_quantized_matrix_is_a_block_weight_of_its_type():
    w = torch.randn(20, 64)
    blocks = quantize(w, Q.Q8_0)
    assert blocks.qtype == Q.Q8_0 and blocks.shape == (20, 64) and blocks.data.shape == (20, 2 * 34)
    assert torch.equal(blocks.dequantize(), values(quantize_q8_0(w), Q.Q8_0))


def test_shapes_the_blocks_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4_1(torch.randn(16, 40))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.randn(16, 33))


def test_a_matrix_is_quantized_once_then_mapped_from_the_disk_cache(tmp_path, monkeypatch):
    """A second load of the same weights maps the first's blocks (and, through them, their packed copy) instead
    of quantizing again; other values are other blocks."""
    monkeypatch.setenv("ZHUZI_CACHE", str(tmp_path))
    stale = tmp_path / "quantized" / "an-earlier-quant.py" / "Q4_1-0123"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"blocks of other code")
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    first = quantize(w, Q.Q4_1)
    assert not stale.parent.exists()  # an earlier version's entries go: the cache does not grow with each change
    entry = Path(first.origin.file[0])
    assert entry.is_relative_to(tmp_path) and torch.equal(first.data, quantize_q4_1(w))
    made = entry.stat().st_mtime_ns
    again = quantize(w.clone(), Q.Q4_1)
    assert again.origin == first.origin and entry.stat().st_mtime_ns == made
    assert torch.equal(again.data, first.data)
    assert torch.equal(again.pack().data, first.pack().data) and any((tmp_path / "packed").iterdir())
    assert quantize(w * 2, Q.Q4_1).origin.file[0] != str(entry)
    assert quantize(w, Q.Q8_0).origin.file[0] != str(entry)
    assert quantize(w.float(), Q.Q4_1).origin.file[0] != str(entry)  # other bytes, though the same values
