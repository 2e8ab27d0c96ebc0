"""Where one request is at its decode worker and when it got there: the stage it is in, the time
each stage began, and the prefill worker's own figures. The request's Timings are worked out here,
in one place, for the final chunk; its trace spans and metrics read the same record."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from services.common.chunk import Timings


class DecodeStage(enum.Enum):
    """A request's stages at its decode worker, in order, the first from its arrival (a local prefill
    goes from RESERVING to DECODING: the engine computes the prompt in the batch)."""

    RESERVING = "reserving"  # waiting for the engine to reserve the prompt's blocks
    RESERVED = "reserved"  # blocks reserved; registering the transfer with the KV receiver
    PREFILLING = "prefilling"  # the prefill worker computes the prompt
    TRANSFERRING = "transferring"  # the first token is back; the last pages are still arriving
    JOINING = "joining"  # the KV is complete; waiting for the engine to join the request to the batch
    DECODING = "decoding"  # in the running batch, streaming
    DONE = "done"  # finished normally

    @property
    def holds_reservation(self) -> bool:
        """Whether the request's blocks are reserved for KV that has not (all) arrived."""
        return self in (DecodeStage.RESERVED, DecodeStage.PREFILLING, DecodeStage.TRANSFERRING, DecodeStage.JOINING)


@dataclass(frozen=True)
class PrefillFigures:
    """What the prefill worker reported of its part."""

    queue_s: float
    compute_s: float
    delivery_wait_s: float  # its wait, after its first token, for the pages to arrive


class DecodeProgress:
    """One request's progress at this worker (perf_counter times)."""

    def __init__(self, arrived_at: float, resumed_tokens: int = 0,
                 on_enter: Callable[[DecodeStage], None] | None = None) -> None:
        """`resumed_tokens`: a resumed request's output delivered before it came here; `on_enter`
        hears of each stage the request enters after the first."""
        self.arrived_at = arrived_at
        self._on_enter = on_enter
        self.resumed_tokens = resumed_tokens
        self.stage = DecodeStage.RESERVING
        self.prefill: PrefillFigures | None = None
        # Prompt tokens this worker's own prefix cache held (they were not transferred).
        self.local_cached_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._began = {DecodeStage.RESERVING: arrived_at}

    def enter(self, stage: DecodeStage, at: float) -> None:
        """The request moved on to `stage` at time `at`."""
        self.stage = stage
        self._began[stage] = at
        if self._on_enter is not None:
            self._on_enter(stage)

    def began(self, stage: DecodeStage) -> float | None:
        """When the request entered `stage` (None if it never did)."""
        return self._began.get(stage)

    def streamed(self, at: float) -> None:
        """An output left for the client at time `at`."""
        if self.first_token_at is None:
            self.first_token_at = at
        self.last_token_at = at

    def between(self, start: DecodeStage, end: DecodeStage) -> float:
        """Seconds from entering `start` to entering `end` (0 when either did not happen)."""
        begin, finish = self._began.get(start), self._began.get(end)
        return finish - begin if begin is not None and finish is not None else 0.0

    def tpot_s(self, num_output_tokens: int) -> float:
        """Mean time per output token after the first (of the tokens generated here)."""
        if self.first_token_at is None or self.last_token_at is None or num_output_tokens < 2:
            return 0.0
        return (self.last_token_at - self.first_token_at) / (num_output_tokens - 1)

    def prefill_s(self) -> tuple[float, float]:
        """The prompt's queue wait and compute: the prefill worker's figures or, for a prompt computed
        here, none and its wait for the first token (it computed in the batch)."""
        if self.prefill is not None:
            return self.prefill.queue_s, self.prefill.compute_s
        if self.began(DecodeStage.RESERVED) is None and self.first_token_at is not None:
            return 0.0, self.first_token_at - self.arrived_at
        return 0.0, 0.0

    def timings(self, num_output_tokens: int) -> Timings:
        """The finished request's Timings (`num_output_tokens`: those generated here)."""
        first, last = self.first_token_at, self.last_token_at
        assert first is not None and last is not None  # the final output came after the first
        queue_s, compute_s = self.prefill_s()
        return Timings(
            ttft_s=first - self.arrived_at,
            tpot_s=self.tpot_s(num_output_tokens),
            prefill_queue_s=queue_s,
            prefill_compute_s=compute_s,
            kv_wait_s=self.between(DecodeStage.TRANSFERRING, DecodeStage.JOINING),
            e2e_s=last - self.arrived_at,
            kv_delivery_wait_s=self.prefill.delivery_wait_s if self.prefill else 0.0,
            reserve_s=self.between(DecodeStage.RESERVING, DecodeStage.RESERVED),
            batch_join_s=self.between(DecodeStage.JOINING, DecodeStage.DECODING),
        )
