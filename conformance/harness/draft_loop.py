"""The draft loop: k EAGLE-style draft steps, each appending one token per request, under CUDA graphs.

Positions, ``seq_lens``, ``slot_mapping`` and the step's query/KV rows are advanced on the device
by captured kernels indexed by a device step counter, never by the host. A backend claiming
``draft_step_update`` gets all k steps in ONE graph, its ``update_for_draft_step`` running
inside it between steps; any other backend gets a captured advance and a captured one-step
graph, with its ``build`` called on the host between them (as vLLM's EAGLE proposer does). Every
step's output is compared with the oracle; the first failing step is named. Stale
position-dependent metadata (DeepSeek-V4 with MTP > 2) fails here at step 2 or later. Each step
runs two layers over one metadata, each with its own pool, scales and sinks (``GraphLayer``), and
on an ``lse`` case every layer's LSE of every step is banked and judged against the oracle's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from backends.base import AttentionBackend, CommonAttentionMetadata, PaddingStyle
from conformance.cases.grammar import Case
from conformance.harness.answers import answer_for
from conformance.harness.batch import PagedBatch, materialize
from conformance.harness.graph_batches import GraphShape
from conformance.harness.graphs import GraphBuffers, GraphLayer, warm_up
from conformance.harness.lse_pass import judge_lse
from conformance.harness.step import PoolFill, padding_queries
from conformance.harness.stored_cache import oracle

# (k, a padding row after the real requests, warm-up before the capture, what unowned slots hold).
# Without a padding row the last row is a real request (a backend that mishandles the last row
# hides behind padding); without a warm-up the capture is the backend's first call at this shape.
# The longest loop runs over NaN: a slot a step reads and weights by zero (a draft position not yet
# written, the tail of a page) turns its output NaN, where the loud poison would vanish. The padding
# row is vLLM's empty request where the backend claims that style (``draft_padding``).
DRAFT_RUNS = ((2, True, True, PoolFill.LOUD), (4, False, False, PoolFill.LOUD), (7, True, True, PoolFill.NAN))
DRAFT_STEPS = tuple(run[0] for run in DRAFT_RUNS)


def draft_padding(backend_cls: type[AttentionBackend], num_steps: int) -> PaddingStyle:
    """The padding row's style: vLLM's empty request where claimed; the longest loop pads with a
    row of its own (SGLang's style, which every backend takes), so that both are watched."""
    if num_steps == DRAFT_RUNS[-1][0]:
        return PaddingStyle.ROWS
    return backend_cls.capabilities.graph_padding


class DraftBanks:
    """One layer's per-step inputs (the query row, key row and value row of request r at draft
    step s, as the layer holds them: ``GraphLayer.rows``) and what each step left in its buffers
    (the output, the LSE where asked)."""

    def __init__(self, layer: GraphLayer, drafted: PagedBatch, contexts: list[int], num_steps: int):
        n = len(contexts)
        self.layer = layer
        self.query = layer.rows(drafted.query).view(n, num_steps, *drafted.query.shape[1:])
        self.key = layer.rows(torch.stack([drafted.keys[r][c : c + num_steps] for r, c in enumerate(contexts)]))
        self.value = (
            None
            if drafted.values[0] is None
            else layer.rows(torch.stack([drafted.values[r][c : c + num_steps] for r, c in enumerate(contexts)]))
        )
        # The per-token inputs of each step (a sparse layer's index rows: the indexer's output for
        # that step's token; an indexer's head weights).
        self.token_inputs = {name: rows.view(n, num_steps, -1) for name, rows in drafted.token_inputs.items()}
        self.answer = answer_for(drafted.spec)
        self.out = torch.full(
            (n, num_steps, *layer.out.shape[1:]), self.answer.unwritten, dtype=layer.out.dtype, device=layer.out.device
        )
        self.lse = (
            None
            if layer.lse is None
            else torch.full((n, num_steps, layer.lse.shape[1]), float("nan"), device=layer.lse.device)
        )

    def advance(self, step: torch.Tensor) -> None:
        """Device-only: this layer's inputs of draft step ``step`` (a one-element device tensor)."""
        layer, n = self.layer, self.query.shape[0]
        layer.query[:n].copy_(self.query.index_select(1, step).squeeze(1))
        layer.key[:n].copy_(self.key.index_select(1, step).squeeze(1))
        if self.value is not None:
            layer.value[:n].copy_(self.value.index_select(1, step).squeeze(1))
        for name, rows in self.token_inputs.items():
            layer.token_inputs[name][:n].copy_(rows.index_select(1, step).squeeze(1))

    def keep(self, step: torch.Tensor) -> None:
        """Device-only: bank what draft step ``step`` wrote."""
        layer, n = self.layer, self.query.shape[0]
        self.out.index_copy_(1, step, layer.out[:n].unsqueeze(1))
        if self.lse is not None:
            self.lse.index_copy_(1, step, layer.lse[:n].unsqueeze(1))

    def clear(self) -> None:
        """Every banked output unwritten (an attention's NaN, ``answers``), NaN in every banked LSE
        and in the layer's LSE buffer: a replay that writes nothing leaves that, not what the
        warm-up wrote."""
        self.out.fill_(self.answer.unwritten)
        for tensor in (self.lse, self.layer.lse):
            if tensor is not None:
                tensor.fill_(float("nan"))


class DraftLoop:
    """The buffers, device-side advance and per-step bookkeeping of one k-step draft loop, over
    ``layers`` layers (each its own pool, scales, sinks: ``GraphLayer``) sharing one metadata."""

    def __init__(
        self,
        backend_cls: type[AttentionBackend],
        case: Case,
        num_steps: int,
        device: torch.device,
        padding_row: bool = True,
        fill: PoolFill = PoolFill.LOUD,
        padding: PaddingStyle = PaddingStyle.ROWS,
        shape_steps: Callable[[PagedBatch], None] | None = None,
        layers: int = 1,
    ):
        self.num_steps = num_steps
        self.num_real = case.num_reqs
        self.padding_row = padding_row
        # A padding row keeps its length through the loop: one token (seq_len = query_len = 1,
        # block-table row 0) or, vLLM's empty request, none (query and seq_len 0, block-table row -1).
        empty = padding == PaddingStyle.EMPTY_REQUESTS
        self.padding_len = 0 if empty else 1
        self.starts = list(range(case.num_reqs + 1)) + [case.num_reqs + self.padding_len] * padding_row
        rows = case.num_reqs + int(padding_row)
        # Edge data: each draft step's own key dominates, so a length one short (a stale or
        # unadvanced seq_len) or one long (a poisoned slot) fails by far more than the tolerance.
        drafted_case = replace(
            case,
            batch=tuple((context, num_steps) for context, _ in case.batch),
            data="edges" if case.data == "normal" else case.data,
        )
        self.drafted = materialize(drafted_case, device)
        if shape_steps is not None:  # the steps' own data shaped before anything is written or banked
            shape_steps(self.drafted)
        contexts = [context for context, _ in case.batch]
        self.contexts = contexts
        block = case.spec.block_size
        shape = GraphShape(
            num_reqs=rows,
            num_tokens=rows,
            padding_query_len=1,
            max_model_len=-(-(max(contexts) + num_steps) // block) * block,
            uniform=True,
        )
        self.buffers = GraphBuffers(
            backend_cls, shape, [self.drafted.case], device, fill, padding, layers=layers, lse=case.lse
        )
        self.host_lengths = backend_cls.capabilities.needs_cpu_seq_lens
        buffers, drafted, n = self.buffers, self.drafted, self.num_real
        buffers.write_history(drafted)
        self.banks = [DraftBanks(layer, drafted, contexts, num_steps) for layer in buffers.layers]
        self.slot_bank = torch.stack([drafted.slots(r, range(c, c + num_steps)) for r, c in enumerate(contexts)]).to(
            device
        )
        self.context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
        self.step = torch.zeros((), dtype=torch.int64, device=device)

        buffers.query_start_loc.copy_(torch.tensor(self.starts, dtype=torch.int32))
        buffers.seq_lens.fill_(self.padding_len)
        buffers.block_table.fill_(-1 if empty else 0)
        buffers.block_table[:n, : drafted.block_table.shape[1]].copy_(drafted.block_table)
        buffers.slot_mapping.fill_(-1)
        for layer in buffers.layers:  # each draft step copies its real rows in; the padding's stay
            layer.query.copy_(padding_queries(layer.query, layer.query.shape[0]))
            layer.key.fill_(7.0)
            if layer.value is not None:
                layer.value.fill_(-7.0)
        self.advance()

    @property
    def out_bank(self) -> torch.Tensor:
        """Layer 0's outputs, [request, step, H, Dv]."""
        return self.banks[0].out

    def advance(self) -> None:
        """Device-only: lengths, slots and inputs of draft step ``self.step`` (captured as kernels)."""
        buffers, n, step = self.buffers, self.num_real, self.step.view(1)
        buffers.seq_lens[:n].copy_(self.context_lens + self.step.to(torch.int32) + 1)
        buffers.slot_mapping[:n].copy_(self.slot_bank.index_select(1, step).view(n))
        for bank in self.banks:
            bank.advance(step)

    def finish_step(self) -> None:
        for bank in self.banks:
            bank.keep(self.step.view(1))
        self.step.add_(1)

    def restart(self) -> None:
        """Back to draft step 0 with every bank cleared (before the replay that is judged)."""
        self.step.zero_()
        for bank in self.banks:
            bank.clear()

    def common(self, step: int) -> CommonAttentionMetadata:
        """What the host knows at draft step ``step``: every request gained exactly one token."""
        seq_lens = [c + step + 1 for c in self.contexts] + [self.padding_len] * self.padding_row
        buffers = self.buffers
        return CommonAttentionMetadata.from_lengths(
            query_start_loc=buffers.query_start_loc,
            seq_lens=buffers.seq_lens,
            block_table=buffers.block_table,
            slot_mapping=buffers.slot_mapping,
            query_starts=self.starts,
            host_seq_lens=seq_lens,
            lengths_known=self.host_lengths,
        )

    def first_failing_step(self, atol: float, rtol: float) -> tuple[int | None, dict[str, Any]]:
        """The first draft step whose output (of any layer) differs from the oracle, with the
        comparison's metrics and worst element (``layer``: which layer, where there are several)."""
        # Every draft step's rows are in the cache now; a step sees only positions up to its own.
        starts = list(range(self.num_real + 1))
        failures = []
        for bank in self.banks:
            layer = bank.layer
            reference, allowance = oracle(self.buffers.prepared(self.drafted, layer), negated=layer.negated)
            reference = reference.view(self.num_real, self.num_steps, *reference.shape[1:])
            allowance = None if allowance is None else allowance.view_as(reference)
            for step in range(self.num_steps):
                passed, metrics, evidence = bank.answer.compare(
                    bank.out[:, step],
                    reference[:, step],
                    starts,
                    atol,
                    rtol,
                    None if allowance is None else allowance[:, step],
                )
                if not passed:
                    failures.append((step, {**metrics, **evidence, "layer": layer.index}))
                    break
        if not failures:
            return None, {}
        return min(failures, key=lambda failure: failure[0])

    def lse_problem(self) -> str | None:
        """Where the LSE is asked for: every layer's banked LSE against the oracle's (tokens
        numbered request by request, each request's draft steps in order), or None."""
        for bank in self.banks:
            if bank.lse is None:
                continue
            layer = bank.layer
            prepared = self.buffers.prepared(self.drafted, layer)
            problem, _ = judge_lse(prepared, bank.lse.flatten(0, 1), negated=layer.negated)
            if problem:
                return f"layer {layer.index}: {problem}" if len(self.banks) > 1 else problem
        return None


def run_one_graph_loop(loop: DraftLoop, warm: bool = True) -> None:
    """All k steps in one graph; update_for_draft_step runs inside it."""
    backend, buffers = loop.buffers.backend, loop.buffers

    def steps(metadata) -> None:
        for step in range(loop.num_steps):
            loop.advance()
            if step:
                metadata = backend.update_for_draft_step(metadata, loop.common(step))
            buffers.step(metadata)
            loop.finish_step()

    if warm:
        warm_up(lambda: (loop.step.zero_(), steps(backend.build(loop.common(0)))), iterations=1)
    loop.step.zero_()
    loop.advance()
    metadata = backend.build_for_capture(loop.common(0))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps(metadata)
    loop.restart()
    graph.replay()
    torch.cuda.synchronize()


def run_rebuilt_loop(loop: DraftLoop, warm: bool = True) -> None:
    """A captured advance and a captured one-step graph; the host rebuilds metadata between."""
    backend, buffers = loop.buffers.backend, loop.buffers

    def one_step(metadata) -> None:
        buffers.step(metadata)
        loop.finish_step()

    if warm:
        warm_up(lambda: (loop.step.zero_(), loop.advance(), one_step(backend.build(loop.common(0)))), iterations=1)
    loop.step.zero_()
    loop.advance()
    advance_graph, step_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(advance_graph):
        loop.advance()
    metadata = backend.build_for_capture(loop.common(0))
    with torch.cuda.graph(step_graph):
        one_step(metadata)
    loop.restart()
    for step in range(loop.num_steps):
        advance_graph.replay()
        backend.build(loop.common(step))
        step_graph.replay()
    torch.cuda.synchronize()
