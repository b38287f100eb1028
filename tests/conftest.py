"""Shared fixtures: the embedded SmolLM2 checkpoint and its transformers reference model; the order files run in,
and which files run in one xdist worker."""
import json
import os
from functools import cached_property
from pathlib import Path

import pytest
import torch
from xdist.scheduler import LoadScopeScheduling

from zhuzi.model.loader import default_model_path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: a file that runs for a minute or more, started before the others")


# tests/server/conftest.py's servers and transformers' load of SmolLM2, each made once per xdist worker that uses
# it: the files that use one run in one worker (FilesAndGroups). A file that uses several goes with the first, and
# the others may be made a second time there (one group of every file that shares any of them would leave one
# worker most of the server tests).
SHARED = ("inspect_server", "det_server", "keyed_server", "models_server", "server", "hf_smollm2")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files marked long first, the rest after (each file's tests stay together, in their order): xdist
    hands whole files out in this order (make test: --no-loadscope-reorder), so the last ones to run are short
    and no core waits idle while a long file ends the run. An xdist worker writes down which files use a shared
    server or fixture, for the scheduler (FilesAndGroups)."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    if hasattr(config, "workerinput"):  # every worker collects the same, so writes the same
        groups = groups_file(Path(config.option.basetemp).parent)
        tmp = groups.with_suffix(f".{os.getpid()}")
        tmp.write_text(json.dumps(server_groups(items, config.rootpath)))
        tmp.replace(groups)


def server_groups(items: list[pytest.Item], root: Path) -> dict[str, str]:
    """file -> the first of SHARED its tests use (a module's own fixture of the same name aside)."""
    uses: dict[str, set[str]] = {}
    for item in items:
        defs = item._fixtureinfo.name2fixturedefs
        uses.setdefault(item.path.relative_to(root).as_posix(), set()).update(
            name for name in SHARED if name in defs and defs[name][-1].scope == "session")
    return {path: next(name for name in SHARED if name in shared) for path, shared in uses.items() if shared}


def groups_file(basetemp: Path) -> Path:
    return basetemp / "server-groups.json"


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadScopeScheduling | None:
    return FilesAndGroups(config, log) if config.getvalue("dist") == "loadgroup" else None


class FilesAndGroups(LoadScopeScheduling):
    """--dist loadgroup here: the files that use a shared server (or fixture) go to one worker together, which
    makes it once; every other file goes whole, as with loadfile. (xdist's own groups, xdist_group marks, do not
    reach the scheduler under pytest 9.2: the group it appends to a test's id is lost.)"""

    @cached_property
    def groups(self) -> dict[str, str]:
        """What the workers wrote while collecting: the scheduler first asks once every one has collected."""
        path = groups_file(self.config._tmp_path_factory.getbasetemp())
        return json.loads(path.read_text()) if path.exists() else {}

    def _split_scope(self, nodeid: str) -> str:
        file = nodeid.split("::", 1)[0]
        return self.groups.get(file, file)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF file."""
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path):
    """transformers' own load of the same GGUF in fp32 (the oracle; ~12 s, so once per session)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path):
    from zhuzi.tokenizer import Tokenizer

    return Tokenizer.load(smollm2_path)


@pytest.fixture(scope="session")
def grammars(smollm2_tokenizer):
    """One grammar compiler on SmolLM2's tokenizer (its tokenizer view takes about a second to build)."""
    from zhuzi.sample.grammar import GrammarCompiler

    return GrammarCompiler(smollm2_tokenizer.hf, 49152, [2])


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module: two OpenMP threads on a loaded 2-core machine make each small op many
    times slower. Use with pytestmark = pytest.mark.usefixtures("one_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
