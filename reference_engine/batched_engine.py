"""The reference engine, part 2: one batched step, run synchronously or zero-bubble async.

Per step: plan → draft → verify → commit → land. The host plans the step row by row (``step_plan``:
the rows the device reads, the lengths the host believes), then, on the device, in stream order:
upload the rows (one pinned copy) → the drafter drafts k tokens for the decoding rows
(``Drafter.draft``) → compute input ids, positions, slots and seq_lens from the device state
(``step_inputs``) → target forward → rejection (greedy, or probabilistic for requests with a
temperature) → commit into the device state → the drafter catches up (``Drafter.after_commit``:
EAGLE's cache, the n-gram history) → copy the results to pinned memory and record an event. The
results land on the host later (``_land``). Uniform steps run these as CUDA-graph segments
(``graphs``).

Async (``async_scheduling``): the host schedules and launches step N + 1 before it has seen step
N's results. It assumes every draft of step N is accepted: a decoding request's host length grows
by 1 + drafts and its output by as many placeholder tokens, and blocks are allocated for that. The
device never reads those host guesses: its inputs come from the device state, which step N's
commit has already updated by the time step N + 1 runs. When step N's results land (one step
late), the host replaces the placeholders with the real tokens, takes back the rejected length,
trims blocks it over-allocated, and applies the stop rule (``Request.stops_after``; truncating
whatever the step in flight produced past a stop). Sync: the same step, with the host waiting for
each step's results before scheduling the next (and then it knows exact host lengths, which it
passes to the backend).

Randomness (the scripted drafter's random pattern, sampling with a temperature) comes from counters: a
request's seed and output position hashed, never a generator, so sync and async runs draw the same
numbers and graphs replay them (``slot_sampling``).

A debug mode (``check_inputs``) counts on the device, without a sync, every input that is a
placeholder, every position that is not committed + offset, every slot outside the request's
blocks; the host raises when the counts arrive.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from backends import token_tree
from backends.base import CommonAttentionMetadata, PaddingStyle
from reference_engine import nvtx
from reference_engine.core import EngineConfig, EngineCore, GenerationOutput
from reference_engine.device_state import DeviceState
from reference_engine.drafters.base import DraftStep, TreeDraftStep, Verified
from reference_engine.empty_padding import EmptyPadding
from reference_engine.handoff import Download, Downloader, Uploader
from reference_engine.metrics import StepTimer
from reference_engine.rejection import PLACEHOLDER, greedy_rejection, rejection_with_noise
from reference_engine.request import Request
from reference_engine.sampling import SamplingParams, batched_filtered_probabilities, counter_uniform
from reference_engine.scheduler import Scheduled
from reference_engine.slot_sampling import ACCEPT_LANE, BONUS_LANE, RECOVER_LANE, SlotSampling
from reference_engine.step_inputs import (
    VIOLATION_NAMES,
    KVWrites,
    RowLayout,
    StepInputs,
    StepTensors,
    empty_step_tensors,
    input_violations,
    prepare_step_inputs,
    verified_digest_terms,
)
from reference_engine.step_plan import HostLengths, StepRows
from reference_engine.tree_rejection import tree_greedy_rejection, tree_rejection_with_noise


class InputCheckFailed(AssertionError):
    pass


@dataclass
class _LaunchedRow:
    request: Request
    decode: bool
    num_tokens: int
    num_drafts: int
    placeholders: int  # output tokens the host assumed this row produces


@dataclass
class _Launched:
    index: int
    rows: list[_LaunchedRow]
    result: Download


@dataclass(frozen=True)
class StepShape:
    """A launched step's static sizes: with ``padded``, the key of its CUDA graphs."""

    num_reqs: int  # rows, padding rows included
    num_tokens: int
    width: int  # block-table columns
    num_decodes: int  # the leading decode rows (padding rows decode)
    draft_steps: int  # draft-loop length: the most drafts of any row
    padded: bool  # a uniform step on persistent buffers (graph segments)
    sampling: bool  # some request of this generate() call has a temperature


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
    # What the step computed and emitted, for telling where two loops' tokens part whether the
    # request's steps were batched alike (``loop_tokens``): (request id, tokens) per row, and the
    # output tokens each request kept from it (its stop condition cuts the rest).
    rows: tuple[tuple[int, int], ...] = ()
    emitted: dict[int, int] = field(default_factory=dict)
    # What the backend was handed beyond the rows that the two loops may set differently: the
    # host's max_seq_len (exact in sync, an upper bound in async; a graph's is max_model_len) and
    # whether the step captured its graph.
    handed: tuple = ()


