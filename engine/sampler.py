"""Turns a batch of logits into next tokens.

Order of operations follows vLLM: a structured output's grammar mask first (tokens it forbids get
-inf, so logprobs are those of the constrained distribution, as vLLM reports them); logprobs come
from those logits; then repetition, presence and frequency penalties and OpenAI's logit bias; then
min_tokens blocks stop tokens; greedy rows take the argmax, the others are divided by their
temperature, filtered by top-k, top-p and min-p, and sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.model.kernels import cpu_kernels
from engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (of the raw model distribution) reported for one generated token."""

    token_id: int
    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...]  # the top-N (token id, logprob), best first; N = params.logprobs


@dataclass(frozen=True)
class SamplingRequestState:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # per-request, seeded from params.seed; None = the sampler's shared one
    allowed: np.ndarray | None = None  # a structured output's bitmask of the tokens its grammar allows here


def _padded_ids(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Stack ragged id lists into a [len(rows), longest] tensor filled with `pad`."""
    width = max(1, max((len(r) for r in rows), default=0))
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out.to(device)


def _id_mask(rows: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] bool mask with True at each row's ids."""
    # Padding points at an extra column that is dropped, so ragged rows need no special case.
    mask = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, _padded_ids(rows, vocab, device), True)
    return mask[:, :vocab]


