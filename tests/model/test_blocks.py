"""GGUF blocks kept as the file stores them: their values are gguf's reference values, bit for bit, whether
a whole matrix is dequantized or a step's embedding rows are taken; and a file's matrices are packed once, into
the disk cache, whose entries later loads map."""
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import cache_beside_kernels
from gguf_blocks import KERNEL_TYPES, random_blocks
from test_decoder import full_logits

from zhuzi.model import cpu_blocks
from zhuzi.model.blocks import BlockWeight
from zhuzi.model.decoder import Decoder
from zhuzi.model.loader import load_checkpoint


def weight(qtype, rows=12, cols=512) -> BlockWeight:
    return BlockWeight(qtype, torch.from_numpy(random_blocks(qtype, rows, cols)), cols)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_values_equal_gguf_reference_bit_for_bit(qtype):
    w = weight(qtype)
    assert cpu_blocks.dequantize_serves(qtype)
    reference = gguf.quants.dequantize(w.data.numpy(), qtype)
    assert np.array_equal(w.dequantize().numpy(), reference)
    assert torch.equal(w.dequantize(torch.bfloat16), torch.from_numpy(reference).bfloat16())


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_0], ids=str)
def test_taken_rows_are_the_rows_values(qtype):
    w = weight(qtype)
    ids = torch.tensor([[3, 0], [11, 3]])
    assert torch.equal(w.take(ids, torch.float32), w.dequantize()[ids])
    assert torch.equal(w[2:5].dequantize(), w.dequantize()[2:5])


def test_an_id_outside_the_matrix_is_an_error():
    with pytest.raises(IndexError, match="outside 0..11"):
        weight(gguf.GGMLQuantizationType.Q8_0).take(torch.tensor([12]), torch.float32)


def test_a_type_without_a_kernel_gets_gguf_values():
    qtype = gguf.GGMLQuantizationType.TQ2_0  # no kernel: the gguf package dequantizes it
    data = random_blocks(gguf.GGMLQuantizationType.Q6_K, 4, 256)[:, :66]  # any bytes make TQ2_0 values
    w = BlockWeight(qtype, torch.from_numpy(np.ascontiguousarray(data)), 256)
    assert not cpu_blocks.dequantize_serves(qtype)
    assert np.array_equal(w.dequantize().numpy(), gguf.quants.dequantize(data, qtype), equal_nan=True)


# ---------------------------------------------------------------- a file's matrices, packed once

K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # SmolLM2's: 192 x 576 Q4_1, 12 groups of 16 rows


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache (the kernels aside) for the test; without the block kernels nothing is packed: a skip."""
    if not cpu_blocks.linear_serves(gguf.GGMLQuantizationType.Q4_1):
        pytest.skip("no block kernels here")
    monkeypatch.setenv("ZHUZI_CACHE", str(cache_beside_kernels(tmp_path / "cache")))
    return tmp_path / "cache"


def entries(cache: Path) -> dict[Path, tuple[int, int]]:
    """The packed matrices the cache holds, each with its inode and mtime (both change when it is written)."""
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (cache / "packed").glob("*/*")}


def mapped_files() -> set[Path]:
    """The files mapped into this process."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {Path(line.split(maxsplit=5)[5]) for line in lines if len(line.split(maxsplit=5)) == 6}


def gguf_decoder(path: Path) -> Decoder:
    checkpoint = load_checkpoint(path, torch.bfloat16)
    return Decoder(checkpoint.config, checkpoint.tensors, quantization="gguf")


def packed_parts(model: Decoder) -> list[BlockWeight]:
    layers = [model.lm_head] + [getattr(h, p) for layer in model.layers for h, p in layer.matrices]
    return [part for layer in layers for part in layer.parts]


