"""`tandem bench SUITE [flags]`: the benchmark suites of bench/ (`python -m bench`), from the tandem command.

The services never import bench otherwise: it is imported here only when the command runs, so a
deployment without bench/ loses this command and nothing else.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand."""
    bench = sub.add_parser("bench", help="run a benchmark suite (`tandem bench` alone lists them)",
                           description="Run one benchmark suite with its own flags: `tandem bench` alone lists the "
                                       "suites, `tandem bench SUITE --help` gives a suite's flags.")
    bench.add_argument("suite", nargs=argparse.REMAINDER, metavar="SUITE [FLAGS]")
    bench.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the suite the arguments name; its exit code."""
    from bench.suites import run as run_suite

    return run_suite(args.suite)
