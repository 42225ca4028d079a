"""Helpers that backends share for cutting a step's batch (vLLM keeps these in
``v1/attention/backends/utils.py``): views, never copies, of one ``CommonAttentionMetadata``."""
from __future__ import annotations

from backends.base import CommonAttentionMetadata


def leading_decodes(query_lens: list[int]) -> int:
    """How many single-token requests open the batch (the decode part of a decodes-first batch)."""
    count = 0
    while count < len(query_lens) and query_lens[count] == 1:
        count += 1
    return count


def sub_batch(common: CommonAttentionMetadata, first: int, last: int) -> CommonAttentionMetadata:
    """Requests [first, last) of ``common`` as a batch of their own (views, no copies)."""
    token_start = int(common.query_start_loc_cpu[first])
    return CommonAttentionMetadata.from_lengths(
        query_start_loc=common.query_start_loc[first : last + 1] - token_start, seq_lens=common.seq_lens[first:last],
        block_table=common.block_table[first:last], slot_mapping=common.slot_mapping,
        query_starts=(common.query_start_loc_cpu[first : last + 1] - token_start).tolist(),
        host_seq_lens=common.seq_lens_cpu[first:last].tolist(), max_seq_len=common.max_seq_len,
    )
