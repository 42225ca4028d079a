"""Triton split-KV kernel for absorbed MLA decode and spec-verify (DeepSeek-style latent cache).

Every head reads the same latent entry per token ([kv_lora_rank | rope_dim]), so one program
serves a block of heads for all of a request's new tokens (rows = tokens x heads) over one KV
split. The head block is the fastest grid dimension: programs that share a request's latent
tiles run together and the tiles come from L2 after the first read. Partial results are merged
by ``kernels.merge_splits_kernel`` (or, with one split, written by the program itself).

A KV tile is read one of three ways (``TILE_READ``, chosen on the host by ``mla_backend``):

* ``GATHER``: pages shorter than a tile; a block-table entry per position, masked loads.
* ``PAGE``: the tile lies in one page; one block-table entry per tile, masked loads.
* ``TMA``: the tile lies in one page and is copied by Hopper's tensor-memory accelerator through
  descriptors over the cache's rows. A copy has no mask, and the slots of a page past the
  sequence may hold anything, NaN included, which a zero softmax weight does not cancel
  (0 x NaN = NaN). So only whole tiles are copied; a split's last, partial tile is read with
  masked loads after the loop.
"""

from __future__ import annotations

import triton
import triton.language as tl

import backends.triton as tile_reads
from backends.triton.kernels import (
    FP16_PRODUCT_SCALE,
    batch_kernel,
    decode_tile,
    fp16_scaling,
    largest_magnitude,
    online_softmax_step,
    split_range,
    store_split_result,
)

GATHER = tl.constexpr(tile_reads.GATHER)
PAGE = tl.constexpr(tile_reads.PAGE)
TMA = tl.constexpr(tile_reads.TMA)


