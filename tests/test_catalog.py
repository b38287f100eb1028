"""The model catalog over stores laid out as their tools write them: a models directory (GGUF files, a split
GGUF, an mmproj, Hugging Face directories), the Hugging Face cache (blobs, snapshots, refs) and Ollama's store
(manifests, sha256 blobs); the big files linked, never copied."""
import hashlib
import json
import logging
import os
from pathlib import Path

import gguf
import pytest
import tiny
from tiny import split_gguf

from zhuzi.catalog import Catalog, format_size, table
from zhuzi.llm import LLM
from zhuzi.model.gguf_header import read_gguf
from zhuzi.model.loader import CheckpointError
from zhuzi.sampling_params import SamplingParams

REV, OLD_REV = "a" * 40, "b" * 40


def header_only_gguf(path: Path, arch: str) -> Path:
    """A GGUF file of metadata and no tensors: enough for a catalog, which reads headers only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def split_copy(source: Path, folder: Path, count: int) -> list[Path]:
    """source's metadata and tensors in count parts, as gguf-split writes them (gguf's writer, by tensor count)."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(folder / source.name, reader.fields["general.architecture"].contents(),
                             split_max_tensors=-(-len(reader.tensors) // count))
    for f in reader.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            writer.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return [folder / f"{source.stem}-{n:05d}-of-{count:05d}.gguf" for n in range(1, count + 1)]


def sizes(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny") / "tiny-qwen3"
    tiny.build("qwen3", directory)
    return directory


@pytest.fixture
def models_dir(tmp_path, smollm2_path, tiny_qwen3) -> Path:
    """llama-server's layout: GGUF files, a split GGUF, a folder of a model and its mmproj; and Hugging Face
    directories, one of an architecture zhuzi does not run."""
    root = tmp_path / "models"
    root.mkdir()
    (root / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(smollm2_path)
    split_gguf(root, "Big-Model-Q4_K_M", 3)
    split_gguf(root, "Half-Downloaded", 2, range(1))
    header_only_gguf(root / "gpt2-small.gguf", "gpt2")
    (root / "vision").mkdir()
    (root / "vision" / "smol.gguf").symlink_to(smollm2_path)
    header_only_gguf(root / "vision" / "mmproj-F16.gguf", "clip")
    (root / "tiny-qwen3").symlink_to(tiny_qwen3, target_is_directory=True)
    (root / "gpt2-hf").mkdir()
    (root / "gpt2-hf" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (root / "notes").mkdir()  # a folder of no model is no entry
    (root / "README.md").write_text("my models")
    return root


def test_a_models_directory_lists_each_model_with_its_id_size_family_and_whether_it_runs(models_dir, smollm2_path,
                                                                                         tiny_qwen3):
    catalog = Catalog.scan([str(models_dir)])
    found = {e.id: e for e in catalog.entries()}
    assert sorted(found) == ["Big-Model-Q4_K_M", "Half-Downloaded", "SmolLM2-135M-Instruct-Q4_1", "gpt2-hf",
                             "gpt2-small", "tiny-qwen3", "vision"]
    smol = found["SmolLM2-135M-Instruct-Q4_1"]
    assert (smol.runs, smol.family, smol.architecture) == (True, "llama", "llama")
    assert smol.paths == (models_dir / "SmolLM2-135M-Instruct-Q4_1.gguf",) and smol.size == sizes(smollm2_path)
    assert smol.source == str(models_dir)

    big = found["Big-Model-Q4_K_M"]  # a split's parts are one model, in order
    assert [p.name for p in big.paths] == [f"Big-Model-Q4_K_M-0000{n}-of-00003.gguf" for n in (1, 2, 3)]
    assert big.size == sizes(*big.paths) and big.family == "llama" and not big.runs
    assert big.problem == "missing GGUF metadata key 'llama.embedding_length'"  # its metadata's, not its parts'
    assert found["Half-Downloaded"].problem == "split GGUF missing part 2 of 2"

    gpt2 = found["gpt2-small"]  # listed with its reason, not hidden
    assert (gpt2.family, gpt2.architecture, gpt2.problem) == (None, "gpt2", "unknown architecture gpt2")
    hf_gpt2 = found["gpt2-hf"]
    assert (hf_gpt2.architecture, hf_gpt2.problem) == ("GPT2LMHeadModel", "unknown architecture GPT2LMHeadModel")

    vision = found["vision"]  # a folder of one model is named after the folder; its mmproj is no model
    assert vision.paths == (models_dir / "vision" / "smol.gguf",) and vision.runs
    assert [(s.path.name, "mmproj" in s.reason) for s in catalog.skipped] == [("mmproj-F16.gguf", True)]

    qwen = found["tiny-qwen3"]
    assert (qwen.paths, qwen.family, qwen.architecture, qwen.runs) == \
        ((models_dir / "tiny-qwen3",), "qwen3", "Qwen3ForCausalLM", True)
    assert qwen.size == sizes(*(f for f in tiny_qwen3.rglob("*") if f.is_file()))


@pytest.fixture(scope="module")
def smollm2_split(tmp_path_factory, smollm2_path) -> list[Path]:
    return split_copy(smollm2_path, tmp_path_factory.mktemp("split"), 3)


def test_a_split_gguf_is_one_model_that_answers_as_the_joined_file_does(smollm2_split, smollm2_path):
    """Named by its first part, as llama-server loads one: the same greedy tokens and log-probabilities."""
    entry = Catalog.scan([str(smollm2_split[0].parent)]).find(smollm2_path.stem)
    assert entry.paths == tuple(smollm2_split) and entry.runs and entry.size == sizes(*smollm2_split)
    llms = [LLM(str(path), kv_cache_memory="64MiB") for path in (entry.path, smollm2_path)]
    assert [llm.engine.model_name for llm in llms] == ["SmolLM2-135M-Instruct"] * 2  # the name clients send
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    split, joined = (llm.generate("The capital of France is", params)[0].outputs[0] for llm in llms)
    assert split.token_ids == joined.token_ids and "Paris" in split.text
    assert [lp[t].logprob for t, lp in zip(split.token_ids, split.logprobs)] == \
        [lp[t].logprob for t, lp in zip(joined.token_ids, joined.logprobs)]


def test_a_split_is_read_from_its_first_part_each_tensor_from_the_part_it_lies_in(tmp_path):
    parts = split_gguf(tmp_path, "Big", 3)
    header = read_gguf(parts[0])
    assert [(t.name, t.file) for t in header.tensors] == [(f"blk.{n}.attn_norm.weight", part)
                                                          for n, part in enumerate(parts)]
    assert [header.vector(t.name) for t in header.tensors] == [[1.0] * 8] * 3
    with pytest.raises(ValueError, match="^part 2 of a split GGUF of 3 parts: load the split by its first part$"):
        read_gguf(parts[1])


@pytest.mark.parametrize("second", ["missing", "of another split"])
def test_a_missing_part_or_one_of_another_split_is_a_one_line_error_naming_it(smollm2_split, tmp_path, second):
    """Parts 1 and 3 linked (as a Hugging Face snapshot links its blobs); part 2 not there, or another split's."""
    folder = tmp_path / "models"
    folder.mkdir()
    for part in smollm2_split[::2]:
        (folder / part.name).symlink_to(part)
    part2 = folder / smollm2_split[1].name
    if second == "missing":
        problem = f"split GGUF part {part2.name} is missing"
    else:
        split_gguf(tmp_path, "Other", 3)[1].rename(part2)
        problem = f"split GGUF part {part2.name} is part of another split"
    with pytest.raises(CheckpointError) as error:
        LLM(str(folder / smollm2_split[0].name))
    assert str(error.value) == f"{folder / smollm2_split[0].name}: {problem}"
    (entry,) = Catalog.scan([str(folder)]).entries()
    assert entry.problem == ("split GGUF missing part 2 of 3" if second == "missing" else problem)


def test_a_file_that_is_no_gguf_is_listed_with_what_is_wrong(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"not a model")
    (entry,) = Catalog.scan([str(tmp_path)]).entries()
    assert (entry.id, entry.size, entry.architecture) == ("broken", 11, "?")
    assert entry.problem == "not a GGUF file (bad magic number)"


def test_a_setting_the_family_does_not_run_is_the_reason_it_gives(tmp_path, tiny_qwen3):
    """The family is known, its mapping refuses the checkpoint: the loader's own reason, without the path."""
    raw = json.loads((tiny_qwen3 / "config.json").read_text()) | {"attention_bias": True}
    (tmp_path / "biased").mkdir()
    (tmp_path / "biased" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "biased" / "model.safetensors").symlink_to(tiny_qwen3 / "model.safetensors")
    (entry,) = Catalog.scan([str(tmp_path)]).entries()
    assert entry.family == "qwen3" and entry.problem == "attention_bias is not supported for qwen3"


def test_an_id_found_twice_is_the_first_directorys_and_the_second_is_skipped_and_logged(tmp_path, smollm2_path,
                                                                                       caplog):
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        folder.mkdir()
        (folder / "smol.gguf").symlink_to(smollm2_path)
    with caplog.at_level(logging.WARNING, logger="zhuzi.catalog"):
        catalog = Catalog.scan([str(first), str(second)])
    assert [e.path for e in catalog.entries()] == [first / "smol.gguf"]
    assert [(s.path, s.reason) for s in catalog.skipped] == \
        [(second / "smol.gguf", f"the id smol is already {first / 'smol.gguf'}'s")]
    assert "model id smol is found twice" in caplog.text


def test_a_models_dir_that_is_not_there_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"--models-dir: {tmp_path / 'none'} is not a directory"):
        Catalog.scan([str(tmp_path / "none")])


# ---------------------------------------------------------------- the Hugging Face cache

def hf_cache_repo(cache: Path, repo_id: str, files: dict[str, Path], rev: str = REV, main: bool = True) -> Path:
    """A repository as huggingface_hub downloads it: each file a blob named by its hash, the snapshot's names
    relative links to the blobs, refs/main the revision."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    for name, source in files.items():
        blob = repo / "blobs" / hashlib.sha256(f"{rev}/{name}".encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.symlink_to(source.resolve())
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    return snapshot


def test_the_hugging_face_cache_lists_its_repositories_by_name_at_the_revision_main_names(
        tmp_path, monkeypatch, smollm2_path, tiny_qwen3):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub, as huggingface_hub reads it
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    hf_cache_repo(cache, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", {"smollm2-q4_1.gguf": smollm2_path}, OLD_REV)
    smol = hf_cache_repo(cache, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", {"smollm2-q4_1.gguf": smollm2_path})
    qwen = hf_cache_repo(cache, "Org/tiny-qwen3", {f.name: f for f in tiny_qwen3.iterdir() if f.is_file()})
    quants = tmp_path / "quants"
    hf_cache_repo(cache, "Org/Thing-GGUF", {
        "Thing-Q4_K_M.gguf": header_only_gguf(quants / "a.gguf", "qwen3"),
        "Thing-Q8_0.gguf": header_only_gguf(quants / "b.gguf", "qwen3"),
        **{f"Thing-UD-Q2_K_XL/{part.name}": part for part in split_gguf(quants, "Thing-UD-Q2_K_XL", 2)},
        "mmproj-Thing-F16.gguf": header_only_gguf(quants / "c.gguf", "clip")})
    hf_cache_repo(cache, "Org/tokenizer-only", {"tokenizer.json": tiny_qwen3 / "tokenizer.json"}, main=False)
    hf_cache_repo(cache, "Org/pickled", {"config.json": tiny_qwen3 / "config.json",
                                         "pytorch_model.bin": tiny_qwen3 / "tokenizer.json"})
    (cache / "datasets--Org--data").mkdir()

    catalog = Catalog.scan(["hf"])
    found = {e.id: e for e in catalog.entries()}
    assert sorted(found) == ["HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "Org/Thing-GGUF:Q4_K_M",
                             "Org/Thing-GGUF:Q8_0", "Org/Thing-GGUF:UD-Q2_K_XL", "Org/pickled", "Org/tiny-qwen3"]
    assert found["Org/pickled"].problem == "no *.safetensors weights"
    entry = found["HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"]
    assert entry.paths == (smol / "smollm2-q4_1.gguf",) and entry.size == sizes(smollm2_path) and entry.runs
    assert (found["Org/tiny-qwen3"].paths, found["Org/tiny-qwen3"].family) == ((qwen,), "qwen3")
    assert found["Org/tiny-qwen3"].runs and found["Org/Thing-GGUF:Q8_0"].family == "qwen3"
    assert len(found["Org/Thing-GGUF:UD-Q2_K_XL"].paths) == 2 and entry.source == "hf"
    assert sorted(s.reason for s in catalog.skipped) == [
        "a vision projector (mmproj), loaded with a model, not a model of its own",
        "no weights (config.json with *.safetensors, or a .gguf file)"]


# ---------------------------------------------------------------- Ollama's store

def ollama_pull(store: Path, name: str, gguf_file: Path, template: str = "{{ .Prompt }}") -> Path:
    """A model as `ollama pull` leaves it: sha256-named blobs (the GGUF linked, not copied) and a manifest
    naming them under manifests/HOST/NAMESPACE/MODEL/TAG."""
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)

    def layer(media_type: str, content: bytes | None = None, source: Path | None = None) -> dict:
        digest = hashlib.sha256(content if content is not None else source.read_bytes()).hexdigest()
        blob = blobs / f"sha256-{digest}"
        if content is not None:
            blob.write_bytes(content)
        elif not blob.exists():
            link(source, blob)
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": blob.stat().st_size}

    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": layer("application/vnd.docker.container.image.v1+json", b'{"model_format":"gguf"}'),
                "layers": [layer("application/vnd.ollama.image.model", source=gguf_file),
                           layer("application/vnd.ollama.image.template", template.encode()),
                           layer("application/vnd.ollama.image.params", b'{"stop":["<|im_end|>"]}')]}
    *path, tag = name.replace(":", "/").split("/")
    file = store / "manifests" / Path(*path) / tag
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(manifest))
    return blobs / manifest["layers"][0]["digest"].replace(":", "-")


def link(source: Path, blob: Path) -> None:
    """A hard link, as a blob is a file; a symbolic one where the source is on another file system."""
    try:
        os.link(source.resolve(), blob)
    except OSError:
        blob.symlink_to(source.resolve())


@pytest.fixture
def ollama_store(tmp_path, monkeypatch, smollm2_path) -> tuple[Path, Path]:
    store = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    return store, smollm2_path


def test_ollamas_store_lists_name_tag_as_ollama_list_does(ollama_store, tmp_path):
    store, smollm2 = ollama_store
    smol_blob = ollama_pull(store, "registry.ollama.ai/library/smollm2:135m", smollm2)
    ollama_pull(store, "registry.ollama.ai/someone/smol:latest", smollm2)
    ollama_pull(store, "hf.co/Org/Thing-GGUF:Q8_0", header_only_gguf(tmp_path / "thing.gguf", "bert"))
    (store / "manifests" / "registry.ollama.ai" / "library" / "broken").mkdir()
    (store / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest").write_text("{")

    catalog = Catalog.scan(["ollama"])
    found = {e.id: e for e in catalog.entries()}
    assert sorted(found) == ["hf.co/Org/Thing-GGUF:Q8_0", "smollm2:135m", "someone/smol:latest"]
    smol = found["smollm2:135m"]
    assert smol.paths == (smol_blob,) and smol.size == sizes(smollm2) and smol.family == "llama" and smol.runs
    assert found["hf.co/Org/Thing-GGUF:Q8_0"].problem == "unknown architecture bert"
    assert catalog.find("someone/smol") is found["someone/smol:latest"]  # Ollama's untagged name is :latest
    assert catalog.find("smollm2") is None and catalog.find("smollm2:135m") is smol
    assert [s.path.parts[-2:] for s in catalog.skipped] == [("broken", "latest")]
    assert "not a manifest Ollama writes" in catalog.skipped[0].reason


def test_a_model_found_in_ollamas_store_loads_and_answers(ollama_store):
    """The blob has no .gguf name: the loader and the tokenizer take it as the GGUF it is."""
    store, smollm2 = ollama_store
    ollama_pull(store, "registry.ollama.ai/library/smollm2:135m", smollm2)
    entry = Catalog.scan(["ollama"]).find("smollm2:135m")
    llm = LLM(str(entry.path), kv_cache_memory="64MiB")
    text = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].text
    assert "Paris" in text


def test_a_missing_blob_is_listed_with_its_reason(ollama_store):
    store, smollm2 = ollama_store
    ollama_pull(store, "registry.ollama.ai/library/smollm2:135m", smollm2).unlink()
    (entry,) = Catalog.scan(["ollama"]).entries()
    assert entry.problem == f"blob {entry.path.name} is missing" and entry.size == 0


# ---------------------------------------------------------------- the table

def test_the_table_has_a_line_per_model_with_id_size_family_runs_and_path(models_dir):
    lines = table(Catalog.scan([str(models_dir)]).entries())
    assert lines[0].split() == ["ID", "SIZE", "FAMILY", "RUNS", "PATH"] and len(lines) == 8
    smol = next(line for line in lines if line.startswith("SmolLM2"))
    assert smol.split()[1:5] == ["98", "MB", "llama", "yes"] and smol.endswith("SmolLM2-135M-Instruct-Q4_1.gguf")
    gpt2 = next(line for line in lines if line.startswith("gpt2-small "))
    assert "no: unknown architecture gpt2" in gpt2
    big = next(line for line in lines if line.startswith("Big-Model"))
    assert big.endswith("Big-Model-Q4_K_M-00001-of-00003.gguf (+2 parts)")
    assert len({line.index("PATH" if i == 0 else str(models_dir)) for i, line in enumerate(lines)}) == 1


@pytest.mark.parametrize("size,shown", [(512, "512 B"), (1500, "1.5 KB"), (98_000_000, "98 MB"),
                                        (4_920_000_000, "4.9 GB"), (40_000_000_000, "40 GB")])
def test_sizes_read_as_ollama_list_shows_them(size, shown):
    assert format_size(size) == shown
