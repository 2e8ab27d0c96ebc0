"""Token-budget continuous batching with chunked prefill, prefix caching and preemption.

Like vLLM v1, the scheduler counts tokens, not phases: every request has `num_computed_tokens`
and a target (all its tokens), and each step hands out at most `max_num_batched_tokens` of
work. A decode step is simply a request one token behind its target. Imports no torch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import SchedulerConfig
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.kv_budget import KeptBlocks
from engine.kv_cache.manager import KVCacheManager
from engine.kv_connector.scheduler_side import KVConnectorScheduler
from engine.kv_connector.tier_loading import TierLoading, TierLoads
from engine.lora.registry import AdapterRegistry
from engine.request import FinishReason, Request, RequestStatus
from engine.speculative.gate import record_verification
from engine.speculative.stats import SpecDecodeStats
from engine.structured.state import GrammarError

if TYPE_CHECKING:
    from engine.lora.adapter import LoraAdapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledChunk:
    """Work for one request in one step: compute tokens [start, start + num_tokens)."""

    request: Request
    start: int
    num_tokens: int
    block_table: tuple[int, ...]
    # Speculative decoding: the last len(draft_token_ids) of the num_tokens positions hold these
    # proposed tokens (not yet in request.token_ids), each position's logits verifying the next.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's known tokens, so its last
        position's logits give the next token (and a draft's positions verify the drafts)."""
        return self.start + self.num_tokens - len(self.draft_token_ids) == self.request.num_tokens

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose logits are sampled: one per draft token plus the one after them."""
        return len(self.draft_token_ids) + 1 if self.samples else 0


@dataclass
class SchedulerOutput:
    """One step's batch, in execution order, and the requests preempted to make room for it."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # LoRA: (slot, adapter) to copy into the runner's slots before this step's forward.
    adapter_loads: list[tuple[int, LoraAdapter]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Total tokens computed in this step."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.chunks


class Scheduler:
    """Decides which requests run each step and keeps their KV blocks allocated.

    Like vLLM v1's, it consults the KV connector's scheduler side (`connector`): for the requests
    whose KV comes from elsewhere (reserved, then started), and for which finished requests keep
    their blocks and until when (released, or expired by `expire`).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        *,
        eos_token_ids: Iterable[int] = (),
        connector: KVConnectorScheduler | None = None,
        tier_loads: TierLoads | None = None,
        adapters: AdapterRegistry | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.connector = connector or KVConnectorScheduler()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every request that holds state here
        self.total_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        # The requests whose prefix loads from a lower KV tier in this step (None: no tiers).
        self.tier_loading = None if tier_loads is None else TierLoading(kv, self.connector, tier_loads)
        # LoRA adapters (None: none served): a request under one runs only while it holds a slot of it.
        self.adapters = adapters

    # ---- admission -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request for its first schedule."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self._enter(request)
        self.waiting.append(request)

    def admit_export(self, request: Request) -> bool:
        """Admit a request whose prompt's KV goes to another worker's reservation, on an engine that
        decodes (and so holds reservations of its own) at once: it joins the running batch holding
        a block for every known token (those a lower tier holds loading while its first step
        computes the rest), and is never preempted. False (nothing changed) when the blocks cannot be had now.

        Queued, it could wait for blocks that this engine's reservations hold, while one of them
        waits for the KV of a prompt queued the same way at the worker this one computes for: a
        cycle that only the reservations' KV deadline would break. Refused, the decode site frees
        its reservation and the request runs elsewhere."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        cached_blocks, num_cached = self._cached_prefix(request)
        from_tiers = 0 if self.tier_loading is None else self.tier_loading.lookup(request, len(cached_blocks))
        if not self._take_slot(request):
            return False
        if not self.kv.allocate_slots(request.request_id, request.num_tokens, cached_blocks):
            self._give_back_slot(request)
            return False
        request.num_computed_tokens = request.num_cached_tokens = num_cached + from_tiers * self.kv.block_size
        request.status = RequestStatus.RUNNING
        self._enter(request)
        self.running.append(request)
        if from_tiers and self.tier_loading is not None:
            # Its load runs while the step that first schedules it computes the rest.
            self.tier_loading.start(request, len(cached_blocks), from_tiers)
        return True

    def reserve(self, request: Request, timeout_s: float) -> int | None:
        """Allocate blocks for every known token of a request whose KV comes from elsewhere (the
        prompt, and a resumed request's output), reusing locally cached prefix blocks; none for a
        head its sliding window hides (KVCacheManager.hidden_head).

        The request then waits (WAITING_FOR_KV) for its pages, at most `timeout_s` seconds; its
        reservation's ticket, or None if the blocks cannot be had.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        cached_blocks, num_cached = self._cached_prefix(request)
        # Under a sliding window the head no later query sees is neither held nor sent (unless the
        # prefix cache holds more than it: then those blocks come, and the window frees them at start).
        hidden = self.kv.hidden_head(request.num_tokens)
        budget = self.kv.budget
        if budget is not None:
            # Only the blocks the prompt keeps arrive: they fill the table's tail until start_reserved
            # places them. Which blocks is the sender's to say, so no local prefix hit is used.
            num_blocks = blocks_for(request.num_tokens, self.kv.block_size)
            hidden = num_blocks - budget.kept_count(num_blocks, request.num_tokens)
            cached_blocks, num_cached = [], 0
        elif hidden <= len(cached_blocks):
            hidden = 0
        else:
            cached_blocks, num_cached = [], 0
        if not self._take_slot(request):
            return None
        if not self.kv.allocate_slots(request.request_id, request.num_tokens, cached_blocks, hidden):
            self._give_back_slot(request)
            return None
        request.num_cached_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_KV
        self._enter(request)
        to_fill = self.kv.block_table(request.request_id)[len(cached_blocks) + hidden:]
        return self.connector.reserved(request.request_id, to_fill, timeout_s)

    def start_reserved(self, request_id: str, first_token: int, kept: KeptBlocks | None = None) -> Request:
        """The KV of every known token of a reserved request has arrived; join the running batch after
        `first_token`. Under a KV budget only the blocks `kept` names arrived, and it holds only
        those. TimeoutError if its deadline passed first (its blocks were freed)."""
        self.connector.check_not_timed_out(request_id)
        request = self.requests[request_id]
        if request.status is not RequestStatus.WAITING_FOR_KV:
            raise ValueError(f"request_id: {request_id!r} is not waiting for KV")
        if (kept is None) != (self.kv.budget is None):
            raise ValueError("kept_blocks: must come with the KV of a reservation under a KV budget, and only then")
        self.connector.end(request_id)  # no page lands in a block a step computes with
        if kept is not None:
            self.kv.place_kept(request_id, kept)
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_blocks(request_id, request.token_ids, request.num_computed_tokens, request.first_block_key)
        self.kv.free_outside_window(request_id, request.num_computed_tokens)
        request.append_output(first_token)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        reason = self._stop_reason(request, first_token)
        if reason is not None:
            self.finish(request_id, reason)
        return request

    # ---- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running requests first (oldest first), then waiting ones."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                index += 1
                continue
            drafts = self._allocate_drafts(request, num_new, budget)
            if drafts:
                num_new += len(drafts)
            elif not self._allocate_or_preempt(request, num_new, out, scheduled_ids):
                continue  # the request itself was preempted; running shrank under us
            out.chunks.append(self._chunk(request, num_new, drafts))
            scheduled_ids.add(request.request_id)
            budget -= num_new
            index += 1
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        if self.adapters is not None:
            out.adapter_loads = self.adapters.take_loads()
        return out

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if num_new > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(num_new, budget)

    def _allocate_drafts(self, request: Request, num_new: int, budget: int) -> tuple[int, ...]:
        """Take the request's proposed drafts into this step if it is decoding and the budget and
        free blocks allow them all (drafts never preempt anything); () otherwise."""
        drafts, request.draft_token_ids = request.draft_token_ids, []
        if not drafts or num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return ()
        drafts = drafts[: budget - 1]
        if not drafts or not self.kv.allocate_slots(request.request_id, request.num_tokens + len(drafts)):
            return ()
        return tuple(drafts)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, out: SchedulerOutput, scheduled_ids: set[str]
    ) -> bool:
        """Allocate this step's slots, preempting the newest running requests if blocks run out
        (never an export admitted at once: it holds its blocks already, and a reservation elsewhere
        waits on it)."""
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = next((r for r in reversed(self.running) if not self.connector.pinned(r.request_id)), request)
            if victim.request_id in scheduled_ids:
                # Everything newer is already in this batch; give up on this request this step.
                victim = request
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        # Recompute-style preemption: drop the KV, requeue at the front with all tokens so far.
        self.running.remove(request)
        self.kv.free(request.request_id)
        self._give_back_slot(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.total_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        out.preempted.append(request.request_id)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        prompt_limit = self.config.max_prompt_batch_tokens
        prompt_tokens = sum(c.num_tokens for c in out.chunks if c.start < c.request.num_prompt_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached_blocks, num_cached = self._cached_prefix(request)
            # Blocks a lower tier holds count as cached: they load while this step computes the rest.
            from_tiers = 0 if self.tier_loading is None else self.tier_loading.lookup(request, len(cached_blocks))
            num_cached += from_tiers * self.kv.block_size
            num_new = request.num_tokens - num_cached
            if prompt_limit is not None and prompt_tokens and prompt_tokens + num_new > prompt_limit:
                break
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            # The queue's head waits for a slot of its adapter (none jumps it: no adapter starves).
            if not self._take_slot(request):
                break
            if not self.kv.allocate_slots(request.request_id, num_cached + num_new, cached_blocks):
                self._give_back_slot(request)
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if from_tiers and self.tier_loading is not None:
                self.tier_loading.start(request, len(cached_blocks), from_tiers)
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
            prompt_tokens += num_new
        return budget

    def tier_loaded(self, request: Request) -> None:
        """A lower tier's load for the request wrote every layer in this step (before `update`)."""
        if self.tier_loading is not None:
            self.tier_loading.finish(request)

    def rewind(self, request_id: str) -> None:
        """A lower tier's load for the request failed in this step (before `update`): it keeps its
        blocks and its place in the running batch (an export is never requeued), but counts only its
        device prefix hit as computed, so the next steps recompute the rest over the blocks that
        never loaded (none of them was hashed)."""
        request = self.requests[request_id]
        if self.tier_loading is not None:
            # First: no late write lands in blocks the request now computes.
            request.num_computed_tokens = self.tier_loading.fail(request_id)
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens

    def _cached_prefix(self, request: Request) -> tuple[list[int], int]:
        return self.kv.find_cached_prefix(request.token_ids, request.first_block_key)

    def _chunk(self, request: Request, num_new: int, drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        return ScheduledChunk(
            request=request,
            start=request.num_computed_tokens,
            num_tokens=num_new,
            block_table=tuple(self.kv.block_table(request.request_id)),
            draft_token_ids=drafts,
        )

    def update(self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> list[Request]:
        """Advance computed counts, record sampled tokens and finish requests that stop on a token.

        `sampled` holds each sampling request's new tokens: one, or after a draft the accepted
        drafts and the token after them. Tokens after a stop are dropped, and so is the KV of
        rejected drafts (a block that held only rejected ones is freed; none is ever hashed).
        Returns the requests that finished in this step.
        """
        finished: list[Request] = []
        for chunk in out.chunks:
            request = chunk.request
            if request.is_finished:
                continue
            tokens = sampled.get(request.request_id, ())
            reason = None
            for token in tokens:
                request.append_output(token)
                reason = self._stop_reason(request, token)
                if reason is not None:
                    break
            if reason is None and tokens and self.connector.hands_off(request):
                reason = FinishReason.HANDOFF
            drafts = len(chunk.draft_token_ids)
            accepted = max(0, len(tokens) - 1) if drafts else 0
            if drafts:
                self.spec_stats.record(drafts, accepted)
                request.num_draft_tokens += drafts
                request.num_accepted_tokens += accepted
                record_verification(request, drafts, accepted)
            computed = chunk.start + chunk.num_tokens - drafts + accepted
            request.num_computed_tokens = min(computed, request.num_tokens)
            if accepted < drafts:
                self.kv.trim(request.request_id, request.num_computed_tokens)
            self.kv.cache_blocks(request.request_id, request.token_ids, request.num_computed_tokens,
                                 request.first_block_key)
            self.kv.free_outside_window(request.request_id, request.num_computed_tokens)
            # A KV budget applies once a request's known tokens are computed but the one just
            # sampled; a request that ends or hands off keeps its blocks until it goes.
            if reason is None and request.num_computed_tokens == request.num_tokens - 1:
                self.kv.evict_over_budget(request.request_id, request.num_computed_tokens)
            if reason is not None:
                self.finish(request.request_id, reason)
                finished.append(request)
        return finished

    def stop_inside_run(self, request_id: str, num_output_tokens: int) -> None:
        """A stop string ended the request at output token `num_output_tokens`, before the last of
        the tokens its step accepted: drop the rest and finish with STOP, as a step that had
        produced one token at a time would have."""
        request = self.requests[request_id]
        request.truncate_output(num_output_tokens)
        if request.is_finished:
            request.finish_reason = FinishReason.STOP
        else:
            self.finish(request_id, FinishReason.STOP)

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if request.grammar is not None:
            # As vLLM's scheduler does: the grammar takes each kept token, and a complete one ends
            # the request (whatever min_tokens says: the grammar allows nothing more).
            try:
                request.grammar.accept((token,))
            except GrammarError as error:
                log.error("request %s: %s; aborted", request.request_id, error)
                return FinishReason.ABORT
            if request.grammar.finished:
                return FinishReason.STOP
        if request.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= request.max_model_len:
            return FinishReason.LENGTH
        return None

    # ---- endings ------------------------------------------------------------------------------
    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request (stop, length, hand-off or abort) and free its blocks, unless the connector
        keeps them for a hand-off."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        if self.tier_loading is not None:
            self.tier_loading.discard(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._give_back_slot(request)
        if reason is not FinishReason.ABORT and self.connector.keeps(request):
            return request
        self.release(request_id)
        return request

    def release(self, request_id: str) -> None:
        """Free a request's blocks and forget it (a kept request: once its KV was handed off)."""
        self.connector.forget(request_id)  # first: its reservation's blocks are about to change owner
        self.kv.free(request_id)
        self._forget_adapter(self.requests.pop(request_id, None))

    def expire(self) -> list[str]:
        """Abort the requests whose connector deadline passed (a reservation whose KV never came, a
        kept request never released) and free their blocks; their ids."""
        expired = self.connector.expired()
        for request_id in expired:
            request = self.requests.pop(request_id, None)
            if self.tier_loading is not None:
                self.tier_loading.discard(request_id)
            if request is not None and not request.is_finished:
                request.status = RequestStatus.FINISHED
                request.finish_reason = FinishReason.ABORT
            self.kv.free(request_id)
            self._forget_adapter(request)
        return expired

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort at any point of a request's life; frees every block it holds."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                self.connector.forget(request_id)  # one its deadline expired: it need not be told apart now
                continue
            if request.is_finished:
                self.release(request_id)  # kept for a hand-off and never released
                continue
            self.finish(request_id, FinishReason.ABORT)
            aborted.append(request)
        return aborted

    def _enter(self, request: Request) -> None:
        """The request holds state here from now on (and so holds its adapter in the served set)."""
        self.requests[request.request_id] = request
        if self.adapters is not None and request.params.lora_name:
            self.adapters.ref(request.params.lora_name)

    def _take_slot(self, request: Request) -> bool:
        return self.adapters is None or self.adapters.take_slot(request)

    def _give_back_slot(self, request: Request) -> None:
        if self.adapters is not None:
            self.adapters.give_back_slot(request)

    def _forget_adapter(self, request: Request | None) -> None:
        """A request left the engine: its slot (an expired reservation's) and its hold on its adapter go."""
        if self.adapters is not None and request is not None and request.params.lora_name:
            self.adapters.give_back_slot(request)
            self.adapters.unref(request.params.lora_name)

    # ---- introspection ---------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests queued for scheduling (including preempted ones)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.running)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests still need computed: the prefill pool's load signal."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def has_work(self) -> bool:
        """True while anything is waiting or running."""
        return bool(self.waiting or self.running)
