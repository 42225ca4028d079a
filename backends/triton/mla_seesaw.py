"""Warp-specialized Gluon kernel for absorbed MLA on Hopper: two compute warpgroups take turns.

``mla_gluon`` has both warpgroups share every product, so each reads the whole query tile from
shared memory for half of a tile's scores (its wgmma is bound by shared-memory bandwidth, not the
tensor cores), and all eight warps do the softmax while the tensor cores idle. Here tiles
alternate between the warpgroups (FlashMLA's "seesaw"):

* the owner of tile t computes its scores alone (64 rows x 64 keys, the whole 576-wide product)
  and its softmax, while the other warpgroup's products run;
* each warpgroup holds half of the 512-wide output (128 fp32 registers a thread) and applies every
  tile's ``P V`` to its half, its own P and the other's, both through shared memory;
* the running row maximum is handed from one owner to the next through shared memory with the
  tile's P and its rescale factor, so both halves of the output use the same maximum;
* a one-warp partition copies the tiles by TMA into a two-stage ring, refilling a stage when both
  warpgroups have finished their ``P V`` on it.

Shared memory: the query's latent (64 KB), two stages of one 64-position page (144 KB), two P
tiles (16 KB); the query's rope columns stay in registers. A split's partial last tile is copied
whole and its rows past the sequence are zeroed in shared memory by its owner before any product
reads them (0 x NaN = NaN: a zero softmax weight does not cancel a NaN in an unowned slot).
Rows, splits and the partial-result format are ``mla_kernels``'.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from backends.triton.mla_gluon import _cta_barrier, _tile_rows, _tma_load

ROWS = 64
TILE = 64  # positions per tile: one page
WARPS = 4  # per compute warpgroup (the default partition); the second is a worker partition
# Registers a thread: the launch's cap (three warpgroups' worth fit the SM's 64K), then the second
# compute warpgroup's and the copy warp's shares; the default partition gets what is left.
MAX_REGISTERS = 168
WORKER_REGISTERS = (240, 24)

BLOCK_M = gl.constexpr(ROWS)
BLOCK_N = gl.constexpr(TILE)
NUM_WARPS = gl.constexpr(WARPS)
WORKER_REGISTERS_0 = gl.constexpr(WORKER_REGISTERS[0])
WORKER_REGISTERS_1 = gl.constexpr(WORKER_REGISTERS[1])


@gluon.jit
def _copy_partition(
    latent_desc,
    rope_desc,
    latent_stages,
    rope_stages,
    q_latent,
    p_tiles,
    stats,
    bars,
    query_ptr,
    cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    block_entries,
    ints,
    scale_log2,
    PAGE_SIZE: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    HEADS_PER_PROGRAM: gl.constexpr,
    DECODE_Q: gl.constexpr,
    ONE_SPLIT: gl.constexpr,
):
    """One warp: each tile's TMA copies into the ring, a stage refilled once both warpgroups freed it."""
    start, end, num_tiles, partial_start = ints[5], ints[6], ints[7], ints[9]
    has_partial = partial_start < end
    for tile in range(num_tiles):
        stage = tile % 2
        mbarrier.wait(bars.index(2 + stage), ((tile // 2) & 1) ^ 1)  # kv_free: its last readers done
        if has_partial:
            tile_start = gl.where(tile == 0, partial_start, start + (tile - 1) * BLOCK_N)
        else:
            tile_start = start + tile * BLOCK_N
        block = gl.load(block_entries + tile_start // PAGE_SIZE)
        row = block * PAGE_SIZE + tile_start % PAGE_SIZE
        ready = bars.index(stage)
        mbarrier.expect(ready, latent_desc.block_type.nbytes + rope_desc.block_type.nbytes)
        _tma_load(latent_desc, [row, 0], ready, latent_stages.index(stage))
        _tma_load(rope_desc, [row, 0], ready, rope_stages.index(stage))


@gluon.jit
def _compute_partition(
    latent_desc,
    rope_desc,
    latent_stages,
    rope_stages,
    q_latent,
    p_tiles,
    stats,
    bars,
    query_ptr,
    cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    block_entries,
    ints,
    scale_log2,
    WG: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    HEADS_PER_PROGRAM: gl.constexpr,
    DECODE_Q: gl.constexpr,
    ONE_SPLIT: gl.constexpr,
):
    """Warpgroup WG: the scores and softmax of tiles t with t % 2 == WG, every tile's P V on its
    half of the output columns, then its half of the result."""
    query_start, query_len, seq_len, first_head, stride_query_token = ints[0], ints[1], ints[2], ints[3], ints[4]
    start, end, num_tiles, partial_start = ints[5], ints[6], ints[7], ints[9]
    stride_query_head, stride_out_token, stride_out_head = ints[10], ints[11], ints[12]
    request, split, num_splits = ints[13], ints[14], ints[15]
    has_partial = partial_start < end
    dtype: gl.constexpr = q_latent.dtype
    LATENT: gl.constexpr = q_latent.shape[1]
    ROPE: gl.constexpr = rope_stages.shape[2]
    HALF: gl.constexpr = LATENT // 2
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    S_ROWS: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    ZERO_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    m_shared = stats.index(0)

    # The query's rope columns, in registers as the A operand of the rope product.
    _, q_head, q_valid, _ = _tile_rows(query_len, seq_len, first_head, HEADS_PER_PROGRAM, NUM_HEADS, DECODE_Q, S_ROWS)
    q_token = gl.arange(0, BLOCK_M, layout=S_ROWS) // HEADS_PER_PROGRAM
    rope_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, S_LAYOUT))
    q_rows = query_ptr + (query_start + q_token)[:, None] * stride_query_token + q_head[:, None] * stride_query_head
    q_rope = gl.load(q_rows + LATENT + rope_cols[None, :], mask=q_valid[:, None], other=0.0)
    q_rope = gl.convert_layout(q_rope, gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT, k_width=2))
    _, _, s_valid, s_positions = _tile_rows(
        query_len, seq_len, first_head, HEADS_PER_PROGRAM, NUM_HEADS, DECODE_Q, S_ROWS
    )

    zero_scores = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HALF], gl.float32, O_LAYOUT))
    row_max = gl.full([BLOCK_M], float("-inf"), gl.float32, S_ROWS)
    row_sum = gl.zeros([BLOCK_M], gl.float32, S_ROWS)
    for tile in range(num_tiles):
        stage = tile % 2
        phase = (tile // 2) & 1
        if has_partial:
            tile_start = gl.where(tile == 0, partial_start, start + (tile - 1) * BLOCK_N)
        else:
            tile_start = start + tile * BLOCK_N
        latent = latent_stages.index(stage)
        if tile % 2 == WG:  # this warpgroup's tile: scores, softmax, and P for both
            mbarrier.wait(bars.index(stage), phase)  # kv_ready
            if tile_start + BLOCK_N > end:  # the partial tile: zero its rows past the sequence
                positions = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ZERO_LAYOUT))
                for chunk in gl.static_range(LATENT // 64):
                    part = latent.slice(chunk * 64, 64, dim=1)
                    rows = part.load(ZERO_LAYOUT)
                    part.store(gl.where((positions < end)[:, None], rows, gl.zeros_like(rows)))
                fence_async_shared()
                _cta_barrier()
            scores = warpgroup_mma(q_latent, latent.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
            scores = warpgroup_mma(q_rope, rope_stages.index(stage).permute((1, 0)), scores, is_async=True)
            scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))  # (and our previous P V: in order)
            positions = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
            visible = (positions[None, :] <= s_positions[:, None]) & (positions[None, :] < end) & s_valid[:, None]
            scores = gl.where(visible, scores * scale_log2, float("-inf"))
            new_max = gl.maximum(row_max, gl.max(scores, axis=1))
            safe_max = gl.where(new_max == float("-inf"), 0.0, new_max)
            probabilities = gl.exp2(scores - safe_max[:, None])
            rescale = gl.exp2(row_max - safe_max)
            row_max = new_max
            row_sum = row_sum * rescale + gl.sum(probabilities, axis=1)
            # The P tile and the stats go to the other warpgroup once it has read the last ones.
            mbarrier.wait(bars.index(6 + stage), phase ^ 1)  # p_free
            p_tiles.index(stage).store(probabilities.to(dtype))
            m_shared.store(row_max)
            stats.index(1 + stage).store(rescale)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(bars.index(4 + stage), count=1)  # p_ready
        else:  # the other's tile: its P and rescale, and the running maximum after it
            mbarrier.wait(bars.index(4 + stage), phase)  # p_ready
            rescale = stats.index(1 + stage).load(S_ROWS)
            row_max = m_shared.load(S_ROWS)
            row_sum = row_sum * rescale
        out = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if tile > 0:  # the previous tile's P V is done: its stage (and, if not ours, its P) is free
            mbarrier.arrive(bars.index(2 + (tile - 1) % 2), count=1)  # kv_free
            if (tile - 1) % 2 != WG:
                mbarrier.arrive(bars.index(6 + (tile - 1) % 2), count=1)  # p_free
        out = out * gl.convert_layout(rescale, O_ROWS)[:, None]
        acc = warpgroup_mma(p_tiles.index(stage), latent.slice(WG * HALF, HALF, dim=1), out, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    # The two warpgroups' row sums (each over its own tiles, both on the final maximum) added.
    stats.index(3 + WG).store(row_sum)
    _cta_barrier()
    mbarrier.arrive(bars.index(8), count=1)  # sums ready (two arrivals)
    mbarrier.wait(bars.index(8), 0)
    total = stats.index(3).load(O_ROWS) + stats.index(4).load(O_ROWS)
    o_max = gl.convert_layout(row_max, O_ROWS)

    o_token, o_head, o_valid, _ = _tile_rows(
        query_len, seq_len, first_head, HEADS_PER_PROGRAM, NUM_HEADS, DECODE_Q, O_ROWS
    )
    o_cols = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_LAYOUT))
    seen = total > 0
    out = acc / gl.where(seen, total, 1.0)[:, None]
    if ONE_SPLIT:
        rows = out_ptr + (query_start + o_token)[:, None] * stride_out_token + o_head[:, None] * stride_out_head
        gl.store(rows + o_cols[None, :], out.to(out_ptr.dtype.element_ty), mask=o_valid[:, None])
    else:
        slot = ((request * DECODE_Q + o_token) * NUM_HEADS + o_head) * num_splits + split
        gl.store(partial_out_ptr + slot[:, None] * LATENT + o_cols[None, :], out, mask=o_valid[:, None])
        lse = gl.where(seen, o_max + gl.log2(gl.where(seen, total, 1.0)), float("-inf"))
        gl.store(partial_lse_ptr + slot, lse, mask=o_valid & (WG == 0))


