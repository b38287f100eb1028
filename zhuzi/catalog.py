"""The model catalog (where a server's models come from): the models in --models-dir directories, the Hugging
Face cache (`hf`) and Ollama's store (`ollama`), read where they lie; each with the id a request names it by,
the files to load, its size, its family and whether zhuzi runs it. Nothing is loaded or copied here."""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zhuzi.model.families import gguf_family, hf_family
from zhuzi.model.gguf_header import SPLIT_PART, read_gguf_header
from zhuzi.model.loader import load_model_config

log = logging.getLogger(__name__)
HF_CACHE, OLLAMA_STORE = "hf", "ollama"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
TAG_SEPARATORS = "-._"


@dataclass(frozen=True)
class CatalogEntry:
    """A model a request can name."""

    id: str
    paths: tuple[Path, ...]  # what the loader opens: a .gguf file, a split GGUF's parts in order, or an HF directory
    size: int  # bytes on disk
    architecture: str  # as the checkpoint names it: general.architecture, or config.json's class
    family: str | None  # the zhuzi family that runs it (model/families), None for an unknown architecture
    problem: str | None  # why zhuzi does not run it; None: it does
    source: str  # the --models-dir value it was found under

    @property
    def path(self) -> Path:
        return self.paths[0]

    @property
    def runs(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class Skipped:
    """A file or directory that is not a model of its own, and why."""

    path: Path
    reason: str


@dataclass
class Catalog:
    """The models of some --models-dir values, by id. Catalog.scan(dirs) reads them; entries() lists them and
    find(name) resolves the name a request sends. An id found twice is the first directory's (logged)."""

    models: dict[str, CatalogEntry] = field(default_factory=dict)
    skipped: list[Skipped] = field(default_factory=list)

    @classmethod
    def scan(cls, dirs: Sequence[str]) -> Catalog:
        catalog = cls()
        for source in dirs:
            for found in _scan(source):
                catalog._add(found)
        return catalog

    def entries(self) -> list[CatalogEntry]:
        return list(self.models.values())

    def find(self, name: str) -> CatalogEntry | None:
        """The model a request names: its id, or (as Ollama resolves it) an untagged name's `:latest`."""
        return self.models.get(name) or (self.models.get(f"{name}:{OLLAMA_TAG}") if ":" not in name else None)

    def _add(self, found: CatalogEntry | Skipped) -> None:
        if isinstance(found, Skipped):
            self.skipped.append(found)
        elif (first := self.models.get(found.id)) is not None:
            log.warning("model id %s is found twice: serving %s, not %s", found.id, first.path, found.path)
            self.skipped.append(Skipped(found.path, f"the id {found.id} is already {first.path}'s"))
        else:
            self.models[found.id] = found


# ---------------------------------------------------------------- where to look

def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, where huggingface_hub puts it (its environment variables, in its order)."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface" / "hub"


def ollama_store_dir() -> Path:
    """Ollama's model store: $OLLAMA_MODELS, or ~/.ollama/models."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def stores_on_disk() -> list[str]:
    """The stores a person already has: `hf` and `ollama`, those that are there."""
    return [source for source, store in ((HF_CACHE, hf_cache_dir()), (OLLAMA_STORE, ollama_store_dir()))
            if store.is_dir()]


def _scan(source: str) -> Iterator[CatalogEntry | Skipped]:
    if source == HF_CACHE:
        yield from _scan_hf_cache(hf_cache_dir(), source)
    elif source == OLLAMA_STORE:
        yield from _scan_ollama(ollama_store_dir(), source)
    else:
        yield from _scan_models_dir(Path(source).expanduser(), source)


def _listing(directory: Path, what: str) -> list[Path]:
    """A directory's children in name order; a directory that is not there is an error naming the flag."""
    if not directory.is_dir():
        raise ValueError(f"--models-dir: {directory} is not a directory ({what})")
    return sorted(directory.iterdir())


# ---------------------------------------------------------------- a models directory

def _scan_models_dir(root: Path, source: str) -> Iterator[CatalogEntry | Skipped]:
    """llama-server's layout: each .gguf file (a split's parts together) is a model named by its stem; a
    subdirectory is a Hugging Face directory or holds a GGUF model (beside its mmproj), named by the directory."""
    children = _listing(root, "models directory")
    yield from _gguf_models([c for c in children if c.is_file() and c.suffix == ".gguf"], None, source)
    for child in children:
        if not child.is_dir():
            continue
        if (child / "config.json").is_file():
            yield _hf_entry(child.name, child, source)
        elif ggufs := sorted(child.rglob("*.gguf")):
            yield from _gguf_models(ggufs, child.name, source)


def _gguf_models(files: list[Path], folder: str | None, source: str) -> Iterator[CatalogEntry | Skipped]:
    """The models among some .gguf files: a split's parts as one. Named by their stems, or by folder when they
    are its one model (folder:TAG each when it holds several, TAG what their stems do not share)."""
    models: list[tuple[str, list[Path]]] = []
    splits: dict[tuple[Path, str, str], list[Path]] = {}
    for file in files:
        if file.name.lower().startswith("mmproj"):
            yield Skipped(file, "a vision projector (mmproj), loaded with a model, not a model of its own")
        elif part := SPLIT_PART.fullmatch(file.name):
            splits.setdefault((file.parent, part[1], part[3]), []).append(file)
        else:
            models.append((file.stem, [file]))
    models += [(stem, parts) for (_, stem, _), parts in splits.items()]
    models.sort(key=lambda model: model[1][0])
    if folder is None:
        ids = [stem for stem, _ in models]
    elif len(models) == 1:
        ids = [folder]
    else:
        ids = [f"{folder}:{tag}" for tag in _tags([stem for stem, _ in models])]
    for id_, (_, parts) in zip(ids, models):
        yield _gguf_entry(id_, parts, source)


def _tags(stems: list[str]) -> list[str]:
    """What tells the stems apart: each after the longest prefix they share up to a separator
    (Qwen3-8B-Q4_K_M, Qwen3-8B-Q8_0 -> Q4_K_M, Q8_0), as llama-server's and Ollama's quantization tags read."""
    shared = os.path.commonprefix(stems)
    cut = max(shared.rfind(sep) for sep in TAG_SEPARATORS) + 1
    return [stem[cut:] or stem for stem in stems]


def _gguf_entry(id_: str, parts: list[Path], source: str) -> CatalogEntry | Skipped:
    size = sum(part.stat().st_size for part in parts)
    problem = _split_problem(parts)
    try:
        header = read_gguf_header(parts[0])
    except (OSError, ValueError) as e:
        return CatalogEntry(id_, tuple(parts), size, "?", None, problem or str(e), source)
    arch = str(header.metadata.get("general.architecture", "?"))
    if arch == "clip":  # llama.cpp's converter writes a vision projector so, whatever the file's name
        return Skipped(parts[0], "a vision projector (mmproj), loaded with a model, not a model of its own")
    fam = gguf_family(arch, bool(header.metadata.get(f"{arch}.expert_count")))
    if fam is None:
        return CatalogEntry(id_, tuple(parts), size, arch, None, problem or f"unknown architecture {arch}", source)
    return CatalogEntry(id_, tuple(parts), size, arch, fam.name, problem or _config_problem(parts[0]), source)


def _split_problem(parts: list[Path]) -> str | None:
    """Why a split GGUF does not load, by its parts' names: one is missing (a part of another split is the
    loader's to find, in the headers)."""
    split = SPLIT_PART.fullmatch(parts[0].name)
    if split is None:
        return None
    count = int(split[3])
    have = {int(SPLIT_PART.fullmatch(part.name)[2]) for part in parts}
    missing = sorted(set(range(1, count + 1)) - have)
    return f"split GGUF missing part {', '.join(map(str, missing))} of {count}" if missing else None


def _config_problem(path: Path) -> str | None:
    """What the loader says of a checkpoint of a known family (a setting its mapping does not run), if anything."""
    try:
        load_model_config(path)
    except (OSError, ValueError) as e:
        return getattr(e, "problem", str(e))
    return None


# ---------------------------------------------------------------- a Hugging Face directory

def _hf_entry(id_: str, directory: Path, source: str) -> CatalogEntry | Skipped:
    files = [f for f in directory.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        return CatalogEntry(id_, (directory,), size, "?", None, f"config.json: {e}", source)
    arch = ", ".join(raw.get("architectures") or []) or str(raw.get("model_type", "?"))
    fam = hf_family(raw)
    if fam is None:
        return CatalogEntry(id_, (directory,), size, arch, None, f"unknown architecture {arch}", source)
    weights = any(f.suffix == ".safetensors" for f in files)
    problem = _config_problem(directory) if weights else "no *.safetensors weights"
    return CatalogEntry(id_, (directory,), size, arch, fam.name, problem, source)


# ---------------------------------------------------------------- the Hugging Face cache

def _scan_hf_cache(cache: Path, source: str) -> Iterator[CatalogEntry | Skipped]:
    """models--ORG--NAME/snapshots/REV, REV the one refs/main names: org/name (the id the Hub, vLLM and
    `llama-server -hf` use), and org/name:TAG for each GGUF of a repository holding several."""
    for repo in _listing(cache, "the Hugging Face cache, $HF_HUB_CACHE or $HF_HOME/hub"):
        if not (repo.is_dir() and repo.name.startswith("models--")):
            continue
        name = repo.name.removeprefix("models--").replace("--", "/")
        snapshot = _hf_snapshot(repo)
        if snapshot is None:
            yield Skipped(repo, "no snapshot downloaded")
        elif (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")):
            yield _hf_entry(name, snapshot, source)
        elif ggufs := sorted(snapshot.rglob("*.gguf")):  # a GGUF repository, whose config.json may be beside them
            yield from _gguf_models(ggufs, name, source)
        elif (snapshot / "config.json").is_file():  # weights zhuzi does not read (pytorch_model.bin): its reason
            yield _hf_entry(name, snapshot, source)
        else:
            yield Skipped(snapshot, "no weights (config.json with *.safetensors, or a .gguf file)")


def _hf_snapshot(repo: Path) -> Path | None:
    """The snapshot refs/main names, else (a revision downloaded by hash) the newest."""
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshot := repo / "snapshots" / ref.read_text().strip()).is_dir():
        return snapshot
    snapshots = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
    return max(snapshots, key=lambda s: s.stat().st_mtime, default=None)


# ---------------------------------------------------------------- Ollama's store

def _scan_ollama(store: Path, source: str) -> Iterator[CatalogEntry | Skipped]:
    """manifests/HOST/NAMESPACE/MODEL/TAG: a JSON manifest whose model layer is the GGUF blob
    (blobs/sha256-HEX). Named as `ollama list` names it: MODEL:TAG for Ollama's library, NAMESPACE/MODEL:TAG
    for a user's, HOST/NAMESPACE/MODEL:TAG for another registry's."""
    manifests = store / "manifests"
    _listing(manifests, "Ollama's store, $OLLAMA_MODELS or ~/.ollama/models")
    for manifest in sorted(m for m in manifests.rglob("*") if m.is_file()):
        parts = manifest.relative_to(manifests).parts
        if len(parts) < 4:
            yield Skipped(manifest, "not at manifests/HOST/NAMESPACE/MODEL/TAG")
            continue
        yield _ollama_entry(_ollama_name(parts), manifest, store / "blobs", source)


def _ollama_name(parts: tuple[str, ...]) -> str:
    *path, tag = parts
    if path[0] == OLLAMA_HOST:
        path = path[1:]
        if path[0] == OLLAMA_NAMESPACE:
            path = path[1:]
    return f"{'/'.join(path)}:{tag}"


def _ollama_entry(id_: str, manifest: Path, blobs: Path, source: str) -> CatalogEntry | Skipped:
    try:
        layers = json.loads(manifest.read_text()).get("layers") or []
    except (OSError, ValueError, AttributeError) as e:
        return Skipped(manifest, f"not a manifest Ollama writes ({e})")
    digests = [layer.get("digest", "") for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    if not digests:
        return Skipped(manifest, "no model layer")
    blob = blobs / digests[0].replace(":", "-")
    if not blob.is_file():
        return CatalogEntry(id_, (blob,), 0, "?", None, f"blob {blob.name} is missing", source)
    return _gguf_entry(id_, [blob], source)


def format_size(size: int) -> str:
    """Bytes as `ollama list` shows them (decimal units)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}" if size < 10 * scale else f"{size // scale} {unit}"
    return f"{size} B"


def table(entries: Iterable[CatalogEntry]) -> list[str]:
    """One line per model, columns aligned: id, size, family, whether zhuzi runs it (or why not), where."""
    rows = [("ID", "SIZE", "FAMILY", "RUNS", "PATH")]
    rows += [(e.id, format_size(e.size), e.family or e.architecture, "yes" if e.runs else f"no: {e.problem}",
              str(e.path) + (f" (+{len(e.paths) - 1} parts)" if len(e.paths) > 1 else "")) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return ["   ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "   " + row[4] for row in rows]
