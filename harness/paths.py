"""Where the repository is: the tests and the benchmarks start `tandem` processes from its root."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
