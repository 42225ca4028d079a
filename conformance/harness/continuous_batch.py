"""Continuous batching: the steps a serving engine's async spec-decode loop hands a backend, with
requests finishing and joining, each step's query lengths decode (1) or spec-verify (k + 1).

A ``Schedule`` is planned on the host from a case (``continuous_batching``): the case's requests
are the first step's batch; at later steps requests finish (their token budget spent, or at
random) and new ones join, several at once or one in the place of another, so that the number of
requests goes up and down and also stays the same while the requests change. Rows are kept as
vLLM's persistent batch keeps them: a joining request takes the row of one that left, the rows
left empty are filled from the end, and the rest join at the end. Each step's query lengths are
drawn from the backend's claims: 1 only for a decode-only backend, 1 or ``SPEC_TOKENS`` + 1 (or
the longest it claims below that) otherwise, mixed within a step unless the backend takes only
uniform batches. ``fixed_batch`` is one batch decoding step after step, every request one token
longer each time.

``ContinuousBatch`` makes a schedule real. Every request's tokens are drawn once, as one batch
(``batch``: each request its context and every token the steps hand it), and every request owns
its blocks for the whole run: a finished request's blocks are not given to a later one. So after
the last step the pool holds every token any step wrote, and one float64 oracle over that batch
answers every step: a token attends to the positions up to its own, whichever step carried it.
A joining request's context is written through the backend's ``write_kv`` right before its first
step (a finished prefill's); every other slot holds the loud poison until a step writes it.

Each step is loaded into persistent buffers (``GraphBuffers``) by device copies from banks made
before the first step, and the backend is handed their first rows (eager: no padding). Its
output (and log-sum-exp) rows are copied into banks in the batch's token order, on the device.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, replace
from typing import Any

import torch

from backends.base import AttentionBackend, Capabilities, CommonAttentionMetadata, PaddingStyle
from conformance.cases.grammar import Case
from conformance.harness import token_inputs
from conformance.harness.answers import answer_for
from conformance.harness.batch import PagedBatch, materialize
from conformance.harness.graph_batches import GraphShape
from conformance.harness.graphs import GraphBuffers
from conformance.harness.step import PoolFill, write_poison

MAX_REQUESTS = 8  # requests in one step: one backend instance (its BackendLimits) serves every step
SPEC_TOKENS = 3  # drafts a verify step checks: query length SPEC_TOKENS + 1
MIN_BUDGET, MAX_BUDGET = 12, 160  # tokens a request is handed over its steps (the ramp stays within 256)
PRELUDE = ("swap", "leave", "join")  # steps 1, 2, 3: each kind of change early, however short the run
SWAP, LEAVE, JOIN = 0.15, 0.12, 0.12  # the chance of each change in a later step
VERIFY_ALL, DECODE_ALL = 0.3, 0.2  # a step's query lengths: all verify, all decode, else mixed


@dataclass(frozen=True)
class Request:
    context: int  # tokens in the pool when it joins (its prefill's)
    first_step: int
    query_lens: tuple[int, ...]  # its query length in each step from ``first_step`` on

    @property
    def new_tokens(self) -> int:
        return sum(self.query_lens)


@dataclass(frozen=True)
class Step:
    requests: tuple[int, ...]  # the request in each row
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    # A run of token trees (``continuous_batching(trees=True)``): each row's tree by its parents,
    # a chain's too (every step of such a run hands the backend trees, as a tree engine does); ().
    trees: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


@dataclass(frozen=True)
class Schedule:
    requests: tuple[Request, ...]
    steps: tuple[Step, ...]

    def joined(self, step: int) -> list[int]:
        """The requests whose first step is ``step`` (for step 0: the first batch)."""
        return [r for r, request in enumerate(self.requests) if request.first_step == step]

    def left(self, step: int) -> list[int]:
        """The requests of the step before ``step`` that are not in it."""
        if step == 0:
            return []
        now = set(self.steps[step].requests)
        return [r for r in self.steps[step - 1].requests if r not in now]

    def describe(self, step: int) -> dict[str, Any]:
        """One step's batch, for a report."""
        this = self.steps[step]
        return {
            "step": step,
            "requests": list(this.requests),
            "query_lens": list(this.query_lens),
            "seq_lens": list(this.seq_lens),
            "joined": self.joined(step) if step else [],
            "left": self.left(step),
            **({"trees": [list(tree) for tree in this.trees]} if this.trees else {}),
        }

    def summary(self) -> dict[str, Any]:
        counts = [len(step.requests) for step in self.steps]
        changed = [s for s in range(1, len(self.steps)) if self.steps[s].requests != self.steps[s - 1].requests]
        return {
            "steps": len(self.steps),
            "requests_seen": len(self.requests),
            "joins": sum(1 for request in self.requests if request.first_step),
            "leaves": sum(len(self.left(s)) for s in range(1, len(self.steps))),
            "steps_with_changes": len(changed),
            "steps_same_count_other_requests": sum(1 for s in changed if counts[s] == counts[s - 1]),
            "requests_per_step": [min(counts), max(counts)],
            "query_lens": sorted({q for step in self.steps for q in step.query_lens}),
            "steps_with_mixed_query_lens": sum(1 for step in self.steps if len(set(step.query_lens)) > 1),
            "max_tokens_per_step": max(step.num_tokens for step in self.steps),
        }


