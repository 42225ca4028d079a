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

from backends.base import BackendLimits, CommonAttentionMetadata
from conformance.harness.comparison import TOLERANCES, compare_with_oracle, how_far_off
from conformance.harness.lse_pass import lse_allowed
from conformance.harness.step import PreparedCase, write_poison
from conformance.harness.stored_cache import expected_lse, oracle


def rank_positions(seq_len: int, rank: int, world: int) -> list[int]:
    """The global positions of a request's keys that ``rank`` holds, in local order."""
    return list(range(rank, seq_len, world))


def local_seq_len(seq_len: int, rank: int, world: int) -> int:
    """vLLM's ``get_dcp_local_seq_lens`` at interleave size 1: the keys ``rank`` holds."""
    return len(rank_positions(seq_len, rank, world))


def rank_step(prepared: PreparedCase, rank: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rank ``rank``'s forward of ``prepared``'s decode step through a backend instance of its own:
    (output, natural-log LSE, each row's local sequence length). Its pool holds its keys of every
    request, the rest poisoned; the step writes the new tokens it owns."""
    batch, world = prepared.batch, prepared.batch.case.dcp
    spec, device, block_size = batch.spec, batch.device, batch.spec.block_size
    lengths = [local_seq_len(seq_len, rank, world) for seq_len in batch.seq_lens]
    widths = [-(-length // block_size) for length in lengths]
    table = torch.zeros(len(lengths), max(1, *widths), dtype=torch.int32)
    first = 1  # block 0 is reserved
    for request, width in enumerate(widths):
        table[request, :width] = torch.arange(first, first + width, dtype=torch.int32)
        first += width
    empty = [query == 0 for _, query in batch.case.batch]
    table[torch.tensor(empty, dtype=torch.bool)] = -1  # an empty request's row (the contract's)
    limits = BackendLimits(len(lengths), max(1, batch.case.num_tokens), max(1, table.shape[1]) * block_size)
    backend = type(prepared.backend)(spec, limits, device)
    kv_cache = backend.allocate_kv_cache(first)

    def slot(request: int, local: int) -> int:
        return int(table[request, local // block_size]) * block_size + local % block_size

    history, own = [], []  # (request, global position, local slot)
    for request, seq_len in enumerate(batch.seq_lens):
        for local, position in enumerate(rank_positions(seq_len, rank, world)):
            is_new = not empty[request] and position == seq_len - 1
            (own if is_new else history).append((request, position, slot(request, local)))
    kept = torch.tensor([entry[2] for entry in history + own], dtype=torch.int64)
    write_poison(backend, kv_cache, batch, keep=kept, num_blocks=first, fill=prepared.fill, layer=prepared.layer)
    if history:
        key, value = rows(batch, history)
        backend.write_kv(kv_cache, key, value, torch.tensor([s for *_, s in history], device=device), prepared.layer)
    # The step: every decode row's query; its key written where this rank owns it, else slot -1.
    new_slots = {request: s for request, _, s in own}
    decoding = [request for request in range(len(lengths)) if not empty[request]]
    key, value = rows(batch, [(request, batch.seq_lens[request] - 1, 0) for request in decoding])
    slots = torch.tensor([new_slots.get(request, -1) for request in decoding], dtype=torch.int64, device=device)
    starts = [0]
    for is_empty in empty:
        starts.append(starts[-1] + (0 if is_empty else 1))
    common = CommonAttentionMetadata.from_lengths(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=slots,
        query_starts=starts,
        host_seq_lens=lengths,
    )
    metadata = backend.build(common)
    backend.write_kv(kv_cache, key, value, slots, prepared.layer)
    tokens = batch.case.num_tokens
    out = torch.full((tokens, spec.num_heads, spec.v_head_dim), float("nan"), dtype=spec.dtype, device=device)
    lse = torch.full((tokens, spec.num_heads), float("nan"), dtype=torch.float32, device=device)
    backend.forward(batch.query, kv_cache, metadata, out, layer=prepared.forward_layer.with_lse(lse))
    return out, lse, [lengths[request] for request in decoding]


def rows(batch, entries: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The keys (and values) at (request, global position) of ``entries``, stacked."""
    keys = torch.stack([batch.keys[request][position] for request, position, _ in entries])
    if batch.values[0] is None:
        return keys, None
    return keys, torch.stack([batch.values[request][position] for request, position, _ in entries])


def merge(outputs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``cp_lse_ag_out_rs`` (natural log), float64: (merged output, merged LSE)."""
    stacked = torch.stack([lse.double() for lse in lses])  # [R, T, H]
    stacked = torch.where(stacked.isnan() | (stacked == float("inf")), float("-inf"), stacked)
    top = stacked.max(0).values
    top = torch.where(top == float("-inf"), 0.0, top)
    total = torch.exp(stacked - top).sum(0)
    merged_lse = top + torch.log(total)
    merged = torch.zeros_like(outputs[0], dtype=torch.float64)
    for out, lse in zip(outputs, stacked):
        factor = torch.exp(lse - merged_lse)[..., None]
        merged += torch.where(factor == 0, 0.0, out.double() * factor)
    return merged, merged_lse


def dcp_findings(prepared: PreparedCase) -> tuple[str | None, dict[str, Any]]:
    """The step sharded over ``case.dcp`` ranks and merged (module docstring): (what is wrong or
    None, metrics)."""
    batch, world = prepared.batch, prepared.batch.case.dcp
    outputs, lses, empty_rows, unmerged = [], [], 0, None
    for rank in range(world):
        out, lse, lengths = rank_step(prepared, rank)
        outputs.append(out)
        lses.append(lse)
        empty = torch.tensor(lengths, device=out.device) == 0
        empty_rows += int(empty.sum())
        wrong = empty[:, None] & ~((lse == float("-inf")) & (out == 0).all(-1))
        if unmerged is None and wrong.any():
            token, head = (int(index) for index in wrong.nonzero()[0])
            unmerged = (
                f"rank {rank} of {world} holds no key of token {token}'s request, and its row gave LSE "
                f"{float(lse[token, head]):g} and output max |{float(out[token, head].double().abs().max()):g}| at "
                f"head {head} instead of -inf and 0 (the contract's, FlashInfer's DCP tests': a merge other than "
                "vLLM's, which zeroes a rank whose LSE is -inf or NaN, spreads anything else)"
            )
    merged, merged_lse = merge(outputs, lses)
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
