"""The reference engine's per-request loop: synchronous speculative decoding, written to be read.

Each step: schedule (continuous batching, chunked prefill, preemption) → draft k tokens for every
decoding request (on the host: the drafter's ``propose``) → one target forward over prefill chunks
and [last token, drafts] rows, through the attention backend with a ``CommonAttentionMetadata``
built like an engine builds it (host lengths given: this loop knows them) → rejection sampling →
bookkeeping and stop checks (``Request.stops_after``) → the drafter catches up with what the
target computed (``after_target``). What it shares with the batched loop (configuration, backend,
KV pool, scheduler, drafter, admission, outputs) is ``core.EngineCore``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from backends.base import CommonAttentionMetadata
from reference_engine.core import EngineConfig, EngineCore, GenerationOutput
from reference_engine.device_state import DeviceState
from reference_engine.model import EagleHead, LlamaModel
from reference_engine.rejection import greedy_rejection, probabilistic_rejection
from reference_engine.request import Request
from reference_engine.sampling import SamplingParams, filtered_probabilities, sample
from reference_engine.scheduler import Scheduled
from reference_engine.step_inputs import StepInputs
from reference_engine.step_plan import HostLengths


@dataclass
class _Row:
    scheduled: Scheduled
    token_ids: list[int]
    start: int  # position of the first token
    decoding: bool = False
    drafts: torch.Tensor | None = None
    draft_probabilities: torch.Tensor | None = None


class Engine(EngineCore):
    def __init__(
        self, config: EngineConfig, model: LlamaModel | None = None, eagle_head: EagleHead | None = None
    ) -> None:
        if config.draft_tree is not None:
            raise ValueError("token trees are verified by the batched loops (async, sync), not the per-request loop")
        super().__init__(config, model, eagle_head)
        self.state = DeviceState(config.max_num_reqs, self.device)
        self.scheduler.on_preempt = lambda request: self.state.reset(request.request_id)

    # --- public API -----------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], on_step=None
    ) -> list[GenerationOutput]:
        """Run every prompt to completion. ``on_step(tokens generated so far)`` after each step."""
        params_list = self.validate(prompts, params)
        self.drafter.begin(prompts, params_list)
        requests = self.admit(prompts, params_list)
        decode_steps = {request.request_id: 0 for request in requests}
        while not self.scheduler.idle:
            for request_id in self.step():
                decode_steps[request_id] += 1
            if on_step is not None:
                on_step(sum(len(request.output) for request in requests))
        return self.outputs(requests, decode_steps)

    def score(self, prompt: list[int]) -> torch.Tensor:
        """Next-token logits after every prefix of ``prompt`` [len, V] (one prefill, nothing kept)."""
        request = Request(-1, list(prompt), SamplingParams())
        self.blocks.allocate(request.block_ids, len(prompt))
        try:
            hidden, _ = self.forward_rows([(request, request.prompt, 0)], self.kv_caches, self.kv_scales, self.model)
            return self.model.logits(hidden)
        finally:
            self.blocks.free(request.block_ids)

    # --- one step ---------------------------------------------------------------------------------

    def step(self) -> list[int]:
        """Run one engine step; returns the ids of requests that decoded in it."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            self.stuck()
            return []
        rows = []
        decoding = [s for s in scheduled if not s.request.in_prefill]
        proposals = self.drafter.propose([(s.request, s.num_drafts) for s in decoding]) if decoding else []
        drafts_of = {id(s): p for s, p in zip(decoding, proposals)}
        for item in scheduled:
            request = item.request
            if id(item) in drafts_of or not request.in_prefill:
                drafts, draft_probabilities = drafts_of.get(id(item), (None, None))
                draft_ids = drafts.tolist() if drafts is not None and item.num_drafts else []
                rows.append(
                    _Row(
                        item, [request.tokens[-1]] + draft_ids, request.num_computed, True, drafts, draft_probabilities
                    )
                )
            else:
                start = request.num_computed
                rows.append(_Row(item, request.tokens[start : start + item.num_tokens], start))
        hidden, starts = self.forward_rows(
            [(row.scheduled.request, self._row_inputs(row), row.start) for row in rows],
            self.kv_caches,
            self.kv_scales,
            self.model,
        )
        decoded, newly_computed = [], []
        for row, start in zip(rows, starts):
            request = row.scheduled.request
            request.stats.steps += 1
            if row.decoding:
                logits = self.model.logits(hidden[start : start + len(row.token_ids)])
                valid = self._finish_decode(row, logits)
                decoded.append(request.request_id)
            else:
                valid = len(row.token_ids)
                request.num_computed += valid
                self.state.add_computed(request.request_id, valid)
                if not request.in_prefill and not request.output:
                    logits = self.model.logits(hidden[start + valid - 1 : start + valid])
                    token = self._sample(request, logits)
                    self.state.set_last_token(request.request_id, token)
                    self._emit(request, [int(token[0])])
                elif not request.in_prefill:  # recomputed after a preemption: the input is the last output
                    self.state.set_last_token(request.request_id, torch.tensor(request.output[-1], device=self.device))
            if not request.finished:
                newly_computed.append((request, row.token_ids[:valid], row.start, hidden[start : start + valid]))
        if newly_computed:
            self.drafter.after_target(newly_computed)
        if self.config.check_device_state:
            for row in rows:
                request = row.scheduled.request
                if not request.finished and not request.in_prefill:
                    self.state.check(request.request_id, request.num_computed, request.tokens[-1])
        for row in rows:
            if row.scheduled.request.finished:
                self.state.release(row.scheduled.request.request_id)
        return decoded

    def last_token(self, request: Request) -> torch.Tensor:
        """The request's last sampled token as the device holds it: [1]."""
        slot = self.state.slot(request.request_id)
        return self.state.last_token[slot : slot + 1]

    def _row_inputs(self, row: _Row) -> torch.Tensor:
        """A row's input ids on the device: a decode row starts from the device's last token."""
        request = row.scheduled.request
        if not row.decoding:
            return torch.tensor(row.token_ids, dtype=torch.long, device=self.device)
        first = self.last_token(request)
        return torch.cat([first, row.drafts[: row.scheduled.num_drafts]]) if row.scheduled.num_drafts else first

    def _sample(self, request: Request, logits: torch.Tensor) -> torch.Tensor:
        params = request.params
        if params.greedy:
            return logits.argmax(dim=-1)
        probabilities = filtered_probabilities(logits, params.temperature, params.top_k, params.top_p)
        return sample(probabilities, self.generator(request))

    def _finish_decode(self, row: _Row, logits: torch.Tensor) -> int:
        """Accept or reject the drafts; returns how many of the row's positions now hold valid KV."""
        request, num_drafts = row.scheduled.request, row.scheduled.num_drafts
        if num_drafts == 0:
            token = self._sample(request, logits)
            self.state.commit(request.request_id, token, torch.ones(1, dtype=torch.long, device=self.device))
            request.num_computed += 1
            self._emit(request, [int(token[0])])
            return 1
        params = request.params
        drafts = row.drafts[None, :]
        count = torch.tensor([num_drafts], device=self.device)
        if params.greedy:
            tokens, emitted = greedy_rejection(drafts, logits.softmax(dim=-1)[None], count)
        else:
            target = filtered_probabilities(logits, params.temperature, params.top_k, params.top_p)[None]
            tokens, emitted = probabilistic_rejection(
                drafts, row.draft_probabilities[None], target, count, self.generator(request)
            )
        self.state.commit(request.request_id, tokens[0], emitted)
        new_tokens = tokens[0, : int(emitted[0])].tolist()  # the host mirror, one step's outputs
        request.stats.drafted += num_drafts
        request.stats.accepted += len(new_tokens) - 1
        # The KV of the last token and of every accepted draft is now valid; rejected slots are
        # simply overwritten later (seq_len never covers them).
        request.num_computed += len(new_tokens)
        self._emit(request, new_tokens)
        return len(new_tokens)

    def _emit(self, request: Request, new_tokens: list[int]) -> None:
        if not request.output:
            request.stats.first_token_time = time.perf_counter()
        for token in new_tokens:
            request.output.append(token)
            if request.stops_after(len(request.output), self.config.model.max_model_len):
                request.stats.finish_time = time.perf_counter()
                self.scheduler.finish(request)
                return

    # --- forwards ---------------------------------------------------------------------------------

    def forward_rows(self, rows: list[tuple[Request, list[int] | torch.Tensor, int]], kv_caches: list, kv_scales, run):
        """One batch through ``run(input_ids, positions, step_inputs)`` — the target, or a drafter's
        model — attending over ``kv_caches`` (the target's, or a drafter's own) with the metadata
        built here from host lengths. rows: (request, token ids, first position). Returns the
        hidden states [T, hidden] and each row's first token index."""
        token_ids, positions, slots, host = [], [], [], HostLengths()
        block_size = self.config.kv_block_size
        for request, ids, start in rows:
            token_ids.append(
                ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long, device=self.device)
            )
            for offset in range(len(ids)):
                position = start + offset
                positions.append(position)
                slots.append(request.block_ids[position // block_size] * block_size + position % block_size)
            host.add_row(start, len(ids), 0)
        width = max(len(request.block_ids) for request, _, _ in rows)
        block_table = torch.zeros(len(rows), width, dtype=torch.int32)
        for index, (request, _, _) in enumerate(rows):
            block_table[index, : len(request.block_ids)] = torch.tensor(request.block_ids, dtype=torch.int32)
        seq_lens = host.seq_lens()
        common = CommonAttentionMetadata.from_lengths(
            query_start_loc=torch.tensor(host.query_start_loc, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_table=block_table.to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            query_starts=host.query_start_loc,
            host_seq_lens=seq_lens,
        )
        step = StepInputs(self.backend, self.backend.build(common), kv_caches, common.slot_mapping, kv_scales)
        hidden = run(torch.cat(token_ids), torch.tensor(positions, device=self.device), step)
        return hidden, host.query_start_loc[:-1]