def fixed_batch(case: Case, steps: int) -> Schedule:
    """The case's requests in every step, each its query length every step: one batch decoding."""
    requests = tuple(Request(context, 0, (query,) * steps) for context, query in case.batch)
    return Schedule(
        requests,
        tuple(
            Step(
                tuple(range(case.num_reqs)),
                tuple(query for _, query in case.batch),
                tuple(context + query * (s + 1) for context, query in case.batch),
            )
            for s in range(steps)
        ),
    )


def verify_query_len(capabilities: Capabilities) -> int:
    """The spec-verify query length a backend's claims allow: ``SPEC_TOKENS`` + 1, or the longest
    below it that it takes; 1 for a decode-only backend."""
    for query_len in range(SPEC_TOKENS + 1, 1, -1):
        if capabilities.query_len_reason(query_len, [query_len]) is None:
            return query_len
    return 1


def takes_mixed(capabilities: Capabilities, verify: int) -> bool:
    """Whether decode and verify rows may share a step (not for a backend of uniform batches only)."""
    return verify > 1 and capabilities.query_len_reason(verify, [1, verify]) is None


@dataclass
class _Planned:
    context: int
    first_step: int
    budget: int
    query_lens: list[int]

    @property
    def remaining(self) -> int:
        return self.budget - sum(self.query_lens)


def continuous_batching(
    case: Case, steps: int, capabilities: Capabilities, max_requests: int = MAX_REQUESTS, trees: bool = False
) -> Schedule:
    """A serving engine's steps, starting from ``case``'s batch (module docstring). Planned from a
    generator seeded by the case: the same case plans the same steps on every machine. ``trees``:
    an engine verifying token trees (EAGLE top-k > 1) — the requests start decoding, and each
    verify row is a tree of its own, drawn afresh every step (``random_tree``)."""
    rng = random.Random(zlib.crc32(case.id.encode()))
    verify = verify_query_len(capabilities)
    mixed = takes_mixed(capabilities, verify)
    contexts = [context for context, query in case.batch if query] or [0]
    block = case.spec.block_size
    planned: list[_Planned] = []

    def new_request(context: int, step: int, query_len: int = 1) -> int:
        planned.append(_Planned(context, step, max(rng.randint(MIN_BUDGET, MAX_BUDGET), query_len), []))
        return len(planned) - 1

    starting = [(context, 1 if trees else query) for context, query in case.batch if query]
    rows = [new_request(context, 0, query) for context, query in starting]
    first_lens = [query for _, query in starting]
    plan: list[Step] = []
    for step in range(steps):
        if step:
            rows = _change(rows, planned, step, rng, max_requests, contexts, block, new_request)
            query_lens = _query_lens([planned[r].remaining for r in rows], verify, mixed, rng)
        else:
            query_lens = first_lens
        for r, query_len in zip(rows, query_lens):
            planned[r].query_lens.append(query_len)
        seq_lens = tuple(planned[r].context + sum(planned[r].query_lens) for r in rows)
        drawn = tuple(random_tree(query_len, rng) for query_len in query_lens) if trees else ()
        plan.append(Step(tuple(rows), tuple(query_lens), seq_lens, drawn))
    return Schedule(tuple(Request(p.context, p.first_step, tuple(p.query_lens)) for p in planned), tuple(plan))


def random_tree(tokens: int, rng: random.Random) -> tuple[int, ...]:
    """A verify's token tree of ``tokens`` (the root, the last accepted token, first; each later
    token a child of any earlier one): chains, stars and everything between."""
    return (-1,) + tuple(rng.randrange(index) for index in range(1, tokens))


