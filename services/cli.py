"""The `tandem` command line: it only translates flags into config and calls the code."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from services.commands.log_flags import LogFlags
from services.common.config_flags import add_flags

# Each module registers one subcommand and imports its heavy dependencies only when run.
_COMMAND_MODULES = (
    "services.commands.generate",
    "services.commands.worker",  # and its aliases prefill and decode
    "services.commands.gateway",
    "services.commands.chat",
    "services.commands.mesh",
    "services.commands.probe",
    "services.commands.advise",
    "services.commands.host_tier",
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every `tandem` subcommand."""
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM inference")
    add_flags(parser, LogFlags)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tandem` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
