"""Command-line flags generated from frozen dataclasses: each knob is declared once, as a field.

A field declared with `flag(default, help)` is the flag `--field-name` (its metadata may rename it
or give a metavar); its type gives argparse's: `int`, `float`, `str`, `Path`, their `| None`,
`bool` (a switch that stores True), a `Literal` (its values are the choices) and `tuple[str, ...]`
(a repeated flag). A field whose type is itself a dataclass contributes that one's fields under
their own names, so nested configs read as one flat command line. `add_flags` builds the parser's
arguments, `from_args` the config from what it parsed (an error "field: ..." from a config's
validation reworded to name the flag), and `to_argv` the inverse: the arguments that give a config,
which is how one process passes its configuration to the processes it starts.

Torch- and gRPC-free: building the `tandem` parser imports no heavy module.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

_SCALARS = (int, float, str, Path)


def flag(default: Any, help: str, *, metavar: str | None = None, name: str | None = None) -> Any:
    """A dataclass field that is a command-line flag: `--NAME` (default: the field's name with
    dashes), `default` unless given (`dataclasses.MISSING`: a required flag), `help` in `--help`."""
    return dataclasses.field(default=default, metadata={"help": help, "metavar": metavar, "name": name})


@dataclasses.dataclass(frozen=True)
class _Flag:
    """One flag: the field it sets, where in the nesting, and how argparse reads it."""

    path: tuple[str, ...]  # field names from the outer config down
    option: str  # "--kv-cache-mib"
    type: Any
    default: Any
    metadata: Mapping[str, Any]

    @property
    def dest(self) -> str:
        return self.path[-1]


@functools.cache
def _flags(cls: type) -> tuple[_Flag, ...]:
    """Every flag of `cls`, nested dataclasses flattened, in declaration order."""
    flags: list[_Flag] = []
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            flags += [dataclasses.replace(inner, path=(field.name, *inner.path)) for inner in _flags(kind)]
            continue
        if "help" not in field.metadata:
            continue  # not a flag: set by the command, not its caller
        option = "--" + (field.metadata["name"] or field.name.replace("_", "-"))
        flags.append(_Flag((field.name,), option, kind, field.default, field.metadata))
    dests = [flag.dest for flag in flags]
    if len(dests) != len(set(dests)):
        raise TypeError(f"{cls.__name__}: two flags set the same attribute: {sorted(dests)}")
    return tuple(flags)


def _argparse_kwargs(flag: _Flag, default: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dest": flag.dest, "help": flag.metadata["help"]}
    if flag.metadata["metavar"]:
        kwargs["metavar"] = flag.metadata["metavar"]
    kind = _without_none(flag.type)
    if kind is bool:
        return {**kwargs, "action": "store_true"}
    if get_origin(kind) is tuple:
        return {**kwargs, "action": "append", "default": list(default)}
    if default is dataclasses.MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = default
    if get_origin(kind) is Literal:
        return {**kwargs, "choices": list(get_args(kind))}
    if kind not in _SCALARS:
        raise TypeError(f"{flag.option}: no command-line form for {flag.type!r}")
    return {**kwargs, "type": kind} if kind is not str else kwargs


def _without_none(kind: Any) -> Any:
    """`X` for `X | None`, else `kind`."""
    if get_origin(kind) in (Union, types.UnionType):
        rest = [arg for arg in get_args(kind) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return kind


def add_flags(parser: argparse.ArgumentParser, cls: type, *, defaults: Mapping[str, Any] | None = None,
              skip: tuple[str, ...] = ()) -> None:
    """Add the flags of `cls` to `parser`; `defaults` replaces some fields' defaults (by attribute
    name) for this command; `skip` leaves out flags this command does not take (their fields keep
    their defaults)."""
    defaults = defaults or {}
    for flag in _flags(cls):
        if flag.dest not in skip:
            parser.add_argument(flag.option, **_argparse_kwargs(flag, defaults.get(flag.dest, flag.default)))


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The `cls` those parsed flags describe (a flag the command skipped takes its field's default,
    unless the command set the attribute); ValueError naming the flag."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            values[field.name] = from_args(kind, args)
        elif hasattr(args, field.name):
            value = getattr(args, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    with _naming_flags(cls):
        return cls(**values)


@contextlib.contextmanager
def _naming_flags(cls: type) -> Iterator[None]:
    """Re-raise a config's ValueError "field: ..." as one naming the flag ("--field-name: ...")."""
    try:
        yield
    except ValueError as error:
        field, _, rest = str(error).partition(": ")
        options = {flag.dest: flag.option for flag in _flags(cls)}
        if field not in options:
            raise
        raise ValueError(f"{options[field]}: {rest}") from None


def to_argv(config: Any, *, defaults: Mapping[str, Any] | None = None) -> list[str]:
    """The arguments that make a parser built by `add_flags(parser, type(config), defaults=...)`
    give `config`: every flag whose value is not its default."""
    defaults = defaults or {}
    argv: list[str] = []
    for flag in _flags(type(config)):
        value = functools.reduce(getattr, flag.path, config)
        if value == defaults.get(flag.dest, flag.default):
            continue
        if value is True:
            argv.append(flag.option)
        elif isinstance(value, tuple):
            argv += [part for item in value for part in (flag.option, str(item))]
        else:
            argv += [flag.option, str(value)]
    return argv
