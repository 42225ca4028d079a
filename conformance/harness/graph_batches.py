"""What a CUDA-graph check captures and what it replays: pure planning, testable on a CPU.

A graph is captured for batch A at a padded shape (A's requests plus one padding row) and
replayed for batches B1..Bn of the same padded shape, each chosen to change a host-visible
quantity a backend might have frozen at capture time: context lengths (so max_seq_len, block
counts and split heuristics change), the number of real requests (more padding rows), the block
table contents, and — where the backend claims any batch — the query lengths; a batch of token
trees keeps each request's tree with it, and one replay hands other trees of the same sizes (a
mask kept from the capture is then stale).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from backends import token_tree
from backends.base import CGSupport
from conformance.cases.grammar import Case


def graph_class_reason(support: CGSupport, case: Case) -> str | None:
    """Why ``case`` is not a batch the claimed graph level covers; None when it is."""
    query_lens = {query for _, query in case.batch}
    if support == CGSupport.NEVER:
        return "claims cuda_graphs=NEVER"
    if support == CGSupport.UNIFORM_SINGLE_TOKEN_DECODE and query_lens != {1}:
        return "not a single-token decode batch (claimed: UNIFORM_SINGLE_TOKEN_DECODE)"
    if support == CGSupport.UNIFORM_BATCH and len(query_lens) != 1:
        return "query lengths differ (claimed: UNIFORM_BATCH)"
    return None


@dataclass(frozen=True)
class GraphShape:
    num_reqs: int  # padded: real requests + padding rows
    num_tokens: int  # padded
    padding_query_len: int  # query length of each padding row
    max_model_len: int
    uniform: bool  # every row, padding included, has the same query length


@dataclass(frozen=True)
class Replay:
    description: str  # what this batch changes, for the report
    case: Case


def _uniform_query_len(case: Case) -> int | None:
    query_lens = {query for _, query in case.batch}
    return query_lens.pop() if len(query_lens) == 1 else None


NO_PADDING = "no padding rows (every row a real request)"


def fits(shape: GraphShape, case: Case) -> bool:
    """Whether ``case`` fills ``shape`` exactly when it needs no padding row."""
    return case.num_reqs < shape.num_reqs or case.num_tokens == shape.num_tokens


def _contexts(batch, new_context) -> tuple[tuple[int, int], ...]:
    """``batch`` with each real request's context replaced by ``new_context(context)``; an empty
    request (0+0) stays empty."""
    return tuple((context, query) if query == 0 else (new_context(context), query) for context, query in batch)


def _requests(case: Case, picked: list[int], extra: tuple[int, int] | None = None) -> Case:
    """``case`` with the requests ``picked`` (by index, in that order), each with its tree, and
    ``extra`` (a chain) after them."""
    batch = tuple(case.batch[r] for r in picked) + ((extra,) if extra else ())
    trees = tuple(case.trees[r] for r in picked) + ((None,) if extra else ()) if case.trees else ()
    return replace(case, batch=batch, trees=trees, tag="")


def other_tree(parents: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """A tree of as many tokens as ``parents`` but another shape: every token the root's child,
    or, for that one, a chain (a request of one or two tokens has no other)."""
    if parents is None:
        return None
    star = (-1,) + (0,) * (len(parents) - 1)
    return star if parents != star else token_tree.chain(len(parents))


def replay_batches(case: Case, support: CGSupport) -> list[Replay]:
    block = case.spec.block_size
    batch = case.batch
    everyone = list(range(len(batch)))
    shared = case.shared_prefix_blocks * block  # a shared prefix must stay whole
    replays = [
        Replay(
            "longer contexts (max_seq_len, block counts and split heuristics change)",
            replace(case, batch=_contexts(batch, lambda context: context * 2 + 3 * block + 5), tag=""),
        ),
        Replay(
            "shorter contexts",
            replace(case, batch=_contexts(batch, lambda context: max(context // 16, shared)), tag=""),
        ),
        Replay("new block-table contents (same lengths, other blocks)", replace(case, seed=case.seed + 1, tag="")),
    ]
    if len(batch) > 1:
        if any(query for _, query in batch[: len(batch) // 2]):  # not only empty requests
            replays.append(
                Replay("fewer real requests, more padding rows", _requests(case, everyone[: len(batch) // 2]))
            )
        replays.append(Replay("requests in reverse order (another request is last)", _requests(case, everyone[::-1])))
    # One more real request than A: the padding row becomes real, so the last row is a request.
    # (In a mixed batch it has one token: A's padded shape has exactly one spare.)
    context, query = batch[-1]
    extra = (max(context * 2 + block + 3, shared), query if _uniform_query_len(case) else 1)
    replays.append(Replay(NO_PADDING, _requests(case, everyone, extra)))
    if support == CGSupport.ALWAYS and _uniform_query_len(case) is None and not case.empty_requests:
        query_lens = [query for _, query in batch][::-1]
        replays.append(
            Replay(
                "query lengths moved between requests",
                replace(
                    case,
                    batch=tuple((c, q) for (c, _), q in zip(batch, query_lens)),
                    trees=case.trees[::-1],  # each tree goes with its length
                    tag="",
                ),
            )
        )
    if case.trees:
        replays.append(
            Replay(
                "other trees of the same sizes (a mask kept from the capture is stale)",
                replace(case, trees=tuple(other_tree(tree) for tree in case.trees), tag=""),
            )
        )
    return [r for r in replays if (r.case.batch, r.case.trees, r.case.seed) != (case.batch, case.trees, case.seed)]


def larger_batch(case: Case) -> Case:
    """A batch the graph never sees: twice the requests (within the backend's 2x limits) at
    longer contexts. Run eagerly after the capture, it makes a backend that sizes a workspace by
    the batch grow it, and the graph must still be right afterwards."""
    block = case.spec.block_size
    grown = _contexts(case.batch, lambda context: context * 2 + block + 1)
    return replace(case, batch=grown + grown, trees=case.trees + case.trees, tag="")


def graph_shape(case: Case, replays: list[Replay], extra: tuple[Case, ...] = ()) -> GraphShape:
    """The padded shape that holds A and every replay; ``extra`` cases (run eagerly, not in the
    graph) only widen max_model_len."""
    cases = [case] + [replay.case for replay in replays]
    uniform_query_len = _uniform_query_len(case)
    padding_query_len = uniform_query_len or 1
    num_reqs = case.num_reqs + 1
    if uniform_query_len is not None:
        num_tokens = num_reqs * uniform_query_len
    else:  # every batch's tokens, plus at least one token for each padding row it needs
        num_tokens = max(c.num_tokens + (num_reqs - c.num_reqs) for c in cases)
    block = case.spec.block_size
    longest = max(max(c.max_seq_len for c in cases + list(extra)), padding_query_len)
    return GraphShape(
        num_reqs, num_tokens, padding_query_len, -(-longest // block) * block, uniform_query_len is not None
    )


def padding_rows(shape: GraphShape, case: Case) -> list[int]:
    """Query lengths of the padding rows that bring ``case`` to the graph's padded shape."""
    rows = shape.num_reqs - case.num_reqs
    if rows == 0:
        return []
    if shape.uniform:
        return [shape.padding_query_len] * rows
    spare = shape.num_tokens - case.num_tokens
    return [1] * (rows - 1) + [spare - (rows - 1)]