@triton.jit
def _read_tile_masked(
    cache_ptr,
    block_table_ptr,
    request,
    stride_block_table,
    stride_cache_block,
    stride_cache_token,
    tile_start,
    end,
    latent_dims,
    rope_dims,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    ONE_PAGE: tl.constexpr,
):
    """The latent and rope rows of positions [tile_start, tile_start + BLOCK_N), zeros past ``end``."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    in_range = positions < end
    block_entries = block_table_ptr + request * stride_block_table
    if ONE_PAGE:
        blocks = tl.load(block_entries + tile_start // PAGE_SIZE)
    else:
        blocks = tl.load(block_entries + positions // PAGE_SIZE, mask=in_range, other=0)
    entries = cache_ptr + blocks.to(tl.int64) * stride_cache_block + (positions % PAGE_SIZE) * stride_cache_token
    c_latent = tl.load(
        entries[:, None] + latent_dims[None, :], mask=in_range[:, None] & (latent_dims[None, :] < LATENT), other=0.0
    )
    c_rope = tl.load(
        entries[:, None] + LATENT + rope_dims[None, :], mask=in_range[:, None] & (rope_dims[None, :] < ROPE), other=0.0
    )
    return c_latent, c_rope


@triton.jit
def _attend_tile(
    q_latent,
    q_rope,
    c_latent,
    c_rope,
    tile_start,
    end,
    query_positions,
    row_valid,
    acc,
    row_max,
    row_sum,
    scale_log2,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    if KV_FP8:  # exact: every fp8 number is an fp16 number; k_scale is in scale_log2 and the output
        c_latent = c_latent.to(tl.float16)
        c_rope = c_rope.to(tl.float16)
    if UPCAST_DOT:
        c_latent = c_latent.to(tl.float32)
        c_rope = c_rope.to(tl.float32)
    positions = tile_start + tl.arange(0, BLOCK_N)
    scores = (tl.dot(q_latent, tl.trans(c_latent)) + tl.dot(q_rope, tl.trans(c_rope))) * scale_log2
    visible = (positions[None, :] <= query_positions[:, None]) & (positions < end)[None, :] & row_valid[:, None]
    product_scale: tl.constexpr = FP16_PRODUCT_SCALE if KV_FP8 else 1.0
    return online_softmax_step(tl.where(visible, scores, float("-inf")), c_latent, acc, row_max, row_sum, product_scale)


@batch_kernel
def mla_decode_split_kernel(
    query_ptr,
    cache_ptr,
    latent_desc,
    rope_desc,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_reqs,
    num_splits,
    scale_log2,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_block_table,
    stride_cache_block,
    stride_cache_token,
    k_scale_ptr,
    NUM_HEADS: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    DECODE_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_READ: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    head_block, request, split = (
        tl.program_id(0),
        tl.program_id(1),
        tl.program_id(2),
    )  # grid (head blocks, requests, splits)
    query_start, query_len, seq_len, token, head, row_valid, query_positions = decode_tile(
        query_start_loc_ptr,
        seq_lens_ptr,
        request,
        num_reqs,
        head_block * HEADS_PER_PROGRAM,
        HEADS_PER_PROGRAM,
        NUM_HEADS,
        DECODE_Q,
        BLOCK_M,
    )
    if query_len == 0:
        return
    latent_dims = tl.arange(0, BLOCK_L)
    rope_dims = tl.arange(0, BLOCK_R)
    query_rows = query_ptr + (query_start + token)[:, None] * stride_query_token + head[:, None] * stride_query_head
    q_latent = tl.load(
        query_rows + latent_dims[None, :], mask=row_valid[:, None] & (latent_dims[None, :] < LATENT), other=0.0
    )
    q_rope = tl.load(
        query_rows + LATENT + rope_dims[None, :], mask=row_valid[:, None] & (rope_dims[None, :] < ROPE), other=0.0
    )
    if KV_FP8:  # the latent's one scale: on the scores, and (the latent is the value too) on the output
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
        # The products in fp16, each query row scaled into its range (``kernels.fp16_scaling``).
        if q_latent.dtype != tl.float16:
            up, down = fp16_scaling(tl.maximum(largest_magnitude(q_latent), largest_magnitude(q_rope)))
            q_latent = (q_latent.to(tl.float32) * up[:, None]).to(tl.float16)
            q_rope = (q_rope.to(tl.float32) * up[:, None]).to(tl.float16)
            scale_log2 = scale_log2 * down[:, None]  # a column: each row's scale (a scalar elsewhere)
    if UPCAST_DOT:
        q_latent = q_latent.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    start, end = split_range(0, seq_len, split, num_splits, BLOCK_N, ONE_SPLIT)
    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    loop_end = end
    if TILE_READ == TMA:
        loop_end = start + (end - start) // BLOCK_N * BLOCK_N  # whole tiles only (see the module docstring)
    for tile_start in range(start, loop_end, BLOCK_N):
        if TILE_READ == TMA:
            block = tl.load(block_table_ptr + request * stride_block_table + tile_start // PAGE_SIZE)
            row = block * PAGE_SIZE + tile_start % PAGE_SIZE
            c_latent = latent_desc.load([row, 0])
            c_rope = rope_desc.load([row, 0])
        else:
            c_latent, c_rope = _read_tile_masked(
                cache_ptr,
                block_table_ptr,
                request,
                stride_block_table,
                stride_cache_block,
                stride_cache_token,
                tile_start,
                end,
                latent_dims,
                rope_dims,
                LATENT,
                ROPE,
                BLOCK_N,
                PAGE_SIZE,
                TILE_READ == PAGE,
            )
        acc, row_max, row_sum = _attend_tile(
            q_latent,
            q_rope,
            c_latent,
            c_rope,
            tile_start,
            end,
            query_positions,
            row_valid,
            acc,
            row_max,
            row_sum,
            scale_log2,
            BLOCK_N,
            UPCAST_DOT,
            KV_FP8,
        )
    if TILE_READ == TMA:
        if loop_end < end:
            c_latent, c_rope = _read_tile_masked(
                cache_ptr,
                block_table_ptr,
                request,
                stride_block_table,
                stride_cache_block,
                stride_cache_token,
                loop_end,
                end,
                latent_dims,
                rope_dims,
                LATENT,
                ROPE,
                BLOCK_N,
                PAGE_SIZE,
                True,
            )
            acc, row_max, row_sum = _attend_tile(
                q_latent,
                q_rope,
                c_latent,
                c_rope,
                loop_end,
                end,
                query_positions,
                row_valid,
                acc,
                row_max,
                row_sum,
                scale_log2,
                BLOCK_N,
                UPCAST_DOT,
                KV_FP8,
            )
    if KV_FP8:
        acc = acc * (tl.load(k_scale_ptr) / FP16_PRODUCT_SCALE)

    store_split_result(
        acc,
        row_max,
        row_sum,
        partial_out_ptr,
        partial_lse_ptr,
        out_ptr,
        query_start,
        token,
        head,
        request,
        split,
        num_splits,
        latent_dims,
        row_valid,
        stride_out_token,
        stride_out_head,
        NUM_HEADS,
        DECODE_Q,
        LATENT,
        ONE_SPLIT,
    )
