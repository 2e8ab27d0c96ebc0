"""How the role workers fail, in their own terms: the handlers map each kind to a gRPC status code
(`services.common.errors`), so the workers need no transport.

Bad input stays a ValueError (naming the field) everywhere; this is for everything else.
"""

from __future__ import annotations

import enum


class Failure(enum.Enum):
    """What went wrong."""

    NO_ROOM = "no_room"  # the KV cache cannot hold the request (here; another worker may)
    UNAVAILABLE = "unavailable"  # a peer or a KV transfer failed
    DEADLINE = "deadline"  # a bounded wait (the KV's arrival) ran out
    MISMATCH = "mismatch"  # the peers' KV layouts differ
    CANCELLED = "cancelled"  # the request was aborted


class WorkerError(Exception):
    """A request failed at a worker for a reason other than its own bad input."""

    def __init__(self, failure: Failure, message: str, failed_prefill: str | None = None) -> None:
        """`failed_prefill`: the prefill worker (host:port) whose failure, or whose KV transfer's,
        this is: the decode worker answering is fine, and the request may run again elsewhere."""
        super().__init__(message)
        self.failure = failure
        self.message = message
        self.failed_prefill = failed_prefill

    def blaming(self, prefill: str) -> WorkerError:
        """This failure, naming `prefill` as the worker that failed (bad input is a ValueError, never
        blamed). A deadline here is the transfer's, not the client's, so it blames the worker too."""
        return WorkerError(self.failure, self.message, failed_prefill=prefill)