def test_a_files_matrices_are_packed_once_then_mapped_from_the_cache(smollm2_path, cache, caplog):
    """The first load packs every matrix of SmolLM2 into the cache and runs on the entries' mappings; the
    next makes none anew and maps the same entries; an unwritable cache packs in memory. All three give the
    same packed bytes and the same logits, bit for bit."""
    (cache / "packed").write_text("in the way")  # no folder can be made there, even by root
    with caplog.at_level(logging.WARNING, logger="zhuzi.model.blocks"):
        uncached = gguf_decoder(smollm2_path)
    assert "cannot be cached" in caplog.text
    (cache / "packed").unlink()

    first = gguf_decoder(smollm2_path)
    made = entries(cache)
    second = gguf_decoder(smollm2_path)

    models = (uncached, first, second)
    parts = [packed_parts(model) for model in models]
    assert len(made) == len(parts[0]) and all(part.packed for part in parts[0])
    assert entries(cache) == made  # not one written again
    assert set(made) <= mapped_files()  # the packed bytes are the entries' pages, not a copy
    assert all(torch.equal(a.data, b.data) and torch.equal(a.data, c.data) for a, b, c in zip(*parts, strict=True))
    ids = list(range(1, 40, 3))
    logits = [full_logits(model, ids) for model in models]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_row_ranges_of_a_matrix_are_cached_apart(smollm2_path, cache):
    """A rank's rows of a matrix (tensor parallelism, Phi-3's fused q, k, v) are entries of their own."""
    w = load_checkpoint(smollm2_path).tensors[K_PROJ]
    top, bottom, whole = w[:64].pack(), w[64:].pack(), w.pack()
    assert len(entries(cache)) == 3
    assert torch.equal(torch.cat([top.data, bottom.data]), whole.data)  # 16-row groups, one after another
    assert torch.equal(top.dequantize(), w[:64].dequantize())


def test_loads_packing_the_same_matrix_at_once_leave_one_whole_entry(smollm2_path, cache):
    """Two servers (or test workers) starting on a cold cache: each maps a whole entry, the bytes packed in memory."""
    embedding = "model.embed_tokens.weight"  # 49152 x 576 Q8_0: 28 MB packed, long enough to overlap
    loads = [load_checkpoint(smollm2_path).tensors[embedding] for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        packed = list(pool.map(BlockWeight.pack, loads))
    in_memory = BlockWeight(loads[0].qtype, loads[0].data, loads[0].in_features).pack()
    assert all(torch.equal(p.data, in_memory.data) for p in packed)
    assert len(entries(cache)) == 1 and not list((cache / "packed").glob("*/.*"))  # no temporary file left


def folders(cache: Path) -> set[Path]:
    return {entry.parent for entry in entries(cache)}


def test_a_changed_file_is_packed_anew_and_its_old_entries_leave(smollm2_path, cache, tmp_path):
    """A GGUF written again (a new mtime) is never answered from its old version's entries, and those leave the
    cache once the new ones are made (every version would hold a whole model's bytes); so do a deleted file's,
    while a file of the same name elsewhere keeps its own."""
    path, twin, gone = (tmp_path / where / "model.gguf" for where in ("models", "twin", "gone"))
    folder = {}
    for copy in (twin, gone, path):
        copy.parent.mkdir()
        shutil.copyfile(smollm2_path, copy)
        known = folders(cache)
        w = load_checkpoint(copy).tensors[K_PROJ]
        before = w.pack().dequantize()
        (folder[copy],) = folders(cache) - known
    gone.unlink()
    twins = {entry: stat for entry, stat in entries(cache).items() if entry.parent == folder[twin]}

    with path.open("r+b") as f:  # the file's first row of k_proj becomes its second
        f.seek(w.origin.offset)
        f.write(w.data[1].numpy().tobytes())
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    changed = load_checkpoint(path).tensors[K_PROJ]
    after = changed.pack().dequantize()

    assert torch.equal(after[0], before[1]) and torch.equal(after[1:], before[1:])
    (new,) = folders(cache) - set(folder.values())
    assert folders(cache) == {new, folder[twin]}
    assert torch.equal(load_checkpoint(twin).tensors[K_PROJ].pack().dequantize(), before)
    assert twins and {entry: entries(cache)[entry] for entry in twins} == twins  # a hit, not packed again
