"""Native CPU kernels for the model: compile once for this CPU, load with ctypes.

The kernels are C++ sources in kernels/ (each includes kernels/prelude.h). Each is
compiled on first use with the system C++ compiler for this very CPU (-march=native)
into the zhuzi cache, keyed by its sources, the compiler, the flags and the CPU, and
loaded with ctypes. They run on torch's OpenMP thread pool (the same libgomp).
Without a compiler `load` returns None and the caller's torch path runs; a kernel that fails to
compile or load raises KernelBuildError (a bug to fix, never a silent fallback).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from zhuzi.cache import atomic_write, cache_path

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]


class KernelBuildError(RuntimeError):
    """A kernel's source did not compile, or its library did not load."""


def compiler() -> str | None:
    """The C++ compiler the kernels are built with ($CXX, else c++ or g++), or None."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cpu_flags() -> str:
    # -march=native code must not be reused on another CPU sharing the cache directory.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def _build(cxx: str, name: str) -> Path:
    sources = [KERNELS / f"{name}.cpp", *sorted(KERNELS.glob("*.h"))]
    lib = cache_path("kernels", name, *(p.read_text() for p in sources), cxx, *_FLAGS, _cpu_flags(),
                     suffix=".so")
    if not lib.exists():
        with atomic_write(lib) as tmp:
            subprocess.run([cxx, *_FLAGS, f"-I{KERNELS}", str(sources[0]), "-o", str(tmp)], check=True,
                           capture_output=True, text=True, timeout=300)
    return lib


def entry(name: str, symbol: str, argtypes: list[type]) -> Callable[..., int] | None:
    """kernels/<name>.cpp's function symbol, returning an int status, with its C signature set; or None when
    there is no C++ compiler."""
    lib = load(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return fn


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The library built from kernels/<name>.cpp, or None (warned once) when there is no C++ compiler.
    Raises KernelBuildError when the source does not compile or the library does not load."""
    cxx = compiler()
    if cxx is None:
        log.warning("CPU kernel %s unavailable, using the torch path: no C++ compiler found (set CXX)", name)
        return None
    try:
        return ctypes.CDLL(str(_build(cxx, name)))
    except subprocess.CalledProcessError as e:
        raise KernelBuildError(f"kernels/{name}.cpp does not compile with {cxx}:\n{e.stderr}") from e
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"kernels/{name}.cpp could not be built or loaded with {cxx}: {e}") from e
