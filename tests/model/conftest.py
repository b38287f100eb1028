"""The CPU variants the kernel tests run under (native.py): every variant this CPU runs, each test once per
variant through the `variant` fixture (avx512 and avx2 on an AVX-512 machine, avx2 alone on an AVX2 one).
The avx2-vnni and neon-i8mm sub-paths differ from their base in the int8 dot-product instructions; where the
base runs too, the C++ unit tests (test_native.py) cover them against float64, which keeps the suite short.
So do they cover generic (slow, and the same bits as the SIMD variants where the kernels promise them: one
test here compares them), unless it is all this CPU runs."""
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from zhuzi.disk_cache import cache_root
from zhuzi.model import native

SUBPATHS = {"avx2-vnni": "avx2", "neon-i8mm": "neon"}
RUNNABLE = [v.name for v in native.runnable()]
SIMD = [v for v in RUNNABLE if SUBPATHS.get(v) not in RUNNABLE and v != "generic"]
VARIANTS = (SIMD or RUNNABLE) if native.compiler() else []


@pytest.fixture(params=VARIANTS or [pytest.param(None, marks=pytest.mark.skip(reason="no kernels: no compiler "
                                                                                   "or no variant for this CPU"))])
def variant(request):
    """The test runs with the process's kernels switched to this variant."""
    before = native.current()
    native.select(request.param)
    yield request.param
    native.select(before)


def q8_bound(x: torch.Tensor, w: torch.Tensor, span: int = 32) -> torch.Tensor:
    """[M, N]: how far x @ w.T can move when each row of x is rounded to q8 codes (kernels/q8.h), one scale per
    `span` inputs (32, or 256 for the K-quants): half a step, amax / 254, times the span's |weights|."""
    m, k = x.shape
    pad = -k % span
    xb = torch.nn.functional.pad(x.double(), (0, pad)).view(m, -1, span).abs().amax(-1)  # [M, spans]
    wb = torch.nn.functional.pad(w.double().abs(), (0, pad)).view(w.shape[0], -1, span).sum(-1)  # [N, spans]
    return xb / 254 @ wb.T * (1 + 1e-6)


def cache_beside_kernels(directory: Path) -> Path:
    """directory as a cache root ($ZHUZI_CACHE) that keeps a test's entries out of the user's home, but for the
    compiled kernels: the rest of the suite builds them in the user's cache, and building them anew is slow."""
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kernels").symlink_to(kernels, target_is_directory=True)
    return directory


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A module's own cache (cache_beside_kernels)."""
    with pytest.MonkeyPatch.context() as patch:
        directory = cache_beside_kernels(tmp_path_factory.mktemp("zhuzi-cache"))
        patch.setenv("ZHUZI_CACHE", str(directory))
        yield directory
