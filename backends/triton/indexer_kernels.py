"""Triton kernels for DeepSeek-V3.2's lightning indexer (``triton_indexer``): each token's logits
``Σ_h w_h · relu(q_h · k_s)`` over its request's index keys, and the write of its top-k row.

``indexer_logits_kernel``: one program per (query row, tile of ``BLOCK_N`` positions). The token's
request and position come from the step's metadata (``SparseMetadata``: made on the device in
``build``, remade by ``update_for_draft_step``); a row past the step's real tokens (the device's
``query_start_loc[num_reqs]``) has no position. Positions ``s <= position`` are read through the
request's block-table row (a tile wholly past the token reads nothing, so an empty request's -1
row is never read: it has no token) and scored by one ``tl.dot`` of all heads against the tile's
keys, fp32 accumulation; fp8 keys are loaded as e4m3, converted to the query's dtype (exact: every
e4m3 number is a bf16 and an fp16 number) and their score multiplied by the token's own float32
scale, read from the 4 bytes after the key. Every position of the row's width gets a logit,
-inf past the token's own position (and for a padding row), so that a top-k over the whole width
(a static shape) chooses only visible positions.

``indexer_topk_write_kernel``: one program per query row: the top-k's indices where their logit
is finite, -1 elsewhere and in the columns past the width (a top-k wider than the block table), and
nothing at all for a row past the step's real tokens.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The width (the block table's columns × page size) and its row stride change with the pool a
# batch runs over, not the kernel: left unspecialized, as the other Triton kernels leave theirs.
_WIDTH_VARYING = ["width", "stride_block_table", "stride_logits"]


@triton.jit(do_not_specialize=_WIDTH_VARYING)
def indexer_logits_kernel(
    query_ptr,
    weights_ptr,
    cache_ptr,
    cache_bytes_ptr,
    block_table_ptr,
    token_request_ptr,
    token_position_ptr,
    num_tokens_ptr,
    logits_ptr,
    width,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_w_token,
    stride_w_head,
    stride_block_table,
    stride_cache_block,
    stride_cache_token,
    stride_logits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KEYS_FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    token = tl.program_id(0)
    start = tl.program_id(1) * BLOCK_N
    positions = start + tl.arange(0, BLOCK_N)
    in_width = positions < width
    logits_row = logits_ptr + token.to(tl.int64) * stride_logits + positions
    position = tl.load(token_position_ptr + token)
    position = tl.where(token < tl.load(num_tokens_ptr), position, -1)  # a padding row sees nothing
    if start > position:  # the whole tile past the token: nothing to read
        tl.store(logits_row, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=in_width)
        return
    request = tl.load(token_request_ptr + token)
    valid = positions <= position  # the token's own request, causal (position < seq_len <= width)
    safe = tl.where(valid, positions, 0)
    blocks = tl.load(
        block_table_ptr + request.to(tl.int64) * stride_block_table + safe // PAGE_SIZE, mask=valid, other=0
    )
    rows = blocks.to(tl.int64) * stride_cache_block + (safe % PAGE_SIZE) * stride_cache_token
    dims = tl.arange(0, BLOCK_D)
    keys = tl.load(
        cache_ptr + rows[:, None] + dims[None, :], mask=valid[:, None] & (dims < HEAD_DIM)[None, :], other=0.0
    )
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    query = tl.load(
        query_ptr + token.to(tl.int64) * stride_q_token + heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
        mask=head_ok[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    weights = tl.load(
        weights_ptr + token.to(tl.int64) * stride_w_token + heads * stride_w_head, mask=head_ok, other=0.0
    )
    if UPCAST_DOT:  # fp32 queries (exact products), and the interpreter's numpy (no bf16 matmul)
        scores = tl.dot(query.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
    else:  # bf16/fp16 products, exact in the fp32 accumulator
        scores = tl.dot(query, tl.trans(keys.to(query.dtype)))
    if KEYS_FP8:
        # The token's float32 scale: the 4 bytes after its key, little-endian (as torch wrote them).
        shifts = tl.arange(0, 4)
        scale_bytes = tl.load(
            cache_bytes_ptr + rows[:, None] + HEAD_DIM + shifts[None, :], mask=valid[:, None], other=0
        )
        bits = tl.sum(scale_bytes.to(tl.uint32) << (8 * shifts[None, :]).to(tl.uint32), axis=1)
        scales = bits.to(tl.float32, bitcast=True)
        scores = scores * tl.where(valid, scales, 0.0)[None, :]
    logits = tl.sum(weights[:, None] * tl.maximum(scores, 0.0), axis=0)  # heads past NUM_HEADS weigh 0
    tl.store(logits_row, tl.where(valid, logits, float("-inf")), mask=in_width)


@triton.jit
def indexer_topk_write_kernel(
    values_ptr,
    indices_ptr,
    num_tokens_ptr,
    out_ptr,
    stride_values,
    stride_indices,
    stride_out,
    stride_out_column,
    CHOSEN: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Row ``program_id`` of ``out`` (int32 ``[rows, TOPK]``): the first ``CHOSEN`` columns from the
    top-k (``values``, ``indices`` ``[rows, CHOSEN]``), -1 where the logit is -inf (no position) and
    in the ``TOPK - CHOSEN`` columns past them; a row past the step's real tokens is not written."""
    token = tl.program_id(0)
    if token >= tl.load(num_tokens_ptr):
        return
    row = token.to(tl.int64)
    for first in range(0, TOPK, BLOCK_K):
        columns = first + tl.arange(0, BLOCK_K)
        chosen = columns < CHOSEN
        values = tl.load(values_ptr + row * stride_values + columns, mask=chosen, other=float("-inf"))
        indices = tl.load(indices_ptr + row * stride_indices + columns, mask=chosen, other=-1)
        entries = tl.where(values > float("-inf"), indices, -1).to(tl.int32)
        tl.store(out_ptr + row * stride_out + columns * stride_out_column, entries, mask=columns < TOPK)
