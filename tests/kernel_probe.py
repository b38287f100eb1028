"""Whether a native kernel serves this CPU, probed once per test module: a kernel test skips only there.

A kernel that fails to build is an error (native.KernelBuildError), so the suite fails loudly; only a
machine without a C++ compiler skips on that account. A kernel that builds but declines the probe's call
(a status "not served", e.g. an AVX512-BF16 path on an AVX2-only CPU) skips its tests.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest

from zhuzi.model import native


def serves(kernel: str, probe: Callable[[], object | None]) -> pytest.MarkDecorator:
    """A mark that skips its tests unless kernels/<kernel>.cpp builds here and probe(), one real call of it,
    returns a result rather than None."""
    if native.compiler() is None:
        return pytest.mark.skip(reason=f"no C++ compiler to build kernels/{kernel}.cpp")
    native.load(kernel)  # raises when it does not compile
    if probe() is None:
        return pytest.mark.skip(reason=f"kernels/{kernel}.cpp does not serve this CPU (its probe call was declined)")
    return pytest.mark.skipif(False, reason=f"kernels/{kernel}.cpp serves this CPU")
