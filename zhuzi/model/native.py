"""Native CPU kernels for the model runner: compile once for this CPU, load with ctypes.

The decode kernels (cpu_attention.py, cpu_linear.py) are small C++ sources held as
strings. Each is compiled on first use with the system C++ compiler for this very
CPU (-march=native) into a cache directory keyed by source, compiler, flags and CPU,
and loaded with ctypes. They run on torch's OpenMP thread pool (the same libgomp).
Without a compiler `load` returns None and the caller's torch path runs.

Every source is compiled after PRELUDE, the helpers both kernels use.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

PRELUDE = r"""
#include <cstdint>
#include <cstring>

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));

static inline float hsum(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  typedef float v2 __attribute__((vector_size(8)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
       + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  v2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

static inline float widen(uint16_t b) { uint32_t u = uint32_t(b) << 16; float x; std::memcpy(&x, &u, 4); return x; }
static inline void store(float x, float* p) { *p = x; }
static inline void store(float x, uint16_t* p) {  // round to nearest even; a NaN stays a NaN
  uint32_t u; std::memcpy(&u, &x, 4);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  *p = nan ? uint16_t((u >> 16) | 0x40) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]


def _cache_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / "zhuzi_native"


def _cpu_flags() -> str:
    # -march=native code must not be reused on another CPU sharing the cache directory.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def _build(cxx: str, name: str, source: str) -> Path:
    key = hashlib.sha256("\n".join([source, cxx, *_FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"{name}_{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"{lib.stem}.{os.getpid()}")  # concurrent builders each rename their own
    src, obj = tmp.with_suffix(".cpp"), tmp.with_suffix(".so")
    src.write_text(source)
    try:
        subprocess.run([cxx, *_FLAGS, str(src), "-o", str(obj)], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(obj, lib)
    finally:
        src.unlink(missing_ok=True)
    return lib


@functools.cache
def load(name: str, source: str) -> ctypes.CDLL | None:
    """The library built from PRELUDE + source, or None (warned once) when it cannot be built or loaded."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    try:
        if cxx is None:
            raise OSError("no C++ compiler found (set CXX)")
        return ctypes.CDLL(str(_build(cxx, name, PRELUDE + source)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or e
        log.warning("CPU kernel %s unavailable, using the torch path: %s", name, detail)
        return None

