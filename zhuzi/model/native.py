"""Native CPU kernels for the model: kernels/*.cpp compiled once per instruction-set variant (VARIANTS, with
explicit flags, never -march=native) into zhuzi's disk cache, keyed by their sources, compiler and flags, and
loaded with ctypes; the best variant this CPU runs is chosen at load (select()). A compile error raises; only a
missing compiler leaves torch's ops alone, with a warning. docs/cpu.md describes the variants.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from zhuzi.disk_cache import atomic_write, cache_path, one_maker

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "kernels"
# -ffp-contract=off: the kernels fuse their multiply-adds themselves (prelude.h's fmadd()); left to the compiler,
# a row's bits would follow its tuning and inlining, and a row must get the same bits alone and in a batch.
COMMON_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-shared", "-fPIC")
# Tuning for the CPU that builds, where the variant runs on that machine's architecture (kernels are built
# where they run): GCC's generic x86 tuning decodes slower (docs/benchmarks.md).
NATIVE_TUNING = {"x86_64": ("-mtune=native",)}
ANY = "any"  # a Variant's arch where it runs on every architecture
_X86_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "popcnt", "sse4_1", "sse4_2", "ssse3")


@dataclass(frozen=True)
class Variant:
    name: str
    arch: str  # platform.machine() of the CPUs it runs on, ANY for every one
    flags: tuple[str, ...]  # what the compiler targets (generic: how it optimizes)
    needs: tuple[str, ...]  # CPU features it executes, as /proc/cpuinfo names them
    bf16: bool  # computes in bf16 natively (dtype auto follows it)

    def missing(self, features: frozenset[str], machine: str) -> list[str]:
        """What this CPU lacks to run it (its architecture first)."""
        if self.arch not in (ANY, machine):
            return [self.arch]
        return [f for f in self.needs if f not in features]


VARIANTS = {v.name: v for v in (
    Variant("avx512", "x86_64", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi"),
            _X86_V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni",
                       "avx512vbmi"), bf16=True),
    Variant("avx2-vnni", "x86_64", ("-march=x86-64-v3", "-mavxvnni"), _X86_V3 + ("avx_vnni",), bf16=False),
    Variant("avx2", "x86_64", ("-march=x86-64-v3",), _X86_V3, bf16=False),
    Variant("neon-i8mm", "aarch64", ("-march=armv8.2-a+dotprod+i8mm",), ("asimd", "asimddp", "i8mm"), bf16=False),
    Variant("neon", "aarch64", ("-march=armv8.2-a+dotprod",), ("asimd", "asimddp"), bf16=False),
    # The plain reference: slow, for CPUs none of the above runs on. -O2 (after COMMON_FLAGS' -O3, so it wins):
    # -O3 took twice as long to compile it, a minute of a core in every cold `make test`, for code not meant fast.
    Variant("generic", ANY, ("-O2",), (), bf16=False),
)}
CHOICES = ("auto", *VARIANTS, "torch")
CROSS_COMPILERS = {"aarch64": "aarch64-linux-gnu-g++"}


class KernelBuildError(RuntimeError):
    """A kernel source that does not compile: a bug to fix, never a reason to run slower."""


@cache
def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, ARM `Features`); empty where unknown."""
    info = cpu_info()
    return frozenset((info.get("flags") or info.get("Features", "")).split())


def runnable() -> list[Variant]:
    """The variants this CPU runs, best first."""
    return [v for v in VARIANTS.values() if not v.missing(cpu_features(), platform.machine())]


def resolve(choice: str) -> str:
    """The variant a cpu_kernels setting means here; ValueError (one line) for one this CPU cannot run."""
    if choice == "torch":
        return choice
    if choice == "auto":
        best = runnable()
        return best[0].name if best else "torch"
    if choice not in VARIANTS:
        raise ValueError(f"unknown cpu_kernels {choice!r}; choose one of {', '.join(CHOICES)}")
    if lacks := VARIANTS[choice].missing(cpu_features(), platform.machine()):
        runs = ", ".join([v.name for v in runnable()] + ["torch"])
        what = (f"runs on {lacks[0]} CPUs, this one is {platform.machine()}" if lacks[0] == VARIANTS[choice].arch
                else f"needs {' '.join(lacks)}, which this CPU lacks")
        raise ValueError(f"cpu_kernels {choice} {what} (it runs: {runs})")
    return choice


def default_choice() -> str:
    return os.environ.get("ZHUZI_CPU_KERNELS") or "auto"


_selected: list[str] = []


def select(choice: str) -> str:
    """Make `choice` the process's kernels (every later entry() loads from its build); returns the variant."""
    name = resolve(choice)
    if _selected != [name]:
        log.info("CPU kernels: %s (%s)", name, "torch only" if name == "torch" else " ".join(flags(name)))
    _selected[:] = [name]
    return name


def current() -> str:
    """The process's variant (select(), else the default choice)."""
    return _selected[0] if _selected else select(default_choice())


