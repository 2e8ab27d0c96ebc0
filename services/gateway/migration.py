"""Moving a request whose decode worker failed mid-stream to another decode worker (migration).

The gateway keeps what the client already has of each request's output: the token ids and the
length of their text. When the decode stream fails with UNAVAILABLE (the worker died, or its
connection did) after it streamed tokens, the request is resumed on another decode worker from
there: that worker has the prompt and those tokens computed (by a prefill worker, or itself, as the
router chooses), treats the tokens as output already generated, and streams only what follows, its
text starting where the client's ended. So the client's stream goes on without a gap or a
duplicate. At most `max_migrations` times per request; past that the client gets the failure.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import grpc

from engine.resume import Resumed
from services.common.chunk import Chunk, Timings
from services.common.errors import StatusError


@dataclass(frozen=True)
class MigrationPolicy:
    """How often one request may move to another decode worker after streaming (0: never)."""

    max_migrations: int = 2

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations: must be >= 0, got {self.max_migrations}")


class StreamProgress:
    """One request's output as its client received it, across the decode workers that produced it.

    Create it when the request is admitted; pass every chunk through `delivered` on its way out.
    """

    def __init__(self, policy: MigrationPolicy) -> None:
        self._policy = policy
        self.token_ids: list[int] = []
        self.text_length = 0
        self.migrations = 0
        self._finished = False
        self._started_at = time.perf_counter()
        self._first_at: float | None = None

    def context(self, prompt: list[int]) -> list[int]:
        """What the next attempt's workers compute before generating: the prompt and the output so far."""
        return prompt + self.token_ids

    def resumed(self) -> Resumed | None:
        """Where the next attempt starts from; None while the client has no token yet."""
        return Resumed(tuple(self.token_ids), self.text_length) if self.token_ids else None

    def delivered(self, chunk: Chunk) -> Chunk:
        """Record a chunk the client is about to get; the chunk to send. After a migration the last
        worker's final timings cover only its own part, so ttft, tpot and e2e become the whole
        stream's as the gateway saw it (from admission); the other figures stay the last attempt's."""
        now = time.perf_counter()
        if chunk.token_ids and self._first_at is None:
            self._first_at = now
        self.token_ids.extend(chunk.token_ids)
        self.text_length += len(chunk.text)
        self._finished = self._finished or chunk.finish_reason is not None
        if chunk.timings is None or not self.migrations:
            return chunk
        return dataclasses.replace(chunk, timings=self._whole_stream(chunk.timings, now))

    def migrate(self, error: StatusError) -> bool:
        """An attempt failed after streaming tokens: whether the request moves on (the worker is
        unavailable, the client has not had the last chunk, and the limit is not reached). A
        migration is counted when it does."""
        if (error.code != grpc.StatusCode.UNAVAILABLE or self._finished
                or self.migrations >= self._policy.max_migrations):
            return False
        self.migrations += 1
        return True

    def _whole_stream(self, timings: Timings, now: float) -> Timings:
        first_at = self._first_at if self._first_at is not None else now
        tokens = len(self.token_ids)
        return dataclasses.replace(
            timings,
            ttft_s=first_at - self._started_at,
            tpot_s=(now - first_at) / (tokens - 1) if tokens > 1 else 0.0,
            e2e_s=now - self._started_at,
        )
