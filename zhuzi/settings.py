"""Settings whose fields are command-line flags: config.py's EngineConfig, ParallelConfig and ServerConfig are
dataclasses of setting() fields, and each field becomes a flag (--max-num-seqs for max_num_seqs), so a new
setting is one edit there."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import types
import typing
from dataclasses import field
from typing import Any


def setting(default: Any, help: str, serve: Any = dataclasses.MISSING, **flag: Any) -> Any:
    """A settings field; serve: its default under `zhuzi serve` when that differs; flag holds argparse options
    beyond the ones read from the field (e.g. choices, or flags=["--api-key"] for a list field's singular flag)."""
    factory = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    return field(**factory, metadata={"help": help, "serve": serve, **flag})


class Settings:
    """Settings whose fields are also command-line flags (--max-num-seqs for max_num_seqs)."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), serving: bool = False) -> None:
        """serving: the flags of `zhuzi serve`, whose defaults may differ (a field's serve default)."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init and f.name not in skip:
                _add_flag(parser, f, hints[f.name], serving)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Any:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if f.init and hasattr(args, f.name)})


def _add_flag(parser: argparse.ArgumentParser, f: dataclasses.Field, hint: Any, serving: bool) -> None:
    options = dict(f.metadata)
    options.pop("flags", None)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    serve_default = options.pop("serve", dataclasses.MISSING)
    if serving and serve_default is not dataclasses.MISSING:
        default = serve_default
    union = isinstance(hint, types.UnionType)
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] if union else [hint]
    kind = typing.get_origin(kinds[0]) or kinds[0]
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif kind is list:
        options.update(action="append", type=typing.get_args(kinds[0])[0])
    else:  # str | int reads as text: the field's own parser (e.g. parse_bytes) takes it from there
        options["type"] = str if str in kinds else kind
    if default is not None and "action" not in options:  # BooleanOptionalAction adds its own
        options["help"] += " (default: %(default)s)"
    parser.add_argument(*flags(f), dest=f.name, default=default, **options)


def flags(f: dataclasses.Field) -> list[str]:
    """A setting's flags: --max-num-seqs for max_num_seqs, unless the field names its own."""
    return f.metadata.get("flags", ["--" + f.name.replace("_", "-")])


def given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The settings argv sets itself, rather than leaving them at their defaults: argv parsed again by a copy of
    the parser whose every default is suppressed, so only what argv names lands in the namespace."""
    quiet = copy.deepcopy(parser)
    _suppress_defaults(quiet)
    return set(vars(quiet.parse_args(argv)))


def _suppress_defaults(parser: argparse.ArgumentParser) -> None:
    parser._defaults.clear()  # set_defaults(), e.g. a command's function
    for action in parser._actions:
        action.default = argparse.SUPPRESS
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _suppress_defaults(sub)
