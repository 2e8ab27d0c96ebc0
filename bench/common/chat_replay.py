"""Replaying multi-turn conversations (bench.common.conversations) through one or more gateways, as a
chat application behind a load balancer does: every turn resends the whole history, and a turn's
gateway is not its previous turn's.

Turns go round-robin over the conversations (every first turn, then every second turn, ...) with
`concurrency` requests in flight; a conversation's next turn waits for its previous reply, so the
order is the same in every replay.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


def gateway_of(conversation: int, turn: int, gateways: int) -> int:
    """The gateway (index) that turn `turn` (from 0) of conversation `conversation` goes to: consecutive
    turns of a conversation alternate between the gateways, and the conversations start on every one
    in turn (a round-robin balancer seen from one conversation)."""
    return (conversation + turn) % gateways


@dataclass(frozen=True)
class Replay:
    """What to send: the conversations' human turns, the assistant's replies (None where the model's
    own, made during the replay, go), and how."""

    conversations: list[list[str]]
    replies: list[list[str | None]]  # filled in by the first replay
    turns: int
    max_tokens: int
    concurrency: int
    cache_salt: str  # a fresh prefix-cache namespace per replay: nothing of an earlier one is a hit

    def run(self, gateways: Sequence[str], tokenizer) -> list[dict]:
        """Every turn through the gateway `gateway_of` names (addresses): per request its turn (from
        1), gateway, TTFT, prompt and cached tokens."""
        from services.client import TandemClient

        clients = [TandemClient(address) for address in gateways]
        answered = [[threading.Event() for _ in range(self.turns)] for _ in self.conversations]
        requests: list[dict] = []

        def turn(job: tuple[int, int]) -> None:
            try:
                requests.append(self._ask(clients, tokenizer, answered, *job))
            finally:  # a failed turn fails the replay (pool.map raises it), not its next turn's wait
                answered[job[0]][job[1]].set()

        jobs = [(index, number) for number in range(self.turns) for index in range(len(self.conversations))]
        try:
            # Submitted in turn order: a thread waits on a previous turn only behind the turns submitted
            # before it, so the pool never deadlocks.
            with ThreadPoolExecutor(self.concurrency) as pool:
                list(pool.map(turn, jobs))
        finally:
            for client in clients:
                client.close()
        return requests

    def _ask(self, clients, tokenizer, answered, index: int, number: int) -> dict:
        if number:
            answered[index][number - 1].wait()
        history: list[dict] = []
        for earlier in range(number):
            history += [{"role": "user", "content": self.conversations[index][earlier]},
                        {"role": "assistant", "content": self.replies[index][earlier]}]
        prompt = tokenizer.encode_chat([*history, {"role": "user", "content": self.conversations[index][number]}])
        gateway = gateway_of(index, number, len(clients))
        started = time.perf_counter()
        ttft, reply, usage = None, [], None
        for chunk in clients[gateway].generate(token_ids=prompt, max_tokens=self.max_tokens, temperature=0.0,
                                               ignore_eos=True, cache_salt=self.cache_salt, timeout=600):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - started
            reply += chunk.token_ids
            usage = chunk.usage or usage
        if self.replies[index][number] is None:
            self.replies[index][number] = tokenizer.decode(reply)
        return {"turn": number + 1, "gateway": gateway, "ttft_s": ttft, "prompt_tokens": len(prompt),
                "cached_tokens": usage.cached_tokens if usage is not None else 0}
