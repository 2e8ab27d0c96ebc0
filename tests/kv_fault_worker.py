"""A `tandem` worker whose KV senders suffer the faults a file asks for (tests/kv_faults.py).

Run as a command-line wrapper: `python -m tests.kv_fault_worker FAULT_FILE python -m services.cli
prefill ...` (what `wrapper(path)` prefixes to a worker's command line, e.g. through
harness.worker.start_worker's `wrapper`): it installs the faults, then runs the CLI in this
process with the rest of the command line.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

CLI = "services.cli"


def wrapper(fault_file: Path) -> list[str]:
    """The command-line prefix that runs a worker command under the faults of `fault_file`."""
    return [sys.executable, "-m", "tests.kv_fault_worker", str(fault_file)]


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2:4] != ["-m", CLI]:
        raise SystemExit(f"usage: python -m tests.kv_fault_worker FAULT_FILE PYTHON -m {CLI} ARGS (got {argv})")
    from tests.kv_faults import install

    fault_file, _python, _flag, _module, *args = argv
    install(Path(fault_file))
    sys.argv = [CLI, *args]
    runpy.run_module(CLI, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
