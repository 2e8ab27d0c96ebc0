"""The flags every `tandem` command takes before its name."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config_flags import flag


@dataclass(frozen=True)
class LogFlags:
    """`tandem --log-level LEVEL COMMAND ...`"""

    log_level: str = flag("INFO", "the log's threshold: DEBUG, INFO, WARNING or ERROR")