@gluon.jit
def _first_warpgroup(
    latent_desc,
    rope_desc,
    latent_stages,
    rope_stages,
    q_latent,
    p_tiles,
    stats,
    bars,
    query_ptr,
    cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    block_entries,
    ints,
    scale_log2,
    PAGE_SIZE: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    HEADS_PER_PROGRAM: gl.constexpr,
    DECODE_Q: gl.constexpr,
    ONE_SPLIT: gl.constexpr,
):
    _compute_partition(
        latent_desc,
        rope_desc,
        latent_stages,
        rope_stages,
        q_latent,
        p_tiles,
        stats,
        bars,
        query_ptr,
        cache_ptr,
        out_ptr,
        partial_out_ptr,
        partial_lse_ptr,
        block_entries,
        ints,
        scale_log2,
        0,
        PAGE_SIZE,
        NUM_HEADS,
        HEADS_PER_PROGRAM,
        DECODE_Q,
        ONE_SPLIT,
    )


@gluon.jit
def _second_warpgroup(
    latent_desc,
    rope_desc,
    latent_stages,
    rope_stages,
    q_latent,
    p_tiles,
    stats,
    bars,
    query_ptr,
    cache_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    block_entries,
    ints,
    scale_log2,
    PAGE_SIZE: gl.constexpr,
    NUM_HEADS: gl.constexpr,
    HEADS_PER_PROGRAM: gl.constexpr,
    DECODE_Q: gl.constexpr,
    ONE_SPLIT: gl.constexpr,
):
    _compute_partition(
        latent_desc,
        rope_desc,
        latent_stages,
        rope_stages,
        q_latent,
        p_tiles,
        stats,
        bars,
        query_ptr,
        cache_ptr,
        out_ptr,
        partial_out_ptr,
        partial_lse_ptr,
        block_entries,
        ints,
        scale_log2,
        1,
        PAGE_SIZE,
        NUM_HEADS,
        HEADS_PER_PROGRAM,
        DECODE_Q,
        ONE_SPLIT,
    )


