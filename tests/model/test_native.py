"""native.py: the variant this CPU runs is chosen and a forced one it cannot run is refused in one line; a
kernel that does not compile fails loudly; and the kernels' own C++ unit tests (tests/kernels, against
float64 references) pass for every x86 variant this CPU runs and for generic, natively; for the x86 variants
it lacks, their intrinsics emulated (tests/kernels/emulate.h); and for both aarch64 variants, cross-compiled
and run under qemu-aarch64 (the neon one on a CPU model without i8mm)."""
import platform
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kernel_builds
import pytest
from kernel_builds import ARM, LACKED, NATIVE, X86

from zhuzi.model import native

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)


def test_auto_picks_the_first_variant_this_cpu_runs():
    best = native.runnable()
    assert native.resolve("auto") == best[0].name
    assert best[-1].name == "generic"  # last: auto takes it only where no SIMD variant runs
    assert native.resolve("torch") == "torch"
    assert [v.name for v in best] == [v for v in native.VARIANTS if v in {b.name for b in best}]  # best first


def test_a_cpu_no_simd_variant_runs_on_gets_the_generic_kernels(monkeypatch):
    monkeypatch.setattr(native.platform, "machine", lambda: "riscv64")
    assert [v.name for v in native.runnable()] == ["generic"] and native.resolve("auto") == "generic"
    with pytest.raises(ValueError, match=r"^cpu_kernels avx2 runs on x86_64 CPUs, this one is riscv64 \(it runs: "
                                         r"generic, torch\)$"):
        native.resolve("avx2")


def test_a_variant_this_cpu_cannot_run_is_a_one_line_error():
    other = "neon" if platform.machine() != "aarch64" else "avx2"
    with pytest.raises(ValueError, match=f"^cpu_kernels {other} runs on .* CPUs, this one is .*it runs: ") as info:
        native.resolve(other)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="unknown cpu_kernels 'sse2'; choose one of auto, avx512"):
        native.resolve("sse2")


@pytest.mark.skipif("avx512" in X86 or platform.machine() != "x86_64", reason="this CPU runs avx512")
def test_avx512_is_refused_naming_what_the_cpu_lacks():
    with pytest.raises(ValueError, match="^cpu_kernels avx512 needs .*avx512.*, which this CPU lacks"):
        native.resolve("avx512")


def test_the_selected_variant_serves_entries(monkeypatch):
    before = native.current()
    try:
        assert native.select("torch") == "torch" and native.current() == "torch"
        assert native.entry("small_m_linear", "zhuzi_small_m_linear", []) is None
    finally:
        native.select(before)


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
def test_a_kernel_that_does_not_compile_raises(tmp_path, monkeypatch):
    (tmp_path / "broken.cpp").write_text("int broken( {\n")
    monkeypatch.setattr(native, "KERNELS", tmp_path)
    variant = native.runnable()[0].name if native.runnable() else pytest.skip("no variant runs here")
    with pytest.raises(native.KernelBuildError, match=r"could not build kernels/broken.cpp for .*\n.*error"):
        native.build("broken", variant, native.compiler())


def test_a_library_tuned_for_this_cpu_is_cached_under_its_name(monkeypatch):
    # -mtune=native tunes an x86 build for the CPU that builds it: a cache shared between machines must not
    # serve it to another CPU. A cross-compiled build is not tuned, and its key holds no CPU.
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    assert "-mtune=native" in native.flags("avx2") and "-mtune=native" not in native.flags("neon")
    here = {"vendor_id": "AuthenticAMD", "cpu family": "25", "model": "17", "model name": "AMD EPYC"}
    paths = []
    for cpu in (here, here | {"model": "1"}, here | {"model name": "AMD EPYC 9654"}):
        monkeypatch.setattr(native, "cpu_info", lambda cpu=cpu: cpu)
        paths.append([native.library("small_m_linear", variant, "g++") for variant in ("avx2", "neon")])
    assert len({tuned for tuned, _ in paths}) == 3 and len({cross for _, cross in paths}) == 1


def test_a_header_edit_rebuilds_only_the_libraries_that_include_it(tmp_path, monkeypatch):
    # A library is cached under its sources: an edit to a header it includes (here only under #if
    # ZHUZI_AVX512, through two others) must give it a new build, and an edit elsewhere must not.
    monkeypatch.setattr(native, "KERNELS", tmp_path / "kernels")
    shutil.copytree(Path(native.__file__).parent / "kernels", native.KERNELS)
    names = ("block_linear", "decode_step", "stream", "prefill_attention")

    def edit(header: str) -> set[str]:
        before = {name: native.library(name, "generic", "g++") for name in names}
        path = native.KERNELS / header
        path.write_text(path.read_text() + "\n// edited\n")
        return {name for name in names if native.library(name, "generic", "g++") != before[name]}

    assert edit("arch/x86/avx512/block_decode.h") == {"block_linear", "decode_step"}
    assert edit("prelude.h") == set(names)


def test_a_header_given_to_include_is_keyed_by_its_text_not_its_folder(tmp_path):
    # The kernel tests force-include tests/kernels/emulate.h: a clone elsewhere must find their builds, an
    # edit to the header must not.
    def key(folder: str, text: str) -> Path:
        header = tmp_path / folder / "emulate.h"
        header.parent.mkdir(exist_ok=True)
        header.write_text(text)
        return native.library("stream", "generic", "g++", ("-O0", "-include", str(header)))

    assert key("a", "#define X 1\n") == key("b", "#define X 1\n") != key("b", "#define X 2\n")


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
def test_builds_of_one_kernel_side_by_side_compile_it_once(tmp_path, monkeypatch):
    # Two servers (or test workers) starting on a cold cache: the second waits for the first's build.
    calls = tmp_path / "calls"
    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\necho $$ >> {calls}\nsleep 1\nexec {native.compiler()} \"$@\"\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("ZHUZI_CACHE", str(tmp_path / "cache"))
    variant = native.runnable()[0].name if native.runnable() else pytest.skip("no variant runs here")
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda _: native.build("stream", variant, str(cxx)), range(2)))
    assert built[0] == built[1] and built[0].exists()
    assert len(calls.read_text().split()) == 1


def test_without_a_compiler_the_torch_path_runs(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "")
    assert native.compiler() is None
    assert native._open("small_m_linear", "avx2") is None


def expect_pass(tests: kernel_builds.KernelTests) -> None:
    done = kernel_builds.run(tests)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith(f"{tests.variant}: ")  # the build is the variant it claims


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
@pytest.mark.parametrize("variant", NATIVE)
def test_kernel_unit_tests_pass_natively(variant):
    expect_pass(kernel_builds.natively(variant))


@pytest.mark.skipif(not kernel_builds.CAN_EMULATE,
                    reason="emulates on an AVX2 CPU, with SIMDe's headers (libsimde-dev; make test installs them)")
@pytest.mark.parametrize("name", LACKED)
def test_kernel_unit_tests_pass_with_the_variant_emulated(name):
    # Kernels edited on a CPU without AVX-512 would otherwise first run on a user's.
    expect_pass(kernel_builds.emulated(name))


@pytest.mark.skipif(not kernel_builds.CAN_CROSS, reason=f"no aarch64 cross toolchain ({kernel_builds.CROSS}, "
                                                        "qemu-aarch64; make test installs them)")
@pytest.mark.parametrize("variant", ARM)
def test_kernel_unit_tests_pass_on_aarch64_under_qemu(variant):
    expect_pass(kernel_builds.under_qemu(variant))
