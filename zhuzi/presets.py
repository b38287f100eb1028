"""Model presets (the engine settings each model is served with): a TOML file (--models-preset) of a [default]
table and a table per model id, each key an engine flag without its dashes, as llama-server's presets name
theirs. A model's settings: the flags' defaults < [default] < the model's table < the flags given to zhuzi."""
from __future__ import annotations

import dataclasses
import difflib
import tomllib
import typing
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zhuzi.config import EngineConfig
from zhuzi.settings import flags

DEFAULT = "default"  # the table every model starts from


def _keys() -> dict[str, dataclasses.Field]:
    """Each engine setting by its flag without the dashes: max-model-len, block-size (page_size)."""
    return {next(flag for flag in flags(f) if flag.startswith("--"))[2:]: f
            for f in dataclasses.fields(EngineConfig) if f.init}


KEYS = _keys()
KINDS = typing.get_type_hints(EngineConfig)


@dataclass(frozen=True)
class Presets:
    """A presets file, read and checked: each table's keys (flags without their dashes) and values."""

    path: Path
    tables: dict[str, dict[str, Any]]

    @classmethod
    def read(cls, path: str | Path) -> Presets:
        """ValueError in one line, naming the file, the table and the key, for anything zhuzi would not run."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"--models-preset: cannot read {path}: {exc.strerror}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not TOML: {exc}") from None
        tables = {}
        for name, table in data.items():
            if not isinstance(table, dict):
                raise ValueError(f"{path}: {name} lies outside a table: put it under [{DEFAULT}] or a model's table")
            for key, value in table.items():
                _check(path, name, key, value)
            tables[name] = table
        if "model" in tables.get(DEFAULT, {}):
            raise ValueError(f"{path} [{DEFAULT}] model: a path belongs in a model's own table")
        return cls(path, tables)

    def settings(self, model_id: str, given: Collection[str] = ()) -> dict[str, Any]:
        """The keys a model takes from the file ([default]'s, then its table's), but those of the fields in
        `given`. Its table is model_id's; an id of Ollama's `:latest` also finds its untagged table."""
        table = self.tables.get(model_id) or self.tables.get(model_id.removesuffix(":latest"), {})
        return {key: value for key, value in {**self.tables.get(DEFAULT, {}), **table}.items()
                if KEYS[key].name not in given}

    def engine_config(self, model_id: str, base: EngineConfig | None = None,
                      given: Collection[str] = ()) -> EngineConfig:
        """The settings of the model a request names model_id: base (the command line's, with its defaults) under
        [default] under the model's table, but for the fields in `given`, which the command line set itself. The
        model's table may name its checkpoint (model = PATH)."""
        settings = self.settings(model_id, given)
        try:
            return dataclasses.replace(base or EngineConfig(), **{KEYS[k].name: v for k, v in settings.items()})
        except ValueError as exc:  # settings that are fine one by one but not together
            raise ValueError(f"{self.path} [{model_id}]: {exc}") from None


def _check(path: Path, table: str, key: str, value: Any) -> None:
    """ValueError unless the key is an engine flag and the value one it takes."""
    where = f"{path} [{table}] {key}"
    if key not in KEYS:
        near = difflib.get_close_matches(key.replace("_", "-"), KEYS, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        if isinstance(value, dict) and not near:
            hint = f" (a table inside [{table}]: quote a model id with dots, [\"{table}.{key}\"])"
        raise ValueError(f"{where}: unknown key{hint}")
    f = KEYS[key]
    kinds = [kind for kind in typing.get_args(KINDS[f.name]) or (KINDS[f.name],) if kind is not type(None)]
    if not any(_is(value, typing.get_origin(kind) or kind) for kind in kinds):
        names = " or ".join("a table" if kind is dict else (typing.get_origin(kind) or kind).__name__
                            for kind in kinds)
        raise ValueError(f"{where}: expected {names}, got {value!r}")
    if "choices" in f.metadata and value not in f.metadata["choices"]:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(f.metadata['choices'])}")
    try:
        EngineConfig(**{f.name: value})  # the checks EngineConfig makes of a value
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _is(value: Any, kind: type) -> bool:
    """Whether a TOML value is of a setting's type (a TOML bool is no int here)."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
