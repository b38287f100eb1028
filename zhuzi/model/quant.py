"""Quantization at load (`--quantization int4|int8`, decoder -> linear.py): dense weights into GGUF blocks,
cached by the values they were made from, which then run as a GGUF file's do (blocks.py: the same packing,
packed cache, kernels and fused step). int4 is Q4_1 with a Q8_0 LM head (4 bits cost too much top-1 agreement
there); int8 is Q8_0 throughout (docs/cpu.md)."""
from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch

from zhuzi.disk_cache import atomic_write, cache_root, file_identity
from zhuzi.model.blocks import BlockWeight, Origin

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
BLOCK = 32  # inputs a block
# Block type of the layers and of the LM head for each quantization made at load.
FORMATS = {"int4": (Q.Q4_1, Q.Q8_0), "int8": (Q.Q8_0, Q.Q8_0)}


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> float32 [N, K / 32, 32]."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {BLOCK}: no GGUF blocks for this matrix")
    return weight.float().reshape(n, k // BLOCK, BLOCK)


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp16 [N, blocks] -> their bytes, uint8 [N, blocks, 2]."""
    return values.contiguous().view(torch.uint8).view(*values.shape, 2)


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> Q4_1 rows, uint8 [N, K / 32 * 20]: per block d, m, then byte j holds code j (low nibble)
    and code j + 16 (high). d and m come from the block's range, which reproduces a Q4_1 file's blocks exactly:
    int4 of a Q4_1 GGUF is its own weights."""
    w = _blocks(weight)
    lo, hi = w.amin(-1), w.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()  # rounded first: the codes are chosen against the stored values
    step = d.float()[..., None]
    q = torch.where(step > 0, torch.round((w - m.float()[..., None]) / step.clamp(min=1e-30)), 0).clamp(0, 15)
    q = q.to(torch.uint8)
    codes = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([_half_bytes(d), _half_bytes(m), codes], -1).view(w.shape[0], -1)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> Q8_0 rows, uint8 [N, K / 32 * 34]: per block d, then 32 int8 codes."""
    w = _blocks(weight)
    d = (w.abs().amax(-1) / 127).half()
    q = torch.round(w / d.float().clamp(min=1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    return torch.cat([_half_bytes(d), q.view(torch.uint8)], -1).view(w.shape[0], -1)


_QUANTIZERS = {Q.Q4_1: quantize_q4_1, Q.Q8_0: quantize_q8_0}


# The quantizers' own code: entries are kept in a folder per version, and an entry made by other code is made anew.
VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
_current: set[Path] = set()  # version folders this process has cleared the others beside


def quantize(weight: torch.Tensor, qtype: Q) -> BlockWeight:
    """weight [N, K] as a matrix of qtype's blocks (Q4_1 or Q8_0): a mapping of its disk cache entry, made on a
    miss; in memory where the cache cannot be written."""
    entry = _folder() / f"{qtype.name}-{_digest(weight)}"
    if not entry.exists():
        rows = _QUANTIZERS[qtype](weight.cpu())
        try:
            with atomic_write(entry) as tmp:  # two loads at once each write the same bytes; the last rename wins
                rows.numpy().tofile(tmp)
        except OSError as e:
            log.warning("quantized weights cannot be cached in %s (%s): every load quantizes them", entry.parent, e)
            return BlockWeight(qtype, rows, weight.shape[1])
    data = torch.from_numpy(np.memmap(entry, dtype=np.uint8, mode="c")).view(weight.shape[0], -1)
    return BlockWeight(qtype, data, weight.shape[1], origin=Origin(file_identity(entry), 0))


def _folder() -> Path:
    """This version's folder; once a process, the folders of other versions go (their packed copies follow: a
    packed folder whose source file is gone is stale, blocks.py), so the cache does not grow with each change."""
    folder = cache_root() / "quantized" / VERSION
    if folder not in _current:
        for other in folder.parent.glob("*"):
            if other.is_dir() and other != folder:
                shutil.rmtree(other, ignore_errors=True)
            elif other.is_file():
                other.unlink(missing_ok=True)
        _current.add(folder)
    return folder


def _digest(weight: torch.Tensor) -> str:
    """The matrix's values (after smoothing, in the dtype they were loaded in), its shape and dtype."""
    w = weight.detach().cpu().contiguous()
    digest = hashlib.blake2b(f"{tuple(w.shape)} {w.dtype}".encode(), digest_size=16)
    digest.update(w.view(torch.uint8).numpy())
    return digest.hexdigest()
