"""The kernels' C++ unit tests (tests/kernels) as one program per CPU variant, cached in zhuzi's disk cache as the
kernels are. A variant this CPU runs links the libraries the product loads (the same cache entries); one it lacks
is emulated (x86: tests/kernels/emulate.h) or cross-compiled (aarch64, run under qemu), the kernels its tests call
compiled into one library of its own. `python -m tests.kernel_builds` builds every program this machine's suite
runs, side by side, before pytest starts (make test); a test that finds none builds its own."""
from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from zhuzi.disk_cache import atomic_write, cache_path, one_maker
from zhuzi.model import native

TESTS = Path(__file__).parent / "kernels"
X86 = [v.name for v in native.runnable() if v.arch == "x86_64"]
NATIVE = [*X86, "generic"]  # generic runs on every CPU
# x86 variants this CPU may lack, emulated in an x86-64-v3 build: the variant and the macros emulate.h reads.
# avx512 with and without AMX: AMX takes its prefill rows past 8.
EMULATED = {"avx512": ("avx512", ("-DZHUZI_EMULATE_AVX512",)),
            "avx512-amx": ("avx512", ("-DZHUZI_EMULATE_AVX512", "-DZHUZI_EMULATE_AMX")),
            "avx2-vnni": ("avx2-vnni", ("-DZHUZI_EMULATE_AVXVNNI",))}
LACKED = [name for name, (variant, _) in EMULATED.items()
          if variant not in X86 or (name.endswith("amx") and "amx_int8" not in native.cpu_features())]
SIMDE = Path("/usr/include/simde/x86/avx512.h")
CAN_EMULATE = platform.machine() == "x86_64" and "avx2" in X86 and SIMDE.exists()
ARM = {"neon-i8mm": "max", "neon": "neoverse-n1"}  # qemu's CPU models: with and without i8mm
CROSS = native.CROSS_COMPILERS["aarch64"]
CAN_CROSS = bool(shutil.which(CROSS) and shutil.which("qemu-aarch64"))
ENTRY = re.compile(r'extern "C" \w+ (zhuzi_\w+)')
FILES = (".cpp", ".h", ".so")  # what a build's key takes by its contents


@dataclass(frozen=True)
class KernelTests:
    """The C++ unit tests built for one variant."""
    name: str  # the test's id: the variant, or what of it is emulated
    variant: str  # whose code runs: the program prints its name
    cxx: str
    build_as: str  # the variant whose flags compile it (x86-64-v3's where a variant is emulated)
    extra: tuple[str, ...] = ()  # arguments after those flags: the -O level, emulate.h and its macros
    runner: tuple[str, ...] = ()  # what runs the program (qemu), nothing where this CPU does

    @property
    def own_library(self) -> bool:
        """Its kernels are built for the tests alone: the product never loads them with these arguments."""
        return bool(self.extra)


def natively(variant: str) -> KernelTests:
    return KernelTests(variant, variant, native.compiler(), variant)


def emulated(name: str) -> KernelTests:
    # -O0: SIMDe's emulation takes GCC three times as long at -O1, and these tests run natively in seconds either way
    variant, macros = EMULATED[name]
    return KernelTests(name, variant, native.compiler(), "avx2", ("-O0", "-include", str(TESTS / "emulate.h"), *macros))


def under_qemu(variant: str) -> KernelTests:
    sysroot = Path(subprocess.run([CROSS, "-print-file-name=libc.so.6"], capture_output=True, text=True,
                                  check=True).stdout.strip()).resolve().parent.parent
    # -O1: -O3's minute of compiling buys nothing here
    return KernelTests(variant, variant, CROSS, variant, ("-O1",), ("qemu-aarch64", "-L", str(sysroot), "-cpu",
                                                                    ARM[variant]))


def buildable() -> list[KernelTests]:
    """Every build this machine's suite runs: what tests/model/test_native.py does not skip here."""
    return ([natively(v) for v in NATIVE] if native.compiler() else []) + \
        ([emulated(name) for name in LACKED] if CAN_EMULATE and native.compiler() else []) + \
        ([under_qemu(v) for v in ARM] if CAN_CROSS else [])


def exercised() -> list[Path]:
    """The kernels/*.cpp whose entry points the C++ tests call."""
    called = set(re.findall(r"\bzhuzi_\w+", "".join(p.read_text() for p in TESTS.glob("*.cpp"))))
    return [src for src in sorted(native.KERNELS.glob("*.cpp")) if called & set(ENTRY.findall(src.read_text()))]


@cache
def headers() -> list[Path]:
    """What the sources may include: every header of the kernels and of their tests."""
    return sorted([*native.KERNELS.rglob("*.h"), *TESTS.glob("*.h")])


def cached(kind: str, name: str, command: list[str], *key: str, suffix: str = "") -> Path:
    """What `command` makes at the path given after its -o, from the cache or made now. Keyed by `key`, the
    command with each source and library in it taken by its contents (a clone elsewhere finds the entry, an edit
    does not) and the include folder by every header's text."""
    named = [digest(arg) if arg.endswith(FILES) else arg for arg in command if not arg.startswith("-I")]
    made = cache_path(kind, name, *key, *named, *(p.read_text() for p in headers()), suffix=suffix)
    if made.exists():
        return made
    with one_maker(made):
        if not made.exists():  # another process made it while this one waited
            with atomic_write(made) as tmp:
                done = subprocess.run([*command, "-o", str(tmp)], capture_output=True, text=True, timeout=600)
                if done.returncode:
                    raise native.KernelBuildError(f"{command[0]} could not build {name}:\n{done.stderr}")
    return made


def digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def libraries(tests: KernelTests) -> list[Path]:
    """The kernel libraries the program links: the product's, or one of its own (tuned as the product's are)."""
    if not tests.own_library:
        return list(native.build_all(tests.variant, tests.cxx).values())
    command = [tests.cxx, *native.COMMON_FLAGS, *native.flags(tests.build_as), *tests.extra, f"-I{native.KERNELS}",
               *map(str, exercised())]
    return [cached("kernels", f"kernel-tests-{tests.name}", command, *native.tuned_for(tests.build_as), suffix=".so")]


def program(tests: KernelTests) -> Path:
    """The unit tests' program for the variant, linked against its kernel libraries."""
    command = [tests.cxx, "-O1", *native.VARIANTS[tests.build_as].flags, *tests.extra, "-fopenmp",
               f"-I{native.KERNELS}", *map(str, sorted(TESTS.glob("*.cpp"))), *map(str, libraries(tests)), "-lm"]
    return cached("kernel-tests", tests.name, command)


def run(tests: KernelTests) -> subprocess.CompletedProcess:
    # Threads that spin at barriers crawl on a shared machine; the tests count checks, not time.
    return subprocess.run([*tests.runner, str(program(tests))], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"OMP_WAIT_POLICY": "passive"})


def main() -> None:
    """Build every program this machine's suite runs, one compiler per core."""
    def build(tests: KernelTests) -> str:
        start = time.monotonic()
        program(tests)
        return f"kernel tests {tests.name}: {time.monotonic() - start:.0f} s"

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for line in pool.map(build, buildable()):
            print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
