"""Noticing that a repository file changed: its modification time and size, polled.

Polled rather than watched with inotify: a Kubernetes ConfigMap volume swaps a symlink to publish
a new version of the file, which inotify watches of the old target do not see.
"""

from __future__ import annotations

import os


class FileStamp:
    """The last seen (modification time, size) of one file."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._seen = self._read()

    def changed(self) -> bool:
        """Whether the file differs from when this was last asked (or made); a file that cannot be
        read has not changed (the previous one stays in force)."""
        stamp = self._read()
        if stamp is None or stamp == self._seen:
            return False
        self._seen = stamp
        return True

    def _read(self) -> tuple[int, int] | None:
        try:
            status = os.stat(self._path)
        except OSError:
            return None
        return status.st_mtime_ns, status.st_size
