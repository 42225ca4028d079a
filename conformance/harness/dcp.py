"""Decode context parallelism (DCP), simulated on one device: a case's decode step sharded over
``case.dcp`` ranks as vLLM shards it, each rank's forward through a backend instance of its own,
the ranks' outputs merged by their log-sum-exps, the merge judged against the oracle.

vLLM interleaves each request's KV over the DCP group token by token (``cp_kv_cache_interleave_size``
1, its default): position ``p`` lives on rank ``p % R`` at local position ``p // R``, and a rank
holds ``get_dcp_local_seq_lens`` of a request's keys. Every rank attends every query head (the
heads are all-gathered first) over its own keys only; the new token's key is written on its own
rank (``slot_mapping`` -1 on the others). A rank may hold no key of a request (a request shorter
than the group): its row's sequence length is 0, and it must give output 0 and LSE -inf (as
FlashInfer's DCP tests ask: vLLM's merge would zero a NaN there, other merges would spread it). The
outputs are merged as ``cp_lse_ag_out_rs`` merges them: natural-log LSEs, a NaN or +inf one taken
as -inf, each rank's output weighted by ``exp(lse_rank - lse_merged)``, a zero weight's output
taken as 0 (so a NaN there does not spread).

Each rank is handed a contiguous query and no padding rows, and a table and pool of its own (no
shared prefix, no pool past 2**31): a case's ``strided``, ``padN``, ``shareN`` and ``bigpool``
layouts are its main pass's. Decode rows only (``Case._check_dcp``): a verify row under DCP needs
each token's causal cut over the rank's keys by global position (vLLM's
``supports_dcp_with_varlen``), which this contract does not hand a backend yet.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.base import AttentionBackend, BackendLimits, CommonAttentionMetadata, LayerParameters
from conformance.harness.batch import PagedBatch
from conformance.harness.comparison import TOLERANCES, compare_with_oracle, how_far_off
from conformance.harness.lse_pass import lse_allowed
from conformance.harness.step import PoolFill, PreparedCase, write_poison
from conformance.harness.stored_cache import expected_lse, oracle
from reference_engine.dcp_attention import merge


def rank_positions(seq_len: int, rank: int, world: int) -> list[int]:
    """The global positions of a request's keys that ``rank`` holds, in local order."""
    return list(range(rank, seq_len, world))


def local_seq_len(seq_len: int, rank: int, world: int) -> int:
    """vLLM's ``get_dcp_local_seq_lens`` at interleave size 1: the keys ``rank`` holds."""
    return len(rank_positions(seq_len, rank, world))


