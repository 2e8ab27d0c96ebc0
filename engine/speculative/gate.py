"""Which requests draft: those whose recent drafts paid for their verification.

A verification step of a few rows costs more than a step of one (`python -m bench speculative`,
docs/benchmarks.md), so a draft pays only when it keeps about one token or more. Acceptance is
bimodal: a request copying a span of its prompt keeps most drafts, one writing freely keeps almost
none, and n-gram matches come for both. So each request keeps a running mean of the tokens its
drafts kept; below one it stops drafting and probes again after some steps, which a request
entering a copied span needs.
"""

from __future__ import annotations

from engine.request import Request

# Tokens a verification must keep, on a running mean, for its request to go on drafting.
KEEP_TO_DRAFT = 1.0
# Weight of the latest verification in the mean: two failures in a row silence a request that
# had been keeping one token a draft.
RECENT_WEIGHT = 0.5
# What a silent step adds to the mean: a request silenced by failures (mean about 0.5) probes again
# after about ten steps, so a silent request spends a tenth of a verification's extra time per step.
PROBE_CREDIT = 0.05


def may_draft(request: Request) -> bool:
    """Whether `request` drafts this step; a silent step moves it toward its next probe."""
    if request.recent_kept is None or request.recent_kept >= KEEP_TO_DRAFT:
        return True
    request.recent_kept += PROBE_CREDIT
    return False


def record_verification(request: Request, kept: int) -> None:
    """Fold one verification's kept drafts into the request's running mean (the first sets it)."""
    previous = request.recent_kept
    request.recent_kept = float(kept) if previous is None else (1 - RECENT_WEIGHT) * previous + RECENT_WEIGHT * kept