@gluon.jit(do_not_specialize=["num_reqs", "num_splits", "stride_block_table"])
def mla_seesaw_kernel(
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
    PAGE_SIZE: gl.constexpr,
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
        start = gl.to_tensor(0)  # a value, not a constant: it is passed to the partitions
        end = seq_len
    else:
        per_split = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = gl.minimum(start + per_split, seq_len)
    num_full = (end - start) // BLOCK_N
    partial_start = start + num_full * BLOCK_N
    num_tiles = num_full + (partial_start < end).to(gl.int32)

    dtype: gl.constexpr = query_ptr.dtype.element_ty
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    first_head = head_block * HEADS_PER_PROGRAM
    token, head, row_valid, _ = _tile_rows(
        query_len, seq_len, first_head, HEADS_PER_PROGRAM, NUM_HEADS, DECODE_Q, gl.SliceLayout(1, LOAD)
    )
    query_rows = query_ptr + (query_start + token)[:, None] * stride_query_token + head[:, None] * stride_query_head
    latent_cols = gl.arange(0, LATENT, layout=gl.SliceLayout(0, LOAD))
    q_latent = gl.allocate_shared_memory(
        dtype,
        [BLOCK_M, LATENT],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, LATENT], dtype),
        gl.load(query_rows + latent_cols[None, :], mask=row_valid[:, None], other=0.0),
    )
    latent_stages = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LATENT], latent_desc.layout)
    rope_stages = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], rope_desc.layout)
    p_tiles = gl.allocate_shared_memory(
        dtype, [2, BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    )
    # Rows' stats: 0 the running maximum, 1-2 each P tile's rescale, 3-4 the warpgroups' sums.
    stats = gl.allocate_shared_memory(gl.float32, [5, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # 0-1 kv_ready, 2-3 kv_free (both warpgroups), 4-5 p_ready, 6-7 p_free, 8 sums ready (both).
    bars = gl.allocate_shared_memory(gl.int64, [9, 1], mbarrier.MBarrierLayout())
    for barrier in gl.static_range(2):
        mbarrier.init(bars.index(barrier), count=1)
        mbarrier.init(bars.index(2 + barrier), count=2)
        mbarrier.init(bars.index(4 + barrier), count=1)
        mbarrier.init(bars.index(6 + barrier), count=1)
    mbarrier.init(bars.index(8), count=2)
    fence_async_shared()

    ints = (
        query_start,
        query_len,
        seq_len,
        first_head,
        stride_query_token,
        start,
        end,
        num_tiles,
        num_full,
        partial_start,
        stride_query_head,
        stride_out_token,
        stride_out_head,
        request,
        split,
        num_splits,
    )
    block_entries = block_table_ptr + request * stride_block_table
    # The argument tuples are written out: a tuple built by concatenation turns constexprs into values.
    gl.warp_specialize(
        [
            (
                _first_warpgroup,
                (
                    latent_desc,
                    rope_desc,
                    latent_stages,
                    rope_stages,
                    q_latent,
                    p_tiles,
                    stats,
                    bars,
                    query_ptr,
                    cache_ptr,
                    out_ptr,
                    partial_out_ptr,
                    partial_lse_ptr,
                    block_entries,
                    ints,
                    scale_log2,
                    PAGE_SIZE,
                    NUM_HEADS,
                    HEADS_PER_PROGRAM,
                    DECODE_Q,
                    ONE_SPLIT,
                ),
            ),
            (
                _second_warpgroup,
                (
                    latent_desc,
                    rope_desc,
                    latent_stages,
                    rope_stages,
                    q_latent,
                    p_tiles,
                    stats,
                    bars,
                    query_ptr,
                    cache_ptr,
                    out_ptr,
                    partial_out_ptr,
                    partial_lse_ptr,
                    block_entries,
                    ints,
                    scale_log2,
                    PAGE_SIZE,
                    NUM_HEADS,
                    HEADS_PER_PROGRAM,
                    DECODE_Q,
                    ONE_SPLIT,
                ),
            ),
            (
                _copy_partition,
                (
                    latent_desc,
                    rope_desc,
                    latent_stages,
                    rope_stages,
                    q_latent,
                    p_tiles,
                    stats,
                    bars,
                    query_ptr,
                    cache_ptr,
                    out_ptr,
                    partial_out_ptr,
                    partial_lse_ptr,
                    block_entries,
                    ints,
                    scale_log2,
                    PAGE_SIZE,
                    NUM_HEADS,
                    HEADS_PER_PROGRAM,
                    DECODE_Q,
                    ONE_SPLIT,
                ),
            ),
        ],
        [NUM_WARPS, 1],
        [WORKER_REGISTERS_0, WORKER_REGISTERS_1],
    )
