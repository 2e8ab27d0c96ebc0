"""The kv_rig sender (bench.common.kv_rig.sender_process) in a process reached through its stdin and
stdout, one JSON line a message, so that it can run on another host (`ip netns exec`, see
harness.hosts), where a multiprocessing pipe cannot follow.

    sender = RemoteSender(hosts.exec_argv("prefill-1"), "int4")  # the pages' KV format
    run = kv_rig.BackendRun(sender, receiver, kv_rig.layout_of("int4"))  # what BackendRun sends and receives
    ... run.once() ...
    sender.close()
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import IO

from bench.common.kv_rig import LAYOUT, layout_of, sender_process
from harness.paths import REPO


def _encode(message: tuple) -> str:
    return json.dumps([{"hex": part.hex()} if isinstance(part, bytes) else part for part in message])


def _decode(line: str) -> tuple:
    if not line:
        raise EOFError("the other side closed the pipe")
    value = json.loads(line)
    if not isinstance(value, list):
        return value
    return tuple(bytes.fromhex(part["hex"]) if isinstance(part, dict) else part for part in value)


class LineConnection:
    """The two methods of a multiprocessing Connection that the rig uses, over text streams."""

    def __init__(self, reader: IO[str], writer: IO[str]) -> None:
        self._reader = reader
        self._writer = writer

    def send(self, message: object) -> None:
        """Write one message (a tuple of JSON values and bytes, or a JSON value)."""
        self._writer.write((_encode(message) if isinstance(message, tuple) else json.dumps(message)) + "\n")
        self._writer.flush()

    def recv(self) -> object:
        """Read one message; EOFError once the other side is gone."""
        return _decode(self._reader.readline())


class RemoteSender(LineConnection):
    """`python -m bench.common.remote_sender KV_DTYPE` started behind `wrapper`; the rig's sender
    connection, its pages the rig's layout in KV format `kv_dtype` (kv_rig.layout_of): a receiver
    expecting another format refuses them."""

    def __init__(self, wrapper: Sequence[str], kv_dtype: str = LAYOUT.dtype) -> None:
        self.proc = subprocess.Popen([*wrapper, sys.executable, "-m", "bench.common.remote_sender", kv_dtype],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        super().__init__(self.proc.stdout, self.proc.stdin)

    def close(self) -> int:
        """Ask the sender to exit and wait for it (killed after 30 s); its exit code."""
        try:
            self.send(("exit",))
            return self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            return self.proc.wait()


if __name__ == "__main__":
    sender_process(LineConnection(sys.stdin, sys.stdout), layout_of(sys.argv[1]))  # type: ignore[arg-type]
