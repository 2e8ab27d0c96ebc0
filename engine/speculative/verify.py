"""Which drafted tokens a verification step keeps.

Every proposer here drafts deterministically (its proposal is a point mass q on the drafted token
d), so the rejection rule of Leviathan et al. and Chen et al. (accept d with probability
min(1, p(d) / q(d)), else draw from the normalised max(0, p - q)) becomes: accept d with
probability p(d), else draw from p without d. Drawing x from the target's p at a draft's position
and accepting exactly when x == d does both at once: P(accept) = p(d), and a rejected x is
distributed as p restricted to the other tokens. So each verified position samples from p exactly
as a step without speculation would, with the same draw; the output's distribution is the
target's, and a seeded request's tokens are the ones it gets without speculation. Greedy is the
case where p puts all its mass on the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_accepted(draft_token_ids: Sequence[int], sampled_token_ids: Sequence[int]) -> int:
    """How many leading drafts the target's own samples at their positions confirm.

    `sampled_token_ids[i]` is the token the target sampled after the request's tokens and the first
    i drafts; the step emits `sampled_token_ids[: num_accepted + 1]` (the accepted drafts and the
    target's token after them: a correction where a draft was rejected, else a bonus token).
    """
    if len(sampled_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(f"{len(draft_token_ids)} drafts need {len(draft_token_ids) + 1} sampled tokens, "
                         f"got {len(sampled_token_ids)}")
    for index, (draft, sampled) in enumerate(zip(draft_token_ids, sampled_token_ids, strict=False)):
        if draft != sampled:
            return index
    return len(draft_token_ids)
