"""Triton kernel for DeepSeek's sparse MLA (DSA): each query token attends to the positions its
indexer chose (``layer.topk_indices``) and, with a window part, to its most recent positions.

One program per (token, block of heads, split). The token's request and position come from the
step's metadata (``SparseMetadata``, built on the device and advanced by ``update_for_draft_step``);
its index row is read in tiles of ``BLOCK_N`` entries, each entry masked unless
``0 <= i <= position`` and translated to a cache slot through the request's block-table row (the
position → slot translation is the backend's, as the contract says), then the window part's
positions ``position - WINDOW + 1 .. position`` in tiles. Both feed one base-2 online softmax. With
one split the program writes the output and the natural-log LSE itself. A step of few tokens would
leave most SMs idle, so there ``num_splits`` programs share a token's tiles (the index row's, then
the window's, cut into equal runs of whole tiles); each writes its rows normalized, with their
base-2 LSE, into the backend's split scratch, and ``sparse_merge_kernel`` folds them.

The cache is the latent entry in the compute dtype, or in fp8 with the layer's one scale
(``KV_FP8``), or DeepSeek's fp8_ds_mla (``DS_MLA``): each entry a row of bytes, its e4m3 latent
dequantized in the kernel by the float32 scale of its block of ``SCALE_BLOCK`` values, its rope
part read as the compute dtype; gathered by the same index rows and window as the others.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend_tile(
    q_latent,
    q_rope,
    cache_ptr,
    block_row_ptr,
    positions,
    valid,
    k_scale_ptr,
    m_i,
    l_i,
    acc,
    scale_log2,
    stride_cache_block,
    stride_cache_token,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    DS_MLA: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One tile of keys (``positions`` of the token's request, ``valid`` where attended) folded
    into the running max ``m_i``, sum ``l_i`` and accumulator ``acc`` (base 2)."""
    safe = tl.where(valid, positions, 0)
    blocks = tl.load(block_row_ptr + safe // PAGE_SIZE, mask=valid, other=0)
    rows = cache_ptr + blocks.to(tl.int64) * stride_cache_block + (safe % PAGE_SIZE) * stride_cache_token
    latent_dims = tl.arange(0, BLOCK_L)
    rope_dims = tl.arange(0, BLOCK_R)
    latent_mask = valid[:, None] & (latent_dims < LATENT)[None, :]
    rope_mask = valid[:, None] & (rope_dims < ROPE)[None, :]
    if DS_MLA:
        # DeepSeek's fp8_ds_mla entry, a row of bytes: LATENT e4m3 values, a float32 scale per
        # SCALE_BLOCK of them, then the rope part in the compute dtype. Each value is dequantized
        # by its block's scale in float32, then rounded to the compute dtype for the dots.
        # (The tile seen as [BLOCK_N, blocks, SCALE_BLOCK] times each row's scales: of three ways
        # compiled for SM90, this one spilled least, nothing without a window part; a select per
        # block spilled more, a scale gathered per value most.)
        stored = tl.load(rows[:, None] + latent_dims[None, :], mask=latent_mask, other=0)
        values = stored.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        tiles = tl.arange(0, BLOCK_L // SCALE_BLOCK)
        scale_rows = (rows + LATENT).to(tl.pointer_type(tl.float32))
        scales = tl.load(
            scale_rows[:, None] + tiles[None, :],
            mask=valid[:, None] & (tiles < LATENT // SCALE_BLOCK)[None, :],
            other=0.0,
        )
        by_tile = tl.reshape(values, [BLOCK_N, BLOCK_L // SCALE_BLOCK, SCALE_BLOCK]) * scales[:, :, None]
        latent = tl.reshape(by_tile, [BLOCK_N, BLOCK_L]).to(q_latent.dtype)
        rope_rows = (rows + LATENT + 4 * (LATENT // SCALE_BLOCK)).to(tl.pointer_type(q_rope.dtype))
        rope = tl.load(rope_rows[:, None] + rope_dims[None, :], mask=rope_mask, other=0.0)
    else:
        latent = tl.load(rows[:, None] + latent_dims[None, :], mask=latent_mask, other=0.0)
        rope = tl.load(rows[:, None] + LATENT + rope_dims[None, :], mask=rope_mask, other=0.0)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        latent = (latent.to(tl.float32) * k_scale).to(q_latent.dtype)
        rope = (rope.to(tl.float32) * k_scale).to(q_rope.dtype)
    if UPCAST_DOT:  # the interpreter's numpy has no bf16 matmul
        scores = tl.dot(q_latent.to(tl.float32), tl.trans(latent.to(tl.float32)))
        scores += tl.dot(q_rope.to(tl.float32), tl.trans(rope.to(tl.float32)))
    else:
        scores = tl.dot(q_latent, tl.trans(latent)) + tl.dot(q_rope, tl.trans(rope))
    scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp() finite
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, latent.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent)
    return m_new, l_i, acc


@triton.jit
def _attend_part(
    q_latent, q_rope, cache_ptr, block_row_ptr, row_ptr, start, offsets, position, k_scale_ptr, m_i, l_i, acc,
    scale_log2, stride_cache_block, stride_cache_token, LATENT: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
    DS_MLA: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr,
    LENGTH: tl.constexpr, WINDOW_PART: tl.constexpr,
):  # fmt: skip
    """The tile ``start`` entries into a token's part of LENGTH keys: its index row (each entry a
    key unless -1 or past the token) or, WINDOW_PART, its window (positions ``position - LENGTH + 1``
    on)."""
    if WINDOW_PART:
        keys = tl.maximum(position - LENGTH + 1, 0) + start + offsets
        valid = (keys <= position) & (start + offsets < LENGTH)
    else:
        keys = tl.load(row_ptr + start + offsets, mask=start + offsets < LENGTH, other=-1)
        valid = (keys >= 0) & (keys <= position)  # -1, and anything past the token: no key
    return _attend_tile(
        q_latent, q_rope, cache_ptr, block_row_ptr, keys, valid, k_scale_ptr, m_i, l_i, acc, scale_log2,
        stride_cache_block, stride_cache_token, LATENT, ROPE, BLOCK_L, BLOCK_R, PAGE_SIZE, KV_FP8, DS_MLA,
        SCALE_BLOCK, BLOCK_N, UPCAST_DOT,
    )  # fmt: skip


@triton.jit
def sparse_mla_kernel(
    query_ptr,
    cache_ptr,
    block_table_ptr,
    token_request_ptr,
    token_position_ptr,
    num_tokens_ptr,
    indices_ptr,
    out_ptr,
    lse_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    k_scale_ptr,
    scale_log2,
    num_splits,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_indices,
    stride_lse,
    stride_block_table,
    stride_cache_block,
    stride_cache_token,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    TOPK: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    DS_MLA: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
):
    token = tl.program_id(0)
    split = tl.program_id(2)
    if token >= tl.load(num_tokens_ptr):  # a padding row, or a slot past this step's tokens
        return
    request = tl.load(token_request_ptr + token)
    position = tl.load(token_position_ptr + token)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    latent_dims = tl.arange(0, BLOCK_L)
    rope_dims = tl.arange(0, BLOCK_R)
    q_rows = query_ptr + token.to(tl.int64) * stride_q_token + heads[:, None] * stride_q_head
    q_latent = tl.load(
        q_rows + latent_dims[None, :], mask=head_ok[:, None] & (latent_dims < LATENT)[None, :], other=0.0
    )
    q_rope = tl.load(
        q_rows + LATENT + rope_dims[None, :], mask=head_ok[:, None] & (rope_dims < ROPE)[None, :], other=0.0
    )
    block_row_ptr = block_table_ptr + request.to(tl.int64) * stride_block_table
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    row_ptr = indices_ptr + token.to(tl.int64) * stride_indices
    if ONE_SPLIT:
        for start in range(0, TOPK, BLOCK_N):
            m_i, l_i, acc = _attend_part(
                q_latent, q_rope, cache_ptr, block_row_ptr, row_ptr, start, offsets, position, k_scale_ptr, m_i,
                l_i, acc, scale_log2, stride_cache_block, stride_cache_token, LATENT, ROPE, BLOCK_L, BLOCK_R,
                PAGE_SIZE, KV_FP8, DS_MLA, SCALE_BLOCK, BLOCK_N, UPCAST_DOT, TOPK, False,
            )  # fmt: skip
        if WINDOW > 0:
            for start in range(0, WINDOW, BLOCK_N):
                m_i, l_i, acc = _attend_part(
                    q_latent, q_rope, cache_ptr, block_row_ptr, row_ptr, start, offsets, position, k_scale_ptr, m_i,
                    l_i, acc, scale_log2, stride_cache_block, stride_cache_token, LATENT, ROPE, BLOCK_L, BLOCK_R,
                    PAGE_SIZE, KV_FP8, DS_MLA, SCALE_BLOCK, BLOCK_N, UPCAST_DOT, WINDOW, True,
                )  # fmt: skip
    else:
        # The index row's tiles, then the window's, as one run of tiles cut into equal parts.
        index_tiles = tl.cdiv(TOPK, BLOCK_N)
        tiles_per_split = tl.cdiv(index_tiles + tl.cdiv(WINDOW, BLOCK_N), num_splits)
        first_tile = split * tiles_per_split
        end_tile = first_tile + tiles_per_split
        for tile in range(first_tile, tl.minimum(end_tile, index_tiles)):
            m_i, l_i, acc = _attend_part(
                q_latent, q_rope, cache_ptr, block_row_ptr, row_ptr, tile * BLOCK_N, offsets, position,
                k_scale_ptr, m_i, l_i, acc, scale_log2, stride_cache_block, stride_cache_token, LATENT, ROPE,
                BLOCK_L, BLOCK_R, PAGE_SIZE, KV_FP8, DS_MLA, SCALE_BLOCK, BLOCK_N, UPCAST_DOT, TOPK, False,
            )  # fmt: skip
        if WINDOW > 0:
            last_tile = tl.minimum(end_tile, index_tiles + tl.cdiv(WINDOW, BLOCK_N))
            for tile in range(tl.maximum(first_tile, index_tiles), last_tile):
                m_i, l_i, acc = _attend_part(
                    q_latent, q_rope, cache_ptr, block_row_ptr, row_ptr, (tile - index_tiles) * BLOCK_N, offsets,
                    position, k_scale_ptr, m_i, l_i, acc, scale_log2, stride_cache_block, stride_cache_token, LATENT,
                    ROPE, BLOCK_L, BLOCK_R, PAGE_SIZE, KV_FP8, DS_MLA, SCALE_BLOCK, BLOCK_N, UPCAST_DOT, WINDOW, True,
                )  # fmt: skip
    if ONE_SPLIT:
        out = acc / l_i[:, None]
        out_rows = out_ptr + token.to(tl.int64) * stride_out_token + heads[:, None] * stride_out_head
        tl.store(
            out_rows + latent_dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None] & (latent_dims < LATENT)[None, :],
        )
        if RETURN_LSE:
            lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # base 2 to natural
            tl.store(lse_ptr + token.to(tl.int64) * stride_lse + heads, lse, mask=head_ok)
    else:
        # This split's normalized rows and base-2 LSE (-inf and zeros where it saw no key), folded
        # by ``sparse_merge_kernel``: row (token, head, split).
        seen = l_i > 0
        out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        rows = (token.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
        tl.store(
            partial_out_ptr + rows[:, None] * LATENT + latent_dims[None, :],
            out,
            mask=head_ok[:, None] & (latent_dims < LATENT)[None, :],
        )
        tl.store(
            partial_lse_ptr + rows, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")), mask=head_ok
        )


@triton.jit
def sparse_merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    num_tokens_ptr,
    out_ptr,
    num_splits,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LATENT: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """A token's rows from its splits (``sparse_mla_kernel`` with more than one): each split's
    output weighted by 2^(its LSE - the largest). (A row asked for its LSE is never split.)"""
    token = tl.program_id(0)
    if token >= tl.load(num_tokens_ptr):
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    latent_dims = tl.arange(0, BLOCK_L)
    first_row = (token.to(tl.int64) * NUM_HEADS + heads) * num_splits
    top = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for split in range(0, num_splits):
        top = tl.maximum(top, tl.load(partial_lse_ptr + first_row + split, mask=head_ok, other=float("-inf")))
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    mask = head_ok[:, None] & (latent_dims < LATENT)[None, :]
    for split in range(0, num_splits):
        weight = tl.exp2(tl.load(partial_lse_ptr + first_row + split, mask=head_ok, other=float("-inf")) - safe_top)
        part = tl.load(
            partial_out_ptr + (first_row + split)[:, None] * LATENT + latent_dims[None, :], mask=mask, other=0.0
        )
        acc += weight[:, None] * part
        total += weight
    out_rows = out_ptr + token.to(tl.int64) * stride_out_token + heads[:, None] * stride_out_head
    tl.store(out_rows + latent_dims[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sparse_positions_kernel(
    query_start_loc_ptr,
    seq_lens_ptr,
    token_request_ptr,
    token_position_ptr,
    num_tokens_ptr,
    num_reqs,
    BLOCK: tl.constexpr,
):
    """Each token's request and position, from the device's ``query_start_loc`` and ``seq_lens``
    (a program per request and ``BLOCK`` of its tokens; the grid's second dimension covers the
    step's longest query): what ``build`` makes and ``update_for_draft_step`` remakes."""
    request = tl.program_id(0)
    start = tl.load(query_start_loc_ptr + request)
    end = tl.load(query_start_loc_ptr + request + 1)
    context = tl.load(seq_lens_ptr + request) - (end - start)
    tokens = start + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mine = tokens < end
    tl.store(token_request_ptr + tokens, request, mask=mine)
    tl.store(token_position_ptr + tokens, context + tokens - start, mask=mine)
    if (request == num_reqs - 1) & (tl.program_id(1) == 0):
        tl.store(num_tokens_ptr, end)