class RankShard:
    """One DCP rank: a backend instance of its own and its pool, each request's keys at the
    positions the rank holds (``rank_positions``) in blocks of its own table (room for ``capacity``
    keys a request, global; an ``empty`` request's row -1, the contract's), every other slot
    poisoned, and the keys before position ``written[request]`` written."""

    def __init__(
        self,
        backend_cls: type[AttentionBackend],
        batch: PagedBatch,
        rank: int,
        world: int,
        capacity: list[int],
        written: list[int],
        layer: LayerParameters,
        fill: PoolFill = PoolFill.LOUD,
        empty: list[bool] | None = None,
    ) -> None:
        self.rank, self.world, self.block_size = rank, world, batch.spec.block_size
        widths = [-(-local_seq_len(length, rank, world) // self.block_size) for length in capacity]
        # One spare column of block 0 (reserved, poisoned), as an engine's table is wider than a
        # request: a read one block past the rank's keys gets poison, not memory outside the table.
        self.table = torch.zeros(len(capacity), max(widths, default=0) + 1, dtype=torch.int32)
        blocks = 1  # block 0 is reserved
        for request, width in enumerate(widths):
            self.table[request, :width] = torch.arange(blocks, blocks + width, dtype=torch.int32)
            blocks += width
        if empty is not None:
            self.table[torch.tensor(empty, dtype=torch.bool)] = -1
        requests = len(capacity)
        limits = BackendLimits(requests, requests, self.table.shape[1] * self.block_size)
        self.backend = backend_cls(batch.spec, limits, batch.device)
        self.kv_cache = self.backend.allocate_kv_cache(blocks)
        history = [
            (request, position, self.slot(request, local))
            for request, end in enumerate(written)
            for local, position in enumerate(rank_positions(end, rank, world))
        ]
        slots = torch.tensor([slot for *_, slot in history], dtype=torch.int64)
        write_poison(self.backend, self.kv_cache, batch, keep=slots, num_blocks=blocks, fill=fill, layer=layer)
        if history:
            key, value = rows(batch, history)
            self.backend.write_kv(self.kv_cache, key, value, slots.to(batch.device), layer)

    def slot(self, request: int, local: int) -> int:
        """The slot of the request's local position ``local`` in this rank's pool."""
        return int(self.table[request, local // self.block_size]) * self.block_size + local % self.block_size

    def owned_slot(self, request: int, position: int) -> int:
        """Where this rank writes the key at global ``position``: its slot, or -1 on another rank."""
        return self.slot(request, position // self.world) if position % self.world == self.rank else -1


def keyless_row_problem(out: torch.Tensor, lse: torch.Tensor, lengths: list[int], rank: int, world: int) -> str | None:
    """What is wrong with the first row that holds no key on this rank (its local length 0) and
    does not give output 0 and LSE -inf; None when every such row does."""
    empty = torch.tensor(lengths, device=out.device) == 0
    wrong = empty[:, None] & ~((lse == float("-inf")) & (out == 0).all(-1))
    if not wrong.any():
        return None
    row, head = (int(index) for index in wrong.nonzero()[0])
    return (
        f"rank {rank} of {world} holds no key of row {row}'s request, and its row gave LSE "
        f"{float(lse[row, head]):g} and output max |{float(out[row, head].double().abs().max()):g}| at head {head} "
        "instead of -inf and 0 (the contract's, FlashInfer's DCP tests': a merge other than vLLM's, which zeroes "
        "a rank whose LSE is -inf or NaN, spreads anything else)"
    )


def rank_step(prepared: PreparedCase, rank: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rank ``rank``'s forward of ``prepared``'s decode step through a backend instance of its own:
    (output, natural-log LSE, each row's local sequence length). Its pool holds its keys of every
    request, the rest poisoned; the step writes the new tokens it owns."""
    batch, world = prepared.batch, prepared.batch.case.dcp
    spec, device = batch.spec, batch.device
    empty = [query == 0 for _, query in batch.case.batch]
    history = [0 if is_empty else seq_len - 1 for seq_len, is_empty in zip(batch.seq_lens, empty)]
    shard = RankShard(
        type(prepared.backend), batch, rank, world, batch.seq_lens, history, prepared.layer, prepared.fill, empty
    )
    # The step: every decode row's query; its key written where this rank owns it, else slot -1.
    decoding = [request for request in range(len(empty)) if not empty[request]]
    key, value = rows(batch, [(request, batch.seq_lens[request] - 1, 0) for request in decoding])
    owned = [shard.owned_slot(request, batch.seq_lens[request] - 1) for request in decoding]
    slots = torch.tensor(owned, dtype=torch.int64, device=device)
    lengths = [local_seq_len(seq_len, rank, world) for seq_len in batch.seq_lens]
    starts = [0]
    for is_empty in empty:
        starts.append(starts[-1] + (0 if is_empty else 1))
    common = CommonAttentionMetadata.from_lengths(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_table=shard.table.to(device),
        slot_mapping=slots,
        query_starts=starts,
        host_seq_lens=lengths,
    )
    metadata = shard.backend.build(common)
    shard.backend.write_kv(shard.kv_cache, key, value, slots, prepared.layer)
    tokens = batch.case.num_tokens
    out = torch.full((tokens, spec.num_heads, spec.v_head_dim), float("nan"), dtype=spec.dtype, device=device)
    lse = torch.full((tokens, spec.num_heads), float("nan"), dtype=torch.float32, device=device)
    shard.backend.forward(batch.query, shard.kv_cache, metadata, out, layer=prepared.forward_layer.with_lse(lse))
    return out, lse, [lengths[request] for request in decoding]


def rows(batch, entries: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The keys (and values) at (request, global position) of ``entries``, stacked."""
    keys = torch.stack([batch.keys[request][position] for request, position, _ in entries])
    if batch.values[0] is None:
        return keys, None
    return keys, torch.stack([batch.values[request][position] for request, position, _ in entries])


def dcp_findings(prepared: PreparedCase) -> tuple[str | None, dict[str, Any]]:
    """The step sharded over ``case.dcp`` ranks and merged (module docstring): (what is wrong or
    None, metrics)."""
    batch, world = prepared.batch, prepared.batch.case.dcp
    outputs, lses, empty_rows, unmerged = [], [], 0, None
    for rank in range(world):
        out, lse, lengths = rank_step(prepared, rank)
        outputs.append(out)
        lses.append(lse)
        empty_rows += lengths.count(0)
        unmerged = unmerged or keyless_row_problem(out, lse, lengths, rank, world)
    merged, merged_lse = merge(outputs, lses, torch.float64)
    reference, allowance = oracle(prepared)
    atol, rtol = TOLERANCES[batch.spec.dtype]
    passed, metrics, _ = compare_with_oracle(merged, reference, batch.query_start_loc, atol, rtol, allowance)
    expected = expected_lse(prepared)
    lse_error = (merged_lse - expected.to(merged_lse.device)).abs()
    lse_bad = ~(lse_error <= lse_allowed(prepared, expected).to(merged_lse.device))
    found = {
        "dcp_ranks": world,
        "dcp_empty_rank_rows": empty_rows,
        "dcp_max_abs_error": metrics["max_abs_error"],
        "dcp_lse_max_abs_error": float(lse_error.nan_to_num(float("inf")).max()),
    }
    where = (
        f"the step sharded over {world} DCP ranks (each request's keys interleaved token by token, {empty_rows} "
        f"rows with no key on their rank) and merged by the ranks' LSEs"
    )
    if unmerged is not None:
        return unmerged, found
    if not passed:
        return (
            f"{where} differs from the oracle: {how_far_off(metrics)}; max abs error {metrics['max_abs_error']:.3g} "
            f"(atol {atol:g}, rtol {rtol:g})"
        ), found
    if lse_bad.any():
        return f"{where}: its merged LSE is off on {int(lse_bad.sum())} of {lse_bad.numel()} (natural log)", found
    return None, found
