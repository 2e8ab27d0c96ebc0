"""The registration check of a worker's block hashes against the gateway's: both hash the shared
probe text (engine.kv_cache.block_hash.PROBE_TEXT), the worker with its tokenizer and salt, the
gateway with its own tokenizer for the worker's model and the salt the worker reported. Where the
chains differ (another tokenizer, another hash layout or salt rule), the gateway's routing hashes
would not name the worker's blocks: its block events are refused, loudly (an error naming the worker
and the first differing block, a metric, the health detail), and it is routed as holding nothing.
The failure peers' users report is this disagreement passing silently (TRT-LLM#18156,
llm-d-router#2889). Imports neither grpc nor torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv_cache.block_hash import prompt_block_hashes

log = logging.getLogger(__name__)

# The probe text's token ids by the gateway's tokenizer for a model version (NAME@VERSION; None: the
# gateway's one model), or None while that tokenizer is not loaded.
ProbeTokens = Callable[[str | None], Sequence[int] | None]


@dataclass(frozen=True)
class ProbeReport:
    """What a worker's load report says of its block hashes."""

    version_key: str | None
    block_size: int
    salt: bytes
    probe_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class _Verdict:
    report: ProbeReport
    refusal: str | None  # None: its hashes agree with the gateway's


class HashProbe:
    """Per worker (by address), whether its block events name blocks as the gateway's hashes do."""

    def __init__(self, probe_tokens: ProbeTokens = lambda _: None) -> None:
        self.probe_tokens = probe_tokens  # the gateway's tokenizers load after the registry starts
        self.mismatches = 0  # refusals for hashes that differ (not for a check still to come)
        self._verdicts: dict[str, _Verdict] = {}

    def check(self, address: str, report: ProbeReport) -> None:
        """Judge the worker's latest report (once per distinct report; again while its model's
        tokenizer was not yet loaded here)."""
        known = self._verdicts.get(address)
        if known is not None and known.report == report and not _pending(known.refusal):
            return
        refusal = self._judge(address, report)
        self._verdicts[address] = _Verdict(report, refusal)

    def refusal(self, address: str) -> str | None:
        """Why the worker's block events are not used for routing; None when they are."""
        verdict = self._verdicts.get(address)
        return verdict.refusal if verdict is not None else _PENDING + "no load report yet"

    def forget(self, address: str) -> None:
        """The worker is gone or its stream broke: the next report is judged afresh."""
        self._verdicts.pop(address, None)

    def refused(self) -> list[str]:
        """The addresses of the workers whose block events are refused now."""
        return [address for address, verdict in self._verdicts.items() if verdict.refusal is not None]

    def _judge(self, address: str, report: ProbeReport) -> str | None:
        if not report.salt or not report.probe_hashes:
            return self._refuse(address, "its load reports carry no block-hash salt or probe hashes (a worker "
                                "that predates the exact prefix index)")
        tokens = self.probe_tokens(report.version_key)
        if tokens is None:
            return _PENDING + f"the gateway's tokenizer for {report.version_key or 'its model'} is not loaded yet"
        expected = prompt_block_hashes(tokens, report.block_size, report.salt)
        theirs = report.probe_hashes
        if list(theirs) == expected:
            return None
        index = next((i for i, (a, b) in enumerate(zip(theirs, expected, strict=False)) if a != b),
                     min(len(theirs), len(expected)))
        return self._refuse(address, f"probe block {index} differs: the worker hashed "
                            f"{_short(theirs, index)}, the gateway {_short(expected, index)} "
                            f"({len(theirs)} and {len(expected)} probe blocks)")

    def _refuse(self, address: str, why: str) -> str:
        self.mismatches += 1
        log.error("worker %s: its KV block hashes disagree with the gateway's, so its block events are refused and "
                  "it is routed as holding no cached prefix: %s", address, why)
        return f"refused: {why}"


_PENDING = "not yet checked: "


def _short(hashes: Sequence[bytes], index: int) -> str:
    return hashes[index].hex()[:16] if index < len(hashes) else "no such block"


def _pending(refusal: str | None) -> bool:
    return refusal is not None and refusal.startswith(_PENDING)