def _change(rows, planned, step, rng, max_requests, contexts, block, new_request) -> list[int]:
    """The rows of ``step``: the requests whose budget is spent leave, then this step's change."""
    leaving = {r for r in rows if planned[r].remaining < 1}
    staying = [r for r in rows if r not in leaving]
    if step <= len(PRELUDE):
        event = PRELUDE[step - 1]
    else:
        draw = rng.random()
        event = (
            "swap" if draw < SWAP else "leave" if draw < SWAP + LEAVE else "join" if draw < SWAP + LEAVE + JOIN else ""
        )
    if event in ("swap", "leave") and len(staying) > (1 if event == "leave" else 0):
        gone = rng.choice(staying)
        leaving.add(gone)
        staying.remove(gone)
    elif event == "leave":
        event = "join"  # a one-request batch has nothing to drop
    joins = 0
    if event == "swap":
        joins = 1
    elif event == "join":
        joins = 1 + (rng.random() < 0.3)
    joins = max(joins, 1 - len(staying))  # never an empty step
    joins = min(joins, max_requests - len(staying))
    if event == "join" and joins == 0 and staying:  # a full batch: one in the place of another
        gone = rng.choice(staying)
        leaving.add(gone)
        joins = 1
    joining = [new_request(rng.choice(contexts) + rng.randrange(block), step) for _ in range(joins)]
    return _persistent_rows(rows, leaving, joining)


def _persistent_rows(rows: list[int], leaving: set[int], joining: list[int]) -> list[int]:
    """vLLM's persistent batch: joining requests take the rows that emptied, lowest first; the
    rows still empty are filled from the end (its ``condense``); the rest join at the end."""
    slots: list[int | None] = [None if r in leaving else r for r in rows]
    waiting = list(joining)
    for index, slot in enumerate(slots):
        if slot is None and waiting:
            slots[index] = waiting.pop(0)
    while None in slots:
        hole = slots.index(None)
        while slots and slots[-1] is None:
            slots.pop()
        if hole < len(slots):
            slots[hole] = slots.pop()
    return [slot for slot in slots if slot is not None] + waiting


def _query_lens(remaining: list[int], verify: int, mixed: bool, rng: random.Random) -> list[int]:
    """A step's query lengths: every row decoding, every row verifying, or (where the backend takes
    mixed batches) each row either; a row verifies only where its budget has room."""
    can_verify = [left >= verify for left in remaining]
    if verify == 1:
        return [1] * len(remaining)
    draw = rng.random()
    if not mixed:
        verifying = draw >= DECODE_ALL and all(can_verify)
        return [verify if verifying else 1] * len(remaining)
    if draw < DECODE_ALL:
        wanted = [False] * len(remaining)
    elif draw < DECODE_ALL + VERIFY_ALL:
        wanted = [True] * len(remaining)
    else:
        wanted = [rng.random() < 0.5 for _ in remaining]
    return [verify if want and can else 1 for want, can in zip(wanted, can_verify)]


