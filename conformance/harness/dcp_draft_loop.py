"""Decode context parallelism in the draft loop: k decode steps, each request one token longer a
step, sharded over ``case.dcp`` simulated ranks (``harness.dcp``), each rank's steps under a CUDA
graph of its own, every step's merge against the oracle.

A step's new position ``p`` lives on rank ``p % R``: that rank's local length grows by one and it
writes the key; every other rank's length stays and its slot is -1. So each rank's lengths
advance on the device by a pattern of its own, and a rank that held no key of a request may come
to hold one. A backend with ``draft_step_update`` is captured once per rank and replayed k times
after ``update_for_draft_step``; one without is built and captured again each step (as an engine
runs it). Before every replay the step's inputs go into the persistent buffers by device copies.
On a CPU (``graphs=False``) the steps run eagerly, built each step: the same loop, for its tests.

The oracle is the attention of the float keys: a cache in the compute dtype only (an fp8 cache's
DCP steps are numerics'). Each step's rows with no key on their rank must give 0 and -inf.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from backends.base import AttentionBackend, CommonAttentionMetadata
from conformance.cases.grammar import Case
from conformance.harness.batch import PagedBatch, materialize
from conformance.harness.comparison import TOLERANCES, compare_with_oracle, how_far_off
from conformance.harness.dcp import RankShard, keyless_row_problem, local_seq_len, rows
from conformance.harness.step import HandedLayer, case_scales
from conformance.results import Outcome, Verdict
from reference_engine.dcp_attention import merge

DCP_DRAFT_STEPS = 4  # more than any group's first ranks hold of a one-token request


def drafted_batch(case: Case, steps: int, device: torch.device) -> PagedBatch:
    """The case's requests with ``steps`` new tokens each (no DCP: the loop shards it itself)."""
    return materialize(replace(case, dcp=1, batch=tuple((context, steps) for context, _ in case.batch)), device)


