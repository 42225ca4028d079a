"""Gluon kernel for absorbed MLA decode and spec-verify on Hopper: the 64-row tiles of ``triton_mla``.

The Triton kernel (``mla_kernels``) leaves the schedule to the compiler, which on this op ran one
block of 8 warps per SM that waited at barriers for a third of its issue slots, with DRAM at a
fifth of its peak (docs/performance.md). Here the schedule is written out:

* The query tile (64 rows x [latent | rope]) is read once into shared memory. Each KV tile (one
  page of BLOCK_N positions) is copied by TMA into a ring of NUM_STAGES shared-memory stages, each
  with an mbarrier that the copy's bytes complete.
* Both warpgroups share each product. Scores ``S = Q K^T`` are split by key columns (each
  warpgroup computes half of the tile's keys); the output ``O += P V`` by latent columns (each
  warpgroup owns half of the 512-wide accumulator, 128 fp32 registers a thread). ``P`` goes
  through shared memory, since each warpgroup needs all of its columns.
* ``P V`` is issued asynchronously and left running into the next iteration, which waits for it
  first: its stage then takes the copy of the tile NUM_STAGES - 1 ahead, started before this
  tile's scores (starting it after them measured 1-2% slower).

A tile's slots past the sequence may hold anything, NaN included, and a zero softmax weight does
not cancel NaN (0 x NaN = NaN). So TMA copies only whole tiles; a split's last, partial tile is
read by masked loads, before the ring starts, while the output accumulator is not yet live.
The rows, splits and the partial-result format are those of ``mla_kernels`` (so the same merge
kernel folds the splits).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Triton 3.6 (the GPU machines') names the TMA load async_copy_global_to_shared; later ones async_load.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# And thread_barrier became barrier.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

ROWS = 64  # rows (tokens x heads) of a program: the M of one wgmma per warpgroup
WARPS = 8  # two warpgroups
# Positions per KV tile and stages in the ring, swept on an H100 (conformance.tuning.tune_triton_mla).
BLOCK_N = 64
NUM_STAGES = 2
# Latent columns per TMA copy, each landing on its own mbarrier so that a tile's scores could start
# on its first columns while the rest are in flight (FlashMLA copies and waits 64 at a time). The
# whole latent in one copy measured fastest here: 64 and 128 columns cost 14% and 4% at 128 heads
# decode (H100, 41cf226), as every copy and every wait adds CTA barriers in Triton's lowering.
LATENT_CHUNK = 512
BLOCK_M = gl.constexpr(ROWS)
NUM_WARPS = gl.constexpr(WARPS)


@gluon.jit
def _issue_tile(
    latent_desc, rope_desc, bars, stage, latent_dst, rope_dst, block_entries, tile_start, PAGE_SIZE: gl.constexpr, pred
):
    """Start the TMA copies of the tile at ``tile_start`` (inside one page) into ring stage
    ``stage``: one per LATENT_CHUNK latent columns, then the rope columns, each on its barrier."""
    CHUNK: gl.constexpr = latent_desc.block_type.shape[1]
    CHUNKS: gl.constexpr = latent_dst.shape[1] // CHUNK
    block = gl.load(block_entries + tile_start // PAGE_SIZE, mask=pred, other=0)
    row = block * PAGE_SIZE + tile_start % PAGE_SIZE
    for chunk in gl.static_range(CHUNKS):
        bar = bars.index(stage * (CHUNKS + 1) + chunk)
        mbarrier.expect(bar, latent_desc.block_type.nbytes, pred=pred)
        _tma_load(latent_desc, [row, chunk * CHUNK], bar, latent_dst.slice(chunk * CHUNK, CHUNK, dim=1), pred=pred)
    bar = bars.index(stage * (CHUNKS + 1) + CHUNKS)
    mbarrier.expect(bar, rope_desc.block_type.nbytes, pred=pred)
    _tma_load(rope_desc, [row, 0], bar, rope_dst, pred=pred)


@gluon.jit
def _scores(q_latent, q_rope, latent_stage, rope_stage, bars, stage, phase, zero_scores, CHUNK: gl.constexpr):
    """``Q K^T`` of a ring stage's tile, each column chunk's product issued as soon as its copy lands."""
    CHUNKS: gl.constexpr = latent_stage.shape[1] // CHUNK
    scores = zero_scores
    for chunk in gl.static_range(CHUNKS):
        mbarrier.wait(bars.index(stage * (CHUNKS + 1) + chunk), phase)
        scores = warpgroup_mma(
            q_latent.slice(chunk * CHUNK, CHUNK, dim=1),
            latent_stage.slice(chunk * CHUNK, CHUNK, dim=1).permute((1, 0)),
            scores,
            use_acc=chunk > 0,
            is_async=True,
        )
    mbarrier.wait(bars.index(stage * (CHUNKS + 1) + CHUNKS), phase)
    scores = warpgroup_mma(q_rope, rope_stage.permute((1, 0)), scores, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(scores,))


@gluon.jit
def _load_masked_tile(
    cache_ptr,
    block_entries,
    stride_cache_block,
    stride_cache_token,
    tile_start,
    end,
    latent_dst,
    rope_dst,
    LATENT: gl.constexpr,
    ROPE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    LOAD: gl.constexpr,
):
    """The partial tile at ``tile_start`` into a stage, zeros at the positions from ``end`` on."""
    positions = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    block = gl.load(block_entries + tile_start // PAGE_SIZE)
    rows = cache_ptr + block.to(gl.int64) * stride_cache_block + (positions % PAGE_SIZE) * stride_cache_token
    in_range = (positions < end)[:, None]
    latent_cols = gl.arange(0, LATENT, layout=gl.SliceLayout(0, LOAD))
    rope_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LOAD))
    latent_dst.store(gl.load(rows[:, None] + latent_cols[None, :], mask=in_range, other=0.0))
    rope_dst.store(gl.load(rows[:, None] + LATENT + rope_cols[None, :], mask=in_range, other=0.0))


@gluon.jit
def _tile_rows(
    query_len, seq_len, first_head, HEADS: gl.constexpr, NUM_HEADS: gl.constexpr, DECODE_Q: gl.constexpr, layout
):
    """Per row of the tile (in ``layout``): token, head, whether it is served, and its position."""
    rows = gl.arange(0, BLOCK_M, layout=layout)
    token = rows // HEADS
    head = first_head + rows % HEADS
    valid = (token < query_len) & (rows < DECODE_Q * HEADS) & (head < NUM_HEADS)
    return token, head, valid, seq_len - query_len + token


@gluon.jit
def _softmax_step(scores, tile_start, end, query_positions, row_valid, row_max, row_sum, scale_log2, BLOCK_N, S_LAYOUT):
    """One tile's base-2 probabilities and the running maximum, sum and output rescale."""
    positions = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    visible = (positions[None, :] <= query_positions[:, None]) & (positions[None, :] < end) & row_valid[:, None]
    scores = gl.where(visible, scores * scale_log2, float("-inf"))
    new_max = gl.maximum(row_max, gl.max(scores, axis=1))
    safe_max = gl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing visible yet
    probabilities = gl.exp2(scores - safe_max[:, None])
    rescale = gl.exp2(row_max - safe_max)
    row_sum = row_sum * rescale + gl.sum(probabilities, axis=1)
    return probabilities, rescale, new_max, row_sum