class ContinuousBatch:
    """A schedule's data, pool and persistent buffers (module docstring), stepped one step at a time."""

    def __init__(
        self,
        backend_cls: type[AttentionBackend],
        case: Case,
        schedule: Schedule,
        device: torch.device,
        shape_steps=None,
    ):
        self.schedule, self.device = schedule, device
        requests = schedule.requests
        # Edges data as the draft loop's: each request's newest keys dominate (``shape_steps``
        # may shape them further before anything is written).
        self.case = replace(
            case,
            batch=tuple((request.context, request.new_tokens) for request in requests),
            data="edges" if case.data == "normal" else case.data,
            shared_prefix_blocks=0,
            strided=False,
            big_pool=False,
            padding=0,
            lse=False,
            tag="",
            trees=(),  # a run's trees are its steps' (``Step.trees``)
        )
        self.batch: PagedBatch = materialize(self.case, device)
        if shape_steps is not None:
            shape_steps(self.batch)
        batch, spec = self.batch, case.spec
        block = spec.block_size
        most_tokens = max(step.num_tokens for step in schedule.steps)
        most_requests = max(len(step.requests) for step in schedule.steps)
        # Sized as an engine's: for its most requests and tokens a step, whatever this run's reach.
        shape = GraphShape(
            num_reqs=max(most_requests, MAX_REQUESTS),
            num_tokens=max(most_tokens, MAX_REQUESTS * (SPEC_TOKENS + 1)),
            padding_query_len=1,
            max_model_len=-(-self.case.max_seq_len // block) * block,
            uniform=False,
        )
        self.buffers = GraphBuffers(backend_cls, shape, [self.case], device, PoolFill.LOUD, PaddingStyle.ROWS)
        buffers = self.buffers
        # Every slot poisoned: a block holds the poison until its request joins and writes it.
        write_poison(
            buffers.backend,
            buffers.kv_cache,
            batch,
            keep=torch.empty(0, dtype=torch.int64),
            num_blocks=buffers.num_blocks,
            fill=PoolFill.LOUD,
            layer=buffers.layer,
        )
        # Banks in the batch's token order: request by request, each its new tokens in order.
        self.offsets = [0]
        for request in requests:
            self.offsets.append(self.offsets[-1] + request.new_tokens)
        new = [range(request.context, request.context + request.new_tokens) for request in requests]
        self.query_bank = batch.query
        self.key_bank = torch.cat([batch.keys[r][span.start : span.stop] for r, span in enumerate(new)])
        self.value_bank = (
            None
            if batch.values[0] is None
            else torch.cat([batch.values[r][span.start : span.stop] for r, span in enumerate(new)])
        )
        self.slot_bank = torch.cat([batch.slots(r, span) for r, span in enumerate(new)]).to(device)
        # The per-token inputs (a sparse layer's index rows, an indexer's head weights), drawn for
        # each request's tokens at their positions: in the batch's token order already, as the query's.
        self.input_banks = batch.token_inputs
        self.table = batch.block_table.to(device)
        self.total_tokens = self.offsets[-1]
        self.answer = answer_for(spec)
        self.out_bank = self.answer.empty(spec, self.total_tokens, device)[0]
        self.lse_bank = torch.full(
            (self.total_tokens, spec.num_heads), float("nan"), dtype=torch.float32, device=device
        )
        self.lse = torch.full((shape.num_tokens, spec.num_heads), float("nan"), dtype=torch.float32, device=device)
        # Per step, on the device: its token rows in the banks, its requests, query starts, lengths.
        self.rows_of_step: list[list[int]] = []
        self.host_starts: list[list[int]] = []
        done = [0] * len(requests)
        indices: list[int] = []
        lengths: list[int] = []
        for step in schedule.steps:
            rows, starts = [], [0]
            for r, query_len in zip(step.requests, step.query_lens):
                rows += range(self.offsets[r] + done[r], self.offsets[r] + done[r] + query_len)
                done[r] += query_len
                starts.append(starts[-1] + query_len)
            self.rows_of_step.append(rows)
            self.host_starts.append(starts)
            indices += rows + list(step.requests)
            lengths += starts + list(step.seq_lens)
        index_bank = torch.tensor(indices, dtype=torch.int64).to(device)
        length_bank = torch.tensor(lengths, dtype=torch.int32).to(device)
        self.step_views: list[tuple[torch.Tensor, ...]] = []
        at_index = at_length = 0
        for step, rows in zip(schedule.steps, self.rows_of_step):
            tokens, count = len(rows), len(step.requests)
            self.step_views.append(
                (
                    index_bank[at_index : at_index + tokens],
                    index_bank[at_index + tokens : at_index + tokens + count],
                    length_bank[at_length : at_length + count + 1],
                    length_bank[at_length + count + 1 : at_length + 2 * count + 1],
                )
            )
            at_index += tokens + count
            at_length += 2 * count + 1
        self.step_of_row = torch.empty(self.total_tokens, dtype=torch.int64)
        for s, rows in enumerate(self.rows_of_step):
            self.step_of_row[rows] = s
        self._bank_trees(shape.num_tokens)
        # Per step: whether forward wrote output or lse rows past the ones it was handed.
        self.spilled = torch.zeros(len(schedule.steps), 2, dtype=torch.bool, device=device)
        self.write_history(0)

    def _bank_trees(self, num_tokens: int) -> None:
        """A run of token trees: each token's parent in its step, in the banks' order, and each
        request's steps as the oracle reads them (``PagedBatch.tree_steps``); a persistent buffer
        the steps are handed in, as an engine's."""
        self.tree_parents = self.parents_bank = None
        if not self.schedule.steps[0].trees:
            return
        parents = [0] * self.total_tokens
        steps_of: list[list[tuple[int, ...]]] = [[] for _ in self.schedule.requests]
        for step, rows in zip(self.schedule.steps, self.rows_of_step):
            at = 0
            for request, tree in zip(step.requests, step.trees):
                parents[rows[at] : rows[at] + len(tree)] = tree  # a request's rows in a step are consecutive
                steps_of[request].append(tree)
                at += len(tree)
        self.parents_bank = torch.tensor(parents, dtype=torch.int32).to(self.device)
        self.tree_parents = torch.full((num_tokens,), -1, dtype=torch.int32, device=self.device)
        self.batch.tree_steps = [tuple(steps) for steps in steps_of]

    def write_history(self, step: int) -> None:
        """The context of every request that joins at ``step``, through the backend's write_kv
        (what its prefill wrote), before the step."""
        buffers, batch = self.buffers, self.batch
        for r in self.schedule.joined(step):
            context = self.schedule.requests[r].context
            if not context:
                continue
            key = batch.keys[r][:context]
            value = None if batch.values[r] is None else batch.values[r][:context]
            slots = batch.slots(r, range(0, context)).to(self.device)
            buffers.backend.write_kv(buffers.kv_cache, key, value, slots, layer=buffers.layer)

    def load(self, step: int, *, lengths_known: bool) -> CommonAttentionMetadata:
        """Step ``step``'s inputs into the persistent buffers (device copies only; the output and
        lse buffers refilled with NaN), and the metadata the backend is handed."""
        if step:
            self.write_history(step)
        buffers = self.buffers
        rows, requests, starts, seq_lens = self.step_views[step]
        tokens, count = rows.shape[0], requests.shape[0]
        buffers.query[:tokens].copy_(self.query_bank.index_select(0, rows))
        buffers.key[:tokens].copy_(self.key_bank.index_select(0, rows))
        if buffers.value is not None:
            buffers.value[:tokens].copy_(self.value_bank.index_select(0, rows))
        buffers.slot_mapping.fill_(-1)
        buffers.slot_mapping[:tokens].copy_(self.slot_bank.index_select(0, rows))
        token_inputs.load(
            buffers.spec,
            buffers.first.token_inputs,
            {name: bank.index_select(0, rows) for name, bank in self.input_banks.items()},
        )
        buffers.query_start_loc[: count + 1].copy_(starts)
        buffers.seq_lens[:count].copy_(seq_lens)
        buffers.block_table[:count, : self.table.shape[1]].copy_(self.table.index_select(0, requests))
        buffers.out.fill_(self.answer.unwritten)
        self.lse.fill_(float("nan"))
        this = self.schedule.steps[step]
        trees = {}
        if self.tree_parents is not None:  # the host's copy only where the host's lengths are handed too
            self.tree_parents[:tokens].copy_(self.parents_bank.index_select(0, rows))
            host = [parent for tree in this.trees for parent in tree] if lengths_known else None
            trees = dict(tree_parents=self.tree_parents[:tokens], host_tree_parents=host)
        return CommonAttentionMetadata.from_lengths(
            query_start_loc=buffers.query_start_loc[: count + 1],
            seq_lens=buffers.seq_lens[:count],
            block_table=buffers.block_table[:count],
            slot_mapping=buffers.slot_mapping[:tokens],
            query_starts=self.host_starts[step],
            host_seq_lens=this.seq_lens,
            lengths_known=lengths_known,
            **trees,
        )

    def handed(self, step: int) -> dict[str, torch.Tensor | None]:
        """What the step's write_kv and forward are handed: the buffers' first rows."""
        tokens = len(self.rows_of_step[step])
        buffers = self.buffers
        return {
            "query": buffers.query[:tokens],
            "key": buffers.key[:tokens],
            "value": None if buffers.value is None else buffers.value[:tokens],
            "slot_mapping": buffers.slot_mapping[:tokens],
            "out": buffers.out[:tokens],
            "lse": self.lse[:tokens],
        }

    def finish_step(self, step: int) -> None:
        """The step's output and lse rows into the banks; whether rows past them were written (on
        the device: nothing is read back here)."""
        rows = self.step_views[step][0]
        tokens = rows.shape[0]
        buffers = self.buffers
        self.out_bank.index_copy_(0, rows, buffers.out[:tokens])
        self.lse_bank.index_copy_(0, rows, self.lse[:tokens])
        self.spilled[step, 0] = self.answer.written(buffers.out[tokens:]).any()
        self.spilled[step, 1] = ~torch.isnan(self.lse[tokens:]).all()

    def first_spill(self, steps: int) -> tuple[int, str] | None:
        """The first step whose forward wrote output or lse rows past the ones it was handed."""
        spilled = self.spilled[:steps].cpu()
        hit = spilled.any(dim=1).nonzero()
        if not hit.numel():
            return None
        step = int(hit[0, 0])
        return step, "output" if bool(spilled[step, 0]) else "lse"

    def first_bad_step(self, bad_rows: torch.Tensor) -> int | None:
        """The earliest step among the banks' rows marked in ``bad_rows`` (bool [total_tokens])."""
        bad = bad_rows.cpu()
        if not bool(bad.any()):
            return None
        return int(self.step_of_row[bad].min())

    def step_rows(self, step: int) -> torch.Tensor:
        return self.step_views[step][0]
