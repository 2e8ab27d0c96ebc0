"""How long an engine step takes, as a linear function of what it computes, fitted from measurement.

One model covers every step a worker runs, prefill, decode and mixed:

    seconds = base + per_prompt_token * prompt tokens + per_sequence * decoding sequences
              + per_context_token * context tokens the decoding sequences attend to

so one fit predicts a prefill's time from its token count, a decode step's time from the batch it
would join, and a step that does both (the chunked local prefill of conditional disaggregation).
The worker fits it online by recursive least squares with forgetting (recent steps weigh more, so
the model follows a machine that gets busier), seeded by a short profile at start-up, and reports
the coefficients in its LoadReport; the gateway predicts with them. Imports neither torch nor grpc.
"""

from __future__ import annotations

from dataclasses import dataclass

_FEATURES = 4
# Per-step forgetting: a step's weight halves after about 350 newer steps.
_FORGET = 0.998
# Acceptance moves with the workload, so its averages follow faster: a step's weight halves after 35 steps.
_FORGET_SPECULATION = 0.98
# Prior precision: pulls coefficients that steps never exercised (e.g. prompt tokens on a pure
# decode worker) toward zero instead of leaving them undetermined. Small next to any real sample.
_PRIOR = 1e-6


@dataclass(frozen=True)
class StepModel:
    """Seconds of one engine step (see the module docstring); all coefficients are ≥ 0."""

    base_s: float = 0.0
    per_prompt_token_s: float = 0.0
    per_sequence_s: float = 0.0
    per_context_token_s: float = 0.0
    # Speculative decoding, measured over the steps that verified drafts: draft rows a decoding
    # sequence adds to a step (computed like prompt tokens), and the tokens it gains per step (1
    # without speculation); a batch of `speculation_max_batch` sequences or more drafts nothing
    # (the engine's disable_by_batch_size; 0: no limit).
    draft_rows_per_sequence: float = 0.0
    tokens_per_decode_step: float = 1.0
    speculation_max_batch: int = 0

    def step_s(self, prompt_tokens: float = 0, sequences: int = 0, context_tokens: int = 0) -> float:
        """One step computing `prompt_tokens` of prompt beside `sequences` decoding sequences."""
        return (self.base_s + self.per_prompt_token_s * prompt_tokens + self.per_sequence_s * sequences
                + self.per_context_token_s * context_tokens)

    def prefill_s(self, prompt_tokens: int, chunk_tokens: int, sequences: int = 0, context_tokens: int = 0) -> float:
        """A prompt computed in chunks of at most `chunk_tokens`, each step beside a decode batch."""
        if prompt_tokens <= 0:
            return 0.0
        steps = -(-prompt_tokens // max(1, chunk_tokens))
        return steps * self.step_s(0, sequences, context_tokens) + self.per_prompt_token_s * prompt_tokens

    def token_s(self, sequences: int, context_tokens: int) -> float:
        """Seconds per output token of each sequence decoding in a batch of `sequences`: one step,
        its drafts included, over the tokens a sequence gains in it."""
        if self.speculation_max_batch and sequences >= self.speculation_max_batch:
            return self.step_s(0, sequences, context_tokens)
        step = self.step_s(self.draft_rows_per_sequence * sequences, sequences, context_tokens)
        return step / max(1.0, self.tokens_per_decode_step)

    @property
    def known(self) -> bool:
        """Whether any step was measured yet."""
        return self.step_s(1, 1, 1) > 0


class StepModelFit:
    """Recursive least squares over (prompt tokens, sequences, context tokens) -> step seconds."""

    def __init__(self, speculation_max_batch: int = 0) -> None:
        self._speculation_max_batch = speculation_max_batch
        self._draft_rows = 0.0  # moving averages over speculating steps, per decoding sequence
        self._tokens = 1.0
        # Sufficient statistics: the weighted Gram matrix X'X and X'y.
        self._xtx = [[_PRIOR if i == j else 0.0 for j in range(_FEATURES)] for i in range(_FEATURES)]
        self._xty = [0.0] * _FEATURES
        self.samples = 0
        self._model = StepModel()

    def record(self, prompt_tokens: int, sequences: int, context_tokens: int, seconds: float) -> None:
        """Account one measured step."""
        if seconds <= 0 or prompt_tokens + sequences == 0:
            return
        x = (1.0, float(prompt_tokens), float(sequences), float(context_tokens))
        for i in range(_FEATURES):
            self._xty[i] = _FORGET * self._xty[i] + x[i] * seconds
            for j in range(_FEATURES):
                self._xtx[i][j] = _FORGET * self._xtx[i][j] + x[i] * x[j]
        self.samples += 1
        self._model = self._solve()

    def record_speculation(self, sequences: int, draft_rows: int, tokens: int) -> None:
        """Account one step in which `sequences` decoding sequences verified `draft_rows` drafts
        between them and gained `tokens` tokens."""
        if sequences <= 0 or draft_rows <= 0:
            return
        weight = 1 - _FORGET_SPECULATION
        self._draft_rows += weight * (draft_rows / sequences - self._draft_rows)
        self._tokens += weight * (tokens / sequences - self._tokens)
        self._model = self._solve()

    @property
    def model(self) -> StepModel:
        """The current fit (zeros until the first step)."""
        return self._model

    def _solve(self) -> StepModel:
        coefficients = _solve_nonnegative(self._xtx, self._xty)
        return StepModel(*coefficients, draft_rows_per_sequence=self._draft_rows, tokens_per_decode_step=self._tokens,
                         speculation_max_batch=self._speculation_max_batch)


def _solve_nonnegative(a: list[list[float]], b: list[float]) -> list[float]:
    """Least squares with coefficients ≥ 0: solve the normal equations, drop any negative
    coefficient from the active set, repeat (a step never gets faster by doing more)."""
    active = list(range(len(b)))
    while active:
        solution = _solve([[a[i][j] for j in active] for i in active], [b[i] for i in active])
        if solution is None:
            return [0.0] * len(b)
        negative = [active[k] for k, value in enumerate(solution) if value < 0]
        if not negative:
            result = [0.0] * len(b)
            for k, index in enumerate(active):
                result[index] = solution[k]
            return result
        active = [index for index in active if index not in negative]
    return [0.0] * len(b)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
