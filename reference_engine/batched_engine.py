"""The reference engine, part 2: one batched step, run synchronously or zero-bubble async.

Per step, on the device, in stream order: upload what the host knows (one pinned copy) → draft k
tokens for the decoding rows → compute input ids, positions, slots and seq_lens from the device
state (``step_inputs``) → target forward → greedy rejection → commit into the device state →
copy the results to pinned memory and record an event.

Async (``async_scheduling``): the host schedules and launches step N + 1 before it has seen step
N's results. It assumes every draft of step N is accepted: a decoding request's host length grows
by 1 + drafts and its output by as many placeholder tokens, and blocks are allocated for that. The
device never reads those host guesses: its inputs come from the device state, which step N's
commit has already updated by the time step N + 1 runs. When step N's results land (one step
late), the host replaces the placeholders with the real tokens, takes back the rejected length,
trims blocks it over-allocated, and applies stop conditions (truncating whatever the step in flight
produced past a stop). Sync: the same step, with the host waiting for each step's results before
scheduling the next (and then it knows exact host lengths, which it passes to the backend).

A debug mode (``check_inputs``) counts on the device, without a sync, every input that is a
placeholder, every position that is not committed + offset, every slot outside the request's
blocks; the host raises when the counts arrive.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from backends.base import CommonAttentionMetadata
from reference_engine import nvtx
from reference_engine.device_state import DeviceState
from reference_engine.drafters import AcceptancePattern
from reference_engine.engine import Engine, EngineConfig, GenerationOutput
from reference_engine.handoff import Download, Downloader, Uploader
from reference_engine.metrics import StepTimer
from reference_engine.model import StepInputs
from reference_engine.rejection import PLACEHOLDER, greedy_rejection
from reference_engine.request import Request
from reference_engine.sampling import SamplingParams
from reference_engine.scheduler import Scheduled
from reference_engine.step_inputs import VIOLATION_NAMES, RowLayout, input_violations, prepare


class InputCheckFailed(AssertionError):
    pass


@dataclass
class _Row:
    request: Request
    decode: bool
    num_tokens: int
    num_drafts: int
    placeholders: int  # output tokens the host assumed this row produces


@dataclass
class _Launched:
    index: int
    rows: list[_Row]
    result: Download


@dataclass
class StepRecord:
    """Per-step host timings: the metrics module turns these into TPOT and overlap figures."""

    index: int
    iteration: int  # the loop iteration that launched it (the host-sync detector's phase)
    num_reqs: int
    num_tokens: int
    uniform_decode: bool
    captured: bool  # a CUDA graph was captured for it (a one-time cost, not steady state)
    host_schedule_s: float
    host_launch_s: float
    host_wait_s: float = 0.0  # polling for the results to land
    host_land_s: float = 0.0  # applying them


class BatchedEngine(Engine):
    def __init__(self, config: EngineConfig, model=None, eagle_head=None) -> None:
        super().__init__(config, model, eagle_head)
        k = config.num_spec_tokens
        self.state = DeviceState(config.max_num_reqs, self.device, k)
        self.scheduler.on_preempt = lambda request: self.state.reset(request.request_id)
        self.scheduler.before_preempt = self._land_pending
        max_blocks = -(-config.model.max_model_len // config.block_size)
        reqs, tokens = config.max_num_reqs, config.max_num_tokens
        self.uploads = Uploader(reqs * (max_blocks + 2 * k + 16) + 2 * tokens + 8, self.device)
        self.downloads = Downloader(reqs * (k + 2) + 8, self.device)
        self.pending: _Launched | None = None
        self.steps: list[StepRecord] = []
        self._decode_steps: dict[int, int] = {}
        self._script: torch.Tensor | None = None  # oracle: reference outputs [requests, L]
        self._script_row = torch.zeros(reqs, dtype=torch.int64, device=self.device)
        self._draft_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.timer = StepTimer(self.device.type == "cuda")
        self.sync_detector = None  # metrics.measure attaches one: a phase per loop iteration
        self.iteration = 0
        self.graphs = None
        if config.cuda_graphs:
            from reference_engine.graphs import StepGraphs

            self.graphs = StepGraphs(self)

    def _make_drafter(self, name: str):
        if name == "eagle":
            raise ValueError("the batched engine drafts with oracle:PATTERN or layer-skip[:N]; "
                             "EAGLE runs in the per-request engine (--loop simple)")
        drafter = super()._make_drafter(name)
        return drafter if isinstance(drafter, AcceptancePattern) else drafter.num_layers

    # --- public API -----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], on_step=None) -> list[GenerationOutput]:
        params_list = self._validate(prompts, params)
        if not all(p.greedy for p in params_list):
            raise ValueError("the batched engine samples greedily (temperature 0); "
                             "sampling with temperature runs in the per-request engine (--loop simple)")
        if isinstance(self.drafter, AcceptancePattern):
            script = self._oracle_script(prompts, params_list)
            width = max(map(len, script.values())) + self.config.num_spec_tokens + 1
            rows = [tokens + [0] * (width - len(tokens)) for _, tokens in sorted(script.items())]
            self._script = torch.tensor(rows, dtype=torch.int64, device=self.device)
        requests = self._admit(prompts, params_list)
        self._decode_steps = {request.request_id: 0 for request in requests}
        self.steps = []
        while not self.scheduler.idle or self.pending:
            detector = self.sync_detector
            with detector.phase(f"iteration {self.iteration}") if detector else contextlib.nullcontext():
                self._iterate(requests, on_step)
            self.iteration += 1
        return self._outputs(requests, self._decode_steps)

    def _iterate(self, requests: list[Request], on_step) -> None:
        """Schedule and launch step N + 1, then land step N (async); or launch and land (sync)."""
        started = time.perf_counter()
        with nvtx.range("schedule"):
            scheduled = self.scheduler.schedule()
        scheduled = [item for item in scheduled if not item.request.finished]  # landed while scheduling
        launched = self._launch(scheduled, started) if scheduled else None
        previous, self.pending = self.pending, launched
        landed = previous is not None
        if landed:
            self._land(previous)  # step N's results, while step N + 1 runs
        if not self.config.async_scheduling and self.pending is not None:
            self._land_pending()
        if not scheduled and not landed:
            if not self.scheduler.running:
                raise RuntimeError("the KV pool cannot hold even one waiting request: raise num_blocks")
            self.scheduler.preempt(self.scheduler.running[-1])  # nobody fits: make room
        if on_step is not None:
            on_step(sum(request.num_confirmed for request in requests))

    # --- launching a step -------------------------------------------------------------------------

    def _launch(self, scheduled: list[Scheduled], started: float) -> _Launched:
        config, k = self.config, self.config.num_spec_tokens
        bs = config.block_size
        fields = {name: [] for name in ("slots", "query_start_loc", "token_row", "host_ids", "is_decode", "num_valid",
                                        "num_drafts", "logits_index", "produces", "decode", "host_last_token", "host_start",
                                        "capacity")}
        fields["query_start_loc"].append(0)
        rows, host_seq_lens = [], []
        width = max(len(item.request.block_ids) for item in scheduled)
        block_rows = []
        prepared = time.perf_counter()
        for index, item in enumerate(scheduled):
            request = item.request
            first_time = request.request_id not in self.state.slot_of
            slot = self.state.slot(request.request_id)
            if first_time:
                self._on_new_slot(request, slot)
            decode = not request.in_prefill
            start, count = request.num_computed, item.num_tokens
            begin = fields["query_start_loc"][-1]
            fields["query_start_loc"].append(begin + count)
            fields["token_row"] += [index] * count
            if decode:
                source, host_ids = self._decode_inputs(request, count)
                fields["host_ids"] += host_ids
                logits_rows = [begin + min(j, count - 1) for j in range(k + 1)]
                placeholders, host_last = count, -1
            else:
                fields["host_ids"] += request.tokens[start : start + count]
                completes = start + count == request.prefill_target
                logits_rows = [begin + count - 1] * (k + 1)
                placeholders = 1 if completes and not request.output else 0
                # A request recomputed after a preemption resumes from its last output token.
                host_last = request.output[-1] if completes and request.output else -1
            fields["slots"].append(slot)
            fields["is_decode"].append(source if decode else 0)
            fields["decode"].append(int(decode))
            fields["num_valid"].append(count)
            fields["num_drafts"].append(item.num_drafts)
            fields["logits_index"] += logits_rows
            fields["produces"].append(int(decode or placeholders > 0))
            fields["host_last_token"].append(host_last)
            fields["host_start"].append(start)
            fields["capacity"].append(len(request.block_ids) * bs)
            block_rows += request.block_ids + [0] * (width - len(request.block_ids))
            host_seq_lens.append(start + count)
            rows.append(_Row(request, decode, count, item.num_drafts, placeholders))
            # Optimism: the host assumes every draft is accepted.
            request.num_computed += count
            request.output += [PLACEHOLDER] * placeholders
            request.steps += 1
        fields["block_table"] = block_rows
        captures = self.graphs.captures if self.graphs else 0
        self.timer.begin()
        with nvtx.range("prepare"):
            up = self.uploads.upload(fields)
        num_tokens = fields["query_start_loc"][-1]
        num_reqs = len(rows)
        layout = RowLayout(
            slots=up["slots"], query_start_loc=up["query_start_loc"].to(torch.int32), token_row=up["token_row"],
            host_ids=up["host_ids"], is_decode=up["is_decode"], num_valid=up["num_valid"],
            block_table=up["block_table"].view(num_reqs, width).to(torch.int32),
        )
        num_decodes = sum(row.decode for row in rows)
        if self.drafter is not None and num_decodes and k:
            with nvtx.range("draft"):
                self._draft(layout, up, num_decodes, max(fields["host_start"][:num_decodes]))
        with nvtx.range("build metadata"):
            starts = self._starts(up)
            step = prepare(starts, self.state.last_token, self.state.drafts, layout, 0, bs)
            violations = None
            if config.check_inputs:
                violations = input_violations(step, layout, self.state.num_computed[up["slots"]], up["host_start"],
                                              up["capacity"], config.model.vocab_size, bs)
                step.input_ids = step.input_ids.clamp(0, config.model.vocab_size - 1)  # keep running; report on landing
            common = CommonAttentionMetadata(
                query_start_loc=layout.query_start_loc, seq_lens=step.seq_lens, block_table=layout.block_table,
                slot_mapping=step.slot_mapping,
                query_start_loc_cpu=torch.tensor(fields["query_start_loc"], dtype=torch.int32),
                num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max(row.num_tokens for row in rows),
                max_seq_len=max(host_seq_lens),  # an upper bound under async: drafts assumed accepted
                host_seq_lens=None if config.async_scheduling else torch.tensor(host_seq_lens, dtype=torch.int32),
            )
        uniform = num_decodes == num_reqs and len({row.num_tokens for row in rows}) == 1
        with nvtx.range("target forward"):
            hidden = self._target_forward(step, common, uniform)
        with nvtx.range("rejection"):
            logits = self.model.logits(hidden[up["logits_index"]]).view(num_reqs, k + 1, -1)
            drafts = self.state.drafts[up["slots"], :k]
            tokens, emitted = greedy_rejection(drafts, logits, up["num_drafts"])
            emitted = emitted * up["produces"]
            self._commit(up, layout, tokens, emitted)
            results = [emitted[:, None], tokens]
            payload = torch.cat([torch.cat(results, dim=1).reshape(-1)]
                                + ([violations] if violations is not None else []))
            download = self.downloads.download(payload)
        self.timer.end()
        launched = _Launched(len(self.steps), rows, download)
        captured = (self.graphs.captures if self.graphs else 0) != captures
        self.steps.append(StepRecord(len(self.steps), self.iteration, num_reqs, num_tokens, uniform, captured,
                                     prepared - started, time.perf_counter() - prepared))
        return launched

    def _on_new_slot(self, request: Request, slot: int) -> None:
        """A request (re)enters the device state: its output count, and its oracle script row."""
        self.state.num_output[slot] = request.num_confirmed
        if self._script is not None:
            self._script_row[slot] = request.request_id

    def _decode_inputs(self, request: Request, count: int) -> tuple[int, list[int]]:
        """A decoding row's input ids come from the device state (source 1): under async
        scheduling the host's last token is a placeholder for the step still in flight."""
        return 1, [0] * count

    def _starts(self, up: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each row's committed length, read on the device (never the host's optimistic guess)."""
        return self.state.num_computed[up["slots"]]

    def _commit(self, up, layout: RowLayout, tokens: torch.Tensor, emitted: torch.Tensor) -> None:
        """The device state after this step: lengths, the next input token, the output count."""
        slots = up["slots"]
        query_lens = (layout.query_start_loc[1:] - layout.query_start_loc[:-1]).long()
        advance = torch.where(up["decode"].bool(), emitted, query_lens)
        self.state.num_computed[slots] += advance.to(torch.int32)
        last_emitted = tokens.gather(1, (emitted - 1).clamp(min=0)[:, None]).squeeze(1)
        host_last = up["host_last_token"]
        keep = torch.where(host_last >= 0, host_last, self.state.last_token[slots])
        self.state.last_token[slots] = torch.where(emitted > 0, last_emitted, keep)
        self.state.num_output[slots] += emitted.to(torch.int32)

    def _target_forward(self, step, common: CommonAttentionMetadata, uniform: bool) -> torch.Tensor:
        if self.graphs is not None and uniform:
            hidden = self.graphs.run(step, common)
            if hidden is not None:
                return hidden
        inputs = StepInputs(self.backend, self.backend.build(common), self.kv_caches, step.slot_mapping)
        return self.model(step.input_ids, step.positions, inputs)

    # --- drafting ---------------------------------------------------------------------------------

    def _draft(self, layout: RowLayout, up, num_decodes: int, max_host_start: int) -> None:
        """Fill ``state.drafts`` for the decoding rows (the first ``num_decodes``) on the device."""
        k = self.config.num_spec_tokens
        slots = up["slots"][:num_decodes]
        if isinstance(self.drafter, AcceptancePattern):
            self._draft_oracle(slots, k)
            return
        draft_layout = RowLayout(
            slots=slots, query_start_loc=torch.arange(num_decodes + 1, dtype=torch.int32, device=self.device),
            token_row=torch.arange(num_decodes, device=self.device), host_ids=torch.zeros(num_decodes, dtype=torch.int64, device=self.device),
            is_decode=torch.ones(num_decodes, dtype=torch.int64, device=self.device), num_valid=up["num_drafts"][:num_decodes],
            block_table=layout.block_table[:num_decodes],
        )
        starts = self.state.num_computed[slots]
        for index in range(k):
            step = prepare(starts, self.state.last_token, self.state.drafts, draft_layout, index, self.config.block_size)
            common = CommonAttentionMetadata(
                query_start_loc=draft_layout.query_start_loc, seq_lens=step.seq_lens, block_table=draft_layout.block_table,
                slot_mapping=step.slot_mapping, query_start_loc_cpu=torch.arange(num_decodes + 1, dtype=torch.int32),
                num_reqs=num_decodes, num_actual_tokens=num_decodes, max_query_len=1,
                max_seq_len=max_host_start + index + 1,
            )
            inputs = StepInputs(self.backend, self.backend.build(common), self.kv_caches, step.slot_mapping)
            hidden = self.model(step.input_ids, step.positions, inputs, self.drafter)
            self.state.drafts[slots, index] = self.model.logits(hidden).argmax(dim=-1)

    def _draft_oracle(self, slots: torch.Tensor, k: int) -> None:
        """Scripted drafts: the reference continuation where the pattern says right, +1 elsewhere."""
        offsets = torch.arange(k, device=self.device)
        index = (self.state.num_output[slots].long()[:, None] + offsets).clamp(max=self._script.shape[1] - 1)
        right = self._script[self._script_row[slots]].gather(1, index)
        pattern = self.drafter
        if pattern.kind == "random":
            correct = torch.rand(right.shape, generator=self._draft_generator, device=self.device) < pattern.value
        else:
            limit = {"all": k, "none": 0}.get(pattern.kind, pattern.value)
            correct = (offsets < limit)[None, :].expand_as(right)
        self.state.drafts[slots, :k] = torch.where(correct, right, (right + 1) % self.config.model.vocab_size)

    # --- landing a step's results -------------------------------------------------------------------

    def _land_pending(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._land(pending)

    def _land(self, launched: _Launched) -> None:
        """Step N's results reach the host: placeholders become tokens, lengths and blocks shrink
        by what was rejected, stop conditions apply."""
        waited = time.perf_counter()
        launched.result.wait()
        landed = time.perf_counter()
        self.steps[launched.index].host_wait_s = landed - waited
        self._apply(launched)
        self.steps[launched.index].host_land_s = time.perf_counter() - landed

    def _apply(self, launched: _Launched) -> None:
        with nvtx.range("output processing"):
            k = self.config.num_spec_tokens
            values = launched.result.wait().tolist()
            width = k + 2
            if self.config.check_inputs:
                counts = values[len(launched.rows) * width :]
                if any(counts):
                    found = "; ".join(f"{name} ({count})" for name, count in zip(VIOLATION_NAMES, counts) if count)
                    raise InputCheckFailed(f"step {launched.index}: {found}")
            for index, row in enumerate(launched.rows):
                request = row.request
                if request.finished or not row.placeholders:
                    continue
                emitted = values[index * width]
                tokens = values[index * width + 1 : index * width + 1 + emitted]
                begin = request.num_confirmed
                if request.output[begin : begin + row.placeholders] != [PLACEHOLDER] * row.placeholders:
                    raise AssertionError(f"request {request.request_id}: host output out of step with the device")
                request.output[begin : begin + row.placeholders] = tokens
                request.num_computed -= row.placeholders - emitted
                if row.decode:
                    request.drafted += row.num_drafts
                    request.accepted += emitted - 1
                    self._decode_steps[request.request_id] += 1
                self._confirm(request, emitted)
                if not request.finished:
                    self.blocks.trim(request.block_ids, request.num_computed)

    def _confirm(self, request: Request, count: int) -> None:
        params = request.params
        if request.num_confirmed == 0 and count:
            request.first_token_time = time.perf_counter()
        for _ in range(count):
            token = request.output[request.num_confirmed]
            request.num_confirmed += 1
            eos = params.eos_token_id is not None and token == params.eos_token_id and not params.ignore_eos
            too_long = len(request.prompt) + request.num_confirmed >= self.config.model.max_model_len
            if eos or request.num_confirmed >= params.max_tokens or too_long:
                del request.output[request.num_confirmed :]  # whatever the step in flight adds is dropped
                request.finish_time = time.perf_counter()
                self.scheduler.finish(request)
                self.state.release(request.request_id)
                return