class _Buffers:
    """One step's device tensors beyond the upload; persistent per shape for padded steps."""

    def __init__(self, shape: StepShape, uploaded: StepRows[torch.Tensor], device, empty_padding: bool = False) -> None:
        reqs, decodes = shape.num_reqs, shape.num_decodes
        # Read where the upload lands (int32, at offsets the shape fixes): no copy per step.
        self.query_start_loc = uploaded.query_start_loc
        self.block_table = uploaded.block_table.view(reqs, shape.width)
        self.verify = empty_step_tensors(shape.num_tokens, reqs, device)
        self.violations = torch.zeros(len(VIOLATION_NAMES), dtype=torch.int64, device=device)
        self.layout = RowLayout(
            slots=uploaded.slots,
            query_start_loc=self.query_start_loc,
            token_row=uploaded.token_row,
            host_ids=uploaded.host_ids,
            is_decode=uploaded.is_decode,
            num_valid=uploaded.num_valid,
            block_table=self.block_table,
        )
        # The draft loop: one token per decoding row, inputs from the device state.
        self.draft_layout = RowLayout(
            slots=uploaded.slots[:decodes],
            query_start_loc=torch.arange(decodes + 1, dtype=torch.int32, device=device),
            token_row=torch.arange(decodes, device=device),
            host_ids=torch.zeros(decodes, dtype=torch.int64, device=device),
            is_decode=torch.ones(decodes, dtype=torch.int64, device=device),
            num_valid=uploaded.num_drafts[:decodes],
            block_table=self.block_table[:decodes],
        )
        self.draft_starts = torch.empty(decodes, dtype=torch.int32, device=device)
        self.draft = empty_step_tensors(decodes, decodes, device)
        # vLLM's empty padding requests, where the backend claims them: attention's view of the padding rows.
        padded = empty_padding and shape.padded
        self.verify_padding = EmptyPadding(uploaded.num_valid, shape.width) if padded else None
        self.draft_padding = EmptyPadding(uploaded.num_valid[:decodes], shape.width) if padded else None


