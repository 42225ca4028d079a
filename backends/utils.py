"""Helpers that backends share for cutting a step's batch (vLLM keeps these in
``v1/attention/backends/utils.py``): views, never copies, of one ``CommonAttentionMetadata``."""

from __future__ import annotations

from dataclasses import dataclass

from backends.base import CommonAttentionMetadata


@dataclass(frozen=True)
class DecodePrefillSplit:
    """A decodes-first batch cut in two: requests [0, num_decodes) decode, the rest prefill."""

    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int


def split_decodes_and_prefills(common: CommonAttentionMetadata, decode_threshold: int = 1) -> DecodePrefillSplit:
    """Where the leading requests of at most ``decode_threshold`` query tokens end (engines order
    a step's decodes first). Reads host values only: no sync."""
    query_lens = common.query_lens_cpu.tolist()
    decodes = 0
    while decodes < len(query_lens) and query_lens[decodes] <= decode_threshold:
        decodes += 1
    decode_tokens = int(common.query_start_loc_cpu[decodes])
    return DecodePrefillSplit(
        decodes, len(query_lens) - decodes, decode_tokens, common.num_actual_tokens - decode_tokens
    )


def sub_batch(common: CommonAttentionMetadata, first: int, last: int) -> CommonAttentionMetadata:
    """Requests [first, last) of ``common`` as a batch of their own (device views, no copies, no
    sync): host lengths where ``common`` has them; else none, and the same upper bound; their
    token trees where ``common`` has trees."""
    token_start = int(common.query_start_loc_cpu[first])
    token_end = int(common.query_start_loc_cpu[last])
    known = common.has_host_seq_lens
    trees, host_trees = common.tree_parents, common.tree_parents_cpu
    return CommonAttentionMetadata.from_lengths(
        query_start_loc=common.query_start_loc[first : last + 1] - token_start,
        seq_lens=common.seq_lens[first:last],
        block_table=common.block_table[first:last],
        slot_mapping=common.slot_mapping[token_start:],
        query_starts=(common.query_start_loc_cpu[first : last + 1] - token_start).tolist(),
        host_seq_lens=common.host_seq_lens[first:last].tolist() if known else [common.max_seq_len] * (last - first),
        lengths_known=known,
        max_seq_len=common.max_seq_len,
        tree_parents=None if trees is None else trees[token_start:token_end],
        host_tree_parents=None if host_trees is None else host_trees[token_start:token_end].tolist(),
    )
