"""The n choices of one prompt, which vLLM counts as one parent request: its figures (`n`, and the
tokens of its longest choice) are known once every choice has finished."""

from __future__ import annotations

from services.gateway.metrics import GatewayMetrics


class ChoiceGroup:
    """Shared by the core requests of one prompt's choices (one alone for a single completion)."""

    def __init__(self, metrics: GatewayMetrics, n: int = 1) -> None:
        self._metrics = metrics
        self._n = n
        self._finished = 0
        self._longest = 0

    def finished(self, generation_tokens: int) -> None:
        """A choice finished with this many generated tokens; the last one accounts the group."""
        self._finished += 1
        self._longest = max(self._longest, generation_tokens)
        if self._finished == self._n:
            self._metrics.choices_finished(self._n, self._longest)