class BatchedEngine(EngineCore):
    def __init__(self, config: EngineConfig, model=None, eagle_head=None) -> None:
        super().__init__(config, model, eagle_head)
        k, reqs = config.num_spec_tokens, config.max_num_reqs
        # One spare slot past max_num_reqs: graph padding rows decode from it and never commit.
        self.state = DeviceState(reqs + 1, self.device, k)
        self.tree = config.draft_tree  # EAGLE top-k > 1: every step a token tree, run eagerly
        self.spare_slot = self.state.free_slots.pop()
        self.slot_sampling = SlotSampling(reqs + 1, self.device)
        self.drafter.allocate_slots(reqs + 1)
        self.scheduler.on_preempt = self._on_preempt
        self.scheduler.before_preempt = self._land_pending
        # check_inputs: a digest of every (KV slot, token) the target verified; two runs verified
        # the same drafts exactly when their digests are equal (read after generate: no sync).
        self.verified = torch.zeros((), dtype=torch.int64, device=self.device)
        # A token-tree engine: accepted nodes whose KV moved to their position (read after generate).
        self.moved = torch.zeros((), dtype=torch.int64, device=self.device)
        max_blocks = -(-config.model.max_model_len // config.kv_block_size)
        self.max_blocks = max_blocks
        tokens = config.max_num_tokens
        self.uploads = Uploader(reqs * (max_blocks + 3 * k + 16) + 3 * tokens + 8, self.device)
        self.downloads = Downloader(reqs * (k + 2) + len(VIOLATION_NAMES) + 8, self.device)
        self.pending: _Launched | None = None
        self.steps: list[StepRecord] = []
        self._decode_steps: dict[int, int] = {}
        self._sampling = False  # some request of this generate() call has a temperature
        self._buffers: dict[StepShape, _Buffers] = {}
        self.timer = StepTimer(self.device.type == "cuda")
        self.sync_detector = None  # metrics.measure attaches one: a phase per loop iteration
        self.iteration = 0
        self.graphs = None
        if config.cuda_graphs:
            from reference_engine.graphs import StepGraphs

            self.graphs = StepGraphs(self)

    @property
    def drafts_with_attention(self) -> bool:
        return self.drafter.uses_attention

    @property
    def draft_steps_update_metadata(self) -> bool:
        """Draft steps after the first advance the backend's metadata with update_for_draft_step
        (eagerly, or all k in one graph), as engines do for a backend that claims it."""
        return self.backend.capabilities.draft_step_update and not self.config.rebuild_draft_metadata

    def moved_nodes(self) -> int:
        """A token-tree engine: accepted nodes so far whose KV moved (their path left the first branch)."""
        return int(self.moved)

    def verified_digest(self) -> int:
        """check_inputs: the digest of everything verified so far (see ``verified``)."""
        return int(self.verified)

    # --- public API -----------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], on_step=None
    ) -> list[GenerationOutput]:
        params_list = self.validate(prompts, params)
        self._sampling = self.slot_sampling.prepare(
            params_list, self.config.num_spec_tokens, self.config.model.vocab_size
        )
        self.drafter.begin_slots(prompts, params_list)
        requests = self.admit(prompts, params_list)
        self._decode_steps = {request.request_id: 0 for request in requests}
        self.steps = []
        while not self.scheduler.idle or self.pending:
            detector = self.sync_detector
            with detector.phase(f"iteration {self.iteration}") if detector else contextlib.nullcontext():
                self._iterate(requests, on_step)
            self.iteration += 1
        return self.outputs(requests, self._decode_steps)

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
            self.stuck()
        if on_step is not None:
            on_step(sum(request.num_confirmed for request in requests))

    # --- one step: plan → draft → verify → commit, launched without waiting ---------------------------

    def _launch(self, scheduled: list[Scheduled], started: float) -> _Launched:
        """Plan the step on the host, then enqueue it on the device: upload, draft, verify (which
        commits), and the download its results land from."""
        prepared = time.perf_counter()
        planned, rows, shape, host = self._plan(scheduled)
        captures = self.graphs.captures if self.graphs else 0
        self.timer.begin()
        with nvtx.range("prepare"):
            uploaded = self.uploads.upload(planned)
            buffers = self._step_buffers(shape, uploaded)
        if shape.num_decodes and shape.draft_steps:
            with nvtx.range("draft"):
                self._draft(shape, host, buffers)
        payload = self._verify(shape, host, uploaded, buffers)
        download = self.downloads.download(payload)
        self.timer.end()
        launched = _Launched(len(self.steps), rows, download)
        captured = (self.graphs.captures if self.graphs else 0) != captures
        uniform = shape.num_decodes == shape.num_reqs and len({row.num_tokens for row in rows}) == 1
        self.steps.append(
            StepRecord(
                len(self.steps),
                self.iteration,
                len(rows),
                sum(row.num_tokens for row in rows),
                uniform,
                captured,
                prepared - started,
                time.perf_counter() - prepared,
                rows=tuple((row.request.request_id, row.num_tokens) for row in rows),
                handed=(self.config.model.max_model_len if shape.padded else max(host.seq_lens()), captured),
            )
        )
        return launched

    # --- plan -----------------------------------------------------------------------------------------

    def _plan(
        self, scheduled: list[Scheduled]
    ) -> tuple[StepRows[list[int]], list[_LaunchedRow], StepShape, HostLengths]:
        """The step row by row as the host sees it, padded for a graph where one serves it; the
        host's optimistic bookkeeping (every draft accepted) applied."""
        bs, k = self.config.kv_block_size, self.config.num_spec_tokens
        counts = {item.num_tokens for item in scheduled}
        uniform = len(counts) == 1 and all(not item.request.in_prefill for item in scheduled)
        # Token-tree steps run eagerly: graphs capture chains (the conformance graphs check judges
        # a backend's trees under replay).
        graphed = self.graphs and uniform and self.tree is None
        size = self.graphs.size_for(len(scheduled), next(iter(counts))) if graphed else None
        width = self.max_blocks if size else max(len(item.request.block_ids) for item in scheduled)
        rows, launched, host = StepRows.empty(), [], HostLengths()
        for item in scheduled:
            request = item.request
            first_time = request.request_id not in self.state.slot_of
            slot = self.state.slot(request.request_id)
            if first_time:
                self._on_new_slot(request, slot)
            decode = not request.in_prefill
            start, count = request.num_computed, item.num_tokens
            if decode:
                from_device, host_ids = self._decode_inputs(request, count)
                placeholders, host_last = count, -1
            else:
                from_device, host_ids = False, request.tokens[start : start + count]
                completes = start + count == request.prefill_target
                placeholders = 1 if completes and not request.output else 0
                # A request recomputed after a preemption resumes from its last output token.
                host_last = request.output[-1] if completes and request.output else -1
            rows.add_row(
                slot=slot,
                host_ids=host_ids,
                inputs_from_device=from_device,
                decode=decode,
                num_valid=count,
                num_drafts=item.num_drafts,
                produces=decode or placeholders > 0,
                host_last_token=host_last,
                host_start=start,
                capacity=len(request.block_ids) * bs,
                block_ids=request.block_ids,
                width=width,
                num_spec_tokens=k,
            )
            host.add_row(start, count, item.num_drafts)
            launched.append(_LaunchedRow(request, decode, count, item.num_drafts, placeholders))
            # Optimism: the host assumes every draft is accepted.
            request.num_computed += count
            request.output += [PLACEHOLDER] * placeholders
            request.stats.steps += 1
        count = next(iter(counts))
        host.num_real = len(scheduled)
        for _ in range(len(scheduled), size or 0):  # graph padding: decode from the spare slot, write nothing
            rows.add_row(
                slot=self.spare_slot,
                host_ids=[0] * count,
                inputs_from_device=True,
                decode=True,
                num_valid=0,
                num_drafts=0,
                produces=False,
                host_last_token=-1,
                host_start=0,
                capacity=0,
                block_ids=[],
                width=width,
                num_spec_tokens=k,
            )
            host.add_row(0, count, 0)
        num_decodes = rows.num_decodes
        shape = StepShape(
            len(rows.slots),
            host.query_start_loc[-1],
            width,
            num_decodes,
            max(host.num_drafts[:num_decodes], default=0),
            size is not None,
            self._sampling,
        )
        return rows, launched, shape, host

    def _on_new_slot(self, request: Request, slot: int) -> None:
        """A request (re)enters the device state: output count, sampling parameters, the drafter's state."""
        params = request.params
        self.state.num_output[slot] = request.num_confirmed
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + request.request_id
        self.slot_sampling.enter(slot, params, seed)
        self.drafter.enter_slot(request, slot)

    def _on_preempt(self, request: Request) -> None:
        """The request leaves its slot (its results have landed: ``before_preempt``)."""
        slot = self.state.slot_of.get(request.request_id)
        if slot is not None:
            self.drafter.leave_slot(request, slot)
        self.state.reset(request.request_id)

    def _decode_inputs(self, request: Request, count: int) -> tuple[bool, list[int]]:
        """A decoding row's input ids come from the device state (True): under async scheduling
        the host's last token is a placeholder for the step still in flight."""
        return True, [0] * count

    def _step_buffers(self, shape: StepShape, uploaded: StepRows[torch.Tensor]) -> _Buffers:
        """Persistent per shape for padded steps (the upload's offsets are fixed by the shape too)."""
        empty = self.backend.capabilities.graph_padding == PaddingStyle.EMPTY_REQUESTS
        if not shape.padded:
            return _Buffers(shape, uploaded, self.device)
        if shape not in self._buffers:
            self._buffers[shape] = _Buffers(shape, uploaded, self.device, empty)
        buffers = self._buffers[shape]
        # The buffers (and the graphs captured on them) read the upload where it lands: a step of
        # this shape whose fields landed elsewhere would replay on another step's rows.
        if buffers.query_start_loc.data_ptr() != uploaded.query_start_loc.data_ptr():
            raise RuntimeError(f"a padded step's upload moved ({shape}): its field lengths are not the shape's")
        return buffers

    # --- draft ----------------------------------------------------------------------------------------

    def _draft(self, shape: StepShape, host: HostLengths, buffers: _Buffers) -> None:
        """The drafter fills ``state.drafts`` for the decoding rows (the first ``num_decodes``), on the device."""
        if self.tree is not None:
            self._draft_tree(shape, host, buffers)
            return
        layout, decodes = buffers.draft_layout, shape.num_decodes
        query_start_loc = list(range(decodes + 1))

        def common(index: int) -> CommonAttentionMetadata:
            # Host lengths (sync): a row stops advancing at its last draft, as on the device.
            return self._common(
                layout,
                buffers.draft,
                shape,
                query_start_loc,
                host.draft_seq_lens(index, decodes),
                buffers.draft_padding,
                host.num_real,
            )

        def segment(name: str, common: CommonAttentionMetadata | None, run):
            return self._segment(name, shape, common, run)

        self.drafter.draft(
            DraftStep(layout, buffers.draft_starts, buffers.draft, shape.draft_steps, shape.sampling, common, segment)
        )

    def _draft_tree(self, shape: StepShape, host: HostLengths, buffers: _Buffers) -> None:
        """The decoding rows that draft (a tree is drafted whole or not at all) draft their trees."""
        rows = [row for row in range(shape.num_decodes) if host.num_drafts[row]]
        if not rows:
            return
        index = token_tree.to_device(torch.tensor(rows), self.device)
        self.drafter.draft_tree(
            TreeDraftStep(
                buffers.layout.slots[index],
                buffers.block_table[index],
                [host.starts[row] for row in rows],
                not self.config.async_scheduling,
            )
        )

    # --- verify: target forward and rejection, then commit, in one segment -----------------------------

    def _verify(
        self, shape: StepShape, host: HostLengths, uploaded: StepRows[torch.Tensor], buffers: _Buffers
    ) -> torch.Tensor:
        config = self.config
        layout = buffers.layout
        with nvtx.range("build metadata"):
            # Read by the step-input kernel only, eagerly: no graph needs it in a buffer of its own.
            step = prepare_step_inputs(
                self._starts(uploaded),
                self.state.last_token,
                self.state.drafts,
                layout,
                0,
                config.kv_block_size,
                buffers.verify,
            )
            parents = depths = None
            if self.tree is not None:  # a tree's node sits at start + its depth
                offsets, parents, depths = self._tree_of_tokens(layout)
                step.positions.add_(depths - offsets)
            if config.check_inputs:
                buffers.violations.copy_(
                    input_violations(
                        step,
                        layout,
                        self.state.num_computed[uploaded.slots],
                        uploaded.host_start,
                        uploaded.capacity,
                        config.model.vocab_size,
                        config.kv_block_size,
                        depths=depths,
                    )
                )
                step.input_ids.clamp_(0, config.model.vocab_size - 1)  # keep running; report on landing
            common = self._common(
                layout,
                step,
                shape,
                host.query_start_loc,
                host.seq_lens(),
                buffers.verify_padding,
                host.num_real,
                *self._tree_metadata(parents, host),
            )
        with nvtx.range("target forward, rejection, commit"):
            return self._segment(
                "verify",
                shape,
                common,
                lambda metadata: self._verify_segment(metadata, step, uploaded, buffers, shape, parents),
            )

    def _tree_of_tokens(self, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A tree engine's step: each token's offset in its row, its parent there and its depth (the
        decode rows read their slot's tree, ``tree_parents`` and ``tree_depths``; the others are chains)."""
        rows = layout.token_row
        offsets = torch.arange(rows.numel(), device=rows.device) - layout.query_start_loc.long()[rows]
        slots, node = layout.slots[rows], offsets.clamp(max=self.config.num_spec_tokens)
        decode = layout.is_decode.bool()[rows]
        parents = torch.where(decode, self.state.tree_parents[slots, node], offsets - 1)
        return offsets, parents, torch.where(decode, self.state.tree_depths[slots, node], offsets)

    def _tree_metadata(self, parents: torch.Tensor, host: HostLengths) -> tuple:
        """The verify step's trees for the backend: on the device, and on the host where the host
        knows them (a static tree; a dynamic tree's shape is chosen on the device)."""
        if self.tree is None:
            return None, None
        host_parents = None
        if self.tree.is_static:
            host_parents = []
            for query_len, drafts in zip(host.query_lens, host.num_drafts):
                host_parents += list(self.tree.parents[: 1 + drafts]) if drafts else list(token_tree.chain(query_len))
        return parents.to(torch.int32), host_parents

    def _starts(self, uploaded: StepRows[torch.Tensor]) -> torch.Tensor:
        """Each row's committed length, read on the device (never the host's optimistic guess)."""
        return self.state.num_computed[uploaded.slots]

    def _verify_segment(
        self,
        metadata,
        step: StepTensors,
        uploaded: StepRows[torch.Tensor],
        buffers: _Buffers,
        shape: StepShape,
        tree_parents: torch.Tensor | None,
    ) -> torch.Tensor:
        """Target forward → rejection → commit → the drafter's catch-up; returns what the host
        downloads. ``tree_parents``: a tree step's, per token (tree steps run eagerly)."""
        k = self.config.num_spec_tokens
        layout = buffers.layout
        writes = KVWrites() if self.tree is not None else None
        hidden = self.model(
            step.input_ids,
            step.positions,
            StepInputs(self.backend, metadata, self.kv_caches, step.slot_mapping, self.kv_scales, writes),
        )
        if self.config.check_inputs:
            self.verified.add_(verified_digest_terms(step.slot_mapping, step.input_ids).sum())
        logits = self.model.logits(hidden[uploaded.logits_index]).view(shape.num_reqs, k + 1, -1)
        if self.tree is None:
            tokens, emitted = self._reject(logits, uploaded, shape)
            path, moved = None, None
        else:
            tokens, emitted, path = self._reject_tree(logits, uploaded, shape)
        emitted = emitted * uploaded.produces
        if writes is not None:
            # Before the commit, the rows' starts are still those the step's inputs were made from.
            moved = self._moved_slots(path, emitted, layout, self._starts(uploaded))
            writes.store_at(moved)  # the accepted path's KV where its positions lie
            self.moved.add_((moved >= 0).sum())
        self._commit(uploaded, layout, tokens, emitted)
        self.drafter.after_commit(
            Verified(metadata, step, layout, uploaded.decode, hidden, tokens, emitted, tree_parents, path, moved)
        )
        results = torch.cat([emitted[:, None], tokens], dim=1).reshape(-1)
        return torch.cat([results, buffers.violations]) if self.config.check_inputs else results

    def _reject(self, logits: torch.Tensor, uploaded: StepRows[torch.Tensor], shape: StepShape):
        """Greedy rows accept drafts equal to the argmax; rows with a temperature by rejection
        sampling, their noise from (seed, output position) counters."""
        slots = uploaded.slots
        drafts = self.state.drafts[slots, : self.config.num_spec_tokens]
        tokens, emitted = greedy_rejection(drafts, logits, uploaded.num_drafts)
        if not shape.sampling:
            return tokens, emitted
        sampling = self.slot_sampling
        temperature = sampling.temperature[slots]
        target = batched_filtered_probabilities(logits, temperature, sampling.top_k[slots], sampling.top_p[slots])
        k = drafts.shape[1]
        seed, position = sampling.seed[slots][:, None], self.state.num_output[slots].long()[:, None]
        offsets = torch.arange(k + 1, device=self.device)
        vocab = (logits.shape[-1],)
        draft_probabilities = sampling.draft_probabilities[slots] if k else target[:, :0]
        sampled, sampled_emitted = rejection_with_noise(
            drafts,
            draft_probabilities,
            target,
            uploaded.num_drafts,
            counter_uniform(seed, position + offsets[:k], ACCEPT_LANE),
            counter_uniform(seed, position + offsets[:k], RECOVER_LANE, vocab),
            counter_uniform(seed, position + offsets, BONUS_LANE, vocab),
        )
        greedy = (temperature == 0)[:, None]
        return torch.where(greedy, tokens, sampled), torch.where(greedy[:, 0], emitted, sampled_emitted)

    def _reject_tree(self, logits: torch.Tensor, uploaded: StepRows[torch.Tensor], shape: StepShape):
        """``_reject`` over each row's token tree (``tree_rejection``): also the accepted path."""
        slots, depth = uploaded.slots, self.tree.depth
        drafts, parents = self.state.drafts[slots], self.state.tree_parents[slots]
        greedy = tree_greedy_rejection(drafts, parents, logits.argmax(dim=-1), uploaded.num_drafts, depth)
        if not shape.sampling:
            return greedy
        sampling = self.slot_sampling
        temperature = sampling.temperature[slots]
        target = batched_filtered_probabilities(logits, temperature, sampling.top_k[slots], sampling.top_p[slots])
        seed, position = sampling.seed[slots], self.state.num_output[slots].long()
        nodes, vocab = logits.shape[1], logits.shape[2]
        sampled = tree_rejection_with_noise(
            drafts,
            parents,
            target,
            uploaded.num_drafts,
            counter_uniform(seed, position, ACCEPT_LANE, (nodes,)),
            counter_uniform(seed, position, BONUS_LANE, (nodes, vocab)),
            depth,
        )
        is_greedy = temperature == 0
        return tuple(torch.where(is_greedy.view(-1, *[1] * (a.dim() - 1)), a, b) for a, b in zip(greedy, sampled))

    def _moved_slots(
        self, path: torch.Tensor, emitted: torch.Tensor, layout: RowLayout, starts: torch.Tensor
    ) -> torch.Tensor:
        """Per token of a tree step: the slot of the position its node was accepted at, where that
        is not the slot it was written to (node j of a row is written at start + j; the node kept
        at position i belongs at start + i); else -1."""
        batch, nodes = path.shape
        kept = torch.arange(nodes, device=path.device)[None, :] < emitted[:, None]
        kept_node = torch.where(kept & (path >= 0), path, nodes)  # column ``nodes``: nothing kept there
        position_of = torch.full((batch, nodes + 1), -1, dtype=torch.long, device=path.device)
        position_of.scatter_(1, kept_node, torch.arange(nodes, device=path.device).expand(batch, nodes))
        rows = layout.token_row
        offsets = torch.arange(rows.numel(), device=rows.device) - layout.query_start_loc.long()[rows]
        index = position_of[rows, offsets.clamp(max=nodes - 1)]
        move = layout.is_decode.bool()[rows] & (index >= 0) & (index != offsets)
        position = starts.long()[rows] + index.clamp(min=0)
        block_size = self.config.kv_block_size
        blocks = layout.block_table.long()[rows, (position // block_size).clamp(max=layout.block_table.shape[1] - 1)]
        return torch.where(move, blocks * block_size + position % block_size, -1)

    # --- commit ---------------------------------------------------------------------------------------

    def _commit(
        self, uploaded: StepRows[torch.Tensor], layout: RowLayout, tokens: torch.Tensor, emitted: torch.Tensor
    ) -> None:
        """The device state after this step: lengths, the next input token, the output count."""
        slots = uploaded.slots
        query_lens = (layout.query_start_loc[1:] - layout.query_start_loc[:-1]).long()
        advance = torch.where(uploaded.decode.bool(), emitted, query_lens)
        self.state.num_computed[slots] += advance.to(torch.int32)
        last_emitted = tokens.gather(1, (emitted - 1).clamp(min=0)[:, None]).squeeze(1)
        host_last = uploaded.host_last_token
        keep = torch.where(host_last >= 0, host_last, self.state.last_token[slots])
        self.state.last_token[slots] = torch.where(emitted > 0, last_emitted, keep)
        self.state.num_output[slots] += emitted.to(torch.int32)

    # --- land: a step's results reach the host --------------------------------------------------------

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
                counts = values[-len(VIOLATION_NAMES) :]
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
                    request.stats.drafted += row.num_drafts
                    request.stats.accepted += emitted - 1
                    self._decode_steps[request.request_id] += 1
                self._confirm(request, emitted)
                self.steps[launched.index].emitted[request.request_id] = request.num_confirmed - begin  # kept
                if not request.finished:  # keeping what a scheduling pass under way allocated for it
                    self.blocks.trim(request.block_ids, request.num_computed + self.scheduler.reserved_tokens(request))

    def _confirm(self, request: Request, count: int) -> None:
        if request.num_confirmed == 0 and count:
            request.stats.first_token_time = time.perf_counter()
        for _ in range(count):
            request.num_confirmed += 1
            if request.stops_after(request.num_confirmed, self.config.model.max_model_len):
                del request.output[request.num_confirmed :]  # whatever the step in flight adds is dropped
                request.stats.finish_time = time.perf_counter()
                self.scheduler.finish(request)
                self.state.release(request.request_id)
                return

    # --- pieces of a step: a graph or eager, the backend's view of a batch ----------------------------

    def _segment(self, name: str, shape: StepShape, common: CommonAttentionMetadata | None, segment):
        """A piece of the step: from a CUDA graph on a padded step, else eagerly."""
        if shape.padded and self.graphs is not None:
            return self.graphs.run((name, shape), common, segment)
        return segment(self.backend.build(common) if common is not None else None)

    def _common(
        self,
        layout: RowLayout,
        step: StepTensors,
        shape: StepShape,
        query_start_loc: list[int],
        host_seq_lens: list[int],
        padding: EmptyPadding | None = None,
        num_real: int = 0,
        tree_parents: torch.Tensor | None = None,
        host_tree_parents: list[int] | None = None,
    ) -> CommonAttentionMetadata:
        """The backend's view of a batch: host lengths only when the host knows them (sync); the
        padding rows past ``num_real`` as empty requests where ``padding`` is given."""
        starts, seq_lens, block_table = layout.query_start_loc, step.seq_lens, layout.block_table
        if padding is not None:
            starts, seq_lens, block_table = padding.device_view(layout, step)
            query_start_loc, host_seq_lens = EmptyPadding.host_view(query_start_loc, host_seq_lens, num_real)
        return CommonAttentionMetadata.from_lengths(
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=step.slot_mapping,
            query_starts=query_start_loc,
            host_seq_lens=host_seq_lens,
            # Async: the host's lengths assume every draft accepted, an upper bound. A graph serves every length.
            lengths_known=not self.config.async_scheduling,
            max_seq_len=self.config.model.max_model_len if shape.padded else None,
            tree_parents=tree_parents,
            host_tree_parents=host_tree_parents,
        )
