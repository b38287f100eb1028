"""The package as a user installs it: `pip wheel .` holds every file of the package, and a fresh venv outside
the checkout, with only that wheel installed, generates on the default model with the CPU kernels compiled
from the installed sources."""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import zhuzi
from zhuzi.disk_cache import cache_root
from zhuzi.model import native

pytestmark = pytest.mark.long  # a minute or more: handed out first (tests/conftest.py)

PACKAGE = Path(zhuzi.__file__).parent
CHECKOUT = PACKAGE.parent
PROMPT = "The capital of France is"
# Greedy. --no-fused-decode: the fused step's library is by far the slowest to compile; the per-layer path's
# libraries build from the same installed headers, subfolders included.
OPTIONS = ["--temperature", "0", "--max-tokens", "4", "--no-fused-decode"]
LOADED = re.compile(r"CPU kernel (\w+): (\S+) build")
USED = re.compile(r"CPU kernels: (variant .*)")


def package_files(root: Path) -> set[str]:
    return {str(p.relative_to(root.parent)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the checkout: a stale build/ folder cannot leak files into it, and the
    checkout gets none. The build backend, setuptools (torch requires it), is in this venv: nothing to download."""
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(PACKAGE, tmp / "source" / "zhuzi", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(CHECKOUT / name, tmp / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(tmp / "source")], check=True, capture_output=True)
    (built,) = (tmp / "dist").glob("zhuzi-*.whl")
    return built


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    """A venv holding only the wheel; the dependencies come from this venv's site-packages through a plain path
    line in a .pth, which adds the folder without running the .pth files there (the checkout's editable hook)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    "--no-compile", str(wheel)], check=True, capture_output=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "shared-dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(shared)))
    return venv


def generate(command: list[str], cwd: Path, **env: str) -> tuple[str, str]:
    """`zhuzi generate` on the default model: its output, and its log."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZHUZI_CACHE")} | env
    done = subprocess.run([*command, "generate", PROMPT, *OPTIONS], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


def test_the_wheel_holds_every_package_file(wheel: Path):
    assert package_files(PACKAGE) - set(zipfile.ZipFile(wheel).namelist()) == set()


def test_a_fresh_venv_generates_with_kernels_built_from_the_installed_files(wheel: Path, tmp_path: Path):
    venv = fresh_venv(tmp_path, wheel)
    find = "import importlib.util; print(importlib.util.find_spec('zhuzi').origin)"
    installed = subprocess.run([venv / "bin" / "python", "-c", find], cwd=tmp_path, check=True, capture_output=True,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, text=True).stdout.strip()
    assert Path(installed).is_relative_to(venv)

    # The checkout's own run, on the shared cache: what the fresh one must print, and the kernels it loads.
    expected, checkout_log = generate([sys.executable, "-m", "zhuzi.cli"], CHECKOUT, PYTHONPATH=str(CHECKOUT),
                                      ZHUZI_CACHE=str(cache_root()))
    loaded = dict(LOADED.findall(checkout_log))

    # An empty cache, but for what start-up work the test is not about: the tokenizer's conversion (not the
    # entries other processes are still writing, ".*"), and every kernel library but the smallest one this run
    # loads. The others are found only if the installed sources are the checkout's (a library's key is its
    # sources' text); the one left out must be compiled from the installed files (a minute a library saved).
    cache = tmp_path / "cache"
    shutil.copytree(cache_root() / "tokenizers", cache / "tokenizers", ignore=shutil.ignore_patterns(".*"))
    variant, cxx = native.resolve(native.default_choice()), native.compiler()
    compiled = min(loaded, key=lambda name: (native.KERNELS / f"{name}.cpp").stat().st_size, default=None)
    if variant != "torch" and cxx is not None:
        (cache / "kernels").mkdir()
        for name in {src.stem for src in native.KERNELS.glob("*.cpp")} - {compiled}:
            shutil.copy(native.build(name, variant, cxx), cache / "kernels")

    out, log = generate([venv / "bin" / "zhuzi"], tmp_path, ZHUZI_CACHE=str(cache))
    assert out == expected and out.startswith(PROMPT) and len(out) > len(PROMPT)
    if variant == "torch" or cxx is None:
        pytest.skip(f"no kernel variant serves this CPU ({variant}, compiler {cxx})")
    assert dict(LOADED.findall(log)) == loaded and set(loaded.values()) == {variant}
    assert USED.findall(log) == USED.findall(checkout_log) and USED.findall(log)[0].startswith(f"variant {variant}")
    # The library left out was not in the cache before the run: compiled by it, from the installed sources; the
    # others were found under the installed sources' keys (nothing else was built).
    built = [path.name.split(f"-{variant}-")[0] for path in (cache / "kernels").glob("*.so")]
    assert compiled in loaded and sorted(built) == sorted(src.stem for src in native.KERNELS.glob("*.cpp"))
