"""The LoRA flags of every command that runs an engine, vLLM's names (`--enable-lora`,
`--lora-modules`, `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`), and the LoraConfig they
describe."""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.config import LoraConfig
from services.common.config_flags import flag

_DEFAULT = LoraConfig()
_MODULE_KEYS = {"name", "path"}


@dataclass(frozen=True)
class LoraFlags:
    """One field per flag, as the command line gives them; `lora_config` turns them into a LoraConfig."""

    enable_lora: bool = flag(False, "serve LoRA adapters over the model: a request names one as its `model` "
                             "(adapters of rank up to --max-lora-rank on q/k/v/o/gate/up/down, loaded at start-up "
                             "with --lora-modules or later over the worker's LoraAdapters service)")
    lora_modules: tuple[str, ...] = flag(
        (), "with --enable-lora: an adapter to serve from start-up, NAME=PATH (a PEFT adapter's directory) or "
        'vLLM\'s JSON \'{"name": "NAME", "path": "PATH"}\'; repeat the flag for more', metavar="NAME=PATH")
    max_loras: int = flag(_DEFAULT.max_loras, "with --enable-lora: adapters one step may run (each in a slot "
                          "the worker holds; a request whose adapter finds no free slot waits)")
    max_lora_rank: int = flag(_DEFAULT.max_lora_rank, "with --enable-lora: the highest rank an adapter may have "
                              "(the slots are this big)")
    max_cpu_loras: int | None = flag(_DEFAULT.max_cpu_loras, "with --enable-lora: adapters kept read in memory, "
                                     "the least recently used idle one dropped beyond (default: --max-loras)")


def lora_config(flags: LoraFlags) -> LoraConfig | None:
    """The LoraConfig those flags describe (None without --enable-lora); ValueError naming the flag."""
    if not flags.enable_lora:
        given = [option for option, value in (("--lora-modules", flags.lora_modules),
                                              ("--max-loras", flags.max_loras != _DEFAULT.max_loras),
                                              ("--max-lora-rank", flags.max_lora_rank != _DEFAULT.max_lora_rank),
                                              ("--max-cpu-loras", flags.max_cpu_loras is not None)) if value]
        if given:
            raise ValueError(f"{given[0]}: serves LoRA adapters, which --enable-lora turns on")
        return None
    modules = tuple(_module(text) for text in flags.lora_modules)
    try:
        return LoraConfig(flags.max_loras, flags.max_lora_rank, flags.max_cpu_loras, modules)
    except ValueError as error:  # "max_loras: ..." from the config: name the flag
        field, _, reason = str(error).partition(": ")
        raise ValueError(f"--{field.replace('_', '-')}: {reason}") from None


def _module(text: str) -> tuple[str, str]:
    """(name, path) of one --lora-modules value; ValueError naming the flag."""
    if text.lstrip().startswith("{"):
        try:
            given = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules: {text!r} is not JSON: {error}") from None
        if not isinstance(given, dict) or set(given) - _MODULE_KEYS or not all(
                isinstance(given.get(key), str) and given[key] for key in _MODULE_KEYS):
            raise ValueError(f'--lora-modules: {text!r}: give {{"name": "NAME", "path": "PATH"}} (strings, no other '
                             "keys)")
        return given["name"], given["path"]
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise ValueError(f"--lora-modules: {text!r}: give NAME=PATH")
    return name, path