def allowed_tokens(bitmasks: Sequence[np.ndarray], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(bitmasks), vocab] bool from int32 bitmasks (bit t % 32 of word t // 32 allows token t):
    the little-endian words' bytes unpacked low bit first, in numpy (8x faster than shifts in torch),
    and viewed as bool (0 and 1 bytes are valid bools) rather than converted: no copy on a CPU."""
    bits = np.unpackbits(np.stack(bitmasks).view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool).to(device=device)


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingRequestState]) -> torch.Tensor:
    """Return `logits` with each row's repetition, presence and frequency penalties and its logit
    bias applied.

    Repetition penalty (HF semantics) covers prompt and output tokens: positive logits are divided by
    it, negative ones multiplied. Presence and frequency penalties (OpenAI semantics) cover output
    tokens only: `logit -= frequency * count + presence * (count > 0)`.
    """
    rows, vocab = logits.shape
    device = logits.device
    outputs = [s.output_token_ids for s in states]
    seen = _id_mask([s.prompt_token_ids for s in states], vocab, device) | _id_mask(outputs, vocab, device)
    repetition = _column([s.params.repetition_penalty for s in states], device)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)

    output_ids = _padded_ids(outputs, vocab, device)
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    frequency = _column([s.params.frequency_penalty for s in states], device)
    presence = _column([s.params.presence_penalty for s in states], device)
    logits = logits - frequency * counts - presence * (counts > 0).float()
    for row, state in enumerate(states):  # OpenAI's logit_bias: added as given, after the penalties
        if state.params.logit_bias:
            ids, biases = zip(*state.params.logit_bias, strict=True)
            logits[row, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=device)
    return logits


def block_tokens(logits: torch.Tensor, blocked: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set each row's `blocked` ids to -inf, leaving alone any row where nothing would remain."""
    mask = _id_mask(blocked, logits.shape[1], logits.device)
    masked = logits.masked_fill(mask, _NEG_INF)
    has_choice = masked.isneginf().logical_not().any(dim=1, keepdim=True)
    return torch.where(has_choice, masked, logits)


def _top_k_top_p_drop_mask(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """[rows, V] bool mask of the tokens top-k and then top-p remove; `top_p` > 1 keeps everything."""
    sorted_logits, order = logits.sort(dim=1, descending=True)
    kth_best = sorted_logits.gather(1, torch.tensor(top_k, device=logits.device).unsqueeze(1) - 1)
    drop_sorted = sorted_logits < kth_best
    probs = torch.softmax(sorted_logits.masked_fill(drop_sorted, _NEG_INF), dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    drop_sorted |= mass_before >= _column(top_p, logits.device)
    return torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Return temperature-scaled `logits` [rows, V] with tokens removed by top-k, top-p, min-p set to -inf.

    Applied in that order, each on what the previous one kept. Top-k keeps every token tied with the
    k-th best. Top-p keeps the smallest set of best tokens whose probability reaches p (the best token
    always stays). Min-p drops tokens whose probability is below `min_p` times the best one's.
    """
    vocab = logits.shape[1]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    # p == 1 must keep everything, which a float cumsum that overshoots 1.0 would not guarantee.
    top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
    # Sorting the vocabulary is the expensive part, so only rows that use top-k or top-p pay for it.
    rows = [i for i in range(len(params)) if top_k[i] < vocab or top_p[i] < 1.0]
    if rows:
        drop = _top_k_top_p_drop_mask(logits[rows], [top_k[i] for i in rows], [top_p[i] for i in rows])
        logits = logits.clone()
        logits[rows] = logits[rows].masked_fill(drop, _NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(logits, dim=1)
        threshold = _column([p.min_p for p in params], logits.device) * probs.max(dim=1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    return logits


def _own_noise(generator: torch.Generator, vocab: int) -> torch.Tensor:
    """One seeded row's Exp(1) noise: its shape depends only on the vocabulary, never on the batch."""
    # Drawn on the generator's own device so a CPU generator also works for GPU logits.
    return torch.empty(vocab, dtype=torch.float32, device=generator.device).exponential_(generator=generator)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, NaN above all, as argmax picks). On CPU, fp32
    logits go through the kernels' argmax_rows (one pass over each row, faster there than torch's
    max(dim=1) and argmax); elsewhere through max(dim=1)."""
    ops = cpu_kernels(logits.device)
    if ops is not None and logits.dtype == torch.float32 and logits.shape[1] > 0 and logits.stride(1) == 1:
        return ops.argmax_rows(logits)
    return logits.max(dim=1).indices


def _is_plain_greedy(params: SamplingParams) -> bool:
    """True when the row's token is simply the argmax of the raw logits, with nothing to report."""
    return params.greedy and not params.needs_penalties and params.logprobs is None


class Sampler:
    """Picks the next token for every row of a batch; seeded rows are reproducible whatever the batch."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], seed: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, states: Sequence[SamplingRequestState]
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """Return (token id, logprobs or None when not requested) for each row of `logits` [B, V].

        Columns past `vocab_size` (padding of the embedding table) are ignored.
        """
        if logits.shape[0] != len(states):
            raise ValueError(f"logits has {logits.shape[0]} rows but {len(states)} states were given")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits has {logits.shape[1]} columns, fewer than vocab_size={self.vocab_size}")
        raw = logits[:, : self.vocab_size].float()
        constrained = [i for i, s in enumerate(states) if s.allowed is not None]
        if constrained:
            # torch.where, not masked_fill: half again as fast on a mask of tens of thousands of tokens.
            allowed = allowed_tokens([states[i].allowed for i in constrained], self.vocab_size, raw.device)
            if len(constrained) == len(states):
                raw = torch.where(allowed, raw, _NEG_INF)
            else:
                raw = raw.clone()
                raw[constrained] = torch.where(allowed, raw[constrained], _NEG_INF)
        blocked = [self._blocked_ids(s) for s in states]
        if not any(blocked) and all(_is_plain_greedy(s.params) for s in states):
            return [(token, None) for token in greedy_tokens(raw).tolist()]

        penalised_rows = [i for i, s in enumerate(states) if s.params.needs_penalties]
        blocked_rows = [i for i, ids in enumerate(blocked) if ids]
        # `raw` may alias the caller's logits and is still needed for logprobs, so edit a copy.
        adjusted = raw.clone() if penalised_rows or blocked_rows else raw
        if penalised_rows:
            adjusted[penalised_rows] = apply_penalties(adjusted[penalised_rows], [states[i] for i in penalised_rows])
        if blocked_rows:
            adjusted[blocked_rows] = block_tokens(adjusted[blocked_rows], [blocked[i] for i in blocked_rows])

        tokens = torch.empty(len(states), dtype=torch.long, device=raw.device)
        greedy_rows = [i for i, s in enumerate(states) if s.params.greedy]
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if greedy_rows:
            tokens[greedy_rows] = greedy_tokens(adjusted[greedy_rows])
        if random_rows:
            tokens[random_rows] = self._draw(adjusted[random_rows], [states[i] for i in random_rows])
        return list(zip(tokens.tolist(), self._logprobs(raw, tokens, states), strict=True))

    def advance(self, generator: torch.Generator, draws: int) -> None:
        """Move a seeded request's generator past `draws` sampled (non-greedy) tokens, so a request
        resumed on another engine continues the token sequence it would have had on this one."""
        for _ in range(draws):
            _own_noise(generator, self.vocab_size)

    def _blocked_ids(self, state: SamplingRequestState) -> list[int]:
        """Stop tokens to forbid while the request is still short of min_tokens."""
        params = state.params
        if len(state.output_token_ids) >= params.min_tokens:
            return []
        # As in vLLM, EOS is only a stop token (and so only blocked) when it is not ignored.
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return sorted(t for t in stops if t < self.vocab_size)

    def _draw(self, logits: torch.Tensor, states: Sequence[SamplingRequestState]) -> torch.Tensor:
        """Sample one token per row from the temperature-scaled, filtered distribution."""
        temperature = _column([s.params.temperature for s in states], logits.device)
        probs = torch.softmax(apply_filters(logits / temperature, [s.params for s in states]), dim=1)
        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i, and
        # its noise does not depend on the probabilities, so a seeded row's draws are batch-independent.
        return (probs / self._exponential_noise(states, logits.shape[1], logits.device)).argmax(dim=1)

    def _exponential_noise(
        self, states: Sequence[SamplingRequestState], vocab: int, device: torch.device
    ) -> torch.Tensor:
        noise = torch.empty(len(states), vocab, dtype=torch.float32, device=device)
        shared_rows = [i for i, s in enumerate(states) if s.generator is None]
        if shared_rows:
            shared = torch.empty(len(shared_rows), vocab, dtype=torch.float32, device=device)
            noise[shared_rows] = shared.exponential_(generator=self._shared_generator(device))
        for i, state in enumerate(states):
            if state.generator is not None:
                noise[i] = _own_noise(state.generator, vocab).to(device)
        # A zero draw would turn a masked token's 0/0 into NaN.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared_generators:
            self._shared_generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._shared_generators[device]

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, states: Sequence[SamplingRequestState]
    ) -> list[TokenLogprobs | None]:
        """Logprobs of the sampled tokens and the top-N, from the raw (unpenalised, unscaled) logits."""
        result: list[TokenLogprobs | None] = [None] * len(states)
        rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not rows:
            return result
        logprobs = torch.log_softmax(raw[rows], dim=1)
        row_tokens = tokens[rows]
        chosen = logprobs.gather(1, row_tokens.unsqueeze(1)).squeeze(1).tolist()
        most = min(max(states[i].params.logprobs or 0 for i in rows), raw.shape[1])
        top_values, top_ids = logprobs.topk(most, dim=1)
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
        for j, (i, token) in enumerate(zip(rows, row_tokens.tolist(), strict=True)):
            n = states[i].params.logprobs or 0
            top = tuple(zip(top_ids_list[j][:n], top_values_list[j][:n], strict=True))
            result[i] = TokenLogprobs(token_id=token, logprob=chosen[j], top=top)
        return result
