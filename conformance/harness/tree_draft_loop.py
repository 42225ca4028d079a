"""Token trees in the draft loop (EAGLE top-k > 1): a tree is drafted level by level, and draft
step ``level`` is a token-tree step over every node of depth <= ``level`` of each request's tree,
as the engine's EAGLE drafts one (``reference_engine.drafters.eagle_tree``): each step extends
every branch, its nodes at their row's slots from the context on and at positions context +
depth. The steps' shapes differ, so each is captured in a graph of its own; before each replay
its inputs go into the persistent buffers by device copies and the backend's ``build`` runs on
the host, as an engine runs the draft steps of a backend without ``draft_step_update``. A
backend that makes a step's masks once (at a capture, or in its first build) and keeps them
attends the next step's nodes with the last one's tree.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from backends import token_tree
from conformance.cases.grammar import Case
from conformance.harness.answers import answer_for
from conformance.harness.batch import PagedBatch, materialize
from conformance.harness.comparison import TOLERANCES
from conformance.harness.graph_batches import GraphShape, other_tree
from conformance.harness.graphs import CaptureFailed, GraphBuffers, capture, step_with_fresh_metadata
from conformance.harness.step import PoolFill
from conformance.harness.stored_cache import oracle
from conformance.results import Outcome, Verdict


def max_depth(case: Case) -> int:
    """The deepest node of a case's trees (a chain request's deepest is its last token): the
    draft loop takes one step more."""
    return max((max(token_tree.depths(parents), default=0) for parents in _parents(case)), default=0)


def grown_case(case: Case, level: int) -> Case:
    """``case`` as draft step ``level`` hands it: each request's nodes of depth <= ``level``, in
    its tree's order (a chain request's first ``level`` + 1 tokens)."""
    return _grown(case, level)[0]


def grown(full: PagedBatch, level: int) -> PagedBatch:
    """``full``'s batch as draft step ``level`` hands it (``grown_case``), at its slots from the
    context on: query, keys and values are ``full``'s own rows for the nodes kept."""
    case, kept = _grown(full.case, level)
    starts, device = full.query_start_loc, full.query.device
    rows, keys, values = [], [], []
    for request, ((context, _), nodes) in enumerate(zip(full.case.batch, kept)):
        rows += [starts[request] + node for node in nodes]
        positions = torch.tensor(list(range(context)) + [context + node for node in nodes], dtype=torch.long)
        keys.append(full.keys[request][positions.to(full.keys[request].device)])
        value = full.values[request]
        values.append(None if value is None else value[positions.to(value.device)])
    index = torch.tensor(rows, dtype=torch.long, device=device)
    return replace(
        full,
        case=case,
        query=full.query.index_select(0, index),
        keys=keys,
        values=values,
        token_inputs={name: tensor.index_select(0, index) for name, tensor in full.token_inputs.items()},
        _reference=None,
    )


def other_trees(batch: PagedBatch) -> PagedBatch:
    """``batch`` with every tree of another shape of the same size (``graph_batches.other_tree``):
    the same tokens, keys and slots."""
    trees = tuple(other_tree(tree) for tree in batch.case.trees)
    return replace(batch, case=replace(batch.case, trees=trees), _reference=None)


def _grown(case: Case, level: int) -> tuple[Case, list[list[int]]]:
    """(the grown case, each request's nodes kept)."""
    batch, trees, kept = [], [], []
    for request, ((context, _), parents) in enumerate(zip(case.batch, _parents(case))):
        nodes = [node for node, depth in enumerate(token_tree.depths(parents)) if depth <= level]
        new_index = {old: new for new, old in enumerate(nodes)}
        chain = not case.trees or case.trees[request] is None
        trees.append(None if chain or not nodes else tuple(new_index.get(parents[node], -1) for node in nodes))
        batch.append((context, len(nodes)))
        kept.append(nodes)
    return replace(case, batch=tuple(batch), trees=tuple(trees)), kept


def _parents(case: Case) -> list[tuple[int, ...]]:
    """Each request's tree, a chain request's as a chain."""
    trees = case.trees or (None,) * case.num_reqs
    return [token_tree.chain(query) if tree is None else tree for (_, query), tree in zip(case.batch, trees)]


def run_tree_draft_loop(backend_cls, case, device: torch.device, graphs: bool = True) -> Outcome:
    """Every draft step of ``case``'s trees (``grown``), each captured in a graph of its own after
    an eager warm-up, then replayed in order, its inputs loaded and ``build`` run before each
    replay; every step against the oracle. ``graphs=False``: each step eager instead (the same
    loads and builds; for a CPU)."""
    full = materialize(case, device)
    steps = [grown(full, level) for level in range(max_depth(case) + 1)]
    block = case.spec.block_size
    shape = GraphShape(
        num_reqs=case.num_reqs,
        num_tokens=case.num_tokens,
        padding_query_len=1,
        max_model_len=-(-case.max_seq_len // block) * block,
        uniform=False,
    )
    buffers = GraphBuffers(backend_cls, shape, [case], device, PoolFill.NAN)
    host = backend_cls.capabilities.needs_cpu_seq_lens
    sizes = [[query for _, query in step.case.batch] for step in steps]
    captured = []
    if graphs:
        for level, step in enumerate(steps):
            step_with_fresh_metadata(buffers, buffers.load(step, with_host_lengths=host).common)
            loaded = buffers.load(step, with_host_lengths=host)
            try:
                captured.append(capture(buffers, buffers.backend.build_for_capture(loaded.common)))
            except CaptureFailed as failure:
                return Outcome(
                    Verdict.FAIL,
                    f"capture of tree draft step {level + 1} of {len(steps)} failed: {failure}",
                    evidence={"capture_events": failure.events},
                )
    atol, rtol = TOLERANCES[case.spec.dtype]
    answer = answer_for(case.spec)
    # Every step with its own trees, then again with other trees of the same sizes: a graph that
    # kept the trees it was captured with is right only for those.
    judged = [(level, step, "") for level, step in enumerate(steps)]
    judged += [(level, other_trees(step), ", replayed with other trees") for level, step in enumerate(steps)]
    for level, step, how in judged:
        loaded = buffers.load(step, with_host_lengths=host)
        metadata = buffers.backend.build(loaded.common)
        buffers.clear_outputs()
        if graphs:
            captured[level].replay()
            torch.cuda.synchronize()
        else:
            buffers.step(metadata)
        reference, allowance = oracle(buffers.prepared(step))
        passed, errors, evidence = answer.compare(
            buffers.out[: loaded.real_tokens], reference, step.query_start_loc, atol, rtol, allowance
        )
        if not passed:
            return Outcome(
                Verdict.FAIL,
                f"tree draft step {level + 1} of {len(steps)}{how} (nodes per request {sizes[level]}) differs from the "
                f"oracle ({answer.count(errors)}, worst at {answer.worst_place(evidence['worst'])}); every step "
                f"before it was right — {'each step its own graph, build before each replay' if graphs else 'eager'}",
                metrics={"tree_draft_steps": len(steps), "first_failing_step": level + 1, **errors},
                evidence={"worst": evidence.get("worst")},
            )
    return Outcome(
        Verdict.PASS,
        f"{len(steps)} tree draft steps, each extending every branch (nodes per request "
        f"{' → '.join(','.join(map(str, size)) for size in sizes)}), "
        f"{'each its own graph, build before each replay' if graphs else 'eager'}, NaN in every unowned slot, "
        "then each again with other trees of its sizes: every step equal to the oracle",
        metrics={"tree_draft_steps": len(steps)},
    )