class RankLoop:
    """One rank's shard (``dcp.RankShard``: its backend instance and pool, the contexts written)
    and the persistent step buffers over ``drafted``'s steps."""

    def __init__(self, backend_cls: type[AttentionBackend], drafted: PagedBatch, rank: int, world: int) -> None:
        self.drafted, self.rank, self.world = drafted, rank, world
        spec, device = drafted.spec, drafted.device
        self.contexts = [context for context, _ in drafted.case.batch]
        self.steps = drafted.case.batch[0][1]
        handed = HandedLayer.copy_of(case_scales(drafted.case, device), drafted.sinks)
        self.layer = handed.parameters.for_write()
        capacity = [context + self.steps for context in self.contexts]
        self.shard = RankShard(backend_cls, drafted, rank, world, capacity, self.contexts, self.layer)
        self.backend, self.kv_cache = self.shard.backend, self.shard.kv_cache
        # Persistent buffers: what a captured graph reads.
        requests = len(self.contexts)
        key, value = rows(drafted, [(request, context, 0) for request, context in enumerate(self.contexts)])
        self.query = torch.zeros(requests, spec.num_heads, spec.head_dim, dtype=spec.handed_query_dtype, device=device)
        self.key, self.value = torch.zeros_like(key), None if value is None else torch.zeros_like(value)
        self.slots = torch.full((requests,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(requests, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(requests + 1, dtype=torch.int32, device=device)
        self.block_table = self.shard.table.to(device)
        self.out = torch.zeros(requests, spec.num_heads, spec.v_head_dim, dtype=spec.dtype, device=device)
        self.lse = torch.zeros(requests, spec.num_heads, dtype=torch.float32, device=device)
        self.forward_layer = handed.parameters.with_lse(self.lse)

    def lengths(self, step: int) -> list[int]:
        """Each request's keys on this rank once step ``step``'s token is written."""
        return [local_seq_len(context + step + 1, self.rank, self.world) for context in self.contexts]

    def load(self, step: int) -> CommonAttentionMetadata:
        """Step ``step``'s inputs into the persistent buffers (device copies), and its metadata."""
        drafted, starts = self.drafted, self.drafted.query_start_loc
        positions = [context + step for context in self.contexts]
        self.query.copy_(drafted.query[[start + step for start in starts[:-1]]])
        key, value = rows(drafted, [(request, position, 0) for request, position in enumerate(positions)])
        self.key.copy_(key)
        if value is not None:
            self.value.copy_(value)
        owned = [self.shard.owned_slot(request, position) for request, position in enumerate(positions)]
        self.slots.copy_(torch.tensor(owned, dtype=torch.int64))
        lengths = self.lengths(step)
        self.seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        return CommonAttentionMetadata.from_lengths(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            slot_mapping=self.slots,
            query_starts=list(range(len(lengths) + 1)),
            host_seq_lens=lengths,
        )

    def run(self, metadata) -> None:
        self.backend.write_kv(self.kv_cache, self.key, self.value, self.slots, self.layer)
        self.backend.forward(self.query, self.kv_cache, metadata, self.out, layer=self.forward_layer)


def run_rank_steps(loop: RankLoop, graphs: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's (output, LSE) of one rank (the module docstring's modes): a backend with
    ``draft_step_update`` built once and updated each step (one graph, replayed), one without
    built (and captured) each step."""
    results = []
    updates = loop.backend.capabilities.draft_step_update
    graph = metadata = None
    for step in range(loop.steps):
        common = loop.load(step)
        metadata = (
            loop.backend.update_for_draft_step(metadata, common) if updates and step else loop.backend.build(common)
        )
        if graphs and (graph is None or not updates):
            graph = captured(lambda: loop.run(metadata))
        if graphs:
            loop.lse.fill_(float("nan"))  # a replay that does not write the LSE leaves NaN
            graph.replay()
        else:
            loop.run(metadata)
        results.append((loop.out.clone(), loop.lse.clone()))
    return results


def captured(step) -> torch.cuda.CUDAGraph:
    """``step`` warmed up on a side stream, then captured."""
    from conformance.harness.graphs import warm_up  # noqa: PLC0415 - CUDA only

    warm_up(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def run_dcp_draft_loop(
    backend_cls: type[AttentionBackend], case: Case, device: torch.device, graphs: bool = True
) -> Outcome:
    """The DCP draft loop's verdict for ``case`` (a ``dcpN`` decode batch)."""
    world, steps = case.dcp, DCP_DRAFT_STEPS
    drafted = drafted_batch(case, steps, device)
    loops = [RankLoop(backend_cls, drafted, rank, world) for rank in range(world)]
    per_rank = [run_rank_steps(loop, graphs) for loop in loops]
    reference = drafted.reference_output()
    atol, rtol = TOLERANCES[case.spec.dtype]
    updates = backend_cls.capabilities.draft_step_update
    mode = "update_for_draft_step" if updates else "built each step"
    mode += (" and one graph a rank" if updates else " and captured") if graphs else ", eager"
    starts = drafted.query_start_loc[:-1]
    for step in range(steps):
        for rank, loop in enumerate(loops):
            out, lse = per_rank[rank][step]
            problem = keyless_row_problem(out, lse, loop.lengths(step), rank, world)
            if problem:
                return Outcome(Verdict.FAIL, f"DCP draft step {step + 1} of {steps} ({mode}): {problem}")
        merged, _ = merge(
            [per_rank[rank][step][0] for rank in range(world)],
            [per_rank[rank][step][1] for rank in range(world)],
            torch.float64,
        )
        expected = reference[[start + step for start in starts]]
        passed, metrics, _ = compare_with_oracle(merged, expected, list(range(len(starts) + 1)), atol, rtol)
        if not passed:
            return Outcome(
                Verdict.FAIL,
                f"DCP draft step {step + 1} of {steps} ({mode}; each request's new position on its own rank, "
                f"the others' lengths unchanged) merged over {world} ranks differs from the oracle: "
                f"{how_far_off(metrics)}; max abs error {metrics['max_abs_error']:.3g} (atol {atol:g}, rtol {rtol:g})",
                metrics={"dcp_ranks": world, "steps": steps},
            )
    return Outcome(
        Verdict.PASS,
        f"{steps} DCP draft steps over {world} ranks ({mode}): every step's merge equal to the oracle",
        metrics={"dcp_ranks": world, "steps": steps},
    )