@gluon.jit(do_not_specialize=["num_reqs", "num_splits", "stride_block_table"])
def mla_gluon_kernel(
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
    NUM_HEADS: gl.constexpr,
    HEADS_PER_PROGRAM: gl.constexpr,
    DECODE_Q: gl.constexpr,
    LATENT: gl.constexpr,
    ROPE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    ONE_SPLIT: gl.constexpr,
):
    head_block = gl.program_id(0)  # grid (head blocks, requests, splits), as mla_decode_split_kernel
    request = gl.program_id(1)
    split = gl.program_id(2)
    if request >= num_reqs:
        return
    query_start = gl.load(query_start_loc_ptr + request)
    query_len = gl.load(query_start_loc_ptr + request + 1) - query_start
    if (query_len == 0) | (query_len > DECODE_Q):  # a padding request, or one for the prefill kernel
        return
    seq_len = gl.load(seq_lens_ptr + request)
    if ONE_SPLIT:
        start = 0
        end = seq_len
    else:
        per_split = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = gl.minimum(start + per_split, seq_len)

    dtype: gl.constexpr = query_ptr.dtype.element_ty
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])  # 16-byte row chunks
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, LATENT // 2, 16]
    )
    S_ROWS: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    first_head = head_block * HEADS_PER_PROGRAM

    # The query tile, once, into shared memory (invalid rows zero).
    token, head, row_valid, _ = _tile_rows(
        query_len, seq_len, first_head, HEADS_PER_PROGRAM, NUM_HEADS, DECODE_Q, gl.SliceLayout(1, LOAD)
    )
    query_rows = query_ptr + (query_start + token)[:, None] * stride_query_token + head[:, None] * stride_query_head
    latent_cols = gl.arange(0, LATENT, layout=gl.SliceLayout(0, LOAD))
    rope_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LOAD))
    q_latent = gl.allocate_shared_memory(
        dtype,
        [BLOCK_M, LATENT],
        latent_desc.layout,
        gl.load(query_rows + latent_cols[None, :], mask=row_valid[:, None], other=0.0),
    )
    q_rope = gl.allocate_shared_memory(
        dtype,
        [BLOCK_M, ROPE],
        rope_desc.layout,
        gl.load(query_rows + LATENT + rope_cols[None, :], mask=row_valid[:, None], other=0.0),
    )
    p_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    )
    latent_stages = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, LATENT], latent_desc.layout)
    rope_stages = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, ROPE], rope_desc.layout)
    CHUNK: gl.constexpr = latent_desc.block_type.shape[1]
    BARRIERS: gl.constexpr = NUM_STAGES * (LATENT // CHUNK + 1)  # per stage: each latent chunk, the rope
    bars = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
    for barrier in gl.static_range(BARRIERS):
        mbarrier.init(bars.index(barrier), count=1)

    _, _, s_valid, s_positions = _tile_rows(
        query_len, seq_len, first_head, HEADS_PER_PROGRAM, NUM_HEADS, DECODE_Q, S_ROWS
    )
    block_entries = block_table_ptr + request * stride_block_table
    num_full = (end - start) // BLOCK_N
    for stage in gl.static_range(NUM_STAGES - 1):  # the ring's first tiles start copying now
        _issue_tile(
            latent_desc,
            rope_desc,
            bars,
            stage,
            latent_stages.index(stage),
            rope_stages.index(stage),
            block_entries,
            start + stage * BLOCK_N,
            PAGE_SIZE,
            stage < num_full,
        )
    fence_async_shared()  # the query and the barriers' init, before the async proxy reads them

    zero_scores = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
    acc = gl.zeros([BLOCK_M, LATENT], gl.float32, O_LAYOUT)
    row_max = gl.full([BLOCK_M], float("-inf"), gl.float32, S_ROWS)
    row_sum = gl.zeros([BLOCK_M], gl.float32, S_ROWS)
    last = NUM_STAGES - 1
    partial_start = start + num_full * BLOCK_N
    if partial_start < end:  # the partial tile, through the last stage before the ring needs it
        _load_masked_tile(
            cache_ptr,
            block_entries,
            stride_cache_block,
            stride_cache_token,
            partial_start,
            end,
            latent_stages.index(last),
            rope_stages.index(last),
            LATENT,
            ROPE,
            BLOCK_N,
            PAGE_SIZE,
            LOAD,
        )
        fence_async_shared()
        _cta_barrier()
        scores = warpgroup_mma(q_latent, latent_stages.index(last).permute((1, 0)), zero_scores, use_acc=False)
        scores = warpgroup_mma(q_rope, rope_stages.index(last).permute((1, 0)), scores)
        probabilities, rescale, row_max, row_sum = _softmax_step(
            scores, partial_start, end, s_positions, s_valid, row_max, row_sum, scale_log2, BLOCK_N, S_LAYOUT
        )
        p_smem.store(probabilities.to(dtype))
        fence_async_shared()
        _cta_barrier()
        acc = warpgroup_mma(p_smem, latent_stages.index(last), acc)
        _cta_barrier()  # every warpgroup is done reading the stage before a copy reuses it
    _issue_tile(
        latent_desc,
        rope_desc,
        bars,
        last,
        latent_stages.index(last),
        rope_stages.index(last),
        block_entries,
        start + last * BLOCK_N,
        PAGE_SIZE,
        last < num_full,
    )

    acc = warpgroup_mma_init(acc)
    for tile in range(num_full):
        ring = tile % NUM_STAGES
        # The previous tile's P V done first: its stage takes the next copy before these scores run.
        out = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        freed = (tile + NUM_STAGES - 1) % NUM_STAGES
        _issue_tile(
            latent_desc,
            rope_desc,
            bars,
            freed,
            latent_stages.index(freed),
            rope_stages.index(freed),
            block_entries,
            start + (tile + NUM_STAGES - 1) * BLOCK_N,
            PAGE_SIZE,
            (tile > 0) & (tile + NUM_STAGES - 1 < num_full),
        )
        scores = _scores(
            q_latent,
            q_rope,
            latent_stages.index(ring),
            rope_stages.index(ring),
            bars,
            ring,
            (tile // NUM_STAGES) & 1,
            zero_scores,
            CHUNK,
        )
        tile_start = start + tile * BLOCK_N
        probabilities, rescale, row_max, row_sum = _softmax_step(
            scores, tile_start, end, s_positions, s_valid, row_max, row_sum, scale_log2, BLOCK_N, S_LAYOUT
        )
        out = out * gl.convert_layout(rescale, O_ROWS)[:, None]
        p_smem.store(probabilities.to(dtype))
        fence_async_shared()
        _cta_barrier()
        acc = warpgroup_mma(p_smem, latent_stages.index(ring), out, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for barrier in gl.static_range(BARRIERS):
        mbarrier.invalidate(bars.index(barrier))

    # The result: with one split the output itself; otherwise the split's normalised rows and
    # base-2 log-sum-exp for merge_splits_kernel (an empty split: -inf, so no weight).
    o_token, o_head, o_valid, _ = _tile_rows(
        query_len, seq_len, first_head, HEADS_PER_PROGRAM, NUM_HEADS, DECODE_Q, O_ROWS
    )
    o_cols = gl.arange(0, LATENT, layout=gl.SliceLayout(0, O_LAYOUT))
    o_sum = gl.convert_layout(row_sum, O_ROWS)
    seen = o_sum > 0
    out = acc / gl.where(seen, o_sum, 1.0)[:, None]
    if ONE_SPLIT:
        rows = out_ptr + (query_start + o_token)[:, None] * stride_out_token + o_head[:, None] * stride_out_head
        gl.store(rows + o_cols[None, :], out.to(out_ptr.dtype.element_ty), mask=o_valid[:, None])
    else:
        partial_row = (request * DECODE_Q + o_token) * NUM_HEADS + o_head
        slot = partial_row * num_splits + split
        gl.store(partial_out_ptr + slot[:, None] * LATENT + o_cols[None, :], out, mask=o_valid[:, None])
        o_max = gl.convert_layout(row_max, O_ROWS)
        lse = gl.where(seen, o_max + gl.log2(gl.where(seen, o_sum, 1.0)), float("-inf"))
        gl.store(partial_lse_ptr + slot, lse, mask=o_valid)


def serves(latent: int, rope: int) -> bool:
    """Widths this kernel serves (the caller has checked that TMA can copy them): the ones it has
    run with on a GPU, DeepSeek's 512 + 64 (the standard suite and ``test_mla_gluon_gpu.py``).
    Their ring fills shared memory: the query and two stages of 64 x 576, and P, 224 KB of 227."""
    return (latent, rope) == (512, 64)


def descriptors(kv_cache: torch.Tensor, latent: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the latent and rope columns of the cache's rows: a box is one tile's
    positions by LATENT_CHUNK latent columns, or by the whole rope."""
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    dtype = gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float16

    def descriptor(cols: torch.Tensor, width: int) -> TensorDescriptor:
        box = [BLOCK_N, width]
        return TensorDescriptor.from_tensor(cols, box, gl.NVMMASharedLayout.get_default_for(box, dtype))

    return descriptor(rows[:, :latent], min(LATENT_CHUNK, latent)), descriptor(
        rows[:, latent:], kv_cache.shape[-1] - latent
    )
