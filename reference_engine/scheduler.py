"""Continuous batching with chunked prefill under a token budget, speculative tokens counted in
the budget and in block allocation, and preemption by recompute when blocks run out."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from reference_engine.kv_cache import BlockManager
from reference_engine.request import Request


@dataclass
class Scheduled:
    request: Request
    num_tokens: int  # prefill chunk length, or 1 + drafts for a decode
    num_drafts: int = 0


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_reqs: int,
        max_num_tokens: int,
        num_spec_tokens: int,
        max_model_len: int,
        whole_drafts: bool = False,
    ) -> None:
        self.blocks = blocks
        # A token tree is drafted whole or not at all (its draft steps' queries need its every slot).
        self.whole_drafts = whole_drafts
        self.max_num_reqs, self.max_num_tokens = max_num_reqs, max_num_tokens
        self.num_spec_tokens, self.max_model_len = num_spec_tokens, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.on_preempt = lambda request: None  # the engine resets the request's device state
        # The async engine learns results one step late: before it recomputes a request from its
        # tokens, the step in flight must land (its placeholders become real tokens).
        self.before_preempt = lambda: None
        # Tokens allocated for requests already scheduled in the pass under way: a step that lands
        # during the pass (before a preemption) must not trim the blocks just allocated for them.
        self._this_pass: dict[int, int] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def preempt(self, request: Request) -> None:
        """Recompute later: drop its KV, keep its tokens."""
        self.before_preempt()
        if request not in self.running:  # it finished when the step in flight landed
            return
        self.running.remove(request)
        self.blocks.free(request.block_ids)
        request.num_computed = 0
        request.stats.preemptions += 1
        self.on_preempt(request)
        self.waiting.appendleft(request)

    def _awaiting_results(self, request: Request) -> bool:
        """Optimistically done (async): nothing to schedule until the step in flight lands."""
        return request.remaining <= 0 or request.num_tokens >= self.max_model_len

    def _drafts_for(self, request: Request) -> int:
        # Never draft past the model's length. Drafting past max_tokens is allowed (the extra
        # tokens are dropped at the stop): an async host only knows an optimistic remaining count,
        # and capping by it would make async draft differently from sync, and, with sampling,
        # emit different tokens.
        room = self.max_model_len - request.num_tokens - 1
        if self.whole_drafts:
            return self.num_spec_tokens if room >= self.num_spec_tokens else 0
        return max(0, min(self.num_spec_tokens, room))

    def reserved_tokens(self, request: Request) -> int:
        """Tokens the scheduling pass under way allocated for ``request`` beyond ``num_computed``."""
        return self._this_pass.get(request.request_id, 0)

    def schedule(self) -> list[Scheduled]:
        try:
            return self._schedule()
        finally:
            self._this_pass = {}  # the engine now counts them in num_computed

    def _schedule(self) -> list[Scheduled]:
        budget = self.max_num_tokens
        scheduled: list[Scheduled] = []
        for request in list(self.running):
            if request not in self.running or request.in_prefill or self._awaiting_results(request):
                continue
            if 1 + self._drafts_for(request) > budget:
                continue
            while request in self.running and not self.blocks.can_allocate(
                request.block_ids, request.num_computed + 1 + self._drafts_for(request)
            ):
                self.preempt(self.running[-1])  # may land the step in flight first (async)
            if request not in self.running or self._awaiting_results(request):
                continue
            drafts = self._drafts_for(request)
            self.blocks.allocate(request.block_ids, request.num_computed + 1 + drafts)
            self._this_pass[request.request_id] = 1 + drafts
            scheduled.append(Scheduled(request, 1 + drafts, drafts))
            budget -= 1 + drafts
        prefilling = [r for r in self.running if r.in_prefill]
        for request in prefilling + list(self.waiting):
            if budget <= 0:
                break
            if request in self.waiting and len(self.running) >= self.max_num_reqs:
                break
            chunk = min(request.prefill_target - request.num_computed, budget)
            if not self.blocks.can_allocate(request.block_ids, request.num_computed + chunk):
                break
            self.blocks.allocate(request.block_ids, request.num_computed + chunk)
            self._this_pass[request.request_id] = chunk
            if request in self.waiting:
                self.waiting.remove(request)
                self.running.append(request)
            scheduled.append(Scheduled(request, chunk))
            budget -= chunk
        return scheduled

    def finish(self, request: Request) -> None:
        request.finished = True
        self.running.remove(request)
        self.blocks.free(request.block_ids)