def native_bf16(variant: str | None = None) -> bool:
    """Whether the kernels (or, without kernels, the CPU under torch) compute bf16 natively."""
    name = variant or current()
    if name != "torch":
        return VARIANTS[name].bf16
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & cpu_features())


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def tuning(variant: str) -> tuple[str, ...]:
    """The flags that tune a variant's build for this CPU: none for a cross build."""
    arch = VARIANTS[variant].arch
    return NATIVE_TUNING.get(arch, ()) if arch == platform.machine() else ()


def flags(variant: str) -> list[str]:
    """What the compiler targets and tunes for in a variant's build (COMMON_FLAGS aside)."""
    return [*VARIANTS[variant].flags, *tuning(variant)]


def tuned_for(variant: str) -> list[str]:
    """The CPU a variant's build is tuned for, for the cache key (a cache shared between machines must not
    serve a library tuned for another CPU): as /proc/cpuinfo names it, with its family and model, since a
    virtual machine may call a CPU only "AMD EPYC". Empty for a build not tuned."""
    if not tuning(variant):
        return []
    info = cpu_info()
    return [info.get(field, "") for field in ("vendor_id", "cpu family", "model", "model name")]


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def sources(name: str) -> list[Path]:
    """kernels/<name>.cpp and every header it includes, directly or through another, for any variant (an
    #include under any #if counts): the cache key must see each, and an edit elsewhere keeps its library.
    A quoted name is looked up as the compiler does: beside the includer, then in kernels/ (-I)."""
    source = (KERNELS / f"{name}.cpp").resolve()
    found, todo = {source}, [source]
    while todo:
        path = todo.pop()
        for included in _INCLUDE.findall(path.read_text()):
            header = next((p.resolve() for p in (path.parent / included, KERNELS / included) if p.is_file()), None)
            if header and header not in found:
                found.add(header)
                todo.append(header)
    return [source, *sorted(found - {source})]


def library(name: str, variant: str, cxx: str, extra: tuple[str, ...] = ()) -> Path:
    """Where the cache keeps the shared library of kernels/<name>.cpp for a variant, built with `extra`
    arguments after the variant's (the kernel tests' builds: another -O level, macros, a header given to
    -include, whose text the key takes as a source's)."""
    forced = [Path(extra[i + 1]) for i, arg in enumerate(extra[:-1]) if arg == "-include"]
    arguments = [Path(arg).name if Path(arg) in forced else arg for arg in extra]  # its text, not its folder
    key = [*(p.read_text() for p in [*sources(name), *forced]), cxx, *COMMON_FLAGS, *flags(variant), *arguments,
           *tuned_for(variant)]
    return cache_path("kernels", f"{name}-{variant}", *key, suffix=".so")


def build(name: str, variant: str, cxx: str, extra: tuple[str, ...] = ()) -> Path:
    """The shared library of kernels/<name>.cpp for a variant (with `extra` arguments: library()), from the
    cache or compiled now."""
    lib = library(name, variant, cxx, extra)
    if lib.exists():
        return lib
    with one_maker(lib):
        if lib.exists():  # another process built it while this one waited
            return lib
        command = [cxx, *COMMON_FLAGS, *flags(variant), *extra, f"-I{KERNELS}", str(KERNELS / f"{name}.cpp")]
        with atomic_write(lib) as tmp:
            done = subprocess.run([*command, "-o", str(tmp)], capture_output=True, text=True, timeout=600)
            if done.returncode:
                raise KernelBuildError(f"{cxx} could not build kernels/{name}.cpp for {variant}:\n{done.stderr}")
    return lib


def build_all(variant: str, cxx: str, extra: tuple[str, ...] = ()) -> dict[str, Path]:
    """Every kernels/*.cpp library of a variant, the missing ones compiled side by side."""
    names = [src.stem for src in sorted(KERNELS.glob("*.cpp"))]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(names, pool.map(lambda name: build(name, variant, cxx, extra), names)))


_libraries: dict[tuple[str, str], ctypes.CDLL | None] = {}


def load(name: str, variant: str | None = None) -> ctypes.CDLL | None:
    """The library of kernels/<name>.cpp for the variant (default: the process's); None for `torch` or
    without a compiler (warned once)."""
    variant = variant or current()
    key = (name, variant)
    if key not in _libraries:
        _libraries[key] = _open(name, variant)
    return _libraries[key]


def _open(name: str, variant: str) -> ctypes.CDLL | None:
    if variant == "torch":
        return None
    cxx = compiler()
    if cxx is None:
        log.warning("CPU kernel %s unavailable, using the torch path: no C++ compiler found (set CXX)", name)
        return None
    if not any(variant == built for _, built in _libraries):
        build_all(variant, cxx)
    lib = ctypes.CDLL(str(build(name, variant, cxx)))
    log.info("CPU kernel %s: %s build", name, variant)
    return lib


_entries: dict[tuple[str, str, str], Callable[..., int] | None] = {}


def entry(name: str, symbol: str, argtypes: list[type], variant: str | None = None) -> Callable[..., int] | None:
    """kernels/<name>.cpp's function `symbol` in the variant's build (default: the process's), returning an
    int status, with its C signature set; None where there is no build (torch, no compiler)."""
    variant = variant or current()
    key = (variant, name, symbol)
    if key not in _entries:
        lib = load(name, variant)
        fn = getattr(lib, symbol) if lib is not None else None
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
        _entries[key] = fn
    return _entries[key]
